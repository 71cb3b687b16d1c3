//! `slipway-bench`: an open/closed-loop load generator that measures SLO-goodput and
//! the capacity frontier of OpenAI-compatible servers (Slipway's engine, llama.cpp's
//! `llama-server`, vLLM).
//!
//! Layout, pure logic first:
//! - [`arrival`]: open-loop arrival schedules (Poisson, gamma, constant), seeded.
//! - [`workload`]: the workload spec and the deterministic requests it generates.
//! - [`trace`]: JSONL trace replay.
//! - [`record`]: what the client saw of one request; [`stats`]: the accounting;
//!   [`occupancy`]: the server's own count of requests in it, for Little's law.
//! - [`sse`]: the server-sent-events parser for OpenAI streams.
//! - [`sweep`]: choosing offered rates and finding the goodput frontier.
//! - [`report`]: tables and the `capacity.replicaGoodput` note; [`plot`]: SVG/PNG.
//! - [`routing`]: `make bench-router`'s SLO and report (routing policies compared).
//! - [`capacity`]: the operator's capacity decisions replayed over a load trace
//!   (static at peak, static at average, measured demand).
//! - I/O shells: [`client`] (HTTP/1.1 streaming) and [`runner`] (open/closed loop).

pub mod arrival;
pub mod capacity;
pub mod client;
pub mod occupancy;
pub mod plot;
pub mod record;
pub mod report;
pub mod routing;
pub mod runner;
pub mod sse;
pub mod stats;
pub mod sweep;
pub mod trace;
pub mod workload;

/// Errors of the benchmark library.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A workload, SLO or schedule parameter is invalid.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    /// A trace line could not be used.
    #[error("trace line {line}: {msg}")]
    Trace {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        msg: String,
    },
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(String),
    /// Writing an output file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Drawing a plot failed.
    #[error("plot {path}: {msg}")]
    Plot {
        /// The file.
        path: String,
        /// The cause.
        msg: String,
    },
}
