//! What both legs of a bootstrap attempt share: the request to a worker, and how a
//! leg's failure is told to the retry loop.

use bytes::Bytes;
use pdserve_protocol::ApiError;
use reqwest::Url;

use crate::clients::worker_client::{Exchange, LegError, LegFault, LegRequest};
use crate::endpoint::Endpoint;
use crate::fleet::registry::Worker;
use crate::handoff::sglang_route::{SglangRoute, GENERATE_ROUTE};
use crate::legs::RequestContext;
use crate::serving::Serving;

/// The failure of a decode leg whose request could not be built.
pub(super) fn decode_exchange_error(state: &Serving, decode: &Worker, why: String) -> LegError {
    Exchange::new(decode, "decode worker", state.settings.decode_timeout)
        .error(LegFault::Failed, why)
}

/// A failure no other pair can fix (nothing is retried after it).
pub(super) fn final_error(error: ApiError) -> LegError {
    LegError {
        failure: error.into(),
        kind: LegFault::Rejected,
        status: None,
        escalated: false,
    }
}

/// A failure whose worker was already reported to passive health: the retry loop, which
/// reports the prefill worker's failures, must neither count it again nor blame P for D.
pub(super) fn reported(mut e: LegError) -> LegError {
    if matches!(e.kind, LegFault::Unreachable | LegFault::Broken) {
        e.kind = LegFault::Failed;
    }
    e
}

/// The request for one leg of `route` to `worker`.
pub(super) fn leg_request(
    state: &Serving,
    ctx: &RequestContext,
    route: SglangRoute,
    worker: &Worker,
    body: Bytes,
    span: Option<&pdserve_telemetry::ChildSpan>,
) -> Result<LegRequest, String> {
    let rank = worker.next_dp_rank();
    let generate_url;
    let url = match route {
        SglangRoute::Chat => worker.url(Endpoint::Chat),
        SglangRoute::Completions => worker.url(Endpoint::Completions),
        SglangRoute::Responses => worker.url(Endpoint::Responses),
        SglangRoute::Generate => {
            generate_url = Url::parse(&format!("{}{GENERATE_ROUTE}", worker.base))
                .map_err(|e| format!("has no /generate URL: {e}"))?;
            &generate_url
        }
    };
    let headers = crate::observe::trace::leg_headers(&ctx.headers, span);
    Ok(state.client.leg_request(url, body, &headers, rank))
}
