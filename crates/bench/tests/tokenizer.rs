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
use support::{never, serve_args};

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
