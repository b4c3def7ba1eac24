//! The prefill worker's room table: where a prefill carrying `bootstrap_room` and its
//! decode worker's read of that room meet, whichever arrives first.
//!
//! A room lives while either side is on it. The prefill side ([`PrefillRoom`]) waits,
//! bounded, for the decode side to claim the room and read it; the decode side (a read
//! on the bootstrap port) waits, bounded, for the prefill to arrive. A side that gives
//! up closes the room for the other, and a prefill leaving an unclaimed room withdraws
//! its published KV, so nothing stays pinned.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::kv::KvService;
use crate::metrics::BootstrapMetrics;

/// How often a waiting side looks again even without a wake-up (belt and braces).
const RECHECK: Duration = Duration::from_millis(250);

/// Why a side could not use a room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoomError {
    /// Another prefill already holds the room.
    #[error("bootstrap_room {0} is already in use on this prefill worker")]
    InUse(u64),
    /// Another read already claimed the room.
    #[error("bootstrap_room {0} was already claimed by a decode worker")]
    AlreadyClaimed(u64),
    /// No decode worker claimed the room in time.
    #[error("no decode worker claimed bootstrap_room {room} within {secs} s")]
    Unclaimed {
        /// The room.
        room: u64,
        /// The wait, in seconds.
        secs: u64,
    },
    /// No prefill arrived for the room in time.
    #[error("no prefill for bootstrap_room {room} arrived within {secs} s")]
    Unfilled {
        /// The room.
        room: u64,
        /// The wait, in seconds.
        secs: u64,
    },
    /// The prefill left the room before a read took its KV.
    #[error("the prefill for bootstrap_room {0} ended without KV for a decode worker")]
    PrefillGone(u64),
    /// The decode worker's read broke off.
    #[error("the KV transfer of bootstrap_room {room} failed: {reason}")]
    TransferFailed {
        /// The room.
        room: u64,
        /// What the read reported.
        reason: String,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum PrefillState {
    #[default]
    Absent,
    Running,
    Gone,
}

/// How a decode read of a room ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimEnd {
    /// Every block reached the decode worker.
    Transferred,
    /// The prefill never came, or left without KV.
    Unfilled(String),
    /// The read broke off.
    Failed(String),
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum DecodeState {
    #[default]
    Absent,
    /// A read waits for the prefill (or for its publication).
    Waiting,
    /// A read took the published blocks and is sending them.
    Reading,
    Done(ClaimEnd),
    /// The prefill gave up waiting; later reads are refused.
    Closed,
}

#[derive(Debug, Default)]
struct Room {
    prefill: PrefillState,
    decode: DecodeState,
}

impl Room {
    /// Nobody is on the room any more: it can go, and this is how it ended.
    fn outcome(&self) -> Option<&'static str> {
        let decode_busy = matches!(self.decode, DecodeState::Waiting | DecodeState::Reading);
        if decode_busy || self.prefill == PrefillState::Running {
            return None;
        }
        Some(match &self.decode {
            DecodeState::Done(ClaimEnd::Transferred) => "transferred",
            DecodeState::Done(ClaimEnd::Unfilled(_)) => "unfilled",
            DecodeState::Done(ClaimEnd::Failed(_)) => "failed",
            _ => "unclaimed",
        })
    }
}

/// The rooms of one prefill worker.
#[derive(Debug)]
pub struct RoomTable {
    rooms: Mutex<HashMap<u64, Room>>,
    /// Woken whenever a room changes.
    changed: Notify,
    metrics: Arc<crate::metrics::Metrics>,
}

impl RoomTable {
    /// An empty table counting into `metrics`.
    pub fn new(metrics: Arc<crate::metrics::Metrics>) -> Self {
        Self {
            rooms: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Room>> {
        // Every critical section leaves the table consistent.
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bootstrap_metrics(&self) -> &BootstrapMetrics {
        &self.metrics.bootstrap
    }

    /// Applies `change` to `room` (created if absent), drops the room when nobody is on
    /// it any more, and wakes the waiters.
    fn update<T>(&self, room: u64, change: impl FnOnce(&mut Room) -> T) -> T {
        let out = {
            let mut rooms = self.lock();
            let entry = rooms.entry(room).or_default();
            let out = change(entry);
            if let Some(outcome) = entry.outcome() {
                rooms.remove(&room);
                self.bootstrap_metrics().room_closed(outcome);
            }
            self.bootstrap_metrics().rooms_open.set(rooms.len() as i64);
            out
        };
        self.changed.notify_waiters();
        out
    }

    /// Rooms open now.
    pub fn open_rooms(&self) -> usize {
        self.lock().len()
    }

    /// A prefill for `room` arrived. `publication` names the KV service and id it
    /// publishes under, withdrawn if the room is left unclaimed.
    pub fn open(
        self: &Arc<Self>,
        room: u64,
        publication: Option<(Arc<KvService>, String)>,
    ) -> Result<PrefillRoom, RoomError> {
        self.update(room, |r| {
            if r.prefill != PrefillState::Absent {
                return Err(RoomError::InUse(room));
            }
            r.prefill = PrefillState::Running;
            Ok(())
        })?;
        Ok(PrefillRoom {
            table: self.clone(),
            room,
            publication,
            opened: Instant::now(),
        })
    }

    /// A decode read claims `room`; end the claim with [`RoomTable::end_claim`].
    pub fn claim(&self, room: u64) -> Result<(), RoomError> {
        self.update(room, |r| {
            if r.decode != DecodeState::Absent {
                return Err(RoomError::AlreadyClaimed(room));
            }
            r.decode = DecodeState::Waiting;
            Ok(())
        })
    }

    /// Waits until the prefill for a claimed `room` has arrived (it may still be
    /// running), at most `wait`.
    pub async fn wait_for_prefill(&self, room: u64, wait: Duration) -> Result<(), RoomError> {
        let started = Instant::now();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let state = self.lock().get(&room).map(|r| r.prefill);
            match state {
                Some(PrefillState::Running) => return Ok(()),
                Some(PrefillState::Gone) | None => return Err(RoomError::PrefillGone(room)),
                Some(PrefillState::Absent) => {}
            }
            let left = wait.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(RoomError::Unfilled {
                    room,
                    secs: wait.as_secs(),
                });
            }
            let _ = tokio::time::timeout(left.min(RECHECK), changed).await;
        }
    }

    /// The claimed `room`'s read took the published blocks.
    pub fn reading(&self, room: u64) {
        self.update(room, |r| r.decode = DecodeState::Reading);
    }

    /// The decode read of `room` ended.
    pub fn end_claim(&self, room: u64, end: ClaimEnd) {
        self.update(room, |r| r.decode = DecodeState::Done(end));
    }
}

/// A prefill's hold on its room. Dropping it (the prefill answered, failed or its
/// client left) leaves the room; KV nobody claimed is withdrawn.
#[derive(Debug)]
pub struct PrefillRoom {
    table: Arc<RoomTable>,
    room: u64,
    publication: Option<(Arc<KvService>, String)>,
    opened: Instant,
}

impl PrefillRoom {
    /// Waits until the decode worker has read the room's KV. A room nobody claimed
    /// within `wait` of the prefill's arrival is closed (later reads are refused); a
    /// claimed room waits for its read to end (bounded by the transfer's own timeouts).
    pub async fn transferred(&self, wait: Duration) -> Result<(), RoomError> {
        let room = self.room;
        loop {
            let changed = self.table.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let left = wait.saturating_sub(self.opened.elapsed());
            // Looked at without `update`: that wakes every waiter, this one included.
            let decode = self.table.lock().get(&room).map(|r| r.decode.clone());
            match decode.unwrap_or_default() {
                DecodeState::Done(ClaimEnd::Transferred) => return Ok(()),
                DecodeState::Done(ClaimEnd::Unfilled(reason) | ClaimEnd::Failed(reason)) => {
                    return Err(RoomError::TransferFailed { room, reason })
                }
                DecodeState::Absent | DecodeState::Closed if left.is_zero() => {
                    let closed = self.table.update(room, |r| {
                        let unclaimed =
                            matches!(r.decode, DecodeState::Absent | DecodeState::Closed);
                        if unclaimed {
                            r.decode = DecodeState::Closed;
                        }
                        unclaimed
                    });
                    if closed {
                        self.withdraw();
                        return Err(RoomError::Unclaimed {
                            room,
                            secs: wait.as_secs(),
                        });
                    }
                    continue;
                }
                _ => {}
            }
            let nap = if left.is_zero() {
                RECHECK
            } else {
                left.min(RECHECK)
            };
            let _ = tokio::time::timeout(nap, changed).await;
        }
    }

    fn withdraw(&self) {
        if let Some((service, id)) = &self.publication {
            if service.withdraw(id) {
                tracing::info!(
                    room = self.room,
                    "no decode worker claimed the bootstrap room; its KV is freed"
                );
            }
        }
    }
}

impl Drop for PrefillRoom {
    fn drop(&mut self) {
        let unclaimed = self.table.update(self.room, |r| {
            r.prefill = PrefillState::Gone;
            let unclaimed = matches!(r.decode, DecodeState::Absent | DecodeState::Closed);
            if unclaimed {
                r.decode = DecodeState::Closed;
            }
            unclaimed
        });
        if unclaimed {
            self.withdraw();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Arc<RoomTable> {
        Arc::new(RoomTable::new(Arc::new(crate::metrics::Metrics::new())))
    }

    fn closed(t: &RoomTable, outcome: &'static str) -> u64 {
        t.metrics
            .bootstrap
            .rooms
            .get_or_create(&vec![("outcome", outcome)])
            .get()
    }

    #[tokio::test]
    async fn a_read_then_a_prefill_meet_and_the_room_goes() {
        let t = table();
        t.claim(7).unwrap();
        assert_eq!(t.claim(7), Err(RoomError::AlreadyClaimed(7)));
        let waiting = {
            let t = t.clone();
            tokio::spawn(async move { t.wait_for_prefill(7, Duration::from_secs(5)).await })
        };
        let p = t.open(7, None).unwrap();
        assert!(matches!(t.open(7, None), Err(RoomError::InUse(7))));
        waiting.await.unwrap().unwrap();
        t.reading(7);
        t.end_claim(7, ClaimEnd::Transferred);
        p.transferred(Duration::from_secs(5)).await.unwrap();
        assert_eq!(t.open_rooms(), 1);
        drop(p);
        assert_eq!(t.open_rooms(), 0);
        assert_eq!(closed(&t, "transferred"), 1);
        assert_eq!(t.metrics.bootstrap.rooms_open.get(), 0);
    }

    #[test]
    fn a_waiting_prefill_yields_instead_of_spinning() {
        // Looking at the room once woke this very waiter, so the wait never returned
        // Pending and starved the task serving the prefill's answer.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            let pending = rt.block_on(async {
                let t = table();
                let p = t.open(5, None).unwrap();
                let wait = p.transferred(Duration::from_secs(60));
                futures::FutureExt::now_or_never(wait).is_none()
            });
            let _ = tx.send(pending);
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
    }

    #[tokio::test]
    async fn an_unclaimed_room_closes_after_the_wait_and_refuses_late_reads() {
        let t = table();
        let p = t.open(1, None).unwrap();
        let err = p.transferred(Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(err, RoomError::Unclaimed { room: 1, .. }), "{err}");
        assert_eq!(t.claim(1), Err(RoomError::AlreadyClaimed(1)));
        drop(p);
        assert_eq!(t.open_rooms(), 0);
        assert_eq!(closed(&t, "unclaimed"), 1);
    }

    #[tokio::test]
    async fn a_read_without_prefill_gives_up_and_leaves_nothing() {
        let t = table();
        t.claim(2).unwrap();
        let err = t
            .wait_for_prefill(2, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, RoomError::Unfilled { room: 2, .. }), "{err}");
        t.end_claim(2, ClaimEnd::Unfilled(err.to_string()));
        assert_eq!(t.open_rooms(), 0);
        assert_eq!(closed(&t, "unfilled"), 1);
    }

    #[tokio::test]
    async fn a_prefill_that_leaves_wakes_its_waiting_read_and_a_failed_read_fails_it() {
        let t = table();
        let p = t.open(3, None).unwrap();
        t.claim(3).unwrap();
        t.end_claim(3, ClaimEnd::Failed("connection reset".into()));
        let err = p.transferred(Duration::from_secs(5)).await.unwrap_err();
        assert!(
            matches!(err, RoomError::TransferFailed { room: 3, .. }),
            "{err}"
        );
        drop(p);
        assert_eq!((t.open_rooms(), closed(&t, "failed")), (0, 1));

        t.claim(4).unwrap();
        let p = t.open(4, None).unwrap();
        drop(p);
        let err = t.wait_for_prefill(4, Duration::from_secs(5)).await;
        assert_eq!(err, Err(RoomError::PrefillGone(4)));
        t.end_claim(4, ClaimEnd::Unfilled("gone".into()));
        assert_eq!(t.open_rooms(), 0);
    }
}
