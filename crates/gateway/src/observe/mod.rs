//! What the gateway tells about itself: Prometheus metrics, the dashboard's history of
//! requests and their journeys, and OpenTelemetry spans.

pub mod history;
pub mod journey;
pub mod metrics;
pub mod request_record;
pub mod trace;
