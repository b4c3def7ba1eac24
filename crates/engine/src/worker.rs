//! Starting and stopping a worker: model load, scheduler thread, HTTP server, and a
//! graceful drain on SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdserve_model::{ModelError, BLOCK_SIZE};
use pdserve_protocol::WorkerRole;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::{router, AppState};
use crate::args::WorkerArgs;
use crate::compute::{Compute, ComputeError};
use crate::health::WorkerHealth;
use crate::kv::{KvContext, KvService, KvServiceConfig};
use crate::kv_events::{KvEventsConfig, Publisher};
use crate::metrics::Metrics;
use crate::orchestrator::{prefill_url, Orchestrator, OrchestratorConfig};
use crate::scheduler::{self, EngineHandle, SchedulerConfig};
use crate::serving::{ModelLimits, ServingContext};

/// After the shutdown timeout has failed the remaining requests, how long their error
/// events get to reach the clients before the connections are dropped.
const FLUSH_GRACE: Duration = Duration::from_secs(2);
/// How long shutdown waits for the scheduler thread to stop (it may be wedged).
const SCHEDULER_STOP_GRACE: Duration = Duration::from_secs(5);
/// How often shutdown looks again at what it waits for.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A flag value is unusable.
    #[error("invalid worker arguments: {0}")]
    InvalidArgs(String),
    /// The model could not be fetched or loaded.
    #[error("model: {0}")]
    Model(#[from] ModelError),
    /// The model or the sim profile could not be set up.
    #[error("{0}")]
    Compute(#[from] ComputeError),
    /// Binding or serving the socket failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A background task or thread died.
    #[error("background task failed: {0}")]
    Task(String),
    /// A second SIGTERM or Ctrl-C cut the drain short.
    #[error("stopped by a second signal before in-flight requests finished")]
    Interrupted,
}

/// A running worker.
pub struct Worker {
    addr: SocketAddr,
    stop_http: Option<oneshot::Sender<()>>,
    server: JoinHandle<std::io::Result<()>>,
    engine: EngineHandle,
    scheduler: std::thread::JoinHandle<()>,
    kv_addr: Option<SocketAddr>,
    kv_service: Option<Arc<KvService>>,
    /// The KV transfer server, its abort-timeout sweeper and, with `--prefill`, the
    /// prefill workers' pre-warm supervisors.
    kv_tasks: Vec<JoinHandle<()>>,
    health: Arc<WorkerHealth>,
    shutdown_timeout: Duration,
    /// The KV-event publisher, while it runs.
    kv_events: Option<Publisher>,
}

fn check_args(args: &WorkerArgs) -> Result<(), WorkerError> {
    if args.role == WorkerRole::Encode {
        return Err(WorkerError::InvalidArgs(
            "--role encode is not supported: the embedded model is text-only (use \
             prefill_decode, prefill or decode)"
                .into(),
        ));
    }
    for (name, value) in [
        ("--num-kv-blocks", args.num_kv_blocks),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-waiting", args.max_waiting),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--threads", args.threads.unwrap_or(1)),
        ("--max-model-len", args.max_model_len.unwrap_or(2)),
        ("--kv-abort-timeout", args.kv_abort_timeout as usize),
        ("--wedged-after-secs", args.wedged_after_secs as usize),
        ("--prefill-timeout-secs", args.prefill_timeout_secs as usize),
        (
            "--prewarm-interval-secs",
            args.prewarm_interval_secs as usize,
        ),
        ("--prewarm-attempts", args.prewarm_attempts as usize),
        (
            "--bootstrap-timeout-secs",
            args.bootstrap_timeout_secs as usize,
        ),
    ] {
        if value == 0 {
            return Err(WorkerError::InvalidArgs(format!(
                "{name} must be at least 1"
            )));
        }
    }
    if let (Some(cores), Some(threads)) = (compute_cores(args), args.threads) {
        if cores.threads() != threads {
            return Err(WorkerError::InvalidArgs(format!(
                "--threads {threads} disagrees with --cpus and --borrowed-cpus, which name \
                 {} cores (one thread each): leave --threads out",
                cores.threads()
            )));
        }
    }
    let mut named: Vec<usize> = args
        .cpus
        .iter()
        .chain(&args.borrowed_cpus)
        .copied()
        .collect();
    named.sort_unstable();
    if named.windows(2).any(|w| w[0] == w[1]) {
        return Err(WorkerError::InvalidArgs(format!(
            "--cpus {:?} and --borrowed-cpus {:?} name a core twice",
            args.cpus, args.borrowed_cpus
        )));
    }
    orchestrator_config(args)?;
    crate::args::kv_security::peers_from_args(args).map_err(WorkerError::InvalidArgs)?;
    if args.bootstrap_port.is_some() && args.role != WorkerRole::Prefill {
        return Err(WorkerError::InvalidArgs(format!(
            "--bootstrap-port serves a prefill worker's rooms: it needs --role prefill, not {}",
            args.role
        )));
    }
    Ok(())
}

/// The cores `--cpus` and `--borrowed-cpus` pin the compute threads to, if any.
fn compute_cores(args: &WorkerArgs) -> Option<pdserve_model::ComputeCores> {
    if args.cpus.is_empty() && args.borrowed_cpus.is_empty() {
        return None;
    }
    Some(pdserve_model::ComputeCores {
        own: args.cpus.clone(),
        borrowed: args.borrowed_cpus.clone(),
    })
}

/// The orchestrator `--prefill` asks for, if any.
fn orchestrator_config(args: &WorkerArgs) -> Result<Option<OrchestratorConfig>, WorkerError> {
    if args.prefill.is_empty() {
        return Ok(None);
    }
    if args.role != WorkerRole::Decode {
        return Err(WorkerError::InvalidArgs(format!(
            "--prefill makes a decode worker the entry point: it needs --role decode, not {}",
            args.role
        )));
    }
    let prefill = args
        .prefill
        .iter()
        .map(|u| prefill_url(u))
        .collect::<Result<Vec<_>, _>>()
        .map_err(WorkerError::InvalidArgs)?;
    Ok(Some(OrchestratorConfig {
        prefill,
        handoff: args.handoff,
        first_token_from_prefill: args.first_token_from_prefill,
        prefill_timeout: Duration::from_secs(args.prefill_timeout_secs),
        prewarm_interval: Duration::from_secs(args.prewarm_interval_secs),
        prewarm_attempts: args.prewarm_attempts,
        prefill_api_key: args.api_key.clone(),
    }))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ModelError> + Send + 'static,
) -> Result<T, WorkerError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| WorkerError::Task(e.to_string()))?
        .map_err(WorkerError::from)
}

impl Worker {
    /// Loads the model and serves it on `listener` (e.g. a 127.0.0.1:0 listener in tests).
    pub async fn start(listener: TcpListener, args: WorkerArgs) -> Result<Self, WorkerError> {
        check_args(&args)?;
        // The compute pools are process-wide and built once: the first worker wins.
        if let Some(cores) = compute_cores(&args) {
            let n = cores.threads();
            if !pdserve_model::set_compute_cores(cores) {
                tracing::warn!("compute threads were already set up; --cpus ignored");
            } else {
                tracing::info!(
                    threads = n,
                    cpus = ?args.cpus,
                    borrowed_cpus = ?args.borrowed_cpus,
                    "compute threads pinned"
                );
            }
        } else if let Some(n) = args.threads {
            if !pdserve_model::set_threads(n) {
                tracing::warn!("compute threads were already set up; --threads {n} ignored");
            }
        }
        let path = match args.model.clone() {
            Some(path) => path,
            None => {
                blocking(|| pdserve_model::ensure_default_model(&pdserve_model::home_dir())).await?
            }
        };
        let served_model_name = args.served_model_name.clone().unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        let mut metrics = Metrics::for_model(&served_model_name);
        if args.sim.is_some() {
            metrics = metrics.with_sim();
        }
        let metrics = Arc::new(metrics);
        let lateness = metrics
            .sim
            .as_ref()
            .map(|sim| sim.step_lateness_seconds.clone());
        let (load_args, load_path) = (args.clone(), path.clone());
        let compute =
            tokio::task::spawn_blocking(move || Compute::load(&load_args, &load_path, lateness))
                .await
                .map_err(|e| WorkerError::Task(e.to_string()))??;
        let Compute {
            step_model,
            text,
            kv_layout,
            kv_block_bytes,
            limits: engine_limits,
            link,
            sim_profile,
        } = compute;
        let max_model_len = engine_limits.max_model_len;
        let capacity = engine_limits.num_kv_blocks * BLOCK_SIZE;
        let config = text.config().clone();
        let kv_events = match args.kv_events_config.as_deref() {
            Some(json) => match KvEventsConfig::parse(json).map_err(WorkerError::InvalidArgs)? {
                Some(config) => Some(
                    Publisher::start(config)
                        .await
                        .map_err(|e| WorkerError::InvalidArgs(e.to_string()))?,
                ),
                None => None,
            },
            None => None,
        };
        let (engine, scheduler) = scheduler::spawn_publishing(
            step_model,
            SchedulerConfig {
                max_num_seqs: engine_limits.max_num_seqs,
                max_waiting: args.max_waiting,
                max_num_batched_tokens: engine_limits.max_num_batched_tokens,
                max_model_len,
                policy: args.scheduling_policy().map_err(WorkerError::InvalidArgs)?,
            },
            metrics.clone(),
            kv_events.as_ref().map(Publisher::sink),
        )?;
        if let Some(dir) = &args.profile_dir {
            engine.profiler().enable(dir.clone());
        }
        let limits = ModelLimits {
            served_model_name,
            max_model_len,
            eos_token_ids: text.tokenizer().eos_token_ids().to_vec(),
            vocab_size: config.vocab_size,
        };
        let mut kv_tasks = Vec::new();
        let mut kv_addr = None;
        // Who may read this worker's KV and whom it reads from (`--kv-peers`,
        // `PDSERVE_KV_SECRET`): the KV transfer service and every pull check them.
        let kv_peers = Arc::new(
            crate::args::kv_security::peers_from_args(&args).map_err(WorkerError::InvalidArgs)?,
        );
        let kv_secret = crate::args::kv_security::secret_from_args(&args);
        let kv_server_config = pdserve_kv_transfer::ServerConfig {
            peers: Some(kv_peers.clone()),
            secret: kv_secret.clone(),
            ..Default::default()
        };
        let kv_service = if args.role != WorkerRole::PrefillDecode || args.kv_port.is_some() {
            let kv_listener =
                TcpListener::bind((args.host.as_str(), args.kv_port.unwrap_or(0))).await?;
            let addr = kv_listener.local_addr()?;
            kv_addr = Some(addr);
            let service = Arc::new(
                KvService::new(
                    KvServiceConfig {
                        engine_id: args
                            .engine_id
                            .clone()
                            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
                        layout: kv_layout.clone(),
                        block_bytes: kv_block_bytes,
                        host: args.kv_host.clone().unwrap_or_else(|| args.host.clone()),
                        port: addr.port(),
                        abort_timeout: Duration::from_secs(args.kv_abort_timeout),
                        // Conversation hand-backs may hold at most half the pool.
                        conversation_budget: engine_limits.num_kv_blocks / 2,
                    },
                    engine.clone(),
                    metrics.clone(),
                )
                .with_streaming(args.kv_stream),
            );
            kv_tasks.push(tokio::spawn(pdserve_kv_transfer::server::serve(
                kv_listener,
                service.clone(),
                kv_server_config.clone(),
                std::future::pending(),
            )));
            kv_tasks.push(tokio::spawn(service.clone().sweep_forever()));
            tracing::info!(
                %addr,
                role = %args.role,
                peers = %kv_peers,
                secret = kv_secret.is_some(),
                "KV transfer service listening"
            );
            Some(service)
        } else {
            None
        };
        // SGLang's bootstrap rendezvous (`--bootstrap-port`, prefill workers only).
        let mut bootstrap = crate::bootstrap::Bootstrap::new(
            args.role,
            path.display().to_string(),
            capacity,
            Duration::from_secs(args.bootstrap_timeout_secs),
            metrics.clone(),
        );
        if let (Some(port), Some(service)) = (args.bootstrap_port, &kv_service) {
            let listener = TcpListener::bind((args.host.as_str(), port)).await?;
            // The same peer and secret checks as the KV transfer service's.
            let config = kv_server_config.clone();
            kv_tasks.push(bootstrap.listen(listener, service.clone(), config)?);
            if let Some(addr) = bootstrap.addr() {
                tracing::info!(%addr, "bootstrap port listening (SGLang rooms)");
            }
        }
        let orchestrator = match orchestrator_config(&args)? {
            Some(config) => Some(Arc::new(
                Orchestrator::new(config, metrics.clone()).map_err(WorkerError::InvalidArgs)?,
            )),
            None => None,
        };
        let mut health =
            WorkerHealth::new(engine.clone(), Duration::from_secs(args.wedged_after_secs));
        if let Some(orchestrator) = &orchestrator {
            health = health.requiring_warm_prefill(orchestrator.pool().clone());
        }
        let health = Arc::new(health);
        let serving = Arc::new(ServingContext {
            engine: engine.clone(),
            text,
            limits,
            kv: KvContext {
                layout: kv_layout,
                block_bytes: kv_block_bytes,
                metrics: metrics.clone(),
                service: kv_service.clone(),
                peers: kv_peers,
                secret: kv_secret,
                link,
            },
            metrics,
        });
        let state = Arc::new(AppState {
            serving,
            health: health.clone(),
            orchestrator: orchestrator.clone(),
            bootstrap,
            responses: Default::default(),
        });
        if let Some(orchestrator) = &orchestrator {
            kv_tasks.extend(orchestrator.spawn_prewarm(&state.serving));
            tracing::info!(
                prefill = ?args.prefill,
                handoff = ?args.handoff,
                "decode as orchestrator: /health is 503 until a prefill worker is warm"
            );
        }
        let addr = listener.local_addr()?;
        let (stop_http, stopped) = oneshot::channel::<()>();
        let http_options = crate::api::http_layers::HttpOptions {
            api_key: args.api_key.clone(),
            max_body_bytes: args.max_body_bytes,
        };
        let app = crate::api::http_layers::apply(router(state), &http_options);
        let options = pdserve_http_server::ServeOptions {
            header_read_timeout: Duration::from_secs(args.header_read_timeout_secs),
            body_read_timeout: Duration::from_secs(args.body_read_timeout_secs),
            max_connections: args.max_connections,
        };
        // The shared accept loop: read timeouts and a connection cap, same drain.
        let server = tokio::spawn(async move {
            pdserve_http_server::serve(listener, app, options, async {
                let _ = stopped.await;
            })
            .await;
            Ok(())
        });
        tracing::info!(
            %addr,
            role = %args.role,
            model = %path.display(),
            sim = sim_profile.as_deref().unwrap_or("off"),
            kv_blocks = engine_limits.num_kv_blocks,
            max_model_len,
            "worker listening"
        );
        Ok(Self {
            addr,
            stop_http: Some(stop_http),
            server,
            engine,
            scheduler,
            kv_addr,
            kv_service,
            kv_tasks,
            health,
            shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
            kv_events,
        })
    }

    /// Where this worker publishes KV events and answers replays (`--kv-events-config`).
    pub fn kv_events_endpoints(&self) -> Option<(&str, Option<&str>)> {
        self.kv_events
            .as_ref()
            .map(|p| (p.endpoint.as_str(), p.replay_endpoint.as_deref()))
    }

    /// The address of the KV transfer service, when the worker runs one.
    pub fn kv_addr(&self) -> Option<SocketAddr> {
        self.kv_addr
    }

    /// The address the worker listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What `GET /health` reports (shared: it stays readable while the worker drains).
    pub fn health(&self) -> Arc<WorkerHealth> {
        self.health.clone()
    }

    /// Drains the worker: `/health` turns 503 and new connections are refused at once;
    /// in-flight requests (open streams included) run to the end, and a prefill worker's
    /// published KV waits for its decode peers, all within `--shutdown-timeout`. Requests
    /// still running then are ended with an error; finally the scheduler thread stops.
    pub async fn shutdown(mut self) -> Result<(), WorkerError> {
        let deadline = Instant::now() + self.shutdown_timeout;
        self.health.begin_drain();
        if let Some(stop) = self.stop_http.take() {
            let _ = stop.send(());
        }
        let served = match tokio::time::timeout_at(deadline, &mut self.server).await {
            Ok(served) => Some(served),
            Err(_) => {
                tracing::warn!(
                    timeout_secs = self.shutdown_timeout.as_secs(),
                    "requests still running at the shutdown timeout; ending them"
                );
                self.engine.shutdown();
                match tokio::time::timeout(FLUSH_GRACE, &mut self.server).await {
                    Ok(served) => Some(served),
                    Err(_) => {
                        // A client that does not read its stream cannot hold the exit.
                        self.server.abort();
                        None
                    }
                }
            }
        };
        if let Some(service) = &self.kv_service {
            // A decode peer reads a prefill's KV right after the prefill's response: let
            // it, or it would fail a request this worker already answered.
            while service.pending_exports() > 0 && Instant::now() < deadline {
                tokio::time::sleep(DRAIN_POLL).await;
            }
            let left = service.pending_exports();
            if left > 0 {
                tracing::warn!(left, "KV exports still unread at the shutdown timeout");
            }
        }
        for task in self.kv_tasks.drain(..) {
            task.abort();
        }
        self.engine.shutdown();
        let stop_by = Instant::now() + SCHEDULER_STOP_GRACE;
        while !self.scheduler.is_finished() && Instant::now() < stop_by {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        if self.scheduler.is_finished() {
            self.scheduler
                .join()
                .map_err(|_| WorkerError::Task("the scheduler thread panicked".into()))?;
        } else {
            // Joining would block forever; the thread ends with the process.
            tracing::error!("the scheduler thread did not stop (wedged in a step?)");
        }
        if let Some(served) = served {
            served.map_err(|e| WorkerError::Task(e.to_string()))??;
        }
        Ok(())
    }
}

/// Runs a worker on `--host`/`--port` until SIGTERM or Ctrl-C, then drains it (see
/// [`Worker::shutdown`]). A second signal stops it without waiting.
pub async fn run(args: WorkerArgs) -> Result<(), WorkerError> {
    // Listening from the start: a signal during the model load must not kill the process
    // with the default action.
    let mut signals = StopSignals::new()?;
    let listener = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let worker = tokio::select! {
        worker = Worker::start(listener, args) => worker?,
        signal = signals.recv() => {
            tracing::info!("{signal} before the worker was ready; exiting");
            return Ok(());
        }
    };
    let signal = signals.recv().await;
    tracing::info!(
        timeout_secs = worker.shutdown_timeout.as_secs(),
        "{signal}: draining (new connections refused, in-flight requests finishing)"
    );
    tokio::select! {
        result = worker.shutdown() => {
            if result.is_ok() {
                tracing::info!("drained; exiting");
            }
            result
        }
        signal = signals.recv() => {
            tracing::warn!("{signal} again: exiting without waiting for in-flight requests");
            Err(WorkerError::Interrupted)
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C), caught from creation on.
struct StopSignals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                terminate: signal(SignalKind::terminate())?,
                interrupt: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next signal's name.
    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.terminate.recv() => "SIGTERM",
                _ = self.interrupt.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
            "Ctrl-C"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    use crate::args::WorkerCli;

    fn check(argv: &[&str]) -> Result<(), WorkerError> {
        let argv = std::iter::once("worker").chain(argv.iter().copied());
        check_args(&WorkerCli::try_parse_from(argv).unwrap().args)
    }

    #[test]
    fn encode_role_and_zero_bounds_are_refused_before_the_model_loads() {
        assert!(check(&[]).is_ok());
        assert!(check(&["--role", "both"]).is_ok());
        assert!(check(&["--role", "decode", "--shutdown-timeout", "0"]).is_ok());
        let err = check(&["--role", "encode"]).unwrap_err().to_string();
        assert!(
            err.contains("--role encode") && err.contains("text-only"),
            "{err}"
        );
        let err = check(&["--wedged-after-secs", "0"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--wedged-after-secs"), "{err}");
        assert!(check(&["--role", "decode", "--prefill", "http://127.0.0.1:1"]).is_ok());
        let err = check(&["--prefill", "http://127.0.0.1:1"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--role decode"), "{err}");
        let err = check(&["--role", "decode", "--prefill", "127.0.0.1:1"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("http://host:port"), "{err}");
    }
}
