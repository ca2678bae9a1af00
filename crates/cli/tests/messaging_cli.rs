//! `multirail pingpong`: both transports across processes, its outputs, and every bad receive
//! setting refused with exit code 2 and the key named.

use std::process::{Command, Output};

fn multirail(args: &[&str], conf: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_multirail"));
    cmd.args(args);
    match conf {
        Some(c) => cmd.env("MULTIRAIL_CONF", c),
        None => cmd.env_remove("MULTIRAIL_CONF"),
    };
    cmd.output().expect("run multirail")
}

fn pingpong_json(transport: &str, extra: &[&str]) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!(
        "mr-pingpong-{}-{transport}-{}",
        std::process::id(),
        extra.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.csv");
    let plot = dir.join("plot.png");
    let mut args = vec![
        "pingpong",
        "--local",
        "--transport",
        transport,
        "--iterations",
        "3000",
        "--warmup",
        "200",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = multirail(&args, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let csv = std::fs::read_to_string(&trace).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("iteration,rtt_ns"));
    assert_eq!(lines.count(), 3000);
    let png = std::fs::read(&plot).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    std::fs::remove_dir_all(&dir).ok();
    v
}

fn check_columns(v: &serde_json::Value, transport: &str) {
    assert_eq!(v["transport"], transport);
    assert_eq!(v["bytes"], 128);
    assert_eq!(v["iterations"], 3000);
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    assert!(f("t_min_us") > 0.0);
    assert!(f("t_min_us") <= f("t_typical_us"));
    assert!(f("t_typical_us") <= f("p99_us"));
    assert!(f("p99_us") <= f("p999_us"));
    assert!(f("p999_us") <= f("t_max_us"));
    assert!(f("t_stdev_us") >= 0.0);
    assert!(v["pattern"].is_string());
    // The local server's own counters, read back after the goodbye: every warm-up and measured
    // message and the goodbye itself.
    let server = &v["server_messages"];
    assert_eq!(server["received"], 200 + 3000 + 1, "{server}");
    assert!(server["recv_sleeps"].is_u64(), "{server}");
    assert!(server["recv_anticipated"].is_u64(), "{server}");
    assert!(server["recv_cpu_moves"].is_u64(), "{server}");
}

#[test]
fn pingpong_local_over_shm() {
    let v = pingpong_json("shm", &[]);
    check_columns(&v, "shm");
}

#[test]
fn pingpong_local_over_tcp() {
    let v = pingpong_json("tcp", &[]);
    check_columns(&v, "tcp");
}

#[test]
fn pingpong_with_receive_knobs() {
    let v = pingpong_json(
        "shm",
        &[
            "--queue-depth",
            "32",
            "--shared-receive-queue",
            "true",
            "--registration-chunks",
            "4",
            "--max-sge",
            "2",
            "--return-policy",
            "bulk",
            "--return-order",
            "after-reply",
        ],
    );
    check_columns(&v, "shm");
    assert_eq!(v["receive"]["queue_depth"], 32);
    assert_eq!(v["receive"]["return_policy"], "bulk");
    assert_eq!(v["receive"]["return_order"], "after_reply");
}

#[test]
fn pingpong_human_table() {
    let out = multirail(
        &[
            "pingpong",
            "--local",
            "--iterations",
            "500",
            "--warmup",
            "10",
        ],
        None,
    );
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("t_typical[usec]"), "{text}");
    assert!(text.contains("99.9% percentile[usec]"), "{text}");
    assert!(text.contains("pattern: "), "{text}");
}

#[test]
fn every_bad_receive_setting_is_a_usage_error() {
    let flags: &[(&[&str], &str)] = &[
        (&["--queue-depth", "0"], "receive.queue_depth"),
        (
            &["--queue-depth", "32", "--registration-chunks", "3"],
            "receive.registration_chunks",
        ),
        (
            &["--registration-chunks", "0"],
            "receive.registration_chunks",
        ),
        (&["--max-sge", "0"], "receive.max_sge"),
    ];
    for (extra, key) in flags {
        let mut args = vec!["pingpong", "--local", "--iterations", "10"];
        args.extend_from_slice(extra);
        let out = multirail(&args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(key), "{extra:?}: {err}");
    }
    let confs = [
        (
            r#"{"transports":{"tcp":{"receive":{"return_policy":"later"}}}}"#,
            "transports.tcp.receive.return_policy",
        ),
        (
            r#"{"transports":{"shm":{"receive":{"return_order":"never"}}}}"#,
            "transports.shm.receive.return_order",
        ),
        (
            r#"{"transports":{"shm":{"receive":{"buffer_size":0}}}}"#,
            "transports.shm.receive.buffer_size",
        ),
        (
            r#"{"transports":{"tcp":{"receive":{"queue_depth":0}}}}"#,
            "transports.tcp.receive.queue_depth",
        ),
    ];
    for (conf, key) in confs {
        let out = multirail(&["pingpong", "--local", "--iterations", "10"], Some(conf));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{conf}: {err}");
        assert!(err.contains(key), "{conf}: {err}");
    }
    let out = multirail(&["pingpong", "--local", "--size", "0"], None);
    assert_eq!(out.status.code(), Some(2));
}

/// A child process killed when dropped (also when a test panics).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An echo server in a child process (`multirail pingpong --server`) over `transport`, and its
/// segment name.
fn echo_server(transport: &str) -> (Killed, String) {
    echo_server_at(transport, "127.0.0.1:0")
}

/// As [`echo_server`], listening at `listen`.
fn echo_server_at(transport: &str, listen: &str) -> (Killed, String) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args([
            "pingpong",
            "--server",
            "--transport",
            transport,
            "--listen",
            listen,
        ])
        .env_remove("MULTIRAIL_CONF")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the echo server");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (Killed(child), line.trim().to_owned())
}

/// A million messages to another process, the lane switched every thousand (shared to
/// dedicated and back): the server echoes each as it receives it, and the echoes come back
/// in order, each once: nothing sent before a switch was overtaken, lost or repeated by what
/// was sent after it.
fn a_million_messages_through_a_thousand_lane_switches(transport: &str) {
    use multirail::{Config, Engine, Lane};
    use std::time::{Duration, Instant};
    const N: u64 = 1_000_000;
    const EVERY: u64 = 1_000;
    let (_server, name) = echo_server(transport);
    // Lanes by hand only: with dynamic lanes (the default) the lanes driver may move this busy
    // peer's lane again between a switch and the check that follows it.
    let conf = format!(r#"{{"transport": "{transport}", "lanes": {{"dynamic": false}}}}"#);
    let engine = Engine::new(Config::from_json_str(&conf, "test").unwrap(), "127.0.0.1:0").unwrap();
    let seg = engine.open_segment(&name).unwrap();
    let started = Instant::now();
    let receiver = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            for i in 0..N {
                let m = engine
                    .recv(Some(Duration::from_secs(30)))
                    .unwrap()
                    .unwrap_or_else(|| panic!("echo {i} of {N} did not come"));
                let got = u64::from_le_bytes(m.data[..8].try_into().unwrap());
                if got != i {
                    let mut more = vec![got];
                    while let Ok(Some(m)) = engine.recv(Some(Duration::from_secs(2))) {
                        more.push(u64::from_le_bytes(m.data[..8].try_into().unwrap()));
                        if more.len() > 30 {
                            break;
                        }
                    }
                    panic!("expected {i}, then got {more:?}");
                }
                assert_eq!(m.data[8..], [(i % 251) as u8; 8]);
            }
            assert!(
                engine
                    .recv(Some(Duration::from_millis(300)))
                    .unwrap()
                    .is_none(),
                "an echo came twice"
            );
        })
    };
    let mut switches = 0;
    for i in 0..N {
        if i > 0 && i % EVERY == 0 {
            let to = if (i / EVERY) % 2 == 1 {
                Lane::Dedicated
            } else {
                Lane::Shared
            };
            engine.switch_lane(seg, to).unwrap();
            assert_eq!(engine.lane(seg).unwrap(), to);
            switches += 1;
        }
        let mut m = [(i % 251) as u8; 16];
        m[..8].copy_from_slice(&i.to_le_bytes());
        engine.send(seg, &m).unwrap();
    }
    receiver.join().unwrap();
    eprintln!(
        "{N} messages over {transport} with {switches} lane switches, echoed in order: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(switches, N / EVERY - 1);
}

#[test]
fn a_million_messages_through_a_thousand_lane_switches_tcp() {
    a_million_messages_through_a_thousand_lane_switches("tcp");
}

#[test]
fn a_million_messages_through_a_thousand_lane_switches_shm() {
    a_million_messages_through_a_thousand_lane_switches("shm");
}

/// A receiver process that dies: the sender's messages to it fail soon after (the lanes
/// thread sees the connection's end within a pass), with an error that says to open the
/// segment again, instead of going on into a ring nobody reads; opened again, the segment
/// reaches the receiver restarted at the same address.
fn a_sender_learns_its_receiver_died_and_reaches_its_restart(transport: &str) {
    use multirail::{Config, Engine, Error};
    use std::time::{Duration, Instant};
    let (server, name) = echo_server(transport);
    let conf = format!(r#"{{"transport": "{transport}"}}"#);
    let engine = Engine::new(Config::from_json_str(&conf, "test").unwrap(), "127.0.0.1:0").unwrap();
    let old = engine.open_segment(&name).unwrap();
    engine.send(old, b"first").unwrap();
    let echo = engine.recv(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(echo.expect("the first echo").data, b"first");
    // Quiet for a while: the lanes thread's passes stretch to their longest (8 ticks).
    std::thread::sleep(Duration::from_secs(1));
    drop(server);
    let died = Instant::now();
    let mut sent_meanwhile = 0;
    let refused = loop {
        match engine.send(old, b"to the dead") {
            Ok(()) => sent_meanwhile += 1,
            Err(e @ Error::PeerDisconnected { .. })
                if e.to_string().contains("open the segment again") =>
            {
                break e
            }
            Err(e) => eprintln!("meanwhile: {e}"),
        }
        // A pass after the death finds it (here ~30 ms), not the sweep that reads every
        // connection, once in 16 passes (here ~235 ms, and 46 messages lost meanwhile).
        assert!(
            died.elapsed() < Duration::from_millis(200),
            "sends to a dead receiver still succeed {:?} after it died ({sent_meanwhile} sent)",
            died.elapsed()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    eprintln!(
        "{transport}: refused {:?} after the receiver died ({sent_meanwhile} sends before): {refused}",
        died.elapsed()
    );
    assert!(
        engine.send(old, b"again").is_err(),
        "the old handle stays refused"
    );

    let (_restarted, again) = echo_server_at(transport, &name);
    assert_eq!(again, name, "restarted at the same address");
    let seg = engine.open_segment(&name).unwrap();
    engine.send(seg, b"to the restarted").unwrap();
    let echo = engine.recv(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(
        echo.expect("an echo from the restarted receiver").data,
        b"to the restarted"
    );
}

#[test]
fn a_sender_learns_its_receiver_died_and_reaches_its_restart_tcp() {
    a_sender_learns_its_receiver_died_and_reaches_its_restart("tcp");
}

#[test]
fn a_sender_learns_its_receiver_died_and_reaches_its_restart_shm() {
    a_sender_learns_its_receiver_died_and_reaches_its_restart("shm");
}
