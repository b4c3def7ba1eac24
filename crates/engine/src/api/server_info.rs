//! What SGLang's gateway probes when a worker joins: `GET /server_info` and
//! `/get_server_info` (its server arguments: `disaggregation_mode`, the bootstrap port,
//! `model_path`/`tokenizer_path`, parallelism), `GET /model_info` and `/get_model_info`
//! (`model_path`, `tokenizer_path`, `is_generation`). With a local `model_path` and
//! `tokenizer_path` the gateway never tries to download the model.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::AppState;

/// `GET /server_info` and `/get_server_info`.
pub async fn server_info(State(app): State<Arc<AppState>>) -> Json<Value> {
    let b = &app.bootstrap;
    let port = b.addr().map(|a| a.port());
    Json(json!({
        "model_path": b.model_path,
        "tokenizer_path": b.model_path,
        "served_model_name": app.serving.limits.served_model_name,
        "is_embedding": false,
        "skip_tokenizer_init": false,
        "disaggregation_mode": b.disaggregation_mode(),
        "disaggregation_bootstrap_port": port,
        "bootstrap_port": port,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": pdserve_model::BLOCK_SIZE,
        "context_length": app.serving.limits.max_model_len,
        "max_total_num_tokens": b.max_total_tokens,
        "version": concat!("pdserve-", env!("CARGO_PKG_VERSION")),
        "bootstrap_rooms_open": b.open_rooms(),
    }))
}

/// `GET /model_info` and `/get_model_info`.
pub async fn model_info(State(app): State<Arc<AppState>>) -> Json<Value> {
    let b = &app.bootstrap;
    Json(json!({
        "model_path": b.model_path,
        "tokenizer_path": b.model_path,
        "served_model_name": app.serving.limits.served_model_name,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "max_model_len": app.serving.limits.max_model_len,
    }))
}
