//! What the store keeps: conversations, their items, and stored responses, in the shapes
//! the OpenAI API gives them.

use rand::Rng;
use serde_json::{json, Map, Value};

/// A conversation's `metadata`: string keys to string values.
pub type Metadata = Map<String, Value>;

/// Most `metadata` pairs, as OpenAI allows.
pub const MAX_METADATA_PAIRS: usize = 16;
/// Longest `metadata` key, in characters.
pub const MAX_METADATA_KEY_CHARS: usize = 64;
/// Longest `metadata` value, in characters.
pub const MAX_METADATA_VALUE_CHARS: usize = 512;
/// Most items one request may add to a conversation.
pub const MAX_ITEMS_PER_REQUEST: usize = 20;

/// One conversation (OpenAI's `conversation` object).
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// `conv_…`.
    pub id: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Its metadata (`{}` when none).
    pub metadata: Metadata,
}

impl Conversation {
    /// The object clients get.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        })
    }
}

/// One item of a conversation, as it was added (its JSON, `id` included).
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// Its `id` (`msg_…`, `fc_…`, or the client's own).
    pub id: String,
    /// The response whose input or output it was, if any.
    pub response_id: Option<String>,
    /// The item as clients get it.
    pub body: Value,
}

/// A page of a conversation's items (OpenAI's `list` object).
#[derive(Debug, Clone, PartialEq)]
pub struct ItemPage {
    /// The items, in the order asked for.
    pub items: Vec<Item>,
    /// Whether more follow `last_id` in that order.
    pub has_more: bool,
}

impl ItemPage {
    /// The `list` object clients get.
    pub fn to_json(&self) -> Value {
        let ids = |item: Option<&Item>| item.map_or(Value::Null, |i| Value::from(i.id.clone()));
        json!({
            "object": "list",
            "data": self.items.iter().map(|i| i.body.clone()).collect::<Vec<_>>(),
            "first_id": ids(self.items.first()),
            "last_id": ids(self.items.last()),
            "has_more": self.has_more,
        })
    }
}

/// Which way a list runs: by when items were added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Oldest first.
    Asc,
    /// Newest first (OpenAI's default).
    Desc,
}

/// What a list of items asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    /// Items after this one, in `order`.
    pub after: Option<String>,
    /// At most this many (1 to 100).
    pub limit: usize,
    /// Which way.
    pub order: Order,
}

/// A stored response and the turn it was: what the client sent, in full (the chain's
/// earlier turns are not repeated), and what it got.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// `resp_…`.
    pub id: String,
    /// The turn before it, if any.
    pub previous_response_id: Option<String>,
    /// The conversation it was a turn of, if any.
    pub conversation_id: Option<String>,
    /// Unix seconds.
    pub created_at: i64,
    /// This turn's input items (the request's `input`, as items).
    pub input: Vec<Value>,
    /// The response object as the client got it (its `output` is the turn's output).
    pub response: Value,
    /// The worker that answered and the handle of the KV it kept, where it kept one: the
    /// next turn's fast path (a miss costs a recompute, never a wrong answer).
    pub kv_route: Option<Value>,
}

impl StoredResponse {
    /// The turn's output items.
    pub fn output(&self) -> Vec<Value> {
        self.response
            .get("output")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    }
}

/// A fresh id: `prefix` and 48 hex digits (24 random bytes).
pub fn new_id(prefix: &str) -> String {
    let bytes: [u8; 24] = rand::rng().random();
    let mut id = String::with_capacity(prefix.len() + 49);
    id.push_str(prefix);
    id.push('_');
    for b in bytes {
        id.push_str(&format!("{b:02x}"));
    }
    id
}

/// The id prefix OpenAI gives an item of `kind` (`message` → `msg`).
pub fn item_prefix(kind: &str) -> &'static str {
    match kind {
        "message" => "msg",
        "function_call" => "fc",
        "function_call_output" => "fco",
        "reasoning" => "rs",
        _ => "item",
    }
}

/// The `id` of item `body`, giving it a fresh one (of its type's prefix) when it has none.
pub fn ensure_item_id(body: &mut Value) -> String {
    if let Some(given) = body.get("id").and_then(Value::as_str) {
        return given.to_string();
    }
    let kind = body
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    let fresh = new_id(item_prefix(kind));
    if let Some(object) = body.as_object_mut() {
        object.insert("id".into(), Value::from(fresh.clone()));
    }
    fresh
}

/// Checks `metadata` against OpenAI's limits; the message names what is wrong.
pub fn check_metadata(metadata: &Metadata) -> Result<(), String> {
    if metadata.len() > MAX_METADATA_PAIRS {
        return Err(format!(
            "metadata has {} pairs; at most {MAX_METADATA_PAIRS} are allowed",
            metadata.len()
        ));
    }
    for (key, value) in metadata {
        if key.chars().count() > MAX_METADATA_KEY_CHARS {
            return Err(format!(
                "metadata key '{key}' is longer than {MAX_METADATA_KEY_CHARS} characters"
            ));
        }
        let Some(text) = value.as_str() else {
            return Err(format!("metadata value of '{key}' must be a string"));
        };
        if text.chars().count() > MAX_METADATA_VALUE_CHARS {
            return Err(format!(
                "metadata value of '{key}' is longer than {MAX_METADATA_VALUE_CHARS} characters"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_prefix_and_differ() {
        let (a, b) = (new_id("conv"), new_id("conv"));
        assert!(a.starts_with("conv_") && a.len() == 5 + 48, "{a}");
        assert_ne!(a, b);
        assert_eq!(item_prefix("message"), "msg");
    }

    #[test]
    fn metadata_limits_are_openais() {
        let mut m = Metadata::new();
        m.insert("k".into(), "v".into());
        assert!(check_metadata(&m).is_ok());
        m.insert("n".into(), 1.into());
        assert!(check_metadata(&m)
            .unwrap_err()
            .contains("'n' must be a string"));
        let long: Metadata = [("k".repeat(65), Value::from("v"))].into_iter().collect();
        assert!(check_metadata(&long)
            .unwrap_err()
            .contains("longer than 64"));
        let many: Metadata = (0..17).map(|i| (i.to_string(), Value::from("v"))).collect();
        assert!(check_metadata(&many).unwrap_err().contains("at most 16"));
    }

    #[test]
    fn a_page_names_its_ends() {
        let item = |id: &str| Item {
            id: id.into(),
            response_id: None,
            body: json!({"id": id, "type": "message"}),
        };
        let page = ItemPage {
            items: vec![item("msg_a"), item("msg_b")],
            has_more: true,
        };
        let v = page.to_json();
        assert_eq!(
            (v["first_id"].as_str(), v["last_id"].as_str()),
            (Some("msg_a"), Some("msg_b"))
        );
        assert_eq!(v["object"], "list");
        let empty = ItemPage {
            items: vec![],
            has_more: false,
        }
        .to_json();
        assert!(empty["first_id"].is_null());
    }
}
