//! Token sampling from logits: greedy at temperature 0, otherwise temperature, min-p,
//! top-k and top-p with a per-request RNG (seeded when the request gives a `seed`), plus
//! the log-probabilities OpenAI's `logprobs` report.
//!
//! Before either, the logits are adjusted as vLLM does: `logit_bias` is added, then the
//! repetition penalty (over prompt and generated tokens) divides positive and multiplies
//! negative logits, then the frequency and presence penalties (over generated tokens
//! only) are subtracted. Without any of them the logits are used as they are, so greedy
//! output is unchanged. Reported log-probabilities stay those of the raw logits (vLLM's
//! default `raw_logprobs`).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How a request wants its tokens chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 keeps every token.
    pub top_k: usize,
    /// Seed for a reproducible RNG; `None` seeds from the OS.
    pub seed: Option<u64>,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps every token.
    pub min_p: f32,
    /// Subtracted once from the logit of every token generated so far (-2..=2).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated so far (-2..=2).
    pub frequency_penalty: f32,
    /// Tokens seen in the prompt or output: positive logits divided by it, negative
    /// ones multiplied (> 0; 1 is off).
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens (values in -100..=100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether any bias or penalty changes the logits before sampling.
    fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}

/// A sampled token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// Log-probability of the sampled token.
    pub logprob: f32,
    /// The `n` most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
    /// The token's place in the vocabulary by likelihood (1 = most likely; vLLM's `rank`).
    pub rank: u32,
}

/// Chooses tokens for one sequence, remembering what it generated (for the penalties).
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Distinct prompt tokens; only kept when a repetition penalty is set.
    prompt: HashSet<u32>,
    /// How often each token was sampled so far.
    generated: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for `params` with an empty prompt.
    pub fn new(params: SamplingParams) -> Self {
        Self::for_prompt(params, &[])
    }

    /// A sampler for `params` continuing `prompt` (which the repetition penalty counts).
    pub fn for_prompt(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let prompt = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            params,
            rng,
            prompt,
            generated: HashMap::new(),
        }
    }

    /// `logits` with the logit bias and the penalties applied (borrowed when none is set).
    pub fn adjusted<'a>(&self, logits: &'a [f32]) -> Cow<'a, [f32]> {
        let p = &self.params;
        if !p.adjusts_logits() {
            return Cow::Borrowed(logits);
        }
        let mut out = logits.to_vec();
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = out.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let seen = self
                .prompt
                .iter()
                .chain(self.generated.keys().filter(|id| !self.prompt.contains(id)));
            for &id in seen {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        for (&id, &count) in &self.generated {
            if let Some(l) = out.get_mut(id as usize) {
                *l -= p.frequency_penalty * count as f32 + p.presence_penalty;
            }
        }
        Cow::Owned(out)
    }

    /// The next token from `logits`; tokens in `banned` are never chosen (e.g. EOS before
    /// `min_tokens`). The token is remembered for the penalties of later steps.
    pub fn sample(&mut self, logits: &[f32], banned: &[u32]) -> u32 {
        let adjusted = self.adjusted(logits);
        let token = self.choose(&adjusted, banned);
        *self.generated.entry(token).or_default() += 1;
        token
    }

    /// Takes `token` as sampled elsewhere with these same parameters (a prefill worker's
    /// first token): remembered for the penalties, and the RNG advanced past the draw
    /// that chose it, so a seeded sampler continues as if it had drawn the token itself.
    pub fn replay(&mut self, token: u32) {
        if self.params.temperature > 0.0 {
            let _: f32 = self.rng.random();
        }
        *self.generated.entry(token).or_default() += 1;
    }

    fn choose(&mut self, logits: &[f32], banned: &[u32]) -> u32 {
        let allowed = |i: usize| !banned.contains(&(i as u32)) && !logits[i].is_nan();
        if self.params.temperature <= 0.0 {
            return argmax(logits, allowed);
        }
        let inv_t = 1.0 / self.params.temperature;
        let mut candidates: Vec<(u32, f32)> = (0..logits.len())
            .filter(|&i| allowed(i))
            .map(|i| (i as u32, logits[i] * inv_t))
            .collect();
        if candidates.is_empty() {
            return argmax(logits, |_| true);
        }
        if self.params.min_p > 0.0 {
            // p >= min_p * p_max  <=>  logit >= max_logit + ln(min_p) (after temperature).
            let max = candidates
                .iter()
                .map(|c| c.1)
                .fold(f32::NEG_INFINITY, f32::max);
            let floor = max + self.params.min_p.ln();
            candidates.retain(|c| c.1 >= floor);
        }
        let top_k = self.params.top_k;
        if top_k > 0 && top_k < candidates.len() {
            candidates.select_nth_unstable_by(top_k - 1, |a, b| b.1.total_cmp(&a.1));
            candidates.truncate(top_k);
        }
        let max = candidates
            .iter()
            .map(|c| c.1)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = candidates
            .into_iter()
            .map(|(id, l)| (id, (l - max).exp()))
            .collect();
        if self.params.top_p < 1.0 {
            probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
            let total: f32 = probs.iter().map(|p| p.1).sum();
            let mut cumulative = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                cumulative += p.1 / total;
                if cumulative >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().map(|p| p.1).sum();
        let mut target = self.rng.random::<f32>() * total;
        for &(id, p) in &probs {
            if target < p {
                return id;
            }
            target -= p;
        }
        // Rounding left a sliver of mass: the last candidate owns it.
        probs.last().map_or(0, |p| p.0)
    }
}

fn argmax(logits: &[f32], allowed: impl Fn(usize) -> bool) -> u32 {
    let mut best = None::<(usize, f32)>;
    for (i, &l) in logits.iter().enumerate() {
        if allowed(i) && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Log-probability of `token` under the model's raw distribution, and the `top_n` most
/// likely tokens.
pub fn logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln() + max;
    let logprob_of = |i: usize| logits[i] - log_sum;
    let mut top = Vec::new();
    if top_n > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let n = top_n.min(ids.len());
        ids.select_nth_unstable_by(n - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        ids.truncate(n);
        ids.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top = ids
            .into_iter()
            .map(|i| (i, logprob_of(i as usize)))
            .collect();
    }
    let own = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&l| l > own).count() as u32;
    TokenLogprobs {
        logprob: logprob_of(token as usize),
        top,
        rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 5] = [1.0, 3.0, 2.0, -1.0, 2.5];

    #[test]
    fn greedy_picks_the_argmax_and_respects_bans() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&LOGITS, &[]), 1);
        assert_eq!(s.sample(&LOGITS, &[1]), 4);
    }

    #[test]
    fn a_replayed_token_leaves_a_seeded_sampler_where_drawing_it_would() {
        let params = SamplingParams {
            temperature: 0.9,
            seed: Some(7),
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        };
        let logits: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut drawing = Sampler::new(params.clone());
        let drawn: Vec<u32> = (0..6).map(|_| drawing.sample(&logits, &[])).collect();
        let mut replaying = Sampler::new(params);
        replaying.replay(drawn[0]);
        let rest: Vec<u32> = (0..5).map(|_| replaying.sample(&logits, &[])).collect();
        assert_eq!(rest, drawn[1..]);
    }

    #[test]
    fn same_seed_same_tokens() {
        let params = SamplingParams {
            temperature: 1.5,
            seed: Some(42),
            ..SamplingParams::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..32).map(|_| s.sample(&LOGITS, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        let distinct: std::collections::HashSet<_> = draw(&params).into_iter().collect();
        assert!(distinct.len() > 1, "temperature 1.5 explores");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let mut k1 = Sampler::new(SamplingParams {
            top_k: 2,
            seed: Some(1),
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert!([1, 4].contains(&k1.sample(&LOGITS, &[])));
        }
        let mut p = Sampler::new(SamplingParams {
            top_p: 0.01,
            seed: Some(1),
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert_eq!(p.sample(&LOGITS, &[]), 1);
        }
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let lp = logprobs(&LOGITS, 2, 3);
        let total: f32 = LOGITS.iter().map(|&l| (l + lp.logprob - 2.0).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
        assert_eq!(
            lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 4, 2]
        );
        assert_eq!(lp.top[2].1, lp.logprob);
        assert!(logprobs(&LOGITS, 0, 0).top.is_empty());
    }
}
