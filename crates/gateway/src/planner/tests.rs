//! The planner's rules on hand-made windows, pools and demand.

use super::*;

fn targets() -> Slo {
    Slo {
        ttft: Some(Duration::from_millis(500)),
        tpot: Some(Duration::from_millis(50)),
    }
}

fn pool(workers: usize, now: f64, one_fewer: f64) -> PoolView {
    PoolView {
        workers,
        predicted_ms: Some(now),
        predicted_one_fewer_ms: Some(one_fewer),
    }
}

fn window(ttft: (u32, u32), tpot: (u32, u32), prefill: f64, decode: f64) -> WindowView {
    WindowView {
        requests: 100,
        attainment: Attainment {
            ttft_met: ttft.0,
            ttft_missed: ttft.1,
            tpot_met: tpot.0,
            tpot_missed: tpot.1,
        },
        prefill_p90_ms: Some(prefill),
        decode_ttfb_p90_ms: Some(decode),
    }
}

#[test]
fn ttft_misses_grow_the_stage_that_takes_longer() {
    let (p, d) = (pool(2, 300.0, 450.0), pool(2, 30.0, 45.0));
    let plan = decide(
        &window((50, 50), (100, 0), 900.0, 40.0),
        &p,
        &d,
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (3, 2), "{}", plan.reason);
    let plan = decide(
        &window((50, 50), (100, 0), 40.0, 900.0),
        &p,
        &d,
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 3), "{}", plan.reason);
}

#[test]
fn tpot_misses_grow_decode() {
    let plan = decide(
        &window((100, 0), (10, 90), 100.0, 20.0),
        &pool(2, 100.0, 150.0),
        &pool(2, 80.0, 120.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 3), "{}", plan.reason);
    assert!(plan.reason.contains("TPOT"), "{}", plan.reason);
}

#[test]
fn a_pool_predicted_over_its_target_grows_before_requests_miss() {
    let plan = decide(
        &WindowView::default(),
        &pool(1, 800.0, 800.0),
        &pool(1, 20.0, 20.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 1), "{}", plan.reason);
}

#[test]
fn pools_shrink_only_with_room_and_never_below_one() {
    // Met, and one fewer worker is predicted well within the targets.
    let plan = decide(
        &window((100, 0), (100, 0), 50.0, 10.0),
        &pool(3, 100.0, 150.0),
        &pool(3, 10.0, 15.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 2), "{}", plan.reason);
    // One fewer would come near the target: hold.
    let plan = decide(
        &window((100, 0), (100, 0), 50.0, 10.0),
        &pool(3, 200.0, 300.0),
        &pool(3, 20.0, 30.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (3, 3), "{}", plan.reason);
    // A pool of one stays.
    let plan = decide(
        &window((100, 0), (100, 0), 1.0, 1.0),
        &pool(1, 1.0, 1.0),
        &pool(1, 1.0, 1.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (1, 1));
    // An empty pool is asked for one.
    let plan = decide(
        &WindowView::default(),
        &PoolView::default(),
        &PoolView::default(),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (1, 1));
}

fn demand(now: f64, peak: f64) -> DemandView {
    let capacity = demand::Capacity {
        tokens_per_s: 10_000.0,
        utilization: 0.5,
    };
    DemandView::new(Some(now), Some(peak), Some(capacity))
}

#[test]
fn arriving_prompt_tokens_grow_prefill_before_any_miss() {
    // Nothing missed yet, every prediction within target: 12k tokens/s need 3
    // workers at 5k each.
    let met = window((100, 0), (100, 0), 50.0, 10.0);
    let (p, d) = (pool(2, 100.0, 150.0), pool(1, 10.0, 10.0));
    let plan = decide(&met, &p, &d, &demand(12_000.0, 12_000.0), targets());
    assert_eq!((plan.prefill, plan.decode), (3, 1), "{}", plan.reason);
    assert!(plan.reason.contains("tokens/s"), "{}", plan.reason);
    // Towards the count needed at once: 26k tokens/s need 6 of 2, 4 more at once.
    let plan = decide(&met, &p, &d, &demand(26_000.0, 26_000.0), targets());
    assert_eq!(plan.prefill, 6, "{}", plan.reason);
    assert!(plan.reason.starts_with("prefill +4"), "{}", plan.reason);
    // At most 4 more or twice the pool, whichever is larger: 60k need 12.
    let plan = decide(&met, &p, &d, &demand(60_000.0, 0.0), targets());
    assert_eq!(plan.prefill, 6, "{}", plan.reason);
    let plan = decide(
        &met,
        &pool(5, 100.0, 150.0),
        &d,
        &demand(60_000.0, 0.0),
        targets(),
    );
    assert_eq!(plan.prefill, 10, "{}", plan.reason);
    // Enough workers for the rate: hold; the window's peak keeps them from shrinking
    // though one fewer is predicted well within the target.
    let (p, quiet) = (pool(3, 50.0, 60.0), demand(2_000.0, 12_000.0));
    let plan = decide(&met, &p, &d, &quiet, targets());
    assert_eq!(plan.prefill, 3, "{}", plan.reason);
    let plan = decide(&met, &p, &d, &demand(2_000.0, 4_000.0), targets());
    assert_eq!(plan.prefill, 2, "{}", plan.reason);
}

#[test]
fn decode_does_not_grow_while_prefill_is_short() {
    // TTFT misses on the prefill leg and TPOT misses (decode workers prefilling
    // locally): prefill grows, decode waits.
    let plan = decide(
        &window((50, 50), (50, 50), 900.0, 40.0),
        &pool(1, 600.0, 600.0),
        &pool(1, 80.0, 80.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 1), "{}", plan.reason);
    assert!(
        plan.reason.contains("wait on the prefill pool"),
        "{}",
        plan.reason
    );
    // Prefill keeps up: the TPOT misses are decode's.
    let plan = decide(
        &window((100, 0), (50, 50), 100.0, 40.0),
        &pool(2, 100.0, 150.0),
        &pool(1, 80.0, 80.0),
        &demand(5_000.0, 5_000.0),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 2), "{}", plan.reason);
}

#[test]
fn too_few_requests_decide_nothing() {
    let plan = decide(
        &window((2, 3), (0, 5), 900.0, 10.0),
        &pool(2, 100.0, 150.0),
        &pool(2, 20.0, 30.0),
        &DemandView::default(),
        targets(),
    );
    assert_eq!((plan.prefill, plan.decode), (2, 2), "{}", plan.reason);
}
