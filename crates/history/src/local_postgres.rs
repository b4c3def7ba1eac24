//! A throwaway PostgreSQL server for tests: [`LocalPostgres::start`] makes a database in a
//! temp folder and serves it on 127.0.0.1 at a free port, with trust authentication on
//! loopback only; dropping it stops the server and removes the folder. Tests can take it
//! down ([`LocalPostgres::stop`]) and bring it back on the same port with the same data
//! ([`LocalPostgres::start_again`]).
//!
//! It uses the installed server's programs (`PDSERVE_POSTGRES_BINDIR` when set, else
//! `pg_config --bindir`, else `/usr/lib/postgresql/*/bin`, else `initdb` on the PATH), run
//! as the `postgres` user when this process is root (PostgreSQL refuses to run as root).
//! Every step is bounded in time, so a server that never comes up is an error, not a hang.
//!
//! [`start_for_test`] holds the rule for tests: without the server's programs a test says
//! `SKIPPED:` and returns, except under `CI=true`, where it fails (unless
//! `PDSERVE_SKIP_POSTGRES=1`, which always skips).

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The database [`LocalPostgres::url`] names.
pub const DATABASE: &str = "pdserve";

/// Longest a server may take to start or stop before it counts as failed.
const SERVER_WAIT: Duration = Duration::from_secs(30);

/// Why there is no local server.
#[derive(Debug, thiserror::Error)]
pub enum LocalPostgresError {
    /// The server's programs are not installed (a test may skip).
    #[error("the PostgreSQL server is not installed: {0}")]
    Missing(String),
    /// They are, but the server did not come up or go down as asked.
    #[error("the local PostgreSQL server failed: {0}")]
    Failed(String),
}

use LocalPostgresError::{Failed, Missing};

/// A PostgreSQL server of this process's own (see the module documentation).
#[derive(Debug)]
pub struct LocalPostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    /// Set when this process is root: every program runs as the `postgres` user.
    runas: Option<RunAs>,
    running: bool,
}

#[derive(Debug, Clone)]
enum RunAs {
    Runuser(PathBuf),
    Su(PathBuf),
}

impl LocalPostgres {
    /// Makes a fresh database cluster and starts serving it.
    pub fn start() -> Result<Self, LocalPostgresError> {
        let bin = find_bindir()?;
        let runas = if running_as_root() {
            Some(find_runas()?)
        } else {
            None
        };
        let dir = make_dir(runas.is_some())?;
        let mut server = Self {
            bin,
            dir,
            port: 0,
            runas,
            running: false,
        };
        // From here on, dropping `server` removes the folder (and stops what started).
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                data.as_str(),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
            Duration::from_secs(120),
        )?;
        // The free port may be taken by someone else before the server binds it: retry.
        let mut last = String::new();
        for _ in 0..5 {
            server.port = free_port()?;
            match server.start_again() {
                Ok(()) => break,
                Err(Failed(why)) if why.contains("already in use") => last = why,
                Err(e) => return Err(e),
            }
        }
        if !server.running {
            return Err(Failed(format!("no free port to serve on: {last}")));
        }
        let port = server.port.to_string();
        server.run(
            "createdb",
            &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", DATABASE],
            SERVER_WAIT,
        )?;
        tracing::debug!(port = server.port, dir = %server.dir.display(), "local PostgreSQL up");
        Ok(server)
    }

    /// The url of its database: `postgres://postgres@127.0.0.1:PORT/pdserve`.
    pub fn url(&self) -> String {
        self.url_of(DATABASE)
    }

    /// The url of database `name` on this server.
    pub fn url_of(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Creates another database, `name`; its url.
    pub fn create_database(&self, name: &str) -> Result<String, LocalPostgresError> {
        let port = self.port.to_string();
        self.run(
            "createdb",
            &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", name],
            SERVER_WAIT,
        )?;
        Ok(self.url_of(name))
    }

    /// Stops the server at once (as a crash would: open connections are cut).
    pub fn stop(&mut self) -> Result<(), LocalPostgresError> {
        let data = self.data();
        let wait = SERVER_WAIT.as_secs().to_string();
        self.run(
            "pg_ctl",
            &["-D", &data, "-m", "immediate", "-w", "-t", &wait, "stop"],
            SERVER_WAIT + Duration::from_secs(10),
        )?;
        self.running = false;
        Ok(())
    }

    /// Starts it again (or the first time), on the same port with the same data, and
    /// returns once it accepts connections.
    pub fn start_again(&mut self) -> Result<(), LocalPostgresError> {
        let data = self.data();
        let log = self.dir.join("server.log").display().to_string();
        let wait = SERVER_WAIT.as_secs().to_string();
        // pg_ctl hands these to a shell: the folder's name has no spaces (see make_dir).
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={}",
            self.port,
            self.dir.display()
        );
        let started = self.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-o", &options, "-w", "-t", &wait, "start",
            ],
            SERVER_WAIT + Duration::from_secs(10),
        );
        if let Err(Failed(why)) = started {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            let tail = tail.lines().rev().take(5).collect::<Vec<_>>();
            let tail = tail.into_iter().rev().collect::<Vec<_>>().join(" | ");
            return Err(Failed(format!("{why}; server log: {tail}")));
        }
        started?;
        self.running = true;
        Ok(())
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// Runs `program` from the server's folder (as `postgres` where needed), bounded by
    /// `limit`; its output, or why it failed.
    fn run(
        &self,
        program: &str,
        args: &[&str],
        limit: Duration,
    ) -> Result<String, LocalPostgresError> {
        let path = self.bin.join(program);
        let mut command = match &self.runas {
            None => Command::new(&path),
            Some(RunAs::Runuser(runuser)) => {
                let mut c = Command::new(runuser);
                c.args(["-u", "postgres", "--"]).arg(&path);
                c
            }
            Some(RunAs::Su(su)) => {
                let line = std::iter::once(path.display().to_string())
                    .chain(args.iter().map(|a| a.to_string()))
                    .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
                    .collect::<Vec<_>>()
                    .join(" ");
                let mut c = Command::new(su);
                c.args(["postgres", "-s", "/bin/sh", "-c", &line]);
                c
            }
        };
        if !matches!(self.runas, Some(RunAs::Su(_))) {
            command.args(args);
        }
        // The postgres user may not be allowed into this process's working folder.
        command.current_dir(&self.dir);
        let output = self.dir.join(format!("{program}.out"));
        run_bounded(command, limit, &output).map_err(|why| Failed(format!("{program}: {why}")))
    }
}

impl Drop for LocalPostgres {
    fn drop(&mut self) {
        if self.running && self.stop().is_err() {
            // pg_ctl could not stop it: end the server by the pid it wrote.
            let pid_file = self.dir.join("data").join("postmaster.pid");
            if let Some(pid) = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|text| text.lines().next().map(str::trim).map(str::to_string))
            {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a server for test `test`, or says why there is none: `None` after a line
/// `SKIPPED: ...` on stderr when the server is not installed, or when
/// `PDSERVE_SKIP_POSTGRES=1`. Under `CI=true` a missing server fails the test instead
/// (CI installs it), and so does a server that is installed but does not start.
pub fn start_for_test(test: &str) -> Option<LocalPostgres> {
    let say = |line: String| {
        // Straight to stderr: libtest's capture would hide a skip.
        let _ = writeln!(std::io::stderr(), "{line}");
    };
    if std::env::var("PDSERVE_SKIP_POSTGRES").as_deref() == Ok("1") {
        say(format!("SKIPPED: {test}: PDSERVE_SKIP_POSTGRES=1"));
        return None;
    }
    match LocalPostgres::start() {
        Ok(server) => Some(server),
        Err(Missing(why)) if std::env::var("CI").as_deref() != Ok("true") => {
            say(format!(
                "SKIPPED: {test}: PostgreSQL is not installed: {why}"
            ));
            None
        }
        Err(Missing(why)) => panic!(
            "{test}: PostgreSQL is not installed ({why}); under CI=true this fails \
             (.ci/run installs it; PDSERVE_SKIP_POSTGRES=1 skips it)"
        ),
        Err(e) => panic!("{test}: {e}"),
    }
}

/// The folder holding `initdb`, `pg_ctl` and `postgres`.
fn find_bindir() -> Result<PathBuf, LocalPostgresError> {
    let complete = |dir: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|p| dir.join(p).is_file())
    };
    if let Some(given) = std::env::var_os("PDSERVE_POSTGRES_BINDIR") {
        let given = PathBuf::from(given);
        return if complete(&given) {
            Ok(given)
        } else {
            Err(Missing(format!(
                "no initdb, pg_ctl and postgres in PDSERVE_POSTGRES_BINDIR={}",
                given.display()
            )))
        };
    }
    let mut candidates = Vec::new();
    let probe = std::env::temp_dir().join(format!("pdserve-pg-config-{}", unique()));
    if let Ok(out) = run_bounded(
        {
            let mut c = Command::new("pg_config");
            c.arg("--bindir");
            c
        },
        Duration::from_secs(10),
        &probe,
    ) {
        candidates.push(PathBuf::from(out.trim()));
    }
    let _ = std::fs::remove_file(&probe);
    // Debian's layout, newest version first.
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(v.0));
    candidates.extend(versions.into_iter().map(|(_, bin)| bin));
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        if let Ok(initdb) = std::fs::canonicalize(dir.join("initdb")) {
            candidates.extend(initdb.parent().map(Path::to_path_buf));
        }
    }
    candidates
        .into_iter()
        .find(|dir| complete(dir))
        .ok_or_else(|| {
            Missing(
            "no initdb, pg_ctl and postgres in `pg_config --bindir`, /usr/lib/postgresql/*/bin \
             or the PATH (Debian: apt-get install postgresql)"
                .into(),
        )
        })
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to this process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// How root runs a program as `postgres`.
fn find_runas() -> Result<RunAs, LocalPostgresError> {
    if !Path::new("/etc/passwd").exists()
        || !std::fs::read_to_string("/etc/passwd")
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("postgres:"))
    {
        return Err(Failed(
            "running as root, and there is no `postgres` user to run the server as".into(),
        ));
    }
    let find = |name: &str| {
        ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|p| p.is_file())
    };
    find("runuser")
        .map(RunAs::Runuser)
        .or_else(|| find("su").map(RunAs::Su))
        .ok_or_else(|| Failed("running as root, and neither runuser nor su is here".into()))
}

/// A fresh folder for one server, the `postgres` user's when `chown` is set.
fn make_dir(chown: bool) -> Result<PathBuf, LocalPostgresError> {
    let dir = std::env::temp_dir().join(format!("pdserve-pg-{}", unique()));
    if dir.display().to_string().contains(char::is_whitespace) {
        return Err(Failed(format!(
            "the temp folder {} has a space in its name",
            dir.display()
        )));
    }
    let failed = |e: std::io::Error| Failed(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(&dir).map_err(failed)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(failed)?;
    if chown {
        let id = |flag: &str| -> Option<u32> {
            let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
            String::from_utf8_lossy(&out.stdout).trim().parse().ok()
        };
        let (Some(uid), Some(gid)) = (id("-u"), id("-g")) else {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(Failed("cannot read the postgres user's uid and gid".into()));
        };
        if let Err(e) = std::os::unix::fs::chown(&dir, Some(uid), Some(gid)) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(failed(e));
        }
    }
    Ok(dir)
}

/// A port on 127.0.0.1 that was free a moment ago, none handed out twice by this process.
fn free_port() -> Result<u16, LocalPostgresError> {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for _ in 0..100 {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| Failed(format!("no free port on 127.0.0.1: {e}")))?
            .port();
        if given.insert(port) {
            return Ok(port);
        }
    }
    Err(Failed("no free port on 127.0.0.1".into()))
}

/// A name no other server of any process on this machine has.
fn unique() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs `command` with its output in the file `output` (a pipe could be held open by a
/// server it starts), killing it past `limit`; the output, or why it failed.
fn run_bounded(mut command: Command, limit: Duration, output: &Path) -> Result<String, String> {
    let file = File::create(output).map_err(|e| format!("{}: {e}", output.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot run it: {e}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(status) => break status,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no end within {} s", limit.as_secs()));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let text = std::fs::read_to_string(output).unwrap_or_default();
    if status.success() {
        Ok(text)
    } else {
        let text = text.trim().lines().rev().take(8).collect::<Vec<_>>();
        let text = text.into_iter().rev().collect::<Vec<_>>().join(" | ");
        Err(format!("{status}: {text}"))
    }
}
