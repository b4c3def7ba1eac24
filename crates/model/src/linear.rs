//! Linear layers: quantized weights for few-row steps, optional dense f32 copies for
//! many-row steps (prefill, large batches) where a GEMM beats row-by-row dot products.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::error::ModelError;
use crate::quant_matmul::{BlockFormat, QuantMatrix};

/// How weight matrices are held for the quantized (few-row) path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Exactly as the GGUF ships them (Q4_1 for the default model; slow on x86 where
    /// candle has no SIMD Q4_1 kernel, but bit-identical to candle's own llama: attention
    /// then also runs through candle's operations).
    AsShipped,
    /// Tensors as shipped; Q4_1 and Q8_0 ones multiplied by our AVX2 kernels (activations
    /// quantized to 8 bits), other types by candle's.
    Native,
    /// Requantized to Q8_0 at load: candle has AVX kernels for it.
    Q8_0,
    /// Dequantized to f32: the numerical reference, largest and slowest per row.
    F32,
}

/// How to load a model.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// Format of the weights used for steps with few rows.
    pub weights: WeightFormat,
    /// Steps with at least this many new tokens (all sequences together) use dense f32
    /// weights and a GEMM (kept in memory alongside the quantized ones); `None` never does.
    pub dense_min_rows: Option<usize>,
}

impl Default for LoadOptions {
    /// The shipped fast path: weights as shipped, our AVX2 kernels for every step size.
    /// Every row is computed alone, so results do not depend on batching or chunking (bit
    /// for bit), which keeps P/D output identical to aggregated output. `dense_min_rows:
    /// Some(32)` prefills ~35% faster (f32 GEMM) at 3x the memory, but GEMM blocking makes
    /// results depend on the step's composition.
    fn default() -> Self {
        Self {
            weights: WeightFormat::Native,
            dense_min_rows: None,
        }
    }
}

impl LoadOptions {
    /// Weights exactly as shipped, never dequantized: matches candle-transformers' llama.
    pub fn as_shipped() -> Self {
        Self {
            weights: WeightFormat::AsShipped,
            dense_min_rows: None,
        }
    }

    /// Everything in f32: the numerical reference.
    pub fn f32_reference() -> Self {
        Self {
            weights: WeightFormat::F32,
            dense_min_rows: None,
        }
    }
}

/// Block formats our own kernels handle.
fn own_format(dtype: GgmlDType) -> Option<BlockFormat> {
    match dtype {
        GgmlDType::Q4_1 => Some(BlockFormat::Q4_1),
        GgmlDType::Q8_0 => Some(BlockFormat::Q8_0),
        _ => None,
    }
}

/// The few-row kernel of a layer.
enum Kernel {
    Candle(QMatMul),
    Own(QuantMatrix),
}

/// A weight matrix `[out, in]` applied as `x · Wᵀ`.
pub(crate) struct Linear {
    quant: Kernel,
    dense: Option<QMatMul>,
    dense_min_rows: usize,
    out_dim: usize,
}

impl Linear {
    /// Builds from one or more tensors stacked along the output dimension (fused QKV or
    /// gate/up), each `[out_i, in]`.
    pub fn new(parts: Vec<QTensor>, options: &LoadOptions) -> Result<Self, ModelError> {
        let cpu = Device::Cpu;
        let in_dim = parts[0].shape().dims2()?.1;
        let out_dim: usize = parts.iter().map(|p| p.shape().dims()[0]).sum();
        let same_dtype = parts.iter().all(|p| p.dtype() == parts[0].dtype());
        let dense_f32 = || -> Result<Tensor, ModelError> {
            let ts = parts
                .iter()
                .map(|p| p.dequantize(&cpu))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Tensor::cat(&ts, 0)?)
        };
        let stacked_bytes = || -> Result<Vec<u8>, ModelError> {
            let mut bytes = Vec::new();
            for p in &parts {
                bytes.extend_from_slice(&p.data()?);
            }
            Ok(bytes)
        };
        let quant = match options.weights {
            WeightFormat::Native if same_dtype && own_format(parts[0].dtype()).is_some() => {
                let format = own_format(parts[0].dtype()).expect("checked above");
                Kernel::Own(
                    QuantMatrix::new(format, stacked_bytes()?, out_dim, in_dim).ok_or_else(
                        || {
                            ModelError::Other(format!(
                                "{format:?} matrix {out_dim}x{in_dim} has the wrong size"
                            ))
                        },
                    )?,
                )
            }
            WeightFormat::Native if same_dtype && parts[0].dtype() != GgmlDType::F32 => {
                Kernel::Candle(QMatMul::from_qtensor(qtensor_from_ggml(
                    parts[0].dtype(),
                    &stacked_bytes()?,
                    vec![out_dim, in_dim],
                    &cpu,
                )?)?)
            }
            WeightFormat::Native => Kernel::Candle(QMatMul::Tensor(dense_f32()?)),
            WeightFormat::F32 => Kernel::Candle(QMatMul::Tensor(dense_f32()?)),
            // Quantized rows are independent blocks: stacking is concatenating bytes.
            WeightFormat::AsShipped if same_dtype && parts[0].dtype() != GgmlDType::F32 => {
                Kernel::Candle(QMatMul::from_qtensor(qtensor_from_ggml(
                    parts[0].dtype(),
                    &stacked_bytes()?,
                    vec![out_dim, in_dim],
                    &cpu,
                )?)?)
            }
            WeightFormat::AsShipped => Kernel::Candle(QMatMul::Tensor(dense_f32()?)),
            WeightFormat::Q8_0 if parts.iter().all(|p| p.dtype() == GgmlDType::Q8_0) => {
                Kernel::Candle(QMatMul::from_qtensor(qtensor_from_ggml(
                    GgmlDType::Q8_0,
                    &stacked_bytes()?,
                    vec![out_dim, in_dim],
                    &cpu,
                )?)?)
            }
            WeightFormat::Q8_0 => Kernel::Candle(QMatMul::from_qtensor(QTensor::quantize(
                &dense_f32()?,
                GgmlDType::Q8_0,
            )?)?),
        };
        let dense = match (options.dense_min_rows, &quant) {
            (_, Kernel::Candle(QMatMul::Tensor(_))) | (None, _) => None,
            (Some(_), _) => Some(QMatMul::Tensor(dense_f32()?)),
        };
        Ok(Self {
            quant,
            dense,
            dense_min_rows: options.dense_min_rows.unwrap_or(usize::MAX),
            out_dim,
        })
    }

    /// Output width.
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// `x · Wᵀ` for `rows` rows of `x` (row-major `[rows, in]`).
    pub fn forward(&self, x: Vec<f32>, rows: usize) -> Result<Vec<f32>, ModelError> {
        let in_dim = x.len() / rows.max(1);
        let w = match (&self.dense, &self.quant) {
            (Some(dense), _) if rows >= self.dense_min_rows => dense,
            (_, Kernel::Own(m)) => return Ok(m.matmul(&x, rows)),
            (_, Kernel::Candle(q)) => q,
        };
        let x = Tensor::from_vec(x, (rows, in_dim), &Device::Cpu)?;
        let y = w.forward(&x)?;
        Ok(y.flatten_all()?.to_vec1::<f32>()?)
    }
}
