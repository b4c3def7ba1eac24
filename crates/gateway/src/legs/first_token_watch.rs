//! The first token of a prefill worker's *streamed* answer, taken as it arrives (SGLang's
//! bootstrap handoff, whose prefill answer streams its one token at once but ends only
//! once the decode worker has read the KV): whole `data:` lines are looked at until the
//! first token of choice 0 shows, which is then handed over once.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::endpoint::Endpoint;
use crate::legs::first_token::{EventToken, FirstToken};

/// Most bytes of a line kept while waiting for its end: a prefill answer's first events
/// are small, a longer line means this stream will not lead.
const MAX_LINE: usize = 64 * 1024;

/// Watches the chunks of one streamed prefill answer for its first token.
pub struct FirstTokenWatch {
    endpoint: Endpoint,
    /// The unfinished line carried over from the last chunk.
    partial: Vec<u8>,
    /// Where the token goes; `None` once it went, or once the stream cannot lead (the
    /// receiver then hears the sender dropped).
    to: Option<oneshot::Sender<Arc<FirstToken>>>,
}

impl FirstTokenWatch {
    /// A watch that sends the first token of an `endpoint` stream to `to`.
    pub fn new(endpoint: Endpoint, to: oneshot::Sender<Arc<FirstToken>>) -> Self {
        Self {
            endpoint,
            partial: Vec::new(),
            to: Some(to),
        }
    }

    /// Looks at the next chunk of the answer.
    pub fn push(&mut self, chunk: &Bytes) {
        if self.to.is_none() {
            return;
        }
        let mut rest = &chunk[..];
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let (line, tail) = rest.split_at(end);
            rest = &tail[1..];
            let line = if self.partial.is_empty() {
                line.to_vec()
            } else {
                let mut whole = std::mem::take(&mut self.partial);
                whole.extend_from_slice(line);
                whole
            };
            if self.line(&line) {
                return;
            }
        }
        self.partial.extend_from_slice(rest);
        if self.partial.len() > MAX_LINE {
            self.give_up();
        }
    }

    /// One whole line; true once the watch is over.
    fn line(&mut self, line: &[u8]) -> bool {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return false;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.give_up();
            return true;
        }
        match FirstToken::from_event(self.endpoint, data) {
            EventToken::NotYet => false,
            EventToken::Never => {
                self.give_up();
                true
            }
            EventToken::Token(token) => {
                if let Some(to) = self.to.take() {
                    let _ = to.send(Arc::new(token));
                }
                self.partial = Vec::new();
                true
            }
        }
    }

    fn give_up(&mut self) {
        self.to = None;
        self.partial = Vec::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(endpoint: Endpoint) -> (FirstTokenWatch, oneshot::Receiver<Arc<FirstToken>>) {
        let (tx, rx) = oneshot::channel();
        (FirstTokenWatch::new(endpoint, tx), rx)
    }

    #[test]
    fn the_first_chat_token_is_taken_across_chunk_boundaries() {
        let (mut w, mut rx) = watch(Endpoint::Chat);
        let role = r#"data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#;
        let token = r#"data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}"#;
        w.push(&Bytes::from(format!("{role}\n\n")));
        assert!(rx.try_recv().is_err());
        let (a, b) = token.split_at(40);
        w.push(&Bytes::from(a.to_string()));
        w.push(&Bytes::from(format!("{b}\n\n")));
        let got = rx.try_recv().expect("the token");
        let events = String::from_utf8(got.events().to_vec()).unwrap();
        assert!(events.contains(r#""content":"Hello""#), "{events}");
        assert!(events.contains(r#""id":"c1""#), "{events}");
    }

    #[test]
    fn a_completion_token_with_length_leads() {
        let (mut w, mut rx) = watch(Endpoint::Completions);
        w.push(&Bytes::from_static(
            br#"data: {"id":"x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":"length"}]}

"#,
        ));
        assert!(rx.try_recv().is_ok());
    }

    #[test]
    fn errors_ends_and_cut_characters_never_lead() {
        for body in [
            "data: {\"error\":{\"message\":\"boom\"}}\n\n",
            "data: [DONE]\n\n",
            "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"text\":\"\u{FFFD}\",\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"x\",\"choices\":[{\"index\":1,\"text\":\"a\",\"finish_reason\":null}]}\n\n",
            "data: not json\n\n",
        ] {
            let (mut w, mut rx) = watch(Endpoint::Completions);
            w.push(&Bytes::from(body.to_string()));
            assert!(
                matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Closed)),
                "{body}"
            );
        }
    }
}
