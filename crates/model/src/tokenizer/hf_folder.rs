//! A tokenizer and chat template from a Hugging Face model folder (`tokenizer.json`,
//! `tokenizer_config.json`, `chat_template.jinja`), as vLLM and SGLang workers load them:
//! the tokenizer's own post-processor adds special tokens, `tokenizer_config.json` names
//! BOS/EOS and the template.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::Tokenizer;
use crate::error::ModelError;
use crate::ChatTemplate;

/// End-of-turn markers that end generation when they are special tokens.
const END_MARKERS: [&str; 4] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
];

/// The folder's `tokenizer_config.json` (empty when it has none).
struct TokenizerConfig(Value);

impl TokenizerConfig {
    fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(Self(Value::Null));
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        serde_json::from_str(&text)
            .map(Self)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// A special token's text: a string, or an `AddedToken` object's `content`.
    fn token(&self, key: &str) -> Option<String> {
        match &self.0[key] {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
            _ => None,
        }
    }

    /// The template: a string, or the `default` of a list of named templates.
    fn chat_template(&self) -> Option<String> {
        match &self.0["chat_template"] {
            Value::String(s) => Some(s.clone()),
            Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| named.first())?["template"]
                .as_str()
                .map(str::to_string),
            _ => None,
        }
    }
}

/// The folder holding `path`'s tokenizer: `path` itself, or a `tokenizer.json`'s parent.
fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if path.file_name().is_some_and(|n| n == "tokenizer.json") => {
            parent.to_path_buf()
        }
        _ => path.to_path_buf(),
    }
}

impl Tokenizer {
    /// Reads `tokenizer.json` and `tokenizer_config.json` from a Hugging Face model
    /// folder (`path` is the folder or its `tokenizer.json`).
    pub fn from_hf_folder(path: &Path) -> Result<Self, ModelError> {
        let dir = folder_of(path);
        let file = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", file.display())))?;
        let config = TokenizerConfig::read(&dir)?;
        let id_of = |text: &Option<String>| text.as_deref().and_then(|t| inner.token_to_id(t));
        let (bos_token, eos_token) = (config.token("bos_token"), config.token("eos_token"));
        let (bos_token_id, eos) = (id_of(&bos_token), id_of(&eos_token));
        let special = inner.get_added_tokens_decoder();
        let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
        for marker in END_MARKERS {
            if let Some(id) = inner.token_to_id(marker) {
                if special.get(&id).is_some_and(|t| t.special) && !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        Ok(Self {
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
            bos_token_id,
            eos_token_ids,
            // Llama 2 style configs ask for BOS here; Llama 3 style tokenizers add it
            // in their post-processor. `encode` honours both, once.
            add_bos: config.0["add_bos_token"] == Value::Bool(true),
            post_processed: true,
            pieces: None,
            inner,
        })
    }

    /// This tokenizer in Hugging Face's `tokenizer.json` format.
    pub fn to_hf_json(&self) -> Result<String, ModelError> {
        self.inner
            .to_string(false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }
}

impl ChatTemplate {
    /// The chat template of a Hugging Face model folder: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template`, else ChatML.
    pub fn from_hf_folder(path: &Path, tokenizer: &Tokenizer) -> Result<Self, ModelError> {
        let dir = folder_of(path);
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|e| ModelError::Template(format!("{}: {e}", jinja.display())))?,
            )
        } else {
            TokenizerConfig::read(&dir)
                .map_err(|e| ModelError::Template(e.to_string()))?
                .chat_template()
        };
        match source {
            Some(source) => Self::new(&source, tokenizer.bos_token(), tokenizer.eos_token()),
            None => Ok(Self::chatml(tokenizer.bos_token(), tokenizer.eos_token())),
        }
    }
}

/// Whether `path` names a Hugging Face tokenizer (a folder with `tokenizer.json`, or
/// the file itself) rather than a GGUF.
pub fn is_hf_tokenizer(path: &Path) -> bool {
    if path.is_dir() {
        return path.join("tokenizer.json").exists();
    }
    path.file_name().is_some_and(|n| n == "tokenizer.json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;

    /// A folder holding a word-level tokenizer whose post-processor adds `<s>`.
    fn folder(name: &str, config: Value) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pdserve-hf-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vocab = [
            ("<unk>", 0),
            ("<s>", 1),
            ("</s>", 2),
            ("hello", 3),
            ("world", 4),
        ]
        .into_iter()
        .map(|(t, i)| (t.to_string(), i))
        .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("<unk>".into())
            .build()
            .unwrap();
        let mut tokenizer = tokenizers::Tokenizer::new(model);
        tokenizer.with_pre_tokenizer(Some(WhitespaceSplit));
        tokenizer
            .add_special_tokens(vec![
                AddedToken::from("<s>", true),
                AddedToken::from("</s>", true),
            ])
            .unwrap();
        tokenizer.with_post_processor(Some(
            TemplateProcessing::builder()
                .try_single("<s> $A")
                .unwrap()
                .special_tokens(vec![("<s>", 1)])
                .build()
                .unwrap(),
        ));
        tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        dir
    }

    #[test]
    fn the_post_processor_adds_bos_once_and_the_config_names_tokens_and_template() {
        let config = serde_json::json!({
            "add_bos_token": true,
            "bos_token": {"__type": "AddedToken", "content": "<s>"},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"},
            ],
        });
        let dir = folder("bos", config);
        let tokenizer = Tokenizer::from_hf_folder(&dir).unwrap();
        assert_eq!(tokenizer.encode("hello world", true).unwrap(), [1, 3, 4]);
        assert_eq!(tokenizer.encode("hello world", false).unwrap(), [3, 4]);
        assert_eq!(tokenizer.bos_token_id(), Some(1));
        assert_eq!(tokenizer.eos_token_ids(), [2]);
        assert_eq!(
            (tokenizer.bos_token(), tokenizer.eos_token()),
            ("<s>", "</s>")
        );
        let template =
            ChatTemplate::from_hf_folder(&dir.join("tokenizer.json"), &tokenizer).unwrap();
        let turn = crate::ChatTurn {
            role: "user".into(),
            content: "hello".into(),
        };
        assert_eq!(template.render(&[turn], true).unwrap(), "<s>hello ");
        assert!(is_hf_tokenizer(&dir) && is_hf_tokenizer(&dir.join("tokenizer.json")));
        assert!(!is_hf_tokenizer(&dir.join("model.gguf")));

        // chat_template.jinja wins over the config's.
        std::fs::write(dir.join("chat_template.jinja"), "jinja").unwrap();
        let template = ChatTemplate::from_hf_folder(&dir, &tokenizer).unwrap();
        assert_eq!(template.render(&[], false).unwrap(), "jinja");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_folder_without_config_has_no_special_names_and_chatml() {
        let dir = folder("bare", Value::Null);
        std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
        let tokenizer = Tokenizer::from_hf_folder(&dir).unwrap();
        // The post-processor still adds what it adds.
        assert_eq!(tokenizer.encode("world", true).unwrap(), [1, 4]);
        assert_eq!(tokenizer.bos_token_id(), None);
        let template = ChatTemplate::from_hf_folder(&dir, &tokenizer).unwrap();
        assert!(template.source().contains("<|im_start|>"));
        let missing = Tokenizer::from_hf_folder(&dir.join("nowhere"));
        assert!(missing.is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
