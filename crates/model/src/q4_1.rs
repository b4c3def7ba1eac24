//! Q4_1 weights times f32 activations, with an AVX2 kernel.
//!
//! candle has no SIMD kernel for Q4_1 on x86, so shipped Q4_1 weights would either run
//! scalar or need requantizing to Q8_0 (twice the bytes to stream per token). Here the
//! activations are quantized to 8 bits per 32-value block (scale `d`, and `s = d·Σq` for
//! the Q4_1 offset term) and each weight block contributes
//! `d_w·d_a·Σ q_w·q_a + m_w·s_a`, the same arithmetic as llama.cpp's `q4_1 × q8_1`.

use half::f16;
use rayon::prelude::*;

/// Values per quantized block.
const QK: usize = 32;
/// Bytes of one Q4_1 block: f16 scale, f16 minimum, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;

/// One block of 8-bit activations.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct ActBlock {
    qs: [i8; QK],
    d: f32,
    s: f32,
}

/// A `[rows, cols]` Q4_1 matrix in GGML block layout.
pub(crate) struct Q4_1Matrix {
    data: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl Q4_1Matrix {
    /// Wraps raw GGML Q4_1 bytes of a `[rows, cols]` matrix.
    pub fn new(data: Vec<u8>, rows: usize, cols: usize) -> Option<Self> {
        (cols.is_multiple_of(QK) && data.len() == rows * cols / QK * Q4_1_BYTES).then_some(Self {
            data,
            rows,
            cols,
        })
    }

    /// `x · Wᵀ` for `m` rows of `x`; returns `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let nb = self.cols / QK;
        let acts: Vec<ActBlock> = x.chunks_exact(QK).map(quantize_block).collect();
        let row_bytes = nb * Q4_1_BYTES;
        // Work items are runs of weight rows; each reads its weights once for all m inputs.
        let per_item = 16;
        let mut out_t = vec![0f32; self.rows * m];
        out_t
            .par_chunks_mut(per_item * m)
            .enumerate()
            .for_each(|(item, out)| {
                let first = item * per_item;
                for (r, out_row) in out.chunks_exact_mut(m).enumerate() {
                    let w = &self.data[(first + r) * row_bytes..(first + r + 1) * row_bytes];
                    for (i, o) in out_row.iter_mut().enumerate() {
                        *o = dot(w, &acts[i * nb..(i + 1) * nb]);
                    }
                }
            });
        if m == 1 {
            return out_t;
        }
        let mut out = vec![0f32; self.rows * m];
        for (j, col) in out_t.chunks_exact(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                out[i * self.rows + j] = *v;
            }
        }
        out
    }
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

fn dot(w: &[u8], a: &[ActBlock]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { dot_avx2(w, a) };
        }
    }
    dot_scalar(w, a)
}

fn block_scales(w: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([w[0], w[1]]).to_f32(),
        f16::from_le_bytes([w[2], w[3]]).to_f32(),
    )
}

fn dot_scalar(w: &[u8], a: &[ActBlock]) -> f32 {
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(w: &[u8], a: &[ActBlock]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    let mut offsets = 0f32;
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for (wb, ab) in w.chunks_exact(Q4_1_BYTES).zip(a) {
        let (d, m) = block_scales(wb);
        offsets += m * ab.s;
        // Element j is the low nibble of byte j, element j+16 its high nibble.
        let packed = _mm_loadu_si128(wb.as_ptr().add(4) as *const __m128i);
        let nibbles = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
        let qw = _mm256_and_si256(nibbles, low_nibbles);
        let qa = _mm256_load_si256(ab.qs.as_ptr() as *const __m256i);
        // u8 × i8 pairs summed to i16 (at most 2·15·128: no saturation), then to i32.
        let pairs = _mm256_maddubs_epi16(qw, qa);
        let sums = _mm256_madd_epi16(pairs, ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * ab.d), _mm256_cvtepi32_ps(sums), acc);
    }
    let hi = _mm256_extractf128_ps(acc, 1);
    let lo = _mm256_castps256_ps128(acc);
    let s = _mm_add_ps(hi, lo);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s) + offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dequantize(w: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for wb in w.chunks_exact(Q4_1_BYTES) {
            let (d, m) = block_scales(wb);
            let mut block = [0f32; QK];
            for j in 0..QK / 2 {
                block[j] = (wb[4 + j] & 0x0F) as f32 * d + m;
                block[j + QK / 2] = (wb[4 + j] >> 4) as f32 * d + m;
            }
            out.extend_from_slice(&block);
        }
        out
    }

    #[test]
    fn matmul_matches_dequantized_weights() {
        let (rows, cols, m) = (37, 96, 3);
        let mut data = Vec::new();
        for b in 0..rows * cols / QK {
            data.extend_from_slice(&f16::from_f32(0.01 + b as f32 * 1e-4).to_le_bytes());
            data.extend_from_slice(&f16::from_f32(-0.07).to_le_bytes());
            data.extend((0..16).map(|j| ((b * 7 + j * 13) % 256) as u8));
        }
        let w = dequantize(&data);
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.1)
            .collect();
        let matrix = Q4_1Matrix::new(data.clone(), rows, cols).unwrap();
        let got = matrix.matmul(&x, m);
        let acts: Vec<ActBlock> = x.chunks_exact(QK).map(quantize_block).collect();
        for i in 0..m {
            for j in 0..rows {
                let exact: f32 = (0..cols).map(|k| x[i * cols + k] * w[j * cols + k]).sum();
                let g = got[i * rows + j];
                assert!(
                    (g - exact).abs() < 0.02 * exact.abs().max(1.0),
                    "{i},{j}: {g} vs {exact}"
                );
                let scalar = dot_scalar(
                    &data[j * cols / QK * Q4_1_BYTES..(j + 1) * cols / QK * Q4_1_BYTES],
                    &acts[i * cols / QK..(i + 1) * cols / QK],
                );
                assert!(
                    (g - scalar).abs() < 1e-4 * scalar.abs().max(1.0),
                    "simd {g} vs scalar {scalar}"
                );
            }
        }
    }
}
