//! Streamed reads: an awaited read (see [`super::awaited`]) that finds its prefill
//! running is attached to the prefill's [`KvFeed`] and accepted as soon as the prefill
//! is admitted (the prompt, hence the matched tokens and the block count, is known from
//! the start; the reused tokens from admission). Its blocks then go out as the
//! scheduler computes them, chunk by chunk, the last one when the prompt is complete,
//! instead of all after the prefill ends.
//!
//! Nothing is pinned for the blocks in flight: the scheduler copies each one out while
//! its sequence holds it. The prefill still publishes its pinned blocks when it
//! finishes, and an accepted streamed read owns that publication: one that arrives
//! while the read is in progress is freed when the read ends; one that arrives after
//! the read ended (completed or broke off) is freed on arrival. A read refused before
//! it was accepted leaves the publication to be read as any other (by the params the
//! prefill returns), or freed by the abort timeout.

use std::sync::Arc;
use std::time::Duration;

use pdserve_kv_transfer::{ErrorCode, Export, NextBlock, Pending, PendingBlocks, ReadRequest};
use pdserve_model::{BlockId, BLOCK_SIZE};

use super::awaited::{AttachedRead, AWAIT_LIMIT};
use super::{common_prefix, release_unpublished, KvService, Reading, State};
use crate::kv_feed::{FeedError, KvFeed};
use crate::request::PinnedKv;

/// Longest wait for any one block of a streamed read (one chunk of the prompt, in a step
/// shared with other sequences). Below the readers' 30 s frame timeout
/// (`kv::pull::IO_TIMEOUT`), so a stalled prefill fails the read with an error frame
/// instead of the reader's timeout; the server's own frame timeout bounds only writes.
/// A read that gave up so leaves the publication to be read by the prefill's answer
/// (the concurrent orchestrator's fallback), as one refused before acceptance does.
pub(super) const BLOCK_WAIT: Duration = Duration::from_secs(20);

/// What becomes of a prefill publication under a reader-chosen id a streamed read is,
/// or was, on.
pub(super) enum Route {
    /// The read ended before it came: freed at once.
    Free,
    /// The read in progress frees it when it ends.
    ToRead,
}

impl KvService {
    /// Accepts the streamed read `attached` once its prefill is admitted: an export whose
    /// blocks are all pending, taken from the feed as they are computed.
    pub(super) async fn export_streamed(
        &self,
        request: &ReadRequest,
        attached: AttachedRead,
    ) -> Result<Export, (ErrorCode, String)> {
        let AttachedRead { feed, started } = attached;
        let id = &request.request_id;
        // Until accepted, a refusal, or this future dropped mid-wait, undoes the attach.
        let mut unaccepted = Unaccepted {
            service: self,
            id,
            armed: true,
        };
        let left = AWAIT_LIMIT.saturating_sub(started.elapsed());
        let Some(reused) = feed.admitted_within(left).await else {
            return Err((
                ErrorCode::UnknownRequest,
                format!(
                    "the prefill publishing {id:?} ended, or was not admitted within {} s",
                    AWAIT_LIMIT.as_secs()
                ),
            ));
        };
        let matched = common_prefix(&request.token_ids, feed.tokens());
        let num_blocks = matched.div_ceil(BLOCK_SIZE);
        if num_blocks > request.block_ids.len() {
            return Err((
                ErrorCode::BlockMismatch,
                format!(
                    "the read has room for {} blocks, its tokens match {num_blocks}",
                    request.block_ids.len()
                ),
            ));
        }
        unaccepted.armed = false;
        tracing::debug!(id, num_blocks, "KV read accepted while its prefill runs");
        let blocks = FeedBlocks {
            feed,
            next: 0,
            wait: self.block_wait,
        };
        let pending = Pending {
            count: num_blocks,
            blocks: Box::new(blocks),
        };
        Ok(Export {
            pending: Some(pending),
            ..Export::ready(matched, Vec::new(), reused.within(matched))
        })
    }

    /// A streamed read refused before it was accepted: the reader will read the
    /// publication by the prefill's answer, so it is published as any other.
    fn refuse_streamed(&self, id: &str) {
        let reading = self.lock().reading.remove(id);
        if let Some(reading) = reading {
            if let Some(feed) = &reading.feed {
                feed.detach();
            }
            // Published in the moment between the refusal and here: nobody reads it.
            if !reading.blocks.is_empty() {
                self.release_in_background(reading.blocks);
            }
        }
    }

    /// Ends the read in progress under `id` and returns it (its blocks are the caller's
    /// to free). A streamed read that ends before its prefill published leaves the id
    /// spent (the publication is freed as it comes), unless it gave up waiting for a
    /// block: its reader may then read the publication by the prefill's answer.
    pub(super) fn end_read(&self, id: &str) -> Option<Reading> {
        let mut st = self.lock();
        let reading = st.reading.remove(id)?;
        if let Some(feed) = &reading.feed {
            feed.detach();
            let early = feed.taken_early() as u64;
            self.metrics.kv.blocks_streamed.inc_by(early);
            let unpublished = reading.blocks.is_empty() && st.expected.contains_key(id);
            if unpublished && !feed.gave_up() {
                st.spent.insert(id.to_string());
            }
        }
        Some(reading)
    }

    /// Where a prefill publication of `pinned` under the reader-chosen `id` goes when a
    /// streamed read is or was on it (`None`: into the table, as any other). Under the
    /// service's lock, so the read cannot end in between.
    pub(super) fn route_publication(
        &self,
        st: &mut State,
        id: &str,
        pinned: &PinnedKv,
    ) -> Option<Route> {
        if st.spent.remove(id) {
            return Some(Route::Free);
        }
        let reading = st.reading.get_mut(id)?;
        if reading.feed.is_none() || !reading.blocks.is_empty() {
            return None;
        }
        // Its tail is timed from the feed's completion, not from here.
        reading.blocks = pinned.blocks.clone();
        self.metrics
            .kv
            .pinned_blocks
            .inc_by(pinned.blocks.len() as i64);
        Some(Route::ToRead)
    }

    /// Carries out `route` for a publication of `blocks`.
    pub(super) fn settle_streamed(&self, id: &str, route: Route, blocks: Vec<BlockId>) {
        self.metrics.kv.published.inc();
        if let Route::Free = route {
            tracing::debug!(id, "KV published after its streamed read ended; freed");
            release_unpublished(&self.engine, blocks);
        }
    }
}

/// A streamed read attached to its feed but not accepted yet.
struct Unaccepted<'a> {
    service: &'a KvService,
    id: &'a str,
    armed: bool,
}

impl Drop for Unaccepted<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.service.refuse_streamed(self.id);
        }
    }
}

/// A streamed read's pending blocks, taken from the prefill's feed in order.
struct FeedBlocks {
    feed: Arc<KvFeed>,
    next: usize,
    /// Longest wait for any one block.
    wait: Duration,
}

impl PendingBlocks for FeedBlocks {
    fn next_block(&mut self) -> NextBlock<'_> {
        Box::pin(async move {
            let block = self.feed.take(self.next, self.wait).await.map_err(|e| {
                let code = match e {
                    FeedError::Ended(_) => ErrorCode::UnknownRequest,
                    FeedError::TimedOut { .. } => ErrorCode::Internal,
                };
                (code, e.to_string())
            })?;
            self.next += 1;
            Ok(block)
        })
    }
}
