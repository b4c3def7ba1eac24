//! The bootstrap port: a `pdserve-kv-transfer` listener whose reads name a room
//! (`bootstrap-room-<room>`) instead of blocks. A read claims its room, waits for the
//! room's prefill to arrive, then is served by the worker's KV service as an awaited
//! read of the prefill's publication (the prefill publishes under the room's id).

use std::sync::Arc;
use std::time::Duration;

use pdserve_kv_transfer::{
    BlockSource, ErrorCode, Export, ReadOutcome, ReadRequest, TransferStats,
};

use super::rooms::{ClaimEnd, RoomTable};
use super::{parse_room_id, BOOTSTRAP_ENGINE_ID};
use crate::kv::service::awaited::is_awaited_read;
use crate::kv::KvService;

/// Serves room reads from a prefill worker's KV service.
#[derive(Debug)]
pub struct RoomSource {
    service: Arc<KvService>,
    rooms: Arc<RoomTable>,
    /// Longest wait of a read for its room's prefill to arrive.
    wait: Duration,
}

impl RoomSource {
    /// Room reads of `service`'s publications, met in `rooms`; a read waits at most
    /// `wait` for its prefill to arrive.
    pub fn new(service: Arc<KvService>, rooms: Arc<RoomTable>, wait: Duration) -> Self {
        Self {
            service,
            rooms,
            wait,
        }
    }
}

/// Ends a claim that did not reach the transfer (refused, or its connection dropped
/// while waiting).
struct PendingClaim<'a> {
    rooms: &'a RoomTable,
    room: u64,
    end: Option<ClaimEnd>,
}

impl Drop for PendingClaim<'_> {
    fn drop(&mut self) {
        if let Some(end) = self.end.take() {
            self.rooms.end_claim(self.room, end);
        }
    }
}

impl BlockSource for RoomSource {
    fn engine_id(&self) -> &str {
        BOOTSTRAP_ENGINE_ID
    }

    fn layout(&self) -> &str {
        BlockSource::layout(&*self.service)
    }

    fn block_bytes(&self) -> usize {
        BlockSource::block_bytes(&*self.service)
    }

    async fn export(&self, request: &ReadRequest) -> Result<Export, (ErrorCode, String)> {
        let Some(room) = parse_room_id(&request.request_id) else {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "{:?} names no bootstrap room (expected bootstrap-room-<u64>)",
                    request.request_id
                ),
            ));
        };
        if !is_awaited_read(request) {
            return Err((
                ErrorCode::BadRequest,
                "a bootstrap room read lists placeholder block ids only".into(),
            ));
        }
        self.rooms
            .claim(room)
            .map_err(|e| (ErrorCode::UnknownRequest, e.to_string()))?;
        let mut claim = PendingClaim {
            rooms: &self.rooms,
            room,
            end: Some(ClaimEnd::Failed("the read was dropped".into())),
        };
        if let Err(e) = self.rooms.wait_for_prefill(room, self.wait).await {
            claim.end = Some(ClaimEnd::Unfilled(e.to_string()));
            return Err((ErrorCode::UnknownRequest, e.to_string()));
        }
        // Waits for the publication while the prefill runs (bounded by the awaited
        // read's own limit), then takes the blocks out of the table.
        match self.service.export(request).await {
            Ok(export) => {
                claim.end = None;
                self.rooms.reading(room);
                Ok(export)
            }
            Err((code, message)) => {
                claim.end = Some(ClaimEnd::Unfilled(message.clone()));
                Err((code, message))
            }
        }
    }

    fn finish(&self, request_id: &str, outcome: ReadOutcome, stats: TransferStats) {
        self.service.finish(request_id, outcome.clone(), stats);
        if let Some(room) = parse_room_id(request_id) {
            let end = match outcome {
                ReadOutcome::Completed => ClaimEnd::Transferred,
                ReadOutcome::Failed(reason) => ClaimEnd::Failed(reason),
            };
            self.rooms.end_claim(room, end);
        }
    }
}
