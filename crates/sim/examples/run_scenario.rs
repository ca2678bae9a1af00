//! Runs a scenario file and prints its reports (`--json` for JSON): the simulator without the
//! CLI, e.g. `cargo run -p multirail-sim --example run_scenario -- sim/scenarios/lanes-1000-hot10.json`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let Some(path) = args.iter().find(|a| !a.starts_with("--")) else {
        eprintln!("usage: run_scenario [--json] SCENARIO.json");
        std::process::exit(2);
    };
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        eprintln!("cannot read {path}: {e}");
        std::process::exit(2);
    });
    let runs = multirail_sim::parse_runs(&text).unwrap_or_else(|e| {
        eprintln!("{path}: {e}");
        std::process::exit(2);
    });
    let mut reports = Vec::new();
    for run in &runs {
        let report = multirail_sim::simulate(run).unwrap_or_else(|e| {
            eprintln!("{path}: {e}");
            std::process::exit(2);
        });
        if !json {
            print!("{}", report.table());
        }
        reports.push(report);
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&reports).expect("reports encode")
        );
    }
}
