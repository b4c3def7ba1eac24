//! The processes `pdserve up` starts: each spawned in its own process group, pinned to
//! its own cores and stopped with `up`, its output relayed with its name on each line;
//! waited for until healthy; stopped front door first, then the workers.

use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
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

impl Member {
    /// The name its log lines carry.
    pub fn name(&self) -> &str {
        &self.name
    }
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

/// Starts a member, pinned to its placement's own cores (anywhere when none).
pub fn spawn(
    name: &str,
    front: bool,
    mut cmd: Command,
    placement: &Placement,
) -> anyhow::Result<Member> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let cpus = placement.cpus.clone();
    // SAFETY: setpgid(2), prctl(2) and sched_setaffinity(2) are async-signal-safe and
    // touch only the child. Its own process group keeps a terminal's Ctrl-C from
    // reaching it directly, so `up` decides the order of the drain; the death signal
    // stops it with this process even if `up` is killed without a chance to stop it; the
    // mask pins it to its own cores (its threads inherit it; the compute threads on
    // borrowed cores pin and lower themselves, see `pdserve worker --borrowed-cpus`).
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
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    if let Some(out) = child.stdout.take() {
        tokio::spawn(relay_lines(name.to_string(), out, Output::Stdout));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(relay_lines(name.to_string(), err, Output::Stderr));
    }
    Ok(Member {
        name: name.to_string(),
        front,
        child,
    })
}

/// Where a member's output goes: `up`'s own stdout or stderr.
#[derive(Clone, Copy)]
enum Output {
    Stdout,
    Stderr,
}

/// Copies a member's output to `up`'s, each line led by the member's name (`gateway   |
/// …`), so that interleaved lines say which process wrote them. A JSON log line
/// (`--log-format json`) gets a `"process"` field instead, and stays one JSON object.
async fn relay_lines(name: String, from: impl AsyncRead + Unpin, to: Output) {
    let mut lines = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match lines.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        let out = labelled(&name, &line);
        // One write per line, so lines of different members never interleave.
        let _ = match to {
            Output::Stdout => std::io::stdout().lock().write_all(&out),
            Output::Stderr => std::io::stderr().lock().write_all(&out),
        };
    }
}

/// `line` (newline included) as `up` prints it for member `name`.
fn labelled(name: &str, line: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(line.len() + 16);
    match line.strip_prefix(b"{") {
        Some(rest) => {
            out.extend_from_slice(b"{\"process\":");
            out.extend_from_slice(serde_json::to_string(name).unwrap_or_default().as_bytes());
            if !rest.trim_ascii_start().starts_with(b"}") {
                out.push(b',');
            }
            out.extend_from_slice(rest);
        }
        None => {
            out.extend_from_slice(format!("{name:<10}| ").as_bytes());
            out.extend_from_slice(line);
        }
    }
    out
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

/// Stops one member: SIGTERM and `limit` to drain and exit, then it is killed.
pub async fn stop_one(member: &mut Member, limit: Duration) {
    if let (Ok(None), Some(pid)) = (member.child.try_wait(), member.child.id()) {
        // SAFETY: kill(2) on our own running child's pid has no memory-safety
        // preconditions.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    all_exited(&mut [member], limit).await;
    if let Ok(None) = member.child.try_wait() {
        tracing::warn!(member = %member.name, "did not stop in {limit:?}; killing it");
        let _ = member.child.kill().await;
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

#[cfg(test)]
mod tests {
    use super::labelled;

    #[test]
    fn a_line_says_which_member_wrote_it() {
        let text = labelled("prefill-0", b"2026-12-06 INFO pdserve: ready\n");
        assert_eq!(text, b"prefill-0 | 2026-12-06 INFO pdserve: ready\n");
        let json = labelled("gateway", b"{\"level\":\"INFO\"}\n");
        let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(value["process"], "gateway");
        assert_eq!(value["level"], "INFO");
        let empty = labelled("gateway", b"{}\n");
        assert_eq!(empty, b"{\"process\":\"gateway\"}\n");
    }
}
