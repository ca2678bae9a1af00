//! Two processes attached to one `shared_quota_shm_path` agree on the current QoS slot.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use multirail::slots::{self, GlobalSlots};

const INTERVAL_NS: u64 = 3_000_000;
const CHILD_ENV: &str = "MULTIRAIL_SLOTS_CHILD";

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// (time, slot) readings every 100 µs for `ms` milliseconds.
fn sample(s: &GlobalSlots, ms: u64) -> Vec<(u64, u8)> {
    let end = Instant::now() + Duration::from_millis(ms);
    let mut out = Vec::new();
    while Instant::now() < end {
        out.push((monotonic_ns(), s.current_slot()));
        std::thread::sleep(Duration::from_micros(100));
    }
    out
}

#[test]
fn two_processes_see_the_same_slot() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        // Child side: attach, report readings on stdout.
        let s = GlobalSlots::attach(&path, INTERVAL_NS, true).unwrap();
        for (t, slot) in sample(&s, 120) {
            println!("SAMPLE {t} {slot}");
        }
        return;
    }
    let path = format!("/multirail-two-procs-{}", std::process::id());
    let parent = GlobalSlots::attach(&path, INTERVAL_NS, true).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "two_processes_see_the_same_slot",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let child_pid = child.id();
    std::thread::sleep(Duration::from_millis(30));
    assert!(
        parent.attached().contains(&child_pid),
        "the child registered in the shared header"
    );
    let mine = sample(&parent, 60);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let theirs: Vec<(u64, u8)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.strip_prefix("SAMPLE ")?.split(' ');
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
        .collect();
    assert!(
        theirs.len() > 100,
        "child reported {} readings",
        theirs.len()
    );
    // Compare readings taken within 50 µs of each other: they must agree, apart from the few
    // that straddle a rotation.
    let (mut compared, mut agreed) = (0, 0);
    for &(t, slot) in &mine {
        if let Some(&(_, other)) = theirs.iter().find(|(u, _)| u.abs_diff(t) < 50_000) {
            compared += 1;
            agreed += usize::from(other == slot);
        }
    }
    assert!(compared > 50, "only {compared} readings overlapped in time");
    assert!(
        agreed * 100 >= compared * 95,
        "{agreed} of {compared} readings agree"
    );
    let seen: std::collections::BTreeSet<u8> = mine.iter().map(|(_, s)| *s).collect();
    assert_eq!(seen.len(), 3, "slots rotated through 0, 1 and 2: {seen:?}");
    drop(parent);
    slots::unlink(&path);
}
