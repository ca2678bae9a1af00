//! Which remote rail each local rail sends to.
//!
//! A local rail pairs only with remote rails it can reach through its own interface, preferring
//! those on its own subnet over those reached through a router. Among the reachable ones, TENT's
//! order: the remote rail with the same name, else the least-loaded remote rail on the local
//! rail's NUMA node, else the least-loaded one anywhere. "Load" is how many local rails already
//! paired with a remote rail, so pairs spread over the remote rails.

/// How a local rail can reach a remote rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reach {
    /// Not through this rail's interface.
    No,
    /// Through a router on this rail's interface.
    Routed,
    /// Directly: the remote address is on the local rail's subnet.
    SameSubnet,
}

/// What pairing needs to know about a rail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailInfo {
    /// Rail name (interface name).
    pub name: String,
    /// NUMA node, -1 when unknown (matches nothing).
    pub numa_node: i32,
}

/// For each local rail, the index of the remote rail it pairs with, or `None` when it reaches
/// none. `reach(l, r)` says how local rail `l` reaches remote rail `r`.
pub fn pair_rails(
    local: &[RailInfo],
    remote: &[RailInfo],
    reach: impl Fn(usize, usize) -> Reach,
) -> Vec<Option<usize>> {
    let mut load = vec![0usize; remote.len()];
    local
        .iter()
        .enumerate()
        .map(|(l, lrail)| {
            let best_reach = (0..remote.len())
                .map(|r| reach(l, r))
                .max()
                .unwrap_or(Reach::No);
            if best_reach == Reach::No {
                return None;
            }
            let candidates: Vec<usize> = (0..remote.len())
                .filter(|&r| reach(l, r) == best_reach)
                .collect();
            let least_loaded =
                |pool: &mut dyn Iterator<Item = usize>| pool.min_by_key(|&r| (load[r], r));
            let choice = candidates
                .iter()
                .copied()
                .find(|&r| remote[r].name == lrail.name)
                .or_else(|| {
                    least_loaded(&mut candidates.iter().copied().filter(|&r| {
                        lrail.numa_node >= 0 && remote[r].numa_node == lrail.numa_node
                    }))
                })
                .or_else(|| least_loaded(&mut candidates.iter().copied()))?;
            load[choice] += 1;
            Some(choice)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rails(spec: &[(&str, i32)]) -> Vec<RailInfo> {
        spec.iter()
            .map(|(n, numa)| RailInfo {
                name: n.to_string(),
                numa_node: *numa,
            })
            .collect()
    }

    #[test]
    fn same_subnet_pairs_one_to_one() {
        let l = rails(&[("b0", 0), ("b1", 0), ("b2", 1), ("b3", 1)]);
        let r = rails(&[("a0", 0), ("a1", 0), ("a2", 1), ("a3", 1)]);
        // Rail i shares a subnet only with remote rail i.
        let p = pair_rails(
            &l,
            &r,
            |a, b| if a == b { Reach::SameSubnet } else { Reach::No },
        );
        assert_eq!(p, vec![Some(0), Some(1), Some(2), Some(3)]);
    }

    #[test]
    fn same_name_first_then_numa_then_least_loaded() {
        let l = rails(&[("eth0", 0), ("eth1", 1), ("eth2", 1), ("eth9", -1)]);
        let r = rails(&[("eth1", 0), ("ethX", 1), ("ethY", 0), ("eth0", 1)]);
        let p = pair_rails(&l, &r, |_, _| Reach::SameSubnet);
        // eth0 -> remote eth0 (index 3) by name; eth1 -> remote eth1 (0) by name;
        // eth2 (numa 1) -> least-loaded on numa 1: ethX (1) (eth0@3 already has one);
        // eth9 (numa unknown) -> least loaded anywhere: ethY (2).
        assert_eq!(p, vec![Some(3), Some(0), Some(1), Some(2)]);
    }

    #[test]
    fn subnet_beats_routed_and_unreachable_gets_none() {
        let l = rails(&[("x", 0), ("y", 0)]);
        let r = rails(&[("p", 0), ("q", 0)]);
        let p = pair_rails(&l, &r, |a, b| match (a, b) {
            (0, 0) => Reach::Routed,
            (0, 1) => Reach::SameSubnet,
            _ => Reach::No,
        });
        assert_eq!(p, vec![Some(1), None]);
    }

    #[test]
    fn load_spreads_pairs() {
        let l = rails(&[("a", -1), ("b", -1), ("c", -1), ("d", -1)]);
        let r = rails(&[("p", -1), ("q", -1)]);
        let p = pair_rails(&l, &r, |_, _| Reach::SameSubnet);
        assert_eq!(p, vec![Some(0), Some(1), Some(0), Some(1)]);
    }
}
