//! This engine's descriptor in the metadata store: publishing and withdrawing its own, and
//! following an open segment to the process that serves it now, whether a store that watches
//! (etcd) says so or a lookup finds it.

use std::sync::Arc;

use super::Inner;
use crate::metadata;
use crate::peer::Peer;
use crate::segment::SegmentDescriptor;

impl Inner {
    /// Publishes this engine's current descriptor to the metadata store, when the store keeps
    /// descriptors and the engine has not withdrawn it. Control path only: it blocks for up to
    /// `metadata.timeout_ms` and holds no lock the data path takes while the request runs. A
    /// failure is logged; peers keep the descriptors they have, and a lookup finds the next
    /// one published.
    pub(super) fn publish_descriptor(&self) {
        if !self.publishes {
            return;
        }
        // Nothing the lock guards can be left half-changed by a panic.
        let withdrawn = self.withdrawn.lock().unwrap_or_else(|e| e.into_inner());
        if *withdrawn {
            return;
        }
        // Taken under the lock, so a publish that started earlier cannot overwrite it.
        let descriptor = self.local.descriptor();
        let name = descriptor.published_name();
        let outcome = self.metadata.publish(name, &descriptor);
        if let Err(e) = self.metadata_counters.publish(outcome) {
            tracing::warn!(segment = %name, error = %e, "cannot publish this engine's descriptor now; retrying in the background with back-off, and peers keep the one they have");
        }
    }

    /// Withdraws this engine's descriptor from the metadata store, once; later publishes do
    /// nothing. Best effort: a failure is logged.
    pub(super) fn withdraw_descriptor(&self) {
        if !self.publishes {
            return;
        }
        let mut withdrawn = self.withdrawn.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::replace(&mut *withdrawn, true) {
            return;
        }
        let name = self.local.published_name();
        if let Err(e) = self.metadata.unpublish(&name) {
            tracing::warn!(segment = %name, error = %e, "cannot withdraw this engine's descriptor");
        }
    }
}

impl Inner {
    /// A store that watches (etcd) saw segment `name` published (`Some`) or withdrawn
    /// (`None`). For a segment this engine has open: new buffers of the same process are
    /// taken at once, and a new process (restarted, moved to another port) replaces the old
    /// one under the same segment id, so the next request goes to it instead of failing on
    /// the dead one first. A withdrawal changes nothing: requests in flight finish or fail on
    /// their own, and a later publish is followed.
    pub(super) fn on_segment_change(&self, name: &str, descriptor: Option<SegmentDescriptor>) {
        let Some(descriptor) = descriptor else {
            tracing::debug!(segment = name, "segment withdrawn from the metadata store");
            return;
        };
        let peers = self.peers.read().expect("peers poisoned");
        let Some(current) = peers
            .by_name
            .get(name)
            .and_then(|id| peers.by_id.get(id))
            .cloned()
        else {
            return;
        };
        let same_process = {
            let known = current.descriptor();
            known.pid == descriptor.pid
                && known.host_id == descriptor.host_id
                && known.name == descriptor.name
        };
        self.metadata_counters.watch_update();
        if same_process {
            // Same process, so it cannot be refused.
            let _ = current.update_descriptor(descriptor);
            return;
        }
        drop(peers);
        match self.follow(&current, descriptor, false) {
            Ok(peer) => {
                tracing::info!(segment = name, addr = %peer.addr, "segment published again by another process; following it")
            }
            Err(e) => {
                tracing::warn!(segment = name, error = %e, "a new descriptor of an open segment names an address that does not resolve; keeping the old one");
            }
        }
    }

    /// Replaces `current`, the peer of an open segment, with a peer for `fresh`, the
    /// descriptor of the process that serves the segment now, under the same segment id: the
    /// segment's handle then reaches the new process, and transports make new paths to it.
    /// `proven` says the descriptor came from the segment itself over its control port, whose
    /// handshake proved membership both ways. When `current` was replaced already (another
    /// thread followed first), returns the peer that replaced it. Fails with the resolver's
    /// error when `fresh` names an address that does not resolve; `current` then stays.
    pub(super) fn follow(
        &self,
        current: &Arc<Peer>,
        fresh: SegmentDescriptor,
        proven: bool,
    ) -> crate::error::Result<Arc<Peer>> {
        let addr = metadata::resolve(&fresh.name)?;
        let peer = Arc::new(Peer::new(
            current.id,
            current.name.clone(),
            addr,
            fresh,
            &self.local.host_id,
        ));
        if proven {
            peer.mark_membership_proven();
        }
        let mut peers = self.peers.write().expect("peers poisoned");
        match peers.by_id.get(&current.id) {
            Some(now) if !Arc::ptr_eq(now, current) => return Ok(now.clone()),
            // Closed meanwhile: following it would open it again behind the caller's back.
            None => return Err(crate::error::Error::UnknownSegment(current.id)),
            Some(_) => {}
        }
        peers.by_id.insert(current.id, peer.clone());
        Ok(peer)
    }

    /// Whether `peer` is still the one the segment's handle reaches: a peer followed to a new
    /// process (see [`follow`](Self::follow)) is not, nor is one whose segment was closed.
    pub(super) fn is_current(&self, peer: &Arc<Peer>) -> bool {
        matches!(
            self.peers.read().expect("peers poisoned").by_id.get(&peer.id),
            Some(now) if Arc::ptr_eq(now, peer)
        )
    }
}
