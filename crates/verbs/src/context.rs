//! An open device (`ibv_context`) and protection domains (`ibv_pd`).
//!
//! Handles are cheap clones around an `Arc`: every child object keeps a
//! clone of its parent, so a context outlives its protection domains, a
//! domain its memory regions and queues, whatever order the user drops them.

use crate::device::{mtu_bytes, DeviceAttr, Gid, GidEntry, LinkLayer, PortInfo, PortState};
use crate::discover::DeviceList;
use crate::ffi::{self, ibv_context, ibv_device, ibv_pd};
use crate::sysfs::{read_gid_attrs, SYSFS_INFINIBAND};
use crate::{Verbs, VerbsError};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

/// An open RDMA device. Clone to share; closed when the last clone and
/// every object made from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) verbs: Arc<Verbs>,
    pub(crate) ctx: NonNull<ibv_context>,
    name: String,
    attr: DeviceAttr,
}

// SAFETY: an ibv_context may be used from any thread: rdma-core's verbs on a
// context go through the kernel or lock inside the provider, and the
// pointer itself is only freed by Drop, once no handle remains.
unsafe impl Send for ContextInner {}
// SAFETY: as above; `&ContextInner` exposes no unsynchronised mutation.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: the context came from ibv_open_device, is closed once, and
        // every child holds an Arc to us, so none is left.
        let _ = unsafe { (self.verbs.sym.ibv_close_device)(self.ctx.as_ptr()) };
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// Opens the device named `device_name` (e.g. `mlx5_0`, `rxe_a`).
    ///
    /// Fails with [`VerbsError::NoSuchDevice`] listing the devices present,
    /// or with the failing verb (`ibv_open_device`, `ibv_query_device`).
    pub fn open(verbs: &Arc<Verbs>, device_name: &str) -> Result<Self, VerbsError> {
        let list = DeviceList::new(verbs)?;
        let dev = list
            .devices()
            .iter()
            .copied()
            .find(|&d| list.name(d) == device_name)
            .ok_or_else(|| {
                let names = list.names();
                VerbsError::NoSuchDevice {
                    name: device_name.to_owned(),
                    present: if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    },
                }
            })?;
        // SAFETY: `dev` is an entry of the live list.
        unsafe { Self::open_raw(verbs, dev, device_name.to_owned()) }
    }

    /// Opens `dev` and reads its limits.
    ///
    /// # Safety
    /// `dev` must be an entry of a device list that is still alive.
    pub(crate) unsafe fn open_raw(
        verbs: &Arc<Verbs>,
        dev: *mut ibv_device,
        name: String,
    ) -> Result<Self, VerbsError> {
        // SAFETY: `dev` is valid (caller's contract).
        let raw = unsafe { (verbs.sym.ibv_open_device)(dev) };
        let Some(ctx) = NonNull::new(raw) else {
            // Read errno before formatting the message can disturb it.
            let errno = crate::error::errno_now();
            return Err(VerbsError::verb(format!("ibv_open_device({name})"), errno));
        };
        let mut inner = ContextInner {
            verbs: verbs.clone(),
            ctx,
            name,
            attr: DeviceAttr::default(),
        };
        // SAFETY: zero is a valid bit pattern for this plain-data struct.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context; `attr` is a complete ibv_device_attr.
        let ret = unsafe { (verbs.sym.ibv_query_device)(ctx.as_ptr(), &mut attr) };
        // On error `inner` drops here and closes the device.
        VerbsError::check(&format!("ibv_query_device({})", inner.name), ret)?;
        inner.attr = DeviceAttr::from_raw(&attr);
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The device's kernel name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's limits, read when it was opened.
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// The library this context was opened through.
    pub fn verbs(&self) -> &Arc<Verbs> {
        &self.inner.verbs
    }

    /// Queries port `port` (1-based): state, link layer, MTUs, speed and
    /// width codes, LID and the non-empty GID table entries with their
    /// sysfs types and netdevs.
    ///
    /// Fails with the verb and errno of `ibv_query_port` or `ibv_query_gid`.
    pub fn port_info(&self, port: u8) -> Result<PortInfo, VerbsError> {
        let sym = &self.inner.verbs.sym;
        let ctx = self.inner.ctx.as_ptr();
        // SAFETY: zero is a valid bit pattern for this plain-data struct.
        let mut pa: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context. The exported ibv_query_port fills the
        // `_compat_ibv_port_attr` prefix of our full-size, zeroed
        // ibv_port_attr, exactly as verbs.h's own fallback calls it.
        let ret = unsafe { (sym.ibv_query_port)(ctx, port, &mut pa) };
        VerbsError::check(
            &format!("ibv_query_port({}, port {port})", self.name()),
            ret,
        )?;
        let link_layer = LinkLayer::from_code(pa.link_layer);
        let gid_tbl_len = u32::try_from(pa.gid_tbl_len).unwrap_or(0);
        let mut gids = Vec::new();
        for index in 0..gid_tbl_len {
            let mut gid = ffi::ibv_gid::default();
            // SAFETY: live context; `gid` is a 16-byte ibv_gid. `index` is
            // below gid_tbl_len, which fits in c_int as it came from one.
            let ret = unsafe { (sym.ibv_query_gid)(ctx, port, index as i32, &mut gid) };
            if ret != 0 {
                // Slots the kernel cannot report (being deleted, or beyond
                // what the driver fills) are empty for our purposes.
                continue;
            }
            let gid = Gid(gid.raw);
            if gid.is_zero() {
                continue;
            }
            let (gid_type, netdev) = read_gid_attrs(
                Path::new(SYSFS_INFINIBAND),
                self.name(),
                port,
                index,
                link_layer,
            );
            gids.push(GidEntry {
                index,
                gid,
                gid_type,
                netdev,
            });
        }
        Ok(PortInfo {
            port,
            state: PortState::from_code(pa.state),
            link_layer,
            active_mtu: mtu_bytes(pa.active_mtu).unwrap_or(0),
            max_mtu: mtu_bytes(pa.max_mtu).unwrap_or(0),
            active_speed: pa.active_speed,
            active_width: pa.active_width,
            lid: pa.lid,
            max_msg_sz: pa.max_msg_sz,
            gid_tbl_len,
            gids,
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_context {
        self.inner.ctx.as_ptr()
    }
}

/// A protection domain: memory regions and queue pairs made in one domain
/// can only be used together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ibv_pd>,
    pub(crate) context: Context,
}

// SAFETY: a PD is an immutable kernel handle once allocated; verbs taking it
// (reg_mr, create_qp, create_srq) are thread-safe, and Drop runs once.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        let sym = &self.context.inner.verbs.sym;
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: allocated by ibv_alloc_pd, freed once; every MR, QP and SRQ
        // in it holds a clone of this PD, so none remains.
        let _ = unsafe { (sym.ibv_dealloc_pd)(self.pd.as_ptr()) };
    }
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.context.name())
            .finish_non_exhaustive()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `context`.
    ///
    /// Fails with `ibv_alloc_pd` and its errno (e.g. ENOMEM).
    pub fn new(context: &Context) -> Result<Self, VerbsError> {
        // SAFETY: live context.
        let raw = unsafe { (context.inner.verbs.sym.ibv_alloc_pd)(context.raw()) };
        let pd = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_alloc_pd"))?;
        Ok(Self {
            inner: Arc::new(PdInner {
                pd,
                context: context.clone(),
            }),
        })
    }

    /// The context this domain belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.context
    }

    pub(crate) fn raw(&self) -> *mut ibv_pd {
        self.inner.pd.as_ptr()
    }

    pub(crate) fn verbs(&self) -> &Verbs {
        &self.inner.context.inner.verbs
    }
}
