//! The prefill leg every mode sends: one request to a prefill worker, answered whole
//! within `--prefill-timeout-secs`, its answer checked by the mode, and its outcome
//! counted for the worker's breaker and the policy that chose it; vLLM's prefill leg on
//! it (body, answer, retries) and the release of a handle no decode will read.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use pdserve_protocol::{KvTransferParams, WorkerRole};
use serde_json::value::RawValue;
use tokio::sync::oneshot;

use super::retry::{with_retries, Leg};
use super::RequestContext;
use crate::clients::worker_client::{Exchange, ForwardHeaders, LegError, LegFault, LegRequest};
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::ingress::request::ClientRequest;
use crate::policy::{RequestOutcome, RouteRequest};
use crate::serving::Serving;

/// Sends `request` to the prefill `worker` and reads the whole answer; `check` turns a
/// 2xx body into what the mode needs, or says why the worker's KV cannot be trusted
/// (a 502). `head` hears when the answer's head came; `watch` sees each chunk of the
/// body as it arrives. The leg's duration is recorded once the body is read.
pub(crate) async fn send_prefill<T>(
    state: &Serving,
    worker: &Arc<Worker>,
    request: Result<LegRequest, String>,
    head: Option<oneshot::Sender<()>>,
    watch: Option<&mut (dyn FnMut(&Bytes) + Send)>,
    check: impl FnOnce(&Bytes) -> Result<T, String>,
) -> Result<T, LegError> {
    let mut in_flight = state.start_request(worker.clone());
    let exchange = Exchange::new(worker, "prefill worker", state.settings.prefill_timeout);
    let sent = Instant::now();
    let result = async {
        let request = request.map_err(|why| exchange.error(LegFault::Failed, why))?;
        let response = exchange.send_leg(&state.client.direct, request).await?;
        if let Some(head) = head {
            let _ = head.send(());
        }
        let body = match watch {
            Some(watch) => exchange.read_leg_watching(response, watch).await?,
            None => exchange.read_leg(response).await?,
        };
        state.metrics.observe_prefill(sent.elapsed());
        check(&body).map_err(|why| exchange.error(LegFault::Failed, why))
    }
    .await;
    in_flight.set_outcome(match &result {
        Ok(_) => RequestOutcome::Success,
        Err(e) if e.is_worker_fault() => RequestOutcome::Failure,
        Err(_) => RequestOutcome::Other,
    });
    result
}

/// Releases the prefill worker's KV handle when dropped armed (decode failed, or the
/// client went away before decode answered).
pub(crate) struct ReleaseOnDrop {
    state: Arc<Serving>,
    worker: Arc<Worker>,
    params: Option<KvTransferParams>,
    headers: ForwardHeaders,
}

impl ReleaseOnDrop {
    /// Armed for `params`, the handle `worker` answered its prefill leg with.
    pub(crate) fn new(
        state: &Arc<Serving>,
        worker: &Arc<Worker>,
        params: Option<KvTransferParams>,
        headers: &ForwardHeaders,
    ) -> Self {
        Self {
            state: state.clone(),
            worker: worker.clone(),
            params,
            headers: headers.clone(),
        }
    }

    /// Decode answered (it read the blocks): nothing to release.
    pub(crate) fn disarm(mut self) {
        self.params = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(params) = self.params.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(release(
            self.state.clone(),
            self.worker.clone(),
            params,
            self.headers.clone(),
        ));
    }
}

pub use pdserve_protocol::kv::KV_SECRET_HEADER;

/// `POST /v1/kv/release {"kv_transfer_params": ...}` to the prefill worker, once: a
/// vLLM worker answers 404 and keeps the blocks until its abort timeout.
async fn release(
    state: Arc<Serving>,
    worker: Arc<Worker>,
    params: KvTransferParams,
    headers: ForwardHeaders,
) {
    // KV_RELEASE_PATH, relative to the worker's `/v1/` so that a path prefix in its URL
    // is kept.
    let Ok(url) = worker.models_url().join("kv/release") else {
        return;
    };
    let body = serde_json::json!({ "kv_transfer_params": params });
    let mut request = state
        .client
        .post_json(&url, Bytes::from(body.to_string()), &headers);
    if let Some(secret) = &state.settings.kv_secret {
        request = request.header(KV_SECRET_HEADER, secret.as_str());
    }
    let outcome = tokio::time::timeout(state.settings.connect_timeout * 2, request.send()).await;
    let request_id = headers.request_id();
    match outcome {
        Ok(Ok(r)) if r.status().is_success() => {
            tracing::debug!(request_id, worker = %worker.base, "released the prefill KV handle after decode failed");
        }
        Ok(Ok(r)) if r.status() == http::StatusCode::NOT_FOUND => {
            tracing::debug!(request_id, worker = %worker.base, "the prefill worker has no release route (vLLM): its blocks wait for its abort timeout");
        }
        Ok(Ok(r)) => {
            tracing::warn!(request_id, worker = %worker.base, status = r.status().as_u16(), "releasing the prefill KV handle failed");
        }
        Ok(Err(e)) => {
            tracing::warn!(request_id, worker = %worker.base, "releasing the prefill KV handle failed: {e}");
        }
        Err(_) => {
            tracing::warn!(request_id, worker = %worker.base, "releasing the prefill KV handle timed out");
        }
    }
}

/// The prefill leg's body: one token, not streamed, asking P to keep its blocks for D.
pub fn prefill_body(request: &ClientRequest, params: KvTransferParams) -> Bytes {
    let mut prefill = request.clone();
    // `n` goes as the client wrote it (a verbatim number) to the decode leg only.
    prefill
        .verbatim_numbers_mut()
        .retain(|(name, _)| name != "n");
    let (transport, generation) = prefill.params_mut();
    pdserve_protocol::shape_prefill_leg(transport, generation, params);
    prefill.to_body()
}

/// Sends the prefill leg (retried on fresh prefill workers before anything reached the
/// client) and returns the `kv_transfer_params` P answered with, and P.
pub(crate) async fn prefill(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    body: Bytes,
) -> Result<(PrefillAnswer, Arc<Worker>), Failure> {
    with_retries(
        state,
        ctx,
        route,
        WorkerRole::Prefill,
        Leg::Prefill,
        |worker| {
            let body = body.clone();
            async move { prefill_once(state, ctx, &worker, body, worker.next_dp_rank()).await }
        },
    )
    .await
}

/// Sends the prefill leg once, to `worker` naming `rank` (the consumer the encoders
/// published to), and returns the `kv_transfer_params` it answered with; the caller
/// decides about retries.
pub async fn prefill_pinned(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    worker: &Arc<Worker>,
    body: Bytes,
    rank: Option<u32>,
) -> Result<Option<KvTransferParams>, LegError> {
    prefill_once(state, ctx, worker, body, rank)
        .await
        .map(|answer| answer.kv)
        .inspect_err(|e| state.report(worker, e))
}

/// What the gateway takes from a prefill worker's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillAnswer {
    /// The handle the decode leg reads the blocks with.
    pub kv: Option<KvTransferParams>,
    /// `usage.prompt_tokens_details.cached_tokens`: P's prefix-cache hits.
    pub cached_tokens: Option<u64>,
    /// The whole answer (its prompt logprobs are merged into D's when asked for).
    pub body: Bytes,
}

async fn prefill_once(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    worker: &Arc<Worker>,
    body: Bytes,
    rank: Option<u32>,
) -> Result<PrefillAnswer, LegError> {
    let url = worker.url(ctx.endpoint);
    let span = crate::observe::trace::leg(ctx.trace.as_ref(), "prefill", worker, url.as_str());
    let headers = crate::observe::trace::leg_headers(&ctx.headers, span.as_ref());
    let request = state.client.leg_request(url, body, &headers, rank);
    let sent = Instant::now();
    let result = send_prefill(state, worker, Ok(request), None, None, |body| {
        parse_prefill_answer(body).map(|answer| PrefillAnswer {
            body: body.clone(),
            ..answer
        })
    })
    .await;
    match &result {
        Ok(_) => ctx.journey.prefill_took(worker, sent.elapsed()),
        Err(e) => state.forget_unsent(worker, ctx.prompt_tokens.as_deref(), e),
    }
    crate::observe::trace::leg_done(span, &result);
    result
}

/// The two fields the gateway reads from a prefill answer, as their source text;
/// everything else (the choices, the one generated token) is skipped without being built.
#[derive(serde::Deserialize)]
struct PrefillFields<'a> {
    #[serde(default, borrow)]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
}

/// `usage.prompt_tokens_details.cached_tokens` (`input_tokens_details` in a Responses
/// answer), read leniently: any other shape is no count.
#[derive(serde::Deserialize)]
struct Usage<'a> {
    #[serde(default, borrow, alias = "input_tokens_details")]
    prompt_tokens_details: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct PromptTokensDetails<'a> {
    #[serde(default, borrow)]
    cached_tokens: Option<&'a RawValue>,
}

/// The `kv_transfer_params` and cached-token count of a prefill worker's 200 answer.
fn parse_prefill_answer(body: &[u8]) -> Result<PrefillAnswer, String> {
    let fields: PrefillFields = serde_json::from_slice(body)
        .map_err(|e| format!("answered 200 with a body that is not JSON: {e}"))?;
    // A struct also deserializes from an array: only an object is an answer.
    if !body.trim_ascii_start().starts_with(b"{") {
        return Err("answered 200 with a body that is not a JSON object".into());
    }
    let cached_tokens = fields
        .usage
        .and_then(|u| serde_json::from_str::<Usage>(u.get()).ok())
        .and_then(|u| u.prompt_tokens_details)
        .and_then(|d| serde_json::from_str::<PromptTokensDetails>(d.get()).ok())
        .and_then(|d| d.cached_tokens)
        .and_then(|n| serde_json::from_str::<u64>(n.get()).ok());
    let kv = match fields.kv_transfer_params {
        None => None,
        Some(raw) if raw.get() == "null" => None,
        Some(raw) => Some(
            serde_json::from_str(raw.get())
                .map_err(|e| format!("answered malformed kv_transfer_params: {e}"))?,
        ),
    };
    Ok(PrefillAnswer {
        kv,
        cached_tokens,
        body: Bytes::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use serde_json::json;
    use serde_json::Value;

    #[test]
    fn prefill_answers_give_the_handle_and_cached_tokens_only() {
        let answer = parse_prefill_answer(
            br#"{"id":"x","choices":[{"index":0,"text":"a","logprobs":null}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}},"kv_transfer_params":{"do_remote_prefill":true,"remote_port":7}}"#,
        )
        .unwrap();
        assert_eq!(answer.cached_tokens, Some(4));
        assert_eq!(answer.kv.unwrap().remote_port, Some(7));
        let bare = parse_prefill_answer(
            br#" {"usage":{"prompt_tokens_details":{"cached_tokens":"4"}},"kv_transfer_params":null}"#,
        )
        .unwrap();
        assert_eq!(
            bare,
            PrefillAnswer {
                kv: None,
                cached_tokens: None,
                body: Bytes::new(),
            }
        );
        for bad in [&b"[1,2]"[..], b"not json", b"{\"kv_transfer_params\":[1]}"] {
            assert!(parse_prefill_answer(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn prefill_body_has_vllm_shape() {
        let (req, _) = ClientRequest::parse(
            Endpoint::Chat,
            json!({
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": 50,
                "max_completion_tokens": 60,
                "min_tokens": 5,
                "temperature": 0.5,
                "n": 2,
                "vendor_field": [1]
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        let body: Value =
            serde_json::from_slice(&prefill_body(&req, KvTransferParams::prefill_request()))
                .unwrap();
        assert_eq!(body["stream"], false);
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["vendor_field"], json!([1]));
        for dropped in ["max_completion_tokens", "min_tokens", "stream_options", "n"] {
            assert!(body.get(dropped).is_none(), "{dropped} must be dropped");
        }
        assert_eq!(
            body["kv_transfer_params"],
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null
            })
        );
    }
}
