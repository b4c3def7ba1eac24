//! The logit adjustments of `presence_penalty`, `frequency_penalty`,
//! `repetition_penalty`, `min_p` and `logit_bias` on known logits (vLLM semantics).

use pdserve_engine::sampling::{Sampler, SamplingParams};

const LOGITS: [f32; 6] = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0];

fn greedy(with: SamplingParams) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..with
    }
}

#[test]
fn no_adjustment_borrows_the_logits_unchanged() {
    let s = Sampler::for_prompt(SamplingParams::greedy(), &[0, 1]);
    assert!(matches!(s.adjusted(&LOGITS), std::borrow::Cow::Borrowed(_)));
}

#[test]
fn presence_and_frequency_count_generated_tokens_only() {
    let params = greedy(SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    });
    // Token 5 is in the prompt: no effect from the prompt alone.
    let mut s = Sampler::for_prompt(params, &[5, 5]);
    assert_eq!(&*s.adjusted(&LOGITS), &LOGITS);
    assert_eq!(s.sample(&LOGITS, &[]), 3);
    // Generated once: 3.0 - 0.5 - 0.25.
    assert_eq!(s.adjusted(&LOGITS)[3], 2.25);
    assert_eq!(s.sample(&LOGITS, &[]), 3);
    // Twice: 3.0 - 0.5 - 2 * 0.25 = 2.0, which ties with token 0: the first wins.
    let adjusted = s.adjusted(&LOGITS).into_owned();
    assert_eq!(adjusted[3], 2.0);
    assert_eq!(adjusted[5], 1.0, "prompt tokens are not penalised");
    assert_eq!(s.sample(&LOGITS, &[]), 0);
}

#[test]
fn negative_presence_penalty_rewards_repeats() {
    let mut s = Sampler::new(greedy(SamplingParams {
        presence_penalty: -2.0,
        ..SamplingParams::default()
    }));
    assert_eq!(s.sample(&LOGITS, &[]), 3);
    assert_eq!(s.adjusted(&LOGITS)[3], 5.0);
}

#[test]
fn repetition_divides_positive_and_multiplies_negative_over_prompt_and_output() {
    let params = greedy(SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::default()
    });
    let mut s = Sampler::for_prompt(params, &[3, 1, 3]);
    let adjusted = s.adjusted(&LOGITS).into_owned();
    assert_eq!(adjusted, vec![2.0, -2.0, 0.5, 1.5, -2.0, 1.0]);
    // 3 halved to 1.5: token 0 (2.0) is now the most likely, and once generated is
    // halved too.
    assert_eq!(s.sample(&LOGITS, &[]), 0);
    let adjusted = s.adjusted(&LOGITS).into_owned();
    assert_eq!(adjusted, vec![1.0, -2.0, 0.5, 1.5, -2.0, 1.0]);
}

#[test]
fn logit_bias_is_added_before_sampling() {
    let mut s = Sampler::new(greedy(SamplingParams {
        logit_bias: vec![(3, -100.0), (4, 4.5), (99, 1.0)],
        ..SamplingParams::default()
    }));
    let adjusted = s.adjusted(&LOGITS).into_owned();
    assert_eq!(adjusted[3], -97.0);
    assert_eq!(adjusted[4], 2.5);
    // Token 4 (-2 + 4.5) beats token 0 (2.0); an id past the vocabulary is ignored here
    // (validation refuses it).
    assert_eq!(s.sample(&LOGITS, &[]), 4);
}

#[test]
fn min_p_keeps_tokens_at_least_that_fraction_of_the_best() {
    // Probabilities relative to the best (token 3, logit 3.0) are exp(l - 3):
    // token 0: 0.37, token 5: 0.14, token 2: 0.08, the rest below 0.02.
    let mut s = Sampler::new(SamplingParams {
        min_p: 0.3,
        temperature: 1.0,
        seed: Some(7),
        ..SamplingParams::default()
    });
    let mut seen = std::collections::HashSet::new();
    for _ in 0..400 {
        seen.insert(s.sample(&LOGITS, &[]));
    }
    assert_eq!(seen, [0, 3].into_iter().collect());
    let mut s = Sampler::new(SamplingParams {
        min_p: 0.1,
        seed: Some(7),
        ..SamplingParams::default()
    });
    let mut seen = std::collections::HashSet::new();
    for _ in 0..400 {
        seen.insert(s.sample(&LOGITS, &[]));
    }
    assert_eq!(seen, [0, 3, 5].into_iter().collect());
}

#[test]
fn min_p_is_ignored_by_greedy_and_penalties_apply_to_greedy() {
    let mut s = Sampler::new(greedy(SamplingParams {
        min_p: 1.0,
        frequency_penalty: 2.0,
        ..SamplingParams::default()
    }));
    // 3 (3.0), then 3 is at 1.0 and 0 (2.0) wins, then 0 is at 0.0 and 3 wins again.
    let picks: Vec<u32> = (0..3).map(|_| s.sample(&LOGITS, &[])).collect();
    assert_eq!(picks, vec![3, 0, 3]);
}
