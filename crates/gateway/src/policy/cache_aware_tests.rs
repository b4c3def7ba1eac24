use http::HeaderMap;
use rand::distr::Alphanumeric;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::endpoint::Endpoint;
use crate::ingress::request::ClientRequest;
use crate::policy::testing::{chat, load, pick, tokens, workers};

const A: &str = "http://127.0.0.1:1";
const B: &str = "http://127.0.0.1:2";

fn policy() -> CacheAware {
    CacheAware::new(&PolicyConfig::default())
}

/// Token ids `from..from + n`.
fn ids(from: u32, n: u32) -> Vec<u32> {
    (from..from + n).collect()
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

fn cached(
    policy: &CacheAware,
    role: WorkerRole,
    ws: &[Arc<Worker>],
    request: &ClientRequest,
) -> Option<PrefixMatch> {
    let headers = HeaderMap::new();
    let route = RouteRequest {
        endpoint: Endpoint::Chat,
        request: Some(request),
        headers: &headers,
        conversation_id: None,
        tokens: None,
        notes: None,
        prefer: None,
        trace: None,
        seen: None,
        slo: Default::default(),
        local_prefill: false,
    };
    policy.cached_prefix(role, ws, &route)
}

#[test]
fn conversations_stick_to_the_worker_that_served_them() {
    let p = policy();
    let ws = workers(WorkerRole::PrefillDecode, &[1, 2]);
    let role = WorkerRole::PrefillDecode;
    let system_a = "You are a pirate. Answer every question in pirate speak. ".repeat(4);
    let system_b = "You are a lawyer. Answer with citations and caveats only. ".repeat(4);
    let mut conv_a = format!("{system_a}Where is the treasure?");
    let mut conv_b = format!("{system_b}Can I sue my neighbour?");
    // Equal load and empty trees: the first worker; then the other one has the smaller
    // tree and the second conversation shares too little with the first.
    assert_eq!(pick(&p, role, &ws, &chat(&conv_a)), A);
    assert_eq!(pick(&p, role, &ws, &chat(&conv_b)), B);
    for turn in 0..5 {
        conv_a.push_str(&format!(" Arr, turn {turn}. And then?"));
        conv_b.push_str(&format!(" Objection, turn {turn}. And then?"));
        assert_eq!(pick(&p, role, &ws, &chat(&conv_a)), A, "turn {turn}");
        assert_eq!(pick(&p, role, &ws, &chat(&conv_b)), B, "turn {turn}");
    }
    // A new conversation with a known system prompt goes where that prompt is cached.
    let other = format!("{system_b}What is a tort?");
    assert_eq!(pick(&p, role, &ws, &chat(&other)), B);
    assert_eq!(p.stats().cache_hits, 11);
    assert_eq!(p.stats().cache_misses, 2);
}

#[test]
fn routes_by_match_only_above_the_threshold() {
    let p = policy();
    let ws = workers(WorkerRole::Prefill, &[1, 2]);
    let role = WorkerRole::Prefill;
    let cached_part = ids(1, 60);
    // Recorded under A alone (the only candidate).
    assert_eq!(pick(&p, role, &ws[..1], &tokens(&cached_part)), A);
    // 60 of 100 tokens cached on A: 0.6 > 0.5.
    let above = cat(&cached_part, &ids(1_000, 40));
    assert_eq!(pick(&p, role, &ws, &tokens(&above)), A);
    // 40 of 100: below, so the idle worker with the smaller tree, B.
    let below = cat(&ids(1, 40), &ids(2_000, 60));
    assert_eq!(pick(&p, role, &ws, &tokens(&below)), B);
    // Exactly 0.5 is not above: A has the best match (50) but B is chosen.
    let half = cat(&ids(1, 50), &ids(3_000, 50));
    assert_eq!(
        cached(&p, role, &ws, &tokens(&half)).unwrap().worker.base,
        A
    );
    assert_eq!(pick(&p, role, &ws, &tokens(&half)), B);
    // A lower threshold takes the 0.4 match.
    let low = CacheAware::new(&PolicyConfig {
        cache_threshold: 0.3,
        ..PolicyConfig::default()
    });
    pick(&low, role, &ws[..1], &tokens(&cached_part));
    assert_eq!(pick(&low, role, &ws, &tokens(&below)), A);
}

/// Where a prompt cached on A goes when A has `a` and B has `b` requests open.
fn route_under_load(a: usize, b: usize, config: PolicyConfig) -> (String, PolicyStats) {
    let p = CacheAware::new(&config);
    let ws = workers(WorkerRole::Decode, &[1, 2]);
    let prompt = ids(1, 100);
    pick(&p, WorkerRole::Decode, &ws[..1], &tokens(&prompt));
    let _a = load(&ws[0], a);
    let _b = load(&ws[1], b);
    let again = cat(&prompt, &ids(500, 10));
    let base = pick(&p, WorkerRole::Decode, &ws, &tokens(&again));
    (base, p.stats())
}

#[test]
fn imbalanced_load_overrides_the_match() {
    let d = PolicyConfig::default;
    // 40 − 0 > 32 and 40 > 0 × 1.5: imbalanced, least loaded.
    let (base, stats) = route_under_load(40, 0, d());
    assert_eq!(base, B);
    assert_eq!((stats.imbalanced, stats.cache_hits), (1, 0));
    // A difference of 20 is within the absolute threshold: the match decides.
    assert_eq!(route_under_load(20, 0, d()).0, A);
    assert_eq!(route_under_load(100, 80, d()).0, A);
    // 100 − 60 > 32 and 100 > 90.
    assert_eq!(route_under_load(100, 60, d()).0, B);
    // 33 − 0 > 32 trips it; exactly 32 does not.
    assert_eq!(route_under_load(33, 0, d()).0, B);
    assert_eq!(route_under_load(32, 0, d()).0, A);
    // Past the absolute threshold but 70 < 50 × 1.5: still balanced.
    let abs10 = || PolicyConfig {
        balance_abs_threshold: 10,
        ..PolicyConfig::default()
    };
    assert_eq!(route_under_load(70, 50, abs10()).0, A);
    assert_eq!(route_under_load(80, 50, abs10()).0, B);
}

#[test]
fn below_the_threshold_load_comes_before_tree_size() {
    let p = policy();
    let ws = workers(WorkerRole::Decode, &[1, 2]);
    // B holds a big tree, A none; A is busier.
    pick(&p, WorkerRole::Decode, &ws[1..], &tokens(&ids(1, 5_000)));
    let _busy = load(&ws[0], 2);
    assert_eq!(
        pick(&p, WorkerRole::Decode, &ws, &tokens(&ids(9_000, 10))),
        B
    );
    // Without a prompt (a bodyless route) the least loaded too.
    let headers = HeaderMap::new();
    let route = RouteRequest::bodyless(Endpoint::Chat, &headers);
    assert_eq!(p.select(WorkerRole::Decode, &ws, &route).unwrap().base, B);
    assert!(p.select(WorkerRole::Decode, &[], &route).is_none());
}

#[test]
fn cached_prefix_reports_without_recording() {
    let p = policy();
    let ws = workers(WorkerRole::Prefill, &[1, 2]);
    let role = WorkerRole::Prefill;
    pick(&p, role, &ws[1..], &chat("héllo wörld"));
    let size = p.tree_size();
    // Text: characters. The prompt is "user\nhéllo wörld, more\n".
    let m = cached(&p, role, &ws, &chat("héllo wörld, more")).unwrap();
    assert_eq!(
        (m.worker.base.as_str(), m.matched, m.prompt_len),
        (B, 16, 23)
    );
    // A match ending inside a character ("é" and "è" share their first byte) does not
    // count that character.
    let m = cached(&p, role, &ws, &chat("è")).unwrap();
    assert_eq!((m.matched, m.prompt_len), (5, 7));
    assert_eq!(p.tree_size(), size, "nothing recorded");
    // Tokens: token ids.
    pick(&p, role, &ws[..1], &tokens(&ids(1, 30)));
    let m = cached(&p, role, &ws, &tokens(&ids(1, 50))).unwrap();
    assert_eq!(
        (m.worker.base.as_str(), m.matched, m.prompt_len),
        (A, 30, 50)
    );
    assert!(cached(&p, role, &ws, &tokens(&ids(700, 5))).is_none());
    // Trees are per role.
    assert!(cached(&p, WorkerRole::Decode, &ws, &tokens(&ids(1, 50))).is_none());
    // Only the two selections counted.
    assert_eq!((p.stats().cache_hits, p.stats().cache_misses), (0, 2));
}

#[test]
fn the_cap_holds_under_prompt_churn() {
    const CAP: usize = 64 << 10;
    let p = CacheAware::new(&PolicyConfig {
        max_tree_size: CAP,
        ..PolicyConfig::default()
    });
    let ws = workers(WorkerRole::PrefillDecode, &[1, 2]);
    let mut rng = StdRng::seed_from_u64(3);
    for i in 0..20_000 {
        let text: String = (&mut rng)
            .sample_iter(Alphanumeric)
            .take(200)
            .map(char::from)
            .collect();
        pick(&p, WorkerRole::PrefillDecode, &ws, &chat(&text));
        if i % 500 == 0 {
            // One text tree per worker, each capped.
            assert!(p.tree_size() <= 2 * CAP, "{} after {i}", p.tree_size());
        }
    }
    // 20k prompts of ~200 bytes are 4 MB; the trees are full but within their caps.
    let size = p.tree_size();
    assert!((2 * CAP - 2_000..=2 * CAP).contains(&size), "{size}");
}

#[test]
fn departed_workers_are_forgotten() {
    let p = policy();
    let ws = workers(WorkerRole::Decode, &[1, 2]);
    pick(&p, WorkerRole::Decode, &ws[..1], &tokens(&ids(1, 100)));
    pick(&p, WorkerRole::Decode, &ws[1..], &tokens(&ids(500, 100)));
    // A worker that is not a candidate is never chosen, whatever its tree holds.
    assert_eq!(
        pick(&p, WorkerRole::Decode, &ws[1..], &tokens(&ids(1, 100))),
        B
    );
    let both = p.tree_size();
    p.retain_workers(&[B]);
    assert!(p.tree_size() < both);
    assert!(
        cached(&p, WorkerRole::Decode, &ws, &tokens(&ids(1, 100)))
            .is_some_and(|m| m.worker.base == B && m.matched == 100)
    );
    // Idle pruning keeps workers seen since the cutoff and drops the others.
    p.prune_idle(0);
    assert!(p.tree_size() > 0);
    p.prune_idle(p.now() + 1);
    assert_eq!(p.tree_size(), 0);
}

#[test]
fn queue_cost_keeps_a_shared_prefix_from_pulling_all_traffic_onto_one_worker() {
    let cost = |queue_cost| PolicyConfig {
        queue_cost,
        ..PolicyConfig::default()
    };
    // A holds 100 of the 110 tokens, B none. One extra request on A costs 0.5 × 110 = 55
    // tokens < 100 cached: A. Two cost 110 > 100: B.
    assert_eq!(route_under_load(1, 0, cost(0.5)).0, A);
    assert_eq!(route_under_load(2, 0, cost(0.5)).0, B);
    assert_eq!(route_under_load(3, 1, cost(0.5)).0, B);
    // Off (SGLang's behaviour): the match decides until the balance thresholds trip.
    assert_eq!(route_under_load(2, 0, cost(0.0)).0, A);
    assert_eq!(route_under_load(20, 0, cost(0.0)).0, A);
    // Once B holds the shared prefix too, only the lead beyond it counts.
    let p = CacheAware::new(&cost(0.5));
    let ws = workers(WorkerRole::Decode, &[1, 2]);
    let shared = ids(1, 100);
    pick(&p, WorkerRole::Decode, &ws[..1], &tokens(&shared));
    pick(&p, WorkerRole::Decode, &ws[1..], &tokens(&shared));
    let history = cat(&shared, &ids(500, 30));
    pick(&p, WorkerRole::Decode, &ws[..1], &tokens(&history));
    let _a = load(&ws[0], 1);
    // A's lead is 30 tokens; one extra request costs 0.5 × 140 = 70 > 30: B.
    let next = cat(&history, &ids(900, 10));
    assert_eq!(pick(&p, WorkerRole::Decode, &ws, &tokens(&next)), B);
}
