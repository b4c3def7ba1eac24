use super::*;
use crate::legs::first_token::FirstToken;

fn chat_answer(tokens: &[&str], finish: &str) -> Vec<u8> {
    let choices: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"index": i, "message": {"role": "assistant", "content": t},
                   "logprobs": null, "finish_reason": finish})
        })
        .collect();
    serde_json::to_vec(&json!({"id": "chatcmpl-P", "object": "chat.completion",
        "created": 1, "model": "m", "choices": choices}))
    .unwrap()
}

fn chat_event(index: u64, delta: Value, finish: Value) -> String {
    let event = json!({"id": "chatcmpl-D", "object": "chat.completion.chunk", "created": 1,
        "model": "m", "choices": [{"index": index, "delta": delta, "logprobs": null,
        "finish_reason": finish}]});
    format!("data: {event}\n\n")
}

fn guard(answer: &[u8], endpoint: Endpoint, n: u64) -> FirstTokenGuard {
    FirstTokenGuard::new(Arc::new(
        FirstToken::from_answer(endpoint, answer, n).unwrap(),
    ))
}

fn texts(out: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn a_prefill_answer_carries_the_token_only_when_it_did_not_end() {
    let answer = chat_answer(&["Hello"], "length");
    assert!(FirstToken::from_answer(Endpoint::Chat, &answer, 1).is_some());
    // One choice leads choice 0 of n; a count that is neither 1 nor n, a stop at the
    // first token, an empty or cut token: none.
    assert!(FirstToken::from_answer(Endpoint::Chat, &answer, 2).is_some());
    let two = chat_answer(&["Hello", "Hi"], "length");
    assert!(FirstToken::from_answer(Endpoint::Chat, &two, 3).is_none());
    let stopped = chat_answer(&["Hello"], "stop");
    assert!(FirstToken::from_answer(Endpoint::Chat, &stopped, 1).is_none());
    let empty = chat_answer(&[""], "length");
    assert!(FirstToken::from_answer(Endpoint::Chat, &empty, 1).is_none());
    let cut = chat_answer(&["\u{FFFD}"], "length");
    assert!(FirstToken::from_answer(Endpoint::Chat, &cut, 1).is_none());
    assert!(FirstToken::from_answer(Endpoint::Chat, b"{}", 1).is_none());
}

#[test]
fn the_decode_stream_loses_its_role_event_and_repeated_token_and_takes_the_prefill_id() {
    let mut guard = guard(&chat_answer(&["Hello", "Hi"], "length"), Endpoint::Chat, 2);
    let stream = [
        chat_event(0, json!({"role": "assistant", "content": ""}), Value::Null),
        chat_event(1, json!({"role": "assistant", "content": ""}), Value::Null),
        chat_event(0, json!({"content": "Hello"}), Value::Null),
        chat_event(0, json!({"content": " world"}), Value::Null),
        chat_event(1, json!({"content": "Hi"}), Value::Null),
        chat_event(1, json!({}), json!("length")),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    let out = guard.filter(Bytes::from(stream)).unwrap();
    let events = texts(&out);
    assert_eq!(events.len(), 2, "{}", String::from_utf8_lossy(&out));
    assert_eq!(events[0]["choices"][0]["delta"]["content"], " world");
    assert_eq!(events[1]["choices"][0]["finish_reason"], "length");
    assert!(events.iter().all(|e| e["id"] == "chatcmpl-P"));
    assert!(out.ends_with(b"data: [DONE]\n\n"));
    // Later chunks: the id rewritten without parsing.
    let later = guard
        .filter(Bytes::from(chat_event(
            0,
            json!({"content": "!"}),
            Value::Null,
        )))
        .unwrap();
    assert_eq!(texts(&later)[0]["id"], "chatcmpl-P");
}

#[test]
fn a_different_first_token_or_an_early_end_is_a_mismatch() {
    let answer = chat_answer(&["Hello"], "length");
    let mut lying = guard(&answer, Endpoint::Chat, 1);
    let event = chat_event(0, json!({"content": "Bye"}), Value::Null);
    let err = lying.filter(Bytes::from(event)).unwrap_err();
    assert_eq!((err.sent.as_str(), err.got.as_str()), ("Hello", "Bye"));
    let mut ended = guard(&answer, Endpoint::Chat, 1);
    let event = chat_event(0, json!({}), json!("stop"));
    assert_eq!(ended.filter(Bytes::from(event)).unwrap_err().got, "<end>");
    let mut done = guard(&answer, Endpoint::Chat, 1);
    assert!(done
        .filter(Bytes::from_static(b"data: [DONE]\n\n"))
        .is_err());
}

#[test]
fn completions_tokens_split_across_events_keep_the_rest_and_its_logprobs() {
    let answer = serde_json::to_vec(&json!({"id": "cmpl-P", "object": "text_completion",
        "created": 1, "model": "m", "choices": [{"index": 0, "text": " Paris",
        "logprobs": {"tokens": [" Paris"], "token_logprobs": [-0.2],
        "top_logprobs": [{" Paris": -0.2}], "text_offset": [0]}, "finish_reason": "length"}]}))
    .unwrap();
    let sent = FirstToken::from_answer(Endpoint::Completions, &answer, 1).unwrap();
    let head = texts(&sent.events());
    assert_eq!(head[0]["choices"][0]["text"], " Paris");
    assert_eq!(head[0]["choices"][0]["logprobs"]["token_logprobs"][0], -0.2);
    let mut guard = FirstTokenGuard::new(Arc::new(sent));
    // Two tokens in one event (a worker that merged them): the first one is cut off.
    let event = json!({"id": "cmpl-D", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": " Paris.", "logprobs": {"tokens": [" Paris", "."],
        "token_logprobs": [-0.2, -0.4], "top_logprobs": [{" Paris": -0.2}, {".": -0.4}],
        "text_offset": [0, 6]}, "finish_reason": null}]});
    let out = guard
        .filter(Bytes::from(format!("data: {event}\n\n")))
        .unwrap();
    let choice = &texts(&out)[0]["choices"][0];
    assert_eq!(choice["text"], ".");
    assert_eq!(choice["logprobs"]["tokens"], json!(["."]));
    assert_eq!(choice["logprobs"]["text_offset"], json!([6]));
}

#[test]
fn the_last_token_keeps_its_finish_reason() {
    let mut guard = guard(&chat_answer(&["Hello"], "length"), Endpoint::Chat, 1);
    let event = chat_event(0, json!({"content": "Hello"}), json!("length"));
    let out = guard.filter(Bytes::from(event)).unwrap();
    let events = texts(&out);
    assert_eq!(events[0]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[0]["choices"][0]["delta"], json!({}));
}

/// The usual events are judged without a JSON tree; anything else the quick reading
/// does not cover (a delta with more than role and content, an `error` key, a choice
/// listed twice) gets the full reading, with the same outcome as before.
#[test]
fn events_the_quick_reading_does_not_cover_get_the_full_one() {
    let mut first = guard(&chat_answer(&["Hello"], "length"), Endpoint::Chat, 1);
    let mut quick = guard(&chat_answer(&["Hello"], "length"), Endpoint::Chat, 1);
    let role = chat_event(0, json!({"role": "assistant", "content": ""}), Value::Null);
    let data = |event: &str| event.trim_end().strip_prefix("data: ").unwrap().to_string();
    assert!(
        quick.drops_whole(data(&role).as_bytes()),
        "the role event is read quickly"
    );
    let token = chat_event(0, json!({"content": "Hello"}), Value::Null);
    assert!(quick.drops_whole(data(&token).as_bytes()));
    assert!(quick.settled() && quick.id_swap.is_some());
    let role_and_more = chat_event(
        0,
        json!({"role": "assistant", "content": "", "reasoning_content": "hm"}),
        Value::Null,
    );
    let out = first.filter(Bytes::from(role_and_more)).unwrap();
    let events = texts(&out);
    assert_eq!(events.len(), 1, "kept, without its role");
    assert_eq!(events[0]["choices"][0]["delta"]["reasoning_content"], "hm");
    assert!(events[0]["choices"][0]["delta"].get("role").is_none());
    assert_eq!(events[0]["id"], "chatcmpl-P");

    let with_error = "data: {\"id\":\"chatcmpl-D\",\"error\":null,\"choices\":[{\"index\":0,\
                      \"delta\":{\"content\":\"Hello\"},\"finish_reason\":null}]}\n\n";
    let out = first.filter(Bytes::from(with_error)).unwrap();
    assert_eq!(texts(&out).len(), 1, "an event with an error key is kept");

    let mut twice = guard(&chat_answer(&["Hello"], "length"), Endpoint::Chat, 1);
    let listed_twice = "data: {\"id\":\"chatcmpl-D\",\"choices\":[\
                        {\"index\":0,\"delta\":{\"content\":\"Hello\"},\"finish_reason\":null},\
                        {\"index\":0,\"delta\":{\"content\":\" again\"},\"finish_reason\":null}]}\n\n";
    let out = twice.filter(Bytes::from(listed_twice)).unwrap();
    let events = texts(&out);
    assert_eq!(events[0]["choices"].as_array().map(Vec::len), Some(1));
    assert_eq!(events[0]["choices"][0]["delta"]["content"], " again");
}

#[test]
fn lines_are_cut_after_each_newline_as_split_inclusive_cuts_them() {
    for text in [
        &b""[..],
        b"\n",
        b"data: a\n\n",
        b"data: a\n\ndata: b",
        b"no newline",
        b"\r\n\r\ndata: [DONE]\r\n\r\n",
    ] {
        let want: Vec<&[u8]> = text.split_inclusive(|&b| b == b'\n').collect();
        assert_eq!(split_lines(text).collect::<Vec<_>>(), want, "{text:?}");
    }
}
