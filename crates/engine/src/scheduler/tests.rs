//! Scheduler tests over the deterministic fake model: every output is checked against
//! the fake's reference continuation, which depends on the KV actually read back from
//! the block tables, so batching, chunking, prefix caching and preemption bugs show up
//! as wrong tokens.

use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::*;
use crate::request::{FinishReason, GenerationRequest, KvImport, SeqEvent, SeqEvents, TokenUsage};
use crate::sampling::TokenLogprobs;
use crate::sequence::Sequence;
use crate::step_model::fake::{next_token, FakeModel};

const DEADLINE: Duration = Duration::from_secs(20);

mod import;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        policy: crate::scheduler::SchedulingPolicy::Fcfs,
        max_num_seqs: 8,
        max_waiting: 64,
        max_num_batched_tokens: 256,
        max_model_len: 512,
    }
}

fn request(prompt: Vec<u32>, max_new_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        stop_token_ids: vec![0],
        ..GenerationRequest::new(prompt, max_new_tokens)
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 13 + salt) % 60 + 1).collect()
}

/// What the fake model must generate after `prompt`.
fn reference(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut history = prompt.to_vec();
    for _ in 0..n {
        history.push(next_token(&history));
    }
    history[prompt.len()..].to_vec()
}

/// Reads a sequence's events to the end: generated ids and the final event.
fn collect(rx: &mut SeqEvents) -> (Vec<u32>, SeqEvent) {
    let start = Instant::now();
    let mut ids = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(SeqEvent::Token { id, .. }) => ids.push(id),
            Ok(SeqEvent::Admitted { .. }) => {}
            Ok(end) => return (ids, end),
            Err(mpsc::error::TryRecvError::Empty) => {
                assert!(start.elapsed() < DEADLINE, "sequence did not finish");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("events channel closed early: {e}"),
        }
    }
}

/// Submits every prompt at once and checks each output against the reference.
fn generate_all_and_check(handle: &EngineHandle, prompts: &[Vec<u32>], max_new_tokens: usize) {
    let mut rxs: Vec<_> = prompts
        .iter()
        .map(|p| handle.submit(request(p.clone(), max_new_tokens)).unwrap())
        .collect();
    for (p, rx) in prompts.iter().zip(&mut rxs) {
        assert_eq!(collect(rx).0, reference(p, max_new_tokens));
    }
}

fn start(
    model: FakeModel,
    config: SchedulerConfig,
) -> (EngineHandle, JoinHandle<()>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let (handle, thread) = spawn(model, config, metrics.clone()).unwrap();
    (handle, thread, metrics)
}

fn stop(handle: EngineHandle, thread: JoinHandle<()>) {
    handle.shutdown();
    thread.join().unwrap();
}

/// Waits until the scheduler's gauges settle on `used` KV blocks.
fn wait_for_blocks_used(metrics: &Metrics, used: i64) {
    let start = Instant::now();
    while metrics.kv_blocks_used.get() != used {
        assert!(
            start.elapsed() < DEADLINE,
            "kv_blocks_used stuck at {}",
            metrics.kv_blocks_used.get()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn single_request_matches_the_reference_and_reports_usage() {
    let (handle, thread, metrics) = start(FakeModel::new(32), config());
    let p = prompt(37, 1);
    let mut rx = handle.submit(request(p.clone(), 6)).unwrap();
    let (ids, end) = collect(&mut rx);
    assert_eq!(ids, reference(&p, 6));
    assert_eq!(
        end,
        SeqEvent::Finished {
            reason: FinishReason::Length,
            usage: TokenUsage {
                prompt_tokens: 37,
                completion_tokens: 6,
                cached_tokens: 0,
                earlier_turn_tokens: 0,
                kv_imported_tokens: 0,
            },
            pinned: None,
        }
    );
    wait_for_blocks_used(&metrics, 0);
    let text = metrics.encode();
    for line in [
        "pdserve_time_to_first_token_seconds_count 1",
        "pdserve_queue_seconds_count 1",
        "pdserve_request_seconds_count 1",
        "pdserve_generation_tokens_total 6",
        "pdserve_prompt_tokens_total 37",
    ] {
        assert!(text.contains(line), "missing {line}:\n{text}");
    }
    stop(handle, thread);
}

#[test]
fn concurrent_requests_batch_together_and_stay_correct() {
    let mut model = FakeModel::new(64);
    model.step_delay = Duration::from_millis(2);
    let batches = model.batches.clone();
    let (handle, thread, metrics) = start(model, config());
    let prompts: Vec<_> = (0..6).map(|i| prompt(5 + i * 9, i as u32)).collect();
    generate_all_and_check(&handle, &prompts, 12);
    assert!(batches.lock().unwrap().iter().any(|&b| b > 1));
    assert!(metrics.batch_size_max.get() > 1);
    stop(handle, thread);
}

#[test]
fn chunked_prefill_over_a_small_token_budget() {
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 7,
        ..config()
    };
    let (handle, thread, _) = start(FakeModel::new(32), cfg);
    let a = prompt(50, 3);
    let b = prompt(20, 4);
    let mut ra = handle.submit(request(a.clone(), 5)).unwrap();
    let mut rb = handle.submit(request(b.clone(), 5)).unwrap();
    assert_eq!(collect(&mut ra).0, reference(&a, 5));
    assert_eq!(collect(&mut rb).0, reference(&b, 5));
    stop(handle, thread);
}

#[test]
fn repeated_prompt_is_served_from_the_prefix_cache() {
    let (handle, thread, metrics) = start(FakeModel::new(32), config());
    let p = prompt(40, 7);
    let first = collect(&mut handle.submit(request(p.clone(), 4)).unwrap());
    let second = collect(&mut handle.submit(request(p.clone(), 4)).unwrap());
    assert_eq!(first.0, second.0);
    let SeqEvent::Finished { usage, .. } = second.1 else {
        panic!("{:?}", second.1)
    };
    assert_eq!(usage.cached_tokens, 32);
    assert_eq!(metrics.prefix_cache_hits.get(), 32);
    // A longer prompt sharing the first block also hits, and is still correct.
    let mut longer = p[..16].to_vec();
    longer.extend(prompt(10, 99));
    let (ids, end) = collect(&mut handle.submit(request(longer.clone(), 4)).unwrap());
    assert_eq!(ids, reference(&longer, 4));
    let SeqEvent::Finished { usage, .. } = end else {
        panic!("{end:?}")
    };
    assert_eq!(usage.cached_tokens, 16);
    wait_for_blocks_used(&metrics, 0);
    stop(handle, thread);
}

#[test]
fn out_of_blocks_preempts_and_recomputes_without_wrong_tokens() {
    // 6 blocks of 16 = 96 slots; three sequences growing to 40 tokens need 9 blocks.
    let mut model = FakeModel::new(6);
    model.step_delay = Duration::from_millis(1);
    let (handle, thread, metrics) = start(model, config());
    let prompts: Vec<_> = (0..3).map(|i| prompt(20, 20 + i)).collect();
    generate_all_and_check(&handle, &prompts, 20);
    assert!(
        metrics.preemptions.get() > 0,
        "the pool was too small for all three"
    );
    wait_for_blocks_used(&metrics, 0);
    stop(handle, thread);
}

#[test]
fn dropped_receiver_frees_the_sequence_and_its_blocks() {
    let mut model = FakeModel::new(32);
    model.step_delay = Duration::from_millis(2);
    let (handle, thread, metrics) = start(model, config());
    let mut rx = handle.submit(request(prompt(60, 5), 400)).unwrap();
    let start = Instant::now();
    let mut seen = 0;
    while seen < 3 {
        if let Ok(SeqEvent::Token { .. }) = rx.try_recv() {
            seen += 1;
        }
        assert!(start.elapsed() < DEADLINE);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(metrics.kv_blocks_used.get() > 0);
    drop(rx);
    wait_for_blocks_used(&metrics, 0);
    assert_eq!(metrics.running.get(), 0);
    stop(handle, thread);
}

#[test]
fn stop_tokens_end_the_sequence_unless_min_tokens_is_not_reached() {
    let (handle, thread, _) = start(FakeModel::new(32), config());
    let p = prompt(10, 1);
    let first = reference(&p, 1)[0];
    let mut req = request(p.clone(), 10);
    req.stop_token_ids = vec![first];
    let (ids, end) = collect(&mut handle.submit(req.clone()).unwrap());
    assert_eq!(ids, vec![first]);
    assert!(matches!(
        end,
        SeqEvent::Finished {
            reason: FinishReason::Stop,
            ..
        }
    ));
    req.min_new_tokens = 1;
    let (ids, _) = collect(&mut handle.submit(req).unwrap());
    assert_ne!(ids[0], first, "the stop token is banned before min_tokens");
    stop(handle, thread);
}

#[test]
fn full_queue_refuses_with_queue_full_and_frees_slots_on_admission() {
    // A handle whose scheduler never runs: submissions only fill the queue.
    let (tx, rx) = std_mpsc::channel();
    let handle = EngineHandle {
        commands: tx,
        queued: Arc::default(),
        max_waiting: 2,
        honours_priority: false,
        heartbeat: Arc::default(),
        profiler: Arc::default(),
    };
    let _a = handle.submit(request(prompt(4, 1), 1)).unwrap();
    let _b = handle.submit(request(prompt(4, 2), 1)).unwrap();
    assert_eq!(
        handle.submit(request(prompt(4, 3), 1)).unwrap_err(),
        SubmitError::QueueFull(2)
    );
    drop(rx);
    let fresh = EngineHandle {
        queued: Arc::default(),
        ..handle.clone()
    };
    assert_eq!(
        fresh.submit(request(prompt(4, 3), 1)).unwrap_err(),
        SubmitError::Stopped
    );
}

#[test]
fn prompts_that_can_never_fit_fail_instead_of_blocking() {
    let (handle, thread, _) = start(FakeModel::new(2), config());
    let (_, end) = collect(&mut handle.submit(request(prompt(40, 1), 4)).unwrap());
    assert!(
        matches!(end, SeqEvent::Failed(ref m) if m.contains("limit")),
        "{end:?}"
    );
    // The worker keeps serving what fits.
    let p = prompt(8, 2);
    assert_eq!(
        collect(&mut handle.submit(request(p.clone(), 3)).unwrap()).0,
        reference(&p, 3)
    );
    stop(handle, thread);
}

/// Submits a `long_len`-token prompt, and once it is admitted (its prefill running in
/// chunks of `budget`) a `short_len`-token one; checks both outputs and answers which of
/// the two sampled its first token first.
fn first_token_of_long_and_short(
    policy: SchedulingPolicy,
    long_len: usize,
    short_len: usize,
    budget: usize,
) -> &'static str {
    first_token_by_priority(policy, (long_len, 0), (short_len, 0), budget)
}

/// [`first_token_of_long_and_short`] with each request's (prompt length, `priority`).
fn first_token_by_priority(
    policy: SchedulingPolicy,
    (long_len, long_priority): (usize, i64),
    (short_len, short_priority): (usize, i64),
    budget: usize,
) -> &'static str {
    let mut model = FakeModel::new(64);
    model.step_delay = Duration::from_millis(5);
    let cfg = SchedulerConfig {
        policy,
        max_num_batched_tokens: budget,
        ..config()
    };
    let (handle, thread, _) = start(model, cfg);
    let long = prompt(long_len, 3);
    let short = prompt(short_len, 4);
    let with_priority = |prompt: &[u32], priority| GenerationRequest {
        priority,
        ..request(prompt.to_vec(), 2)
    };
    let mut long_rx = handle.submit(with_priority(&long, long_priority)).unwrap();
    let started = Instant::now();
    loop {
        match long_rx.try_recv() {
            Ok(SeqEvent::Admitted { .. }) => break,
            Ok(other) => panic!("before admission: {other:?}"),
            Err(_) => {
                assert!(started.elapsed() < DEADLINE, "never admitted");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    let mut short_rx = handle
        .submit(with_priority(&short, short_priority))
        .unwrap();
    let mut first = None;
    let mut outputs = [Vec::new(), Vec::new()];
    let mut ended = [false, false];
    while !(ended[0] && ended[1]) {
        assert!(started.elapsed() < DEADLINE, "did not finish");
        for (k, rx) in [&mut long_rx, &mut short_rx].into_iter().enumerate() {
            if ended[k] {
                continue;
            }
            match rx.try_recv() {
                Ok(SeqEvent::Token { id, .. }) => {
                    first.get_or_insert(["long", "short"][k]);
                    outputs[k].push(id);
                }
                Ok(SeqEvent::Admitted { .. }) => {}
                Ok(_) => ended[k] = true,
                Err(mpsc::error::TryRecvError::Empty) => {}
                Err(e) => panic!("{e}"),
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // Whatever the order, the outputs are the reference continuations.
    assert_eq!(outputs[0], reference(&long, 2));
    assert_eq!(outputs[1], reference(&short, 2));
    stop(handle, thread);
    first.expect("tokens came")
}

#[test]
fn shortest_prefill_first_lets_a_short_prompt_pass_a_long_prefill() {
    let spf = SchedulingPolicy::ShortestPrefillFirst {
        age_limit: Duration::from_secs(60),
    };
    assert_eq!(first_token_of_long_and_short(spf, 200, 5, 8), "short");
    // First come, first served: the long prompt keeps the whole budget until it is done.
    assert_eq!(
        first_token_of_long_and_short(SchedulingPolicy::Fcfs, 200, 5, 8),
        "long"
    );
    // Past the age limit (here at once) a request keeps its place.
    let aged = SchedulingPolicy::ShortestPrefillFirst {
        age_limit: Duration::ZERO,
    };
    assert_eq!(first_token_of_long_and_short(aged, 200, 5, 8), "long");
    // The short prompt joins the long one's last chunk with budget to spare: each is
    // scheduled once (scheduling the admitted one again overran its prompt).
    first_token_of_long_and_short(spf, 100, 10, 64);
}

#[test]
fn priority_scheduling_serves_a_lower_priority_value_first_then_arrival() {
    let p = SchedulingPolicy::Priority;
    // A later request of a lower value passes a running prefill of a higher one, even a
    // longer one.
    assert_eq!(first_token_by_priority(p, (200, 5), (200, 0), 8), "short");
    assert_eq!(first_token_by_priority(p, (200, 0), (5, -3), 8), "short");
    // Within one priority, arrival order: the short prompt does not pass (that would be
    // shortest-prefill-first), nor does a later one of a higher value.
    assert_eq!(first_token_by_priority(p, (200, 1), (5, 1), 8), "long");
    assert_eq!(first_token_by_priority(p, (200, 0), (5, 2), 8), "long");
}

#[test]
fn a_priority_is_refused_unless_priority_scheduling_is_on() {
    let (handle, thread, _) = start(FakeModel::new(64), config());
    let ranked = GenerationRequest {
        priority: 1,
        ..request(prompt(4, 1), 1)
    };
    assert_eq!(
        handle.submit(ranked).unwrap_err(),
        SubmitError::PriorityNotEnabled
    );
    // Priority 0 is everyone's default and always accepted.
    let mut rx = handle.submit(request(prompt(4, 1), 1)).unwrap();
    assert!(matches!(collect(&mut rx).1, SeqEvent::Finished { .. }));
    stop(handle, thread);
}

#[test]
fn shortest_prefill_first_stays_correct_when_blocks_run_out() {
    // 8 blocks of 16 tokens for prompts of mixed length that together need more.
    let mut model = FakeModel::new(8);
    model.step_delay = Duration::from_millis(1);
    let cfg = SchedulerConfig {
        policy: SchedulingPolicy::ShortestPrefillFirst {
            age_limit: Duration::from_secs(60),
        },
        max_num_batched_tokens: 24,
        ..config()
    };
    let (handle, thread, metrics) = start(model, cfg);
    let prompts: Vec<_> = [60, 5, 40, 12, 30, 3]
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt(len, 40 + i as u32))
        .collect();
    generate_all_and_check(&handle, &prompts, 20);
    wait_for_blocks_used(&metrics, 0);
    stop(handle, thread);
}

#[test]
fn a_prefill_short_of_blocks_is_not_stuck_behind_a_waiting_prompt_that_cannot_be_admitted() {
    // Driven step by step (no thread): two 40-token prompts half prefilled hold all four
    // blocks, and a 5-token prompt waits. It goes first under the policy but cannot be
    // admitted; the running prefills must still move (one preempted for the other's
    // block) rather than the step scheduling nothing, forever. Only the schedule is
    // checked: their first 32 positions were never written, so the fake fails the batch.
    let model = FakeModel::new(4);
    let batches = model.batches.clone();
    let mut scheduler = Scheduler {
        blocks: BlockManager::new(4),
        events: None,
        model,
        config: SchedulerConfig {
            policy: SchedulingPolicy::ShortestPrefillFirst {
                age_limit: Duration::from_secs(60),
            },
            ..config()
        },
        metrics: Arc::new(Metrics::new()),
        queued: Arc::default(),
        waiting: VecDeque::new(),
        running: Vec::new(),
        stopping: false,
        heartbeat: Arc::default(),
        profiler: Arc::default(),
    };
    let (events, _receiver) = mpsc::unbounded_channel();
    for salt in [1, 2] {
        let mut seq = Sequence::new(request(prompt(40, salt), 4), events.clone());
        seq.blocks = scheduler.blocks.allocate(2).unwrap();
        seq.num_computed = 32;
        seq.cached_tokens = Some(0);
        seq.holds_queue_slot = false;
        scheduler.running.push(seq);
    }
    let mut short = Sequence::new(request(prompt(5, 3), 4), events);
    short.holds_queue_slot = false;
    scheduler.waiting.push_back(short);
    assert_eq!(scheduler.blocks.num_free(), 0);
    assert!(scheduler.step(), "the step scheduled nothing");
    assert_eq!(batches.lock().unwrap().len(), 1);
    assert_eq!(scheduler.metrics.preemptions.get(), 1);
}

/// Reads a scored sequence to the end: its prompt logprobs, generated ids, final event.
fn collect_scored(rx: &mut SeqEvents) -> (Vec<TokenLogprobs>, Vec<u32>, SeqEvent) {
    let start = Instant::now();
    let (mut scores, mut ids) = (None, Vec::new());
    loop {
        match rx.try_recv() {
            Ok(SeqEvent::PromptLogprobs(lps)) => {
                assert!(
                    scores.is_none() && ids.is_empty(),
                    "scores once, before tokens"
                );
                scores = Some(lps);
            }
            Ok(SeqEvent::Token { id, .. }) => ids.push(id),
            Ok(SeqEvent::Admitted { .. }) => {}
            Ok(end) => return (scores.expect("prompt logprobs sent"), ids, end),
            Err(mpsc::error::TryRecvError::Empty) => {
                assert!(start.elapsed() < DEADLINE, "sequence did not finish");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("events channel closed early: {e}"),
        }
    }
}

#[test]
fn prompt_logprobs_score_every_chunk_and_ignore_the_prefix_cache() {
    // Chunks of 16 tokens: a 50-token prompt is scored across four steps.
    let config = SchedulerConfig {
        max_num_batched_tokens: 16,
        ..config()
    };
    let (handle, thread, metrics) = start(FakeModel::new(64), config);
    // Half the prompt follows the fake's own continuation: those tokens score high.
    let mut p = prompt(25, 3);
    p.extend(reference(&p, 25));
    let scored = |max_new_tokens| GenerationRequest {
        prompt_logprobs: Some(2),
        ..request(p.clone(), max_new_tokens)
    };
    let mut rx = handle.submit(scored(3)).unwrap();
    let (lps, ids, _) = collect_scored(&mut rx);
    assert_eq!(ids, reference(&p, 3));
    assert_eq!(lps.len(), p.len() - 1);
    for (i, lp) in lps.iter().enumerate() {
        let predicted = next_token(&p[..i + 1]) == p[i + 1];
        assert_eq!(lp.rank == 1, predicted, "position {}", i + 1);
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0].0, next_token(&p[..i + 1]));
    }
    // The prompt's blocks are cached now; a second scoring computes it all again and
    // `max_tokens` 0 ends without a token.
    let mut rx = handle.submit(scored(0)).unwrap();
    let (again, ids, end): (Vec<TokenLogprobs>, _, _) = collect_scored(&mut rx);
    assert!(ids.is_empty());
    assert_eq!(again, lps);
    match end {
        SeqEvent::Finished { reason, usage, .. } => {
            assert_eq!(reason, FinishReason::Length);
            assert_eq!((usage.completion_tokens, usage.cached_tokens), (0, 0));
        }
        other => panic!("{other:?}"),
    }
    wait_for_blocks_used(&metrics, 0);
    // Imported KV cannot be scored.
    let mut importing = scored(1);
    importing.kv_import = Some(KvImport {
        num_tokens: 16,
        blocks: vec![vec![0; 64]],
        reused: Default::default(),
        landed_at: None,
    });
    let mut rx = handle.submit(importing).unwrap();
    match rx.blocking_recv() {
        Some(SeqEvent::Failed(msg)) => assert!(msg.contains("prompt logprobs"), "{msg}"),
        other => panic!("{other:?}"),
    }
    stop(handle, thread);
}
