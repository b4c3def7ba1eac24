//! Reading and validating a GGUF file's header: model shape, tokenizer and template metadata.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};

use crate::config::{Hyperparams, ModelConfig};
use crate::error::ModelError;

/// Architectures whose tensors follow llama's layout and interleaved RoPE.
const LLAMA_FAMILY: &[&str] = &["llama", "mistral"];

/// Whether the file starts with the GGUF magic bytes.
pub(crate) fn has_gguf_magic(path: &Path) -> std::io::Result<bool> {
    let mut magic = [0u8; 4];
    File::open(path)?.read_exact(&mut magic)?;
    Ok(&magic == b"GGUF")
}

/// An opened GGUF: parsed header plus a reader positioned anywhere in the file.
pub(crate) struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    pub reader: BufReader<File>,
}

impl GgufFile {
    /// Opens and parses the header, rejecting files that are not GGUF.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let invalid = |reason: String| ModelError::InvalidGguf {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(|source| ModelError::Io {
            context: "opening model",
            path: path.to_path_buf(),
            source,
        })?;
        match has_gguf_magic(path) {
            Ok(true) => {}
            Ok(false) => {
                return Err(invalid(
                    "the file does not start with the GGUF magic bytes".into(),
                ))
            }
            Err(e) => return Err(invalid(format!("cannot read the header: {e}"))),
        }
        let mut reader = BufReader::new(file);
        let content =
            Content::read(&mut reader).map_err(|e| invalid(format!("bad header: {e}")))?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Result<&Value, ModelError> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| ModelError::MissingMetadata(key.to_string()))
    }

    /// A metadata value read as an unsigned integer of any width.
    pub fn get_usize(&self, key: &str) -> Result<usize, ModelError> {
        let v = self.get(key)?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => return Err(ModelError::MissingMetadata(key.to_string())),
        };
        Ok(n as usize)
    }

    /// A metadata value read as a float.
    pub fn get_f32(&self, key: &str) -> Result<f32, ModelError> {
        match self.get(key)? {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            _ => Err(ModelError::MissingMetadata(key.to_string())),
        }
    }

    /// A metadata string.
    pub fn get_str(&self, key: &str) -> Result<&str, ModelError> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            _ => Err(ModelError::MissingMetadata(key.to_string())),
        }
    }

    /// A metadata array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, ModelError> {
        match self.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    _ => Err(ModelError::MissingMetadata(key.to_string())),
                })
                .collect(),
            _ => Err(ModelError::MissingMetadata(key.to_string())),
        }
    }

    /// A metadata array of integers.
    pub fn get_ints(&self, key: &str) -> Result<Vec<i64>, ModelError> {
        match self.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Ok(*x as i64),
                    Value::U32(x) => Ok(*x as i64),
                    Value::I64(x) => Ok(*x),
                    Value::U8(x) => Ok(*x as i64),
                    Value::I8(x) => Ok(*x as i64),
                    _ => Err(ModelError::MissingMetadata(key.to_string())),
                })
                .collect(),
            _ => Err(ModelError::MissingMetadata(key.to_string())),
        }
    }

    /// Model shape and hyperparameters, checked for consistency.
    pub fn hyperparams(&self) -> Result<Hyperparams, ModelError> {
        let arch = self.get_str("general.architecture")?.to_string();
        if !LLAMA_FAMILY.contains(&arch.as_str()) {
            return Err(ModelError::UnsupportedArchitecture(arch));
        }
        if self
            .content
            .metadata
            .contains_key(&format!("{arch}.expert_count"))
            && self.get_usize(&format!("{arch}.expert_count")).unwrap_or(0) > 1
        {
            return Err(ModelError::UnsupportedArchitecture(format!(
                "{arch} (mixture of experts)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = self.get_usize(&key("embedding_length"))?;
        let num_heads = self.get_usize(&key("attention.head_count"))?;
        let num_kv_heads = self
            .get_usize(&key("attention.head_count_kv"))
            .unwrap_or(num_heads);
        let num_layers = self.get_usize(&key("block_count"))?;
        let ffn_size = self.get_usize(&key("feed_forward_length"))?;
        let context_length = self.get_usize(&key("context_length"))?;
        let rms_eps = self.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = self.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
        if num_heads == 0
            || num_kv_heads == 0
            || !hidden_size.is_multiple_of(num_heads)
            || !num_heads.is_multiple_of(num_kv_heads)
        {
            return Err(self.invalid(format!(
                "inconsistent attention shape: hidden {hidden_size}, heads {num_heads}, kv heads {num_kv_heads}"
            )));
        }
        let head_dim = hidden_size / num_heads;
        let rope_dim = self
            .get_usize(&key("rope.dimension_count"))
            .unwrap_or(head_dim);
        if rope_dim != head_dim || !head_dim.is_multiple_of(2) {
            return Err(self.invalid(format!(
                "partial RoPE ({rope_dim} of {head_dim} dims) is not supported"
            )));
        }
        let embd = self
            .content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| self.invalid("tensor token_embd.weight is missing".into()))?;
        let dims = embd.shape.dims();
        if dims.len() != 2 || dims[1] != hidden_size {
            return Err(self.invalid(format!("token_embd.weight has shape {dims:?}")));
        }
        let vocab_size = dims[0];
        for name in
            ["output_norm.weight"]
                .into_iter()
                .map(String::from)
                .chain((0..num_layers).flat_map(|l| {
                    [
                        "attn_norm",
                        "attn_q",
                        "attn_k",
                        "attn_v",
                        "attn_output",
                        "ffn_norm",
                        "ffn_gate",
                        "ffn_up",
                        "ffn_down",
                    ]
                    .map(|t| format!("blk.{l}.{t}.weight"))
                }))
        {
            if !self.content.tensor_infos.contains_key(&name) {
                return Err(self.invalid(format!("tensor {name} is missing")));
            }
        }
        Ok(Hyperparams {
            config: ModelConfig {
                architecture: arch,
                num_layers,
                num_heads,
                num_kv_heads,
                head_dim,
                hidden_size,
                vocab_size,
                context_length,
            },
            ffn_size,
            rms_eps,
            rope_base,
        })
    }

    fn invalid(&self, reason: String) -> ModelError {
        ModelError::InvalidGguf {
            path: self.path.clone(),
            reason,
        }
    }
}

/// Parses a GGUF's header and checks it describes a model this crate can run.
pub fn inspect(path: &Path) -> Result<ModelConfig, ModelError> {
    Ok(GgufFile::open(path)?.hyperparams()?.config)
}
