//! The paged KV store: blocks exported after a prefill and imported into a fresh store
//! under other block ids continue decoding identically; a batched step equals running each
//! sequence alone (bit for bit on the default path); bad input is rejected.

mod common;

use common::{argmax, blocks, chat_prompt, greedy, model_path};
use pdserve_model::{
    KvStore, LoadOptions, Model, ModelError, SequenceStep, WeightFormat, BLOCK_SIZE,
};

#[test]
fn exported_blocks_continue_decoding_identically() {
    let model = Model::load(&model_path()).unwrap();
    let prompt = chat_prompt(&model, "Give me three tips for staying healthy.");
    assert!(
        prompt.len() > BLOCK_SIZE,
        "the prompt should span several blocks"
    );
    let steps = 10;
    let table = blocks(0, 1, prompt.len() + steps + 1);
    let mut kv = KvStore::new(model.config(), table.len());
    let (expected, _) = greedy(&model, &mut kv, &table, &prompt, steps);

    // Prefill again in a store, export its blocks, import them elsewhere under new ids.
    let mut source = KvStore::new(model.config(), table.len());
    let logits = model
        .forward(
            &mut source,
            &[SequenceStep {
                tokens: &prompt,
                start_pos: 0,
                block_table: &table,
            }],
        )
        .unwrap()
        .remove(0);
    let moved = blocks(3, 2, prompt.len() + steps + 1);
    let mut target = KvStore::new(model.config(), 3 + 2 * moved.len());
    assert_eq!(source.block_bytes(), target.block_bytes());
    assert_eq!(source.bytes_per_token(), 23_040);
    for (&from, &to) in table
        .iter()
        .zip(&moved)
        .take(prompt.len().div_ceil(BLOCK_SIZE))
    {
        let bytes = source.read_block(from);
        assert_eq!(bytes.len(), source.block_bytes());
        target.write_block(to, &bytes).unwrap();
    }
    let mut next = argmax(&logits);
    let mut got = vec![next];
    for i in 0..steps - 1 {
        let step = SequenceStep {
            tokens: &[next],
            start_pos: prompt.len() + i,
            block_table: &moved,
        };
        next = argmax(&model.forward(&mut target, &[step]).unwrap()[0]);
        got.push(next);
    }
    assert_eq!(got, expected);
}

#[test]
fn batched_step_equals_each_sequence_alone() {
    let model = Model::load(&model_path()).unwrap();
    // The last prompt is long enough (> 256 positions) that its attention is split into
    // several parts of the context, computed by both threads.
    let long = "Summarise: the river town traded grain, salt and cloth for centuries. ".repeat(24);
    let prompts: Vec<Vec<u32>> = [
        "Hi!",
        "Write a haiku about the sea.",
        "What is 12 times 7? Explain step by step.",
        long.as_str(),
    ]
    .iter()
    .map(|p| chat_prompt(&model, p))
    .collect();
    assert!(prompts[3].len() > 2 * 128, "{}", prompts[3].len());
    let steps = 4;
    let tables: Vec<Vec<u32>> = (0..prompts.len() as u32)
        .map(|i| {
            blocks(
                i,
                prompts.len() as u32,
                prompts[i as usize].len() + steps + 1,
            )
        })
        .collect();
    let capacity = tables.iter().flatten().max().unwrap() + 1;

    let mut alone = Vec::new();
    for (p, t) in prompts.iter().zip(&tables) {
        let mut kv = KvStore::new(model.config(), capacity as usize);
        alone.push(greedy(&model, &mut kv, t, p, steps));
    }

    let mut kv = KvStore::new(model.config(), capacity as usize);
    let batch: Vec<SequenceStep> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SequenceStep {
            tokens: p,
            start_pos: 0,
            block_table: t,
        })
        .collect();
    let mut logits = model.forward(&mut kv, &batch).unwrap();
    for step in 0..steps {
        let next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
        for (s, (tokens, per_step)) in alone.iter().enumerate() {
            assert_eq!(next[s], tokens[step], "sequence {s}, step {step}");
            let diff = per_step[step]
                .iter()
                .zip(&logits[s])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // The default kernels treat every row alone (per-row activation quantization,
            // fixed summation order), so batching changes nothing, bit for bit: the
            // property P/D disaggregation relies on to match aggregated output.
            assert_eq!(diff, 0.0, "sequence {s}, step {step}: max |Δlogit| {diff}");
        }
        let batch: Vec<SequenceStep> = (0..prompts.len())
            .map(|s| SequenceStep {
                tokens: std::slice::from_ref(&next[s]),
                start_pos: prompts[s].len() + step,
                block_table: &tables[s],
            })
            .collect();
        logits = model.forward(&mut kv, &batch).unwrap();
    }
}

#[test]
fn bad_steps_and_blocks_are_rejected() {
    let model = Model::load(&model_path()).unwrap();
    let mut kv = KvStore::new(model.config(), 2);
    let too_long = vec![1u32; 3 * BLOCK_SIZE];
    let err = model
        .forward(
            &mut kv,
            &[SequenceStep {
                tokens: &too_long,
                start_pos: 0,
                block_table: &[0, 1],
            }],
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::InvalidInput(_)), "{err}");
    let err = model
        .forward(
            &mut kv,
            &[SequenceStep {
                tokens: &[1],
                start_pos: 0,
                block_table: &[9],
            }],
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::InvalidInput(_)), "{err}");
    let err = model
        .forward(
            &mut kv,
            &[SequenceStep {
                tokens: &[u32::MAX],
                start_pos: 0,
                block_table: &[0],
            }],
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::InvalidInput(_)), "{err}");
    assert!(kv.write_block(0, &[0u8; 7]).is_err());
    assert!(kv.write_block(5, &vec![0u8; kv.block_bytes()]).is_err());
}

#[test]
fn chunked_prefill_equals_one_prefill() {
    // One kernel for every step size, so chunking is the only difference.
    let options = LoadOptions {
        weights: WeightFormat::Native,
        dense_min_rows: None,
    };
    let model = Model::load_with(&model_path(), &options).unwrap();
    let prompt = chat_prompt(&model, "Write a haiku about the sea, then explain it.");
    let table = blocks(0, 1, prompt.len() + 1);
    let mut kv = KvStore::new(model.config(), table.len());
    let whole = model
        .forward(
            &mut kv,
            &[SequenceStep {
                tokens: &prompt,
                start_pos: 0,
                block_table: &table,
            }],
        )
        .unwrap()
        .remove(0);
    // Chunks that do not line up with block boundaries, then a single-token tail.
    let mut kv = KvStore::new(model.config(), table.len());
    let cuts = [0, 5, 23, prompt.len() - 1, prompt.len()];
    let mut last = Vec::new();
    for w in cuts.windows(2) {
        let step = SequenceStep {
            tokens: &prompt[w[0]..w[1]],
            start_pos: w[0],
            block_table: &table,
        };
        last = model.forward(&mut kv, &[step]).unwrap().remove(0);
    }
    assert_eq!(argmax(&last), argmax(&whole));
    let diff = last
        .iter()
        .zip(&whole)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // Rows are computed alone, so chunk boundaries change nothing, bit for bit.
    assert_eq!(diff, 0.0, "max |Δlogit| {diff}");
}
