//! Shedding on prediction: a sheddable request (its priority above `--shed-priority`,
//! later in vLLM's order) is refused with 429 and `Retry-After` when no route open to it
//! is predicted to meet its objectives, so the capacity goes to requests that can still
//! be served in time. Requests at or below `--shed-priority` are never shed on a
//! prediction; without objectives or predictions nothing is shed.

use axum::response::{IntoResponse, Response};
use http::HeaderValue;
use pdserve_protocol::ApiError;

use crate::fleet::registry::Mode;
use crate::ingress::request::ClientRequest;
use crate::legs::RequestContext;
use crate::serving::outlook::Outlook;
use crate::serving::Serving;

/// The longest `Retry-After` a shed request is told, in seconds.
const MAX_RETRY_AFTER_SECS: u64 = 60;

/// The 429 for `request` when it is sheddable and no open route is predicted to meet its
/// objectives; `None` when it goes on.
pub fn refusal(state: &Serving, ctx: &RequestContext, request: &ClientRequest) -> Option<Response> {
    if ctx.priority <= state.settings.shed_priority
        || (ctx.slo.ttft.is_none() && ctx.slo.tpot.is_none())
    {
        return None;
    }
    let roster = state.registry.snapshot();
    let disaggregates = match roster.routing_mode() {
        Mode::Disaggregated => true,
        Mode::Aggregated => false,
        Mode::Unavailable => return None,
    };
    let route = ctx.route_for(request, None);
    let outlook = Outlook::of(state, &roster, &route);
    let routes = outlook.open_routes(disaggregates, state.settings.disagg_threshold.is_some());
    if routes.is_empty() || routes.iter().any(|r| r.meets(ctx.slo)) {
        return None;
    }
    let best = routes
        .iter()
        .copied()
        .min_by(|a, b| a.ttft_ms.total_cmp(&b.ttft_ms))?;
    state.admission.record_shed();
    let mut missed = Vec::new();
    if let Some(ttft) = ctx.slo.ttft {
        missed.push(format!(
            "first token within {} ms: best predicted {:.0} ms",
            ttft.as_millis(),
            best.ttft_ms
        ));
    }
    if let (Some(tpot), Some(predicted)) = (ctx.slo.tpot, best.tpot_ms) {
        missed.push(format!(
            "{} ms per token: {:.0} ms",
            tpot.as_millis(),
            predicted
        ));
    }
    let message = format!(
        "no worker is predicted to meet this request's objectives ({}); it is sheddable \
         (priority {} is above --shed-priority {}); retry later or raise its priority",
        missed.join("; "),
        ctx.priority,
        state.settings.shed_priority
    );
    let mut response = ApiError::too_many_requests(message).into_response();
    let retry_after = best
        .ttft_excess(ctx.slo)
        .as_secs_f64()
        .ceil()
        .clamp(1.0, MAX_RETRY_AFTER_SECS as f64) as u64;
    response
        .headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(retry_after));
    Some(response)
}
