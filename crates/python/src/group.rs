//! `NativeGroup`: a joined multicast group ([`multirail::Group`]) for `multirail.Group`, and
//! `SlotView`, the exporter behind the memoryview `send_into` hands to its fill callback.
//!
//! **Threads.** The group sits in an `Arc` that every call clones for its duration, so several
//! Python threads send, receive and flush at once (with the GIL released while they wait).
//! `leave` consumes the group: it takes the `Arc` out (later calls fail with "group X was
//! left"), waits for the calls in flight to return and then leaves. `recv` waits in slices of
//! [`RECV_SLICE`], between which it notices a `leave` from another thread and Ctrl-C.
//!
//! **send_into.** `Group::try_send_with` lends the message's slot in the ring as `&mut [u8]` for
//! the duration of a Rust closure; the closure takes the GIL back and calls the Python `fill`
//! with a writable memoryview over the slot. The memoryview's exporter (`SlotView`, built by
//! hand like `BufferView`, see `view.rs`) counts the buffers it exported and refuses new ones
//! once `fill` returned; the memoryview is released then. A view that `fill` kept anyway (a
//! slice of the memoryview, a NumPy array over it) is reported as a `BufferError`, and cannot
//! touch unmapped memory: the exporter holds a reference to the group, so the ring stays mapped
//! until the last such view is gone.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use multirail::{Delivery, Engine, Group, GroupConfig, GroupStats};

use crate::buffer_type;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict};

use crate::{parse_transport, to_py, GroupError, InvalidArgumentError};

/// Longest single wait of `recv`: between two, it checks for signals and for a `leave` from
/// another thread. A message that arrives wakes it at once.
const RECV_SLICE: Duration = Duration::from_millis(50);

/// `Py_buffer` of CPython 3 (the layout has not changed since 3.3; the abi3-py39 headers of
/// PyO3 leave it out, as they leave out the functions below).
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    // Present in every CPython 3 (part of the stable ABI since 3.11, exported before too).
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// `PyBUF_SIMPLE`: contiguous bytes, no format, shape or strides.
const PYBUF_SIMPLE: c_int = 0;

/// The bytes of a Python object with the buffer protocol (`bytes`, `bytearray`, `memoryview`,
/// C-contiguous NumPy arrays...), borrowed without a copy; released on drop. The object
/// cannot be resized while this lives.
pub(crate) struct Borrowed<'py> {
    view: RawBuffer,
    _py: Python<'py>,
}

impl<'py> Borrowed<'py> {
    /// Borrows the bytes of `obj`; fails with the TypeError (or BufferError) Python raises
    /// for an object without the buffer protocol or not C-contiguous.
    pub(crate) fn new(obj: &Bound<'py, PyAny>) -> PyResult<Borrowed<'py>> {
        let mut view = RawBuffer {
            buf: ptr::null_mut(),
            obj: ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: ptr::null_mut(),
            shape: ptr::null_mut(),
            strides: ptr::null_mut(),
            suboffsets: ptr::null_mut(),
            internal: ptr::null_mut(),
        };
        // SAFETY: `obj` is a live object (we hold the GIL and a reference); `view` is a
        // properly laid out Py_buffer that the call fills. On success the export is ours to
        // release (Drop); on failure nothing needs releasing.
        if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, PYBUF_SIMPLE) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Borrowed {
            view,
            _py: obj.py(),
        })
    }

    fn ptr(&self) -> *const u8 {
        self.view.buf as *const u8
    }

    fn len(&self) -> usize {
        // A successful PyBUF_SIMPLE export has len >= 0.
        self.view.len.max(0) as usize
    }

    /// The borrowed bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: a successful PyBUF_SIMPLE export points at `len` contiguous bytes that stay
        // alive and unresized until the export is released on drop, which the borrow of
        // `self` outlives the returned slice. Another Python thread may write a mutable object
        // meanwhile only while the GIL is released, which `'py` held here rules out.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }
}

impl Drop for Borrowed<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
        // exactly once, with the GIL held (the `'py` token).
        unsafe { PyBuffer_Release(&mut self.view) }
    }
}

// ---- SlotView: the exporter of send_into's memoryview ----

#[repr(C)]
struct RawSlot {
    ob_base: ffi::PyObject,
    addr: usize,
    len: ffi::Py_ssize_t,
    /// Buffers exported and not released yet.
    exports: ffi::Py_ssize_t,
    /// Non-zero while `fill` runs; afterwards new exports are refused.
    valid: c_int,
    /// Keeps the group, and so the ring the slot lies in, mapped while this object lives.
    keep: *mut Arc<Group>,
}

// SAFETY (the four slot functions below): CPython alone calls them, with the GIL held (so the
// fields are never touched concurrently), on objects of the SlotView type: `obj` points at a
// RawSlot that `run_fill` initialised (tp_new refuses to make any other), following the slots'
// contracts: newfunc; destructor once, at refcount zero; getbufferproc with a Py_buffer to fill;
// releasebufferproc once per successful getbuffer.

unsafe extern "C" fn slot_new(
    _subtype: *mut ffi::PyTypeObject,
    _args: *mut ffi::PyObject,
    _kwargs: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    ffi::PyErr_SetString(
        ffi::PyExc_TypeError,
        c"SlotView objects are made by Group.send_into only".as_ptr(),
    );
    ptr::null_mut()
}

unsafe extern "C" fn slot_dealloc(obj: *mut ffi::PyObject) {
    let s = obj as *mut RawSlot;
    let keep = std::mem::replace(&mut (*s).keep, ptr::null_mut());
    if !keep.is_null() {
        // SAFETY: `keep` came from Box::into_raw in run_fill and is taken exactly once (nulled).
        drop(Box::from_raw(keep));
    }
    buffer_type::free_instance(obj);
}

unsafe extern "C" fn slot_getbuffer(
    obj: *mut ffi::PyObject,
    view: *mut c_void,
    flags: c_int,
) -> c_int {
    let s = obj as *mut RawSlot;
    if (*s).valid == 0 {
        ffi::PyErr_SetString(
            ffi::PyExc_BufferError,
            c"the slot of Group.send_into is writable only while fill runs".as_ptr(),
        );
        (*(view as *mut RawBuffer)).obj = ptr::null_mut();
        return -1;
    }
    // SAFETY: while `valid` is set, run_fill is inside `fill`, so the slot of `len` bytes at
    // `addr` is lent to us by try_send_with and nothing else touches it.
    let rc =
        buffer_type::PyBuffer_FillInfo(view, obj, (*s).addr as *mut c_void, (*s).len, 0, flags);
    if rc == 0 {
        (*s).exports += 1;
    }
    rc
}

unsafe extern "C" fn slot_releasebuffer(obj: *mut ffi::PyObject, _view: *mut c_void) {
    (*(obj as *mut RawSlot)).exports -= 1;
}

static SLOT_TYPE: GILOnceCell<PyObject> = GILOnceCell::new();

fn slot_type(py: Python<'_>) -> PyResult<&PyObject> {
    SLOT_TYPE.get_or_try_init(py, || {
        buffer_type::create(
            py,
            &buffer_type::BufferTypeSpec {
                name: c"multirail._native.SlotView",
                doc: c"The slot of a message being sent by Group.send_into (writable while fill runs).",
                basicsize: std::mem::size_of::<RawSlot>(),
                subclassable: false,
                new: slot_new,
                dealloc: slot_dealloc,
                getbuffer: slot_getbuffer,
                releasebuffer: Some(slot_releasebuffer),
            },
        )
    })
}

thread_local! {
    /// Groups (by `Arc` address) whose `send_into` runs its fill callback on this thread: their
    /// send state is locked, so a send, flush or leave of the same group from inside `fill`
    /// would deadlock and is refused instead.
    static FILLING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Marks group `key` as filling on this thread until dropped.
struct Filling(usize);

impl Filling {
    fn enter(key: usize) -> Filling {
        FILLING.with(|f| f.borrow_mut().push(key));
        Filling(key)
    }
}

impl Drop for Filling {
    fn drop(&mut self) {
        FILLING.with(|f| {
            let mut f = f.borrow_mut();
            if let Some(i) = f.iter().rposition(|k| *k == self.0) {
                f.remove(i);
            }
        });
    }
}

/// Why `fill` did not hand back a clean slot.
enum FillError {
    /// `fill` raised: the message is not sent.
    Raised(PyErr),
    /// A view of the slot outlived the call (`BufferError`): the message is sent as written,
    /// since writes through that view would otherwise land in the next message.
    Escaped(PyErr),
}

/// Calls `fill(memoryview of slot)`, then revokes the view. Errors: what `fill` raised, or a
/// `BufferError` when a view of the slot outlived the call.
fn run_fill(
    py: Python<'_>,
    slot: &mut [u8],
    fill: &PyObject,
    keep: Arc<Group>,
    group_name: &str,
) -> Result<(), FillError> {
    let tp = slot_type(py).map_err(FillError::Raised)?.bind(py);
    let tp_ptr = tp.as_ptr() as *mut ffi::PyTypeObject;
    // SAFETY: `tp` is the SlotView heap type, alive (the static holds it). Its tp_alloc (or
    // the generic allocator) returns a zeroed object of `basicsize` = size_of::<RawSlot>()
    // bytes with the header initialised and a reference to the type taken, or null with an
    // exception set. We initialise every field before Python can see the object.
    let exporter = unsafe {
        let alloc = ffi::PyType_GetSlot(tp_ptr, ffi::Py_tp_alloc);
        let alloc: ffi::allocfunc = if alloc.is_null() {
            ffi::PyType_GenericAlloc
        } else {
            std::mem::transmute::<*mut c_void, ffi::allocfunc>(alloc)
        };
        let obj = alloc(tp_ptr, 0);
        if obj.is_null() {
            return Err(FillError::Raised(PyErr::fetch(py)));
        }
        let s = obj as *mut RawSlot;
        (*s).addr = slot.as_mut_ptr() as usize;
        (*s).len = slot.len() as ffi::Py_ssize_t;
        (*s).exports = 0;
        (*s).valid = 1;
        (*s).keep = Box::into_raw(Box::new(keep));
        Bound::from_owned_ptr(py, obj)
    };
    let raw = exporter.as_ptr() as *mut RawSlot;
    // SAFETY: `exporter` is a live object with the buffer protocol; the call returns a new
    // reference or null with an exception set.
    let view = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PyMemoryView_FromObject(exporter.as_ptr()))
            .map_err(FillError::Raised)?
    };
    let called = fill.call1(py, (view.clone(),));
    // SAFETY: `raw` points into `exporter`, which we still hold; only threads holding the GIL
    // (as we do) read or write these fields.
    unsafe { (*raw).valid = 0 };
    // Fails (BufferError) only if something exported from the memoryview itself is alive;
    // that is caught by the count below.
    let _ = view.call_method0("release");
    drop(view);
    // SAFETY: as above.
    let escaped = unsafe { (*raw).exports };
    drop(exporter);
    if escaped > 0 {
        let err = PyBufferError::new_err(format!(
            "group {group_name}: send_into's fill kept a view of the message's slot after it \
             returned (a slice of the memoryview or an array over it); the message was sent, \
             but writes through that view can change it while it is pushed"
        ));
        if let Err(cause) = called {
            err.set_cause(py, Some(cause));
        }
        return Err(FillError::Escaped(err));
    }
    // No view of the slot is left (checked above): on an exception the slot is simply not
    // committed, and the next message takes it.
    called.map(|_| ()).map_err(FillError::Raised)
}

/// Final or current stats as a dict of counters.
fn stats_dict(py: Python<'_>, s: &GroupStats) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in [
        ("sent", s.sent),
        ("sent_bytes", s.sent_bytes),
        ("delivered", s.delivered),
        ("pushes", s.pushes),
        ("data_writes", s.data_writes),
        ("counter_writes", s.counter_writes),
        ("ack_writes", s.ack_writes),
        ("heartbeat_writes", s.heartbeat_writes),
        ("window_stalls", s.window_stalls),
        ("null_records", s.null_records),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d.unbind())
}

/// `delivery` argument of `join_group`.
pub(crate) fn parse_delivery(delivery: &str) -> PyResult<Delivery> {
    match delivery.to_ascii_lowercase().as_str() {
        "unordered" => Ok(Delivery::Unordered),
        "ordered" => Ok(Delivery::Ordered),
        _ => Err(InvalidArgumentError::new_err(format!(
            "invalid argument `delivery`: expected \"unordered\" or \"ordered\", got {delivery:?}"
        ))),
    }
}

/// The settings of `Engine.join_group`, as the Python layer passes them.
pub(crate) struct JoinArgs {
    pub name: String,
    pub members: Vec<String>,
    pub senders: Option<Vec<String>>,
    pub window_size: Option<u64>,
    pub max_payload: Option<u64>,
    pub delivery: Delivery,
    pub batching: Option<String>,
    pub flush_us: Option<u64>,
    pub transport: Option<String>,
    pub join_timeout_ms: Option<u64>,
}

/// `Engine.join_group`: checks the arguments, then joins with the GIL released.
pub(crate) fn join(py: Python<'_>, engine: &Engine, args: JoinArgs) -> PyResult<NativeGroup> {
    let mut config = GroupConfig::new(args.name, args.members);
    if let Some(senders) = args.senders {
        if senders.is_empty() {
            return Err(InvalidArgumentError::new_err(
                "invalid argument `senders`: an empty list; pass None for \"every member sends\"",
            ));
        }
        config.senders = senders;
    }
    config.window_size = args.window_size;
    config.max_payload = args.max_payload;
    config.delivery = args.delivery;
    config.batching = args.batching;
    config.flush_us = args.flush_us;
    config.transport = parse_transport(args.transport.as_deref())?;
    config.join_timeout_ms = args.join_timeout_ms;
    let timeout = Duration::from_millis(engine.config().transports.tcp.timeout_ms);
    let engine = engine.clone();
    let group = py
        .allow_threads(move || engine.join_group(config))
        .map_err(to_py)?;
    Ok(NativeGroup {
        name: group.name().to_owned(),
        members: group.members().to_vec(),
        max_payload: group.max_payload(),
        timeout,
        group: Mutex::new(Some(Arc::new(group))),
    })
}

/// A joined multicast group, as `multirail.Group` sees it.
#[pyclass(module = "multirail._native", frozen)]
pub(crate) struct NativeGroup {
    name: String,
    members: Vec<String>,
    max_payload: u64,
    /// `transports.tcp.timeout_ms`: the longest a call in flight may take to notice trouble.
    timeout: Duration,
    /// `None` once left.
    group: Mutex<Option<Arc<Group>>>,
}

impl NativeGroup {
    fn left_error(&self) -> PyErr {
        GroupError::new_err(format!("group {} was left", self.name))
    }

    /// The group for one call; fails once it was left.
    fn get(&self) -> PyResult<Arc<Group>> {
        self.group
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| self.left_error())
    }

    /// Refuses `what` from inside this group's own `send_into` fill (it would deadlock).
    fn not_filling(&self, group: &Arc<Group>, what: &str) -> PyResult<()> {
        let key = Arc::as_ptr(group) as usize;
        if FILLING.with(|f| f.borrow().contains(&key)) {
            return Err(GroupError::new_err(format!(
                "group {}: {what} called from inside send_into's fill callback; fill may only \
                 write the slot",
                self.name
            )));
        }
        Ok(())
    }
}

impl Drop for NativeGroup {
    fn drop(&mut self) {
        let group = self
            .group
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(group) = group {
            // Dropping the last handle stops the group thread (it may be finishing a write):
            // let other Python threads run meanwhile.
            Python::with_gil(|py| py.allow_threads(move || drop(group)));
        }
    }
}

#[pymethods]
impl NativeGroup {
    /// The group's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The members' segment names, in member order.
    #[getter]
    fn members(&self) -> Vec<String> {
        self.members.clone()
    }

    /// Largest message, bytes.
    #[getter]
    fn max_payload(&self) -> u64 {
        self.max_payload
    }

    /// True once `leave` took the group.
    #[getter]
    fn left(&self) -> bool {
        self.group
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// Sends the bytes of `data` (any C-contiguous object with the buffer protocol), copied
    /// once, straight into the ring. Returns the message index.
    fn send(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
        let group = self.get()?;
        self.not_filling(&group, "send")?;
        let bytes = Borrowed::new(data)?;
        let (src, len) = (bytes.ptr() as usize, bytes.len());
        let sent = py.allow_threads(|| {
            group.send_with(len, |slot| {
                // SAFETY: `src` points at `len` bytes of the exporting object, kept alive and
                // unresizable by the export `bytes` holds until after this call; `slot` has
                // `len` bytes (send_with's contract) and lies in the ring, not in `data`. Another
                // Python thread may write into a mutable object meanwhile: that can only tear the
                // copied bytes, as with any copy from memory Python code can change.
                unsafe { ptr::copy_nonoverlapping(src as *const u8, slot.as_mut_ptr(), len) }
            })
        });
        drop(bytes);
        sent.map_err(to_py)
    }

    /// Sends a message of `length` bytes that `fill(memoryview)` writes in place, in the
    /// ring. Returns the message index.
    fn send_into(&self, py: Python<'_>, length: usize, fill: PyObject) -> PyResult<u64> {
        let group = self.get()?;
        self.not_filling(&group, "send_into")?;
        if !fill.bind(py).is_callable() {
            return Err(PyTypeError::new_err(format!(
                "fill must be callable (it receives a writable memoryview), got {}",
                fill.bind(py).get_type().name()?
            )));
        }
        // Created here, with the GIL, so the closure below only looks it up.
        slot_type(py)?;
        let key = Arc::as_ptr(&group) as usize;
        let keep = group.clone();
        let name = self.name.as_str();
        let mut escaped: Option<PyErr> = None;
        let sent = py.allow_threads(|| {
            group.try_send_with(length, |slot| {
                Python::with_gil(|py| {
                    let _filling = Filling::enter(key);
                    match run_fill(py, slot, &fill, keep, name) {
                        Ok(()) => Ok(()),
                        Err(FillError::Raised(e)) => Err(e),
                        Err(FillError::Escaped(e)) => {
                            escaped = Some(e);
                            Ok(())
                        }
                    }
                })
            })
        });
        let index = sent.map_err(to_py)??;
        match escaped {
            None => Ok(index),
            Some(e) => {
                if let Ok(note) = e.value(py).getattr("add_note") {
                    let _ = note.call1((format!(
                        "message {index} of group {} was sent as the view left it",
                        self.name
                    ),));
                }
                Err(e)
            }
        }
    }

    /// Pushes everything sent so far and waits until every member can see it.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let group = self.get()?;
        self.not_filling(&group, "flush")?;
        py.allow_threads(|| group.flush()).map_err(to_py)
    }

    /// The next message as `(sender, index, bytes)`, or None after `timeout` seconds (None:
    /// no limit).
    #[pyo3(signature = (timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(String, u64, Py<PyBytes>)>> {
        // The group is fetched again each slice, so a `leave` from another thread is noticed.
        let got = crate::wait_in_slices(py, timeout, RECV_SLICE, |py, wait| {
            let group = self.get()?;
            py.allow_threads(|| group.recv(Some(wait))).map_err(to_py)
        })?;
        Ok(got.map(|m| {
            (
                m.sender.to_string(),
                m.index,
                PyBytes::new(py, &m.bytes).unbind(),
            )
        }))
    }

    /// Counters of what the group did at this member.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let group = self.get()?;
        stats_dict(py, &group.stats())
    }

    /// Leaves with the other members (a barrier) and returns the final stats.
    fn leave(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        self.not_filling(&self.get()?, "leave")?;
        let Some(shared) = self.group.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Err(self.left_error());
        };
        // Calls in flight in other threads return in time: recv within a slice, a send waiting
        // for room within 1.5 x the timeout, flush within the timeout.
        let patience = self.timeout * 2 + Duration::from_secs(1);
        let outcome = py.allow_threads(move || {
            let start = Instant::now();
            let mut shared = shared;
            let group = loop {
                match Arc::try_unwrap(shared) {
                    Ok(g) => break g,
                    Err(still) if start.elapsed() >= patience => return Err(still),
                    Err(still) => {
                        shared = still;
                        thread::sleep(Duration::from_millis(1));
                    }
                }
            };
            Ok(group.leave())
        });
        match outcome {
            Ok(left) => stats_dict(py, &left.map_err(to_py)?),
            Err(still) => {
                *self.group.lock().unwrap_or_else(|e| e.into_inner()) = Some(still);
                Err(GroupError::new_err(format!(
                    "group {}: cannot leave: calls of other threads, or a view kept from \
                     send_into, still used it after {} ms; the group is still joined",
                    self.name,
                    patience.as_millis()
                )))
            }
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<multirail._native.NativeGroup {} members={}>",
            self.name,
            self.members.len()
        )
    }
}
