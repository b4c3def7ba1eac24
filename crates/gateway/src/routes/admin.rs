//! The roster and its admin API: `GET /instances` (public, read-only) and, with
//! `--dynamic-registration`, `POST /instances` and `DELETE /instances?url=...` guarded by
//! `ADMIN_API_KEY`.

// ApiError is the protocol crate's error value, built once per rejected admin call;
// boxing it would only add an allocation on the error path.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::Json;
use bytes::Bytes;
use http::{header, HeaderMap, StatusCode};
use pdserve_protocol::{ApiError, WorkerRole};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use subtle::ConstantTimeEq;

use crate::fleet::identity::WorkerCheck;
use crate::fleet::kv_events::KvEventsHub;
use crate::fleet::registry::{check_dp_size, parse_worker_url, MAX_DP_SIZE};
use crate::fleet::registry::{worker_key, Health, RegistryError, Roster, WorkerSpec};
use crate::fleet::registry::{FleetMetrics, Registry};
use crate::ingress::request::body_rejection;

/// The admin key header (vLLM's proxies use the same one).
pub const X_API_KEY: &str = "x-api-key";

/// The largest admin request body: a registration is a few hundred bytes.
pub const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;

/// What the admin API works with, handed over by the composition root.
#[derive(Debug)]
pub struct AdminApi {
    /// The live worker set.
    pub registry: Arc<Registry>,
    /// How a registered URL is checked (never this gateway; another only when allowed).
    pub check: WorkerCheck,
    /// The admin key; `Some` enables `POST`/`DELETE /instances`.
    pub admin_api_key: Option<String>,
    /// The workers' KV-event indexes, shown per worker.
    pub kv_events: Arc<KvEventsHub>,
    /// Where refused registrations are counted.
    pub fleet_metrics: Arc<FleetMetrics>,
}

/// `GET /instances`: live and evicted workers per role, and each worker's state.
pub async fn list(State(state): State<Arc<AdminApi>>) -> Json<Value> {
    Json(roster_json(&state.registry.snapshot(), &state))
}

/// The roster as `/instances` shows it.
pub fn roster_json(roster: &Roster, state: &AdminApi) -> Value {
    let mut out = Map::new();
    out.insert("mode".into(), json!(roster.mode().as_str()));
    out.insert(
        "dynamic_registration".into(),
        json!(state.admin_api_key.is_some()),
    );
    for role in WorkerRole::ALL {
        let urls = |health| {
            roster
                .members()
                .iter()
                .filter(|m| m.worker.role() == role && m.health == health)
                .map(|m| m.worker.base.clone())
                .collect::<Vec<_>>()
        };
        out.insert(
            role.as_str().into(),
            json!({"live": urls(Health::Live), "evicted": urls(Health::Evicted)}),
        );
    }
    let workers: Vec<Value> = roster
        .members()
        .iter()
        .map(|m| {
            let w = &m.worker;
            json!({
                "url": w.base,
                "role": w.role(),
                "health": m.health,
                "state": w.state(),
                "source": m.source,
                "in_flight": w.in_flight(),
                "load": w.load(),
                "reported_load": w.reported_load().map(|r| json!({
                    "waiting": r.waiting,
                    "running": r.running,
                    "kv_usage": r.kv_usage,
                    "prefix_cache_hit_ratio": r.prefix_cache_hit_ratio,
                })),
                "dp_size": w.spec.dp_size,
                "bootstrap_port": w.spec.bootstrap_port,
                "ec_zmq_addrs": w.spec.ec_zmq_addrs,
                "kv_events_endpoint": w.spec.kv_events_endpoint,
                "kv_events_replay_endpoint": w.spec.kv_events_replay_endpoint,
                "consecutive_failures": w.failures(),
                "circuit": w.circuit(),
                "evicted_for_secs": m.evicted_since.map(|t| t.elapsed().as_secs_f64()),
                "kv_index": state.kv_events.worker(&w.base).map(|events| {
                    let (blocks, block_size) = {
                        let index = events.lock();
                        (index.len(), index.block_size())
                    };
                    json!({
                        "blocks": blocks,
                        "block_size": block_size,
                        "last_event_secs_ago": events.last_heard().map(|t| t.elapsed().as_secs_f64()),
                    })
                }),
            })
        })
        .collect();
    out.insert("workers".into(), Value::Array(workers));
    Value::Object(out)
}

/// `POST /instances` `{role, url, dp_size?, bootstrap_port?, ec_zmq_addrs?, kv_events_endpoint?}` →
/// `{"registered": bool}`. A URL that answers as this gateway, or as another gateway
/// without `--allow-gateway-workers`, is refused with 400.
pub async fn register(
    State(state): State<Arc<AdminApi>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let body = body.map_err(|r| body_rejection(r, MAX_ADMIN_BODY_BYTES))?;
    let spec = parse_registration(&body)?;
    let key = spec.key();
    if let Err(refusal) = state.check.admit(&spec.url, &key).await {
        state
            .fleet_metrics
            .inc_workers_refused("registration", refusal.reason());
        tracing::warn!("refused a registration: {refusal}");
        return Err(ApiError::bad_request(refusal.to_string()).with_param("url"));
    }
    match state.registry.register(spec) {
        Ok(registered) => Ok(Json(json!({"registered": registered}))),
        Err(e @ (RegistryError::MixedTopology { .. } | RegistryError::RoleChange { .. })) => Err(
            ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string()),
        ),
        Err(e @ RegistryError::Full { .. }) => Err(ApiError::too_many_requests(format!(
            "{e}; unregister workers or start the gateway with a larger --max-workers"
        ))),
    }
}

/// The query of `DELETE /instances`.
#[derive(Debug, Deserialize)]
pub struct RemoveQuery {
    url: Option<String>,
}

/// `DELETE /instances?url=...` → `{"removed": bool}`.
pub async fn unregister(
    State(state): State<Arc<AdminApi>>,
    headers: HeaderMap,
    query: Result<Query<RemoveQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let raw = query.ok().and_then(|Query(q)| q.url).ok_or_else(|| {
        ApiError::bad_request("give the worker's URL: DELETE /instances?url=http://host:port")
            .with_param("url")
    })?;
    let url = parse_worker_url("url", &raw)
        .map_err(|e| ApiError::bad_request(e.to_string()).with_param("url"))?;
    Ok(Json(
        json!({"removed": state.registry.unregister(&worker_key(&url))}),
    ))
}

/// Admin calls need dynamic registration on and the admin key, compared in constant time.
fn authorize(state: &AdminApi, headers: &HeaderMap) -> Result<(), ApiError> {
    let forbidden = |msg: &str| ApiError::new(StatusCode::FORBIDDEN, "forbidden", msg);
    let Some(expected) = &state.admin_api_key else {
        return Err(forbidden(
            "dynamic registration is off: start the gateway with --dynamic-registration and ADMIN_API_KEY",
        ));
    };
    let given = headers
        .get(X_API_KEY)
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
        })
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
        Ok(())
    } else {
        Err(forbidden("invalid admin API key"))
    }
}

/// Validates a registration body into a worker spec (400 with the offending field).
fn parse_registration(body: &[u8]) -> Result<WorkerSpec, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object {role, url, dp_size?, bootstrap_port?}",
        ));
    };
    let field = |name: &str| object.get(name).filter(|v| !v.is_null());
    let bad = |name: &str, msg: String| ApiError::bad_request(msg).with_param(name);

    let role = match field("role") {
        Some(Value::String(s)) => s
            .parse::<WorkerRole>()
            .map_err(|e| bad("role", e.to_string()))?,
        Some(_) => return Err(bad("role", "`role` must be a string".into())),
        None => return Err(bad("role", "`role` is required".into())),
    };
    let url = match field("url") {
        Some(Value::String(s)) => {
            parse_worker_url("url", s).map_err(|e| bad("url", e.to_string()))?
        }
        Some(_) => return Err(bad("url", "`url` must be a string".into())),
        None => return Err(bad("url", "`url` is required".into())),
    };
    let dp_size = match field("dp_size") {
        None => 1,
        Some(v) => v
            .as_u64()
            .and_then(|n| check_dp_size(n).ok())
            .ok_or_else(|| {
                bad(
                    "dp_size",
                    format!("`dp_size` must be an integer from 1 to {MAX_DP_SIZE}, got {v}"),
                )
            })?,
    };
    let bootstrap_port = match field("bootstrap_port") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|n| (1..=u64::from(u16::MAX)).contains(n))
                .map(|n| n as u16)
                .ok_or_else(|| {
                    bad(
                        "bootstrap_port",
                        format!("`bootstrap_port` must be a port number (1-65535), got {v}"),
                    )
                })?,
        ),
    };
    let ec_zmq_addrs = match field("ec_zmq_addrs") {
        None => Vec::new(),
        Some(Value::Array(addrs)) => addrs
            .iter()
            .map(|a| a.as_str().filter(|s| !s.is_empty()).map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                bad(
                    "ec_zmq_addrs",
                    "`ec_zmq_addrs` must be a list of addresses (strings)".into(),
                )
            })?,
        Some(_) => {
            return Err(bad(
                "ec_zmq_addrs",
                "`ec_zmq_addrs` must be a list of addresses (strings)".into(),
            ))
        }
    };
    if !ec_zmq_addrs.is_empty() {
        // The encoders push embeddings to the stage that consumes them.
        if !matches!(role, WorkerRole::Prefill | WorkerRole::PrefillDecode) {
            return Err(bad(
                "ec_zmq_addrs",
                format!("only encoder-cache consumers (prefill, prefill_decode) take `ec_zmq_addrs`, not {role}"),
            ));
        }
        if ec_zmq_addrs.len() != dp_size as usize {
            return Err(bad(
                "ec_zmq_addrs",
                format!(
                    "give one `ec_zmq_addrs` entry per data-parallel replica: {} for dp_size {dp_size}",
                    ec_zmq_addrs.len()
                ),
            ));
        }
    }
    let endpoint = |name: &str| match field(name) {
        None => Ok(None),
        Some(Value::String(s)) => crate::fleet::kv_events::check_endpoint(s)
            .map(|()| Some(s.clone()))
            .map_err(|e| bad(name, e.replace("kv_events_endpoint", name))),
        Some(_) => Err(bad(
            name,
            format!("`{name}` must be a string (tcp://host:port)"),
        )),
    };
    let kv_events_endpoint = endpoint("kv_events_endpoint")?;
    let kv_events_replay_endpoint = endpoint("kv_events_replay_endpoint")?;
    Ok(WorkerSpec {
        role,
        url,
        dp_size,
        bootstrap_port,
        ec_zmq_addrs,
        kv_events_endpoint,
        kv_events_replay_endpoint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_bodies_are_validated() {
        let ok = parse_registration(
            br#"{"role":"prefill","url":"http://127.0.0.1:8100/","dp_size":2,"bootstrap_port":8998}"#,
        )
        .unwrap();
        assert_eq!(ok.role, WorkerRole::Prefill);
        assert_eq!(ok.key(), "http://127.0.0.1:8100");
        assert_eq!((ok.dp_size, ok.bootstrap_port), (2, Some(8998)));
        let minimal = parse_registration(br#"{"role":"decode","url":"http://h:1"}"#).unwrap();
        let widest =
            parse_registration(br#"{"role":"decode","url":"http://h:1","dp_size":1024}"#).unwrap();
        assert_eq!(widest.dp_size, MAX_DP_SIZE);
        assert_eq!((minimal.dp_size, minimal.bootstrap_port), (1, None));
        let consumer = parse_registration(
            br#"{"role":"prefill_decode","url":"http://h:1","dp_size":2,"ec_zmq_addrs":["tcp://a:1","tcp://b:1"]}"#,
        )
        .unwrap();
        assert_eq!(consumer.ec_zmq_addrs, ["tcp://a:1", "tcp://b:1"]);
        for (body, param) in [
            (&br#"{"role":"prefill","url":"nope"}"#[..], "url"),
            (br#"{"role":"prefill","url":"ftp://h:1"}"#, "url"),
            (br#"{"role":"prefill"}"#, "url"),
            (br#"{"role":"cook","url":"http://h:1"}"#, "role"),
            (br#"{"role":7,"url":"http://h:1"}"#, "role"),
            (br#"{"url":"http://h:1"}"#, "role"),
            (
                br#"{"role":"decode","url":"http://h:1","dp_size":0}"#,
                "dp_size",
            ),
            (
                br#"{"role":"decode","url":"http://h:1","dp_size":1.5}"#,
                "dp_size",
            ),
            (
                br#"{"role":"decode","url":"http://h:1","dp_size":1025}"#,
                "dp_size",
            ),
            (
                br#"{"role":"decode","url":"http://h:1","dp_size":1000000000}"#,
                "dp_size",
            ),
            (
                br#"{"role":"decode","url":"http://h:1","dp_size":"2"}"#,
                "dp_size",
            ),
            (
                br#"{"role":"decode","url":"http://h:1","bootstrap_port":70000}"#,
                "bootstrap_port",
            ),
            (
                br#"{"role":"decode","url":"http://h:1","ec_zmq_addrs":["tcp://a:1"]}"#,
                "ec_zmq_addrs",
            ),
            (
                br#"{"role":"prefill","url":"http://h:1","dp_size":2,"ec_zmq_addrs":["tcp://a:1"]}"#,
                "ec_zmq_addrs",
            ),
            (
                br#"{"role":"prefill","url":"http://h:1","ec_zmq_addrs":[1]}"#,
                "ec_zmq_addrs",
            ),
            (
                br#"{"role":"prefill","url":"http://h:1","kv_events_endpoint":"h:5557"}"#,
                "kv_events_endpoint",
            ),
            (
                br#"{"role":"prefill","url":"http://h:1","kv_events_endpoint":5557}"#,
                "kv_events_endpoint",
            ),
            (
                br#"{"role":"prefill","url":"http://h:1","kv_events_replay_endpoint":"x"}"#,
                "kv_events_replay_endpoint",
            ),
        ] {
            let err = parse_registration(body).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert_eq!(
                err.body.error.param.as_deref(),
                Some(param),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            parse_registration(b"[1]").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            parse_registration(b"{").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
