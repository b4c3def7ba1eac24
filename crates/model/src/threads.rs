//! Thread-count control for candle's compute pools, and which core each compute thread
//! runs on.

use std::sync::OnceLock;

/// How much nicer than the rest of its process a compute thread on a borrowed core runs:
/// at 10 the lending worker's thread outweighs it about nine to one (CFS weights 1024
/// and 110), so the lender's steps preempt it almost at once.
pub const BORROWED_NICE: i32 = 10;

/// The cores a worker's compute threads are pinned to, one thread per core.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ComputeCores {
    /// The worker's own cores: its compute threads there run at its own priority.
    pub own: Vec<usize>,
    /// Cores another worker lends it (a decode worker's, under `pdserve up`'s shared
    /// layout): its compute threads there run [`BORROWED_NICE`] nicer, so they take only
    /// what the lender leaves idle and nothing from the rest of the machine's share.
    pub borrowed: Vec<usize>,
}

impl ComputeCores {
    /// One compute thread per core, own cores first.
    pub fn threads(&self) -> usize {
        self.own.len() + self.borrowed.len()
    }

    /// The core of compute slot `index` and whether it is borrowed.
    fn slot(&self, index: usize) -> Option<(usize, bool)> {
        let n = self.threads();
        if n == 0 {
            return None;
        }
        let i = index % n;
        Some(match self.own.get(i) {
            Some(&core) => (core, false),
            None => (self.borrowed[i - self.own.len()], true),
        })
    }
}

/// The cores set by [`set_compute_cores`], if any.
static CORES: OnceLock<ComputeCores> = OnceLock::new();

/// Sets how many threads the forward pass uses (candle's matmul pool, the rayon pool
/// its GEMM, our attention and decode matmuls run on, and the prefill matmuls' takeover
/// pool, sized from rayon's). The pools spin-wait briefly between tasks, so two engines
/// sharing cores must each get their own share.
///
/// Must be called before the first model is loaded or run: the pools are created once per
/// process. Returns `false` if the rayon pool already existed (the count then stays as it was).
pub fn set_threads(n: usize) -> bool {
    let n = n.max(1);
    set_thread_env(n);
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .is_ok()
}

/// As [`set_threads`] with one compute thread per core of `cores`, each pinned to its
/// core, those on borrowed cores at a lower priority. The thread that calls the forward
/// pass takes part in it: pin it with [`pin_to_own_cores`].
///
/// Only the takeover pool (the prefill matmuls, most of a prefill's work) computes on
/// borrowed cores: its regions finish without a preempted thread. The rayon pool's
/// fork/join regions (attention, candle's GEMM) wait for every thread they split to, so
/// they stay on the own cores, where no lender's step can hold one of them back.
///
/// Returns `false` if the pools already existed (nothing is pinned then).
pub fn set_compute_cores(cores: ComputeCores) -> bool {
    let own = cores.own.len().max(1);
    if CORES.set(cores).is_err() {
        return false;
    }
    set_thread_env(own);
    rayon::ThreadPoolBuilder::new()
        .num_threads(own)
        .start_handler(place_rayon_thread)
        .build_global()
        .is_ok()
}

/// How many threads the takeover pool adds to the caller: one per own or borrowed core
/// but the caller's, or the rayon pool's size without [`set_compute_cores`].
pub(crate) fn takeover_workers() -> usize {
    match CORES.get() {
        Some(cores) => cores.threads().saturating_sub(1),
        None => rayon::current_num_threads().saturating_sub(1),
    }
}

/// Pins rayon thread `index` to own core `index` (wrapping).
fn place_rayon_thread(index: usize) {
    if let Some(cores) = CORES.get().filter(|c| !c.own.is_empty()) {
        os::pin_current(&[cores.own[index % cores.own.len()]]);
    }
}

fn set_thread_env(n: usize) {
    // candle reads these once, when its pools are first used.
    std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
}

/// Pins the calling thread to the worker's own cores (anywhere it was when none are set):
/// the thread that runs the forward pass computes beside the pool's threads.
pub fn pin_to_own_cores() {
    if let Some(cores) = CORES.get() {
        if !cores.own.is_empty() {
            os::pin_current(&cores.own);
        }
    }
}

/// Pins takeover thread `index` to its core (slot `index` of [`ComputeCores`], wrapping;
/// slot 0 is the caller's), lowering its priority when that core is borrowed. A no-op
/// unless [`set_compute_cores`] ran.
pub(crate) fn place_takeover_thread(index: usize) {
    let Some((core, borrowed)) = CORES.get().and_then(|c| c.slot(index)) else {
        return;
    };
    os::pin_current(&[core]);
    if borrowed {
        os::lower_current_priority(BORROWED_NICE);
    }
}

#[cfg(target_os = "linux")]
mod os {
    /// Pins the calling thread to `cores`; a core outside the process's cpuset is
    /// refused by the kernel and leaves the thread where it was, with a warning.
    pub(super) fn pin_current(cores: &[usize]) {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_setaffinity(0) touches
        // only the calling thread.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cores {
                libc::CPU_SET(c, &mut set);
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            tracing::warn!(?cores, %err, "cannot pin a compute thread to its cores");
        }
    }

    /// Makes the calling thread `by` nicer than it is (Linux's niceness is per thread);
    /// raising niceness needs no privilege.
    pub(super) fn lower_current_priority(by: i32) {
        // SAFETY: gettid, getpriority and setpriority on the calling thread's own id.
        let rc = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            *libc::__errno_location() = 0;
            let now = libc::getpriority(libc::PRIO_PROCESS, tid);
            if now == -1 && *libc::__errno_location() != 0 {
                -1
            } else {
                libc::setpriority(libc::PRIO_PROCESS, tid, (now + by).min(19))
            }
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            tracing::warn!(%err, "cannot lower a borrowed compute thread's priority");
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod os {
    pub(super) fn pin_current(_cores: &[usize]) {
        tracing::warn!("compute threads are pinned to cores on Linux only");
    }

    pub(super) fn lower_current_priority(_by: i32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_take_own_cores_first_then_borrowed_ones() {
        let cores = ComputeCores {
            own: vec![0],
            borrowed: vec![2, 3],
        };
        assert_eq!(cores.threads(), 3);
        let slots: Vec<_> = (0..4).map(|i| cores.slot(i)).collect();
        assert_eq!(
            slots,
            vec![
                Some((0, false)),
                Some((2, true)),
                Some((3, true)),
                Some((0, false))
            ]
        );
        assert_eq!(ComputeCores::default().slot(0), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_borrowed_slot_runs_nicer_than_its_process() {
        // A thread of its own, so the test's thread keeps its priority.
        let (before, after) = std::thread::spawn(|| {
            let nice = || unsafe {
                libc::getpriority(libc::PRIO_PROCESS, libc::syscall(libc::SYS_gettid) as _)
            };
            let before = nice();
            os::lower_current_priority(BORROWED_NICE);
            (before, nice())
        })
        .join()
        .unwrap();
        assert_eq!(after, (before + BORROWED_NICE).min(19));
    }
}
