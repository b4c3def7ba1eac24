//! A compute pool whose parallel regions finish while one of its threads is descheduled.
//!
//! With `pdserve up --core-layout shared` a prefill worker lends its cores to a decode
//! worker that runs at a higher priority, so a decode step preempts one of the prefill
//! worker's threads for its whole length. Under fork/join (rayon) every other thread then
//! waits at the end of each parallel region for the item the preempted thread holds, and
//! prefill runs at the speed of its slowest core. Here each item is computed into the
//! computing thread's own scratch and published into the output by whoever finishes it
//! first; a thread that runs out of items recomputes one held for much longer than items
//! take, so a region ends as soon as the running threads have covered it. A thread that
//! comes back late finds its item published (it checks while computing), drops its copy
//! and never touches the output. Items are pure functions of the job's inputs, so the
//! output does not depend on which thread computed which item.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Work split into items whose outputs land in disjoint parts of one output buffer.
pub(crate) trait RegionJob: Send + Sync {
    /// Number of items.
    fn items(&self) -> usize;

    /// Computes `item` into `scratch` (sized by the job), stopping early with `false` as
    /// soon as `published()` says another thread has published the item.
    fn compute(&self, item: usize, scratch: &mut Vec<f32>, published: &dyn Fn() -> bool) -> bool;

    /// Copies a computed item from `scratch` into the output.
    ///
    /// # Safety
    /// Called at most once per item, and only while [`TakeoverPool::run`] for this job has
    /// not returned (the output is alive and only this call writes the item's part).
    unsafe fn publish(&self, item: usize, scratch: &[f32]);
}

/// An item held this much longer than the region's mean item time is recomputed by an
/// idle thread (a preempted holder is typically gone for a whole decode step, ≥ 5 ms).
const LATE_FACTOR: u64 = 2;
/// Never recompute an item held for less than this.
const MIN_LATE: Duration = Duration::from_micros(300);
/// The lateness bar before any item of the region has been published.
const NO_MEAN_LATE: Duration = Duration::from_millis(5);
/// How long an idle worker spins for the next region before sleeping (regions of one
/// forward pass follow each other within microseconds, apart from attention).
const IDLE_SPIN: Duration = Duration::from_micros(200);

/// One parallel region: its job and who has done what.
struct Region {
    job: Arc<dyn RegionJob>,
    /// Next item nobody has claimed.
    next: AtomicUsize,
    /// Per item: a thread has won the right to publish it (it is being or has been copied
    /// into the output; completion is counted by `published`).
    taken: Box<[AtomicBool]>,
    /// When each item was first claimed, in ns after `epoch` (0: not yet).
    claimed_at: Box<[AtomicU64]>,
    /// Items published; the region is complete when this reaches the item count.
    published: AtomicUsize,
    /// Compute time of published items (for the lateness bar).
    busy_ns: AtomicU64,
    epoch: Instant,
}

impl Region {
    fn new(job: Arc<dyn RegionJob>) -> Self {
        let n = job.items();
        Self {
            job,
            next: AtomicUsize::new(0),
            taken: (0..n).map(|_| AtomicBool::new(false)).collect(),
            claimed_at: (0..n).map(|_| AtomicU64::new(0)).collect(),
            published: AtomicUsize::new(0),
            busy_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn now_ns(&self) -> u64 {
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }

    fn is_complete(&self) -> bool {
        self.published.load(Ordering::Acquire) == self.taken.len()
    }

    /// Claims items until none are left, then recomputes late ones until every item is
    /// published.
    fn work(&self, scratch: &mut Vec<f32>) {
        let n = self.taken.len();
        loop {
            let item = self.next.fetch_add(1, Ordering::Relaxed);
            if item >= n {
                break;
            }
            self.claimed_at[item].store(self.now_ns(), Ordering::Relaxed);
            self.compute_item(item, scratch);
        }
        let mut idle_rounds = 0u32;
        while !self.is_complete() {
            if let Some(item) = self.late_item() {
                self.compute_item(item, scratch);
                idle_rounds = 0;
                continue;
            }
            idle_rounds += 1;
            if idle_rounds < 64 {
                std::hint::spin_loop();
            } else {
                // Let a holder that shares this core run.
                std::thread::yield_now();
            }
        }
    }

    /// Computes one item and publishes it unless another thread did first.
    fn compute_item(&self, item: usize, scratch: &mut Vec<f32>) {
        let taken = &self.taken[item];
        let started = self.now_ns();
        let published = || taken.load(Ordering::Relaxed);
        if !self.job.compute(item, scratch, &published) {
            return;
        }
        if taken
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        // SAFETY: `taken` went false → true once, here; the caller of `run`
        // waits until every item is counted in `published`, which this one is only after
        // the copy.
        unsafe { self.job.publish(item, scratch) };
        self.busy_ns
            .fetch_add(self.now_ns().saturating_sub(started), Ordering::Relaxed);
        self.published.fetch_add(1, Ordering::AcqRel);
    }

    /// The longest-held unpublished item, if it has been held past the lateness bar.
    fn late_item(&self) -> Option<usize> {
        let published = self.published.load(Ordering::Relaxed) as u64;
        let bar = match published {
            // No item time to go by yet (the holders got every item): wait about as long
            // as a decode step would keep a holder away.
            0 => NO_MEAN_LATE.as_nanos() as u64,
            n => (LATE_FACTOR * self.busy_ns.load(Ordering::Relaxed) / n)
                .max(MIN_LATE.as_nanos() as u64),
        };
        let now = self.now_ns();
        (0..self.taken.len())
            .filter(|&i| !self.taken[i].load(Ordering::Relaxed))
            .filter_map(|i| {
                let at = self.claimed_at[i].load(Ordering::Relaxed);
                (at != 0 && now.saturating_sub(at) > bar).then_some((at, i))
            })
            .min()
            .map(|(_, i)| i)
    }
}

/// What the workers watch: the newest region, numbered.
struct Slot {
    generation: u64,
    region: Option<Arc<Region>>,
    stop: bool,
}

struct Shared {
    slot: Mutex<Slot>,
    wake: Condvar,
    /// `slot.generation`, readable without the lock while spinning.
    generation: AtomicU64,
}

/// Threads that join the caller of [`TakeoverPool::run`] on its region.
pub(crate) struct TakeoverPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

thread_local! {
    /// The calling thread's item scratch, reused across regions.
    static CALLER_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl TakeoverPool {
    /// A pool whose regions run on the caller plus `workers` threads.
    pub(crate) fn new(workers: usize) -> Self {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                generation: 0,
                region: None,
                stop: false,
            }),
            wake: Condvar::new(),
            generation: AtomicU64::new(0),
        });
        let workers = (0..workers)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("pdserve-compute-{i}"))
                    .spawn(move || {
                        // Slot 0 is the caller's; the workers take the rest of the cores.
                        crate::threads::place_takeover_thread(i + 1);
                        worker_loop(&shared)
                    })
                    .expect("spawning a compute thread")
            })
            .collect();
        Self { shared, workers }
    }

    /// The process's pool: one thread per compute core, caller included (the rayon
    /// pool's size, plus any borrowed cores).
    pub(crate) fn global() -> &'static TakeoverPool {
        static POOL: OnceLock<TakeoverPool> = OnceLock::new();
        POOL.get_or_init(|| TakeoverPool::new(crate::threads::takeover_workers()))
    }

    /// Runs every item of `job` on the caller and the pool's threads; returns once every
    /// item is published. Callers on several threads at once are served one region at a
    /// time by the workers; the others compute their regions alone.
    pub(crate) fn run(&self, job: Arc<dyn RegionJob>) {
        let region = Arc::new(Region::new(job));
        let generation = {
            let mut slot = self.shared.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.generation += 1;
            slot.region = Some(Arc::clone(&region));
            self.shared
                .generation
                .store(slot.generation, Ordering::Release);
            slot.generation
        };
        self.shared.wake.notify_all();
        CALLER_SCRATCH.with(|scratch| region.work(&mut scratch.borrow_mut()));
        // Drop the slot's hold on the job (and its inputs) unless a newer region took it.
        let mut slot = self.shared.slot.lock().unwrap_or_else(|e| e.into_inner());
        if slot.generation == generation {
            slot.region = None;
        }
    }
}

impl Drop for TakeoverPool {
    fn drop(&mut self) {
        self.shared
            .slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stop = true;
        self.shared.generation.fetch_add(1, Ordering::Release);
        self.shared.wake.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn worker_loop(shared: &Shared) {
    let mut seen = 0u64;
    let mut scratch = Vec::new();
    loop {
        let spin_until = Instant::now() + IDLE_SPIN;
        while shared.generation.load(Ordering::Acquire) == seen && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
        let region = {
            let mut slot = shared.slot.lock().unwrap_or_else(|e| e.into_inner());
            while slot.generation == seen && !slot.stop {
                slot = shared.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
            }
            if slot.stop {
                return;
            }
            seen = slot.generation;
            slot.region.clone()
        };
        if let Some(region) = region {
            region.work(&mut scratch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;
    use std::thread::ThreadId;

    /// Item `i` is `len` copies of `i * 10 + attempt-independent value`; the first attempt
    /// at an item by a thread other than `caller` can be made to block until released.
    struct TestJob {
        items: usize,
        len: usize,
        out: *mut f32,
        caller: ThreadId,
        /// Block a worker's first item until this is set.
        release: Arc<AtomicBool>,
        blocked: Arc<AtomicUsize>,
        /// Value a blocked (late) attempt would write, to catch a late publish.
        late_value: f32,
        /// Set once a worker has claimed an item.
        worker_started: Arc<AtomicBool>,
    }

    // SAFETY: `out` is written only through `publish`, per item, while `run` waits.
    unsafe impl Send for TestJob {}
    unsafe impl Sync for TestJob {}

    impl RegionJob for TestJob {
        fn items(&self) -> usize {
            self.items
        }

        fn compute(
            &self,
            item: usize,
            scratch: &mut Vec<f32>,
            published: &dyn Fn() -> bool,
        ) -> bool {
            scratch.clear();
            let mut value = (item * 10) as f32;
            if std::thread::current().id() == self.caller {
                // Give the worker time to claim an item before the caller takes them all.
                let until = Instant::now() + Duration::from_secs(5);
                while !self.worker_started.load(Ordering::SeqCst) && Instant::now() < until {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(1));
            } else {
                self.worker_started.store(true, Ordering::SeqCst);
                if self.blocked.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The "preempted" attempt: held until the region is over.
                    while !self.release.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    // Were it to publish, the output would show this value.
                    value = self.late_value;
                }
            }
            if published() {
                return false;
            }
            scratch.resize(self.len, value);
            true
        }

        unsafe fn publish(&self, item: usize, scratch: &[f32]) {
            std::ptr::copy_nonoverlapping(
                scratch.as_ptr(),
                self.out.add(item * self.len),
                self.len,
            );
        }
    }

    #[test]
    fn a_region_finishes_while_a_worker_holds_an_item() {
        let pool = TakeoverPool::new(1);
        let (items, len) = (8, 5);
        let mut out = vec![-1f32; items * len];
        let release = Arc::new(AtomicBool::new(false));
        let job = Arc::new(TestJob {
            items,
            len,
            out: out.as_mut_ptr(),
            caller: std::thread::current().id(),
            release: Arc::clone(&release),
            blocked: Arc::new(AtomicUsize::new(0)),
            late_value: 999.0,
            worker_started: Arc::new(AtomicBool::new(false)),
        });
        // Bounded: without takeover `run` would wait for `release` forever.
        let (done_tx, done_rx) = mpsc::channel();
        let watchdog_release = Arc::clone(&release);
        let watchdog = std::thread::spawn(move || {
            let finished = done_rx.recv_timeout(Duration::from_secs(30)).is_ok();
            watchdog_release.store(true, Ordering::SeqCst);
            finished
        });
        pool.run(job.clone());
        done_tx.send(()).unwrap();
        assert!(
            watchdog.join().unwrap(),
            "the region waited for the held item"
        );
        let expected: Vec<f32> = (0..items)
            .flat_map(|i| std::iter::repeat_n((i * 10) as f32, len))
            .collect();
        assert_eq!(out, expected);
        // The held attempt comes back, sees its item published and writes nothing.
        release.store(true, Ordering::SeqCst);
        drop(pool); // joins the worker, so its late attempt has ended
        assert_eq!(out, expected);
        assert_eq!(job.blocked.load(Ordering::SeqCst), 1);
    }

    struct Squares {
        out: *mut f32,
    }

    // SAFETY: as for `TestJob`.
    unsafe impl Send for Squares {}
    unsafe impl Sync for Squares {}

    impl RegionJob for Squares {
        fn items(&self) -> usize {
            1000
        }

        fn compute(&self, item: usize, scratch: &mut Vec<f32>, _: &dyn Fn() -> bool) -> bool {
            scratch.clear();
            scratch.push((item * item) as f32);
            true
        }

        unsafe fn publish(&self, item: usize, scratch: &[f32]) {
            *self.out.add(item) = scratch[0];
        }
    }

    #[test]
    fn concurrent_callers_each_get_every_item() {
        let pool = Arc::new(TakeoverPool::new(1));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let mut out = vec![0f32; 1000];
                        pool.run(Arc::new(Squares {
                            out: out.as_mut_ptr(),
                        }));
                        assert!(out.iter().enumerate().all(|(i, &v)| v == (i * i) as f32));
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.join().unwrap();
        }
    }
}
