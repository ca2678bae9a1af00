//! The dispatcher in virtual time, against the real DeviceSelector.

use super::*;
use crate::selector::{DeviceSelector, SelectorConfig};
use proptest::prelude::*;

const US: u64 = 1_000;
const MS: u64 = 1_000_000;

/// A piece of request `req` covering `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Piece {
    req: u32,
    offset: u64,
    len: u64,
    /// Whether its transport has probes ([`Payload::probe`]).
    probes: bool,
}

/// The request a probe stands for: none.
const PROBE_REQ: u32 = u32::MAX;

impl Payload for Piece {
    fn len(&self) -> u64 {
        self.len
    }

    fn split_off(&mut self, at: u64) -> Piece {
        assert!(at > 0 && at < self.len, "split {at} of {}", self.len);
        assert!(!self.is_probe(), "a probe was cut");
        let rest = Piece {
            req: self.req,
            offset: self.offset + at,
            len: self.len - at,
            probes: self.probes,
        };
        self.len = at;
        rest
    }

    fn has_probes(&self) -> bool {
        self.probes
    }

    fn probe(&self, len: u64) -> Option<Piece> {
        self.probes.then_some(Piece {
            req: PROBE_REQ,
            offset: 0,
            len,
            probes: true,
        })
    }

    fn is_probe(&self) -> bool {
        self.req == PROBE_REQ
    }
}

/// The engine-wide view, over a real selector; `high`/`bulk` say which priorities are active.
struct Host {
    selector: DeviceSelector,
    high: bool,
    bulk: bool,
    slot_admits_all: bool,
    unassigned: u64,
    holds: u32,
    /// Answers reported app-limited.
    limited: u64,
}

impl Host {
    fn new(gbps: &[f64], smart: bool) -> Host {
        let cfg = SelectorConfig {
            enable_smart_scheduling: smart,
            min_bandwidth_gbps: 0.001,
            ..SelectorConfig::default()
        };
        let reported: Vec<Option<f64>> = gbps.iter().map(|g| Some(*g)).collect();
        Host {
            selector: DeviceSelector::new(cfg, &reported, 7),
            high: false,
            bulk: false,
            slot_admits_all: true,
            unassigned: 0,
            holds: 0,
            limited: 0,
        }
    }
}

impl Rails<Piece> for Host {
    fn smart(&self) -> bool {
        self.selector.config().enable_smart_scheduling
    }
    fn slot_admits(&self, priority: Priority) -> bool {
        self.slot_admits_all || priority == Priority::High
    }
    fn rail_admits(&self, _rail: RailId, _priority: Priority) -> bool {
        true
    }
    fn has_work(&self, priority: Priority) -> bool {
        if priority == Priority::High {
            self.high
        } else {
            self.bulk
        }
    }
    fn tiers(&mut self, _item: &Piece, out: &mut Vec<u8>) {
        out.clear();
        out.resize(self.selector.num_rails(), 0);
    }
    fn bandwidths(&mut self, out: &mut [f64]) {
        for (rail, bw) in out.iter_mut().enumerate() {
            *bw = self
                .selector
                .rail_stats(rail)
                .map_or(0.0, |s| s.ewma_gbps * 1e9 / 8.0);
        }
    }
    fn link_bandwidth(&mut self, rail: RailId) -> f64 {
        self.selector
            .rail_stats(rail)
            .map_or(0.0, |s| s.theoretical_gbps * 1e9 / 8.0)
    }

    fn select(&mut self, candidates: &[Vec<RailId>; 3], shape: SliceShape, out: &mut Vec<RailId>) {
        let tiers: [&[RailId]; 3] = [&candidates[0], &candidates[1], &candidates[2]];
        if self.selector.select(&tiers, shape, out).is_err() {
            out.clear();
        }
    }
    fn delivered(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_ns: u64,
        now_ns: u64,
        app_limited: bool,
    ) {
        self.limited += u64::from(app_limited);
        self.selector
            .on_delivered(rail, bytes, posted_ns, now_ns, app_limited)
            .unwrap();
    }
    fn failed(&mut self, rail: RailId, bytes: u64) {
        self.selector.on_failed(rail, bytes).unwrap();
    }
    fn recovered(&mut self, rail: RailId, now_ns: u64) {
        self.selector.on_recovered(rail, now_ns).unwrap();
    }
    fn stalled(&mut self, rail: RailId, bytes: u64, posted_ns: u64, now_ns: u64) {
        self.selector
            .on_stalled(rail, bytes, posted_ns, now_ns)
            .unwrap();
    }
    fn unassigned(&mut self, rail: RailId, bytes: u64) {
        self.unassigned += bytes;
        self.selector.on_unassigned(rail, bytes).unwrap();
    }
    fn slot_holds_work(&mut self) {
        self.holds += 1;
    }
}

fn config() -> DispatchConfig {
    DispatchConfig {
        timeout_ns: 1_000 * MS,
        max_retries: 3,
        ..DispatchConfig::default()
    }
}

fn dispatcher(paths: usize) -> Dispatcher<Piece> {
    let rails: Vec<RailId> = (0..paths).collect();
    let mut d = Dispatcher::new(config(), &rails);
    for p in 0..paths {
        d.on_path(0, p, 2);
    }
    d
}

fn pieces(req: u32, count: u64, len: u64) -> Vec<Piece> {
    (0..count)
        .map(|i| Piece {
            req,
            offset: i * len,
            len,
            probes: false,
        })
        .collect()
}

/// [`pieces`] of a transport that has probes.
fn probing_pieces(req: u32, count: u64, len: u64) -> Vec<Piece> {
    let mut v = pieces(req, count, len);
    for p in &mut v {
        p.probes = true;
    }
    v
}

fn drain(d: &mut Dispatcher<Piece>, now: u64, host: &mut Host) -> Vec<Post<Piece>> {
    std::iter::from_fn(|| d.poll_post(now, host)).collect()
}

#[test]
fn slices_go_out_only_while_windows_have_room() {
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    d.on_submit(0, Priority::Low, pieces(0, 200, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    // Before any round trip a path holds two initial windows (LOW alone), and the slice that
    // crosses that line: 2 × 2 MiB in all, plus at most a slice per path.
    let total: u64 = posts.iter().map(|p| p.item.len).sum();
    assert!(total >= 2 * 2 * DEFAULT_INITIAL_WINDOW);
    assert!(total <= 2 * 2 * DEFAULT_INITIAL_WINDOW + 2 * (64 << 10));
    assert!(posts.iter().all(|p| p.connection == Connection::Shared));
    assert_eq!(d.depths()[Priority::Low.index()], 200 - posts.len());
    // An answer frees room; the dispatcher asks to be polled once half a window drained.
    let mut refill = false;
    for p in posts.iter().take(20) {
        refill |= d.on_completed(100 * US, p.id, None, &mut host);
    }
    assert!(refill);
    assert!(!drain(&mut d, 100 * US, &mut host).is_empty());
}

#[test]
fn a_rail_assumed_far_faster_than_it_carries_is_not_dealt_past_the_peers_timeout() {
    // A rail assumed at 400 Gbit/s (a rail given by hand without its speed) that a token
    // bucket holds at 100 Mbit/s (12.5 MB/s), one FIFO stream, 64 MiB of 128 KiB slices (what
    // four bench threads queue at once) and the engine's 5 s timeout. The first answer used
    // to open a window of a millisecond at the assumed speed (50 MB): the whole transfer went
    // out at once, its last slice 5.4 s behind the first, and the path was dropped as silent.
    let mut host = Host::new(&[400.0], true);
    let mut d = Dispatcher::new(
        DispatchConfig {
            timeout_ns: 5_000 * MS,
            ..config()
        },
        &[0],
    );
    d.on_path(0, 0, 2);
    let slice = 128u64 << 10;
    let rate = 12.5e6;
    d.on_submit(0, Priority::Low, pieces(0, 512, slice));
    // Posted slices in the link's order, each with the time its last byte arrives.
    let mut link: VecDeque<(Post<Piece>, u64)> = VecDeque::new();
    let mut link_free = 0u64;
    let (mut now, mut delivered, mut most_in_flight, mut longest_wait) = (0u64, 0u64, 0u64, 0u64);
    loop {
        for post in drain(&mut d, now, &mut host) {
            link_free = link_free.max(now) + (post.item.len as f64 * 1e9 / rate) as u64;
            link.push_back((post, link_free));
        }
        most_in_flight = most_in_flight.max(d.in_flight(0));
        let Some((post, done)) = link.pop_front() else {
            break;
        };
        // The dispatcher's timer runs through the wait, as the engine's does.
        while let Some(due) = d.poll_timeout().filter(|&t| t < done) {
            now = now.max(due);
            d.on_timeout(now, &mut host);
            assert_eq!(d.poll_event(), None, "at {} ms", now / MS);
            now += MS;
        }
        now = done;
        // The link is FIFO: the slice it answers is the path's oldest.
        let posted = d.paths[0].oldest_posted_ns().expect("a slice in flight");
        longest_wait = longest_wait.max(done - posted);
        d.on_completed(now, post.id, None, &mut host);
        delivered += post.item.len;
    }
    assert_eq!(delivered, 512 * slice, "every slice answered");
    assert!(d.poll_failed().is_none());
    // Slow start: never more in flight than the initial window plus what was answered, and
    // the estimate then learns the rail long before its queue nears the timeout.
    assert!(
        most_in_flight < 8 << 20,
        "{most_in_flight} bytes in flight at once"
    );
    assert!(
        longest_wait < 1_000 * MS,
        "a slice waited {} ms",
        longest_wait / MS
    );
}

#[test]
fn high_takes_the_reserved_connection_and_goes_first() {
    let mut host = Host::new(&[100.0], true);
    host.bulk = true;
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 4, 64 << 10));
    d.on_submit(0, Priority::High, pieces(1, 2, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert_eq!(posts[0].priority, Priority::High);
    assert_eq!(posts[1].priority, Priority::High);
    assert_eq!(posts[0].connection, Connection::Reserved);
    assert_eq!(posts[1].connection, Connection::Reserved);
    assert_eq!(posts[2].priority, Priority::Low);
}

#[test]
fn a_large_high_transfer_spreads_over_the_connections_of_a_lone_fast_path_while_no_bulk_moves() {
    let mut host = Host::new(&[100.0], true);
    let mut d = dispatcher(1);
    // HIGH alone, several slices: every one may spread, the first too (on the reserved
    // connection it would make a third stream beside the two the others take turns on).
    d.on_submit(0, Priority::High, pieces(0, 8, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert_eq!(posts.len(), 8);
    assert!(posts.iter().all(|p| p.connection == Connection::Spread));
    for p in &posts {
        d.on_completed(10 * US, p.id, None, &mut host);
    }
    // A request of one slice on the idle path: the reserved connection.
    d.on_submit(20 * US, Priority::High, pieces(1, 1, 4096));
    let one = drain(&mut d, 20 * US, &mut host);
    assert_eq!(one[0].connection, Connection::Reserved);
    d.on_completed(30 * US, one[0].id, None, &mut host);
    // Bulk queued or moving anywhere in the engine: every HIGH slice keeps to the reserved
    // connection, so none queues behind bulk bytes.
    host.bulk = true;
    d.on_submit(40 * US, Priority::High, pieces(2, 8, 64 << 10));
    let posts = drain(&mut d, 40 * US, &mut host);
    assert_eq!(posts.len(), 8);
    assert!(posts.iter().all(|p| p.connection == Connection::Reserved));
    // Over two paths a HIGH transfer already takes two streams: every slice stays reserved.
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    d.on_submit(0, Priority::High, pieces(4, 8, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert_eq!(posts.len(), 8);
    assert!(posts.iter().all(|p| p.connection == Connection::Reserved));
    // A rail one stream fills (1 Gbit/s) keeps HIGH on the reserved connection alone.
    let mut host = Host::new(&[1.0], true);
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::High, pieces(3, 8, 16 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert!(posts.len() > 1);
    assert!(posts.iter().all(|p| p.connection == Connection::Reserved));
}

#[test]
fn a_fast_link_estimated_slow_still_spreads_high_and_a_slow_link_does_not() {
    // Slices answered slowly (each of 8 × 64 KiB a millisecond after the one before: about
    // 65 MB/s) teach both rails an estimate far below the spreading bar.
    fn taught_slow(gbps: f64) -> (Dispatcher<Piece>, Host) {
        let mut host = Host::new(&[gbps], true);
        let mut d = dispatcher(1);
        let mut now = 0;
        for round in 0..20 {
            d.on_submit(now, Priority::High, pieces(round, 8, 64 << 10));
            let posts = drain(&mut d, now, &mut host);
            for p in &posts {
                now += MS;
                d.on_completed(now, p.id, None, &mut host);
            }
        }
        assert!(
            d.fastest_usable_bandwidth() < SPREAD_MIN_BYTES_PER_SEC,
            "estimate {} B/s",
            d.fastest_usable_bandwidth()
        );
        (d, host)
    }
    // A 100 Gbit/s link held back by what each slice costs: a second connection helps.
    let (mut d, mut host) = taught_slow(100.0);
    d.on_submit(100 * MS, Priority::High, pieces(100, 8, 4096));
    // (The slow estimate's small window lets only some of the slices go now.)
    let posts = drain(&mut d, 100 * MS, &mut host);
    assert!(posts.len() > 1, "{} posted", posts.len());
    assert!(posts.iter().all(|p| p.connection == Connection::Spread));
    // A 10 Gbit/s link (a policed veth reports this): one stream fills it.
    let (mut d, mut host) = taught_slow(10.0);
    d.on_submit(100 * MS, Priority::High, pieces(100, 8, 4096));
    let posts = drain(&mut d, 100 * MS, &mut host);
    assert!(posts.len() > 1, "{} posted", posts.len());
    assert!(posts.iter().all(|p| p.connection == Connection::Reserved));
}

#[test]
fn high_alone_is_refilled_in_batches_and_high_beside_bulk_at_every_answer() {
    // HIGH alone, far more queued than the window holds: the first answers leave more than
    // half of it in flight, so they ask for no deal; the path is refilled once half of it has
    // drained, several slices at once.
    fn high_backlog(bulk: bool) -> (Dispatcher<Piece>, Host, Vec<Post<Piece>>) {
        let mut host = Host::new(&[100.0], true);
        host.high = true;
        host.bulk = bulk;
        let mut d = dispatcher(1);
        d.on_submit(0, Priority::High, pieces(0, 4000, 4096));
        let posts = drain(&mut d, 0, &mut host);
        (d, host, posts)
    }
    let (mut d, mut host, posts) = high_backlog(false);
    assert!(posts.len() > 8, "{} posted", posts.len());
    assert!(!d.on_completed(10 * US, posts[0].id, None, &mut host));
    let first_refill = posts[1..]
        .iter()
        .position(|p| d.on_completed(10 * US, p.id, None, &mut host))
        .expect("refilled once half the window drained");
    assert!(
        first_refill > 2,
        "refilled after {} answers",
        first_refill + 2
    );
    assert!(drain(&mut d, 10 * US, &mut host).len() > 2);
    // The same beside bulk: every answer deals the next HIGH slice at once.
    let (mut d, mut host, posts) = high_backlog(true);
    assert!(posts.len() > 1);
    assert!(d.on_completed(10 * US, posts[0].id, None, &mut host));
}

#[test]
fn bulk_beside_high_is_cut_to_what_a_slow_rail_moves_in_the_high_wait() {
    // 1 Gbps = 125 MB/s: 250 µs of it is 31 250 bytes → 28 KiB in whole pages.
    let mut host = Host::new(&[1.0], true);
    host.high = true;
    host.bulk = true;
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 1, 1 << 20));
    let posts = drain(&mut d, 0, &mut host);
    assert!(!posts.is_empty());
    assert_eq!(posts[0].item.len, 28 << 10);
    // The rest waits at the head and leaves in request order, every byte once.
    let mut all: Vec<Piece> = posts.iter().map(|p| p.item.clone()).collect();
    let mut t = 0;
    let mut out = posts;
    while d.has_outstanding() {
        t += 10 * US;
        for p in out.drain(..) {
            d.on_completed(t, p.id, None, &mut host);
        }
        out = drain(&mut d, t, &mut host);
        all.extend(out.iter().map(|p| p.item.clone()));
        assert!(t < 10_000 * MS, "no progress");
    }
    let offsets: Vec<u64> = all.iter().map(|p| p.offset).collect();
    let mut sorted = offsets.clone();
    sorted.sort();
    assert_eq!(offsets, sorted, "pieces leave in request order");
    assert_eq!(all.iter().map(|p| p.len).sum::<u64>(), 1 << 20);
}

#[test]
fn baseline_mode_waits_for_the_rail_it_chose() {
    let mut host = Host::new(&[100.0, 100.0], false);
    let mut d = dispatcher(2);
    d.on_submit(0, Priority::Low, pieces(0, 100, 1 << 20));
    let posts = drain(&mut d, 0, &mut host);
    // Round-robin: alternate rails, each up to its full window (the initial 1 MiB).
    let rails: Vec<RailId> = posts.iter().map(|p| p.rail).collect();
    assert_eq!(rails, vec![0, 1]);
    // The third slice was charged to rail 0 and waits for room there, though rail 1 frees first.
    d.on_completed(10 * US, posts[1].id, None, &mut host);
    assert!(drain(&mut d, 10 * US, &mut host).is_empty());
    d.on_completed(20 * US, posts[0].id, None, &mut host);
    let next = drain(&mut d, 20 * US, &mut host);
    assert_eq!(next[0].rail, 0);
}

#[test]
fn a_refused_slice_returns_to_the_head() {
    let mut host = Host::new(&[100.0], true);
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 3, 4096));
    let mut posts = drain(&mut d, 0, &mut host);
    assert_eq!(posts.len(), 3);
    let first = posts.remove(0);
    let offset = first.item.offset;
    d.on_refused(1, first, &mut host);
    assert_eq!(d.in_flight(0), 2 * 4096);
    let again = drain(&mut d, 2, &mut host);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].item.offset, offset);
}

#[test]
fn a_rail_that_goes_down_has_its_slices_dealt_to_the_others() {
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    d.on_submit(0, Priority::Low, pieces(0, 8, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert_eq!(posts.len(), 8);
    // Path 0's connections die: its slices come back, and the path has none left.
    d.on_path(100 * US, 0, 0);
    let mut redealt = Vec::new();
    for p in posts {
        if p.path == 0 {
            redealt.push(p.item.offset);
            d.on_failed(100 * US, p.id, p.item, Cause::Lost, &mut host);
        } else {
            d.on_completed(100 * US, p.id, None, &mut host);
        }
    }
    assert!(!redealt.is_empty());
    let again = drain(&mut d, 100 * US, &mut host);
    assert!(again.iter().all(|p| p.path == 1));
    let mut offsets: Vec<u64> = again.iter().map(|p| p.item.offset).collect();
    offsets.sort();
    redealt.sort();
    assert_eq!(offsets, redealt);
    assert!(d.poll_failed().is_none());
}

#[test]
fn retries_are_bounded() {
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    d.on_submit(0, Priority::Low, pieces(0, 1, 4096));
    for attempt in 0..=config().max_retries {
        let post = d.poll_post(attempt as u64, &mut host).expect("dealt");
        d.on_failed(attempt as u64, post.id, post.item, Cause::Lost, &mut host);
    }
    let f = d.poll_failed().expect("given up");
    assert_eq!(f.verdict, Verdict::Failed(Cause::Lost));
    assert!(!d.has_outstanding());
}

#[test]
fn a_silent_peer_fails_everything_with_the_timeout() {
    let mut host = Host::new(&[100.0], true);
    let mut d = dispatcher(1);
    // HIGH: no promotion check wakes the dispatcher before the deadlines.
    d.on_submit(0, Priority::High, pieces(0, 100, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert_eq!(d.poll_timeout(), Some(500 * MS + 1));
    d.on_timeout(500 * MS + 1, &mut host);
    // One path: nothing else answers, so it is not "stalled", and the peer is not silent yet.
    assert_eq!(d.poll_event(), None);
    // The half-timeout deadline has passed and must not be reported again at once: a timer
    // that fires at each deadline would spin until the whole timeout. It looks again a
    // sixteenth of the timeout later, a bounded number of times.
    let mut now = 500 * MS + 1;
    let mut wakes = 0;
    loop {
        let deadline = d.poll_timeout().unwrap();
        assert!(deadline > now, "deadline {deadline} not after {now}");
        assert!(deadline <= 1_000 * MS + 1);
        now = deadline;
        wakes += 1;
        if now == 1_000 * MS + 1 {
            break;
        }
        d.on_timeout(now, &mut host);
        assert_eq!(d.poll_event(), None);
    }
    assert!(wakes <= 9, "{wakes} wakes between half and whole timeout");
    d.on_timeout(1_000 * MS + 1, &mut host);
    assert_eq!(d.poll_event(), Some(Event::Silent));
    assert!(d.is_silent());
    let queued = std::iter::from_fn(|| d.poll_failed()).count();
    assert_eq!(queued, 100 - posts.len());
    for p in posts {
        d.on_failed(1_000 * MS + 2, p.id, p.item, Cause::Lost, &mut host);
        assert_eq!(d.poll_failed().unwrap().verdict, Verdict::Timeout);
    }
    assert!(std::iter::from_fn(|| d.poll_event()).all(|e| e == Event::Silent));
    assert!(!d.has_outstanding());
    assert_eq!(d.poll_timeout(), None);
}

#[test]
fn an_answer_pushes_the_deadline_back() {
    let mut host = Host::new(&[100.0], true);
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 100, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    d.on_completed(900 * MS, posts[0].id, None, &mut host);
    d.on_timeout(1_000 * MS + 1, &mut host);
    assert_ne!(d.poll_event(), Some(Event::Silent));
    d.on_timeout(1_900 * MS + 1, &mut host);
    assert_eq!(d.poll_event(), Some(Event::Silent));
}

#[test]
fn a_stalled_path_is_dropped_while_another_answers() {
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    d.on_submit(0, Priority::Low, pieces(0, 4, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    // Path 1 answers everything; path 0 nothing.
    let (stuck, answered): (Vec<_>, Vec<_>) = posts.into_iter().partition(|p| p.path == 0);
    assert!(!stuck.is_empty() && !answered.is_empty());
    for p in answered {
        d.on_completed(100 * US, p.id, None, &mut host);
    }
    d.on_timeout(500 * MS + 1, &mut host);
    assert_eq!(
        d.poll_event(),
        Some(Event::DropPath {
            path: 0,
            stalled: true
        })
    );
    // Not asked again while its slices come back.
    d.on_timeout(600 * MS, &mut host);
    assert_eq!(d.poll_event(), None);
    d.on_path(600 * MS, 0, 0);
    for p in stuck {
        d.on_failed(600 * MS, p.id, p.item, Cause::Timeout, &mut host);
    }
    assert!(d.poll_failed().is_none(), "retried on path 1");
    let again = drain(&mut d, 600 * MS, &mut host);
    assert!(!again.is_empty() && again.iter().all(|p| p.path == 1));
}

/// A dispatcher of two paths (rails 0 and 1) with a 10 s timeout: the overdue rule, not half
/// the timeout, is what gives a stuck path up.
fn two_paths_ten_second_timeout() -> Dispatcher<Piece> {
    let cfg = DispatchConfig {
        timeout_ns: 10_000 * MS,
        ..config()
    };
    let mut d = Dispatcher::new(cfg, &[0, 1]);
    d.on_path(0, 0, 2);
    d.on_path(0, 1, 2);
    d
}

/// Both rails at 10 Gbit/s under [`two_paths_ten_second_timeout`]: a batch of 8 × 64 KiB dealt
/// at 0, path 1's share answered at 1 ms, path 0's (returned) still in flight.
fn path_0_stuck_under_a_batch() -> (Dispatcher<Piece>, Host, Vec<Post<Piece>>) {
    let mut host = Host::new(&[10.0, 10.0], true);
    let mut d = two_paths_ten_second_timeout();
    d.on_submit(0, Priority::Low, pieces(0, 8, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    let (stuck, answered): (Vec<_>, Vec<_>) = posts.into_iter().partition(|p| p.path == 0);
    assert!(!stuck.is_empty() && !answered.is_empty());
    for p in answered {
        d.on_completed(MS, p.id, None, &mut host);
    }
    (d, host, stuck)
}

#[test]
fn a_path_whose_slices_are_overdue_is_dropped_once_another_answered_since() {
    // Both rails estimated at 10 Gbit/s: what path 0 has in flight should take well under a
    // millisecond, so its oldest slice is overdue after the 500 ms floor, not 5 s.
    let (mut d, mut host, stuck) = path_0_stuck_under_a_batch();
    let due = d.poll_timeout().expect("a deadline for the stuck path");
    assert!(due <= 500 * MS + 1, "looked at only at {due} ns");
    d.on_timeout(400 * MS, &mut host);
    assert_eq!(d.poll_event(), None, "dropped before it was overdue");
    d.on_timeout(500 * MS + 1, &mut host);
    assert_eq!(
        d.poll_event(),
        Some(Event::DropPath {
            path: 0,
            stalled: true
        })
    );
    // The rail delivered nothing in half a second: its estimate falls from 10 Gbit/s to what a
    // slice in that time is at most (64 KiB over 0.5 s: 1 Mbit/s).
    let estimate = host.selector.rail_stats(0).unwrap().ewma_gbps;
    assert!(
        estimate < 0.01,
        "rail 0 still estimated at {estimate} Gbit/s"
    );
    assert!(host.selector.rail_stats(1).unwrap().ewma_gbps > 1.0);
    d.on_path(501 * MS, 0, 0);
    for p in stuck {
        d.on_failed(501 * MS, p.id, p.item, Cause::Timeout, &mut host);
    }
    assert!(d.poll_failed().is_none(), "retried on path 1");
    let again = drain(&mut d, 501 * MS, &mut host);
    assert!(!again.is_empty() && again.iter().all(|p| p.path == 1));
}

#[test]
fn a_slice_is_overdue_by_the_estimate_it_was_dealt_on_not_one_lowered_since() {
    // Rail 0 at 10 Gbit/s when its slices went out; then a sample of a trickle lowers its
    // estimate to 80 kbit/s (a rail collapsing under a policer) before any of them is overdue.
    // At that estimate its oldest 64 KiB slice takes 6.5 s, and it would be given up on only
    // at half the timeout (5 s): the batch holding it would wait that long.
    let (mut d, mut host, _stuck) = path_0_stuck_under_a_batch();
    host.selector.on_stalled(0, 1_000, 0, 100 * MS).unwrap();
    assert!(host.selector.rail_stats(0).unwrap().ewma_gbps < 1e-4);
    // The dispatcher takes the lowered estimate when it next deals.
    d.on_submit(100 * MS, Priority::Low, pieces(1, 1, 4096));
    for p in drain(&mut d, 100 * MS, &mut host) {
        if p.path == 1 {
            d.on_completed(101 * MS, p.id, None, &mut host);
        }
    }
    d.on_timeout(500 * MS + 1, &mut host);
    assert_eq!(
        d.poll_event(),
        Some(Event::DropPath {
            path: 0,
            stalled: true
        }),
        "not overdue at the floor"
    );
}

/// Two paths at 10 Gbit/s; path 0 stalls under a batch and is given up on at 0.5 s, its slices
/// retried and answered on path 1, and it is connected again at 0.6 s (answering the probe its
/// health asks for).
fn stalled_and_reconnected(host: &mut Host) -> Dispatcher<Piece> {
    let mut d = two_paths_ten_second_timeout();
    d.on_submit(0, Priority::Low, pieces(0, 8, 64 << 10));
    let posts = drain(&mut d, 0, host);
    let (stuck, answered): (Vec<_>, Vec<_>) = posts.into_iter().partition(|p| p.path == 0);
    for p in answered {
        d.on_completed(MS, p.id, None, host);
    }
    d.on_timeout(500 * MS + 1, host);
    assert!(matches!(
        d.poll_event(),
        Some(Event::DropPath {
            path: 0,
            stalled: true
        })
    ));
    d.on_path(501 * MS, 0, 0);
    for p in stuck {
        d.on_failed(501 * MS, p.id, p.item, Cause::Timeout, host);
    }
    for p in drain(&mut d, 501 * MS, host) {
        assert_eq!(p.path, 1);
        d.on_completed(502 * MS, p.id, None, host);
    }
    d.on_path(600 * MS, 0, 2);
    d.on_timeout(600 * MS, host);
    while let Some(ev) = d.poll_event() {
        if let Event::Probe(p) = ev {
            d.on_probe(600 * MS, p, true);
        }
    }
    assert!(d.is_usable(0), "path 0 not back");
    d
}

#[test]
fn a_rail_given_up_on_as_stalled_takes_one_page_at_a_time_until_it_answers() {
    let mut host = Host::new(&[10.0, 10.0], true);
    let mut d = stalled_and_reconnected(&mut host);
    // Just back: the batch goes to path 1 alone, though path 0 has room in any window.
    d.on_submit(600 * MS, Priority::Low, pieces(1, 8, 64 << 10));
    let posts = drain(&mut d, 600 * MS, &mut host);
    assert!(!posts.is_empty() && posts.iter().all(|p| p.path == 1));
    for p in posts {
        d.on_completed(610 * MS, p.id, None, &mut host);
    }
    // Idle long enough for a probe (20 pages' time at the estimate of about 1 Mbit/s the
    // stall left): one page, and no more while it is out.
    let t = 1_500 * MS;
    d.on_submit(t, Priority::Low, pieces(2, 256, 64 << 10));
    let mut on_0 = Vec::new();
    for round in 0..4 {
        for p in drain(&mut d, t + round * MS, &mut host) {
            if p.path == 0 {
                on_0.push(p);
            } else {
                d.on_completed(t + round * MS + 1, p.id, None, &mut host);
            }
        }
    }
    assert_eq!(
        on_0.len(),
        1,
        "path 0 took {} slices on probation",
        on_0.len()
    );
    assert_eq!(on_0[0].item.len, 4096);
    // It answers at 0.1 Mbit/s (a page in 0.33 s): that is learned, though the rail was idle
    // before it, and the probation ends.
    let page = on_0.pop().unwrap();
    let limited = host.limited;
    d.on_completed(t + 330 * MS, page.id, None, &mut host);
    let estimate = host.selector.rail_stats(0).unwrap().ewma_gbps;
    assert!(
        (0.00005..0.0002).contains(&estimate),
        "rail 0 estimated at {estimate} Gbit/s after its probe"
    );
    assert_eq!(
        host.limited, limited,
        "the probe's answer was taken as app-limited"
    );
    // Slow, it does not end the probation: the next page is the way back for this rail.
    assert!(d.paths[0].probation);
}

/// With a transport that has probes, a path on probation is tried with a probe of a page and
/// takes none of the requests' bytes: every slice of the batch goes to the path that did not
/// stall, the probe's answer is learned as the page's would be, and a probe whose connection
/// fails is dropped, neither retried nor failed as anyone's work.
#[test]
fn a_rail_on_probation_is_tried_with_probes_and_no_request_waits_on_it() {
    let mut host = Host::new(&[10.0, 10.0], true);
    let mut d = stalled_and_reconnected(&mut host);
    let t = 1_500 * MS;
    let n = 256;
    d.on_submit(t, Priority::Low, probing_pieces(2, n, 64 << 10));
    let mut on_0 = Vec::new();
    let mut carried = 0;
    for round in 0..400 {
        for p in drain(&mut d, t + round * MS, &mut host) {
            if p.path == 0 {
                on_0.push(p);
            } else {
                assert_eq!(p.item.req, 2);
                carried += p.item.len;
                d.on_completed(t + round * MS + 1, p.id, None, &mut host);
            }
        }
    }
    assert_eq!(carried, n * (64 << 10), "path 1 carried the whole request");
    assert_eq!(
        on_0.len(),
        1,
        "path 0 took {} posts on probation",
        on_0.len()
    );
    let probe = on_0.pop().unwrap();
    assert!(probe.item.is_probe() && probe.item.len == 4096, "{probe:?}");
    // Its slow answer (0.1 Mbit/s) is learned, and keeps the path on probation.
    d.on_completed(t + 400 * MS, probe.id, None, &mut host);
    let estimate = host.selector.rail_stats(0).unwrap().ewma_gbps;
    assert!(
        (0.00005..0.0002).contains(&estimate),
        "rail 0 estimated at {estimate} Gbit/s after its probe"
    );
    assert!(d.paths[0].probation);
    // The next probe's connection fails: it is gone for good.
    let t = 3_000 * MS;
    d.on_submit(t, Priority::Low, probing_pieces(3, n, 64 << 10));
    let mut probes = Vec::new();
    for round in 0..400 {
        for p in drain(&mut d, t + round * MS, &mut host) {
            if p.item.is_probe() {
                probes.push(p);
            } else {
                assert_eq!(p.path, 1);
                d.on_completed(t + round * MS + 1, p.id, None, &mut host);
            }
        }
    }
    assert_eq!(probes.len(), 1);
    let probe = probes.pop().unwrap();
    d.on_failed(t + 400 * MS, probe.id, probe.item, Cause::Lost, &mut host);
    assert!(d.poll_failed().is_none(), "a probe failed as work");
    let again = drain(&mut d, t + 400 * MS, &mut host);
    assert!(
        again.iter().all(|p| !p.item.is_probe() || p.path == 0),
        "a failed probe was retried elsewhere: {again:?}"
    );
}

#[test]
fn a_path_on_probation_is_dealt_as_any_other_when_no_other_path_can_take_the_work() {
    let mut host = Host::new(&[10.0, 10.0], true);
    let mut d = stalled_and_reconnected(&mut host);
    d.on_path(600 * MS, 1, 0);
    assert!(!d.is_usable(1));
    d.on_submit(600 * MS, Priority::Low, pieces(1, 8, 64 << 10));
    let posts = drain(&mut d, 600 * MS, &mut host);
    assert!(!posts.is_empty() && posts.iter().all(|p| p.path == 0));
    assert!(
        posts.iter().all(|p| p.item.len == 64 << 10),
        "cut to pages with nowhere else to go"
    );
}

/// Deals `n` slices of 64 KiB at `now`, answers at once those that went to path 1 and returns
/// those that went to path 0.
fn deal_and_answer_path_1(
    d: &mut Dispatcher<Piece>,
    host: &mut Host,
    now: u64,
    req: u32,
    n: u64,
) -> Vec<Post<Piece>> {
    d.on_submit(now, Priority::Low, pieces(req, n, 64 << 10));
    let mut on_0 = Vec::new();
    for step in 0..4 {
        for p in drain(d, now + step * US, host) {
            if p.path == 0 {
                on_0.push(p);
            } else {
                d.on_completed(now + step * US + 1, p.id, None, host);
            }
        }
    }
    on_0
}

#[test]
fn a_rail_that_stalls_again_stays_on_probation_twice_as_long() {
    let mut host = Host::new(&[10.0, 10.0], true);
    // Stalled at 0.5 s: on probation until at least 1.5 s.
    let mut d = stalled_and_reconnected(&mut host);
    assert!(d.paths[0].probation);
    assert_eq!(d.paths[0].probation_until_ns, 1_500 * MS + 1);
    // A page answers at once (a policer's burst lets it through), but before 1.5 s that does
    // not end the probation, and it takes nothing more than a page meanwhile.
    let mut now = 1_200 * MS;
    let mut pages = 0;
    while now < 1_500 * MS {
        for p in deal_and_answer_path_1(&mut d, &mut host, now, 1, 64) {
            assert_eq!(p.item.len, 4096, "a slice of {} on probation", p.item.len);
            pages += 1;
            d.on_completed(now + 100 * US, p.id, None, &mut host);
        }
        now += 100 * MS;
    }
    assert!(pages >= 1, "no page dealt on probation");
    assert!(d.paths[0].probation);
    // Answered at once, the page brought the estimate back to before the stall.
    let estimate = host.selector.rail_stats(0).unwrap().ewma_gbps;
    assert!(estimate > 5.0, "rail 0 estimated at {estimate} Gbit/s");
    // Path 1 goes away: path 0 takes whole slices, and the first answered past 1.5 s ends the
    // probation. The rest stall once path 1 is back and answering; not forgiven (it answered a
    // page and a slice since), the second stall in a row holds it on probation for 2 s.
    let now = 1_600 * MS;
    d.on_path(now, 1, 0);
    d.on_submit(now, Priority::Low, pieces(2, 8, 64 << 10));
    let mut stuck = drain(&mut d, now, &mut host);
    assert!(stuck.len() > 1 && stuck.iter().all(|p| p.path == 0 && p.item.len == 64 << 10));
    let first = stuck.remove(0);
    d.on_completed(now + 100 * US, first.id, None, &mut host);
    assert!(!d.paths[0].probation);
    d.on_path(now, 1, 2);
    deal_and_answer_path_1(&mut d, &mut host, now + MS, 3, 4);
    // Overdue by the rule of the module doc, however low the estimate the first stall left.
    let (stalled_at, dropped) = loop {
        let due = d.poll_timeout().expect("a deadline for the stuck slices");
        assert!(
            due < now + 5_000 * MS,
            "not dropped within half the timeout"
        );
        d.on_timeout(due, &mut host);
        if let Some(ev) = d.poll_event() {
            break (due, ev);
        }
    };
    assert_eq!(
        dropped,
        Event::DropPath {
            path: 0,
            stalled: true
        }
    );
    assert_eq!(d.paths[0].probation_until_ns, stalled_at + 2_000 * MS);
    assert_eq!(d.paths[0].stalls, 2);
    // A megabyte answered forgives the stalls: the next probation would be 1 s again.
    for p in stuck {
        d.on_failed(stalled_at, p.id, p.item, Cause::Timeout, &mut host);
    }
    d.on_path(stalled_at, 0, 0);
    d.on_path(stalled_at + MS, 0, 2);
    d.on_path(stalled_at + MS, 1, 0);
    d.on_submit(stalled_at + MS, Priority::Low, pieces(4, 32, 64 << 10));
    let mut now = stalled_at + MS;
    while d.paths[0].stalls > 0 && now < stalled_at + 100 * MS {
        for p in drain(&mut d, now, &mut host) {
            d.on_completed(now + 10 * US, p.id, None, &mut host);
        }
        now += MS;
    }
    assert_eq!(d.paths[0].stalls, 0, "not forgiven after a megabyte");
}

#[test]
fn an_overdue_path_is_kept_while_no_other_answered_since_its_slice_went_out() {
    let mut host = Host::new(&[10.0, 10.0], true);
    let mut d = two_paths_ten_second_timeout();
    d.on_submit(0, Priority::Low, pieces(0, 8, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    assert!(posts.iter().any(|p| p.path == 0) && posts.iter().any(|p| p.path == 1));
    // Nothing answers anywhere: the peer may be stuck as a whole, which only its own deadline
    // decides. The dispatcher looks again now and then, never in a loop.
    let mut now = 0;
    let mut wakes = 0;
    while now < 5_000 * MS {
        let due = d.poll_timeout().expect("a deadline");
        assert!(due > now, "deadline {due} not after {now}");
        now = due;
        wakes += 1;
        d.on_timeout(now, &mut host);
        assert_eq!(d.poll_event(), None, "a path dropped at {now} ns");
    }
    assert!(wakes <= 20, "{wakes} wakes before half the timeout");
}

#[test]
fn a_slow_rail_that_moves_is_not_taken_for_a_stalled_one_until_it_stops() {
    // Rail 0 estimated at 10 Mbit/s answers a 64 KiB slice every 52 ms, oldest first, while rail
    // 1 answers at once: however long its queue, it is answering, so it stays. Round robin, so
    // the slow rail takes its share.
    let mut host = Host::new(&[0.01, 10.0], false);
    let mut d = two_paths_ten_second_timeout();
    d.on_submit(0, Priority::Low, pieces(0, 64, 64 << 10));
    let mut slow: VecDeque<Post<Piece>> = VecDeque::new();
    let mut now = 0;
    let slice_ns = ((64 << 10) as f64 / (0.01e9 / 8.0) * 1e9) as u64;
    let mut answered_slow = 0;
    while now < 2_000 * MS {
        for p in drain(&mut d, now, &mut host) {
            if p.path == 0 {
                slow.push_back(p);
            } else {
                d.on_completed(now + US, p.id, None, &mut host);
            }
        }
        now += slice_ns;
        if let Some(p) = slow.pop_front() {
            d.on_completed(now, p.id, None, &mut host);
            answered_slow += 1;
        }
        d.on_timeout(now, &mut host);
        let events: Vec<Event> = std::iter::from_fn(|| d.poll_event()).collect();
        assert!(
            events.iter().all(|e| !matches!(e, Event::DropPath { .. })),
            "rail 0 dropped at {now} ns while it answers: {events:?}"
        );
        if d.queue.depths().iter().all(|&n| n == 0) {
            d.on_submit(now, Priority::Low, pieces(1, 16, 64 << 10));
        }
    }
    assert!(answered_slow > 20, "{answered_slow} answered");
    // Then it stops answering: given up on within the floor and a recheck, not half the
    // timeout, as long as rail 1 keeps answering.
    let stopped = now;
    loop {
        now += 10 * MS;
        for p in drain(&mut d, now, &mut host) {
            if p.path == 1 {
                d.on_completed(now + US, p.id, None, &mut host);
            }
        }
        if d.queue.depths().iter().all(|&n| n == 0) {
            d.on_submit(now, Priority::Low, pieces(2, 4, 64 << 10));
        }
        d.on_timeout(now, &mut host);
        if std::iter::from_fn(|| d.poll_event()).any(|e| {
            e == Event::DropPath {
                path: 0,
                stalled: true,
            }
        }) {
            break;
        }
        assert!(
            now - stopped < 1_000 * MS,
            "still not dropped after {} ns",
            now - stopped
        );
    }
    assert!(
        now - stopped > 400 * MS,
        "dropped {} ns after it stopped",
        now - stopped
    );
}

#[test]
fn a_probe_of_a_rail_estimated_far_slower_than_the_rest_is_one_page() {
    // Rail 0 estimated at 1 Mbit/s, rail 1 at 10 Gbit/s: the slow rail takes nothing of a batch
    // (it would finish late) until it has been idle long enough for a probe, and the probe is
    // cut to a page: a whole 64 KiB slice would hold the batch half a second at the estimate,
    // and seconds on a rail slower still.
    let mut host = Host::new(&[0.001, 10.0], true);
    let mut d = two_paths_ten_second_timeout();
    d.on_submit(0, Priority::Low, pieces(0, 16, 64 << 10));
    let first = drain(&mut d, 0, &mut host);
    assert!(
        first.iter().all(|p| p.path == 1),
        "the slow rail took part of the batch"
    );
    for p in &first {
        d.on_completed(MS, p.id, None, &mut host);
    }
    assert!(drain(&mut d, MS, &mut host).iter().all(|p| p.path == 1));
    let later = 11_000 * MS;
    // More than rail 1's window holds (a millisecond's round trip and a millisecond of queue
    // at 10 Gbit/s): the probe goes to rail 0 once rail 1 is full.
    d.on_submit(later, Priority::Low, pieces(1, 256, 64 << 10));
    let posts = drain(&mut d, later, &mut host);
    let probe: Vec<_> = posts.iter().filter(|p| p.path == 0).collect();
    assert_eq!(probe.len(), 1, "one probe: {probe:?}");
    assert_eq!(probe[0].item.len, PAGE);
    // The rest of the probed slice is still dealt: nothing is lost.
    let mut moved: u64 = posts.iter().map(|p| p.item.len).sum();
    for p in &posts {
        d.on_completed(later + MS, p.id, None, &mut host);
    }
    let mut now = later + MS;
    while d.has_outstanding() {
        let more = drain(&mut d, now, &mut host);
        now += MS;
        for p in &more {
            moved += p.item.len;
            d.on_completed(now, p.id, None, &mut host);
        }
        assert!(now < later + 1_000 * MS, "the batch never finished");
    }
    assert_eq!(moved, 256 * (64 << 10));
}

#[test]
fn a_stall_counts_once_however_many_connections_its_drop_closes() {
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    let threshold = config().health.error_threshold;
    d.on_submit(0, Priority::Low, pieces(0, 4, 64 << 10));
    let posts = drain(&mut d, 0, &mut host);
    let (stuck, answered): (Vec<_>, Vec<_>) = posts.into_iter().partition(|p| p.path == 0);
    for p in answered {
        d.on_completed(100 * US, p.id, None, &mut host);
    }
    d.on_timeout(500 * MS + 1, &mut host);
    assert!(matches!(
        d.poll_event(),
        Some(Event::DropPath { path: 0, .. })
    ));
    // The drop closes every connection of the path; each reports its loss.
    for _ in 0..threshold + 1 {
        assert!(
            !d.on_path_error(501 * MS, 0),
            "a closed connection paused the rail"
        );
    }
    d.on_path(502 * MS, 0, 0);
    for p in stuck {
        d.on_failed(502 * MS, p.id, p.item, Cause::Timeout, &mut host);
    }
    // Remade: the path carries again, and later losses count as errors again.
    d.on_path(600 * MS, 0, 4);
    assert!(d.is_usable(0));
    let mut paused = false;
    for i in 0..threshold - 1 {
        paused = d.on_path_error(601 * MS + i as u64, 0);
    }
    assert!(
        paused,
        "the stall and {} more errors make {threshold}",
        threshold - 1
    );
    assert!(!d.is_usable(0));
}

#[test]
fn a_path_that_keeps_failing_is_paused_then_probed_back() {
    let mut host = Host::new(&[100.0, 100.0], true);
    let mut d = dispatcher(2);
    let cfg = config().health;
    let mut paused = false;
    for i in 0..cfg.error_threshold {
        paused = d.on_path_error(i as u64, 0);
    }
    assert!(paused && !d.is_usable(0) && d.is_usable(1));
    let probe_at = d.poll_timeout().expect("probe due");
    assert_eq!(probe_at, 2 + cfg.initial_pause_ns);
    d.on_timeout(probe_at, &mut host);
    assert_eq!(d.poll_event(), Some(Event::Probe(0)));
    d.on_probe(probe_at + 1, 0, true);
    assert!(d.is_usable(0));
}

#[test]
fn every_path_paused_fails_the_queue_at_once() {
    let mut host = Host::new(&[100.0], true);
    let mut d = dispatcher(1);
    for i in 0..config().health.error_threshold {
        d.on_path_error(i as u64, 0);
    }
    d.on_submit(10, Priority::High, pieces(0, 2, 4096));
    assert!(d.poll_post(10, &mut host).is_none());
    assert_eq!(d.poll_failed().unwrap().verdict, Verdict::RailsDown);
    assert!(d.is_dead());
}

#[test]
fn a_slot_that_holds_work_back_says_so() {
    let mut host = Host::new(&[100.0], true);
    host.slot_admits_all = false;
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 2, 4096));
    assert!(d.poll_post(0, &mut host).is_none());
    assert_eq!(host.holds, 1);
    host.slot_admits_all = true;
    assert!(d.poll_post(1, &mut host).is_some());
}

#[derive(Debug, Clone)]
enum Op {
    Submit { prio: u8, count: u64, len: u64 },
    Post,
    Complete(usize),
    Fail(usize, bool),
    Refuse,
    PathDown(usize),
    PathUp(usize),
    High(bool),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3, 1u64..6, 1u64..(300 << 10)).prop_map(|(prio, count, len)| Op::Submit {
            prio,
            count,
            len
        }),
        Just(Op::Post),
        Just(Op::Post),
        (0usize..64).prop_map(Op::Complete),
        (0usize..64).prop_map(Op::Complete),
        (0usize..64, any::<bool>()).prop_map(|(i, t)| Op::Fail(i, t)),
        Just(Op::Refuse),
        (0usize..3).prop_map(Op::PathDown),
        (0usize..3).prop_map(Op::PathUp),
        any::<bool>().prop_map(Op::High),
        (1u64..400).prop_map(|ms| Op::Advance(ms * MS)),
    ]
}

/// Drives a dispatcher through `ops`, then lets every path answer until nothing is
/// outstanding. Returns the finished pieces (completed or failed) and the requests' lengths.
fn run(ops: &[Op], smart: bool) -> Result<(Vec<Piece>, Vec<u64>), TestCaseError> {
    let mut host = Host::new(&[1.0, 10.0, 100.0], smart);
    let mut d = dispatcher(3);
    let mut now = 0u64;
    let mut lengths = Vec::new();
    let mut inflight: Vec<Post<Piece>> = Vec::new();
    let mut done: Vec<Piece> = Vec::new();
    let post_all =
        |d: &mut Dispatcher<Piece>, now: u64, host: &mut Host, inflight: &mut Vec<Post<Piece>>| {
            // What each path held before this round, plus what the round added so far: what a
            // slice found ahead of it when it was dealt (posts leave in dealing order).
            let mut ahead: Vec<u64> = (0..3).map(|q| d.in_flight(q)).collect();
            while let Some(p) = d.poll_post(now, host) {
                // HIGH never waits behind more than one window of bulk: bulk goes on a path
                // beside active HIGH work only while less than a full window is in flight.
                if p.priority != Priority::High && host.high && smart {
                    let full = d.window(p.path, p.item.len).full;
                    prop_assert!(
                        ahead[p.path] < full,
                        "bulk posted on path {} holding {} of window {}",
                        p.path,
                        ahead[p.path],
                        full
                    );
                }
                ahead[p.path] += p.item.len;
                inflight.push(p);
            }
            Ok(())
        };
    for op in ops {
        match op.clone() {
            Op::Submit { prio, count, len } => {
                let req = lengths.len() as u32;
                lengths.push(count * len);
                d.on_submit(now, Priority::ALL[prio as usize], pieces(req, count, len));
            }
            Op::Post => post_all(&mut d, now, &mut host, &mut inflight)?,
            Op::Complete(i) if !inflight.is_empty() => {
                let p = inflight.swap_remove(i % inflight.len());
                d.on_completed(now, p.id, None, &mut host);
                done.push(p.item);
            }
            Op::Fail(i, timeout) if !inflight.is_empty() => {
                let p = inflight.swap_remove(i % inflight.len());
                let cause = if timeout { Cause::Timeout } else { Cause::Lost };
                d.on_failed(now, p.id, p.item, cause, &mut host);
            }
            Op::Refuse if !inflight.is_empty() => {
                let p = inflight.pop().expect("non-empty");
                d.on_refused(now, p, &mut host);
            }
            Op::PathDown(p) => {
                d.on_path(now, p, 0);
                // Its connections die: what they carried comes back.
                let (gone, kept): (Vec<_>, Vec<_>) = inflight.drain(..).partition(|x| x.path == p);
                inflight = kept;
                for x in gone {
                    d.on_failed(now, x.id, x.item, Cause::Lost, &mut host);
                }
            }
            Op::PathUp(p) => d.on_path(now, p, 2),
            Op::High(on) => host.high = on,
            Op::Advance(dt) => {
                now += dt;
                d.on_timeout(now, &mut host);
                while let Some(e) = d.poll_event() {
                    match e {
                        Event::Silent => {
                            for x in inflight.drain(..) {
                                d.on_failed(now, x.id, x.item, Cause::Lost, &mut host);
                            }
                        }
                        Event::DropPath { path, .. } => {
                            d.on_path(now, path, 0);
                            let (gone, kept): (Vec<_>, Vec<_>) =
                                inflight.drain(..).partition(|x| x.path == path);
                            inflight = kept;
                            for x in gone {
                                d.on_failed(now, x.id, x.item, Cause::Timeout, &mut host);
                            }
                        }
                        Event::Probe(p) => d.on_probe(now, p, true),
                    }
                }
            }
            _ => {}
        }
        while let Some(f) = d.poll_failed() {
            done.push(f.item);
        }
        prop_assert_eq!(
            (0..3).map(|p| d.in_flight(p)).sum::<u64>(),
            inflight.iter().map(|p| p.item.len).sum::<u64>(),
            "in-flight accounting"
        );
    }
    // Wind down: every path up and answering.
    for p in 0..3 {
        d.on_path(now, p, 2);
    }
    let mut rounds = 0;
    while d.has_outstanding() || !inflight.is_empty() {
        rounds += 1;
        prop_assert!(rounds < 100_000, "no progress");
        now += MS;
        d.on_timeout(now, &mut host);
        while let Some(e) = d.poll_event() {
            if let Event::Probe(p) = e {
                d.on_probe(now, p, true);
            }
        }
        post_all(&mut d, now, &mut host, &mut inflight)?;
        for p in inflight.drain(..) {
            d.on_completed(now, p.id, None, &mut host);
            done.push(p.item);
        }
        while let Some(f) = d.poll_failed() {
            done.push(f.item);
        }
    }
    Ok((done, lengths))
}

fn check_coverage(done: &[Piece], lengths: &[u64]) -> Result<(), TestCaseError> {
    let mut by_req: Vec<Vec<(u64, u64)>> = vec![Vec::new(); lengths.len()];
    for p in done {
        prop_assert!(p.len > 0, "empty piece");
        by_req[p.req as usize].push((p.offset, p.len));
    }
    for (req, mut ranges) in by_req.into_iter().enumerate() {
        ranges.sort();
        let mut at = 0;
        for (off, len) in ranges {
            prop_assert_eq!(off, at, "request {} has a gap or overlap at {}", req, at);
            at = off + len;
        }
        prop_assert_eq!(at, lengths[req], "request {} not covered", req);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Whatever fails, is refused, retried or times out, every byte of every request finishes
    /// exactly once (completed or given up on), and the dispatcher's in-flight accounting
    /// matches what is really out.
    #[test]
    fn no_slice_is_lost_or_duplicated(ops in proptest::collection::vec(op(), 1..120), smart in any::<bool>()) {
        let (done, lengths) = run(&ops, smart)?;
        check_coverage(&done, &lengths)?;
    }

    /// In smart mode a path never holds more than its allowance (three full windows, HIGH
    /// beside bulk) plus the slice that crossed it.
    #[test]
    fn a_path_never_holds_more_than_its_allowance(
        count in 1u64..200,
        len in 1u64..(1 << 20),
        high in any::<bool>(),
    ) {
        let mut host = Host::new(&[1.0, 100.0], true);
        host.high = high;
        host.bulk = true;
        let mut d = dispatcher(2);
        d.on_submit(0, Priority::Low, pieces(0, count, len));
        d.on_submit(0, Priority::High, pieces(1, count, len));
        let posts = drain(&mut d, 0, &mut host);
        for p in 0..2 {
            let w = d.window(p, len);
            prop_assert!(d.in_flight(p) < 3 * w.full + len);
        }
        prop_assert!(!posts.is_empty());
    }
}

#[test]
fn a_trickle_with_nothing_queued_reports_app_limited_samples() {
    // HIGH slices one at a time on an idle 100 Gbps rail: each is alone, so its delivery rate
    // is the sender's, and the rail's estimate must not fall to it.
    let mut host = Host::new(&[100.0], true);
    host.high = true;
    let mut d = dispatcher(1);
    let mut t = 0;
    for i in 0..50 {
        d.on_submit(t, Priority::High, pieces(i, 1, 64 << 10));
        let posts = drain(&mut d, t, &mut host);
        assert_eq!(posts.len(), 1);
        // 64 KiB takes 5.2 µs at 100 Gbps; answered after 10 µs, then idle for 90.
        d.on_completed(t + 10 * US, posts[0].id, Some(t), &mut host);
        t += 100 * US;
    }
    assert_eq!(host.limited, 50);
    assert_eq!(host.selector.rail_stats(0).unwrap().ewma_gbps, 100.0);
}

#[test]
fn batches_below_a_long_paths_product_do_not_lower_the_estimate() {
    // One writer of 16 x 64 KiB batches on a 10 Gbps rail 10 ms away (12.5 MB on the way):
    // each batch queues behind itself at the sender, but the rail idles for most of the round
    // trip, and a batch's delivery rate is its size over the path's length (a tenth of a
    // Gbps). The slices come back when the estimate says they should: app-limited samples.
    let mut host = Host::new(&[10.0], true);
    let mut d = dispatcher(1);
    let ser = (65536.0 / (10.0 * 1e9 / 8.0) * 1e9) as u64;
    let mut t = 0;
    for batch in 0..20 {
        d.on_submit(t, Priority::Low, pieces(batch, 16, 64 << 10));
        let posts = drain(&mut d, t, &mut host);
        assert_eq!(posts.len(), 16, "the batch is dealt whole");
        let mut answered = t;
        for (k, p) in posts.iter().enumerate() {
            answered = t + 10 * MS + (k as u64 + 1) * ser;
            d.on_completed(answered, p.id, Some(t), &mut host);
        }
        t = answered + 10 * US;
    }
    // The first batch's slices found no product to compare with; every later one kept up.
    assert!(host.limited >= 19 * 16, "{} app-limited", host.limited);
    assert_eq!(host.selector.rail_stats(0).unwrap().ewma_gbps, 10.0);
    // A rail that really carries a tenth of that, 10 ms away: its slices come back late for
    // the estimate, and it falls.
    let mut slow = Host::new(&[10.0], true);
    let mut d = dispatcher(1);
    let mut t = 0;
    for batch in 0..20 {
        d.on_submit(t, Priority::Low, pieces(batch, 16, 64 << 10));
        let mut answered = t;
        for (k, p) in drain(&mut d, t, &mut slow).iter().enumerate() {
            answered = t + 10 * MS + (k as u64 + 1) * 10 * ser;
            d.on_completed(answered, p.id, Some(t), &mut slow);
        }
        t = answered + 10 * US;
    }
    let fell = slow.selector.rail_stats(0).unwrap().ewma_gbps;
    assert!(fell < 2.0, "estimate {fell} Gbps");
}

#[test]
fn slices_that_queued_behind_others_with_work_waiting_are_link_samples() {
    // A backlog on a rail that really carries 10 Gbps of its reported 100: slices wait behind
    // each other on the wire, so their samples show the link and the estimate falls to it.
    let mut host = Host::new(&[100.0], true);
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 4000, 64 << 10));
    let ser = (65536.0 / (10.0 * 1e9 / 8.0) * 1e9) as u64;
    let mut wire_free = 0u64;
    let mut now = 0u64;
    let mut inflight: VecDeque<(SliceId, u64)> = VecDeque::new();
    let mut linked = 0;
    for _ in 0..3000 {
        for p in drain(&mut d, now, &mut host) {
            inflight.push_back((p.id, now));
        }
        let Some((id, posted)) = inflight.pop_front() else {
            break;
        };
        wire_free = wire_free.max(posted) + ser;
        now = wire_free + 20 * US;
        let before = host.limited;
        d.on_completed(now, id, Some(posted), &mut host);
        linked += u64::from(host.limited == before);
    }
    assert!(linked > 2000, "{linked} link samples");
    let e = host.selector.rail_stats(0).unwrap().ewma_gbps;
    assert!((e - 10.0).abs() < 1.5, "estimate {e} Gbps");
}

#[test]
fn bulk_beside_high_keeps_at_least_a_pipe_in_flight() {
    // One 100 Gbps rail with a 10 µs fixed round trip: a pipe is 125 kB + the slice. Bulk
    // beside HIGH at the lean window (one product, so one pipe) must be refilled as soon as it
    // drops below a pipe, or the rail idles between answers and measures less than it carries.
    let mut host = Host::new(&[100.0], true);
    host.high = true;
    host.bulk = true;
    let mut d = dispatcher(1);
    d.on_submit(0, Priority::Low, pieces(0, 400, 64 << 10));
    let mut now = 0;
    // Every slice of the first deal answered after the fixed 10 µs plus its 5.2 µs on the
    // wire (as if each went alone): the round trip is learned.
    let rtt = 10 * US + 5_243;
    for p in drain(&mut d, now, &mut host) {
        now += 1;
        d.on_completed(now + rtt, p.id, Some(now), &mut host);
    }
    now += rtt;
    let w = d.window(0, 64 << 10);
    assert_eq!(w.pipe, w.lean);
    assert!(w.pipe >= 125_000 + (64 << 10) - 1, "{w:?}");
    let posts = drain(&mut d, now, &mut host);
    assert!(d.in_flight(0) >= w.pipe);
    // One answer takes it below the pipe: the dispatcher asks to be polled at once.
    now += 5 * US;
    assert!(d.on_completed(now, posts[0].id, Some(now - 15 * US), &mut host));
}

/// Runs batches of `count` slices of `len` bytes, one batch at a time as a single submitting
/// thread does, over paths that each serve their slices in order at `gbps[path]` (what the
/// selector is told, so its estimates are right from the start). Returns, per batch, how long
/// it took (ns) and how many of its bytes each path carried.
fn run_batches(gbps: &[f64], batches: usize, count: u64, len: u64) -> Vec<(u64, Vec<u64>)> {
    run_batches_at(Priority::Low, gbps, batches, count, len)
}

fn run_batches_at(
    priority: Priority,
    gbps: &[f64],
    batches: usize,
    count: u64,
    len: u64,
) -> Vec<(u64, Vec<u64>)> {
    let mut host = Host::new(gbps, true);
    run_batches_on(&mut host, priority, gbps, 0, batches, count, len)
}

/// As [`run_batches`], at `priority`, over paths that carry `gbps[path]` whatever `host`'s
/// selector was told, each slice answered `latency` ns after its last byte left.
fn run_batches_on(
    host: &mut Host,
    priority: Priority,
    gbps: &[f64],
    latency: u64,
    batches: usize,
    count: u64,
    len: u64,
) -> Vec<(u64, Vec<u64>)> {
    let mut d = dispatcher(gbps.len());
    let mut now = 0u64;
    // Per path: when its link is free, and its slices in flight with when each finishes.
    let mut free = vec![0u64; gbps.len()];
    let mut flight: Vec<(u64, SliceId, u64, u64)> = Vec::new();
    let mut out = Vec::new();
    for b in 0..batches {
        let start = now;
        let mut carried = vec![0u64; gbps.len()];
        host.high = priority == Priority::High;
        host.bulk = priority != Priority::High;
        d.on_submit(now, priority, pieces(b as u32, count, len));
        let mut left = count * len;
        while left > 0 {
            for post in drain(&mut d, now, host) {
                let p = post.path;
                let wire_ns = (post.item.len as f64 * 8.0 / gbps[p]) as u64;
                free[p] = free[p].max(now) + wire_ns;
                flight.push((free[p] + latency, post.id, now, post.item.len));
                carried[p] += post.item.len;
            }
            let (i, _) = flight
                .iter()
                .enumerate()
                .min_by_key(|(_, (at, _, _, _))| *at)
                .expect("slices in flight while the batch is not done");
            let (at, id, sent, bytes) = flight.swap_remove(i);
            now = at;
            d.on_completed(now, id, Some(sent), host);
            left -= bytes;
        }
        out.push((now - start, carried));
    }
    out
}

#[test]
fn the_tail_of_a_batch_is_not_left_to_a_slow_rail() {
    // Four rails policed at 150, 300, 450 and 600 Mbit/s; batches of 16 × 64 KiB. Dealt by
    // room alone, the 150 Mbit/s rail took a second slice whenever its window freed first
    // (7 ms for the two). The best split in whole slices (1, 3, 5 and 7) takes 6.1 ms; with
    // pieces cut at the tail the batch can come close to the rails' sum, 5.6 ms.
    let gbps = [0.15, 0.3, 0.45, 0.6];
    let batch = 16 * (64u64 << 10);
    let whole_slices_ns = 7 * (64u64 << 10) * 8 * 1_000 / 600;
    let sum_ns = batch * 8 * 1_000 / 1_500;
    for (i, (took_ns, carried)) in run_batches(&gbps, 20, 16, 64 << 10).iter().enumerate() {
        assert!(
            carried[0] <= 2 * batch / 10,
            "batch {i}: the slowest rail carried {carried:?}"
        );
        assert!(
            *took_ns < whole_slices_ns && *took_ns <= sum_ns + sum_ns / 20,
            "batch {i} took {took_ns} ns; whole slices {whole_slices_ns}, the sum {sum_ns} \
             ({carried:?})"
        );
    }
}

#[test]
fn equal_rails_share_every_batch() {
    // The horizon keeps nothing off rails of one speed.
    for (i, (_, carried)) in run_batches(&[0.6; 4], 10, 16, 64 << 10).iter().enumerate() {
        assert_eq!(carried, &vec![4 * (64 << 10); 4], "batch {i}");
    }
}

#[test]
fn the_usable_bandwidth_counts_each_usable_rail_once() {
    let mut host = Host::new(&[100.0, 50.0], true);
    // Paths 0 and 1 leave from rail 0, path 2 from rail 1.
    let mut d = Dispatcher::new(config(), &[0, 0, 1]);
    assert_eq!(d.usable_bandwidth(), 0.0, "no deal yet, no estimate");
    for p in 0..3 {
        d.on_path(0, p, 2);
    }
    d.on_submit(0, Priority::High, pieces(0, 1, 4096));
    let posts = drain(&mut d, 0, &mut host);
    assert_eq!(posts.len(), 1);
    let gbps = |bytes_per_sec: f64| bytes_per_sec * 8.0 / 1e9;
    assert!((gbps(d.usable_bandwidth()) - 150.0).abs() < 1e-6);
    assert!((gbps(d.fastest_usable_bandwidth()) - 100.0).abs() < 1e-6);
}

#[test]
fn a_rail_far_slower_than_the_rest_is_probed_rarely() {
    // A 2 Gbit/s rail beside one of 10 Mbit/s (a NIC that fell back to its slowest speed, a
    // management port), batches of 16 × 64 KiB from one thread: 4.2 ms each on the fast rail
    // alone, while one slice on the slow rail takes 52 ms. The horizon keeps the slow rail
    // off; its probes (the only slices it gets) each hold one batch back by a slice's time
    // there, so they must come rarely enough to cost a few percent. They came back to back:
    // the idle time that starts a probe was counted from the probe slice's post, which a
    // 52 ms slice has always passed by its answer, so every answer started the next probe
    // and batches waited on the slow rail half of the time (8 MB/s instead of 240 over
    // shaped veths).
    let gbps = [2.0, 0.01];
    let (count, len) = (16u64, 64u64 << 10);
    for priority in [Priority::Low, Priority::High] {
        let runs = run_batches_at(priority, &gbps, 400, count, len);
        let took: u64 = runs.iter().map(|(ns, _)| ns).sum();
        let fast_alone = 400 * count * len * 8 / 2;
        let slow_bytes: u64 = runs.iter().map(|(_, carried)| carried[1]).sum();
        assert!(
            took <= fast_alone + fast_alone / 10,
            "{priority:?}: 400 batches took {:.1} ms; the fast rail alone {:.1} ms; the slow \
             rail carried {} slices",
            took as f64 / 1e6,
            fast_alone as f64 / 1e6,
            slow_bytes / len
        );
        assert!(
            slow_bytes > 0,
            "{priority:?}: the slow rail was never probed"
        );
    }
}

#[test]
fn a_rail_far_slower_than_its_interface_says_is_learned_at_its_first_sample() {
    // Both interfaces say 10 Gbit/s; one carries 2 Gbit/s, the other is policed at 10 Mbit/s.
    // The first batches go out before anything is measured (the initial windows), and the
    // policed rail holds them back. Then its first pooled sample must replace the assumed
    // 10 Gbit/s: smoothed into it, a hundredth of the assumption (110 Mbit/s) stayed until the
    // next pooled sample, a megabyte later, and meanwhile every batch gave the policed rail a
    // piece it was estimated to finish with the rest and took ten times longer for.
    let mut host = Host::new(&[10.0, 10.0], true);
    let (count, len) = (16u64, 64u64 << 10);
    let runs = run_batches_on(
        &mut host,
        Priority::Low,
        &[2.0, 0.01],
        50 * US,
        300,
        count,
        len,
    );
    let estimate = host.selector.rail_stats(1).unwrap().ewma_gbps;
    assert!(
        (0.008..0.012).contains(&estimate),
        "estimate {estimate} Gbit/s"
    );
    let initial = runs
        .iter()
        .take_while(|(_, carried)| carried[1] >= 8 * len)
        .count();
    assert!(
        initial <= 2,
        "{initial} batches gave the policed rail its initial window"
    );
    let later = &runs[initial..];
    let took: u64 = later.iter().map(|(ns, _)| ns).sum();
    let batch_alone = count * len * 8 / 2 + 50 * US;
    let fast_alone = later.len() as u64 * batch_alone;
    assert!(
        took <= fast_alone + fast_alone * 3 / 20,
        "{} batches after the initial windows took {:.1} ms, the fast rail alone {:.1}; \
         slow batches: {:?}",
        later.len(),
        took as f64 / 1e6,
        fast_alone as f64 / 1e6,
        later
            .iter()
            .enumerate()
            .filter(|(_, (ns, _))| *ns > 2 * batch_alone)
            .map(|(i, (ns, _))| (i + initial, ns / 1_000_000))
            .collect::<Vec<_>>()
    );
}
