//! Derecho's total order for a group's ordered delivery, free of I/O: a round robin over the
//! senders (message `i` of sender rank `r` has sequence number `i × senders + r`), where a
//! message is delivered only once it is *stable* (every member has received it), and null
//! messages (runs of them in one record) stand in for a sender with nothing to say so the
//! round robin never waits on an idle sender.
//!
//! Every member feeds the same records of every sender and the same stability counts move
//! only forward, so every member delivers the same sequence.

use std::collections::VecDeque;

/// Messages of one sender received but not yet delivered, in order.
struct Entry {
    /// Index of the first message.
    first: u64,
    /// Messages it stands for (1 for a real message; a run for nulls).
    count: u64,
    /// The payload; `None` for a run of nulls.
    bytes: Option<Vec<u8>>,
}

/// The round robin over `senders` sender ranks.
pub(crate) struct RoundRobin {
    queues: Vec<VecDeque<Entry>>,
    /// The round (message index) to deliver next.
    round: u64,
    /// The sender rank to deliver next within the round.
    rank: usize,
}

impl RoundRobin {
    /// A round robin over `senders` senders, starting at message 0 of rank 0.
    pub fn new(senders: usize) -> RoundRobin {
        RoundRobin {
            queues: (0..senders).map(|_| VecDeque::new()).collect(),
            round: 0,
            rank: 0,
        }
    }

    /// Sender `rank`'s next record arrived: a message (`bytes`) or `count` nulls, starting at
    /// its message `first`. Records of one sender arrive in order.
    pub fn push(&mut self, rank: usize, first: u64, count: u64, bytes: Option<Vec<u8>>) {
        self.queues[rank].push_back(Entry {
            first,
            count,
            bytes,
        });
    }

    /// Messages held, received but not yet delivered (nulls not counted).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.queues
            .iter()
            .map(|q| q.iter().filter(|e| e.bytes.is_some()).count())
            .sum()
    }

    /// Delivers, in order, every message that is stable: `stable[r]` is how many messages of
    /// sender rank `r` every member has received. Calls `deliver(rank, index, bytes)` for each
    /// real message and skips nulls. Stops at the first message not stable or not received.
    pub fn poll(&mut self, stable: &[u64], mut deliver: impl FnMut(usize, u64, Vec<u8>)) {
        let senders = self.queues.len();
        loop {
            let (rank, round) = (self.rank, self.round);
            if stable[rank] <= round {
                return;
            }
            let queue = &mut self.queues[rank];
            let Some(front) = queue.front_mut() else {
                return;
            };
            debug_assert!(front.first <= round && round < front.first + front.count);
            match front.bytes.take() {
                Some(bytes) => {
                    queue.pop_front();
                    deliver(rank, round, bytes);
                }
                None if round + 1 >= front.first + front.count => {
                    queue.pop_front();
                }
                None => {}
            }
            self.rank += 1;
            if self.rank == senders {
                self.rank = 0;
                self.round += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(rr: &mut RoundRobin, stable: &[u64]) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        rr.poll(stable, |r, i, _| out.push((r, i)));
        out
    }

    #[test]
    fn rounds_go_rank_by_rank_and_wait_for_stability() {
        let mut rr = RoundRobin::new(2);
        rr.push(0, 0, 1, Some(vec![1]));
        rr.push(0, 1, 1, Some(vec![2]));
        rr.push(1, 0, 1, Some(vec![3]));
        assert_eq!(
            drain(&mut rr, &[2, 0]),
            vec![(0, 0)],
            "rank 1 not stable yet"
        );
        assert_eq!(drain(&mut rr, &[2, 1]), vec![(1, 0), (0, 1)]);
        assert_eq!(rr.held(), 0);
    }

    #[test]
    fn a_run_of_nulls_lets_the_busy_sender_through() {
        let mut rr = RoundRobin::new(3);
        for i in 0..5 {
            rr.push(0, i, 1, Some(vec![i as u8]));
        }
        rr.push(1, 0, 5, None);
        rr.push(2, 0, 5, None);
        let got = drain(&mut rr, &[5, 5, 5]);
        assert_eq!(got, (0..5).map(|i| (0, i)).collect::<Vec<_>>());
    }

    #[test]
    fn every_member_delivers_the_same_sequence_whatever_the_arrival_order() {
        // Two members see the same records arrive in different interleavings and with
        // stability advancing at different times; the delivered sequences must agree.
        let records: Vec<(usize, u64, u64, bool)> = vec![
            (0, 0, 1, true),
            (1, 0, 1, true),
            (0, 1, 1, true),
            (1, 1, 2, false),
            (0, 2, 1, true),
            (1, 3, 1, true),
            (0, 3, 1, true),
        ];
        let run = |order: &[usize], stable_steps: &[[u64; 2]]| {
            let mut rr = RoundRobin::new(2);
            let mut out = Vec::new();
            for (step, &i) in order.iter().enumerate() {
                let (r, first, count, real) = records[i];
                rr.push(r, first, count, real.then(|| vec![i as u8]));
                let s = stable_steps[step.min(stable_steps.len() - 1)];
                rr.poll(&s, |r, i, b| out.push((r, i, b)));
            }
            rr.poll(&[4, 4], |r, i, b| out.push((r, i, b)));
            out
        };
        let a = run(&[0, 1, 2, 3, 4, 5, 6], &[[1, 1], [2, 1], [3, 3]]);
        let b = run(&[1, 0, 3, 2, 5, 4, 6], &[[0, 0], [4, 4]]);
        assert_eq!(a, b);
        assert_eq!(a.len(), 6, "the null run is not delivered");
    }
}
