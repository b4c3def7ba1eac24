//! A prefill's prompt KV offered block by block while the prefill still runs, to a
//! reader that is already waiting for it (a publication under a reader-chosen id: the
//! orchestrator's concurrent handoff, an SGLang bootstrap room).
//!
//! The scheduler copies each block out of the KV pool on its own thread, right after
//! the chunk that completed it, and only once a reader is attached: the copy is taken
//! while the sequence still references the block, so nothing can free or reuse it
//! mid-copy, and no pin is taken for blocks in flight. The reader takes the copies in order and
//! sends them; the last (possibly partial) block is copied when the prompt's last chunk
//! is computed. A prefill that never completes closes the feed and the reader fails.
//!
//! Shared by the scheduler (which fills it) and the KV service (which drains it), so it
//! lives below both.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pdserve_kv_transfer::ReusedTokens;
use pdserve_model::BLOCK_SIZE;
use tokio::sync::Notify;

/// Whether a reader may take a feed's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attach {
    /// This reader now gets every block, as it is computed.
    Attached,
    /// The prompt was computed before any reader came: read the publication instead.
    TooLate,
    /// Another reader has it, or had it, or the prefill ended without completing.
    Refused,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Reader {
    #[default]
    None,
    Attached,
    /// The reader left; nobody else may attach.
    Gone,
}

#[derive(Debug, Default)]
struct FeedState {
    reader: Reader,
    /// Tokens the prefill did not compute itself, known once it is admitted.
    reused: Option<ReusedTokens>,
    /// Blocks copied so far, by index; `None` once the reader took one.
    blocks: Vec<Option<Vec<u8>>>,
    /// When the prompt's last chunk was computed.
    completed: Option<Instant>,
    /// Blocks taken while the prompt was still being computed.
    early: usize,
    /// The prefill ended (published, failed or cancelled): no block comes any more.
    closed: bool,
    /// The reader gave up waiting for a block.
    gave_up: bool,
}

/// One prefill's prompt KV, fed to at most one reader as it is computed.
pub struct KvFeed {
    /// The tokens whose KV is fed: the prompt.
    tokens: Vec<u32>,
    state: Mutex<FeedState>,
    changed: Notify,
}

impl std::fmt::Debug for KvFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("KvFeed")
            .field("tokens", &self.tokens.len())
            .field("reader", &st.reader)
            .field("copied", &st.blocks.len())
            .field("completed", &st.completed.is_some())
            .field("closed", &st.closed)
            .finish()
    }
}

/// Why a fed block will not come.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    /// The prefill ended without computing it (failed, cancelled, client gone).
    #[error("the prefill ended before KV block {0} was computed")]
    Ended(usize),
    /// It was not computed within the wait.
    #[error("KV block {index} was not computed within {wait:?}")]
    TimedOut {
        /// The block.
        index: usize,
        /// The wait.
        wait: Duration,
    },
}

impl KvFeed {
    /// A feed of `prompt`'s KV; nothing is copied until a reader attaches.
    pub fn new(prompt: Vec<u32>) -> Self {
        Self {
            tokens: prompt,
            state: Mutex::default(),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FeedState> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tokens whose KV is fed.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn total_blocks(&self) -> usize {
        self.tokens.len().div_ceil(BLOCK_SIZE)
    }

    // The scheduler's side (its thread; never blocks on the reader).

    /// The sequence was admitted: `reused` of its prompt tokens it will not compute.
    pub fn admitted(&self, reused: ReusedTokens) {
        let mut st = self.lock();
        if st.reused.is_none() {
            st.reused = Some(reused);
            drop(st);
            self.changed.notify_waiters();
        }
    }

    /// The first `computed` prompt tokens have KV: copies the full blocks not copied
    /// yet (`copy` reads block `i`), when a reader is attached.
    pub fn offer(&self, computed: usize, copy: impl FnMut(usize) -> Vec<u8>) {
        let full = computed.min(self.tokens.len()) / BLOCK_SIZE;
        self.copy_up_to(full, copy, false);
    }

    /// The whole prompt has KV: copies what is left, the last partial block included,
    /// and marks the prompt complete.
    pub fn complete(&self, copy: impl FnMut(usize) -> Vec<u8>) {
        self.copy_up_to(self.total_blocks(), copy, true);
    }

    fn copy_up_to(&self, end: usize, mut copy: impl FnMut(usize) -> Vec<u8>, complete: bool) {
        let mut st = self.lock();
        // Copied under the lock, so a reader attaching meanwhile either sees the prompt
        // complete (and reads the publication) or gets every block from here.
        let copying = st.reader == Reader::Attached && !st.closed;
        let before = st.blocks.len();
        if copying {
            for i in before..end {
                st.blocks.push(Some(copy(i)));
            }
        }
        if complete && st.completed.is_none() {
            st.completed = Some(Instant::now());
        }
        let news = st.blocks.len() > before || complete;
        drop(st);
        if news {
            self.changed.notify_waiters();
        }
    }

    /// Whether a reader takes every block from this feed, so the prompt's publication
    /// will not be read for them.
    pub fn has_reader(&self) -> bool {
        let st = self.lock();
        st.reader == Reader::Attached && !st.closed && !st.gave_up
    }

    // The prefill's publication side.

    /// The prefill ended (published, failed or cancelled): a waiting reader gets what
    /// was computed and no more.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        if st.completed.is_none() {
            // Nothing more comes; the reader fails at the first missing block.
            st.blocks.clear();
        }
        drop(st);
        self.changed.notify_waiters();
    }

    // The reader's side.

    /// Attaches the one reader.
    pub fn attach(&self) -> Attach {
        let mut st = self.lock();
        match (st.reader, st.completed, st.closed) {
            (Reader::None, None, false) => {
                st.reader = Reader::Attached;
                Attach::Attached
            }
            (Reader::None, Some(_), _) => Attach::TooLate,
            _ => Attach::Refused,
        }
    }

    /// The reader left: nothing more is copied, and what was is dropped.
    pub fn detach(&self) {
        let mut st = self.lock();
        st.reader = Reader::Gone;
        st.blocks.clear();
    }

    /// Waits, at most `wait`, until the prefill was admitted; its reused tokens, or
    /// `None` when it ended first or the wait ran out.
    pub async fn admitted_within(&self, wait: Duration) -> Option<ReusedTokens> {
        let started = Instant::now();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let st = self.lock();
                if let Some(reused) = st.reused {
                    return Some(reused);
                }
                if st.closed {
                    return None;
                }
            }
            let left = wait.saturating_sub(started.elapsed());
            if left.is_zero() {
                return None;
            }
            let _ = tokio::time::timeout(left, changed).await;
        }
    }

    /// Takes block `index` once it is copied, waiting at most `wait` for it.
    pub async fn take(&self, index: usize, wait: Duration) -> Result<Vec<u8>, FeedError> {
        let started = Instant::now();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut st = self.lock();
                let early = st.completed.is_none();
                if let Some(block) = st.blocks.get_mut(index).and_then(Option::take) {
                    st.early += early as usize;
                    return Ok(block);
                }
                if st.closed || st.completed.is_some() {
                    return Err(FeedError::Ended(index));
                }
            }
            let left = wait.saturating_sub(started.elapsed());
            if left.is_zero() {
                self.lock().gave_up = true;
                return Err(FeedError::TimedOut { index, wait });
            }
            let _ = tokio::time::timeout(left, changed).await;
        }
    }

    /// Whether the reader gave up waiting for a block (the prefill was too slow).
    pub fn gave_up(&self) -> bool {
        self.lock().gave_up
    }

    /// When the prompt's last chunk was computed, if it was.
    pub fn completed_at(&self) -> Option<Instant> {
        self.lock().completed
    }

    /// Blocks the reader took before the prompt was complete (sent while the prefill
    /// was still computing).
    pub fn taken_early(&self) -> usize {
        self.lock().early
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(i: usize) -> Vec<u8> {
        vec![i as u8; 4]
    }

    #[tokio::test]
    async fn an_attached_reader_gets_each_block_as_it_is_computed_then_the_tail() {
        let feed = KvFeed::new((0..40).collect()); // 2 full blocks, 8 tokens more
        feed.offer(16, block); // nobody attached: nothing copied
        assert_eq!(feed.attach(), Attach::Attached);
        assert_eq!(feed.attach(), Attach::Refused, "one reader");
        feed.admitted(ReusedTokens::default());
        assert!(feed.admitted_within(Duration::ZERO).await.is_some());
        feed.offer(20, block); // the block computed before the reader came is copied now
        assert_eq!(feed.take(0, Duration::ZERO).await, Ok(block(0)));
        let wait = Duration::from_millis(20);
        assert!(matches!(
            feed.take(1, wait).await,
            Err(FeedError::TimedOut { index: 1, .. })
        ));
        feed.offer(32, block);
        feed.complete(block);
        assert_eq!(feed.take(1, Duration::ZERO).await, Ok(block(1)));
        assert_eq!(feed.take(2, Duration::ZERO).await, Ok(block(2)));
        assert_eq!(feed.taken_early(), 1);
        assert!(feed.completed_at().is_some());
        // Closing after completion (the publication) keeps nothing from the reader.
        feed.close();
        assert_eq!(feed.take(3, Duration::ZERO).await, Err(FeedError::Ended(3)));
    }

    #[tokio::test]
    async fn a_prefill_that_ends_early_fails_its_reader_and_late_readers_read_elsewhere() {
        let feed = std::sync::Arc::new(KvFeed::new((0..40).collect()));
        assert_eq!(feed.attach(), Attach::Attached);
        let waiting = {
            let feed = feed.clone();
            tokio::spawn(async move { feed.take(0, Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        feed.close();
        assert_eq!(waiting.await.unwrap(), Err(FeedError::Ended(0)));
        assert_eq!(feed.admitted_within(Duration::from_secs(10)).await, None);

        let late = KvFeed::new((0..40).collect());
        late.complete(block);
        assert_eq!(late.attach(), Attach::TooLate);
        let left = KvFeed::new((0..40).collect());
        assert_eq!(left.attach(), Attach::Attached);
        left.detach();
        left.offer(32, |_| panic!("nothing is copied for a reader that left"));
        assert_eq!(left.attach(), Attach::Refused);
    }
}
