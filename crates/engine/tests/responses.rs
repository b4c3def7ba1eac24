//! OpenAI's Responses API on a real worker: a plain response answers what a chat
//! completion of the same message answers (greedy); the stream's events come in the
//! published order with the text in the deltas and usage in `response.completed`; a chain
//! of `previous_response_id` turns equals a chat over the whole conversation and reports
//! the earlier turns as cached; stored responses are retrieved and deleted; fields the
//! worker does not implement are 400s naming them.

mod support;

use serde_json::{json, Value};
use support::{chat, serial, TestWorker};

fn output_text(response: &Value) -> &str {
    response["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no output text in {response}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_as_chat_does_and_chain_by_previous_response_id() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let question = "What is the capital of France?";
        let body = json!({"model": "smollm2", "input": question, "max_output_tokens": 12, "temperature": 0});
        let (status, first) = w.post("/v1/responses", &body).await;
        assert_eq!(status, 200, "{first}");
        assert_eq!(first["object"], "response");
        assert!(first["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(first["output"][0]["role"], "assistant");
        let (_, chat_answer) = w.post("/v1/chat/completions", &chat(question, json!({"max_tokens": 12}))).await;
        let chat_text = chat_answer["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(output_text(&first), chat_text);
        let incomplete = chat_answer["choices"][0]["finish_reason"] == "length";
        assert_eq!(first["status"], if incomplete { "incomplete" } else { "completed" });
        assert_eq!(first["usage"]["input_tokens"], chat_answer["usage"]["prompt_tokens"]);
        assert_eq!(first["usage"]["output_tokens"], chat_answer["usage"]["completion_tokens"]);

        // Stored: retrievable as answered.
        let id = first["id"].as_str().unwrap().to_string();
        let got: Value = w.http.get(format!("{}/v1/responses/{id}", w.base)).send().await.unwrap().json().await.unwrap();
        assert_eq!(got, first);

        // Two more turns; each equals a chat over the whole conversation.
        let mut messages = vec![
            json!({"role": "user", "content": question}),
            json!({"role": "assistant", "content": output_text(&first)}),
        ];
        let mut previous = id.clone();
        for next in ["And of Italy?", "Thanks. Which is bigger?"] {
            let body = json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": next}]}],
                              "previous_response_id": previous, "max_output_tokens": 12, "temperature": 0});
            let (status, turn) = w.post("/v1/responses", &body).await;
            assert_eq!(status, 200, "{turn}");
            messages.push(json!({"role": "user", "content": next}));
            let (_, whole) = w
                .post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 12, "temperature": 0}))
                .await;
            assert_eq!(output_text(&turn), whole["choices"][0]["message"]["content"].as_str().unwrap());
            assert!(turn["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{turn}");
            assert_eq!(turn["previous_response_id"], previous.as_str());
            messages.push(json!({"role": "assistant", "content": output_text(&turn)}));
            previous = turn["id"].as_str().unwrap().to_string();
        }

        // Streamed: the published event order, the deltas make the text.
        let mut stream_body = json!({"input": question, "max_output_tokens": 12, "temperature": 0, "stream": true});
        let text = w.http.post(format!("{}/v1/responses", w.base)).json(&stream_body).send().await.unwrap().text().await.unwrap();
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(&kinds[..4], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]);
        let last = *kinds.last().unwrap();
        assert!(last == "response.completed" || last == "response.incomplete", "{kinds:?}");
        assert_eq!(&kinds[kinds.len() - 4..kinds.len() - 1], ["response.output_text.done", "response.content_part.done", "response.output_item.done"]);
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, chat_text);
        let numbers: Vec<u64> = events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
        let completed = &events.last().unwrap()["response"];
        assert_eq!(output_text(completed), chat_text);
        assert!(completed["usage"]["total_tokens"].as_u64().unwrap() > 0);

        // Not stored: not retrievable. Deleted: gone.
        stream_body["stream"] = json!(false);
        stream_body["store"] = json!(false);
        let (_, unstored) = w.post("/v1/responses", &stream_body).await;
        let status = |path: String| {
            let http = w.http.clone();
            async move { http.get(path).send().await.unwrap().status().as_u16() }
        };
        assert_eq!(status(format!("{}/v1/responses/{}", w.base, unstored["id"].as_str().unwrap())).await, 404);
        let deleted: Value = w.http.delete(format!("{}/v1/responses/{id}", w.base)).send().await.unwrap().json().await.unwrap();
        assert_eq!(deleted, json!({"id": id, "object": "response", "deleted": true}));
        assert_eq!(status(format!("{}/v1/responses/{id}", w.base)).await, 404);

        // Bad input.
        for (body, want, param) in [
            (json!({"input": "x", "previous_response_id": "resp_nope"}), 404, "previous_response_id"),
            (json!({"input": "x", "tools": [{"type": "function", "name": "f"}]}), 400, "tools"),
            (json!({"input": "x", "text": {"format": {"type": "json_schema"}}}), 400, "text.format"),
            (json!({"input": "x", "reasoning": {"effort": "low"}}), 400, "reasoning"),
            (json!({"input": "x", "background": true}), 400, "background"),
            (json!({"input": [{"type": "function_call", "name": "f"}]}), 400, "input"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), 400, "input"),
            (json!({"input": "x", "max_output_tokens": 0}), 400, "max_output_tokens"),
            (json!({"input": "x", "model": "other"}), 404, "model"),
        ] {
            let (status, answer) = w.post("/v1/responses", &body).await;
            assert_eq!(status, want, "{body}: {answer}");
            assert_eq!(answer["error"]["param"], param, "{body}: {answer}");
        }
        w.stop().await;
    })
    .await;
}
