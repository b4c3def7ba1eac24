//! The prefill leg every mode sends: one request to a prefill worker, answered whole
//! within `--prefill-timeout-secs`, its answer checked by the mode, and its outcome
//! counted for the worker's breaker and the policy that chose it.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::policy::RequestOutcome;
use crate::registry::Worker;
use crate::state::AppState;
use crate::worker_client::{Exchange, LegError, LegErrorKind, LegRequest};

/// Sends `request` to the prefill `worker` and reads the whole answer; `check` turns a
/// 2xx body into what the mode needs, or says why the worker's KV cannot be trusted
/// (a 502). `head` hears when the answer's head came. The leg's duration is recorded
/// once the body is read.
pub(crate) async fn send_prefill<T>(
    state: &AppState,
    worker: &Arc<Worker>,
    request: Result<LegRequest, String>,
    head: Option<oneshot::Sender<()>>,
    check: impl FnOnce(&Bytes) -> Result<T, String>,
) -> Result<T, LegError> {
    let mut in_flight = state.start_request(worker.clone());
    let exchange = Exchange::new(worker, "prefill worker", state.config.prefill_timeout);
    let sent = Instant::now();
    let result = async {
        let request = request.map_err(|why| exchange.error(LegErrorKind::Status, why))?;
        let response = exchange.send_leg(&state.client.direct, request).await?;
        if let Some(head) = head {
            let _ = head.send(());
        }
        let body = exchange.read_leg(response).await?;
        state.metrics.observe_prefill(sent.elapsed());
        check(&body).map_err(|why| exchange.error(LegErrorKind::Status, why))
    }
    .await;
    in_flight.set_outcome(match &result {
        Ok(_) => RequestOutcome::Success,
        Err(e) if e.is_worker_fault() => RequestOutcome::Failure,
        Err(_) => RequestOutcome::Other,
    });
    result
}
