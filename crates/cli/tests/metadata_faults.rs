//! A fault suite for the directory. Up to eight `multirail target` processes join and leave at
//! random (killed with SIGKILL, or stopped with SIGTERM) for a minute while the metadata store,
//! real etcd in one test and the real `multirail metadata-server` in the other, is stopped,
//! restarted with its data, and wiped at random moments; an engine in this process moves
//! verified bytes to the live targets throughout, and every segment ever started is looked up
//! again and again. What must hold:
//!
//! - no lookup returns the descriptor of a process that died longer than one lease ago (counted
//!   from its death, or from the store's return when it died while the store was away);
//! - every live engine is found once the store has been up for one lease plus one back-off
//!   step (during the run, and in a last check with the store up);
//! - no call blocks longer than its timeout;
//! - every transfer that got its segment moves the bytes it should.
//!
//! The run prints its counts. `MULTIRAIL_FAULT_SECS` shortens or lengthens the minute,
//! `MULTIRAIL_FAULT_SEED` replays a run.

mod common;
#[path = "../../multirail/tests/common/etcd.rs"]
mod etcd;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd::Etcd;
use multirail::metadata::{EtcdMetadata, HttpMetadata, MetadataStore};
use multirail::{Config, Engine, Error, Location, Request, SegmentId};
use xxhash_rust::xxh3::xxh3_64;

/// `metadata.lease_ttl_s` of every engine, and the HTTP server's `--key-ttl-s`.
const TTL: Duration = Duration::from_secs(3);
/// `metadata.timeout_ms` of every engine and lookup.
const TIMEOUT: Duration = Duration::from_millis(500);
/// The longest back-off step: the keeper never waits longer than a third of the lease.
const BACKOFF_CAP: Duration = Duration::from_secs(1);
/// What a loaded two-core machine may add to a deadline: etcd's expiry pass runs every
/// 500 ms, and ten processes share the cores.
const SLACK: Duration = Duration::from_millis(1500);
/// Live targets at most.
const MAX_TARGETS: usize = 8;
/// Bytes each target serves, and each transfer moves.
const BUFFER: usize = 256 << 10;

/// SplitMix64: a seeded sequence, so a failing run can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The store under test, as the suite drives it.
trait Store {
    /// The `metadata` section of an engine's configuration (without `segment_name`).
    fn metadata_json(&self) -> String;
    /// A client of the store, for lookups that go to it every time.
    fn client(&self) -> Box<dyn MetadataStore>;
    fn running(&self) -> bool;
    fn stop(&mut self);
    /// Starts it again with the data it had.
    fn restart(&mut self);
    /// Starts it again with no data.
    fn wipe(&mut self);
    /// Freezes it (SIGSTOP): connections stay open and nothing answers, so every call runs
    /// into its timeout.
    fn freeze(&mut self);
    /// Lets a frozen store run again.
    fn thaw(&mut self);
}

impl Store for Etcd {
    fn metadata_json(&self) -> String {
        format!(
            r#""type": "etcd", "servers": "{}", "lease_ttl_s": {}, "timeout_ms": {}"#,
            self.url(),
            TTL.as_secs(),
            TIMEOUT.as_millis()
        )
    }

    fn client(&self) -> Box<dyn MetadataStore> {
        Box::new(
            EtcdMetadata::new(&self.url(), "multirail/", None, TIMEOUT, TTL.as_secs()).unwrap(),
        )
    }

    fn running(&self) -> bool {
        Etcd::running(self)
    }

    fn stop(&mut self) {
        self.kill();
    }

    fn restart(&mut self) {
        Etcd::restart(self);
    }

    fn wipe(&mut self) {
        self.restart_empty();
    }

    fn freeze(&mut self) {
        self.pause();
    }

    fn thaw(&mut self) {
        self.resume();
    }
}

/// The real `multirail metadata-server`, persisting to a directory and expiring keys not PUT
/// again within the lease.
struct HttpServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl HttpServer {
    fn new() -> HttpServer {
        // Restarted on the same port: one no outgoing connection can take meanwhile.
        let port = etcd::free_port();
        let dir = std::env::temp_dir().join(format!(
            "multirail-fault-meta-{}-{port}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let mut server = HttpServer {
            port,
            dir,
            child: None,
        };
        server.restart();
        server
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/metadata", self.port)
    }
}

impl Store for HttpServer {
    fn metadata_json(&self) -> String {
        format!(
            r#""type": "http", "servers": "{}", "lease_ttl_s": {}, "timeout_ms": {}"#,
            self.url(),
            TTL.as_secs(),
            TIMEOUT.as_millis()
        )
    }

    fn client(&self) -> Box<dyn MetadataStore> {
        Box::new(HttpMetadata::new(&self.url(), "multirail/", None, TIMEOUT).unwrap())
    }

    fn running(&self) -> bool {
        self.child.is_some()
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restart(&mut self) {
        self.stop();
        let listen = format!("127.0.0.1:{}", self.port);
        let deadline = Instant::now() + Duration::from_secs(10);
        // The port may still be held for a moment by the process just killed.
        loop {
            let mut child = Command::new(common::multirail_bin())
                .args(["metadata-server", "--listen", &listen, "--data-dir"])
                .arg(&self.dir)
                .args(["--key-ttl-s", &TTL.as_secs().to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start multirail metadata-server");
            let mut line = String::new();
            let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
            if line.starts_with("http://") {
                self.child = Some(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            assert!(
                Instant::now() < deadline,
                "the metadata server does not start on {listen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wipe(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
        self.restart();
    }

    fn freeze(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    fn thaw(&mut self) {
        self.signal(libc::SIGCONT);
    }
}

impl HttpServer {
    fn signal(&self, sig: libc::c_int) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid; it takes no memory.
            unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `multirail target` of the suite.
struct Target {
    child: Child,
    /// Its buffer's address.
    addr: u64,
    started: Instant,
}

/// What became of a segment name (each target has a name of its own).
enum Fate {
    Live(Target),
    Dead(Instant),
}

/// What a run saw.
#[derive(Default, Debug)]
struct Counts {
    joins: u64,
    kills: u64,
    terminations: u64,
    store_stops: u64,
    store_restarts: u64,
    store_wipes: u64,
    store_freezes: u64,
    lookups: u64,
    lookups_found: u64,
    lookups_unavailable: u64,
    transfers_verified: u64,
    transfers_without_segment: u64,
    stale_answers: u64,
    live_missing: u64,
    transfer_failures: u64,
    slow_calls: u64,
    longest_call: Duration,
    /// The latest a dead engine was still found, past its death (or the store's return) plus
    /// one lease.
    worst_stale_lateness: Duration,
}

/// The suite over one store.
struct Suite<S: Store> {
    store: S,
    name_prefix: &'static str,
    names: BTreeMap<String, Fate>,
    next_id: u64,
    /// When the store last came back up (or started, or thawed).
    up_since: Instant,
    /// The store is frozen (SIGSTOP).
    frozen: bool,
    /// Faults of a running store so far; picks the next kind.
    fault_turn: u64,
    lookup: Box<dyn MetadataStore>,
    engine: Engine,
    /// Segments the engine has opened, by name.
    opened: BTreeMap<String, SegmentId>,
    src: multirail::Buffer,
    back: multirail::Buffer,
    counts: Counts,
    problems: Vec<String>,
}

impl<S: Store> Suite<S> {
    fn new(store: S, name_prefix: &'static str) -> Suite<S> {
        let lookup = store.client();
        let config = Config::from_json_str(
            &format!(r#"{{"metadata": {{{}}}}}"#, store.metadata_json()),
            "fault suite",
        )
        .unwrap();
        let engine = Engine::new(config, "127.0.0.1:0").unwrap();
        let src = engine.allocate(BUFFER, Location::Any).unwrap();
        let back = engine.allocate(BUFFER, Location::Any).unwrap();
        Suite {
            store,
            name_prefix,
            names: BTreeMap::new(),
            next_id: 0,
            up_since: Instant::now(),
            frozen: false,
            fault_turn: 0,
            lookup,
            engine,
            opened: BTreeMap::new(),
            src,
            back,
            counts: Counts::default(),
            problems: Vec::new(),
        }
    }

    fn live(&self) -> Vec<String> {
        self.names
            .iter()
            .filter(|(_, f)| matches!(f, Fate::Live(_)))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Times a call against the store's timeout (plus the scheduling margin etcd's client
    /// gets, and the slack).
    fn timed<T>(&mut self, what: &str, limit: Duration, call: impl FnOnce(&mut Self) -> T) -> T {
        let t0 = Instant::now();
        let out = call(self);
        let took = t0.elapsed();
        self.counts.longest_call = self.counts.longest_call.max(took);
        if took > limit + Duration::from_millis(500) + SLACK {
            self.counts.slow_calls += 1;
            self.problems
                .push(format!("{what} blocked {took:?} (its limit is {limit:?})"));
        }
        out
    }

    fn join(&mut self) {
        let name = format!("{}-{}", self.name_prefix, self.next_id);
        self.next_id += 1;
        let conf = format!(
            r#"{{"metadata": {{{}, "segment_name": "{name}"}}}}"#,
            self.store.metadata_json()
        );
        let mut child = Command::new(common::multirail_bin())
            .args(["target", "--listen", "127.0.0.1:0", "--size", "256KiB"])
            .env("MULTIRAIL_CONF", conf)
            .env_remove("MULTIRAIL_METADATA")
            .env_remove("MULTIRAIL_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start multirail target");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (mut first, mut second) = (String::new(), String::new());
        let _ = out.read_line(&mut first);
        let _ = out.read_line(&mut second);
        assert!(
            first.starts_with("127.0.0.1:"),
            "the target prints its address first, got {first:?}"
        );
        let addr = second
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr=0x"))
            .and_then(|a| u64::from_str_radix(a, 16).ok())
            .unwrap_or_else(|| panic!("no buffer address in {second:?}"));
        self.counts.joins += 1;
        self.names.insert(
            name,
            Fate::Live(Target {
                child,
                addr,
                started: Instant::now(),
            }),
        );
    }

    fn leave(&mut self, rng: &mut Rng) {
        let live = self.live();
        let name = live[rng.below(live.len())].clone();
        let Some(Fate::Live(mut target)) = self.names.remove(&name) else {
            unreachable!()
        };
        let kill = rng.chance(0.5);
        let sig = if kill { libc::SIGKILL } else { libc::SIGTERM };
        // SAFETY: kill(2) on our own child's pid; it takes no memory.
        unsafe { libc::kill(target.child.id() as libc::pid_t, sig) };
        // A stopping target withdraws its key, bounded by the store's timeout.
        let _ = target.child.wait();
        if kill {
            self.counts.kills += 1;
        } else {
            self.counts.terminations += 1;
        }
        self.opened.remove(&name);
        self.names.insert(name, Fate::Dead(Instant::now()));
    }

    fn store_fault(&mut self, rng: &mut Rng) {
        if self.frozen {
            self.store.thaw();
            self.frozen = false;
        } else if self.store.running() {
            // Each kind in turn, at random moments, so even a short run sees them all.
            self.fault_turn += 1;
            match self.fault_turn % 4 {
                0 => {
                    self.store.stop();
                    self.counts.store_stops += 1;
                    return;
                }
                1 => {
                    self.store.freeze();
                    self.frozen = true;
                    self.counts.store_freezes += 1;
                    return;
                }
                2 => {
                    self.store.restart();
                    self.counts.store_restarts += 1;
                }
                _ => {
                    self.store.wipe();
                    self.counts.store_wipes += 1;
                }
            }
        } else if rng.chance(0.6) {
            self.store.restart();
            self.counts.store_restarts += 1;
        } else {
            self.store.wipe();
            self.counts.store_wipes += 1;
        }
        self.up_since = Instant::now();
    }

    /// Whether the store is running and not frozen.
    fn store_up(&self) -> bool {
        self.store.running() && !self.frozen
    }

    /// Looks every name up in the store and checks what came back against what is known of
    /// its engine: a dead one must be gone one lease after its death (or the store's return),
    /// a live one found once the store has been up for one lease plus one back-off step.
    fn look_up_all(&mut self, rng: &mut Rng) {
        let mut names: Vec<String> = self.names.keys().cloned().collect();
        if self.frozen {
            // Every lookup of a frozen store waits out its timeout: a few per round suffice.
            for _ in 0..names.len().saturating_sub(3) {
                names.swap_remove(rng.below(names.len()));
            }
        }
        for name in names {
            let found = self.timed("a lookup", TIMEOUT, |s| s.lookup.fetch(&name));
            self.counts.lookups += 1;
            let now = Instant::now();
            let store_up = self.store_up();
            match (&found, &self.names[&name]) {
                (Ok(_), Fate::Dead(died)) => {
                    self.counts.lookups_found += 1;
                    let gone_by = (*died).max(self.up_since) + TTL;
                    if now > gone_by {
                        let late = now - gone_by;
                        self.counts.worst_stale_lateness =
                            self.counts.worst_stale_lateness.max(late);
                        if late > SLACK {
                            self.counts.stale_answers += 1;
                            self.problems.push(format!(
                                "{name} died {:?} ago and is still found",
                                died.elapsed()
                            ));
                        }
                    }
                }
                (Ok(_), Fate::Live(_)) => self.counts.lookups_found += 1,
                (Err(Error::SegmentUnreachable { reason, .. }), Fate::Live(t))
                    if reason.contains("not registered") =>
                {
                    let due = t.started.max(self.up_since) + TTL + BACKOFF_CAP + SLACK;
                    if store_up && now > due {
                        self.counts.live_missing += 1;
                        self.problems.push(format!(
                            "{name} is alive and not registered {:?} after the store came up",
                            self.up_since.elapsed()
                        ));
                    }
                }
                (Err(Error::SegmentUnreachable { reason, .. }), _)
                    if reason.contains("not registered") => {}
                (Err(_), _) => self.counts.lookups_unavailable += 1,
            }
        }
    }

    /// Writes a fresh pattern to a random live target and reads it back.
    fn transfer(&mut self, rng: &mut Rng, round: u64) {
        let live = self.live();
        if live.is_empty() {
            return;
        }
        let name = live[rng.below(live.len())].clone();
        let addr = match &self.names[&name] {
            Fate::Live(t) => t.addr,
            Fate::Dead(_) => unreachable!(),
        };
        let segment = match self.opened.get(&name) {
            Some(s) => *s,
            None => match self.timed("open_segment", TIMEOUT * 2, |s| {
                s.engine.open_segment(&name)
            }) {
                Ok(s) => {
                    self.opened.insert(name.clone(), s);
                    s
                }
                Err(_) => {
                    // Not registered yet, or the store is away: the segment is unknown.
                    self.counts.transfers_without_segment += 1;
                    return;
                }
            },
        };
        // SAFETY: no transfer is in flight on these buffers between rounds.
        let src = unsafe { self.src.as_mut_slice() };
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i as u64).wrapping_mul(round | 1).to_le_bytes()[0] ^ (round as u8);
        }
        let want = xxh3_64(src);
        let outcome = self.timed("a transfer", Duration::from_secs(10), |s| {
            for request in [
                Request::write(s.src.addr(), segment, addr, BUFFER as u64),
                Request::read(s.back.addr(), segment, addr, BUFFER as u64),
            ] {
                let batch = s.engine.allocate_batch(1)?;
                s.engine.submit(batch, &[request])?;
                let waited = s.engine.wait(batch, Some(Duration::from_secs(10)));
                s.engine.free_batch(batch)?;
                waited?;
            }
            Ok::<(), Error>(())
        });
        match outcome {
            // SAFETY: both batches completed; nothing writes `back` now.
            Ok(()) if xxh3_64(unsafe { self.back.as_slice() }) == want => {
                self.counts.transfers_verified += 1
            }
            Ok(()) => {
                self.counts.transfer_failures += 1;
                self.problems.push(format!(
                    "bytes read back from {name} differ from those written"
                ));
            }
            Err(e) => {
                self.counts.transfer_failures += 1;
                self.problems
                    .push(format!("a transfer to live target {name} failed: {e}"));
            }
        }
    }

    /// The last check: the store up for good, every live engine found within one lease plus
    /// one back-off step, every dead one gone within its lease.
    fn settle(&mut self, rng: &mut Rng) {
        if self.frozen {
            self.store.thaw();
            self.frozen = false;
            self.up_since = Instant::now();
        }
        if !self.store.running() {
            self.store.restart();
            self.counts.store_restarts += 1;
            self.up_since = Instant::now();
        }
        let last_death = self
            .names
            .values()
            .filter_map(|f| match f {
                Fate::Dead(d) => Some(*d),
                Fate::Live(_) => None,
            })
            .max()
            .unwrap_or(self.up_since);
        let until = self.up_since.max(last_death) + TTL + BACKOFF_CAP + SLACK + SLACK;
        while Instant::now() < until {
            self.look_up_all(rng);
            std::thread::sleep(Duration::from_millis(200));
        }
        // Now everything has had its time: the answers must be exact.
        for (name, fate) in &self.names {
            let found = self.lookup.fetch(name);
            match (fate, found) {
                (Fate::Live(_), Err(e)) => self
                    .problems
                    .push(format!("live {name} is not found with the store up: {e}")),
                (Fate::Dead(_), Ok(_)) => self
                    .problems
                    .push(format!("dead {name} is still found with the store up")),
                _ => {}
            }
        }
    }

    fn run(mut self, seed: u64, length: Duration) {
        let mut rng = Rng(seed);
        let t0 = Instant::now();
        let mut round = 0;
        let mut next_fault = t0 + Duration::from_secs(2);
        while t0.elapsed() < length {
            round += 1;
            let live = self.live().len();
            if live < MAX_TARGETS && (live < 2 || rng.chance(0.3)) {
                self.join();
            } else if live > 0 && rng.chance(0.25) {
                self.leave(&mut rng);
            }
            if Instant::now() >= next_fault {
                self.store_fault(&mut rng);
                // A frozen store thaws soon: every call meanwhile waits out its timeout.
                let (lo, hi) = if self.frozen {
                    (500, 2000)
                } else {
                    (1500, 5000)
                };
                next_fault =
                    Instant::now() + Duration::from_millis((lo + rng.below(hi - lo)) as u64);
            }
            self.look_up_all(&mut rng);
            self.transfer(&mut rng, round);
            std::thread::sleep(Duration::from_millis(50 + rng.below(200) as u64));
        }
        self.settle(&mut rng);
        let c = &self.counts;
        println!(
            "fault suite ({}; seed {seed}; {:?}): joins {}, leaves {} ({} SIGKILL, {} SIGTERM), \
             store faults {} ({} stops, {} freezes, {} restarts, {} wipes), lookups {} ({} found, {} with \
             the store away), transfers verified {}, transfers without a segment yet {}, \
             stale answers {}, live engines missing {}, transfer failures {}, calls over \
             their timeout {}, longest call {:?}, latest dead answer {:?} past its lease",
            self.name_prefix,
            t0.elapsed(),
            c.joins,
            c.kills + c.terminations,
            c.kills,
            c.terminations,
            c.store_stops + c.store_freezes + c.store_restarts + c.store_wipes,
            c.store_stops,
            c.store_freezes,
            c.store_restarts,
            c.store_wipes,
            c.lookups,
            c.lookups_found,
            c.lookups_unavailable,
            c.transfers_verified,
            c.transfers_without_segment,
            c.stale_answers,
            c.live_missing,
            c.transfer_failures,
            c.slow_calls,
            c.longest_call,
            c.worst_stale_lateness,
        );
        assert!(
            c.joins > 8
                && c.kills > 0
                && c.terminations > 0
                && c.store_wipes > 0
                && c.store_freezes > 0,
            "the run exercised too little: {c:?}"
        );
        assert!(c.transfers_verified > 0, "no transfer got through: {c:?}");
        assert!(
            self.problems.is_empty(),
            "{} problems:\n{}",
            self.problems.len(),
            self.problems.join("\n")
        );
    }
}

impl<S: Store> Drop for Suite<S> {
    fn drop(&mut self) {
        for fate in self.names.values_mut() {
            if let Fate::Live(t) = fate {
                let _ = t.child.kill();
                let _ = t.child.wait();
            }
        }
    }
}

fn seed(salt: u64) -> u64 {
    std::env::var("MULTIRAIL_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0000 + salt)
}

fn length() -> Duration {
    let secs = std::env::var("MULTIRAIL_FAULT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

#[test]
fn engines_come_and_go_while_etcd_is_stopped_restarted_and_wiped() {
    Suite::new(Etcd::start(), "etcd-seg").run(seed(1), length());
}

#[test]
fn engines_come_and_go_while_the_http_metadata_server_is_stopped_restarted_and_wiped() {
    Suite::new(HttpServer::new(), "http-seg").run(seed(2), length());
}
