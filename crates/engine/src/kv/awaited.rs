//! Reads that wait for their publication: concurrent handoff.
//!
//! An orchestrating decode worker that wants to start its KV read before the prefill
//! worker has answered picks the publication's id itself and sends it with the prefill
//! leg (`kv_transfer_params.publish_request_id`). The prefill worker announces the id
//! when the request arrives ([`KvService::expect`]) and publishes under it when the
//! prefill finishes. The reader cannot know the block ids yet, so its read lists
//! [`AWAITED_BLOCK`] placeholders, one per block it has room for; such a read waits
//! until the publication appears, or fails as soon as the prefill that would have
//! published it ends without doing so (failed, cancelled, client gone).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_kv_transfer::{ErrorCode, ReadRequest};

use super::KvService;

/// Placeholder block id of a read that waits for a publication under an id the reader
/// chose (it cannot know the block ids before the publication exists).
pub const AWAITED_BLOCK: u64 = u64::MAX;

/// How long an awaited read waits for an id nobody announced yet: the reader sends its
/// prefill request and its read at the same time, and the read may arrive first.
const ANNOUNCE_GRACE: Duration = Duration::from_secs(5);

/// Longest wait of an awaited read. Below the readers' 30 s frame timeout, so a slow
/// prefill fails the read cleanly (the reader then reads by the params the prefill
/// returns) instead of timing the connection out while blocks are being sent.
const AWAIT_LIMIT: Duration = Duration::from_secs(20);

/// How often a waiting read looks again even without a wake-up (belt and braces).
const RECHECK: Duration = Duration::from_millis(250);

/// Whether `read` waits for its publication (it lists only placeholder block ids).
pub fn is_awaited_read(read: &ReadRequest) -> bool {
    !read.block_ids.is_empty() && read.block_ids.iter().all(|&b| b == AWAITED_BLOCK)
}

/// Placeholder block ids for an awaited read of a prompt of `prompt_tokens` tokens.
pub fn awaited_block_ids(prompt_tokens: usize) -> Vec<u64> {
    vec![AWAITED_BLOCK; prompt_tokens.div_ceil(pdserve_model::BLOCK_SIZE).max(1)]
}

/// An awaited read may only take a publication made under its reader's id.
pub(super) fn check_awaited_read(
    read: &ReadRequest,
    named_by_reader: bool,
) -> Result<(), (ErrorCode, String)> {
    if named_by_reader {
        return Ok(());
    }
    Err((
        ErrorCode::BlockMismatch,
        format!(
            "{:?} was published under an id of this worker's own; read it by its block ids",
            read.request_id
        ),
    ))
}

/// Why an id cannot be announced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("publish_request_id {0:?} is already in use on this worker")]
pub struct IdInUse(pub String);

/// A prefill running here that will publish under a reader-chosen id. Dropping it (the
/// prefill published, failed or was cancelled) tells waiting reads to look again.
#[derive(Debug)]
pub struct ExpectedPublication {
    service: Arc<KvService>,
    id: String,
}

impl ExpectedPublication {
    /// The id the prefill publishes under.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for ExpectedPublication {
    fn drop(&mut self) {
        self.service.lock().expected.remove(&self.id);
        self.service.changed.notify_waiters();
    }
}

impl KvService {
    /// Announces that a prefill running here will publish under `id`; refused when the
    /// id is announced, published or being read already.
    pub fn expect(self: &Arc<Self>, id: &str) -> Result<ExpectedPublication, IdInUse> {
        {
            let mut st = self.lock();
            let taken = st.pins.get(id).is_some()
                || st.reading.contains_key(id)
                || !st.expected.insert(id.to_string());
            if taken {
                return Err(IdInUse(id.to_string()));
            }
        }
        self.changed.notify_waiters();
        Ok(ExpectedPublication {
            service: self.clone(),
            id: id.to_string(),
        })
    }

    /// Waits until something is published under `id`, or until that cannot happen any
    /// more: the announced prefill ended without publishing, nobody announced the id
    /// within [`ANNOUNCE_GRACE`], or [`AWAIT_LIMIT`] passed. The caller then looks the id
    /// up as for any read.
    pub(super) async fn await_publication(&self, id: &str) {
        let started = Instant::now();
        let mut announced = false;
        loop {
            // Registered before looking, so a change between the look and the wait is
            // not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let st = self.lock();
                if st.pins.get(id).is_some() {
                    return;
                }
                if st.expected.contains(id) {
                    announced = true;
                } else if announced || started.elapsed() >= ANNOUNCE_GRACE {
                    return;
                }
            }
            let left = AWAIT_LIMIT.saturating_sub(started.elapsed());
            if left.is_zero() {
                tracing::warn!(id, "an awaited KV publication did not appear in time");
                return;
            }
            let _ = tokio::time::timeout(left.min(RECHECK), changed).await;
        }
    }
}
