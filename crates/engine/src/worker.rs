//! Starting and stopping a worker: model load, scheduler thread, HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdserve_model::{Model, ModelError, BLOCK_SIZE};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::api::validate::ModelLimits;
use crate::api::{router, AppState};
use crate::args::{Role, WorkerArgs};
use crate::kv::{KvContext, KvService, KvServiceConfig};
use crate::metrics::Metrics;
use crate::scheduler::{self, EngineHandle, SchedulerConfig};
use crate::step_model::ModelRunner;

/// How long in-flight requests may run on after shutdown is asked for.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A flag value is unusable.
    #[error("invalid worker arguments: {0}")]
    InvalidArgs(String),
    /// The model could not be fetched or loaded.
    #[error("model: {0}")]
    Model(#[from] ModelError),
    /// Binding or serving the socket failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A background task or thread died.
    #[error("background task failed: {0}")]
    Task(String),
}

/// A running worker.
pub struct Worker {
    addr: SocketAddr,
    stop_http: Option<oneshot::Sender<()>>,
    server: JoinHandle<std::io::Result<()>>,
    engine: EngineHandle,
    scheduler: std::thread::JoinHandle<()>,
    kv_addr: Option<SocketAddr>,
    /// The KV transfer server and its abort-timeout sweeper.
    kv_tasks: Vec<JoinHandle<()>>,
}

fn check_args(args: &WorkerArgs) -> Result<(), WorkerError> {
    for (name, value) in [
        ("--num-kv-blocks", args.num_kv_blocks),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-waiting", args.max_waiting),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--threads", args.threads.unwrap_or(1)),
        ("--max-model-len", args.max_model_len.unwrap_or(2)),
        ("--kv-abort-timeout", args.kv_abort_timeout as usize),
    ] {
        if value == 0 {
            return Err(WorkerError::InvalidArgs(format!(
                "{name} must be at least 1"
            )));
        }
    }
    Ok(())
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
        if let Some(n) = args.threads {
            // The compute pools are process-wide and built once: the first worker wins.
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
        let load_path = path.clone();
        let model = Arc::new(blocking(move || Model::load(&load_path)).await?);
        let config = model.config().clone();
        let capacity = args.num_kv_blocks * BLOCK_SIZE;
        if let Some(len) = args.max_model_len {
            if len > config.context_length {
                return Err(WorkerError::InvalidArgs(format!(
                    "--max-model-len {len} exceeds the model's context length {}",
                    config.context_length
                )));
            }
        }
        let max_model_len = args
            .max_model_len
            .unwrap_or(config.context_length)
            .min(capacity);
        let metrics = Arc::new(Metrics::new());
        let runner = ModelRunner::new(model.clone(), args.num_kv_blocks);
        let kv_layout = runner.kv_layout();
        let kv_block_bytes = runner.kv_block_bytes();
        let (engine, scheduler) = scheduler::spawn(
            runner,
            SchedulerConfig {
                max_num_seqs: args.max_num_seqs,
                max_waiting: args.max_waiting,
                max_num_batched_tokens: args.max_num_batched_tokens,
                max_model_len,
            },
            metrics.clone(),
        )?;
        let limits = ModelLimits {
            served_model_name,
            max_model_len,
            eos_token_ids: model.tokenizer().eos_token_ids().to_vec(),
            vocab_size: config.vocab_size,
        };
        let mut kv_tasks = Vec::new();
        let mut kv_addr = None;
        let kv_service = if args.role != Role::Both || args.kv_port.is_some() {
            let kv_listener =
                TcpListener::bind((args.host.as_str(), args.kv_port.unwrap_or(0))).await?;
            let addr = kv_listener.local_addr()?;
            kv_addr = Some(addr);
            let service = Arc::new(KvService::new(
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
                    conversation_budget: args.num_kv_blocks / 2,
                },
                engine.clone(),
                metrics.clone(),
            ));
            kv_tasks.push(tokio::spawn(pdserve_kv_transfer::server::serve(
                kv_listener,
                service.clone(),
                pdserve_kv_transfer::ServerConfig::default(),
                std::future::pending(),
            )));
            kv_tasks.push(tokio::spawn(service.clone().sweep_forever()));
            tracing::info!(%addr, role = ?args.role, "KV transfer service listening");
            Some(service)
        } else {
            None
        };
        let state = Arc::new(AppState {
            engine: engine.clone(),
            model,
            limits,
            kv: KvContext {
                layout: kv_layout,
                block_bytes: kv_block_bytes,
                metrics: metrics.clone(),
                service: kv_service,
            },
            metrics,
        });
        let addr = listener.local_addr()?;
        let (stop_http, stopped) = oneshot::channel::<()>();
        let app = router(state);
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        tracing::info!(
            %addr,
            model = %path.display(),
            kv_blocks = args.num_kv_blocks,
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
            kv_tasks,
        })
    }

    /// The address of the KV transfer service, when the worker runs one.
    pub fn kv_addr(&self) -> Option<SocketAddr> {
        self.kv_addr
    }

    /// The address the worker listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting requests, lets in-flight ones finish for up to [`SHUTDOWN_GRACE`],
    /// then fails the rest and stops the scheduler thread.
    pub async fn shutdown(mut self) -> Result<(), WorkerError> {
        if let Some(stop) = self.stop_http.take() {
            let _ = stop.send(());
        }
        let served = match tokio::time::timeout(SHUTDOWN_GRACE, &mut self.server).await {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!("requests still running after the grace period; ending them");
                self.engine.shutdown();
                self.server.await
            }
        };
        for task in self.kv_tasks.drain(..) {
            task.abort();
        }
        self.engine.shutdown();
        let scheduler = self.scheduler;
        tokio::task::spawn_blocking(move || scheduler.join())
            .await
            .map_err(|e| WorkerError::Task(e.to_string()))?
            .map_err(|_| WorkerError::Task("the scheduler thread panicked".into()))?;
        served.map_err(|e| WorkerError::Task(e.to_string()))??;
        Ok(())
    }
}

/// Runs a worker on `--host`/`--port` until Ctrl-C or SIGTERM.
pub async fn run(args: WorkerArgs) -> Result<(), WorkerError> {
    let listener = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let worker = Worker::start(listener, args).await?;
    shutdown_signal().await;
    tracing::info!("shutting down");
    worker.shutdown().await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}
