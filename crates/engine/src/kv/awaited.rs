//! Reads that wait for their publication: concurrent handoff.
//!
//! An orchestrating decode worker that wants to start its KV read before the prefill
//! worker has answered picks the publication's id itself and sends it with the prefill
//! leg (`kv_transfer_params.publish_request_id`). The prefill worker announces the id
//! when the request arrives ([`KvService::expect`]) and publishes under it when the
//! prefill finishes. The reader cannot know the block ids yet, so its read lists
//! [`AWAITED_BLOCK`] placeholders, one per block it has room for; such a read waits
//! until the prefill runs (it is then served the blocks as they are computed, see
//! [`super::streamed`]) or its publication appears, or fails as soon as the prefill
//! that would have published it ends without doing so (failed, cancelled, client gone).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_kv_transfer::{ErrorCode, ReadRequest};

use super::{KvService, Reading};
use crate::kv_feed::{Attach, KvFeed};

/// Placeholder block id of a read that waits for a publication under an id the reader
/// chose (it cannot know the block ids before the publication exists).
pub const AWAITED_BLOCK: u64 = u64::MAX;

/// How long an awaited read waits for an id nobody announced yet: the reader sends its
/// prefill request and its read at the same time, and the read may arrive first.
const ANNOUNCE_GRACE: Duration = Duration::from_secs(5);

/// Longest wait of an awaited read for its answer frame: for the publication, or for
/// the prefill to be admitted (a streamed read). Below the readers' 30 s frame timeout,
/// so a slow prefill fails the read cleanly (the reader then reads by the params the
/// prefill returns) instead of timing the connection out.
pub(super) const AWAIT_LIMIT: Duration = Duration::from_secs(20);

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

/// A prefill running here that will publish under a reader-chosen id, and the feed its
/// prompt's KV goes to as it is computed. Dropping it (the prefill published, failed or
/// was cancelled) tells waiting reads to look again.
#[derive(Debug)]
pub struct ExpectedPublication {
    service: Arc<KvService>,
    id: String,
    feed: Arc<KvFeed>,
}

impl ExpectedPublication {
    /// The id the prefill publishes under.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where the prefill's scheduler puts its prompt's KV as it is computed
    /// (`GenerationRequest::kv_feed`).
    pub fn feed(&self) -> &Arc<KvFeed> {
        &self.feed
    }
}

impl Drop for ExpectedPublication {
    fn drop(&mut self) {
        {
            let mut st = self.service.lock();
            st.expected.remove(&self.id);
            // Nothing is published under the id after this.
            st.spent.remove(&self.id);
        }
        self.feed.close();
        self.service.changed.notify_waiters();
    }
}

/// A streamed read that found its prefill running and is attached to its feed.
#[derive(Debug)]
pub(super) struct AttachedRead {
    pub feed: Arc<KvFeed>,
    /// When the read began waiting.
    pub started: Instant,
}

impl KvService {
    /// Announces that a prefill of `prompt` running here will publish under `id`;
    /// refused when the id is announced, published or being read already.
    pub fn expect(
        self: &Arc<Self>,
        id: &str,
        prompt: &[u32],
    ) -> Result<ExpectedPublication, IdInUse> {
        let feed = Arc::new(KvFeed::new(prompt.to_vec()));
        {
            let mut st = self.lock();
            let taken = st.pins.get(id).is_some()
                || st.reading.contains_key(id)
                || st.expected.contains_key(id);
            if taken {
                return Err(IdInUse(id.to_string()));
            }
            st.expected.insert(id.to_string(), feed.clone());
        }
        self.changed.notify_waiters();
        Ok(ExpectedPublication {
            service: self.clone(),
            id: id.to_string(),
            feed,
        })
    }

    /// Waits until the prefill announced under `id` runs (the read is then attached to
    /// its feed, and registered as in progress) or something is published under it, or
    /// until neither can happen any more: the announced prefill ended without
    /// publishing, nobody announced the id within [`ANNOUNCE_GRACE`], or [`AWAIT_LIMIT`]
    /// passed. Without an attachment the caller looks the id up as for any read.
    pub(super) async fn await_publication(&self, id: &str) -> Option<AttachedRead> {
        let started = Instant::now();
        let mut announced = false;
        loop {
            // Registered before looking, so a change between the look and the wait is
            // not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut st = self.lock();
                if st.pins.get(id).is_some() {
                    return None;
                }
                if let Some(feed) = st.expected.get(id).cloned() {
                    announced = true;
                    // Not streamed (`--kv-stream off`): wait for the publication.
                    let attach = if self.streaming {
                        feed.attach()
                    } else {
                        Attach::TooLate
                    };
                    match attach {
                        Attach::Attached => {
                            // In progress from now on: the publication, when it comes,
                            // is this read's to free (see `streamed`).
                            let reading = Reading {
                                feed: Some(feed.clone()),
                                ..Reading::default()
                            };
                            st.reading.insert(id.to_string(), reading);
                            return Some(AttachedRead { feed, started });
                        }
                        // Computed before any reader came: wait for the publication.
                        Attach::TooLate => {}
                        // Another read has it; this one finds nothing published.
                        Attach::Refused => return None,
                    }
                } else if announced || started.elapsed() >= ANNOUNCE_GRACE {
                    return None;
                }
            }
            let left = AWAIT_LIMIT.saturating_sub(started.elapsed());
            if left.is_zero() {
                tracing::warn!(id, "an awaited KV publication did not appear in time");
                return None;
            }
            let _ = tokio::time::timeout(left.min(RECHECK), changed).await;
        }
    }
}
