//! Q4_1 and Q8_0 weights times f32 activations, with AVX2 kernels, on the rayon pool.
//!
//! candle has no SIMD kernel for Q4_1 on x86, so shipped Q4_1 weights would either run
//! scalar or need requantizing to Q8_0 (twice the bytes to stream per token). Here the
//! activations are quantized to 8 bits per 32-value block (scale `d`, and `s = d·Σq` for
//! the Q4_1 offset term) and each Q4_1 weight block contributes
//! `d_w·d_a·Σ q_w·q_a + m_w·s_a`, the same arithmetic as llama.cpp's `q4_1 × q8_1`; a Q8_0
//! block contributes `d_w·d_a·Σ q_w·q_a`. Keeping these on rayon (instead of candle's own
//! spinning barrier pool) leaves one set of worker threads per process.

use half::f16;
use rayon::prelude::*;

/// Values per quantized block.
const QK: usize = 32;
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
}

/// One block of 8-bit activations.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct ActBlock {
    qs: [i8; QK],
    d: f32,
    s: f32,
}

/// A `[rows, cols]` quantized matrix in GGML block layout.
pub(crate) struct QuantMatrix {
    format: BlockFormat,
    data: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl QuantMatrix {
    /// Wraps raw GGML bytes of a `[rows, cols]` matrix.
    pub fn new(format: BlockFormat, data: Vec<u8>, rows: usize, cols: usize) -> Option<Self> {
        let size = rows * cols / QK * format.block_bytes();
        (cols.is_multiple_of(QK) && data.len() == size).then_some(Self {
            format,
            data,
            rows,
            cols,
        })
    }

    /// `x · Wᵀ` for `m` rows of `x`; returns `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let nb = self.cols / QK;
        let acts = quantize_rows(x);
        let row_bytes = nb * self.format.block_bytes();
        // Work items are runs of weight rows (a few KB, kept in L1) swept against tiles of
        // activation rows, so each weight block is unpacked once per tile, not once per row.
        let per_item = WEIGHT_ROWS_PER_ITEM;
        let weights =
            |first: usize, count: usize| &self.data[first * row_bytes..(first + count) * row_bytes];
        if m == 1 {
            let mut out = vec![0f32; self.rows];
            out.par_chunks_mut(per_item)
                .enumerate()
                .for_each(|(item, out)| {
                    let (first, count) = (item * per_item, out.len());
                    let w = weights(first, count);
                    item_product(self.format, w, count, row_bytes, &acts, 1, nb, out);
                });
            return out;
        }
        // Each item computes its weight rows × all activation rows into a small buffer,
        // then copies it into its columns of `[m, rows]` (16 floats, one cache line, per
        // activation row) instead of a strided transpose of the whole result afterwards.
        let mut out = vec![0f32; self.rows * m];
        let dst = SharedOut(out.as_mut_ptr());
        let rows = self.rows;
        (0..rows.div_ceil(per_item)).into_par_iter().for_each_init(
            Vec::new,
            |buf: &mut Vec<f32>, item| {
                let first = item * per_item;
                let count = per_item.min(rows - first);
                buf.resize(count * m, 0.0);
                let w = weights(first, count);
                item_product(self.format, w, count, row_bytes, &acts, m, nb, buf);
                let base = dst.get();
                for i in 0..m {
                    for r in 0..count {
                        // SAFETY: `i * rows + first + r < m * rows`, and only this item
                        // writes columns `first..first + count`.
                        unsafe { *base.add(i * rows + first + r) = buf[r * m + i] };
                    }
                }
            },
        );
        out
    }
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

/// Weight rows per parallel work item.
const WEIGHT_ROWS_PER_ITEM: usize = 16;
/// Activation rows multiplied together against one unpacked weight block.
const ACT_ROWS_PER_TILE: usize = 4;

/// `out[r * m + i] = w_r · act_i` for the `count` weight rows of one work item.
#[allow(clippy::too_many_arguments)]
fn item_product(
    format: BlockFormat,
    w: &[u8],
    count: usize,
    row_bytes: usize,
    acts: &[ActBlock],
    m: usize,
    nb: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx2_fma_f16c() {
            // SAFETY: the CPU supports the features the kernels are compiled for; `w` holds
            // `count` rows of `row_bytes`, `acts` holds `m` rows of `nb` blocks.
            unsafe {
                match format {
                    BlockFormat::Q4_1 => {
                        item_product_avx2::<false>(w, count, row_bytes, acts, m, nb, out)
                    }
                    BlockFormat::Q8_0 => {
                        item_product_avx2::<true>(w, count, row_bytes, acts, m, nb, out)
                    }
                }
            }
            return;
        }
    }
    for r in 0..count {
        let wr = &w[r * row_bytes..(r + 1) * row_bytes];
        for i in 0..m {
            let a = &acts[i * nb..(i + 1) * nb];
            out[r * m + i] = match format {
                BlockFormat::Q4_1 => dot_q4_1_scalar(wr, a),
                BlockFormat::Q8_0 => dot_q8_0_scalar(wr, a),
            };
        }
    }
}

/// Register tiles: two weight rows × four activation rows for full tiles (each unpacked
/// weight block and each loaded activation block is used several times), four weight
/// rows × one activation row otherwise (independent accumulators hide FMA latency).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_product_avx2<const Q8: bool>(
    w: &[u8],
    count: usize,
    row_bytes: usize,
    acts: &[ActBlock],
    m: usize,
    nb: usize,
    out: &mut [f32],
) {
    let mut i = 0;
    while i < m {
        let tile = (m - i).min(ACT_ROWS_PER_TILE);
        let a = &acts[i * nb..];
        if tile == ACT_ROWS_PER_TILE {
            let mut r = 0;
            while r < count {
                let wr = &w[r * row_bytes..];
                if r + 2 <= count {
                    let res = kernel::<Q8, 2, 4>(wr, row_bytes, a, nb);
                    for (dr, row) in res.iter().enumerate() {
                        out[(r + dr) * m + i..(r + dr) * m + i + 4].copy_from_slice(row);
                    }
                    r += 2;
                } else {
                    out[r * m + i..r * m + i + 4]
                        .copy_from_slice(&kernel::<Q8, 1, 4>(wr, row_bytes, a, nb)[0]);
                    r += 1;
                }
            }
        } else {
            for g in 0..tile {
                let a = &acts[(i + g) * nb..];
                let mut r = 0;
                while r < count {
                    let wr = &w[r * row_bytes..];
                    if r + 4 <= count {
                        let res = kernel::<Q8, 4, 1>(wr, row_bytes, a, nb);
                        for (dr, row) in res.iter().enumerate() {
                            out[(r + dr) * m + i + g] = row[0];
                        }
                        r += 4;
                    } else {
                        out[r * m + i + g] = kernel::<Q8, 1, 1>(wr, row_bytes, a, nb)[0][0];
                        r += 1;
                    }
                }
            }
        }
        i += tile;
    }
}

/// Dot products of `R` weight rows (`row_bytes` apart in `w`) with `G` activation rows
/// (`nb` blocks apart in `acts`): Q8_0 weights when `Q8`, Q4_1 otherwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const Q8: bool, const R: usize, const G: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: &[ActBlock],
    nb: usize,
) -> [[f32; G]; R] {
    use std::arch::x86_64::*;
    let block_bytes = if Q8 { Q8_0_BYTES } else { Q4_1_BYTES };
    debug_assert!(w.len() >= (R - 1) * row_bytes + nb * block_bytes && acts.len() >= G * nb);
    let mut acc = [[_mm256_setzero_ps(); G]; R];
    let mut offsets = [[0f32; G]; R];
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        // Unpack this block of every weight row: unsigned 8-bit operand for maddubs (and,
        // for Q8_0, the signs to move onto the activations), scale and offset.
        let mut qw = [_mm256_setzero_si256(); R];
        let mut signs = [_mm256_setzero_si256(); R];
        let mut dw = [0f32; R];
        let mut mw = [0f32; R];
        for r in 0..R {
            let wb = w.as_ptr().add(r * row_bytes + b * block_bytes);
            // F16C here: half's scalar conversion re-checks CPU features on every call
            // in a build without them enabled at compile time.
            let scales = _mm_cvtph_ps(_mm_cvtsi32_si128((wb as *const i32).read_unaligned()));
            dw[r] = _mm_cvtss_f32(scales);
            if Q8 {
                let q = _mm256_loadu_si256(wb.add(2) as *const __m256i);
                qw[r] = _mm256_sign_epi8(q, q);
                signs[r] = q;
            } else {
                mw[r] = _mm_cvtss_f32(_mm_movehdup_ps(scales));
                // Element j is the low nibble of byte j, element j+16 its high nibble.
                let packed = _mm_loadu_si128(wb.add(4) as *const __m128i);
                qw[r] = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                    low_nibbles,
                );
            }
        }
        for g in 0..G {
            let ab = acts.get_unchecked(g * nb + b);
            let qa = _mm256_load_si256(ab.qs.as_ptr() as *const __m256i);
            for r in 0..R {
                let qa = if Q8 {
                    _mm256_sign_epi8(qa, signs[r])
                } else {
                    qa
                };
                // u8 × i8 pairs summed to i16 (|w| ≤ 128, |a| ≤ 127: at most 2·128·127, no
                // saturation), then to i32.
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(qw[r], qa), ones);
                acc[r][g] = _mm256_fmadd_ps(
                    _mm256_set1_ps(dw[r] * ab.d),
                    _mm256_cvtepi32_ps(sums),
                    acc[r][g],
                );
                if !Q8 {
                    offsets[r][g] += mw[r] * ab.s;
                }
            }
        }
    }
    let mut out = [[0f32; G]; R];
    for r in 0..R {
        for g in 0..G {
            out[r][g] = crate::simd::hsum256(acc[r][g]) + offsets[r][g];
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

fn block_scales(w: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([w[0], w[1]]).to_f32(),
        f16::from_le_bytes([w[2], w[3]]).to_f32(),
    )
}

fn dot_q4_1_scalar(w: &[u8], a: &[ActBlock]) -> f32 {
    let mut total = 0f32;
    for (wb, ab) in w.chunks_exact(Q4_1_BYTES).zip(a) {
        let (d, m) = block_scales(wb);
        let mut sum = 0i32;
        for j in 0..QK / 2 {
            let byte = wb[4 + j];
            sum += (byte & 0x0F) as i32 * ab.qs[j] as i32;
            sum += (byte >> 4) as i32 * ab.qs[j + QK / 2] as i32;
        }
        total += d * ab.d * sum as f32 + m * ab.s;
    }
    total
}

fn dot_q8_0_scalar(w: &[u8], a: &[ActBlock]) -> f32 {
    let mut total = 0f32;
    for (wb, ab) in w.chunks_exact(Q8_0_BYTES).zip(a) {
        let d = f16::from_le_bytes([wb[0], wb[1]]).to_f32();
        let sum: i32 = wb[2..]
            .iter()
            .zip(&ab.qs)
            .map(|(&q, &a)| q as i8 as i32 * a as i32)
            .sum();
        total += d * ab.d * sum as f32;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dequantize(format: BlockFormat, w: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for wb in w.chunks_exact(format.block_bytes()) {
            match format {
                BlockFormat::Q4_1 => {
                    let (d, m) = block_scales(wb);
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
        // 1, 7 and 8 activation rows: single rows, a tile of four plus three single rows,
        // two tiles; 37 weight rows: work items of 16, 16 and 5 rows.
        for m in [1, 7, 8] {
            check_matmul(m);
        }
    }

    fn check_matmul(m: usize) {
        let (rows, cols) = (37, 96);
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.1)
            .collect();
        let acts: Vec<ActBlock> = x.chunks_exact(QK).map(quantize_block).collect();
        let nb = cols / QK;
        for format in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let data = matrix(format, rows, cols);
            let w = dequantize(format, &data);
            let got = QuantMatrix::new(format, data.clone(), rows, cols)
                .unwrap()
                .matmul(&x, m);
            let row_bytes = nb * format.block_bytes();
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
                    let wj = &data[j * row_bytes..(j + 1) * row_bytes];
                    let a = &acts[i * nb..(i + 1) * nb];
                    let scalar = match format {
                        BlockFormat::Q4_1 => dot_q4_1_scalar(wj, a),
                        BlockFormat::Q8_0 => dot_q8_0_scalar(wj, a),
                    };
                    assert!(
                        (g - scalar).abs() < 1e-4 * scalar.abs().max(1.0),
                        "{format:?}: simd {g} vs scalar {scalar}"
                    );
                }
            }
        }
    }
}
