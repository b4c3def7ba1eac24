//! The processes `pdserve up` starts: each spawned in its own process group, pinned to
//! its cores at its niceness and stopped with `up`; waited for until healthy; stopped
//! front door first, then the workers.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::placement::Placement;

/// One child process of the stack.
pub struct Member {
    name: String,
    /// The entry point (the gateway, or the orchestrating decode worker): drained first.
    front: bool,
    child: Child,
}

/// SIGTERM and SIGINT (Ctrl-C), caught from creation on.
pub struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl StopSignals {
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self {
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?,
        })
    }

    /// The next signal's name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "Ctrl-C",
        }
    }
}

/// Starts a member, pinned to its placement's cores (anywhere when none) at its niceness.
pub fn spawn(
    name: &str,
    front: bool,
    mut cmd: Command,
    placement: &Placement,
) -> anyhow::Result<Member> {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let cpus = placement.cpus.clone();
    let nice = placement.nice;
    // SAFETY: setpgid(2), prctl(2), sched_setaffinity(2) and nice(2) are
    // async-signal-safe and touch only the child. Its own process group keeps a
    // terminal's Ctrl-C from reaching it directly, so `up` decides the order of the
    // drain; the death signal stops it with this process even if `up` is killed without
    // a chance to stop it; the mask pins it and the niceness slows it (its threads
    // inherit both).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
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
            // Relative to `up`'s own niceness (as `nice -n`), so that under a niced `up`
            // prefill still yields to decode, and no privilege is needed to set it.
            if nice != 0 {
                *libc::__errno_location() = 0;
                if libc::nice(nice) == -1 && *libc::__errno_location() != 0 {
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
        front,
        child,
    })
}

/// Polls `url/health` until it answers 200, failing early if a member exits.
pub async fn wait_ready(members: &mut [Member], url: &str, limit: Duration) -> anyhow::Result<()> {
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
pub async fn first_exit(members: &mut [Member]) -> (String, std::process::ExitStatus) {
    loop {
        for m in members.iter_mut() {
            if let Ok(Some(status)) = m.child.try_wait() {
                return (m.name.clone(), status);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Stops the entry point (gateway or orchestrating decode worker), then the other
/// workers: each gets SIGTERM and `limit` to drain and exit, then is killed. A second
/// signal kills every member still running at once.
pub async fn stop_all(members: &mut [Member], limit: Duration, signals: &mut StopSignals) {
    let (front, workers): (Vec<&mut Member>, Vec<&mut Member>) =
        members.iter_mut().partition(|m| m.front);
    let mut forced = false;
    for mut stage in [front, workers] {
        if !forced {
            for m in stage.iter_mut() {
                if let (Ok(None), Some(pid)) = (m.child.try_wait(), m.child.id()) {
                    // SAFETY: kill(2) on our own running child's pid has no
                    // memory-safety preconditions.
                    unsafe {
                        libc::kill(pid as libc::pid_t, libc::SIGTERM);
                    }
                }
            }
            tokio::select! {
                _ = all_exited(&mut stage, limit) => {}
                signal = signals.recv() => {
                    eprintln!("{signal} again: killing the stack");
                    forced = true;
                }
            }
        }
        for m in stage.iter_mut() {
            match m.child.try_wait() {
                Ok(Some(status)) if status.success() => {}
                Ok(Some(status)) => {
                    tracing::warn!(member = %m.name, %status, "exited with an error")
                }
                _ => {
                    if !forced {
                        tracing::warn!(member = %m.name, "did not stop in {limit:?}; killing it");
                    }
                    let _ = m.child.kill().await;
                }
            }
        }
    }
}

/// Resolves when every one of `members` has exited, or after `limit`.
async fn all_exited(members: &mut [&mut Member], limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if members
            .iter_mut()
            .all(|m| !matches!(m.child.try_wait(), Ok(None)))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
