//! `multirail sim SCENARIO.json`: runs a scenario's runs in the simulator and prints their
//! reports side by side (`--json` for scripts, `--plot` for throughput per rail over time).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::limits;
use crate::out::{self, outln};
use crate::Failure;

/// Arguments of `multirail sim`.
#[derive(Args)]
pub struct SimArgs {
    /// Scenario file (JSON; see sim/scenarios/).
    scenario: PathBuf,
    /// Print the reports as one JSON document instead of tables.
    #[arg(long)]
    json: bool,
    /// Draw throughput per rail over time into this PNG file. Default: no plot.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Override every run's simulated duration, ms: 1 to 3600000 (an hour). Default: the
    /// scenario's.
    #[arg(long, value_parser = limits::count::<u64>(1, multirail_sim::scenario::MAX_DURATION_MS))]
    duration_ms: Option<u64>,
    /// Override every run's seed. Default: the scenario's (1 if it gives none).
    #[arg(long)]
    seed: Option<u64>,
}

/// Runs `multirail sim`: exit 2 for a bad scenario file, 1 if a plot cannot be written.
pub fn run(args: SimArgs) -> Result<(), Failure> {
    let text = std::fs::read_to_string(&args.scenario)
        .map_err(|e| Failure::Usage(format!("cannot read {}: {e}", args.scenario.display())))?;
    let mut runs = multirail_sim::parse_runs(&text)
        .map_err(|e| Failure::Usage(format!("{}: {e}", args.scenario.display())))?;
    for run in &mut runs {
        if let Some(d) = args.duration_ms {
            run.duration_ms = d;
            run.events.retain(|e| e.at_ms < d);
            // A longer run may take more samples, or more arrivals, than the scenario's keys
            // allow.
            run.validate().map_err(|e| {
                Failure::Usage(format!(
                    "{} with --duration-ms {d}: {e}",
                    args.scenario.display()
                ))
            })?;
        }
        if let Some(s) = args.seed {
            run.seed = s;
        }
    }
    let mut reports = Vec::new();
    for run in &runs {
        let report = multirail_sim::simulate(run)
            .map_err(|e| Failure::Usage(format!("{}: {e}", args.scenario.display())))?;
        if !args.json {
            out::print(format_args!("{}", report.table()))?;
        }
        reports.push(report);
    }
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&reports).context("encoding the reports")?
        )?;
    }
    if let Some(path) = &args.plot {
        multirail_sim::plot(&reports, path)
            .map_err(|e| anyhow::anyhow!("cannot draw {}: {e}", path.display()))?;
    }
    Ok(())
}
