//! The gateway's `--tokenizer` counts a prompt's tokens exactly as the workers do: with
//! `max_model_len` 64, a chat (or a text completion) whose `max_tokens` fills the context
//! to the last token is served, and one more token is refused by the gateway itself,
//! naming the same input count the worker reports in its usage — with the model's GGUF
//! and with a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`) holding
//! the same tokenizer and template.

use std::time::Duration;

use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};
use tokio::net::TcpListener;

#[path = "support/worker.rs"]
mod worker;

use worker::start_worker;

const MAX_MODEL_LEN: u64 = 64;

/// A Hugging Face folder with `model`'s tokenizer and chat template.
fn hf_folder(model: &std::path::Path) -> std::path::PathBuf {
    let tokenizer = pdserve_model::Tokenizer::load(model).unwrap();
    let template = pdserve_model::ChatTemplate::load(model, &tokenizer).unwrap();
    let dir = std::env::temp_dir().join(format!("pdserve-hf-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_hf_json().unwrap()).unwrap();
    let adds_bos = tokenizer.encode("x", true).unwrap() != tokenizer.encode("x", false).unwrap();
    let config = json!({
        "bos_token": tokenizer.bos_token(),
        "eos_token": tokenizer.eos_token(),
        "add_bos_token": adds_bos,
        "chat_template": template.source(),
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// `/tokenize` and `/detokenize` through `gateway` answer as the worker at `worker` does.
async fn tokenizes_as_the_worker(http: &reqwest::Client, gateway: &str, worker: &str) {
    let bodies = [
        (
            "/tokenize",
            json!({"prompt": "The three primary colours are", "return_token_strs": true}),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "What colour is the sea?"}]}),
        ),
        (
            "/tokenize",
            json!({"model": "no-such-model", "prompt": "x"}),
        ),
        ("/tokenize", json!({"prompt": 1})),
        ("/detokenize", json!({"tokens": [504, 713, 216]})),
        ("/detokenize", json!({"tokens": [999999999]})),
    ];
    for (path, body) in bodies {
        let (want_status, want) = post(http, &format!("{worker}{path}"), body.clone()).await;
        let (status, got) = post(http, &format!("{gateway}{path}"), body.clone()).await;
        assert_eq!(status, want_status, "{path} {body}: {got}");
        if status == 200 {
            assert_eq!(got, want, "{path} {body}");
        } else {
            assert!(got["error"]["message"].is_string(), "{got}");
        }
    }
}

async fn post(http: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let response = http.post(url).json(&body).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_counts_prompt_tokens_as_the_workers_do() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let len = MAX_MODEL_LEN.to_string();
        let flags = ["--num-kv-blocks", "64", "--max-model-len", len.as_str()];
        let (prefill, p_url) = start_worker("prefill", &model, &flags).await;
        let (decode, d_url) = start_worker("decode", &model, &flags).await;
        let folder = hf_folder(&model);
        for tokenizer in [model.clone(), folder.clone()] {
            let mut config = GatewayConfig::new(
                vec![p_url.parse().unwrap()],
                vec![d_url.parse().unwrap()],
                Vec::new(),
            );
            config.tokenizer = Some(tokenizer.clone());
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let gateway = format!("http://{}", listener.local_addr().unwrap());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let served = tokio::spawn(pdserve_gateway::serve(listener, config, async {
                let _ = stopped.await;
            }));
            let http = reqwest::Client::builder().no_proxy().build().unwrap();

            let chat = |max_tokens: u64| {
                json!({
                    "messages": [
                        {"role": "system", "content": "You answer in one word."},
                        {"role": "user", "content": "What colour is the sea on a sunny day?"}
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0
                })
            };
            let text = |max_tokens: u64| {
                json!({"prompt": "The three primary colours are", "max_tokens": max_tokens, "temperature": 0})
            };
            for (path, body) in [
                ("/v1/chat/completions", &chat as &dyn Fn(u64) -> Value),
                ("/v1/completions", &text),
            ] {
                let url = format!("{gateway}{path}");
                let (status, first) = post(&http, &url, body(1)).await;
                assert_eq!(status, 200, "{first}");
                let input = first["usage"]["prompt_tokens"].as_u64().unwrap();
                assert!(input > 3 && input < MAX_MODEL_LEN, "{input}");
                // To the last token of the context: served.
                let (status, full) = post(&http, &url, body(MAX_MODEL_LEN - input)).await;
                assert_eq!(status, 200, "{path}: {full}");
                // One more: the gateway refuses it, with the worker's count, exactly.
                let (status, refused) = post(&http, &url, body(MAX_MODEL_LEN - input + 1)).await;
                assert_eq!(status, 400, "{path}: {refused}");
                let message = refused["error"]["message"].as_str().unwrap();
                assert!(
                    message.contains(&format!("your request has {input} input tokens")),
                    "{path}: {message}"
                );
            }
            // Once a worker's model list is known the gateway answers these itself.
            tokenizes_as_the_worker(&http, &gateway, &d_url).await;
            let _ = stop.send(());
            let _ = served.await;
        }
        // Without a tokenizer a worker answers them.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway = format!("http://{}", listener.local_addr().unwrap());
        let config = GatewayConfig::new(
            vec![p_url.parse().unwrap()],
            vec![d_url.parse().unwrap()],
            Vec::new(),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(pdserve_gateway::serve(listener, config, async {
            let _ = stopped.await;
        }));
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        tokenizes_as_the_worker(&http, &gateway, &d_url).await;
        let _ = stop.send(());
        let _ = served.await;
        std::fs::remove_dir_all(&folder).unwrap();
        let _ = prefill.shutdown().await;
        let _ = decode.shutdown().await;
    })
    .await
    .expect("test exceeded its time limit");
}
