//! The guard on a decode stream whose first tokens the client already got from the
//! prefill leg: drops the role event and the first token of each choice when it equals
//! the one sent, gives the stream the prefill answer's id, and reports any other first
//! token as a mismatch.

use std::sync::Arc;

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::endpoint::Endpoint;
use crate::legs::first_token::FirstToken;

/// How the decode stream failed to continue from the tokens sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "choice {index}: the prefill worker's first token was {sent:?}, the decode worker's {got:?}"
)]
pub struct Mismatch {
    /// The choice.
    pub index: u64,
    /// The text the client got from the prefill answer.
    pub sent: String,
    /// What the decode worker generated instead (`<end>` when it ended first).
    pub got: String,
}

/// Where a choice stands on the decode stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// The decode worker has not yet generated the first token again.
    Awaiting,
    /// Its first token was dropped: the rest passes.
    Continued,
}

/// Watches one decode stream (one attempt) whose first tokens the client already got.
#[derive(Debug)]
pub struct FirstTokenGuard {
    sent: Arc<FirstToken>,
    progress: Vec<Progress>,
    /// Where the decode stream's id differs from the prefill answer's: its events' head
    /// (`data: {"id":"<decode id>"`) and that head with the prefill answer's id, made
    /// once so that each later event is a prefix swap, not a parse.
    id_swap: Option<(Vec<u8>, Vec<u8>)>,
    /// A dropped event's blank line is still to come.
    skip_blank: bool,
}

impl FirstTokenGuard {
    /// A guard for a decode stream that must continue from `sent`.
    pub fn new(sent: Arc<FirstToken>) -> Self {
        let progress = vec![Progress::Awaiting; sent.choices.len()];
        Self {
            sent,
            progress,
            id_swap: None,
            skip_blank: false,
        }
    }

    /// Whether every choice has continued from its token.
    fn settled(&self) -> bool {
        self.progress.iter().all(|p| *p == Progress::Continued)
    }

    /// Whole lines of the decode stream, as the client gets them: the role events and
    /// the first token of each choice taken out, the stream's id made the prefill
    /// answer's.
    pub fn filter(&mut self, lines: Bytes) -> Result<Bytes, Mismatch> {
        if self.settled() && !self.skip_blank && self.id_swap.is_none() {
            return Ok(lines);
        }
        let mut out = BytesMut::with_capacity(lines.len());
        for line in split_lines(&lines) {
            let bare = line.strip_suffix(b"\n").unwrap_or(line);
            let bare = bare.strip_suffix(b"\r").unwrap_or(bare);
            if std::mem::take(&mut self.skip_blank) && bare.is_empty() {
                continue;
            }
            let Some(data) = bare.strip_prefix(b"data:") else {
                out.put(line);
                continue;
            };
            let data = data.strip_prefix(b" ").unwrap_or(data);
            if data == b"[DONE]" {
                if let Some(index) = self.progress.iter().position(|p| *p == Progress::Awaiting) {
                    return Err(self.mismatch(index as u64, "<end>".into()));
                }
                out.put(line);
                continue;
            }
            if self.settled() {
                self.put_with_prefill_id(&mut out, line);
                continue;
            }
            match self.edit(data)? {
                Edit::Keep => self.put_with_prefill_id(&mut out, line),
                Edit::Drop => self.skip_blank = true,
                Edit::Replace(event) => {
                    out.put(&b"data: "[..]);
                    out.put(&event[..]);
                    out.put(&b"\n"[..]);
                }
            }
        }
        Ok(out.freeze())
    }

    /// Writes `line` to `out`, the decode stream's id at its start replaced by the
    /// prefill answer's.
    fn put_with_prefill_id(&self, out: &mut BytesMut, line: &[u8]) {
        let swapped = self
            .id_swap
            .as_ref()
            .and_then(|(head, prefill)| Some((prefill, line.strip_prefix(&head[..])?)));
        match swapped {
            Some((prefill, rest)) => {
                out.put(&prefill[..]);
                out.put(rest);
            }
            None => out.put(line),
        }
    }

    /// What becomes of one event while a choice still awaits its first token.
    fn edit(&mut self, data: &[u8]) -> Result<Edit, Mismatch> {
        if self.drops_whole(data) {
            return Ok(Edit::Drop);
        }
        let Ok(Value::Object(mut event)) = serde_json::from_slice::<Value>(data) else {
            return Ok(Edit::Keep);
        };
        if event.contains_key("error") {
            return Ok(Edit::Keep);
        }
        let Some(Value::Array(choices)) = event.get_mut("choices") else {
            return Ok(Edit::Keep);
        };
        if choices.is_empty() {
            // The usage event.
            return Ok(Edit::Keep);
        }
        let mut kept = Vec::with_capacity(choices.len());
        let mut changed = false;
        for mut choice in std::mem::take(choices) {
            match self.edit_choice(&mut choice)? {
                Edit::Keep => kept.push(choice),
                Edit::Drop => changed = true,
                Edit::Replace(_) => {
                    changed = true;
                    kept.push(choice);
                }
            }
        }
        if let Some(id) = event.get("id").and_then(Value::as_str) {
            if id != self.sent.id {
                if self.id_swap.is_none() {
                    let head = format!("data: {{\"id\":\"{id}\"").into_bytes();
                    let prefill = format!("data: {{\"id\":{}", json!(self.sent.id)).into_bytes();
                    self.id_swap = Some((head, prefill));
                }
                event.insert("id".into(), Value::String(self.sent.id.clone()));
                changed = true;
            }
        }
        if kept.is_empty() {
            return Ok(Edit::Drop);
        }
        if !changed {
            return Ok(Edit::Keep);
        }
        event.insert("choices".into(), Value::Array(kept));
        let bytes = serde_json::to_vec(&event).unwrap_or_default();
        Ok(Edit::Replace(bytes))
    }

    /// One choice of an event: `Drop` (it said nothing else), `Replace` (edited in
    /// place) or `Keep`.
    fn edit_choice(&mut self, choice: &mut Value) -> Result<Edit, Mismatch> {
        let Some(index) = choice.get("index").and_then(Value::as_u64) else {
            return Ok(Edit::Keep);
        };
        let at = index as usize;
        if self.progress.get(at) != Some(&Progress::Awaiting) {
            return Ok(Edit::Keep);
        }
        let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        let chat = self.sent.endpoint == Endpoint::Chat;
        let mut changed = false;
        let text = if chat {
            let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
                return Ok(Edit::Keep);
            };
            // The role event was sent with the token.
            changed |= delta.remove("role").is_some();
            delta
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        } else {
            choice
                .get("text")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let sent = &self.sent.choices[at].text;
        if text.is_empty() {
            if finished {
                return Err(self.mismatch(index, "<end>".into()));
            }
            let delta_empty = !chat
                || choice
                    .get("delta")
                    .and_then(Value::as_object)
                    .is_none_or(|d| d.keys().all(|k| k == "content"));
            return Ok(if delta_empty {
                Edit::Drop
            } else if changed {
                Edit::Replace(Vec::new())
            } else {
                Edit::Keep
            });
        }
        let Some(rest) = text.strip_prefix(sent.as_str()) else {
            return Err(self.mismatch(index, text));
        };
        self.progress[at] = Progress::Continued;
        if rest.is_empty() && !finished {
            return Ok(Edit::Drop);
        }
        let rest = Value::String(rest.to_string());
        if chat {
            if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                if rest.as_str() == Some("") {
                    delta.remove("content");
                } else {
                    delta.insert("content".into(), rest.clone());
                }
            }
        } else if let Some(obj) = choice.as_object_mut() {
            obj.insert("text".into(), rest.clone());
        }
        drop_first_logprob(choice, chat, rest.as_str() == Some(""));
        Ok(Edit::Replace(Vec::new()))
    }

    /// The usual case, read without building a JSON tree: an event whose every choice
    /// is a role event or exactly the token already sent (not finished), which is
    /// dropped whole. True when it is (its choices then continue); anything else is
    /// left to [`Self::edit`]'s full reading, which this mirrors.
    fn drops_whole(&mut self, data: &[u8]) -> bool {
        // An `"error"` key, even null, is the full reading's to judge.
        if memchr::memmem::find(data, b"\"error\"").is_some() {
            return false;
        }
        let Ok(event) = serde_json::from_slice::<EventView>(data) else {
            return false;
        };
        let chat = self.sent.endpoint == Endpoint::Chat;
        let Some(choices) = event.choices.as_deref() else {
            return false;
        };
        let mut seen = Vec::with_capacity(choices.len());
        let mut continued = Vec::with_capacity(choices.len());
        for choice in choices {
            let Some(at) = choice.index.map(|i| i as usize) else {
                return false;
            };
            if self.progress.get(at) != Some(&Progress::Awaiting)
                || choice.finish_reason.is_some()
                || seen.contains(&at)
            {
                return false;
            }
            seen.push(at);
            let text = match (chat, &choice.delta, &choice.text) {
                (true, Some(delta), _) => delta.content.as_deref().unwrap_or(""),
                (false, _, text) => text.as_deref().unwrap_or(""),
                (true, None, _) => return false,
            };
            if !text.is_empty() {
                if text != self.sent.choices[at].text {
                    return false;
                }
                continued.push(at);
            }
        }
        if choices.is_empty() {
            return false;
        }
        for at in continued {
            self.progress[at] = Progress::Continued;
        }
        if let Some(id) = event.id.as_deref() {
            if id != self.sent.id && self.id_swap.is_none() {
                let head = format!("data: {{\"id\":\"{id}\"").into_bytes();
                let prefill = format!("data: {{\"id\":{}", json!(self.sent.id)).into_bytes();
                self.id_swap = Some((head, prefill));
            }
        }
        true
    }

    fn mismatch(&self, index: u64, got: String) -> Mismatch {
        Mismatch {
            index,
            sent: self
                .sent
                .choices
                .get(index as usize)
                .map(|c| c.text.clone())
                .unwrap_or_default(),
            got,
        }
    }
}

/// The parts of a decode stream event the guard's usual case reads, borrowed.
#[derive(Deserialize)]
struct EventView<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: Option<Vec<ChoiceView<'a>>>,
}

/// One choice of an [`EventView`].
#[derive(Deserialize)]
struct ChoiceView<'a> {
    #[serde(default)]
    index: Option<u64>,
    /// Chat's; a delta with more than a role and content fails the reading (it is left
    /// to the full one).
    #[serde(borrow, default)]
    delta: Option<DeltaView<'a>>,
    /// Completions'.
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    /// Any value but null: the choice ends here.
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

/// A chat delta that says nothing but its role and content.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeltaView<'a> {
    #[serde(borrow, default)]
    #[allow(dead_code)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

/// What the guard does with an event or a choice.
enum Edit {
    Keep,
    Drop,
    /// An event's new JSON (a choice's edit carries none: it was edited in place).
    Replace(Vec<u8>),
}

/// Takes the first token's entry out of a choice's `logprobs` (it was sent with the
/// prefill's token); `none_left`: the choice carries no token now, its logprobs `null`.
fn drop_first_logprob(choice: &mut Value, chat: bool, none_left: bool) {
    let Some(logprobs) = choice.get_mut("logprobs") else {
        return;
    };
    if logprobs.is_null() {
        return;
    }
    if none_left {
        *logprobs = Value::Null;
        return;
    }
    let lists: &[&str] = if chat {
        &["content"]
    } else {
        &["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    };
    for key in lists {
        if let Some(Value::Array(list)) = logprobs.get_mut(*key) {
            if !list.is_empty() {
                list.remove(0);
            }
        }
    }
}

/// `bytes` cut after each `\n` (the last piece may lack one), found with `memchr`: a
/// decode stream passes here whole, event by event.
fn split_lines(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = memchr::memchr(b'\n', rest).map_or(rest.len(), |at| at + 1);
        let (line, tail) = rest.split_at(end);
        rest = tail;
        Some(line)
    })
}

#[cfg(test)]
#[path = "first_token_tests.rs"]
mod tests;
