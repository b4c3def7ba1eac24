//! Media items of a chat request (`image_url`, `audio_url`, `input_audio` and `video_url`
//! parts of `messages[].content`) and their content-derived cache keys.

use std::fmt::Write as _;

use pdserve_protocol::{ChatCompletionRequest, MessageContent};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A kind of media item that goes to the encoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    /// `{"type": "image_url", "image_url": {"url": ...}}`
    ImageUrl,
    /// `{"type": "audio_url", "audio_url": {"url": ...}}`
    AudioUrl,
    /// `{"type": "input_audio", "input_audio": {"data": ..., "format": ...}}`
    InputAudio,
    /// `{"type": "video_url", "video_url": {"url": ...}}`
    VideoUrl,
}

impl MediaKind {
    /// The kind of a content part, `None` for text and anything else.
    pub fn of(part: &Value) -> Option<Self> {
        match part.get("type")?.as_str()? {
            "image_url" => Some(Self::ImageUrl),
            "audio_url" => Some(Self::AudioUrl),
            "input_audio" => Some(Self::InputAudio),
            "video_url" => Some(Self::VideoUrl),
            _ => None,
        }
    }

    /// The part's `type`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ImageUrl => "image_url",
            Self::AudioUrl => "audio_url",
            Self::InputAudio => "input_audio",
            Self::VideoUrl => "video_url",
        }
    }

    /// The content type the item becomes once the encoder has published its embedding.
    pub fn embeds_type(self) -> &'static str {
        match self {
            Self::ImageUrl => "image_embeds",
            Self::AudioUrl | Self::InputAudio => "audio_embeds",
            Self::VideoUrl => "video_embeds",
        }
    }

    /// Audio items: their processors may consume other modalities' placeholders too.
    pub fn is_audio(self) -> bool {
        matches!(self, Self::AudioUrl | Self::InputAudio)
    }
}

/// One media item of a request, in message order.
#[derive(Debug, Clone, Copy)]
pub struct MediaItem<'a> {
    /// What it is.
    pub kind: MediaKind,
    /// The content part as the client sent it.
    pub part: &'a Value,
}

/// The content parts of every message that has a list of parts.
fn parts(request: &ChatCompletionRequest) -> impl Iterator<Item = &Value> {
    request
        .messages
        .iter()
        .filter_map(|m| match &m.content {
            Some(MessageContent::Parts(parts)) => Some(parts),
            _ => None,
        })
        .flatten()
}

/// Every media item of `request`, in message order.
pub fn extract(request: &ChatCompletionRequest) -> Vec<MediaItem<'_>> {
    parts(request)
        .filter_map(|part| MediaKind::of(part).map(|kind| MediaItem { kind, part }))
        .collect()
}

/// Whether `request` has a media item (no allocation: text requests pay one scan).
pub fn has_media(request: &ChatCompletionRequest) -> bool {
    parts(request).any(|part| MediaKind::of(part).is_some())
}

/// The item's cache key: the client's own `uuid` when it gave one, else [`content_uuid`].
pub fn item_uuid(part: &Value) -> String {
    match part.get("uuid").and_then(Value::as_str) {
        Some(uuid) if !uuid.is_empty() => uuid.to_string(),
        _ => content_uuid(part),
    }
}

/// SHA-256 (hex) of the item's URL, or of its canonical JSON when it has none.
///
/// The key must come from the content, never from the request: the encoder cache is
/// keyed by it, so a per-request key would make every request a miss. The canonical form
/// is Python's `json.dumps(item, sort_keys=True)`, so keys match vLLM's proxy.
pub fn content_uuid(part: &Value) -> String {
    let url = ["image_url", "audio_url", "video_url"]
        .iter()
        .filter_map(|key| part.get(*key)?.as_object())
        .find(|object| !object.is_empty())
        .and_then(|object| object.get("url")?.as_str())
        .filter(|url| !url.is_empty());
    let digest = match url {
        Some(url) => Sha256::digest(url.as_bytes()),
        None => {
            let mut canonical = String::new();
            write_python_json(part, &mut canonical);
            Sha256::digest(canonical.as_bytes())
        }
    };
    format!("{digest:x}")
}

/// Writes `value` as Python's `json.dumps(value, sort_keys=True)` does: `", "` and
/// `": "` separators, keys sorted, non-ASCII escaped as `\uXXXX`.
fn write_python_json(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => write_python_float(f, out),
            None => {
                let _ = write!(out, "{n}");
            }
        },
        Value::String(s) => write_python_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_str(key, out);
                out.push_str(": ");
                write_python_json(&map[key], out);
            }
            out.push('}');
        }
    }
}

fn write_python_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7f => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, positional when the decimal
/// exponent is in [-4, 16), else `d.ddde+XX`.
fn write_python_float(f: f64, out: &mut String) {
    // `{:e}` gives the shortest round-trip digits as `d.ddde<exp>`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn extracts_every_media_kind_in_message_order() {
        let request: ChatCompletionRequest = serde_json::from_value(json!({
            "messages": [
                {"role": "system", "content": "plain text"},
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                    {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
                ]},
                {"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
                    {"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}},
                    {"type": "image_embeds", "image_embeds": {}},
                ]},
            ]
        }))
        .unwrap();
        let kinds: Vec<_> = extract(&request).iter().map(|i| i.kind).collect();
        assert_eq!(
            kinds,
            [
                MediaKind::ImageUrl,
                MediaKind::InputAudio,
                MediaKind::VideoUrl,
                MediaKind::AudioUrl
            ]
        );
        assert!(has_media(&request));
        let text: ChatCompletionRequest =
            serde_json::from_value(json!({"messages": [{"role": "user", "content": "hi"}]}))
                .unwrap();
        assert!(!has_media(&text) && extract(&text).is_empty());
    }

    #[test]
    fn uuids_hash_the_url_or_the_canonical_item() {
        let image = json!({"type": "image_url", "image_url": {"url": "http://x/a.png"}});
        // sha256("http://x/a.png")
        let expected = format!("{:x}", Sha256::digest(b"http://x/a.png"));
        assert_eq!(content_uuid(&image), expected);
        let detail =
            json!({"image_url": {"detail": "low", "url": "http://x/a.png"}, "type": "image_url"});
        assert_eq!(content_uuid(&detail), expected, "only the URL counts");
        assert_eq!(
            item_uuid(&json!({"type": "image_url", "image_url": {"url": "u"}, "uuid": "mine"})),
            "mine"
        );

        // Python: json.dumps({"type": "input_audio", "input_audio": {"format": "wav",
        //   "data": "AAA"}, "n": 1.5, "é": [1e16, 0.0001, 1e-05]}, sort_keys=True)
        let audio = json!({"type": "input_audio", "input_audio": {"format": "wav", "data": "AAA"},
                           "n": 1.5, "é": [1e16, 0.0001, 1e-5]});
        let mut canonical = String::new();
        write_python_json(&audio, &mut canonical);
        assert_eq!(
            canonical,
            r#"{"input_audio": {"data": "AAA", "format": "wav"}, "n": 1.5, "type": "input_audio", "\u00e9": [1e+16, 0.0001, 1e-05]}"#
        );
        assert_eq!(
            content_uuid(&audio),
            format!("{:x}", Sha256::digest(canonical.as_bytes()))
        );
        let mut s = String::new();
        write_python_json(
            &json!(["a\"\\\n\u{1}😀", 3, 100.0, -2.5e-7, 123456789.125]),
            &mut s,
        );
        assert_eq!(
            s,
            r#"["a\"\\\n\u0001\ud83d\ude00", 3, 100.0, -2.5e-07, 123456789.125]"#
        );
    }
}
