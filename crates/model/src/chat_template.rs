//! Chat template from `tokenizer.chat_template`, rendered with minijinja.

use minijinja::{context, Environment, Error, ErrorKind};

use crate::error::ModelError;

/// A chat message as the template sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatTurn {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// ChatML, used when a GGUF carries no template.
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Chat template from `tokenizer.chat_template`, rendered with minijinja.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` (a Hugging Face style Jinja chat template).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        // HF templates rely on Python's whitespace handling of blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(format!("cannot parse: {e}")))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Reads the template of a GGUF file (ChatML if it has none), with the tokenizer's
    /// BOS/EOS texts.
    pub fn load(path: &std::path::Path, tokenizer: &crate::Tokenizer) -> Result<Self, ModelError> {
        let gguf = crate::gguf::GgufFile::open(path)?;
        Self::from_gguf(&gguf, tokenizer)
    }

    pub(crate) fn from_gguf(
        gguf: &crate::gguf::GgufFile,
        tokenizer: &crate::Tokenizer,
    ) -> Result<Self, ModelError> {
        match gguf.get_str("tokenizer.chat_template") {
            Ok(source) => Self::new(source, tokenizer.bos_token(), tokenizer.eos_token()),
            Err(_) => Ok(Self::chatml(tokenizer.bos_token(), tokenizer.eos_token())),
        }
    }

    /// The ChatML template, for models whose GGUF has none.
    pub fn chatml(bos_token: &str, eos_token: &str) -> Self {
        Self::new(CHATML, bos_token, eos_token).expect("the built-in ChatML template parses")
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages`.
    pub fn render(
        &self,
        messages: &[ChatTurn],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidOperation => {
                    ModelError::Template(e.detail().unwrap_or("invalid operation").to_string())
                }
                _ => ModelError::Template(e.to_string()),
            })
    }
}

impl ChatTemplate {
    /// The prompt for `messages` with the final message left open, for the model to
    /// continue it: rendered whole, then cut after that message's text, as transformers'
    /// `continue_final_message` does.
    pub fn render_open(&self, messages: &[ChatTurn]) -> Result<String, ModelError> {
        let last = messages
            .last()
            .ok_or_else(|| ModelError::Template("no message to continue".into()))?;
        let mut text = self.render(messages, false)?;
        let content = last.content.trim();
        match text.rfind(content) {
            Some(at) if !content.is_empty() => {
                text.truncate(at + content.len());
                Ok(text)
            }
            _ => Err(ModelError::Template(
                "the final message's text is not in the rendered prompt, so it cannot be left open"
                    .into(),
            )),
        }
    }
}

/// `raise_exception(msg)` as Hugging Face templates call it to reject a conversation.
fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}
