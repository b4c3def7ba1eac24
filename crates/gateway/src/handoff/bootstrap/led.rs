//! An attempt whose answer P's streamed first token leads (`--first-token-from-prefill`):
//! the token is sent before D's head, and D's stream, its repeat of the token taken
//! out, follows in the same body with P's outcome attached.

use std::pin::Pin;
use std::sync::Arc;

use axum::response::Response;
use futures::{FutureExt, StreamExt};
use pdserve_protocol::ApiError;

use super::attached::Attached;
use super::prefill_leg::PrefillLeg;
use crate::clients::worker_client::LegError;
use crate::fleet::registry::Worker;
use crate::legs::answer::{expose_worker, relay, stream_response, AnswerStart};
use crate::legs::first_token::{self, FirstToken};
use crate::legs::first_token_guard::FirstTokenGuard;
use crate::legs::sse::StreamDialect;
use crate::legs::{RequestContext, X_PDSERVE_PREFILL};
use crate::policy::{InFlight, RequestOutcome};
use crate::serving::Serving;

/// D's answer start, owned (see [`Led`]).
pub(super) type DecodeStart =
    Pin<Box<dyn std::future::Future<Output = Result<AnswerStart, LegError>> + Send>>;

/// An attempt whose answer P's streamed first token leads: sent before D's head, D's
/// stream (its repeat of the token taken out) and P's outcome following in the body.
pub(super) struct Led {
    pub(super) sent: Arc<FirstToken>,
    pub(super) decode: Arc<Worker>,
    pub(super) prefill: Arc<Worker>,
    pub(super) decode_start: DecodeStart,
    pub(super) p_leg: PrefillLeg,
    pub(super) d_in_flight: InFlight,
    pub(super) d_span: Option<pdserve_telemetry::ChildSpan>,
}

impl Led {
    /// The answer, sent now. Nothing is retried once it left: a failure of either leg
    /// ends the stream with an error event.
    pub(super) fn into_response(self, state: &Arc<Serving>, ctx: &RequestContext) -> Response {
        state.metrics.inc_first_token_from_prefill();
        let Self {
            sent,
            decode,
            prefill,
            mut decode_start,
            mut p_leg,
            mut d_in_flight,
            d_span,
        } = self;
        let rest_state = state.clone();
        let rest_ctx = ctx.clone();
        let guard = sent.clone();
        let rest = async move {
            let (state, ctx) = (rest_state, rest_ctx);
            let started = loop {
                tokio::select! {
                    biased;
                    started = &mut decode_start => break started,
                    failure = p_leg.failure(), if p_leg.is_pending() => {
                        if let Some(e) = failure {
                            return Err(e.failure);
                        }
                    }
                }
            };
            let head = match started {
                Ok(AnswerStart::Stream(head)) => head,
                Ok(AnswerStart::Body(_)) => {
                    return Err(ApiError::bad_gateway(format!(
                        "decode worker {} answered a stream request with a JSON body",
                        decode.base
                    ))
                    .into())
                }
                Err(e) => {
                    if let Some(Some(p_error)) = p_leg.failure().now_or_never() {
                        return Err(p_error.failure);
                    }
                    if e.is_worker_fault() {
                        d_in_flight.set_outcome(RequestOutcome::Failure);
                    }
                    state.report(&decode, &e);
                    // P computed the prompt (its first token led): only D's send is
                    // undone.
                    state.forget_unsent(&decode, ctx.prompt_tokens.as_deref(), &e);
                    return Err(e.failure);
                }
            };
            state.registry.record_answer(&decode);
            let (content_type, mut relay) =
                relay(&state, &ctx, &decode, d_in_flight, head, None, d_span);
            relay.first_token = Some(FirstTokenGuard::new(guard));
            let attached = Attached {
                dialect: StreamDialect::Chat,
                relay: Some(relay.into_stream().boxed()),
                prefill: p_leg.is_pending().then_some(p_leg),
                merge: None,
                held: None,
                at_boundary: true,
                metrics: state.metrics.clone(),
            };
            ctx.journey.served_by(&decode, None, None);
            Ok(stream_response(content_type, attached.into_stream()))
        };
        let mut response =
            first_token::led_from_prefill(&sent, rest, state.metrics.clone(), ctx.journey.clone());
        expose_worker(&mut response, ctx, X_PDSERVE_PREFILL, &prefill);
        response
    }
}
