//! The prefill leg: a completion request with the prompt as token ids, one token, not
//! streamed, asking the prefill worker to keep the prompt's KV for this worker
//! (`kv_transfer_params.do_remote_decode`), and how it can fail.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use pdserve_protocol::{
    error_chain, shape_prefill_leg, CompletionRequest, KvTransferParams, LegFault, Prompt,
};
use serde_json::Value;

use super::first_token;
use crate::kv::PUBLISH_REQUEST_ID;
use crate::sampling::TokenLogprobs;

/// Longest part of an upstream error body quoted in an error message.
const QUOTE_LIMIT: usize = 512;

/// The prefill leg's body for `prompt`. `publish_as` names the id the prefill worker
/// publishes the KV under (concurrent handoff); `model` is the client's `model` field.
/// Sampling fields are left out: the prefill's one token is thrown away (this worker
/// computes the last prompt position itself and samples from its own logits).
/// With `prompt_logprobs` the prefill worker also scores the prompt (vLLM's field), as
/// only it computes the prompt.
pub fn prefill_body(
    model: Option<&str>,
    prompt: &[u32],
    publish_as: Option<&str>,
    prompt_logprobs: Option<usize>,
) -> Value {
    let mut params = KvTransferParams::prefill_request();
    if let Some(id) = publish_as {
        params
            .extra
            .insert(PUBLISH_REQUEST_ID.into(), Value::from(id));
    }
    let mut request = CompletionRequest {
        model: model.map(str::to_string),
        prompt: Prompt::Tokens(prompt.to_vec()),
        logprobs: None,
        echo: None,
        generation: Default::default(),
        transport: Default::default(),
        extra: Default::default(),
        verbatim_numbers: Vec::new(),
    };
    if let Some(n) = prompt_logprobs {
        request
            .extra
            .insert("prompt_logprobs".into(), Value::from(n));
    }
    shape_prefill_leg(&mut request.transport, &mut request.generation, params);
    serde_json::to_value(&request).expect("a completion request serializes")
}

/// What a prefill leg's 200 answer tells this worker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillAnswer {
    /// Where its KV is (`None`: a worker that keeps no KV).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Its `choices[0].prompt_logprobs`, when the leg asked for them: entry `i` scores
    /// prompt token `i` (`None` for the first).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// The id of the token it sampled, when the leg asked for it and the answer lists it.
    pub first_token: Option<u32>,
}

/// Reads vLLM's `prompt_logprobs` list against the prompt it scores: each entry's own
/// token gives the log-probability and rank, the others (most likely first) the
/// alternatives, capped at `top`.
pub fn parse_prompt_logprobs(
    value: &Value,
    prompt: &[u32],
    top: usize,
) -> Option<Vec<Option<TokenLogprobs>>> {
    let list = value.as_array()?;
    let entries = list
        .iter()
        .zip(prompt)
        .map(|(entry, &token)| {
            let map = entry.as_object()?;
            let mut scored: Vec<(u32, f32, u32)> = map
                .iter()
                .filter_map(|(id, v)| {
                    let logprob = v.get("logprob")?.as_f64()? as f32;
                    let rank = v.get("rank").and_then(Value::as_u64).unwrap_or(0) as u32;
                    Some((id.parse().ok()?, logprob, rank))
                })
                .collect();
            let own = *scored.iter().find(|(id, ..)| *id == token)?;
            scored.sort_by(|a, b| b.1.total_cmp(&a.1));
            let top = scored
                .iter()
                .filter(|(id, _, rank)| *id != token || *rank as usize <= top)
                .take(top)
                .map(|&(id, l, _)| (id, l))
                .collect();
            Some(TokenLogprobs {
                logprob: own.1,
                top,
                rank: own.2,
            })
        })
        .collect();
    Some(entries)
}

/// A failed prefill leg.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    /// The prefill worker refused the request (4xx); the client gets its answer as is.
    #[error("prefill worker {url} answered {status}")]
    Rejected {
        /// The prefill worker.
        url: String,
        /// Its 4xx status.
        status: StatusCode,
        /// Its body, passed on unchanged.
        body: Bytes,
    },
    /// The prefill worker answered with a non-4xx error status.
    #[error("prefill worker {url} answered {status}: {message}")]
    Failed {
        /// The prefill worker.
        url: String,
        /// Its status.
        status: StatusCode,
        /// The start of its body.
        message: String,
    },
    /// No connection could be made.
    #[error("prefill worker {url} could not be reached: {reason}")]
    Unreachable {
        /// The prefill worker.
        url: String,
        /// The connection error.
        reason: String,
    },
    /// The connection broke before the answer was complete.
    #[error("prefill worker {url} broke off the request: {reason}")]
    Broken {
        /// The prefill worker.
        url: String,
        /// The transport error.
        reason: String,
    },
    /// No complete answer within `--prefill-timeout-secs`.
    #[error("prefill worker {url} did not answer within {} s", .limit.as_secs_f64())]
    TimedOut {
        /// The prefill worker.
        url: String,
        /// The limit that passed.
        limit: Duration,
    },
    /// A 200 whose body is not a completion with usable `kv_transfer_params`.
    #[error("prefill worker {url} answered 200 with {reason}")]
    BadAnswer {
        /// The prefill worker.
        url: String,
        /// What is wrong with the body.
        reason: String,
    },
}

impl PrefillError {
    /// How the leg failed, in the classification the gateway's legs share.
    pub fn fault(&self) -> LegFault {
        match self {
            Self::Rejected { .. } => LegFault::Rejected,
            Self::Failed { .. } => LegFault::Failed,
            Self::Unreachable { .. } => LegFault::Unreachable,
            Self::Broken { .. } => LegFault::Broken,
            Self::TimedOut { .. } => LegFault::TimedOut,
            Self::BadAnswer { .. } => LegFault::BadAnswer,
        }
    }

    /// The `outcome` label of the prefill-request counter.
    pub fn outcome(&self) -> &'static str {
        match self.fault() {
            LegFault::Rejected => "rejected",
            LegFault::Failed => "failed",
            LegFault::Unreachable => "unreachable",
            LegFault::Broken => "broken",
            LegFault::TimedOut => "timeout",
            LegFault::BadAnswer => "bad_answer",
        }
    }

    /// Whether the worker looks gone (not just this request failed): it is then routed
    /// around until pre-warmed again.
    pub fn worker_gone(&self) -> bool {
        self.fault().server_gone()
    }
}

/// Sends prefill legs over pooled HTTP/1.1 connections.
#[derive(Debug, Clone)]
pub struct PrefillClient {
    http: reqwest::Client,
    timeout: Duration,
    api_key: Option<String>,
}

impl PrefillClient {
    /// A client whose legs may take at most `timeout` each, sending `api_key` as a
    /// bearer token when given.
    pub fn new(timeout: Duration, api_key: Option<String>) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            // Workers close idle keep-alive connections after their header read timeout
            // (30 s by default): retire ours first so a reused one never races that close.
            .pool_idle_timeout(Duration::from_secs(20))
            .connect_timeout(Duration::from_secs(3).min(timeout))
            .build()
            .map_err(|e| format!("cannot build the prefill HTTP client: {e}"))?;
        Ok(Self {
            http,
            timeout,
            api_key,
        })
    }

    /// POSTs `body` to `url`'s `/v1/completions` and returns what its 200 answer says.
    pub async fn send(&self, url: &str, body: &Value) -> Result<PrefillAnswer, PrefillError> {
        let (span, trace_headers) = crate::trace::prefill_leg(url);
        let exchange = async {
            let mut request = self.http.post(format!("{url}/v1/completions")).json(body);
            if let Some(key) = &self.api_key {
                request = request.bearer_auth(key);
            }
            if let Some(headers) = &trace_headers {
                for (name, value) in headers.header_values() {
                    request = request.header(name, value);
                }
            }
            let response = request.send().await.map_err(|e| transport_error(url, &e))?;
            let status = response.status();
            let bytes = response.bytes().await.map_err(|e| PrefillError::Broken {
                url: url.to_string(),
                reason: error_chain(&e),
            })?;
            answer(url, status, bytes, body)
        };
        let result = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| PrefillError::TimedOut {
                url: url.to_string(),
                limit: self.timeout,
            })
            .and_then(|answer| answer);
        if let (Some(span), Err(e)) = (&span, &result) {
            span.fail(e.to_string());
        }
        result
    }

    /// Whether `url`'s `/health` answers 200 within `limit`.
    pub async fn healthy(&self, url: &str, limit: Duration) -> Result<(), String> {
        let response = self
            .http
            .get(format!("{url}/health"))
            .timeout(limit)
            .send()
            .await
            .map_err(|e| error_chain(&e))?;
        match response.status() {
            StatusCode::OK => Ok(()),
            status => Err(format!("/health answered {status}")),
        }
    }
}

fn transport_error(url: &str, e: &reqwest::Error) -> PrefillError {
    let url = url.to_string();
    let reason = error_chain(e);
    if e.is_connect() {
        PrefillError::Unreachable { url, reason }
    } else {
        PrefillError::Broken { url, reason }
    }
}

/// Classifies a complete answer to `sent`.
fn answer(
    url: &str,
    status: StatusCode,
    body: Bytes,
    sent: &Value,
) -> Result<PrefillAnswer, PrefillError> {
    let url = url.to_string();
    match LegFault::of_status(status) {
        None => {}
        Some(LegFault::Rejected) => return Err(PrefillError::Rejected { url, status, body }),
        Some(_) => {
            return Err(PrefillError::Failed {
                url,
                status,
                message: quote(&body),
            })
        }
    }
    let bad = |reason: String| PrefillError::BadAnswer {
        url: url.clone(),
        reason,
    };
    let mut answer: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("a body that is not JSON: {e}")))?;
    let Some(object) = answer.as_object_mut() else {
        return Err(bad("a body that is not a JSON object".into()));
    };
    let kv_transfer_params = match object.remove("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(params) => Some(
            serde_json::from_value(params)
                .map_err(|e| bad(format!("malformed kv_transfer_params: {e}")))?,
        ),
    };
    let prompt_logprobs = match sent.get("prompt_logprobs").and_then(Value::as_u64) {
        None => None,
        Some(top) => {
            let prompt: Vec<u32> = sent
                .get("prompt")
                .and_then(|p| serde_json::from_value(p.clone()).ok())
                .unwrap_or_default();
            let listed = object
                .get("choices")
                .and_then(|c| c.get(0))
                .and_then(|c| c.get("prompt_logprobs"))
                .ok_or_else(|| bad("no choices[0].prompt_logprobs for a scored prompt".into()))?;
            let parsed = parse_prompt_logprobs(listed, &prompt, top as usize)
                .ok_or_else(|| bad("a prompt_logprobs that is not a list".into()))?;
            Some(parsed)
        }
    };
    let first_token = if sent.get(first_token::RETURN_TOKEN_IDS) == Some(&Value::Bool(true)) {
        first_token::read(&answer)
    } else {
        None
    };
    Ok(PrefillAnswer {
        kv_transfer_params,
        prompt_logprobs,
        first_token,
    })
}

/// The start of `body` as text, for error messages.
fn quote(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(QUOTE_LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_prefill_leg_is_a_one_token_token_id_completion() {
        let body = prefill_body(Some("m"), &[1, 2, 3], Some("pdkv-x"), None);
        assert_eq!(
            body,
            json!({
                "prompt": [1, 2, 3], "max_tokens": 1, "stream": false, "model": "m",
                "kv_transfer_params": {
                    "do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null,
                    "remote_host": null, "remote_port": null,
                    "publish_request_id": "pdkv-x"
                }
            })
        );
        let body = prefill_body(None, &[7], None, None);
        assert!(body.get("model").is_none());
        assert!(body["kv_transfer_params"].get(PUBLISH_REQUEST_ID).is_none());
    }

    #[test]
    fn answers_are_classified() {
        let url = "http://p:1";
        let sent = prefill_body(None, &[7], None, None);
        let answer = |url, status, body| answer(url, status, body, &sent);
        let ok = answer(
            url,
            StatusCode::OK,
            Bytes::from(r#"{"kv_transfer_params": {"do_remote_prefill": true, "remote_port": 9}}"#),
        )
        .unwrap()
        .kv_transfer_params
        .unwrap();
        assert!(ok.do_remote_prefill && ok.remote_port == Some(9));
        assert_eq!(
            answer(url, StatusCode::OK, Bytes::from("{}")).unwrap(),
            PrefillAnswer::default()
        );
        let body = Bytes::from(r#"{"error": {"message": "too long"}}"#);
        match answer(url, StatusCode::BAD_REQUEST, body.clone()).unwrap_err() {
            PrefillError::Rejected {
                status, body: b, ..
            } => {
                assert_eq!((status, b), (StatusCode::BAD_REQUEST, body))
            }
            other => panic!("{other:?}"),
        }
        let e = answer(url, StatusCode::SERVICE_UNAVAILABLE, Bytes::from("busy")).unwrap_err();
        assert_eq!(e.outcome(), "failed");
        assert!(e.to_string().contains("busy"), "{e}");
        let e = answer(url, StatusCode::OK, Bytes::from("nope")).unwrap_err();
        assert_eq!(e.outcome(), "bad_answer");
        let e = answer(
            url,
            StatusCode::OK,
            Bytes::from(r#"{"kv_transfer_params": 3}"#),
        )
        .unwrap_err();
        assert_eq!(e.outcome(), "bad_answer");
        assert_eq!(quote("x".repeat(600).as_bytes()).chars().count(), 513);
    }

    #[test]
    fn a_scored_prefill_answer_gives_the_prompt_logprobs() {
        let sent = prefill_body(None, &[5, 6, 7], None, Some(1));
        assert_eq!(sent["prompt_logprobs"], 1);
        let body = json!({"choices": [{"prompt_logprobs": [
            null,
            {"6": {"logprob": -2.0, "rank": 3}, "9": {"logprob": -0.5, "rank": 1}},
            {"7": {"logprob": -0.1, "rank": 1}}
        ]}]});
        let got = answer("u", StatusCode::OK, Bytes::from(body.to_string()), &sent)
            .unwrap()
            .prompt_logprobs
            .unwrap();
        assert_eq!(got[0], None);
        let second = got[1].as_ref().unwrap();
        assert_eq!((second.logprob, second.rank), (-2.0, 3));
        assert_eq!(second.top, vec![(9, -0.5)]);
        assert_eq!(got[2].as_ref().unwrap().top, vec![(7, -0.1)]);
        let e = answer("u", StatusCode::OK, Bytes::from("{}"), &sent).unwrap_err();
        assert_eq!(e.outcome(), "bad_answer");
    }
}
