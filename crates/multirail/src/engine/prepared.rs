//! Prepared request lists: transfers described and checked once, posted by index many times.
//!
//! Serving stacks move the same KV-cache blocks between the same buffers again and again (NIXL's
//! `prep_xfer_dlist` and `make_prepped_xfer`, vLLM reposting one handle per step). A prepared
//! list resolves each entry once: the local range is found registered, the peer and its target
//! buffer (key and bounds) are looked up, and the transport is chosen and readied (an shm
//! mapping opened, an RDMA registration checked). A post then only picks entries by index and
//! hands them to their transports as one batch, with the usual status, wait and notification.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use multirail_policy::qos::Priority;

use super::{Engine, RoutedBatch};
use crate::config::TransportChoice;
use crate::engine::{BatchId, Request};
use crate::error::{Error, Result};
use crate::transport::Opcode;

/// Handle of a prepared request list, returned by [`Engine::prepare`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PreparedListId(pub u64);

/// One entry of a prepared list: `length` bytes between local address `source` and address
/// `target_offset` in segment `target`; the direction is chosen at each post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedEntry {
    /// Local address, inside memory this engine allocated or registered.
    pub source: u64,
    /// The segment to read from or write to.
    pub target: crate::SegmentId,
    /// Address in the target segment (a buffer's `addr` plus an offset).
    pub target_offset: u64,
    /// Bytes to move; at least 1.
    pub length: u64,
}

/// A prepared list as the engine keeps it.
pub(crate) struct PreparedList {
    entries: RoutedBatch,
    /// The local registry's generation when every source was last found registered; a post
    /// checks the sources again only when memory was unregistered since.
    checked_at: Mutex<u64>,
}

impl Engine {
    /// Checks and resolves `entries` once (each source registered, each target inside a
    /// buffer of its open segment, each transport chosen and readied, `transport` forcing one
    /// for all when given) and keeps them as a list to post by index with
    /// [`Engine::submit_prepared`]. Fails, keeping nothing, on an empty list or on the first
    /// bad entry, as [`Engine::submit`] fails on a bad request (the error names the problem).
    pub fn prepare(
        &self,
        entries: &[PreparedEntry],
        transport: Option<TransportChoice>,
    ) -> Result<PreparedListId> {
        if entries.is_empty() {
            return Err(Error::invalid("entries", "must hold at least one entry"));
        }
        let generation = self.inner.local.registry.generation();
        let mut memo = super::RouteMemo::default();
        let mut routed = RoutedBatch::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let request = Request {
                transport,
                ..Request::write(e.source, e.target, e.target_offset, e.length)
            };
            self.route(&request, &mut memo, &mut routed)
                .map_err(|err| entry_error(i, entries.len(), err))?;
        }
        let id = self.inner.next_prepared.fetch_add(1, Ordering::Relaxed);
        self.inner
            .prepared
            .lock()
            .expect("prepared poisoned")
            .insert(
                id,
                Arc::new(PreparedList {
                    entries: routed,
                    checked_at: Mutex::new(generation),
                }),
            );
        Ok(PreparedListId(id))
    }

    /// How many entries `list` holds. Fails with `InvalidArgument` for a list never prepared
    /// or already freed.
    pub fn prepared_len(&self, list: PreparedListId) -> Result<usize> {
        Ok(self.prepared(list)?.entries.len())
    }

    /// Frees `list`; batches posted from it run on. Fails with `InvalidArgument` for a list
    /// never prepared or already freed.
    pub fn free_prepared(&self, list: PreparedListId) -> Result<()> {
        self.inner
            .prepared
            .lock()
            .expect("prepared poisoned")
            .remove(&list.0)
            .map(|_| ())
            .ok_or_else(|| unknown_list(list))
    }

    /// Posts entries of `list` into `batch` as `opcode` (READ: target to source; WRITE: source
    /// to target) at `priority`: those at `indices`, in that order (an index may repeat), or
    /// every entry when `indices` is `None`. The batch then reports their status and wait in
    /// that order, as if they had been submitted as requests. Nothing is posted if anything is
    /// wrong: an unknown list or batch, an index past the list's end, a batch without room, a
    /// source unregistered since the list was prepared, or a peer that has exited.
    pub fn submit_prepared(
        &self,
        batch: BatchId,
        list: PreparedListId,
        opcode: Opcode,
        priority: Priority,
        indices: Option<&[usize]>,
    ) -> Result<()> {
        let prepared = self.prepared(list)?;
        let b = self.batch(batch)?;
        let all: Vec<usize>;
        let indices = match indices {
            Some(i) => i,
            None => {
                all = (0..prepared.entries.len()).collect();
                &all
            }
        };
        if indices.is_empty() {
            return Err(Error::invalid("indices", "must name at least one entry"));
        }
        if let Some(&bad) = indices.iter().find(|&&i| i >= prepared.entries.len()) {
            return Err(Error::invalid(
                "indices",
                format!(
                    "{bad} is past the end of a list of {} entries",
                    prepared.entries.len()
                ),
            ));
        }
        self.recheck_sources(&prepared)?;
        // Whether a peer exited costs a poll of its pidfd: ask once per peer, not per entry.
        let mut asked = super::LivePeers::default();
        for &i in indices {
            let peer = prepared.entries.peer_of(&prepared.entries.requests[i]);
            if asked.contains(peer.id) {
                continue;
            }
            asked.insert(peer.id);
            if peer.process_exited() {
                return Err(peer.exited_error("open the segment again and prepare the list again"));
            }
            if !self.inner.is_current(peer) {
                // Followed to another process since: this list's keys are the old one's.
                return Err(Error::PeerDisconnected {
                    peer: peer.name.clone(),
                    reason: "another process serves the segment now; prepare the list again".into(),
                });
            }
        }
        let selected = prepared.entries.select(indices, |r| {
            r.opcode = opcode;
            r.priority = priority;
        });
        self.post_all(&b, &selected)
    }

    /// As [`Engine::submit_prepared`], then, once every posted entry completed, sends `msg` as
    /// a notification to each segment they target, so it arrives after the data (see
    /// [`Engine::submit_with_notification`]).
    pub fn submit_prepared_with_notification(
        &self,
        batch: BatchId,
        list: PreparedListId,
        opcode: Opcode,
        priority: Priority,
        indices: Option<&[usize]>,
        msg: &str,
    ) -> Result<()> {
        let pending = self.batch(batch)?;
        let prepared = self.prepared(list)?;
        self.submit_prepared(batch, list, opcode, priority, indices)?;
        let mut targets: Vec<crate::SegmentId> = match indices {
            Some(i) => i
                .iter()
                .map(|&i| prepared.entries.requests[i].request.target)
                .collect(),
            None => prepared
                .entries
                .requests
                .iter()
                .map(|e| e.request.target)
                .collect(),
        };
        targets.sort_by_key(|t| t.0);
        targets.dedup();
        self.notify_when_done(pending, targets, msg)
    }

    fn prepared(&self, list: PreparedListId) -> Result<Arc<PreparedList>> {
        self.inner
            .prepared
            .lock()
            .expect("prepared poisoned")
            .get(&list.0)
            .cloned()
            .ok_or_else(|| unknown_list(list))
    }

    /// Finds every source of `list` registered again when memory was unregistered since it
    /// was last checked, so a post never reads or writes memory the engine no longer serves.
    fn recheck_sources(&self, list: &PreparedList) -> Result<()> {
        let registry = &self.inner.local.registry;
        let generation = registry.generation();
        let mut checked_at = list.checked_at.lock().expect("prepared poisoned");
        if *checked_at == generation {
            return Ok(());
        }
        for entry in list.entries.requests.iter().map(|r| &r.request) {
            if registry.find(entry.source, entry.length).is_none() {
                return Err(Error::SourceNotRegistered {
                    addr: entry.source,
                    len: entry.length,
                });
            }
        }
        *checked_at = generation;
        Ok(())
    }
}

fn unknown_list(list: PreparedListId) -> Error {
    Error::invalid(
        "list",
        format!(
            "{} is not a prepared list of this engine (never prepared, or freed)",
            list.0
        ),
    )
}

/// Names the entry an error is about.
fn entry_error(index: usize, total: usize, e: Error) -> Error {
    if total > 1 {
        tracing::debug!(index, error = %e, "prepared entry refused");
    }
    e
}
