//! `serve` against the scripted server: measured latencies against scripted truth,
//! goodput, failure reasons, Poisson arrivals and the bench's own send lateness,
//! interruption and priority classes.
//!
//! Tolerances: a measurement can only exceed the scripted delay (the server sleeps at
//! least that long), so lower bounds are tight; upper bounds leave room for a loaded
//! 2-core CI machine.

mod support;

use std::time::Duration;

use pdserve_bench::schedule::poisson_offsets;
use pdserve_bench::serve::run_serve;
use support::scripted_server::{Reply, ScriptedServer, MODEL};
use support::{never, serve_args, TEST_LIMIT};
use tokio::time::timeout;

const TTFT_MS: f64 = 50.0;
const ITL_MS: f64 = 20.0;
const TOKENS: u64 = 10;
/// Slack for scheduling delays on a loaded machine.
const SLACK_MS: f64 = 60.0;

async fn timed_run(endpoint: &str) {
    let server = ScriptedServer::start(|_| Reply::stream_ms(TTFT_MS as u64, ITL_MS as u64)).await;
    let url = server.url();
    let args = serve_args(&[
        "--url",
        &url,
        "--num-prompts",
        "12",
        "--concurrency",
        "4",
        "--input-len",
        "30",
        "--output-len",
        "10",
        "--endpoint",
        endpoint,
    ]);
    let result = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;
    let s = &result.summary;
    assert_eq!(
        (s.completed, s.failed, s.not_finished),
        (12, 0, 0),
        "{:?}",
        result.failures
    );
    // The probe goes first and shares no prefix with the workload (no cache warm-up).
    let first_words = |b: &serde_json::Value| {
        let t = &b["prompt"];
        let t = if t.is_null() {
            &b["messages"][0]["content"]
        } else {
            t
        };
        let words: Vec<&str> = t.as_str().unwrap().split_whitespace().take(4).collect();
        words.join(" ")
    };
    assert_eq!(bodies.len(), 13);
    assert_eq!(bodies[0]["max_tokens"], 1);
    let probe = first_words(&bodies[0]);
    assert!(
        bodies[1..].iter().all(|b| first_words(b) != probe),
        "probe prefix reused"
    );
    assert_eq!(
        result.config.model, MODEL,
        "model defaults to the first listed"
    );
    assert_eq!(s.total_output_tokens, 12 * TOKENS);
    // The server reports the prompt's word count: the dataset's approximation is exact.
    assert_eq!(s.total_input_tokens, 12 * 30);

    let ttft = s.ttft_ms.expect("ttft");
    assert!(
        ttft.min >= TTFT_MS,
        "TTFT {ttft:?} below the scripted {TTFT_MS} ms"
    );
    assert!(ttft.mean <= TTFT_MS + SLACK_MS, "TTFT {ttft:?}");
    let itl = s.itl_ms.expect("itl");
    assert!(
        itl.mean >= ITL_MS - 1.0 && itl.mean <= ITL_MS + 15.0,
        "ITL {itl:?}"
    );
    assert!(itl.p50 >= ITL_MS - 1.0, "ITL {itl:?}");
    let tpot = s.tpot_ms.expect("tpot");
    assert!(
        tpot.min >= ITL_MS - 1.0 && tpot.mean <= ITL_MS + 15.0,
        "TPOT {tpot:?}"
    );
    let e2e = s.e2e_ms.expect("e2e");
    let scripted_e2e = TTFT_MS + (TOKENS - 1) as f64 * ITL_MS;
    assert!(
        e2e.min >= scripted_e2e && e2e.mean <= scripted_e2e + SLACK_MS + 100.0,
        "E2E {e2e:?}"
    );
    for r in &result.requests {
        assert_eq!(r.itl_ms.len() as u64, TOKENS - 1);
        assert_eq!(r.output_tokens, TOKENS);
    }

    // 4 slots each run 3 requests back to back, each at least `scripted_e2e` long.
    let floor_s = 3.0 * scripted_e2e / 1e3;
    assert!(s.duration_s >= floor_s, "duration {}", s.duration_s);
    assert!(s.duration_s <= floor_s + 0.8, "duration {}", s.duration_s);
    let max_rps = 12.0 / floor_s;
    assert!(
        s.request_throughput <= max_rps && s.request_throughput >= max_rps * 0.45,
        "throughput {} vs at most {max_rps}",
        s.request_throughput
    );
    assert!((s.output_throughput - s.request_throughput * TOKENS as f64).abs() < 1e-6);
    assert_eq!(s.goodput, None, "no SLO given");
}

#[tokio::test]
async fn completions_timings_match_the_script() {
    timed_run("completions").await;
}

#[tokio::test]
async fn chat_timings_match_the_script_and_ignore_the_role_chunk() {
    // The role chunk arrives at once; were it counted, TTFT would be ~0.
    timed_run("chat").await;
}

#[tokio::test]
async fn goodput_counts_exactly_the_requests_meeting_both_slos() {
    // Per arrival: fast, slow first token, slow decode, both slow (twice each).
    let server = ScriptedServer::start(|n| match n % 4 {
        0 => Reply::stream_ms(30, 10),
        1 => Reply::stream_ms(400, 10),
        2 => Reply::stream_ms(30, 80),
        _ => Reply::stream_ms(400, 80),
    })
    .await;
    let url = server.url();
    let args = serve_args(&[
        "--url",
        &url,
        "--num-prompts",
        "8",
        "--concurrency",
        "8",
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--slo-ttft-ms",
        "200",
        "--slo-tpot-ms",
        "40",
    ]);
    let result = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    server.stop().await;
    let s = &result.summary;
    assert_eq!(s.completed, 8);
    assert_eq!(s.good_requests, Some(2));
    let goodput = s.goodput.expect("goodput");
    assert!((goodput - 2.0 / s.duration_s).abs() < 1e-9);
    assert!(goodput < s.request_throughput);
    let table = result.table();
    assert!(
        table.contains("TTFT≤200ms TPOT≤40ms") && table.contains("Request goodput (req/s):"),
        "{table}"
    );
}

#[tokio::test]
async fn failures_are_counted_with_their_reasons() {
    let server = ScriptedServer::start(|n| match n % 5 {
        0 => Reply::stream_ms(1, 1),
        1 => Reply::Error {
            status: 503,
            message: "engine overloaded".into(),
        },
        2 => Reply::Truncated { after: 2 },
        3 => Reply::ErrorEvent {
            after: 1,
            message: "decode worker lost".into(),
        },
        _ => Reply::Json,
    })
    .await;
    let url = server.url();
    let args = serve_args(&[
        "--url",
        &url,
        "--num-prompts",
        "10",
        "--concurrency",
        "3",
        "--output-len",
        "4",
    ]);
    let result = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    server.stop().await;
    assert_eq!((result.summary.completed, result.summary.failed), (2, 8));
    let reasons: Vec<(&str, u64)> = result
        .failures
        .iter()
        .map(|f| (f.reason.as_str(), f.count))
        .collect();
    assert!(
        reasons.contains(&("HTTP 503: engine overloaded", 2)),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&("broken stream: ended before `data: [DONE]`", 2)),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&("error event: decode worker lost", 2)),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|(r, n)| *n == 2
            && r.starts_with(
                "not an OpenAI-compatible stream: expected text/event-stream, got application/json"
            )),
        "{reasons:?}"
    );
    assert!(result.table().contains("engine overloaded"));
}

#[tokio::test]
async fn request_rate_mode_sends_on_the_poisson_schedule() {
    let server = ScriptedServer::start(|_| Reply::stream_ms(2, 2)).await;
    let url = server.url();
    let (n, rate, seed) = (20usize, 25.0, 11u64);
    let args = serve_args(&[
        "--url",
        &url,
        "--num-prompts",
        "20",
        "--request-rate",
        "25",
        "--seed",
        "11",
        "--output-len",
        "2",
        "--input-len",
        "4",
    ]);
    let result = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    server.stop().await;
    assert_eq!(result.summary.completed, n as u64);
    assert_eq!(result.config.request_rate, Some(rate));
    assert_eq!(result.config.concurrency, None);
    let planned = poisson_offsets(n, rate, seed);
    for (r, at) in result.requests.iter().zip(&planned) {
        let at = at.as_secs_f64();
        assert_eq!(r.scheduled_s, Some(at), "request {}", r.index);
        assert!(
            r.start_s >= at,
            "request {} sent at {} before {at}",
            r.index,
            r.start_s
        );
        assert!(
            r.start_s <= at + 0.15,
            "request {} sent at {}, planned {at}",
            r.index,
            r.start_s
        );
    }
    // The realised span matches the plan, so the achieved rate is the planned one.
    let span = result.requests.last().unwrap().start_s - result.requests[0].start_s;
    let planned_span = planned[n - 1].as_secs_f64();
    assert!(
        (span - planned_span).abs() < 0.15,
        "span {span} vs {planned_span}"
    );
    // Open loop: the run lasts about as long as the schedule, not n × latency.
    assert!(result.summary.duration_s >= planned_span);
}

#[tokio::test]
async fn interruption_keeps_finished_requests_and_drops_the_rest() {
    // Each request takes >= 1 s; two slots; interrupted at 1.5 s, mid second wave.
    let server = ScriptedServer::start(|_| Reply::stream_ms(50, 50)).await;
    let url = server.url();
    let args = serve_args(&[
        "--url",
        &url,
        "--num-prompts",
        "6",
        "--concurrency",
        "2",
        "--output-len",
        "20",
    ]);
    let begun = std::time::Instant::now();
    let stop = tokio::time::sleep(Duration::from_millis(1500));
    let result = timeout(TEST_LIMIT, run_serve(&args, stop))
        .await
        .expect("bounded")
        .expect("run");
    let waited = begun.elapsed();
    server.stop().await;
    assert!(result.interrupted);
    let s = &result.summary;
    assert!((1..=2).contains(&s.completed), "{s:?}");
    assert_eq!(s.failed, 0);
    assert_eq!(s.not_finished, 6 - s.completed);
    assert!(
        waited < Duration::from_millis(2500),
        "did not wait for in-flight requests: {waited:?}"
    );
    assert!(result.table().contains("interrupted"));
    let err = pdserve_bench::emit(&result, &Default::default()).unwrap_err();
    assert!(matches!(err, pdserve_bench::BenchError::Interrupted));
}

#[tokio::test]
async fn priority_classes_are_sent_in_their_shares_and_rejections_counted_per_class() {
    for endpoint in ["completions", "chat"] {
        priority_case(endpoint).await;
    }
}

async fn priority_case(endpoint: &str) {
    // An overloaded gateway's queue in miniature: priority -1 is served, priority 5 is
    // turned away (queue full), requests without a priority wait until they time out.
    let server = ScriptedServer::start_with_body(|_, body| match body["priority"].as_i64() {
        Some(-1) => Reply::stream_ms(1, 1),
        Some(_) => Reply::Error {
            status: 429,
            message: "queue full".into(),
        },
        None => Reply::Error {
            status: 408,
            message: "queue wait ran out".into(),
        },
    })
    .await;
    let url = server.url();
    let (n, seed) = (200u64, 3u64);
    let args = serve_args(&[
        "--url",
        &url,
        "--num-prompts",
        "200",
        "--concurrency",
        "8",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--seed",
        "3",
        "--endpoint",
        endpoint,
        "--priority",
        "-1:0.5",
        "--priority",
        "5:0.25",
    ]);
    let result = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;

    // The probe carries the first non-zero priority, so a server refusing it stops the
    // run up front.
    assert_eq!(bodies[0]["max_tokens"], 1);
    assert_eq!(bodies[0]["priority"], -1);
    let workload = &bodies[1..];
    assert_eq!(workload.len() as u64, n);
    assert!(workload.iter().all(|b| b
        .get(if endpoint == "chat" {
            "messages"
        } else {
            "prompt"
        })
        .is_some()));
    // The seed fixes each request's class; the bodies carry exactly those.
    let planned = |class: Option<i64>| {
        (0..n)
            .filter(|&i| args.priority.class_of(seed, i) == class)
            .count() as u64
    };
    let sent = |class: Option<i64>| {
        workload
            .iter()
            .filter(|b| b.get("priority").and_then(|p| p.as_i64()) == class)
            .count() as u64
    };
    for (class, share) in [(Some(-1), 0.5), (Some(5), 0.25), (None, 0.25)] {
        assert_eq!(sent(class), planned(class), "{endpoint} {class:?}");
        let got = sent(class) as f64 / n as f64;
        assert!((got - share).abs() < 0.1, "{class:?}: share {got}");
    }
    assert!(workload
        .iter()
        .all(|b| b.get("priority").is_none_or(serde_json::Value::is_i64)));
    for r in &result.requests {
        assert_eq!(r.priority, args.priority.class_of(seed, r.index));
        let status = match r.priority {
            Some(-1) => None,
            Some(_) => Some(429),
            None => Some(408),
        };
        assert_eq!(r.http_status, status, "request {}", r.index);
    }

    let rows: Vec<_> = result
        .per_priority
        .iter()
        .map(|p| {
            (
                p.priority,
                p.completed,
                p.failed,
                p.rejected_429,
                p.rejected_408,
            )
        })
        .collect();
    let (high, low, none) = (planned(Some(-1)), planned(Some(5)), planned(None));
    assert_eq!(
        rows,
        vec![
            (Some(-1), high, 0, 0, 0),
            (Some(5), 0, low, low, 0),
            (None, 0, none, 0, none),
        ]
    );
    let served = &result.per_priority[0];
    assert!(served.ttft_ms.expect("TTFT of the served class").min >= 1.0);
    assert!(served.e2e_ms.is_some());
    assert!(result.per_priority[1].ttft_ms.is_none());
    assert_eq!(
        result
            .config
            .priorities
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["-1:0.5", "5:0.25"]
    );

    let table = result.table();
    println!("{table}");
    let section: Vec<Vec<&str>> = table
        .lines()
        .skip_while(|l| !l.contains(" Per priority "))
        .skip(2)
        .take(3)
        .map(|l| l.split_whitespace().collect())
        .collect();
    let (low, none) = (low.to_string(), none.to_string());
    assert_eq!(section[0][..5], ["-1", &high.to_string(), "0", "0", "0"]);
    assert_eq!(section[1], ["5", "0", &low, &low, "0", "-", "-", "-", "-"]);
    assert_eq!(
        section[2],
        ["none", "0", &none, "0", &none, "-", "-", "-", "-"]
    );
    // Every line of the widened report has the same width as its frame.
    let width = table.lines().next().unwrap().chars().count();
    assert!(table.lines().all(|l| l.chars().count() <= width), "{table}");
}

#[tokio::test]
async fn lateness_is_reported_for_open_loops_and_flagged_when_high() {
    let server = ScriptedServer::start(|_| Reply::stream_ms(1, 1)).await;
    let url = server.url();
    let flags = [
        "--url",
        url.as_str(),
        "--num-prompts",
        "4",
        "--input-len",
        "4",
        "--output-len",
        "2",
    ];
    let mut rate = flags.to_vec();
    rate.extend(["--request-rate", "100"]);
    let open = timeout(TEST_LIMIT, run_serve(&serve_args(&rate), never()))
        .await
        .expect("bounded")
        .expect("run");
    let mut closed = flags.to_vec();
    closed.extend(["--concurrency", "2"]);
    let closed = timeout(TEST_LIMIT, run_serve(&serve_args(&closed), never()))
        .await
        .expect("bounded")
        .expect("run");
    server.stop().await;

    assert!(open.requests.iter().all(|r| r.scheduled_s.is_some()));
    let mut late = open.clone();
    let lateness = open
        .summary
        .send_lateness_ms
        .expect("request-rate mode is an open loop");
    assert!(open.table().contains("Send Lateness"));
    assert!(
        closed.summary.send_lateness_ms.is_none()
            && closed.requests.iter().all(|r| r.scheduled_s.is_none())
    );
    assert!(!closed.table().contains("Send Lateness"));
    // A client that cannot keep up is called out.
    late.summary.send_lateness_ms = Some(pdserve_bench::metrics::Distribution {
        p99: 25.0,
        max: 40.0,
        ..lateness
    });
    let table = late.table();
    assert!(table.contains("LATE: p99 > 10 ms"), "{table}");
    if lateness.p99 <= 10.0 {
        assert!(!open.table().contains("LATE"));
    }
    let width = table.lines().next().unwrap().chars().count();
    assert!(table.lines().all(|l| l.chars().count() <= width), "{table}");
}
