//! A request's choices once submitted, and the request each choice runs.

use super::Generation;
use crate::request::GenerationRequest;

/// The request for choice `index`. With a `seed`, choice `i` samples with `seed + i`
/// (wrapping; as vLLM derives its children's seeds), so seeded choices differ from each
/// other yet repeat from call to call; greedy choices all equal the `n` = 1 output.
pub fn choice_request(request: &GenerationRequest, index: usize) -> GenerationRequest {
    let mut request = request.clone();
    if index > 0 {
        // A KV feed, and a first token sampled by the prefill worker, belong to one
        // sequence (choice 0's).
        request.kv_feed = None;
        request.first_token = None;
    }
    if let Some(seed) = request.sampling.seed.as_mut() {
        *seed = seed.wrapping_add(index as u64);
    }
    request
}

/// A request's submitted choices: one generation per choice, or (a prefill for a remote
/// decode) one generation whose output stands for every choice.
pub struct Submitted {
    /// The generations, in choice order.
    pub generations: Vec<Generation>,
    /// How many choices the answer lists (`n`, times the prompts of a batch).
    pub choices: usize,
    /// How many prompts the choices answer (a batch of prompts: `choices / prompts`
    /// choices each, in prompt order).
    pub prompts: usize,
}

impl Submitted {
    /// One generation per choice.
    pub fn each(generations: Vec<Generation>) -> Self {
        let choices = generations.len();
        Self {
            generations,
            choices,
            prompts: 1,
        }
    }

    /// `n` choices answered by one generation (a prefill for a remote decode).
    pub fn shared(generation: Generation, choices: usize) -> Self {
        Self {
            generations: vec![generation],
            choices,
            prompts: 1,
        }
    }

    /// Nothing submitted yet (a batch's answers are appended to it).
    pub fn empty() -> Self {
        Self {
            generations: Vec::new(),
            choices: 0,
            prompts: 0,
        }
    }

    /// Appends the choices of the batch's next prompt.
    pub fn append(&mut self, next: Submitted) {
        self.generations.extend(next.generations);
        self.choices += next.choices;
        self.prompts += next.prompts;
    }
}
