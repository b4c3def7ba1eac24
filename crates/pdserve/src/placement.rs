//! Which cores, and at which scheduling priority, each worker `pdserve up` starts runs on.

use pdserve_protocol::WorkerRole;

/// How much nicer than decode workers prefill workers run under [`CoreLayout::Shared`]
/// (added to `up`'s own niceness, so it holds under `nice pdserve up` too): at 10 a decode
/// thread outweighs a prefill thread on the same core about nine to one (CFS weights
/// 1024 and 110), so decode steps preempt prefill almost at once.
pub const SHARED_PREFILL_NICE: i32 = 10;

/// How `pdserve up` places P/D workers on the machine's cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CoreLayout {
    /// Disjoint shares: every worker computes on its own cores only.
    Split,
    /// Prefill workers also compute on the decode workers' cores, at a lower priority
    /// (nice 10): they borrow the cycles decode leaves idle between its steps, and a
    /// decode step preempts them.
    Shared,
}

/// Where one worker runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The cores it is pinned to; its compute threads are one per core.
    pub cpus: Vec<usize>,
    /// How much nicer than `up` itself it runs (0: the same priority), as `nice -n`.
    pub nice: i32,
}

impl Placement {
    /// Any core, default priority (the gateway).
    pub fn anywhere() -> Self {
        Self {
            cpus: Vec::new(),
            nice: 0,
        }
    }
}

/// A placement for each of `roles` (in order) on `cores` cores.
pub fn place(roles: &[WorkerRole], cores: usize, layout: CoreLayout) -> Vec<Placement> {
    let shares = split_cores(roles.len(), cores);
    let mut decode_cpus: Vec<usize> = roles
        .iter()
        .zip(&shares)
        .filter(|(role, _)| **role == WorkerRole::Decode)
        .flat_map(|(_, cpus)| cpus.iter().copied())
        .collect();
    decode_cpus.sort_unstable();
    decode_cpus.dedup();
    roles
        .iter()
        .zip(shares)
        .map(|(role, mut cpus)| {
            if layout == CoreLayout::Shared
                && *role == WorkerRole::Prefill
                && !decode_cpus.is_empty()
            {
                cpus.extend(&decode_cpus);
                cpus.sort_unstable();
                cpus.dedup();
                return Placement {
                    cpus,
                    nice: SHARED_PREFILL_NICE,
                };
            }
            Placement { cpus, nice: 0 }
        })
        .collect()
}

/// The cores each worker is pinned to: disjoint, contiguous shares while there are
/// enough cores (the compute pools spin-wait, so equal-priority workers sharing cores
/// collapse throughput), with leftover cores going to the last (decode) workers; past
/// that, round-robin.
pub fn split_cores(workers: usize, cores: usize) -> Vec<Vec<usize>> {
    if workers > cores {
        return (0..workers).map(|i| vec![i % cores]).collect();
    }
    let share = cores / workers;
    let extra = cores % workers;
    let mut next = 0;
    (0..workers)
        .map(|i| {
            let n = share + usize::from(i >= workers - extra);
            let set: Vec<usize> = (next..next + n).collect();
            next += n;
            set
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use WorkerRole::{Decode, Prefill, PrefillDecode};

    #[test]
    fn cores_are_split_disjointly_then_shared() {
        assert_eq!(split_cores(2, 2), vec![vec![0], vec![1]]);
        assert_eq!(split_cores(1, 4), vec![vec![0, 1, 2, 3]]);
        assert_eq!(split_cores(2, 3), vec![vec![0], vec![1, 2]]);
        assert_eq!(split_cores(3, 2), vec![vec![0], vec![1], vec![0]]);
    }

    fn cpus(placements: &[Placement]) -> Vec<(Vec<usize>, i32)> {
        placements
            .iter()
            .map(|p| (p.cpus.clone(), p.nice))
            .collect()
    }

    #[test]
    fn split_layout_keeps_disjoint_shares_at_default_priority() {
        let placed = place(&[Prefill, Decode], 2, CoreLayout::Split);
        assert_eq!(cpus(&placed), vec![(vec![0], 0), (vec![1], 0)]);
    }

    #[test]
    fn shared_layout_lends_decode_cores_to_prefill_at_lower_priority() {
        let placed = place(&[Prefill, Decode], 2, CoreLayout::Shared);
        assert_eq!(
            cpus(&placed),
            vec![(vec![0, 1], SHARED_PREFILL_NICE), (vec![1], 0)]
        );
        let placed = place(&[Prefill, Prefill, Decode], 4, CoreLayout::Shared);
        assert_eq!(
            cpus(&placed),
            vec![
                (vec![0, 2, 3], SHARED_PREFILL_NICE),
                (vec![1, 2, 3], SHARED_PREFILL_NICE),
                (vec![2, 3], 0)
            ]
        );
    }

    #[test]
    fn shared_layout_leaves_aggregated_workers_alone() {
        let placed = place(&[PrefillDecode, PrefillDecode], 4, CoreLayout::Shared);
        assert_eq!(cpus(&placed), vec![(vec![0, 1], 0), (vec![2, 3], 0)]);
    }
}
