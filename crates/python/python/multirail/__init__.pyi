"""Type stubs of the multirail package (the Pythonic API over the multirail engine)."""

import enum
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _native

PRIO_HIGH: int
"""Highest priority, the default: metadata, control, latency-sensitive transfers (0)."""
PRIO_MEDIUM: int
"""Interactive and serving traffic (1)."""
PRIO_LOW: int
"""Bulk and background transfers (2)."""
READ: str
"""Opcode: copy from the target segment into local memory ("read")."""
WRITE: str
"""Opcode: copy from local memory into the target segment ("write")."""

class Error(Exception):
    """Base class of every error the engine reports; str(e) is the engine's message."""

class ConfigError(Error):
    """The configuration is malformed; the message names the key."""

class InvalidArgumentError(Error):
    """An argument is out of range or malformed (the message names it)."""

class SourceNotRegisteredError(Error):
    """A request's local range is not inside memory this engine allocated or registered."""

class TargetOutOfRangeError(Error):
    """A request's remote range lies outside every buffer of the target segment."""

class UnknownSegmentError(Error):
    """A segment id that was never opened or was closed."""

class SegmentUnreachableError(Error):
    """Nothing answered at the segment's address, or the name is not host:port."""

class UnknownBatchError(Error):
    """A batch that was never allocated or was already freed."""

class BatchFullError(Error):
    """The requests do not fit in the batch."""

class BatchBusyError(Error):
    """The batch still has requests in flight."""

class PeerDisconnectedError(Error):
    """The peer closed the connection or died while requests were in flight."""

class TransferTimeoutError(Error):
    """The peer did not answer within transports.tcp.timeout_ms."""

class RemoteRejectedError(Error):
    """The peer checked a slice and refused it (unknown buffer, wrong key, out of bounds)."""

class ProtocolError(Error):
    """The peer sent something that is not valid protocol."""

class AllocationError(Error):
    """Allocating, mapping or registering memory failed."""

class TransportUnavailableError(Error):
    """The demanded transport cannot serve this request."""

class WaitTimeoutError(Error):
    """Batch.wait() gave up before every request finished."""

class IoError(Error):
    """An operating-system call failed."""

class NotAMemberError(Error):
    """This engine and the peer do not share the membership token (auth.token / MULTIRAIL_TOKEN)."""

class GroupError(Error):
    """A multicast group refused an operation: a message over max_payload, this member is not
    a sender, flush or leave not done in time, the group was left."""

class GroupJoinError(GroupError):
    """Joining failed: this engine is not a member, a member joined with different settings
    (the message names it and the setting), or members did not join in time (named)."""

class GroupMemberFailedError(GroupError):
    """A member died, stopped answering for transports.tcp.timeout_ms, or did not acknowledge
    while a sender's window stayed full; the group cannot go on and every later send, recv,
    flush and leave raises this. `member` may name several members, comma-separated."""

    group: str
    """The group's name."""
    member: str
    """The failed member's segment name."""

class Status(str, enum.Enum):
    """State of one request or of a whole batch."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"

class Buffer(_native.BufferView):
    """Memory the engine allocated or registered; supports the buffer protocol (writable,
    format "B", one dimension): memoryview(buf), numpy.frombuffer(buf, dtype)."""

    @property
    def addr(self) -> int:
        """Start address in this process; peers use it (plus an offset) as target_offset."""
    @property
    def size(self) -> int:
        """Length in bytes."""
    @property
    def key(self) -> int:
        """The random 64-bit access key peers present to touch this memory."""
    @property
    def location(self) -> str:
        """"*" or "cpu:N"."""
    def __len__(self) -> int: ...

class Segment:
    """A peer's segment, opened with Engine.open_segment."""

    id: int
    """Engine handle of the segment."""
    name: str
    """The name it was opened with, host:port."""
    @property
    def buffers(self) -> List[Tuple[int, int]]:
        """[(addr, length), ...] the segment published."""
    def first_buffer_address(self) -> int:
        """Address of the segment's first buffer, 0 when it has none."""
    def close(self) -> None:
        """Forgets the segment and closes its connections."""

class Request:
    """One transfer of `length` bytes between local `source` and `target_offset` in `target`."""

    opcode: str
    source: int
    target: int
    target_offset: int
    length: int
    priority: int
    transport: Optional[str]
    def __init__(
        self,
        opcode: str,
        source: Union[int, Buffer],
        target: Union[Segment, int],
        target_offset: int,
        length: int,
        priority: int = ...,
        transport: Optional[str] = None,
    ) -> None:
        """opcode READ or WRITE; source an address or a Buffer; target a Segment or its id;
        target_offset the remote address; priority PRIO_HIGH (default), PRIO_MEDIUM, PRIO_LOW;
        transport None, "auto", "tcp" or "shm". Raises InvalidArgumentError for a bad opcode
        or transport."""

class Batch:
    """Requests submitted together; freed when garbage-collected."""

    def __len__(self) -> int: ...
    def status(self, index: Optional[int] = None) -> Status:
        """Status of request `index`, or of the whole batch when None. Never blocks."""
    def error(self, index: Optional[int] = None) -> Optional[Error]:
        """The exception of a failed request (or the batch's first failure), else None."""
    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks (GIL released) until every request finished; raises the first failure or
        WaitTimeoutError."""
    def free(self) -> None:
        """Frees the batch now; BatchBusyError while requests are in flight."""

class PreparedList:
    """Transfers checked and routed once by Engine.prepare, posted by index many times; freed
    by free(), a `with` block or garbage collection (batches posted from it run on)."""

    def __len__(self) -> int: ...
    @property
    def id(self) -> int:
        """The engine's id of the list."""
    def post(self, op: str, indices: Optional[Sequence[int]] = None, priority: int = ..., notify: Optional[str] = None) -> Batch:
        """Posts the entries at `indices` (all when None) as READ or WRITE at `priority` into a
        new Batch; `notify` reaches the targets after the data. Raises InvalidArgumentError for
        a bad index, opcode or priority or a freed list, SourceNotRegisteredError,
        PeerDisconnectedError; nothing is posted then."""
    def free(self) -> None:
        """Frees the list now; InvalidArgumentError when it was freed already."""
    def __enter__(self) -> "PreparedList": ...
    def __exit__(self, *exc: Any) -> None: ...

class Group:
    """A multicast group joined with Engine.join_group; usable from several threads at once,
    every waiting call releases the GIL. A `with` block leaves it on exit."""

    @property
    def name(self) -> str:
        """The group's name."""
    @property
    def members(self) -> List[str]:
        """The members' segment names, in member order."""
    @property
    def max_payload(self) -> int:
        """Largest message, bytes."""
    @property
    def left(self) -> bool:
        """True once leave() was called."""
    def send(self, data: Any) -> int:
        """Sends the bytes of a C-contiguous buffer-protocol object (bytes, bytearray,
        memoryview, NumPy array) to every member, copied once into the ring; returns the
        message index; waits while the window is full. Raises GroupError (over max_payload,
        not a sender, left), GroupMemberFailedError (also when the window stays full: the
        members that do not acknowledge are failed)."""
    def send_into(self, length: int, fill: Callable[[memoryview], Any]) -> int:
        """Sends `length` bytes that fill(memoryview) writes in place in the ring (no copy);
        the view is valid only during the call (keeping it raises BufferError). If fill raises,
        nothing is sent and the exception propagates. Returns the index."""
    def recv(self, timeout: Optional[float] = None) -> Optional[Tuple[str, int, bytes]]:
        """(sender segment name, index, bytes) of the next message, or None after `timeout`
        seconds (None: no limit). Raises GroupMemberFailedError, GroupError (left)."""
    def flush(self) -> None:
        """Pushes everything sent so far and waits until every member can see it."""
    def stats(self) -> Dict[str, int]:
        """sent, sent_bytes, delivered, pushes, data_writes, counter_writes, ack_writes,
        heartbeat_writes, window_stalls, null_records. Raises GroupError once left."""
    def leave(self) -> Dict[str, int]:
        """Leaves with the other members (a barrier); returns the final stats. Raises
        GroupMemberFailedError or GroupError; the group is released either way."""
    def __enter__(self) -> "Group": ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

ConfigArg = Union[None, Mapping[str, Any], str, "os.PathLike[str]"]

class Engine:
    """A transfer engine serving one segment named host:port.

    config: None (MULTIRAIL_CONF or defaults), a dict, a JSON file path, or inline JSON.
    name: "HOST" or "HOST:PORT" (port 0 / none: a free port). An IP address is listened on
    and published; a host name is published while the engine listens on 0.0.0.0. None:
    listen on 0.0.0.0, publish the first non-loopback IPv4 address.
    transport: overrides the configuration's `transport` ("auto", "tcp", "shm")."""

    def __init__(self, config: ConfigArg = None, name: Optional[str] = None, *, transport: Optional[str] = None, metadata: Optional[str] = None, segment_name: Optional[str] = None) -> None: ...
    @property
    def name(self) -> str:
        """This engine's address, host:port."""
    @property
    def segment_name(self) -> str:
        """The name peers open this engine by: segment_name when given, else name."""
    @property
    def config(self) -> Dict[str, Any]:
        """The effective configuration."""
    def allocate(self, size: int, location: str = "*") -> Buffer:
        """Allocates and serves `size` zeroed bytes in a shared mapping."""
    def register(self, ptr_or_buffer: Any, length: Optional[int] = None, location: str = "*") -> Buffer:
        """Serves caller memory: an address (with length) or a writable, C-contiguous object
        with the buffer protocol."""
    def unregister(self, buffer_or_addr: Union[Buffer, int]) -> None:
        """Stops serving a buffer."""
    def open_segment(self, name: str) -> Segment:
        """Opens peer segment `name` (host:port); GIL released while it answers."""
    def submit(self, requests: Union[Request, Sequence[Request]]) -> Batch:
        """Checks every request, then starts them all (none if any is bad)."""
    def transfer(self, requests: Union[Request, Sequence[Request]], timeout: Optional[float] = None) -> None:
        """submit(requests).wait(timeout)."""
    def notify(self, segment: Union[Segment, int], msg: str) -> None:
        """Sends a notification to an opened segment."""
    def notifications(self, timeout: Optional[float] = 0.0) -> List[Tuple[str, str]]:
        """Notifications received since the last call: [(sender segment name, msg), ...]; with
        none yet, waits up to `timeout` seconds (0: no wait, None: no limit) for the first."""
    def send(self, segment: Union[Segment, int], data: Any) -> None:
        """Sends the bytes of `data` (buffer protocol) to an opened segment as a message."""
    def recv(self, timeout: Optional[float] = None) -> Optional[Tuple[str, bytes]]:
        """The next message as (sender segment name, bytes), or None after `timeout` seconds."""
    def traffic_stats(self) -> Dict[str, Dict[str, Any]]:
        """Per rail: bytes, slices, errors, priority_bytes, ewma_gbps, inflight_bytes, window_bytes."""
    def served_stats(self) -> Dict[str, Any]:
        """What peers read and wrote of this engine's memory over TCP: {"rails", "peers",
        "latency", "max_peers"} (shm and one-sided RDMA are not counted at the target)."""
    def metadata_stats(self) -> Dict[str, Any]:
        """The metadata store as this engine sees it: {"store": "up"|"down"|"unknown"|"not_used",
        "store_failures_in_a_row", "lookups", "lookup_failures", "publishes", "publish_failures",
        "watch_updates", "refreshes", "republishes"}."""
    def qos_stats(self) -> Dict[str, Any]:
        """Priority queues: {"priorities": {"high"|"medium"|"low": {queued, dequeued, wait_p50_us,
        wait_p99_us}}, "promotions": n, "global_slot": slot or None}."""
    def prepare(self, entries: Sequence[Tuple[Union[int, Buffer], Union[Segment, int], int, int]], transport: Optional[str] = None) -> PreparedList:
        """Checks and routes [(local, segment, remote_addr, length), ...] once for posting many
        times. Raises InvalidArgumentError, SourceNotRegisteredError, TargetOutOfRangeError,
        UnknownSegmentError or PeerDisconnectedError for the first bad entry (nothing kept)."""
    def connection_stats(self) -> Dict[str, int]:
        """The listening port: open, pending, accepted, not_members, shed_pending, shed_idle,
        refused_full, accept_errors, serve_threads."""
    def lanes(self) -> Dict[str, Any]:
        """Lanes of small messages: {"dynamic", "max_dedicated", "receive_bytes", "outgoing":
        [{peer, lane, score, promotions, demotions, denials}], "incoming": [...], "requesting":
        {...}, "granting": {...}}."""
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
        """Joins multicast group `name` of `members` (segment names, this engine included);
        returns once every member joined. delivery "unordered" or "ordered"; batching "off",
        "opportunistic" or "k:N"; None settings come from transports.<t>.multicast. Raises
        InvalidArgumentError naming a bad argument, GroupJoinError (not a member, a member with
        different settings, members missing after join_timeout_ms)."""
    def close(self) -> None:
        """Stops serving and releases the engine; later calls raise Error."""
    def __enter__(self) -> "Engine": ...
    def __exit__(self, *exc: Any) -> None: ...

__all__: List[str]
