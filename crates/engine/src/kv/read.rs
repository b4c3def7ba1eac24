//! Serving reads of the service's publications ([`BlockSource`]): a read names a
//! publication, takes it out of the table (one read each), has its blocks copied out
//! of the pool and frees them when it ends; a conversation hand-back's kept blocks are
//! claimed first (`gone` when the pool reclaimed them). A read of a reader-chosen id
//! whose prefill still runs is streamed instead (see [`super::streamed`]).

use pdserve_kv_transfer::{
    BlockSource, ErrorCode, Export, ReadOutcome, ReadRequest, TransferStats,
};
use pdserve_model::BLOCK_SIZE;

use super::{awaited, common_prefix, release, KvService, Reading};
use crate::request::BlockBytes;

impl KvService {
    /// Pins a conversation hand-back's kept blocks for the read under `request_id`, or
    /// answers `gone` when the pool reclaimed any of them.
    async fn claim_handback(
        &self,
        request_id: &str,
        handle: u64,
        num_blocks: usize,
    ) -> Result<(), (ErrorCode, String)> {
        match self.engine.claim_kept(handle).await {
            Ok(Some(_)) => {
                self.metrics.kv.pinned_blocks.inc_by(num_blocks as i64);
                Ok(())
            }
            Ok(None) => {
                self.lock().reading.remove(request_id);
                tracing::info!(
                    request_id,
                    "a conversation hand-back was read after its blocks were reclaimed"
                );
                Err((
                    ErrorCode::Gone,
                    format!(
                        "the KV of {request_id:?} was reclaimed for other requests; compute the prompt"
                    ),
                ))
            }
            Err(e) => {
                self.lock().reading.remove(request_id);
                Err((ErrorCode::Internal, format!("cannot claim the blocks: {e}")))
            }
        }
    }
}

impl BlockSource for KvService {
    fn engine_id(&self) -> &str {
        &self.config.engine_id
    }

    fn layout(&self) -> &str {
        &self.config.layout
    }

    fn block_bytes(&self) -> usize {
        self.config.block_bytes
    }

    async fn export(&self, request: &ReadRequest) -> Result<Export, (ErrorCode, String)> {
        let began = std::time::Instant::now();
        let exported = self.export_blocks(request).await;
        match &exported {
            Ok(_) => crate::trace::export_accepted(request, began),
            Err((_, why)) => crate::trace::export_refused(request, began, why),
        }
        exported
    }

    fn finish(&self, request_id: &str, outcome: ReadOutcome, stats: TransferStats) {
        crate::trace::export_finished(request_id, &outcome, &stats);
        self.finish_read(request_id, outcome, stats);
    }
}

impl KvService {
    /// [`BlockSource::export`] itself (the trait's method adds the trace span).
    async fn export_blocks(&self, request: &ReadRequest) -> Result<Export, (ErrorCode, String)> {
        let awaited = awaited::is_awaited_read(request);
        if awaited {
            if let Some(attached) = self.await_publication(&request.request_id).await {
                return self.export_streamed(request, attached).await;
            }
        }
        let entry = {
            let mut st = self.lock();
            let Some(entry) = st.pins.get(&request.request_id) else {
                return Err((
                    ErrorCode::UnknownRequest,
                    format!(
                        "nothing is published under {:?} (never, already read, or expired)",
                        request.request_id
                    ),
                ));
            };
            if awaited {
                awaited::check_awaited_read(request, entry.named_by_reader)?;
            } else if !entry
                .blocks
                .iter()
                .map(|&b| u64::from(b))
                .eq(request.block_ids.iter().copied())
            {
                return Err((
                    ErrorCode::BlockMismatch,
                    format!(
                        "the read names {} blocks that differ from the {} published under {:?}",
                        request.block_ids.len(),
                        entry.blocks.len(),
                        request.request_id
                    ),
                ));
            }
            // Taken out of the table: one read per publication, and the sweeper cannot
            // free blocks while they are being sent.
            let entry = st
                .take(&request.request_id)
                .expect("present under the lock");
            let reading = Reading {
                blocks: entry.blocks.clone(),
                finished_at: entry.finished_at,
                feed: None,
            };
            st.reading.insert(request.request_id.clone(), reading);
            entry
        };
        if let Some(handle) = entry.kept {
            self.claim_handback(&request.request_id, handle, entry.blocks.len())
                .await?;
        }
        let matched = common_prefix(&request.token_ids, &entry.tokens);
        let wanted = entry.blocks[..matched.div_ceil(BLOCK_SIZE)].to_vec();
        if wanted.len() > request.block_ids.len() {
            // Only an awaited read can get here (a named read lists every block): it
            // announced room for fewer blocks than its own tokens match.
            self.lock().reading.remove(&request.request_id);
            release(&self.engine, &self.metrics, entry.blocks).await;
            return Err((
                ErrorCode::BlockMismatch,
                format!(
                    "the read has room for {} blocks, its tokens match {}",
                    request.block_ids.len(),
                    wanted.len()
                ),
            ));
        }
        if let Some(BlockBytes(mut bytes)) = entry.bytes {
            // Copied as the prefill finished: nothing waits for the scheduler.
            bytes.truncate(wanted.len());
            return Ok(Export::ready(matched, bytes, entry.reused.within(matched)));
        }
        match self.engine.read_blocks(wanted).await {
            Ok(blocks) => Ok(Export::ready(matched, blocks, entry.reused.within(matched))),
            Err(e) => {
                self.lock().reading.remove(&request.request_id);
                release(&self.engine, &self.metrics, entry.blocks).await;
                Err((ErrorCode::Internal, format!("cannot read the blocks: {e}")))
            }
        }
    }

    /// [`BlockSource::finish`] itself.
    fn finish_read(&self, request_id: &str, outcome: ReadOutcome, stats: TransferStats) {
        let reading = self.end_read(request_id);
        match outcome {
            ReadOutcome::Completed => {
                let kv = &self.metrics.kv;
                kv.blocks_sent.inc_by(stats.blocks as u64);
                kv.bytes_sent.inc_by(stats.bytes as u64);
                kv.transfer_seconds.observe(stats.elapsed.as_secs_f64());
                let finished = reading.as_ref().and_then(|r| match &r.feed {
                    Some(feed) => feed.completed_at(),
                    None => r.finished_at,
                });
                if let Some(finished) = finished {
                    kv.stream_tail_seconds
                        .observe(finished.elapsed().as_secs_f64());
                }
                tracing::debug!(
                    request_id,
                    blocks = stats.blocks,
                    ms = stats.elapsed.as_secs_f64() * 1e3,
                    "KV blocks sent"
                );
            }
            ReadOutcome::Failed(reason) => {
                self.metrics.kv.serve_failures.inc();
                tracing::warn!(request_id, %reason, "a KV read broke off; its blocks are freed");
            }
        }
        if let Some(reading) = reading.filter(|r| !r.blocks.is_empty()) {
            self.release_in_background(reading.blocks);
        }
    }
}
