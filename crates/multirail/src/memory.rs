//! Memory the engine can move bytes in and out of: buffers it allocates (memfd-backed shared
//! mappings a same-host peer can map) and caller memory it registers. Every buffer has a random
//! access key that peers must present.

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, RwLock};

use crate::access::AccessTable;
use crate::error::{Error, Result};
use crate::mapping::create_shared;
pub use crate::segment::Location;
use crate::segment::{AccessDescriptor, BufferDescriptor, ShmHandle};

/// Who owns the bytes of a region.
enum Backing {
    /// Mapped by the engine from a memfd; unmapped when the last reference goes.
    Owned { memfd: OwnedFd },
    /// The caller's memory; the caller keeps it alive until `unregister`.
    Registered,
}

/// One contiguous range of registered memory.
pub(crate) struct Region {
    addr: usize,
    len: usize,
    key: u64,
    location: Location,
    backing: Backing,
    /// Remote keys of the range on each RDMA rail, as peers must present them.
    rkeys: Vec<u32>,
    /// The registry's number for this region, by which the hook knows it.
    id: u64,
    /// The region's entry in the access table, which same-host peers hold for each copy into
    /// it (see [`crate::access`]); `None` when the registry has no access table or it is full.
    access: Option<AccessDescriptor>,
}

/// What else must know of every region: the RDMA transport registers each with every device
/// (and deregisters it when the region goes), so peers can reach it with one-sided operations.
pub(crate) trait RegionHook: Send + Sync {
    /// Registers `addr..addr+len` as region `id`; returns the remote key on each RDMA rail.
    /// An error fails the allocation or registration that asked, with nothing left registered.
    fn registered(&self, id: u64, addr: usize, len: usize) -> Result<Vec<u32>>;
    /// Region `id` is no longer served: deregister it (once nothing in flight uses it).
    fn unregistered(&self, id: u64);
}

impl Region {
    /// The registry's number for this region (what the region hook knows it by).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
    pub(crate) fn key(&self) -> u64 {
        self.key
    }
    pub(crate) fn location(&self) -> Location {
        self.location
    }
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        let start = self.addr as u64;
        addr >= start && len <= self.len as u64 && addr - start <= self.len as u64 - len
    }

    fn descriptor(&self) -> BufferDescriptor {
        BufferDescriptor {
            addr: self.addr as u64,
            len: self.len as u64,
            key: self.key,
            location: self.location,
            shm: match &self.backing {
                Backing::Owned { memfd } => Some(ShmHandle {
                    pid: std::process::id(),
                    fd: memfd.as_raw_fd(),
                }),
                Backing::Registered => None,
            },
            rkeys: self.rkeys.clone(),
            access: self.access,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Backing::Owned { .. } = self.backing {
            // SAFETY: `addr..addr+len` was mapped by `allocate` and is unmapped exactly once, here,
            // when the last `Arc<Region>` (buffer handles and in-flight slices) is gone.
            unsafe {
                libc::munmap(self.addr as *mut libc::c_void, self.len);
            }
        }
    }
}

/// A buffer the engine allocated or registered. Cloning is cheap; memory the engine allocated
/// stays mapped while any clone (or an in-flight slice) holds it, even after `Engine::free`.
#[derive(Clone)]
pub struct Buffer {
    region: Arc<Region>,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.region.addr))
            .field("len", &self.region.len)
            .field("location", &self.region.location)
            .finish()
    }
}

impl Buffer {
    /// The registry's number for its region (what the region hook knows it by).
    pub(crate) fn region_id(&self) -> u64 {
        self.region.id()
    }

    /// How another process on this host maps it (memory the engine allocated); `None` for
    /// caller memory registered in place.
    pub(crate) fn shm_handle(&self) -> Option<crate::segment::ShmHandle> {
        self.region.descriptor().shm
    }

    /// Start address in this process; this is also the address peers use as `target_offset`.
    pub fn addr(&self) -> u64 {
        self.region.addr as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }
    /// True for a zero-length buffer (the engine never creates one).
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
    /// The access key peers must present to touch this buffer.
    pub fn key(&self) -> u64 {
        self.region.key
    }
    /// Where the memory lives.
    pub fn location(&self) -> Location {
        self.region.location
    }
    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    /// The bytes as a shared slice.
    ///
    /// # Safety
    /// No transfer may write into this range while the slice lives (peers write into allocated
    /// buffers without this process's involvement), and for registered memory the caller's
    /// memory must still be alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.as_ptr(), self.len())
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    /// As [`Buffer::as_slice`], and no other reference to these bytes may exist while it lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.as_ptr(), self.len())
    }
}

/// Every region this engine serves, ordered by address for range lookups.
pub(crate) struct MemoryRegistry {
    regions: RwLock<BTreeMap<usize, Arc<Region>>>,
    /// The entries same-host peers hold for their copies into the regions; `None` when the
    /// table could not be made (peers then copy unguarded, as into an engine of an older
    /// version).
    access_table: Option<AccessTable>,
    /// Bumped by every unregistration, so what was checked against the registry once (a
    /// prepared request list) knows when to check again.
    generation: std::sync::atomic::AtomicU64,
    hook: std::sync::OnceLock<Arc<dyn RegionHook>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Default for MemoryRegistry {
    /// An empty registry with an access table (logged and done without when one cannot be
    /// made).
    fn default() -> Self {
        let access_table = AccessTable::new()
            .inspect_err(|e| {
                tracing::warn!(
                    error = %e,
                    "no access table: same-host peers may copy into buffers after they are unregistered"
                )
            })
            .ok();
        MemoryRegistry {
            regions: RwLock::default(),
            access_table,
            generation: Default::default(),
            hook: Default::default(),
            next_id: Default::default(),
        }
    }
}

fn random_key() -> u64 {
    // A zero key would read as "unset" in wire dumps; never hand it out.
    loop {
        let k: u64 = rand::random();
        if k != 0 {
            return k;
        }
    }
}

fn check_numa_node(location: Location) -> Result<()> {
    if let Location::Cpu(n) = location {
        let path = format!("/sys/devices/system/node/node{n}");
        if !std::path::Path::new(&path).exists() {
            return Err(Error::invalid(
                "location",
                format!("NUMA node {n} does not exist on this host"),
            ));
        }
    }
    Ok(())
}

/// Prefers pages of `addr..addr+len` on `node`. Placement is a performance hint, so a kernel that
/// refuses (no NUMA support) only gets a log line.
fn bind_to_node(addr: usize, len: usize, node: u32) {
    const MPOL_PREFERRED: libc::c_long = 1;
    let mut mask = [0u64; 16];
    if node as usize >= mask.len() * 64 {
        return;
    }
    mask[node as usize / 64] |= 1 << (node % 64);
    // SAFETY: mbind only reads `mask` (valid for `mask.len() * 64` bits, the maxnode passed) and
    // changes the placement policy of a mapping this process owns; it never touches the bytes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr,
            len,
            MPOL_PREFERRED,
            mask.as_ptr(),
            (mask.len() * 64) as libc::c_ulong,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        tracing::debug!(
            node,
            error = %std::io::Error::last_os_error(),
            "mbind refused; memory placed by the kernel's default policy"
        );
    }
}

impl MemoryRegistry {
    /// Allocates `len` bytes in a fresh memfd mapping so same-host peers can map it too.
    pub(crate) fn allocate(&self, len: usize, location: Location) -> Result<Buffer> {
        if len == 0 {
            return Err(Error::invalid("len", "must be greater than 0"));
        }
        check_numa_node(location)?;
        let (memfd, ptr) = create_shared("multirail-buffer", len, "a buffer")?;
        if let Location::Cpu(n) = location {
            bind_to_node(ptr, len, n);
        }
        let mut region = Region {
            addr: ptr,
            len,
            key: random_key(),
            location,
            backing: Backing::Owned { memfd },
            rkeys: Vec::new(),
            id: 0,
            access: None,
        };
        // Dropping `region` on failure unmaps what was mapped.
        let region = self.insert(&mut region).map(|()| Arc::new(region))?;
        self.publish(region.clone())?;
        Ok(Buffer { region })
    }

    /// Registers caller memory. Fails on a null pointer, zero length or overlap with a region
    /// already registered.
    pub(crate) fn register(&self, ptr: *mut u8, len: usize, location: Location) -> Result<Buffer> {
        if ptr.is_null() {
            return Err(Error::invalid("ptr", "is null"));
        }
        if len == 0 {
            return Err(Error::invalid("len", "must be greater than 0"));
        }
        if (ptr as usize).checked_add(len).is_none() {
            return Err(Error::invalid(
                "len",
                "range wraps around the address space",
            ));
        }
        check_numa_node(location)?;
        let mut region = Region {
            addr: ptr as usize,
            len,
            key: random_key(),
            location,
            backing: Backing::Registered,
            rkeys: Vec::new(),
            id: 0,
            access: None,
        };
        self.insert(&mut region)?;
        let region = Arc::new(region);
        self.publish(region.clone())?;
        Ok(Buffer { region })
    }

    /// Installs the hook every region is registered with from now on. Set once, before any
    /// memory is registered (regions already served would lack their keys).
    pub(crate) fn set_hook(&self, hook: Arc<dyn RegionHook>) {
        let _ = self.hook.set(hook);
    }

    /// Checks that `region` overlaps nothing served and registers it with the hook, filling in
    /// its remote keys. Does not publish it yet: that is `publish`, once it is in an `Arc`.
    fn insert(&self, region: &mut Region) -> Result<()> {
        Self::check_overlap(
            &self.regions.read().expect("memory registry poisoned"),
            region,
        )?;
        // Registering with devices pins pages and takes a while: not under the lock.
        region.id = 1 + self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(hook) = self.hook.get() {
            region.rkeys = hook.registered(region.id, region.addr, region.len)?;
        }
        if let Some(access_table) = &self.access_table {
            region.access = access_table.grant(region.key);
            if region.access.is_none() {
                tracing::warn!(
                    addr = region.addr,
                    len = region.len,
                    entries = crate::access::ENTRIES,
                    "every access entry is taken: same-host peers reach this buffer without one, and may copy into it after it is unregistered"
                );
            }
        }
        Ok(())
    }

    /// Revokes `region`'s entry in the access table, waiting for same-host peers' copies into
    /// it to end.
    fn revoke(&self, region: &Region) {
        if let (Some(access_table), Some(access)) = (&self.access_table, region.access) {
            access_table.revoke(access.entry);
        }
    }

    fn check_overlap(map: &BTreeMap<usize, Arc<Region>>, region: &Region) -> Result<()> {
        let (start, end) = (region.addr, region.addr + region.len);
        let overlaps_before = map
            .range(..end)
            .next_back()
            .is_some_and(|(_, r)| r.addr + r.len > start);
        if overlaps_before {
            return Err(Error::invalid(
                "ptr",
                format!("range {start:#x}+{} overlaps registered memory", region.len),
            ));
        }
        Ok(())
    }

    /// Serves `region`. One that raced another registration of an overlapping range (both
    /// checked before either was served) loses, and is deregistered from the hook again.
    fn publish(&self, region: Arc<Region>) -> Result<()> {
        let mut map = self.regions.write().expect("memory registry poisoned");
        if let Err(e) = Self::check_overlap(&map, &region) {
            drop(map);
            self.revoke(&region);
            if let Some(hook) = self.hook.get() {
                hook.unregistered(region.id);
            }
            return Err(e);
        }
        map.insert(region.addr, region);
        Ok(())
    }

    /// Removes the region starting at `addr`. Same-host peers' copies into it stop: this
    /// returns once those running have ended (see [`crate::access`]). Memory the engine
    /// allocated is unmapped once no buffer handle or in-flight slice holds it; RDMA
    /// registrations go at once (slices in flight on them keep them until they finish).
    pub(crate) fn unregister(&self, addr: u64) -> Result<()> {
        let removed = {
            let mut map = self.regions.write().expect("memory registry poisoned");
            let removed = map.remove(&(addr as usize));
            if removed.is_some() {
                self.generation
                    .fetch_add(1, std::sync::atomic::Ordering::Release);
            }
            removed
        };
        match removed {
            Some(region) => {
                // Not under the lock: the wait for peers' copies takes as long as a copy.
                self.retire(&region);
                Ok(())
            }
            None => Err(Error::invalid(
                "addr",
                format!("{addr:#x} is not the start of a registered buffer"),
            )),
        }
    }

    /// Stops serving every region, as `unregister` of each would: its access entry revoked
    /// (waiting for same-host peers' copies into it to end) and its RDMA registrations gone.
    /// For an engine whose caller has let go of it, and may free the memory it registered.
    pub(crate) fn close(&self) {
        let removed = {
            let mut map = self.regions.write().expect("memory registry poisoned");
            if !map.is_empty() {
                self.generation
                    .fetch_add(1, std::sync::atomic::Ordering::Release);
            }
            std::mem::take(&mut *map)
        };
        for region in removed.values() {
            self.retire(region);
        }
    }

    /// Ends the serving of `region`, already out of the map: its access entry revoked
    /// (waiting for same-host peers' copies into it) and its RDMA registrations gone.
    fn retire(&self, region: &Region) {
        self.revoke(region);
        if let Some(hook) = self.hook.get() {
            hook.unregistered(region.id);
        }
    }

    /// How many unregistrations there have been: a range found registered stays registered
    /// while this does not change.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The region that holds all of `addr..addr+len`, if any.
    pub(crate) fn find(&self, addr: u64, len: u64) -> Option<Arc<Region>> {
        let map = self.regions.read().expect("memory registry poisoned");
        let (_, region) = map.range(..=addr as usize).next_back()?;
        region.contains(addr, len).then(|| region.clone())
    }

    /// Descriptors of every region, in address order, for the segment descriptor.
    pub(crate) fn descriptors(&self) -> Vec<BufferDescriptor> {
        let map = self.regions.read().expect("memory registry poisoned");
        map.values().map(|r| r.descriptor()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_parses_and_prints() {
        assert_eq!("*".parse::<Location>().unwrap(), Location::Any);
        assert_eq!("cpu:3".parse::<Location>().unwrap(), Location::Cpu(3));
        assert_eq!(Location::Cpu(1).to_string(), "cpu:1");
        assert!("gpu:0".parse::<Location>().is_err());
        assert!("cpu:x".parse::<Location>().is_err());
    }

    #[test]
    fn allocate_register_find_unregister() {
        let reg = MemoryRegistry::default();
        let a = reg.allocate(1 << 20, Location::Any).unwrap();
        assert_eq!(a.len(), 1 << 20);
        assert!(reg.find(a.addr(), 1 << 20).is_some());
        assert!(reg.find(a.addr() + 10, 100).is_some());
        assert!(reg.find(a.addr() + 1, 1 << 20).is_none());
        assert!(reg.find(a.addr() - 1, 2).is_none());

        let mut own = vec![0u8; 4096];
        let b = reg
            .register(own.as_mut_ptr(), own.len(), Location::Any)
            .unwrap();
        assert_ne!(a.key(), b.key());
        assert!(
            reg.register(own.as_mut_ptr(), 10, Location::Any).is_err(),
            "overlap"
        );
        assert!(reg
            .register(std::ptr::null_mut(), 10, Location::Any)
            .is_err());
        assert!(reg.register(own.as_mut_ptr(), 0, Location::Any).is_err());
        assert_eq!(reg.descriptors().len(), 2);
        reg.unregister(b.addr()).unwrap();
        assert!(reg.unregister(b.addr()).is_err());
        assert!(reg.find(b.addr(), 1).is_none());
    }

    #[test]
    fn missing_numa_node_is_an_error() {
        let reg = MemoryRegistry::default();
        let err = reg.allocate(4096, Location::Cpu(999)).unwrap_err();
        assert!(err.to_string().contains("location"), "{err}");
    }

    #[test]
    fn peer_mapping_sees_the_same_bytes() {
        let reg = MemoryRegistry::default();
        let a = reg.allocate(8192, Location::Any).unwrap();
        let desc = reg.descriptors().remove(0);
        let map = crate::mapping::PeerMapping::open(desc.shm.as_ref().unwrap(), 8192).unwrap();
        // SAFETY: both mappings are private to this test and 8192 bytes long.
        unsafe {
            *a.as_ptr().add(100) = 42;
            assert_eq!(*(map.base() as *const u8).add(100), 42);
        }
    }
}
