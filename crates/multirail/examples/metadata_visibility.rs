//! How long after an engine starts another engine can open it through a metadata store:
//! `--starts N` times, an engine named `vis-<run>-<i>` (`metadata.segment_name`) is started and
//! allocates 4 KiB, while an observer engine on another thread keeps opening that name; one
//! sample is the time from the start of `Engine::new` to the observer's first descriptor that
//! holds the buffer (what a peer needs before it can move a byte). The observer closes the
//! segment after each look, so it never answers from its cache, and looks again 0.5 ms after
//! a miss, which bounds the resolution. The started engine is then dropped (withdrawing its
//! key) before the next.
//!
//! Usage: `metadata_visibility --metadata URL [--starts N] [--json]` (URL: `etcd://HOST:PORT`
//! or `http://HOST:PORT/metadata`). Prints p50, p99 and max in milliseconds, and with `--json`
//! one JSON object. Used by `bench/etcd`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use multirail::{Config, Engine};

fn usage() -> ! {
    eprintln!("usage: metadata_visibility --metadata URL [--starts N] [--json]");
    std::process::exit(2)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn main() {
    let mut metadata = None;
    let mut starts = 100usize;
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--metadata" => metadata = Some(args.next().unwrap_or_else(|| usage())),
            "--starts" => {
                starts = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|&n| n > 0)
                    .unwrap_or_else(|| usage())
            }
            "--json" => json = true,
            _ => usage(),
        }
    }
    let Some(metadata) = metadata else { usage() };
    let config = || {
        let mut c = Config::default();
        if let Err(e) = c.use_metadata_server(&metadata) {
            eprintln!("error: --metadata: {e}");
            std::process::exit(2);
        }
        c
    };
    let observer = Arc::new(Engine::new(config(), "127.0.0.1:0").unwrap_or_else(|e| {
        eprintln!("error: the observer engine does not start: {e}");
        std::process::exit(1);
    }));
    let run = std::process::id();
    let mut samples_ms = Vec::with_capacity(starts);
    let mut failed_lookups = 0u64;
    for i in 0..starts {
        let name = format!("vis-{run}-{i}");
        let mut c = config();
        c.metadata.segment_name = Some(name.clone());
        let t0 = Instant::now();
        let watcher = {
            let (observer, name) = (observer.clone(), name.clone());
            std::thread::spawn(move || {
                let mut misses = 0u64;
                let deadline = t0 + Duration::from_secs(30);
                while Instant::now() < deadline {
                    if let Ok(seg) = observer.open_segment(&name) {
                        let took = t0.elapsed();
                        let ready = observer
                            .segment_descriptor(seg)
                            .is_ok_and(|d| !d.buffers.is_empty());
                        let _ = observer.close_segment(seg);
                        if ready {
                            return (Some(took), misses);
                        }
                    }
                    misses += 1;
                    // Leaves the CPU to the engine starting; sets the resolution.
                    std::thread::sleep(Duration::from_micros(500));
                }
                (None, misses)
            })
        };
        let engine = Engine::new(c, "127.0.0.1:0").unwrap_or_else(|e| {
            eprintln!("error: engine {i} does not start: {e}");
            std::process::exit(1);
        });
        let buffer = engine
            .allocate(4096, multirail::Location::Any)
            .unwrap_or_else(|e| {
                eprintln!("error: engine {i} cannot allocate: {e}");
                std::process::exit(1);
            });
        let (took, misses) = watcher.join().expect("observer thread");
        failed_lookups += misses;
        let Some(took) = took else {
            eprintln!("error: {name} was not visible within 30 s");
            std::process::exit(1);
        };
        samples_ms.push(took.as_secs_f64() * 1e3);
        drop(buffer);
        drop(engine);
    }
    let mut sorted = samples_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let (p50, p99, max) = (
        percentile(&sorted, 50.0),
        percentile(&sorted, 99.0),
        *sorted.last().expect("at least one start"),
    );
    if json {
        println!(
            "{}",
            serde_json::json!({
                "metadata": metadata,
                "starts": starts,
                "p50_ms": p50,
                "p99_ms": p99,
                "max_ms": max,
                "lookups_before_visible": failed_lookups,
            })
        );
    } else {
        println!(
            "{metadata}: {starts} starts, start to visibility p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms ({failed_lookups} lookups before visible)"
        );
    }
}
