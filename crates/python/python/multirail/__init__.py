"""multirail: move bytes between the registered memory of processes, from Python.

    import multirail, numpy as np

    target = multirail.Engine(name="127.0.0.1")          # serves segment target.name
    dst = target.allocate(1 << 20)                       # multirail.Buffer (buffer protocol)

    engine = multirail.Engine(name="127.0.0.1")
    src = engine.allocate(1 << 20)
    np.frombuffer(src, dtype=np.uint8)[:] = 7            # no copy: NumPy sees engine memory
    seg = engine.open_segment(target.name)
    batch = engine.submit([multirail.Request(multirail.WRITE, src, seg, dst.addr, len(src))])
    batch.wait()                                         # raises a multirail.Error subclass on failure

Every error the engine reports is raised as a subclass of :class:`multirail.Error` whose message
is the engine's. Calls that wait for the network or for memory (``Engine()``, ``allocate``,
``open_segment``, ``submit``, ``Batch.wait``, every blocking :class:`Group` call) release the GIL.

Group multicast (every member runs this, in its own process or thread)::

    with engine.join_group("g", [a.segment_name, b.segment_name, c.segment_name]) as group:
        group.send(b"hello")                             # to every member, this one included
        sender, index, data = group.recv(timeout=5)      # None after 5 s without a message

:mod:`multirail.mooncake` offers ``TransferEngine``, a drop-in for Mooncake's
``mooncake.engine.TransferEngine``; :mod:`multirail.nixl` offers ``nixl_agent`` and
``nixl_agent_config``, a drop-in for NIXL's Python agent API.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _native
from ._native import (
    PRIO_HIGH,
    PRIO_LOW,
    PRIO_MEDIUM,
    AllocationError,
    BatchBusyError,
    BatchFullError,
    ConfigError,
    Error,
    InvalidArgumentError,
    GroupError,
    GroupJoinError,
    GroupMemberFailedError,
    IoError,
    NotAMemberError,
    PeerDisconnectedError,
    ProtocolError,
    RemoteRejectedError,
    SegmentUnreachableError,
    SourceNotRegisteredError,
    TargetOutOfRangeError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnknownBatchError,
    UnknownSegmentError,
    WaitTimeoutError,
)

__all__ = [
    "Engine",
    "Buffer",
    "Segment",
    "Request",
    "Batch",
    "PreparedList",
    "Group",
    "Status",
    "READ",
    "WRITE",
    "PRIO_HIGH",
    "PRIO_MEDIUM",
    "PRIO_LOW",
    "Error",
    "ConfigError",
    "InvalidArgumentError",
    "SourceNotRegisteredError",
    "TargetOutOfRangeError",
    "UnknownSegmentError",
    "SegmentUnreachableError",
    "UnknownBatchError",
    "BatchFullError",
    "BatchBusyError",
    "PeerDisconnectedError",
    "TransferTimeoutError",
    "RemoteRejectedError",
    "ProtocolError",
    "AllocationError",
    "TransportUnavailableError",
    "WaitTimeoutError",
    "IoError",
    "NotAMemberError",
    "GroupError",
    "GroupJoinError",
    "GroupMemberFailedError",
]

_native.init_logging()

#: Opcode of a request that copies from the target segment into local memory.
READ = "read"
#: Opcode of a request that copies from local memory into the target segment.
WRITE = "write"


class Status(str, enum.Enum):
    """State of one request or of a whole batch."""

    PENDING = "pending"
    """Some bytes are still on their way."""
    COMPLETED = "completed"
    """Every byte is in place at its destination."""
    FAILED = "failed"
    """The request failed; ``Batch.error()`` or ``Batch.wait()`` says why."""


def _uint(value: Any, what: str) -> int:
    """An address or length argument: a non-negative int (bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0 or value >= 1 << 64:
        raise InvalidArgumentError(f"invalid argument `{what}`: {value} is not a 64-bit unsigned integer")
    return value


class Buffer(_native.BufferView):
    """Memory the engine allocated or registered.

    Supports the buffer protocol (writable, format ``"B"``, one dimension), so
    ``memoryview(buf)`` and ``numpy.frombuffer(buf, dtype)`` see the memory itself, without a
    copy. Memory the engine allocated stays mapped while this object, or any view of it, lives,
    even after :meth:`Engine.unregister`. ``len(buf)`` is its size in bytes.
    """

    _handle: Any
    _keep: Any

    @property
    def addr(self) -> int:
        """Start address in this process; peers use it (plus an offset) as ``target_offset``."""
        return self._handle.addr

    @property
    def size(self) -> int:
        """Length in bytes."""
        return self._handle.size

    @property
    def key(self) -> int:
        """The random 64-bit access key peers present to touch this memory."""
        return self._handle.key

    @property
    def location(self) -> str:
        """``"*"`` (anywhere) or ``"cpu:N"`` (NUMA node N)."""
        return self._handle.location

    def __len__(self) -> int:
        return self._handle.size

    def __repr__(self) -> str:
        return f"<multirail.Buffer addr={self.addr:#x} size={self.size} location={self.location!r}>"


def _make_buffer(handle: Any, keep: Any = None) -> Buffer:
    buf = Buffer(handle.addr, handle.size, handle)
    buf._handle = handle
    buf._keep = keep
    return buf


class Segment:
    """A peer's segment, opened with :meth:`Engine.open_segment`."""

    __slots__ = ("_engine", "id", "name")

    def __init__(self, engine: "Engine", seg_id: int, name: str) -> None:
        self._engine = engine
        self.id: int = seg_id
        """Engine handle of the segment (what :class:`Request` carries)."""
        self.name: str = name
        """The name it was opened with, ``host:port``."""

    @property
    def buffers(self) -> List[Tuple[int, int]]:
        """``[(addr, length), ...]`` the segment published, from the cached descriptor."""
        return self._engine._native.segment_info(self.id)[1]

    def first_buffer_address(self) -> int:
        """Address of the segment's first buffer (0 when it publishes none)."""
        b = self.buffers
        return b[0][0] if b else 0

    def close(self) -> None:
        """Forgets the segment and closes its connections."""
        self._engine._native.close_segment(self.id)

    def __repr__(self) -> str:
        return f"<multirail.Segment {self.name} id={self.id}>"


class Request:
    """One transfer of ``length`` bytes between local ``source`` and ``target_offset`` in ``target``.

    ``opcode`` is :data:`READ` (target to source) or :data:`WRITE` (source to target);
    ``source`` a local address or a :class:`Buffer` (its start); ``target`` a :class:`Segment`
    or its id; ``target_offset`` the remote address (a peer buffer's ``addr`` plus an offset);
    ``priority`` :data:`PRIO_HIGH` (default), :data:`PRIO_MEDIUM` or :data:`PRIO_LOW`;
    ``transport`` ``None`` (the engine's setting), ``"auto"``, ``"tcp"``, ``"shm"`` or
    ``"rdma"``. A bad opcode, priority or transport raises :class:`InvalidArgumentError` here;
    ranges and length are checked by :meth:`Engine.submit`.
    """

    __slots__ = ("opcode", "source", "target", "target_offset", "length", "priority", "transport", "_native")

    def __init__(
        self,
        opcode: str,
        source: Union[int, Buffer],
        target: Union[Segment, int],
        target_offset: int,
        length: int,
        priority: int = PRIO_HIGH,
        transport: Optional[str] = None,
    ) -> None:
        self.opcode = opcode
        self.source = source.addr if isinstance(source, Buffer) else _uint(source, "source")
        self.target = target.id if isinstance(target, Segment) else _uint(target, "target")
        self.target_offset = _uint(target_offset, "target_offset")
        self.length = _uint(length, "length")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if not 0 <= priority <= 255:
            raise InvalidArgumentError(
                f"invalid argument `priority`: {priority} is not PRIO_HIGH (0), PRIO_MEDIUM (1) or PRIO_LOW (2)"
            )
        self.priority = priority
        self.transport = transport
        if not isinstance(opcode, str):
            raise TypeError(f"opcode must be multirail.READ or multirail.WRITE, got {opcode!r}")
        self._native = _native.NativeRequest(
            opcode, self.source, self.target, self.target_offset, self.length, priority, transport
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.opcode!r}, source={self.source:#x}, target={self.target}, "
            f"target_offset={self.target_offset:#x}, length={self.length}, priority={self.priority})"
        )


class Batch:
    """Requests submitted together by :meth:`Engine.submit`; freed when garbage-collected."""

    __slots__ = ("_native",)

    def __init__(self, native: Any) -> None:
        self._native = native

    def __len__(self) -> int:
        return len(self._native)

    def status(self, index: Optional[int] = None) -> Status:
        """Status of request ``index`` (submission order), or of the whole batch when None:
        FAILED if any failed, else PENDING while any runs, else COMPLETED. Never blocks."""
        s, _ = self._native.overall_status() if index is None else self._native.status(index)
        return Status(s)

    def error(self, index: Optional[int] = None) -> Optional[Error]:
        """The exception of failed request ``index`` (or the batch's first failure), else None."""
        _, e = self._native.overall_status() if index is None else self._native.status(index)
        return e

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every request finished, ``timeout`` seconds at most (None: no limit).

        Raises the first failure as a :class:`multirail.Error` subclass, or
        :class:`WaitTimeoutError` when the time ran out. The GIL is released meanwhile."""
        self._native.wait(timeout)

    def free(self) -> None:
        """Frees the batch now (otherwise when the object goes away). Raises
        :class:`BatchBusyError` while requests are in flight."""
        self._native.free()

    def __repr__(self) -> str:
        return f"<multirail.Batch id={self._native.id} requests={len(self)} status={self.status().value}>"


class PreparedList:
    """Transfers checked and routed once by :meth:`Engine.prepare`, posted by index as often as
    wanted (as NIXL's prepared descriptor lists and vLLM's reposted handles need).

    Each post is a new :class:`Batch`; the direction (:data:`READ` or :data:`WRITE`) and the
    priority are chosen per post. ``len(lst)`` is the number of entries. The list is freed by
    :meth:`free`, at the end of a ``with`` block, or when garbage-collected; batches posted from
    it run on.
    """

    __slots__ = ("_native",)

    def __init__(self, native: Any) -> None:
        self._native = native

    def __len__(self) -> int:
        return len(self._native)

    @property
    def id(self) -> int:
        """The engine's id of the list."""
        return self._native.id

    def post(
        self,
        op: str,
        indices: Optional[Sequence[int]] = None,
        priority: int = PRIO_HIGH,
        notify: Optional[str] = None,
    ) -> Batch:
        """Posts the entries at ``indices`` (every entry, in order, when None; an index may
        repeat; a NumPy integer array works) as ``op`` at ``priority``, and returns the
        :class:`Batch` (request ``k`` of the batch is ``indices[k]``). With ``notify``, the
        message reaches every segment the posted entries target, once all of them completed
        (so after the data).

        Nothing is posted when anything is wrong: :class:`InvalidArgumentError` for an index
        past the end, no index, a bad opcode or priority, a freed list;
        :class:`SourceNotRegisteredError` when local memory was unregistered since
        :meth:`Engine.prepare`; :class:`PeerDisconnectedError` when a target's process exited;
        TypeError for indices that are not integers. The GIL is released meanwhile."""
        if not isinstance(op, str):
            raise TypeError(f"op must be multirail.READ or multirail.WRITE, got {op!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if not 0 <= priority <= 255:
            raise InvalidArgumentError(
                f"invalid argument `priority`: {priority} is not PRIO_HIGH (0), PRIO_MEDIUM (1) or PRIO_LOW (2)"
            )
        idx: Optional[List[int]] = None
        if indices is not None:
            idx = _indices(indices, len(self))
        if notify is not None and not isinstance(notify, str):
            raise TypeError(f"notify must be a str or None, got {type(notify).__name__}")
        return Batch(self._native.post(op, priority, idx, notify))

    def free(self) -> None:
        """Frees the list now. Raises :class:`InvalidArgumentError` when it was freed already."""
        self._native.free()

    def __enter__(self) -> "PreparedList":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Frees the list unless it was freed already."""
        try:
            self._native.free()
        except InvalidArgumentError:
            pass

    def __repr__(self) -> str:
        return f"<multirail.PreparedList id={self.id} entries={len(self)}>"


def _indices(indices: Any, length: int) -> List[int]:
    """Entry indices as a list of ints: any iterable of ints (NumPy arrays included).
    Negative indices and indices past ``length`` raise InvalidArgumentError."""
    tolist = getattr(indices, "tolist", None)
    values = tolist() if callable(tolist) else indices
    if isinstance(values, (str, bytes)):
        raise TypeError("indices must be a sequence of ints")
    try:
        out = list(values)
    except TypeError:
        raise TypeError(f"indices must be a sequence of ints, got {type(indices).__name__}") from None
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"indices must hold ints, got {type(i).__name__}")
        if i < 0 or i >= length:
            raise InvalidArgumentError(
                f"invalid argument `indices`: {i} is past the end of a list of {length} entries"
            )
    return out


def _opt_uint(value: Any, what: str) -> Optional[int]:
    """An optional count or size argument: None or a non-negative int."""
    return None if value is None else _uint(value, what)


def _opt_str(value: Any, what: str) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{what} must be a str or None, got {type(value).__name__}")
    return value


def _names(value: Any, what: str) -> List[str]:
    """A list of segment names: any iterable of str except a str itself."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a list of segment names, not a single {type(value).__name__}")
    try:
        names = list(value)
    except TypeError:
        raise TypeError(f"{what} must be a list of segment names, got {type(value).__name__}") from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{what} must hold segment names (str), got {type(n).__name__}")
    return names


class Group:
    """A multicast group this engine joined with :meth:`Engine.join_group`.

    Every message a sender sends reaches every member, the sender included, exactly once, in
    the order its sender sent it (``delivery="unordered"``) or in one order identical at every
    member (``delivery="ordered"``). All methods may be called from several threads at once;
    every call that waits releases the GIL.

    Membership is fixed: when a member dies or stops answering for
    ``transports.tcp.timeout_ms``, every later :meth:`send`, :meth:`recv` and :meth:`flush`
    raises :class:`GroupMemberFailedError` naming it (messages that arrived before are still
    returned first). Leave with :meth:`leave` or a ``with`` block; after that every call raises
    :class:`GroupError` ("group X was left"). A group that is garbage-collected without leaving
    stops at once, and the other members see it fail.
    """

    __slots__ = ("_native",)

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def name(self) -> str:
        """The group's name."""
        return self._native.name

    @property
    def members(self) -> List[str]:
        """The members' segment names, in the order given to :meth:`Engine.join_group`."""
        return self._native.members

    @property
    def max_payload(self) -> int:
        """Largest message this group carries, in bytes."""
        return self._native.max_payload

    def send(self, data: Any) -> int:
        """Sends ``data`` to every member and returns the message's index among this member's
        messages (0, 1, ...).

        ``data`` is any C-contiguous object with the buffer protocol (``bytes``, ``bytearray``,
        ``memoryview``, a NumPy array...): its bytes are copied once, straight into the group's
        ring, with no copy in Python. Waits while the window is full. Raises
        :class:`GroupError` when ``data`` is longer than :attr:`max_payload`, this member is not
        a sender, or the group was left; :class:`GroupMemberFailedError` when a member failed,
        also when the window stayed full for 1.5 x ``transports.tcp.timeout_ms`` (the members
        that did not acknowledge are failed); TypeError or BufferError for an object without
        contiguous bytes."""
        return self._native.send(data)

    def send_into(self, length: int, fill: Callable[[memoryview], Any]) -> int:
        """Sends a message of ``length`` bytes that ``fill`` writes in place, in the group's
        ring (no copy at all); returns its index as :meth:`send` does.

        ``fill`` is called once with a writable ``memoryview`` of exactly ``length`` bytes,
        e.g. ``lambda mv: mv.__setitem__(slice(None), payload)`` or
        ``numpy.frombuffer(mv, numpy.uint8)[:] = ...``. The view is valid only during the call:
        it is released when ``fill`` returns, and keeping a slice of it or an array over it
        raises BufferError (the message is sent regardless). ``fill`` must not call
        :meth:`send`, :meth:`send_into`, :meth:`flush` or :meth:`leave` of this group
        (:class:`GroupError`), and should be quick: other senders of this member wait for it.
        If ``fill`` raises, its exception propagates and nothing is sent (the message is
        committed only after ``fill`` returns). Raises as :meth:`send` does (``fill`` is then
        not called)."""
        return self._native.send_into(_uint(length, "length"), fill)

    def recv(self, timeout: Optional[float] = None) -> Optional[Tuple[str, int, bytes]]:
        """The next message delivered to this member, as ``(sender, index, data)``: the
        sender's segment name, the message's index among the sender's messages and its bytes.

        Waits up to ``timeout`` seconds (None: until a message comes; Ctrl-C interrupts) and
        returns None when none came. Raises :class:`GroupMemberFailedError` once a member
        failed and the messages that arrived before were returned, :class:`GroupError` when the
        group was left (also by another thread while this one waits)."""
        return self._native.recv(timeout)

    def flush(self) -> None:
        """Pushes everything this member sent so far at once (without waiting for batching's
        ``k`` messages or ``flush_us``) and returns once every member can see it. Raises
        :class:`GroupMemberFailedError` or :class:`GroupError` (not done within
        ``transports.tcp.timeout_ms``; group left)."""
        self._native.flush()

    def stats(self) -> Dict[str, int]:
        """What the group did at this member: ``sent``, ``sent_bytes``, ``delivered`` (its own
        messages included), ``pushes``, ``data_writes``, ``counter_writes``, ``ack_writes``,
        ``heartbeat_writes``, ``window_stalls``, ``null_records`` (ordered delivery). Raises
        :class:`GroupError` after :meth:`leave` (which returns the final figures)."""
        return self._native.stats()

    def leave(self) -> Dict[str, int]:
        """Leaves the group together with the other members (a barrier: each member's messages
        are acknowledged by all, then all leave) and returns the final :meth:`stats`.

        Waits for calls other threads have in flight on this group to return first. Raises
        :class:`GroupMemberFailedError` when a member failed before everyone left,
        :class:`GroupError` when the barrier did not complete within
        ``transports.tcp.timeout_ms`` or the group was already left; the group is released
        either way."""
        return self._native.leave()

    @property
    def left(self) -> bool:
        """True once :meth:`leave` was called."""
        return self._native.left

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leaves the group unless it was left already. When the block raised, an error of
        ``leave`` is dropped so the block's exception propagates."""
        if self._native.left:
            return
        if exc_type is None:
            self.leave()
        else:
            try:
                self.leave()
            except Error:
                pass

    def __repr__(self) -> str:
        state = " (left)" if self._native.left else ""
        return f"<multirail.Group {self.name!r} members={len(self.members)}{state}>"


class _Closed:
    """Stands in for the native engine after Engine.close(). The engine's names stay
    readable (logs and error messages name a closed engine too); everything else raises."""

    def __init__(self, name: Optional[str] = None, segment_name: Optional[str] = None) -> None:
        self._names = {"name": name, "segment_name": segment_name}

    def __getattr__(self, attr: str) -> Any:
        # Only called for attributes not found the normal way, so `_names` itself never lands here.
        value = self.__dict__.get("_names", {}).get(attr)
        if value is not None:
            return value
        raise Error("the engine is closed")


ConfigArg = Union[None, Mapping[str, Any], str, "os.PathLike[str]"]


def _listen_for(name: Optional[str]) -> Tuple[str, Optional[str]]:
    """Maps ``Engine(name=...)`` to (listen address, local_hostname)."""
    if name is None:
        return "0.0.0.0:0", None
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"invalid argument `name`: expected \"host\" or \"host:port\", got {name!r}")
    host, port = name, "0"
    if name.startswith("["):  # [v6]:port or [v6]
        end = name.find("]")
        if end < 0:
            raise InvalidArgumentError(f"invalid argument `name`: unbalanced '[' in {name!r}")
        host, rest = name[1:end], name[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise InvalidArgumentError(f"invalid argument `name`: expected [host]:port, got {name!r}")
            port = rest[1:]
    elif name.count(":") == 1:
        host, port = name.split(":")
    if not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError(f"invalid argument `name`: port {port!r} is not 0-65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        # A host name: listen everywhere, publish the name.
        return f"0.0.0.0:{port}", host
    return (f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"), None


class Engine:
    """A transfer engine serving one segment, named ``host:port``.

    ``config``: None (``MULTIRAIL_CONF`` when set, else the defaults), a dict (the JSON
    document, TENT keys included), a path to a JSON file, or a string of inline JSON starting
    with ``{``. Invalid configuration raises :class:`ConfigError` naming the key.

    ``name``: where the engine listens and what it calls itself. ``"HOST"`` or
    ``"HOST:PORT"``; port 0 or no port picks a free one. When HOST is an IP address the engine
    listens on it only (``"127.0.0.1"`` keeps everything on loopback) and its segment name is
    ``HOST:PORT``. When HOST is a host name the engine listens on every address (0.0.0.0) and
    publishes ``HOST:PORT`` (``local_hostname``), unless the configuration sets
    ``local_hostname`` itself. None listens on 0.0.0.0 and publishes the first non-loopback
    IPv4 address of the host (else 127.0.0.1).

    ``transport`` overrides the configuration's ``transport`` key: ``"auto"`` (shared memory
    to same-host peers, else RDMA when both ends have RDMA devices, else TCP), ``"tcp"``,
    ``"shm"`` or ``"rdma"``.

    ``metadata`` overrides where segments are looked up, as Mooncake's ``metadata_server``:
    ``"P2PHANDSHAKE"`` asks each segment itself (the default), ``"http://HOST:PORT/PATH"`` a
    metadata server speaking Mooncake's HTTP protocol (the engine publishes its descriptor
    there and withdraws it when closed), ``"etcd://HOST:PORT[,HOST:PORT]"`` or a bare
    ``"HOST:PORT"`` an etcd cluster (the descriptor hangs on a lease the engine keeps alive, so
    a killed engine disappears within ``metadata.lease_ttl_s``; a watch follows open segments
    that are published again). Anything else raises :class:`InvalidArgumentError`.

    ``segment_name``: with a metadata store, the name the engine is published under and peers
    open it by (``metadata.segment_name``; default ``host:port``). A name that outlives the
    port lets peers follow a restarted engine to its new port.

    The engine stops serving on :meth:`close` (also at the end of a ``with`` block) or when the
    last reference goes away.
    """

    def __init__(
        self,
        config: ConfigArg = None,
        name: Optional[str] = None,
        *,
        transport: Optional[str] = None,
        metadata: Optional[str] = None,
        segment_name: Optional[str] = None,
    ) -> None:
        config_json: Optional[str] = None
        config_path: Optional[str] = None
        if config is None:
            pass
        elif isinstance(config, Mapping):
            config_json = json.dumps(config)
        elif isinstance(config, (str, os.PathLike)):
            text = os.fspath(config)
            if isinstance(text, bytes):
                text = os.fsdecode(text)
            if text.lstrip().startswith("{"):
                config_json = text
            else:
                config_path = text
        else:
            raise TypeError(f"config must be None, a dict or a path, got {type(config).__name__}")
        listen, hostname = _listen_for(name)
        self._native = _native.NativeEngine(
            listen,
            config_json=config_json,
            config_path=config_path,
            local_hostname=hostname,
            transport=transport,
            metadata=metadata,
            segment_name=segment_name,
        )

    @classmethod
    def _publishing(
        cls, host: str, port: int, *, transport: Optional[str], metadata: Optional[str]
    ) -> "Engine":
        """An engine listening on every IPv4 address (port ``port``, 0 for a free one) that
        publishes ``host`` (``local_hostname``, unless the configuration sets it), with the
        configuration of ``MULTIRAIL_CONF``: every interface is a rail, where ``Engine(name=IP)``
        would keep to the one holding that address. Raises what :class:`Engine` raises."""
        engine = cls.__new__(cls)
        engine._native = _native.NativeEngine(
            f"0.0.0.0:{port}", local_hostname=host, transport=transport, metadata=metadata
        )
        return engine

    @property
    def name(self) -> str:
        """This engine's address, ``host:port``: what peers pass to ``open_segment`` unless it
        has a ``segment_name``."""
        return self._native.name

    @property
    def segment_name(self) -> str:
        """The name peers pass to ``open_segment``: ``segment_name`` when given, else
        :attr:`name`."""
        return self._native.segment_name

    @property
    def config(self) -> Dict[str, Any]:
        """The effective configuration, as a dict."""
        return json.loads(self._native.config_json())

    def allocate(self, size: int, location: str = "*") -> Buffer:
        """Allocates ``size`` bytes (zeroed) in a shared mapping same-host peers can map, and serves
        them. Raises :class:`InvalidArgumentError` for size 0, :class:`AllocationError` when the
        OS refuses."""
        return _make_buffer(self._native.allocate(_uint(size, "size"), location))

    def register(self, ptr_or_buffer: Any, length: Optional[int] = None, location: str = "*") -> Buffer:
        """Serves memory the caller owns, and returns a :class:`Buffer` over it.

        ``ptr_or_buffer`` is an address (int; ``length`` required, the memory must stay valid
        until :meth:`unregister`) or a writable, C-contiguous object with the buffer protocol
        (``bytearray``, NumPy array, ``mmap``...; ``length`` defaults to its size in bytes and
        may be smaller). An object is kept alive, and cannot be resized, while the returned
        Buffer lives. Raises :class:`InvalidArgumentError` (length 0, null address),
        :class:`AllocationError` (overlap with registered memory) or TypeError (read-only or
        non-contiguous object)."""
        keep = None
        if isinstance(ptr_or_buffer, int) and not isinstance(ptr_or_buffer, bool):
            if length is None:
                raise InvalidArgumentError("invalid argument `length`: required when registering an address")
            addr = _uint(ptr_or_buffer, "ptr")
        else:
            try:
                mv = memoryview(ptr_or_buffer)
            except TypeError:
                raise TypeError(
                    f"register() needs an address or an object with the buffer protocol, got {type(ptr_or_buffer).__name__}"
                ) from None
            nbytes = mv.nbytes
            mv.release()
            if nbytes == 0:
                raise InvalidArgumentError("invalid argument `length`: the object is empty")
            try:
                keep = (ctypes.c_char * nbytes).from_buffer(ptr_or_buffer)
            except (TypeError, ValueError) as e:
                raise TypeError(f"register() needs writable, C-contiguous memory: {e}") from None
            addr = ctypes.addressof(keep)
            if length is None:
                length = nbytes
            elif _uint(length, "length") > nbytes:
                raise InvalidArgumentError(
                    f"invalid argument `length`: {length} is more than the object's {nbytes} bytes"
                )
        return _make_buffer(self._native.register(addr, _uint(length, "length"), location), keep)

    def unregister(self, buffer_or_addr: Union[Buffer, int]) -> None:
        """Stops serving a buffer (a :class:`Buffer` or its start address). Raises
        :class:`InvalidArgumentError` when no buffer starts there."""
        addr = buffer_or_addr.addr if isinstance(buffer_or_addr, Buffer) else _uint(buffer_or_addr, "addr")
        self._native.unregister(addr)

    def open_segment(self, name: str) -> Segment:
        """Opens peer segment ``name`` (``host:port``), fetching its descriptor from the peer.
        Raises :class:`SegmentUnreachableError` when nothing answers, :class:`InvalidArgumentError`
        for a malformed name."""
        if not isinstance(name, str):
            raise TypeError(f"segment name must be a str, got {type(name).__name__}")
        return Segment(self, self._native.open_segment(name), name)

    def submit(self, requests: Union[Request, Sequence[Request]]) -> Batch:
        """Checks every request, then starts them all, as one :class:`Batch`. Nothing starts if
        any is bad; the exception names the first problem (:class:`SourceNotRegisteredError`,
        :class:`TargetOutOfRangeError`, :class:`UnknownSegmentError`,
        :class:`InvalidArgumentError` for length 0 or a bad priority...)."""
        if isinstance(requests, Request):
            requests = [requests]
        natives = []
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"submit() takes multirail.Request objects, got {type(r).__name__}")
            natives.append(r._native)
        return Batch(self._native.submit(natives))

    def transfer(self, requests: Union[Request, Sequence[Request]], timeout: Optional[float] = None) -> None:
        """``submit(requests).wait(timeout)``, freeing the batch afterwards."""
        batch = self.submit(requests)
        batch.wait(timeout)

    def prepare(
        self,
        entries: Sequence[Tuple[Union[int, Buffer], Union[Segment, int], int, int]],
        transport: Optional[str] = None,
    ) -> PreparedList:
        """Checks and routes transfers once, for posting many times with
        :meth:`PreparedList.post`.

        ``entries``: ``[(local, segment, remote_addr, length), ...]``, each moving ``length``
        bytes between ``local`` (an address inside memory this engine allocated or registered,
        or a :class:`Buffer` for its start) and ``remote_addr`` in ``segment`` (a
        :class:`Segment` or its id); the direction is chosen at each post. ``transport``:
        ``None`` (the engine's setting), ``"auto"``, ``"tcp"``, ``"shm"`` or ``"rdma"`` for
        every entry.

        Raises, keeping nothing, :class:`InvalidArgumentError` for an empty list, length 0 or a
        bad transport, :class:`SourceNotRegisteredError`, :class:`TargetOutOfRangeError`,
        :class:`UnknownSegmentError` or :class:`PeerDisconnectedError` for the first bad entry,
        TypeError or ValueError for an entry that is not a 4-tuple of the right types. The GIL
        is released while the engine checks."""
        sources: List[int] = []
        segments: List[int] = []
        targets: List[int] = []
        lengths: List[int] = []
        for e in entries:
            try:
                local, segment, remote, length = e
            except (TypeError, ValueError):
                raise ValueError(
                    f"prepare() entries are (local, segment, remote_addr, length) tuples, got {e!r}"
                ) from None
            sources.append(local.addr if isinstance(local, Buffer) else _uint(local, "local"))
            segments.append(segment.id if isinstance(segment, Segment) else _uint(segment, "segment"))
            targets.append(_uint(remote, "remote_addr"))
            lengths.append(_uint(length, "length"))
        if not sources:
            raise InvalidArgumentError("invalid argument `entries`: must hold at least one entry")
        return PreparedList(self._native.prepare(sources, segments, targets, lengths, _opt_str(transport, "transport")))

    def connection_stats(self) -> Dict[str, int]:
        """What this engine's listening port holds: ``open`` connections (of every kind, peers'
        transfers and messages), ``pending`` (handshake unfinished), and counts since start:
        ``accepted``, ``not_members``, ``shed_pending``, ``shed_idle``, ``refused_full``,
        ``accept_errors``; ``serve_threads``."""
        return self._native.connection_stats()

    def traffic_stats(self) -> Dict[str, Dict[str, Any]]:
        """Per rail (``"shm"`` for same-host copies, an interface name for TCP): ``bytes``,
        ``slices``, ``errors`` since the engine started, ``priority_bytes`` (``{"high": ...,
        "medium": ..., "low": ...}``), and for network rails the scheduler's ``ewma_gbps``,
        ``inflight_bytes`` and the bound on bytes in flight, ``window_bytes``."""
        out: Dict[str, Dict[str, Any]] = {}
        for r in self._native.traffic_stats():
            name = r.pop("name")
            out[name] = r
        return out

    def served_stats(self) -> Dict[str, Any]:
        """What peers read and wrote of this engine's memory over TCP: ``{"rails": {name:
        {"read": {bytes, requests, refused, priority_bytes, priority_requests}, "write":
        {...}}}, "peers": {address: {"read": {bytes, requests}, "write": {...}}}, "latency":
        {"read": {"high": {count, p50_us, p99_us}, ...}, "write": {...}}, "max_peers": n}``.
        Same-host shm copies and one-sided RDMA never reach this engine's CPU and are not
        counted here; past ``max_peers`` addresses, the rest count under ``"other"``."""
        return self._native.served_stats()

    def metadata_stats(self) -> Dict[str, Any]:
        """The metadata store as this engine sees it: ``store`` (``"up"``, ``"down"``,
        ``"unknown"`` before any request, ``"not_used"`` with peer-to-peer lookups),
        ``store_failures_in_a_row``, and counts of ``lookups``, ``lookup_failures``,
        ``publishes``, ``publish_failures``, ``watch_updates``, ``refreshes`` (renewals the
        store took) and ``republishes`` (keys lost or never stored, published again once the
        store answered)."""
        return self._native.metadata_stats()

    def qos_stats(self) -> Dict[str, Any]:
        """The priority queues: ``{"priorities": {"high": {"queued", "dequeued", "wait_p50_us",
        "wait_p99_us"}, "medium": {...}, "low": {...}}, "promotions": n, "global_slot": slot}``
        (``global_slot`` is ``None`` unless ``shared_quota_shm_path`` is set)."""
        return self._native.qos_stats()

    def lanes(self) -> Dict[str, Any]:
        """Lanes of small messages (``lanes.*`` in the configuration): ``{"dynamic": bool,
        "max_dedicated": n, "receive_bytes": n, "outgoing": [...], "incoming": [...],
        "requesting": {...}, "granting": {...}}``. Each peer entry has ``peer`` (segment name),
        ``lane`` (``"shared"`` or ``"dedicated"``), ``score`` (this engine's usage score,
        outgoing only, else ``None``), ``promotions``, ``demotions`` and ``denials``;
        ``requesting`` and ``granting`` count the negotiation's messages and switches."""
        return self._native.lanes()

    def notify(self, segment: Union[Segment, int], msg: str) -> None:
        """Sends ``msg`` to an opened segment as a notification; it arrives in order with this
        engine's other messages to that peer. Raises :class:`PeerDisconnectedError`,
        :class:`TransferTimeoutError`..."""
        seg_id = segment.id if isinstance(segment, Segment) else _uint(segment, "segment")
        self._native.send_notification(seg_id, msg)

    def notifications(self, timeout: Optional[float] = 0.0) -> List[Tuple[str, str]]:
        """Notifications received since the last call: ``[(sender segment name, msg), ...]``.
        With none yet, waits up to ``timeout`` seconds (default 0: do not wait; None: no
        limit) for the first, with the GIL released: a short spin, then asleep until a sender
        rings, so a long wait costs no core. ``[]`` when none came in time."""
        if timeout == 0.0:
            return self._native.receive_notifications()
        return self._native.wait_notifications(timeout)

    def send(self, segment: Union[Segment, int], data: Any) -> None:
        """Sends the bytes of ``data`` (``bytes``, ``bytearray``, ``memoryview``, a C-contiguous
        NumPy array...) to an opened segment as a message; the peer gets them from
        :meth:`recv`, after every message and notification this engine sent it before. Waits
        (GIL released) while the peer has no receive buffer for us. Raises an
        :class:`Error` subclass naming the limit for a message larger than the peer's receive
        buffers, :class:`TransferTimeoutError` or :class:`PeerDisconnectedError`; TypeError
        for an object without the buffer protocol."""
        seg_id = segment.id if isinstance(segment, Segment) else _uint(segment, "segment")
        self._native.send(seg_id, data)

    def recv(self, timeout: Optional[float] = None) -> Optional[Tuple[str, bytes]]:
        """The next message from any peer as ``(sender segment name, bytes)``, waiting up to
        ``timeout`` seconds (None: no limit) with the GIL released: a short spin, then asleep
        until a sender rings, so a long wait costs no core. None when none came in time."""
        return self._native.recv(timeout)

    def join_group(
        self,
        name: str,
        members: Sequence[str],
        senders: Optional[Sequence[str]] = None,
        *,
        window_size: Optional[int] = None,
        max_payload: Optional[int] = None,
        delivery: str = "unordered",
        batching: Optional[str] = None,
        flush_us: Optional[int] = None,
        transport: Optional[str] = None,
        join_timeout_ms: Optional[int] = None,
    ) -> Group:
        """Joins multicast group ``name`` and returns the :class:`Group` once every member
        joined. Every member calls this (each in its own process or thread) with the same
        settings.

        ``members``: the segment names (:attr:`segment_name`) of every member, this engine
        included, in one order all members agree on (at least 2). ``senders``: the members
        that send, None for all. ``window_size``: messages a sender may have unacknowledged;
        ``max_payload``: largest message in bytes; ``delivery``: ``"unordered"`` (per-sender
        FIFO) or ``"ordered"`` (one total order, the same at every member); ``batching``:
        ``"off"``, ``"opportunistic"`` or ``"k:N"`` (push every N messages or after
        ``flush_us`` microseconds); ``transport``: ``"tcp"``, ``"shm"``, ``"rdma"``,
        ``"auto"`` or None (the engine's). Settings left None come from
        ``transports.<transport>.multicast`` of the configuration. ``join_timeout_ms``: how long
        to wait for the other members (default 30000).

        Raises :class:`InvalidArgumentError` naming the argument for a bad setting (negative or
        out of range, unknown ``delivery`` or ``batching``...), :class:`GroupJoinError` when
        this engine is not among ``members``, a member joined with different settings (naming
        it and the setting) or members did not join in time (naming them), TypeError for
        arguments of the wrong type."""
        if not isinstance(name, str):
            raise TypeError(f"group name must be a str, got {type(name).__name__}")
        if not isinstance(delivery, str):
            raise TypeError(f"delivery must be \"unordered\" or \"ordered\", got {delivery!r}")
        native = self._native.join_group(
            name,
            _names(members, "members"),
            None if senders is None else _names(senders, "senders"),
            window_size=_opt_uint(window_size, "window_size"),
            max_payload=_opt_uint(max_payload, "max_payload"),
            delivery=delivery,
            batching=_opt_str(batching, "batching"),
            flush_us=_opt_uint(flush_us, "flush_us"),
            transport=_opt_str(transport, "transport"),
            join_timeout_ms=_opt_uint(join_timeout_ms, "join_timeout_ms"),
        )
        return Group(native)

    def close(self) -> None:
        """Stops serving (the port and every connection close) and releases the engine: later
        calls raise :class:`Error`; a ``recv`` or notification wait blocked in another thread
        returns at once (``None``, or no notifications). Buffers stay usable as memory. Closing
        twice is harmless. :attr:`name` and :attr:`segment_name` stay readable."""
        native = self._native
        if isinstance(native, _Closed):
            return
        self._native = _Closed(native.name, native.segment_name)
        native.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " (closed)" if isinstance(self._native, _Closed) else ""
        return f"<multirail.Engine {self.name}{state}>"
