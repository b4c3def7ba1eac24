//! Who this gateway is, and what a worker URL answers as: a pdserve gateway names itself
//! on its health routes, so that a gateway is never taken for a worker by mistake (a
//! registration of its own URL, two gateways that list each other, a label selector that
//! also matches gateway pods).

use std::time::Duration;

use http::HeaderValue;
use reqwest::Url;

use crate::error::error_chain;

/// The response header of a gateway's `/health`, `/readiness` and `/liveness`: its
/// instance id. Workers never send it.
pub const X_PDSERVE_GATEWAY: &str = "x-pdserve-gateway";

/// The `server` field of a gateway's health body.
pub const SERVER_NAME: &str = "pdserve-gateway";

/// This gateway process: a random id, new at every start.
#[derive(Debug, Clone)]
pub struct Instance {
    id: String,
    header: HeaderValue,
}

impl Default for Instance {
    fn default() -> Self {
        Self::new()
    }
}

impl Instance {
    /// A fresh instance id (32 hex digits).
    pub fn new() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let header = HeaderValue::from_str(&id).expect("hex digits are a valid header value");
        Self { id, header }
    }

    /// The id, as it appears in hop headers and health answers.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The id as a header value.
    pub fn header(&self) -> &HeaderValue {
        &self.header
    }
}

/// What a URL answered as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// This very gateway process.
    ThisGateway,
    /// Another pdserve gateway, with its instance id.
    Gateway(String),
    /// A worker, or something that did not say (down, slow, not pdserve).
    Other,
}

/// Why a worker URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The URL is this gateway.
    #[error("{url} is this gateway itself (instance {id}): a gateway cannot be its own worker")]
    ThisGateway {
        /// The refused URL.
        url: String,
        /// This gateway's instance id.
        id: String,
    },
    /// The URL is another gateway and gateway workers are not allowed.
    #[error(
        "{url} answers as a pdserve gateway (instance {id}), not a worker; start this gateway \
         with --allow-gateway-workers to route to a tier of gateways"
    )]
    Gateway {
        /// The refused URL.
        url: String,
        /// The other gateway's instance id.
        id: String,
    },
}

impl Refusal {
    /// The metrics label of the refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ThisGateway { .. } => "self",
            Self::Gateway { .. } => "gateway",
        }
    }
}

impl Identity {
    /// What an answer with `headers` says about the URL that sent it.
    pub fn from_headers(headers: &http::HeaderMap, this: &Instance) -> Self {
        match headers.get(X_PDSERVE_GATEWAY).and_then(|v| v.to_str().ok()) {
            Some(id) if id == this.id() => Self::ThisGateway,
            Some(id) => Self::Gateway(id.to_string()),
            None => Self::Other,
        }
    }

    /// `Ok` when the URL may be routed to as a worker.
    pub fn admit(self, url: &str, this: &Instance, allow_gateways: bool) -> Result<(), Refusal> {
        match self {
            Self::ThisGateway => Err(Refusal::ThisGateway {
                url: url.to_string(),
                id: this.id().to_string(),
            }),
            Self::Gateway(id) if !allow_gateways => Err(Refusal::Gateway {
                url: url.to_string(),
                id,
            }),
            Self::Gateway(_) | Self::Other => Ok(()),
        }
    }
}

/// Asks `base`'s `/health` what it is, within `timeout`. A URL that does not answer is
/// [`Identity::Other`]: a worker that is still starting must not be refused for it (its
/// health probes ask again).
pub async fn identify(
    client: &reqwest::Client,
    base: &Url,
    this: &Instance,
    timeout: Duration,
) -> Identity {
    let Ok(url) = base.join("health") else {
        return Identity::Other;
    };
    match tokio::time::timeout(timeout, client.get(url).timeout(timeout).send()).await {
        Ok(Ok(response)) => Identity::from_headers(response.headers(), this),
        Ok(Err(e)) => {
            tracing::debug!(url = %base, "could not ask what the URL is: {}", error_chain(&e));
            Identity::Other
        }
        Err(_) => Identity::Other,
    }
}

/// What deciding whether a URL may be routed to as a worker needs: discovery, the admin
/// API and the startup check of static URLs all ask the same way.
#[derive(Debug, Clone)]
pub struct WorkerCheck {
    /// The client the URL is asked with.
    pub client: reqwest::Client,
    /// This gateway, which no URL may be.
    pub instance: Instance,
    /// Whether a URL may answer as another gateway (`--allow-gateway-workers`).
    pub allow_gateways: bool,
    /// Limit for the URL's answer (`--probe-timeout`).
    pub timeout: Duration,
}

impl WorkerCheck {
    /// Asks `base` what it is (see [`identify`]) and whether it may be routed to as the
    /// worker `key`.
    pub async fn admit(&self, base: &Url, key: &str) -> Result<(), Refusal> {
        identify(&self.client, base, &self.instance, self.timeout)
            .await
            .admit(key, &self.instance, self.allow_gateways)
    }

    /// The first of `urls` that must not be routed to as a worker, all asked at once.
    pub async fn first_refused(&self, urls: impl Iterator<Item = Url>) -> Option<Refusal> {
        let asked = urls
            .map(|url| async move { self.admit(&url, url.as_str().trim_end_matches('/')).await });
        futures::future::join_all(asked)
            .await
            .into_iter()
            .find_map(Result::err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_refused_when_it_answers_as_this_or_another_gateway() {
        let this = Instance::new();
        let other = Instance::new();
        assert_ne!(this.id(), other.id());
        let mut headers = http::HeaderMap::new();
        assert_eq!(Identity::from_headers(&headers, &this), Identity::Other);
        headers.insert(X_PDSERVE_GATEWAY, this.header().clone());
        let me = Identity::from_headers(&headers, &this);
        assert_eq!(me, Identity::ThisGateway);
        let refusal = me.clone().admit("http://h:1", &this, true).unwrap_err();
        assert_eq!(refusal.reason(), "self");
        assert!(refusal.to_string().contains("http://h:1"), "{refusal}");
        headers.insert(X_PDSERVE_GATEWAY, other.header().clone());
        let gateway = Identity::from_headers(&headers, &this);
        assert_eq!(gateway, Identity::Gateway(other.id().to_string()));
        let refusal = gateway
            .clone()
            .admit("http://h:1", &this, false)
            .unwrap_err();
        assert_eq!(refusal.reason(), "gateway");
        assert!(refusal.to_string().contains("--allow-gateway-workers"));
        assert!(gateway.admit("http://h:1", &this, true).is_ok());
        assert!(Identity::Other.admit("http://h:1", &this, false).is_ok());
    }
}
