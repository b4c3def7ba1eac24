//! Causal grouped-query attention of one query row over a sequence's KV blocks.
//!
//! Two passes over the row's blocks: scores `q·k` for every position (each key row
//! converted once and used by every query head of its group), then, after an unnormalised
//! softmax, the weighted sum of values, divided by the softmax sum at the end. The AVX2
//! path (chosen at run time) reads f16 keys and values straight from the store with F16C
//! and uses FMA; the scalar path runs the same two passes.

use crate::kv_store::{BlockId, KvElement, KvGeometry, BLOCK_SIZE};
use crate::simd::exp_shifted;

/// Per-thread buffers reused across rows.
#[derive(Default)]
pub(crate) struct AttnScratch {
    block: Vec<f32>,
    scores: Vec<f32>,
}

/// Where one row's attention reads from.
pub(crate) struct AttnInput<'a, T> {
    /// The whole KV store.
    pub data: &'a [T],
    /// Its geometry.
    pub g: &'a KvGeometry,
    /// The layer.
    pub layer: usize,
    /// The sequence's blocks.
    pub block_table: &'a [BlockId],
    /// Position of the query row; it attends to `0..=pos`.
    pub pos: usize,
    /// The KV head shared by the query heads in `q`.
    pub kv_head: usize,
}

/// Dot product with independent partial sums, so the compiler can use SIMD lanes.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// Attention output of the query heads sharing `input.kv_head` (`q` and `out` are those
/// heads, `group * head_dim` values) for the token at `input.pos`.
pub(crate) fn attend_group<T: KvElement>(
    input: &AttnInput<T>,
    q: &[f32],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if input.g.head_dim.is_multiple_of(16) && crate::simd::avx2_fma_f16c() {
            // SAFETY: the CPU has the features; head_dim is a multiple of the vector width.
            unsafe { x86::attend_group(input, q, out, &mut scratch.scores) };
            return;
        }
    }
    attend_group_scalar(input, q, out, scratch)
}

fn attend_group_scalar<T: KvElement>(
    input: &AttnInput<T>,
    q: &[f32],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let g = input.g;
    let hd = g.head_dim;
    let n_ctx = input.pos + 1;
    let n_blocks = n_ctx.div_ceil(BLOCK_SIZE);
    let scale = 1.0 / (hd as f32).sqrt();
    scratch.block.resize(BLOCK_SIZE * hd, 0.0);
    scratch.scores.resize(q.len() / hd * n_ctx, 0.0);
    let AttnScratch { block, scores } = scratch;
    for (bi, &b) in input.block_table[..n_blocks].iter().enumerate() {
        let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
        let at = g.offset(b as usize, input.layer, 0, input.kv_head);
        T::load(&input.data[at..at + valid * hd], &mut block[..valid * hd]);
        for j in 0..valid {
            let k = &block[j * hd..(j + 1) * hd];
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                scores[h * n_ctx + bi * BLOCK_SIZE + j] = dot(qh, k) * scale;
            }
        }
    }
    let sums: Vec<f32> = scores.chunks_exact_mut(n_ctx).map(exp_shifted).collect();
    out.fill(0.0);
    for (bi, &b) in input.block_table[..n_blocks].iter().enumerate() {
        let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
        let at = g.offset(b as usize, input.layer, 1, input.kv_head);
        T::load(&input.data[at..at + valid * hd], &mut block[..valid * hd]);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            for j in 0..valid {
                let w = scores[h * n_ctx + bi * BLOCK_SIZE + j];
                for (o, v) in o.iter_mut().zip(&block[j * hd..(j + 1) * hd]) {
                    *o += w * v;
                }
            }
        }
    }
    for (o, sum) in out.chunks_exact_mut(hd).zip(sums) {
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::AttnInput;
    use crate::kv_store::{KvElement, BLOCK_SIZE};
    use crate::simd::{exp_shifted, hsum256};

    /// AVX2/FMA/F16C attention of one row's query heads over one KV head.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `head_dim` is a multiple of 16.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_group<T: KvElement>(
        input: &AttnInput<T>,
        q: &[f32],
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        let g = input.g;
        let hd = g.head_dim;
        let group = q.len() / hd;
        let n_ctx = input.pos + 1;
        let n_blocks = n_ctx.div_ceil(BLOCK_SIZE);
        let scale = 1.0 / (hd as f32).sqrt();
        scores.resize(group * n_ctx, 0.0);
        let table = &input.block_table[..n_blocks];
        let block = |bi: usize, kind: usize| {
            let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
            let at = g.offset(table[bi] as usize, input.layer, kind, input.kv_head);
            (&input.data[at..at + valid * hd], valid)
        };
        for bi in 0..n_blocks {
            let (k, valid) = block(bi, 0);
            let mut h = 0;
            while h < group {
                let take = (group - h).min(3);
                let qh = &q[h * hd..(h + take) * hd];
                let s = &mut scores[h * n_ctx + bi * BLOCK_SIZE..];
                match take {
                    3 => block_scores::<T, 3>(k, valid, hd, qh, scale, s, n_ctx),
                    2 => block_scores::<T, 2>(k, valid, hd, qh, scale, s, n_ctx),
                    _ => block_scores::<T, 1>(k, valid, hd, qh, scale, s, n_ctx),
                }
                h += take;
            }
        }
        let sums: Vec<f32> = scores.chunks_exact_mut(n_ctx).map(exp_shifted).collect();
        out.fill(0.0);
        for bi in 0..n_blocks {
            let (v, valid) = block(bi, 1);
            let mut h = 0;
            while h < group {
                let take = (group - h).min(4);
                let w = &scores[h * n_ctx + bi * BLOCK_SIZE..];
                let o = &mut out[h * hd..(h + take) * hd];
                match take {
                    4 => block_values::<T, 4>(v, valid, hd, w, n_ctx, o),
                    3 => block_values::<T, 3>(v, valid, hd, w, n_ctx, o),
                    2 => block_values::<T, 2>(v, valid, hd, w, n_ctx, o),
                    _ => block_values::<T, 1>(v, valid, hd, w, n_ctx, o),
                }
                h += take;
            }
        }
        for (o, sum) in out.chunks_exact_mut(hd).zip(sums) {
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|v| *v *= inv);
        }
    }

    /// `s[h * stride + j] = scale · q_h · k_j` for the `valid` keys of one block and `H`
    /// query heads; each key chunk is converted once for all heads.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block_scores<T: KvElement, const H: usize>(
        k: &[T],
        valid: usize,
        hd: usize,
        q: &[f32],
        scale: f32,
        s: &mut [f32],
        stride: usize,
    ) {
        debug_assert!(k.len() >= valid * hd && q.len() >= H * hd);
        debug_assert!(s.len() > (H - 1) * stride + valid - 1);
        for j in 0..valid {
            let kr = k.as_ptr().add(j * hd);
            let mut acc = [[_mm256_setzero_ps(); 2]; H];
            let mut c = 0;
            while c < hd {
                let k0 = T::load8(kr.add(c));
                let k1 = T::load8(kr.add(c + 8));
                for (h, acc) in acc.iter_mut().enumerate() {
                    let qp = q.as_ptr().add(h * hd + c);
                    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp), k0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8)), k1, acc[1]);
                }
                c += 16;
            }
            for (h, acc) in acc.iter().enumerate() {
                *s.get_unchecked_mut(h * stride + j) =
                    hsum256(_mm256_add_ps(acc[0], acc[1])) * scale;
            }
        }
    }

    /// `o_h += Σ_j w[h * stride + j] · v_j` for the `valid` values of one block and `H`
    /// heads, 16 dimensions at a time (each value chunk converted once for all heads).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_values<T: KvElement, const H: usize>(
        v: &[T],
        valid: usize,
        hd: usize,
        w: &[f32],
        stride: usize,
        o: &mut [f32],
    ) {
        debug_assert!(v.len() >= valid * hd && o.len() >= H * hd);
        debug_assert!(w.len() > (H - 1) * stride + valid - 1);
        let mut c = 0;
        while c < hd {
            let mut acc = [[_mm256_setzero_ps(); 2]; H];
            for (h, acc) in acc.iter_mut().enumerate() {
                let op = o.as_ptr().add(h * hd + c);
                acc[0] = _mm256_loadu_ps(op);
                acc[1] = _mm256_loadu_ps(op.add(8));
            }
            for j in 0..valid {
                let vr = v.as_ptr().add(j * hd + c);
                let v0 = T::load8(vr);
                let v1 = T::load8(vr.add(8));
                for (h, acc) in acc.iter_mut().enumerate() {
                    let wj = _mm256_set1_ps(*w.get_unchecked(h * stride + j));
                    acc[0] = _mm256_fmadd_ps(wj, v0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(wj, v1, acc[1]);
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                let op = o.as_mut_ptr().add(h * hd + c);
                _mm256_storeu_ps(op, acc[0]);
                _mm256_storeu_ps(op.add(8), acc[1]);
            }
            c += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;

    /// The run-time-chosen path (AVX2 here when the CPU has it) agrees with the scalar
    /// path, for f16 and f32 stores, over partial and whole blocks.
    #[test]
    fn dispatched_attention_matches_scalar() {
        let g = KvGeometry {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 32,
        };
        let blocks = 4;
        let values: Vec<f32> = (0..g.block_elems() * blocks)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 2.0)
            .collect();
        let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        let table: Vec<BlockId> = vec![2, 0, 3, 1];
        let group = 3;
        let q: Vec<f32> = (0..group * g.head_dim)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.3)
            .collect();
        for pos in [0, 15, 16, 40, 63] {
            for kv_head in 0..2 {
                let check = |got: &[f32], want: &[f32]| {
                    for (a, b) in got.iter().zip(want) {
                        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
                    }
                };
                let mut got = vec![0f32; q.len()];
                let mut want = vec![0f32; q.len()];
                let input = AttnInput {
                    data: &halves[..],
                    g: &g,
                    layer: 1,
                    block_table: &table,
                    pos,
                    kv_head,
                };
                attend_group(&input, &q, &mut got, &mut AttnScratch::default());
                attend_group_scalar(&input, &q, &mut want, &mut AttnScratch::default());
                check(&got, &want);
                let input = AttnInput {
                    data: &values[..],
                    g: &g,
                    layer: 1,
                    block_table: &table,
                    pos,
                    kv_head,
                };
                attend_group(&input, &q, &mut got, &mut AttnScratch::default());
                attend_group_scalar(&input, &q, &mut want, &mut AttnScratch::default());
                check(&got, &want);
            }
        }
    }
}
