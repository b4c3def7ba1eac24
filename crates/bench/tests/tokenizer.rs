//! Prompt lengths against the default model's real tokenizer (SmolLM2, fetched once
//! into $PDSERVE_HOME like the model tests do): the word approximation is exact for it,
//! and `--tokenizer-gguf` sizes prompts exactly.

mod support;

use pdserve_bench::dataset::{load_tokenizer, PromptGenerator};
use pdserve_bench::serve::run_serve;
use pdserve_bench::trace::TraceEntry;
use pdserve_bench::trace_prompt::TracePrompts;
use pdserve_bench::BenchError;
use pdserve_model::{ensure_default_model, home_dir};
use support::scripted_server::{Reply, ScriptedServer};
use support::{never, parse, scratch, serve_args, TEST_LIMIT};

#[test]
fn word_prompts_have_exactly_the_requested_tokens() {
    let path = ensure_default_model(&home_dir()).expect("default model");
    let tokenizer = load_tokenizer(Some(&path)).expect("load").expect("some");
    let mut approximate = PromptGenerator::new(3);
    let mut exact = PromptGenerator::new(3).with_tokenizer(Some(tokenizer.clone()));
    for n in [1u64, 2, 16, 127, 1000] {
        let text = approximate.words(n);
        assert_eq!(
            tokenizer.encode(&text).unwrap().len() as u64,
            n,
            "approximation for {n}"
        );
        let text = exact.prompt(n).expect("prompt");
        assert_eq!(
            tokenizer.encode(&text).unwrap().len() as u64,
            n,
            "exact for {n}"
        );
    }
    let requests = PromptGenerator::new(5)
        .with_tokenizer(Some(tokenizer.clone()))
        .requests(20, 64, 8, 0.5)
        .expect("requests");
    for r in requests {
        assert_eq!(
            tokenizer.encode(&r.prompt).unwrap().len() as u64,
            r.prompt_tokens
        );
    }
}

#[test]
fn trace_prompts_are_exact_and_blocks_tokenize_alike_wherever_they_are() {
    let path = ensure_default_model(&home_dir()).expect("default model");
    let tokenizer = load_tokenizer(Some(&path)).expect("load").expect("some");
    let entry = |input_length, ids: &[u64]| TraceEntry {
        timestamp: 0.0,
        input_length,
        output_length: 1,
        hash_ids: ids.to_vec(),
    };
    for exact in [None, Some(&*tokenizer)] {
        let prompts = TracePrompts::new(4, exact).expect("prompts");
        let a = tokenizer
            .encode(&prompts.prompt(0, &entry(1100, &[1, 2, 3])))
            .unwrap();
        let b = tokenizer
            .encode(&prompts.prompt(1, &entry(1300, &[1, 2])))
            .unwrap();
        let c = tokenizer
            .encode(&prompts.prompt(2, &entry(200, &[2])))
            .unwrap();
        assert_eq!((a.len(), b.len(), c.len()), (1100, 1300, 200));
        // A block's tokens do not depend on what follows it (block 3, or a unique tail).
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1100], b[1024..1100]);
        assert_eq!(
            c[..],
            a[512..712],
            "block 2, cut short, tokenizes as its start"
        );
    }
}

#[test]
fn tokenized_trace_prompts_are_the_ids_of_their_text() {
    let path = ensure_default_model(&home_dir()).expect("default model");
    let tokenizer = load_tokenizer(Some(&path)).expect("load").expect("some");
    let prompts = TracePrompts::new(9, Some(&*tokenizer)).expect("prompts");
    for (index, length, ids) in [
        (0, 1100, &[1, 2, 3][..]),
        (1, 700, &[1][..]),
        (2, 40, &[][..]),
    ] {
        let entry = TraceEntry {
            timestamp: 0.0,
            input_length: length,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        let text = tokenizer.encode(&prompts.prompt(index, &entry)).unwrap();
        let sent = prompts
            .prompt_ids(index, &entry)
            .expect("built with a tokenizer");
        assert_eq!(sent, text, "request {index}");
        assert_eq!(sent.len() as u64, length);
    }
    let approximate = TracePrompts::new(9, None).expect("prompts");
    let entry = TraceEntry {
        timestamp: 0.0,
        input_length: 10,
        output_length: 1,
        hash_ids: vec![],
    };
    assert_eq!(
        approximate.prompt_ids(0, &entry),
        None,
        "no tokenizer, no ids"
    );
}

#[tokio::test]
async fn a_missing_tokenizer_file_is_a_clear_error() {
    let args = serve_args(&[
        "--url",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--concurrency",
        "1",
        "--tokenizer-gguf",
        "/nonexistent/model.gguf",
    ]);
    let err = run_serve(&args, never()).await.unwrap_err();
    assert!(matches!(err, BenchError::Tokenizer { .. }), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/model.gguf"), "{err}");
}

#[tokio::test]
async fn tokenize_prompt_sends_a_traces_prompts_as_their_token_ids() {
    let path = ensure_default_model(&home_dir()).expect("default model");
    let gguf = path.to_str().unwrap();
    let tokenizer = load_tokenizer(Some(&path)).expect("load").expect("some");
    let trace = scratch("tokenized.jsonl");
    let lines = [
        r#"{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [4]}"#,
        r#"{"timestamp": 10, "input_length": 1030, "output_length": 2, "hash_ids": [4, 5]}"#,
    ];
    std::fs::write(&trace, lines.join("\n") + "\n").expect("write trace");
    let server = ScriptedServer::start(|_| Reply::stream_ms(1, 1)).await;
    let url = server.url();
    let trace_flags = [
        "--url",
        &url,
        "--dataset",
        "mooncake",
        "--dataset-path",
        trace.to_str().unwrap(),
        "--seed",
        "3",
    ];
    let mut with_ids = trace_flags.to_vec();
    with_ids.extend(["--tokenize-prompt", "--tokenizer-gguf", gguf]);
    let result = tokio::time::timeout(TEST_LIMIT, run_serve(&serve_args(&with_ids), never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;
    assert_eq!(result.summary.completed, 2, "{:?}", result.failures);
    assert!(result.config.tokenize_prompt);
    // After the probe (text): arrays of ids, the first block's the same in both, and
    // they are what the text of the same replay tokenizes to.
    let ids: Vec<Vec<u32>> = bodies[1..]
        .iter()
        .map(|b| serde_json::from_value(b["prompt"].clone()).expect("an array of ids"))
        .collect();
    let (short, long) = if ids[0].len() == 600 {
        (&ids[0], &ids[1])
    } else {
        (&ids[1], &ids[0])
    };
    assert_eq!((short.len(), long.len()), (600, 1030));
    assert_eq!(short[..512], long[..512], "hash id 4 is the same tokens");
    let prompts = TracePrompts::new(3, Some(&*tokenizer)).expect("prompts");
    let entry = TraceEntry {
        timestamp: 10.0,
        input_length: 1030,
        output_length: 2,
        hash_ids: vec![4, 5],
    };
    assert_eq!(*long, tokenizer.encode(&prompts.prompt(1, &entry)).unwrap());

    // Without the tokenizer it cannot build ids; chat takes none.
    let mut no_tokenizer = vec!["serve"];
    no_tokenizer.extend(trace_flags);
    no_tokenizer.push("--tokenize-prompt");
    let err = parse(&no_tokenizer).unwrap_err().to_string();
    assert!(err.contains("--tokenizer-gguf"), "{err}");
    let mut chat = with_ids.clone();
    chat.extend(["--endpoint", "chat"]);
    let err = run_serve(&serve_args(&chat), never()).await.unwrap_err();
    assert!(
        matches!(err, BenchError::TokenIdsNeedCompletions),
        "{err:?}"
    );
}
