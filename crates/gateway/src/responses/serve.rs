//! `POST /v1/responses`: which workers serve a turn, and with which body.

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use bytes::Bytes;
use http::HeaderMap;
use pdserve_protocol::{ApiError, WorkerRole};
use serde_json::{json, Map, Value};

use super::edits::ResponseEdits;
use super::request::{encode, prefill_body, ResponsesBody};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::{Mode, Roster, Worker};
use crate::handoff::bootstrap::{serve_body, SglangRoute};
use crate::handoff::sequential::{context_limit, TurnPrefill};
use crate::handoff::{conditional, RequestContext, X_PDSERVE_PREFILL};
use crate::ingress::request::{body_rejection, ClientRequest};
use crate::legs::answer::{expose_worker, forward, FinalLeg};
use crate::legs::prefill::ReleaseOnDrop;
use crate::policy::RouteRequest;
use crate::serving::Serving;
use crate::sessions::response_chains::ChainRecord;

/// Handles `POST /v1/responses`.
pub async fn create(
    State(state): State<Arc<Serving>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let endpoint = Endpoint::Responses;
    let mut ctx = RequestContext::new(endpoint, endpoint.path(), headers);
    if state.settings.expose_routing {
        ctx.routing_notes = Some(Default::default());
    }
    let result = async {
        let body = body.map_err(|r| body_rejection(r, state.settings.max_body_bytes))?;
        let request = ResponsesBody::parse(&body)?;
        let previous = match &request.previous_response_id {
            None => None,
            Some(id) => Some(find_previous(&state, &ctx, id).await?),
        };
        let before = previous
            .as_ref()
            .and_then(|p| p.record.conversation.as_ref())
            .map(|c| c.items())
            .unwrap_or_default();
        let chat = request.as_chat(&before)?;
        let permit = match crate::handoff::intake::admit_and_count(&state, &mut ctx, &chat).await {
            Ok(permit) => permit,
            Err(refused) => return Ok(refused),
        };
        let turn = Turn {
            request: &request,
            previous: previous.as_ref(),
            before: &before,
            chat: &chat,
        };
        let response = serve(&state, &ctx, turn).await?;
        Ok(crate::ingress::admission::hold_until_sent(response, permit))
    }
    .await;
    crate::handoff::intake::answer(&state, &ctx, result)
}

/// The stored response a request continues.
struct Previous {
    id: String,
    record: ChainRecord,
}

/// The previous response as this gateway remembers it, or as found on the workers (a
/// chain another gateway relayed: its conversation is unknown here).
async fn find_previous(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    id: &str,
) -> Result<Previous, Failure> {
    if let Some(record) = state.responses.get(id) {
        return Ok(Previous {
            id: id.to_string(),
            record,
        });
    }
    match super::stored::locate(state, &ctx.headers, id).await {
        Some(worker) => Ok(Previous {
            id: id.to_string(),
            record: ChainRecord {
                owner: worker.base.clone(),
                root: id.to_string(),
                previous: None,
                conversation: None,
            },
        }),
        None => Err(
            ApiError::not_found(format!("Previous response with id '{id}' not found."))
                .with_param("previous_response_id")
                .into(),
        ),
    }
}

/// One turn: the request, what it continues, and how it routes.
#[derive(Clone, Copy)]
struct Turn<'a> {
    request: &'a ResponsesBody,
    previous: Option<&'a Previous>,
    /// The conversation before this turn, as input items (empty when unknown).
    before: &'a [Value],
    /// The turn as the chat request the workers render it as.
    chat: &'a ClientRequest,
}

impl Turn<'_> {
    /// Whether the gateway knows the whole conversation.
    fn history_known(&self) -> bool {
        self.previous
            .is_none_or(|p| p.record.conversation.is_some())
    }

    /// The live worker of `role` that stores the previous response.
    fn owner(&self, roster: &Roster, role: WorkerRole) -> Option<Arc<Worker>> {
        let owner = &self.previous?.record.owner;
        roster.live(role).iter().find(|w| w.base == *owner).cloned()
    }

    /// The edits of the answer; `cached_tokens` from the prefill leg.
    fn edits(&self, state: &Serving, cached_tokens: Option<u64>) -> Arc<ResponseEdits> {
        Arc::new(ResponseEdits {
            chains: state.responses.clone(),
            conversations: state.conversations.clone(),
            previous: self.request.previous_response_id.clone(),
            root: self.previous.map(|p| p.record.root.clone()),
            before: self.previous.and_then(|p| p.record.conversation.clone()),
            history_known: self.history_known(),
            input: self.request.input.clone(),
            store: self.request.store,
            cached_tokens,
        })
    }
}

/// Serves a turn in the mode the pools allow.
async fn serve(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    turn: Turn<'_>,
) -> Result<Response, Failure> {
    let roster = state.registry.snapshot();
    let root = turn.previous.map(|p| p.record.root.as_str());
    let mode = roster.routing_mode();
    let role = match mode {
        Mode::Aggregated => WorkerRole::PrefillDecode,
        Mode::Disaggregated => WorkerRole::Decode,
        Mode::Unavailable => {
            return Err(state
                .registry
                .refuse_unservable("no worker can serve this request")
                .into())
        }
    };
    let owner = turn.owner(&roster, role);
    // The turn goes back to the worker that stores the conversation, and its session key
    // is the chain's first response (the `conversation_id` of a chat client).
    let route = RouteRequest {
        prefer: owner.as_ref().map(|w| w.base.as_str()),
        ..ctx.route_for(turn.chat, root)
    };
    let stream = turn.request.stream;
    // A decode worker's turn at prefilling alone, held until its answer starts.
    let mut local_prefill = None;
    let alone = if mode == Mode::Aggregated {
        // The owner continues from its own store (and prefix cache); any other worker is
        // sent the conversation, unless only the owner knows it (then it is that worker's
        // 404 to give).
        let known_elsewhere = owner.is_none() && turn.history_known();
        Some((
            "aggregated",
            turn.request.body_for(known_elsewhere, turn.before),
        ))
    } else if !turn.history_known() {
        // Only the decode worker that stores the conversation has it: it computes the
        // turn alone.
        Some(("prefill_skipped", turn.request.original()))
    } else {
        // The decode worker is sent the conversation as the prefill worker is, so that
        // both compute the same prompt whichever decode worker a retry lands on.
        local_prefill = conditional::skips_prefill(state, &roster, &route);
        local_prefill
            .is_some()
            .then(|| ("prefill_skipped", turn.request.expanded(turn.before)))
    };
    if let Some((outcome, body)) = alone {
        state.metrics.record_disaggregation(outcome);
        let edits = turn.edits(state, None);
        let answer = single(state, ctx, &route, role, body, stream, edits).await;
        drop(local_prefill);
        return answer;
    }
    let body = turn.request.expanded(turn.before);
    state.metrics.record_disaggregation("disaggregated");
    if state.settings.protocol == crate::serving::Protocol::Sglang {
        let edits = turn.edits(state, None);
        return serve_body(
            state,
            ctx,
            SglangRoute::Responses,
            body,
            Vec::new(),
            &route,
            Some(edits),
        )
        .await;
    }
    sequential(state, ctx, &route, turn, body).await
}

/// The turn on one worker of `role`.
async fn single(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    role: WorkerRole,
    body: Map<String, Value>,
    stream: bool,
    edits: Arc<ResponseEdits>,
) -> Result<Response, Failure> {
    forward(state, ctx, route, final_leg(role, &body, stream, edits)).await
}

/// The leg that answers the client with `body`, its response objects edited.
fn final_leg(
    role: WorkerRole,
    body: &Map<String, Value>,
    stream: bool,
    edits: Arc<ResponseEdits>,
) -> FinalLeg {
    FinalLeg {
        role,
        body: encode(body),
        stream,
        conversation_id: None,
        dp_rank: None,
        reencode_on_500: false,
        first_token: None,
        responses: Some(edits),
    }
}

/// vLLM's sequential handoff of a turn: the prefill leg (reading the previous decode's
/// blocks, when that handle is still kept), then the decode leg with P's handle.
async fn sequential(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    turn: Turn<'_>,
    body: Map<String, Value>,
) -> Result<Response, Failure> {
    // A request that cannot fit the model's context is refused before the prefill leg,
    // which asks for one token and would pass, pinning blocks decode then never reads.
    if let Some(max_model_len) = context_limit(state) {
        let known = ctx.prompt_tokens.as_ref().map(|t| t.len() as u64);
        crate::clients::model_len::check(&mut turn.chat.clone(), max_model_len, known)?;
    }
    let (answer, prefill_worker) =
        TurnPrefill::for_conversation(state, turn.previous.map(|p| p.id.as_str()))
            .send(state, ctx, route, |params| prefill_body(&body, params))
            .await?;
    // Until decode has answered, P's blocks are released if decode fails or the client
    // leaves.
    let release = ReleaseOnDrop::new(state, &prefill_worker, answer.kv.clone(), &ctx.headers);
    let mut decode = body;
    match &answer.kv {
        Some(kv) => {
            decode.insert("kv_transfer_params".into(), json!(kv));
        }
        None => tracing::warn!(
            request_id = ctx.headers.request_id(),
            "prefill answered without kv_transfer_params; the decode worker will recompute the prompt"
        ),
    }
    let edits = turn.edits(state, answer.cached_tokens);
    let leg = final_leg(WorkerRole::Decode, &decode, turn.request.stream, edits);
    let mut response = forward(state, ctx, route, leg).await?;
    // Decode answered: it has read the blocks.
    release.disarm();
    expose_worker(&mut response, ctx, X_PDSERVE_PREFILL, &prefill_worker);
    Ok(response)
}
