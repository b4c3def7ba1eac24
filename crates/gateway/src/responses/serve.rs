//! `POST /v1/responses`: which workers serve a turn, and with which body.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use bytes::Bytes;
use http::HeaderMap;
use pdserve_history::{ListQuery, Order};
use pdserve_protocol::{ApiError, KvTransferParams, WorkerRole};
use serde_json::{json, Map, Value};

use super::edits::{stored_handle, ResponseEdits};
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
use crate::sessions::history_items::{chain_items, shape_item, store_error};

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
        let previous = find_previous(&state, &ctx, &request).await?;
        let before = previous
            .as_ref()
            .and_then(|p| p.before.clone())
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

/// What a turn continues: a stored response's chain, or a conversation.
struct Previous {
    /// The session key the turn routes by: the chain's first response, or the
    /// conversation.
    root: String,
    /// The worker that answered the last turn, and so holds its prefix (and, for a chain
    /// only a worker holds, the chain itself).
    owner: Option<String>,
    /// The decode side's KV handle the last turn kept, while fresh.
    kv: Option<KvTransferParams>,
    /// Every item before this turn; `None` for a chain only its worker holds (another
    /// gateway relayed it without a shared history store).
    before: Option<Vec<Value>>,
}

/// What `request` continues, from the history store (or, for a response the store does
/// not hold, from the worker that does). A store that cannot answer is a 503: a turn is
/// never served without its history.
async fn find_previous(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    request: &ResponsesBody,
) -> Result<Option<Previous>, Failure> {
    if let Some(conversation) = &request.conversation {
        return conversation_turns(state, conversation).await.map(Some);
    }
    let Some(id) = &request.previous_response_id else {
        return Ok(None);
    };
    if state.history.enabled() {
        let started = Instant::now();
        let chain = state.history.chain(id).await;
        state
            .metrics
            .observe_history("read", started.elapsed(), chain.is_ok());
        if let Some(chain) = chain.map_err(store_error)? {
            let last = chain.last().expect("a found chain has its own turn");
            let (owner, kv) = stored_handle(last, state.conversations.ttl());
            // A handle is worth reading only while its worker is still in the fleet.
            let live = owner
                .as_ref()
                .is_some_and(|o| state.registry.snapshot().get(o).is_some());
            let kv = kv.filter(|_| live);
            return Ok(Some(Previous {
                root: chain[0].id.clone(),
                owner,
                kv,
                before: Some(chain_items(&chain)),
            }));
        }
    }
    match super::stored::locate(state, &ctx.headers, id).await {
        Some(worker) => Ok(Some(Previous {
            root: id.clone(),
            owner: Some(worker.base.clone()),
            kv: None,
            before: None,
        })),
        None => Err(ApiError::new(
            http::StatusCode::NOT_FOUND,
            "previous_response_not_found",
            format!("Previous response with id '{id}' not found."),
        )
        .with_param("previous_response_id")
        .into()),
    }
}

/// Every item of conversation `id`, oldest first.
async fn conversation_turns(state: &Arc<Serving>, id: &str) -> Result<Previous, Failure> {
    let started = Instant::now();
    let mut items = Vec::new();
    let mut after = None;
    let read = loop {
        let query = ListQuery {
            after: after.take(),
            limit: 100,
            order: Order::Asc,
        };
        match state.history.list_items(id, query).await {
            Ok(Some(page)) => {
                after = page.items.last().map(|i| i.id.clone());
                let more = page.has_more;
                items.extend(page.items.into_iter().map(|i| i.body));
                if !more {
                    break Ok(true);
                }
            }
            Ok(None) => break Ok(false),
            Err(e) => break Err(e),
        }
    };
    state
        .metrics
        .observe_history("read", started.elapsed(), read.is_ok());
    if !read.map_err(store_error)? {
        return Err(
            ApiError::not_found(format!("Conversation with id '{id}' not found."))
                .with_param("conversation")
                .into(),
        );
    }
    Ok(Previous {
        root: id.to_string(),
        owner: None,
        kv: None,
        before: Some(items),
    })
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
        self.previous.is_none_or(|p| p.before.is_some())
    }

    /// The live worker of `role` that answered the last turn.
    fn owner(&self, roster: &Roster, role: WorkerRole) -> Option<Arc<Worker>> {
        let owner = self.previous?.owner.as_ref()?;
        roster.live(role).iter().find(|w| w.base == *owner).cloned()
    }

    /// The edits of the answer; `cached_tokens` from the prefill leg.
    fn edits(&self, state: &Serving, cached_tokens: Option<u64>) -> Arc<ResponseEdits> {
        let input = self
            .request
            .input
            .iter()
            .enumerate()
            .map(|(i, item)| shape_item(item, &format!("input[{i}]")).unwrap_or(item.clone()))
            .collect();
        Arc::new(ResponseEdits {
            history: state.history.clone(),
            conversations: state.conversations.clone(),
            metrics: state.metrics.clone(),
            previous: self.request.previous_response_id.clone(),
            conversation: self.request.conversation.clone(),
            history_known: self.history_known(),
            input,
            store: self.request.store,
            cached_tokens,
            pending: Default::default(),
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
    let root = turn.previous.map(|p| p.root.as_str());
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
        // The gateway's history writes the conversation out for whichever worker serves
        // the turn (routed to the last turn's worker, whose prefix cache holds it); a
        // chain only a worker holds goes to that worker as the client sent it.
        Some((
            "aggregated",
            turn.request.body_for(turn.history_known(), turn.before),
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
    let (answer, prefill_worker) = TurnPrefill::for_turn(
        state,
        turn.request.previous_response_id.as_deref(),
        turn.previous.and_then(|p| p.kv.clone()),
    )
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
