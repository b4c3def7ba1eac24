//! `pdserve up`: the whole stack on this machine in one command — workers on free local
//! ports, each pinned to its own cores, and a gateway in front of them.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::process::{Child, Command};

/// `pdserve up` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Port of the gateway (the OpenAI endpoint clients use).
    #[arg(long, env = "PDSERVE_PORT", default_value_t = 8000)]
    port: u16,
    /// Address the gateway binds.
    #[arg(long, env = "PDSERVE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// GGUF model to serve (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long, env = "PDSERVE_MODEL")]
    model: Option<PathBuf>,
    /// CPU cores to use in all (default: every core of this machine).
    #[arg(long, env = "PDSERVE_CORES")]
    cores: Option<usize>,
    /// Longest wait for a worker to load its model and answer /health.
    #[arg(long, default_value_t = 300)]
    ready_timeout_secs: u64,
}

/// One child process of the stack.
struct Member {
    name: String,
    child: Child,
}

/// Runs the stack until Ctrl-C (or until a member dies), then stops every member.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
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

    let mut members = Vec::new();
    let result = start_and_supervise(&args, &exe, &model, cores, &mut members).await;
    stop_all(&mut members).await;
    result
}

async fn start_and_supervise(
    args: &UpArgs,
    exe: &std::path::Path,
    model: &std::path::Path,
    cores: usize,
    members: &mut Vec<Member>,
) -> anyhow::Result<()> {
    let worker_port = free_port()?;
    let worker_url = format!("http://127.0.0.1:{worker_port}");
    let mut worker = Command::new(exe);
    worker
        .arg("worker")
        .args(["--role", "both", "--host", "127.0.0.1"])
        .args(["--port", &worker_port.to_string()])
        .arg("--model")
        .arg(model)
        .args(["--threads", &cores.to_string()]);
    members.push(spawn("worker", worker)?);
    wait_ready(
        members,
        &worker_url,
        Duration::from_secs(args.ready_timeout_secs),
    )
    .await?;

    let mut gateway = Command::new(exe);
    gateway
        .arg("gateway")
        .args(["--host", &args.host, "--port", &args.port.to_string()])
        .args(["--worker", &worker_url]);
    members.push(spawn("gateway", gateway)?);
    let gateway_url = format!("http://{}:{}", args.host, args.port);
    wait_ready(members, &gateway_url, Duration::from_secs(30)).await?;

    println!(
        "pdserve is up at {gateway_url}/v1 (1 aggregated worker at {worker_url}, {cores} cores)"
    );
    println!(
        "try:\n  curl {gateway_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Give me three tips for staying healthy.\"}}], \"max_tokens\": 64}}'"
    );
    println!("Ctrl-C stops everything.");

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => {
            r.context("cannot listen for Ctrl-C")?;
            eprintln!("stopping pdserve…");
            Ok(())
        }
        _ = terminate.recv() => {
            eprintln!("stopping pdserve (SIGTERM)…");
            Ok(())
        }
        (name, status) = first_exit(members) => {
            bail!("{name} exited unexpectedly ({status}); stopping the stack")
        }
    }
}

fn spawn(name: &str, mut cmd: Command) -> anyhow::Result<Member> {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    // SAFETY: prctl(2) is async-signal-safe; it makes the child die with this process
    // even if `up` is killed without a chance to stop it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("cannot start the {name}"))?;
    Ok(Member {
        name: name.to_string(),
        child,
    })
}

/// Polls `url/health` until it answers 200, failing early if a member exits.
async fn wait_ready(members: &mut [Member], url: &str, limit: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let started = Instant::now();
    loop {
        for m in members.iter_mut() {
            if let Some(status) = m.child.try_wait()? {
                bail!("{} exited before it was ready ({status})", m.name);
            }
        }
        if let Ok(resp) = client.get(format!("{url}/health")).send().await {
            if resp.status().is_success() {
                return Ok(());
            }
        }
        if started.elapsed() > limit {
            bail!("{url} was not ready after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Resolves when any member exits, with its name and status.
async fn first_exit(members: &mut [Member]) -> (String, std::process::ExitStatus) {
    loop {
        for m in members.iter_mut() {
            if let Ok(Some(status)) = m.child.try_wait() {
                return (m.name.clone(), status);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Asks every member to shut down gracefully (SIGINT, as Ctrl-C would), then kills
/// stragglers.
async fn stop_all(members: &mut [Member]) {
    for m in members.iter_mut() {
        if let Some(pid) = m.child.id() {
            // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGINT);
            }
        }
    }
    for m in members.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(10), m.child.wait())
            .await
            .is_err()
        {
            tracing::warn!(member = %m.name, "did not stop in 10 s; killing it");
            let _ = m.child.kill().await;
        }
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("no free local port")?;
    Ok(listener.local_addr()?.port())
}
