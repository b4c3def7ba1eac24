//! `POST /v1/kv/release`: frees the blocks a prefill leg published for a decode leg that
//! will never read them (the gateway calls it when decode fails after a prefill).
//!
//! Body: `{"kv_transfer_params": {...}}`, the params the prefill leg returned (only
//! `remote_request_id` and, if present, `remote_engine_id` are used). Answers 200
//! `{"released": true|false, "remote_request_id", "blocks"}`; releasing twice, or a
//! handle already read or expired, is `released: false`. With a transfer secret
//! configured the `X-PDServe-KV-Secret` header must carry it (401 otherwise).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use http::{HeaderMap, StatusCode};
use pdserve_protocol::{ApiError, KvTransferParams};
use serde::Deserialize;
use serde_json::{json, Value};

use pdserve_protocol::kv::KV_SECRET_HEADER;

use super::body::parse_json;
use super::AppState;

#[derive(Deserialize)]
struct ReleaseBody {
    kv_transfer_params: KvTransferParams,
}

/// `POST /v1/kv/release`.
pub async fn handle(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    if let Some(secret) = &app.serving.kv.secret {
        let offered = headers.get(KV_SECRET_HEADER).and_then(|v| v.to_str().ok());
        if !secret.verify(offered) {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_kv_secret",
                "releasing KV needs this worker's transfer secret in the X-PDServe-KV-Secret header",
            ));
        }
    }
    let Some(service) = &app.serving.kv.service else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "this worker runs no KV transfer service: it publishes no KV to release",
        ));
    };
    let body: ReleaseBody = parse_json(body)?;
    let params = body.kv_transfer_params;
    let Some(request_id) = params.remote_request_id.filter(|id| !id.is_empty()) else {
        return Err(
            ApiError::bad_request("kv_transfer_params.remote_request_id is required")
                .with_param("kv_transfer_params.remote_request_id"),
        );
    };
    if let Some(engine) = params.remote_engine_id.as_deref() {
        if engine != service.engine_id() {
            return Err(ApiError::bad_request(format!(
                "kv_transfer_params.remote_engine_id {engine:?} is another engine; this is {:?}",
                service.engine_id()
            ))
            .with_param("kv_transfer_params.remote_engine_id"));
        }
    }
    let blocks = service.release(&request_id).await;
    Ok(Json(json!({
        "released": blocks.is_some(),
        "remote_request_id": request_id,
        "blocks": blocks.unwrap_or(0),
    })))
}
