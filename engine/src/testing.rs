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

use std::path::{Path, PathBuf};

use crate::template::ChatMessage;

/// File name of the test model.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of llama.cpp's reference outputs for it.
pub const ORACLE_FILE: &str = "smollm2-q4_1-llamacpp.json";

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
    let cache = std::env::var_os("SLIPWAY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/slipway")))
        .unwrap_or_else(|| PathBuf::from(".cache/slipway"));
    let p = cache.join("models").join(MODEL_FILE);
    assert!(
        p.is_file(),
        "test model not found at {}: run `make model` (or set SLIPWAY_MODEL)",
        p.display()
    );
    p
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
