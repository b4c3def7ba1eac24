//! Turning generated token ids into the text a client sees: incremental detokenization
//! (whole UTF-8 characters only) and stop strings (the stop text and everything after it
//! is cut; text that might be the start of a stop string is held back while streaming).

/// What the output side needs from a tokenizer.
pub trait TokenText {
    /// Text of `ids`, special tokens skipped. Incomplete UTF-8 shows as U+FFFD.
    fn decode(&self, ids: &[u32]) -> String;
    /// Raw bytes of one token, special tokens included (for logprobs).
    fn token_bytes(&self, id: u32) -> Vec<u8>;
}

impl TokenText for pdserve_model::Tokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        pdserve_model::Tokenizer::decode(self, ids, true).unwrap_or_default()
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        pdserve_model::Tokenizer::token_bytes(self, id).unwrap_or_default()
    }
}

/// Incremental detokenizer: decodes a sliding window of recent ids so that multi-token
/// characters and merges are emitted once they are complete (the TGI/vLLM approach).
#[derive(Debug, Default)]
struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    fn push(&mut self, tok: &impl TokenText, id: u32) -> String {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset]);
        let text = tok.decode(&self.ids[self.prefix_offset..]);
        if text.len() > prefix.len()
            && text.starts_with(&prefix)
            && !text.ends_with(char::REPLACEMENT_CHARACTER)
        {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            text[prefix.len()..].to_string()
        } else {
            String::new()
        }
    }

    /// Whatever is still pending at the end (an incomplete character decodes as U+FFFD).
    fn finish(&mut self, tok: &impl TokenText) -> String {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset]);
        let text = tok.decode(&self.ids[self.prefix_offset..]);
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        match text.strip_prefix(&prefix) {
            Some(rest) => rest.to_string(),
            None => String::new(),
        }
    }
}

/// One token's contribution to the output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextStep {
    /// Text that can be sent now (may be empty).
    pub text: String,
    /// A stop string was found: the output ends here.
    pub stopped: bool,
}

/// Output text of one sequence, with stop-string handling.
#[derive(Debug)]
pub struct OutputText {
    decoder: IncrementalDecoder,
    stops: Vec<String>,
    /// Every character decoded so far (up to a stop string).
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    stopped: bool,
}

impl OutputText {
    /// Output with the given stop strings (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            decoder: IncrementalDecoder::default(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// Text handed out so far, in bytes (OpenAI `text_offset` counts these).
    pub fn sent_len(&self) -> usize {
        self.sent
    }

    /// Adds a generated token.
    pub fn push(&mut self, tok: &impl TokenText, id: u32) -> TextStep {
        if self.stopped {
            return TextStep {
                text: String::new(),
                stopped: true,
            };
        }
        let delta = self.decoder.push(tok, id);
        self.append(&delta)
    }

    /// Ends the output: the held-back tail, unless a stop string cut it.
    pub fn finish(&mut self, tok: &impl TokenText) -> String {
        if self.stopped {
            return String::new();
        }
        let tail = self.decoder.finish(tok);
        let step = self.append(&tail);
        if step.stopped {
            return step.text;
        }
        let mut rest = step.text;
        rest.push_str(&self.text[self.sent..]);
        self.sent = self.text.len();
        rest
    }

    fn append(&mut self, delta: &str) -> TextStep {
        let searched_from = self.text.len();
        self.text.push_str(delta);
        if self.stops.is_empty() {
            let text = self.text[self.sent..].to_string();
            self.sent = self.text.len();
            return TextStep {
                text,
                stopped: false,
            };
        }
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop string may straddle old and new text.
        let mut from = searched_from.saturating_sub(longest - 1).max(self.sent);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            self.stopped = true;
            let text = self.text[self.sent..].to_string();
            self.sent = self.text.len();
            return TextStep {
                text,
                stopped: true,
            };
        }
        // Hold back the longest tail that could still grow into a stop string.
        let unsent = &self.text[self.sent..];
        let hold = (1..longest.min(unsent.len() + 1))
            .rev()
            .find(|&k| {
                unsent.is_char_boundary(unsent.len() - k)
                    && self
                        .stops
                        .iter()
                        .any(|s| s.len() > k && s.is_char_boundary(k) && unsent.ends_with(&s[..k]))
            })
            .unwrap_or(0);
        let end = self.text.len() - hold;
        let text = self.text[self.sent..end].to_string();
        self.sent = end;
        TextStep {
            text,
            stopped: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level fake: token `b` is the single byte `b`; 0 is a special token.
    struct Bytes;

    impl TokenText for Bytes {
        fn decode(&self, ids: &[u32]) -> String {
            let bytes: Vec<u8> = ids.iter().filter(|&&i| i != 0).map(|&i| i as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        fn token_bytes(&self, id: u32) -> Vec<u8> {
            vec![id as u8]
        }
    }

    fn ids(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    fn run(stops: &[&str], input: &[u32]) -> (Vec<String>, String, bool) {
        let mut out = OutputText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut steps = Vec::new();
        let mut stopped = false;
        for &id in input {
            let step = out.push(&Bytes, id);
            steps.push(step.text);
            if step.stopped {
                stopped = true;
                break;
            }
        }
        let tail = out.finish(&Bytes);
        (steps, tail, stopped)
    }

    #[test]
    fn multibyte_characters_are_emitted_whole() {
        let (steps, tail, _) = run(&[], &ids("aé€"));
        assert_eq!(steps, vec!["a", "", "é", "", "", "€"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn special_tokens_produce_no_text() {
        let (steps, _, _) = run(&[], &[104, 0, 105]);
        assert_eq!(steps.concat(), "hi");
    }

    #[test]
    fn stop_string_is_cut_with_everything_after_it() {
        let (steps, tail, stopped) = run(&["END"], &ids("hello ENDworld"));
        assert!(stopped);
        assert_eq!(steps.concat() + &tail, "hello ");
    }

    #[test]
    fn partial_stop_prefix_is_held_back_then_released() {
        let (steps, tail, stopped) = run(&["ab"], &ids("xaac"));
        assert!(!stopped);
        assert_eq!(steps, vec!["x", "", "a", "ac"]);
        assert_eq!(tail, "");
        // Held back at the very end is flushed by finish.
        let (steps, tail, _) = run(&["ab"], &ids("xa"));
        assert_eq!((steps.concat(), tail), ("x".to_string(), "a".to_string()));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (steps, tail, stopped) = run(&["zz", "\n"], &ids("ab\ncdzz"));
        assert!(stopped);
        assert_eq!(steps.concat() + &tail, "ab");
    }
}
