//! Heap types whose instances lend memory through the buffer protocol, built by hand with
//! `PyType_FromSpec`: PyO3 only offers `__getbuffer__` with abi3 from Python 3.11 on, yet this
//! package targets abi3 for 3.9+. CPython has handled the `bf_getbuffer` and
//! `bf_releasebuffer` slots in `PyType_FromSpec` since 3.x (they were only left out of the
//! limited-API headers until 3.11), and `PyBuffer_FillInfo` has the same signature in every
//! Python 3. Used by `BufferView` (engine memory) and `SlotView` (a group message's slot).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;

extern "C" {
    // Present in every CPython 3 (declared here because the abi3-py39 headers leave it out).
    pub(crate) fn PyBuffer_FillInfo(
        view: *mut c_void,
        obj: *mut ffi::PyObject,
        buf: *mut c_void,
        len: ffi::Py_ssize_t,
        readonly: c_int,
        flags: c_int,
    ) -> c_int;
}

/// `Py_bf_getbuffer` and `Py_bf_releasebuffer` from typeslots.h (stable since Python 3.1).
const PY_BF_GETBUFFER: c_int = 1;
const PY_BF_RELEASEBUFFER: c_int = 2;

/// `getbufferproc`, with the `Py_buffer` opaque (the abi3-py39 headers do not declare it).
pub(crate) type GetBufferProc =
    unsafe extern "C" fn(*mut ffi::PyObject, *mut c_void, c_int) -> c_int;
/// `releasebufferproc`, likewise.
pub(crate) type ReleaseBufferProc = unsafe extern "C" fn(*mut ffi::PyObject, *mut c_void);

/// What a buffer-lending type is made of.
pub(crate) struct BufferTypeSpec {
    /// `module.Name`.
    pub name: &'static CStr,
    pub doc: &'static CStr,
    /// Size of the instance struct, object header included.
    pub basicsize: usize,
    /// Whether Python classes may subclass it.
    pub subclassable: bool,
    pub new: ffi::newfunc,
    pub dealloc: ffi::destructor,
    pub getbuffer: GetBufferProc,
    pub releasebuffer: Option<ReleaseBufferProc>,
}

/// Creates the type object `spec` describes. Fails with the Python error `PyType_FromSpec`
/// raised (out of memory, a bad size).
pub(crate) fn create(py: Python<'_>, spec: &BufferTypeSpec) -> PyResult<PyObject> {
    let slot = |slot: c_int, pfunc: *mut c_void| ffi::PyType_Slot { slot, pfunc };
    let mut slots = vec![
        slot(ffi::Py_tp_new, spec.new as *mut c_void),
        slot(ffi::Py_tp_dealloc, spec.dealloc as *mut c_void),
        slot(PY_BF_GETBUFFER, spec.getbuffer as *mut c_void),
        slot(ffi::Py_tp_doc, spec.doc.as_ptr() as *mut c_void),
    ];
    if let Some(release) = spec.releasebuffer {
        slots.push(slot(PY_BF_RELEASEBUFFER, release as *mut c_void));
    }
    slots.push(slot(0, ptr::null_mut()));
    let mut flags = ffi::Py_TPFLAGS_DEFAULT;
    if spec.subclassable {
        flags |= ffi::Py_TPFLAGS_BASETYPE;
    }
    let mut type_spec = ffi::PyType_Spec {
        name: spec.name.as_ptr() as *const c_char,
        basicsize: spec.basicsize as c_int,
        itemsize: 0,
        flags: flags as _,
        slots: slots.as_mut_ptr(),
    };
    // SAFETY: `type_spec` and `slots` are valid for the call, which copies what it keeps (name
    // and doc are 'static). Each slot function has the signature CPython calls that slot with
    // (typed above: newfunc, destructor, getbufferproc, releasebufferproc).
    unsafe {
        let tp = ffi::PyType_FromSpec(&mut type_spec);
        if tp.is_null() {
            return Err(PyErr::fetch(py));
        }
        Ok(PyObject::from_owned_ptr(py, tp))
    }
}

/// The end of every `tp_dealloc` here: frees `obj` with its type's `tp_free` and drops the
/// reference each instance of a heap type holds to its type.
///
/// # Safety
/// Called once, from `tp_dealloc`, with the GIL held, on an object of a type made by
/// [`create`], after its own fields were released.
pub(crate) unsafe fn free_instance(obj: *mut ffi::PyObject) {
    let tp = ffi::Py_TYPE(obj);
    let free = ffi::PyType_GetSlot(tp, ffi::Py_tp_free);
    if !free.is_null() {
        let free: ffi::freefunc = std::mem::transmute::<*mut c_void, ffi::freefunc>(free);
        free(obj as *mut c_void);
    }
    ffi::Py_DECREF(tp as *mut ffi::PyObject);
}
