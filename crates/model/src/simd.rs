//! Run-time CPU feature checks shared by the SIMD kernels.
//!
//! Release builds target baseline x86-64 (no `target-cpu=native`), so every AVX2 kernel
//! is a `#[target_feature]` function chosen here at run time, with a scalar path for other
//! CPUs and architectures.

/// Whether the CPU has AVX2, FMA and F16C (every x86-64 CPU since Haswell / Zen 1).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn avx2_fma_f16c() -> bool {
    // `is_x86_feature_detected!` caches its answer: each check is one atomic load.
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Sum of the eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn hsum256(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `eˣ` of eight lanes: Cody–Waite reduction to `r = x - n·ln2` (|r| ≤ ½ln2) and Cephes'
/// degree-7 polynomial, relative error ~1e-7 (libm's `expf` is correctly rounded, so results
/// differ from the scalar path in the last bits). Inputs are clamped to ±87.3/88.3, where
/// the result is ~1e-38 / ~2e38 instead of 0 / ∞.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) fn exp256(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_set1_ps(88.3),
        _mm256_max_ps(_mm256_set1_ps(-87.3), x),
    );
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    // 2ⁿ built in the exponent field (n is in -126..=127 after the clamp).
    let pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}

/// Replaces every `x` by `exp(x - max)` and returns `(max, sum)` (AVX2 when the CPU has it).
pub(crate) fn exp_shifted(xs: &mut [f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma_f16c() {
            // SAFETY: the CPU has the features.
            return unsafe { exp_shifted_avx2(xs) };
        }
    }
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in xs.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    (max, sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_shifted_avx2(xs: &mut [f32]) -> (f32, f32) {
    use std::arch::x86_64::*;
    let (body, tail) = xs.as_chunks_mut::<8>();
    // SAFETY (all loads and stores below): each chunk is eight f32.
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in body.iter() {
        vmax = _mm256_max_ps(vmax, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), vmax) };
    let max = lanes
        .iter()
        .chain(tail.iter())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let (vmax, mut vsum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for c in body.iter_mut() {
        let e = exp256(_mm256_sub_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, vmax));
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), e) };
        vsum = _mm256_add_ps(vsum, e);
    }
    let mut sum = hsum256(vsum);
    for x in tail.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    (max, sum)
}

/// `out = silu(gate) · up` elementwise (AVX2 when the CPU has it).
pub(crate) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma_f16c() {
            // SAFETY: the CPU has the features.
            return unsafe { silu_mul_avx2(gate, up, out) };
        }
    }
    for ((d, g), u) in out.iter_mut().zip(gate).zip(up) {
        *d = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = out.len().min(gate.len()).min(up.len());
    let body = n / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    let neg = _mm256_set1_ps(-0.0);
    for i in (0..body).step_by(8) {
        // SAFETY: i + 8 <= n for all three slices.
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let e = exp256(_mm256_xor_ps(g, neg));
            let y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
        }
    }
    for i in body..n {
        out[i] = gate[i] / (1.0 + (-gate[i]).exp()) * up[i];
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn vector_exp_is_within_a_few_ulp_of_libm() {
        if !avx2_fma_f16c() {
            eprintln!("no AVX2/FMA here: nothing to compare");
            return;
        }
        let xs: Vec<f32> = (0..20_000).map(|i| -87.0 + i as f32 * 0.0087).collect();
        let mut got = [0f32; 8];
        for c in xs.chunks_exact(8) {
            // SAFETY: features checked above; eight values in and out.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_ps(got.as_mut_ptr(), exp256(_mm256_loadu_ps(c.as_ptr())));
            }
            for (g, x) in got.iter().zip(c) {
                let want = x.exp();
                assert!(
                    (g - want).abs() <= 4e-7 * want,
                    "exp({x}) = {g}, libm {want}"
                );
            }
        }
    }

    #[test]
    fn vector_softmax_and_silu_match_scalar_closely() {
        let mut a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.61).sin() * 9.0).collect();
        let max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: Vec<f32> = a.iter().map(|x| (x - max).exp()).collect();
        let (_, sum) = exp_shifted(&mut a);
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-5 * sum);
        for (g, w) in a.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.max(1e-3), "{g} vs {w}");
        }
        let gate: Vec<f32> = (0..29).map(|i| i as f32 - 14.0).collect();
        let up: Vec<f32> = (0..29).map(|i| 0.5 + i as f32 * 0.1).collect();
        let mut out = vec![0f32; 29];
        silu_mul(&gate, &up, &mut out);
        for ((o, g), u) in out.iter().zip(&gate).zip(&up) {
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (o - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "{o} vs {want}"
            );
        }
    }
}
