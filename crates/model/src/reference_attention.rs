//! Attention computed with candle's own operations, in the order candle-transformers'
//! `quantized_llama` runs them (GEMMs over `[heads, tokens, head_dim]` tensors, the same
//! softmax reductions). With 8-bit activations feeding the next matmul, even last-bit
//! differences can flip a rounding and change greedy tokens; this path makes the
//! as-shipped mode bit-identical to that reference. It is slower than
//! [`crate::attention`] and used only by [`crate::WeightFormat::AsShipped`].

use candle_core::cpu::kernels::VecOps;
use candle_core::{Device, Tensor};

use crate::error::ModelError;
use crate::kv_store::{BlockId, KvElement, KvGeometry, BLOCK_SIZE};

/// Attention of one sequence's `t` new rows (positions `start..start + t`, already in the
/// store); `q` is `[t, num_heads * head_dim]` after RoPE; returns `[t, num_heads * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_sequence<T: KvElement>(
    data: &[T],
    g: &KvGeometry,
    layer: usize,
    block_table: &[BlockId],
    start: usize,
    q: &[f32],
    num_heads: usize,
) -> Result<Vec<f32>, ModelError> {
    let (hd, kvh) = (g.head_dim, g.num_kv_heads);
    let t = q.len() / (num_heads * hd);
    let total = start + t;
    let cpu = Device::Cpu;
    // [1, t, heads, d] -> [1, heads, t, d], contiguous as candle's RoPE output is.
    let q = Tensor::from_slice(q, (1, t, num_heads, hd), &cpu)?
        .transpose(1, 2)?
        .contiguous()?;
    let gather = |kind: usize| -> Result<Tensor, ModelError> {
        let mut out = vec![0f32; kvh * total * hd];
        for head in 0..kvh {
            for pos in 0..total {
                let at = g.offset(block_table[pos / BLOCK_SIZE] as usize, layer, kind, head)
                    + (pos % BLOCK_SIZE) * hd;
                let dst = (head * total + pos) * hd;
                T::load(&data[at..at + hd], &mut out[dst..dst + hd]);
            }
        }
        let x = Tensor::from_vec(out, (1, kvh, total, hd), &cpu)?;
        // candle-transformers' repeat_kv.
        let n_rep = num_heads / kvh;
        Ok(Tensor::cat(&vec![&x; n_rep], 2)?.reshape((1, num_heads, total, hd))?)
    };
    let (k, v) = (gather(0)?, gather(1)?);
    let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    let mut att = att.flatten_all()?.to_vec1::<f32>()?;
    for (r, row) in att.chunks_exact_mut(total).enumerate() {
        let i = r % t;
        // Causal mask: row i (position start + i) sees keys 0..=start + i.
        if t > 1 {
            row[start + i + 1..].fill(f32::NEG_INFINITY);
        }
        softmax_like_candle(row);
    }
    let att = Tensor::from_vec(att, (1, num_heads, t, total), &cpu)?;
    let y = att
        .matmul(&v.contiguous()?)?
        .transpose(1, 2)?
        .reshape((t, num_heads * hd))?;
    Ok(y.flatten_all()?.to_vec1::<f32>()?)
}

/// candle-nn's `softmax_last_dim` arithmetic for one row.
fn softmax_like_candle(row: &mut [f32]) {
    let n = row.len();
    let mut max = f32::NEG_INFINITY;
    // SAFETY: `row` holds `n > 0` values and `max` is a valid output location.
    unsafe { f32::vec_reduce_max(row.as_ptr(), &mut max, n) };
    for x in row.iter_mut() {
        *x = (*x - max).exp();
    }
    let mut sum = 0f32;
    // SAFETY: as above.
    unsafe { f32::vec_reduce_sum(row.as_ptr(), &mut sum, n) };
    for x in row.iter_mut() {
        *x /= sum;
    }
}
