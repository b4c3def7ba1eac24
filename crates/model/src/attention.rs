//! Causal grouped-query attention of one query row over a sequence's KV blocks.
//!
//! A row's context is cut into parts of [`PART_POSITIONS`] positions, so one long row
//! (decode at batch 1) still gives both threads work. Per part, two passes: scores `q·k`
//! (each key row converted once and used by every query head of its group), then, after
//! an unnormalised softmax, the weighted sum of values; [`merge_parts`] rescales the
//! parts to their common maximum and divides by the softmax sum. The cut depends only on
//! the row's position, never on the rest of the batch, so results stay bit-identical
//! however rows are batched. The AVX2 path (chosen at run time) reads f16 keys and values
//! straight from the store with F16C and uses FMA; the scalar path runs the same passes.

use crate::kv_store::{BlockId, KvElement, KvGeometry, BLOCK_SIZE};
use crate::simd::exp_shifted;

/// Blocks per part of a row's context.
const PART_BLOCKS: usize = 8;
/// Positions per part of a row's context.
pub(crate) const PART_POSITIONS: usize = PART_BLOCKS * BLOCK_SIZE;

/// Parts of the context of the row at `pos`.
pub(crate) fn parts(pos: usize) -> usize {
    (pos + 1).div_ceil(PART_POSITIONS)
}

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
    /// Which part of the context (`0..parts(pos)`).
    pub part: usize,
}

impl<T> AttnInput<'_, T> {
    /// Blocks of this part (indices into the block table) and positions attended in all.
    fn span(&self) -> (std::ops::Range<usize>, usize) {
        let n_ctx = self.pos + 1;
        let first = self.part * PART_BLOCKS;
        (
            first..(first + PART_BLOCKS).min(n_ctx.div_ceil(BLOCK_SIZE)),
            n_ctx,
        )
    }
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

/// Floats of one part's result for `group` query heads of `head_dim`: the unnormalised
/// outputs, then each head's score maximum and softmax sum.
pub(crate) fn part_len(group: usize, head_dim: usize) -> usize {
    group * (head_dim + 2)
}

/// One part of the attention of the query heads sharing `input.kv_head` (`q` is those
/// heads, `group * head_dim` values) for the token at `input.pos`, into `part` (laid out
/// as [`part_len`] says).
pub(crate) fn attend_part<T: KvElement>(
    input: &AttnInput<T>,
    q: &[f32],
    part: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let group = q.len() / input.g.head_dim;
    let (out, stats) = part.split_at_mut(q.len());
    #[cfg(target_arch = "x86_64")]
    {
        if input.g.head_dim.is_multiple_of(16) && crate::simd::avx2_fma_f16c() {
            // SAFETY: the CPU has the features; head_dim is a multiple of the vector width.
            unsafe {
                x86::attend_part(input, q, out, &mut stats[..2 * group], &mut scratch.scores)
            };
            return;
        }
    }
    attend_part_scalar(input, q, out, &mut stats[..2 * group], scratch)
}

/// Combines a row's `parts` (each [`part_len`] floats, in order) into the normalised
/// output of its `group` query heads.
pub(crate) fn merge_parts(parts: &[f32], group: usize, hd: usize, out: &mut [f32]) {
    let len = part_len(group, hd);
    let n = parts.len() / len;
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        let stat = |p: usize, k: usize| parts[p * len + group * hd + k * group + h];
        let max = (0..n).map(|p| stat(p, 0)).fold(f32::NEG_INFINITY, f32::max);
        o.fill(0.0);
        let mut sum = 0.0;
        for p in 0..n {
            // exp(0) is exactly 1: a single part is only divided by its sum.
            let w = (stat(p, 0) - max).exp();
            sum += w * stat(p, 1);
            let src = &parts[p * len + h * hd..p * len + (h + 1) * hd];
            for (o, v) in o.iter_mut().zip(src) {
                *o += w * v;
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

fn attend_part_scalar<T: KvElement>(
    input: &AttnInput<T>,
    q: &[f32],
    out: &mut [f32],
    stats: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let g = input.g;
    let hd = g.head_dim;
    let group = q.len() / hd;
    let (blocks, n_ctx) = input.span();
    let base = blocks.start * BLOCK_SIZE;
    let len = (blocks.end * BLOCK_SIZE).min(n_ctx) - base;
    let scale = 1.0 / (hd as f32).sqrt();
    scratch.block.resize(BLOCK_SIZE * hd, 0.0);
    scratch.scores.resize(group * len, 0.0);
    let AttnScratch { block, scores } = scratch;
    for bi in blocks.clone() {
        let b = input.block_table[bi];
        let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
        let at = g.offset(b as usize, input.layer, 0, input.kv_head);
        T::load(&input.data[at..at + valid * hd], &mut block[..valid * hd]);
        for j in 0..valid {
            let k = &block[j * hd..(j + 1) * hd];
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                scores[h * len + bi * BLOCK_SIZE - base + j] = dot(qh, k) * scale;
            }
        }
    }
    for (h, s) in scores.chunks_exact_mut(len).enumerate() {
        (stats[h], stats[group + h]) = exp_shifted(s);
    }
    out.fill(0.0);
    for bi in blocks {
        let b = input.block_table[bi];
        let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
        let at = g.offset(b as usize, input.layer, 1, input.kv_head);
        T::load(&input.data[at..at + valid * hd], &mut block[..valid * hd]);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            for j in 0..valid {
                let w = scores[h * len + bi * BLOCK_SIZE - base + j];
                for (o, v) in o.iter_mut().zip(&block[j * hd..(j + 1) * hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::AttnInput;
    use crate::kv_store::{KvElement, BLOCK_SIZE};
    use crate::simd::{exp_shifted, hsum256};

    /// AVX2/FMA/F16C attention of one row's query heads over one KV head and one part
    /// of the context: unnormalised outputs into `out`, maxima and sums into `stats`.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `head_dim` is a multiple of 16.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_part<T: KvElement>(
        input: &AttnInput<T>,
        q: &[f32],
        out: &mut [f32],
        stats: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        let g = input.g;
        let hd = g.head_dim;
        let group = q.len() / hd;
        let (blocks, n_ctx) = input.span();
        let base = blocks.start * BLOCK_SIZE;
        let len = (blocks.end * BLOCK_SIZE).min(n_ctx) - base;
        let scale = 1.0 / (hd as f32).sqrt();
        scores.resize(group * len, 0.0);
        let table = input.block_table;
        let block = |bi: usize, kind: usize| {
            let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
            let at = g.offset(table[bi] as usize, input.layer, kind, input.kv_head);
            (&input.data[at..at + valid * hd], valid)
        };
        for bi in blocks.clone() {
            let (k, valid) = block(bi, 0);
            let mut h = 0;
            while h < group {
                let take = (group - h).min(3);
                let qh = &q[h * hd..(h + take) * hd];
                let s = &mut scores[h * len + bi * BLOCK_SIZE - base..];
                match take {
                    3 => block_scores::<T, 3>(k, valid, hd, qh, scale, s, len),
                    2 => block_scores::<T, 2>(k, valid, hd, qh, scale, s, len),
                    _ => block_scores::<T, 1>(k, valid, hd, qh, scale, s, len),
                }
                h += take;
            }
        }
        for (h, s) in scores.chunks_exact_mut(len).enumerate() {
            (stats[h], stats[group + h]) = exp_shifted(s);
        }
        out.fill(0.0);
        for bi in blocks {
            let (v, valid) = block(bi, 1);
            let mut h = 0;
            while h < group {
                let take = (group - h).min(4);
                let w = &scores[h * len + bi * BLOCK_SIZE - base..];
                let o = &mut out[h * hd..(h + take) * hd];
                match take {
                    4 => block_values::<T, 4>(v, valid, hd, w, len, o),
                    3 => block_values::<T, 3>(v, valid, hd, w, len, o),
                    2 => block_values::<T, 2>(v, valid, hd, w, len, o),
                    _ => block_values::<T, 1>(v, valid, hd, w, len, o),
                }
                h += take;
            }
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

    /// All parts of one row through `part_fn`, merged.
    fn attend_row<T: KvElement>(
        input: &AttnInput<T>,
        q: &[f32],
        part_fn: fn(&AttnInput<T>, &[f32], &mut [f32], &mut AttnScratch),
    ) -> Vec<f32> {
        let (hd, group) = (input.g.head_dim, q.len() / input.g.head_dim);
        let len = part_len(group, hd);
        let mut parts = vec![0f32; parts(input.pos) * len];
        for (p, buf) in parts.chunks_exact_mut(len).enumerate() {
            let input = AttnInput { part: p, ..*input };
            part_fn(&input, q, buf, &mut AttnScratch::default());
        }
        let mut out = vec![0f32; q.len()];
        merge_parts(&parts, group, hd, &mut out);
        out
    }

    fn scalar_part<T: KvElement>(
        input: &AttnInput<T>,
        q: &[f32],
        part: &mut [f32],
        scratch: &mut AttnScratch,
    ) {
        let (out, stats) = part.split_at_mut(q.len());
        attend_part_scalar(input, q, out, stats, scratch);
    }

    /// Plain softmax attention over the whole context in f64: what the parts must add up to.
    fn naive<T: KvElement>(input: &AttnInput<T>, q: &[f32]) -> Vec<f32> {
        let (g, hd) = (input.g, input.g.head_dim);
        let n_ctx = input.pos + 1;
        let row = |kind: usize, p: usize| {
            let at = g.offset(
                input.block_table[p / BLOCK_SIZE] as usize,
                input.layer,
                kind,
                input.kv_head,
            ) + p % BLOCK_SIZE * hd;
            let mut v = vec![0f32; hd];
            T::load(&input.data[at..at + hd], &mut v);
            v
        };
        let mut out = Vec::new();
        for qh in q.chunks_exact(hd) {
            let s: Vec<f64> = (0..n_ctx)
                .map(|p| dot(qh, &row(0, p)) as f64 / (hd as f64).sqrt())
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            let mut o = vec![0f64; hd];
            for (p, w) in w.iter().enumerate() {
                for (o, v) in o.iter_mut().zip(row(1, p)) {
                    *o += w * v as f64;
                }
            }
            out.extend(o.iter().map(|o| (o / sum) as f32));
        }
        out
    }

    /// The run-time-chosen path (AVX2 here when the CPU has it) agrees with the scalar
    /// path and with plain softmax attention, for f16 and f32 stores, over partial and
    /// whole blocks and over one, two and three parts of the context.
    #[test]
    fn dispatched_attention_matches_scalar() {
        let g = KvGeometry {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 32,
        };
        let blocks = 2 * PART_BLOCKS + 4;
        let values: Vec<f32> = (0..g.block_elems() * blocks)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 2.0)
            .collect();
        let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        let table: Vec<BlockId> = (0..blocks as BlockId)
            .map(|b| (b * 7) % blocks as BlockId)
            .collect();
        let group = 3;
        let q: Vec<f32> = (0..group * g.head_dim)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.3)
            .collect();
        let last = blocks * BLOCK_SIZE - 1;
        for pos in [
            0,
            15,
            16,
            40,
            63,
            PART_POSITIONS - 1,
            PART_POSITIONS,
            2 * PART_POSITIONS + 7,
            last,
        ] {
            for kv_head in 0..2 {
                let check = |got: &[f32], want: &[f32], tol: f32| {
                    for (a, b) in got.iter().zip(want) {
                        assert!(
                            (a - b).abs() <= tol * b.abs().max(1.0),
                            "pos {pos}: {a} vs {b}"
                        );
                    }
                };
                let input = AttnInput {
                    data: &halves[..],
                    g: &g,
                    layer: 1,
                    block_table: &table,
                    pos,
                    kv_head,
                    part: 0,
                };
                let got = attend_row(&input, &q, attend_part);
                check(&got, &attend_row(&input, &q, scalar_part), 1e-5);
                check(&got, &naive(&input, &q), 1e-5);
                let input = AttnInput {
                    data: &values[..],
                    g: &g,
                    layer: 1,
                    block_table: &table,
                    pos,
                    kv_head,
                    part: 0,
                };
                let got = attend_row(&input, &q, attend_part);
                check(&got, &attend_row(&input, &q, scalar_part), 1e-5);
                check(&got, &naive(&input, &q), 1e-5);
            }
        }
    }
}
