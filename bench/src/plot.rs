//! Plots of a sweep (or several, one colour per server): TTFT and TPOT P50/P99 against
//! offered rate with the SLO targets drawn, and SLO-goodput against offered rate.
//!
//! Written as SVG and PNG from one drawing function. Text is rendered with a TrueType
//! font loaded at run time (`SLIPWAY_BENCH_FONT`, else common system paths), because
//! plotters' system-font backend needs native fontconfig/freetype; without any font the
//! plots are still drawn, with lines and tick marks but no text, and a warning says so.
//! An infinite percentile (unfinished requests) is drawn as a cross on the top edge.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::BenchError;
use crate::stats::Latency;
use crate::sweep::SweepResult;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a font once per process; returns whether text can be drawn.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let env = std::env::var("SLIPWAY_BENCH_FONT").ok();
        for path in env
            .iter()
            .map(String::as_str)
            .chain(FONT_PATHS.iter().copied())
        {
            if let Ok(bytes) = std::fs::read(path) {
                // The font must outlive every plot; it is loaded once per process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        tracing::warn!("no TrueType font found (set SLIPWAY_BENCH_FONT); plots will have no text");
        false
    })
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

type Series = Vec<(f64, Option<f64>)>;

fn pct(
    results: &[&SweepResult],
    get: fn(&crate::stats::Summary) -> &Latency,
    p99: bool,
) -> Vec<Series> {
    results
        .iter()
        .map(|r| {
            r.sorted_points()
                .iter()
                .map(|p| {
                    let l = get(&p.summary);
                    (p.rate, if p99 { l.p99_ms } else { l.p50_ms })
                })
                .collect()
        })
        .collect()
}

/// One of the three charts.
struct Panel<'a> {
    title: &'a str,
    y_label: &'a str,
    /// Series per server, and whether they are the P99 (thick) lines.
    lines: Vec<(Vec<Series>, bool)>,
    /// An SLO target line and its legend.
    target: Option<(f64, String)>,
    /// Draw the offered = goodput diagonal (the goodput chart).
    diagonal: bool,
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel<'_>,
    labels: &[String],
    text: bool,
) -> Result<(), String> {
    let Panel {
        title,
        y_label,
        lines,
        target,
        diagonal,
    } = panel;
    let diagonal = *diagonal;
    let all: Vec<(f64, Option<f64>)> = lines
        .iter()
        .flat_map(|(s, _)| s.iter().flatten().copied())
        .collect();
    let x_max = all.iter().map(|p| p.0).fold(0.0, f64::max).max(1e-3) * 1.05;
    let y_data = all.iter().filter_map(|p| p.1).fold(0.0, f64::max);
    let y_max = y_data
        .max(target.as_ref().map_or(0.0, |t| t.0 * 1.3))
        .max(if diagonal { x_max } else { 0.0 })
        .max(1e-3)
        * 1.1;
    let mut b = ChartBuilder::on(area);
    b.margin(12);
    if text {
        b.caption(*title, ("sans-serif", 20))
            .x_label_area_size(40)
            .y_label_area_size(60);
    } else {
        b.x_label_area_size(12).y_label_area_size(12);
    }
    let mut chart = b
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    let blank = |_: &f64| String::new();
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("offered rate (req/s)")
            .y_desc(*y_label)
            .label_style(("sans-serif", 14));
    } else {
        mesh.x_labels(8)
            .y_labels(8)
            .x_label_formatter(&blank)
            .y_label_formatter(&blank);
    }
    mesh.draw().map_err(|e| e.to_string())?;
    if let Some((t, name)) = target {
        let t = *t;
        let s = chart
            .draw_series(LineSeries::new([(0.0, t), (x_max, t)], RED.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        if text {
            s.label(name.clone())
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED.stroke_width(2)));
        }
    }
    if diagonal {
        let s = chart
            .draw_series(LineSeries::new(
                [(0.0, 0.0), (x_max, x_max)],
                BLACK.mix(0.3),
            ))
            .map_err(|e| e.to_string())?;
        if text {
            s.label("offered = goodput")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.3)));
        }
    }
    for (series, thick) in lines {
        for (i, s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let style = color.stroke_width(if *thick { 3 } else { 1 });
            let finite: Vec<(f64, f64)> =
                s.iter().filter_map(|&(x, y)| y.map(|y| (x, y))).collect();
            let drawn = chart
                .draw_series(LineSeries::new(finite.clone(), style))
                .map_err(|e| e.to_string())?;
            if text {
                let what = match (diagonal, *thick) {
                    (true, _) => "SLO-goodput",
                    (false, true) => "P99",
                    (false, false) => "P50",
                };
                drawn
                    .label(format!("{} {what}", labels[i]))
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
            }
            chart
                .draw_series(
                    finite
                        .iter()
                        .map(|&p| Circle::new(p, if *thick { 4 } else { 2 }, color.filled())),
                )
                .map_err(|e| e.to_string())?;
            chart
                .draw_series(
                    s.iter()
                        .filter(|p| p.1.is_none())
                        .map(|&(x, _)| Cross::new((x, y_max * 0.98), 6, color.stroke_width(2))),
                )
                .map_err(|e| e.to_string())?;
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn draw_all<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    results: &[&SweepResult],
    text: bool,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, 3));
    let labels: Vec<String> = results.iter().map(|r| r.label.clone()).collect();
    let slo = results.first().map(|r| r.slo).unwrap_or_default();
    let p = slo.percentile;
    let panels_spec = [
        Panel {
            title: "Time to first token",
            y_label: "ms",
            lines: vec![
                (pct(results, |s| &s.ttft, false), false),
                (pct(results, |s| &s.ttft, true), true),
            ],
            target: Some((slo.ttft_ms, format!("SLO TTFT P{p}"))),
            diagonal: false,
        },
        Panel {
            title: "Time per output token",
            y_label: "ms",
            lines: vec![
                (pct(results, |s| &s.tpot, false), false),
                (pct(results, |s| &s.tpot, true), true),
            ],
            target: Some((slo.tpot_ms, format!("SLO TPOT P{p}"))),
            diagonal: false,
        },
        Panel {
            title: "SLO-goodput",
            y_label: "req/s",
            lines: vec![(
                results
                    .iter()
                    .map(|r| {
                        r.sorted_points()
                            .iter()
                            .map(|p| (p.rate, Some(p.summary.goodput_rps)))
                            .collect()
                    })
                    .collect(),
                true,
            )],
            target: None,
            diagonal: true,
        },
    ];
    for (area, panel) in panels.iter().zip(&panels_spec) {
        draw_panel(area, panel, &labels, text)?;
    }
    root.present().map_err(|e| e.to_string())
}

/// Writes the plot of `results` to `stem.svg` and `stem.png`; returns both paths.
///
/// # Errors
/// [`BenchError::Plot`] when drawing or writing a file fails.
pub fn plot_sweeps(
    results: &[&SweepResult],
    stem: &Path,
) -> Result<Vec<std::path::PathBuf>, BenchError> {
    let text = font_ready();
    let size = (1500, 480);
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    let err = |p: &Path| {
        let path = p.display().to_string();
        move |msg: String| BenchError::Plot { path, msg }
    };
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_all(&root, results, text).map_err(err(&svg))?;
    }
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_all(&root, results, text).map_err(err(&png))?;
    }
    Ok(vec![svg, png])
}

/// The capacity comparison over time: offered demand and each configuration's live
/// groups (top), and each configuration's SLO-met share per step (bottom).
fn draw_capacity<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    results: &[crate::capacity::RunResult],
    goodput: f64,
    text: bool,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, bottom) = root.split_vertically(root.dim_in_pixel().1 * 3 / 5);
    let minutes = |t: f64| t / 60.0;
    let x_max = results
        .iter()
        .flat_map(|r| r.timeline.last())
        .map(|p| minutes(p.t))
        .fold(1.0, f64::max);
    let y_max = results
        .iter()
        .flat_map(|r| &r.timeline)
        .map(|p| f64::from(p.live_groups).max(p.demand / goodput))
        .fold(1.0, f64::max)
        * 1.15;
    let mut b = ChartBuilder::on(&top);
    b.margin(12);
    if text {
        b.caption("Groups against demand", ("sans-serif", 20))
            .x_label_area_size(36)
            .y_label_area_size(60);
    }
    let mut chart = b
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("minutes")
            .y_desc("groups (demand in groups' goodput)")
            .label_style(("sans-serif", 14));
    }
    mesh.draw().map_err(|e| e.to_string())?;
    if let Some(first) = results.first() {
        let demand = chart
            .draw_series(LineSeries::new(
                first
                    .timeline
                    .iter()
                    .map(|p| (minutes(p.t), p.demand / goodput)),
                BLACK.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
        if text {
            demand
                .label("demand / replicaGoodput")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
        }
    }
    for (i, r) in results.iter().enumerate() {
        let style = COLORS[i % COLORS.len()].stroke_width(2);
        let drawn = chart
            .draw_series(LineSeries::new(
                r.timeline
                    .iter()
                    .map(|p| (minutes(p.t), f64::from(p.live_groups))),
                style,
            ))
            .map_err(|e| e.to_string())?;
        if text {
            drawn
                .label(format!("{} (live groups)", r.name))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    let mut b = ChartBuilder::on(&bottom);
    b.margin(12);
    if text {
        b.caption("Share of requests meeting the SLO", ("sans-serif", 20))
            .x_label_area_size(36)
            .y_label_area_size(60);
    }
    let mut chart = b
        .build_cartesian_2d(0.0..x_max, 0.0..1.05)
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("minutes")
            .y_desc("SLO met")
            .label_style(("sans-serif", 14));
    }
    mesh.draw().map_err(|e| e.to_string())?;
    for (i, r) in results.iter().enumerate() {
        chart
            .draw_series(LineSeries::new(
                r.timeline.iter().map(|p| (minutes(p.t), p.slo_met)),
                COLORS[i % COLORS.len()].stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

/// Writes the capacity comparison to `stem.svg` and `stem.png`; returns both paths.
///
/// # Errors
/// [`BenchError::Plot`] when drawing or writing a file fails.
pub fn plot_capacity(
    results: &[crate::capacity::RunResult],
    goodput: f64,
    stem: &Path,
) -> Result<Vec<std::path::PathBuf>, BenchError> {
    let text = font_ready();
    let size = (1200, 800);
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    let err = |p: &Path| {
        let path = p.display().to_string();
        move |msg: String| BenchError::Plot { path, msg }
    };
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_capacity(&root, results, goodput, text).map_err(err(&svg))?;
    }
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_capacity(&root, results, goodput, text).map_err(err(&png))?;
    }
    Ok(vec![svg, png])
}
