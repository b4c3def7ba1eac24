//! Token sampling from logits: greedy at temperature 0, otherwise temperature, top-k and
//! top-p with a per-request RNG (seeded when the request gives a `seed`), plus the
//! log-probabilities OpenAI's `logprobs` report.

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
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
}

/// A sampled token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// Log-probability of the sampled token.
    pub logprob: f32,
    /// The `n` most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Chooses tokens for one sequence.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Self { params, rng }
    }

    /// The next token from `logits`; tokens in `banned` are never chosen (e.g. EOS before
    /// `min_tokens`).
    pub fn sample(&mut self, logits: &[f32], banned: &[u32]) -> u32 {
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
    TokenLogprobs {
        logprob: logprob_of(token as usize),
        top,
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
