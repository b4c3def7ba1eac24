//! An in-process `pdserve worker` on 127.0.0.1, for tests that drive the engine and the
//! gateway in one process.

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use tokio::net::TcpListener;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

/// Starts a worker of `role` on the model at `model`, one compute thread, with `extra`
/// flags; returns it and its base URL.
pub async fn start_worker(role: &str, model: &std::path::Path, extra: &[&str]) -> (Worker, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    start_worker_on(listener, role, model, extra).await
}

/// [`start_worker`] on a listener the caller bound (so flags may name its port).
pub async fn start_worker_on(
    listener: TcpListener,
    role: &str,
    model: &std::path::Path,
    extra: &[&str],
) -> (Worker, String) {
    let model = model.display().to_string();
    let argv = [
        "worker",
        "--role",
        role,
        "--model",
        &model,
        "--threads",
        "1",
    ]
    .into_iter()
    .chain(extra.iter().copied());
    let args = Cli::try_parse_from(argv).unwrap().args;
    let worker = Worker::start(listener, args).await.unwrap();
    let url = format!("http://{}", worker.local_addr());
    (worker, url)
}
