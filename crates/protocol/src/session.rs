//! Sessions, as the gateway's `session` policy and the orchestrating decode worker both
//! read them: which key names a request's session, and which worker owns a session.
//!
//! The key is the body's `conversation_id`, else the `X-Session-Id` header, else the
//! OpenAI `user` field (the first that is a non-empty string). A session's owner is
//! chosen by rendezvous (highest-random-weight) hashing: each candidate scores
//! hash(key, worker URL) and the highest wins, so a worker that leaves moves only its own
//! sessions and a worker that joins takes only those it now wins. The hash is a fixed
//! FNV-1a with a final mix, so every gateway replica, every restart and the engine agree.

/// The header that names a session when the body has no `conversation_id`.
pub const SESSION_HEADER: &str = "x-session-id";

/// The body field that names a conversation (pdserve's and vLLM's multi-turn proxies).
pub const CONVERSATION_ID: &str = "conversation_id";

/// The session key of a request, from its body's `conversation_id`, its `X-Session-Id`
/// header and its body's `user`, in that order; empty strings do not count.
pub fn session_key<'a>(
    conversation_id: Option<&'a str>,
    header: Option<&'a str>,
    user: Option<&'a str>,
) -> Option<&'a str> {
    [conversation_id, header, user]
        .into_iter()
        .flatten()
        .find(|key| !key.is_empty())
}

/// The `X-Session-Id` header of `headers`, when it is text.
pub fn header_session(headers: &http::HeaderMap) -> Option<&str> {
    headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok())
}

/// FNV-1a's 64-bit offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a over `bytes`, continuing from `state` (start from [`FNV_OFFSET`]).
pub fn fnv1a(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

/// MurmurHash3's 64-bit finaliser: FNV alone leaves the high bits of similar inputs
/// correlated, which would skew which worker wins.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The hash state of a rendezvous key, to score every candidate with: the same in every
/// process, build and Rust release (unlike std's `DefaultHasher`).
pub fn rendezvous_key(key: &[u8]) -> u64 {
    // The 0xff separator cannot occur in UTF-8, so (key, url) pairs never collide by
    // moving bytes from one to the other.
    fnv1a(fnv1a(FNV_OFFSET, key), &[0xff])
}

/// A candidate's rendezvous score for a key from [`rendezvous_key`]: the highest wins.
pub fn rendezvous_score(key: u64, url: &str) -> u64 {
    mix(fnv1a(key, url.as_bytes()))
}

/// A candidate's rendezvous score for a key from [`rendezvous_key`], the candidate named
/// by a 64-bit id of its URL rather than the URL: no bytes read per candidate. Agrees
/// across processes that derive ids alike (gateway replicas of one build).
pub fn rendezvous_score_of_id(key: u64, id: u64) -> u64 {
    mix(key ^ mix(id))
}

/// The candidate that owns session `key`: the highest rendezvous score of
/// (`key`, `url(candidate)`), the first of equal scores; `None` when there are none.
pub fn rendezvous_owner<'c, T>(
    key: &str,
    candidates: &'c [T],
    url: impl Fn(&T) -> &str,
) -> Option<&'c T> {
    let key_hash = rendezvous_key(key.as_bytes());
    let score = |c: &T| rendezvous_score(key_hash, url(c));
    let mut best: Option<(&T, u64)> = None;
    for candidate in candidates {
        let s = score(candidate);
        if best.is_none_or(|(_, top)| s > top) {
            best = Some((candidate, s));
        }
    }
    best.map(|(c, _)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_key_is_conversation_id_then_header_then_user() {
        assert_eq!(session_key(Some("c"), Some("h"), Some("u")), Some("c"));
        assert_eq!(session_key(None, Some("h"), Some("u")), Some("h"));
        assert_eq!(session_key(Some(""), Some("h"), Some("u")), Some("h"));
        assert_eq!(session_key(None, Some(""), Some("u")), Some("u"));
        assert_eq!(session_key(None, None, Some("")), None);
        let mut headers = http::HeaderMap::new();
        assert_eq!(header_session(&headers), None);
        headers.insert(SESSION_HEADER, "alice".parse().unwrap());
        assert_eq!(header_session(&headers), Some("alice"));
    }

    #[test]
    fn the_owner_is_stable_and_moves_only_the_sessions_of_a_worker_that_leaves() {
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        let urls: Vec<String> = (1..=4).map(|p| format!("http://w:{p}")).collect();
        let owner = |key: &str, urls: &[String]| {
            rendezvous_owner(key, urls, |u| u.as_str()).unwrap().clone()
        };
        let mut counts = [0usize; 4];
        for i in 0..4_000 {
            let key = format!("s-{i}");
            let first = owner(&key, &urls);
            assert_eq!(owner(&key, &urls), first);
            counts[urls.iter().position(|u| *u == first).unwrap()] += 1;
            let without_last = owner(&key, &urls[..3]);
            if first != urls[3] {
                assert_eq!(
                    without_last, first,
                    "{key} moved although its worker stayed"
                );
            }
        }
        assert!(
            counts.iter().all(|c| (800..=1_200).contains(c)),
            "{counts:?}"
        );
        assert_eq!(
            rendezvous_owner("k", &[] as &[String], |u| u.as_str()),
            None
        );
    }
}
