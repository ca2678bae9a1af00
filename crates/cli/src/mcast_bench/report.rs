//! The figures of an `mcast-bench` run, from every member's report: multicasts per second
//! at each member, one-sided writes per multicast, latency, and the checks (everything
//! delivered exactly once, the same order everywhere when ordered, failures named).

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::member::{histogram, MemberReport, StatsReport};
use super::{DeliveryArg, McastBenchArgs};
use crate::out::outln;
use crate::Failure;

/// The member a run killed, and when (monotonic ns).
pub struct Kill {
    pub member: usize,
    pub name: String,
    pub at_ns: u64,
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// Prints the run's figures (a table, or JSON under `--json`); fails (exit 1) when a check
/// failed: a message lost, duplicated or wrong, orders that differ, a member that failed
/// (or, with `--kill-member`, a member that did not see the failure).
pub(super) fn finish(
    args: &McastBenchArgs,
    reports: &[Option<MemberReport>],
    kill: Option<&Kill>,
) -> Result<(), Failure> {
    let present: Vec<&MemberReport> = reports.iter().flatten().collect();
    let mut problems: Vec<String> = Vec::new();
    let mut total = StatsReport::default();
    let mut merged: Histogram<u64> =
        Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds");
    for r in &present {
        let s = &r.stats;
        total.sent += s.sent;
        total.pushes += s.pushes;
        total.data_writes += s.data_writes;
        total.counter_writes += s.counter_writes;
        total.ack_writes += s.ack_writes;
        total.heartbeat_writes += s.heartbeat_writes;
        total.window_stalls += s.window_stalls;
        total.null_records += s.null_records;
        match histogram(&r.latency) {
            Some(h) => {
                let _ = merged.add(&h);
            }
            None => problems.push(format!("member {}: unreadable latency histogram", r.member)),
        }
        if r.verify_errors > 0 {
            problems.push(format!(
                "member {}: {} messages wrong; first: {}",
                r.member,
                r.verify_errors,
                r.first_verify_error.as_deref().unwrap_or("?")
            ));
        }
    }
    // Exactly once: every member delivered what each sender says it sent.
    let sent_by: Vec<Option<u64>> = (0..args.senders)
        .map(|rank| reports[rank].as_ref().map(|r| r.sent))
        .collect();
    for r in &present {
        if r.failure.is_some() {
            continue;
        }
        for (rank, sent) in sent_by.iter().enumerate() {
            if let Some(sent) = sent {
                if r.delivered.get(rank) != Some(sent) {
                    problems.push(format!(
                        "member {} delivered {} of sender {rank}'s {sent} messages",
                        r.member,
                        r.delivered.get(rank).copied().unwrap_or(0)
                    ));
                }
            }
        }
    }
    let ordered = args.delivery == DeliveryArg::Ordered;
    let hashes: Vec<&str> = present
        .iter()
        .filter(|r| r.failure.is_none())
        .map(|r| r.order_hash.as_str())
        .collect();
    let identical = hashes.windows(2).all(|w| w[0] == w[1]);
    if ordered && !identical {
        problems.push(format!(
            "members delivered different sequences (hashes {})",
            hashes.join(", ")
        ));
    }
    let mut detections = Vec::new();
    if let (Some(m), None) = (args.kill_member, kill) {
        problems.push(format!(
            "member {m} was not killed: the run ended before --kill-after"
        ));
    }
    match kill {
        None => {
            for r in &present {
                if let Some(f) = &r.failure {
                    problems.push(format!("member {} failed: {f}", r.member));
                }
            }
        }
        Some(k) => {
            for r in &present {
                let after_s = r
                    .failure_at_ns
                    .map(|t| t.saturating_sub(k.at_ns) as f64 / 1e9);
                let names_it = r.failure.as_deref().is_some_and(|f| f.contains(&k.name));
                if !names_it {
                    problems.push(format!(
                        "member {} did not report the failure of member {} ({}): {}",
                        r.member,
                        k.member,
                        k.name,
                        r.failure.as_deref().unwrap_or("no error")
                    ));
                }
                detections.push(json!({
                    "member": r.member,
                    "error": r.failure,
                    "seconds_after_kill": after_s,
                    "names_killed_member": names_it,
                }));
            }
        }
    }
    let multicasts = total.sent.max(1) as f64;
    let per = |n: u64| n as f64 / multicasts;
    let rates: Vec<f64> = present
        .iter()
        .map(|r| r.measured as f64 / (r.window_ns.max(1) as f64 / 1e9))
        .collect();
    let q = |q: f64| {
        if merged.is_empty() {
            0.0
        } else {
            us(merged.value_at_quantile(q))
        }
    };
    let v = json!({
        "kill_signal": kill.map(|_| if args.kill_signal == super::KillSignal::Stop { "stop" } else { "kill" }),
        "members": args.members,
        "senders": args.senders,
        "size": args.size.to_string(),
        "batching": args.batching.clone().unwrap_or_else(|| "default".into()),
        "flush_us": args.flush_us,
        "window": args.window,
        "delivery": if ordered { "ordered" } else { "unordered" },
        "transport": args.transport.name(),
        "rate_per_sender": args.rate,
        "duration_s": args.messages.is_none().then_some(args.duration.as_secs_f64()),
        "warmup_s": args.messages.is_none().then_some(args.warmup.as_secs_f64()),
        "messages": args.messages,
        "multicasts": total.sent,
        "multicasts_per_s": rates.iter().copied().fold(f64::INFINITY, f64::min),
        "writes_per_multicast": {
            "data": per(total.data_writes),
            "counters": per(total.counter_writes),
            "acks": per(total.ack_writes),
            "total": per(total.data_writes + total.counter_writes + total.ack_writes),
            "heartbeats": per(total.heartbeat_writes),
        },
        "pushes": total.pushes,
        "window_stalls": total.window_stalls,
        "null_records": total.null_records,
        "latency_us": { "p50": q(0.5), "p99": q(0.99), "max": us(merged.max()) },
        "order_identical": identical,
        "per_member": present.iter().zip(&rates).map(|(r, rate)| json!({
            "member": r.member,
            "name": r.name,
            "sender": r.member < args.senders,
            "sent": r.sent,
            "delivered": r.delivered.iter().sum::<u64>(),
            "multicasts_per_s": rate,
            "latency_p50_us": us(r.p50_ns),
            "latency_p99_us": us(r.p99_ns),
            "order_hash": r.order_hash,
            "failure": r.failure,
            "stats": serde_json::to_value(&r.stats).expect("stats serialize"),
        })).collect::<Vec<_>>(),
        "killed": kill.map(|k| json!({"member": k.member, "name": k.name})),
        "detections": detections,
        "problems": problems,
    });
    if args.json {
        outln!("{v}")?;
    } else {
        print_tables(&v)?;
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Failure::Runtime(anyhow::anyhow!(problems.join("; "))))
    }
}

fn print_tables(v: &Value) -> Result<(), Failure> {
    use comfy_table::{presets::UTF8_FULL, Table};
    let f = |x: &Value| x.as_f64().unwrap_or(0.0);
    let mut t = Table::new();
    t.load_preset(UTF8_FULL);
    t.set_header(vec![
        "member",
        "role",
        "delivered",
        "multicasts/s",
        "p50 µs",
        "p99 µs",
        "failure",
    ]);
    for m in v["per_member"].as_array().into_iter().flatten() {
        t.add_row(vec![
            m["member"].to_string(),
            if m["sender"].as_bool() == Some(true) {
                format!("sender ({} sent)", m["sent"])
            } else {
                "receiver".into()
            },
            m["delivered"].to_string(),
            format!("{:.0}", f(&m["multicasts_per_s"])),
            format!("{:.1}", f(&m["latency_p50_us"])),
            format!("{:.1}", f(&m["latency_p99_us"])),
            m["failure"].as_str().unwrap_or("-").to_owned(),
        ]);
    }
    outln!("{t}")?;
    let w = &v["writes_per_multicast"];
    let mut s = Table::new();
    s.load_preset(UTF8_FULL);
    s.set_header(vec!["figure", "value"]);
    let run = format!(
        "{} members, {} sender(s), {} B, batching {}, {} over {}",
        v["members"],
        v["senders"],
        v["size"].as_str().unwrap_or(""),
        v["batching"].as_str().unwrap_or(""),
        v["delivery"].as_str().unwrap_or(""),
        v["transport"].as_str().unwrap_or(""),
    );
    s.add_row(vec!["run".into(), run]);
    s.add_row(vec![
        "multicasts/s (slowest member)".into(),
        format!("{:.0}", f(&v["multicasts_per_s"])),
    ]);
    s.add_row(vec![
        "one-sided writes per multicast".into(),
        format!(
            "{:.3} (data {:.3}, counters {:.3}, acks {:.3}; heartbeats {:.3} besides)",
            f(&w["total"]),
            f(&w["data"]),
            f(&w["counters"]),
            f(&w["acks"]),
            f(&w["heartbeats"])
        ),
    ]);
    s.add_row(vec![
        "latency p50 / p99 (µs, all members)".into(),
        format!(
            "{:.1} / {:.1}",
            f(&v["latency_us"]["p50"]),
            f(&v["latency_us"]["p99"])
        ),
    ]);
    s.add_row(vec!["pushes".into(), v["pushes"].to_string()]);
    s.add_row(vec!["window stalls".into(), v["window_stalls"].to_string()]);
    if v["delivery"] == "ordered" {
        s.add_row(vec![
            "same order at every member".into(),
            v["order_identical"].to_string(),
        ]);
    }
    for d in v["detections"].as_array().into_iter().flatten() {
        s.add_row(vec![
            format!("member {} saw the kill after (s)", d["member"]),
            format!(
                "{:.3}: {}",
                f(&d["seconds_after_kill"]),
                d["error"].as_str().unwrap_or("no error")
            ),
        ]);
    }
    for p in v["problems"].as_array().into_iter().flatten() {
        s.add_row(vec!["PROBLEM".into(), p.as_str().unwrap_or("").to_owned()]);
    }
    outln!("{s}")
}
