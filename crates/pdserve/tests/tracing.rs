//! OpenTelemetry traces end to end (issue 27, part 1): an OTLP/HTTP receiver started
//! here, `pdserve up --otlp-traces-endpoint` pointed at it, one chat request with a
//! client `traceparent`; the client's trace holds spans from the gateway and both
//! workers, each span's parent is in the trace (but the client's own), and the spans
//! of every stage are there. `--nocapture` prints the span tree with durations.

#[path = "support/up.rs"]
mod up_support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;
use up_support::Up;

/// The client's trace and span: every span of the request must be in this trace.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// One received span, with the `service.name` of the process that sent it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    start: u64,
    end: u64,
    attributes: BTreeMap<String, String>,
    events: Vec<String>,
    /// The span ids it links to.
    links: Vec<String>,
}

type Spans = Arc<Mutex<Vec<Received>>>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => format!("{d:.6}"),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::ArrayValue(a)) => {
            let items: Vec<String> = a.values.iter().map(|v| text(v.value.as_ref())).collect();
            format!("[{}]", items.join(","))
        }
        other => format!("{other:?}"),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let value = kv.value.as_ref().and_then(|v| v.value.as_ref());
            (kv.key.clone(), text(value))
        })
        .collect()
}

/// `POST /v1/traces`: OTLP/HTTP protobuf, every span kept.
async fn receive(State(spans): State<Spans>, body: Bytes) -> &'static str {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
    let mut spans = spans.lock().unwrap();
    for resource in request.resource_spans {
        let resource_attributes = resource
            .resource
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service = resource_attributes
            .get("service.name")
            .cloned()
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                spans.push(Received {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                    start: span.start_time_unix_nano,
                    end: span.end_time_unix_nano,
                    attributes: attributes(&span.attributes),
                    events: span.events.into_iter().map(|e| e.name).collect(),
                    links: span.links.iter().map(|l| hex(&l.span_id)).collect(),
                });
            }
        }
    }
    ""
}

/// An OTLP/HTTP receiver on 127.0.0.1:0: its traces URL and what it received.
async fn receiver() -> (String, Spans, tokio::task::JoinHandle<()>) {
    let spans = Spans::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(spans.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (url, spans, server)
}

/// The client's trace, once `done` says it is complete (or the wait ran out).
async fn trace_when(spans: &Spans, done: impl Fn(&[Received]) -> bool) -> Vec<Received> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let trace: Vec<Received> = spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == TRACE_ID)
            .cloned()
            .collect();
        if done(&trace) || tokio::time::Instant::now() > deadline {
            return trace;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The span tree under the client's span: name, process and duration, indented.
fn tree(trace: &[Received]) -> String {
    let mut children: BTreeMap<&str, Vec<&Received>> = BTreeMap::new();
    for span in trace {
        children.entry(span.parent.as_str()).or_default().push(span);
    }
    for list in children.values_mut() {
        list.sort_by_key(|s| s.start);
    }
    let mut out = String::new();
    fn walk(
        out: &mut String,
        children: &BTreeMap<&str, Vec<&Received>>,
        parent: &str,
        depth: usize,
        origin: u64,
    ) {
        for span in children.get(parent).into_iter().flatten() {
            let ms = span.end.saturating_sub(span.start) as f64 / 1e6;
            let at = span.start.saturating_sub(origin) as f64 / 1e6;
            let events = if span.events.is_empty() {
                String::new()
            } else {
                format!(" events={:?}", span.events)
            };
            out.push_str(&format!(
                "{:indent$}{} [{}] {ms:.2} ms (at +{at:.2} ms){events}\n",
                "",
                span.name,
                span.service,
                indent = depth * 2
            ));
            walk(out, children, &span.span_id, depth + 1, origin);
        }
    }
    let origin = trace.iter().map(|s| s.start).min().unwrap_or(0);
    walk(&mut out, &children, CLIENT_SPAN, 0, origin);
    out
}

/// Every span's parent is in the trace, but the client's span.
fn assert_connected(trace: &[Received]) {
    let ids: BTreeSet<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
    for span in trace {
        assert!(
            span.parent == CLIENT_SPAN || ids.contains(span.parent.as_str()),
            "{} [{}] has a parent ({}) outside the trace",
            span.name,
            span.service,
            span.parent
        );
    }
}

fn find<'a>(trace: &'a [Received], service: &str, name: &str) -> &'a Received {
    trace
        .iter()
        .find(|s| s.service == service && s.name == name)
        .unwrap_or_else(|| panic!("no {name:?} span from {service}:\n{}", tree(trace)))
}

fn parent_of<'a>(trace: &'a [Received], span: &Received) -> &'a Received {
    trace
        .iter()
        .find(|s| s.span_id == span.parent)
        .unwrap_or_else(|| panic!("{} has no parent in the trace", span.name))
}

/// One streamed chat request carrying the client's `traceparent`; its text.
async fn chat(entry: &str) -> String {
    chat_in(entry, &format!("00-{TRACE_ID}-{CLIENT_SPAN}-01")).await
}

/// A trace whose client said "not sampled" (flags 00): no process records a span of it.
const UNSAMPLED_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

/// One streamed chat request carrying `traceparent`; its text.
async fn chat_in(entry: &str, traceparent: &str) -> String {
    let http = reqwest::Client::new();
    let response = tokio::time::timeout(
        Duration::from_secs(120),
        http.post(format!("{entry}/v1/chat/completions"))
            .header("traceparent", traceparent)
            .json(&serde_json::json!({
                "messages": [{"role": "user", "content": "Give me three tips for staying healthy."}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": true,
            }))
            .send(),
    )
    .await
    .expect("the request timed out")
    .unwrap();
    assert_eq!(response.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(120), response.text())
        .await
        .expect("the stream timed out")
        .unwrap();
    assert!(body.contains("[DONE]"), "{body}");
    body
}

const GATEWAY: &str = "pdserve-gateway";
const PREFILL: &str = "pdserve-worker-prefill";
const DECODE: &str = "pdserve-worker-decode";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pd_request_is_one_trace_across_gateway_prefill_and_decode() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let (url, spans, server) = receiver().await;
    let up = tokio::task::spawn_blocking(move || {
        Up::start(&model, &["--otlp-traces-endpoint", url.as_str()])
    })
    .await
    .unwrap();
    chat(&up.entry).await;
    chat_in(
        &up.entry,
        &format!("00-{UNSAMPLED_TRACE_ID}-{CLIENT_SPAN}-00"),
    )
    .await;
    // Stopping the stack flushes every process's exporter.
    tokio::task::spawn_blocking(move || up.stop())
        .await
        .unwrap();
    let services = [GATEWAY, PREFILL, DECODE];
    let trace = trace_when(&spans, |t| {
        services.iter().all(|s| t.iter().any(|x| x.service == *s))
            && t.iter().any(|x| x.name == "kv_export")
            && t.iter().filter(|x| x.name == "llm_request").count() >= 2
    })
    .await;
    println!(
        "span tree of one P/D request (name [process] duration):\n{}",
        tree(&trace)
    );

    assert_connected(&trace);
    let request = find(&trace, GATEWAY, "POST /v1/chat/completions");
    assert_eq!(
        request.parent, CLIENT_SPAN,
        "the gateway's span is the client's child"
    );
    assert_eq!(request.attributes["gen_ai.operation.name"], "chat");
    assert_eq!(request.attributes["gen_ai.request.max_tokens"], "8");
    assert_eq!(request.attributes["http.response.status_code"], "200");
    let routings: Vec<&Received> = trace.iter().filter(|s| s.name == "routing").collect();
    let roles: BTreeSet<&str> = routings
        .iter()
        .map(|s| s.attributes["pdserve.routing.role"].as_str())
        .collect();
    assert_eq!(roles, BTreeSet::from(["decode", "prefill"]), "{routings:?}");
    assert!(routings.iter().all(|s| s.parent == request.span_id));
    assert!(routings
        .iter()
        .all(|s| s.attributes.contains_key("pdserve.routing.policy")));

    // Each leg is a client span of the gateway's request, and the worker's server span
    // hangs under it.
    for (leg, worker) in [("prefill leg", PREFILL), ("decode leg", DECODE)] {
        let leg_span = find(&trace, GATEWAY, leg);
        assert_eq!(leg_span.parent, request.span_id, "{leg}");
        assert_eq!(leg_span.attributes["http.response.status_code"], "200");
        let served = find(&trace, worker, "POST /v1/chat/completions");
        assert_eq!(
            served.parent, leg_span.span_id,
            "{worker}'s request is under the {leg}"
        );
        let llm = trace
            .iter()
            .find(|s| s.service == worker && s.name == "llm_request")
            .unwrap();
        assert_eq!(llm.parent, served.span_id);
        for stage in ["queue", "prefill"] {
            assert_eq!(
                parent_of(&trace, find(&trace, worker, stage)).span_id,
                llm.span_id
            );
        }
        assert!(llm.events.iter().any(|e| e == "first_token"), "{llm:?}");
        assert!(llm
            .attributes
            .contains_key("gen_ai.latency.time_to_first_token"));
        assert!(llm.attributes.contains_key("gen_ai.latency.time_in_queue"));
    }
    let answered = find(&trace, DECODE, "POST /v1/chat/completions");
    assert!(answered.attributes["gen_ai.response.id"].starts_with("chatcmpl-"));
    assert_eq!(answered.attributes["gen_ai.operation.name"], "chat");
    let decode = find(&trace, DECODE, "decode");
    assert_eq!(decode.attributes["gen_ai.usage.output_tokens"], "8");

    // The KV transfer: the decode worker's pull, and the prefill worker's export under it.
    let pull = find(&trace, DECODE, "kv_pull");
    assert_eq!(parent_of(&trace, pull).name, "POST /v1/chat/completions");
    assert!(pull.attributes["pdserve.kv.blocks"].parse::<u64>().unwrap() > 0);
    assert!(pull.attributes["pdserve.kv.bytes"].parse::<u64>().unwrap() > 0);
    let export = find(&trace, PREFILL, "kv_export");
    assert_eq!(export.parent, pull.span_id, "the export is under the pull");
    let published_by = find(&trace, PREFILL, "POST /v1/chat/completions");
    assert_eq!(
        export.links,
        vec![published_by.span_id.clone()],
        "the export links to the prefill request that published the blocks"
    );
    assert_eq!(
        export.attributes["pdserve.kv.blocks"],
        pull.attributes["pdserve.kv.blocks"]
    );

    // The unsampled request left no span anywhere (its context still reached the workers,
    // whose parent-based sampler honoured it).
    let unsampled: Vec<String> = spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace_id == UNSAMPLED_TRACE_ID)
        .map(|s| format!("{} [{}]", s.name, s.service))
        .collect();
    assert!(unsampled.is_empty(), "{unsampled:?}");
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orchestrators_prefill_leg_carries_the_trace() {
    // Sequential (P answers, then D reads) and concurrent (D's read starts with P's leg,
    // which runs on a task of its own).
    for handoff in ["sequential", "concurrent"] {
        orchestrated_request_is_one_trace(handoff).await;
    }
}

async fn orchestrated_request_is_one_trace(handoff: &'static str) {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let (url, spans, server) = receiver().await;
    let up = tokio::task::spawn_blocking(move || {
        let flags = [
            "--topology",
            "orchestrator",
            "--handoff",
            handoff,
            "--otlp-traces-endpoint",
            &url,
        ];
        Up::start(&model, &flags)
    })
    .await
    .unwrap();
    chat(&up.entry).await;
    tokio::task::spawn_blocking(move || up.stop())
        .await
        .unwrap();
    let trace = trace_when(&spans, |t| {
        t.iter().any(|x| x.name == "kv_export")
            && t.iter().filter(|x| x.name == "llm_request").count() >= 2
    })
    .await;
    println!(
        "span tree of one orchestrated request ({handoff} handoff):\n{}",
        tree(&trace)
    );

    assert_connected(&trace);
    let request = find(&trace, DECODE, "POST /v1/chat/completions");
    assert_eq!(request.parent, CLIENT_SPAN);
    let leg = find(&trace, DECODE, "prefill leg");
    assert_eq!(leg.parent, request.span_id, "{handoff}");
    let served = find(&trace, PREFILL, "POST /v1/completions");
    assert_eq!(
        served.parent, leg.span_id,
        "the prefill worker's request is under the leg ({handoff})"
    );
    let export = find(&trace, PREFILL, "kv_export");
    assert_eq!(export.parent, find(&trace, DECODE, "kv_pull").span_id);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_dual_dispatch_is_one_trace_too() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let (url, spans, server) = receiver().await;
    let up = tokio::task::spawn_blocking(move || {
        let flags = ["--protocol", "sglang", "--otlp-traces-endpoint", &url];
        Up::start(&model, &flags)
    })
    .await
    .unwrap();
    chat(&up.entry).await;
    tokio::task::spawn_blocking(move || up.stop())
        .await
        .unwrap();
    let trace = trace_when(&spans, |t| {
        t.iter().any(|x| x.name == "kv_export")
            && t.iter().filter(|x| x.name == "llm_request").count() >= 2
    })
    .await;
    println!(
        "span tree of one SGLang-protocol request:\n{}",
        tree(&trace)
    );

    assert_connected(&trace);
    let request = find(&trace, GATEWAY, "POST /v1/chat/completions");
    for (leg, worker) in [("prefill leg", PREFILL), ("decode leg", DECODE)] {
        let leg_span = find(&trace, GATEWAY, leg);
        assert_eq!(leg_span.parent, request.span_id, "{leg}");
        let served = find(&trace, worker, "POST /v1/chat/completions");
        assert_eq!(
            served.parent, leg_span.span_id,
            "{worker}'s request is under the {leg}"
        );
    }
    let export = find(&trace, PREFILL, "kv_export");
    assert_eq!(export.parent, find(&trace, DECODE, "kv_pull").span_id);
    server.abort();
}
