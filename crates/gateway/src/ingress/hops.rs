//! Loop detection: every gateway names itself in a hop header on each leg it sends, and
//! refuses at once (508 Loop Detected) a request that already passed through it, or
//! through `--max-hops` gateways, rather than forward it round a loop until the client
//! gives up.

use std::future::{ready, Ready};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use futures::future::Either;
use http::{HeaderMap, HeaderValue, StatusCode};
use pdserve_protocol::ApiError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tower::{Layer, Service};

/// The hop header: the instance ids of the gateways a request passed through, in order,
/// comma-separated.
pub const X_PDSERVE_HOPS: &str = "x-pdserve-hops";

/// The gateway ids in `headers`' hop header(s), in order.
pub fn received(headers: &HeaderMap) -> Vec<&str> {
    headers
        .get_all(X_PDSERVE_HOPS)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .collect()
}

/// Why a request is refused as a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loop {
    /// It already passed through this gateway.
    OwnId,
    /// It passed through `--max-hops` gateways already.
    MaxHops,
}

impl Loop {
    /// The metrics label.
    pub fn reason(self) -> &'static str {
        match self {
            Self::OwnId => "own_id",
            Self::MaxHops => "max_hops",
        }
    }
}

/// Whether a request that passed through `hops` may go on through gateway `own_id`.
pub fn check(hops: &[&str], own_id: &str, max_hops: u32) -> Result<(), Loop> {
    if hops.contains(&own_id) {
        return Err(Loop::OwnId);
    }
    // This gateway would be hop `hops.len() + 1`.
    if hops.len() >= max_hops as usize {
        return Err(Loop::MaxHops);
    }
    Ok(())
}

/// Labels of `loops_refused_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct LoopLabels {
    reason: &'static str,
}

/// Requests refused as routing loops, by reason.
#[derive(Debug, Default)]
pub struct LoopMetrics {
    refused: Family<LoopLabels, Counter>,
}

impl LoopMetrics {
    /// The family, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "loops_refused",
            "Requests refused with 508 Loop Detected: they had passed through this gateway \
             already (reason own_id) or through --max-hops gateways (reason max_hops)",
            m.refused.clone(),
        );
        m
    }

    /// Counts a request refused as `why`.
    pub fn inc(&self, why: Loop) {
        self.refused
            .get_or_create(&LoopLabels {
                reason: why.reason(),
            })
            .inc();
    }
}

/// What the loop guard needs: who this gateway is and how many hops it allows.
#[derive(Debug, Clone)]
pub struct HopGuard {
    /// This gateway's instance id.
    pub own_id: String,
    /// The same, as the hop header of a request that came from no gateway.
    pub own_header: HeaderValue,
    /// `--max-hops`.
    pub max_hops: u32,
    /// Where refused loops are counted.
    pub refused: Arc<LoopMetrics>,
}

/// The loop guard as a layer: 508 for a looping request; otherwise the hop header is
/// rewritten to the received ids plus this gateway's, so that every leg sent for it
/// carries the chain. A plain service, not `from_fn`: every request passes it, and a
/// `from_fn` middleware boxes a copy of the service stack below it per request.
#[derive(Debug, Clone)]
pub struct HopGuardLayer(pub Arc<HopGuard>);

impl<S> Layer<S> for HopGuardLayer {
    type Service = HopGuardService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HopGuardService {
            guard: self.0.clone(),
            inner,
        }
    }
}

/// The service [`HopGuardLayer`] wraps around the routes.
#[derive(Debug, Clone)]
pub struct HopGuardService<S> {
    guard: Arc<HopGuard>,
    inner: S,
}

impl<S> Service<Request> for HopGuardService<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        match self.guard.refuse(&mut request) {
            None => Either::Right(self.inner.call(request)),
            Some(refused) => Either::Left(ready(Ok(refused))),
        }
    }
}

impl HopGuard {
    /// The 508 answer for a request that loops; for one that may go on, `None`, its hop
    /// header rewritten for its legs.
    fn refuse(&self, request: &mut Request) -> Option<Response> {
        let headers = request.headers();
        // The common case, a request straight from a client, allocates nothing.
        if !headers.contains_key(X_PDSERVE_HOPS) {
            request
                .headers_mut()
                .insert(X_PDSERVE_HOPS, self.own_header.clone());
            return None;
        }
        let own = self.own_id.as_str();
        let hops = received(headers);
        if let Err(why) = check(&hops, own, self.max_hops) {
            self.refused.inc(why);
            let chain = hops.join(",");
            tracing::warn!(
                path = request.uri().path(),
                hops = %chain,
                reason = why.reason(),
                "refused a routing loop"
            );
            let message = match why {
                Loop::OwnId => format!(
                    "Loop detected: this request has already passed through this gateway \
                     (instance {own}; hops: {chain}). A gateway is registered as a worker of \
                     itself, directly or through other gateways."
                ),
                Loop::MaxHops => format!(
                    "Loop detected: this request has passed through {} gateways (hops: {chain}), \
                     the most --max-hops ({}) allows.",
                    hops.len(),
                    self.max_hops
                ),
            };
            return Some(
                ApiError::new(StatusCode::LOOP_DETECTED, "loop_detected", message).into_response(),
            );
        }
        let mut chain = hops.join(",");
        if !chain.is_empty() {
            chain.push(',');
        }
        chain.push_str(own);
        let headers = request.headers_mut();
        match HeaderValue::from_str(&chain) {
            Ok(value) => {
                headers.insert(X_PDSERVE_HOPS, value);
            }
            // Ids that are not visible ASCII were dropped by `received`; what is left is.
            Err(_) => {
                headers.remove(X_PDSERVE_HOPS);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_that_passed_through_this_gateway_or_too_many_is_a_loop() {
        let mut headers = HeaderMap::new();
        assert!(received(&headers).is_empty());
        assert_eq!(check(&[], "me", 4), Ok(()));
        headers.append(X_PDSERVE_HOPS, HeaderValue::from_static("a, b"));
        headers.append(X_PDSERVE_HOPS, HeaderValue::from_static("c,"));
        let hops = received(&headers);
        assert_eq!(hops, ["a", "b", "c"]);
        assert_eq!(check(&hops, "me", 4), Ok(()));
        assert_eq!(check(&hops, "b", 4), Err(Loop::OwnId));
        assert_eq!(check(&hops, "me", 3), Err(Loop::MaxHops));
        assert_eq!(check(&["a"], "me", 1), Err(Loop::MaxHops));
    }
}
