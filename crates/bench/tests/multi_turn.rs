//! `multi-turn` against the scripted server: prompts grow with the previous answers,
//! `conversation_id` is sent when asked, and the per-turn cached share is the server's.

mod support;

use std::collections::BTreeMap;

use pdserve_bench::multi_turn::run_multi_turn;
use serde_json::Value;
use support::scripted_server::{Reply, ScriptedServer};
use support::{multi_turn_args, never, TEST_LIMIT};
use tokio::time::timeout;

const ANSWER: &str = " tok0 tok1 tok2 tok3";

#[tokio::test]
async fn conversations_grow_and_report_per_turn_cache_share() {
    let server = ScriptedServer::start(|_| Reply::stream_ms(5, 2)).await;
    let url = server.url();
    let args = multi_turn_args(&[
        "--url",
        &url,
        "--conversations",
        "3",
        "--turns",
        "3",
        "--input-len",
        "20",
        "--turn-input-len",
        "5",
        "--output-len",
        "4",
        "--concurrency",
        "2",
        "--send-conversation-id",
    ]);
    let result = timeout(TEST_LIMIT, run_multi_turn(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies: Vec<Value> = server
        .requests()
        .into_iter()
        .filter(|b| b["max_tokens"] == 4)
        .collect();
    server.stop().await;

    assert_eq!((result.summary.completed, result.summary.failed), (9, 0));
    // Every turn sends the whole conversation: earlier user messages and answers.
    let mut by_conversation: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for body in bodies {
        let id = body["conversation_id"]
            .as_str()
            .expect("conversation_id sent")
            .to_string();
        by_conversation.entry(id).or_default().push(body);
    }
    assert_eq!(by_conversation.len(), 3, "one id per conversation");
    for turns in by_conversation.values() {
        assert_eq!(turns.len(), 3);
        for (t, body) in turns.iter().enumerate() {
            let messages = body["messages"].as_array().expect("messages");
            assert_eq!(messages.len(), 2 * t + 1);
            for (m, message) in messages.iter().enumerate() {
                let want_role = if m % 2 == 0 { "user" } else { "assistant" };
                assert_eq!(message["role"], want_role);
                if m % 2 == 1 {
                    assert_eq!(message["content"], ANSWER, "the previous answer is resent");
                }
            }
            if t > 0 {
                assert_eq!(
                    messages[..2 * t - 1],
                    turns[t - 1]["messages"].as_array().unwrap()[..]
                );
            }
        }
    }
    // The server reports every message but the last as cached (20, 20+4+5, ...).
    let want = [(0.0, 20.0), (24.0 / 29.0, 29.0), (33.0 / 38.0, 38.0)];
    assert_eq!(result.turns.len(), 3);
    for (turn, (share, prompt)) in result.turns.iter().zip(want) {
        assert_eq!(turn.completed, 3);
        assert!(
            (turn.cached_token_share.unwrap() - share).abs() < 1e-9,
            "{turn:?}"
        );
        assert_eq!(turn.mean_prompt_tokens, Some(prompt));
        assert!(turn.ttft_ms.unwrap().min >= 5.0);
    }
    let overall = (3.0 * (24.0 + 33.0)) / (3.0 * (20.0 + 29.0 + 38.0));
    assert!((result.summary.cached_token_share.unwrap() - overall).abs() < 1e-9);
    let table = result.table();
    assert!(
        table.contains("Per turn") && table.contains("82.8%"),
        "{table}"
    );
    // Requested prompt tokens track the conversation (answers counted from usage).
    let turn2: Vec<_> = result
        .requests
        .iter()
        .filter(|r| r.turn == Some(2))
        .collect();
    assert!(turn2.iter().all(|r| r.requested_prompt_tokens == 38));
}

#[tokio::test]
async fn conversation_id_is_only_sent_when_asked_and_failures_end_a_conversation() {
    // The second scripted request fails: its conversation stops there.
    let server = ScriptedServer::start(|n| {
        if n == 1 {
            Reply::Error {
                status: 500,
                message: "boom".into(),
            }
        } else {
            Reply::stream_ms(1, 1)
        }
    })
    .await;
    let url = server.url();
    let args = multi_turn_args(&[
        "--url",
        &url,
        "--conversations",
        "2",
        "--turns",
        "3",
        "--output-len",
        "2",
        "--concurrency",
        "1",
    ]);
    let result = timeout(TEST_LIMIT, run_multi_turn(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;
    assert!(bodies.iter().all(|b| b.get("conversation_id").is_none()));
    // Conversation 0: turn 0 ok, turn 1 fails, turn 2 never sent. Conversation 1: 3 ok.
    assert_eq!(
        (
            result.summary.completed,
            result.summary.failed,
            result.summary.not_finished
        ),
        (4, 1, 1)
    );
    assert_eq!(result.failures[0].reason, "HTTP 500: boom");
}
