//! A request's choices once submitted, and the request each choice runs.

use super::Generation;
use crate::request::GenerationRequest;

/// The request for choice `index`. With a `seed`, choice `i` samples with `seed + i`
/// (wrapping; as vLLM derives its children's seeds), so seeded choices differ from each
/// other yet repeat from call to call; greedy choices all equal the `n` = 1 output.
pub fn choice_request(request: &GenerationRequest, index: usize) -> GenerationRequest {
    let mut request = request.clone();
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
    /// How many choices the answer lists (`n`).
    pub choices: usize,
}

impl Submitted {
    /// One generation per choice.
    pub fn each(generations: Vec<Generation>) -> Self {
        let choices = generations.len();
        Self {
            generations,
            choices,
        }
    }
}
