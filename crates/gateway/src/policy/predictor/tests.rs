//! Tests of the latency predictor.

use super::*;

fn features(uncached: f64, load: f64) -> Features {
    Features {
        uncached_tokens: uncached,
        prompt_tokens: uncached + 100.0,
        waiting: load / 2.0,
        running: load / 2.0,
        in_flight: load,
        kv_usage: 0.2,
        queued_tokens: 0.0,
    }
}

/// A worker whose TTFT is 30 ms + 0.1 ms per uncached token, times one more for each
/// request ahead.
fn truth(f: &Features) -> f64 {
    (30.0 + 0.1 * f.uncached_tokens) * (1.0 + f.in_flight)
}

/// Numbers in [0, 1) from `seed`, the same every run (a linear congruential generator).
fn uniform(mut seed: u64) -> impl FnMut() -> f64 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as f64 / (1u64 << 31) as f64
    }
}

#[test]
fn it_learns_a_worker_to_within_ten_percent() {
    let p = LatencyPredictor::new();
    let role = WorkerRole::PrefillDecode;
    assert!(p
        .predict(role, Target::Ttft, "w", features(500.0, 0.0))
        .is_some());
    assert!(!p.trained(role, Target::Ttft));
    let mut next = uniform(7);
    for _ in 0..2000 {
        let f = features((next() * 2000.0).round(), (next() * 6.0).floor());
        let noise = 1.0 + (next() - 0.5) * 0.1;
        p.observe(role, Target::Ttft, "w", f, truth(&f) * noise);
    }
    assert!(p.trained(role, Target::Ttft));
    let error = p.error_ratio(role, Target::Ttft).unwrap();
    assert!(error < 0.10, "recent error {error}");
    let f = features(1000.0, 2.0);
    let predicted = p.predict(role, Target::Ttft, "w", f).unwrap().ms;
    let want = truth(&f);
    assert!(
        (predicted - want).abs() / want < 0.15,
        "{predicted} vs {want}"
    );
}

/// Mostly short waits and a few long ones whose growth the model cannot follow (the wait
/// grows with the square of the queue, the model is linear in it): fitted in squared
/// milliseconds, the long ones set the line and the short ones are predicted off by far
/// more than they last (an error of 1.65 here); fitted relatively, the short ones are
/// right.
#[test]
fn short_waits_are_predicted_at_their_own_scale_beside_long_ones() {
    let p = LatencyPredictor::new();
    let role = WorkerRole::Prefill;
    let mut next = uniform(11);
    for _ in 0..3000 {
        let load = if next() < 0.9 {
            (next() * 3.0).floor()
        } else {
            10.0 + (next() * 3.0).floor()
        };
        let f = features(200.0, load);
        let noise = 1.0 + (next() - 0.5) * 0.1;
        p.observe(
            role,
            Target::Ttft,
            "w",
            f,
            20.0 * (1.0 + load).powi(2) * noise,
        );
    }
    let error = p.error_ratio(role, Target::Ttft).unwrap();
    assert!(error < 0.3, "recent error {error}");
}

#[test]
fn nonsense_features_get_no_prediction_and_teach_nothing() {
    let p = LatencyPredictor::new();
    let role = WorkerRole::Decode;
    for bad in [
        Features {
            waiting: -1.0,
            ..features(10.0, 1.0)
        },
        Features {
            running: 1e9,
            ..features(10.0, 1.0)
        },
        Features {
            uncached_tokens: f64::NAN,
            ..features(10.0, 1.0)
        },
    ] {
        assert!(p.predict(role, Target::Tpot, "w", bad).is_none(), "{bad:?}");
        p.observe(role, Target::Tpot, "w", bad, 20.0);
    }
    p.observe(role, Target::Tpot, "w", features(10.0, 1.0), f64::INFINITY);
    p.observe(role, Target::Tpot, "w", features(10.0, 1.0), -3.0);
    assert!(p.error_ratio(role, Target::Tpot).is_none());
    // KV use past 1 is read as full, not refused.
    let full = Features {
        kv_usage: 3.0,
        ..features(10.0, 1.0)
    };
    assert!(p.predict(role, Target::Tpot, "w", full).is_some());
}

#[test]
fn prompt_tokens_given_a_worker_are_queued_until_computed_or_the_request_ends() {
    let pool = crate::policy::testing::workers(WorkerRole::Prefill, &[1, 2]);
    let seen = SeenFeatures::default();
    seen.claim(&pool[0], 700);
    seen.claim(&pool[1], 300);
    assert_eq!(features_of(&pool[0], 100, 0, None).queued_tokens, 700.0);
    // With a rate, what the worker has computed of them since they were sent is not
    // ahead any more (a million tokens per ms: all of it, however soon).
    std::thread::sleep(std::time::Duration::from_millis(2));
    assert_eq!(features_of(&pool[0], 100, 0, Some(1e6)).queued_tokens, 0.0);
    seen.computed(&pool[0].base);
    assert_eq!(pool[0].pending_prompt_tokens(), 0);
    assert_eq!(pool[1].pending_prompt_tokens(), 300);
    drop(seen);
    assert_eq!(
        pool[1].pending_prompt_tokens(),
        0,
        "released with the request"
    );
}

#[test]
fn a_slower_worker_keeps_its_own_correction_until_it_leaves() {
    let p = LatencyPredictor::new();
    let role = WorkerRole::Decode;
    let f = features(0.0, 2.0);
    for i in 0..400 {
        let (worker, ms) = if i % 2 == 0 {
            ("fast", 20.0)
        } else {
            ("slow", 40.0)
        };
        p.observe(role, Target::Tpot, worker, f, ms);
    }
    let fast = p.predict(role, Target::Tpot, "fast", f).unwrap().ms;
    let slow = p.predict(role, Target::Tpot, "slow", f).unwrap().ms;
    assert!(slow > 1.6 * fast, "fast {fast}, slow {slow}");
    p.retain_workers(&["fast"]);
    let forgotten = p.predict(role, Target::Tpot, "slow", f).unwrap().ms;
    assert!((forgotten - 30.0).abs() < 6.0, "pooled again: {forgotten}");
}

#[test]
fn the_error_gauge_is_published_per_role_and_target() {
    let p = LatencyPredictor::new();
    let mut registry = Registry::with_prefix("pdserve_gateway");
    p.register(&mut registry);
    p.observe(
        WorkerRole::Prefill,
        Target::Ttft,
        "w",
        features(100.0, 0.0),
        50.0,
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"pdserve_gateway_predictor_error_ratio{role="prefill",target="ttft"}"#),
        "{text}"
    );
}

#[test]
fn the_queue_estimate_predicts_from_the_first_few_prefill_legs() {
    let p = LatencyPredictor::new();
    let (prefill, decode) = (WorkerRole::Prefill, WorkerRole::Decode);
    let queued = Features {
        queued_tokens: 2000.0,
        ..features(500.0, 1.0)
    };
    assert!(!p.trained(prefill, Target::Ttft));
    assert!(
        !p.predict(prefill, Target::Ttft, "w", queued)
            .unwrap()
            .trained
    );
    // Three legs of 1,000 tokens, each 20 ms on an idle worker: 50 tokens per ms.
    let t0 = Instant::now();
    for i in 0..3u64 {
        let started = t0 + std::time::Duration::from_millis(100 * i);
        let ended = started + std::time::Duration::from_millis(20);
        p.prefill_leg_ended(prefill, "w", features(1000.0, 0.0), started, ended);
    }
    assert!(p.trained(prefill, Target::Ttft));
    let made = p.predict(prefill, Target::Ttft, "w", queued).unwrap();
    assert!(made.trained);
    // The 2,000 tokens ahead and its own 500, at 50 per ms.
    assert!((made.ms - 50.0).abs() < 1e-9, "{}", made.ms);
    // A decode pool with no legs of its own is estimated at the prefill pool's rate.
    let local = p.predict(decode, Target::Ttft, "d", queued).unwrap();
    assert!((local.ms - made.ms).abs() < 1e-9);
    assert!(
        !p.trained(decode, Target::Tpot),
        "TPOT has no queue estimate"
    );
    // Nothing to compute (a first token after a transfer): the regression's prior.
    let after_transfer = Features {
        uncached_tokens: 0.0,
        queued_tokens: 0.0,
        ..queued
    };
    assert!(
        !p.predict(decode, Target::Ttft, "d", after_transfer)
            .unwrap()
            .trained
    );
    // Once a few such first tokens are known: their running mean, plus what is ahead.
    for _ in 0..5 {
        p.observe(decode, Target::Ttft, "d", after_transfer, 30.0);
    }
    let first = p
        .predict(decode, Target::Ttft, "d", after_transfer)
        .unwrap();
    assert!(first.trained && (first.ms - 30.0).abs() < 1e-9, "{first:?}");
    let behind = Features {
        queued_tokens: 500.0,
        ..after_transfer
    };
    let behind = p.predict(decode, Target::Ttft, "d", behind).unwrap().ms;
    assert!((behind - 40.0).abs() < 1e-9, "{behind}");
}

#[test]
fn the_regression_takes_over_once_it_predicts_better_than_the_queue() {
    let p = LatencyPredictor::new();
    let role = WorkerRole::Prefill;
    let t0 = Instant::now();
    for i in 0..3u64 {
        let started = t0 + std::time::Duration::from_millis(100 * i);
        let ended = started + std::time::Duration::from_millis(20);
        p.prefill_leg_ended(role, "w", features(1000.0, 0.0), started, ended);
    }
    // The truth here is far from the queue estimate (each request ahead doubles the
    // wait), and the regression learns it.
    let mut next = uniform(5);
    let mut made_before = Vec::new();
    for i in 0..2000 {
        let f = features((next() * 2000.0).round(), (next() * 6.0).floor());
        if i < TRAINED_AFTER && f.uncached_tokens > 0.0 {
            let queue = f.uncached_tokens / 50.0;
            made_before.push((p.predict(role, Target::Ttft, "w", f).unwrap().ms - queue).abs());
        }
        p.observe(role, Target::Ttft, "w", f, truth(&f));
    }
    assert!(
        made_before.iter().all(|d| *d < 1e-9),
        "the queue estimate is followed until the regression has learned"
    );
    let error = p.error_ratio(role, Target::Ttft).unwrap();
    assert!(
        error < 0.10,
        "recent error of the predictions made: {error}"
    );
    let f = features(1000.0, 2.0);
    let predicted = p.predict(role, Target::Ttft, "w", f).unwrap().ms;
    assert!(
        (predicted - truth(&f)).abs() / truth(&f) < 0.15,
        "{predicted}"
    );
}
