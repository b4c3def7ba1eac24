//! Remembered token ids of the text pieces between added tokens.
//!
//! Hugging Face `tokenizers` first cuts a text at its added tokens (`<|im_start|>`,
//! `<|im_end|>`), leftmost-longest, and then normalizes, pre-tokenizes and encodes every
//! piece on its own: a piece's ids do not depend on what surrounds it. Chat prompts repeat
//! most of their pieces (the system prompt, every earlier turn of a conversation), so
//! keeping each piece's ids turns all but the new turn into a hash lookup. Most of an
//! encode's cost is fixed per call (allocating the normalized and pre-tokenized strings),
//! so even short pieces are worth keeping.
//!
//! The cut is reproduced exactly only when every added token matches literally: not
//! normalized, no stripping of neighbouring spaces, not single-word, special tokens not
//! encoded as text. GGUF-built tokenizers are always so; a `tokenizer.json` that is not
//! gets no cache, and encodes as before.

use std::sync::{Arc, Mutex, MutexGuard};

use aho_corasick::{AhoCorasick, MatchKind};
use lru::LruCache;

/// Bytes an entry costs besides its key and ids (hash slot, list links, two allocations).
const ENTRY_OVERHEAD: usize = 96;

/// A bounded, least-recently-used map from text piece to its token ids.
pub(crate) struct SegmentCache {
    /// Every added token's text, matched as `tokenizers` matches them.
    added: AhoCorasick,
    /// The id of each pattern of `added`, by pattern index.
    added_ids: Vec<u32>,
    /// Approximate bytes the entries may hold.
    max_bytes: usize,
    entries: Mutex<Entries>,
}

struct Entries {
    pieces: LruCache<Box<str>, Arc<[u32]>>,
    bytes: usize,
}

/// One part of a text cut at its added tokens.
#[derive(Debug, PartialEq)]
enum Piece<'t> {
    Added(u32),
    Text(&'t str),
}

fn cost(text: &str, ids: &[u32]) -> usize {
    text.len() + std::mem::size_of_val(ids) + ENTRY_OVERHEAD
}

impl SegmentCache {
    /// A cache for `inner` holding about `max_bytes`; `None` when `inner`'s added tokens
    /// are not cut literally (see the module) or `max_bytes` is 0.
    pub(crate) fn new(inner: &tokenizers::Tokenizer, max_bytes: usize) -> Option<Self> {
        if max_bytes == 0 || inner.get_encode_special_tokens() {
            return None;
        }
        let mut added: Vec<(u32, String)> = Vec::new();
        for (id, token) in inner.get_added_tokens_decoder() {
            if token.normalized || token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            added.push((id, token.content));
        }
        added.sort_unstable();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, text)| text.as_str()))
            .ok()?;
        Some(Self {
            added: matcher,
            added_ids: added.into_iter().map(|(id, _)| id).collect(),
            max_bytes,
            entries: Mutex::new(Entries {
                pieces: LruCache::unbounded(),
                bytes: 0,
            }),
        })
    }

    /// `text`'s ids: `inner`'s ids of every piece, without special tokens added.
    pub(crate) fn encode(
        &self,
        inner: &tokenizers::Tokenizer,
        text: &str,
    ) -> tokenizers::Result<Vec<u32>> {
        let pieces = self.pieces(text);
        // One lock for all look-ups, none held while encoding.
        let known: Vec<Option<Arc<[u32]>>> = {
            let mut entries = self.lock();
            pieces
                .iter()
                .map(|piece| match piece {
                    Piece::Text(t) => entries.pieces.get(*t).cloned(),
                    Piece::Added(_) => None,
                })
                .collect()
        };
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        let mut fresh: Vec<(&str, Arc<[u32]>)> = Vec::new();
        for (piece, known) in pieces.iter().zip(known) {
            match (piece, known) {
                (Piece::Added(id), _) => ids.push(*id),
                (Piece::Text(_), Some(known)) => ids.extend_from_slice(&known),
                (Piece::Text(t), None) => {
                    let encoded: Arc<[u32]> = inner.encode_fast(*t, false)?.get_ids().into();
                    ids.extend_from_slice(&encoded);
                    fresh.push((t, encoded));
                }
            }
        }
        if !fresh.is_empty() {
            self.remember(fresh);
        }
        Ok(ids)
    }

    fn remember(&self, fresh: Vec<(&str, Arc<[u32]>)>) {
        let mut entries = self.lock();
        for (text, ids) in fresh {
            let added = cost(text, &ids);
            // A piece bigger than a quarter of the cache would only push out many others.
            if added > self.max_bytes / 4 {
                continue;
            }
            if let Some(old) = entries.pieces.put(text.into(), ids) {
                entries.bytes -= cost(text, &old);
            }
            entries.bytes += added;
        }
        while entries.bytes > self.max_bytes {
            let Some((text, ids)) = entries.pieces.pop_lru() else {
                break;
            };
            entries.bytes -= cost(&text, &ids);
        }
    }

    /// `text` cut at its added tokens, leftmost-longest, as `tokenizers` cuts it.
    fn pieces<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let mut pieces = Vec::new();
        let mut at = 0;
        for found in self.added.find_iter(text) {
            if found.start() > at {
                pieces.push(Piece::Text(&text[at..found.start()]));
            }
            pieces.push(Piece::Added(self.added_ids[found.pattern().as_usize()]));
            at = found.end();
        }
        if at < text.len() {
            pieces.push(Piece::Text(&text[at..]));
        }
        pieces
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // The entries stay consistent whatever panicked while the lock was held.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Entries held and their approximate bytes.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let entries = self.lock();
        (entries.pieces.len(), entries.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;

    /// A byte-level BPE over single bytes with a few merges, and ChatML's markers.
    fn tokenizer(added: Vec<AddedToken>) -> tokenizers::Tokenizer {
        let alphabet = ByteLevel::alphabet();
        let mut vocab: Vec<String> = alphabet.iter().map(char::to_string).collect();
        vocab.sort();
        let merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")];
        for (a, b) in merges {
            vocab.push(format!("{a}{b}"));
        }
        let vocab: tokenizers::models::bpe::Vocab = vocab
            .into_iter()
            .enumerate()
            .map(|(id, t)| (t, id as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .unwrap();
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.add_special_tokens(added).unwrap();
        inner
    }

    /// The ids the tokenizer itself gives `text`.
    fn reference(inner: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
        inner.encode(text, false).unwrap().get_ids().to_vec()
    }

    fn chatml() -> Vec<AddedToken> {
        ["<|im_start|>", "<|im_end|>", "<|im"]
            .into_iter()
            .map(|t| AddedToken::from(t, true).normalized(false))
            .collect()
    }

    const TEXTS: &[&str] = &[
        "",
        "hello world",
        "<|im_start|>",
        "<|im_start|><|im_end|>",
        "<|im_start|>system\nhello<|im_end|>\n<|im_start|>user\nworld <|im_end|>\n",
        "  <|im_start|>  hello  <|im_end|>  ",
        "<|im <|im_start <|im_end|>|>",
        "naïve <|im_start|>東京 🚀<|im_end|>",
    ];

    #[test]
    fn ids_equal_the_tokenizers_own_for_every_text_hit_or_miss() {
        let inner = tokenizer(chatml());
        let cache = SegmentCache::new(&inner, 1 << 20).expect("literal added tokens");
        for round in ["miss", "hit"] {
            for text in TEXTS {
                assert_eq!(
                    cache.encode(&inner, text).unwrap(),
                    reference(&inner, text),
                    "{round} {text:?}"
                );
            }
        }
    }

    #[test]
    fn a_text_is_cut_leftmost_longest_at_added_tokens() {
        let inner = tokenizer(chatml());
        let cache = SegmentCache::new(&inner, 1 << 20).unwrap();
        let id = |t: &str| inner.token_to_id(t).unwrap();
        assert_eq!(
            cache.pieces("a<|im_start|>b<|im"),
            vec![
                Piece::Text("a"),
                Piece::Added(id("<|im_start|>")),
                Piece::Text("b"),
                Piece::Added(id("<|im")),
            ]
        );
        assert_eq!(cache.pieces(""), vec![]);
    }

    #[test]
    fn tokens_that_do_not_match_literally_get_no_cache() {
        for token in [
            AddedToken::from("<mask>", true).normalized(true),
            AddedToken::from("<mask>", true)
                .normalized(false)
                .lstrip(true),
            AddedToken::from("<mask>", true)
                .normalized(false)
                .rstrip(true),
            AddedToken::from("<mask>", true)
                .normalized(false)
                .single_word(true),
        ] {
            assert!(SegmentCache::new(&tokenizer(vec![token]), 1 << 20).is_none());
        }
        let mut encoded_as_text = tokenizer(chatml());
        encoded_as_text.set_encode_special_tokens(true);
        assert!(SegmentCache::new(&encoded_as_text, 1 << 20).is_none());
        assert!(SegmentCache::new(&tokenizer(chatml()), 0).is_none());
    }

    #[test]
    fn the_cache_stays_under_its_size() {
        let inner = tokenizer(chatml());
        let max = 64 * 1024;
        let cache = SegmentCache::new(&inner, max).unwrap();
        for i in 0..10_000 {
            let text = format!("<|im_start|>user\nhello {i}<|im_end|>");
            assert_eq!(
                cache.encode(&inner, &text).unwrap(),
                reference(&inner, &text)
            );
            assert!(cache.held().1 <= max);
        }
        let (entries, bytes) = cache.held();
        assert!(entries > 100, "{entries} entries");
        assert!(bytes > max / 2, "{bytes} bytes");
        // A piece as big as the cache is encoded, not kept.
        let big = "hello ".repeat(max / 4);
        assert_eq!(cache.encode(&inner, &big).unwrap(), reference(&inner, &big));
        assert_eq!(cache.held(), (entries, bytes));
    }
}
