//! What a run reports: the figures `multirail bench` prints (GB/s, bytes per rail, latency
//! percentiles per class), plus the timeline, adaptation after link changes, and the
//! simulator's own cost.

use std::fmt::Write;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::scenario::{LinkEvent, Run};

/// Latency percentiles, microseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl Percentiles {
    /// The percentiles of `h` (ns samples), in µs.
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
        Percentiles {
            p50: us(0.5),
            p99: us(0.99),
            p999: us(0.999),
        }
    }
}

/// One rail's share.
#[derive(Debug, Clone, Serialize)]
pub struct RailReport {
    /// Rail name.
    pub name: String,
    /// Bytes answered on it.
    pub bytes: u64,
    /// Its average rate, GB/s.
    pub gb_per_s: f64,
}

/// One workload's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ClassReport {
    /// Workload name.
    pub workload: String,
    /// Its priority.
    pub priority: String,
    /// Requests finished.
    pub requests: u64,
    /// Requests that finished with a failed part.
    pub failed: u64,
    /// Its rate, GB/s.
    pub gb_per_s: f64,
    /// Batch latency (closed loop) or request latency (open loop).
    pub latency_us: Percentiles,
}

/// Throughput in one sample window.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// End of the window, ms.
    pub t_ms: u64,
    /// Per rail, GB/s.
    pub rails_gb_per_s: Vec<f64>,
    /// All rails, GB/s.
    pub gb_per_s: f64,
}

/// How throughput recovered after a link change.
#[derive(Debug, Clone, Serialize)]
pub struct Adaptation {
    /// What changed.
    pub event: String,
    /// When, ms.
    pub at_ms: u64,
    /// Line rate of all rails after the change, GB/s.
    pub new_line_rate_gb_per_s: f64,
    /// Time from the change to the end of the first sample window from which throughput stays
    /// at or above 0.85 × the new line rate (the criterion `bench/rails` applies to its
    /// intervals), ms; so at best one sample window. `None` if it never did.
    pub recovered_ms: Option<u64>,
}

impl Adaptation {
    /// Measures recovery after `event` on `timeline`.
    pub fn measure(run: &Run, event: &LinkEvent, timeline: &[Sample]) -> Adaptation {
        let mut rates: Vec<f64> = run
            .rails
            .iter()
            .map(|r| r.gbps * r.efficiency / 8.0)
            .collect();
        for e in run.events.iter().filter(|e| e.at_ms <= event.at_ms) {
            match e.action.as_str() {
                "rate" => rates[e.rail] = e.gbps * run.rails[e.rail].efficiency / 8.0,
                "fail" => rates[e.rail] = 0.0,
                _ => {}
            }
        }
        let line: f64 = rates.iter().sum();
        let target = 0.85 * line;
        let after: Vec<&Sample> = timeline.iter().filter(|s| s.t_ms > event.at_ms).collect();
        // The last window may be cut short by the end of the run: do not judge by it.
        let judged = after.len().saturating_sub(1).max(1).min(after.len());
        let recovered = (0..judged)
            .find(|&i| after[i..judged].iter().all(|s| s.gb_per_s >= target))
            .map(|i| after[i].t_ms - event.at_ms);
        Adaptation {
            event: format!(
                "rail {} {} {}",
                event.rail,
                event.action,
                if event.action == "rate" {
                    format!("{} Gbps", event.gbps)
                } else {
                    String::new()
                }
            )
            .trim()
            .to_owned(),
            at_ms: event.at_ms,
            new_line_rate_gb_per_s: line,
            recovered_ms: recovered,
        }
    }
}

/// The report of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Scenario/run name.
    pub name: String,
    /// What it shows.
    pub description: String,
    /// Simulated time, ms.
    pub simulated_ms: u64,
    /// Wall-clock time the simulation took, ms.
    pub wall_ms: f64,
    /// Smart (EWMA) or round-robin selection.
    pub smart: bool,
    /// Sum of the rails' line rates at the start, GB/s of payload.
    pub line_rate_gb_per_s: f64,
    /// Bytes answered per second of simulated time, GB/s.
    pub gb_per_s: f64,
    /// Slices answered.
    pub slices: u64,
    /// Slices handed back by lost connections (and retried or failed).
    pub retried: u64,
    /// Probes of paused rails.
    pub probes: u64,
    /// Times a rail was paused.
    pub rails_paused: u64,
    /// Requests neither completed nor failed at the end (still in flight).
    pub unfinished_requests: u64,
    /// Per rail.
    pub rails: Vec<RailReport>,
    /// Per workload.
    pub classes: Vec<ClassReport>,
    /// Recovery after each rate change or failure.
    pub adaptation: Vec<Adaptation>,
    /// Throughput per sample window.
    pub timeline: Vec<Sample>,
    /// NUMA node of each rail.
    pub nic_numa: Vec<i32>,
}

impl Report {
    /// The human table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} ({} mode): {:.3} GB/s = {:.3} x line rate {:.3} GB/s over {} ms simulated ({} slices, {:.0} ms wall)",
            self.name,
            if self.smart { "smart" } else { "round-robin" },
            self.gb_per_s,
            self.gb_per_s / self.line_rate_gb_per_s,
            self.line_rate_gb_per_s,
            self.simulated_ms,
            self.slices,
            self.wall_ms
        );
        for r in &self.rails {
            let _ = writeln!(
                out,
                "  rail {:<12} {:>16} bytes {:>9.3} GB/s",
                r.name, r.bytes, r.gb_per_s
            );
        }
        for c in &self.classes {
            let _ = writeln!(
                out,
                "  {:<14} {:<6} {:>8} requests ({} failed) {:>9.3} GB/s  latency p50 {:.1} us  p99 {:.1} us  p999 {:.1} us",
                c.workload, c.priority, c.requests, c.failed, c.gb_per_s, c.latency_us.p50, c.latency_us.p99, c.latency_us.p999
            );
        }
        for a in &self.adaptation {
            let _ = writeln!(
                out,
                "  {} at {} ms: new line rate {:.3} GB/s; back above 0.85 x it after {}",
                a.event,
                a.at_ms,
                a.new_line_rate_gb_per_s,
                a.recovered_ms
                    .map_or("never".to_owned(), |ms| format!("{ms} ms"))
            );
        }
        if self.retried > 0 || self.rails_paused > 0 || self.probes > 0 {
            let _ = writeln!(
                out,
                "  slices handed back {}, rails paused {}, probes {}",
                self.retried, self.rails_paused, self.probes
            );
        }
        if self.unfinished_requests > 0 {
            let _ = writeln!(
                out,
                "  requests still in flight at the end: {}",
                self.unfinished_requests
            );
        }
        out
    }
}

/// Where charts look for a TrueType font (plotters draws text with one it is given).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers the first font of [`FONTS`] found as plotters' `sans-serif`, once per process.
/// Fails naming the paths looked at when none is there (Debian: `fonts-dejavu-core`).
pub fn register_font() -> Result<(), String> {
    use plotters::style::{register_font, FontStyle};
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = FONTS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| format!("no TrueType font found (looked for {})", FONTS.join(", ")))?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the font file does not parse".to_string())
    })
    .clone()
}

/// Draws throughput per rail over time, one panel per report, into a PNG at `path`. Fails with
/// the drawing backend's message, or when no font is found.
pub fn plot(reports: &[Report], path: &std::path::Path) -> Result<(), String> {
    use plotters::prelude::*;
    register_font()?;
    let height = 300 * reports.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((reports.len().max(1), 1));
    for (report, area) in reports.iter().zip(panels.iter()) {
        let max_t = report.timeline.last().map_or(1, |s| s.t_ms) as f64;
        let max_y = report
            .timeline
            .iter()
            .flat_map(|s| s.rails_gb_per_s.iter().copied())
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(&report.name, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..max_t, 0f64..max_y)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("simulated ms")
            .y_desc("GB/s")
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, rail) in report.rails.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    report
                        .timeline
                        .iter()
                        .map(|s| (s.t_ms as f64, s.rails_gb_per_s[i])),
                    color,
                ))
                .map_err(|e| e.to_string())?
                .label(rail.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}
