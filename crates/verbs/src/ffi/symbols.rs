//! The exported libibverbs entry points, resolved once when the library is
//! opened so that a missing symbol is reported up front, never mid-transfer.
//!
//! Every symbol here has been exported since rdma-core v17 at the latest
//! (`IBVERBS_1.1`, the default version of the verbs that also have a legacy
//! `IBVERBS_1.0` variant), so an older cluster's library works too. `dlsym`
//! returns the default version; a test checks that against `dlvsym`.

use super::*;
use std::ffi::{c_char, c_int, c_void, CStr};

macro_rules! symbols {
    ($($name:ident: $ty:ty;)*) => {
        /// Function pointers into libibverbs, all resolved before use.
        pub(crate) struct Symbols {
            $(pub $name: $ty,)*
        }

        impl Symbols {
            /// The names of every symbol resolved, for messages and tests.
            #[cfg(test)]
            pub(crate) const NAMES: &'static [&'static str] = &[$(stringify!($name),)*];

            /// Resolves every symbol in `handle`, or names the first missing one.
            ///
            /// # Safety
            /// `handle` must be a live handle returned by `dlopen` for a
            /// library that exports these symbols with the C signatures
            /// declared here (the rdma-core ABI).
            pub(crate) unsafe fn resolve(handle: *mut c_void) -> Result<Self, &'static str> {
                Ok(Self {
                    $($name: {
                        let name = concat!(stringify!($name), "\0");
                        // SAFETY: `handle` is live (caller's contract) and
                        // `name` is NUL-terminated.
                        let ptr = unsafe { libc::dlsym(handle, name.as_ptr().cast()) };
                        if ptr.is_null() {
                            return Err(stringify!($name));
                        }
                        // SAFETY: a non-null symbol of this name has this C
                        // signature in rdma-core (caller's contract), and
                        // function pointers are pointer-sized on every
                        // platform rdma-core supports.
                        unsafe { std::mem::transmute::<*mut c_void, $ty>(ptr) }
                    },)*
                })
            }
        }
    };
}

symbols! {
    ibv_get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
    ibv_free_device_list: unsafe extern "C" fn(*mut *mut ibv_device);
    ibv_get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
    ibv_get_device_guid: unsafe extern "C" fn(*mut ibv_device) -> u64;
    ibv_open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
    ibv_close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int;
    ibv_query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    ibv_query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    ibv_query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    ibv_alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
    ibv_dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int;
    ibv_reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    ibv_dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int;
    ibv_create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel;
    ibv_destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int;
    ibv_get_cq_event: unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, std::ffi::c_uint);
    ibv_create_cq: unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    ibv_destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int;
    ibv_create_srq: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq;
    ibv_destroy_srq: unsafe extern "C" fn(*mut ibv_srq) -> c_int;
    ibv_create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int;
    ibv_modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    ibv_query_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    ibv_wc_status_str: unsafe extern "C" fn(std::ffi::c_uint) -> *const c_char;
}

/// Reads a C string the library returned, or `None` for a null pointer.
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string that lives as long as
/// the returned borrow is used.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char) -> Option<&'a CStr> {
    if ptr.is_null() {
        None
    } else {
        // SAFETY: non-null and NUL-terminated by the caller's contract.
        Some(unsafe { CStr::from_ptr(ptr) })
    }
}
