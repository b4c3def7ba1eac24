//! Where workers come from, and keeping the workers of one discovery source in step with
//! what the source lists now: added, updated in place, removed when they vanish — and
//! never touching the workers another source registered.

use std::fmt;

use serde::Serialize;

use super::{Registry, RegistryError, WorkerSpec};

/// Where a worker came from (`source` in `GET /instances`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerSource {
    /// `--prefill`, `--decode`, `--worker` or `--encode` at start.
    Static,
    /// `POST /instances`.
    Registration,
    /// `--discover-file`.
    File,
    /// `--discover-dns`.
    Dns,
    /// `--service-discovery` (Kubernetes).
    Kubernetes,
}

impl WorkerSource {
    /// The source's name in JSON, logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Registration => "registration",
            Self::File => "file",
            Self::Dns => "dns",
            Self::Kubernetes => "kubernetes",
        }
    }
}

impl fmt::Display for WorkerSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one [`Registry::sync_source`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SyncReport {
    /// URLs added.
    pub added: Vec<String>,
    /// URLs whose record changed (`dp_size`, `bootstrap_port`, ...).
    pub updated: Vec<String>,
    /// URLs removed because the source no longer lists them.
    pub removed: Vec<String>,
    /// URLs not taken, and why (registered by another source, a role conflict, a full
    /// roster).
    pub refused: Vec<(String, String)>,
}

impl Registry {
    /// Makes the workers registered by `source` exactly `specs`, in one roster change:
    /// new ones are added (live at once), changed ones updated in place (keeping their
    /// health), and those `source` no longer lists removed (requests already on them
    /// finish). A URL another source registered is left as it is.
    pub fn sync_source(&self, source: WorkerSource, specs: Vec<WorkerSpec>) -> SyncReport {
        let _guard = self.lock();
        let mut members = self.roster.load().members().to_vec();
        let mut report = SyncReport::default();
        let listed: Vec<String> = specs.iter().map(WorkerSpec::key).collect();
        // Removals first, so that a worker replaced by another role in the same listing
        // does not conflict with itself.
        members.retain(|m| {
            let keep = m.source != source || listed.contains(&m.worker.base);
            if !keep {
                tracing::info!(role = %m.worker.role(), url = %m.worker.base, %source, "worker no longer listed; removed");
                self.metrics
                    .forget_worker(m.worker.role().as_str(), &m.worker.base);
                report.removed.push(m.worker.base.clone());
            }
            keep
        });
        for spec in specs {
            let key = spec.key();
            if let Some(owner) = members.iter().find(|m| m.worker.base == key) {
                if owner.source != source {
                    report
                        .refused
                        .push((key, format!("already registered by {}", owner.source)));
                    continue;
                }
            }
            match self.admit(&mut members, spec, source) {
                Ok(super::Admitted::Added) => report.added.push(key),
                Ok(super::Admitted::Updated) => report.updated.push(key),
                Ok(super::Admitted::Unchanged) => {}
                Err(
                    e @ (RegistryError::MixedTopology { .. }
                    | RegistryError::RoleChange { .. }
                    | RegistryError::Full { .. }),
                ) => report.refused.push((key, e.to_string())),
            }
        }
        if !(report.added.is_empty() && report.updated.is_empty() && report.removed.is_empty()) {
            self.publish(members);
        }
        report
    }
}
