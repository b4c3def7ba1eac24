//! The HTTP client for workers and the headers every upstream request carries.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use reqwest::{RequestBuilder, Url};

use crate::args::GatewayConfig;

/// The request id header shared by the client response and both upstream legs.
pub const X_REQUEST_ID: &str = "x-request-id";

/// Headers taken from the client request and sent on every leg.
#[derive(Debug, Clone)]
pub struct ForwardHeaders {
    /// The client's `X-Request-Id`, or one generated for this request.
    pub request_id: HeaderValue,
    /// The client's `Authorization`, forwarded so workers can check API keys.
    pub authorization: Option<HeaderValue>,
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
        }
    }

    /// The request id as text, for logs.
    pub fn request_id(&self) -> &str {
        self.request_id.to_str().unwrap_or("<non-ascii>")
    }
}

/// A pooled HTTP/1.1 client for all workers.
#[derive(Debug, Clone)]
pub struct Upstream {
    client: reqwest::Client,
}

impl Upstream {
    /// A client whose idle connections are retired before the workers' keep-alive
    /// closes them (a request sent on a connection the server just closed fails
    /// without the server ever seeing it).
    pub fn new(config: &GatewayConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .pool_idle_timeout(config.upstream_idle_timeout)
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .http1_only()
            .no_proxy()
            .build()?;
        Ok(Self { client })
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

    fn with_headers(&self, builder: RequestBuilder, headers: &ForwardHeaders) -> RequestBuilder {
        let builder = builder.header(X_REQUEST_ID, headers.request_id.clone());
        match &headers.authorization {
            Some(auth) => builder.header(header::AUTHORIZATION, auth.clone()),
            None => builder,
        }
    }
}
