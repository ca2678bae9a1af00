//! Discovering devices: the device list, and [`Verbs::devices`], which
//! opens each device to describe it.

use crate::context::Context;
use crate::device::DeviceInfo;
use crate::ffi::{self, ibv_device};
use crate::sysfs::{read_numa_node, SYSFS_INFINIBAND};
use crate::{Verbs, VerbsError};
use std::ffi::c_int;
use std::path::Path;

/// The array `ibv_get_device_list` returns, freed on drop.
pub(crate) struct DeviceList<'a> {
    verbs: &'a Verbs,
    list: *mut *mut ibv_device,
    len: usize,
}

impl<'a> DeviceList<'a> {
    /// Lists the devices. A kernel without RDMA support (ENOSYS) is an
    /// empty list, not an error: the machine simply has no devices.
    pub(crate) fn new(verbs: &'a Verbs) -> Result<Self, VerbsError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the count.
        let list = unsafe { (verbs.sym.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            let err = VerbsError::last_os("ibv_get_device_list");
            return match err.errno() {
                Some(libc::ENOSYS) => Ok(Self {
                    verbs,
                    list,
                    len: 0,
                }),
                _ => Err(err),
            };
        }
        Ok(Self {
            verbs,
            list,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    /// The device pointers; valid until the list is dropped (or longer for
    /// devices opened meanwhile).
    pub(crate) fn devices(&self) -> &[*mut ibv_device] {
        if self.list.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: rdma-core returns `len` valid entries followed by NULL,
        // alive until ibv_free_device_list, which only our Drop calls.
        unsafe { std::slice::from_raw_parts(self.list, self.len) }
    }

    /// The kernel name of a device from this list.
    pub(crate) fn name(&self, dev: *mut ibv_device) -> String {
        // SAFETY: `dev` comes from this live list; the name is a
        // NUL-terminated array inside the device struct.
        let name = unsafe { ffi::c_str((self.verbs.sym.ibv_get_device_name)(dev)) };
        name.map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Names of every device, for error messages.
    pub(crate) fn names(&self) -> Vec<String> {
        self.devices().iter().map(|&d| self.name(d)).collect()
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: the list came from ibv_get_device_list and is freed
            // once; opened contexts stay valid after the list is freed.
            unsafe { (self.verbs.sym.ibv_free_device_list)(self.list) };
        }
    }
}

impl Verbs {
    /// Names of the RDMA devices present (empty when there are none).
    ///
    /// Fails only when `ibv_get_device_list` itself fails for a reason other
    /// than missing kernel support.
    pub fn device_names(&self) -> Result<Vec<String>, VerbsError> {
        Ok(DeviceList::new(self)?.names())
    }

    /// Describes every RDMA device: GUID, NUMA node, limits, and each port's
    /// state, link layer, MTU, speed, width, LID and GID table.
    ///
    /// No devices is an empty list. Fails with the verb and errno when a
    /// device cannot be opened or queried.
    pub fn devices(self: &std::sync::Arc<Self>) -> Result<Vec<DeviceInfo>, VerbsError> {
        let list = DeviceList::new(self)?;
        let mut out = Vec::with_capacity(list.devices().len());
        for &dev in list.devices() {
            let name = list.name(dev);
            // SAFETY: `dev` is an entry of the live list.
            let guid = unsafe { (self.sym.ibv_get_device_guid)(dev) };
            // SAFETY: as above; the context keeps the device alive.
            let ctx = unsafe { Context::open_raw(self, dev, name.clone()) }?;
            let ports = (1..=ctx.attr().phys_port_cnt)
                .map(|p| ctx.port_info(p))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(DeviceInfo {
                numa_node: read_numa_node(Path::new(SYSFS_INFINIBAND), &name),
                node_guid: u64::from_be(guid),
                attr: ctx.attr().clone(),
                name,
                ports,
            });
        }
        Ok(out)
    }
}
