//! End to end on the default (shipped) path: chat template, tokenizer, batched forward over
//! the paged store and the incremental detokenizer give a sensible greedy answer.

mod common;

use common::{blocks, chat_prompt, greedy, model_path};
use pdserve_model::{IncrementalDecoder, KvStore, Model};

#[test]
fn greedy_answer_is_sensible() {
    let model = Model::load(&model_path()).unwrap();
    let prompt = chat_prompt(&model, "Give me three tips for staying healthy.");
    let steps = 40;
    let table = blocks(0, 1, prompt.len() + steps + 1);
    let mut kv = KvStore::new(model.config(), table.len());
    let (tokens, _) = greedy(&model, &mut kv, &table, &prompt, steps);
    let tok = model.tokenizer();
    let mut decoder = IncrementalDecoder::new(true);
    let mut streamed = String::new();
    for &t in &tokens {
        streamed.extend(decoder.step(tok, t).unwrap());
    }
    streamed.extend(decoder.flush(tok).unwrap());
    assert_eq!(streamed, tok.decode(&tokens, true).unwrap());
    let answer = streamed.to_lowercase();
    assert!(
        ["water", "hydrat", "sleep", "exercise"]
            .iter()
            .any(|w| answer.contains(w)),
        "unexpected answer: {streamed:?}"
    );
}
