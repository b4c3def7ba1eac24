//! What every generation route (chat, completions, Responses, SGLang's `/generate`) does
//! around its mode: admission and the prompt's token ids before routing, and one tail
//! that logs and counts the answer.

use axum::response::{IntoResponse, Response};

use crate::error::Failure;
use crate::ingress::request::ClientRequest;
use crate::legs::RequestContext;
use crate::serving::Serving;

/// What every generation route does before routing: its latency objectives (a malformed
/// `x-slo-*` header is a 400), admission (past `--max-concurrent-requests` the request
/// waits, earliest deadline first within its priority, or is refused with the returned
/// answer), the prompt's token ids where routing or the length check reads them, then
/// shedding (a sheddable request no route is predicted to serve in time is a 429).
pub async fn admit_and_count(
    state: &Serving,
    ctx: &mut RequestContext,
    request: &ClientRequest,
) -> Result<crate::ingress::admission::Permit, Response> {
    crate::observe::trace::describe(ctx.trace.as_ref(), request);
    ctx.slo = crate::ingress::slo::Slo::from_headers(&ctx.client_headers, state.settings.slo)
        .map_err(IntoResponse::into_response)?;
    ctx.journey.learn_into(state.predictor.clone());
    ctx.journey.aim_at(ctx.slo);
    let field = request.verbatim_number("priority");
    ctx.priority = crate::ingress::admission::priority(field, &ctx.client_headers)
        .map_err(IntoResponse::into_response)?;
    let permit =
        crate::ingress::admission::admit(&state.admission, ctx.priority, ctx.slo.ttft).await?;
    if let Some(ids) = crate::ingress::prompt_tokens::client_token_ids(request) {
        ctx.prompt_tokens = Some(std::sync::Arc::from(ids));
    } else if let Some(tokenizer) = &state.tokenizer {
        if state.routing_reads_tokens
            || crate::ingress::prompt_tokens::may_overflow(request, state.model_lens.smallest())
        {
            ctx.prompt_tokens = crate::ingress::prompt_tokens::tokenize(tokenizer, request).await;
        }
    }
    if let Some(refusal) = super::shed::refusal(state, ctx, request) {
        return Err(refusal);
    }
    Ok(permit)
}

/// The client's answer to a generation request, with its failure logged and both
/// counted: every generation route ends here.
pub fn answer(
    state: &Serving,
    ctx: &RequestContext,
    result: Result<Response, Failure>,
) -> Response {
    let response = match result {
        Ok(response) => response,
        Err(failure) => {
            tracing::info!(
                request_id = ctx.headers.request_id(),
                status = failure.status().as_u16(),
                "request failed: {failure:?}"
            );
            state
                .metrics
                .observe_end_to_end(ctx.route, ctx.started.elapsed());
            failure.into_response()
        }
    };
    let status = response.status().as_u16();
    state.metrics.record_request(ctx.route, status);
    // A stream's relay files it when the stream ends; a body is complete here.
    if !ctx.journey.relayed() {
        let finished = crate::observe::request_record::Finished {
            status,
            outcome: if status < 400 { "ok" } else { "error" },
            stream: false,
            ttft: None,
            itl: None,
            duration: ctx.started.elapsed(),
        };
        ctx.journey.file(state.metrics.history(), finished);
    }
    response
}
