//! How `pdserve up` starts its members: the workers on free local ports (pinned to their
//! cores, or anywhere for `--sim`) with their KV-event sockets in the stack's private
//! folder, then the gateway replicas in front of them, or the orchestrating decode
//! worker.

use std::time::Duration;

use anyhow::{bail, Context};
use pdserve_engine::orchestrator::HandoffMode;
use pdserve_gateway::config::Protocol;
use pdserve_protocol::WorkerRole;
use tokio::process::Command;

use super::UpArgs;
use crate::members::{spawn, wait_ready, Member};
use crate::placement::{place, Placement};

/// What every member is started from.
pub(super) struct Stack<'a> {
    pub(super) exe: &'a std::path::Path,
    pub(super) model: &'a std::path::Path,
    pub(super) args: &'a UpArgs,
    /// The KV transfer secret every member gets (`PDSERVE_KV_SECRET`).
    pub(super) kv_secret: &'a str,
    /// The stack's private folder for its members' Unix sockets (KV events).
    pub(super) sockets: &'a std::path::Path,
    /// The ports handed to members so far.
    pub(super) ports: PortPicker,
    /// The gateways' `--discover-file` listing of the workers (`--autoscale`); `None`:
    /// the workers are the gateways' static flags.
    pub(super) listing: Option<std::path::PathBuf>,
}

/// A folder only this user can enter, for the stack's Unix sockets; removed by
/// [`super::run`] when the stack stops.
pub(super) fn socket_folder() -> anyhow::Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = std::env::temp_dir().join(format!("pdserve-up-{}", std::process::id()));
    // One left by an earlier process with this pid holds nothing alive.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

/// `PDSERVE_KV_SECRET` when the user set one, else 32 random bytes (hex): the stack's
/// workers then read and serve KV only among themselves.
pub(super) fn kv_secret() -> anyhow::Result<String> {
    use std::io::Read;
    if let Some(secret) = std::env::var("PDSERVE_KV_SECRET")
        .ok()
        .filter(|s| !s.is_empty())
    {
        return Ok(secret);
    }
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read /dev/urandom for the KV transfer secret")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl Stack<'_> {
    /// `ipc://` endpoint of the socket `name` in the stack's folder.
    fn socket(&self, name: &str) -> String {
        format!("ipc://{}", self.sockets.join(name).display())
    }

    /// `--otlp-traces-endpoint` for a member, when the stack exports traces.
    fn trace_to(&self, member: &mut Command) {
        if let Some(url) = &self.args.otlp_traces_endpoint {
            member.args(["--otlp-traces-endpoint", url]);
        }
    }

    /// `pdserve worker` as `role` on `host:port`, with a compute thread pinned to each of
    /// its placement's own and borrowed cores.
    fn worker(
        &self,
        role: WorkerRole,
        host: &str,
        port: u16,
        placement: &Placement,
    ) -> anyhow::Result<Command> {
        let mut worker = Command::new(self.exe);
        // A sim worker computes nothing: one thread, any core.
        let threads = if self.args.sim.is_some() {
            1
        } else {
            placement.threads().max(1)
        };
        worker
            .env("PDSERVE_KV_SECRET", self.kv_secret)
            .arg("worker")
            .args(["--role", role.as_str(), "--host", host])
            .args(["--port", &port.to_string()])
            .arg("--model")
            .arg(self.model)
            .args(["--threads", &threads.to_string()])
            .args([
                "--shutdown-timeout",
                &self.args.shutdown_timeout.to_string(),
            ]);
        if self.args.sim.is_none() && !placement.cpus.is_empty() {
            worker.args(["--cpus", &core_list(&placement.cpus)]);
            if !placement.borrowed.is_empty() {
                worker.args(["--borrowed-cpus", &core_list(&placement.borrowed)]);
            }
        }
        if let Some(key) = &self.args.api_key {
            // The worker's --api-key (its environment variable, not shown in `ps`).
            worker.env("PDSERVE_WORKER_API_KEY", key);
        }
        if role != WorkerRole::PrefillDecode {
            worker
                .args(["--kv-port", &self.ports.pick()?.to_string()])
                .args([
                    "--kv-abort-timeout",
                    &self.args.kv_abort_timeout.to_string(),
                ]);
        }
        if let Some(profile) = &self.args.sim {
            worker.args(["--sim", profile]);
        }
        self.trace_to(&mut worker);
        worker.args(&self.args.worker_args);
        Ok(worker)
    }

    /// Workers, then a gateway in front of them; returns the gateway's URL and a summary.
    pub(super) async fn start_with_gateway(
        &self,
        members: &mut Vec<Member>,
        cores: usize,
    ) -> anyhow::Result<Started> {
        let args = self.args;
        let roles: Vec<WorkerRole> = if args.aggregated {
            vec![WorkerRole::PrefillDecode; args.workers.into()]
        } else {
            std::iter::repeat_n(WorkerRole::Prefill, args.prefill.into())
                .chain(std::iter::repeat_n(WorkerRole::Decode, args.decode.into()))
                .collect()
        };
        // Every replica's flags but its port; the workers' are added below.
        let mut gateway: Vec<String> = vec![
            "gateway".into(),
            "--host".into(),
            args.host.clone(),
            "--shutdown-timeout".into(),
            args.shutdown_timeout.to_string(),
            "--policy".into(),
            args.policy.clone(),
            // The gateway tokenizes as the workers do (exact counts, token prefixes).
            "--tokenizer".into(),
            self.model.display().to_string(),
        ];
        gateway.extend(args.gateway_args.iter().cloned());
        gateway.extend(args.history_flags());
        let sglang = args.protocol == Protocol::Sglang;
        if sglang && args.aggregated {
            bail!("--protocol sglang is a P/D handoff: it does not apply to --aggregated");
        }
        if !args.aggregated {
            gateway.extend(["--protocol".into(), protocol_name(args.protocol).into()]);
            let given = |flag: &str| {
                let with_value = format!("{flag}=");
                args.gateway_args
                    .iter()
                    .any(|a| a == flag || a.starts_with(&with_value))
            };
            if args.disagg_threshold > 0 && !given("--disagg-threshold") {
                gateway.extend([
                    "--disagg-threshold".into(),
                    args.disagg_threshold.to_string(),
                ]);
                if !given("--disagg-min-prefill-load") {
                    gateway.extend(["--disagg-min-prefill-load".into(), "1".into()]);
                }
            }
        }
        let mut listed: Vec<Listed> = Vec::new();
        let mut summary = Vec::new();
        let placements = match args.sim {
            Some(_) => vec![Placement::anywhere(); roles.len()],
            None => place(&roles, cores, args.core_layout),
        };
        for (role, placement) in roles.iter().zip(placements) {
            let name = member_name(*role, &roles[..listed.len()]);
            let (member, worker, line) = self.launch(*role, listed.len(), &name, &placement)?;
            members.push(member);
            summary.push(line);
            listed.push(worker);
        }
        match &self.listing {
            // Workers come and go: the gateways read them from a file the stack rewrites.
            Some(path) => {
                write_listing(path, &listed)?;
                gateway.extend([
                    "--discover-file".into(),
                    path.display().to_string(),
                    "--discover-interval".into(),
                    LISTING_INTERVAL_SECS.to_string(),
                ]);
            }
            None => {
                for worker in &listed {
                    gateway.extend(worker.gateway_flags());
                }
            }
        }
        let worker_urls: Vec<String> = listed.iter().map(|w| w.url.clone()).collect();
        let limit = Duration::from_secs(args.ready_timeout_secs);
        for url in &worker_urls {
            wait_ready(members, url, limit).await?;
        }
        let mut urls = Vec::new();
        for replica in 0..args.gateway_replicas {
            let port = args
                .port
                .checked_add(replica)
                .context("--port + --gateway-replicas runs past port 65535")?;
            let mut command = Command::new(self.exe);
            // The gateway asks prefill workers to release KV decode will not read: same
            // secret.
            command
                .env("PDSERVE_KV_SECRET", self.kv_secret)
                .args(&gateway)
                .args(["--port", &port.to_string()]);
            self.trace_to(&mut command);
            if let Some(key) = &args.api_key {
                command
                    .env("PDSERVE_API_KEY", key)
                    .env("PDSERVE_WORKER_API_KEY", key);
            }
            let name = match args.gateway_replicas {
                1 => "gateway".to_string(),
                _ => format!("gateway-{replica}"),
            };
            members.push(spawn(&name, true, command, &Placement::anywhere())?);
            urls.push(format!("http://{}:{port}", args.host));
        }
        for url in &urls {
            wait_ready(members, url, Duration::from_secs(30)).await?;
        }
        if urls.len() > 1 {
            summary.push(format!("gateway replicas at {}", urls.join(", ")));
        }
        Ok(Started {
            entry: urls[0].clone(),
            summary,
            workers: listed,
        })
    }

    /// Starts `role`'s worker `name` (the stack's `index`-th, which names its sockets) on
    /// `placement`, publishing its KV events: its member, how the gateway is told of it,
    /// and its line in the summary.
    pub(super) fn launch(
        &self,
        role: WorkerRole,
        index: usize,
        name: &str,
        placement: &Placement,
    ) -> anyhow::Result<(Member, Listed, String)> {
        let port = self.ports.pick()?;
        let url = format!("http://127.0.0.1:{port}");
        let mut worker = self.worker(role, "127.0.0.1", port, placement)?;
        let mut line = format!("{role} worker at {url} on {}", describe(placement));
        let mut bootstrap_port = None;
        if self.args.protocol == Protocol::Sglang && role == WorkerRole::Prefill {
            let port = self.ports.pick()?;
            worker.args(["--bootstrap-port", &port.to_string()]);
            line.push_str(&format!(", bootstrap port {port}"));
            bootstrap_port = Some(port);
        }
        // Every worker publishes its KV-cache events; every gateway replica subscribes
        // and indexes them. By vLLM's rule an ipc:// endpoint binds, and a Unix socket in
        // the stack's private folder is reachable from this machine only.
        let (events, replay) = (
            self.socket(&format!("w{index}-events.sock")),
            self.socket(&format!("w{index}-replay.sock")),
        );
        worker.args([
            "--kv-events-config",
            &serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": events,
                "replay_endpoint": replay,
            })
            .to_string(),
        ]);
        let member = spawn(name, false, worker, placement)?;
        let listed = Listed {
            role,
            url,
            bootstrap_port,
            events,
            replay,
        };
        Ok((member, listed, line))
    }

    /// Prefill workers, then the decode worker that orchestrates them on the public port;
    /// returns its URL and a summary. It is ready once a prefill worker is pre-warmed.
    pub(super) async fn start_orchestrated(
        &self,
        members: &mut Vec<Member>,
        cores: usize,
    ) -> anyhow::Result<Started> {
        let args = self.args;
        if args.protocol == Protocol::Sglang {
            bail!("--protocol sglang is the gateway's handoff: use --topology gateway");
        }
        if args.sim.is_some() {
            bail!("--sim runs a fleet behind the gateway: use --topology gateway");
        }
        if args.aggregated
            || args.decode != 1
            || !args.gateway_args.is_empty()
            || args.gateway_replicas != 1
        {
            bail!(
                "--topology orchestrator runs --prefill N prefill workers and one decode \
                 worker as the entry point: --aggregated, --decode, --gateway-arg and \
                 --gateway-replicas do not apply"
            );
        }
        let roles: Vec<WorkerRole> = std::iter::repeat_n(WorkerRole::Prefill, args.prefill.into())
            .chain([WorkerRole::Decode])
            .collect();
        let mut shares = place(&roles, cores, args.core_layout);
        let decode_placement = shares.pop().expect("at least two workers");
        let mut summary = Vec::new();
        let mut prefill_urls = Vec::new();
        for (i, placement) in shares.iter().enumerate() {
            let port = self.ports.pick()?;
            let url = format!("http://127.0.0.1:{port}");
            let worker = self.worker(WorkerRole::Prefill, "127.0.0.1", port, placement)?;
            members.push(spawn(&format!("prefill-{i}"), false, worker, placement)?);
            summary.push(format!(
                "prefill worker at {url} on {}",
                describe(placement)
            ));
            prefill_urls.push(url);
        }
        let limit = Duration::from_secs(args.ready_timeout_secs);
        for url in &prefill_urls {
            wait_ready(members, url, limit).await?;
        }
        let mut decode =
            self.worker(WorkerRole::Decode, &args.host, args.port, &decode_placement)?;
        decode
            .args(["--prefill", &prefill_urls.join(",")])
            .args(["--handoff", handoff_name(args.handoff)]);
        members.push(spawn("decode-0", true, decode, &decode_placement)?);
        let entry = format!("http://{}:{}", args.host, args.port);
        wait_ready(members, &entry, limit).await?;
        summary.push(format!(
            "decode worker (orchestrator, {} handoff) at {entry} on {}",
            handoff_name(args.handoff),
            describe(&decode_placement)
        ));
        Ok(Started {
            entry,
            summary,
            workers: Vec::new(),
        })
    }
}

fn protocol_name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Vllm => "vllm",
        Protocol::Sglang => "sglang",
    }
}

fn handoff_name(mode: HandoffMode) -> &'static str {
    match mode {
        HandoffMode::Sequential => "sequential",
        HandoffMode::Concurrent => "concurrent",
    }
}

/// The name a worker's log lines carry: its role and its index among the workers of that
/// role started before it (`prefill-0`, `decode-1`; aggregated workers are `worker-N`).
fn member_name(role: WorkerRole, before: &[WorkerRole]) -> String {
    let index = before.iter().filter(|r| **r == role).count();
    match role {
        WorkerRole::PrefillDecode => format!("worker-{index}"),
        role => format!("{role}-{index}"),
    }
}

/// "cores [0]", with the cores it borrows and at what priority.
fn describe(placement: &Placement) -> String {
    if placement.cpus.is_empty() {
        return "any core".into();
    }
    match placement.borrowed.as_slice() {
        [] => format!("cores {:?}", placement.cpus),
        borrowed => format!(
            "cores {:?}, borrowing {borrowed:?} (one thread each, nice +{})",
            placement.cpus,
            pdserve_model::BORROWED_NICE
        ),
    }
}

/// "0,1": a `--cpus` value.
fn core_list(cores: &[usize]) -> String {
    cores
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Ports for the members, each handed out once: a pick is only free until its member
/// binds it, and a fleet of many workers (`--sim`) takes hundreds of picks, among which
/// independent random picks would repeat.
#[derive(Debug, Default)]
pub(super) struct PortPicker {
    given: std::sync::Mutex<std::collections::HashSet<u16>>,
}

impl PortPicker {
    /// Keeps `port` from being handed out.
    pub(super) fn reserve(&self, port: u16) {
        self.given
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port);
    }

    /// A port on 127.0.0.1 that was free a moment ago, from outside the ephemeral range
    /// (see [`pdserve_http_server::free_local_port`]), and not handed out before.
    fn pick(&self) -> anyhow::Result<u16> {
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..1000 {
            let port = pdserve_http_server::free_local_port().context("no free local port")?;
            if given.insert(port) {
                return Ok(port);
            }
        }
        bail!("no free local port that this stack has not handed out already")
    }
}

/// How often, in seconds, the gateways re-read the workers' listing (`--autoscale`).
pub(super) const LISTING_INTERVAL_SECS: u64 = 1;

/// What [`Stack::start_with_gateway`] and [`Stack::start_orchestrated`] started.
pub(super) struct Started {
    /// The entry point's URL.
    pub entry: String,
    /// A line per member, for the banner.
    pub summary: Vec<String>,
    /// The workers behind the gateway (none for the orchestrator).
    pub workers: Vec<Listed>,
}

/// One worker as the gateways are told of it.
#[derive(Debug, Clone)]
pub(super) struct Listed {
    pub role: WorkerRole,
    pub url: String,
    /// SGLang's bootstrap port (prefill workers under `--protocol sglang`).
    pub bootstrap_port: Option<u16>,
    /// Its KV-event publisher and replay endpoints.
    pub events: String,
    pub replay: String,
}

impl Listed {
    /// The gateway flags that name it (static workers): after the URL the bootstrap port
    /// (SGLang's `--prefill URL PORT` stays together), then its event endpoints.
    fn gateway_flags(&self) -> Vec<String> {
        let mut flags = vec![gateway_flag(self.role).to_string(), self.url.clone()];
        flags.extend(self.bootstrap_port.map(|p| p.to_string()));
        flags.extend([
            "--kv-events".into(),
            format!("{}={}", self.url, self.events),
            "--kv-events-replay".into(),
            format!("{}={}", self.url, self.replay),
        ]);
        flags
    }
}

/// Writes the gateways' `--discover-file` listing `workers` to `path` (whole, by rename,
/// so a gateway never reads half of it).
pub(super) fn write_listing(path: &std::path::Path, workers: &[Listed]) -> anyhow::Result<()> {
    let entries: Vec<serde_json::Value> = workers
        .iter()
        .map(|w| {
            let mut entry = serde_json::json!({
                "url": w.url,
                "role": w.role.as_str(),
                "kv_events_endpoint": w.events,
                "kv_events_replay_endpoint": w.replay,
            });
            if let Some(port) = w.bootstrap_port {
                entry["bootstrap_port"] = port.into();
            }
            entry
        })
        .collect();
    let text = serde_json::to_string_pretty(&serde_json::json!({ "workers": entries }))?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)
        .and_then(|()| std::fs::rename(&partial, path))
        .with_context(|| format!("cannot write the workers' listing {}", path.display()))
}

/// The `pdserve gateway` flag that adds a worker of `role` to its pools.
fn gateway_flag(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::PrefillDecode => "--worker",
        WorkerRole::Prefill => "--prefill",
        WorkerRole::Decode => "--decode",
        WorkerRole::Encode => unreachable!("pdserve up starts no encode workers"),
    }
}
