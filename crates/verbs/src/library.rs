//! Opening libibverbs at run time, so a binary built with this crate starts
//! on machines without RDMA and uses it where it exists.

use crate::ffi::{self, Symbols};
use crate::{VerbsError, WcStatus};
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, OnceLock};

/// The names tried by [`Verbs::load`], in order: the runtime package's
/// soname first, then the development symlink.
pub const LIBRARY_NAMES: &[&str] = &["libibverbs.so.1", "libibverbs.so"];

/// libibverbs, opened with every entry point this crate uses resolved.
///
/// The library is never closed: providers register themselves in its global
/// state and every verbs object points into it, so unloading it while the
/// process runs would only trade a few pages for a use-after-free risk.
pub struct Verbs {
    pub(crate) sym: Symbols,
    library: String,
    _handle: *mut c_void,
}

// SAFETY: the handle is never used after loading (no dlclose), the symbol
// table is immutable function pointers, and libibverbs' entry points are
// thread-safe (rdma-core serialises its global device list and each
// provider locks its own queues).
unsafe impl Send for Verbs {}
// SAFETY: as above; `&Verbs` only reads immutable data.
unsafe impl Sync for Verbs {}

impl std::fmt::Debug for Verbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verbs")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

static GLOBAL: OnceLock<Result<Arc<Verbs>, VerbsError>> = OnceLock::new();

impl Verbs {
    /// Opens libibverbs (`libibverbs.so.1`, else `libibverbs.so`) and
    /// resolves every symbol this crate uses.
    ///
    /// Fails with [`VerbsError::LibraryNotFound`] ("libibverbs.so.1 not
    /// found: install rdma-core/libibverbs1 (...)") when no name opens, and
    /// with [`VerbsError::MissingSymbol`] naming the first absent symbol.
    pub fn load() -> Result<Arc<Self>, VerbsError> {
        Self::load_from(LIBRARY_NAMES)
    }

    /// The process-wide instance: loads on first call and hands every later
    /// caller the same library or the same error.
    pub fn get() -> Result<Arc<Self>, VerbsError> {
        GLOBAL.get_or_init(Self::load).clone()
    }

    /// Like [`Verbs::load`] with explicit library names (paths or sonames),
    /// tried in order; the first that opens is used.
    ///
    /// Fails as [`Verbs::load`] does, naming `names[0]` when none opens (or
    /// `InvalidArgument` for an empty list or a name with a NUL byte).
    pub fn load_from(names: &[&str]) -> Result<Arc<Self>, VerbsError> {
        let first = names
            .first()
            .ok_or_else(|| VerbsError::InvalidArgument("no library name to load".into()))?;
        let mut failures = Vec::new();
        for name in names {
            let c_name = CString::new(*name).map_err(|_| {
                VerbsError::InvalidArgument(format!("library name {name:?} contains NUL"))
            })?;
            // SAFETY: `c_name` is NUL-terminated. Loading runs the library's
            // constructors; libibverbs' only set up its global state.
            let handle =
                unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                failures.push(dl_error());
                continue;
            }
            // SAFETY: `handle` was just returned by dlopen and the library
            // opened under a libibverbs name is taken to be rdma-core's (a
            // library lacking these names fails here instead).
            let sym = unsafe { Symbols::resolve(handle) }.map_err(|symbol| {
                VerbsError::MissingSymbol {
                    library: (*name).to_owned(),
                    symbol,
                }
            })?;
            return Ok(Arc::new(Self {
                sym,
                library: (*name).to_owned(),
                _handle: handle,
            }));
        }
        Err(VerbsError::LibraryNotFound {
            library: (*first).to_owned(),
            detail: failures.join("; "),
        })
    }

    /// The name under which the library was opened.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// libibverbs' text for a work completion status (`ibv_wc_status_str`),
    /// e.g. "transport retry counter exceeded"; "unknown" if it has none.
    pub fn wc_status_str(&self, status: WcStatus) -> &'static str {
        // SAFETY: ibv_wc_status_str accepts any value (unknown ones map to
        // "unknown") and returns a pointer into a static table of the
        // library, which is never unloaded, so 'static holds.
        let text = unsafe { ffi::c_str((self.sym.ibv_wc_status_str)(status.0)) };
        text.and_then(|t| t.to_str().ok()).unwrap_or("unknown")
    }
}

/// The dynamic loader's last error message.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until
    // the next dl* call on this thread; it is copied out at once.
    unsafe {
        let msg = libc::dlerror();
        if msg.is_null() {
            "dlopen failed".to_owned()
        } else {
            CStr::from_ptr(msg).to_string_lossy().into_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_error_names_it() {
        let err = Verbs::load_from(&["libibverbs-multirail-absent.so.1"]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with(
                "libibverbs-multirail-absent.so.1 not found: install rdma-core/libibverbs1"
            ),
            "{text}"
        );
        assert!(matches!(err, VerbsError::LibraryNotFound { .. }));
    }

    #[test]
    fn wrong_library_names_missing_symbol() {
        let err = Verbs::load_from(&["libc.so.6"]).unwrap_err();
        assert_eq!(
            err,
            VerbsError::MissingSymbol {
                library: "libc.so.6".into(),
                symbol: "ibv_get_device_list"
            }
        );
    }

    #[test]
    fn empty_name_list_is_an_error() {
        assert!(matches!(
            Verbs::load_from(&[]),
            Err(VerbsError::InvalidArgument(_))
        ));
    }

    /// Passes on both kinds of machine: with libibverbs it loads and lists
    /// devices (none here is fine), without it the error names the library.
    #[test]
    fn load_works_or_names_the_library() {
        match Verbs::load() {
            Ok(verbs) => {
                assert!(LIBRARY_NAMES.contains(&verbs.library()));
                let devices = verbs.devices().expect("devices() with libibverbs present");
                if !std::path::Path::new(crate::SYSFS_INFINIBAND).exists() {
                    assert!(devices.is_empty(), "{devices:?}");
                }
                for d in &devices {
                    assert!(!d.name.is_empty());
                }
                assert_eq!(verbs.wc_status_str(WcStatus::SUCCESS), "success");
                assert_eq!(
                    verbs.wc_status_str(WcStatus::RETRY_EXC_ERR),
                    "transport retry counter exceeded"
                );
                assert!(Verbs::get().is_ok());
            }
            Err(err) => {
                let text = err.to_string();
                assert!(text.contains("libibverbs.so.1"), "{text}");
                assert!(text.contains("install rdma-core"), "{text}");
                assert_eq!(Verbs::get().unwrap_err(), err);
            }
        }
    }

    /// `dlsym` must hand us the current `IBVERBS_1.1` verbs, never the
    /// legacy 1.0 ones with their older struct layouts.
    #[cfg(target_env = "gnu")]
    #[test]
    fn dlsym_picks_the_current_symbol_versions() {
        let Ok(verbs) = Verbs::load() else {
            eprintln!("libibverbs not installed: skipping the symbol version check");
            return;
        };
        let name = CString::new(verbs.library()).unwrap();
        // SAFETY: the library is already loaded; this only takes a reference.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(!handle.is_null());
        for sym in [
            "ibv_reg_mr",
            "ibv_query_port",
            "ibv_create_qp",
            "ibv_modify_qp",
        ] {
            let s = CString::new(sym).unwrap();
            // SAFETY: live handle, NUL-terminated names.
            let (plain, v11) = unsafe {
                (
                    libc::dlsym(handle, s.as_ptr()),
                    libc::dlvsym(handle, s.as_ptr(), c"IBVERBS_1.1".as_ptr()),
                )
            };
            assert!(!plain.is_null(), "{sym}");
            assert_eq!(plain, v11, "{sym} resolves to a non-default version");
        }
        for sym in Symbols::NAMES {
            let s = CString::new(*sym).unwrap();
            // SAFETY: as above.
            let ptr = unsafe { libc::dlsym(handle, s.as_ptr()) };
            assert!(!ptr.is_null(), "{sym}");
        }
    }
}
