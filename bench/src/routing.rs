//! `make bench-router`: routing policies compared on the same engines in one run, and
//! the report `router/BENCHMARKS.md` is regenerated from.
//!
//! The script (`bench/scripts/bench-router`) measures; this module only reads what it
//! wrote and decides nothing about the machine. Layout of a run directory:
//!
//! ```text
//! meta.json                          what, where, when, how (the script's notes)
//! calibration/summary.json           one request at a time on an idle engine
//! <W>/<policy>/sweep.json            a sweep of workload W through the router
//! <W>/<policy>/router.metrics        the router's /metrics after the sweep
//! <W>/<policy>/engine-<i>.metrics    each engine's /metrics after the sweep
//! overhead/<direct|router>-<n>/summary.json
//! ```
//!
//! Every comparison is a ratio against a peer measured in the same run, never an
//! absolute time: the machine is shared and small, and only ratios travel.
//!
//! Pure functions over plain data: [`derive_slo`], [`metric_sum`], [`render`].

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use slipway_contract::metrics::{PREFIX_HITS, PREFIX_QUERIES, REQUESTS, router as names};

use crate::BenchError;
use crate::report;
use crate::stats::{Latency, Slo, Summary};
use crate::sweep::{SweepPoint, SweepResult};

/// The workloads, in report order: key (the run directory's), title, what it shows.
pub const WORKLOADS: [(&str, &str, &str); 4] = [
    (
        "P",
        "multi-tenant (8 system prompts), a KV pool per engine that barely holds them",
        "prefix affinity: a tenant's prompt stays cached where its requests go, and each \
         replica's cache holds its share of the tenants instead of all of them",
    ),
    (
        "U",
        "no shared prefixes",
        "nothing to gain from prefixes: the cost policy must not lose to plain load balancing",
    ),
    (
        "H",
        "hot spot (one prefix for all traffic)",
        "the one cached prefix must not pull every request onto one replica",
    ),
    (
        "P-large-pool",
        "multi-tenant, the engines' default KV pool",
        "P when every replica can cache every tenant's prompt: round-robin then misses each \
         prompt once per replica and hits it after, so affinity has little left to win",
    ),
];

/// Ratios reported for reference, without a target: `(workload, ours, peer)`.
pub const REFERENCE_RATIOS: [(&str, &str, &str); 6] = [
    ("P", "least-in-flight", "round-robin"),
    ("P", "cost", "least-in-flight"),
    ("P", "cost-scale-1", "round-robin"),
    ("P", "cost-scale-8", "round-robin"),
    ("H", "cost-scale-8", "round-robin"),
    ("P-large-pool", "cost", "round-robin"),
];

/// The policies, in report order: the router's `--policy` values, then the cost policy
/// at other `--prefill-load-scale` values than the default (`cost-scale-N`).
pub const POLICIES: [&str; 5] = [
    "round-robin",
    "least-in-flight",
    "cost",
    "cost-scale-1",
    "cost-scale-8",
];

/// A ratio the issue sets a target for: `ours / peer` goodput frontier on `workload`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    /// Workload key.
    pub workload: &'static str,
    /// The policy under test.
    pub ours: &'static str,
    /// The peer it is compared with.
    pub peer: &'static str,
    /// The ratio must be at least this.
    pub min_ratio: f64,
    /// How the issue words it.
    pub wording: &'static str,
}

/// The issue's targets.
pub const TARGETS: [Target; 3] = [
    Target {
        workload: "P",
        ours: "cost",
        peer: "round-robin",
        min_ratio: 1.5,
        wording: "≥ 1.5× round-robin's goodput frontier",
    },
    Target {
        workload: "U",
        ours: "cost",
        peer: "least-in-flight",
        min_ratio: 0.95,
        wording: "within 5 % of least-in-flight",
    },
    Target {
        workload: "H",
        ours: "cost",
        peer: "round-robin",
        min_ratio: 1.0,
        wording: "no worse than round-robin",
    },
];

/// The SLO of a run, derived from one request at a time on an idle engine (`calib`):
/// TTFT P99 ≤ `ttft_factor` × the idle TTFT P50 of a full (uncached) prompt, TPOT P99 ≤
/// `tpot_factor` × the idle TPOT P50, rounded up to 50 ms and 5 ms; success ≥ 99 %.
/// Returns the SLO and one sentence saying where it came from.
///
/// # Errors
/// [`BenchError::InvalidSpec`] when the calibration has no finite TTFT or TPOT median.
pub fn derive_slo(
    calib: &Summary,
    ttft_factor: f64,
    tpot_factor: f64,
) -> Result<(Slo, String), BenchError> {
    let (Some(ttft), Some(tpot)) = (calib.ttft.p50_ms, calib.tpot.p50_ms) else {
        return Err(BenchError::InvalidSpec(
            "the calibration measured no TTFT or TPOT median".into(),
        ));
    };
    let round_up = |v: f64, step: f64| (v / step).ceil() * step;
    let slo = Slo {
        ttft_ms: round_up(ttft * ttft_factor, 50.0),
        tpot_ms: round_up(tpot * tpot_factor, 5.0),
        percentile: 99.0,
        min_success: 0.99,
    };
    let why = format!(
        "TTFT ≤ {ttft_factor}× and TPOT ≤ {tpot_factor}× what one request alone gets on an idle engine \
         (uncached prompt: TTFT P50 {ttft:.0} ms, TPOT P50 {tpot:.1} ms over {} requests), rounded up: \
         {}",
        calib.ttft.count,
        slo.describe()
    );
    Ok((slo, why))
}

/// The sum of every sample of `name` in a Prometheus text exposition whose labels
/// include all of `labels`; `None` when no sample matches. Only plain `name{labels}
/// value` lines are read (counters and gauges); comments and other families are skipped.
#[must_use]
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut sum = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_text, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once('}') {
                Some((l, v)) => (l, v),
                None => continue,
            },
            None if rest.starts_with(' ') => ("", rest),
            None => continue,
        };
        let has = |(k, v): &(&str, &str)| {
            label_text
                .split(',')
                .any(|kv| kv.trim() == format!("{k}=\"{v}\""))
        };
        if !labels.iter().all(has) {
            continue;
        }
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// What the script wrote about the run (`meta.json`); every field optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Meta {
    /// UTC start and end.
    pub date: String,
    /// CPU model, cores, memory, kernel.
    pub machine: String,
    /// The commit measured (and whether the tree had changes).
    pub commit: String,
    /// How to rerun it.
    pub command: String,
    /// A smoke run, not a measurement.
    pub quick: bool,
    /// The engines' command line.
    pub engines: String,
    /// The router's command line (the policy varies).
    pub router: String,
    /// The load generator's settings.
    pub load: String,
    /// Where the SLO came from.
    pub slo: String,
    /// Load average and concurrent compiles seen during the run.
    pub noise: Vec<String>,
    /// Said at the top when set: why these numbers are not a measurement (a busy
    /// machine).
    pub warning: String,
    /// Anything else the reader should know.
    pub notes: Vec<String>,
}

/// One policy's sweep of one workload, with the metrics scraped after it.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRun {
    /// The router's `--policy`.
    pub policy: String,
    /// The sweep.
    pub sweep: SweepResult,
    /// The router's `/metrics` after the sweep.
    pub router_metrics: Option<String>,
    /// Each engine's `/metrics` after the sweep (engines restart for every sweep).
    pub engine_metrics: Vec<String>,
}

/// Every policy measured on one workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadRuns {
    /// `P`, `U` or `H`.
    pub key: String,
    /// The runs, in [`POLICIES`] order.
    pub runs: Vec<PolicyRun>,
}

impl WorkloadRuns {
    fn get(&self, policy: &str) -> Option<&PolicyRun> {
        self.runs.iter().find(|r| r.policy == policy)
    }
}

/// Direct-to-engine against through-the-router, in alternating pairs.
#[derive(Debug, Clone, PartialEq)]
pub struct Overhead {
    /// `(direct, router)` summaries, one pair per round.
    pub pairs: Vec<(Summary, Summary)>,
}

/// A whole run, as read back from its directory.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterBench {
    /// The script's notes.
    pub meta: Meta,
    /// The calibration run the SLO came from.
    pub calibration: Option<Summary>,
    /// The workloads measured, in [`WORKLOADS`] order.
    pub workloads: Vec<WorkloadRuns>,
    /// The router's overhead, when measured.
    pub overhead: Option<Overhead>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, BenchError> {
    let io = |source| BenchError::Io {
        path: path.display().to_string(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    serde_json::from_str(&text)
        .map_err(|e| BenchError::InvalidSpec(format!("{}: {e}", path.display())))
}

/// Reads a run directory; missing workloads, policies and files are left out.
///
/// # Errors
/// [`BenchError`] when a file that is there cannot be read or parsed.
pub fn load(dir: &Path) -> Result<RouterBench, BenchError> {
    let meta_path = dir.join("meta.json");
    let meta = if meta_path.exists() {
        read_json(&meta_path)?
    } else {
        Meta::default()
    };
    let calib_path = dir.join("calibration/summary.json");
    let calibration = calib_path
        .exists()
        .then(|| read_json(&calib_path))
        .transpose()?;
    let text = |p: &Path| std::fs::read_to_string(p).ok();
    let mut workloads = Vec::new();
    for (key, _, _) in WORKLOADS {
        let mut runs = Vec::new();
        for policy in POLICIES {
            let d = dir.join(key).join(policy);
            let sweep_path = d.join("sweep.json");
            if !sweep_path.exists() {
                continue;
            }
            let engine_metrics = (0..)
                .map(|i| d.join(format!("engine-{i}.metrics")))
                .map_while(|p| text(&p))
                .collect();
            runs.push(PolicyRun {
                policy: policy.to_owned(),
                sweep: read_json(&sweep_path)?,
                router_metrics: text(&d.join("router.metrics")),
                engine_metrics,
            });
        }
        if !runs.is_empty() {
            workloads.push(WorkloadRuns {
                key: key.to_owned(),
                runs,
            });
        }
    }
    let mut pairs = Vec::new();
    for n in 1.. {
        let (d, r) = (
            dir.join(format!("overhead/direct-{n}/summary.json")),
            dir.join(format!("overhead/router-{n}/summary.json")),
        );
        if !(d.exists() && r.exists()) {
            break;
        }
        pairs.push((read_json(&d)?, read_json(&r)?));
    }
    Ok(RouterBench {
        meta,
        calibration,
        workloads,
        overhead: (!pairs.is_empty()).then_some(Overhead { pairs }),
    })
}

/// A latency percentile for a table cell.
fn ms(v: Option<f64>, l: &Latency) -> String {
    match v {
        Some(v) => format!("{v:.0}"),
        None if l.count + l.infinite == 0 => "-".into(),
        None => "inf".into(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1} %", v * 100.0))
}

/// The offered rate every policy of `w` measured at which the first policy (the
/// baseline) still passed the SLO, the highest such; else the lowest common rate.
fn equal_load_rate(w: &WorkloadRuns) -> Option<f64> {
    let first = w.runs.first()?;
    let common: Vec<&SweepPoint> = first
        .sweep
        .sorted_points()
        .into_iter()
        .filter(|p| {
            w.runs.iter().all(|r| {
                r.sweep
                    .points
                    .iter()
                    .any(|q| (q.rate - p.rate).abs() < 1e-9)
            })
        })
        .collect();
    common
        .iter()
        .rev()
        .find(|p| p.summary.slo_pass)
        .or_else(|| common.first())
        .map(|p| p.rate)
}

fn point_at(s: &SweepResult, rate: f64) -> Option<&SweepPoint> {
    s.points.iter().find(|p| (p.rate - rate).abs() < 1e-9)
}

/// Prefix-cache hits over the whole sweep (every rate), from the clients' usage.
fn sweep_hit_rate(s: &SweepResult) -> Option<f64> {
    let (cached, prompt) = s.points.iter().fold((0u64, 0u64), |(c, p), pt| {
        (
            c + pt.summary.prefix_cache.cached_tokens,
            p + pt.summary.prefix_cache.prompt_tokens,
        )
    });
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

/// The highest SLO-goodput any rate of the sweep reached (requests that met both
/// targets, per second), passing or not: the goodput curve's peak.
fn peak_goodput(s: &SweepResult) -> f64 {
    s.points
        .iter()
        .map(|p| p.summary.goodput_rps)
        .fold(0.0, f64::max)
}

/// The goodput-frontier ratio `ours / peer` and whether it is a lower bound (the peer
/// failed even its lowest rate).
fn frontier_ratio(ours: &SweepResult, peer: &SweepResult) -> Option<(f64, bool)> {
    let c = report::compare(ours, peer);
    c.goodput_frontier_rps
        .ratio
        .map(|r| (r, false))
        .or(c.goodput_frontier_ratio_at_least.map(|r| (r, true)))
}

/// The verdicts of [`TARGETS`] that the run measured: `(target, ratio, lower bound)`.
#[must_use]
pub fn verdicts(b: &RouterBench) -> Vec<(Target, Option<(f64, bool)>)> {
    TARGETS
        .iter()
        .filter_map(|t| {
            let w = b.workloads.iter().find(|w| w.key == t.workload)?;
            let (ours, peer) = (w.get(t.ours)?, w.get(t.peer)?);
            Some((*t, frontier_ratio(&ours.sweep, &peer.sweep)))
        })
        .collect()
}

fn engine_split(run: &PolicyRun) -> String {
    let counts: Vec<f64> = run
        .engine_metrics
        .iter()
        .map(|m| metric_sum(m, &format!("{REQUESTS}_total"), &[]).unwrap_or(0.0))
        .collect();
    if counts.is_empty() {
        return "-".into();
    }
    counts
        .iter()
        .map(|c| format!("{c:.0}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn engine_hit_rate(run: &PolicyRun) -> Option<f64> {
    let sum = |name: &str| -> f64 {
        run.engine_metrics
            .iter()
            .filter_map(|m| metric_sum(m, &format!("{name}_total"), &[]))
            .sum()
    };
    let queries = sum(PREFIX_QUERIES);
    (queries > 0.0).then(|| sum(PREFIX_HITS) / queries)
}

fn workload_section(o: &mut String, w: &WorkloadRuns) {
    let (_, title, why) = WORKLOADS
        .iter()
        .find(|(k, _, _)| *k == w.key)
        .copied()
        .unwrap_or(("?", "?", ""));
    let Some(first) = w.runs.first() else {
        return;
    };
    let _ = writeln!(o, "## Workload {}: {title}\n", w.key);
    let _ = writeln!(o, "What it shows: {why}.  ");
    let _ = writeln!(o, "Requests: {}.  ", first.sweep.workload);
    let _ = writeln!(o, "Arrivals: {}.\n", first.sweep.arrivals);
    let eq = equal_load_rate(w);
    let _ = writeln!(
        o,
        "| policy | goodput frontier (req/s) | at offered (req/s) | peak SLO-goodput (req/s) | prefix hit rate, all rates (engine usage) | requests per engine | {} |",
        eq.map_or("at equal load".into(), |r| format!(
            "at equal load {r} req/s: TTFT P50 / P99, TPOT P99 (ms), hit rate"
        )),
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---|");
    for r in &w.runs {
        let (frontier, at) = r
            .sweep
            .frontier
            .as_ref()
            .map_or(("none (failed its lowest rate)".into(), "-".into()), |f| {
                (format!("{:.3}", f.goodput_rps), format!("{}", f.rate))
            });
        let equal = eq
            .and_then(|rate| point_at(&r.sweep, rate))
            .map_or("-".into(), |p| {
                let s = &p.summary;
                format!(
                    "{} / {}, {}, {}",
                    ms(s.ttft.p50_ms, &s.ttft),
                    ms(s.ttft.p99_ms, &s.ttft),
                    ms(s.tpot.p99_ms, &s.tpot),
                    pct(s.prefix_cache.hit_rate)
                )
            });
        let _ = writeln!(
            o,
            "| {} | {frontier} | {at} | {:.3} | {} | {} | {equal} |",
            r.policy,
            peak_goodput(&r.sweep),
            pct(sweep_hit_rate(&r.sweep)),
            engine_split(r),
        );
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "Every rate measured:\n");
    let _ = writeln!(
        o,
        "| offered (req/s) | policy | SLO-goodput (req/s) | success | prefix hit rate | TTFT P50 | TTFT P99 | TPOT P50 | TPOT P99 | SLO |"
    );
    let _ = writeln!(o, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut rates: Vec<f64> = w
        .runs
        .iter()
        .flat_map(|r| r.sweep.points.iter().map(|p| p.rate))
        .collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
    for rate in rates {
        for r in &w.runs {
            let Some(p) = point_at(&r.sweep, rate) else {
                continue;
            };
            let s = &p.summary;
            let _ = writeln!(
                o,
                "| {rate} | {} | {:.3} | {:.1} % | {} | {} | {} | {} | {} | {} |",
                r.policy,
                s.goodput_rps,
                s.success_rate * 100.0,
                pct(s.prefix_cache.hit_rate),
                ms(s.ttft.p50_ms, &s.ttft),
                ms(s.ttft.p99_ms, &s.ttft),
                ms(s.tpot.p50_ms, &s.tpot),
                ms(s.tpot.p99_ms, &s.tpot),
                if s.slo_pass {
                    "pass".to_owned()
                } else {
                    format!("FAIL: {}", s.slo_failures.join("; "))
                }
            );
        }
    }
    let _ = writeln!(o);
    prediction_table(o, w);
}

/// The router's `--policy` behind a run's policy label: `cost-scale-N` is the cost policy.
fn router_policy(label: &str) -> &str {
    if label.starts_with("cost-scale-") {
        "cost"
    } else {
        label
    }
}

fn prediction_table(o: &mut String, w: &WorkloadRuns) {
    let with_metrics: Vec<&PolicyRun> = w
        .runs
        .iter()
        .filter(|r| r.router_metrics.is_some())
        .collect();
    if with_metrics.is_empty() {
        return;
    }
    let family = format!("{}_total", names::PREFIX_PREDICTIONS);
    let _ = writeln!(
        o,
        "The router's prefix index against the engines (`{family}`, whole sweep, warm-up included; \
         matched = within one KV block of what the engine reported; decided by the policy = \
         choices the policy made itself, the rest fell back to least-in-flight on a stale load \
         view):\n"
    );
    let _ = writeln!(
        o,
        "| policy | matched | over | under | matched share | predicted cached tokens | engine-reported cached tokens | engine prefix hits / queries (engine /metrics) | decided by the policy |"
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in with_metrics {
        let m = r.router_metrics.as_deref().unwrap_or_default();
        let count =
            |result: &str| metric_sum(m, &family, &[(names::RESULT_LABEL, result)]).unwrap_or(0.0);
        let (matched, over, under) = (count("matched"), count("over"), count("under"));
        let total = matched + over + under;
        let tokens = |name: &str| {
            metric_sum(m, &format!("{name}_total"), &[]).map_or("-".into(), |v| format!("{v:.0}"))
        };
        let decisions = format!("{}_total", names::DECISIONS);
        let by_policy = metric_sum(
            m,
            &decisions,
            &[(names::POLICY_LABEL, router_policy(&r.policy))],
        );
        let all_decisions = metric_sum(m, &decisions, &[]);
        let _ = writeln!(
            o,
            "| {} | {matched:.0} | {over:.0} | {under:.0} | {} | {} | {} | {} | {} |",
            r.policy,
            pct((total > 0.0).then(|| matched / total)),
            tokens(names::PREDICTED_CACHED_TOKENS),
            tokens(names::CACHED_TOKENS),
            pct(engine_hit_rate(r)),
            pct(by_policy
                .zip(all_decisions)
                .and_then(|(a, b)| (b > 0.0).then(|| a / b))),
        );
    }
    let _ = writeln!(o);
}

fn overhead_section(o: &mut String, ov: &Overhead) {
    let _ = writeln!(o, "## Router overhead\n");
    let _ = writeln!(
        o,
        "One engine, the same light load (one request at a time), direct and through the router \
         (`--policy cost`, that engine alone behind it), alternating; each round its own prompts.\n"
    );
    let _ = writeln!(
        o,
        "| round | requests (direct / router) | TTFT P50 direct (ms) | TTFT P50 router (ms) | added (ms) | TPOT P50 direct / router (ms) |"
    );
    let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|");
    let mut added = Vec::new();
    for (i, (d, r)) in ov.pairs.iter().enumerate() {
        let diff = r.ttft.p50_ms.zip(d.ttft.p50_ms).map(|(r, d)| r - d);
        if let Some(x) = diff {
            added.push(x);
        }
        let _ = writeln!(
            o,
            "| {} | {} / {} | {} | {} | {} | {} / {} |",
            i + 1,
            d.counts.completed,
            r.counts.completed,
            ms(d.ttft.p50_ms, &d.ttft),
            ms(r.ttft.p50_ms, &r.ttft),
            diff.map_or("-".into(), |x| format!("{x:+.1}")),
            ms(d.tpot.p50_ms, &d.tpot),
            ms(r.tpot.p50_ms, &r.tpot),
        );
    }
    if !added.is_empty() {
        added.sort_by(f64::total_cmp);
        let mean = added.iter().sum::<f64>() / added.len() as f64;
        let _ = writeln!(
            o,
            "\nAdded TTFT P50: mean {mean:+.1} ms over {} rounds (min {:+.1}, max {:+.1}); \
             the spread between rounds is the machine's noise, not the router's cost.\n",
            added.len(),
            added[0],
            added[added.len() - 1]
        );
    }
}

/// The report, as Markdown (also readable as plain text). `plots` are the plot files
/// per workload key, relative to where the Markdown is written.
#[must_use]
pub fn render(b: &RouterBench, plots: &[(String, String)]) -> String {
    let mut o = String::new();
    let m = &b.meta;
    let _ = writeln!(
        o,
        "# slipway-router benchmarks\n\n\
         Regenerated by `make bench-router` (do not edit by hand). {}\n",
        if m.quick {
            "**This is a QUICK=1 smoke run: a few short points, not a measurement.**"
        } else {
            ""
        }
    );
    if !m.warning.is_empty() {
        let _ = writeln!(o, "**{}**\n", m.warning);
    }
    let _ = writeln!(o, "## How to read it\n");
    let _ = writeln!(
        o,
        "- Two engine replicas behind one `slipway-router`; the three policies are the same \
         router binary with a different `--policy`: `round-robin` (what a Kubernetes Service \
         does), `least-in-flight`, and `cost` (slipway-router's choice: prefix overlap and \
         load). Engines and router restart for every sweep, so each starts with cold caches.\n\
         - Open-loop Poisson arrivals at rising offered rates. **SLO-goodput** = requests/s \
         that completed and met both targets. The **goodput frontier** is the SLO-goodput at \
         the highest offered rate whose P99s still met the SLO (a pass above a failure does \
         not count). Peak SLO-goodput is the highest goodput at any rate, passing or not.\n\
         - Prefix hit rate = prompt tokens the engines reported cached \
         (`usage.prompt_tokens_details.cached_tokens`) over all prompt tokens.\n\
         - Ratios are against the peer measured in the same run; absolute times belong to \
         this machine only. `inf` is a percentile that falls on a request that never \
         finished.\n"
    );
    let _ = writeln!(o, "## The run\n");
    for (k, v) in [
        ("Date", &m.date),
        ("Machine", &m.machine),
        ("Commit", &m.commit),
        ("Command", &m.command),
        ("Engines", &m.engines),
        ("Router", &m.router),
        ("Load generator", &m.load),
        ("SLO", &m.slo),
    ] {
        if !v.is_empty() {
            let _ = writeln!(o, "- {k}: {v}");
        }
    }
    for n in &m.noise {
        let _ = writeln!(o, "- Noise: {n}");
    }
    for n in &m.notes {
        let _ = writeln!(o, "- Note: {n}");
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "## Against the issue's targets\n");
    let _ = writeln!(
        o,
        "| workload | ratio of goodput frontiers | measured | target | met |"
    );
    let _ = writeln!(o, "|---|---|---:|---|---|");
    for (t, r) in verdicts(b) {
        let (measured, met) = match r {
            Some((r, lower)) => (
                format!("{}{r:.2}×", if lower { "> " } else { "" }),
                if r >= t.min_ratio {
                    "yes"
                } else if lower {
                    "unknown (lower bound)"
                } else {
                    "**no**"
                },
            ),
            None => ("n/a (no frontier)".into(), "n/a"),
        };
        let _ = writeln!(
            o,
            "| {} | {} / {} | {measured} | {} | {met} |",
            t.workload, t.ours, t.peer, t.wording
        );
    }
    for (key, ours, peer) in REFERENCE_RATIOS {
        if let Some(w) = b.workloads.iter().find(|w| w.key == key)
            && let (Some(a), Some(p)) = (w.get(ours), w.get(peer))
        {
            let measured = match frontier_ratio(&a.sweep, &p.sweep) {
                Some((r, lower)) => format!("{}{r:.2}×", if lower { "> " } else { "" }),
                None => "n/a (no frontier)".into(),
            };
            let _ = writeln!(
                o,
                "| {key} | {ours} / {peer} (for reference) | {measured} | - | - |"
            );
        }
    }
    if let Some(ov) = &b.overhead {
        let added: Vec<f64> = ov
            .pairs
            .iter()
            .filter_map(|(d, r)| r.ttft.p50_ms.zip(d.ttft.p50_ms).map(|(r, d)| r - d))
            .collect();
        if !added.is_empty() {
            let _ = writeln!(
                o,
                "| overhead | TTFT P50 through the router − direct | {:+.1} ms | report | - |",
                added.iter().sum::<f64>() / added.len() as f64
            );
        }
    }
    let _ = writeln!(o);
    for w in &b.workloads {
        workload_section(&mut o, w);
        if let Some((_, path)) = plots.iter().find(|(k, _)| *k == w.key) {
            let _ = writeln!(
                o,
                "![Workload {}: TTFT, TPOT and SLO-goodput against offered rate, per policy]({path})\n",
                w.key
            );
        }
    }
    if let Some(ov) = &b.overhead {
        overhead_section(&mut o, ov);
    }
    if let Some(c) = &b.calibration {
        let _ = writeln!(o, "## Calibration\n");
        let _ = writeln!(
            o,
            "One request at a time on an idle engine, uncached prompts of the run's length: \
             {} requests, TTFT P50 {} ms, TPOT P50 {} ms, E2E P50 {} ms.\n",
            c.counts.completed,
            ms(c.ttft.p50_ms, &c.ttft),
            ms(c.tpot.p50_ms, &c.tpot),
            ms(c.e2e.p50_ms, &c.e2e),
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{DEFAULT_BUCKETS, summarize};

    const ROUTER_METRICS: &str = "# HELP slipway_router_prefix_predictions Requests by how\n\
# TYPE slipway_router_prefix_predictions counter\n\
slipway_router_prefix_predictions_total{release=\"stable\",result=\"matched\"} 40\n\
slipway_router_prefix_predictions_total{release=\"stable\",result=\"over\"} 3\n\
slipway_router_prefix_predictions_total{release=\"canary\",result=\"matched\"} 2\n\
slipway_router_prefix_predictions_total_extra{result=\"matched\"} 1000\n\
slipway_router_predicted_cached_tokens_total{release=\"stable\"} 12800\n\
slipway_router_cached_tokens_total{release=\"stable\"} 12000\n\
slipway_router_decisions_total{release=\"stable\",policy=\"cost\"} 36\n\
slipway_router_decisions_total{release=\"stable\",policy=\"least-in-flight\"} 4\n";

    #[test]
    fn metric_sum_adds_matching_samples_only() {
        let f = "slipway_router_prefix_predictions_total";
        assert_eq!(metric_sum(ROUTER_METRICS, f, &[]), Some(45.0));
        assert_eq!(
            metric_sum(ROUTER_METRICS, f, &[("result", "matched")]),
            Some(42.0)
        );
        assert_eq!(
            metric_sum(
                ROUTER_METRICS,
                f,
                &[("result", "matched"), ("release", "stable")]
            ),
            Some(40.0)
        );
        assert_eq!(metric_sum(ROUTER_METRICS, f, &[("result", "under")]), None);
        assert_eq!(metric_sum("plain 3\nplain_x 4\n", "plain", &[]), Some(3.0));
    }

    fn calib(ttft_ms: f64, tpot_ms: f64) -> Summary {
        let mut s = summarize(&[], &[], 1.0, None, Slo::default(), DEFAULT_BUCKETS);
        s.ttft.p50_ms = Some(ttft_ms);
        s.tpot.p50_ms = Some(tpot_ms);
        s.ttft.count = 5;
        s
    }

    #[test]
    fn the_slo_is_a_rounded_multiple_of_the_idle_latencies() {
        let (slo, why) = derive_slo(&calib(412.0, 31.2), 4.0, 3.0).unwrap();
        assert_eq!((slo.ttft_ms, slo.tpot_ms), (1650.0, 95.0));
        assert!((slo.percentile - 99.0).abs() < f64::EPSILON);
        assert!(why.contains("412 ms") && why.contains("1650 ms"), "{why}");
        let mut none = calib(1.0, 1.0);
        none.tpot.p50_ms = None;
        assert!(derive_slo(&none, 4.0, 3.0).is_err());
    }

    fn sweep(label: &str, points: &[(f64, bool, f64)]) -> SweepResult {
        let mut r = SweepResult {
            label: label.into(),
            workload: "w".into(),
            arrivals: "a".into(),
            slo: Slo::default(),
            points: points
                .iter()
                .map(|&(rate, pass, goodput)| {
                    let mut s =
                        summarize(&[], &[], 1.0, Some(rate), Slo::default(), DEFAULT_BUCKETS);
                    s.slo_pass = pass;
                    s.goodput_rps = goodput;
                    s.prefix_cache.prompt_tokens = 1000;
                    s.prefix_cache.cached_tokens = if label == "cost" { 900 } else { 500 };
                    s.prefix_cache.hit_rate = Some(s.prefix_cache.cached_tokens as f64 / 1000.0);
                    SweepPoint { rate, summary: s }
                })
                .collect(),
            frontier: None,
        };
        r.compute_frontier();
        r
    }

    fn run(policy: &str, points: &[(f64, bool, f64)]) -> PolicyRun {
        PolicyRun {
            policy: policy.into(),
            sweep: sweep(policy, points),
            router_metrics: Some(ROUTER_METRICS.into()),
            engine_metrics: vec![
                "slipway_requests_total{outcome=\"ok\"} 30\nslipway_prefix_cache_queries_total 100\nslipway_prefix_cache_hits_total 80\n".into(),
                "slipway_requests_total{outcome=\"ok\"} 12\nslipway_prefix_cache_queries_total 100\nslipway_prefix_cache_hits_total 60\n".into(),
            ],
        }
    }

    #[test]
    fn the_report_states_ratios_against_the_peers_of_the_same_run() {
        let b = RouterBench {
            meta: Meta {
                machine: "2 cores".into(),
                warning: "busy".into(),
                ..Meta::default()
            },
            calibration: Some(calib(400.0, 30.0)),
            workloads: vec![
                WorkloadRuns {
                    key: "P".into(),
                    runs: vec![
                        run("round-robin", &[(0.2, true, 0.2), (0.4, false, 0.3)]),
                        run("least-in-flight", &[(0.2, true, 0.2), (0.4, false, 0.3)]),
                        run(
                            "cost",
                            &[(0.2, true, 0.2), (0.4, true, 0.39), (0.6, false, 0.4)],
                        ),
                    ],
                },
                WorkloadRuns {
                    key: "U".into(),
                    runs: vec![
                        run("least-in-flight", &[(0.2, true, 0.2), (0.4, true, 0.4)]),
                        run("cost", &[(0.2, true, 0.2), (0.4, false, 0.3)]),
                    ],
                },
                WorkloadRuns {
                    key: "H".into(),
                    runs: vec![
                        run("round-robin", &[(0.2, false, 0.1)]),
                        run("cost", &[(0.2, true, 0.2)]),
                    ],
                },
            ],
            overhead: None,
        };
        let v = verdicts(&b);
        assert_eq!(v.len(), 3);
        // P: 0.39 / 0.2; U: 0.2 / 0.4; H: round-robin failed its lowest rate, so > 1.
        assert!((v[0].1.unwrap().0 - 1.95).abs() < 1e-12);
        assert!((v[1].1.unwrap().0 - 0.5).abs() < 1e-12);
        assert_eq!(v[2].1, Some((1.0, true)));
        let md = render(&b, &[("P".into(), "benchmarks/P.svg".into())]);
        assert!(md.contains("| P | cost / round-robin | 1.95× |"), "{md}");
        assert!(
            md.contains("| U | cost / least-in-flight | 0.50× |"),
            "{md}"
        );
        assert!(md.contains("**no**"), "{md}");
        assert!(md.contains("| H | cost / round-robin | > 1.00× |"), "{md}");
        assert!(md.contains("![Workload P"), "{md}");
        // Prediction table: 42 matched of 45 in the sample; engines split 30 / 12; the
        // cost policy decided 36 of 40 choices itself (4 fell back).
        assert!(
            md.contains("| cost | 42 | 3 | 0 | 93.3 % | 12800 | 12000 | 70.0 % | 90.0 % |"),
            "{md}"
        );
        assert!(md.contains("| 30 / 12 |"), "{md}");
        assert_eq!(router_policy("cost-scale-8"), "cost");
        assert_eq!(router_policy("least-in-flight"), "least-in-flight");
        assert!(md.contains("at equal load 0.2 req/s"), "{md}");
        assert!(md.contains("Machine: 2 cores"), "{md}");
        assert!(md.contains("**busy**"), "{md}");
    }

    #[test]
    fn the_overhead_is_the_mean_added_ttft_median() {
        let pair = |d: f64, r: f64| (calib(d, 30.0), calib(r, 30.0));
        let b = RouterBench {
            meta: Meta::default(),
            calibration: None,
            workloads: Vec::new(),
            overhead: Some(Overhead {
                pairs: vec![pair(100.0, 101.0), pair(100.0, 103.0)],
            }),
        };
        let md = render(&b, &[]);
        assert!(
            md.contains("| overhead | TTFT P50 through the router − direct | +2.0 ms |"),
            "{md}"
        );
        assert!(
            md.contains("mean +2.0 ms over 2 rounds (min +1.0, max +3.0)"),
            "{md}"
        );
    }

    #[test]
    fn a_run_directory_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("P/cost");
        std::fs::create_dir_all(&d).unwrap();
        let s = sweep("cost", &[(0.2, true, 0.2)]);
        std::fs::write(d.join("sweep.json"), serde_json::to_string(&s).unwrap()).unwrap();
        std::fs::write(d.join("router.metrics"), ROUTER_METRICS).unwrap();
        std::fs::write(d.join("engine-0.metrics"), "x 1\n").unwrap();
        std::fs::write(dir.path().join("meta.json"), r#"{"quick": true}"#).unwrap();
        let b = load(dir.path()).unwrap();
        assert!(b.meta.quick);
        assert_eq!(b.workloads.len(), 1);
        assert_eq!(b.workloads[0].runs[0].engine_metrics.len(), 1);
        assert!(b.overhead.is_none());
        assert!(render(&b, &[]).contains("QUICK=1 smoke run"));
    }
}
