//! `pdserve up` as a child process on a free port, for tests that drive a whole stack: its
//! entry point and workers read from its banner, stopped with SIGINT (or killed) when done.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A free port from outside the ephemeral range, where no `bind(0)` or outgoing
/// connection of a sibling test can take it before the process it is for binds it.
pub fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

/// `pdserve up` with some flags, stopped with SIGINT (or killed) when dropped.
pub struct Up {
    child: Child,
    pub entry: String,
    log: std::path::PathBuf,
    /// The workers it started (from its banner).
    #[allow(dead_code)]
    pub workers: Vec<String>,
}

impl Up {
    pub fn start(model: &std::path::Path, flags: &[&str]) -> Self {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("pdserve-up-{port}.log"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(["up", "--port", &port.to_string(), "--cores", "2"])
            .args(flags)
            .arg("--model")
            .arg(model)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut up = Self {
            child,
            entry: format!("http://127.0.0.1:{port}"),
            log,
            workers: Vec::new(),
        };
        loop {
            match rx.recv_timeout(Duration::from_secs(240)) {
                Ok(line) if line.starts_with("Ctrl-C stops everything") => return up,
                Ok(line) => {
                    let line = line.trim();
                    for role in ["prefill worker at ", "decode worker at "] {
                        if let Some(rest) = line.strip_prefix(role) {
                            up.workers.push(rest.split(' ').next().unwrap().to_string());
                        }
                    }
                }
                Err(e) => panic!(
                    "pdserve up {flags:?} did not come up: {e}; {}",
                    up.log_tail()
                ),
            }
        }
    }

    /// The last few KB of the stack's log (its stderr).
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = log.len().saturating_sub(6000);
        log[log.floor_char_boundary(start)..].to_string()
    }

    pub fn stop(mut self) {
        // SAFETY: signalling our own child process.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "pdserve up did not stop");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- pdserve up log (tail) ---\n{}", self.log_tail());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
