//! `multirail._native`: the PyO3 extension module under the Python package `multirail`.
//!
//! The Pythonic surface (`multirail.Engine`, `multirail.Buffer`, `multirail.mooncake`) is written
//! in Python on top of these classes; everything that touches memory or waits for the network is
//! here and runs with the GIL released.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use multirail::{BatchId, Config, Engine, Location, Opcode, SegmentId, Status, TransportChoice};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// Keys of per-priority figures in the dicts handed to Python, in priority order.
const PRIORITY_NAMES: [&str; 3] = ["high", "medium", "low"];

mod buffer_type;
mod group;
mod prepared;
mod view;

create_exception!(
    multirail,
    Error,
    PyException,
    "Base class of every error the multirail engine reports; str(e) is the engine's message."
);
create_exception!(
    multirail,
    ConfigError,
    Error,
    "The configuration is malformed; the message names the key."
);
create_exception!(
    multirail,
    InvalidArgumentError,
    Error,
    "An argument is out of range or malformed."
);
create_exception!(
    multirail,
    SourceNotRegisteredError,
    Error,
    "A request's local range is not inside memory this engine allocated or registered."
);
create_exception!(
    multirail,
    TargetOutOfRangeError,
    Error,
    "A request's remote range lies outside every buffer of the target segment."
);
create_exception!(
    multirail,
    UnknownSegmentError,
    Error,
    "A segment that was never opened or was closed."
);
create_exception!(
    multirail,
    SegmentUnreachableError,
    Error,
    "Nothing answered at the segment's address."
);
create_exception!(
    multirail,
    UnknownBatchError,
    Error,
    "A batch that was never allocated or was already freed."
);
create_exception!(
    multirail,
    BatchFullError,
    Error,
    "The requests do not fit in the batch."
);
create_exception!(
    multirail,
    BatchBusyError,
    Error,
    "The batch still has requests in flight."
);
create_exception!(
    multirail,
    PeerDisconnectedError,
    Error,
    "The peer closed the connection or died while requests were in flight."
);
create_exception!(
    multirail,
    TransferTimeoutError,
    Error,
    "The peer did not answer within transports.tcp.timeout_ms."
);
create_exception!(
    multirail,
    RemoteRejectedError,
    Error,
    "The peer checked a slice and refused it (unknown buffer, wrong key, out of bounds)."
);
create_exception!(
    multirail,
    ProtocolError,
    Error,
    "The peer sent something that is not valid protocol."
);
create_exception!(
    multirail,
    AllocationError,
    Error,
    "Allocating, mapping or registering memory failed."
);
create_exception!(
    multirail,
    TransportUnavailableError,
    Error,
    "The demanded transport cannot serve this request."
);
create_exception!(
    multirail,
    WaitTimeoutError,
    Error,
    "wait() gave up before every request of the batch finished."
);
create_exception!(
    multirail,
    IoError,
    Error,
    "An operating-system call failed."
);
create_exception!(
    multirail,
    NotAMemberError,
    Error,
    "This engine and the peer do not share the membership token (auth.token / MULTIRAIL_TOKEN)."
);
create_exception!(
    multirail,
    GroupError,
    Error,
    "A multicast group refused an operation (message over max_payload, not a sender, group left, flush or leave not done in time)."
);
create_exception!(
    multirail,
    GroupJoinError,
    GroupError,
    "Joining a multicast group failed: a member joined with different settings (named) or did not join in time."
);
create_exception!(
    multirail,
    GroupMemberFailedError,
    GroupError,
    "A member of the multicast group died, stopped answering or stopped acknowledging (the window stayed full); the group cannot go on. Attributes `group` and `member` name them."
);

/// Turns an engine error into the matching `multirail.Error` subclass, keeping its message.
fn to_py(e: multirail::Error) -> PyErr {
    use multirail::Error as E;
    let msg = e.to_string();
    #[allow(unreachable_patterns)]
    match e {
        E::Config(_) => ConfigError::new_err(msg),
        E::InvalidArgument { .. } => InvalidArgumentError::new_err(msg),
        E::SourceNotRegistered { .. } => SourceNotRegisteredError::new_err(msg),
        E::TargetOutOfRange { .. } => TargetOutOfRangeError::new_err(msg),
        E::UnknownSegment(_) => UnknownSegmentError::new_err(msg),
        E::SegmentUnreachable { .. } => SegmentUnreachableError::new_err(msg),
        E::UnknownBatch(_) => UnknownBatchError::new_err(msg),
        E::BatchFull { .. } => BatchFullError::new_err(msg),
        E::BatchBusy(_) => BatchBusyError::new_err(msg),
        E::PeerDisconnected { .. } => PeerDisconnectedError::new_err(msg),
        E::Timeout { .. } => TransferTimeoutError::new_err(msg),
        E::RemoteRejected { .. } => RemoteRejectedError::new_err(msg),
        E::Protocol { .. } => ProtocolError::new_err(msg),
        E::Memory(_) => AllocationError::new_err(msg),
        E::TransportUnavailable { .. } => TransportUnavailableError::new_err(msg),
        E::WaitTimeout { .. } => WaitTimeoutError::new_err(msg),
        E::Io { .. } => IoError::new_err(msg),
        E::NotAMember { .. } => NotAMemberError::new_err(msg),
        E::GroupJoin { .. } => GroupJoinError::new_err(msg),
        E::Group { .. } => GroupError::new_err(msg),
        E::GroupMemberFailed(f) => {
            let err = GroupMemberFailedError::new_err(msg);
            Python::with_gil(|py| {
                let value = err.value(py);
                let _ = value.setattr("group", f.group.as_str());
                let _ = value.setattr("member", f.member.as_str());
            });
            err
        }
        // Variants added to the engine later still reach Python as multirail.Error.
        _ => Error::new_err(msg),
    }
}

fn config_err(e: multirail::ConfigError) -> PyErr {
    to_py(multirail::Error::Config(e))
}

fn parse_opcode(op: &str) -> PyResult<Opcode> {
    match op.to_ascii_lowercase().as_str() {
        "read" => Ok(Opcode::Read),
        "write" => Ok(Opcode::Write),
        _ => Err(InvalidArgumentError::new_err(format!(
            "invalid argument `opcode`: expected \"read\" or \"write\", got {op:?}"
        ))),
    }
}

fn parse_transport(t: Option<&str>) -> PyResult<Option<TransportChoice>> {
    match t {
        None => Ok(None),
        Some("auto") => Ok(Some(TransportChoice::Auto)),
        Some("tcp") => Ok(Some(TransportChoice::Tcp)),
        Some("shm") => Ok(Some(TransportChoice::Shm)),
        Some("rdma") => Ok(Some(TransportChoice::Rdma)),
        Some(other) => Err(InvalidArgumentError::new_err(format!(
            "invalid argument `transport`: expected \"auto\", \"tcp\", \"shm\" or \"rdma\", got {other:?}"
        ))),
    }
}

fn parse_location(loc: &str) -> PyResult<Location> {
    loc.parse::<Location>().map_err(to_py)
}

fn status_str(s: &Status) -> &'static str {
    match s {
        Status::Pending => "pending",
        Status::Completed => "completed",
        Status::Failed(_) => "failed",
    }
}

/// How long a blocking call waits with the GIL released before it looks for Ctrl-C.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Calls `attempt` with waits of at most `slice` until it finds something or `timeout`
/// seconds (None: no limit) pass, checking for signals between, so Ctrl-C interrupts a long
/// wait; `attempt` releases the GIL while it waits. Fails on a bad `timeout`, an error of
/// `attempt` or a signal.
pub(crate) fn wait_in_slices<T>(
    py: Python<'_>,
    timeout: Option<f64>,
    slice: Duration,
    mut attempt: impl FnMut(Python<'_>, Duration) -> PyResult<Option<T>>,
) -> PyResult<Option<T>> {
    // Beyond what an Instant can hold means no limit.
    let deadline = timeout_arg(timeout)?.and_then(|t| Instant::now().checked_add(t));
    loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(slice),
            None => slice,
        };
        if let Some(got) = attempt(py, wait)? {
            return Ok(Some(got));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        // `from_secs_f64` panics past what a Duration holds (about 5.8e11 years); such a wait
        // means "no limit", as None does.
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Duration::try_from_secs_f64(t).ok()),
        Some(t) => Err(InvalidArgumentError::new_err(format!(
            "invalid argument `timeout`: must be a non-negative number of seconds or None, got {t}"
        ))),
    }
}

/// Memory the engine allocated or registered; keeps allocated memory mapped while it lives.
#[pyclass(module = "multirail._native", frozen)]
struct NativeBuffer {
    buffer: multirail::Buffer,
}

#[pymethods]
impl NativeBuffer {
    /// Start address in this process (also what peers use as `target_offset`).
    #[getter]
    fn addr(&self) -> u64 {
        self.buffer.addr()
    }
    /// Length in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.buffer.len()
    }
    /// The access key peers present to touch this buffer.
    #[getter]
    fn key(&self) -> u64 {
        self.buffer.key()
    }
    /// `"*"` or `"cpu:N"`.
    #[getter]
    fn location(&self) -> String {
        self.buffer.location().to_string()
    }
}

/// One transfer, as `multirail.Request` builds it.
#[pyclass(module = "multirail._native", frozen)]
#[derive(Clone)]
struct NativeRequest {
    req: multirail::Request,
}

#[pymethods]
impl NativeRequest {
    #[new]
    #[pyo3(signature = (opcode, source, target, target_offset, length, priority, transport=None))]
    fn new(
        opcode: &str,
        source: u64,
        target: u64,
        target_offset: u64,
        length: u64,
        priority: u8,
        transport: Option<&str>,
    ) -> PyResult<Self> {
        let priority = multirail::Priority::from_u8(priority).ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "invalid argument priority: {priority} is not PRIO_HIGH (0), PRIO_MEDIUM (1) or PRIO_LOW (2)"
            ))
        })?;
        Ok(NativeRequest {
            req: multirail::Request {
                opcode: parse_opcode(opcode)?,
                source,
                target: SegmentId(target),
                target_offset,
                length,
                priority,
                transport: parse_transport(transport)?,
            },
        })
    }
}

/// A submitted batch; freed when the object goes away (if nothing is in flight then).
#[pyclass(module = "multirail._native", frozen)]
struct NativeBatch {
    engine: Engine,
    id: BatchId,
    len: usize,
}

impl Drop for NativeBatch {
    fn drop(&mut self) {
        // A batch still in flight stays with the engine (freed when the engine goes).
        let _ = self.engine.free_batch(self.id);
    }
}

#[pymethods]
impl NativeBatch {
    /// Number of requests in the batch.
    fn __len__(&self) -> usize {
        self.len
    }
    /// Engine batch id.
    #[getter]
    fn id(&self) -> u64 {
        self.id.0
    }
    /// `(status, error)` of request `index`; error is None unless status is "failed". A poll
    /// of a pending request may first do one of the batch's same-host copies (GIL released).
    fn status(&self, py: Python<'_>, index: usize) -> PyResult<(&'static str, Option<PyErr>)> {
        let (engine, id) = (self.engine.clone(), self.id);
        let s = py
            .allow_threads(move || engine.status(id, index))
            .map_err(to_py)?;
        Ok(match s {
            Status::Failed(e) => ("failed", Some(to_py(e))),
            other => (status_str(&other), None),
        })
    }
    /// `(status, error)` of the whole batch: failed if any failed, else pending while any runs.
    /// A poll may first do one of the batch's same-host copies (GIL released).
    fn overall_status(&self, py: Python<'_>) -> PyResult<(&'static str, Option<PyErr>)> {
        let (engine, id) = (self.engine.clone(), self.id);
        let s = py
            .allow_threads(move || engine.overall_status(id))
            .map_err(to_py)?;
        Ok(match s {
            Status::Failed(e) => ("failed", Some(to_py(e))),
            other => (status_str(&other), None),
        })
    }
    /// Blocks (GIL released) until every request finished or `timeout` seconds passed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout_arg(timeout)?;
        let engine = self.engine.clone();
        let id = self.id;
        py.allow_threads(move || engine.wait(id, timeout))
            .map_err(to_py)
    }
    /// Frees the batch now; fails with BatchBusyError while requests are in flight.
    fn free(&self) -> PyResult<()> {
        self.engine.free_batch(self.id).map_err(to_py)
    }
}

/// Memory ranges the Mooncake layer registered, to check raw-address copies against.
#[derive(Default)]
struct Ranges {
    by_addr: BTreeMap<u64, u64>,
}

impl Ranges {
    fn contains(&self, addr: u64, len: u64) -> bool {
        match self.by_addr.range(..=addr).next_back() {
            Some((&start, &size)) => len <= size && addr - start <= size - len,
            None => false,
        }
    }
}

/// The engine as the Python layer sees it.
#[pyclass(module = "multirail._native", frozen)]
struct NativeEngine {
    engine: Engine,
    /// Segments opened by name for the Mooncake-style calls.
    segments: Mutex<HashMap<String, SegmentId>>,
    /// Registered or allocated ranges (Mooncake layer), for write/read_bytes checks.
    ranges: Mutex<Ranges>,
    /// Buffers allocated through `allocate` and kept alive by address (Mooncake's managed buffers).
    managed: Mutex<HashMap<u64, multirail::Buffer>>,
}

impl NativeEngine {
    fn segment(&self, py: Python<'_>, name: &str) -> PyResult<SegmentId> {
        if let Some(id) = self.segments.lock().unwrap().get(name) {
            return Ok(*id);
        }
        let engine = self.engine.clone();
        let owned = name.to_owned();
        let id = py
            .allow_threads(move || engine.open_segment(&owned))
            .map_err(to_py)?;
        self.segments.lock().unwrap().insert(name.to_owned(), id);
        Ok(id)
    }

    fn forget_segment(&self, name: &str) {
        if let Some(id) = self.segments.lock().unwrap().remove(name) {
            let _ = self.engine.close_segment(id);
        }
    }

    fn requests(
        seg: SegmentId,
        op: Opcode,
        sources: &[u64],
        targets: &[u64],
        lengths: &[u64],
    ) -> PyResult<Vec<multirail::Request>> {
        if sources.len() != targets.len() || sources.len() != lengths.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "invalid argument `buffers`: buffers, peer_buffer_addresses and lengths have different lengths ({}, {}, {})",
                sources.len(),
                targets.len(),
                lengths.len()
            )));
        }
        if sources.is_empty() {
            return Err(InvalidArgumentError::new_err(
                "invalid argument `buffers`: no transfer given",
            ));
        }
        Ok(sources
            .iter()
            .zip(targets)
            .zip(lengths)
            .map(|((&s, &t), &l)| {
                let mut r = multirail::Request::write(s, seg, t, l);
                r.opcode = op;
                r
            })
            .collect())
    }
}

#[pymethods]
impl NativeEngine {
    /// Starts an engine listening on `listen`. `config_json` (inline JSON) wins over
    /// `config_path`; with neither, MULTIRAIL_CONF or the defaults apply. `local_hostname`, when
    /// given and the configuration sets none, becomes the host part of the segment name.
    /// `segment_name` sets `metadata.segment_name` (the name published in a store).
    #[new]
    #[pyo3(signature = (listen, config_json=None, config_path=None, local_hostname=None, transport=None, metadata=None, segment_name=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        config_json: Option<&str>,
        config_path: Option<&str>,
        local_hostname: Option<String>,
        transport: Option<&str>,
        metadata: Option<&str>,
        segment_name: Option<String>,
    ) -> PyResult<Self> {
        let mut config = match (config_json, config_path) {
            (Some(json), _) => Config::from_json_str(json, "config").map_err(config_err)?,
            (None, Some(path)) => Config::from_file(Path::new(path)).map_err(config_err)?,
            (None, None) => Config::load(None).map_err(config_err)?,
        };
        if config.local_hostname.is_none() {
            config.local_hostname = local_hostname;
        }
        if let Some(t) = parse_transport(transport)? {
            config.transport = t;
        }
        if let Some(m) = metadata {
            config.use_metadata_server(m).map_err(|e| {
                InvalidArgumentError::new_err(format!("invalid argument `metadata`: {e}"))
            })?;
        }
        if segment_name.is_some() {
            config.metadata.segment_name = segment_name;
        }
        let listen = listen.to_owned();
        let engine = py
            .allow_threads(move || Engine::new(config, &listen))
            .map_err(to_py)?;
        Ok(NativeEngine {
            engine,
            segments: Mutex::default(),
            ranges: Mutex::default(),
            managed: Mutex::default(),
        })
    }

    /// Segment name, `host:port`.
    #[getter]
    fn name(&self) -> String {
        self.engine.name()
    }

    /// The name peers open this engine by: `metadata.segment_name`, else `name`.
    #[getter]
    fn segment_name(&self) -> String {
        self.engine.segment_name()
    }

    /// The effective configuration as JSON.
    fn config_json(&self) -> String {
        self.engine.config().to_json_pretty()
    }

    #[pyo3(signature = (size, location="*"))]
    fn allocate(&self, py: Python<'_>, size: usize, location: &str) -> PyResult<NativeBuffer> {
        let loc = parse_location(location)?;
        let engine = self.engine.clone();
        let buffer = py
            .allow_threads(move || engine.allocate(size, loc))
            .map_err(to_py)?;
        Ok(NativeBuffer { buffer })
    }

    #[pyo3(signature = (addr, length, location="*"))]
    fn register(&self, addr: u64, length: usize, location: &str) -> PyResult<NativeBuffer> {
        let loc = parse_location(location)?;
        let buffer = self
            .engine
            .register(addr as usize as *mut u8, length, loc)
            .map_err(to_py)?;
        Ok(NativeBuffer { buffer })
    }

    fn unregister(&self, addr: u64) -> PyResult<()> {
        self.engine.unregister(addr).map_err(to_py)
    }

    /// Opens segment `name`, returning its id (GIL released while the peer answers).
    fn open_segment(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        let engine = self.engine.clone();
        let owned = name.to_owned();
        py.allow_threads(move || engine.open_segment(&owned))
            .map(|s| s.0)
            .map_err(to_py)
    }

    fn close_segment(&self, id: u64) -> PyResult<()> {
        self.engine.close_segment(SegmentId(id)).map_err(to_py)
    }

    /// `(name, [(addr, len), ...])` of an opened segment, from the cached descriptor.
    fn segment_info(&self, id: u64) -> PyResult<(String, Vec<(u64, u64)>)> {
        let d = self
            .engine
            .segment_descriptor(SegmentId(id))
            .map_err(to_py)?;
        Ok((d.name, d.buffers.iter().map(|b| (b.addr, b.len)).collect()))
    }

    /// Allocates a batch sized for `requests`, submits them all (none if any is bad).
    fn submit(&self, py: Python<'_>, requests: Vec<NativeRequest>) -> PyResult<NativeBatch> {
        let reqs: Vec<multirail::Request> = requests.into_iter().map(|r| r.req).collect();
        if reqs.is_empty() {
            return Err(InvalidArgumentError::new_err(
                "invalid argument `requests`: submit needs at least one request",
            ));
        }
        let engine = self.engine.clone();
        let len = reqs.len();
        let id = py
            .allow_threads(|| {
                let id = engine.allocate_batch(reqs.len())?;
                if let Err(e) = engine.submit(id, &reqs) {
                    let _ = engine.free_batch(id);
                    return Err(e);
                }
                Ok(id)
            })
            .map_err(to_py)?;
        Ok(NativeBatch {
            engine: self.engine.clone(),
            id,
            len,
        })
    }

    /// Checks and routes a list of transfers once (`Engine::prepare`) for posting by index
    /// many times: entry i moves `lengths[i]` bytes between local address `sources[i]` and
    /// address `targets[i]` of opened segment `segments[i]`. `transport` forces one transport
    /// for every entry. Raises as `submit` does for the first bad entry (nothing is kept), and
    /// InvalidArgumentError for an empty list or columns of different lengths.
    #[pyo3(signature = (sources, segments, targets, lengths, transport=None))]
    fn prepare(
        &self,
        py: Python<'_>,
        sources: Vec<u64>,
        segments: Vec<u64>,
        targets: Vec<u64>,
        lengths: Vec<u64>,
        transport: Option<&str>,
    ) -> PyResult<prepared::NativePreparedList> {
        let entries = prepared::entries(&sources, &segments, &targets, &lengths)?;
        prepared::prepare(py, &self.engine, entries, transport)
    }

    /// What the listening port holds: `{"open", "pending", "accepted", "not_members",
    /// "shed_pending", "shed_idle", "refused_full", "accept_errors", "serve_threads"}`.
    fn connection_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.engine.connection_stats();
        let out = PyDict::new(py);
        out.set_item("open", c.open)?;
        out.set_item("pending", c.pending)?;
        out.set_item("accepted", c.accepted)?;
        out.set_item("not_members", c.not_members)?;
        out.set_item("shed_pending", c.shed_pending)?;
        out.set_item("shed_idle", c.shed_idle)?;
        out.set_item("refused_full", c.refused_full)?;
        out.set_item("accept_errors", c.accept_errors)?;
        out.set_item("serve_threads", c.serve_threads)?;
        Ok(out)
    }

    /// Per rail: name, bytes, slices, errors, ewma_gbps, inflight_bytes, window_bytes and
    /// priority_bytes (a dict: high, medium, low), which count what this engine initiates; and
    /// served: what peers read and wrote of this engine's memory over tcp on that rail,
    /// `{"read": {bytes, requests, refused, priority_bytes, priority_requests}, "write": {...}}`
    /// (all 0 on a rail nothing was served on). A rail only served on (it carried nothing this
    /// engine initiated) has its own entry with the other figures 0 and ewma_gbps None.
    /// `served_stats()` has the per-peer counts and the serving latency too.
    fn traffic_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let traffic = self.engine.traffic_stats();
        let served_on = |name: &str| traffic.served.rails.iter().find(|s| s.name == name);
        for r in &traffic.rails {
            let d = PyDict::new(py);
            d.set_item("name", &r.name)?;
            d.set_item("bytes", r.bytes)?;
            d.set_item("slices", r.slices)?;
            d.set_item("errors", r.errors)?;
            d.set_item("ewma_gbps", r.ewma_gbps)?;
            d.set_item("inflight_bytes", r.inflight_bytes)?;
            d.set_item("window_bytes", r.window_bytes)?;
            d.set_item("priority_bytes", priority_dict(py, r.priority_bytes)?)?;
            let served = served_on(&r.name).cloned().unwrap_or_default();
            d.set_item("served", served_rail_dict(py, &served)?)?;
            out.append(d)?;
        }
        for s in &traffic.served.rails {
            if traffic.rails.iter().any(|r| r.name == s.name) {
                continue;
            }
            let d = PyDict::new(py);
            d.set_item("name", &s.name)?;
            for key in [
                "bytes",
                "slices",
                "errors",
                "inflight_bytes",
                "window_bytes",
            ] {
                d.set_item(key, 0u64)?;
            }
            d.set_item("ewma_gbps", None::<f64>)?;
            d.set_item("priority_bytes", priority_dict(py, [0; 3])?)?;
            d.set_item("served", served_rail_dict(py, s)?)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// What peers read and wrote of this engine's memory over tcp (shm and RDMA transfers never
    /// reach this engine's CPU and are not counted): `{"rails": {name: {"read": {...},
    /// "write": {...}}}, "peers": {address: {"read": {bytes, requests}, "write": {...}}},
    /// "latency": {"read": {"high": {count, p50_us, p99_us}, ...}, "write": {...}},
    /// "max_peers": n}`. Past `max_peers` peer addresses, the rest count under "other".
    fn served_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let served = self.engine.traffic_stats().served;
        let rails = PyDict::new(py);
        for r in &served.rails {
            rails.set_item(&r.name, served_rail_dict(py, r)?)?;
        }
        let peers = PyDict::new(py);
        for p in &served.peers {
            let d = PyDict::new(py);
            for (op, c) in [("read", p.read), ("write", p.write)] {
                let o = PyDict::new(py);
                o.set_item("bytes", c.bytes)?;
                o.set_item("requests", c.requests)?;
                d.set_item(op, o)?;
            }
            peers.set_item(&p.peer, d)?;
        }
        let latency = PyDict::new(py);
        for (op, per_priority) in [
            ("read", &served.read_latency),
            ("write", &served.write_latency),
        ] {
            let d = PyDict::new(py);
            for (name, l) in PRIORITY_NAMES.iter().zip(per_priority) {
                let e = PyDict::new(py);
                e.set_item("count", l.count)?;
                e.set_item("p50_us", l.p50_us)?;
                e.set_item("p99_us", l.p99_us)?;
                d.set_item(*name, e)?;
            }
            latency.set_item(op, d)?;
        }
        let out = PyDict::new(py);
        out.set_item("rails", rails)?;
        out.set_item("peers", peers)?;
        out.set_item("latency", latency)?;
        out.set_item("max_peers", served.max_peers)?;
        Ok(out)
    }

    /// The metadata store as this engine sees it: `{"store": "up" | "down" | "unknown" |
    /// "not_used", "store_failures_in_a_row", "lookups", "lookup_failures", "publishes",
    /// "publish_failures", "watch_updates", "refreshes", "republishes"}`.
    fn metadata_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.engine.metadata_stats();
        let out = PyDict::new(py);
        out.set_item("store", m.store.as_str())?;
        out.set_item("store_failures_in_a_row", m.store_failures_in_a_row)?;
        out.set_item("lookups", m.lookups)?;
        out.set_item("lookup_failures", m.lookup_failures)?;
        out.set_item("publishes", m.publishes)?;
        out.set_item("publish_failures", m.publish_failures)?;
        out.set_item("watch_updates", m.watch_updates)?;
        out.set_item("refreshes", m.refreshes)?;
        out.set_item("republishes", m.republishes)?;
        Ok(out)
    }

    /// Priority queues: `{"priorities": {"high": {queued, dequeued, wait_p50_us, wait_p99_us},
    /// "medium": ..., "low": ...}, "promotions": n, "global_slot": slot or None}`.
    fn qos_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let q = self.engine.qos_stats();
        let priorities = PyDict::new(py);
        for (name, p) in PRIORITY_NAMES.iter().zip(q.priorities) {
            let d = PyDict::new(py);
            d.set_item("queued", p.queued)?;
            d.set_item("dequeued", p.dequeued)?;
            d.set_item("wait_p50_us", p.wait_p50_us)?;
            d.set_item("wait_p99_us", p.wait_p99_us)?;
            priorities.set_item(*name, d)?;
        }
        let out = PyDict::new(py);
        out.set_item("priorities", priorities)?;
        out.set_item("promotions", q.promotions)?;
        out.set_item("global_slot", q.global_slot)?;
        Ok(out)
    }

    /// Lanes of small messages: `{"dynamic", "max_dedicated", "receive_bytes",
    /// "outgoing": [{peer, lane, score, promotions, demotions, denials, duplex}], "incoming": [...],
    /// "requesting": {counter: n}, "granting": {counter: n}}`; `lane` is "shared" or
    /// "dedicated", `score` None when untracked.
    fn lanes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.engine.lanes();
        let peers = |list: &[multirail::PeerLaneReport]| -> PyResult<Bound<'py, PyList>> {
            let out = PyList::empty(py);
            for p in list {
                let d = PyDict::new(py);
                d.set_item("peer", &p.peer)?;
                let lane = match p.lane {
                    multirail::Lane::Shared => "shared",
                    multirail::Lane::Dedicated => "dedicated",
                };
                d.set_item("lane", lane)?;
                d.set_item("score", p.score)?;
                d.set_item("promotions", p.promotions)?;
                d.set_item("demotions", p.demotions)?;
                d.set_item("denials", p.denials)?;
                d.set_item("duplex", p.duplex)?;
                out.append(d)?;
            }
            Ok(out)
        };
        let counters = |s: &multirail::LanesStats| -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            for (k, v) in [
                ("requests_sent", s.requests_sent),
                ("accepts_sent", s.accepts_sent),
                ("accepts_received", s.accepts_received),
                ("denials_sent", s.denials_sent),
                ("denials_received", s.denials_received),
                ("demotes_sent", s.demotes_sent),
                ("demotes_received", s.demotes_received),
                ("evictions", s.evictions),
                ("timeouts", s.timeouts),
                ("promotions", s.promotions),
                ("demotions", s.demotions),
                ("switches", s.switches),
                ("peers_gone", s.peers_gone),
            ] {
                d.set_item(k, v)?;
            }
            Ok(d)
        };
        let out = PyDict::new(py);
        out.set_item("dynamic", r.dynamic)?;
        out.set_item("max_dedicated", r.max_dedicated)?;
        out.set_item("receive_bytes", r.receive_bytes)?;
        out.set_item("outgoing", peers(&r.outgoing)?)?;
        out.set_item("incoming", peers(&r.incoming)?)?;
        out.set_item("requesting", counters(&r.requesting)?)?;
        out.set_item("granting", counters(&r.granting)?)?;
        Ok(out)
    }

    /// Sends `msg` to opened segment `id` as a notification (GIL released).
    fn send_notification(&self, py: Python<'_>, id: u64, msg: &str) -> PyResult<()> {
        let engine = self.engine.clone();
        let msg = msg.to_owned();
        py.allow_threads(move || engine.send_notification(SegmentId(id), &msg))
            .map_err(to_py)
    }

    /// Notifications received since the last call: `[(sender segment name, msg), ...]`.
    fn receive_notifications(&self) -> Vec<(String, String)> {
        self.engine
            .receive_notifications()
            .into_iter()
            .map(|n| (n.from, n.msg))
            .collect()
    }

    /// [`receive_notifications`], but when none has arrived, waits (GIL released) up to
    /// `timeout` seconds (None: no limit) for the first; `[]` when none came in time.
    #[pyo3(signature = (timeout=None))]
    fn wait_notifications(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<(String, String)>> {
        // A wait that found nothing ends once the engine shut down (`close` in another
        // thread): nothing can arrive any more.
        let got = wait_in_slices(py, timeout, WAIT_SLICE, |py, wait| {
            let got = py.allow_threads(|| self.engine.wait_notifications(Some(wait)));
            Ok((!got.is_empty() || self.engine.is_shut_down()).then_some(got))
        })?;
        Ok(got
            .unwrap_or_default()
            .into_iter()
            .map(|n| (n.from, n.msg))
            .collect())
    }

    /// Sends the bytes of `data` (any C-contiguous object with the buffer protocol) to opened
    /// segment `id` as a message (GIL released while it waits for the peer's credit).
    fn send(&self, py: Python<'_>, id: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = group::Borrowed::new(data)?.bytes().to_vec();
        let engine = self.engine.clone();
        py.allow_threads(move || engine.send(SegmentId(id), &bytes))
            .map_err(to_py)
    }

    /// The next message from any peer as `(sender segment name, bytes)`, waiting (GIL
    /// released) up to `timeout` seconds (None: no limit); None when none came in time.
    #[pyo3(signature = (timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(String, Py<PyBytes>)>> {
        // As in `wait_notifications`: nothing more arrives once the engine shut down.
        let got = wait_in_slices(py, timeout, WAIT_SLICE, |py, wait| {
            let m = py
                .allow_threads(|| self.engine.recv(Some(wait)))
                .map_err(to_py)?;
            Ok(match m {
                Some(m) => Some(Some(m)),
                None if self.engine.is_shut_down() => Some(None),
                None => None,
            })
        })?
        .flatten();
        Ok(got.map(|m| (m.from.to_string(), PyBytes::new(py, &m.data).unbind())))
    }

    /// Sends a notification to segment `name` (opened on first use).
    fn mc_notify(&self, py: Python<'_>, name: &str, msg: &str) -> PyResult<()> {
        let seg = self.segment(py, name)?;
        let engine = self.engine.clone();
        let msg = msg.to_owned();
        py.allow_threads(move || engine.send_notification(seg, &msg))
            .map_err(to_py)
    }

    /// Joins multicast group `name` of `members` (segment names) and returns once every member
    /// joined (GIL released meanwhile). `None` settings come from `transports.<t>.multicast`.
    #[pyo3(signature = (name, members, senders=None, window_size=None, max_payload=None, delivery="unordered", batching=None, flush_us=None, transport=None, join_timeout_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn join_group(
        &self,
        py: Python<'_>,
        name: String,
        members: Vec<String>,
        senders: Option<Vec<String>>,
        window_size: Option<u64>,
        max_payload: Option<u64>,
        delivery: &str,
        batching: Option<String>,
        flush_us: Option<u64>,
        transport: Option<String>,
        join_timeout_ms: Option<u64>,
    ) -> PyResult<group::NativeGroup> {
        group::join(
            py,
            &self.engine,
            group::JoinArgs {
                name,
                members,
                senders,
                window_size,
                max_payload,
                delivery: group::parse_delivery(delivery)?,
                batching,
                flush_us,
                transport,
                join_timeout_ms,
            },
        )
    }

    /// Stops serving: closes the control port and every connection.
    fn shutdown(&self, py: Python<'_>) {
        let engine = self.engine.clone();
        py.allow_threads(move || engine.shutdown());
    }

    // ---- helpers for the Mooncake layer (addresses as integers, segments by name) ----

    /// Registers ranges (all or none); records them for the byte-copy checks.
    fn mc_register(&self, addrs: Vec<u64>, lens: Vec<u64>, location: &str) -> PyResult<()> {
        if addrs.len() != lens.len() {
            return Err(InvalidArgumentError::new_err(
                "invalid argument `capacities`: buffer_addresses and capacities have different lengths",
            ));
        }
        let loc = parse_location(location)?;
        let mut done = Vec::new();
        for (&a, &l) in addrs.iter().zip(&lens) {
            match self.engine.register(a as usize as *mut u8, l as usize, loc) {
                Ok(_) => done.push((a, l)),
                Err(e) => {
                    for (a, _) in done {
                        let _ = self.engine.unregister(a);
                    }
                    return Err(to_py(e));
                }
            }
        }
        let mut ranges = self.ranges.lock().unwrap();
        for (a, l) in done {
            ranges.by_addr.insert(a, l);
        }
        Ok(())
    }

    /// Unregisters every address it can; raises the first failure after trying them all.
    fn mc_unregister(&self, addrs: Vec<u64>) -> PyResult<()> {
        let mut first = None;
        for a in addrs {
            match self.engine.unregister(a) {
                Ok(()) => {
                    self.ranges.lock().unwrap().by_addr.remove(&a);
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), |e| Err(to_py(e)))
    }

    /// Allocates an engine buffer kept until `mc_free`; returns its address.
    fn mc_allocate(&self, py: Python<'_>, len: usize) -> PyResult<u64> {
        let engine = self.engine.clone();
        let b = py
            .allow_threads(move || engine.allocate(len, Location::Any))
            .map_err(to_py)?;
        let addr = b.addr();
        self.ranges.lock().unwrap().by_addr.insert(addr, len as u64);
        self.managed.lock().unwrap().insert(addr, b);
        Ok(addr)
    }

    fn mc_free(&self, addr: u64) -> PyResult<()> {
        let b = self.managed.lock().unwrap().remove(&addr).ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "invalid argument `buffer_addr`: {addr:#x} is not a managed buffer of this engine"
            ))
        })?;
        self.ranges.lock().unwrap().by_addr.remove(&addr);
        self.engine.free(&b).map_err(to_py)
    }

    /// Copies `data[:length]` to `addr`, which must lie in registered or managed memory.
    fn mc_write_bytes(&self, addr: u64, data: &[u8], length: usize) -> PyResult<()> {
        if length > data.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "invalid argument `length`: {length} is more than the {} bytes given",
                data.len()
            )));
        }
        if !self.ranges.lock().unwrap().contains(addr, length as u64) {
            return Err(SourceNotRegisteredError::new_err(format!(
                "range {addr:#x}+{length} is not inside memory registered or allocated through this engine"
            )));
        }
        // SAFETY: the range lies inside memory the caller registered (and promised to keep
        // alive until unregister) or that the engine allocated and still holds.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as usize as *mut u8, length) };
        Ok(())
    }

    /// Copies `length` bytes at `addr` (registered or managed memory) into a new `bytes`.
    fn mc_read_bytes<'py>(
        &self,
        py: Python<'py>,
        addr: u64,
        length: usize,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        if length > 0 && !self.ranges.lock().unwrap().contains(addr, length as u64) {
            return Err(SourceNotRegisteredError::new_err(format!(
                "range {addr:#x}+{length} is not inside memory registered or allocated through this engine"
            )));
        }
        // SAFETY: as in mc_write_bytes.
        let slice = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, length) };
        Ok(pyo3::types::PyBytes::new(py, slice))
    }

    /// Address of the first buffer segment `name` publishes (0 when it has none).
    fn mc_first_buffer(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        let seg = self.segment(py, name)?;
        let d = self.engine.segment_descriptor(seg).map_err(to_py)?;
        Ok(d.buffers.first().map_or(0, |b| b.addr))
    }

    /// Submits the transfers to segment `name` and waits for them (GIL released).
    /// With `notify`, the message is sent to the segment as a notification once every byte
    /// is in place.
    #[pyo3(signature = (name, opcode, sources, targets, lengths, timeout, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn mc_transfer_sync(
        &self,
        py: Python<'_>,
        name: &str,
        opcode: &str,
        sources: Vec<u64>,
        targets: Vec<u64>,
        lengths: Vec<u64>,
        timeout: f64,
        notify: Option<String>,
    ) -> PyResult<()> {
        let op = parse_opcode(opcode)?;
        let timeout = timeout_arg(Some(timeout))?;
        let seg = self.segment(py, name)?;
        let reqs = Self::requests(seg, op, &sources, &targets, &lengths)?;
        let total: u64 = lengths.iter().sum();
        let engine = self.engine.clone();
        let result = py.allow_threads(move || {
            let id = engine.allocate_batch(reqs.len())?;
            let submitted = match &notify {
                Some(msg) => engine.submit_with_notification(id, &reqs, msg),
                None => engine.submit(id, &reqs),
            };
            if let Err(e) = submitted {
                let _ = engine.free_batch(id);
                return Err(e);
            }
            let waited = wait_small(&engine, id, total, timeout);
            let _ = engine.free_batch(id);
            waited
        });
        if let Err(e) = &result {
            if matches!(
                e,
                multirail::Error::PeerDisconnected { .. } | multirail::Error::UnknownSegment(_)
            ) {
                self.forget_segment(name);
            }
        }
        result.map_err(to_py)
    }

    /// Submits the transfers to segment `name` without waiting; returns the batch id.
    fn mc_transfer_async(
        &self,
        py: Python<'_>,
        name: &str,
        opcode: &str,
        sources: Vec<u64>,
        targets: Vec<u64>,
        lengths: Vec<u64>,
    ) -> PyResult<u64> {
        let op = parse_opcode(opcode)?;
        let seg = self.segment(py, name)?;
        let reqs = Self::requests(seg, op, &sources, &targets, &lengths)?;
        let engine = self.engine.clone();
        py.allow_threads(move || {
            let id = engine.allocate_batch(reqs.len())?;
            if let Err(e) = engine.submit(id, &reqs) {
                let _ = engine.free_batch(id);
                return Err(e);
            }
            Ok(id.0)
        })
        .map_err(to_py)
    }

    /// Waits for an async batch up to `timeout` seconds; frees it once it finished (whatever
    /// the outcome). Returns "completed", "failed" or "pending" (timed out, still in flight).
    fn mc_wait_batch(&self, py: Python<'_>, id: u64, timeout: f64) -> PyResult<&'static str> {
        let timeout = timeout_arg(Some(timeout))?;
        let engine = self.engine.clone();
        let batch = BatchId(id);
        py.allow_threads(move || {
            let outcome = match engine.wait(batch, timeout) {
                Ok(()) => "completed",
                Err(multirail::Error::WaitTimeout { .. }) => return Ok("pending"),
                Err(multirail::Error::UnknownBatch(b)) => {
                    return Err(multirail::Error::UnknownBatch(b))
                }
                Err(_) => "failed",
            };
            // A failed batch may still have requests in flight; it is freed when they end.
            let _ = engine.free_batch(batch);
            Ok(outcome)
        })
        .map_err(to_py)
    }

    /// Non-blocking status of an async batch: "completed" (and freed), "failed" (freed when
    /// nothing is in flight any more) or "pending".
    fn mc_poll_batch(&self, id: u64) -> PyResult<&'static str> {
        let batch = BatchId(id);
        let s = self.engine.overall_status(batch).map_err(to_py)?;
        let out = status_str(&s);
        if out != "pending" {
            let _ = self.engine.free_batch(batch);
        }
        Ok(out)
    }
}

/// Transfers up to this many bytes are waited for by polling first (as Mooncake's binding does
/// for every transfer): a blocked thread's wake-up costs tens of microseconds, more than such a
/// transfer takes on loopback.
const POLL_BYTES: u64 = 64 << 10;
/// How long a small transfer is polled for before the thread blocks.
const POLL_FOR: Duration = Duration::from_micros(500);

/// `Engine::wait`, polling first for small transfers.
fn wait_small(
    engine: &Engine,
    id: BatchId,
    total: u64,
    timeout: Option<Duration>,
) -> multirail::Result<()> {
    if total <= POLL_BYTES {
        let start = std::time::Instant::now();
        while start.elapsed() < POLL_FOR {
            match engine.overall_status(id)? {
                Status::Pending => std::thread::yield_now(),
                Status::Completed => return Ok(()),
                Status::Failed(e) => return Err(e),
            }
        }
    }
    engine.wait(id, timeout.map(|t| t.saturating_sub(POLL_FOR)))
}

/// `multirail._native.init_logging()`: sends the engine's tracing output to stderr, filtered by
/// RUST_LOG (nothing is printed when RUST_LOG is unset). Called once at import.
#[pyfunction]
fn init_logging() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<NativeEngine>()?;
    m.add_class::<NativeBuffer>()?;
    m.add_class::<NativeRequest>()?;
    m.add_class::<NativeBatch>()?;
    m.add_class::<prepared::NativePreparedList>()?;
    m.add_class::<group::NativeGroup>()?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add("PRIO_HIGH", multirail::PRIO_HIGH.as_u8())?;
    m.add("PRIO_MEDIUM", multirail::PRIO_MEDIUM.as_u8())?;
    m.add("PRIO_LOW", multirail::PRIO_LOW.as_u8())?;
    m.add("BufferView", view::create_type(py)?)?;
    macro_rules! exc {
        ($($name:ident),*) => { $( m.add(stringify!($name), py.get_type::<$name>())?; )* };
    }
    exc!(
        Error,
        ConfigError,
        InvalidArgumentError,
        SourceNotRegisteredError,
        TargetOutOfRangeError,
        UnknownSegmentError,
        SegmentUnreachableError,
        UnknownBatchError,
        BatchFullError,
        BatchBusyError,
        PeerDisconnectedError,
        TransferTimeoutError,
        RemoteRejectedError,
        ProtocolError,
        AllocationError,
        TransportUnavailableError,
        WaitTimeoutError,
        IoError,
        NotAMemberError,
        GroupError,
        GroupJoinError,
        GroupMemberFailedError
    );
    Ok(())
}

/// `{"high": v, "medium": v, "low": v}` of per-priority figures.
fn priority_dict(py: Python<'_>, values: [u64; 3]) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in PRIORITY_NAMES.iter().zip(values) {
        d.set_item(*name, v)?;
    }
    Ok(d)
}

/// `{"read": {...}, "write": {...}}` of what one rail served.
fn served_rail_dict<'py>(
    py: Python<'py>,
    r: &multirail::ServedRailTraffic,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (op, t) in [("read", &r.read), ("write", &r.write)] {
        let o = PyDict::new(py);
        o.set_item("bytes", t.bytes)?;
        o.set_item("requests", t.requests)?;
        o.set_item("refused", t.refused)?;
        o.set_item("priority_bytes", priority_dict(py, t.priority_bytes)?)?;
        o.set_item("priority_requests", priority_dict(py, t.priority_requests)?)?;
        d.set_item(op, o)?;
    }
    Ok(d)
}
