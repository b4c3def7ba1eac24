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

use crate::members::{first_exit, stop_all, Member, StopSignals};
use crate::placement::CoreLayout;

mod autoscale;
mod stack;

use stack::{kv_secret, socket_folder, PortPicker, Stack};

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
    /// Size the prefill and decode pools as the gateway's P:D planner asks (its `GET
    /// /planner`): start workers of a pool it wants larger (as many as it asks, at once),
    /// and drain one of a pool it wants smaller (taken out of the gateway's listing, its
    /// requests finished, then stopped), never below one each. With the real engine or
    /// `--sim`; not with `--aggregated` or the orchestrator.
    #[arg(long, env = "PDSERVE_AUTOSCALE")]
    autoscale: bool,
    /// With --autoscale: the most workers (prefill and decode together) the stack runs.
    #[arg(
        long,
        env = "PDSERVE_MAX_WORKERS",
        default_value_t = 8,
        requires = "autoscale"
    )]
    max_workers: usize,
    /// With --autoscale: seconds between two looks at the planner.
    #[arg(
        long,
        env = "PDSERVE_AUTOSCALE_INTERVAL_SECS",
        default_value_t = 5.0,
        requires = "autoscale"
    )]
    autoscale_interval_secs: f64,
    /// With --autoscale: seconds a pool is left as it is after it was resized, so the
    /// planner's window sees the new size before the next step (growth of the prefill
    /// pool that the arriving prompt work asks for does not wait).
    #[arg(
        long,
        env = "PDSERVE_AUTOSCALE_COOLDOWN_SECS",
        default_value_t = 30.0,
        requires = "autoscale"
    )]
    autoscale_cooldown_secs: f64,
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
    if args.autoscale && (args.aggregated || args.topology != Topology::Gateway) {
        bail!("--autoscale sizes the prefill and decode pools behind the gateway: it does not apply to --aggregated or --topology orchestrator");
    }
    let initial = usize::from(args.prefill) + usize::from(args.decode);
    if args.autoscale && initial > args.max_workers {
        bail!(
            "--max-workers {} is below the {initial} workers --prefill and --decode start",
            args.max_workers
        );
    }
    let stack = Stack {
        exe: &exe,
        model: &model,
        args,
        kv_secret: &kv_secret,
        sockets,
        ports: PortPicker::default(),
        listing: args.autoscale.then(|| sockets.join("workers.json")),
    };
    // The entry points' own ports are never handed to a worker.
    for replica in 0..args.gateway_replicas {
        stack.ports.reserve(args.port.saturating_add(replica));
    }
    let started = match args.topology {
        Topology::Gateway => stack.start_with_gateway(members, cores).await?,
        Topology::Orchestrator => stack.start_orchestrated(members, cores).await?,
    };
    let (entry, summary) = (&started.entry, &started.summary);

    println!("pdserve is up at {entry}/v1");
    for line in summary {
        println!("  {line}");
    }
    if args.autoscale {
        println!(
            "  autoscaling on the gateway's /planner: up to {} workers",
            args.max_workers
        );
    }
    println!(
        "try:\n  curl {entry}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Give me three tips for staying healthy.\"}}], \"max_tokens\": 64}}'"
    );
    println!("Ctrl-C stops everything.");

    if args.autoscale {
        return autoscale::Autoscaler::new(&stack, started)
            .run(members)
            .await;
    }
    let (name, status) = first_exit(members).await;
    bail!("{name} exited unexpectedly ({status}); stopping the stack")
}
