//! Thread-count control for candle's compute pools.

/// Sets how many threads the forward pass uses (candle's matmul pool, the rayon pool
/// its GEMM, our attention and decode matmuls run on, and the prefill matmuls' takeover
/// pool, sized from rayon's). The pools spin-wait briefly between tasks, so two engines
/// sharing cores must each get their own share.
///
/// Must be called before the first model is loaded or run: the pools are created once per
/// process. Returns `false` if the rayon pool already existed (the count then stays as it was).
pub fn set_threads(n: usize) -> bool {
    let n = n.max(1);
    // candle reads these once, when its pools are first used.
    std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .is_ok()
}
