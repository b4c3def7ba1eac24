//! axum routes, tower layers and graceful shutdown.

use std::future::Future;
use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use pdserve_protocol::{ApiError, WorkerRole};
use serde_json::Value;
use tokio::net::TcpListener;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;

use crate::clients::worker_client::{Exchange, ForwardHeaders, LegFault};
use crate::config::{GatewayArgs, GatewayConfig, Protocol};
use crate::endpoint::Endpoint;
use crate::error::{Failure, GatewayError};
use crate::fleet::registry;
use crate::fleet::registry::Mode;
use crate::handoff::prewarm;
use crate::handoff::sglang_route::{SglangRoute, GENERATE_ROUTE};
use crate::handoff::{self, RequestContext};
use crate::ingress::request::{body_rejection, ClientRequest};
use crate::policy::RouteRequest;
use crate::routes::{admin, profile, readiness};
use crate::serving::Serving;
use crate::state::AppState;

/// The gateway's routes and layers over `state`.
pub fn router(state: AppState) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route(GENERATE_ROUTE, post(sglang_generate))
        .route("/v1/responses", post(crate::responses::create))
        .route(
            "/v1/responses/{id}",
            get(crate::responses::retrieve).delete(crate::responses::delete),
        )
        .route(
            "/v1/conversations",
            post(crate::routes::conversations::create),
        )
        .route(
            "/v1/conversations/{id}",
            get(crate::routes::conversations::retrieve)
                .post(crate::routes::conversations::update)
                .delete(crate::routes::conversations::delete),
        )
        .route(
            "/v1/conversations/{id}/items",
            get(crate::routes::conversations::list_items)
                .post(crate::routes::conversations::add_items),
        )
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            get(crate::routes::conversations::retrieve_item)
                .delete(crate::routes::conversations::delete_item),
        )
        .route("/v1/models", get(models))
        .route("/tokenize", post(crate::routes::tokenize::tokenize))
        .route("/detokenize", post(crate::routes::tokenize::detokenize))
        .route("/health", get(readiness::readiness))
        .route("/readiness", get(readiness::readiness))
        .route("/liveness", get(readiness::liveness))
        .route(
            "/instances",
            get(admin::list)
                .post(admin::register)
                .delete(admin::unregister)
                .layer(DefaultBodyLimit::max(admin::MAX_ADMIN_BODY_BYTES)),
        )
        .route("/metrics", get(metrics))
        .route("/planner", get(crate::routes::planner::planner))
        .route("/dashboard", get(crate::routes::dashboard::page))
        .route("/dashboard/data", get(crate::routes::dashboard::data))
        .route("/start_profile", post(profile::start))
        .route("/stop_profile", post(profile::stop))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        // The request's server span, only when tracing is on (otherwise no layer at all).
        .layer(tower::util::option_layer(
            pdserve_telemetry::enabled()
                .then(|| axum::middleware::from_fn(pdserve_telemetry::http::trace_requests)),
        ))
        // --api-key on the OpenAI routes (inside the access log: 401s are logged too);
        // without a key, no layer at all.
        .layer(tower::util::option_layer(
            state.config.api_key.as_deref().map(|key| {
                axum::middleware::from_fn_with_state(
                    crate::routes::auth::ApiKey(Some(Arc::from(key))),
                    crate::routes::auth::require_api_key,
                )
            }),
        ))
        // Before anything is forwarded: a request that looped back is refused here.
        .layer(crate::ingress::hops::HopGuardLayer(Arc::new(
            crate::ingress::hops::HopGuard {
                own_id: state.instance.id().to_string(),
                own_header: state.instance.header().clone(),
                max_hops: state.config.max_hops,
                refused: state.metrics.loops.clone(),
            },
        )))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http())
        // One access-log line per request, with the id set by the layer outside it.
        .layer(crate::ingress::access::AccessLogLayer)
        // Outermost: every request (and so both legs and the response) has an id.
        .layer(SetRequestIdLayer::x_request_id(RandomRequestId))
        .with_state(state)
}

/// Random (v4) UUIDs as request ids, drawn from the thread-local generator: tower-http's
/// `MakeRequestUuid` asks the kernel for 16 bytes per request, a system call each.
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomRequestId;

impl MakeRequestId for RandomRequestId {
    fn make_request_id<B>(&mut self, _: &http::Request<B>) -> Option<RequestId> {
        let id = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
        let mut text = uuid::Uuid::encode_buffer();
        let text = id.hyphenated().encode_lower(&mut text);
        HeaderValue::from_str(text).ok().map(RequestId::new)
    }
}

/// Aborts the gateway's background tasks when the server stops.
struct BackgroundTasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Serves the gateway on `listener` until `shutdown` completes, then lets open requests
/// finish for up to `--shutdown-timeout`.
pub async fn serve(
    listener: TcpListener,
    config: GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let drain_limit = config.shutdown_timeout;
    let state = AppState::new(config)?;
    let mut tasks = Vec::new();
    // First, so a collector that cannot bind stops the gateway before anything runs.
    if let Some(endpoint) = &state.config.kv_events.bind {
        let (_, task) = crate::fleet::kv_events::collector::start(
            endpoint,
            state.kv_events.clone(),
            state.serving.registry.clone(),
        )
        .await?;
        tasks.push(task);
    }
    tasks.extend(registry::probe::spawn(
        &state.serving.registry,
        state.serving.client.pooled().clone(),
        state.config.probe,
        registry::probe::IdentityCheck {
            instance: (*state.instance).clone(),
            allow_gateways: state.config.allow_gateway_workers,
        },
    ));
    tasks.extend(crate::fleet::discovery::spawn(
        crate::fleet::discovery::Discoverer {
            registry: state.serving.registry.clone(),
            check: state.worker_check.clone(),
            metrics: state.metrics.fleet.clone(),
            interval: state.config.discovery.interval,
        },
        &state.config.discovery,
    ));
    tasks.push(state.kv_events.spawn(state.serving.registry.clone()));
    tasks.extend(crate::fleet::load::spawn(
        state.serving.registry.clone(),
        state.serving.client.pooled().clone(),
        state.config.load_scrape_interval,
        state.metrics.load.clone(),
    ));
    if state.config.prewarm {
        tasks.push(prewarm::spawn(state.serving.clone()));
    }
    tasks.extend(state.planner.clone().spawn(state.serving.clone()));
    if state.serving.history.enabled() {
        // Retention and the size bounds, enforced in the database once a minute.
        tasks.push(tokio::spawn(
            state
                .serving
                .history
                .clone()
                .sweep_every(std::time::Duration::from_secs(60)),
        ));
    }
    let _tasks = BackgroundTasks(tasks);
    // The static workers' context lengths, fetched now rather than on the first request.
    for member in state.serving.registry.snapshot().members() {
        state
            .serving
            .model_lens
            .get(&state.serving.client, &member.worker);
    }
    let options = state.config.serve;
    let state_for_check = state.clone();
    let app = router(state);
    let draining = Arc::new(tokio::sync::Notify::new());
    // Header and body read timeouts, the connection cap and TCP_NODELAY (stream chunks
    // are small writes) come from the shared accept loop.
    let server = pdserve_http_server::serve(listener, app, options, {
        let draining = draining.clone();
        async move {
            shutdown.await;
            draining.notify_one();
        }
    });
    tokio::pin!(server);
    // A static worker URL that is this gateway (or another one, unless allowed) would
    // make every request loop: refuse to run. Asked while serving, since this gateway
    // answers its own question.
    let static_urls: Vec<_> = state_for_check
        .config
        .static_workers()
        .map(|spec| spec.url)
        .collect();
    tokio::select! {
        () = &mut server => return Ok(()),
        refused = state_for_check.worker_check.first_refused(static_urls.into_iter()) => {
            if let Some(refusal) = refused {
                state_for_check.metrics.fleet.inc_workers_refused("static", refusal.reason());
                return Err(GatewayError::Config(format!("a static worker flag is refused: {refusal}")));
            }
        }
    }
    drop(state_for_check);
    tokio::select! {
        () = &mut server => {},
        () = async {
            draining.notified().await;
            tokio::time::sleep(drain_limit).await;
        } => {
            tracing::warn!("open requests did not finish within --shutdown-timeout ({drain_limit:?}); exiting anyway");
        }
    }
    Ok(())
}

async fn chat_completions(
    State(state): State<Arc<Serving>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<Serving>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, Endpoint::Completions, headers, body).await
}

async fn generate(
    state: Arc<Serving>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut ctx = RequestContext::new(endpoint, endpoint.path(), headers);
    if state.settings.expose_routing {
        ctx.routing_notes = Some(Default::default());
    }
    let result = async {
        let body = body.map_err(|r| body_rejection(r, state.settings.max_body_bytes))?;
        let (request, conversation_id) = ClientRequest::parse(endpoint, &body)?;
        let permit = match crate::handoff::intake::admit_and_count(&state, &mut ctx, &request).await
        {
            Ok(permit) => permit,
            Err(refused) => return Ok(refused),
        };
        let response = handoff::generate(&state, &ctx, request, conversation_id).await?;
        Ok(crate::ingress::admission::hold_until_sent(response, permit))
    }
    .await;
    crate::handoff::intake::answer(&state, &ctx, result)
}

/// `POST /generate` (SGLang's native API), served with `--protocol sglang` over P/D
/// pools with SGLang's bootstrap handoff.
async fn sglang_generate(
    State(state): State<Arc<Serving>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut ctx = RequestContext::new(Endpoint::Completions, GENERATE_ROUTE, headers);
    if state.settings.expose_routing {
        ctx.routing_notes = Some(Default::default());
    }
    let result = async {
        if state.settings.protocol != Protocol::Sglang {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "/generate is SGLang's native route; the gateway serves it with --protocol sglang",
            )
            .into());
        }
        let body = body.map_err(|r| body_rejection(r, state.settings.max_body_bytes))?;
        let mut body = match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(map)) => map,
            _ => return Err(ApiError::bad_request("the body must be a JSON object").into()),
        };
        // Only the gateway writes KV handles (the bootstrap fields are overwritten).
        body.remove("kv_transfer_params");
        let field = body.get("priority").map(Value::to_string);
        ctx.slo = crate::ingress::slo::Slo::from_headers(&ctx.client_headers, state.settings.slo)?;
        ctx.priority = crate::ingress::admission::priority(field.as_deref(), &ctx.client_headers)?;
        ctx.journey.aim_at(ctx.slo);
        let permit =
            match crate::ingress::admission::admit(&state.admission, ctx.priority, ctx.slo.ttft)
                .await
            {
                Ok(permit) => permit,
                Err(refused) => return Ok(refused),
            };
        let roster = state.registry.snapshot();
        if roster.routing_mode() != Mode::Disaggregated {
            return Err(state
                .registry
                .refuse_unservable("/generate needs prefill and decode workers")
                .into());
        }
        state.metrics.record_disaggregation("disaggregated");
        let route = RouteRequest::bodyless(Endpoint::Completions, &ctx.client_headers);
        let shape = SglangRoute::Generate;
        let response =
            handoff::bootstrap::serve_body(&state, &ctx, shape, body, Vec::new(), &route, None)
                .await?;
        Ok(crate::ingress::admission::hold_until_sent(response, permit))
    }
    .await;
    crate::handoff::intake::answer(&state, &ctx, result)
}

async fn models(State(state): State<Arc<Serving>>, headers: HeaderMap) -> Response {
    const ROUTE: &str = "/v1/models";
    let response = match fetch_models(&state, &headers).await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(failure) => failure.into_response(),
    };
    state
        .metrics
        .record_request(ROUTE, response.status().as_u16());
    response
}

/// `/v1/models` of a live decode (or prefill_decode, or prefill) worker, passed through.
async fn fetch_models(state: &Serving, headers: &HeaderMap) -> Result<Bytes, Failure> {
    let route = RouteRequest::bodyless(Endpoint::Chat, headers);
    let worker = state.pick_any(&route).ok_or_else(|| state.refuse_any())?;
    let exchange = Exchange::new(&worker, "worker", state.settings.decode_timeout);
    let request = state
        .client
        .get(worker.models_url(), &ForwardHeaders::from_client(headers));
    let body = match exchange.send_and_read(request).await {
        Ok(body) => body,
        Err(e) => {
            state.report(&worker, &e);
            return Err(e.failure);
        }
    };
    if !serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_object()) {
        let text = String::from_utf8_lossy(&body);
        return Err(exchange
            .error(
                LegFault::Failed,
                format!(
                    "answered /v1/models with a body that is not a JSON object: {}",
                    crate::error::truncate(text.trim(), 512)
                ),
            )
            .failure);
    }
    Ok(body)
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    for role in WorkerRole::ALL {
        let policy = state.serving.policy(role);
        if policy.name() == "cache_aware" {
            let stats = policy.stats();
            state.metrics.set_policy_stats(
                role.as_str(),
                stats.cache_hits,
                stats.cache_misses,
                policy.tree_size(),
            );
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "No such route.")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "Method not allowed on this route.",
    )
}

/// Runs the gateway until SIGTERM or Ctrl-C, then drains open requests for up to
/// `--shutdown-timeout`.
pub async fn run(args: GatewayArgs) -> Result<(), GatewayError> {
    let config = args.to_config()?;
    let addr = args.listen_addr();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr()?;
    tracing::info!(
        addr = %local,
        prefill = config.prefill.len(),
        decode = config.decode.len(),
        prefill_decode = config.worker.len(),
        encode = config.encode.len(),
        dynamic_registration = config.admin_api_key.is_some(),
        policy = %config.policy,
        prefill_policy = config.prefill_policy.as_deref().unwrap_or(&config.policy),
        decode_policy = config.decode_policy.as_deref().unwrap_or(&config.policy),
        "gateway listening"
    );
    if config.static_workers().next().is_none()
        && config.admin_api_key.is_none()
        && !config.discovery.any()
    {
        tracing::warn!(
            "no --prefill/--decode/--worker given, no discovery source and --dynamic-registration \
             is off: every request will get 503"
        );
    }
    serve(listener, config, async {
        shutdown_signal().await;
        tracing::info!("shutting down: no new connections; draining open requests");
    })
    .await
}

/// Completes on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_distinct_v4_uuids() {
        let request = http::Request::new(());
        let mut ids = std::collections::HashSet::new();
        for _ in 0..100 {
            let id = RandomRequestId.make_request_id(&request).unwrap();
            let text = id.header_value().to_str().unwrap().to_owned();
            let uuid = uuid::Uuid::parse_str(&text).unwrap();
            assert_eq!(uuid.get_version_num(), 4);
            assert_eq!(text, uuid.hyphenated().to_string());
            assert!(ids.insert(text));
        }
    }
}
