//! The simulation of a multicast scenario: a group of `members` where `senders` of them send
//! as fast as their rings allow, with the real [`PushPlanner`] and [`AckPlanner`] deciding
//! every push and acknowledgement, in virtual time steps of 20 ns.
//!
//! - **Writes.** A push to the other `members - 1` members is one write of its slots and one
//!   of the sender's committed count to each; an acknowledgement is one write of a member's
//!   received count to each other member. Every member acknowledges every sender, the sender
//!   itself included (Derecho's receive loop counts its own messages too): with batching off
//!   that is the 10 writes per multicast of Derecho's unbatched SMC in a group of 3 with one
//!   sender.
//! - **NIC.** As in Derecho's SMC arithmetic, every write of the group is charged to one NIC's
//!   operation rate (`nic_mops`), and every sender's payload to each other member to its line
//!   rate (`nic_gbps`). Writes go in the order decided, each once the NIC has the operations
//!   (and bytes) for it; a push's messages reach the other members when its writes are done.
//!   Capacity left idle is not banked.
//! - **Senders** commit whenever their window has room (an application with messages always
//!   ready); a slot frees when every member has acknowledged it.
//!
//! A multicast counts once every member has received it.

use std::collections::VecDeque;

use multirail_policy::coalesce::{AckPlanner, PushPlanner};

use crate::report::{MulticastReport, Report};
use crate::scenario::{MulticastScenario, Run, ScenarioError};

/// Virtual time step, ns.
const STEP_NS: u64 = 20;

/// A write job in the NIC's queue.
enum Job {
    /// `len` messages of `sender`, urgent or not: writes of slots and of the count.
    Push {
        sender: usize,
        len: u64,
        urgent: bool,
    },
    /// `member` has received `count` messages of `sender`.
    Ack {
        member: usize,
        sender: usize,
        count: u64,
    },
}

/// Runs the scenario for `run.duration_ms` of virtual time. Fails only on settings
/// [`MulticastScenario`] validation already refuses.
pub fn simulate(run: &Run, sc: &MulticastScenario) -> Result<Report, ScenarioError> {
    let wall = std::time::Instant::now();
    let batching = sc.batching()?;
    let members = sc.members as usize;
    let senders = sc.senders as usize;
    let others = sc.members - 1;
    let mut push: Vec<PushPlanner> = (0..senders)
        .map(|_| PushPlanner::new(batching, sc.window).expect("validated"))
        .collect();
    // ack[member][sender]
    let mut ack: Vec<Vec<AckPlanner>> = (0..members)
        .map(|_| {
            (0..senders)
                .map(|_| AckPlanner::new(batching, sc.window).expect("validated"))
                .collect()
        })
        .collect();
    let mut received = vec![vec![0u64; senders]; members];
    let mut acknowledged = vec![vec![0u64; senders]; members];
    let mut queue: VecDeque<(u64, u64, Job)> = VecDeque::new();
    let ops_per_ns = sc.nic_mops * 1e6 / 1e9;
    let bytes_per_ns = sc.nic_gbps / 8.0;
    let (mut ops_budget, mut bytes_budget) = (0.0f64, 0.0f64);
    let (mut data_writes, mut counter_writes, mut ack_writes) = (0u64, 0u64, 0u64);
    let (mut ops_used, mut bytes_used) = (0u64, 0u64);
    let end = run.duration_ms * 1_000_000;
    let mut now = 0u64;
    while now < end {
        // Senders fill their windows and push what their planner says.
        for (s, p) in push.iter_mut().enumerate() {
            while p.commit(now).is_some() {}
            while let Some(out) = p.poll_push(now) {
                let len = out.messages.end - out.messages.start;
                // The sender has its own messages at once.
                received[s][s] += len;
                ack[s][s].on_consumed(len, out.urgent, now);
                queue.push_back((
                    2 * others,
                    len * sc.message_bytes * others,
                    Job::Push {
                        sender: s,
                        len,
                        urgent: out.urgent,
                    },
                ));
            }
        }
        // Members acknowledge what their planners say.
        for (m, planners) in ack.iter_mut().enumerate() {
            for (s, a) in planners.iter_mut().enumerate() {
                while let Some(count) = a.poll_ack(now) {
                    queue.push_back((
                        others,
                        0,
                        Job::Ack {
                            member: m,
                            sender: s,
                            count,
                        },
                    ));
                }
            }
        }
        // The NIC does what its capacity allows, in order.
        ops_budget += ops_per_ns * STEP_NS as f64;
        bytes_budget += bytes_per_ns * STEP_NS as f64;
        while let Some(&(ops, bytes, _)) = queue.front() {
            if ops_budget < ops as f64 || bytes_budget < bytes as f64 {
                break;
            }
            ops_budget -= ops as f64;
            bytes_budget -= bytes as f64;
            ops_used += ops;
            bytes_used += bytes;
            let (_, _, job) = queue.pop_front().expect("front exists");
            match job {
                Job::Push {
                    sender,
                    len,
                    urgent,
                } => {
                    data_writes += others;
                    counter_writes += others;
                    for m in (0..members).filter(|&m| m != sender) {
                        received[m][sender] += len;
                        ack[m][sender].on_consumed(len, urgent, now);
                    }
                }
                Job::Ack {
                    member,
                    sender,
                    count,
                } => {
                    ack_writes += others;
                    acknowledged[member][sender] = count;
                    let least = (0..members)
                        .map(|m| acknowledged[m][sender])
                        .min()
                        .unwrap_or(0);
                    push[sender].on_acknowledged(least);
                }
            }
        }
        if queue.is_empty() {
            // Idle capacity is not banked for later bursts.
            ops_budget = ops_budget.min(ops_per_ns * STEP_NS as f64);
            bytes_budget = bytes_budget.min(bytes_per_ns * STEP_NS as f64);
        }
        now += STEP_NS;
    }
    let multicasts: u64 = (0..senders)
        .map(|s| (0..members).map(|m| received[m][s]).min().unwrap_or(0))
        .sum();
    let secs = end as f64 / 1e9;
    let per = |w: u64| {
        if multicasts == 0 {
            0.0
        } else {
            w as f64 / multicasts as f64
        }
    };
    let ops_utilization = ops_used as f64 / (sc.nic_mops * 1e6 * secs);
    let bandwidth_utilization = bytes_used as f64 / (sc.nic_gbps / 8.0 * 1e9 * secs);
    let report = MulticastReport {
        batching: sc.batching.clone(),
        members: sc.members,
        senders: sc.senders,
        message_bytes: sc.message_bytes,
        multicasts,
        multicasts_per_sec: multicasts as f64 / secs,
        data_writes_per_multicast: per(data_writes),
        counter_writes_per_multicast: per(counter_writes),
        ack_writes_per_multicast: per(ack_writes),
        ops_utilization,
        bandwidth_utilization,
        bound: if ops_utilization >= bandwidth_utilization {
            "operations".into()
        } else {
            "bandwidth".into()
        },
    };
    Ok(Report {
        multicast: Some(report),
        ..Report::without_rails(
            run,
            wall.elapsed(),
            bytes_used as f64 / secs / 1e9,
            sc.nic_gbps / 8.0,
        )
    })
}

#[cfg(test)]
mod tests {
    use crate::scenario::parse_runs;

    fn run(batching: &str) -> crate::report::MulticastReport {
        let doc = format!(
            r#"{{"name": "m", "duration_ms": 2, "multicast": {{"batching": "{batching}"}}}}"#
        );
        let runs = parse_runs(&doc).expect("scenario parses");
        crate::simulate(&runs[0]).expect("runs").multicast.unwrap()
    }

    #[test]
    fn off_is_the_seeds_ten_writes_and_seven_and_a_half_million_a_second() {
        let off = run("off");
        let writes = off.data_writes_per_multicast
            + off.counter_writes_per_multicast
            + off.ack_writes_per_multicast;
        assert!((writes - 10.0).abs() < 0.01, "{off:?}");
        assert!(
            (off.multicasts_per_sec / 7.5e6 - 1.0).abs() < 0.02,
            "{off:?}"
        );
        assert_eq!(off.bound, "operations");
    }

    #[test]
    fn batching_multiplies_the_rate_up_to_the_line_rate() {
        let off = run("off").multicasts_per_sec;
        for mode in ["opportunistic", "k:25"] {
            let b = run(mode);
            assert!(b.multicasts_per_sec >= 4.0 * off, "{mode}: {b:?}");
            assert!(b.bandwidth_utilization <= 1.0 + 1e-9, "{mode}: {b:?}");
        }
        let k = run("k:25");
        let writes = k.data_writes_per_multicast
            + k.counter_writes_per_multicast
            + k.ack_writes_per_multicast;
        assert!(writes <= 1.0, "{k:?}");
    }

    #[test]
    fn bad_multicast_settings_are_refused_naming_the_key() {
        for (body, key) in [
            (r#""members": 1"#, "multicast.members"),
            (r#""senders": 4"#, "multicast.senders"),
            (r#""batching": "k:0""#, "multicast.batching"),
            (r#""batching": "k:200""#, "multicast.batching"),
            (r#""batching": "nagle""#, "multicast.batching"),
            (r#""batching": "k:5", "flush_us": 0"#, "multicast.flush_us"),
            (r#""window": 0"#, "multicast.window"),
            (r#""nic_mops": 0"#, "multicast.nic_mops"),
        ] {
            let doc = format!(r#"{{"name": "m", "duration_ms": 1, "multicast": {{{body}}}}}"#);
            let e = parse_runs(&doc).unwrap_err();
            assert_eq!(e.key, key, "{body}: {e}");
        }
        let e = parse_runs(
            r#"{"name": "m", "duration_ms": 1, "multicast": {}, "rails": [{"name": "r", "gbps": 1}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.key, "rails");
    }
}
