//! `BufferView`: a small type that exposes `len` bytes at `addr` through the buffer protocol,
//! so `memoryview(buf)` and `numpy.frombuffer(buf, ...)` see engine memory without a copy.
//!
//! PyO3 only offers `__getbuffer__` with abi3 from Python 3.11 on, yet this package targets
//! abi3 for 3.9+. The type is therefore built by hand with `PyType_FromSpec` and a
//! `bf_getbuffer` slot: CPython has handled that slot in `PyType_FromSpec` since 3.x (it was
//! only left out of the limited-API headers until 3.11), and `PyBuffer_FillInfo` has the same
//! signature in every Python 3. `multirail.Buffer` (Python) subclasses it.
//!
//! Layout: the object header, the address, the length and a strong reference to the owner (the
//! object keeping the memory alive). Exports hold a reference to the view, so the memory stays
//! alive while any memoryview or NumPy array over it exists.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;

#[repr(C)]
struct RawView {
    ob_base: ffi::PyObject,
    addr: usize,
    len: ffi::Py_ssize_t,
    owner: *mut ffi::PyObject,
}

extern "C" {
    // Present in every CPython 3 (declared here because the abi3-py39 headers leave it out).
    fn PyBuffer_FillInfo(
        view: *mut c_void,
        obj: *mut ffi::PyObject,
        buf: *mut c_void,
        len: ffi::Py_ssize_t,
        readonly: c_int,
        flags: c_int,
    ) -> c_int;
}

/// `Py_bf_getbuffer` from typeslots.h (stable value since Python 3.1).
const PY_BF_GETBUFFER: c_int = 1;

unsafe fn set_error(exc: *mut ffi::PyObject, msg: &'static [u8]) {
    ffi::PyErr_SetString(exc, msg.as_ptr() as *const c_char);
}

/// `BufferView(addr, length, owner)`.
unsafe extern "C" fn view_new(
    subtype: *mut ffi::PyTypeObject,
    args: *mut ffi::PyObject,
    _kwargs: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    if ffi::PyTuple_Size(args) != 3 {
        set_error(
            ffi::PyExc_TypeError,
            b"BufferView(addr, length, owner) takes exactly 3 arguments\0",
        );
        return ptr::null_mut();
    }
    let addr = ffi::PyLong_AsSize_t(ffi::PyTuple_GetItem(args, 0));
    if !ffi::PyErr_Occurred().is_null() {
        return ptr::null_mut();
    }
    let len = ffi::PyLong_AsSsize_t(ffi::PyTuple_GetItem(args, 1));
    if !ffi::PyErr_Occurred().is_null() {
        return ptr::null_mut();
    }
    if len < 0 || (addr == 0 && len > 0) {
        set_error(
            ffi::PyExc_ValueError,
            b"BufferView: length must be >= 0 and addr non-null\0",
        );
        return ptr::null_mut();
    }
    let owner = ffi::PyTuple_GetItem(args, 2);
    let alloc = ffi::PyType_GetSlot(subtype, ffi::Py_tp_alloc);
    let alloc: ffi::allocfunc = if alloc.is_null() {
        ffi::PyType_GenericAlloc
    } else {
        std::mem::transmute::<*mut c_void, ffi::allocfunc>(alloc)
    };
    let obj = alloc(subtype, 0);
    if obj.is_null() {
        return ptr::null_mut();
    }
    let v = obj as *mut RawView;
    (*v).addr = addr;
    (*v).len = len;
    ffi::Py_INCREF(owner);
    (*v).owner = owner;
    obj
}

unsafe extern "C" fn view_dealloc(obj: *mut ffi::PyObject) {
    let tp = ffi::Py_TYPE(obj);
    let v = obj as *mut RawView;
    let owner = (*v).owner;
    (*v).owner = ptr::null_mut();
    if !owner.is_null() {
        ffi::Py_DECREF(owner);
    }
    let free = ffi::PyType_GetSlot(tp, ffi::Py_tp_free);
    if !free.is_null() {
        let free: ffi::freefunc = std::mem::transmute::<*mut c_void, ffi::freefunc>(free);
        free(obj as *mut c_void);
    }
    // Instances of heap types own a reference to their type.
    ffi::Py_DECREF(tp as *mut ffi::PyObject);
}

unsafe extern "C" fn view_getbuffer(
    obj: *mut ffi::PyObject,
    view: *mut c_void,
    flags: c_int,
) -> c_int {
    let v = obj as *mut RawView;
    PyBuffer_FillInfo(view, obj, (*v).addr as *mut c_void, (*v).len, 0, flags)
}

static DOC: &[u8] = b"Writable bytes at a fixed address, exposed through the buffer protocol.\0";
static NAME: &[u8] = b"multirail._native.BufferView\0";

/// Creates the `BufferView` type object.
pub(crate) fn create_type(py: Python<'_>) -> PyResult<PyObject> {
    let mut slots = [
        ffi::PyType_Slot {
            slot: ffi::Py_tp_new,
            pfunc: view_new as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_dealloc,
            pfunc: view_dealloc as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: PY_BF_GETBUFFER,
            pfunc: view_getbuffer as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_doc,
            pfunc: DOC.as_ptr() as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: 0,
            pfunc: ptr::null_mut(),
        },
    ];
    let mut spec = ffi::PyType_Spec {
        name: NAME.as_ptr() as *const c_char,
        basicsize: std::mem::size_of::<RawView>() as c_int,
        itemsize: 0,
        flags: (ffi::Py_TPFLAGS_DEFAULT | ffi::Py_TPFLAGS_BASETYPE) as _,
        slots: slots.as_mut_ptr(),
    };
    // SAFETY: spec and slots are valid for the call; PyType_FromSpec copies what it keeps
    // (name and doc are 'static).
    unsafe {
        let tp = ffi::PyType_FromSpec(&mut spec);
        if tp.is_null() {
            return Err(PyErr::fetch(py));
        }
        Ok(PyObject::from_owned_ptr(py, tp))
    }
}
