//! Which cores each worker `pdserve up` starts computes on, and which of them it borrows.

use pdserve_protocol::WorkerRole;

/// How `pdserve up` places P/D workers on the machine's cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CoreLayout {
    /// Disjoint shares: every worker computes on its own cores only.
    Split,
    /// Prefill workers also compute on the decode workers' cores, one thread each at a
    /// lower priority (nice +10, per thread): they borrow the cycles decode leaves idle
    /// between its steps, and a decode step preempts them. On their own cores they run at
    /// the same priority as the rest of the machine.
    Shared,
}

/// Where one worker runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Its own cores: the whole worker is pinned to them, one compute thread per core.
    pub cpus: Vec<usize>,
    /// Another worker's cores it also computes on, one thread each at a lower priority
    /// (the worker's `--borrowed-cpus`).
    pub borrowed: Vec<usize>,
}

impl Placement {
    /// Any core, nothing borrowed (the gateway).
    pub fn anywhere() -> Self {
        Self {
            cpus: Vec::new(),
            borrowed: Vec::new(),
        }
    }

    /// Compute threads: one per own or borrowed core.
    pub fn threads(&self) -> usize {
        self.cpus.len() + self.borrowed.len()
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
        .map(|(role, cpus)| {
            let borrowed = if layout == CoreLayout::Shared && *role == WorkerRole::Prefill {
                // Past one core per worker a prefill's own core can be a decode core too.
                decode_cpus
                    .iter()
                    .copied()
                    .filter(|c| !cpus.contains(c))
                    .collect()
            } else {
                Vec::new()
            };
            Placement { cpus, borrowed }
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

    fn cpus(placements: &[Placement]) -> Vec<(Vec<usize>, Vec<usize>)> {
        placements
            .iter()
            .map(|p| (p.cpus.clone(), p.borrowed.clone()))
            .collect()
    }

    #[test]
    fn split_layout_keeps_disjoint_shares_and_borrows_nothing() {
        let placed = place(&[Prefill, Decode], 2, CoreLayout::Split);
        assert_eq!(cpus(&placed), vec![(vec![0], vec![]), (vec![1], vec![])]);
    }

    #[test]
    fn shared_layout_lends_decode_cores_to_prefill() {
        let placed = place(&[Prefill, Decode], 2, CoreLayout::Shared);
        assert_eq!(cpus(&placed), vec![(vec![0], vec![1]), (vec![1], vec![])]);
        assert_eq!(placed[0].threads(), 2);
        let placed = place(&[Prefill, Prefill, Decode], 4, CoreLayout::Shared);
        assert_eq!(
            cpus(&placed),
            vec![
                (vec![0], vec![2, 3]),
                (vec![1], vec![2, 3]),
                (vec![2, 3], vec![])
            ]
        );
        // Three workers on two cores: the second prefill's own core is decode's.
        let placed = place(&[Prefill, Prefill, Decode], 2, CoreLayout::Shared);
        assert_eq!(
            cpus(&placed),
            vec![(vec![0], vec![]), (vec![1], vec![0]), (vec![0], vec![])]
        );
    }

    #[test]
    fn shared_layout_leaves_aggregated_workers_alone() {
        let placed = place(&[PrefillDecode, PrefillDecode], 4, CoreLayout::Shared);
        assert_eq!(
            cpus(&placed),
            vec![(vec![0, 1], vec![]), (vec![2, 3], vec![])]
        );
    }
}
