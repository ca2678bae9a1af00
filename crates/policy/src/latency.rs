//! Latency-trace analysis: perftest's summary columns and a finder for periodic patterns.
//!
//! A trace is the round-trip time of every iteration of a ping-pong, in nanoseconds. The
//! summary reports one-way latency (round trip / 2) in microseconds, as perftest does. The
//! pattern finder looks for periods `p` (2..=1024, at least [`MIN_CYCLES`] cycles in the trace)
//! whose phases (`i mod p`) have means that differ from the rest by far more than noise
//! explains, and describes them the way RAMCloud's InfRc ping-pong study does: "every 31st and
//! 32nd round trip is 4.4 µs; others 3.15 µs (period 32)".
//!
//! Method, per round: clip the trace at its 99.9th percentile (one stray millisecond must not
//! look like a slow phase); for every period compute each phase's mean and the pooled
//! within-phase standard deviation (one-way ANOVA); a phase is significant when its mean lies
//! more than [`Z_THRESHOLD`] standard errors and [`MIN_RELATIVE_EFFECT`] of the median away
//! from the trace mean. A period's weight is the variance its significant phases explain.
//! The pick is the smallest period explaining at least 95 % of the best weight (multiples of a
//! period explain as much as it does), lowered to its smallest divisor explaining at least
//! 65 % (a nested pattern: 32 inside 128). The pick's phase offsets are subtracted and the
//! search runs again, up to [`MAX_PATTERNS`] times, which finds nested periods.

/// Longest period searched.
pub const MAX_PERIOD: usize = 1024;
/// A period needs at least this many full cycles in the trace to be considered.
pub const MIN_CYCLES: usize = 8;
/// Standard errors a phase mean must lie from the trace mean. Up to ~525,000 phases are tested
/// per round; at 6 the chance of one false phase in pure Gaussian noise is about 1 in 1000.
pub const Z_THRESHOLD: f64 = 6.0;
/// A phase must also differ from the mean by this fraction of the median round trip.
pub const MIN_RELATIVE_EFFECT: f64 = 0.03;
/// Most patterns reported.
pub const MAX_PATTERNS: usize = 4;
/// Iterations analysed for patterns (the first ones); the summary uses every iteration.
pub const MAX_ANALYSED: usize = 200_000;

/// perftest's columns, one-way latency in microseconds (round trip / 2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Round trips measured.
    pub iterations: usize,
    /// Smallest one-way latency.
    pub t_min: f64,
    /// Largest one-way latency.
    pub t_max: f64,
    /// Median (perftest's t_typical).
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// Standard deviation.
    pub t_stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl Summary {
    /// Summarises round trips given in nanoseconds; `None` for an empty trace.
    pub fn from_round_trips(rtt_ns: &[u64]) -> Option<Summary> {
        if rtt_ns.is_empty() {
            return None;
        }
        let mut sorted: Vec<u64> = rtt_ns.to_vec();
        sorted.sort_unstable();
        let us = |ns: f64| ns / 2.0 / 1000.0;
        let n = sorted.len() as f64;
        let mean = sorted.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = sorted
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        Some(Summary {
            iterations: sorted.len(),
            t_min: us(sorted[0] as f64),
            t_max: us(sorted[sorted.len() - 1] as f64),
            t_typical: us(median_sorted(&sorted)),
            t_avg: us(mean),
            t_stdev: us(var.sqrt()),
            p99: us(percentile_sorted(&sorted, 99.0) as f64),
            p999: us(percentile_sorted(&sorted, 99.9) as f64),
        })
    }
}

/// Nearest-rank percentile `q` (0..=100) of sorted values; 0 for an empty slice.
pub fn percentile_sorted(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median of sorted values (mean of the middle two for an even count); 0 when empty.
pub fn median_sorted(sorted: &[u64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2] as f64,
        _ => (sorted[n / 2 - 1] as f64 + sorted[n / 2] as f64) / 2.0,
    }
}

/// Phases of one period that share a level.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseGroup {
    /// 1-based positions in the cycle: 31 and 32 mean "every 31st and 32nd round trip".
    pub phases: Vec<usize>,
    /// Length of the cycle the positions count in: the pattern's period or a divisor of it
    /// (in period 128, "every 31st and 32nd" of each 32).
    pub cycle: usize,
    /// Mean round trip of these phases in the trace, in nanoseconds.
    pub level_ns: f64,
}

/// One periodic pattern.
#[derive(Debug, Clone, PartialEq)]
pub struct Pattern {
    /// Cycle length in iterations.
    pub period: usize,
    /// Phases that stand out, grouped by level, slowest first.
    pub groups: Vec<PhaseGroup>,
}

/// What the finder found.
#[derive(Debug, Clone, PartialEq)]
pub struct PatternReport {
    /// Patterns in the order found (strongest first).
    pub patterns: Vec<Pattern>,
    /// Median round trip of the iterations in no reported phase, in nanoseconds.
    pub others_ns: f64,
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

fn join_words(items: &[String]) -> String {
    match items.len() {
        0 => String::new(),
        1 => items[0].clone(),
        n => format!("{} and {}", items[..n - 1].join(", "), items[n - 1]),
    }
}

/// Microseconds with two decimals below 10 µs, one above.
pub fn format_us(ns: f64) -> String {
    let us = ns / 1000.0;
    if us < 10.0 {
        format!("{us:.2} µs")
    } else {
        format!("{us:.1} µs")
    }
}

impl PatternReport {
    /// The findings in words, one pattern per line, or "no periodic pattern".
    pub fn describe(&self) -> String {
        if self.patterns.is_empty() {
            return "no periodic pattern".into();
        }
        let mut lines = Vec::new();
        for p in &self.patterns {
            let parts: Vec<String> = p
                .groups
                .iter()
                .map(|g| {
                    let mut phases: Vec<String> = g.phases.iter().map(|&k| ordinal(k)).collect();
                    if phases.len() > 8 {
                        let more = phases.len() - 6;
                        phases.truncate(6);
                        phases.push(format!("{more} more"));
                    }
                    // Positions in a shorter cycle than the period say which cycle.
                    let of = if g.cycle == p.period {
                        "round trip".to_string()
                    } else {
                        format!("of each {} round trips", g.cycle)
                    };
                    format!(
                        "every {} {of} is {}",
                        join_words(&phases),
                        format_us(g.level_ns)
                    )
                })
                .collect();
            lines.push(format!(
                "{}; others {} (period {})",
                parts.join("; "),
                format_us(self.others_ns),
                p.period
            ));
        }
        lines.join("\n")
    }
}

/// Per-period statistics of one round.
struct PeriodFit {
    period: usize,
    /// Mean per phase.
    means: Vec<f64>,
    /// Level of the ordinary phases (median phase mean).
    base: f64,
    /// Significant phases (0-based) and their deviation from `base`.
    significant: Vec<(usize, f64)>,
    /// Variance explained by the significant phases (sum of count × deviation²).
    weight: f64,
}

/// Family-wise chance of a false phase per round, split over every phase tested.
const FALSE_PHASE_CHANCE: f64 = 1e-3;

/// The distribution-free test a phase's median must pass, per phase size `m`: under no
/// pattern the samples of a phase are draws from the whole trace, so its median lies above
/// the trace's `(1 - q)` quantile only if half its samples do, with binomial probability. `q`
/// is the largest tail share keeping that probability below `alpha`. Exact for small `m`
/// (where a normal approximation of a skewed trace's median gives false phases), normal above.
struct MedianTest {
    alpha: f64,
    q: std::collections::HashMap<usize, f64>,
}

impl MedianTest {
    fn new(phases_tested: usize) -> Self {
        MedianTest {
            alpha: FALSE_PHASE_CHANCE / phases_tested.max(1) as f64,
            q: std::collections::HashMap::new(),
        }
    }

    /// P(Binomial(m, q) >= k).
    fn tail(m: usize, k: usize, q: f64) -> f64 {
        let (lq, lp) = (q.ln(), (1.0 - q).ln());
        let mut log_c = 0.0; // ln C(m, j), built up from j = 0
        let mut total = 0.0;
        for j in 0..=m {
            if j > 0 {
                log_c += ((m - j + 1) as f64).ln() - (j as f64).ln();
            }
            if j >= k {
                total += (log_c + j as f64 * lq + (m - j) as f64 * lp).exp();
            }
        }
        total
    }

    fn q(&mut self, m: usize) -> f64 {
        let alpha = self.alpha;
        *self.q.entry(m).or_insert_with(|| {
            let k = m - m / 2;
            if m > 400 {
                // Normal approximation; z for alpha by bisection on the Gaussian tail bound.
                let z = (2.0 * (1.0 / alpha).ln()).sqrt();
                return (0.5 - z * 0.5 / (m as f64).sqrt()).max(1e-6);
            }
            let (mut lo, mut hi) = (0.0f64, 0.5f64);
            for _ in 0..50 {
                let mid = (lo + hi) / 2.0;
                if Self::tail(m, k, mid) < alpha {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            lo
        })
    }
}

/// `sorted`: the current trace sorted, whose quantiles a phase's median is compared with.
fn fit(
    x: &[f64],
    period: usize,
    sorted: &[f64],
    test: &mut MedianTest,
    floor: f64,
    scratch: &mut Vec<f64>,
) -> PeriodFit {
    let mut sum = vec![0.0f64; period];
    let mut sum2 = vec![0.0f64; period];
    let mut count = vec![0usize; period];
    for (i, &v) in x.iter().enumerate() {
        let k = i % period;
        sum[k] += v;
        sum2[k] += v * v;
        count[k] += 1;
    }
    let mut within = 0.0;
    let mut means = vec![0.0; period];
    for k in 0..period {
        let c = count[k] as f64;
        means[k] = sum[k] / c;
        within += (sum2[k] - sum[k] * sum[k] / c).max(0.0);
    }
    let dof = (x.len() - period).max(1) as f64;
    let sigma = (within / dof).sqrt();
    // The level of the ordinary phases: the median phase mean (slow phases are a minority).
    scratch.clear();
    scratch.extend_from_slice(&means);
    let mid = scratch.len() / 2;
    let (_, base, _) = scratch.select_nth_unstable_by(mid, f64::total_cmp);
    let base = *base;
    let mut significant = Vec::new();
    let mut weight = 0.0;
    for k in 0..period {
        let dev = means[k] - base;
        let se = sigma / (count[k] as f64).sqrt();
        if dev.abs() <= Z_THRESHOLD * se || dev.abs() < floor {
            continue;
        }
        // A few stray samples move a mean; a real phase moves its median too.
        scratch.clear();
        scratch.extend(x.iter().skip(k).step_by(period));
        let mid = scratch.len() / 2;
        let (_, med, _) = scratch.select_nth_unstable_by(mid, f64::total_cmp);
        let med = *med;
        let q = test.q(count[k] as usize);
        let n = sorted.len();
        let beyond = if dev > 0.0 {
            med > sorted[(((1.0 - q) * n as f64) as usize).min(n - 1)]
        } else {
            med < sorted[((q * n as f64) as usize).min(n - 1)]
        };
        if !beyond {
            continue;
        }
        significant.push((k, dev));
        weight += count[k] as f64 * dev * dev;
    }
    PeriodFit {
        period,
        means,
        base,
        significant,
        weight,
    }
}

/// Looks for periodic patterns in a trace of round trips (nanoseconds).
pub fn find_patterns(rtt_ns: &[u64]) -> PatternReport {
    let trace = &rtt_ns[..rtt_ns.len().min(MAX_ANALYSED)];
    let mut sorted = trace.to_vec();
    sorted.sort_unstable();
    let median = median_sorted(&sorted);
    let clip = percentile_sorted(&sorted, 99.9) as f64;
    let original: Vec<f64> = trace.iter().map(|&v| (v as f64).min(clip)).collect();
    let mut x = original.clone();
    let max_period = MAX_PERIOD.min(trace.len() / MIN_CYCLES);
    let floor = MIN_RELATIVE_EFFECT * median;
    let mut patterns: Vec<Pattern> = Vec::new();
    // Iterations in a reported phase, for the "others" level.
    let mut marked = vec![false; trace.len()];
    for _round in 0..MAX_PATTERNS {
        if max_period < 2 {
            break;
        }
        let mut scratch = Vec::new();
        let mut sorted_x = x.clone();
        sorted_x.sort_unstable_by(f64::total_cmp);
        let mut test = MedianTest::new((2..=max_period).sum());
        let fits: Vec<PeriodFit> = (2..=max_period)
            .map(|p| fit(&x, p, &sorted_x, &mut test, floor, &mut scratch))
            .collect();
        let best = fits.iter().map(|f| f.weight).fold(0.0, f64::max);
        if best <= 0.0 {
            break;
        }
        let pick = fits
            .iter()
            .find(|f| f.weight >= 0.95 * best)
            .expect("the best fit qualifies");
        // Report the strong phases; weak ones in later rounds are estimation leftovers.
        let strongest = pick
            .significant
            .iter()
            .map(|s| s.1.abs())
            .fold(0.0, f64::max);
        let keep: Vec<usize> = pick
            .significant
            .iter()
            .filter(|s| patterns.is_empty() || s.1.abs() >= 0.5 * strongest)
            .map(|s| s.0)
            .collect();
        // Levels as in the (clipped) trace, not the residual.
        let p = pick.period;
        let mut levels: Vec<(usize, f64)> = keep
            .iter()
            .map(|&k| {
                let vals: Vec<f64> = original.iter().skip(k).step_by(p).copied().collect();
                (k, vals.iter().sum::<f64>() / vals.len() as f64)
            })
            .collect();
        for &k in &keep {
            for i in (k..trace.len()).step_by(p) {
                marked[i] = true;
            }
        }
        // Subtract the pick's pattern and look again.
        for &(k, _) in &pick.significant {
            let shift = pick.means[k] - pick.base;
            for i in (k..x.len()).step_by(p) {
                x[i] -= shift;
            }
        }
        if keep.is_empty() {
            continue;
        }
        levels.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut clusters: Vec<Vec<(usize, f64)>> = Vec::new();
        let mut members: Vec<(usize, f64)> = Vec::new();
        for (k, level) in levels {
            if let Some(&(_, last)) = members.last() {
                if (last - level).abs() > 0.05 * last.max(level) {
                    clusters.push(std::mem::take(&mut members));
                }
            }
            members.push((k, level));
        }
        clusters.push(members);
        let mut covered: std::collections::HashSet<usize> = std::collections::HashSet::new();
        let groups = clusters.iter().map(|c| group(c, p, &mut covered)).collect();
        patterns.push(Pattern { period: p, groups });
    }
    let rest: Vec<u64> = trace
        .iter()
        .zip(&marked)
        .filter(|(_, m)| !**m)
        .map(|(v, _)| *v)
        .collect();
    let others_ns = if rest.is_empty() {
        median
    } else {
        let mut r = rest;
        r.sort_unstable();
        median_sorted(&r)
    };
    // A group that, described, barely differs from the others (a later round's leftover of
    // skew, not a level) is not worth a line.
    for p in &mut patterns {
        p.groups
            .retain(|g| (g.level_ns - others_ns).abs() >= MIN_RELATIVE_EFFECT * others_ns);
    }
    patterns.retain(|p| !p.groups.is_empty());
    PatternReport {
        patterns,
        others_ns,
    }
}

/// A cluster of phases (0-based, of period `p`) as a group, described by the shortest cycle
/// `q` dividing `p` whose residues this cluster and the slower ones (`covered`) fill: in
/// period 128, phases 31, 32, 63, 64, 95 and 96 beside slower 127 and 128 are "every 31st and
/// 32nd" of a 32-cycle.
fn group(
    members: &[(usize, f64)],
    p: usize,
    covered: &mut std::collections::HashSet<usize>,
) -> PhaseGroup {
    let mine: std::collections::HashSet<usize> = members.iter().map(|m| m.0).collect();
    covered.extend(&mine);
    let mut cycle = p;
    for q in (1..p).filter(|q| p.is_multiple_of(*q)) {
        let residues: std::collections::BTreeSet<usize> = mine.iter().map(|k| k % q).collect();
        if residues
            .iter()
            .all(|&r| (r..p).step_by(q).all(|k| covered.contains(&k)))
        {
            cycle = q;
            break;
        }
    }
    let mut phases: Vec<usize> = mine
        .iter()
        .map(|k| k % cycle + 1)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    phases.sort_unstable();
    PhaseGroup {
        phases,
        cycle,
        level_ns: members.iter().map(|m| m.1).sum::<f64>() / members.len() as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// Gaussian-ish noise (sum of uniforms) around `base` with standard deviation `sd`, plus a
    /// rare large outlier, as real traces have.
    fn noise(n: usize, base: f64, sd: f64, seed: u64) -> Vec<f64> {
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let u: f64 = (0..12).map(|_| rng.gen::<f64>()).sum::<f64>() - 6.0;
                let spike = if rng.gen::<f64>() < 0.0005 {
                    rng.gen_range(10.0..200.0) * base
                } else {
                    0.0
                };
                base + u * sd + spike
            })
            .collect()
    }

    fn to_ns(x: &[f64]) -> Vec<u64> {
        x.iter().map(|v| v.max(1.0) as u64).collect()
    }

    #[test]
    fn summary_columns_are_one_way_microseconds() {
        let rtt: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let s = Summary::from_round_trips(&rtt).unwrap();
        assert_eq!(s.iterations, 1000);
        assert!((s.t_min - 0.5).abs() < 1e-9);
        assert!((s.t_max - 500.0).abs() < 1e-9);
        assert!((s.t_typical - 250.25).abs() < 1e-9);
        assert!((s.t_avg - 250.25).abs() < 1e-9);
        assert!((s.p99 - 495.0).abs() < 1e-9);
        assert!((s.p999 - 499.5).abs() < 1e-9);
        assert!(s.t_stdev > 144.0 && s.t_stdev < 145.0);
        assert!(Summary::from_round_trips(&[]).is_none());
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v = [10, 20, 30, 40];
        assert_eq!(percentile_sorted(&v, 50.0), 20);
        assert_eq!(percentile_sorted(&v, 100.0), 40);
        assert_eq!(percentile_sorted(&v, 0.0), 10);
        assert_eq!(percentile_sorted(&[], 50.0), 0);
        assert_eq!(median_sorted(&v), 25.0);
    }

    #[test]
    fn ordinals() {
        let got: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 31, 32, 112]
            .iter()
            .map(|&n| ordinal(n))
            .collect();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "31st", "32nd",
                "112th"
            ]
        );
    }

    #[test]
    fn period_16_with_two_slow_phases() {
        for seed in 0..4 {
            let mut x = noise(10_000, 3170.0, 60.0, seed);
            for (i, v) in x.iter_mut().enumerate() {
                if i % 16 >= 14 {
                    *v += 1230.0;
                }
            }
            let r = find_patterns(&to_ns(&x));
            assert_eq!(r.patterns.len(), 1, "seed {seed}: {}", r.describe());
            let p = &r.patterns[0];
            assert_eq!(p.period, 16);
            assert_eq!(p.groups.len(), 1);
            assert_eq!(p.groups[0].phases, vec![15, 16]);
            assert!((p.groups[0].level_ns - 4400.0).abs() < 60.0);
            assert!((r.others_ns - 3170.0).abs() < 30.0);
            let text = r.describe();
            assert!(
                text.starts_with("every 15th and 16th round trip is 4.4"),
                "{text}"
            );
            assert!(text.ends_with("others 3.17 µs (period 16)"), "{text}");
        }
    }

    #[test]
    fn seed_figures_period_32_two_levels() {
        // N = 32 with SRQ: 31st/32nd at 4.4 µs, 15th/16th at 3.85 µs, others 3.15 µs.
        let mut x = noise(10_000, 3150.0, 80.0, 7);
        for (i, v) in x.iter_mut().enumerate() {
            match i % 32 {
                30 | 31 => *v += 1250.0,
                14 | 15 => *v += 700.0,
                _ => {}
            }
        }
        let r = find_patterns(&to_ns(&x));
        assert_eq!(r.patterns.len(), 1, "{}", r.describe());
        assert_eq!(r.patterns[0].period, 32);
        let g = &r.patterns[0].groups;
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].phases, vec![31, 32]);
        assert_eq!(g[1].phases, vec![15, 16]);
        assert_eq!(g[1].cycle, 16);
        let text = r.describe();
        assert!(
            text.contains("every 31st and 32nd round trip is 4.4"),
            "{text}"
        );
        assert!(
            text.contains("every 15th and 16th of each 16 round trips is 3.8"),
            "{text}"
        );
    }

    #[test]
    fn nested_periods_32_and_128() {
        for seed in 0..3 {
            let mut x = noise(10_000, 3150.0, 60.0, 100 + seed);
            for (i, v) in x.iter_mut().enumerate() {
                if i % 128 >= 126 {
                    *v += 1350.0;
                } else if i % 32 >= 30 {
                    *v += 650.0;
                }
            }
            let r = find_patterns(&to_ns(&x));
            assert_eq!(r.patterns.len(), 1, "seed {seed}: {}", r.describe());
            let p = &r.patterns[0];
            assert_eq!(p.period, 128, "seed {seed}: {}", r.describe());
            assert_eq!(p.groups.len(), 2, "seed {seed}: {}", r.describe());
            assert_eq!(
                (p.groups[0].cycle, &p.groups[0].phases[..]),
                (128, &[127, 128][..])
            );
            assert!((p.groups[0].level_ns - 4500.0).abs() < 80.0);
            assert_eq!(
                (p.groups[1].cycle, &p.groups[1].phases[..]),
                (32, &[31, 32][..])
            );
            assert!((p.groups[1].level_ns - 3800.0).abs() < 80.0);
            let text = r.describe();
            assert!(
                text.contains("every 127th and 128th round trip is 4."),
                "{text}"
            );
            assert!(
                text.contains("every 31st and 32nd of each 32 round trips is 3.8"),
                "{text}"
            );
            assert!(text.ends_with("(period 128)"), "{text}");
        }
    }

    #[test]
    fn three_slow_phases_period_16() {
        let mut x = noise(10_000, 3150.0, 100.0, 42);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 16 >= 13 {
                *v += 4050.0;
            }
        }
        let r = find_patterns(&to_ns(&x));
        assert_eq!(r.patterns.len(), 1, "{}", r.describe());
        assert_eq!(r.patterns[0].groups[0].phases, vec![14, 15, 16]);
        assert!(r
            .describe()
            .starts_with("every 14th, 15th and 16th round trip is 7.2"));
    }

    #[test]
    fn long_period_near_the_limit() {
        let mut x = noise(20_000, 5000.0, 150.0, 9);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 1000 == 999 {
                *v += 5000.0;
            }
        }
        let r = find_patterns(&to_ns(&x));
        assert_eq!(r.patterns.len(), 1, "{}", r.describe());
        assert_eq!(r.patterns[0].period, 1000);
        assert_eq!(r.patterns[0].groups[0].phases, vec![1000]);
    }

    #[test]
    fn pure_noise_has_no_pattern() {
        for seed in 0..8 {
            let x = noise(10_000, 3000.0 + seed as f64 * 500.0, 150.0, 1000 + seed);
            let r = find_patterns(&to_ns(&x));
            assert!(r.patterns.is_empty(), "seed {seed}: {}", r.describe());
            assert_eq!(r.describe(), "no periodic pattern");
        }
    }

    #[test]
    fn skewed_noise_has_no_pattern() {
        // Exponential tails, as TCP round trips have: mean well above the median.
        for seed in 0..6 {
            let mut rng = SmallRng::seed_from_u64(500 + seed);
            let x: Vec<u64> = (0..10_000)
                .map(|_| {
                    let u: f64 = rng.gen_range(1e-9..1.0);
                    (13_000.0 - 4_000.0 * u.ln()) as u64
                })
                .collect();
            let r = find_patterns(&x);
            assert!(r.patterns.is_empty(), "seed {seed}: {}", r.describe());
        }
    }

    #[test]
    fn bimodal_noise_has_no_pattern() {
        // The InfRc ping-pong study's N = 1 without SRQ: two modes, 17 and 12.5 µs, no pattern
        // between them.
        for seed in 0..4 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let x: Vec<u64> = (0..10_000)
                .map(|_| {
                    let base = if rng.gen::<bool>() {
                        17_000.0
                    } else {
                        12_500.0
                    };
                    (base + rng.gen_range(-300.0..300.0)) as u64
                })
                .collect();
            let r = find_patterns(&x);
            assert!(r.patterns.is_empty(), "seed {seed}: {}", r.describe());
        }
    }

    #[test]
    fn short_and_constant_traces() {
        assert!(find_patterns(&[]).patterns.is_empty());
        assert!(find_patterns(&[5; 10]).patterns.is_empty());
        assert!(find_patterns(&[3000; 5000]).patterns.is_empty());
    }
}
