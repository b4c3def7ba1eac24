//! `--discover-file PATH`: the workers a YAML (or JSON) file lists, for bare metal and
//! Slurm, re-read every `--discover-interval` and applied when it changed. A file that
//! cannot be read or parsed keeps the last good roster and says why: a half-written or
//! deleted file never empties the fleet.
//!
//! ```yaml
//! workers:
//!   - url: http://10.0.0.5:8100
//!     role: prefill
//!     bootstrap_port: 8998   # optional
//!   - url: http://10.0.0.6:8200
//!     role: decode
//!     dp_size: 2             # optional
//!     kv_events_endpoint: tcp://10.0.0.6:5557          # optional
//!     kv_events_replay_endpoint: tcp://10.0.0.6:5558   # optional
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pdserve_protocol::WorkerRole;
use serde::Deserialize;

use super::Discoverer;
use crate::fleet::registry::{check_dp_size, parse_worker_url};
use crate::fleet::registry::{WorkerSource, WorkerSpec};

/// Re-reads `path` every `--discover-interval` and applies it when its text changed.
pub async fn watch(state: Arc<Discoverer>, path: PathBuf) {
    let mut ticks = tokio::time::interval(state.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut applied: Option<String> = None;
    loop {
        ticks.tick().await;
        let text = match read(&path).await {
            Ok(text) => text,
            Err(why) => {
                super::failed(&state, WorkerSource::File, &why);
                continue;
            }
        };
        if applied.as_deref() == Some(text.as_str()) {
            continue;
        }
        match parse(&text) {
            Ok(specs) => {
                super::apply(&state, WorkerSource::File, specs).await;
                applied = Some(text);
            }
            Err(why) => super::failed(
                &state,
                WorkerSource::File,
                &format!("{}: {why}", path.display()),
            ),
        }
    }
}

/// The file's shape.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Listing {
    workers: Vec<Entry>,
}

/// One listed worker.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    url: String,
    role: String,
    #[serde(default)]
    dp_size: Option<u32>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    kv_events_endpoint: Option<String>,
    #[serde(default)]
    kv_events_replay_endpoint: Option<String>,
}

/// The workers `text` lists, or why it is not a listing (naming the entry at fault).
pub fn parse(text: &str) -> Result<Vec<WorkerSpec>, String> {
    if text.trim().is_empty() {
        return Err("the file is empty (a listing with no workers says `workers: []`)".into());
    }
    let listing: Listing =
        serde_yaml_ng::from_str(text).map_err(|e| format!("not a worker listing: {e}"))?;
    listing
        .workers
        .into_iter()
        .enumerate()
        .map(|(i, entry)| {
            let at = |what: String| format!("workers[{i}] ({}): {what}", entry.url);
            let role: WorkerRole = entry.role.parse().map_err(|e| at(format!("{e}")))?;
            let url = parse_worker_url("url", &entry.url).map_err(|e| at(e.to_string()))?;
            let dp_size = check_dp_size(entry.dp_size.unwrap_or(1).into()).map_err(at)?;
            if entry.bootstrap_port == Some(0) {
                return Err(at("bootstrap_port must be a port number (1-65535)".into()));
            }
            for endpoint in [&entry.kv_events_endpoint, &entry.kv_events_replay_endpoint]
                .into_iter()
                .flatten()
            {
                crate::fleet::kv_events::check_endpoint(endpoint).map_err(at)?;
            }
            let mut spec = WorkerSpec::new(role, url);
            spec.dp_size = dp_size;
            spec.bootstrap_port = entry.bootstrap_port;
            spec.kv_events_endpoint = entry.kv_events_endpoint.clone();
            spec.kv_events_replay_endpoint = entry.kv_events_replay_endpoint.clone();
            Ok(spec)
        })
        .collect()
}

/// The file's text, or why it cannot be read.
pub async fn read(path: &Path) -> Result<String, String> {
    tokio::fs::read_to_string(path)
        .await
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_are_read_as_yaml_or_json_and_bad_ones_say_why() {
        let yaml = "workers:\n  - url: http://10.0.0.5:8100/\n    role: prefill\n    bootstrap_port: 8998\n  - url: http://10.0.0.6:8200\n    role: decode\n    dp_size: 2\n    kv_events_endpoint: tcp://10.0.0.6:5557\n";
        let specs = parse(yaml).unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].key(), "http://10.0.0.5:8100");
        assert_eq!(
            (specs[0].role, specs[0].bootstrap_port),
            (WorkerRole::Prefill, Some(8998))
        );
        assert_eq!((specs[1].role, specs[1].dp_size), (WorkerRole::Decode, 2));
        assert_eq!(
            specs[1].kv_events_endpoint.as_deref(),
            Some("tcp://10.0.0.6:5557")
        );
        let json = r#"{"workers": [{"url": "http://h:1", "role": "both"}]}"#;
        assert_eq!(parse(json).unwrap()[0].role, WorkerRole::PrefillDecode);
        assert!(parse("workers: []").unwrap().is_empty());
        for (bad, says) in [
            ("", "empty"),
            (
                "workers:\n  - url: http://h:1\n    role: cook\n",
                "workers[0]",
            ),
            (
                "workers:\n  - url: ftp://h:1\n    role: decode\n",
                "workers[0]",
            ),
            (
                "workers:\n  - url: http://h:1\n    role: decode\n    dp_size: 5000\n",
                "dp_size",
            ),
            ("workers:\n  - url: http://h:1\n    role: dec", "workers[0]"),
            ("worker: []", "not a worker listing"),
            (
                "workers:\n  - url: http://h:1\n    role: decode\n    kv_events_endpoint: h:5557\n",
                "kv_events_endpoint",
            ),
            (
                "workers:\n  - url: http://h:1\n    role: decode\n    dp: 2\n",
                "unknown field",
            ),
            ("workers: [{url: http://h:1}]", "not a worker listing"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }
}
