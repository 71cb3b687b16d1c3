//! A host process restarted when it exits, as a Deployment's kubelet restarts its
//! container: for the operator, which exits on purpose when it cannot renew its Lease
//! in time (an API server that stalls for a few seconds under a loaded CI machine is
//! enough with the tests' 6 s leases). A test that started it once would otherwise
//! wait out its timeout with no operator at all and blame whatever it was waiting for.
//!
//! Every exit is written to the process's log (appended, so one file holds every run)
//! and counted; [`Supervised::describe`] says both for failure messages, so a test that
//! times out tells a restarted operator from a stuck one.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{ChildGuard, ProcessError};

/// How often the supervisor looks at the process, and how long it waits before a
/// restart (a process that exits at once is not restarted in a hot loop).
const CHECK_EVERY: Duration = Duration::from_millis(200);
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// Builds the command line of each run; stdout and stderr are set by [`Supervised`].
pub type Launch = Box<dyn Fn() -> Command + Send + Sync>;

struct Shared {
    name: String,
    launch: Launch,
    log: PathBuf,
    child: Mutex<Option<ChildGuard>>,
    stop: AtomicBool,
    restarts: AtomicU32,
}

/// A process that is started again when it exits, until [`Supervised::kill`] or
/// drop, which kill it (SIGKILL, by its handle) and reap it.
pub struct Supervised {
    shared: Arc<Shared>,
    supervisor: Option<JoinHandle<()>>,
}

impl Supervised {
    /// Starts `launch()` with its output in `log` (created afresh) and supervises it.
    ///
    /// # Errors
    /// [`ProcessError::Log`] when the log cannot be created, [`ProcessError::Spawn`]
    /// when the first run cannot start.
    pub fn start(name: &str, launch: Launch, log: &Path) -> Result<Self, ProcessError> {
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir).map_err(|source| log_error(dir, source))?;
        }
        let file = File::create(log).map_err(|source| log_error(log, source))?;
        let child = spawn(name, &launch, file, log)?;
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            launch,
            log: log.to_owned(),
            child: Mutex::new(Some(child)),
            stop: AtomicBool::new(false),
            restarts: AtomicU32::new(0),
        });
        let watched = Arc::clone(&shared);
        let supervisor = std::thread::Builder::new()
            .name(format!("supervise {name}"))
            .spawn(move || supervise(&watched))
            .map_err(|source| log_error(log, source))?;
        Ok(Self {
            shared,
            supervisor: Some(supervisor),
        })
    }

    /// The whole log (empty when it cannot be read).
    #[must_use]
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.shared.log).unwrap_or_default()
    }

    /// How often the process exited and was started again.
    #[must_use]
    pub fn restarts(&self) -> u32 {
        self.shared.restarts.load(Ordering::SeqCst)
    }

    /// The restart count and the log's last `lines` lines, for a failure message.
    #[must_use]
    pub fn describe(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        format!(
            "{} restarted {} times; its log ({}) ends:\n{}",
            self.shared.name,
            self.restarts(),
            self.shared.log.display(),
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }

    /// Kills the process and stops restarting it.
    pub fn kill(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // The supervisor sees `stop` before it would restart; drop the child under the
        // lock so a restart cannot slip in between.
        drop(
            self.shared
                .child
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        if let Some(supervisor) = self.supervisor.take() {
            // A panicked supervisor has nothing left to stop.
            let _ = supervisor.join();
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.kill();
    }
}

fn log_error(path: &Path, source: std::io::Error) -> ProcessError {
    ProcessError::Log {
        path: path.to_owned(),
        source,
    }
}

fn spawn(name: &str, launch: &Launch, file: File, log: &Path) -> Result<ChildGuard, ProcessError> {
    let stderr = file.try_clone().map_err(|source| log_error(log, source))?;
    let mut command = launch();
    ChildGuard::spawn(name, command.stdout(file).stderr(stderr))
}

fn supervise(shared: &Shared) {
    while !shared.stop.load(Ordering::SeqCst) {
        std::thread::sleep(CHECK_EVERY);
        let exited = {
            let mut child = shared.child.lock().unwrap_or_else(PoisonError::into_inner);
            match child.as_mut().map(ChildGuard::ensure_running) {
                Some(Err(exit)) => {
                    *child = None;
                    Some(exit.to_string())
                }
                _ => None,
            }
        };
        let Some(exit) = exited else { continue };
        std::thread::sleep(RESTART_DELAY);
        let mut child = shared.child.lock().unwrap_or_else(PoisonError::into_inner);
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let restarts = shared.restarts.fetch_add(1, Ordering::SeqCst) + 1;
        let restarted = OpenOptions::new()
            .append(true)
            .open(&shared.log)
            .and_then(|mut file| {
                writeln!(
                    file,
                    "=== e2e supervisor: {exit}; starting {} again (restart {restarts}) ===",
                    shared.name
                )?;
                Ok(file)
            })
            .map_err(|source| log_error(&shared.log, source))
            .and_then(|file| spawn(&shared.name, &shared.launch, file, &shared.log));
        match restarted {
            Ok(process) => *child = Some(process),
            Err(error) => {
                tracing::error!(%error, name = %shared.name, "could not restart; giving up");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn an_exited_process_is_started_again_until_killed() {
        let dir = std::env::temp_dir().join(format!("slipway-supervised-{}", std::process::id()));
        let log = dir.join("exits.log");
        let launch: Launch = Box::new(|| {
            let mut command = Command::new("sh");
            command.args(["-c", "echo started; exit 3"]);
            command
        });
        let mut process = Supervised::start("exits", launch, &log).expect("starting sh");
        // The count goes up as a restart is launched, before its shell has printed:
        // wait for the third "started" too.
        wait_for("a second restart's output", || {
            process.restarts() >= 2 && process.log_text().matches("started").count() >= 3
        });
        process.kill();
        let after_kill = process.restarts();
        let text = process.log_text();
        assert!(text.matches("started").count() >= 3, "{text}");
        assert!(
            text.contains("exit status: 3; starting exits again (restart 1)"),
            "{text}"
        );
        assert!(
            process.describe(2).starts_with("exits restarted"),
            "{}",
            process.describe(2)
        );
        std::thread::sleep(RESTART_DELAY + CHECK_EVERY * 2);
        assert_eq!(process.restarts(), after_kill, "restarted after kill");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_running_process_is_left_alone_and_killed_on_drop() {
        let dir =
            std::env::temp_dir().join(format!("slipway-supervised-run-{}", std::process::id()));
        let launch: Launch = Box::new(|| {
            let mut command = Command::new("sleep");
            command.arg("600");
            command
        });
        let process = Supervised::start("sleeps", launch, &dir.join("sleeps.log")).expect("sleep");
        std::thread::sleep(CHECK_EVERY * 3);
        assert_eq!(process.restarts(), 0);
        let pid = process
            .shared
            .child
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(ChildGuard::id)
            .expect("a running child");
        drop(process);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "sleep {pid} still running after drop"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
