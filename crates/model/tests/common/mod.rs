//! Helpers shared by the model tests: the default model and greedy decoding over a KvStore.

#![allow(dead_code)]

use std::path::PathBuf;

use pdserve_model::{
    ensure_default_model, home_dir, BlockId, ChatTurn, KvStore, Model, SequenceStep, BLOCK_SIZE,
};

/// Path of the default model, fetched on first use.
pub fn model_path() -> PathBuf {
    ensure_default_model(&home_dir()).expect("default model")
}

/// Index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0 as u32
}

/// A chat prompt rendered with the model's template, as token ids.
pub fn chat_prompt(model: &Model, user: &str) -> Vec<u32> {
    let text = model
        .chat_template()
        .render(
            &[ChatTurn {
                role: "user".into(),
                content: user.into(),
            }],
            true,
        )
        .unwrap();
    model.tokenizer().encode(&text, true).unwrap()
}

/// Blocks `first, first + stride, ...` covering `positions` tokens.
pub fn blocks(first: u32, stride: u32, positions: usize) -> Vec<BlockId> {
    (0..positions.div_ceil(BLOCK_SIZE) as u32)
        .map(|i| first + i * stride)
        .collect()
}

/// Prefills `prompt`, then greedily generates `steps` tokens; returns them with each step's logits.
pub fn greedy(
    model: &Model,
    kv: &mut KvStore,
    table: &[BlockId],
    prompt: &[u32],
    steps: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = model
        .forward(
            kv,
            &[SequenceStep {
                tokens: prompt,
                start_pos: 0,
                block_table: table,
            }],
        )
        .unwrap()
        .remove(0);
    let mut tokens = Vec::new();
    let mut all = Vec::new();
    for pos in prompt.len()..prompt.len() + steps {
        let next = argmax(&logits);
        tokens.push(next);
        all.push(std::mem::take(&mut logits));
        logits = model
            .forward(
                kv,
                &[SequenceStep {
                    tokens: &[next],
                    start_pos: pos,
                    block_table: table,
                }],
            )
            .unwrap()
            .remove(0);
    }
    (tokens, all)
}
