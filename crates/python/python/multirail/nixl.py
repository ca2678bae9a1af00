"""Drop-in for NIXL's Python agent API (``nixl._api``: ``nixl_agent``, ``nixl_agent_config``) on
the multirail engine, so a KV connector written for NIXL (vLLM's NixlConnector) moves its blocks
with multirail by changing one import::

    from multirail.nixl import nixl_agent, nixl_agent_config   # instead of: from nixl._api import ...

    agent = nixl_agent("prefill-0", nixl_agent_config(backends=["MULTIRAIL"]))   # ["UCX"] works too
    reg = agent.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
    meta = agent.get_agent_metadata()                 # bytes: send them to the peer out of band
    peer = agent.add_remote_agent(peer_meta)          # the peer's agent name
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_blocks, "DRAM")   # Nx3 (addr, len, dev)
    remote = agent.prep_xfer_dlist(peer, remote_blocks, "DRAM")
    handle = agent.make_prepped_xfer("READ", local, ids, remote, ids, notif_msg=b"req-1")
    agent.transfer(handle)                            # "PROC" (or "DONE", "ERR")
    while agent.check_xfer_state(handle) == "PROC": ...
    agent.release_xfer_handle(handle)

Every method vLLM's NixlConnector calls is here with NIXL 1.5.1's signature, argument names and
return types. What they mean on multirail:

* Backends: ``"MULTIRAIL"`` and, so unchanged configurations work, ``"UCX"`` both mean the
  multirail engine (shared memory to same-host peers, RDMA when both ends have it, else TCP, as
  its configuration says); other names are skipped with a warning, as NIXL skips a missing
  plugin. ``backends=[...]`` arguments of other methods must name created backends (KeyError
  otherwise, as in NIXL) and do not change anything.
* Memory: ``"DRAM"`` (and its old name ``"cpu"``). Other memory types build descriptor lists
  but registering or preparing them raises :class:`nixlNotSupportedError`.
* Agent metadata is a few bytes naming the agent and its multirail segment; the remote agent's
  registered memory is read from its segment when :meth:`nixl_agent.add_remote_agent` opens it
  (memory it registers later is found when it is first used, or after loading its metadata
  again).
* :meth:`nixl_agent.make_prepped_xfer` pairs local index ``i`` with remote index ``i`` and builds
  one multirail prepared list (checked and routed once; contiguous pairs are merged unless
  ``skip_desc_merge``); :meth:`nixl_agent.transfer` posts it, again once it is ``"DONE"`` or
  ``"ERR"``.
* Notifications are bytes and arrive after the data of the transfer they go with, keyed by the
  sending agent's name. They travel as text (the agent name and the payload in base64), so a
  payload of up to about 6 KB fits multirail's default 8 KiB receive buffers.
* Failures of the peer (it died, closed the connection, did not answer within
  ``transports.tcp.timeout_ms``) make :meth:`nixl_agent.transfer` and
  :meth:`nixl_agent.check_xfer_state` return ``"ERR"``; misuse (unknown handles, bad
  descriptors or indices) raises, as NIXL's binding does. Errors are :class:`multirail.Error`
  subclasses; the NIXL-named ones below subclass them.
* The engine's configuration: ``nixl_agent_config(engine_config=...)`` (a dict, a path or
  inline JSON) or ``MULTIRAIL_CONF``; where it listens: ``engine_name`` (``"HOST[:PORT]"``;
  default: every address, publishing the host's first non-loopback IPv4 address).

Not provided: NIXL's own metadata exchange over sockets or etcd (``send_local_metadata``,
``fetch_remote_metadata``, ... raise :class:`nixlNotSupportedError`; exchange
``get_agent_metadata()`` bytes instead, as vLLM does), GPU memory and memory views, and cost
estimates. Needs NumPy, as NIXL does.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import pickle
import sys
import threading
import time
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import (
    PRIO_HIGH,
    _Closed,
    BatchBusyError,
    Engine,
    Error,
    InvalidArgumentError,
    IoError,
    PeerDisconnectedError,
    ProtocolError,
    RemoteRejectedError,
    SegmentUnreachableError,
    TransferTimeoutError,
    UnknownSegmentError,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "nixlXferDList",
    "nixlRegDList",
    "nixlXferTelemetry",
    "nixlInvalidParamError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlRepostActiveError",
    "nixlNotSupportedError",
]

log = logging.getLogger("multirail.nixl")

#: NIXL's default metadata listener port (accepted, unused: metadata travels out of band).
DEFAULT_COMM_PORT = 8888
#: The agent name that marks a local descriptor list in :meth:`nixl_agent.prep_xfer_dlist`
#: (``"NIXL_INIT_AGENT"`` is accepted too).
NIXL_INIT_AGENT = ""

#: Backend names that mean the multirail engine.
_BACKENDS = ("MULTIRAIL", "UCX")
_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM", "FILE": "FILE", "BLOCK": "BLOCK", "OBJ": "OBJ"}
_OPS = {"WRITE": "write", "READ": "read"}
_METADATA_MAGIC = b"multirail-nixl/1\n"
_NOTIF_TAG = "nixl1 "
#: Peer failures that make a transfer "ERR" instead of raising.
_PEER_FAILURES = (
    PeerDisconnectedError,
    TransferTimeoutError,
    SegmentUnreachableError,
    RemoteRejectedError,
    ProtocolError,
    IoError,
)


class nixlInvalidParamError(InvalidArgumentError):
    """An argument NIXL would refuse with NIXL_ERR_INVALID_PARAM: a malformed descriptor list,
    indices out of range or of different counts, descriptors of different lengths paired."""


class nixlNotFoundError(Error):
    """Something NIXL would not find (NIXL_ERR_NOT_FOUND): an agent never loaded or removed,
    a released handle, memory never registered, a remote range outside the agent's memory."""


class nixlNotPostedError(Error):
    """The state of a transfer handle that was never posted was asked for."""


class nixlRepostActiveError(BatchBusyError):
    """A transfer handle was posted again while its previous post was still in progress."""


class nixlNotSupportedError(Error):
    """A NIXL feature this drop-in does not provide (GPU memory, NIXL's own metadata exchange,
    cost estimates)."""


class nixl_thread_sync_t(Enum):
    """NIXL's thread synchronization modes; accepted for compatibility (every method of this
    agent may be called from any thread)."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


#: Opaque handle of a backend, as in NIXL.
nixl_backend_handle = int


class nixl_agent_config:
    """Configuration of a :class:`nixl_agent`, with NIXL's arguments.

    ``backends``: backend names to create; ``"MULTIRAIL"`` and ``"UCX"`` both mean the multirail
    engine (default ``["UCX"]``, as NIXL). ``capture_telemetry`` is accepted (telemetry is always
    kept). ``enable_prog_thread``, ``enable_listen_thread``, ``listen_port``, ``num_threads`` and
    ``sync_mode`` are accepted and have no effect: the engine has its own threads, and metadata
    travels out of band.

    multirail's own, keyword only: ``engine_config``, the engine's configuration (a dict, a path
    to a JSON file or inline JSON; None: ``MULTIRAIL_CONF``, else the defaults), and
    ``engine_name``, where the engine listens and what it publishes (``"HOST"`` or
    ``"HOST:PORT"``, see :class:`multirail.Engine`; None: every address, publishing the host's
    first non-loopback IPv4 address).

    Raises TypeError when ``sync_mode`` is not a :class:`nixl_thread_sync_t`.
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],
        sync_mode: Optional[nixl_thread_sync_t] = None,
        *,
        engine_config: Any = None,
        engine_name: Optional[str] = None,
    ):
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.sync_mode = sync_mode
        self.engine_config = engine_config
        self.engine_name = engine_name


class _DescList:
    """Descriptors ``(addr, len, dev_id)`` of one memory type, as an Nx3 uint64 array."""

    def __init__(self, mem_type: str, descs: Any = ()) -> None:
        if mem_type not in _MEM_TYPES:
            raise nixlInvalidParamError(f"unknown memory type {mem_type!r}; expected one of {sorted(_MEM_TYPES)}")
        self.mem_type = _MEM_TYPES[mem_type]
        self._descs = _rows(descs, 3, "descriptors")

    def descCount(self) -> int:
        """Number of descriptors."""
        return len(self._descs)

    def isEmpty(self) -> bool:
        """True when the list holds no descriptor."""
        return len(self._descs) == 0

    def getType(self) -> str:
        """The memory type: ``"DRAM"``, ``"VRAM"``, ``"FILE"``, ``"BLOCK"`` or ``"OBJ"``."""
        return self.mem_type

    def __len__(self) -> int:
        return len(self._descs)

    def __getitem__(self, i: int) -> Tuple[int, ...]:
        """Descriptor ``i`` as ``(addr, len, dev_id)``."""
        return tuple(int(v) for v in self._descs[i])

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and other.mem_type == self.mem_type  # type: ignore[attr-defined]
            and np.array_equal(other._descs, self._descs)  # type: ignore[attr-defined]
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.mem_type} descs={len(self)}>"


class nixlXferDList(_DescList):
    """A transfer descriptor list: ``(addr, len, dev_id)`` descriptors of one memory type, as
    :meth:`nixl_agent.get_xfer_descs` builds it. Picklable. Raises
    :class:`nixlInvalidParamError` for an unknown memory type or malformed descriptors."""


class nixlRegDList(_DescList):
    """A registration descriptor list: ``(addr, len, dev_id, meta)`` descriptors of one memory
    type, as :meth:`nixl_agent.get_reg_descs` builds it. Picklable. Raises
    :class:`nixlInvalidParamError` for an unknown memory type or malformed descriptors."""

    def __init__(self, mem_type: str, descs: Any = (), metas: Optional[List[Any]] = None) -> None:
        super().__init__(mem_type, descs)
        self.metas = list(metas) if metas is not None else [""] * len(self._descs)

    def __getitem__(self, i: int) -> Tuple[int, ...]:
        """Descriptor ``i`` as ``(addr, len, dev_id, meta)``."""
        return (*super().__getitem__(i), self.metas[i])


class nixlXferTelemetry:
    """What one transfer took, as NIXL reports it: ``startTime`` (microseconds since the epoch
    when it was last posted), ``postDuration`` and ``xferDuration`` (microseconds; the latter
    from the post until the completion was seen by :meth:`nixl_agent.check_xfer_state`, 0 while
    in progress), ``totalBytes`` and ``descCount`` (descriptors after merging)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0, totalBytes: int = 0, descCount: int = 0) -> None:
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})"
        )


class nixl_prepped_dlist_handle:
    """Opaque handle of a prepared descriptor list (from :meth:`nixl_agent.prep_xfer_dlist`).
    :meth:`release` frees it; garbage collection does too (best effort)."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: Any, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        """Frees the list (transfers made from it keep working). Raises
        :class:`nixlNotFoundError` when the agent no longer knows it."""
        if not self._released:
            self._agent._release_dlist(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent._release_dlist(self._handle)
            except Exception:
                pass


class nixl_xfer_handle:
    """Opaque handle of a transfer (from :meth:`nixl_agent.make_prepped_xfer` or
    :meth:`nixl_agent.initialize_xfer`). :meth:`release` frees it; garbage collection does too
    (best effort)."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: Any, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        """Frees the transfer. A post still in progress cannot be cancelled: it finishes on its
        own (a warning is logged). Raises :class:`nixlNotFoundError` when the agent no longer
        knows the handle."""
        if not self._released:
            self._agent._release_xfer(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent._release_xfer(self._handle)
            except Exception:
                pass


# ------------------------------------------------------------------------------- helpers


def _rows(descs: Any, width: int, what: str) -> np.ndarray:
    """An N x width uint64 array from an integer array or a sequence of int tuples; raises
    nixlInvalidParamError for another shape, non-integers or values outside 0..2**64-1."""
    if isinstance(descs, np.ndarray):
        arr = descs
    else:
        seq = list(descs)
        if not seq:
            return np.zeros((0, width), dtype=np.uint64)
        try:
            arr = np.array(seq)
        except (TypeError, ValueError) as e:
            raise nixlInvalidParamError(f"invalid {what}: {e}") from None
    if arr.ndim != 2 or arr.shape[1] != width:
        raise nixlInvalidParamError(f"invalid {what}: expected N x {width} values, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros((0, width), dtype=np.uint64)
    if arr.dtype.kind == "u":
        return np.ascontiguousarray(arr, dtype=np.uint64)
    if arr.dtype.kind == "i":
        if int(arr.min()) < 0:
            raise nixlInvalidParamError(f"invalid {what}: negative value {int(arr.min())}")
        return np.ascontiguousarray(arr, dtype=np.uint64)
    if arr.dtype == object:
        for v in arr.flat:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 1 << 64:
                raise nixlInvalidParamError(f"invalid {what}: {v!r} is not a 64-bit unsigned integer")
        return np.array([[int(v) for v in row] for row in arr], dtype=np.uint64).reshape(-1, width)
    raise nixlInvalidParamError(f"invalid {what}: integers needed, got {arr.dtype}")


def _is_torch_tensor(obj: object) -> bool:
    """True for a torch.Tensor (torch is never imported here: only an object of an imported
    torch can be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _descriptor_rows(descs: Any, mem_type: Optional[str], want: type, other: type, purpose: str,
                     other_msg: str) -> Any:
    """What :meth:`nixl_agent.get_xfer_descs` and :meth:`nixl_agent.get_reg_descs` share: a
    finished list of type ``want`` (``descs`` itself, or one made from tensors or an Nx3 NumPy
    array), or else ``descs`` as a Python list of tuples for the caller to check. Raises
    :class:`nixlInvalidParamError` (with NIXL's own messages) for a list of the ``other`` type,
    no ``mem_type`` without tensors, or a NumPy array of another shape."""
    if isinstance(descs, want):
        return descs
    if isinstance(descs, other):
        raise nixlInvalidParamError(other_msg)
    if _is_torch_tensor(descs):
        mem, rows = _tensor_rows([descs])
        return want(mem, rows)
    if isinstance(descs, (list, tuple)) and descs and _is_torch_tensor(descs[0]):
        mem, rows = _tensor_rows(descs)
        return want(mem, rows)
    if mem_type is None:
        raise nixlInvalidParamError("Please specify a mem type if not using Tensors")
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise nixlInvalidParamError(
                f"Nx3 shape required for {purpose} descriptor list from numpy array")
        return want(mem_type, descs)
    return list(descs)


def _tensor_rows(tensors: Sequence[Any]) -> Tuple[str, np.ndarray]:
    """(memory type, Nx3 rows) of contiguous tensors on one device."""
    device = tensors[0].device
    rows = []
    for t in tensors:
        if t.device != device:
            raise nixlInvalidParamError("tensors on different devices in one descriptor list")
        if not t.is_contiguous():
            raise nixlInvalidParamError("descriptor lists need contiguous tensors")
        rows.append((t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0)))
    mem = "DRAM" if tensors[0].get_device() == -1 else "VRAM"
    return mem, np.array(rows, dtype=np.uint64).reshape(-1, 3)


def _agent_name(name: Any) -> str:
    if isinstance(name, bytes):
        return name.decode()
    if not isinstance(name, str):
        raise TypeError(f"an agent name is a str, got {type(name).__name__}")
    return name


def _payload(msg: Any) -> bytes:
    """A notification payload as bytes (str is UTF-8 encoded, as NIXL's binding does)."""
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"a notification is bytes or str, got {type(msg).__name__}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _inside(starts: np.ndarray, ends: np.ndarray, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For each range, the index of the region [starts[i], ends[i]) holding it, or -1."""
    if len(starts) == 0:
        return np.full(len(addrs), -1, dtype=np.int64)
    i = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ok = i >= 0
    j = np.where(ok, i, 0)
    ok &= addrs + lens <= ends[j]
    ok &= addrs + lens >= addrs  # no wrap-around
    return np.where(ok, i, -1)


def _regions(pairs: Sequence[Tuple[int, int]]) -> Tuple[np.ndarray, np.ndarray]:
    """Sorted (starts, ends) arrays of (addr, len) regions."""
    if not pairs:
        z = np.zeros(0, dtype=np.uint64)
        return z, z
    arr = np.array(sorted(pairs), dtype=np.uint64)
    return arr[:, 0].copy(), arr[:, 0] + arr[:, 1]


class _Remote:
    """A loaded remote agent: its segment."""

    __slots__ = ("name", "segment", "seg_id", "metadata")

    def __init__(self, name: str, segment: str, seg_id: int, metadata: bytes) -> None:
        self.name = name
        self.segment = segment
        self.seg_id = seg_id
        self.metadata = metadata


class _Dlist:
    """A prepared descriptor list: local (agent None) or of a remote (or this) agent."""

    __slots__ = ("agent", "descs")

    def __init__(self, agent: Optional[str], descs: np.ndarray) -> None:
        self.agent = agent
        self.descs = descs


class _Xfer:
    """A transfer: its multirail prepared list and its latest post."""

    __slots__ = ("op", "native", "agent", "notif", "batch", "state", "error", "bytes", "count", "start_us", "post_us", "posted_at", "xfer_us")

    def __init__(self, op: str, native: Any, agent: str, notif: bytes, nbytes: int, count: int) -> None:
        self.op = op
        self.native = native
        self.agent = agent
        self.notif = notif
        self.batch: Any = None
        self.state = "INIT"
        self.error: Optional[BaseException] = None
        self.bytes = nbytes
        self.count = count
        self.start_us = 0
        self.post_us = 0
        self.posted_at = 0.0
        self.xfer_us = 0


# --------------------------------------------------------------------------------- agent


class nixl_agent:
    """A NIXL agent on the multirail engine: registers memory, prepares descriptor lists, makes
    and posts transfers to other agents, sends and receives notifications.

    ``agent_name`` names this agent to its peers (unique among them). ``nixl_conf``: a
    :class:`nixl_agent_config` (None: its defaults). ``instantiate_all`` creates every backend
    this drop-in has (``"MULTIRAIL"`` and ``"UCX"``, both the same engine) when no config is
    given.

    Raises :class:`multirail.ConfigError` for a bad ``engine_config``,
    :class:`multirail.InvalidArgumentError` for a bad ``engine_name``, TypeError for an
    ``agent_name`` that is not a str. Every method may be called from any thread.
    """

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False):
        if not isinstance(agent_name, str):
            raise TypeError(f"agent_name must be a str, got {type(agent_name).__name__}")
        if nixl_conf and instantiate_all:
            instantiate_all = False
            log.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        self.name = agent_name
        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, nixl_backend_handle] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list: List[str] = list(_BACKENDS)
        self._conf = nixl_conf
        self._lock = threading.RLock()
        self._engine = Engine(nixl_conf.engine_config, nixl_conf.engine_name)
        self._native = self._engine._native
        self._segment = self._engine.segment_name
        self._remotes: Dict[str, _Remote] = {}
        self._own_seg: Optional[int] = None
        self._regs: Dict[int, List[Any]] = {}  # addr -> [len, native buffer, count]
        self._reg_starts, self._reg_ends = _regions([])
        self._dlists: Dict[int, _Dlist] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._next = 1
        for b in self.plugin_list if instantiate_all else nixl_conf.backends:
            if b not in self.plugin_list:
                log.warning("Skipping backend registration %s due to the missing plugin.", b)
            else:
                self.create_backend(b)
        if not self.backends:
            log.warning("no multirail backend (MULTIRAIL or UCX) in %r; transfers still use the multirail engine", nixl_conf.backends)
        log.info("Initialized NIXL agent %s on multirail segment %s", agent_name, self._segment)

    # ---------------------------------------------------------------- multirail extras

    @property
    def engine(self) -> Engine:
        """The :class:`multirail.Engine` underneath (multirail extra)."""
        return self._engine

    def close(self) -> None:
        """Stops the engine underneath: its port and every connection close (multirail extra;
        NIXL has no such call). Every handle and registration of this agent is dropped with it
        (the engine lets its last connections go only once nothing refers to it any more).
        Later calls raise :class:`multirail.Error`; closing twice is harmless."""
        with self._lock:
            xfers, self._xfers = self._xfers, {}
            self._dlists.clear()
            self._remotes.clear()
            self._regs.clear()
            self._own_seg = None
            self._update_regions()
            self._native = _Closed()
        for x in xfers.values():
            x.batch = None
            try:
                x.native.free()
            except Error:
                pass
            x.native = None
        self._engine.close()

    # ------------------------------------------------------------------------ backends

    def get_plugin_list(self) -> list[str]:
        """The backends this drop-in offers: ``["MULTIRAIL", "UCX"]`` (both the multirail
        engine)."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        """Memory types a backend handles: ``["DRAM"]``; ``[]`` (and a warning) for an unknown
        backend."""
        if backend not in self.plugin_list:
            log.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return ["DRAM"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        """Initialization parameters of a backend: none (``{}``); configure the engine through
        ``nixl_agent_config(engine_config=...)`` or ``MULTIRAIL_CONF``. ``{}`` and a warning for
        an unknown backend."""
        if backend not in self.plugin_list:
            log.warning("Plugin %s is not available to get its parameters.", backend)
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        """Memory types a created backend handles (``["DRAM"]``); ``[]`` and a warning when
        ``backend`` was not created."""
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        log.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        """Parameters of a created backend (``{}``); ``{}`` and a warning when ``backend`` was not
        created."""
        if backend in self.backend_options:
            return self.backend_options[backend]
        log.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:
        """Creates backend ``backend`` (``"MULTIRAIL"`` or ``"UCX"``: both name this agent's
        multirail engine; ``initParams`` are ignored). Raises :class:`nixlNotFoundError` for
        another name."""
        if backend not in self.plugin_list:
            raise nixlNotFoundError(f"backend {backend!r} is not available; multirail offers {self.plugin_list}")
        if initParams:
            log.info("create_backend(%s): parameters %r ignored; configure the engine with engine_config or MULTIRAIL_CONF", backend, initParams)
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = ["DRAM"]
        self.backend_options[backend] = {}
        log.info("Backend %s was instantiated", backend)

    def _check_backends(self, backends: Sequence[str]) -> None:
        for b in backends:
            if b not in self.backends:
                raise KeyError(b)

    # -------------------------------------------------------------------------- memory

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, backends: list[str] = []) -> nixlRegDList:
        """Registers memory regions (anything :meth:`get_reg_descs` takes) with the engine, all
        or none, and returns their :class:`nixlRegDList` (for :meth:`deregister_memory`).
        Registering the very same region again counts one more registration.

        Raises :class:`nixlInvalidParamError` for malformed descriptors,
        :class:`nixlNotSupportedError` for memory other than DRAM,
        :class:`multirail.InvalidArgumentError` for a null address or length 0,
        :class:`multirail.AllocationError` for a region overlapping registered memory
        otherwise, KeyError for a backend that was not created."""
        reg = self.get_reg_descs(reg_list, mem_type)
        self._check_backends(backends)
        _dram(reg.mem_type)
        with self._lock:
            done: List[int] = []
            try:
                for addr, length, _dev in reg._descs.tolist():
                    entry = self._regs.get(addr)
                    if entry is not None and entry[0] == length:
                        entry[2] += 1
                    else:
                        self._regs[addr] = [length, self._native.register(addr, length, "*"), 1]
                    done.append(addr)
            except BaseException:
                for addr in done:
                    self._unregister(addr)
                self._update_regions()
                raise
            self._update_regions()
        return reg

    def deregister_memory(self, dereg_list: nixlRegDList, backends: list[str] = []) -> None:
        """Deregisters the regions of ``dereg_list`` (from :meth:`register_memory` or
        :meth:`get_reg_descs`): the engine stops serving them once every registration of a
        region is gone. Tries every region, then raises :class:`nixlNotFoundError` for the
        first that was not registered; KeyError for a backend that was not created."""
        reg = self.get_reg_descs(dereg_list)
        self._check_backends(backends)
        missing = None
        with self._lock:
            for addr, length, _dev in reg._descs.tolist():
                entry = self._regs.get(addr)
                if entry is None or entry[0] != length:
                    missing = missing or (addr, length)
                    continue
                self._unregister(addr)
            self._update_regions()
        if missing is not None:
            raise nixlNotFoundError(f"memory {missing[0]:#x}+{missing[1]} is not registered with agent {self.name}")

    def _unregister(self, addr: int) -> None:
        entry = self._regs[addr]
        entry[2] -= 1
        if entry[2] == 0:
            del self._regs[addr]
            self._native.unregister(addr)

    def _update_regions(self) -> None:
        self._reg_starts, self._reg_ends = _regions([(a, e[0]) for a, e in self._regs.items()])

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list[Optional[dict[str, str]]]:
        """For each region of ``reg_list``: ``{}`` when it lies inside memory registered with
        this agent, else None. Raises ValueError for a backend that was not created,
        :class:`nixlInvalidParamError` for malformed descriptors."""
        reg = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        with self._lock:
            hit = _inside(self._reg_starts, self._reg_ends, reg._descs[:, 0], reg._descs[:, 1])
        return [{} if h >= 0 else None for h in hit.tolist()]

    # ------------------------------------------------------------------------ metadata

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata, for peers' :meth:`add_remote_agent`: its name and its multirail
        segment (the memory it registered is read from the segment itself)."""
        doc = {"agent": self.name, "segment": self._segment}
        return _METADATA_MAGIC + json.dumps(doc, separators=(",", ":")).encode()

    def get_partial_agent_metadata(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: list[str] = []) -> bytes:
        """The same bytes as :meth:`get_agent_metadata`: peers read registered memory from the
        segment, so there is nothing partial to leave out. Raises KeyError for a backend that
        was not created."""
        self._check_backends(backends)
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Loads a peer's :meth:`get_agent_metadata` bytes: opens its segment (fetching the
        memory it registered), after which this agent can prepare descriptors of that agent,
        transfer to it and notify it. Loading an agent again refreshes what is known of its
        memory (and follows it to a new segment). Returns the agent's name.

        Raises :class:`nixlInvalidParamError` for bytes that are not such metadata,
        :class:`multirail.SegmentUnreachableError` when its segment does not answer."""
        if isinstance(metadata, str):
            metadata = metadata.encode()
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise TypeError(f"metadata must be bytes, got {type(metadata).__name__}")
        metadata = bytes(metadata)
        try:
            if not metadata.startswith(_METADATA_MAGIC):
                raise ValueError("not multirail NIXL agent metadata")
            doc = json.loads(metadata[len(_METADATA_MAGIC) :])
            name, segment = doc["agent"], doc["segment"]
            if not isinstance(name, str) or not isinstance(segment, str):
                raise ValueError("agent and segment must be strings")
        except (ValueError, KeyError, TypeError) as e:
            raise nixlInvalidParamError(f"invalid agent metadata: {e}") from None
        with self._lock:
            old = self._remotes.pop(name, None)
            if old is not None:
                self._close_segment(old.seg_id)
        seg_id = self._native.open_segment(segment)
        with self._lock:
            self._remotes[name] = _Remote(name, segment, seg_id, metadata)
        log.info("loaded remote agent %s (segment %s)", name, segment)
        return name

    def remove_remote_agent(self, agent: str) -> None:
        """Forgets agent ``agent`` and closes its segment: transfers to it can no longer be made
        or posted (those in progress finish). An agent never loaded is ignored, as NIXL returns
        a status there instead of raising."""
        agent = _agent_name(agent)
        with self._lock:
            r = self._remotes.pop(agent, None)
            if r is None:
                log.debug("remove_remote_agent: %s is not loaded", agent)
                return
            self._close_segment(r.seg_id)

    def _close_segment(self, seg_id: int) -> None:
        """Closes a segment unless another loaded agent still uses it (lock held)."""
        if seg_id == self._own_seg or any(r.seg_id == seg_id for r in self._remotes.values()):
            return
        try:
            self._native.close_segment(seg_id)
        except UnknownSegmentError:
            pass

    def check_remote_metadata(self, agent: str, descs: Optional[nixlXferDList] = None) -> bool:
        """True when agent ``agent`` is loaded and, with ``descs``, each descriptor lies inside
        memory it registered (as its segment last said)."""
        agent = _agent_name(agent)
        with self._lock:
            if agent not in self._remotes and agent != self.name:
                return False
        if descs is None or len(descs) == 0:
            return True
        try:
            self._check_remote(agent, self.get_xfer_descs(descs)._descs)
        except (nixlNotFoundError, nixlInvalidParamError):
            return False
        return True

    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:
        """Checks that ``remote_agent`` is loaded; connections are made by the first transfer or
        notification (multirail connects in well under a millisecond on a LAN). Raises
        :class:`nixlNotFoundError` for an agent never loaded, KeyError for a backend that was
        not created."""
        self._check_backends(backends)
        self._segment_of(_agent_name(remote_agent))

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """NIXL's socket/etcd metadata exchange is not provided: always raises
        :class:`nixlNotSupportedError` (send :meth:`get_agent_metadata` bytes out of band)."""
        raise nixlNotSupportedError("send_local_metadata: exchange get_agent_metadata() bytes out of band and call add_remote_agent")

    def send_partial_agent_metadata(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: list[str] = [],
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """Not provided: always raises :class:`nixlNotSupportedError` (see
        :meth:`send_local_metadata`)."""
        raise nixlNotSupportedError("send_partial_agent_metadata: exchange get_agent_metadata() bytes out of band and call add_remote_agent")

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        """Not provided: always raises :class:`nixlNotSupportedError` (see
        :meth:`send_local_metadata`)."""
        raise nixlNotSupportedError("fetch_remote_metadata: exchange get_agent_metadata() bytes out of band and call add_remote_agent")

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Not provided: always raises :class:`nixlNotSupportedError` (peers forget this agent
        with :meth:`remove_remote_agent`)."""
        raise nixlNotSupportedError("invalidate_local_metadata: peers call remove_remote_agent")

    # ---------------------------------------------------------------- descriptor lists

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlXferDList:
        """A :class:`nixlXferDList` from: a list of ``(addr, len, dev_id)`` tuples or an Nx3
        NumPy integer array (``mem_type`` required: ``"DRAM"``...), a contiguous tensor or a
        list of them (memory type from the device), or a :class:`nixlXferDList` (returned as is).

        Raises :class:`nixlInvalidParamError` for anything else (a :class:`nixlRegDList`,
        tuples of another length, no ``mem_type``, negative values, an unknown memory type)."""
        seq = _descriptor_rows(descs, mem_type, nixlXferDList, nixlRegDList, "transfer",
                               "RegList type detected for transfer, please use XferList")
        if not isinstance(seq, list):
            return seq
        if any(not isinstance(d, tuple) or len(d) != 3 for d in seq):
            raise nixlInvalidParamError("3-tuple list (addr, len, dev_id) needed for transfer")
        return nixlXferDList(mem_type, seq)

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlRegDList:
        """A :class:`nixlRegDList` from: a list of ``(addr, len, dev_id, meta)`` tuples
        (``(addr, len, dev_id)`` works too) or an Nx3 NumPy integer array (``mem_type``
        required), a contiguous tensor or a list of them, or a :class:`nixlRegDList` (returned
        as is).

        Raises :class:`nixlInvalidParamError` for anything else (a :class:`nixlXferDList`,
        malformed tuples, no ``mem_type``, negative values, an unknown memory type)."""
        seq = _descriptor_rows(descs, mem_type, nixlRegDList, nixlXferDList, "registration",
                               "XferList type detected for registration, please use RegList")
        if not isinstance(seq, list):
            return seq
        if any(not isinstance(d, tuple) or len(d) not in (3, 4) for d in seq):
            raise nixlInvalidParamError("(addr, len, dev_id, meta) tuples needed for registration")
        return nixlRegDList(mem_type, [d[:3] for d in seq], [d[3] if len(d) == 4 else "" for d in seq])

    def get_serialized_descs(self, descs: Any) -> bytes:
        """``descs`` (a descriptor list) pickled, as NIXL does."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """A descriptor list from :meth:`get_serialized_descs` bytes (unpickled: load only bytes
        from peers you trust, as with NIXL)."""
        return pickle.loads(serialized_descs)

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None, backends: list[str] = []) -> nixl_prepped_dlist_handle:
        """Prepares descriptors for making transfers by index (:meth:`make_prepped_xfer`).

        ``agent_name``: ``"NIXL_INIT_AGENT"`` (or ``""``) for local descriptors, each inside
        memory registered with this agent; a loaded remote agent's name for descriptors of its
        memory; this agent's own name for loopback. ``xfer_list``: anything
        :meth:`get_xfer_descs` takes, or an Nx5 NumPy array of strided runs ``(addr, len,
        dev_id, stride, count)``: ``count`` descriptors of ``len`` bytes ``stride`` apart from
        ``addr`` (``mem_type`` required).

        Raises :class:`nixlNotFoundError` for an agent never loaded, a local descriptor outside
        registered memory, a remote one outside the agent's memory;
        :class:`nixlInvalidParamError` for malformed descriptors or length 0;
        :class:`nixlNotSupportedError` for memory other than DRAM; ValueError for an Nx5 array
        without ``mem_type``; KeyError for a backend that was not created."""
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            descs = nixlXferDList(mem_type, _strided(_rows(xfer_list, 5, "strided descriptors")))
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
        self._check_backends(backends)
        _dram(descs.mem_type)
        rows = descs._descs
        if len(rows) and int(rows[:, 1].min()) == 0:
            raise nixlInvalidParamError("descriptors of length 0 cannot be transferred")
        agent = _agent_name(agent_name)
        if agent in ("", "NIXL_INIT_AGENT"):
            self._check_local(rows)
            dl = _Dlist(None, rows)
        else:
            self._check_remote(agent, rows)
            dl = _Dlist(agent, rows)
        with self._lock:
            h = self._new_id()
            self._dlists[h] = dl
        return nixl_prepped_dlist_handle(self, h)

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        """Frees a prepared descriptor list (transfers made from it keep working). Raises
        :class:`nixlNotFoundError` when this agent does not know it."""
        handle.release()

    def _release_dlist(self, h: int) -> None:
        with self._lock:
            if self._dlists.pop(h, None) is None:
                raise nixlNotFoundError(f"descriptor list handle {h:#x} is not known to agent {self.name}")

    def _check_local(self, rows: np.ndarray) -> None:
        with self._lock:
            hit = _inside(self._reg_starts, self._reg_ends, rows[:, 0], rows[:, 1])
        bad = np.flatnonzero(hit < 0)
        if len(bad):
            a, n = int(rows[bad[0], 0]), int(rows[bad[0], 1])
            raise nixlNotFoundError(f"local descriptor {int(bad[0])} ({a:#x}+{n}) is not inside memory registered with agent {self.name}")

    def _remote_regions(self, agent: str) -> Tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the memory agent ``agent`` registered, as its segment last said."""
        seg = self._segment_of(agent)
        _, buffers = self._native.segment_info(seg)
        return _regions([(a, n) for a, n in buffers])

    def _check_remote(self, agent: str, rows: np.ndarray) -> None:
        starts, ends = self._remote_regions(agent)
        hit = _inside(starts, ends, rows[:, 0], rows[:, 1])
        bad = np.flatnonzero(hit < 0)
        if len(bad):
            a, n = int(rows[bad[0], 0]), int(rows[bad[0], 1])
            raise nixlNotFoundError(
                f"descriptor {int(bad[0])} ({a:#x}+{n}) is not inside memory agent {agent} registered "
                "(load its metadata again if it registered memory since)"
            )

    def _segment_of(self, agent: str) -> int:
        """The open segment of a loaded agent (this agent's own for loopback)."""
        with self._lock:
            r = self._remotes.get(agent)
            if r is not None:
                return r.seg_id
            if agent != self.name:
                raise nixlNotFoundError(f"agent {agent!r} is not loaded (add_remote_agent first)")
            if self._own_seg is None:
                self._own_seg = self._native.open_segment(self._segment)
            return self._own_seg

    def _new_id(self) -> int:
        h = self._next
        self._next += 1
        return h

    # ------------------------------------------------------------------------ transfers

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Union[list[int], np.ndarray],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Union[list[int], np.ndarray],
        notif_msg: bytes = b"",
        backends: list[str] = [],
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """Makes a transfer of local descriptor ``local_indices[k]`` with remote descriptor
        ``remote_indices[k]`` for every k, checked and routed once (one multirail prepared
        list; runs contiguous on both sides are merged unless ``skip_desc_merge``).
        ``operation``: ``"WRITE"`` (local to remote) or ``"READ"``. ``notif_msg`` (bytes or
        str): sent to the remote agent after the data of each post (unless :meth:`transfer`
        gives another). Post it with :meth:`transfer`, as often as wanted.

        Raises :class:`nixlInvalidParamError` for another operation, indices out of range,
        empty or of different counts, paired descriptors of different lengths, a local side
        that is remote or the reverse; :class:`nixlNotFoundError` for released lists or an agent
        removed since; the engine's errors (:class:`multirail.SourceNotRegisteredError` for
        memory deregistered since, :class:`multirail.PeerDisconnectedError` for a peer that
        exited...); KeyError for a backend that was not created."""
        op = _op(operation)
        self._check_backends(backends)
        with self._lock:
            local = self._dlists.get(local_xfer_side._handle)
            remote = self._dlists.get(remote_xfer_side._handle)
        if local is None or remote is None:
            raise nixlNotFoundError("descriptor list handle released or unknown to this agent")
        if local.agent is not None:
            raise nixlInvalidParamError("local_xfer_side must be prepared with NIXL_INIT_AGENT")
        if remote.agent is None:
            raise nixlInvalidParamError("remote_xfer_side must be prepared with a remote (or this) agent's name")
        li = _index_array(local_indices, len(local.descs), "local_indices")
        ri = _index_array(remote_indices, len(remote.descs), "remote_indices")
        if len(li) != len(ri):
            raise nixlInvalidParamError(f"local_indices and remote_indices have different counts ({len(li)}, {len(ri)})")
        return self._make(op, local.descs[li], remote.descs[ri], remote.agent, notif_msg, not skip_desc_merge)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = [],
    ) -> nixl_xfer_handle:
        """Makes a transfer of ``local_descs[k]`` with ``remote_descs[k]`` of agent
        ``remote_agent`` for every k (both checked as :meth:`prep_xfer_dlist` checks them);
        otherwise as :meth:`make_prepped_xfer`. Raises as :meth:`prep_xfer_dlist` and
        :meth:`make_prepped_xfer` do, :class:`nixlInvalidParamError` for lists of different
        counts."""
        op = _op(operation)
        self._check_backends(backends)
        local = self.get_xfer_descs(local_descs)
        remote = self.get_xfer_descs(remote_descs)
        _dram(local.mem_type)
        _dram(remote.mem_type)
        if len(local) != len(remote):
            raise nixlInvalidParamError(f"local and remote descriptor lists have different counts ({len(local)}, {len(remote)})")
        if len(local) == 0:
            raise nixlInvalidParamError("a transfer needs at least one descriptor")
        agent = _agent_name(remote_agent)
        self._check_local(local._descs)
        self._check_remote(agent, remote._descs)
        return self._make(op, local._descs, remote._descs, agent, notif_msg, True)

    def _make(self, op: str, local: np.ndarray, remote: np.ndarray, agent: str, notif_msg: Any, merge: bool) -> nixl_xfer_handle:
        notif = _payload(notif_msg)
        if len(local) == 0:
            raise nixlInvalidParamError("a transfer needs at least one descriptor")
        if not np.array_equal(local[:, 1], remote[:, 1]):
            k = int(np.flatnonzero(local[:, 1] != remote[:, 1])[0])
            raise nixlInvalidParamError(
                f"descriptor pair {k}: local length {int(local[k, 1])} differs from remote length {int(remote[k, 1])}"
            )
        src, dst, lens = local[:, 0], remote[:, 0], local[:, 1]
        if merge and len(src) > 1:
            src, dst, lens = self._merged(src, dst, lens, agent)
        seg = self._segment_of(agent)
        n = len(src)
        native = self._native.prepare(src.tolist(), [seg] * n, dst.tolist(), lens.tolist(), None)
        x = _Xfer(op, native, agent, notif, int(lens.sum()), n)
        with self._lock:
            h = self._new_id()
            self._xfers[h] = x
        return nixl_xfer_handle(self, h)

    def _merged(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, agent: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Merges pairs that continue the previous one on both sides within one registered
        region of each side (a merged range must stay inside one buffer)."""
        with self._lock:
            lreg = _inside(self._reg_starts, self._reg_ends, src, lens)
        rstarts, rends = self._remote_regions(agent)
        rreg = _inside(rstarts, rends, dst, lens)
        cont = (src[1:] == src[:-1] + lens[:-1]) & (dst[1:] == dst[:-1] + lens[:-1])
        cont &= (lreg[1:] == lreg[:-1]) & (rreg[1:] == rreg[:-1]) & (lreg[1:] >= 0) & (rreg[1:] >= 0)
        if not cont.any():
            return src, dst, lens
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        merged_lens = np.add.reduceat(lens, starts)
        return src[starts], dst[starts], merged_lens.astype(np.uint64)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Posts the transfer; returns ``"DONE"`` when it completed already, ``"PROC"`` while it
        runs, ``"ERR"`` when the peer failed (it exited, closed the connection, did not answer
        within ``transports.tcp.timeout_ms``). ``notif_msg`` (bytes or str), when given,
        replaces the handle's notification for this post; either reaches the remote agent after
        the data. A handle may be posted again once :meth:`check_xfer_state` said ``"DONE"``
        or ``"ERR"``.

        Raises :class:`nixlRepostActiveError` while the previous post is in progress,
        :class:`nixlNotFoundError` for a released handle or an agent removed since,
        :class:`multirail.SourceNotRegisteredError` for memory deregistered since."""
        x = self._xfer(handle)
        with self._lock:
            if x.state == "PROC" and self._poll(x) == "PROC":
                raise nixlRepostActiveError(f"transfer {handle._handle:#x} is still in progress; post it again once DONE")
            if x.agent not in self._remotes and x.agent != self.name:
                raise nixlNotFoundError(f"agent {x.agent!r} was removed; the transfer cannot be posted")
            payload = _payload(notif_msg) if notif_msg else x.notif
            notify = self._encode(payload) if payload else None
            x.batch, x.error, x.xfer_us = None, None, 0
            x.start_us = time.time_ns() // 1000
            t0 = time.perf_counter()
            try:
                x.batch = x.native.post(x.op, PRIO_HIGH, None, notify)
            except _PEER_FAILURES as e:
                x.state, x.error = "ERR", e
                x.post_us = int((time.perf_counter() - t0) * 1e6)
                log.error("transfer to agent %s failed: %s", x.agent, e)
                return "ERR"
            x.posted_at = t0
            x.post_us = int((time.perf_counter() - t0) * 1e6)
            x.state = "PROC"
            return self._poll(x)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"DONE"`` once every byte of the latest post is in place, ``"PROC"`` while it runs,
        ``"ERR"`` when it failed (the reason is logged). Never blocks. Raises
        :class:`nixlNotPostedError` for a handle never posted, :class:`nixlNotFoundError` for a
        released one."""
        x = self._xfer(handle)
        with self._lock:
            if x.state == "INIT":
                raise nixlNotPostedError(f"transfer {handle._handle:#x} was never posted")
            return self._poll(x)

    def _poll(self, x: _Xfer) -> str:
        """Refreshes the state of a posted transfer (lock held)."""
        if x.state != "PROC":
            return x.state
        status, err = x.batch.overall_status()
        if status == "pending":
            return "PROC"
        x.xfer_us = int((time.perf_counter() - x.posted_at) * 1e6)
        if status == "completed":
            x.state = "DONE"
        else:
            x.state, x.error = "ERR", err
            log.error("transfer to agent %s failed: %s", x.agent, err)
        return x.state

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """What the latest post of the transfer took (see :class:`nixlXferTelemetry`). Raises
        :class:`nixlNotFoundError` for a released handle."""
        x = self._xfer(handle)
        with self._lock:
            return nixlXferTelemetry(x.start_us, x.post_us, x.xfer_us, x.bytes, x.count)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend that carries the transfer: the first one created (``"MULTIRAIL"`` or
        ``"UCX"``; the multirail engine either way). Raises :class:`nixlNotFoundError` for a
        released handle or when no backend was created."""
        self._xfer(handle)
        if not self.backends:
            raise nixlNotFoundError("no backend was created")
        return next(iter(self.backends))

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, int]:
        """Not provided: always raises :class:`nixlNotSupportedError`."""
        raise nixlNotSupportedError("estimate_xfer_cost is not provided by multirail")

    def prep_mem_view(self, dlist: Any, *, backends: Optional[list[str]] = None) -> int:
        """GPU memory views are not provided: always raises :class:`nixlNotSupportedError`."""
        raise nixlNotSupportedError("memory views (GPU device API) are not provided by multirail")

    def release_mem_view(self, mvh: int) -> None:
        """GPU memory views are not provided: always raises :class:`nixlNotSupportedError`."""
        raise nixlNotSupportedError("memory views (GPU device API) are not provided by multirail")

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Frees a transfer. A post still in progress cannot be cancelled: it finishes on its own
        (its notification is still sent) and a warning is logged. Raises
        :class:`nixlNotFoundError` when this agent does not know the handle."""
        handle.release()

    def _release_xfer(self, h: int) -> None:
        with self._lock:
            x = self._xfers.pop(h, None)
            if x is None:
                raise nixlNotFoundError(f"transfer handle {h:#x} is not known to agent {self.name}")
            if x.state == "PROC" and self._poll(x) == "PROC":
                log.warning("transfer %#x released while in progress: it cannot be cancelled and finishes on its own", h)
        try:
            x.native.free()
        except Error:
            pass

    def _xfer(self, handle: nixl_xfer_handle) -> _Xfer:
        if not isinstance(handle, nixl_xfer_handle):
            raise TypeError(f"expected a nixl_xfer_handle, got {type(handle).__name__}")
        with self._lock:
            x = self._xfers.get(handle._handle)
        if x is None or handle._agent is not self:
            raise nixlNotFoundError(f"transfer handle {handle._handle:#x} is released or not of agent {self.name}")
        return x

    # -------------------------------------------------------------------- notifications

    def _encode(self, payload: bytes) -> str:
        return f"{_NOTIF_TAG}{_b64(self.name.encode())} {_b64(payload)}"

    def _drain(self) -> Dict[str, List[bytes]]:
        """Notifications the engine received since the last drain, by sending agent. Messages
        that are not this drop-in's (a native multirail peer's) are keyed by the sender's
        segment name, their text as UTF-8 bytes."""
        out: Dict[str, List[bytes]] = {}
        for sender, msg in self._native.receive_notifications():
            key, payload = sender, msg.encode()
            if msg.startswith(_NOTIF_TAG):
                try:
                    name, data = msg[len(_NOTIF_TAG) :].split(" ", 1)
                    key = base64.b64decode(name, validate=True).decode()
                    payload = base64.b64decode(data, validate=True)
                except (ValueError, binascii.Error, UnicodeDecodeError):
                    key, payload = sender, msg.encode()
            out.setdefault(key, []).append(payload)
        return out

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        """Notifications received since the last call (here or in :meth:`update_notifs` /
        :meth:`check_remote_xfer_done`): ``{agent name: [payload bytes, ...]}``, in arrival
        order per agent. Raises KeyError for a backend that was not created."""
        self._check_backends(backends)
        return self._drain()

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        """Adds the notifications received since the last call to :attr:`notifs` and returns it
        (every one not yet consumed by :meth:`check_remote_xfer_done`). Raises KeyError for a
        backend that was not created."""
        self._check_backends(backends)
        with self._lock:
            for k, v in self._drain().items():
                self.notifs.setdefault(k, []).extend(v)
            return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: list[str] = [], tag_is_prefix: bool = True) -> bool:
        """True when a notification from ``remote_agent_name`` starts with ``lookup_tag``
        (contains it, with ``tag_is_prefix=False``); that one notification is consumed. Collects
        new notifications into :attr:`notifs` first. Raises KeyError for a backend that was not
        created."""
        tag = _payload(lookup_tag)
        agent = _agent_name(remote_agent_name)
        with self._lock:
            self.update_notifs(backends)
            msgs = self.notifs.get(agent, [])
            for i, m in enumerate(msgs):
                if (tag_is_prefix and m.startswith(tag)) or (not tag_is_prefix and tag in m):
                    del msgs[i]
                    return True
            return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None:
        """Sends ``notif_msg`` (bytes or str) to agent ``remote_agent_name``; it arrives after
        everything this agent sent that agent before. Raises :class:`nixlNotFoundError` for an
        agent never loaded, KeyError for a backend that was not created,
        :class:`multirail.PeerDisconnectedError` or :class:`multirail.TransferTimeoutError`
        when the peer is gone."""
        if backend is not None:
            self._check_backends([backend])
        seg = self._segment_of(_agent_name(remote_agent_name))
        self._native.send_notification(seg, self._encode(_payload(notif_msg)))

    def __repr__(self) -> str:
        return f"<multirail.nixl.nixl_agent {self.name!r} segment={self._segment}>"


def _dram(mem_type: str) -> None:
    if mem_type != "DRAM":
        raise nixlNotSupportedError(f"multirail moves host memory (DRAM) only, not {mem_type}")


def _op(operation: Any) -> str:
    try:
        return _OPS[operation]
    except (KeyError, TypeError):
        raise nixlInvalidParamError(f"operation must be 'WRITE' or 'READ', got {operation!r}") from None


def _index_array(indices: Any, length: int, what: str) -> np.ndarray:
    """Indices (a list of ints or a 1-D integer array) checked against a list's length."""
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise nixlInvalidParamError(f"{what} must be a 1-D sequence of ints")
    if arr.size == 0:
        raise nixlInvalidParamError(f"{what} is empty: a transfer needs at least one descriptor")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= length:
        bad = lo if lo < 0 else hi
        raise nixlInvalidParamError(f"{what}: index {bad} is out of range for a list of {length} descriptors")
    return arr.astype(np.int64)


def _strided(rows: np.ndarray) -> np.ndarray:
    """Nx3 descriptors from Nx5 strided runs (addr, len, dev_id, stride, count)."""
    counts = rows[:, 4].astype(np.int64)
    if len(rows) == 0 or counts.sum() == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    run = np.repeat(np.arange(len(rows)), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    k = (np.arange(int(counts.sum())) - first[run]).astype(np.uint64)
    out = np.empty((len(run), 3), dtype=np.uint64)
    out[:, 0] = rows[run, 0] + k * rows[run, 3]
    out[:, 1] = rows[run, 1]
    out[:, 2] = rows[run, 2]
    return out
