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
    /// Prefill workers.
    #[arg(long, env = "PDSERVE_PREFILL_WORKERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    prefill: u16,
    /// Decode workers.
    #[arg(long, env = "PDSERVE_DECODE_WORKERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    decode: u16,
    /// One aggregated worker (prefill and decode in one process) instead of P/D pools.
    #[arg(long, env = "PDSERVE_AGGREGATED", conflicts_with_all = ["prefill", "decode"])]
    aggregated: bool,
    /// Seconds a P/D worker keeps KV blocks pinned for a peer that never reads them.
    #[arg(long, env = "PDSERVE_KV_ABORT_TIMEOUT", default_value_t = 480)]
    kv_abort_timeout: u64,
}

/// What one worker of the stack does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkerRole {
    Both,
    Prefill,
    Decode,
}

impl WorkerRole {
    /// The `--role` value of `pdserve worker`.
    fn flag_value(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// The `pdserve gateway` flag that adds a worker of this role to its pools.
    fn gateway_flag(self) -> &'static str {
        match self {
            Self::Both => "--worker",
            Self::Prefill => "--prefill",
            Self::Decode => "--decode",
        }
    }
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
    let roles: Vec<WorkerRole> = if args.aggregated {
        vec![WorkerRole::Both]
    } else {
        std::iter::repeat_n(WorkerRole::Prefill, args.prefill.into())
            .chain(std::iter::repeat_n(WorkerRole::Decode, args.decode.into()))
            .collect()
    };
    let mut gateway = Command::new(exe);
    gateway
        .arg("gateway")
        .args(["--host", &args.host, "--port", &args.port.to_string()]);
    let mut worker_urls = Vec::new();
    let mut summary = Vec::new();
    for (role, cpus) in roles.iter().zip(split_cores(roles.len(), cores)) {
        let port = free_port()?;
        let url = format!("http://127.0.0.1:{port}");
        let mut worker = Command::new(exe);
        worker
            .arg("worker")
            .args(["--role", role.flag_value(), "--host", "127.0.0.1"])
            .args(["--port", &port.to_string()])
            .arg("--model")
            .arg(model)
            .args(["--threads", &cpus.len().to_string()]);
        if *role != WorkerRole::Both {
            worker
                .args(["--kv-port", &free_port()?.to_string()])
                .args(["--kv-abort-timeout", &args.kv_abort_timeout.to_string()]);
        }
        let name = format!("{} worker {}", role.flag_value(), worker_urls.len());
        members.push(spawn(&name, worker, &cpus)?);
        gateway.args([role.gateway_flag(), &url]);
        summary.push(format!(
            "{} worker at {url} on cores {cpus:?}",
            role.flag_value()
        ));
        worker_urls.push(url);
    }
    let limit = Duration::from_secs(args.ready_timeout_secs);
    for url in &worker_urls {
        wait_ready(members, url, limit).await?;
    }
    members.push(spawn("gateway", gateway, &[])?);
    let gateway_url = format!("http://{}:{}", args.host, args.port);
    wait_ready(members, &gateway_url, Duration::from_secs(30)).await?;

    println!("pdserve is up at {gateway_url}/v1");
    for line in &summary {
        println!("  {line}");
    }
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

/// The cores each worker is pinned to: disjoint, contiguous shares while there are
/// enough cores (the compute pools spin-wait, so shared cores collapse throughput), with
/// leftover cores going to the last (decode) workers; past that, round-robin.
fn split_cores(workers: usize, cores: usize) -> Vec<Vec<usize>> {
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

/// Starts a member, pinned to `cpus` (anywhere when empty).
fn spawn(name: &str, mut cmd: Command, cpus: &[usize]) -> anyhow::Result<Member> {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let cpus = cpus.to_vec();
    // SAFETY: prctl(2) and sched_setaffinity(2) are async-signal-safe and touch only the
    // child. The first makes the child die with this process even if `up` is killed
    // without a chance to stop it; the second pins it (its threads inherit the mask).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if !cpus.is_empty() {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for &c in &cpus {
                    libc::CPU_SET(c, &mut set);
                }
                let size = std::mem::size_of::<libc::cpu_set_t>();
                if libc::sched_setaffinity(0, size, &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
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

#[cfg(test)]
mod tests {
    use super::split_cores;

    #[test]
    fn cores_are_split_disjointly_then_shared() {
        assert_eq!(split_cores(2, 2), vec![vec![0], vec![1]]);
        assert_eq!(split_cores(1, 4), vec![vec![0, 1, 2, 3]]);
        assert_eq!(split_cores(2, 3), vec![vec![0], vec![1, 2]]);
        assert_eq!(split_cores(3, 2), vec![vec![0], vec![1], vec![0]]);
    }
}
