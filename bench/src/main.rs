//! `slipway-bench`: measure SLO-goodput and the capacity frontier of an
//! OpenAI-compatible server (Slipway's engine, llama.cpp's llama-server, vLLM).
//!
//! `run` measures one offered load, `sweep` raises the offered rate until the SLO
//! fails and prints `capacity.replicaGoodput`, `compare` puts two sweeps side by side.
//! Real output goes to stdout; logs and the progress bar go to stderr.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use slipway_api::spec::DemandUnit;
use slipway_bench::arrival::{ArrivalProcess, schedule};
use slipway_bench::client::{Client, ClientConfig};
use slipway_bench::report;
use slipway_bench::runner::{self, RunLimits, RunOutput, Sessions};
use slipway_bench::stats::{DEFAULT_BUCKETS, Slo, Summary, summarize};
use slipway_bench::sweep::{SweepPlan, SweepPoint, SweepResult, geometric_ladder, next_rate};
use slipway_bench::workload::{Api, RequestPlan, WorkloadSpec, generate, point_seed};

/// Open/closed-loop load generator for OpenAI-compatible LLM servers: TTFT, TPOT,
/// SLO-goodput and the capacity frontier (`capacity.replicaGoodput`).
///
/// Latencies are client-side and measured from each request's *scheduled* arrival, so
/// an overloaded server (or client) shows up as latency, never as fewer requests.
/// Every offered request ends in exactly one outcome: completed, rejected (429/503),
/// timed out, cancelled, error, or client-capped (in-flight cap reached); a request
/// that did not finish is an infinite latency, never a finite one.
#[derive(Parser, Debug)]
#[command(name = "slipway-bench", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Measure one offered load and write summary.json and records.jsonl.
    Run(RunArgs),
    /// Raise the offered rate until the SLO fails; find the goodput frontier, write
    /// sweep.json, per-rate records, sweep.svg/png and capacity.yaml.
    Sweep(SweepArgs),
    /// Compare two sweep.json files (ours first, the peer second): table, ratios, plot.
    Compare(CompareArgs),
    /// Replay one load trace (a 3× ramp, a plateau, a fall) under static-at-peak,
    /// static-at-average and measured-demand capacity, with the operator's own
    /// decisions; print group-seconds and SLO-met share, write capacity.csv and a plot.
    Capacity(CapacityArgs),
    /// `make bench-router`: print the SLO derived from a calibration run's summary.json
    /// (one request at a time on an idle engine) as `TTFT_MS TPOT_MS`, then the reason.
    RouterSlo(RouterSloArgs),
    /// `make bench-router`: read a run directory, print the report, write it as Markdown.
    RouterReport(RouterReportArgs),
}

#[derive(Args, Debug)]
struct RouterSloArgs {
    /// The calibration run's summary.json.
    summary: PathBuf,
    /// TTFT target = this × the idle TTFT median of an uncached prompt: a cold prompt
    /// may wait behind about two others' prefill.
    #[arg(long, default_value_t = 3.0)]
    ttft_factor: f64,
    /// TPOT target = this × the idle TPOT median: room for the prefill steps of other
    /// requests interleaved with a stream's decode.
    #[arg(long, default_value_t = 4.0)]
    tpot_factor: f64,
}

#[derive(Args, Debug)]
struct RouterReportArgs {
    /// The run directory bench/scripts/bench-router wrote.
    dir: PathBuf,
    /// Write the report here (Markdown); plots go to `<its directory>/benchmarks/`.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct CapacityArgs {
    /// What one group serves within the SLO, req/s (`capacity.replicaGoodput`).
    #[arg(long, default_value_t = 1.0)]
    goodput: f64,
    /// The trace's base rate, req/s; it ramps to `--peak-factor` times this. With a
    /// goodput of 1, the base is 10 groups and the peak 30.
    #[arg(long, default_value_t = 10.0)]
    base_rate: f64,
    /// Peak over base.
    #[arg(long, default_value_t = 3.0)]
    peak_factor: f64,
    /// Seconds from creating a group to it serving.
    #[arg(long, default_value_t = 60)]
    cold_start_seconds: u64,
    /// Seconds between reconciles.
    #[arg(long, default_value_t = 5.0)]
    step: f64,
    /// Fault domains the groups are spread over.
    #[arg(long, default_value_t = 3)]
    zones: usize,
    /// Measured demand: `rateWindow`.
    #[arg(long, default_value = "1m")]
    rate_window: String,
    /// Measured demand: `peakWindow`.
    #[arg(long, default_value = "5m")]
    peak_window: String,
    /// Measured demand: `headroom`.
    #[arg(long, default_value_t = 0.1)]
    headroom: f64,
    /// Measured demand: `scaleDownStabilization`.
    #[arg(long, default_value = "5m")]
    stabilization: String,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

#[derive(Args, Debug, Clone)]
struct Common {
    /// Server base URL (only 127.0.0.1/localhost servers you run yourself).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// `model` field of each request.
    #[arg(long, default_value = "default")]
    model: String,
    /// Label for reports (e.g. "llama-server -np 8").
    #[arg(long, default_value = "server")]
    label: String,
    /// Workload spec (YAML or JSON); default: prompts U[64,512], outputs U[32,128] tokens.
    #[arg(long)]
    workload: Option<PathBuf>,
    /// Override the workload's endpoint.
    #[arg(long, value_enum)]
    api: Option<ApiArg>,
    /// Arrival process for open-loop load.
    #[arg(long, value_enum, default_value_t = ArrivalArg::Poisson)]
    arrival: ArrivalArg,
    /// Gamma shape for `--arrival gamma` (1 = Poisson, < 1 burstier).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Arrival window per measurement, seconds.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Grace after the window for requests still in flight, seconds; then they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    drain: f64,
    /// Cap on requests in flight; arrivals beyond it are counted as client-capped, not queued.
    #[arg(long, default_value_t = 256)]
    max_in_flight: usize,
    /// Hard per-request timeout, seconds (counted as timed out, never as a latency).
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Lengthen the arrival window at low rates so each measurement offers at least
    /// this many requests (window = max(duration, min_requests / rate)); a P99 of
    /// three requests is only their maximum.
    #[arg(long, default_value_t = 0)]
    min_requests: usize,
    /// Seed for arrivals and prompts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Sequential unrecorded requests before measuring (warms caches and connections).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// SLO: TTFT target at the percentile, ms.
    #[arg(long, default_value_t = 2000.0)]
    ttft_ms: f64,
    /// SLO: TPOT target at the percentile, ms.
    #[arg(long, default_value_t = 150.0)]
    tpot_ms: f64,
    /// SLO percentile (50, 95 or 99).
    #[arg(long, default_value_t = 99.0)]
    percentile: f64,
    /// SLO: minimum fraction of offered requests that must complete.
    #[arg(long, default_value_t = 0.99)]
    min_success: f64,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Bearer token, if the server wants one.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Do not send `ignore_eos` (for servers that refuse the field): the model may
    /// then stop before `max_tokens`; the records show by how much.
    #[arg(long)]
    no_ignore_eos: bool,
    /// Hide the progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    /// Open-loop mean arrival rate, requests/s.
    #[arg(long, conflicts_with_all = ["sessions", "trace"])]
    rate: Option<f64>,
    /// Closed loop: this many concurrent sessions instead of an arrival schedule.
    #[arg(long, conflicts_with = "trace")]
    sessions: Option<usize>,
    /// Closed loop: mean think time between requests of a session, ms.
    #[arg(long, default_value_t = 0.0)]
    think_ms: f64,
    /// Closed loop: stop after this many requests (or at the end of the window, if
    /// sooner).
    #[arg(long, requires = "sessions")]
    requests: Option<usize>,
    /// Replay a JSONL trace (timestamp/arrivalMs, prompt or promptTokens, outputTokens, tenant).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Trace replay speed-up factor.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
}

#[derive(Args, Debug)]
struct SweepArgs {
    #[command(flatten)]
    common: Common,
    /// Offered rates to try, ascending, comma-separated (req/s); default a doubling ladder.
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Ladder start when --rates is not given.
    #[arg(long, default_value_t = 0.1)]
    start: f64,
    /// Ladder top when --rates is not given.
    #[arg(long, default_value_t = 6.4)]
    max: f64,
    /// Ladder factor when --rates is not given.
    #[arg(long, default_value_t = 2.0)]
    factor: f64,
    /// Bisection steps between the last passing and first failing rate.
    #[arg(long, default_value_t = 2)]
    refine: u32,
    /// The unit capacity.yaml writes `replicaGoodput` in, as the InferenceService's
    /// `capacity.demandUnit`: `RequestsPerSecond` (SLO-meeting requests/s) or
    /// `OutputTokensPerSecond` (their generated tokens/s).
    #[arg(long, default_value = "RequestsPerSecond", value_parser = parse_demand_unit)]
    demand_unit: DemandUnit,
}

/// A `capacity.demandUnit` value, spelled as in the InferenceService.
fn parse_demand_unit(text: &str) -> Result<DemandUnit, String> {
    serde_json::from_value(serde_json::Value::String(text.to_owned()))
        .map_err(|_| format!("expected RequestsPerSecond or OutputTokensPerSecond, got {text:?}"))
}

#[derive(Args, Debug)]
struct CompareArgs {
    /// sweep.json of the system under test (ratios are this / peer).
    ours: PathBuf,
    /// sweep.json of the peer.
    peer: PathBuf,
    /// Write a combined plot to this path stem (.svg and .png).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write the comparison (values and ratios) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(ValueEnum, Debug, Clone, Copy)]
enum ApiArg {
    Completions,
    Chat,
}

#[derive(ValueEnum, Debug, Clone, Copy)]
enum ArrivalArg {
    Poisson,
    Gamma,
    Constant,
}

impl Common {
    fn slo(&self) -> anyhow::Result<Slo> {
        if ![50.0, 95.0, 99.0].contains(&self.percentile) {
            bail!("--percentile must be 50, 95 or 99");
        }
        Ok(Slo {
            ttft_ms: self.ttft_ms,
            tpot_ms: self.tpot_ms,
            percentile: self.percentile,
            min_success: self.min_success,
        })
    }

    fn workload(&self) -> anyhow::Result<WorkloadSpec> {
        let mut w = match &self.workload {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                WorkloadSpec::from_yaml(&text)
                    .with_context(|| format!("workload {}", p.display()))?
            }
            None => WorkloadSpec::default(),
        };
        if let Some(a) = self.api {
            w.api = match a {
                ApiArg::Completions => Api::Completions,
                ApiArg::Chat => Api::Chat,
            };
        }
        Ok(w)
    }

    fn process(&self, rate: f64) -> ArrivalProcess {
        match self.arrival {
            ArrivalArg::Poisson => ArrivalProcess::Poisson { rate },
            ArrivalArg::Gamma => ArrivalProcess::Gamma {
                rate,
                burstiness: self.burstiness,
            },
            ArrivalArg::Constant => ArrivalProcess::Constant { rate },
        }
    }

    fn client(&self, api: Api) -> anyhow::Result<Client> {
        Ok(Client::new(ClientConfig {
            base_url: self.url.clone(),
            model: self.model.clone(),
            api,
            timeout: Duration::from_secs_f64(self.timeout),
            api_key: self.api_key.clone(),
            ignore_eos: !self.no_ignore_eos,
        })?)
    }

    fn limits(&self) -> RunLimits {
        RunLimits {
            window_s: self.duration,
            drain_s: self.drain,
            max_in_flight: self.max_in_flight,
        }
    }

    fn progress(&self, n: u64, what: &str) -> Option<ProgressBar> {
        if self.quiet {
            return None;
        }
        let bar = ProgressBar::new(n);
        let style = ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(what.to_owned());
        Some(bar)
    }
}

/// Sends `n` unrecorded requests one at a time so the first measured request does not
/// pay for connection setup or cold caches. With `systemPrompts`, the first ones are one
/// per tenant (so at least the tenants' count), so no tenant's prompt is first seen by a
/// measured request. Failures here are reported, not fatal: the measurement itself
/// will count them properly.
async fn warmup(client: &Client, spec: &WorkloadSpec, n: usize, seed: u64) -> anyhow::Result<()> {
    let plans = match spec.system_prompts {
        Some(p) if n > 0 => {
            let tenants = p.count as usize;
            let mut pool = generate(spec, &vec![0.0; 32 * tenants.max(n)], seed ^ 0xa11)?;
            let mut first = Vec::new();
            for k in 0..tenants {
                let name = format!("tenant-{k}");
                if let Some(i) = pool.iter().position(|r| r.tenant.as_deref() == Some(&name)) {
                    first.push(pool.remove(i));
                }
            }
            let rest = n.saturating_sub(first.len());
            first.extend(pool.into_iter().take(rest));
            first
        }
        _ => generate(spec, &vec![0.0; n], seed ^ 0xa11)?,
    };
    for p in plans {
        let out = runner::closed_loop(
            client,
            vec![p],
            Sessions {
                count: 1,
                think_s: 0.0,
                seed,
            },
            RunLimits {
                window_s: 1.0,
                drain_s: 300.0,
                max_in_flight: 1,
            },
            None,
        )
        .await;
        if let Some(r) = out.records.first()
            && r.outcome != slipway_bench::record::Outcome::Completed
        {
            tracing::warn!(outcome = ?r.outcome, error = ?r.error, "warm-up request did not complete");
        }
    }
    Ok(())
}

fn write_json(path: &Path, v: &impl Serialize) -> anyhow::Result<()> {
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    serde_json::to_writer_pretty(std::io::BufWriter::new(f), v)
        .with_context(|| format!("writing {}", path.display()))
}

fn write_records(dir: &Path, out: &RunOutput, summary: &Summary) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("records.jsonl");
    let f = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    for r in &out.records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    write_json(&dir.join("summary.json"), summary)
}

async fn measure(
    c: &Common,
    spec: &WorkloadSpec,
    client: &Client,
    rate: f64,
) -> anyhow::Result<(RunOutput, Summary)> {
    let window = c.duration.max(c.min_requests as f64 / rate);
    let arrivals = schedule(&c.process(rate), window, usize::MAX, c.seed)?;
    // Fresh prompts at every rate: a sweep that resent the same prompts would let a
    // server's prefix cache answer later points from earlier ones.
    let plans = generate(spec, &arrivals, point_seed(c.seed, rate))?;
    let bar = c.progress(plans.len() as u64, &format!("{rate} req/s"));
    let limits = RunLimits {
        window_s: window,
        ..c.limits()
    };
    let out = runner::open_loop(client, plans, limits, bar.as_ref()).await;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let summary = summarize(
        &out.records,
        &out.server,
        window,
        Some(rate),
        c.slo()?,
        DEFAULT_BUCKETS,
    );
    if summary.little.consistent == Some(false) {
        tracing::error!(check = ?summary.little, "Little's law check failed: the server's requests in system and the client's λW disagree");
    }
    Ok((out, summary))
}

async fn cmd_run(a: RunArgs) -> anyhow::Result<()> {
    let c = &a.common;
    let spec = c.workload()?;
    let client = c.client(spec.api)?;
    warmup(&client, &spec, c.warmup, c.seed).await?;
    let (out, summary) = if let Some(trace) = &a.trace {
        let text = std::fs::read_to_string(trace)
            .with_context(|| format!("reading {}", trace.display()))?;
        let plans = slipway_bench::trace::parse_trace(&text, a.speedup, c.seed)?;
        let window = plans.last().map_or(0.0, |p| p.arrival_s) + 1e-3;
        let bar = c.progress(plans.len() as u64, "trace");
        let out = runner::open_loop(
            &client,
            plans,
            RunLimits {
                window_s: window,
                ..c.limits()
            },
            bar.as_ref(),
        )
        .await;
        let s = summarize(
            &out.records,
            &out.server,
            window,
            None,
            c.slo()?,
            DEFAULT_BUCKETS,
        );
        (out, s)
    } else if let Some(n) = a.sessions {
        // Enough requests that sessions never run dry within the window, unless the
        // run is bounded in requests.
        let n_plans = a.requests.unwrap_or(100_000);
        let plans: Vec<RequestPlan> = generate(&spec, &vec![0.0; n_plans], c.seed)?;
        let bar = c.progress(0, "sessions");
        let out = runner::closed_loop(
            &client,
            plans,
            Sessions {
                count: n,
                think_s: a.think_ms / 1000.0,
                seed: c.seed,
            },
            c.limits(),
            bar.as_ref(),
        )
        .await;
        let s = summarize(
            &out.records,
            &out.server,
            c.duration,
            None,
            c.slo()?,
            DEFAULT_BUCKETS,
        );
        (out, s)
    } else {
        let rate = a
            .rate
            .context("one of --rate, --sessions or --trace is required")?;
        measure(c, &spec, &client, rate).await?
    };
    write_records(&c.out, &out, &summary)?;
    print!("{}", report::summary_table(&c.label, &summary));
    println!(
        "peak in flight {} (cap {})",
        out.peak_in_flight, c.max_in_flight
    );
    println!(
        "wrote {}/summary.json and {}/records.jsonl",
        c.out.display(),
        c.out.display()
    );
    Ok(())
}

async fn cmd_sweep(a: SweepArgs) -> anyhow::Result<()> {
    let c = &a.common;
    let spec = c.workload()?;
    let client = c.client(spec.api)?;
    let ladder = if a.rates.is_empty() {
        geometric_ladder(a.start, a.max, a.factor)
    } else {
        a.rates.clone()
    };
    if ladder.is_empty()
        || ladder.iter().any(|r| !r.is_finite() || *r <= 0.0)
        || ladder.windows(2).any(|w| w[0] >= w[1])
    {
        bail!("the sweep needs positive, strictly ascending rates");
    }
    let plan = SweepPlan {
        rates: ladder,
        refine: a.refine,
    };
    std::fs::create_dir_all(&c.out).with_context(|| format!("creating {}", c.out.display()))?;
    warmup(&client, &spec, c.warmup, c.seed).await?;
    let mut result = SweepResult {
        label: c.label.clone(),
        workload: spec.describe(),
        arrivals: format!(
            "{:?}, {} s window per rate (≥ {} requests), seed {}",
            c.process(1.0),
            c.duration,
            c.min_requests,
            c.seed
        )
        .replace("rate: 1.0", "rate: swept"),
        slo: c.slo()?,
        points: Vec::new(),
        frontier: None,
    };
    let mut done = Vec::new();
    while let Some(rate) = next_rate(&plan, &done) {
        let (out, summary) = measure(c, &spec, &client, rate).await?;
        write_records(&c.out.join(format!("rate-{rate}")), &out, &summary)?;
        eprint!(
            "{}",
            report::summary_table(&format!("{} @ {rate}", c.label), &summary)
        );
        done.push((rate, summary.slo_pass));
        result.points.push(SweepPoint { rate, summary });
        result.compute_frontier();
        // Written after every point so an interrupted sweep keeps what it measured.
        write_json(&c.out.join("sweep.json"), &result)?;
    }
    let files = slipway_bench::plot::plot_sweeps(&[&result], &c.out.join("sweep"))?;
    let note = report::capacity_note(&result, a.demand_unit);
    std::fs::write(c.out.join("capacity.yaml"), &note)
        .with_context(|| format!("writing {}/capacity.yaml", c.out.display()))?;
    print!("{}", report::sweep_table(&result));
    print!("{note}");
    let names: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    println!(
        "wrote {}/sweep.json, per-rate records, {}",
        c.out.display(),
        names.join(", ")
    );
    Ok(())
}

fn cmd_compare(a: &CompareArgs) -> anyhow::Result<()> {
    let load = |p: &Path| -> anyhow::Result<SweepResult> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    };
    let (ours, peer) = (load(&a.ours)?, load(&a.peer)?);
    print!("{}", report::compare_table(&ours, &peer));
    if let Some(path) = &a.json {
        write_json(path, &report::compare(&ours, &peer))?;
        println!("comparison: {}", path.display());
    }
    if let Some(stem) = &a.plot {
        let files = slipway_bench::plot::plot_sweeps(&[&ours, &peer], stem)?;
        let names: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
        println!("plot: {}", names.join(", "));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Run(a) => cmd_run(a).await,
        Cmd::Sweep(a) => cmd_sweep(a).await,
        Cmd::Compare(a) => cmd_compare(&a),
        Cmd::Capacity(a) => cmd_capacity(&a),
        Cmd::RouterSlo(a) => cmd_router_slo(&a),
        Cmd::RouterReport(a) => cmd_router_report(&a),
    }
}

fn cmd_router_slo(a: &RouterSloArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.summary)
        .with_context(|| format!("reading {}", a.summary.display()))?;
    let calib: Summary =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", a.summary.display()))?;
    let (slo, why) = slipway_bench::routing::derive_slo(&calib, a.ttft_factor, a.tpot_factor)?;
    println!("{} {}", slo.ttft_ms, slo.tpot_ms);
    println!("{why}");
    Ok(())
}

fn cmd_router_report(a: &RouterReportArgs) -> anyhow::Result<()> {
    use slipway_bench::routing;
    let bench = routing::load(&a.dir)?;
    let mut plots = Vec::new();
    if let Some(md) = &a.markdown {
        let base = md.parent().unwrap_or_else(|| Path::new("."));
        let dir = base.join("benchmarks");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for w in &bench.workloads {
            let sweeps: Vec<&SweepResult> = w.runs.iter().map(|r| &r.sweep).collect();
            let stem = dir.join(format!("workload-{}", w.key));
            let files = slipway_bench::plot::plot_sweeps(&sweeps, &stem)?;
            // The PNG is for a local look; the SVG (text, small) is what the report links.
            for f in files
                .iter()
                .filter(|f| f.extension().is_some_and(|e| e == "png"))
            {
                let copy = a.dir.join(f.file_name().unwrap_or_default());
                std::fs::rename(f, &copy)
                    .with_context(|| format!("moving {} to {}", f.display(), copy.display()))?;
            }
            plots.push((w.key.clone(), format!("benchmarks/workload-{}.svg", w.key)));
        }
    }
    let text = routing::render(&bench, &plots);
    print!("{text}");
    if let Some(md) = &a.markdown {
        std::fs::write(md, &text).with_context(|| format!("writing {}", md.display()))?;
        eprintln!("wrote {}", md.display());
    }
    Ok(())
}

fn cmd_capacity(a: &CapacityArgs) -> anyhow::Result<()> {
    use slipway_bench::capacity;
    let trace = capacity::Trace {
        base: a.base_rate,
        peak_factor: a.peak_factor,
        ..capacity::Trace::default()
    };
    let measured = serde_json::json!({
        "rateWindow": a.rate_window,
        "peakWindow": a.peak_window,
        "headroom": a.headroom,
        "scaleDownStabilization": a.stabilization,
    });
    let cold_start = Duration::from_secs(a.cold_start_seconds);
    let mut results = Vec::new();
    for config in capacity::configs(&trace, a.goodput, a.step, &measured) {
        eprintln!(
            "replaying the trace under {}: {}",
            config.name, config.capacity
        );
        results.push(capacity::run(
            &config, &trace, a.goodput, a.step, cold_start, a.zones,
        )?);
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut csv = String::from("config,t_s,demand_rps,live_groups,ready_groups,slo_met\n");
    for r in &results {
        for p in &r.timeline {
            csv.push_str(&format!(
                "{},{},{:.3},{},{},{:.4}\n",
                r.name, p.t, p.demand, p.live_groups, p.ready_groups, p.slo_met
            ));
        }
    }
    let csv_path = a.out.join("capacity.csv");
    std::fs::write(&csv_path, csv).with_context(|| format!("writing {}", csv_path.display()))?;
    let plots = slipway_bench::plot::plot_capacity(&results, a.goodput, &a.out.join("capacity"))?;
    println!(
        "trace: {} req/s, ramp to {}x over {} min, plateau {} min, fall {} min ({} min in all); cold start {} s; one group serves {} req/s within the SLO\n",
        trace.base,
        trace.peak_factor,
        trace.ramp_minutes,
        trace.plateau_minutes,
        trace.fall_minutes,
        trace.seconds() / 60.0,
        a.cold_start_seconds,
        a.goodput
    );
    print!("{}", capacity::table(&results));
    if let [peak, _, measured] = results.as_slice() {
        let share = measured.group_seconds / peak.group_seconds.max(1.0);
        let slo_gap = 100.0 * (peak.slo_met_fraction() - measured.slo_met_fraction());
        println!(
            "\nmeasured demand: {:.1} % of static-at-peak's group-seconds (target ≤ 70 %), SLO met {:.2} points below it (target ≤ 1)",
            100.0 * share,
            slo_gap
        );
    }
    println!("\nwrote {}", csv_path.display());
    for p in plots {
        println!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_takes_the_demand_unit_as_the_inference_service_spells_it() {
        let unit = |extra: &[&str]| {
            let args = ["slipway-bench", "sweep"].iter().chain(extra);
            match Cli::try_parse_from(args).map(|cli| cli.cmd) {
                Ok(Cmd::Sweep(a)) => Ok(a.demand_unit),
                Ok(other) => panic!("parsed as {other:?}"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(unit(&[]), Ok(DemandUnit::RequestsPerSecond));
        assert_eq!(
            unit(&["--demand-unit", "OutputTokensPerSecond"]),
            Ok(DemandUnit::OutputTokensPerSecond)
        );
        let wrong = unit(&["--demand-unit", "tokens"]).expect_err("not a demandUnit");
        assert!(
            wrong.contains("expected RequestsPerSecond or OutputTokensPerSecond"),
            "{wrong}"
        );
    }
}
