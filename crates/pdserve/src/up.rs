//! `pdserve up`: the whole stack on this machine in one command — workers on free local
//! ports, each pinned to its own cores, and a gateway in front of them; or, with
//! `--topology orchestrator`, prefill workers and one decode worker that is itself the
//! entry point (decode as orchestrator, no gateway). SIGTERM or Ctrl-C drains the front
//! door first (its in-flight requests still need the workers), then the workers; a
//! second signal kills whatever is left.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use pdserve_engine::orchestrator::HandoffMode;
use pdserve_gateway::config::Protocol;
use pdserve_history::HistoryBackend;
use pdserve_protocol::WorkerRole;
use tokio::process::Command;

use crate::members::{first_exit, spawn, stop_all, wait_ready, Member, StopSignals};
use crate::placement::{place, CoreLayout, Placement};

/// `--disagg-threshold`'s default: prompts shorter than this are prefilled by the decode
/// worker while the prefill worker is busy (measured: docs/benchmarks.md, "Conditional
/// disaggregation").
const DISAGG_THRESHOLD: usize = 512;

/// How long past its `--shutdown-timeout` a member may take to exit before it is killed.
const STOP_MARGIN: Duration = Duration::from_secs(5);

/// How the stack is put together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Topology {
    /// A gateway in front of the workers; it runs the P/D handoff.
    Gateway,
    /// No gateway: one decode worker started with `--prefill` is the entry point and runs
    /// the prefill leg itself (decode as orchestrator).
    Orchestrator,
}

/// `pdserve up` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Port of the entry point clients use (the gateway, or the orchestrating decode
    /// worker).
    #[arg(long, env = "PDSERVE_PORT", default_value_t = 8000)]
    port: u16,
    /// Address the entry point binds.
    #[arg(long, env = "PDSERVE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// GGUF model to serve (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long, env = "PDSERVE_MODEL")]
    model: Option<PathBuf>,
    /// CPU cores to use in all (default: every core of this machine).
    #[arg(long, env = "PDSERVE_CORES")]
    cores: Option<usize>,
    /// Longest wait for a worker to load its model and answer /health.
    #[arg(long, env = "PDSERVE_READY_TIMEOUT_SECS", default_value_t = 300)]
    ready_timeout_secs: u64,
    /// Prefill workers.
    #[arg(long, env = "PDSERVE_PREFILL_WORKERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    prefill: u16,
    /// Decode workers.
    #[arg(long, env = "PDSERVE_DECODE_WORKERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    decode: u16,
    /// Aggregated (prefill_decode) workers, each prefilling and decoding in one process,
    /// instead of P/D pools.
    #[arg(long, env = "PDSERVE_AGGREGATED", conflicts_with_all = ["prefill", "decode"])]
    aggregated: bool,
    /// How many aggregated workers --aggregated starts.
    #[arg(long, env = "PDSERVE_AGGREGATED_WORKERS", default_value_t = 1, requires = "aggregated",
          value_parser = clap::value_parser!(u16).range(1..))]
    workers: u16,
    /// The gateway's routing policy for every role (see `pdserve gateway --help`). The
    /// default routes on the workers' own KV events, which `up` always wires up with the
    /// served model's tokenizer: a prompt goes where most of it is cached, net of load.
    #[arg(long, env = "PDSERVE_POLICY", default_value = "precise_prefix")]
    policy: String,
    /// P/D through a gateway: a prompt whose uncached part is shorter than this many
    /// tokens skips the prefill leg, and the decode worker prefills it, while the prefill
    /// worker is busy with another prompt (the gateway's --disagg-threshold with
    /// --disagg-min-prefill-load 1): the decode worker is a second prefill lane instead
    /// of a queue behind the first. 0 turns it off; a --gateway-arg=--disagg-threshold
    /// overrides it. The default is measured in docs/benchmarks.md ("Conditional
    /// disaggregation").
    #[arg(long, env = "PDSERVE_DISAGG_THRESHOLD", default_value_t = DISAGG_THRESHOLD)]
    disagg_threshold: usize,
    /// Gateway replicas, on --port, --port + 1, …: each with the same flags, workers and
    /// event subscriptions (as replicas behind a load balancer; spread clients over them
    /// with `pdserve bench serve --url` repeated).
    #[arg(long, env = "PDSERVE_GATEWAY_REPLICAS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    gateway_replicas: u16,
    /// More `pdserve gateway` flags, passed through as given (repeat for each flag or
    /// value), e.g. `--gateway-arg=--disagg-threshold --gateway-arg=64`. The environment
    /// variable holds one argument per line (split at newlines only, so an argument may
    /// contain commas and spaces).
    #[arg(
        long = "gateway-arg",
        env = "PDSERVE_GATEWAY_ARGS",
        value_delimiter = '\n',
        allow_hyphen_values = true
    )]
    gateway_args: Vec<String>,
    /// More `pdserve worker` flags for every worker, passed through as given (repeat for
    /// each flag or value), e.g. `--worker-arg=--scheduling-policy --worker-arg=priority`.
    /// The environment variable holds one argument per line (split at newlines only, so an
    /// argument may contain commas and spaces).
    #[arg(
        long = "worker-arg",
        env = "PDSERVE_WORKER_ARGS",
        value_delimiter = '\n',
        allow_hyphen_values = true
    )]
    worker_args: Vec<String>,
    /// Seconds a P/D worker keeps KV blocks pinned for a peer that never reads them.
    #[arg(long, env = "PDSERVE_KV_ABORT_TIMEOUT", default_value_t = 480)]
    kv_abort_timeout: u64,
    /// Seconds the gateway, then each worker, may take on SIGTERM or Ctrl-C to finish
    /// in-flight requests before they are ended (passed on as their --shutdown-timeout).
    #[arg(long, env = "PDSERVE_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    shutdown_timeout: u64,
    /// `gateway`: a gateway in front of P/D (or aggregated) workers. `orchestrator`:
    /// `--prefill N` prefill workers and one decode worker on its own cores that is the
    /// entry point (on --host/--port) and sends each request's prefill leg itself.
    #[arg(long, env = "PDSERVE_TOPOLOGY", value_enum, default_value_t = Topology::Gateway)]
    topology: Topology,
    /// With `--topology orchestrator`: the decode worker's `--handoff` (`sequential`
    /// reads the KV after the prefill answered; `concurrent` starts the read with it).
    #[arg(long, env = "PDSERVE_HANDOFF", value_enum, default_value_t = HandoffMode::Sequential)]
    handoff: HandoffMode,
    /// The gateway's P/D protocol (`pdserve gateway --protocol`). `sglang` starts each
    /// prefill worker with a `--bootstrap-port` of its own and gives it to the gateway
    /// (`--prefill URL BOOTSTRAP_PORT`), which then sends each request to P and D at once.
    #[arg(long, env = "PDSERVE_PROTOCOL", value_enum, default_value_t = Protocol::Vllm)]
    protocol: Protocol,
    /// One API key for the whole stack: clients of the entry point's OpenAI routes must
    /// send `Authorization: Bearer <key>`; the gateway sends it to the workers, which
    /// require it too (their --api-key). Prefer the environment variable.
    #[arg(long, env = "PDSERVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// How P/D workers share the cores. `shared`: prefill workers also compute on the
    /// decode workers' cores, one thread each at a lower priority (nice +10, that thread
    /// only), borrowing what decode leaves idle between its steps (on 2 cores: prefill
    /// on core 0 and, borrowed, core 1; decode on core 1). `split`: each worker on its own
    /// cores only. Aggregated workers are always split.
    #[arg(long, env = "PDSERVE_CORE_LAYOUT", value_enum, default_value_t = CoreLayout::Shared)]
    core_layout: CoreLayout,
    /// Export OpenTelemetry traces over OTLP/HTTP to this URL from every process of the
    /// stack (passed on as their `--otlp-traces-endpoint`).
    #[arg(long, env = "PDSERVE_OTLP_TRACES_ENDPOINT")]
    otlp_traces_endpoint: Option<String>,
    /// A simulated fleet: every worker is `pdserve worker --sim PROFILE` (a built-in
    /// profile's name, see `pdserve sim profiles`, or a profile file), a stand-in for a
    /// GPU engine that runs no model and needs little CPU, so `--prefill`, `--decode` and
    /// `--workers` can be large (64 and more). Workers are not pinned to cores; each
    /// publishes `pdserve_sim_step_lateness_seconds`, which shows whether this machine
    /// kept the simulated time. The gateway's defaults are `up`'s own.
    #[arg(long, env = "PDSERVE_SIM", value_name = "PROFILE")]
    sim: Option<String>,
    /// Where the gateway keeps stored responses (`previous_response_id` chains) and
    /// conversations (`/v1/conversations`), its --history-backend: `sqlite` by default,
    /// so a conversation survives restarting the stack; `postgres` to share it with other
    /// stacks; `memory`; `none`.
    #[arg(long, env = "PDSERVE_HISTORY_BACKEND", value_enum, default_value_t = HistoryBackend::Sqlite)]
    history_backend: HistoryBackend,
    /// The history database, the gateway's --history-url. Default for `sqlite`:
    /// history.sqlite in $PDSERVE_HOME (~/.cache/pdserve).
    #[arg(long, env = "PDSERVE_HISTORY_URL", hide_env_values = true)]
    history_url: Option<String>,
}

impl UpArgs {
    /// The gateway's --history-* flags, unless --gateway-arg gives them.
    fn history_flags(&self) -> Vec<String> {
        let given = |flag: &str| {
            let with_value = format!("{flag}=");
            self.gateway_args
                .iter()
                .any(|a| a == flag || a.starts_with(&with_value))
        };
        let mut flags = Vec::new();
        if !given("--history-backend") {
            let name = clap::ValueEnum::to_possible_value(&self.history_backend)
                .map(|v| v.get_name().to_string())
                .unwrap_or_default();
            flags.extend(["--history-backend".to_string(), name]);
        }
        let url = self.history_url.clone().or_else(|| {
            (self.history_backend == HistoryBackend::Sqlite).then(|| {
                let file = pdserve_model::home_dir().join("history.sqlite");
                file.to_string_lossy().into_owned()
            })
        });
        if let Some(url) = url.filter(|_| !given("--history-url")) {
            flags.extend(["--history-url".to_string(), url]);
        }
        flags
    }
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

/// Runs the stack until SIGTERM or Ctrl-C (or until a member dies), then stops every
/// member: the gateway first, then the workers.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    // Listening from the start, so a stop during start-up also drains the members.
    let mut signals = StopSignals::new()?;
    let mut members = Vec::new();
    let sockets = socket_folder()?;
    let result = tokio::select! {
        result = start_and_supervise(&args, &mut members, &sockets) => result,
        signal = signals.recv() => {
            eprintln!("stopping pdserve ({signal})…");
            Ok(())
        }
    };
    stop_all(
        &mut members,
        Duration::from_secs(args.shutdown_timeout) + STOP_MARGIN,
        &mut signals,
    )
    .await;
    let _ = std::fs::remove_dir_all(&sockets);
    result
}

/// Starts the members and returns only if one of them exits (or cannot start).
async fn start_and_supervise(
    args: &UpArgs,
    members: &mut Vec<Member>,
    sockets: &std::path::Path,
) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot locate the pdserve executable")?;
    let model = match args.model.clone() {
        Some(p) => p,
        None => {
            tokio::task::spawn_blocking(|| {
                pdserve_model::ensure_default_model(&pdserve_model::home_dir())
            })
            .await??
        }
    };
    let cores = args
        .cores
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    if let Some(spec) = &args.sim {
        // A bad profile is refused here, once, not by every worker.
        let profile = pdserve_engine::sim::SimProfile::load(spec)?;
        println!("simulated engine: {}", profile.summary());
    }
    let kv_secret = kv_secret()?;
    let stack = Stack {
        exe: &exe,
        model: &model,
        args,
        kv_secret: &kv_secret,
        sockets,
        ports: PortPicker::default(),
    };
    // The entry points' own ports are never handed to a worker.
    for replica in 0..args.gateway_replicas {
        stack.ports.reserve(args.port.saturating_add(replica));
    }
    let (entry, summary) = match args.topology {
        Topology::Gateway => stack.start_with_gateway(members, cores).await?,
        Topology::Orchestrator => stack.start_orchestrated(members, cores).await?,
    };

    println!("pdserve is up at {entry}/v1");
    for line in &summary {
        println!("  {line}");
    }
    println!(
        "try:\n  curl {entry}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Give me three tips for staying healthy.\"}}], \"max_tokens\": 64}}'"
    );
    println!("Ctrl-C stops everything.");

    let (name, status) = first_exit(members).await;
    bail!("{name} exited unexpectedly ({status}); stopping the stack")
}

/// What every member is started from.
struct Stack<'a> {
    exe: &'a std::path::Path,
    model: &'a std::path::Path,
    args: &'a UpArgs,
    /// The KV transfer secret every member gets (`PDSERVE_KV_SECRET`).
    kv_secret: &'a str,
    /// The stack's private folder for its members' Unix sockets (KV events).
    sockets: &'a std::path::Path,
    /// The ports handed to members so far.
    ports: PortPicker,
}

/// A folder only this user can enter, for the stack's Unix sockets; removed by
/// [`run`] when the stack stops.
fn socket_folder() -> anyhow::Result<std::path::PathBuf> {
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
fn kv_secret() -> anyhow::Result<String> {
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
            placement.threads()
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
    async fn start_with_gateway(
        &self,
        members: &mut Vec<Member>,
        cores: usize,
    ) -> anyhow::Result<(String, Vec<String>)> {
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
        let mut worker_urls = Vec::new();
        let mut summary = Vec::new();
        let placements = match args.sim {
            Some(_) => vec![Placement::anywhere(); roles.len()],
            None => place(&roles, cores, args.core_layout),
        };
        for (role, placement) in roles.iter().zip(placements) {
            let port = self.ports.pick()?;
            let url = format!("http://127.0.0.1:{port}");
            let mut worker = self.worker(*role, "127.0.0.1", port, &placement)?;
            let name = member_name(*role, &roles[..worker_urls.len()]);
            gateway.extend([gateway_flag(*role).into(), url.clone()]);
            let mut line = format!("{role} worker at {url} on {}", describe(&placement));
            if sglang && *role == WorkerRole::Prefill {
                // SGLang's router reads `--prefill URL BOOTSTRAP_PORT`.
                let bootstrap = self.ports.pick()?.to_string();
                worker.args(["--bootstrap-port", &bootstrap]);
                gateway.push(bootstrap.clone());
                line.push_str(&format!(", bootstrap port {bootstrap}"));
            }
            // Every worker publishes its KV-cache events; every gateway replica subscribes
            // and indexes them. (After the bootstrap port: SGLang's `--prefill URL PORT`
            // must stay together.) By vLLM's rule an ipc:// endpoint binds, and a Unix
            // socket in the stack's private folder is reachable from this machine only.
            let index = worker_urls.len();
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
            gateway.extend([
                "--kv-events".into(),
                format!("{url}={events}"),
                "--kv-events-replay".into(),
                format!("{url}={replay}"),
            ]);
            members.push(spawn(&name, false, worker, &placement)?);
            summary.push(line);
            worker_urls.push(url);
        }
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
        let gateway_url = urls.swap_remove(0);
        Ok((gateway_url, summary))
    }

    /// Prefill workers, then the decode worker that orchestrates them on the public port;
    /// returns its URL and a summary. It is ready once a prefill worker is pre-warmed.
    async fn start_orchestrated(
        &self,
        members: &mut Vec<Member>,
        cores: usize,
    ) -> anyhow::Result<(String, Vec<String>)> {
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
        Ok((entry, summary))
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
struct PortPicker {
    given: std::sync::Mutex<std::collections::HashSet<u16>>,
}

impl PortPicker {
    /// Keeps `port` from being handed out.
    fn reserve(&self, port: u16) {
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
