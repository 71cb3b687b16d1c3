//! `slipway-bench capacity`: one load trace (a 3× ramp, a plateau, a fall) replayed
//! under three capacity configurations, static at the peak, static at the average, and
//! measured demand, with the operator's own decisions: every step runs
//! `slipway_operator::plan` on the simulated cluster, and measured demand is read
//! through the operator's own sample store and rate history from per-engine request
//! counters, as its scrape would.
//!
//! What is simulated, and why: this machine cannot host the 3× peak's worth of real
//! engine groups side by side (they would share two cores, so more groups would add no
//! capacity). So serving is a fluid model of the definition the CRD uses: one ready
//! group serves `replicaGoodput` requests per second within the SLO; in each step, the
//! requests beyond what the ready groups serve miss it. A created group becomes ready
//! after `cold_start`; a deleted group stops taking requests at once (its drain
//! finishes what it holds). Arrivals are the trace's rate, without noise, so the three
//! runs differ only in their decisions. Group-seconds count every live group, starting
//! ones included: what a cluster pays for.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};
use slipway_api::InferenceService;
use slipway_api::status::InferenceServiceStatus;
use slipway_operator::demand::{self, DemandReading, RateHistory};
use slipway_operator::observed::{Observed, ObservedNode, ObservedPod, Phase};
use slipway_operator::plan;
use slipway_operator::plan::{Child, ChildKind};
use slipway_operator::rollout::source::{Counters, SampleStore};

use crate::BenchError;

/// The sample the runs start from (its release and SLO; capacity is replaced).
const SAMPLE: &str = include_str!("../../manifests/samples/smollm2-cpu.yaml");
const ZONE_KEY: &str = "topology.kubernetes.io/zone";

/// The load trace: a base rate, a ramp to `peak_factor` × base, a plateau, a fall back,
/// and the base again (minutes for each phase).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trace {
    pub base: f64,
    pub peak_factor: f64,
    pub low_minutes: f64,
    pub ramp_minutes: f64,
    pub plateau_minutes: f64,
    pub fall_minutes: f64,
    pub tail_minutes: f64,
}

impl Default for Trace {
    fn default() -> Self {
        Self {
            base: 10.0,
            peak_factor: 3.0,
            low_minutes: 30.0,
            ramp_minutes: 15.0,
            plateau_minutes: 20.0,
            fall_minutes: 15.0,
            tail_minutes: 40.0,
        }
    }
}

impl Trace {
    /// Requests per second at `t` seconds.
    pub fn rate(&self, t: f64) -> f64 {
        let peak = self.base * self.peak_factor;
        let m = t / 60.0;
        let ends = [
            self.low_minutes,
            self.low_minutes + self.ramp_minutes,
            self.low_minutes + self.ramp_minutes + self.plateau_minutes,
            self.low_minutes + self.ramp_minutes + self.plateau_minutes + self.fall_minutes,
        ];
        if m < ends[0] {
            self.base
        } else if m < ends[1] {
            self.base + (peak - self.base) * (m - ends[0]) / self.ramp_minutes
        } else if m < ends[2] {
            peak
        } else if m < ends[3] {
            peak - (peak - self.base) * (m - ends[2]) / self.fall_minutes
        } else {
            self.base
        }
    }

    /// Length in seconds.
    pub fn seconds(&self) -> f64 {
        60.0 * (self.low_minutes
            + self.ramp_minutes
            + self.plateau_minutes
            + self.fall_minutes
            + self.tail_minutes)
    }

    /// The mean rate over the trace.
    pub fn mean(&self, step: f64) -> f64 {
        let steps = (self.seconds() / step).ceil() as usize;
        (0..steps).map(|i| self.rate(i as f64 * step)).sum::<f64>() / steps as f64
    }
}

/// One configuration: a name and the `spec.capacity` it runs with.
#[derive(Debug, Clone)]
pub struct Config {
    pub name: String,
    pub capacity: Value,
}

/// The three configurations of the comparison, for a trace and a group's goodput.
pub fn configs(trace: &Trace, goodput: f64, step: f64, measured: &Value) -> Vec<Config> {
    let capacity = |demand: Value| {
        json!({
            "demand": demand,
            "replicaGoodput": goodput,
            "faultDomain": {"fLoss": 0},
            "minReplicas": 1,
            "maxReplicas": 100,
        })
    };
    let peak = trace.base * trace.peak_factor;
    vec![
        Config {
            name: "static at peak".to_owned(),
            capacity: capacity(json!({"static": peak})),
        },
        Config {
            name: "static at average".to_owned(),
            capacity: capacity(json!({"static": (trace.mean(step) * 1000.0).round() / 1000.0})),
        },
        Config {
            name: "measured".to_owned(),
            capacity: capacity(json!({"measured": measured})),
        },
    ]
}

/// One point of a run's timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub t: f64,
    pub demand: f64,
    pub live_groups: u32,
    pub ready_groups: u32,
    pub slo_met: f64,
}

/// What one configuration did over the trace.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub name: String,
    pub group_seconds: f64,
    pub requests: f64,
    pub slo_met: f64,
    pub timeline: Vec<Point>,
}

impl RunResult {
    /// Share of requests that met the SLO.
    pub fn slo_met_fraction(&self) -> f64 {
        if self.requests > 0.0 {
            self.slo_met / self.requests
        } else {
            1.0
        }
    }
}

struct SimPod {
    pod: ObservedPod,
    ready_at: f64,
    /// Requests this engine has counted (its `slipway_requests_total`).
    requests: f64,
}

fn time_at(start: Timestamp, t: f64) -> Time {
    let at = start
        .checked_add(SignedDuration::from_secs(t as i64))
        .unwrap_or(start);
    Time(at)
}

/// Runs one configuration over the trace. `step`: seconds between reconciles (the
/// demand reader reads every quarter of its rate window; reconciles in between reuse
/// the last reading, as the reader does).
///
/// # Errors
/// [`BenchError::InvalidSpec`] when the configuration does not make a valid object.
pub fn run(
    config: &Config,
    trace: &Trace,
    goodput: f64,
    step: f64,
    cold_start: Duration,
    zones: usize,
) -> Result<RunResult, BenchError> {
    let invalid = |e: String| BenchError::InvalidSpec(format!("{}: {e}", config.name));
    let mut isvc: Value = serde_yaml::from_str(SAMPLE).map_err(|e| invalid(e.to_string()))?;
    isvc["metadata"]["namespace"] = json!("bench");
    isvc["metadata"]["uid"] = json!("00000000-0000-0000-0000-000000000001");
    isvc["metadata"]["generation"] = json!(1);
    isvc["spec"]["capacity"] = config.capacity.clone();
    let start = Timestamp::from_second(1_767_225_600).unwrap_or(Timestamp::UNIX_EPOCH);
    let nodes: BTreeMap<String, ObservedNode> = (0..zones.max(1))
        .map(|z| {
            (
                format!("node-{z}"),
                ObservedNode {
                    labels: BTreeMap::from([(ZONE_KEY.to_owned(), format!("zone-{z}"))]),
                    ready: true,
                    ..ObservedNode::default()
                },
            )
        })
        .collect();
    let windows = {
        let object: InferenceService =
            serde_json::from_value(isvc.clone()).map_err(|e| invalid(e.to_string()))?;
        object
            .spec
            .capacity
            .demand
            .measured
            .as_ref()
            .map(demand::Windows::of)
    };
    let unit = slipway_api::spec::DemandUnit::RequestsPerSecond;
    let read_every = windows.map_or(f64::INFINITY, |w| w.interval().as_secs_f64());
    let mut store = SampleStore::new(0.0);
    let mut history = RateHistory::default();
    let mut reading: Option<DemandReading> = None;
    let mut last_read = f64::NEG_INFINITY;

    let mut pods: BTreeMap<String, SimPod> = BTreeMap::new();
    let mut status = InferenceServiceStatus::default();
    let mut placed = 0usize;
    let mut result = RunResult {
        name: config.name.clone(),
        group_seconds: 0.0,
        requests: 0.0,
        slo_met: 0.0,
        timeline: Vec::new(),
    };
    let mut t = 0.0;
    while t < trace.seconds() {
        let now = time_at(start, t);
        // Serve this step's arrivals on the ready groups, evenly.
        let ready: Vec<String> = pods
            .iter()
            .filter(|(_, p)| t >= p.ready_at)
            .map(|(name, _)| name.clone())
            .collect();
        let arrivals = trace.rate(t) * step;
        let served_in_slo = arrivals.min(ready.len() as f64 * goodput * step);
        result.requests += arrivals;
        result.slo_met += served_in_slo;
        for name in &ready {
            if let Some(pod) = pods.get_mut(name) {
                pod.requests += arrivals / ready.len() as f64;
            }
        }
        for pod in pods.values_mut() {
            let is_ready = t >= pod.ready_at;
            if is_ready && !pod.pod.ready {
                pod.pod.ready_since = Some(time_at(start, pod.ready_at));
            }
            pod.pod.ready = is_ready;
            pod.pod.phase = Phase::Running;
        }
        // The operator's demand reading, at its own interval.
        if let Some(windows) = &windows
            && t - last_read >= read_every
        {
            last_read = t;
            for pod in pods.values().filter(|p| t >= p.ready_at) {
                let counters = Counters {
                    requests: pod.requests,
                    ..Counters::default()
                };
                let uid = pod.pod.uid.clone().unwrap_or_default();
                store.record(t, &uid, &pod.pod.release, counters);
            }
            store.prune(t, windows.rate.as_secs_f64());
            let releases: Vec<String> = pods.values().map(|p| p.pod.release.clone()).collect();
            reading = Some(DemandReading {
                at: Some(now.clone()),
                ..demand::scrape_reading(&store, &mut history, t, windows, unit, &releases)
            });
        }
        // Reconcile.
        isvc["status"] = serde_json::to_value(&status).map_err(|e| invalid(e.to_string()))?;
        let object: InferenceService =
            serde_json::from_value(isvc.clone()).map_err(|e| invalid(e.to_string()))?;
        let observed = Observed {
            pods: pods.values().map(|p| p.pod.clone()).collect(),
            nodes: nodes.clone(),
            serving_pods: ready.iter().cloned().collect(),
            demand: reading.clone(),
            ..Observed::default()
        };
        let planned = plan(&object, &observed, &now);
        if let Some(why) = planned.invalid {
            return Err(invalid(why.to_string()));
        }
        for child in &planned.delete {
            if child.kind == ChildKind::Pod {
                pods.remove(&child.name);
            }
        }
        for child in &planned.apply {
            let Child::Pod(pod) = child else { continue };
            // As the API server would show it just created: the operator's own
            // conversion, then what the server and scheduler fill in.
            let Some(mut created) = slipway_operator::observed::pod_from(pod) else {
                continue;
            };
            placed += 1;
            created.uid = Some(format!("{}-{placed}", created.name));
            created.node = Some(format!("node-{}", placed % zones.max(1)));
            created.created = Some(now.clone());
            pods.insert(
                created.name.clone(),
                SimPod {
                    pod: created,
                    ready_at: t + cold_start.as_secs_f64(),
                    requests: 0.0,
                },
            );
        }
        status = planned.status;
        let live = u32::try_from(pods.len()).unwrap_or(u32::MAX);
        result.group_seconds += f64::from(live) * step;
        result.timeline.push(Point {
            t,
            demand: trace.rate(t),
            live_groups: live,
            ready_groups: u32::try_from(ready.len()).unwrap_or(u32::MAX),
            slo_met: if arrivals > 0.0 {
                served_in_slo / arrivals
            } else {
                1.0
            },
        });
        t += step;
    }
    Ok(result)
}

/// The comparison table: each configuration's group-seconds and SLO-met fraction, and
/// both against static-at-peak (the first result).
pub fn table(results: &[RunResult]) -> String {
    let mut out = format!(
        "{:<20} {:>14} {:>16} {:>12} {:>18}\n",
        "configuration", "group-seconds", "vs static peak", "SLO met", "vs static peak"
    );
    let Some(reference) = results.first() else {
        return out;
    };
    for r in results {
        out.push_str(&format!(
            "{:<20} {:>14.0} {:>15.1}% {:>11.2}% {:>+15.2} pt\n",
            r.name,
            r.group_seconds,
            100.0 * r.group_seconds / reference.group_seconds.max(1.0),
            100.0 * r.slo_met_fraction(),
            100.0 * (r.slo_met_fraction() - reference.slo_met_fraction()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_ramps_to_three_times_and_back() {
        let trace = Trace::default();
        assert_eq!(trace.rate(0.0), 10.0);
        assert_eq!(trace.rate(60.0 * 45.0), 30.0);
        assert_eq!(trace.rate(60.0 * 37.5), 20.0);
        assert_eq!(trace.rate(trace.seconds() - 1.0), 10.0);
        let mean = trace.mean(5.0);
        assert!(mean > 10.0 && mean < 30.0, "{mean}");
    }

    /// The simulation is the operator's: static at the peak runs exactly
    /// ceil(peak / goodput) groups once started, and meets the SLO after the cold start.
    #[test]
    fn static_at_peak_runs_the_peak_groups() {
        let trace = Trace {
            base: 2.0,
            low_minutes: 2.0,
            ramp_minutes: 1.0,
            plateau_minutes: 2.0,
            fall_minutes: 1.0,
            tail_minutes: 2.0,
            ..Trace::default()
        };
        let measured = json!({"rateWindow": "1m", "peakWindow": "2m", "headroom": 0, "scaleDownStabilization": "1m"});
        let configs = configs(&trace, 1.0, 5.0, &measured);
        let peak = run(&configs[0], &trace, 1.0, 5.0, Duration::from_secs(30), 3).unwrap();
        assert!(peak.timeline.iter().all(|p| p.live_groups == 6));
        assert!(
            peak.timeline
                .iter()
                .filter(|p| p.t >= 30.0)
                .all(|p| p.slo_met == 1.0)
        );
        let measured = run(&configs[2], &trace, 1.0, 5.0, Duration::from_secs(30), 3).unwrap();
        let most = measured
            .timeline
            .iter()
            .map(|p| p.live_groups)
            .max()
            .unwrap_or(0);
        assert!(
            most >= 6,
            "measured demand never reached the peak's groups: {most}"
        );
        assert!(measured.group_seconds < peak.group_seconds);
    }
}
