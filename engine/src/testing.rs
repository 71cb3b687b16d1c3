//! Test fixtures shared by unit tests, integration tests and benchmarks: where the
//! real model and llama.cpp's reference outputs live.
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

use std::path::{Path, PathBuf};

use crate::template::ChatMessage;

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

/// A `slipway-engine serve` child process, for the tests that run the real engine
/// over HTTP (this crate's, the operator's, the bench's). Killed when dropped.
pub struct ServeProcess {
    child: std::process::Child,
    base: String,
}

impl ServeProcess {
    /// Spawns `command` (a `slipway-engine serve ...` command; stdout is taken over)
    /// and waits up to 120 s for its `listening on <url>` line.
    ///
    /// # Panics
    /// If it cannot start, or exits or stays silent before listening (the exit
    /// status says which).
    #[must_use]
    pub fn spawn(mut command: std::process::Command) -> Self {
        use std::io::BufRead as _;
        let mut child = command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawning slipway-engine serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads to the end, so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sent = false;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if !sent && let Some(url) = line.strip_prefix("listening on ") {
                    let _ = tx.send(url.trim().to_owned());
                    sent = true;
                }
            }
        });
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(base) => Self { child, base },
            Err(_) => {
                let status = child.try_wait();
                let _ = child.kill();
                panic!(
                    "slipway-engine serve did not print `listening on <url>` within 120 s \
                     (exit: {status:?}; one built without `--features fault-injection` rejects --inject-*)"
                )
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

    /// Sends SIGTERM, as the kubelet does after the preStop hook.
    ///
    /// # Panics
    /// If `kill` fails.
    pub fn sigterm(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits up to `within` for the process to exit; `None` if it is still running.
    ///
    /// # Panics
    /// If its status cannot be read.
    pub async fn exit_within(
        &mut self,
        within: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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
