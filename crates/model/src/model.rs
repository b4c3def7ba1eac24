//! A loaded llama-family model and its batched forward step over the paged KV store.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::attention::{attend_part, merge_parts, part_len, parts, AttnInput, AttnScratch};
use crate::chat_template::ChatTemplate;
use crate::config::{Hyperparams, ModelConfig};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::kv_store::{store_token, BlockId, KvData, KvElement, KvGeometry, KvStore, BLOCK_SIZE};
use crate::linear::{Linear, LoadOptions, WeightFormat};
use crate::model_text::ModelText;
use crate::reference_attention::attend_sequence;
use crate::simd::silu_mul;
use crate::tokenizer::Tokenizer;

/// One sequence's share of a batched forward step.
pub struct SequenceStep<'a> {
    /// New tokens to run: a prompt (chunk) or the one token sampled last step.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV store.
    pub start_pos: usize,
    /// Blocks of this sequence, covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [BlockId],
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    attn_out: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Linear,
    down: Linear,
}

/// A loaded model.
pub struct Model {
    hp: Hyperparams,
    embedding: QTensor,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    output: Linear,
    /// `cos`/`sin` of every position × frequency, `[context_length][head_dim / 2]`.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    text: Arc<ModelText>,
    options: LoadOptions,
}

impl Model {
    /// Loads a llama-family GGUF with the default (fast) [`LoadOptions`].
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::load_with(path, &LoadOptions::default())
    }

    /// Loads a llama-family GGUF.
    pub fn load_with(path: &Path, options: &LoadOptions) -> Result<Self, ModelError> {
        let mut gguf = GgufFile::open(path)?;
        let hp = gguf.hyperparams()?;
        let text = Arc::new(ModelText::from_gguf(&gguf)?);
        let has_output = gguf.content.tensor_infos.contains_key("output.weight");
        let cpu = Device::Cpu;
        let mut tensor = |name: &str| -> Result<QTensor, ModelError> {
            let GgufFile {
                content,
                reader,
                path,
                ..
            } = &mut gguf;
            content
                .tensor(reader, name, &cpu)
                .map_err(|e| ModelError::InvalidGguf {
                    path: path.clone(),
                    reason: format!("tensor {name}: {e}"),
                })
        };
        let vector = |t: QTensor| -> Result<Vec<f32>, ModelError> {
            Ok(t.dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        let mut layers = Vec::with_capacity(hp.config.num_layers);
        for l in 0..hp.config.num_layers {
            let name = |t: &str| format!("blk.{l}.{t}.weight");
            layers.push(Layer {
                attn_norm: vector(tensor(&name("attn_norm"))?)?,
                qkv: Linear::new(
                    vec![
                        tensor(&name("attn_q"))?,
                        tensor(&name("attn_k"))?,
                        tensor(&name("attn_v"))?,
                    ],
                    options,
                )?,
                attn_out: Linear::new(vec![tensor(&name("attn_output"))?], options)?,
                ffn_norm: vector(tensor(&name("ffn_norm"))?)?,
                gate_up: Linear::new(
                    vec![tensor(&name("ffn_gate"))?, tensor(&name("ffn_up"))?],
                    options,
                )?,
                down: Linear::new(vec![tensor(&name("ffn_down"))?], options)?,
            });
        }
        let output_norm = vector(tensor("output_norm.weight")?)?;
        let embedding = tensor("token_embd.weight")?;
        // Tied embeddings: without output.weight the embedding matrix is the output layer.
        let output = match has_output {
            true => tensor("output.weight")?,
            false => tensor("token_embd.weight")?,
        };
        let output = Linear::new(vec![output], options)?;
        let c = &hp.config;
        if layers
            .iter()
            .any(|l| l.qkv.out_dim() != (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
            || output.out_dim() != c.vocab_size
        {
            return Err(ModelError::InvalidGguf {
                path: path.to_path_buf(),
                reason: "weight shapes do not match the metadata".into(),
            });
        }
        let (rope_cos, rope_sin) = rope_tables(c.head_dim, c.context_length, hp.rope_base);
        tracing::info!(
            path = %path.display(),
            layers = c.num_layers,
            hidden = c.hidden_size,
            weights = ?options.weights,
            dense_min_rows = ?options.dense_min_rows,
            "model loaded"
        );
        Ok(Self {
            hp,
            embedding,
            layers,
            output_norm,
            output,
            rope_cos,
            rope_sin,
            text,
            options: options.clone(),
        })
    }

    /// Shapes of the model.
    pub fn config(&self) -> &ModelConfig {
        &self.hp.config
    }

    /// The options it was loaded with.
    pub fn load_options(&self) -> &LoadOptions {
        &self.options
    }

    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.text.tokenizer()
    }

    /// Its chat template.
    pub fn chat_template(&self) -> &ChatTemplate {
        self.text.chat_template()
    }

    /// Its shapes, tokenizer and chat template, shared.
    pub fn text(&self) -> Arc<ModelText> {
        self.text.clone()
    }

    /// One batched step: writes the new tokens' K/V into their blocks and returns, per
    /// sequence, the logits of its last new token (`[batch][vocab]`).
    pub fn forward(
        &self,
        kv: &mut KvStore,
        batch: &[SequenceStep],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_inner(kv, batch, &vec![false; batch.len()])
    }

    /// Like [`Model::forward`], but returns logits for every new token of every sequence
    /// (`[batch][tokens][vocab]` flattened per sequence as `tokens * vocab`), e.g. for
    /// prompt logprobs.
    pub fn forward_all_logits(
        &self,
        kv: &mut KvStore,
        batch: &[SequenceStep],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_inner(kv, batch, &vec![true; batch.len()])
    }

    /// Like [`Model::forward`], but sequence `i` gets the logits of every new token when
    /// `all_rows[i]` (`tokens * vocab`, row-major) and of its last one otherwise: only a
    /// sequence scoring its prompt pays for the extra output-layer rows.
    pub fn forward_rows(
        &self,
        kv: &mut KvStore,
        batch: &[SequenceStep],
        all_rows: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if all_rows.len() != batch.len() {
            return Err(ModelError::InvalidInput(format!(
                "{} row choices for {} sequences",
                all_rows.len(),
                batch.len()
            )));
        }
        self.forward_inner(kv, batch, all_rows)
    }

    fn validate(&self, kv: &KvStore, batch: &[SequenceStep]) -> Result<(), ModelError> {
        let c = &self.hp.config;
        let expected = KvGeometry {
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        if kv.geometry() != expected {
            return Err(ModelError::InvalidInput(format!(
                "KV store layout {} does not fit this model",
                kv.layout()
            )));
        }
        for (i, s) in batch.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            if s.tokens.is_empty() {
                return Err(ModelError::InvalidInput(format!(
                    "sequence {i} has no new tokens"
                )));
            }
            if end > c.context_length {
                return Err(ModelError::InvalidInput(format!(
                    "sequence {i} reaches position {end}, beyond the context length {}",
                    c.context_length
                )));
            }
            if s.block_table.len() * BLOCK_SIZE < end {
                return Err(ModelError::InvalidInput(format!(
                    "sequence {i} needs {} blocks for {end} positions, has {}",
                    end.div_ceil(BLOCK_SIZE),
                    s.block_table.len()
                )));
            }
            for &b in &s.block_table[..end.div_ceil(BLOCK_SIZE)] {
                kv.check_block(b)?;
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::InvalidInput(format!(
                    "token id {t} is outside the vocabulary"
                )));
            }
        }
        Ok(())
    }

    fn forward_inner(
        &self,
        kv: &mut KvStore,
        batch: &[SequenceStep],
        all_logits: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        // The whole step runs on a pool worker: each of the ~150 parallel loops of a decode
        // step then starts with a steal by the other (still spinning) worker, instead of
        // waking sleeping workers from outside the pool and sleeping until they finish.
        rayon::scope(|_| self.forward_on_pool(kv, batch, all_logits))
    }

    fn forward_on_pool(
        &self,
        kv: &mut KvStore,
        batch: &[SequenceStep],
        all_logits: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.validate(kv, batch)?;
        let c = &self.hp.config;
        let (hidden, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.kv_dim());
        // Every row of the step: (sequence, absolute position).
        let rows: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.tokens.len()).map(move |t| (i, s.start_pos + t)))
            .collect();
        let n = rows.len();
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut x = self
            .embedding
            .embedding(&Tensor::new(ids.as_slice(), &Device::Cpu)?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let geometry = kv.geometry();
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, hidden, self.hp.rms_eps);
            let mut qkv = layer.qkv.forward(h, n)?;
            let width = q_dim + 2 * kv_dim;
            for (r, &(_, pos)) in rows.iter().enumerate() {
                let row = &mut qkv[r * width..r * width + q_dim + kv_dim];
                self.rope(row, pos);
            }
            match &mut kv.data {
                KvData::F16(data) => {
                    write_kv(data, &geometry, l, batch, &rows, &qkv, q_dim, kv_dim)
                }
                KvData::F32(data) => {
                    write_kv(data, &geometry, l, batch, &rows, &qkv, q_dim, kv_dim)
                }
            }
            let mut attn = vec![0f32; n * q_dim];
            match &kv.data {
                KvData::F16(data) => {
                    self.attend(data, &geometry, l, batch, &rows, &qkv, &mut attn)?
                }
                KvData::F32(data) => {
                    self.attend(data, &geometry, l, batch, &rows, &qkv, &mut attn)?
                }
            }
            drop(qkv);
            let o = layer.attn_out.forward(attn, n)?;
            add_assign(&mut x, &o);
            let h = rms_norm(&x, &layer.ffn_norm, hidden, self.hp.rms_eps);
            let gu = layer.gate_up.forward(h, n)?;
            let exact = self.options.weights == WeightFormat::AsShipped;
            let act = swiglu(&gu, self.hp.ffn_size, exact);
            let d = layer.down.forward(act, n)?;
            add_assign(&mut x, &d);
        }
        // Only the rows whose logits are wanted go through the output layer.
        let mut wanted = Vec::new();
        let mut first = 0;
        for (s, &all) in batch.iter().zip(all_logits) {
            let len = s.tokens.len();
            if all {
                wanted.extend(first..first + len);
            } else {
                wanted.push(first + len - 1);
            }
            first += len;
        }
        let mut last = Vec::with_capacity(wanted.len() * hidden);
        for &r in &wanted {
            last.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let normed = rms_norm(&last, &self.output_norm, hidden, self.hp.rms_eps);
        let logits = self.output.forward(normed, wanted.len())?;
        let vocab = c.vocab_size;
        if !all_logits.contains(&true) {
            return Ok(logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect());
        }
        let mut out = Vec::with_capacity(batch.len());
        let mut at = 0;
        for (s, &all) in batch.iter().zip(all_logits) {
            let len = if all { s.tokens.len() } else { 1 } * vocab;
            out.push(logits[at..at + len].to_vec());
            at += len;
        }
        Ok(out)
    }

    /// Interleaved RoPE (pairs `2i, 2i+1`) on every query and key head of one row.
    fn rope(&self, row: &mut [f32], pos: usize) {
        let half = self.hp.config.head_dim / 2;
        let cos = &self.rope_cos[pos * half..(pos + 1) * half];
        let sin = &self.rope_sin[pos * half..(pos + 1) * half];
        for head in row.chunks_exact_mut(2 * half) {
            for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * cos[i] - b * sin[i];
                pair[1] = a * sin[i] + b * cos[i];
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn attend<T: KvElement>(
        &self,
        data: &[T],
        g: &KvGeometry,
        layer: usize,
        batch: &[SequenceStep],
        rows: &[(usize, usize)],
        qkv: &[f32],
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let c = &self.hp.config;
        let q_dim = c.num_heads * c.head_dim;
        let width = q_dim + 2 * c.kv_dim();
        if self.options.weights == WeightFormat::AsShipped {
            let mut first = 0;
            for s in batch {
                let t = s.tokens.len();
                let q: Vec<f32> = (first..first + t)
                    .flat_map(|r| qkv[r * width..r * width + q_dim].iter().copied())
                    .collect();
                let y =
                    attend_sequence(data, g, layer, s.block_table, s.start_pos, &q, c.num_heads)?;
                out[first * q_dim..(first + t) * q_dim].copy_from_slice(&y);
                first += t;
            }
            return Ok(());
        }
        // Work units are (row, KV head, part of the row's context): each writes one part's
        // partial result for the query heads of its group; merging follows per (row, head).
        let kvh = c.num_kv_heads;
        let group_width = q_dim / kvh;
        let plen = part_len(group_width / c.head_dim, c.head_dim);
        // First unit of each row (units of row r: first[r]..first[r + 1]).
        let mut first = Vec::with_capacity(rows.len() + 1);
        first.push(0);
        for &(_, pos) in rows {
            first.push(first.last().unwrap() + kvh * parts(pos));
        }
        let units: Vec<(usize, usize, usize)> = rows
            .iter()
            .enumerate()
            .flat_map(|(r, &(_, pos))| {
                (0..kvh).flat_map(move |h| (0..parts(pos)).map(move |p| (r, h, p)))
            })
            .collect();
        let mut partial = vec![0f32; units.len() * plen];
        let run = |(&(r, kv_head, part), buf): (&(usize, usize, usize), &mut [f32]),
                   scratch: &mut AttnScratch| {
            let (seq, pos) = rows[r];
            let q =
                &qkv[r * width + kv_head * group_width..r * width + (kv_head + 1) * group_width];
            let input = AttnInput {
                data,
                g,
                layer,
                block_table: batch[seq].block_table,
                pos,
                kv_head,
                part,
            };
            attend_part(&input, q, buf, scratch);
        };
        let group = group_width / c.head_dim;
        let merge = |partial: &[f32], (r, out): (usize, &mut [f32])| {
            let parts = &partial[first[r] * plen..first[r + 1] * plen];
            for (h, out) in out.chunks_exact_mut(group_width).enumerate() {
                let per_head = parts.len() / kvh;
                merge_parts(
                    &parts[h * per_head..(h + 1) * per_head],
                    group,
                    c.head_dim,
                    out,
                );
            }
        };
        // Below this much work (positions attended, summed over rows) threads cost more
        // than they save.
        let positions: usize = rows.iter().map(|&(_, pos)| pos + 1).sum();
        if positions < 256 {
            let mut scratch = AttnScratch::default();
            units
                .iter()
                .zip(partial.chunks_mut(plen))
                .for_each(|item| run(item, &mut scratch));
            out.chunks_mut(q_dim)
                .enumerate()
                .for_each(|item| merge(&partial, item));
        } else {
            units
                .par_iter()
                .zip(partial.par_chunks_mut(plen))
                .for_each_init(AttnScratch::default, |scratch, item| run(item, scratch));
            out.par_chunks_mut(q_dim)
                .enumerate()
                .for_each(|item| merge(&partial, item));
        }
        Ok(())
    }
}

/// Writes the new rows' K and V (already rotated) into their sequences' blocks.
#[allow(clippy::too_many_arguments)]
fn write_kv<T: KvElement>(
    data: &mut [T],
    g: &KvGeometry,
    layer: usize,
    batch: &[SequenceStep],
    rows: &[(usize, usize)],
    qkv: &[f32],
    q_dim: usize,
    kv_dim: usize,
) {
    let width = q_dim + 2 * kv_dim;
    for (r, &(seq, pos)) in rows.iter().enumerate() {
        let block = batch[seq].block_table[pos / BLOCK_SIZE] as usize;
        let row = &qkv[r * width..(r + 1) * width];
        let (k, v) = row[q_dim..].split_at(kv_dim);
        store_token(data, g, block, pos % BLOCK_SIZE, layer, k, v);
    }
}

/// RMSNorm of every `dim`-wide row, scaled by `weight`.
fn rms_norm(x: &[f32], weight: &[f32], dim: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let sum2 = src.iter().map(|v| v * v).sum::<f32>();
        let m = (sum2 / dim as f32 + eps).sqrt();
        for ((d, s), w) in dst.iter_mut().zip(src).zip(weight) {
            *d = *s / m * *w;
        }
    }
    out
}

/// `silu(gate) * up` for rows laid out as `[gate (ffn) | up (ffn)]`.
/// With `exact`, `exp` is libm's, as in candle (the as-shipped path must match it bit for
/// bit); otherwise the vectorised one.
fn swiglu(gu: &[f32], ffn: usize, exact: bool) -> Vec<f32> {
    let mut out = vec![0f32; gu.len() / 2];
    let body = |(dst, src): (&mut [f32], &[f32])| {
        let (gate, up) = src.split_at(ffn);
        if exact {
            for ((d, g), u) in dst.iter_mut().zip(gate).zip(up) {
                *d = g / (1.0 + (-g).exp()) * u;
            }
        } else {
            silu_mul(gate, up, dst);
        }
    };
    if out.len() > ffn * 8 {
        out.par_chunks_mut(ffn)
            .zip(gu.par_chunks(2 * ffn))
            .for_each(body);
    } else {
        out.chunks_mut(ffn).zip(gu.chunks(2 * ffn)).for_each(body);
    }
    out
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `cos` and `sin` of `pos · base^(-2i/d)` for every position and pair, computed in f32
/// the same way as candle-transformers' llama so the reference comparison is exact.
fn rope_tables(head_dim: usize, positions: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
    let theta: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(positions * theta.len());
    let mut sin = Vec::with_capacity(positions * theta.len());
    for p in 0..positions {
        for t in &theta {
            let angle = p as f32 * t;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}
