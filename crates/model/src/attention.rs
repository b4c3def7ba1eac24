//! Causal grouped-query attention of one query row over a sequence's KV blocks.

use crate::kv_store::{BlockId, KvElement, KvGeometry, BLOCK_SIZE};

/// Per-thread buffers reused across rows.
#[derive(Default)]
pub(crate) struct AttnScratch {
    block: Vec<f32>,
    scores: Vec<f32>,
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

/// Attention output of the query heads sharing `kv_head` (`q` and `out` are those heads,
/// `group * head_dim` values) for the token at `pos`, which attends to positions `0..=pos`
/// of the sequence whose blocks are `block_table`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_group<T: KvElement>(
    data: &[T],
    g: &KvGeometry,
    layer: usize,
    block_table: &[BlockId],
    pos: usize,
    kv_head: usize,
    q: &[f32],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let hd = g.head_dim;
    let group = q.len() / hd;
    let n_ctx = pos + 1;
    let n_blocks = n_ctx.div_ceil(BLOCK_SIZE);
    let scale = 1.0 / (hd as f32).sqrt();
    scratch.block.resize(BLOCK_SIZE * hd, 0.0);
    scratch.scores.resize(group * n_ctx, 0.0);
    let AttnScratch { block, scores } = scratch;
    // Scores q·k for every position, one block of keys at a time.
    for (bi, &b) in block_table[..n_blocks].iter().enumerate() {
        let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
        let at = g.offset(b as usize, layer, 0, kv_head);
        T::load(&data[at..at + valid * hd], &mut block[..valid * hd]);
        for j in 0..valid {
            let k = &block[j * hd..(j + 1) * hd];
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                scores[h * n_ctx + bi * BLOCK_SIZE + j] = dot(qh, k) * scale;
            }
        }
    }
    for row in scores.chunks_exact_mut(n_ctx) {
        softmax(row);
    }
    out.fill(0.0);
    // Weighted sum of values.
    for (bi, &b) in block_table[..n_blocks].iter().enumerate() {
        let valid = (n_ctx - bi * BLOCK_SIZE).min(BLOCK_SIZE);
        let at = g.offset(b as usize, layer, 1, kv_head);
        T::load(&data[at..at + valid * hd], &mut block[..valid * hd]);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            for j in 0..valid {
                let w = scores[h * n_ctx + bi * BLOCK_SIZE + j];
                for (o, v) in o.iter_mut().zip(&block[j * hd..(j + 1) * hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

/// In-place softmax.
pub(crate) fn softmax(xs: &mut [f32]) {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in xs.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    for x in xs.iter_mut() {
        *x /= sum;
    }
}
