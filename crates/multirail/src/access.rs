//! The access table: how an engine stops same-host peers, which copy into its buffers without
//! asking it, from writing a buffer it has unregistered.
//!
//! Over tcp and RDMA the owner, or its NIC, checks every slice against the buffers it serves,
//! so a buffer unregistered is refused at once. A same-host peer copies straight into the
//! owner's memory (through its mapping of the owner's memfd, or with process_vm_writev), and
//! nothing on the owner's side sees the copy: without more, a peer would go on writing into
//! memory its owner has unregistered and perhaps freed and reused.
//!
//! So every buffer gets an *entry* in a small table the owner shares with its same-host peers (a
//! memfd they map, as they map its buffers): the buffer's key while it is served, and how many
//! of the peers' copies into it are running. A peer raises the count, then checks the key, for
//! each copy; the owner, unregistering, clears the key, then waits until the count is zero.
//! Both sides order their two steps sequentially consistently, so either the peer sees the key
//! gone and copies nothing, or the owner sees the copy and waits for it to end: once
//! `unregister` returns, no peer writes into the buffer again. A peer that dies mid-copy leaves
//! its count up; the owner then waits at most [`REVOKE_WAIT`], says so, and never hands that
//! entry out again. Giving up then is safe: a peer's copy into registered memory (the caller's,
//! which it may free) runs inside the kernel's process_vm_writev, which a stopped or dying peer
//! does not leave half done for later; a copy into an allocated buffer, which a stopped peer
//! could finish later, writes the owner's memfd, whose pages serve nothing else while any
//! mapping of them lives.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::mapping::{create_shared, PeerMapping};
use crate::segment::{AccessDescriptor, ShmHandle};

/// Entries in an owner's table: buffers served at once with an entry. A buffer registered while
/// every entry is taken is served without one (and a warning), as peers reach the buffers of
/// an engine of an older version.
pub(crate) const ENTRIES: u32 = 16384;

/// Bytes per entry: a cache line each, so peers copying into different buffers do not contend.
const ENTRY_BYTES: usize = 64;

/// Longest an unregistration waits for peers' copies into the buffer to end. A copy holds the
/// buffer's entry for at most one copy step or one gathered system call (a few ms); a count
/// still up after this belongs to a peer that died mid-copy.
pub(crate) const REVOKE_WAIT: Duration = Duration::from_secs(1);

/// One entry as both sides see it in the shared table.
#[repr(C, align(64))]
struct Entry {
    /// The served buffer's access key; 0 while the entry is free or revoked.
    key: AtomicU64,
    /// Peers' copies into the buffer running now.
    users: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Entry>() == ENTRY_BYTES);

/// The entry that holds the table's id in its `key` instead of a buffer's; never granted.
const HEADER: u32 = 0;

/// Entry `entry` of a table mapped at `base` (at least [`ENTRIES`] entries long).
///
/// # Safety
/// `base` must be the start of a live shared mapping of at least `ENTRIES * ENTRY_BYTES` bytes
/// that stays mapped for `'a`, and `entry < ENTRIES`.
unsafe fn entry_at<'a>(base: usize, entry: u32) -> &'a Entry {
    debug_assert!(entry < ENTRIES);
    // SAFETY: per the contract the entry lies inside the mapping; the mapping is page aligned
    // and entries are 64 bytes, so the pointer is aligned for `Entry`; the bytes are only ever
    // accessed through atomics (by every process mapping the table), and an all-zero `Entry`
    // (a fresh memfd's bytes) is valid.
    unsafe { &*((base + entry as usize * ENTRY_BYTES) as *const Entry) }
}

/// The owner's access table.
pub(crate) struct AccessTable {
    memfd: OwnedFd,
    base: usize,
    /// This table's identity, also in its [`HEADER`] entry: a peer holding a mapping of an
    /// older table under the same descriptor number (one a closed engine of this process left)
    /// tells them apart by it.
    id: u64,
    /// Entries free to grant, drained of copies; entries never granted are not listed but come
    /// from `fresh`.
    free: Mutex<FreeEntries>,
}

struct FreeEntries {
    released: Vec<u32>,
    fresh: u32,
}

impl AccessTable {
    /// A table of [`ENTRIES`] free entries in a fresh memfd. Fails when the memfd cannot be made
    /// or mapped.
    pub(crate) fn new() -> Result<AccessTable> {
        let (memfd, base) = create_shared(
            "multirail-access-table",
            ENTRIES as usize * ENTRY_BYTES,
            "the access table",
        )?;
        let id = loop {
            let id: u64 = rand::random();
            if id != 0 {
                break id;
            }
        };
        let table = AccessTable {
            memfd,
            base,
            id,
            free: Mutex::new(FreeEntries {
                released: Vec::new(),
                fresh: HEADER + 1,
            }),
        };
        table.entry(HEADER).key.store(id, Ordering::SeqCst);
        Ok(table)
    }

    fn entry(&self, entry: u32) -> &Entry {
        // SAFETY: `base` maps `ENTRIES` entries until `self` drops, and every index handed out is
        // below `ENTRIES`.
        unsafe { entry_at(self.base, entry) }
    }

    /// Gives an entry to the buffer with access key `key`; `None` when every entry is taken.
    pub(crate) fn grant(&self, key: u64) -> Option<AccessDescriptor> {
        let entry = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            match free.released.pop() {
                Some(entry) => entry,
                None if free.fresh < ENTRIES => {
                    free.fresh += 1;
                    free.fresh - 1
                }
                None => return None,
            }
        };
        // A free entry has no copies running and its key is 0, so a peer holding an old one
        // on it sees a different key from now on.
        self.entry(entry).key.store(key, Ordering::SeqCst);
        Some(AccessDescriptor {
            table: ShmHandle {
                pid: std::process::id(),
                fd: self.memfd.as_raw_fd(),
            },
            table_id: self.id,
            entry,
        })
    }

    /// Revokes `entry`: no peer's copy starts after this, and it returns once the
    /// copies running have ended, or after [`REVOKE_WAIT`] (the entry is then never granted
    /// again). Returns whether the copies ended.
    pub(crate) fn revoke(&self, entry: u32) -> bool {
        let s = self.entry(entry);
        s.key.store(0, Ordering::SeqCst);
        let start = Instant::now();
        let mut spins = 0u32;
        while s.users.load(Ordering::SeqCst) != 0 {
            if start.elapsed() >= REVOKE_WAIT {
                tracing::warn!(
                    entry,
                    copies = s.users.load(Ordering::SeqCst),
                    "a same-host peer's copy into an unregistered buffer did not end within {REVOKE_WAIT:?} (the peer died mid-copy?); its access entry is retired"
                );
                return false;
            }
            // A copy holds the entry for microseconds to a few ms: spin briefly, then nap.
            if spins < 1000 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .released
            .push(entry);
        true
    }
}

impl Drop for AccessTable {
    fn drop(&mut self) {
        // Peers keep their mappings of the table: every key it still holds goes, so nothing
        // reaches the buffers of an engine that is gone (its process may live on).
        let granted = self.free.lock().unwrap_or_else(|e| e.into_inner()).fresh;
        // The header too: a peer mapping the table from now on finds it is not the one its
        // descriptor names.
        for entry in HEADER..granted {
            self.entry(entry).key.store(0, Ordering::SeqCst);
        }
        // SAFETY: `base` was mapped by `new` with this length and is unmapped once, here; no
        // `&Entry` borrowed from `self` outlives it.
        unsafe {
            libc::munmap(
                self.base as *mut libc::c_void,
                ENTRIES as usize * ENTRY_BYTES,
            );
        }
    }
}

/// A peer's handle on the entry of one buffer of a same-host segment, held by every copy into
/// the buffer.
#[derive(Clone)]
pub(crate) struct Access {
    table: Arc<PeerMapping>,
    entry: u32,
    key: u64,
    /// The segment, for the error of a revoked entry.
    peer: Arc<str>,
    /// The peer's flag for a refused key (`Peer::keys_refused`), set when the entry is found
    /// revoked.
    refused: Arc<AtomicBool>,
}

impl Access {
    /// Maps the access table `access` names, of segment `peer`. Fails when it cannot be mapped,
    /// or with `RemoteRejected` when the table found there is not the one named (the engine
    /// that published it is gone; another may have taken its descriptor number).
    pub(crate) fn map_table(access: &AccessDescriptor, peer: &str) -> Result<Arc<PeerMapping>> {
        let mapping = PeerMapping::open(&access.table, Self::TABLE_BYTES)?;
        // SAFETY: the mapping is `TABLE_BYTES` long and lives until the end of this function;
        // `HEADER < ENTRIES`.
        let header = unsafe { entry_at(mapping.base(), HEADER) };
        if header.key.load(Ordering::SeqCst) != access.table_id {
            return Err(Error::RemoteRejected {
                peer: peer.to_owned(),
                reason: "no buffer at that address with that key (its engine is gone)".into(),
            });
        }
        Ok(Arc::new(mapping))
    }

    /// The entry `access` describes, of a buffer of key `key` of segment `peer`, whose table is
    /// mapped as `table` (see [`map_table`](Self::map_table)). Fails when the entry lies
    /// outside the table or is its header.
    pub(crate) fn new(
        table: Arc<PeerMapping>,
        access: &AccessDescriptor,
        key: u64,
        (peer, refused): (Arc<str>, Arc<AtomicBool>),
    ) -> Result<Access> {
        if access.entry >= ENTRIES || access.entry == HEADER {
            return Err(Error::Protocol {
                peer: peer.to_string(),
                reason: format!(
                    "its descriptor gives access entry {} of a table of {ENTRIES}",
                    access.entry
                ),
            });
        }
        Ok(Access {
            table,
            entry: access.entry,
            key,
            peer,
            refused,
        })
    }

    /// Bytes a peer maps of an owner's table.
    pub(crate) const TABLE_BYTES: usize = ENTRIES as usize * ENTRY_BYTES;

    fn entry(&self) -> &Entry {
        // SAFETY: the mapping is `TABLE_BYTES` long (checked against the file when it was
        // opened) and held by `self.table` while `self` lives; `entry < ENTRIES` (checked in
        // `new`).
        unsafe { entry_at(self.table.base(), self.entry) }
    }

    /// Whether `other` is a handle on the same entry of the same table with the same key: a
    /// hold of one lets a copy into the other's buffer run.
    pub(crate) fn same_entry(&self, other: &Access) -> bool {
        Arc::ptr_eq(&self.table, &other.table) && self.entry == other.entry && self.key == other.key
    }

    /// Holds the entry for one copy: until the returned guard drops, the owner's
    /// unregistration of the buffer waits. Fails with `RemoteRejected` when the buffer is no
    /// longer served.
    pub(crate) fn hold(&self) -> Result<Held<'_>> {
        self.enter()?;
        Ok(Held { access: self })
    }

    /// As [`hold`](Self::hold), for a copy that ends later than a guard could say: every
    /// `Ok` must be followed by one [`leave`](Self::leave) once the copy has ended.
    pub(crate) fn enter(&self) -> Result<()> {
        let e = self.entry();
        e.users.fetch_add(1, Ordering::SeqCst);
        if e.key.load(Ordering::SeqCst) != self.key {
            e.users.fetch_sub(1, Ordering::SeqCst);
            self.refused.store(true, Ordering::Relaxed);
            return Err(Error::RemoteRejected {
                peer: self.peer.to_string(),
                reason: "no buffer at that address with that key (unregistered)".into(),
            });
        }
        Ok(())
    }

    /// Ends a copy [`enter`](Self::enter) let start.
    pub(crate) fn leave(&self) {
        self.entry().users.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A copy's hold on an [`Access`]; released on drop.
pub(crate) struct Held<'a> {
    access: &'a Access,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.access.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer_side(table: &AccessTable, access: &AccessDescriptor, key: u64) -> Access {
        let mapping = Access::map_table(access, "peer:1").unwrap();
        assert_eq!(access.table.fd, table.memfd.as_raw_fd());
        Access::new(mapping, access, key, (Arc::from("peer:1"), Arc::default())).unwrap()
    }

    #[test]
    fn a_revoked_entry_refuses_and_comes_back_with_a_new_key() {
        let table = AccessTable::new().unwrap();
        let granted = table.grant(7).unwrap();
        let access = peer_side(&table, &granted, 7);
        drop(access.hold().unwrap());
        assert!(table.revoke(granted.entry));
        let err = access.hold().err().expect("revoked");
        assert!(matches!(err, Error::RemoteRejected { .. }), "{err}");
        // The entry is granted again, to another buffer: the old access stays refused.
        let again = table.grant(9).unwrap();
        assert_eq!(again.entry, granted.entry);
        assert!(access.hold().is_err());
        assert!(peer_side(&table, &again, 9).hold().is_ok());
    }

    #[test]
    fn revoking_waits_for_the_copy_in_flight() {
        let table = Arc::new(AccessTable::new().unwrap());
        let granted = table.grant(5).unwrap();
        let access = peer_side(&table, &granted, 5);
        let held = access.hold().unwrap();
        // Timed from here, before the revoker starts: a revoker thread scheduled late would
        // otherwise measure less than the copy's 100 ms.
        let start = Instant::now();
        let revoker = {
            let table = table.clone();
            std::thread::spawn(move || {
                assert!(table.revoke(granted.entry));
                Instant::now()
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        // Revoked meanwhile: no new copy starts.
        assert!(access.hold().is_err());
        let released = Instant::now();
        drop(held);
        let revoked = revoker.join().unwrap();
        assert!(revoked >= released, "revoke returned before the copy ended");
        assert!(revoked - start >= Duration::from_millis(100));
    }

    #[test]
    fn a_copy_that_never_ends_retires_the_entry_after_the_wait() {
        let table = AccessTable::new().unwrap();
        let granted = table.grant(3).unwrap();
        let access = peer_side(&table, &granted, 3);
        let held = access.hold().unwrap();
        // As a peer that died mid-copy leaves it.
        std::mem::forget(held);
        assert!(!table.revoke(granted.entry));
        let next = table.grant(4).unwrap();
        assert_ne!(
            next.entry, granted.entry,
            "a entry with a copy still counted is not reused"
        );
    }

    #[test]
    fn dropping_the_table_revokes_every_entry() {
        let table = AccessTable::new().unwrap();
        let granted = table.grant(11).unwrap();
        let access = peer_side(&table, &granted, 11);
        drop(table);
        assert!(access.hold().is_err());
    }

    #[test]
    fn an_entry_outside_the_table_or_its_header_is_refused() {
        let table = AccessTable::new().unwrap();
        let mut granted = table.grant(1).unwrap();
        assert_ne!(granted.entry, HEADER, "the header is never granted");
        let mapping = Access::map_table(&granted, "p:1").unwrap();
        for bad in [ENTRIES, HEADER] {
            granted.entry = bad;
            let owner = (Arc::from("p:1"), Arc::default());
            assert!(Access::new(mapping.clone(), &granted, 1, owner).is_err());
        }
    }

    #[test]
    fn a_table_of_a_gone_engine_is_told_from_its_successor() {
        let old = AccessTable::new().unwrap();
        let named = old.grant(1).unwrap();
        drop(old);
        // The next table of this process likely gets the same descriptor number.
        let new = AccessTable::new().unwrap();
        let _ = new.grant(2).unwrap();
        match Access::map_table(&named, "p:1") {
            Err(Error::RemoteRejected { .. }) | Err(Error::Io { .. }) => {}
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("a table of a gone engine was taken for the one named"),
        }
    }
}
