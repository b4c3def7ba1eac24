//! `multi-turn --api responses` against the scripted server's `/v1/responses`: each turn
//! sends only its new message and the previous turn's id, instructions every turn, and
//! the report reads the Responses usage (cached share, TTFT) like chat's.

mod support;

use axum::routing::get;
use axum::{Json, Router};
use clap::error::ErrorKind;
use pdserve_bench::args::Api;
use pdserve_bench::multi_turn::run_multi_turn;
use pdserve_bench::{BenchCommand, BenchError};
use serde_json::json;
use support::scripted_server::{Reply, ScriptedServer};
use support::{multi_turn_args, never, parse, TEST_LIMIT};
use tokio::net::TcpListener;
use tokio::time::timeout;

#[tokio::test]
async fn responses_turns_chain_previous_response_id_and_send_only_the_new_message() {
    let server = ScriptedServer::start(|_| Reply::stream_ms(5, 2)).await;
    let url = server.url();
    let args = multi_turn_args(&[
        "--url",
        &url,
        "--api",
        "responses",
        "--conversations",
        "2",
        "--turns",
        "3",
        "--system-prompt-len",
        "10",
        "--input-len",
        "20",
        "--turn-input-len",
        "5",
        "--output-len",
        "4",
        "--concurrency",
        "1",
    ]);
    let result = timeout(TEST_LIMIT, run_multi_turn(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;

    assert_eq!((result.summary.completed, result.summary.failed), (6, 0));
    assert_eq!(result.config.api, Some(Api::Responses));
    // The probe: one small unstored, unstreamed request; it is issued `resp_1`.
    assert_eq!(bodies.len(), 1 + 6);
    assert_eq!(bodies[0]["max_output_tokens"], 1);
    assert_eq!(bodies[0]["store"], false);
    assert!(bodies[0].get("stream").is_none());
    // One conversation at a time: request j (from 0, the probe first) is `resp_{j+1}`,
    // so turn t > 0 at j continues `resp_j`.
    let instructions = bodies[1]["instructions"].as_str().expect("instructions");
    assert_eq!(instructions.split_whitespace().count(), 10);
    for (j, body) in bodies.iter().enumerate().skip(1) {
        let turn = (j - 1) % 3;
        let input = body["input"].as_array().expect("input items");
        assert_eq!(input.len(), 1, "only the new message: {body}");
        assert_eq!(input[0]["role"], "user");
        let words = input[0]["content"].as_str().unwrap().split_whitespace();
        assert_eq!(words.count(), if turn == 0 { 20 } else { 5 });
        assert_eq!(
            body["instructions"], instructions,
            "instructions every turn"
        );
        assert_eq!(
            (&body["stream"], &body["store"], &body["max_output_tokens"]),
            (&json!(true), &json!(true), &json!(4))
        );
        assert_eq!(body["ignore_eos"], true);
        assert!(body.get("messages").is_none() && body.get("conversation_id").is_none());
        let previous = body.get("previous_response_id");
        if turn == 0 {
            assert!(previous.is_none(), "{body}");
        } else {
            assert_eq!(previous, Some(&json!(format!("resp_{j}"))));
        }
    }
    // The server holds instructions + the conversation; all but the new message cached.
    let want = [
        (10.0 / 30.0, 30.0),
        (34.0 / 39.0, 39.0),
        (43.0 / 48.0, 48.0),
    ];
    assert_eq!(result.turns.len(), 3);
    for (turn, (share, prompt)) in result.turns.iter().zip(want) {
        assert_eq!(turn.completed, 2);
        assert!(
            (turn.cached_token_share.unwrap() - share).abs() < 1e-9,
            "{turn:?}"
        );
        assert_eq!(turn.mean_prompt_tokens, Some(prompt));
        assert!(turn.ttft_ms.unwrap().min >= 5.0);
    }
    for r in &result.requests {
        let turn = r.turn.unwrap() as usize;
        assert_eq!(r.prompt_tokens, Some(want[turn].1 as u64));
        assert_eq!(r.requested_prompt_tokens, want[turn].1 as u64);
        assert_eq!(r.output_tokens, 4);
        assert_eq!(r.itl_ms.len(), 3, "gaps between the four deltas");
    }
    let table = result.table();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("API:") && l.ends_with("responses")),
        "{table}"
    );
}

#[tokio::test]
async fn responses_error_event_is_a_failure_and_ends_the_conversation() {
    let server = ScriptedServer::start(|n| {
        if n == 1 {
            Reply::ErrorEvent {
                after: 1,
                message: "boom".into(),
            }
        } else {
            Reply::stream_ms(1, 1)
        }
    })
    .await;
    let url = server.url();
    // Without ignore_eos the scripted stream ends with `response.completed`.
    let args = multi_turn_args(&[
        "--url",
        &url,
        "--api",
        "responses",
        "--conversations",
        "2",
        "--turns",
        "3",
        "--output-len",
        "2",
        "--concurrency",
        "1",
        "--no-ignore-eos",
    ]);
    let result = timeout(TEST_LIMIT, run_multi_turn(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;
    // Conversation 0: turn 0 ok, turn 1 an error event, turn 2 never sent.
    assert_eq!(
        (
            result.summary.completed,
            result.summary.failed,
            result.summary.not_finished
        ),
        (4, 1, 1)
    );
    assert_eq!(result.failures[0].reason, "error event: boom");
    // The probe, two turns of conversation 0, three of conversation 1 (starting afresh).
    assert_eq!(bodies.len(), 1 + 2 + 3);
    assert!(bodies[3].get("previous_response_id").is_none());
    assert!(bodies.iter().all(|b| b.get("ignore_eos").is_none()));
    assert!(bodies[1].get("instructions").is_none(), "no system prompt");
    let turn0 = &result.requests[0];
    assert!(turn0.ok && turn0.ttft_ms.is_some());
    assert_eq!(turn0.cached_tokens, Some(0));
}

#[tokio::test]
async fn responses_probe_rejects_a_server_without_the_responses_api() {
    // Chat-only: `/v1/responses` is a plain 404.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = Router::new().route(
        "/v1/models",
        get(|| async { Json(json!({"object": "list", "data": [{"id": "m"}]})) }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let args = multi_turn_args(&["--url", &url, "--api", "responses", "--model", "m"]);
    let err = timeout(TEST_LIMIT, run_multi_turn(&args, never()))
        .await
        .expect("bounded")
        .unwrap_err();
    task.abort();
    assert!(matches!(err, BenchError::ProbeFailed { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("/v1/responses") && text.contains("404"),
        "{text}"
    );
}

#[test]
fn api_flag_defaults_to_chat_and_responses_conflicts_with_conversation_id() {
    let url = "http://127.0.0.1:1";
    let multi = |extra: &[&str]| {
        let mut all = vec!["multi-turn", "--url", url];
        all.extend_from_slice(extra);
        parse(&all).map(|c| match c {
            BenchCommand::MultiTurn(a) => a.protocol,
            other => panic!("not multi-turn: {other:?}"),
        })
    };
    let default = multi(&["--send-conversation-id"]).expect("chat is the default");
    assert_eq!(
        (default.api, default.send_conversation_id),
        (Api::Chat, true)
    );
    let chat = multi(&["--api", "chat", "--send-conversation-id"]).expect("chat allows it");
    assert_eq!((chat.api, chat.send_conversation_id), (Api::Chat, true));
    assert_eq!(multi(&["--api", "responses"]).unwrap().api, Api::Responses);
    let err = multi(&["--api", "responses", "--send-conversation-id"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ArgumentConflict);
    let text = err.to_string();
    assert!(
        text.contains("--api responses") && text.contains("--send-conversation-id"),
        "{text}"
    );
    assert!(multi(&["--api", "completions"]).is_err());
    assert_eq!(serde_json::to_value(Api::Responses).unwrap(), "responses");
}
