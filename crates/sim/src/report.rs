//! What a run reports: the figures `multirail bench` prints (GB/s, bytes per rail, latency
//! percentiles per class), plus the timeline, adaptation after link changes, and the
//! simulator's own cost.

use std::fmt::Write;

use hdrhistogram::Histogram;
use multirail_policy::lanes::LanesStats;
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
    /// The selector's bandwidth estimate of it at the end of the run, GB/s: what the policy
    /// learned the rail carries.
    pub estimate_gb_per_s: f64,
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

/// What the lane machines did in one window of simulated time, summed over every process.
/// Every exchange counts once at each end where it counts: a pair going dedicated is two
/// promotions (and two switches), one at each end.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LanesSample {
    /// End of the window, ms.
    pub t_ms: u64,
    /// `Promote`s sent.
    pub requests: u64,
    /// `Accept`s sent.
    pub accepts: u64,
    /// `Deny`s sent.
    pub denials: u64,
    /// `Demote`s sent.
    pub demotes: u64,
    /// Dedicated peers demoted to make room for a stronger request.
    pub evictions: u64,
    /// Requests dropped unanswered.
    pub timeouts: u64,
    /// Dedicated peers demoted because their requester's score cooled.
    pub cooled: u64,
    /// `Score`s sent.
    pub scores: u64,
    /// Lane changes to dedicated.
    pub promotions: u64,
    /// Lane changes to shared.
    pub demotions: u64,
    /// `promotions + demotions`.
    pub switches: u64,
    /// Promotions by the usage trackers (`UsageEvent::Promoted`).
    pub tracker_promotions: u64,
    /// Demotions by the usage trackers.
    pub tracker_demotions: u64,
    /// Dedicated lanes held at the end of the window, summed over every lane machine (twice
    /// the dedicated lanes when both ends agree).
    pub dedicated: u64,
    /// Most dedicated lanes one lane machine held during the window.
    pub max_dedicated: u64,
}

/// One mbw_mr receiver at the end of the run.
#[derive(Debug, Clone, Serialize)]
pub struct ReceiverReport {
    /// Its process id.
    pub node: u64,
    /// The hot senders that send to it.
    pub hot: Vec<u64>,
    /// The peers it holds a dedicated lane with at the end, ascending.
    pub dedicated: Vec<u64>,
    /// How many of `dedicated` are its hot senders.
    pub hot_dedicated: usize,
    /// How many of `dedicated` are not.
    pub cold_dedicated: usize,
    /// First time every one of its hot senders held a dedicated lane with it, ms.
    pub all_hot_at_ms: Option<f64>,
    /// When its dedicated set last changed, ms (`None`: never).
    pub last_switch_ms: Option<f64>,
    /// Since when its dedicated set has been exactly its hot senders, ms (`None` if it is
    /// not at the end).
    pub hot_set_since_ms: Option<f64>,
    /// First time a cold sender held a dedicated lane with it, ms (`None`: never).
    pub cold_first_at_ms: Option<f64>,
    /// Lanes it granted to cold senders over the run.
    pub cold_granted: u64,
    /// Lanes its hot senders lost (evicted or demoted) after all of them first held one.
    pub hot_lost: u64,
    /// The lanes of its answers (its requesting machine's) dedicated at the end, ascending.
    pub replies_dedicated: Vec<u64>,
    /// Lane changes of its answers' lanes over the run.
    pub replies_switches: u64,
    /// Of those, demotions because its own score for the peer fell below the cooling line.
    pub replies_cooled: u64,
}

/// How many dedicated lanes the processes hold at the end.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct DedicatedSpread {
    /// Fewest of one process.
    pub min: usize,
    /// Mean.
    pub mean: f64,
    /// Most of one process.
    pub max: usize,
}

/// The report of a lanes scenario.
#[derive(Debug, Clone, Serialize)]
pub struct LanesReport {
    /// `mbw_mr` or `alltoall`.
    pub workload: String,
    /// Processes.
    pub peers: usize,
    /// The bound on dedicated lanes per lane machine (each process has a requesting and a
    /// granting one).
    pub max_dedicated: usize,
    /// Whose score a process keeps for peers it accepted.
    pub receiver_view: String,
    /// Application messages sent.
    pub messages: u64,
    /// Sends reported to the trackers (`on_sample` calls).
    pub samples: u64,
    /// Tracker progress runs, all processes: on the send path and by the driver.
    pub progress_runs: u64,
    /// Of `progress_runs`, those the driver ran because the tracker was idle.
    pub idle_progress_runs: u64,
    /// Whether the driver ran idle progress (the scenario's `idle_progress`).
    pub idle_progress: bool,
    /// The driver's period, ms.
    pub drive_every_ms: f64,
    /// Lane messages delivered.
    pub lane_messages: u64,
    /// Lane messages still in flight at the end.
    pub lane_messages_in_flight: u64,
    /// Promotions by the usage trackers.
    pub tracker_promotions: u64,
    /// Demotions by the usage trackers.
    pub tracker_demotions: u64,
    /// `Lanes::stats()` summed over every process.
    pub totals: LanesStats,
    /// Per window of `sample_ms`.
    pub timeline: Vec<LanesSample>,
    /// Lane changes after half the simulated time, all processes.
    pub switches_second_half: u64,
    /// Last lane change anywhere, ms.
    pub last_switch_ms: Option<f64>,
    /// Most dedicated lanes one lane machine (a process's requesting or granting one) held at
    /// any time.
    pub max_dedicated_seen: usize,
    /// Lanes (one per direction of a pair: sender to receiver) dedicated at both ends at the
    /// end.
    pub dedicated_pairs: usize,
    /// Lanes dedicated at one end only at the end (a message still in flight, or a fault).
    pub one_sided: usize,
    /// Dedicated lanes per process at the end.
    pub dedicated_per_process: DedicatedSpread,
    /// mbw_mr: each receiver's view at the end.
    pub receivers: Vec<ReceiverReport>,
}

impl LanesReport {
    /// The human table: the counters in windows (at most about 25 rows), the totals, who is
    /// dedicated at the end.
    pub fn table(&self, out: &mut String) {
        let ms = |v: Option<f64>| v.map_or("never".to_owned(), |t| format!("{t:.1} ms"));
        let _ = writeln!(
            out,
            "  {} over {} processes, at most {} dedicated lanes each, receiver view {}, a driver pass every {} ms, idle progress {}: {} messages, {} sampled, {} tracker progress runs ({} idle), {} lane messages ({} in flight at the end)",
            self.workload,
            self.peers,
            self.max_dedicated,
            self.receiver_view,
            self.drive_every_ms,
            if self.idle_progress { "on" } else { "off" },
            self.messages,
            self.samples,
            self.progress_runs,
            self.idle_progress_runs,
            self.lane_messages,
            self.lane_messages_in_flight,
        );
        let per_row = self.timeline.len().div_ceil(25).max(1);
        let _ = writeln!(
            out,
            "  {:>10} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>7} {:>7} {:>10} {:>10} {:>9} {:>10} {:>10} {:>9}",
            "until ms",
            "requests",
            "accepts",
            "denials",
            "demotes",
            "evictions",
            "timeouts",
            "cooled",
            "scores",
            "promotions",
            "demotions",
            "switches",
            "trk promo",
            "trk demo",
            "dedicated"
        );
        for rows in self.timeline.chunks(per_row) {
            let sum = |f: fn(&LanesSample) -> u64| rows.iter().map(f).sum::<u64>();
            let last = rows.last().expect("chunks are not empty");
            let _ = writeln!(
                out,
                "  {:>10} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>7} {:>7} {:>10} {:>10} {:>9} {:>10} {:>10} {:>9}",
                last.t_ms,
                sum(|s| s.requests),
                sum(|s| s.accepts),
                sum(|s| s.denials),
                sum(|s| s.demotes),
                sum(|s| s.evictions),
                sum(|s| s.timeouts),
                sum(|s| s.cooled),
                sum(|s| s.scores),
                sum(|s| s.promotions),
                sum(|s| s.demotions),
                sum(|s| s.switches),
                sum(|s| s.tracker_promotions),
                sum(|s| s.tracker_demotions),
                last.dedicated,
            );
        }
        let t = &self.totals;
        let _ = writeln!(
            out,
            "  totals: requests {} accepts {}/{} (sent/received) denials {}/{} demotes {}/{} evictions {} cooled {} scores {}/{} timeouts {} collisions {} undone {} promotions {} demotions {} switches {}",
            t.requests_sent,
            t.accepts_sent,
            t.accepts_received,
            t.denials_sent,
            t.denials_received,
            t.demotes_sent,
            t.demotes_received,
            t.evictions,
            t.cooled,
            t.scores_sent,
            t.scores_received,
            t.timeouts,
            t.collisions,
            t.undone,
            t.promotions,
            t.demotions,
            t.switches,
        );
        let d = &self.dedicated_per_process;
        let _ = writeln!(
            out,
            "  at the end: {} dedicated pairs, {} one-sided; per process min {} mean {:.2} max {}; most ever held by one process {}; last switch {}; switches in the second half {}",
            self.dedicated_pairs,
            self.one_sided,
            d.min,
            d.mean,
            d.max,
            self.max_dedicated_seen,
            ms(self.last_switch_ms),
            self.switches_second_half,
        );
        for r in &self.receivers {
            let _ = writeln!(
                out,
                "  receiver {}: dedicated {:?} ({} hot of {}, {} cold); all hot dedicated at {}; exactly the hot set since {}; last switch {}; hot lanes lost since {}; {} lanes granted to cold senders, the first at {}",
                r.node,
                r.dedicated,
                r.hot_dedicated,
                r.hot.len(),
                r.cold_dedicated,
                ms(r.all_hot_at_ms),
                ms(r.hot_set_since_ms),
                ms(r.last_switch_ms),
                r.hot_lost,
                r.cold_granted,
                ms(r.cold_first_at_ms),
            );
            let _ = writeln!(
                out,
                "  receiver {}'s answers: dedicated {:?}; {} switches, {} cooled",
                r.node, r.replies_dedicated, r.replies_switches, r.replies_cooled,
            );
        }
    }
}

/// The report of one run. A lanes run fills `lanes` and leaves the rail figures empty, but for
/// `gb_per_s`, which is then the payload rate of its application messages.
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
    /// What the lane machines did, for a lanes scenario.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lanes: Option<LanesReport>,
    /// What the group did, for a multicast scenario.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multicast: Option<MulticastReport>,
}

/// A multicast scenario's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct MulticastReport {
    /// The batching mode, as the scenario spells it.
    pub batching: String,
    /// Group members.
    pub members: u64,
    /// Members sending.
    pub senders: u64,
    /// Payload of each message, bytes.
    pub message_bytes: u64,
    /// Messages delivered at every member.
    pub multicasts: u64,
    /// Of them, per second of simulated time.
    pub multicasts_per_sec: f64,
    /// One-sided writes per multicast carrying slots.
    pub data_writes_per_multicast: f64,
    /// One-sided writes per multicast carrying a sender's committed count.
    pub counter_writes_per_multicast: f64,
    /// One-sided writes per multicast carrying a member's received count.
    pub ack_writes_per_multicast: f64,
    /// Share of the NIC's write rate used.
    pub ops_utilization: f64,
    /// Share of the NIC's line rate used by payload.
    pub bandwidth_utilization: f64,
    /// What bounds the rate: `operations` or `bandwidth` (whichever is nearer full).
    pub bound: String,
}

impl MulticastReport {
    /// The human lines.
    pub fn table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "  {} members, {} sender(s), {} B messages, batching {}: {:.2} M multicasts/s; one-sided writes per multicast {:.3} (data {:.3}, counters {:.3}, acknowledgements {:.3}); NIC operations {:.0} %, bandwidth {:.0} %, bound by {}",
            self.members,
            self.senders,
            self.message_bytes,
            self.batching,
            self.multicasts_per_sec / 1e6,
            self.data_writes_per_multicast + self.counter_writes_per_multicast + self.ack_writes_per_multicast,
            self.data_writes_per_multicast,
            self.counter_writes_per_multicast,
            self.ack_writes_per_multicast,
            self.ops_utilization * 100.0,
            self.bandwidth_utilization * 100.0,
            self.bound,
        );
    }
}

impl Report {
    /// The report of a scenario that models no rails (lanes, multicast): `run`'s name,
    /// description and duration, `gb_per_s` of payload against a line rate of
    /// `line_rate_gb_per_s` (0 when none applies), and nothing of rails, requests or slices;
    /// the caller fills in its own section.
    pub(crate) fn without_rails(
        run: &crate::scenario::Run,
        wall: std::time::Duration,
        gb_per_s: f64,
        line_rate_gb_per_s: f64,
    ) -> Report {
        Report {
            name: run.name.clone(),
            description: run.description.clone(),
            simulated_ms: run.duration_ms,
            wall_ms: wall.as_secs_f64() * 1e3,
            smart: false,
            line_rate_gb_per_s,
            gb_per_s,
            slices: 0,
            retried: 0,
            probes: 0,
            rails_paused: 0,
            unfinished_requests: 0,
            rails: Vec::new(),
            classes: Vec::new(),
            adaptation: Vec::new(),
            timeline: Vec::new(),
            nic_numa: Vec::new(),
            lanes: None,
            multicast: None,
        }
    }

    /// The human table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        if let Some(mc) = &self.multicast {
            let _ = writeln!(
                out,
                "{} (multicast): {} ms simulated, {:.0} ms wall",
                self.name, self.simulated_ms, self.wall_ms
            );
            mc.table(&mut out);
            return out;
        }
        if let Some(lanes) = &self.lanes {
            let _ = writeln!(
                out,
                "{} (lanes): {} ms simulated, {:.0} ms wall",
                self.name, self.simulated_ms, self.wall_ms
            );
            lanes.table(&mut out);
            return out;
        }
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
                "  rail {:<12} {:>16} bytes {:>9.3} GB/s  estimate {:.3} GB/s",
                r.name, r.bytes, r.gb_per_s, r.estimate_gb_per_s
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

/// Draws a lanes report's counters per window: requests, denials and switches.
fn plot_lanes<DB: plotters::prelude::DrawingBackend>(
    name: &str,
    lanes: &LanesReport,
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String> {
    use plotters::prelude::*;
    let t = &lanes.timeline;
    let max_t = t.last().map_or(1, |s| s.t_ms) as f64;
    type Counter = fn(&LanesSample) -> u64;
    let series: [(&str, Counter); 3] = [
        ("requests", |s| s.requests),
        ("denials", |s| s.denials),
        ("switches", |s| s.switches),
    ];
    let max_y = t
        .iter()
        .flat_map(|s| series.iter().map(move |(_, f)| f(s)))
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(name, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max_t, 0f64..max_y)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("simulated ms")
        .y_desc("per window, all processes")
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (label, f)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                t.iter().map(|s| (s.t_ms as f64, f(s) as f64)),
                color,
            ))
            .map_err(|e| e.to_string())?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// Draws throughput per rail over time (for a lanes report: requests, denials and switches per
/// window), one panel per report, into a PNG at `path`. Fails with
/// the drawing backend's message, or when no font is found.
pub fn plot(reports: &[Report], path: &std::path::Path) -> Result<(), String> {
    use plotters::prelude::*;
    register_font()?;
    let height = 300 * reports.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((reports.len().max(1), 1));
    for (report, area) in reports.iter().zip(panels.iter()) {
        if let Some(lanes) = &report.lanes {
            plot_lanes(&report.name, lanes, area)?;
            continue;
        }
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
