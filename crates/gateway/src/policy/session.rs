//! Session affinity: every request of a session goes to the same worker, by rendezvous
//! (highest-random-weight) hashing — the key order and the hash are
//! [`pdserve_protocol::session`]'s, shared with the orchestrating decode worker, so a
//! session maps the same way across gateway restarts and replicas. Requests without a
//! key go to the fallback policy.

use std::sync::Arc;

use pdserve_protocol::session::{header_session, rendezvous_owner};
use pdserve_protocol::WorkerRole;
use serde_json::Value;

use super::{Choice, Policy, PolicyStats, PrefixMatch, RequestOutcome, RouteRequest};
use crate::fleet::registry::Worker;
use crate::ingress::request::ClientRequest;

/// Consistent hashing on the session key, with a fallback policy for keyless requests.
#[derive(Debug)]
pub struct Session {
    fallback: Arc<dyn Policy>,
}

impl Session {
    /// Session affinity, `fallback` for requests without a session key.
    pub fn new(fallback: Arc<dyn Policy>) -> Self {
        Self { fallback }
    }
}

/// The request's session key: `conversation_id`, `X-Session-Id` or `user` (non-empty).
pub fn session_key<'a>(request: &RouteRequest<'a>) -> Option<&'a str> {
    let user = request.request.and_then(|r| {
        let extra = match r {
            ClientRequest::Chat(r) => &r.extra,
            ClientRequest::Completion(r) => &r.extra,
        };
        extra.get("user").and_then(Value::as_str)
    });
    pdserve_protocol::session::session_key(
        request.conversation_id,
        header_session(request.headers),
        user,
    )
}

/// The candidate that owns `key` (`candidates` is not empty).
fn owner<'w>(key: &str, candidates: &'w [Arc<Worker>]) -> &'w Arc<Worker> {
    rendezvous_owner(key, candidates, |w| w.base.as_str()).expect("candidates is not empty")
}

impl Policy for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    fn select(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        if candidates.is_empty() {
            return None;
        }
        match session_key(request) {
            Some(key) => Some(owner(key, candidates).clone()),
            None => self.fallback.select(role, candidates, request),
        }
    }

    fn choose(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Choice> {
        match session_key(request) {
            Some(_) => self.select(role, candidates, request).map(|worker| Choice {
                worker,
                cache: None,
                forecast: None,
            }),
            None => self.fallback.choose(role, candidates, request),
        }
    }

    // The fallback's own state (trees, counters) is kept up to date through these.
    fn on_request_end(&self, worker: &Worker, outcome: RequestOutcome) {
        self.fallback.on_request_end(worker, outcome);
    }

    fn cached_prefix(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<PrefixMatch> {
        self.fallback.cached_prefix(role, candidates, request)
    }

    fn tree_size(&self) -> usize {
        self.fallback.tree_size()
    }

    fn reads_prompt(&self) -> bool {
        self.fallback.reads_prompt()
    }

    fn stats(&self) -> PolicyStats {
        self.fallback.stats()
    }

    fn retain_workers(&self, live: &[&str]) {
        self.fallback.retain_workers(live);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use http::HeaderMap;

    use super::*;
    use crate::endpoint::Endpoint;
    use crate::policy::testing::{chat, chat_from, index_of, workers};
    use crate::policy::{build, PolicyConfig, RoundRobin};

    fn session() -> Session {
        Session::new(Arc::new(RoundRobin::default()))
    }

    fn route<'a>(
        request: &'a ClientRequest,
        headers: &'a HeaderMap,
        conversation_id: Option<&'a str>,
    ) -> RouteRequest<'a> {
        RouteRequest {
            endpoint: Endpoint::Chat,
            request: Some(request),
            headers,
            conversation_id,
            tokens: None,
            notes: None,
            prefer: None,
            trace: None,
            seen: None,
            slo: Default::default(),
            local_prefill: false,
        }
    }

    fn pick_for(policy: &Session, ws: &[Arc<Worker>], key: &str) -> String {
        let request = chat("hi");
        let headers = HeaderMap::new();
        let ctx = route(&request, &headers, Some(key));
        policy
            .select(WorkerRole::Decode, ws, &ctx)
            .unwrap()
            .base
            .clone()
    }

    #[test]
    fn the_hash_is_standard_fnv1a_and_stable() {
        // Published FNV-1a 64 test vectors: a fixed function, not a seeded one.
        use pdserve_protocol::session::{fnv1a, FNV_OFFSET};
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
        // Two independently built policies agree on every session.
        let ws = workers(WorkerRole::Decode, &[1, 2, 3, 4, 5]);
        let (a, b) = (session(), session());
        for i in 0..200 {
            let key = format!("conv-{i}");
            assert_eq!(pick_for(&a, &ws, &key), pick_for(&b, &ws, &key));
        }
    }

    #[test]
    fn a_session_sticks_and_sessions_spread() {
        let ws = workers(WorkerRole::Decode, &[1, 2, 3, 4]);
        let policy = session();
        let mut counts = [0usize; 4];
        for i in 0..4_000 {
            let key = format!("session-{i}");
            let first = pick_for(&policy, &ws, &key);
            for _ in 0..3 {
                assert_eq!(pick_for(&policy, &ws, &key), first);
            }
            counts[index_of(&ws, &first)] += 1;
        }
        for c in counts {
            assert!((800..=1_200).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn a_removed_worker_moves_only_its_own_sessions() {
        let ws = workers(WorkerRole::Decode, &[1, 2, 3, 4, 5]);
        let policy = session();
        let keys: Vec<String> = (0..2_000).map(|i| format!("user-{i}")).collect();
        let before: HashMap<&str, String> = keys
            .iter()
            .map(|k| (k.as_str(), pick_for(&policy, &ws, k)))
            .collect();
        let removed = &ws[2].base;
        let rest: Vec<_> = ws.iter().filter(|w| &w.base != removed).cloned().collect();
        let mut moved = 0;
        for k in &keys {
            let after = pick_for(&policy, &rest, k);
            if &before[k.as_str()] == removed {
                moved += 1;
            } else {
                assert_eq!(
                    after,
                    before[k.as_str()],
                    "{k} moved off a worker that stayed"
                );
            }
        }
        assert!(moved > 200, "the removed worker owned sessions: {moved}");
        // Adding a worker takes sessions only onto itself.
        let grown = workers(WorkerRole::Decode, &[1, 2, 3, 4, 5, 6]);
        for k in &keys {
            let after = pick_for(&policy, &grown, k);
            assert!(after == before[k.as_str()] || after == "http://127.0.0.1:6");
        }
    }

    #[test]
    fn keys_come_from_conversation_id_then_header_then_user() {
        let plain = chat("hi");
        let with_user = chat_from("hi", "alice");
        let mut headers = HeaderMap::new();
        let none = HeaderMap::new();
        assert_eq!(session_key(&route(&plain, &none, None)), None);
        assert_eq!(session_key(&route(&with_user, &none, None)), Some("alice"));
        // Header names match case-insensitively.
        let name = http::HeaderName::from_bytes(b"X-Session-Id").unwrap();
        headers.insert(name, "s-1".parse().unwrap());
        assert_eq!(session_key(&route(&with_user, &headers, None)), Some("s-1"));
        assert_eq!(
            session_key(&route(&with_user, &headers, Some("conv"))),
            Some("conv")
        );
        // Empty values do not count.
        assert_eq!(session_key(&route(&plain, &none, Some(""))), None);
        assert_eq!(
            session_key(&RouteRequest::bodyless(Endpoint::Chat, &headers)),
            Some("s-1")
        );
    }

    #[test]
    fn keyless_requests_use_the_fallback() {
        let ws = workers(WorkerRole::Decode, &[1, 2, 3]);
        let policy = session();
        let request = chat("hi");
        let headers = HeaderMap::new();
        let ctx = route(&request, &headers, None);
        let picks: Vec<_> = (0..6)
            .map(|_| {
                policy
                    .select(WorkerRole::Decode, &ws, &ctx)
                    .unwrap()
                    .base
                    .clone()
            })
            .collect();
        // Round-robin: each worker twice, in turn.
        assert_eq!(picks[..3], picks[3..]);
        let mut distinct = picks[..3].to_vec();
        distinct.dedup();
        assert_eq!(distinct.len(), 3);
        assert!(policy.select(WorkerRole::Decode, &[], &ctx).is_none());
        // The user field is a key like the others.
        let alice = chat_from("hi", "alice");
        let ctx = route(&alice, &headers, None);
        let first = policy.select(WorkerRole::Decode, &ws, &ctx).unwrap();
        for _ in 0..5 {
            assert_eq!(
                policy.select(WorkerRole::Decode, &ws, &ctx).unwrap().base,
                first.base
            );
        }
    }

    #[test]
    fn built_with_a_configured_fallback() {
        let config = PolicyConfig {
            session_fallback: "cache_aware".into(),
            ..PolicyConfig::default()
        };
        let policy = build("session", &config).unwrap();
        assert_eq!(policy.name(), "session");
        let ws = workers(WorkerRole::Decode, &[1, 2]);
        let request = chat("a prompt the cache-aware fallback records");
        let headers = HeaderMap::new();
        policy.select(WorkerRole::Decode, &ws, &route(&request, &headers, None));
        assert!(policy.tree_size() > 0, "the fallback recorded the prompt");
        for bad in ["session", "nope"] {
            let config = PolicyConfig {
                session_fallback: bad.into(),
                ..PolicyConfig::default()
            };
            assert!(build("session", &config).is_none());
            assert!(config.validate().is_err());
        }
    }
}
