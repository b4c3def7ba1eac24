//! Attribute names: OpenTelemetry's GenAI and HTTP semantic conventions where they have
//! one, vLLM's `SpanAttributes` (`vllm/tracing.py`) for its latencies, `pdserve.*` for
//! what neither names (routing, legs, KV transfer).

/// `chat`, `text_completion` or `generate_content` (GenAI).
pub const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
/// `pdserve` (GenAI's provider name).
pub const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
/// The model the client asked for (GenAI).
pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
/// The model that answered (GenAI).
pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
/// `max_tokens` (GenAI).
pub const GEN_AI_REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
/// `temperature` (GenAI).
pub const GEN_AI_REQUEST_TEMPERATURE: &str = "gen_ai.request.temperature";
/// `top_p` (GenAI).
pub const GEN_AI_REQUEST_TOP_P: &str = "gen_ai.request.top_p";
/// Choices asked for (vLLM).
pub const GEN_AI_REQUEST_N: &str = "gen_ai.request.n";
/// The request id (vLLM).
pub const GEN_AI_REQUEST_ID: &str = "gen_ai.request.id";
/// The response's id (GenAI).
pub const GEN_AI_RESPONSE_ID: &str = "gen_ai.response.id";
/// Prompt tokens (GenAI).
pub const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
/// Generated tokens (GenAI).
pub const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
/// Why generation stopped, one per choice (GenAI).
pub const GEN_AI_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
/// Seconds from arrival to the first token (vLLM).
pub const GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: &str = "gen_ai.latency.time_to_first_token";
/// Seconds waiting for the scheduler (vLLM).
pub const GEN_AI_LATENCY_TIME_IN_QUEUE: &str = "gen_ai.latency.time_in_queue";
/// Seconds from arrival to the end (vLLM).
pub const GEN_AI_LATENCY_E2E: &str = "gen_ai.latency.e2e";
/// Seconds computing the prompt (vLLM).
pub const GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: &str = "gen_ai.latency.time_in_model_prefill";
/// Seconds generating after the first token (vLLM).
pub const GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: &str = "gen_ai.latency.time_in_model_decode";

/// HTTP method (HTTP semconv).
pub const HTTP_REQUEST_METHOD: &str = "http.request.method";
/// The matched route template (HTTP semconv).
pub const HTTP_ROUTE: &str = "http.route";
/// The answer's status code (HTTP semconv).
pub const HTTP_RESPONSE_STATUS_CODE: &str = "http.response.status_code";
/// The request path (URL semconv).
pub const URL_PATH: &str = "url.path";
/// The full URL of a client request (URL semconv).
pub const URL_FULL: &str = "url.full";
/// The peer's host (server semconv).
pub const SERVER_ADDRESS: &str = "server.address";
/// The peer's port (server semconv).
pub const SERVER_PORT: &str = "server.port";
/// A failure's class (general semconv).
pub const ERROR_TYPE: &str = "error.type";

/// The routing policy that chose (`round_robin`, `cache_aware`, …).
pub const PDSERVE_ROUTING_POLICY: &str = "pdserve.routing.policy";
/// The role a worker was chosen for.
pub const PDSERVE_ROUTING_ROLE: &str = "pdserve.routing.role";
/// The chosen worker's URL.
pub const PDSERVE_ROUTING_WORKER: &str = "pdserve.routing.worker";
/// Workers the policy chose among.
pub const PDSERVE_ROUTING_CANDIDATES: &str = "pdserve.routing.candidates";
/// The prompt's start the chosen worker held (`…unit`: tokens or chars).
pub const PDSERVE_ROUTING_CACHE_MATCHED: &str = "pdserve.routing.cache.matched";
/// The prompt's length in the same unit.
pub const PDSERVE_ROUTING_CACHE_PROMPT: &str = "pdserve.routing.cache.prompt";
/// `events` or `approximate`.
pub const PDSERVE_ROUTING_CACHE_SOURCE: &str = "pdserve.routing.cache.source";
/// The chosen worker's predicted time to first token, in milliseconds (`--policy slo`).
pub const PDSERVE_ROUTING_PREDICTED_TTFT_MS: &str = "pdserve.routing.predicted.ttft_ms";
/// The chosen worker's predicted time per output token, in milliseconds.
pub const PDSERVE_ROUTING_PREDICTED_TPOT_MS: &str = "pdserve.routing.predicted.tpot_ms";
/// Which leg: `prefill`, `decode`, `prefill_decode`, `encode`.
pub const PDSERVE_LEG: &str = "pdserve.leg";
/// The worker role of this process.
pub const PDSERVE_ROLE: &str = "pdserve.role";
/// KV blocks moved.
pub const PDSERVE_KV_BLOCKS: &str = "pdserve.kv.blocks";
/// KV bytes moved.
pub const PDSERVE_KV_BYTES: &str = "pdserve.kv.bytes";
/// Prompt tokens whose KV was moved.
pub const PDSERVE_KV_TOKENS: &str = "pdserve.kv.tokens";
/// Seconds the transfer took.
pub const PDSERVE_KV_SECONDS: &str = "pdserve.kv.duration";
/// The transfer's request id (`remote_request_id`).
pub const PDSERVE_KV_REQUEST_ID: &str = "pdserve.kv.request_id";
/// Prompt tokens served from the prefix cache or an earlier turn.
pub const PDSERVE_CACHED_TOKENS: &str = "pdserve.usage.cached_tokens";
/// Prompt tokens whose KV was imported from a peer.
pub const PDSERVE_KV_IMPORTED_TOKENS: &str = "pdserve.usage.kv_imported_tokens";
