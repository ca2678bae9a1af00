//! `BufferView`: a small type that exposes `len` bytes at `addr` through the buffer protocol,
//! so `memoryview(buf)` and `numpy.frombuffer(buf, ...)` see engine memory without a copy.
//!
//! The type is built by hand (see `buffer_type` for why); `multirail.Buffer` (Python)
//! subclasses it.
//!
//! Layout: the object header, the address, the length and a strong reference to the owner (the
//! object keeping the memory alive). Exports hold a reference to the view, so the memory stays
//! alive while any memoryview or NumPy array over it exists.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffer_type;

#[repr(C)]
struct RawView {
    ob_base: ffi::PyObject,
    addr: usize,
    len: ffi::Py_ssize_t,
    owner: *mut ffi::PyObject,
}

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
    let v = obj as *mut RawView;
    let owner = (*v).owner;
    (*v).owner = ptr::null_mut();
    if !owner.is_null() {
        ffi::Py_DECREF(owner);
    }
    buffer_type::free_instance(obj);
}

unsafe extern "C" fn view_getbuffer(
    obj: *mut ffi::PyObject,
    view: *mut c_void,
    flags: c_int,
) -> c_int {
    let v = obj as *mut RawView;
    buffer_type::PyBuffer_FillInfo(view, obj, (*v).addr as *mut c_void, (*v).len, 0, flags)
}

/// Creates the `BufferView` type object.
pub(crate) fn create_type(py: Python<'_>) -> PyResult<PyObject> {
    buffer_type::create(
        py,
        &buffer_type::BufferTypeSpec {
            name: c"multirail._native.BufferView",
            doc: c"Writable bytes at a fixed address, exposed through the buffer protocol.",
            basicsize: std::mem::size_of::<RawView>(),
            subclassable: true,
            new: view_new,
            dealloc: view_dealloc,
            getbuffer: view_getbuffer,
            releasebuffer: None,
        },
    )
}
