//! A prompt as clients give it — text, or chat messages for the template — turned into
//! the token ids the model computes, as vLLM's `/tokenize` does it.

use crate::{ChatTemplate, ChatTurn, ModelError, Tokenizer};

/// What to tokenize, and how.
#[derive(Debug, Clone, Copy)]
pub enum PromptInput<'a> {
    /// A completion's text; `add_special_tokens` adds BOS where the model wants one.
    Text {
        text: &'a str,
        add_special_tokens: bool,
    },
    /// Chat messages rendered with the model's template.
    Chat {
        turns: &'a [ChatTurn],
        /// End with the assistant turn's opening.
        add_generation_prompt: bool,
        /// Leave the final message open for the model to continue it.
        continue_final_message: bool,
        /// Special tokens on top of the template's own.
        add_special_tokens: bool,
    },
}

/// The token ids of `input`.
pub fn tokenize(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    input: PromptInput<'_>,
) -> Result<Vec<u32>, ModelError> {
    match input {
        PromptInput::Text {
            text,
            add_special_tokens,
        } => tokenizer.encode(text, add_special_tokens),
        PromptInput::Chat {
            turns,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens,
        } => {
            if add_generation_prompt && continue_final_message {
                return Err(ModelError::Template(
                    "cannot set both continue_final_message and add_generation_prompt to true"
                        .into(),
                ));
            }
            let text = if continue_final_message {
                template.render_open(turns)?
            } else {
                template.render(turns, add_generation_prompt)?
            };
            tokenizer.encode(&text, add_special_tokens)
        }
    }
}
