//! Routing one request: validating it against this engine's registered memory and the peer's
//! buffers, proving membership before shared memory, and picking its transport.

use std::sync::Arc;

use super::routed::RoutedBatch;
use super::{Engine, Request};
use crate::config::TransportChoice;
use crate::error::{Error, Result};
use crate::metadata::MetadataStore;
use crate::peer::Peer;
use crate::segment;
use crate::transport::Transport;

impl Engine {
    /// Proves membership to a same-host peer's process before its memory is reached over shm.
    /// The network transports prove it on every connection they open; shared memory opens
    /// none, and a descriptor from a metadata store was not handed over by the peer itself, so
    /// without this an engine lacking the token would move bytes to a member's memory. Needed
    /// only when either side requires a token, once per peer process: the segment is asked for
    /// its descriptor over its control port, whose handshake proves membership both ways, and
    /// that descriptor (the peer's own word on its buffers) replaces the store's. Fails with
    /// `NotAMember` when either side cannot prove it, `SegmentUnreachable` when the control
    /// port does not answer, and `PeerDisconnected` when another process answers there.
    pub(super) fn prove_membership(&self, peer: &Peer) -> Result<()> {
        // Engines in one process prove it too: each holds its own token.
        if peer.membership_proven() {
            return Ok(());
        }
        let known = peer.descriptor();
        if self.inner.local.members_only || known.members_only {
            let own = self.inner.direct.fetch(&known.name)?;
            if peer.update_descriptor(own).is_err() {
                return Err(peer.exited_error("open the segment again"));
            }
        }
        // Proven, or not asked for by either side: a process keeps its token for life.
        peer.mark_membership_proven();
        Ok(())
    }

    /// The transport a route names.
    pub(super) fn transport(&self, route: Route) -> &dyn Transport {
        match route {
            Route::Tcp => &self.inner.tcp,
            Route::Shm => &self.inner.shm,
            Route::Rdma => &*self.inner.rdma,
        }
    }

    /// Validates one request and picks its transport. `memo` holds what this call has already
    /// resolved (the peers found running, the last source region, peer, target buffer and
    /// transport readied for it), so a batch of many requests between the same buffers looks
    /// each up once, not once per request: a kernel poll of the peer's pidfd, two map lookups
    /// under locks and a transport's own lookups add up to most of a 4 KiB request's cost.
    /// A segment found served by another process than the one its handle reached (restarted
    /// on its address, or published again) is followed: the handle reaches the new process
    /// from then on, and the request goes there.
    pub(super) fn route(
        &self,
        r: &Request,
        memo: &mut RouteMemo,
        out: &mut RoutedBatch,
    ) -> Result<()> {
        self.route_to(r, memo, out, true)
    }

    /// [`route`](Self::route), following the segment to a new process only when `may_follow`
    /// (once per request: a segment that changes process again meanwhile fails it).
    fn route_to(
        &self,
        r: &Request,
        memo: &mut RouteMemo,
        out: &mut RoutedBatch,
        may_follow: bool,
    ) -> Result<()> {
        if r.length == 0 {
            return Err(Error::invalid("length", "must be at least 1 byte"));
        }
        let location = match &memo.region {
            Some(region) if region.contains(r.source, r.length) => region.location(),
            _ => {
                let region = self.inner.local.registry.find(r.source, r.length).ok_or(
                    Error::SourceNotRegistered {
                        addr: r.source,
                        len: r.length,
                    },
                )?;
                let location = region.location();
                memo.region = Some(region);
                location
            }
        };
        // The peer and buffer stay in the memo and are borrowed from it: cloning them per
        // request cost a batch of a thousand small ones more than its routing.
        if !matches!(&memo.peer, Some((segment, _)) if *segment == r.target.0) {
            memo.peer = Some((r.target.0, self.peer(r.target)?));
        }
        let (_, peer) = memo.peer.as_ref().expect("set above");
        if !memo.alive.contains(peer.id) && peer.process_exited() {
            let next = if may_follow {
                self.successor(peer)
            } else {
                None
            };
            return match next {
                Some(next) => self.route_followed(r, memo, out, next),
                None => Err(peer.exited_error("open the segment again")),
            };
        }
        memo.alive.insert(peer.id);
        let choice = r.transport.unwrap_or(self.inner.config.transport);
        let shm_possible = match choice {
            TransportChoice::Shm => true,
            TransportChoice::Auto => peer.same_host && self.inner.config.transports.shm.enable,
            TransportChoice::Tcp | TransportChoice::Rdma => false,
        };
        if shm_possible {
            // Before the buffer is looked up, so that it comes from the peer's own descriptor.
            self.prove_membership(peer)?;
        }
        if !matches!(&memo.buffer, Some((id, b)) if *id == peer.id && b.contains(r.target_offset, r.length))
        {
            match self.target_buffer(peer, r.target_offset, r.length)? {
                Located::Here(b) => memo.buffer = Some((peer.id, b)),
                Located::Elsewhere(next) if may_follow => {
                    return self.route_followed(r, memo, out, next)
                }
                Located::Elsewhere(next) => return Err(replaced(&next)),
            }
        }
        let (_, buffer) = memo.buffer.as_ref().expect("set above");
        let readied = Readied {
            peer: peer.id,
            buffer: (buffer.addr, buffer.key),
            choice,
        };
        if let Some((done, route)) = &memo.readied {
            if *done == readied {
                out.push(peer, buffer, *route, location, *r);
                return Ok(());
            }
        }
        let route = match choice {
            TransportChoice::Tcp => Route::Tcp,
            TransportChoice::Shm => Route::Shm,
            TransportChoice::Rdma => Route::Rdma,
            TransportChoice::Auto if shm_possible => match self.inner.shm.prepare(peer, buffer) {
                Ok(()) => Route::Shm,
                Err(e) => {
                    if self.inner.fallback_logged.set(()).is_ok() {
                        tracing::warn!(peer = %peer.name, reason = %e, "shm cannot reach this buffer; using tcp");
                    }
                    Route::Tcp
                }
            },
            // Across hosts, RDMA when both ends have it; tcp when it cannot serve this one.
            TransportChoice::Auto if self.inner.rdma.reaches(peer) => {
                match self.inner.rdma.prepare(peer, buffer) {
                    Ok(()) => Route::Rdma,
                    Err(e) => {
                        if self.inner.fallback_logged.set(()).is_ok() {
                            tracing::warn!(peer = %peer.name, reason = %e, "rdma cannot reach this buffer; using tcp");
                        }
                        Route::Tcp
                    }
                }
            }
            TransportChoice::Auto => Route::Tcp,
        };
        let transport = self.transport(route);
        transport.prepare(peer, buffer)?;
        tracing::trace!(transport = transport.name(), peer = %peer.name, "routed");
        memo.readied = Some((readied, route));
        out.push(peer, buffer, route, location, *r);
        Ok(())
    }

    /// Routes `r` again to `next`, the peer that now serves the segment `memo` had reached
    /// another process of, forgetting what the memo held for the old one.
    fn route_followed(
        &self,
        r: &Request,
        memo: &mut RouteMemo,
        out: &mut RoutedBatch,
        next: Arc<Peer>,
    ) -> Result<()> {
        memo.peer = Some((r.target.0, next));
        memo.buffer = None;
        memo.readied = None;
        self.route_to(r, memo, out, false)
    }

    /// The peer for the process that serves `peer`'s segment now, `peer`'s own process having
    /// exited: asks the store (or the segment's address) again, and follows the segment when
    /// another process answers. `None` when nothing answers or the answer is the old process.
    fn successor(&self, peer: &Arc<Peer>) -> Option<Arc<Peer>> {
        let fresh = self.lookup(&peer.name).ok()?;
        // The same process takes the fresh descriptor; another one is followed.
        let fresh = peer.update_descriptor(fresh).err()?;
        self.follow(peer, *fresh, !self.inner.publishes)
    }

    /// Follows `peer`'s segment to the process `fresh` describes (see `Inner::follow`),
    /// logging it; `None` (logged) when its address does not resolve.
    fn follow(
        &self,
        peer: &Arc<Peer>,
        fresh: segment::SegmentDescriptor,
        proven: bool,
    ) -> Option<Arc<Peer>> {
        match self.inner.follow(peer, fresh, proven) {
            Ok(next) => {
                tracing::info!(segment = %peer.name, addr = %next.addr, "another process serves the segment now; following it");
                Some(next)
            }
            Err(e) => {
                tracing::warn!(segment = %peer.name, error = %e, "another process serves the segment now, at an address that does not resolve");
                None
            }
        }
    }

    /// The buffer of `peer` holding the range. When the cached descriptor does not have it
    /// (the peer may have registered memory since), or the peer has refused a key of it since
    /// it was fetched (a buffer unregistered, perhaps registered again) or closed a connection
    /// (its process may have been replaced), the store is asked again, and when the store's
    /// copy lacks it too, the segment itself over its control port: a store can be behind its
    /// segments for up to one refresh period (a publish that failed while it was away, or an
    /// older PUT it applied last), and a live peer's own answer is the truth. An answer from
    /// another process than `peer`'s follows the segment to it: `Located::Elsewhere` with the
    /// new peer, to route the request again. Fails with `TargetOutOfRange` when no answer has
    /// the range, with the lookup's error when the segment does not answer (a cached buffer
    /// held suspect is then used as it is), or `PeerDisconnected` when another process serves
    /// the segment at an address that does not resolve.
    pub(crate) fn target_buffer(&self, peer: &Arc<Peer>, addr: u64, len: u64) -> Result<Located> {
        let stale = peer.take_keys_refused();
        if !stale {
            if let Some(b) = peer.descriptor().find_buffer(addr, len) {
                return Ok(Located::Here(b.clone()));
            }
        }
        let out_of_range = || Error::TargetOutOfRange {
            segment: peer.name.clone(),
            addr,
            len,
        };
        // A descriptor held suspect that no answer could check is still the best word on the
        // range: the request goes out with it, as it would have without the suspicion, and
        // fails at its peer if the keys are gone. Asking again on every request instead would
        // wait on a silent host each time.
        let unchecked = |e: Error| match peer.descriptor().find_buffer(addr, len) {
            Some(b) if stale => {
                tracing::debug!(segment = %peer.name, error = %e, "cannot check the segment's descriptor now; using the cached one");
                Ok(Located::Here(b.clone()))
            }
            _ => Err(e),
        };
        let elsewhere = |fresh: segment::SegmentDescriptor, proven: bool| {
            self.follow(peer, fresh, proven)
                .map(Located::Elsewhere)
                .ok_or_else(|| replaced(peer))
        };
        match self.lookup(&peer.name) {
            Ok(fresh) => {
                let proven = !self.inner.publishes;
                if let Some(b) = fresh.find_buffer(addr, len).cloned() {
                    return match peer.update_descriptor(fresh) {
                        Ok(()) => Ok(Located::Here(b)),
                        Err(fresh) => elsewhere(*fresh, proven),
                    };
                }
                if !self.inner.publishes {
                    // The lookup above already asked the segment itself.
                    return match peer.update_descriptor(fresh) {
                        Ok(()) => Err(out_of_range()),
                        Err(fresh) => elsewhere(*fresh, proven),
                    };
                }
            }
            // Without a store the segment itself did not answer; with one, it may still.
            Err(e) if !self.inner.publishes => {
                return unchecked(e);
            }
            Err(e) => {
                tracing::debug!(segment = %peer.name, error = %e, "the metadata store does not answer; asking the segment itself");
            }
        }
        let control = peer.descriptor().name.clone();
        let own = match self.inner.direct.fetch(&control) {
            Ok(own) => own,
            Err(e) => {
                tracing::debug!(segment = %peer.name, error = %e, "the segment does not answer for its descriptor; the range stays unknown");
                return unchecked(out_of_range());
            }
        };
        let found = own.find_buffer(addr, len).cloned();
        if let Err(own) = peer.update_descriptor(own) {
            return elsewhere(*own, true);
        }
        if found.is_some() {
            tracing::debug!(segment = %peer.name, "the metadata store's descriptor is behind the segment's own; using the segment's");
        }
        found.map(Located::Here).ok_or_else(out_of_range)
    }
}

/// Where a target range was found (see [`Engine::target_buffer`]).
pub(crate) enum Located {
    /// In this buffer of the peer asked about.
    Here(segment::BufferDescriptor),
    /// Another process serves the segment now; the handle was moved to this peer for it.
    Elsewhere(Arc<Peer>),
}

/// The error for a request to a segment that changed process again while it was routed.
fn replaced(peer: &Peer) -> Error {
    Error::PeerDisconnected {
        peer: peer.name.clone(),
        reason: "the segment is now served by another process; open it again".into(),
    }
}

/// What one submit call has resolved so far (see [`Engine::route`]). Only the latest source
/// region, peer, buffer and readied transport are kept: a batch's requests mostly run between
/// the same two buffers, and a miss costs just the lookup it would have cost anyway.
#[derive(Default)]
pub(crate) struct RouteMemo {
    pub(crate) alive: LivePeers,
    region: Option<Arc<crate::memory::Region>>,
    /// The latest peer, by segment id.
    peer: Option<(u64, Arc<Peer>)>,
    /// The latest target buffer, by peer id.
    buffer: Option<(u64, segment::BufferDescriptor)>,
    /// The latest buffer a transport was readied for, and the route that was chosen.
    readied: Option<(Readied, Route)>,
}

/// A buffer of a peer that a transport choice was readied for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Readied {
    peer: u64,
    /// Address and key: a buffer freed and registered again at the same address has a new key.
    buffer: (u64, u64),
    choice: TransportChoice,
}

/// Peers one submit call has found running, by id: a few, looked up by scanning (a batch
/// usually goes to one or a handful of peers; past the bound, peers are simply checked again).
#[derive(Default)]
pub(crate) struct LivePeers(Vec<u64>);

impl LivePeers {
    /// Most peers remembered per call.
    const BOUND: usize = 16;

    pub(crate) fn contains(&self, id: u64) -> bool {
        self.0.contains(&id)
    }

    pub(crate) fn insert(&mut self, id: u64) {
        if self.0.len() < Self::BOUND && !self.0.contains(&id) {
            self.0.push(id);
        }
    }
}

/// The transport a request was routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    Tcp,
    Shm,
    Rdma,
}

impl Route {
    /// Every route, in the order of their discriminants (`route as usize` indexes this).
    pub(super) const ALL: [Route; 3] = [Route::Tcp, Route::Shm, Route::Rdma];
}

pub(super) fn annotate(e: Error, index: usize, total: usize) -> Error {
    if total > 1 {
        tracing::debug!(index, error = %e, "request refused");
    }
    e
}
