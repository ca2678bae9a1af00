//! Requests validated and routed, as one submit call (or one prepared list) holds them: each
//! refers to its peer and target buffer by index into tables that grow only when the peer or
//! buffer changes from one request to the next. A batch's requests mostly go to one buffer of
//! one peer, so a thousand of them cost one peer handle and one buffer descriptor, not a
//! thousand clones of each (and their drops) on the submitting thread, where every microsecond
//! is a microsecond the rails wait for the batch.

use std::sync::Arc;

use super::route::Route;
use super::Request;
use crate::memory::Location;
use crate::peer::Peer;
use crate::segment::BufferDescriptor;

/// One validated request: its transport, source location and the request itself, with its
/// peer and target buffer by index into its [`RoutedBatch`]'s tables.
#[derive(Debug, Clone, Copy)]
pub(super) struct RoutedRequest {
    pub(super) peer: u32,
    pub(super) buffer: u32,
    pub(super) route: Route,
    pub(super) location: Location,
    pub(super) request: Request,
}

/// Validated requests in submission order, with the peers and target buffers they use.
#[derive(Default)]
pub(crate) struct RoutedBatch {
    pub(super) peers: Vec<Arc<Peer>>,
    /// Each buffer with the index of its peer (addresses and keys are only unique per peer).
    pub(super) buffers: Vec<(u32, Arc<BufferDescriptor>)>,
    pub(super) requests: Vec<RoutedRequest>,
}

impl RoutedBatch {
    /// An empty batch with room for `n` requests.
    pub(super) fn with_capacity(n: usize) -> Self {
        RoutedBatch {
            peers: Vec::new(),
            buffers: Vec::new(),
            requests: Vec::with_capacity(n),
        }
    }

    /// Appends `request`, routed over `route` to `buffer` of `peer`; the peer and buffer are
    /// cloned into the tables only when they differ from the previous request's.
    pub(super) fn push(
        &mut self,
        peer: &Arc<Peer>,
        buffer: &BufferDescriptor,
        route: Route,
        location: Location,
        request: Request,
    ) {
        let peer_index = match self.peers.last() {
            Some(last) if Arc::ptr_eq(last, peer) => self.peers.len() - 1,
            _ => {
                self.peers.push(peer.clone());
                self.peers.len() - 1
            }
        } as u32;
        let buffer_index = match self.buffers.last() {
            Some((owner, last))
                if *owner == peer_index && (last.addr, last.key) == (buffer.addr, buffer.key) =>
            {
                self.buffers.len() - 1
            }
            _ => {
                self.buffers.push((peer_index, Arc::new(buffer.clone())));
                self.buffers.len() - 1
            }
        } as u32;
        self.requests.push(RoutedRequest {
            peer: peer_index,
            buffer: buffer_index,
            route,
            location,
            request,
        });
    }

    /// How many requests it holds.
    pub(super) fn len(&self) -> usize {
        self.requests.len()
    }

    /// The requests at `indices` (in that order; an index may repeat), each given `edit`,
    /// with the tables they use. Every index must be below [`RoutedBatch::len`].
    pub(super) fn select(&self, indices: &[usize], edit: impl Fn(&mut Request)) -> RoutedBatch {
        RoutedBatch {
            peers: self.peers.clone(),
            buffers: self.buffers.clone(),
            requests: indices
                .iter()
                .map(|&i| {
                    let mut r = self.requests[i];
                    edit(&mut r.request);
                    r
                })
                .collect(),
        }
    }

    /// True when `a` and `b` go to the same buffer of the same peer. Equal indices say so at
    /// once; different ones may still name the same buffer (a prepared list's entries posted in
    /// another order than they were prepared in), so then the buffers themselves are compared.
    pub(super) fn same_target(&self, a: &RoutedRequest, b: &RoutedRequest) -> bool {
        if a.buffer == b.buffer {
            return true;
        }
        let (x, y) = (self.buffer_of(a), self.buffer_of(b));
        self.peer_of(a).id == self.peer_of(b).id && (x.addr, x.key) == (y.addr, y.key)
    }

    /// The peer of `r`.
    pub(super) fn peer_of(&self, r: &RoutedRequest) -> &Arc<Peer> {
        &self.peers[r.peer as usize]
    }

    /// The target buffer of `r`.
    pub(super) fn buffer_of(&self, r: &RoutedRequest) -> &Arc<BufferDescriptor> {
        &self.buffers[r.buffer as usize].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_requests_share_table_entries_and_a_change_adds_one() {
        let descriptor = |addr, key| BufferDescriptor {
            addr,
            len: 1 << 20,
            key,
            location: Location::Any,
            shm: None,
            rkeys: Vec::new(),
            access: None,
        };
        let (a, b) = (descriptor(0x1000, 7), descriptor(0x1000, 8));
        let peer_named = |id, name: &str| {
            let descriptor = crate::segment::SegmentDescriptor {
                name: name.into(),
                host_id: "elsewhere".into(),
                pid: 1,
                protocol_version: crate::segment::PROTOCOL_VERSION,
                rails: vec![],
                rdma: vec![],
                buffers: vec![a.clone()],
                segment_name: None,
                members_only: false,
                groups: Vec::new(),
            };
            let addr = "127.0.0.1:1".parse().expect("an address");
            Arc::new(Peer::new(id, name.into(), addr, descriptor, "here"))
        };
        let (peer, other) = (peer_named(1, "p:1"), peer_named(2, "q:1"));
        let write = |offset| Request::write(0x10, crate::SegmentId(1), offset, 16);
        let mut batch = RoutedBatch::with_capacity(4);
        batch.push(&peer, &a, Route::Tcp, Location::Any, write(0x1000));
        batch.push(&peer, &a, Route::Tcp, Location::Any, write(0x1010));
        // Same address, new key: memory registered again is another buffer.
        batch.push(&peer, &b, Route::Tcp, Location::Any, write(0x1020));
        // Same buffer fields, another peer.
        batch.push(&other, &b, Route::Tcp, Location::Any, write(0x1030));
        let ids: Vec<(u32, u32)> = batch.requests.iter().map(|r| (r.peer, r.buffer)).collect();
        assert_eq!(ids, vec![(0, 0), (0, 0), (0, 1), (1, 2)]);
        assert_eq!(batch.buffer_of(&batch.requests[2]).key, 8);
        assert!(Arc::ptr_eq(batch.peer_of(&batch.requests[3]), &other));
        let r = &batch.requests;
        assert!(batch.same_target(&r[0], &r[1]));
        assert!(
            !batch.same_target(&r[1], &r[2]),
            "a new key is another buffer"
        );
        assert!(!batch.same_target(&r[2], &r[3]), "another peer's buffer");
        let picked = batch.select(&[3, 0, 0], |r| r.length = 4);
        let offsets: Vec<u64> = picked
            .requests
            .iter()
            .map(|r| r.request.target_offset)
            .collect();
        assert_eq!(offsets, vec![0x1030, 0x1000, 0x1000]);
        assert!(picked.requests.iter().all(|r| r.request.length == 4));
        assert_eq!(picked.buffer_of(&picked.requests[0]).key, 8);
        // Entries prepared apart that name one buffer: told the same by their buffers.
        let mut apart = RoutedBatch::with_capacity(3);
        apart.push(&peer, &a, Route::Tcp, Location::Any, write(0x1000));
        apart.push(&peer, &b, Route::Tcp, Location::Any, write(0x1000));
        apart.push(&peer, &a, Route::Tcp, Location::Any, write(0x1010));
        let r = &apart.requests;
        assert_ne!(r[0].buffer, r[2].buffer);
        assert!(apart.same_target(&r[0], &r[2]));
    }
}
