//! Child processes that cannot outlive the suite.
//!
//! Each child runs under a small `sh` watchdog in its own process group: the watchdog
//! waits while both this test process and the child live, then kills the whole group.
//! So when the test binary exits (the shared fixture is a static and is never dropped)
//! or dies, vLLM (with its engine-core subprocess) and kvroute go within a second. The
//! suite kills a server on purpose the same way: SIGKILL to its group.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The watchdog: `$1…` is the command; `KVROUTE_WATCH_PID` the process it outlives not.
const WATCHDOG: &str = r#"
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
while kill -0 "$KVROUTE_WATCH_PID" 2>/dev/null && kill -0 "$child" 2>/dev/null; do sleep 0.5; done
kill -KILL 0
"#;

/// `<temp>/<name>-<pid>`, created: a scratch directory for this run's configs and logs.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A supervised child process.
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `program args…` with `envs`, output appended to `log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], envs: &[(&str, String)], log: &Path) -> Proc {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log file opens");
        let err = out.try_clone().expect("log file clones");
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(WATCHDOG).arg("watchdog").arg(program).args(args);
        cmd.env("KVROUTE_WATCH_PID", std::process::id().to_string());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null()).stdout(out).stderr(err).process_group(0);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {name} ({}): {e}", program.display()));
        Proc { child }
    }

    /// Whether it is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL to the whole group (the program and everything it started), then reaps.
    pub fn kill(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Lowest port [`free_port`] hands out.
const PORT_MIN: u16 = 20_000;

/// A free TCP port below the kernel's ephemeral range, so that no `bind(0)` and no
/// outgoing connection can take it between this check and the server's own bind: two
/// vLLM servers starting at once pick their internal ports by `bind(0)`, and once took
/// one of the other's chosen ports on every retry. Falls back to `bind(0)` when the
/// ephemeral range leaves no room below it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let top = ephemeral_low().unwrap_or(32_768);
    if top <= PORT_MIN + 1_000 {
        return bind_any();
    }
    let span = u32::from(top - PORT_MIN);
    // The pid spreads concurrent test binaries apart; the counter walks on from there.
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = PORT_MIN + ((start + n) % span) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    bind_any()
}

/// The first port of the kernel's ephemeral range, if it says.
fn ephemeral_low() -> Option<u16> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn bind_any() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0").local_addr().expect("addr").port()
}
