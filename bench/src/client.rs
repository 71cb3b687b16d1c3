//! The streaming OpenAI client: one request in, one [`RequestRecord`] filled out.
//!
//! HTTP/1.1 only, with keep-alive connection reuse (one pooled connection per
//! concurrent stream), because that is what every peer server speaks well and what
//! a real gateway in front of them does. Every content chunk is timestamped on
//! arrival with the run clock.
//!
//! The request asks for exactly `max_tokens` tokens (`ignore_eos`, an extension vLLM
//! and llama-server accept), so output length is the workload's, not the model's
//! whim. A server that refuses unknown fields can be driven without it
//! ([`ClientConfig::ignore_eos`] off); it is still measured correctly because N_out
//! comes from `usage` or the chunks seen, and the records keep `maxTokens` beside the
//! server's count so a shorter output shows.

use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::BenchError;
use crate::occupancy::{ServerSample, in_system};
use crate::record::{Outcome, RequestRecord};
use crate::sse::{SseParser, parse_chunk};
use crate::workload::{Api, RequestPlan};

/// The run clock: seconds since the start of the run.
#[derive(Debug, Clone, Copy)]
pub struct RunClock {
    start: Instant,
}

impl RunClock {
    /// A clock whose zero is now.
    #[must_use]
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// Seconds since zero.
    #[must_use]
    pub fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// The instant `s` seconds after zero.
    #[must_use]
    pub fn at(&self, s: f64) -> Instant {
        self.start + Duration::from_secs_f64(s.max(0.0))
    }
}

/// Where and how to send requests.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Base URL, e.g. `http://127.0.0.1:8080` (the `/v1/...` path is appended).
    pub base_url: String,
    /// The `model` field.
    pub model: String,
    /// Endpoint.
    pub api: Api,
    /// Hard per-request timeout, from send; the request then counts as timed out.
    pub timeout: Duration,
    /// Optional bearer token.
    pub api_key: Option<String>,
    /// Send `ignore_eos: true` so every request generates exactly `max_tokens`.
    pub ignore_eos: bool,
}

/// Longest wait for one scrape of the server's `/metrics`.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// A pooled HTTP/1.1 client.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    url: String,
    cfg: ClientConfig,
}

/// Why the exchange ended early.
enum Stop {
    Rejected,
    Failed(String),
}

/// Which of the racing conditions ended a request.
enum End {
    Exchanged(Result<(), Stop>),
    TimedOut,
    Cancelled(&'static str),
}

impl Client {
    /// Builds the client.
    ///
    /// # Errors
    /// [`BenchError::Client`] when the HTTP client cannot be built.
    pub fn new(cfg: ClientConfig) -> Result<Self, BenchError> {
        let http = reqwest::Client::builder()
            .http1_only()
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| BenchError::Client(e.to_string()))?;
        let path = match cfg.api {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        };
        let url = format!("{}{path}", cfg.base_url.trim_end_matches('/'));
        Ok(Self { http, url, cfg })
    }

    /// One scrape of the server's `/metrics` for its requests running plus waiting,
    /// stamped at the middle of the round trip; `None` when the scrape fails or the
    /// text has none of the gauges ([`in_system`]).
    pub async fn server_in_system(&self, clock: RunClock) -> Option<ServerSample> {
        let url = format!(
            "{}{}",
            self.cfg.base_url.trim_end_matches('/'),
            slipway_contract::paths::METRICS
        );
        let before = clock.now_s();
        let mut req = self.http.get(url).timeout(SCRAPE_TIMEOUT);
        if let Some(k) = &self.cfg.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.ok()?.error_for_status().ok()?;
        let text = resp.text().await.ok()?;
        let after = clock.now_s();
        Some(ServerSample {
            t: (before + after) / 2.0,
            in_system: in_system(&text)?,
        })
    }

    /// The request body for `plan`.
    #[must_use]
    pub fn body(&self, plan: &RequestPlan) -> serde_json::Value {
        let mut b = match self.cfg.api {
            Api::Completions => {
                let prompt = match &plan.system {
                    Some(s) => format!("{s}\n\n{}", plan.prompt),
                    None => plan.prompt.clone(),
                };
                json!({ "prompt": prompt })
            }
            Api::Chat => {
                let mut messages = Vec::new();
                if let Some(s) = &plan.system {
                    messages.push(json!({"role": "system", "content": s}));
                }
                messages.push(json!({"role": "user", "content": plan.prompt}));
                json!({ "messages": messages })
            }
        };
        b["model"] = json!(self.cfg.model);
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
        b["max_tokens"] = json!(plan.max_tokens);
        if self.cfg.ignore_eos {
            b["ignore_eos"] = json!(true);
        }
        b["temperature"] = json!(0.0);
        if let Some(t) = &plan.tenant {
            b["user"] = json!(t);
        }
        b
    }

    /// Sends `plan` and fills `rec` (whose `sent_s` the caller has stamped) until the
    /// stream ends, the hard timeout fires, the request's deadline passes, or `stop`
    /// turns true (end of the run). Always sets `outcome` and `done_s`.
    pub async fn send(
        &self,
        plan: &RequestPlan,
        rec: &mut RequestRecord,
        clock: RunClock,
        mut stop: watch::Receiver<bool>,
    ) {
        let sent = rec.sent_s.unwrap_or_else(|| clock.now_s());
        let timeout_at = clock.at(sent) + self.cfg.timeout;
        let deadline_at = plan
            .deadline_ms
            .map(|ms| clock.at(rec.scheduled_s) + Duration::from_millis(ms));
        let end = tokio::select! {
            r = self.exchange(plan, rec, clock) => End::Exchanged(r),
            () = tokio::time::sleep_until(timeout_at) => End::TimedOut,
            () = async {
                match deadline_at {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => End::Cancelled("deadline passed"),
            // An error here means the runner is gone, which also ends the run.
            _ = stop.wait_for(|s| *s) => End::Cancelled("run ended"),
        };
        rec.done_s = Some(clock.now_s());
        rec.outcome = match end {
            End::Exchanged(Ok(())) => Outcome::Completed,
            End::Exchanged(Err(Stop::Rejected)) => Outcome::Rejected,
            End::Exchanged(Err(Stop::Failed(m))) => {
                rec.error = Some(m);
                Outcome::Error
            }
            End::TimedOut => Outcome::TimedOut,
            End::Cancelled(why) => {
                rec.error = Some(why.to_owned());
                Outcome::Cancelled
            }
        };
    }

    async fn exchange(
        &self,
        plan: &RequestPlan,
        rec: &mut RequestRecord,
        clock: RunClock,
    ) -> Result<(), Stop> {
        let mut req = self.http.post(&self.url).json(&self.body(plan));
        if let Some(k) = &self.cfg.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| Stop::Failed(format!("send: {e}")))?;
        let status = resp.status();
        rec.http_status = Some(status.as_u16());
        if status.as_u16() == 429 || status.as_u16() == 503 {
            rec.retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            return Err(Stop::Rejected);
        }
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            let body: String = body.chars().take(200).collect();
            return Err(Stop::Failed(format!("HTTP {status}: {body}")));
        }
        let mut parser = SseParser::new();
        let mut stream = resp.bytes_stream();
        let mut finished = false;
        let mut handle = |data: String, rec: &mut RequestRecord, t: f64| -> Result<bool, Stop> {
            let c = parse_chunk(&data).map_err(|e| Stop::Failed(format!("bad chunk: {e}")))?;
            if let Some(e) = c.error {
                return Err(Stop::Failed(format!("server error in stream: {e}")));
            }
            if !c.text.is_empty() {
                rec.token_s.push(t);
            }
            if let Some((p, o)) = c.usage {
                rec.server_prompt_tokens = Some(p);
                rec.server_output_tokens = Some(o);
            }
            if c.cached_tokens.is_some() {
                rec.server_cached_tokens = c.cached_tokens;
            }
            finished |= c.done || c.finish_reason.is_some();
            Ok(c.done)
        };
        // Stop at `[DONE]` rather than at the end of the body: a server may hold the
        // response open a little longer, and that is not the user's latency.
        let mut done = false;
        while let Some(piece) = stream.next().await {
            let bytes = piece.map_err(|e| Stop::Failed(format!("stream: {e}")))?;
            let t = clock.now_s();
            for data in parser.push(&bytes) {
                done |= handle(data, rec, t)?;
            }
            if done {
                break;
            }
        }
        if !done && let Some(data) = parser.finish() {
            handle(data, rec, clock.now_s())?;
        }
        if finished {
            Ok(())
        } else {
            Err(Stop::Failed(
                "stream ended before [DONE] or finish_reason".into(),
            ))
        }
    }
}
