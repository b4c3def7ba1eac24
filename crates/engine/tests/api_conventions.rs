//! Conventions a client brings from vLLM, on a real worker: unimplemented fields and
//! out-of-range numbers are 400s naming the field, `vllm:*` metrics, request ids and the
//! access log, `--api-key`, `--max-body-bytes`, and cancellation of an abandoned
//! non-streaming request.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{json, Value};
use support::{chat, completion, serial, TestWorker};

/// Everything the worker logs in this test binary.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logs() -> &'static LogBuffer {
    static LOGS: OnceLock<LogBuffer> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = LogBuffer::default();
        let writer = buffer.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .init();
        buffer
    })
}

fn log_text() -> String {
    String::from_utf8_lossy(&logs().0.lock().unwrap()).into_owned()
}

fn param(body: &Value) -> &str {
    body["error"]["param"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unimplemented_fields_and_out_of_range_numbers_are_400_naming_the_field() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        for (path, body, field) in [
            (
                "/v1/chat/completions",
                chat(
                    "hi",
                    json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
                ),
                "tools",
            ),
            (
                "/v1/chat/completions",
                chat("hi", json!({"tool_choice": "required"})),
                "tool_choice",
            ),
            (
                "/v1/chat/completions",
                chat("hi", json!({"response_format": {"type": "json_object"}})),
                "response_format",
            ),
            (
                "/v1/completions",
                completion("hi", json!({"best_of": 3})),
                "best_of",
            ),
            (
                "/v1/completions",
                completion("hi", json!({"guided_regex": "[a-z]+"})),
                "guided_regex",
            ),
            (
                "/v1/completions",
                completion("hi", json!({"frequency_penalty": 1e39})),
                "frequency_penalty",
            ),
            (
                "/v1/completions",
                completion("hi", json!({"presence_penalty": -2.5})),
                "presence_penalty",
            ),
            (
                "/v1/completions",
                completion("hi", json!({"repetition_penalty": 0})),
                "repetition_penalty",
            ),
            (
                "/v1/chat/completions",
                chat("hi", json!({"min_p": 1.5})),
                "min_p",
            ),
            (
                "/v1/chat/completions",
                chat("hi", json!({"logit_bias": {"99999999": 5}})),
                "logit_bias",
            ),
        ] {
            let (status, answer) = w.post(path, &body).await;
            assert_eq!(status, 400, "{field}: {answer}");
            assert_eq!(param(&answer), field, "{answer}");
            assert_eq!(answer["error"]["type"], "invalid_request_error");
        }
        // Numbers past f32 (1e39) are 400s, not defaults; past f64 the JSON is refused.
        for (body, field) in [
            (
                r#"{"prompt": "hi", "max_tokens": 2, "temperature": 1e39}"#,
                Some("temperature"),
            ),
            (
                r#"{"prompt": "hi", "max_tokens": 2, "top_p": 1e39}"#,
                Some("top_p"),
            ),
            (
                r#"{"prompt": "hi", "max_tokens": 2, "temperature": 1e400}"#,
                None,
            ),
            (
                r#"{"prompt": "hi", "max_tokens": 2, "temperature": NaN}"#,
                None,
            ),
            (r#"{"prompt": "hi", "max_tokens": 2, "top_p": "NaN"}"#, None),
        ] {
            let (status, answer) = w.post_raw("/v1/completions", body).await;
            assert_eq!(status, 400, "{body}: {answer}");
            if let Some(field) = field {
                assert_eq!(param(&answer), field, "{answer}");
            }
        }
        // Harmless fields (and neutral values of unimplemented ones) are accepted.
        let (status, answer) = w
            .post(
                "/v1/chat/completions",
                &chat(
                    "hi",
                    json!({
                        "max_tokens": 2, "user": "u", "seed": 3, "conversation_id": "c",
                        "tools": [], "tool_choice": "none", "metadata": {"k": "v"},
                        "response_format": {"type": "text"}, "parallel_tool_calls": false,
                        "chat_template_kwargs": {"enable_thinking": false},
                        "logit_bias": {"5": -100}, "min_p": 0.1,
                    }),
                ),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_metrics_request_ids_access_log_and_abandoned_requests() {
    serial(async {
        logs();
        let w = TestWorker::start(&[]).await;
        let prompt = "A long time ago, in a quiet village by the sea, there lived an old \
                      fisherman who";
        let body = completion(prompt, json!({"max_tokens": 8, "ignore_eos": true}));
        let resp = w
            .http
            .post(format!("{}/v1/completions", w.base))
            .header("x-request-id", "req-conventions-1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-request-id"], "req-conventions-1");
        let first: Value = resp.json().await.unwrap();
        let usage = &first["usage"];
        assert_eq!(usage["completion_tokens"], 8);
        assert!(usage.get("pdserve").is_none(), "no KV imported: {usage}");

        let labels = r#"{model_name="smollm2",engine="0"}"#;
        let m = |name: &str| format!("{name}{labels}");
        assert_eq!(w.metric(&m("vllm:num_requests_running")).await, 0.0);
        assert_eq!(w.metric(&m("vllm:num_requests_waiting")).await, 0.0);
        assert_eq!(
            w.metric(&m("vllm:prompt_tokens_total")).await,
            usage["prompt_tokens"].as_f64().unwrap()
        );
        assert_eq!(w.metric(&m("vllm:generation_tokens_total")).await, 8.0);
        assert_eq!(w.metric(&m("vllm:prefix_cache_hits_total")).await, 0.0);
        assert_eq!(
            w.metric(&m("vllm:time_to_first_token_seconds_count")).await,
            1.0
        );
        assert_eq!(
            w.metric(&m("vllm:inter_token_latency_seconds_count")).await,
            7.0
        );
        assert_eq!(
            w.metric(&m("vllm:e2e_request_latency_seconds_count")).await,
            1.0
        );
        let text = w.metrics_text().await;
        assert!(
            text.contains(r#"vllm:e2e_request_latency_seconds_bucket{model_name="smollm2",engine="0",le="7680.0"} 1"#),
            "{text}"
        );
        // Finished, its blocks stay as reclaimable cache: usage is back to 0.
        assert_eq!(w.metric(&m("vllm:kv_cache_usage_perc")).await, 0.0);

        // The same prompt again: its full blocks come from the prefix cache.
        let resp = w
            .http
            .post(format!("{}/v1/completions", w.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let generated_id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
        assert_eq!(generated_id.len(), 36, "a UUID: {generated_id}");
        let second: Value = resp.json().await.unwrap();
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .unwrap();
        assert!(cached >= 16.0, "{second}");
        assert_eq!(w.metric(&m("vllm:prefix_cache_hits_total")).await, cached);

        // One access-log line per request, with the id it was given.
        let log = log_text();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("pdserve::access") && l.contains("req-conventions-1"))
            .collect();
        assert_eq!(lines.len(), 1, "{log}");
        for needle in ["INFO", "method=POST", "path=/v1/completions", "status=200", "latency_ms="] {
            assert!(lines[0].contains(needle), "{needle} missing: {}", lines[0]);
        }
        assert!(log.contains(&generated_id), "the generated id is logged too");
        // Metrics scrapes (above) and health probes log at debug: an idle worker polled by
        // a gateway stays quiet at info.
        let (status, _) = w.get("/health").await;
        assert_eq!(status, 200);
        let log = log_text();
        for path in ["path=/metrics", "path=/health"] {
            assert!(
                !log.lines().any(|l| l.contains("pdserve::access") && l.contains(path)),
                "{path} logged at info: {log}"
            );
        }

        // A non-streaming request whose client goes away is cancelled like a stream.
        let abandoned = completion(prompt, json!({"max_tokens": 400, "ignore_eos": true}));
        let aborted_before = w.metric(r#"pdserve_requests_finished_total{reason="abort"}"#).await;
        let generated_before = w.metric("pdserve_generation_tokens_total").await;
        let client = w.http.clone();
        let url = format!("{}/v1/completions", w.base);
        let request = tokio::spawn(async move { client.post(url).json(&abandoned).send().await });
        w.wait_metric("pdserve_num_requests_running", 1.0).await;
        request.abort();
        let _ = request.await;
        w.wait_metric("pdserve_num_requests_running", 0.0).await;
        w.wait_metric(
            r#"pdserve_requests_finished_total{reason="abort"}"#,
            aborted_before + 1.0,
        )
        .await;
        let generated = w.metric("pdserve_generation_tokens_total").await - generated_before;
        assert!(generated < 400.0, "ran to max_tokens: {generated}");
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_the_api_routes_and_the_body_limit_is_configurable() {
    serial(async {
        let w = TestWorker::start(&["--api-key", "sk-test", "--max-body-bytes", "4096"]).await;
        let body = completion("Hello", json!({"max_tokens": 2}));
        let send = |key: Option<&'static str>, path: &'static str, body: Value| {
            let mut req = w.http.post(format!("{}{path}", w.base)).json(&body);
            if let Some(key) = key {
                req = req.header("authorization", key);
            }
            async move {
                let resp = req.send().await.unwrap();
                let id = resp.headers().get("x-request-id").is_some();
                (
                    resp.status().as_u16(),
                    id,
                    resp.json::<Value>().await.unwrap_or(Value::Null),
                )
            }
        };
        for key in [
            None,
            Some("Bearer wrong"),
            Some("sk-test"),
            Some("Bearer sk-tes"),
        ] {
            let (status, has_id, answer) = send(key, "/v1/completions", body.clone()).await;
            assert_eq!(status, 401, "{key:?}: {answer}");
            assert!(has_id, "a 401 carries a request id too");
            assert_eq!(answer["error"]["type"], "authentication_error", "{answer}");
        }
        let (status, _, answer) = send(Some("Bearer sk-test"), "/v1/completions", body).await;
        assert_eq!(status, 200, "{answer}");
        let models = |key: Option<&str>| {
            let mut req = w.http.get(format!("{}/v1/models", w.base));
            if let Some(key) = key {
                req = req.bearer_auth(key);
            }
            req.send()
        };
        assert_eq!(models(None).await.unwrap().status(), 401);
        assert_eq!(models(Some("sk-test")).await.unwrap().status(), 200);
        for open in ["/health", "/metrics"] {
            let resp = w
                .http
                .get(format!("{}{open}", w.base))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{open} stays open");
        }
        // --max-body-bytes 4096: a 5000-byte body is 413 (OpenAI-shaped), 3000 passes.
        for (size, want) in [(5000, 413), (3000, 200)] {
            let mut big = completion("Hello", json!({"max_tokens": 1}));
            big["user"] = json!("x".repeat(size - 100));
            let (status, _, answer) = send(Some("Bearer sk-test"), "/v1/completions", big).await;
            assert_eq!(status, want, "{size}: {answer}");
            if want == 413 {
                assert!(answer["error"]["message"].is_string(), "{answer}");
            }
        }
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_kv_is_reported_apart_from_prefix_cache_hits() {
    serial(async {
        let prefill = TestWorker::start(&["--role", "prefill"]).await;
        let decode = TestWorker::start(&["--role", "decode"]).await;
        let prompt = "A long time ago, in a quiet village by the sea, there lived an old \
                      fisherman who";
        let leg = completion(
            prompt,
            json!({"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        let (status, p) = prefill.post("/v1/completions", &leg).await;
        assert_eq!(status, 200, "{p}");
        assert_eq!(p["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let prompt_tokens = p["usage"]["prompt_tokens"].as_u64().unwrap();
        let body = completion(
            prompt,
            json!({"max_tokens": 4, "kv_transfer_params": p["kv_transfer_params"].clone()}),
        );
        let (status, d) = decode.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{d}");
        // A cold prompt: nothing came from the decode worker's prefix cache; all but the
        // last prompt token were loaded from the prefill worker.
        let usage = &d["usage"];
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], 0,
            "{usage}"
        );
        assert_eq!(
            usage["pdserve"]["kv_imported_tokens"].as_u64(),
            Some(prompt_tokens - 1),
            "{usage}"
        );
        decode.stop().await;
        prefill.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_is_honoured_only_with_priority_scheduling() {
    serial(async {
        let fcfs = TestWorker::start(&[]).await;
        for (path, body) in [
            ("/v1/chat/completions", chat("hi", json!({"priority": 3}))),
            ("/v1/completions", completion("hi", json!({"priority": -1}))),
            ("/v1/responses", json!({"input": "hi", "priority": 2})),
        ] {
            let (status, answer) = fcfs.post(path, &body).await;
            assert_eq!(status, 400, "{path}: {answer}");
            assert_eq!(answer["error"]["param"], "priority", "{answer}");
        }
        // 0, vLLM's default, is accepted everywhere; a non-integer is a 400 everywhere.
        let (status, answer) = fcfs
            .post(
                "/v1/chat/completions",
                &chat("hi", json!({"priority": 0, "max_tokens": 2})),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        let (status, answer) = fcfs
            .post(
                "/v1/chat/completions",
                &chat("hi", json!({"priority": "high"})),
            )
            .await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["param"], "priority");
        fcfs.stop().await;

        let ranked = TestWorker::start(&["--scheduling-policy", "priority"]).await;
        for (path, body) in [
            (
                "/v1/chat/completions",
                chat("hi", json!({"priority": 3, "max_tokens": 2})),
            ),
            (
                "/v1/completions",
                completion("hi", json!({"priority": -1, "max_tokens": 2})),
            ),
            (
                "/v1/responses",
                json!({"input": "hi", "priority": 2, "max_output_tokens": 2}),
            ),
        ] {
            let (status, answer) = ranked.post(path, &body).await;
            assert_eq!(status, 200, "{path}: {answer}");
        }
        ranked.stop().await;
    })
    .await;
}
