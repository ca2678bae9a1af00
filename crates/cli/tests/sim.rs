//! `multirail sim` runs every scenario in sim/scenarios, reports as JSON, draws its plot, and
//! refuses a bad scenario naming the key.

use std::path::{Path, PathBuf};
use std::process::Command;

fn multirail() -> Command {
    Command::new(env!("CARGO_BIN_EXE_multirail"))
}

fn scenarios() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sim/scenarios");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("sim/scenarios exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_scenario_runs_and_reports_json() {
    let files = scenarios();
    for name in ["netns-4rails", "tent-8x400", "qos-8x400", "rail-failure"] {
        assert!(
            files.iter().any(|f| f.file_stem().unwrap() == name),
            "sim/scenarios/{name}.json is missing"
        );
    }
    for file in files {
        // Short runs: the scenarios' own durations are for the closing figures, not tests.
        let out = multirail()
            .args(["sim", "--json", "--duration-ms", "60"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let reports: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let reports = reports.as_array().expect("one report per run");
        assert!(!reports.is_empty());
        for r in reports {
            assert!(r["gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
            assert_eq!(r["simulated_ms"], 60);
            for c in r["classes"].as_array().unwrap() {
                assert_eq!(c["failed"], 0, "{}: {c}", file.display());
            }
        }
    }
}

#[test]
fn plot_writes_a_png() {
    let dir = std::env::temp_dir().join(format!("mr-sim-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("rails.png");
    let scenario =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sim/scenarios/rail-failure.json");
    let out = multirail()
        .args(["sim", "--duration-ms", "50", "--plot"])
        .arg(&png)
        .arg(&scenario)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("no TrueType font") {
        eprintln!("skipped: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_scenario_exits_2_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("mr-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            r#"{"name": "x", "duration_ms": 10, "rails": [{"name": "a", "gbps": 0}], "workloads": [{"name": "w", "priority": "low", "size": 1}]}"#,
            "rails[0].gbps",
        ),
        (
            r#"{"name": "x", "duration_ms": 10, "rails": [{"name": "a", "gbps": 1}], "workloads": [{"name": "w", "priority": "low", "size": 1}], "policy": {"block_sise": 4}}"#,
            "block_sise",
        ),
        (
            r#"{"name": "x", "duration_ms": 10, "rails": [{"name": "a", "gbps": 1}], "workloads": [{"name": "w", "priority": "low", "size": 1}], "events": [{"at_ms": 1, "rail": 3, "action": "fail"}]}"#,
            "events[0].rail",
        ),
    ];
    for (i, (doc, key)) in cases.iter().enumerate() {
        let file = dir.join(format!("bad{i}.json"));
        std::fs::write(&file, doc).unwrap();
        let out = multirail().arg("sim").arg(&file).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{doc}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(key), "{key} not named in: {stderr}");
    }
    let out = multirail()
        .args(["sim", "/nonexistent/scenario.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}
