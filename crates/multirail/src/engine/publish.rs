//! This engine's descriptor in the metadata store: publishing and withdrawing its own, and
//! following an open segment that a store that watches (etcd) sees published again.

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
        let mut peers = self.peers.write().expect("peers poisoned");
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
            current.update_descriptor(descriptor);
            return;
        }
        let addr = match metadata::resolve(&descriptor.name) {
            Ok(addr) => addr,
            Err(e) => {
                tracing::warn!(segment = name, error = %e, "a new descriptor of an open segment names an address that does not resolve; keeping the old one");
                return;
            }
        };
        tracing::info!(segment = name, %addr, "segment published again by another process; following it");
        let peer = Arc::new(Peer::new(
            current.id,
            name.to_owned(),
            addr,
            descriptor,
            &self.local.host_id,
        ));
        peers.by_id.insert(current.id, peer);
    }
}
