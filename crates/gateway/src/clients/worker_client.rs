//! The HTTP client for workers, the headers every upstream request carries, and the
//! failure mapping every exchange with a worker shares.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use http_body_util::Full;
use pdserve_protocol::ApiError;
use reqwest::{RequestBuilder, Url};
use tokio::time::timeout_at;

use crate::clients::direct::{DirectClient, DirectError, DirectResponse};
use crate::error::{error_chain, truncate, Failure};
use crate::fleet::registry::{Worker, WorkerState};
use crate::ingress::hops::X_PDSERVE_HOPS;
use pdserve_telemetry::propagation::{TRACEPARENT, TRACESTATE};

pub use crate::ingress::access::X_REQUEST_ID;

/// A transport error of an upstream stream (reqwest's or the direct client's).
pub type StreamError = Box<dyn std::error::Error + Send + Sync>;

/// The rest of an upstream body.
pub type ByteStream = futures::stream::BoxStream<'static, Result<Bytes, StreamError>>;

/// How the worker client connects: the `--upstream-idle-timeout-secs`,
/// `--connect-timeout-secs` and `--worker-api-key` flags.
#[derive(Debug, Clone, Default)]
pub struct ClientSettings {
    /// Lifetime of an idle pooled connection.
    pub idle_timeout: Duration,
    /// Limit for opening a connection.
    pub connect_timeout: Duration,
    /// The key sent to workers instead of the client's `Authorization`.
    pub worker_api_key: Option<String>,
}

/// The header that names the data-parallel replica a request must run on (vLLM).
pub const X_DATA_PARALLEL_RANK: &str = "x-data-parallel-rank";

/// Headers taken from the client request and sent on every leg.
#[derive(Debug, Clone)]
pub struct ForwardHeaders {
    /// The client's `X-Request-Id`, or one generated for this request.
    pub request_id: HeaderValue,
    /// The client's `Authorization`, forwarded so workers can check API keys.
    pub authorization: Option<HeaderValue>,
    /// The gateways the request passed through, this one last (see [`crate::ingress::hops`]).
    pub hops: Option<HeaderValue>,
    /// W3C `traceparent` naming the span a leg runs under (traced requests only).
    pub traceparent: Option<HeaderValue>,
    /// W3C `tracestate` going with it.
    pub tracestate: Option<HeaderValue>,
}

impl ForwardHeaders {
    /// The forwarded headers of a client request (its request id is set by the
    /// request-id layer when the client sent none).
    pub fn from_client(headers: &HeaderMap) -> Self {
        let request_id = headers.get(X_REQUEST_ID).cloned().unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().to_string())
                .expect("a UUID is a valid header value")
        });
        Self {
            request_id,
            authorization: headers.get(header::AUTHORIZATION).cloned(),
            hops: headers.get(X_PDSERVE_HOPS).cloned(),
            traceparent: None,
            tracestate: None,
        }
    }

    /// The request id as text, for logs.
    pub fn request_id(&self) -> &str {
        self.request_id.to_str().unwrap_or("<non-ascii>")
    }
}

/// A pooled HTTP/1.1 client for all workers.
#[derive(Debug, Clone)]
pub struct WorkerClient {
    client: reqwest::Client,
    /// Connections for streamed final legs, driven by the relay that reads them.
    pub direct: DirectClient,
    /// `Bearer <--worker-api-key>`, sent instead of the client's `Authorization`.
    worker_authorization: Option<HeaderValue>,
}

impl WorkerClient {
    /// A client whose idle connections are retired before the workers' keep-alive
    /// closes them (a request sent on a connection the server just closed fails
    /// without the server ever seeing it).
    pub fn new(config: ClientSettings) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .pool_idle_timeout(config.idle_timeout)
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .http1_only()
            .no_proxy()
            .build()?;
        let worker_authorization = config.worker_api_key.as_deref().and_then(|key| {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
            value.set_sensitive(true);
            Some(value)
        });
        Ok(Self {
            client,
            direct: DirectClient::new(config.idle_timeout, config.connect_timeout),
            worker_authorization,
        })
    }

    /// The pooled client (health probes and pre-warm requests share its pool).
    pub fn pooled(&self) -> &reqwest::Client {
        &self.client
    }

    /// A JSON POST to `url` for the direct client, naming `rank` when given: the worker's
    /// `host:port` and the request (`None` when `url` is not `http://`).
    pub fn direct_post(
        &self,
        url: &Url,
        body: Bytes,
        headers: &ForwardHeaders,
        rank: Option<u32>,
    ) -> Option<(String, http::Request<Full<Bytes>>)> {
        let addr = crate::clients::direct::authority(url)?;
        let path = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let mut request = http::Request::post(path)
            .header(header::HOST, HeaderValue::from_str(&addr).ok()?)
            .header(header::CONTENT_TYPE, "application/json")
            .header(X_REQUEST_ID, headers.request_id.clone());
        if let Some(auth) = self.authorization(headers) {
            request = request.header(header::AUTHORIZATION, auth.clone());
        }
        if let Some(rank) = rank {
            request = request.header(X_DATA_PARALLEL_RANK, rank);
        }
        if let Some(hops) = &headers.hops {
            request = request.header(X_PDSERVE_HOPS, hops.clone());
        }
        if let Some(traceparent) = &headers.traceparent {
            request = request.header(TRACEPARENT, traceparent.clone());
            if let Some(tracestate) = &headers.tracestate {
                request = request.header(TRACESTATE, tracestate.clone());
            }
        }
        let request = request.body(Full::new(body)).ok()?;
        Some((addr, request))
    }

    /// A JSON POST of a leg to `url`: on the direct client when `url` is `http://`, else
    /// through the pooled client.
    pub fn leg_request(
        &self,
        url: &Url,
        body: Bytes,
        headers: &ForwardHeaders,
        rank: Option<u32>,
    ) -> LegRequest {
        if let Some((addr, request)) = self.direct_post(url, body.clone(), headers, rank) {
            return LegRequest::Direct { addr, request };
        }
        let request = self.post_json(url, body, headers);
        LegRequest::Pooled(match rank {
            Some(rank) => request.header(X_DATA_PARALLEL_RANK, rank),
            None => request,
        })
    }

    /// A JSON POST to `url` with the forwarded headers.
    pub fn post_json(&self, url: &Url, body: Bytes, headers: &ForwardHeaders) -> RequestBuilder {
        self.with_headers(self.client.post(url.clone()), headers)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
    }

    /// A GET to `url` with the forwarded headers.
    pub fn get(&self, url: &Url, headers: &ForwardHeaders) -> RequestBuilder {
        self.with_headers(self.client.get(url.clone()), headers)
    }

    /// A DELETE to `url` with the forwarded headers.
    pub fn delete(&self, url: &Url, headers: &ForwardHeaders) -> RequestBuilder {
        self.with_headers(self.client.delete(url.clone()), headers)
    }

    fn with_headers(&self, builder: RequestBuilder, headers: &ForwardHeaders) -> RequestBuilder {
        let mut builder = builder.header(X_REQUEST_ID, headers.request_id.clone());
        if let Some(hops) = &headers.hops {
            builder = builder.header(X_PDSERVE_HOPS, hops.clone());
        }
        if let Some(traceparent) = &headers.traceparent {
            builder = builder.header(TRACEPARENT, traceparent.clone());
            if let Some(tracestate) = &headers.tracestate {
                builder = builder.header(TRACESTATE, tracestate.clone());
            }
        }
        match self.authorization(headers) {
            Some(auth) => builder.header(header::AUTHORIZATION, auth.clone()),
            None => builder,
        }
    }

    /// The `Authorization` a leg carries: the workers' own key when configured, else the
    /// client's header as it came.
    fn authorization<'a>(&'a self, headers: &'a ForwardHeaders) -> Option<&'a HeaderValue> {
        self.worker_authorization
            .as_ref()
            .or(headers.authorization.as_ref())
    }
}

/// A leg's request, for whichever client can send it.
pub enum LegRequest {
    /// For the direct client: the worker's `host:port` and the request.
    Direct {
        /// `host:port`.
        addr: String,
        /// The request, its path relative to `addr`.
        request: http::Request<Full<Bytes>>,
    },
    /// For the pooled reqwest client (a worker URL the direct client cannot reach).
    Pooled(RequestBuilder),
}

/// A worker's 2xx answer to a [`LegRequest`].
// The direct variant holds its connection's state inline; it is moved a few times per
// leg, which costs less than boxing it (an allocation per leg).
#[allow(clippy::large_enum_variant)]
pub enum LegResponse {
    /// From the direct client: reading the body drives its connection.
    Direct(DirectResponse),
    /// From the pooled client.
    Pooled(reqwest::Response),
}

impl LegResponse {
    /// The answer's `Content-Type`.
    pub fn content_type(&self) -> Option<&HeaderValue> {
        match self {
            Self::Direct(r) => r.headers.get(header::CONTENT_TYPE),
            Self::Pooled(r) => r.headers().get(header::CONTENT_TYPE),
        }
    }

    /// The body as a stream of chunks.
    pub fn into_stream(self) -> ByteStream {
        use futures::{StreamExt, TryStreamExt};
        match self {
            Self::Direct(r) => r.body.err_into().boxed(),
            Self::Pooled(r) => r.bytes_stream().err_into().boxed(),
        }
    }
}

pub use pdserve_protocol::LegFault;

/// The gateway's metrics label of a leg's fault (`reason` of `retries_total`).
pub fn fault_label(fault: LegFault) -> &'static str {
    match fault {
        LegFault::Unreachable => "connect",
        LegFault::Broken => "transport",
        LegFault::TimedOut => "timeout",
        LegFault::Failed | LegFault::BadAnswer => "status_5xx",
        LegFault::Rejected => "client_error",
    }
}

/// A failed exchange: what the client gets, and what kind of failure it was.
#[derive(Debug)]
pub struct LegError {
    /// The response the client gets if nothing else is tried.
    pub failure: Failure,
    /// What went wrong.
    pub kind: LegFault,
    /// The worker's error status, when it answered one.
    pub status: Option<http::StatusCode>,
    /// The failure calls for redoing an earlier stage of the request (a decode 500 after
    /// the encoder stage: the embedding could not be fetched), not for retrying this leg
    /// alone.
    pub escalated: bool,
}

impl LegError {
    /// Whether another worker may succeed where this one failed (all but a 4xx, and
    /// never an escalated failure: the leg alone cannot succeed).
    pub fn retryable(&self) -> bool {
        self.kind.is_server_fault() && !self.escalated
    }

    /// The message the client would get.
    pub fn failure_message(&self) -> String {
        match &self.failure {
            Failure::Api(e) => e.body.error.message.clone(),
            Failure::Upstream { status, body } => {
                format!(
                    "{status}: {}",
                    truncate(&String::from_utf8_lossy(body), 512)
                )
            }
        }
    }

    /// Whether the worker failed (as opposed to the request being at fault).
    pub fn is_worker_fault(&self) -> bool {
        self.kind.is_server_fault()
    }

    /// Whether the failure counts against the worker's circuit breaker: a worker fault,
    /// unless the worker answered 502 or 504, which say that a peer it depends on failed
    /// (a decode worker's KV pull from the prefill worker cut or refused, an
    /// orchestrator's prefill leg), not the worker itself. Charging those to the worker
    /// opened the only decode worker's breaker when one prefill worker's KV transfers
    /// broke, refusing every request, those through healthy prefill workers too.
    pub fn blames_worker(&self) -> bool {
        self.is_worker_fault()
            && !matches!(
                self.status,
                Some(StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT)
            )
    }
}

/// One request/response exchange with a worker under a time limit, with the failure
/// mapping every leg shares: past the limit → 504; no connection or a broken one → 502;
/// 4xx → passed through; other non-2xx → 502 with the start of the worker's body.
#[derive(Debug)]
pub struct Exchange<'a> {
    worker: &'a Worker,
    /// How the worker is named in messages (`prefill worker`, `decode worker`, ...).
    label: &'a str,
    limit: Duration,
    deadline: tokio::time::Instant,
}

impl<'a> Exchange<'a> {
    /// An exchange with `worker`, named `label` in messages, that must finish in `limit`.
    pub fn new(worker: &'a Worker, label: &'a str, limit: Duration) -> Self {
        Self {
            worker,
            label,
            limit,
            deadline: tokio::time::Instant::now() + limit,
        }
    }

    /// The instant the exchange times out.
    pub fn deadline(&self) -> tokio::time::Instant {
        self.deadline
    }

    /// Sends `request`; returns the response head when the status is 2xx.
    pub async fn send(&self, request: RequestBuilder) -> Result<reqwest::Response, LegError> {
        let response = match timeout_at(self.deadline, request.send()).await {
            Err(_) => return Err(self.timed_out()),
            Ok(Err(e)) => return Err(self.transport(&e)),
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        Err(self.error_with_body(status, response.bytes()).await)
    }

    /// Sends `request` to `addr` on a direct connection (see [`crate::clients::direct`]); returns
    /// the response when the status is 2xx, with the same failure mapping as [`Self::send`].
    pub async fn send_direct(
        &self,
        client: &DirectClient,
        addr: &str,
        request: http::Request<Full<Bytes>>,
    ) -> Result<DirectResponse, LegError> {
        let response = match timeout_at(self.deadline, client.send(addr, request)).await {
            Err(_) => return Err(self.timed_out()),
            Ok(Err(e)) => return Err(self.direct_transport(&e)),
            Ok(Ok(r)) => r,
        };
        if response.status.is_success() {
            return Ok(response);
        }
        let status = response.status;
        Err(self.error_with_body(status, response.body.concat()).await)
    }

    /// Sends a leg on the client it was built for; returns the answer when it is 2xx.
    pub async fn send_leg(
        &self,
        client: &DirectClient,
        request: LegRequest,
    ) -> Result<LegResponse, LegError> {
        match request {
            LegRequest::Direct { addr, request } => self
                .send_direct(client, &addr, request)
                .await
                .map(LegResponse::Direct),
            LegRequest::Pooled(request) => self.send(request).await.map(LegResponse::Pooled),
        }
    }

    /// Reads the whole body of a leg's answer within the limit.
    pub async fn read_leg(&self, response: LegResponse) -> Result<Bytes, LegError> {
        match response {
            LegResponse::Direct(r) => self.read_direct(r).await,
            LegResponse::Pooled(r) => self.read(r).await,
        }
    }

    /// [`Exchange::read_leg`], handing each chunk to `watch` as it arrives (the prefill
    /// leg's first token is sent on before its answer ends).
    pub async fn read_leg_watching(
        &self,
        response: LegResponse,
        watch: &mut (dyn FnMut(&Bytes) + Send),
    ) -> Result<Bytes, LegError> {
        let mut body = BytesMut::new();
        match response {
            LegResponse::Direct(r) => {
                let mut chunks = r.body;
                loop {
                    match timeout_at(self.deadline, futures::StreamExt::next(&mut chunks)).await {
                        Err(_) => return Err(self.timed_out()),
                        Ok(None) => break,
                        Ok(Some(Err(e))) => return Err(self.direct_transport(&e)),
                        Ok(Some(Ok(chunk))) => {
                            watch(&chunk);
                            body.extend_from_slice(&chunk);
                        }
                    }
                }
            }
            LegResponse::Pooled(mut r) => loop {
                match timeout_at(self.deadline, r.chunk()).await {
                    Err(_) => return Err(self.timed_out()),
                    Ok(Err(e)) => return Err(self.transport(&e)),
                    Ok(Ok(None)) => break,
                    Ok(Ok(Some(chunk))) => {
                        watch(&chunk);
                        body.extend_from_slice(&chunk);
                    }
                }
            },
        }
        Ok(body.freeze())
    }

    /// Reads the whole body of a direct response within the limit.
    pub async fn read_direct(&self, response: DirectResponse) -> Result<Bytes, LegError> {
        match timeout_at(self.deadline, response.body.concat()).await {
            Err(_) => Err(self.timed_out()),
            Ok(Err(e)) => Err(self.direct_transport(&e)),
            Ok(Ok(b)) => Ok(b),
        }
    }

    /// The failure for a non-2xx `status`, its body read within the same limit: a worker
    /// that sends a status and then nothing still gets its status reported.
    async fn error_with_body<E>(
        &self,
        status: StatusCode,
        body: impl std::future::Future<Output = Result<Bytes, E>>,
    ) -> LegError {
        let body = match timeout_at(self.deadline, body).await {
            Ok(Ok(b)) => b,
            _ => Bytes::new(),
        };
        self.status_error(status, body)
    }

    /// The failure for a non-2xx `status` with its `body`: 4xx passed through, else 502.
    /// A 508 (a gateway downstream detected a routing loop) passes through as well and
    /// is not retried: every worker of a looping tier would answer the same.
    fn status_error(&self, status: StatusCode, body: Bytes) -> LegError {
        let fault = LegFault::of_status(status).unwrap_or(LegFault::Failed);
        if fault == LegFault::Rejected {
            return LegError {
                failure: Failure::from_upstream_client_error(status, body, &self.worker.base),
                kind: LegFault::Rejected,
                status: Some(status),
                escalated: false,
            };
        }
        let text = String::from_utf8_lossy(&body);
        let mut error = self.error(
            LegFault::Failed,
            format!("answered {status}: {}", truncate(text.trim(), 512)),
        );
        error.status = Some(status);
        error
    }

    /// Sends `request` and reads the whole 2xx body within the limit.
    pub async fn send_and_read(&self, request: RequestBuilder) -> Result<Bytes, LegError> {
        let response = self.send(request).await?;
        self.read(response).await
    }

    /// Reads the whole body of a response within the limit.
    pub async fn read(&self, response: reqwest::Response) -> Result<Bytes, LegError> {
        match timeout_at(self.deadline, response.bytes()).await {
            Err(_) => Err(self.timed_out()),
            Ok(Err(e)) => Err(self.transport(&e)),
            Ok(Ok(b)) => Ok(b),
        }
    }

    /// The 504 for a worker that did not answer in time.
    pub fn timed_out(&self) -> LegError {
        LegError {
            failure: ApiError::gateway_timeout(format!(
                "{} {} did not answer within {:?}",
                self.label, self.worker.base, self.limit
            ))
            .into(),
            kind: LegFault::TimedOut,
            status: None,
            escalated: false,
        }
    }

    /// The 502 for a transport error (connection refused, reset, bad framing).
    pub fn transport(&self, e: &reqwest::Error) -> LegError {
        self.transport_failed(e.is_connect(), error_chain(e))
    }

    /// The 502 for a direct connection's transport error.
    pub fn direct_transport(&self, e: &DirectError) -> LegError {
        self.transport_failed(e.is_connect(), error_chain(e))
    }

    /// A 502, or a 503 when a worker that panic routing tried (evicted, or its breaker
    /// open: none of its role was healthy) refused the connection: then no worker could
    /// take the request.
    fn transport_failed(&self, connect: bool, why: String) -> LegError {
        if !connect {
            return self.error(LegFault::Broken, format!("failed: {why}"));
        }
        let kept_out = match self.worker.state() {
            WorkerState::Live => None,
            WorkerState::Evicted => Some("is evicted"),
            WorkerState::BreakerOpen => Some("has its circuit breaker open"),
            WorkerState::Draining => Some("is draining for shutdown"),
        };
        if let Some(kept_out) = kept_out {
            return LegError {
                failure: ApiError::service_unavailable(format!(
                    "no healthy {role} worker: {} {} {kept_out} and refused the connection: {why}",
                    self.label,
                    self.worker.base,
                    role = self.worker.role(),
                ))
                .into(),
                kind: LegFault::Unreachable,
                status: None,
                escalated: false,
            };
        }
        self.error(LegFault::Unreachable, format!("failed: {why}"))
    }

    /// A 502 saying the worker `what` (e.g. "answered 200 with a body that is not JSON").
    pub fn error(&self, kind: LegFault, what: impl std::fmt::Display) -> LegError {
        LegError {
            failure: ApiError::bad_gateway(format!("{} {} {what}", self.label, self.worker.base))
                .into(),
            kind,
            status: None,
            escalated: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16) -> LegError {
        let status = StatusCode::from_u16(status).unwrap();
        LegError {
            failure: Failure::Upstream {
                status,
                body: Bytes::new(),
            },
            kind: LegFault::of_status(status).unwrap_or(LegFault::Failed),
            status: Some(status),
            escalated: false,
        }
    }

    #[test]
    fn a_workers_502_or_504_blames_its_peer_not_the_worker() {
        assert!(answered(500).blames_worker());
        assert!(answered(503).blames_worker());
        assert!(!answered(502).blames_worker(), "its KV peer failed");
        assert!(!answered(504).blames_worker(), "its peer timed out");
        assert!(!answered(400).blames_worker(), "the request was at fault");
        // Retried all the same: another decode worker may pull the KV.
        assert!(answered(502).retryable());
        let unreachable = LegError {
            failure: Failure::Upstream {
                status: StatusCode::BAD_GATEWAY,
                body: Bytes::new(),
            },
            kind: LegFault::Unreachable,
            status: None,
            escalated: false,
        };
        assert!(unreachable.blames_worker(), "no answer at all: the worker");
    }
}
