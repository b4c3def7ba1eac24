//! The prompts this gateway just sent to workers, for the whole fleet in one map: block
//! key → the workers it went to, and when. A routing decision looks a prompt's blocks up
//! once, not once per candidate: a new prompt is one lookup for a fleet of 128, where a
//! map per worker cost two cache misses per candidate.
//!
//! Only every `SENT_STRIDE`th block of a sent prompt (and its last) is kept: a new
//! 8k-token prompt is 512 blocks, and keeping each cost most of a decision. A prompt
//! that shares a sent one's start is matched to the last kept block they share, so it
//! may count up to `SENT_STRIDE - 1` blocks fewer than it shares; the worker's events
//! replace the estimate within a scheduler step or two.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::fleet::kv_events::{BlockIndex, BlockKey};
use crate::fleet::registry::{url_id, Worker};

/// How long a prompt sent to a worker counts as cached there before its events say so.
pub(crate) const PENDING_FOR: Duration = Duration::from_secs(10);

/// Blocks kept for the fleet (a prompt's every `SENT_STRIDE`th block and its last):
/// 64M tokens sent within `PENDING_FOR`, what some hundred H100s prefill.
pub(crate) const PENDING_BLOCKS: usize = 262_144;

/// Every how many blocks of a sent prompt are kept.
const SENT_STRIDE: usize = 8;

/// How many blocks of a prompt of `blocks` blocks are kept.
pub(crate) fn remembered_of(blocks: usize) -> usize {
    blocks.div_ceil(SENT_STRIDE)
}

/// Whether block `position` of a prompt of `blocks` blocks is kept.
fn remembered(position: usize, blocks: usize) -> bool {
    (position + 1).is_multiple_of(SENT_STRIDE) || position + 1 == blocks
}

/// A worker as the map names it: its URL's id (see [`url_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recipient(u64);

impl Recipient {
    /// The name of the worker at `base`.
    pub(crate) fn of(base: &str) -> Self {
        Self(url_id(base))
    }

    /// The name of `worker`.
    pub(crate) fn worker(worker: &Worker) -> Self {
        Self(worker.id())
    }
}

/// Who one block went to, and when (each worker once, at its newest send). Inline for
/// one: dropping a generation then frees no more than its table.
type Sends = smallvec::SmallVec<[(Recipient, Instant); 1]>;

type Generation = HashMap<BlockKey, Sends, foldhash::fast::FixedState>;

/// Blocks sent to the fleet, in two generations: sends go to the current one, which
/// becomes the previous one (the older is dropped) once it is `PENDING_FOR` old or holds
/// half of `PENDING_BLOCKS`.
#[derive(Debug)]
pub(crate) struct SentBlocks {
    current: Generation,
    previous: Generation,
    /// When `current` took its first send.
    since: Instant,
}

impl Default for SentBlocks {
    fn default() -> Self {
        Self {
            current: Generation::default(),
            previous: Generation::default(),
            since: Instant::now(),
        }
    }
}

impl SentBlocks {
    /// Notes that block `key` went to `to` at `now`.
    fn put(&mut self, key: BlockKey, to: Recipient, now: Instant) {
        if self.current.len() >= PENDING_BLOCKS / 2 || now.duration_since(self.since) >= PENDING_FOR
        {
            // The dropped generation's table is emptied and written again, not freed
            // and allocated afresh: a fresh table of some MiB faults a page on each of
            // its first sends, which was most of a routing decision's p99.
            let mut recycled = std::mem::take(&mut self.previous);
            recycled.clear();
            self.previous = std::mem::replace(&mut self.current, recycled);
            self.since = now;
        }
        let sends = self.current.entry(key).or_default();
        match sends.iter_mut().find(|(r, _)| *r == to) {
            Some(send) => send.1 = now,
            None => sends.push((to, now)),
        }
    }

    /// Notes that the prompt of `keys` went to `to` at `now`, from block `from` on (the
    /// blocks before it the worker held).
    pub(crate) fn record(&mut self, to: Recipient, keys: &[BlockKey], from: usize, now: Instant) {
        for (position, key) in keys.iter().enumerate().skip(from) {
            if remembered(position, keys.len()) {
                self.put(*key, to, now);
            }
        }
    }

    /// Forgets that the prompt of `keys` went to `to`: the worker refused it or never
    /// got it. A send of the same blocks to `to` by another request goes too (the map
    /// keeps one send per worker); that worker's events restore it within a step or two.
    pub(crate) fn forget(&mut self, to: Recipient, keys: &[BlockKey]) {
        for (position, key) in keys.iter().enumerate() {
            if !remembered(position, keys.len()) {
                continue;
            }
            for generation in [&mut self.current, &mut self.previous] {
                if let Some(sends) = generation.get_mut(key) {
                    sends.retain(|(r, _)| *r != to);
                    if sends.is_empty() {
                        generation.remove(key);
                    }
                }
            }
        }
    }

    /// The newest send of `key` to `to`.
    #[cfg(test)]
    fn sent_at(&self, key: &BlockKey, to: Recipient) -> Option<Instant> {
        newest([self.current.get(key), self.previous.get(key)], to)
    }

    /// Drops what went to workers `live` says are gone.
    pub(crate) fn retain(&mut self, live: impl Fn(Recipient) -> bool) {
        for generation in [&mut self.current, &mut self.previous] {
            generation.retain(|_, sends| {
                sends.retain(|(to, _)| live(*to));
                !sends.is_empty()
            });
        }
    }

    /// Blocks kept in both generations.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// A prompt's blocks, to be matched against what went to each candidate in turn.
    pub(crate) fn prompt<'a>(&'a self, keys: &'a [BlockKey]) -> SentPrompt<'a> {
        SentPrompt {
            sent: self,
            keys,
            found: vec![None; keys.len()],
        }
    }
}

/// The newest of the sends in `generations` that went to `to`.
fn newest(generations: [Option<&Sends>; 2], to: Recipient) -> Option<Instant> {
    generations
        .into_iter()
        .flatten()
        .flat_map(|sends| sends.iter())
        .filter(|(r, _)| *r == to)
        .map(|(_, at)| *at)
        .max()
}

/// One prompt's blocks against [`SentBlocks`]: each block is looked up once, whichever
/// candidate asks first.
#[derive(Debug)]
pub(crate) struct SentPrompt<'a> {
    sent: &'a SentBlocks,
    keys: &'a [BlockKey],
    found: Vec<Option<[Option<&'a Sends>; 2]>>,
}

impl SentPrompt<'_> {
    fn sends(&mut self, position: usize) -> [Option<&Sends>; 2] {
        let (sent, key) = (self.sent, &self.keys[position]);
        *self.found[position].get_or_insert_with(|| [sent.current.get(key), sent.previous.get(key)])
    }

    /// Blocks from block `first` on that went to `to` within `PENDING_FOR` of `now` and
    /// that its `index` (locked only when a send matches) has not removed since: it
    /// cached them, then evicted them, so they are gone however recently sent. Keys
    /// chain over their prefix, so a sent block past the ones an index holds continues
    /// that same prefix.
    pub(crate) fn prefix<I: std::ops::Deref<Target = BlockIndex>>(
        &mut self,
        to: Recipient,
        first: usize,
        mut index: impl FnMut() -> Option<I>,
        now: Instant,
    ) -> usize {
        let blocks = self.keys.len();
        let mut locked = None;
        let mut matched = first;
        for position in first..blocks {
            if !remembered(position, blocks) {
                continue;
            }
            let Some(at) = newest(self.sends(position), to) else {
                break;
            };
            if now.duration_since(at) >= PENDING_FOR {
                break;
            }
            let index = locked.get_or_insert_with(&mut index);
            if index
                .as_deref()
                .is_some_and(|i| i.removed_since(&self.keys[position], at))
            {
                break;
            }
            matched = position + 1;
        }
        matched - first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey).collect()
    }

    #[test]
    fn sends_keep_two_generations_and_the_newest_send_of_a_block() {
        let (a, b) = (Recipient::of("http://a"), Recipient::of("http://b"));
        let t0 = Instant::now();
        let mut sent = SentBlocks {
            since: t0,
            ..SentBlocks::default()
        };
        let half = PENDING_BLOCKS as u64 / 2;
        for i in 0..half {
            sent.put(BlockKey(i), a, t0);
        }
        let t1 = t0 + Duration::from_millis(1);
        // A full generation becomes the previous one; a block sent again is found at its
        // newest send, and to another worker it is a second send.
        sent.put(BlockKey(0), a, t1);
        sent.put(BlockKey(0), b, t1);
        assert_eq!(sent.sent_at(&BlockKey(0), a), Some(t1));
        assert_eq!(sent.sent_at(&BlockKey(0), b), Some(t1));
        assert_eq!(sent.sent_at(&BlockKey(1), a), Some(t0));
        assert_eq!(sent.sent_at(&BlockKey(1), b), None);
        for i in half..2 * half {
            sent.put(BlockKey(i), a, t1);
        }
        // The third generation drops the first.
        assert_eq!(sent.sent_at(&BlockKey(1), a), None, "the oldest sends left");
        assert_eq!(sent.sent_at(&BlockKey(0), a), Some(t1));
        assert!(sent.len() <= PENDING_BLOCKS);
        // Once a generation is `PENDING_FOR` old it turns over with the next send.
        let late = t1 + PENDING_FOR;
        sent.put(BlockKey(u64::MAX), a, late);
        sent.put(BlockKey(u64::MAX - 1), a, late + PENDING_FOR);
        assert_eq!(sent.sent_at(&BlockKey(0), a), None);
        assert_eq!(sent.sent_at(&BlockKey(u64::MAX), a), Some(late));
        assert_eq!(sent.len(), 2);
        // A worker that left takes its sends along.
        sent.retain(|r| r != a);
        assert_eq!(sent.len(), 0);
    }

    #[test]
    fn a_prompt_sharing_a_sent_ones_start_matches_to_its_last_kept_block() {
        let (a, b) = (Recipient::of("http://a"), Recipient::of("http://b"));
        let t0 = Instant::now();
        let mut sent = SentBlocks::default();
        let prompt = keys(0..20);
        sent.record(a, &prompt, 0, t0);
        assert_eq!(sent.len(), remembered_of(20));
        let now = t0 + Duration::from_millis(1);
        let no_index = || None::<&BlockIndex>;
        let mut same = sent.prompt(&prompt);
        // The same prompt, all of it; nothing went to b.
        assert_eq!(same.prefix(a, 0, no_index, now), 20);
        assert_eq!(same.prefix(b, 0, no_index, now), 0);
        // From past what an index holds (block 3 on).
        assert_eq!(same.prefix(a, 3, no_index, now), 17);
        // Too old to count.
        assert_eq!(same.prefix(a, 0, no_index, t0 + PENDING_FOR), 0);
        // Its first 18 blocks then others: matched to block 16 (the 2nd kept).
        let mut other = prompt[..18].to_vec();
        other.extend(keys(100..104));
        assert_eq!(sent.prompt(&other).prefix(a, 0, no_index, now), 16);
        // Sent from block 12 on (it held the first 12): kept are 15 and 19.
        let mut later = SentBlocks::default();
        later.record(b, &prompt, 12, t0);
        assert_eq!(later.len(), 2);
        assert_eq!(later.prompt(&prompt).prefix(b, 12, no_index, now), 8);
        assert_eq!(later.prompt(&prompt).prefix(b, 0, no_index, now), 0);
        // Refused by b: forgotten there, still sent to a.
        sent.record(b, &prompt, 0, t0);
        sent.forget(b, &prompt);
        assert_eq!(sent.prompt(&prompt).prefix(b, 0, no_index, now), 0);
        assert_eq!(sent.prompt(&prompt).prefix(a, 0, no_index, now), 20);
        sent.forget(a, &prompt);
        assert_eq!(sent.len(), 0, "a block goes with its last send");
    }
}
