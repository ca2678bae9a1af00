//! Which requests of one submit call are moved together: a *run* of requests that follow one
//! another in memory on both sides, so a thousand 16 KiB requests for consecutive KV-cache
//! blocks cost the slices, wire frames and completions of a few large transfers instead of a
//! thousand small ones. Each request keeps its own status (see [`crate::batch::Batch::add_runs`]).
//! Free of I/O: the caller says which neighbours may join and whether a grown run still lies
//! in one registered region.

use std::ops::Range;

/// Where one request's bytes are: its local address, its address at the target, its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}

/// Splits `spans` (in submission order) into runs, as ranges of consecutive indices covering
/// them all in order. Span `i` joins the run before it when it starts where that run ends on
/// both sides, `joinable(i)` says it may follow span `i - 1` (same peer, target buffer,
/// operation, priority), the run stays within `max` bytes, and `fits(start, len)` accepts the
/// grown run's local bytes (they must lie in one registered region). `max` 0: every span is a
/// run of its own.
pub(crate) fn runs(
    spans: &[Span],
    max: u64,
    mut joinable: impl FnMut(usize) -> bool,
    mut fits: impl FnMut(u64, u64) -> bool,
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < spans.len() {
        let first = spans[i];
        let mut len = first.len;
        let mut j = i + 1;
        while j < spans.len() && max > 0 {
            let next = spans[j];
            let grown = len.checked_add(next.len);
            let adjacent = first.local.checked_add(len) == Some(next.local)
                && first.remote.checked_add(len) == Some(next.remote);
            match grown {
                Some(g) if adjacent && g <= max && joinable(j) && fits(first.local, g) => {
                    len = g;
                    j += 1;
                }
                _ => break,
            }
        }
        out.push(i..j);
        i = j;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(local: u64, remote: u64, len: u64) -> Span {
        Span { local, remote, len }
    }

    fn all(_: usize) -> bool {
        true
    }

    fn anywhere(_: u64, _: u64) -> bool {
        true
    }

    #[test]
    fn adjacent_requests_form_one_run_up_to_the_limit() {
        let spans: Vec<Span> = (0..10)
            .map(|k| span(0x1000 + k * 16, 0x9000 + k * 16, 16))
            .collect();
        assert_eq!(runs(&spans, 64, all, anywhere), vec![0..4, 4..8, 8..10]);
        assert_eq!(runs(&spans, 1 << 20, all, anywhere), vec![0..10]);
    }

    #[test]
    fn a_gap_on_either_side_or_a_step_back_ends_the_run() {
        let spans = [
            span(0, 100, 10),
            span(10, 110, 10),
            span(20, 121, 10), // remote gap of one byte
            span(30, 131, 10),
            span(41, 141, 10), // local gap
            span(31, 131, 10), // backwards on both sides
        ];
        assert_eq!(
            runs(&spans, 1 << 20, all, anywhere),
            vec![0..2, 2..4, 4..5, 5..6]
        );
    }

    #[test]
    fn zero_limit_keeps_every_request_on_its_own() {
        let spans = [span(0, 0, 8), span(8, 8, 8), span(16, 16, 8)];
        assert_eq!(runs(&spans, 0, all, anywhere), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn the_callers_rules_split_runs() {
        let spans: Vec<Span> = (0..6).map(|k| span(k * 8, k * 8, 8)).collect();
        // Span 3 may not follow span 2 (another priority, say).
        assert_eq!(
            runs(&spans, 1 << 20, |i| i != 3, anywhere),
            vec![0..3, 3..6]
        );
        // Local memory ends at 32: a run may not grow past it.
        assert_eq!(
            runs(&spans, 1 << 20, all, |start, len| start + len <= 32
                || start >= 32),
            vec![0..4, 4..6]
        );
    }

    #[test]
    fn lengths_that_would_overflow_do_not_merge() {
        let spans = [span(0, 0, u64::MAX), span(u64::MAX, u64::MAX, 1)];
        assert_eq!(runs(&spans, u64::MAX, all, anywhere), vec![0..1, 1..2]);
    }

    #[test]
    fn an_empty_list_has_no_runs() {
        assert!(runs(&[], 1 << 20, all, anywhere).is_empty());
    }
}
