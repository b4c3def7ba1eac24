//! Q4_1 and Q8_0 weights times f32 activations, with AVX2 kernels, on the rayon pool.
//!
//! candle has no SIMD kernel for Q4_1 on x86, so shipped Q4_1 weights would either run
//! scalar or need requantizing to Q8_0 (twice the bytes to stream per token). Here the
//! activations are quantized to 8 bits per 32-value block (scale `d`, and `s = d·Σq` for
//! the Q4_1 offset term) and each Q4_1 weight block contributes
//! `d_w·d_a·Σ q_w·q_a + m_w·s_a`, the same arithmetic as llama.cpp's `q4_1 × q8_1`; a Q8_0
//! block contributes `d_w·d_a·Σ q_w·q_a`. Decode-sized steps run on rayon (instead of
//! candle's own spinning barrier pool); prefill-sized ones on the [`TakeoverPool`], whose
//! regions do not wait for a thread another process has preempted.

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

pub(crate) use crate::act_block::{ActBlock, QK};
use crate::takeover::{RegionJob, TakeoverPool};

/// Bytes of one Q4_1 block: f16 scale, f16 minimum, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;
/// Bytes of one Q8_0 block: f16 scale, 32 signed bytes.
const Q8_0_BYTES: usize = 34;

/// Block formats with a kernel here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockFormat {
    /// GGML Q4_1.
    Q4_1,
    /// GGML Q8_0.
    Q8_0,
}

impl BlockFormat {
    fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_1 => Q4_1_BYTES,
            BlockFormat::Q8_0 => Q8_0_BYTES,
        }
    }

    /// Bytes of f16 scale (and minimum) before a block's quants.
    fn head_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_1 => 4,
            BlockFormat::Q8_0 => 2,
        }
    }
}

/// Weight rows interleaved per panel.
const PANEL: usize = 8;

/// A `[rows, cols]` quantized matrix, repacked into panels of [`PANEL`] rows: per block
/// column, the panel's 8 scales (f16), for Q4_1 its 8 minimums, then the 8 rows' quants.
/// One vector load then gives 8 rows' scales, and each activation block's 8 integer dot
/// products are reduced into one vector of row sums, scaled and accumulated once.
pub(crate) struct QuantMatrix {
    format: BlockFormat,
    /// Shared with prefill work items, which may outlive a call (see [`crate::takeover`]).
    data: Arc<[u8]>,
    rows: usize,
    cols: usize,
}

impl QuantMatrix {
    /// Repacks raw GGML bytes of a `[rows, cols]` matrix.
    pub fn new(format: BlockFormat, data: Vec<u8>, rows: usize, cols: usize) -> Option<Self> {
        let size = rows * cols / QK * format.block_bytes();
        (cols.is_multiple_of(QK) && data.len() == size).then(|| Self {
            format,
            data: repack(format, &data, rows, cols / QK).into(),
            rows,
            cols,
        })
    }

    /// `x · Wᵀ` for `m` rows of `x`; returns `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let nb = self.cols / QK;
        let acts = quantize_rows(x);
        let panel_bytes = nb * PANEL * self.format.block_bytes();
        // Work items are runs of panels (a few KB, kept in L1) swept against tiles of
        // activation rows, so each weight block is unpacked once per tile, not once per row.
        // Many activation rows: larger items, so the activations (too big for L2 at
        // prefill) are streamed once per 48 weight rows rather than once per 16.
        let per_item = if m > 2 * ACT_ROWS_PER_TILE {
            3 * WEIGHT_ROWS_PER_ITEM
        } else {
            WEIGHT_ROWS_PER_ITEM
        };
        let mut out = vec![0f32; self.rows * m];
        if m >= TAKEOVER_MIN_ROWS {
            // Prefill: long regions, run where a preempted thread cannot hold them up.
            let job = MatmulItems {
                format: self.format,
                weights: Arc::clone(&self.data),
                acts,
                m,
                nb,
                rows: self.rows,
                per_item,
                out: SharedOut(out.as_mut_ptr()),
            };
            TakeoverPool::global().run(Arc::new(job));
            return out;
        }
        // Each item writes its columns `first..first + count` of every row of `[m, rows]`
        // directly (8 contiguous floats per panel and activation row).
        let dst = SharedOut(out.as_mut_ptr());
        let rows = self.rows;
        (0..rows.div_ceil(per_item))
            .into_par_iter()
            .for_each(|item| {
                let first = item * per_item;
                let count = per_item.min(rows - first);
                let w = panels(&self.data, panel_bytes, first, count);
                // SAFETY: only this item writes columns `first..first + count`, and every
                // write is at `i * rows + first + r` with `i < m`, `r < count`.
                unsafe {
                    item_product(
                        self.format,
                        w,
                        count,
                        &acts,
                        m,
                        nb,
                        dst.get().add(first),
                        rows,
                        &|| false,
                    )
                };
            });
        out
    }
}

/// Activation rows from which a matmul runs on the [`TakeoverPool`] (prefill chunks);
/// below, regions are too short to pay for waking its threads.
const TAKEOVER_MIN_ROWS: usize = 64;

/// The panels holding weight rows `first..first + count`.
fn panels(data: &[u8], panel_bytes: usize, first: usize, count: usize) -> &[u8] {
    let n = count.div_ceil(PANEL);
    &data[first / PANEL * panel_bytes..(first / PANEL + n) * panel_bytes]
}

/// One prefill matmul as [`TakeoverPool`] items: item `k` is weight rows
/// `k·per_item..` against every activation row, computed as `[m, count]` in scratch.
struct MatmulItems {
    format: BlockFormat,
    weights: Arc<[u8]>,
    acts: Vec<ActBlock>,
    m: usize,
    nb: usize,
    rows: usize,
    per_item: usize,
    /// `[m, rows]`, written only by `publish`.
    out: SharedOut,
}

// SAFETY: `out` is written only through `publish`, at most once per item and only while
// the pool's `run` waits (the buffer is alive); everything else is owned or shared.
unsafe impl Send for MatmulItems {}

impl MatmulItems {
    fn span(&self, item: usize) -> (usize, usize) {
        let first = item * self.per_item;
        (first, self.per_item.min(self.rows - first))
    }
}

impl RegionJob for MatmulItems {
    fn items(&self) -> usize {
        self.rows.div_ceil(self.per_item)
    }

    fn compute(&self, item: usize, scratch: &mut Vec<f32>, published: &dyn Fn() -> bool) -> bool {
        let (first, count) = self.span(item);
        let need = self.m * count;
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        let panel_bytes = self.nb * PANEL * self.format.block_bytes();
        let w = panels(&self.weights, panel_bytes, first, count);
        // SAFETY: `scratch` holds `m * count` floats, written at `i * count + r`.
        unsafe {
            item_product(
                self.format,
                w,
                count,
                &self.acts,
                self.m,
                self.nb,
                scratch.as_mut_ptr(),
                count,
                published,
            )
        }
    }

    unsafe fn publish(&self, item: usize, scratch: &[f32]) {
        let (first, count) = self.span(item);
        for (i, row) in scratch[..self.m * count].chunks_exact(count).enumerate() {
            // SAFETY (caller): the output is alive and only this call writes these columns.
            std::ptr::copy_nonoverlapping(
                row.as_ptr(),
                self.out.get().add(i * self.rows + first),
                count,
            );
        }
    }
}

/// Interleaves GGML rows into panels of [`PANEL`] rows (the last one padded with zero
/// blocks, whose products are zero and never read).
fn repack(format: BlockFormat, data: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let bb = format.block_bytes();
    let head = format.head_bytes();
    let body = bb - head;
    let mut out = vec![0u8; rows.div_ceil(PANEL) * nb * PANEL * bb];
    for r in 0..rows {
        let (panel, lane) = (r / PANEL, r % PANEL);
        for b in 0..nb {
            let src = &data[(r * nb + b) * bb..(r * nb + b + 1) * bb];
            let dst = &mut out[(panel * nb + b) * PANEL * bb..(panel * nb + b + 1) * PANEL * bb];
            // Scales, then (Q4_1) minimums, each 8 f16; then 8 rows of quants.
            for k in 0..head / 2 {
                dst[k * 2 * PANEL + lane * 2..k * 2 * PANEL + lane * 2 + 2]
                    .copy_from_slice(&src[k * 2..k * 2 + 2]);
            }
            let q = PANEL * head + lane * body;
            dst[q..q + body].copy_from_slice(&src[head..]);
        }
    }
    out
}

/// The output buffer, written by parallel items at disjoint positions.
struct SharedOut(*mut f32);

// SAFETY: items write disjoint elements, and the buffer outlives the parallel loop.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The base pointer (a method, so closures capture the `Sync` wrapper, not the field).
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Weight rows per parallel work item (two panels).
const WEIGHT_ROWS_PER_ITEM: usize = 2 * PANEL;
/// Activation rows multiplied together against one unpacked weight block.
const ACT_ROWS_PER_TILE: usize = 4;

/// `out[i * stride + r] = w_r · act_i` for the `count` weight rows of one work item (`w`
/// holds their panels). Every product is computed the same way whatever `m` and the tile
/// it falls in, so a row's result does not depend on the batch. Gives up, returning
/// `false`, once `published()` says another thread delivered the item.
///
/// # Safety
/// `out` is valid for writes at `i * stride + r` for every `i < m`, `r < count`.
#[allow(clippy::too_many_arguments)]
unsafe fn item_product(
    format: BlockFormat,
    w: &[u8],
    count: usize,
    acts: &[ActBlock],
    m: usize,
    nb: usize,
    out: *mut f32,
    stride: usize,
    published: &dyn Fn() -> bool,
) -> bool {
    let panel_bytes = nb * PANEL * format.block_bytes();
    let mut i = 0;
    while i < m {
        if published() {
            return false;
        }
        let tile = (m - i).min(ACT_ROWS_PER_TILE);
        let a = &acts[i * nb..(i + tile) * nb];
        for (p, panel) in w.chunks_exact(panel_bytes).enumerate() {
            let res = panel_product(format, panel, a, tile, nb);
            let lanes = (count - p * PANEL).min(PANEL);
            for (g, row) in res[..tile].iter().enumerate() {
                let at = out.add((i + g) * stride + p * PANEL);
                std::ptr::copy_nonoverlapping(row.as_ptr(), at, lanes);
            }
        }
        i += tile;
    }
    true
}

/// Products of one panel's 8 rows with `tile` (≤ 4) activation rows: `[act][row]`.
fn panel_product(
    format: BlockFormat,
    panel: &[u8],
    acts: &[ActBlock],
    tile: usize,
    nb: usize,
) -> [[f32; PANEL]; ACT_ROWS_PER_TILE] {
    debug_assert!(panel.len() == nb * PANEL * format.block_bytes() && acts.len() == tile * nb);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx2_fma_f16c() {
            use crate::quant_kernels::panel_avx2;
            let mut out = [[0f32; PANEL]; ACT_ROWS_PER_TILE];
            let q8 = format == BlockFormat::Q8_0;
            // SAFETY: the CPU has the features; `panel` holds `nb` panel blocks and `acts`
            // `tile` rows of `nb` blocks (checked above).
            unsafe {
                let p = panel.as_ptr();
                match (q8, tile) {
                    (false, 4) => out[..4].copy_from_slice(&panel_avx2::<false, 4>(p, acts, nb)),
                    (false, 3) => out[..3].copy_from_slice(&panel_avx2::<false, 3>(p, acts, nb)),
                    (false, 2) => out[..2].copy_from_slice(&panel_avx2::<false, 2>(p, acts, nb)),
                    (false, _) => out[..1].copy_from_slice(&panel_avx2::<false, 1>(p, acts, nb)),
                    (true, 4) => out[..4].copy_from_slice(&panel_avx2::<true, 4>(p, acts, nb)),
                    (true, 3) => out[..3].copy_from_slice(&panel_avx2::<true, 3>(p, acts, nb)),
                    (true, 2) => out[..2].copy_from_slice(&panel_avx2::<true, 2>(p, acts, nb)),
                    (true, _) => out[..1].copy_from_slice(&panel_avx2::<true, 1>(p, acts, nb)),
                }
            }
            return out;
        }
    }
    panel_scalar(format, panel, acts, tile, nb)
}

/// The panel product without SIMD, with the same operations per product: per block the
/// exact integer dot product, times `d_w·d_a` fused-added into the sum; `m_w·s_a`
/// fused-added into a second sum (Q4_1); the two sums added at the end.
fn panel_scalar(
    format: BlockFormat,
    panel: &[u8],
    acts: &[ActBlock],
    tile: usize,
    nb: usize,
) -> [[f32; PANEL]; ACT_ROWS_PER_TILE] {
    let bb = format.block_bytes();
    let (head, body) = (format.head_bytes(), bb - format.head_bytes());
    let half = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut out = [[0f32; PANEL]; ACT_ROWS_PER_TILE];
    for (g, out) in out[..tile].iter_mut().enumerate() {
        for (lane, out) in out.iter_mut().enumerate() {
            let (mut acc, mut offs) = (0f32, 0f32);
            for b in 0..nb {
                let pb = &panel[b * PANEL * bb..(b + 1) * PANEL * bb];
                let a = &acts[g * nb + b];
                let q = &pb[PANEL * head + lane * body..PANEL * head + (lane + 1) * body];
                let isum: i32 = match format {
                    BlockFormat::Q4_1 => (0..QK / 2)
                        .map(|j| {
                            (q[j] & 0x0F) as i32 * a.qs[j] as i32
                                + (q[j] >> 4) as i32 * a.qs[j + QK / 2] as i32
                        })
                        .sum(),
                    BlockFormat::Q8_0 => q
                        .iter()
                        .zip(&a.qs)
                        .map(|(&w, &x)| w as i8 as i32 * x as i32)
                        .sum(),
                };
                acc = (isum as f32).mul_add(half(pb, lane * 2) * a.d, acc);
                if format == BlockFormat::Q4_1 {
                    offs = half(pb, 2 * PANEL + lane * 2).mul_add(a.s, offs);
                }
            }
            *out = acc + offs;
        }
    }
    out
}

/// Activation blocks quantized per thread above this many.
const PARALLEL_QUANTIZE_BLOCKS: usize = 1024;

/// Quantizes every 32-value block of `x` (rows are whole numbers of blocks).
fn quantize_rows(x: &[f32]) -> Vec<ActBlock> {
    let zero = ActBlock {
        qs: [0; QK],
        d: 0.0,
        s: 0.0,
    };
    let mut acts = vec![zero; x.len() / QK];
    let body = |(dst, src): (&mut [ActBlock], &[f32])| quantize_into(src, dst);
    if acts.len() >= PARALLEL_QUANTIZE_BLOCKS {
        let per = PARALLEL_QUANTIZE_BLOCKS / 4;
        acts.par_chunks_mut(per)
            .zip(x.par_chunks(per * QK))
            .for_each(body);
    } else {
        body((&mut acts, x));
    }
    acts
}

fn quantize_into(src: &[f32], dst: &mut [ActBlock]) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx2_fma_f16c() {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(QK)) {
                // SAFETY: the CPU has the features; `s` is one whole block.
                *d = unsafe { quantize_block_avx2(s) };
            }
            return;
        }
    }
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(QK)) {
        *d = quantize_block(s);
    }
}

/// [`quantize_block`] with AVX2, bit for bit: the same maximum, scale and products, and
/// the same round-half-away-from-zero (`trunc(v + copysign(0.5⁻, v))`, which is how LLVM
/// lowers `f32::round` where it inlines it; a baseline x86-64 build calls `roundf` instead).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block_avx2(x: &[f32]) -> ActBlock {
    use std::arch::x86_64::*;
    debug_assert_eq!(x.len(), QK);
    let p = x.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_andnot_ps(sign, v[0]);
    for vi in &v[1..] {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let inv = _mm256_set1_ps(inv);
    let below_half = _mm256_set1_ps(f32::from_bits(0.5f32.to_bits() - 1));
    let mut q = [_mm256_setzero_si256(); 4];
    for (q, vi) in q.iter_mut().zip(v) {
        let scaled = _mm256_mul_ps(vi, inv);
        let bias = _mm256_or_ps(below_half, _mm256_and_ps(sign, scaled));
        // Truncating conversion of the biased value: the rounding step.
        *q = _mm256_cvttps_epi32(_mm256_add_ps(scaled, bias));
    }
    let total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let total = _mm_add_epi32(
        _mm256_castsi256_si128(total),
        _mm256_extracti128_si256(total, 1),
    );
    let total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0b01_00_11_10));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(
        total,
        _mm_shuffle_epi32(total, 0b10_11_00_01),
    ));
    // Pack to bytes; the packs work within 128-bit lanes, the permute restores the order.
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut out = ActBlock {
        qs: [0; QK],
        d,
        s: d * sum as f32,
    };
    _mm256_storeu_si256(out.qs.as_mut_ptr() as *mut __m256i, w);
    out
}

fn quantize_block(x: &[f32]) -> ActBlock {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    let mut sum = 0i32;
    for (q, v) in qs.iter_mut().zip(x) {
        *q = (v * inv).round() as i8;
        sum += *q as i32;
    }
    ActBlock {
        qs,
        d,
        s: d * sum as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dequantize(format: BlockFormat, w: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for wb in w.chunks_exact(format.block_bytes()) {
            match format {
                BlockFormat::Q4_1 => {
                    let half = |at: usize| f16::from_le_bytes([wb[at], wb[at + 1]]).to_f32();
                    let (d, m) = (half(0), half(2));
                    let mut block = [0f32; QK];
                    for j in 0..QK / 2 {
                        block[j] = (wb[4 + j] & 0x0F) as f32 * d + m;
                        block[j + QK / 2] = (wb[4 + j] >> 4) as f32 * d + m;
                    }
                    out.extend_from_slice(&block);
                }
                BlockFormat::Q8_0 => {
                    let d = f16::from_le_bytes([wb[0], wb[1]]).to_f32();
                    out.extend(wb[2..].iter().map(|&q| q as i8 as f32 * d));
                }
            }
        }
        out
    }

    fn matrix(format: BlockFormat, rows: usize, cols: usize) -> Vec<u8> {
        let mut data = Vec::new();
        for b in 0..rows * cols / QK {
            data.extend_from_slice(&f16::from_f32(0.01 + b as f32 * 1e-4).to_le_bytes());
            let body = match format {
                BlockFormat::Q4_1 => {
                    data.extend_from_slice(&f16::from_f32(-0.07).to_le_bytes());
                    16
                }
                BlockFormat::Q8_0 => 32,
            };
            data.extend((0..body).map(|j| ((b * 7 + j * 13) % 256) as u8));
        }
        data
    }

    #[test]
    fn simd_quantization_equals_scalar_bit_for_bit() {
        // Ties (±k.5 after scaling), zeros, the maximum itself and ordinary values.
        let mut blocks: Vec<Vec<f32>> = vec![vec![0.0; QK]];
        let mut ties: Vec<f32> = (0..QK).map(|i| i as f32 - 16.0 + 0.5).collect();
        (ties[0], ties[1]) = (127.0, -126.5);
        blocks.push(ties);
        blocks.push(
            (0..QK)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.731)
                .collect(),
        );
        blocks.push((0..QK).map(|i| (i as f32 * 0.77).sin() * 1e-3).collect());
        #[cfg(target_arch = "x86_64")]
        for b in &blocks {
            if !crate::simd::avx2_fma_f16c() {
                eprintln!("no AVX2/FMA/F16C here: nothing to compare");
                return;
            }
            let scalar = quantize_block(b);
            // SAFETY: features checked above; `b` is one block.
            let got = unsafe { quantize_block_avx2(b) };
            assert_eq!(got.qs, scalar.qs, "{b:?}");
            assert_eq!(got.d.to_bits(), scalar.d.to_bits());
            assert_eq!(got.s.to_bits(), scalar.s.to_bits());
        }
    }

    #[test]
    fn matmul_matches_dequantized_weights() {
        // 1, 7 and 8 activation rows: single rows, a tile of four plus a tile of three,
        // two tiles; 37 weight rows: work items of 16, 16 and 5 rows (a padded panel).
        for m in [1, 7, 8] {
            check_matmul(m, 37);
        }
        // A prefill-sized step, on the takeover pool: items of 48, 48 and 5 rows.
        check_matmul(70, 101);
    }

    fn check_matmul(m: usize, rows: usize) {
        let cols = 96;
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.1)
            .collect();
        let acts: Vec<ActBlock> = x.chunks_exact(QK).map(quantize_block).collect();
        let nb = cols / QK;
        for format in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let data = matrix(format, rows, cols);
            let w = dequantize(format, &data);
            let matrix = QuantMatrix::new(format, data.clone(), rows, cols).unwrap();
            let got = matrix.matmul(&x, m);
            let alone: Vec<Vec<f32>> = x.chunks_exact(cols).map(|r| matrix.matmul(r, 1)).collect();
            let panel_bytes = nb * PANEL * format.block_bytes();
            for i in 0..m {
                for j in 0..rows {
                    let exact: f32 = (0..cols).map(|k| x[i * cols + k] * w[j * cols + k]).sum();
                    // 8-bit activations: error bounded by a fraction of Σ|x·w|.
                    let scale: f32 = (0..cols)
                        .map(|k| (x[i * cols + k] * w[j * cols + k]).abs())
                        .sum();
                    let g = got[i * rows + j];
                    assert!(
                        (g - exact).abs() <= 0.01 * scale,
                        "{format:?} {i},{j}: {g} vs {exact}"
                    );
                    // The SIMD path does exactly the scalar path's arithmetic.
                    let panel =
                        &matrix.data[j / PANEL * panel_bytes..(j / PANEL + 1) * panel_bytes];
                    let a = &acts[i * nb..(i + 1) * nb];
                    let scalar = panel_scalar(format, panel, a, 1, nb)[0][j % PANEL];
                    assert_eq!(
                        g.to_bits(),
                        scalar.to_bits(),
                        "{format:?}: simd {g} vs scalar {scalar}"
                    );
                    // A row's result does not depend on how many rows share the step.
                    assert_eq!(
                        g.to_bits(),
                        alone[i][j].to_bits(),
                        "{format:?} row {i} batched vs alone"
                    );
                }
            }
        }
    }
}
