//! Test fixtures shared by unit tests, integration tests and benchmarks: where the
//! real model and llama.cpp's reference outputs live, and the engine as a child
//! process ([`EngineProcess`]: started from a typed [`ServeArgs`], ready once it
//! prints the readiness line of [`slipway_contract::listening`], killed on drop), and a
//! host process restarted when it exits as a kubelet would ([`Supervised`]: the e2e
//! tests' operators).
//!
//! Built only with the `testing` feature (and for this crate's unit tests): the
//! release binary never carries it. Other crates' dev-dependencies turn it on.
//!
//! Invariant: a missing fixture is a test *failure* with instructions ("run `make
//! model`"), never a silent skip, so a CI run without the model cannot pass by
//! testing nothing. These helpers therefore panic by design; they are for tests.
//!
//! - Model: `$SLIPWAY_MODEL`, else `$SLIPWAY_CACHE/models/<file>` (default cache
//!   `~/.cache/slipway`), which is where `engine/scripts/fetch-model` puts it.
//! - Oracle: `shared/oracle/` beside the repository clone (`<repo>/../shared`), as
//!   CI lays it out.
//! - LoRA adapter: `$SLIPWAY_LORA_ADAPTER`, else `$SLIPWAY_CACHE/models/<file>`, where
//!   `make lora-adapter` writes it; llama.cpp's outputs with it are checked in under
//!   `engine/tests/fixtures/` (see the README there).

use std::io::{BufRead as _, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use slipway_contract::{EngineCommand, ServeArgs, listening};

use crate::template::ChatMessage;

mod supervised;
pub use supervised::{Launch, Supervised};

/// File name of the test model.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of llama.cpp's reference outputs for it.
pub const ORACLE_FILE: &str = "smollm2-q4_1-llamacpp.json";
/// File name of the test LoRA adapter (random, rank 8; `engine/scripts/make-lora-adapter`).
pub const LORA_ADAPTER_FILE: &str = "smollm2-lora-test.gguf";
/// File name of llama.cpp's reference outputs for the test model with that adapter.
pub const LORA_ORACLE_FILE: &str = "smollm2-lora-llamacpp.json";

/// The cache `engine/scripts/fetch-model` and `make lora-adapter` write to.
fn cache_dir() -> PathBuf {
    std::env::var_os("SLIPWAY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/slipway")))
        .unwrap_or_else(|| PathBuf::from(".cache/slipway"))
}

/// Path of the real test model.
///
/// # Panics
/// If the model is not where `SLIPWAY_MODEL` or the cache says.
#[must_use]
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("SLIPWAY_MODEL") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "SLIPWAY_MODEL={} does not exist; unset it and run `make model`",
            p.display()
        );
        return p;
    }
    let p = cache_dir().join("models").join(MODEL_FILE);
    assert!(
        p.is_file(),
        "test model not found at {}: run `make model` (or set SLIPWAY_MODEL)",
        p.display()
    );
    p
}

/// Path of the test LoRA adapter for the test model.
///
/// # Panics
/// If the adapter is not where `SLIPWAY_LORA_ADAPTER` or the cache says.
#[must_use]
pub fn lora_adapter_path() -> PathBuf {
    let p = std::env::var_os("SLIPWAY_LORA_ADAPTER").map_or_else(
        || cache_dir().join("models").join(LORA_ADAPTER_FILE),
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "test LoRA adapter not found at {}: run `make lora-adapter` (or set SLIPWAY_LORA_ADAPTER)",
        p.display()
    );
    p
}

/// Path of llama.cpp's reference outputs with the test adapter, checked in at
/// `engine/tests/fixtures/`: the [`Oracle`] format plus `adapter_sha256` and
/// `adapter` (how it was made); see the README beside it.
#[must_use]
pub fn lora_oracle_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(LORA_ORACLE_FILE)
}

/// `slipway-engine` in the calling test's target directory (`target/<profile>/`), for
/// the tests of other crates that run the real engine as a process (the workspace's
/// `cargo test` builds it); `SLIPWAY_ENGINE_BIN` overrides it.
///
/// # Panics
/// If the binary is not there.
#[must_use]
pub fn engine_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("SLIPWAY_ENGINE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/slipway-engine
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps")
        .join(format!("slipway-engine{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} not found: run the workspace tests (`make test` / `cargo test`), which build it, \
         or `cargo build -p slipway-engine`, or set SLIPWAY_ENGINE_BIN",
        bin.display()
    );
    bin
}

/// Directory of llama.cpp's reference outputs (`<repo>/../shared/oracle`).
#[must_use]
pub fn oracle_dir() -> PathBuf {
    // CARGO_MANIFEST_DIR is <repo>/engine.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/oracle")
}

/// llama.cpp's reference outputs for the test model (see `shared/oracle/README.md`).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Oracle {
    pub model: String,
    pub model_sha256: String,
    pub reference: String,
    pub prompts: Vec<OraclePrompt>,
}

/// One prompt of the oracle.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct OraclePrompt {
    pub id: String,
    /// The exact prompt text (for chat prompts: the rendered template).
    pub prompt: String,
    /// The chat messages the prompt was rendered from, if any.
    pub chat: Option<Vec<ChatMessage>>,
    /// llama.cpp's ids for `prompt` (special tokens parsed, no BOS added).
    pub prompt_tokens: Vec<u32>,
    /// Greedy continuation ids.
    pub continuation: Vec<u32>,
    pub continuation_text: String,
    /// Per generated position: chosen token and llama.cpp's top-5 log-probs.
    pub steps: Vec<OracleStep>,
    /// Leading greedy steps whose top-1/top-2 margin is at least 0.3 nat.
    pub safe_prefix: usize,
}

/// One generated position of an oracle prompt.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct OracleStep {
    pub token: u32,
    /// `(token id, log-probability)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// Loads the oracle.
///
/// # Panics
/// If the file is absent or malformed (say where it was expected).
#[must_use]
pub fn oracle() -> Oracle {
    let path = oracle_dir().join(ORACLE_FILE);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "llama.cpp oracle not readable at {}: {e}; the tests expect a copy of shared/ beside the repository",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is malformed: {e}", path.display()))
}

/// How long a server may take to print its readiness line: loading the model on a
/// loaded 2-core machine, never this slow.
pub const LISTEN_PATIENCE: Duration = Duration::from_secs(120);

/// What went wrong with a guarded child process.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("starting {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the state of {name}: {source}")]
    Wait {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited early: {status}")]
    Exited { name: String, status: ExitStatus },
    #[error(
        "{name} did not print `{prefix}<url>` on stdout within {LISTEN_PATIENCE:?} (exit: {status}; \
         an engine built without `--features fault-injection` rejects --inject-*)",
        prefix = listening::PREFIX
    )]
    NotListening { name: String, status: String },
    #[error("the log of a supervised process, {path}: {source}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A child process that is killed (SIGKILL, by its own handle, never by name) and
/// reaped when dropped, so a failing test leaves nothing running: the one kill-on-drop
/// guard of the workspace's tests, for servers and any other process they start.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Child,
}

impl ChildGuard {
    /// Spawns `command`; `name` says which process in messages.
    ///
    /// # Errors
    /// [`ProcessError::Spawn`] if it cannot start.
    pub fn spawn(name: impl Into<String>, command: &mut Command) -> Result<Self, ProcessError> {
        let name = name.into();
        match command.spawn() {
            Ok(child) => Ok(Self { name, child }),
            Err(source) => Err(ProcessError::Spawn { name, source }),
        }
    }

    /// The name given at spawn.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the process has exited (it should be running).
    ///
    /// # Errors
    /// [`ProcessError::Exited`] with its status, or [`ProcessError::Wait`].
    pub fn ensure_running(&mut self) -> Result<(), ProcessError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(ProcessError::Exited {
                name: self.name.clone(),
                status,
            }),
            Err(source) => Err(ProcessError::Wait {
                name: self.name.clone(),
                source,
            }),
        }
    }

    /// Sends SIGTERM, as the kubelet does after the preStop hook.
    ///
    /// # Panics
    /// If `kill` fails.
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits up to `within` for the process to exit; `None` if it is still running.
    ///
    /// # Panics
    /// If its status cannot be read.
    pub async fn exit_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills (SIGKILL) and reaps the process unless it has exited; idempotent.
    pub fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `serve` flags for a test: the test model on 127.0.0.1, a free port (`--port 0`,
/// learnt from the readiness line), served as `served_model_name`, and the parser's
/// defaults for everything else. The defaults the parser would read from the
/// environment (log format, OTLP endpoint) are left unset here, so the child reads
/// them from its own environment as it would without a flag.
///
/// # Panics
/// If the test model is missing ([`model_path`]).
#[must_use]
pub fn serve_args(served_model_name: &str) -> ServeArgs {
    serve_args_with_model(model_path(), served_model_name)
}

/// [`serve_args`] with another model file.
///
/// # Panics
/// If the path is not valid UTF-8 (the parser's defaults cannot be read for it).
#[must_use]
pub fn serve_args_with_model(model: impl Into<PathBuf>, served_model_name: &str) -> ServeArgs {
    let mut args = ServeArgs::for_model(model).expect("the parser's defaults");
    args.host = IpAddr::V4(Ipv4Addr::LOCALHOST);
    args.port = 0;
    args.served_model_name = Some(served_model_name.to_owned());
    args.telemetry.logs.log_format = None;
    args.telemetry.otlp_endpoint = None;
    args
}

/// A Slipway server child process (`slipway-engine serve`, and the router, which
/// prints the same readiness line) for the tests that drive it over HTTP: started,
/// waited for until it listens, and killed when dropped (it is a [`ChildGuard`]).
#[derive(Debug)]
pub struct EngineProcess {
    process: ChildGuard,
    base: String,
}

impl EngineProcess {
    /// Starts `slipway-engine serve` ([`engine_binary`]) with `args` (its stderr is
    /// the test's) and waits until it listens.
    ///
    /// # Panics
    /// If it cannot start, or exits or stays silent before listening.
    #[must_use]
    pub fn spawn(args: &ServeArgs) -> Self {
        Self::spawn_command(Self::command(args))
    }

    /// The command that runs `slipway-engine serve` ([`engine_binary`]) with `args`,
    /// its stderr the test's: for a test that sets its environment or output first,
    /// adds raw flags, or expects it to refuse to start ([`refused`]).
    #[must_use]
    pub fn command(args: &ServeArgs) -> Command {
        Self::command_with_binary(engine_binary(), args)
    }

    /// [`EngineProcess::command`] with another engine binary (a build of its own).
    #[must_use]
    pub fn command_with_binary(binary: impl AsRef<std::ffi::OsStr>, args: &ServeArgs) -> Command {
        let mut command = Command::new(binary);
        command
            .args(EngineCommand::Serve(args.clone()).to_args())
            .stderr(Stdio::inherit());
        command
    }

    /// Spawns `command` (a server that prints the readiness line; its stdout is
    /// taken over) and waits until it listens.
    ///
    /// # Panics
    /// Where [`EngineProcess::start`] fails.
    #[must_use]
    pub fn spawn_command(command: Command) -> Self {
        let name = Path::new(command.get_program()).file_name().map_or_else(
            || "the server".to_owned(),
            |n| n.to_string_lossy().into_owned(),
        );
        Self::start(name, command).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Spawns `command` under `name` and waits up to [`LISTEN_PATIENCE`] for its
    /// readiness line ([`listening`]) on stdout, which it reads to the end so the
    /// child never blocks on a full pipe.
    ///
    /// # Errors
    /// [`ProcessError::Spawn`], or [`ProcessError::NotListening`] (the process is
    /// killed) with its exit status if it exited.
    pub fn start(name: impl Into<String>, mut command: Command) -> Result<Self, ProcessError> {
        let mut process =
            ChildGuard::spawn(name, command.stdin(Stdio::null()).stdout(Stdio::piped()))?;
        let stdout = process.child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent && let Some(url) = listening::url(&line) {
                    let _ = tx.send(url.to_owned());
                    sent = true;
                }
            }
        });
        match rx.recv_timeout(LISTEN_PATIENCE) {
            Ok(base) => Ok(Self { process, base }),
            Err(_) => {
                let status = match process.child.try_wait() {
                    Ok(Some(status)) => status.to_string(),
                    Ok(None) => "still running".to_owned(),
                    Err(e) => e.to_string(),
                };
                Err(ProcessError::NotListening {
                    name: process.name.clone(),
                    status,
                })
            }
        }
    }

    /// `http://host:port`.
    #[must_use]
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `host:port`.
    #[must_use]
    pub fn address(&self) -> &str {
        self.base.strip_prefix("http://").unwrap_or(&self.base)
    }

    /// The URL of `path` on this server.
    #[must_use]
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The process alone, for a test that keeps it with others it guards.
    #[must_use]
    pub fn into_process(self) -> ChildGuard {
        self.process
    }
}

impl std::ops::Deref for EngineProcess {
    type Target = ChildGuard;

    fn deref(&self) -> &ChildGuard {
        &self.process
    }
}

impl std::ops::DerefMut for EngineProcess {
    fn deref_mut(&mut self) -> &mut ChildGuard {
        &mut self.process
    }
}

/// Runs `command`, a server that must refuse to start; returns its exit status and
/// stderr (which it takes over).
///
/// # Panics
/// If it cannot start, or is still running after [`LISTEN_PATIENCE`] (it would have
/// started serving).
#[must_use]
pub fn refused(mut command: Command) -> (ExitStatus, String) {
    let mut process = ChildGuard::spawn(
        "the refused server",
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut stderr = process.child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    // stderr closes when the process exits.
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        let _ = tx.send(text);
    });
    let text = rx.recv_timeout(LISTEN_PATIENCE).unwrap_or_else(|_| {
        panic!(
            "the server did not exit within {LISTEN_PATIENCE:?}: it should have refused to start"
        )
    });
    (process.child.wait().expect("wait"), text)
}

/// Reads SSE `data:` payloads until `[DONE]` or the end of the body; calls `first`
/// after the first payload.
///
/// # Panics
/// If the body cannot be read.
pub async fn read_sse(mut response: reqwest::Response, mut first: impl FnMut()) -> Vec<String> {
    let mut buffer = String::new();
    let mut data = Vec::new();
    while let Some(chunk) = response.chunk().await.expect("reading the stream") {
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find('\n') {
            let line: String = buffer.drain(..=end).collect();
            if let Some(payload) = line.trim_end().strip_prefix("data: ") {
                data.push(payload.to_owned());
                if data.len() == 1 {
                    first();
                }
                if payload == "[DONE]" {
                    return data;
                }
            }
        }
    }
    data
}

/// The first `finish_reason` among SSE payloads.
#[must_use]
pub fn finish_reason(payloads: &[String]) -> Option<String> {
    payloads
        .iter()
        .filter_map(|p| serde_json::from_str::<serde_json::Value>(p).ok())
        .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned))
}
