//! vLLM's `/tokenize` and `/detokenize` on a real worker: a text prompt's ids are the ones
//! a completion computes (its `usage.prompt_tokens`), a chat's the ones a chat completion
//! computes, `continue_final_message` leaves the last message open, `return_token_strs`
//! spells the tokens, `/detokenize` inverts `/tokenize`; bad bodies, unknown models and
//! out-of-vocabulary ids are OpenAI-shaped 4xx.

mod support;

use serde_json::json;
use support::{chat, completion, serial, TestWorker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_what_generation_computes_and_detokenize_inverts_it() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let text = "The three primary colours are";
        let (status, tokens) = w.post("/tokenize", &json!({"model": "smollm2", "prompt": text})).await;
        assert_eq!(status, 200, "{tokens}");
        let (_, done) = w.post("/v1/completions", &completion(text, json!({"max_tokens": 1}))).await;
        assert_eq!(tokens["count"], done["usage"]["prompt_tokens"], "{tokens} {done}");
        assert_eq!(tokens["tokens"].as_array().unwrap().len() as u64, tokens["count"].as_u64().unwrap());
        assert!(tokens["max_model_len"].as_u64().unwrap() > 0);
        assert_eq!(tokens["token_strs"], json!(null));

        let messages = json!([{"role": "user", "content": "What is 2+2?"}]);
        let (status, chat_tokens) = w.post("/tokenize", &json!({"messages": messages})).await;
        assert_eq!(status, 200, "{chat_tokens}");
        let (_, done) = w.post("/v1/chat/completions", &chat("What is 2+2?", json!({"max_tokens": 1}))).await;
        assert_eq!(chat_tokens["count"], done["usage"]["prompt_tokens"]);

        // Without the generation prompt: fewer tokens, the same start.
        let (_, bare) = w
            .post("/tokenize", &json!({"messages": messages, "add_generation_prompt": false}))
            .await;
        let (bare, full) = (bare["tokens"].as_array().unwrap(), chat_tokens["tokens"].as_array().unwrap());
        assert!(bare.len() < full.len() && full.starts_with(bare), "{bare:?} {full:?}");

        // The final message left open ends with its own text.
        let open = json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]);
        let (status, cont) = w
            .post(
                "/tokenize",
                &json!({"messages": open, "add_generation_prompt": false, "continue_final_message": true, "return_token_strs": true}),
            )
            .await;
        assert_eq!(status, 200, "{cont}");
        let (_, text_back) = w.post("/detokenize", &json!({"tokens": cont["tokens"]})).await;
        assert!(text_back["prompt"].as_str().unwrap().ends_with("The answer is"), "{text_back}");
        assert_eq!(cont["token_strs"].as_array().unwrap().len(), cont["tokens"].as_array().unwrap().len());
        let (status, both) = w
            .post("/tokenize", &json!({"messages": open, "continue_final_message": true}))
            .await;
        assert_eq!(status, 400, "both flags: {both}");

        // /detokenize inverts /tokenize.
        let (status, back) = w.post("/detokenize", &json!({"model": "smollm2", "tokens": tokens["tokens"]})).await;
        assert_eq!(status, 200, "{back}");
        assert_eq!(back["prompt"], text);

        // Bad input.
        for (path, body, want) in [
            ("/tokenize", json!({"prompt": 7}), 400),
            ("/tokenize", json!({}), 400),
            ("/tokenize", json!({"model": "other", "prompt": "x"}), 404),
            ("/tokenize", json!({"messages": []}), 400),
            ("/detokenize", json!({"tokens": [99999999]}), 400),
            ("/detokenize", json!({"tokens": "abc"}), 400),
            ("/detokenize", json!({"model": "other", "tokens": [1]}), 404),
        ] {
            let (status, answer) = w.post(path, &body).await;
            assert_eq!(status, want, "{path} {body}: {answer}");
            assert!(answer["error"]["message"].is_string(), "{answer}");
        }
        w.stop().await;
    })
    .await;
}
