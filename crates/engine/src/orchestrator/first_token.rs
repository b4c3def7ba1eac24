//! The first token from prefill, orchestrated: the prefill leg samples the request's
//! first token with the request's own sampling and answers its id (vLLM's
//! `return_token_ids`); the decode here starts from it (`GenerationRequest::first_token`),
//! importing the whole prompt's KV, so its first step computes the second token.
//!
//! Equality with the aggregated worker holds because the prefill worker computes the
//! same logits for the last prompt position and samples them with the same parameters
//! (seeded choice 0 included: the decode's sampler then skips the draw the prefill made).
//! Requests whose first token carries more than its id (logprobs), or that could not go
//! on after it, sample it here as before.

use serde_json::{Map, Value};

use super::FirstTokenFromPrefill;
use crate::request::GenerationRequest;

/// vLLM's request field that makes a completion answer list its tokens' ids
/// (`choices[i].token_ids`).
pub const RETURN_TOKEN_IDS: &str = "return_token_ids";

/// Whether `request` asks the prefill leg for its first token: `mode` and the request's
/// own `choice` allow it, the token needs nothing but its id (no logprobs, no prompt
/// logprobs), and the sequence can go on after it (`max_tokens` above 1, room in the
/// context for one more token).
pub fn wanted(
    mode: FirstTokenFromPrefill,
    choice: Option<bool>,
    request: &GenerationRequest,
    max_model_len: usize,
) -> bool {
    mode.wanted(choice)
        && request.logprobs.is_none()
        && request.prompt_logprobs.is_none()
        && request.max_new_tokens > 1
        && request.prompt.len() + 1 < max_model_len
}

/// Makes the prefill leg `body` sample its one token as `request` would (its sampling
/// fields, and `min_tokens` 1 when the first token may not be a stop token) and answer
/// its id.
pub fn ask(body: &mut Value, request: &GenerationRequest) {
    let Some(object) = body.as_object_mut() else {
        return;
    };
    let s = &request.sampling;
    let mut put = |name: &str, value: Value| {
        object.insert(name.into(), value);
    };
    put("temperature", Value::from(s.temperature));
    put("top_p", Value::from(s.top_p));
    // -1 is "every token" for vLLM and this engine alike.
    put(
        "top_k",
        if s.top_k == 0 {
            Value::from(-1)
        } else {
            Value::from(s.top_k)
        },
    );
    put("min_p", Value::from(s.min_p));
    if let Some(seed) = s.seed {
        put("seed", Value::from(seed));
    }
    if s.repetition_penalty != 1.0 {
        put("repetition_penalty", Value::from(s.repetition_penalty));
    }
    if !s.logit_bias.is_empty() {
        let bias: Map<String, Value> = s
            .logit_bias
            .iter()
            .map(|&(id, b)| (id.to_string(), Value::from(b)))
            .collect();
        put("logit_bias", Value::Object(bias));
    }
    // Presence and frequency penalties weigh generated tokens only: none yet.
    if request.min_new_tokens > 0 && !request.stop_token_ids.is_empty() {
        // The stop tokens are the model's EOS (`stop_token_ids` is not accepted), which
        // the prefill worker bans under `min_tokens` as this worker would.
        put("min_tokens", Value::from(1));
    }
    put(RETURN_TOKEN_IDS, Value::Bool(true));
}

/// The first token's id in a prefill answer (`choices[0].token_ids[0]`), if it lists one.
pub fn read(answer: &Value) -> Option<u32> {
    let id = answer
        .get("choices")?
        .get(0)?
        .get("token_ids")?
        .get(0)?
        .as_u64()?;
    u32::try_from(id).ok()
}

/// Whether `token`, answered by a prefill worker for `request`, can start its decode
/// here: a token of this model's vocabulary that does not end the sequence (an ending
/// token is sampled again here, which ends it the same way).
pub fn usable(token: u32, request: &GenerationRequest, vocab_size: usize) -> bool {
    (token as usize) < vocab_size
        && !(request.min_new_tokens == 0 && request.stop_token_ids.contains(&token))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;
    use serde_json::json;

    fn request() -> GenerationRequest {
        GenerationRequest {
            stop_token_ids: vec![2],
            ..GenerationRequest::new(vec![1, 5, 9], 8)
        }
    }

    #[test]
    fn only_requests_whose_first_token_is_its_id_and_that_go_on_ask_for_it() {
        let r = request();
        let auto = FirstTokenFromPrefill::Auto;
        assert!(wanted(auto, None, &r, 64));
        assert!(!wanted(auto, Some(false), &r, 64));
        assert!(!wanted(FirstTokenFromPrefill::Off, None, &r, 64));
        assert!(wanted(FirstTokenFromPrefill::Off, Some(true), &r, 64));
        assert!(!wanted(auto, None, &r, 4), "no room after the first token");
        let one = GenerationRequest::new(vec![1, 5, 9], 1);
        assert!(!wanted(auto, None, &one, 64));
        let scored = GenerationRequest {
            logprobs: Some(0),
            ..request()
        };
        assert!(!wanted(auto, None, &scored, 64));
    }

    #[test]
    fn the_leg_samples_as_the_request_does_and_answers_the_id() {
        let mut r = request();
        r.sampling = SamplingParams {
            temperature: 0.5,
            top_k: 7,
            seed: Some(11),
            repetition_penalty: 1.5,
            logit_bias: vec![(4, -1.0)],
            ..SamplingParams::default()
        };
        r.min_new_tokens = 3;
        let mut body = json!({"prompt": [1, 5, 9], "max_tokens": 1});
        ask(&mut body, &r);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["top_k"], 7);
        assert_eq!(body["seed"], 11);
        assert_eq!(body["repetition_penalty"], 1.5);
        assert_eq!(body["logit_bias"], json!({"4": -1.0}));
        assert_eq!(body["min_tokens"], 1);
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body[RETURN_TOKEN_IDS], true);
        let mut plain = json!({});
        ask(&mut plain, &request());
        assert!(plain.get("seed").is_none() && plain.get("min_tokens").is_none());
    }

    #[test]
    fn the_token_is_read_from_the_answer_and_checked() {
        let answer = json!({"choices": [{"text": "x", "token_ids": [42]}]});
        assert_eq!(read(&answer), Some(42));
        assert_eq!(read(&json!({"choices": [{"text": "x"}]})), None);
        assert_eq!(read(&json!({"choices": [{"token_ids": ["42"]}]})), None);
        let r = request();
        assert!(usable(42, &r, 100));
        assert!(!usable(100, &r, 100), "outside the vocabulary");
        assert!(!usable(2, &r, 100), "a stop token ends the sequence");
        let held = GenerationRequest {
            min_new_tokens: 1,
            ..request()
        };
        assert!(usable(2, &held, 100));
    }
}
