//! Byte-level BPE tokenizer built from a GGUF's `tokenizer.ggml.*` metadata, or read
//! from a Hugging Face `tokenizer.json` ([`hf_folder`]).

pub mod hf_folder;
mod segments;

use std::collections::HashMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::ModelError;
use crate::gguf::GgufFile;
use segments::SegmentCache;

/// GGUF token type of control tokens (`<|im_start|>`): special, matched whole.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF token type of user-defined tokens: matched whole, but not special.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// llama.cpp's `llama-bpe` (Llama 3) split pattern.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `qwen2` split pattern.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Tokenizer built from `tokenizer.ggml.*` or read from `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    add_bos: bool,
    /// Special tokens come from `inner`'s own post-processor (a `tokenizer.json`); a
    /// GGUF's tokenizer has none, and `add_bos` alone decides.
    post_processed: bool,
    bos_token: String,
    eos_token: String,
    /// Ids of text pieces seen before ([`Tokenizer::cache_pieces`]); off by default.
    pieces: Option<SegmentCache>,
}

impl Tokenizer {
    /// Reads only the tokenizer from a GGUF file (no weights).
    pub fn load(path: &std::path::Path) -> Result<Self, ModelError> {
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// Builds the tokenizer from an opened GGUF.
    pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)"
            )));
        }
        let tokens = gguf.get_strings("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = gguf
            .get_strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge `{m}`")))
            })
            .collect::<Result<_, _>>()?;
        let token_types = gguf
            .get_ints("tokenizer.ggml.token_type")
            .unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.to_string(), id as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| ModelError::Tokenizer(format!("building BPE: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let marked = |wanted: i64| {
            tokens
                .iter()
                .zip(token_types.iter())
                .filter(move |(_, &ty)| ty == wanted)
                .map(|(t, _)| t.to_string())
        };
        let special: Vec<AddedToken> = marked(TOKEN_TYPE_CONTROL)
            .map(|t| AddedToken::from(t, true).normalized(false))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| ModelError::Tokenizer(format!("special tokens: {e}")))?;
        let user: Vec<AddedToken> = marked(TOKEN_TYPE_USER_DEFINED)
            .map(|t| AddedToken::from(t, false).normalized(false))
            .collect();
        if !user.is_empty() {
            inner
                .add_tokens(user)
                .map_err(|e| ModelError::Tokenizer(format!("added tokens: {e}")))?;
        }

        let id_in_vocab = |key: &str| {
            gguf.get_usize(key)
                .ok()
                .filter(|&id| id < tokens.len())
                .map(|id| id as u32)
        };
        let bos_token_id = id_in_vocab("tokenizer.ggml.bos_token_id");
        let eos = id_in_vocab("tokenizer.ggml.eos_token_id");
        // End-of-turn markers also end generation even when the file names another EOS.
        let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
        for marker in [
            "<|im_end|>",
            "<|eot_id|>",
            "<|endoftext|>",
            "<|end_of_text|>",
        ] {
            if let Some(id) = inner.token_to_id(marker) {
                if token_types.get(id as usize) == Some(&TOKEN_TYPE_CONTROL)
                    && !eos_token_ids.contains(&id)
                {
                    eos_token_ids.push(id);
                }
            }
        }
        if let Some(eot) = id_in_vocab("tokenizer.ggml.eot_token_id") {
            if !eos_token_ids.contains(&eot) {
                eos_token_ids.push(eot);
            }
        }
        let text_of = |id: Option<u32>| {
            id.map(|i| tokens[i as usize].to_string())
                .unwrap_or_default()
        };
        let add_bos = matches!(
            gguf.get("tokenizer.ggml.add_bos_token"),
            Ok(candle_core::quantized::gguf_file::Value::Bool(true))
        );
        Ok(Self {
            inner,
            bos_token: text_of(bos_token_id),
            eos_token: text_of(eos),
            bos_token_id,
            eos_token_ids,
            add_bos,
            post_processed: false,
            pieces: None,
        })
    }

    /// Token ids of `text`; `add_special_tokens` adds BOS where the model wants one.
    /// Special tokens written in the text (`<|im_start|>`) are always recognised.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        if let Some(pieces) = &self.pieces {
            // A post-processor sees the whole sequence: that case is not cut into pieces.
            if !(add_special_tokens && self.post_processed) {
                let mut ids = Vec::new();
                if add_special_tokens && self.add_bos {
                    ids.extend(self.bos_token_id);
                }
                let encoded = pieces
                    .encode(&self.inner, text)
                    .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
                if ids.is_empty() {
                    return Ok(encoded);
                }
                ids.extend_from_slice(&encoded);
                return Ok(ids);
            }
        }
        let encoding = self
            .inner
            .encode(text, add_special_tokens && self.post_processed)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        let encoded = encoding.get_ids();
        // A post-processor that already added BOS is not second-guessed.
        let has_bos = self.post_processed
            && self.bos_token_id.is_some()
            && encoded.first() == self.bos_token_id.as_ref();
        if add_special_tokens && self.add_bos && !has_bos {
            ids.extend(self.bos_token_id);
        }
        ids.extend_from_slice(encoded);
        Ok(ids)
    }

    /// Remembers the ids of the text pieces between added tokens (system prompts, earlier
    /// turns), up to about `max_bytes`, so that [`Tokenizer::encode`] encodes only pieces
    /// it has not seen; the ids are the same. Returns whether this tokenizer can (its added
    /// tokens match literally, as a GGUF's do) and `max_bytes` is not 0.
    pub fn cache_pieces(&mut self, max_bytes: usize) -> bool {
        self.pieces = SegmentCache::new(&self.inner, max_bytes);
        self.pieces.is_some()
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// End-of-sequence token ids.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Beginning-of-sequence token id, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Text of the BOS token (empty if none), as chat templates see it.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// Text of the EOS token (empty if none), as chat templates see it.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The vocabulary spelling of one token (byte-level alphabet), for logprob output.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The raw bytes one token stands for (`Ġthe` → `b" the"`); a token may hold part of a
    /// UTF-8 character, so this is bytes, not text (OpenAI logprobs report them as `bytes`).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let spelling = self.inner.id_to_token(id)?;
        let table = unicode_to_byte();
        let mut out = Vec::with_capacity(spelling.len());
        for c in spelling.chars() {
            match table.get(&c) {
                Some(&b) => out.push(b),
                // Added tokens may be spelled outside the byte alphabet: keep them as text.
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        Some(out)
    }

    /// The id of a token spelled exactly so (e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Inverse of GPT-2's byte-to-character alphabet used by byte-level BPE vocabularies.
fn unicode_to_byte() -> &'static HashMap<char, u8> {
    static TABLE: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next = 256u32;
        (0..=255u8)
            .map(|b| {
                let c = if printable(b) {
                    char::from(b)
                } else {
                    next += 1;
                    char::from_u32(next - 1).expect("valid code point")
                };
                (c, b)
            })
            .collect()
    })
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let split = |pattern: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let split = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| ModelError::Tokenizer(format!("split pattern: {e}")))?;
        Ok(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])
        .into())
    };
    Ok(match pre {
        // SmolLM: every digit on its own, then GPT-2's split, no prefix space.
        "smollm" => Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into(),
        "llama-bpe" | "llama3" | "llama-v3" | "dbrx" | "smaug-bpe" | "falcon3" => {
            split(LLAMA3_SPLIT)?
        }
        "qwen2" | "deepseek-r1-qwen" => split(QWEN2_SPLIT)?,
        "gpt2" | "default" | "gpt-2" => ByteLevel::new(false, true, true).into(),
        other => {
            tracing::warn!(
                pre = other,
                "unknown pre-tokenizer; using GPT-2's byte-level split"
            );
            ByteLevel::new(false, true, true).into()
        }
    })
}

/// Turns a stream of generated ids into text pieces holding only whole UTF-8 characters.
///
/// Owns its state (not the tokenizer), so a sequence can keep one across steps.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder; `skip_special_tokens` drops control tokens from the text.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Adds one token; returns the new text once it forms whole characters.
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() <= prefix.len()
            || full.ends_with('\u{FFFD}')
            || !full.starts_with(prefix.as_str())
        {
            return Ok(None);
        }
        let piece = full[prefix.len()..].to_string();
        // Keep a few tokens of context: byte-level decoders need the neighbours of a token.
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        Ok(Some(piece))
    }

    /// Text of tokens still held back (an incomplete character at the end), lossily decoded.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, ModelError> {
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        if full.len() > prefix.len() && full.starts_with(prefix.as_str()) {
            Ok(Some(full[prefix.len()..].to_string()))
        } else {
            Ok(None)
        }
    }
}
