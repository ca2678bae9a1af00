"""Drop-in for Mooncake's ``mooncake.engine.TransferEngine`` (the class SGLang's and vLLM's
Mooncake connectors drive), on the multirail engine.

    from multirail.mooncake import TransferEngine      # instead of: from mooncake.engine import ...

    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    session_id = f"127.0.0.1:{te.get_rpc_port()}"     # what peers pass as target_hostname
    te.register_memory(ptr, length)
    te.batch_transfer_sync_write(peer_session_id, [ptr], [peer_ptr], [length])

Conventions follow Mooncake's pybind11 binding (``transfer_engine_py.cpp``): methods return 0 on
success and a negative number (-1) on failure instead of raising; the reason is logged on the
``multirail.mooncake`` logger (standard :mod:`logging`). The exceptions to that rule are also
Mooncake's: ``batch_transfer_async_*`` return a batch id (> 0), or 0 on failure;
``allocate_managed_buffer`` returns an address, 0 on failure; ``get_first_buffer_address``
returns an address, 0 on failure; ``transfer_check_status`` returns 1 / 0 / -1 / -2;
``read_bytes_from_buffer`` returns ``bytes`` and raises :class:`multirail.Error` subclasses
(Mooncake would read any address; this one refuses memory it did not register). Methods called
before a successful ``initialize`` return -1 (0 where 0 means failure) instead of crashing.

Differences from Mooncake, all documented on the methods:

* ``metadata_server``: ``"P2PHANDSHAKE"`` (segments are discovered by asking the peer itself),
  an HTTP metadata server ``"http://HOST:PORT/metadata"`` (Mooncake's protocol) or etcd
  (``"etcd://HOST:PORT[,HOST:PORT]"`` or a bare ``host:port``, as Mooncake reads it). Engines
  publish under ``multirail/``, beside Mooncake's own keys, by their session id
  ``host:port``.
* ``protocol``: ``"tcp"`` forces the TCP transport (also to same-host peers, as Mooncake does);
  ``"rdma"`` uses the best transport multirail has (shared memory to same-host peers, RDMA when
  both ends have RDMA devices, else TCP) and logs so. Anything else returns -1.
* ``device_name`` is ignored (logged): multirail picks its rails from the configuration
  (``MULTIRAIL_CONF``) or the host's interfaces. ``local_hostname`` names the engine and does
  not pin it to one interface: given an IPv4 address that is not loopback, the engine listens
  on every address and publishes that one, so its TCP traffic is sprayed over every interface.
* ``get_notifies()`` returns the notifications received since the last call; a
  notification's ``name`` is the sender's session id (``host:port``), whatever name the
  sender put in its ``TransferNotify`` (only ``msg`` travels).
* ``allocate_managed_buffer`` gives each call its own engine allocation (page-granular,
  shared-memory backed) instead of Mooncake's buddy allocator.
* The engine's configuration comes from ``MULTIRAIL_CONF`` (a path or inline JSON), as for the
  ``multirail`` command.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import os
from typing import Any, Dict, List, Optional, Sequence

from . import Engine, Error
from . import _native

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify"]

log = logging.getLogger("multirail.mooncake")

#: ``metadata_server`` value that selects peer-to-peer discovery (the default; an HTTP metadata
#: server URL is the other choice).
P2PHANDSHAKE = "P2PHANDSHAKE"


class TransferOpcode(enum.IntEnum):
    """Opcode of ``transfer_sync`` / ``batch_transfer_sync`` / ``batch_transfer_async``."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: ``name`` (the sender's segment name) and ``msg``."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _timeout_seconds() -> float:
    """Mooncake's sync-transfer budget: MC_TRANSFER_TIMEOUT seconds (at least 5), default 30."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw:
        try:
            return float(max(5, int(raw)))
        except ValueError:
            pass
    return 30.0


def _split_host(local_hostname: str) -> "tuple[str, int]":
    """``host``, ``host:port`` or ``[v6]:port`` -> (host, port or 0)."""
    if local_hostname.startswith("["):
        end = local_hostname.find("]")
        host = local_hostname[1:end]
        rest = local_hostname[end + 1 :]
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else 0
    if local_hostname.count(":") == 1:
        host, port = local_hostname.split(":")
        return host, int(port) if port.isdigit() else 0
    return local_hostname, 0


def _every_interface(host: str) -> bool:
    """Whether an engine named after ``host`` listens on every address, so that every interface
    of this host is a rail: true for an IPv4 address that is neither loopback nor unspecified.
    Loopback keeps everything on this host; a host name and the unspecified address already
    listen everywhere; IPv6 has no rails but the one (TCP rails are IPv4 interfaces)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.version == 4 and not ip.is_loopback and not ip.is_unspecified


class TransferEngine:
    """Mooncake-compatible transfer engine. Call :meth:`initialize` first."""

    def __init__(self) -> None:
        self._engine: Optional[Engine] = None
        self._timeout = _timeout_seconds()

    # ------------------------------------------------------------------ setup

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Starts the engine. Returns 0, or -1 (logged) on failure.

        ``local_hostname``: ``"host"`` or ``"host:port"``; as in Mooncake with P2PHANDSHAKE the
        port is ignored and a free one is picked (set ``MC_LEGACY_RPC_PORT_BINDING`` to use
        it). The engine publishes ``host`` and listens on every address, so that every
        interface of the host is a rail (``MULTIRAIL_CONF``'s ``rails`` chooses them by hand);
        a loopback address (``"127.0.0.1"``) is listened on alone, which keeps everything on
        this host, and so is an IPv6 address. The session id peers use is
        ``f"{host}:{get_rpc_port()}"``.
        ``metadata_server``: ``"P2PHANDSHAKE"``, ``"http://HOST:PORT/PATH"``,
        ``"etcd://HOST:PORT[,...]"`` or a bare ``"HOST:PORT[,...]"`` (etcd). ``protocol``: ``"tcp"`` or ``"rdma"`` (see the module docstring).
        ``device_name``: ignored."""
        if self._engine is not None:
            log.error("initialize: this TransferEngine is already initialized (%s)", self._engine.name)
            return -1
        if not isinstance(local_hostname, str) or not local_hostname:
            log.error("initialize: local_hostname must be a non-empty string, got %r", local_hostname)
            return -1
        if not isinstance(metadata_server, str) or not (
            metadata_server == P2PHANDSHAKE
            or metadata_server.startswith(("http://", "etcd://"))
            or (metadata_server and "://" not in metadata_server)
        ):
            log.error(
                "initialize: metadata server %r is not supported; pass %r, an HTTP metadata "
                "server 'http://HOST:PORT/metadata' or etcd 'etcd://HOST:PORT'",
                metadata_server,
                P2PHANDSHAKE,
            )
            return -1
        if protocol == "tcp":
            transport = "tcp"
        elif protocol == "rdma":
            transport = "auto"
            log.info(
                "initialize: protocol 'rdma': using multirail's best transport to each peer (shared "
                "memory on this host, RDMA when both ends have RDMA devices, else TCP)"
            )
        else:
            log.error("initialize: protocol %r is not supported (use 'tcp' or 'rdma')", protocol)
            return -1
        if device_name:
            log.info("initialize: device_name %r ignored; rails come from MULTIRAIL_CONF or the host's interfaces", device_name)
        host, port = _split_host(local_hostname)
        if not os.environ.get("MC_LEGACY_RPC_PORT_BINDING"):
            port = 0
        try:
            if _every_interface(host):
                # Mooncake's local_hostname names the engine; it does not choose its NICs (its
                # RDMA transport takes every device). Listening on this one address would keep
                # multirail to the one interface holding it.
                self._engine = Engine._publishing(host, port, transport=transport, metadata=metadata_server)
            else:
                name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                self._engine = Engine(None, name, transport=transport, metadata=metadata_server)
        except Error as e:
            log.error("initialize: %s", e)
            return -1
        log.info("initialize: segment %s, transport %s", self._engine.name, transport)
        return 0

    def get_rpc_port(self) -> int:
        """The port of this engine's segment (its session id is ``host:port``); -1 before
        ``initialize``."""
        if self._engine is None:
            return -1
        return int(self._engine.name.rsplit(":", 1)[1])

    def get_session_id(self) -> str:
        """``host:port``, the name peers pass as ``target_hostname`` (multirail extra; empty
        before ``initialize``)."""
        return self._engine.name if self._engine is not None else ""

    # ----------------------------------------------------------------- memory

    def _call(self, what: str, fn: Any, *args: Any, failure: int = -1) -> Any:
        if self._engine is None:
            log.error("%s: the TransferEngine is not initialized", what)
            return failure
        try:
            return fn(*args)
        except (Error, TypeError, ValueError, OverflowError) as e:
            log.error("%s: %s", what, e)
            return failure

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Serves ``capacity`` bytes at ``buffer_addr`` (the caller keeps them alive until
        ``unregister_memory``). Returns 0, or -1 (null address, length 0, overlap)."""
        return self._call(
            "register_memory",
            lambda: self._native().mc_register([buffer_addr], [capacity], location) or 0,
        )

    def unregister_memory(self, buffer_addr: int) -> int:
        """Stops serving the memory registered at ``buffer_addr``. Returns 0, or -1 when nothing
        is registered there."""
        return self._call("unregister_memory", lambda: self._native().mc_unregister([buffer_addr]) or 0)

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*") -> int:
        """Registers every range, or none: on a failure the ones already registered are
        unregistered again. Returns 0 or -1."""
        return self._call(
            "batch_register_memory",
            lambda: self._native().mc_register(list(buffer_addresses), list(capacities), location) or 0,
        )

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters every address it can. Returns 0, or -1 if any was not registered."""
        return self._call(
            "batch_unregister_memory", lambda: self._native().mc_unregister(list(buffer_addresses)) or 0
        )

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers ``length`` bytes owned by the engine; returns the address,
        0 on failure. Free it with ``free_managed_buffer``."""
        return self._call("allocate_managed_buffer", lambda: self._native().mc_allocate(length), failure=0)

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees a buffer from ``allocate_managed_buffer``. Returns 0, or -1 when
        ``buffer_addr`` is not one (``length`` is accepted for compatibility)."""
        return self._call("free_managed_buffer", lambda: self._native().mc_free(buffer_addr) or 0)

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies the first ``length`` bytes of ``src_ptr`` to ``dest_address``, which must lie in
        memory registered or allocated through this object. Returns 0 or -1."""
        return self._call(
            "write_bytes_to_buffer", lambda: self._native().mc_write_bytes(dest_address, src_ptr, length) or 0
        )

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """Returns a copy of ``length`` bytes at ``source_address`` (memory registered or
        allocated through this object). Raises :class:`multirail.SourceNotRegisteredError`
        outside it, :class:`multirail.Error` before ``initialize``."""
        return self._native().mc_read_bytes(source_address, length)

    # --------------------------------------------------------------- segments

    def get_first_buffer_address(self, segment_name: str) -> int:
        """Address of the first buffer segment ``segment_name`` publishes (lowest address);
        0 when it publishes none or cannot be reached."""
        return self._call(
            "get_first_buffer_address", lambda: self._native().mc_first_buffer(segment_name), failure=0
        )

    def get_notifies(self) -> List[TransferNotify]:
        """Notifications received since the last call, in arrival order, as
        :class:`TransferNotify` (``name``: the sender's session id ``host:port``; ``msg``: the
        text). Empty before ``initialize``."""
        if self._engine is None:
            return []
        return [TransferNotify(name, msg) for name, msg in self._engine._native.receive_notifications()]

    def send_notify(self, target_hostname: str, notify: TransferNotify) -> int:
        """Sends ``notify.msg`` to ``target_hostname`` as a notification (multirail extra).
        Returns 0 or -1."""
        return self._call("send_notify", lambda: self._native().mc_notify(target_hostname, notify.msg) or 0)

    # -------------------------------------------------------------- transfers

    def _sync(self, what: str, opcode: str, target: str, bufs: Sequence[int], peers: Sequence[int], lens: Sequence[int], notify: Optional[str] = None) -> int:
        if self._engine is None:
            log.error("%s: the TransferEngine is not initialized", what)
            return -1
        lens = list(lens)
        budget = self._timeout + sum(lens) / 1e9 if lens and all(isinstance(x, int) for x in lens) else self._timeout
        try:
            self._engine._native.mc_transfer_sync(target, opcode, list(bufs), list(peers), lens, budget, notify)
            return 0
        except (Error, TypeError, ValueError, OverflowError) as e:
            log.error("%s to %s: %s", what, target, e)
            return -1

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        """Writes ``length`` bytes at local ``buffer`` to ``peer_buffer_address`` of segment
        ``target_hostname`` (``host:port``) and waits. Returns 0, or -1 on failure or after
        MC_TRANSFER_TIMEOUT (30 s) plus 1 s per GB."""
        return self._sync("transfer_sync_write", "write", target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        """Reads ``length`` bytes at ``peer_buffer_address`` of ``target_hostname`` into local
        ``buffer`` and waits. Returns 0 or -1."""
        return self._sync("transfer_sync_read", "read", target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int:
        """Writes every ``buffers[i]`` to ``peer_buffer_addresses[i]`` (``lengths[i]`` bytes) as
        one batch and waits. Returns 0, or -1 (lists of different lengths, unregistered
        memory, unreachable peer, failure, timeout)."""
        return self._sync("batch_transfer_sync_write", "write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int:
        """Reads every ``peer_buffer_addresses[i]`` into ``buffers[i]`` as one batch and waits.
        Returns 0 or -1."""
        return self._sync("batch_transfer_sync_read", "read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode: int, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """``transfer_sync_read`` or ``transfer_sync_write`` by ``opcode``
        (:class:`TransferOpcode`). With ``notify``, ``notify.msg`` reaches the target's
        ``get_notifies()`` after the data is in place."""
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """``batch_transfer_sync_read`` or ``_write`` by ``opcode``. With ``notify``,
        ``notify.msg`` reaches the target's ``get_notifies()`` once every byte is in place
        (the receiver sees the sender's session id as ``name``)."""
        op = _opcode(opcode)
        if op is None:
            log.error("batch_transfer_sync: unknown opcode %r", opcode)
            return -1
        msg = None
        if notify is not None:
            if not isinstance(notify, TransferNotify):
                log.error("batch_transfer_sync: notify must be a TransferNotify, got %r", notify)
                return -1
            msg = notify.msg
        return self._sync("batch_transfer_sync", op, target_hostname, buffers, peer_buffer_addresses, lengths, msg)

    def _async(self, what: str, opcode: str, target: str, bufs: Sequence[int], peers: Sequence[int], lens: Sequence[int]) -> int:
        return self._call(
            what,
            lambda: self._native().mc_transfer_async(target, opcode, list(bufs), list(peers), list(lens)),
            failure=0,
        )

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts the writes and returns at once: a batch id (> 0) for
        ``get_batch_transfer_status``, or 0 on failure (as Mooncake)."""
        return self._async("batch_transfer_async_write", "write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts the reads and returns at once: a batch id (> 0), or 0 on failure."""
        return self._async("batch_transfer_async_read", "read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int, transport_hint: str = "") -> int:
        """``batch_transfer_async_read`` or ``_write`` by ``opcode``; a batch id or 0."""
        op = _opcode(opcode)
        if op is None:
            log.error("batch_transfer_async: unknown opcode %r", opcode)
            return 0
        return self._async("batch_transfer_async", op, target_hostname, buffers, peer_buffer_addresses, lengths)

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch (MC_TRANSFER_TIMEOUT, 30 s, each at most). Returns 0 when all
        completed, -1 as soon as one failed or timed out (or an id is unknown). Finished
        batches are freed: ask about an id once."""
        if self._engine is None:
            log.error("get_batch_transfer_status: the TransferEngine is not initialized")
            return -1
        native = self._native()
        for bid in list(batch_ids):
            try:
                outcome = native.mc_wait_batch(bid, self._timeout)
            except (Error, TypeError, OverflowError) as e:
                log.error("get_batch_transfer_status: batch %r: %s", bid, e)
                return -1
            if outcome != "completed":
                log.error("get_batch_transfer_status: batch %d %s", bid, "timed out" if outcome == "pending" else "failed")
                return -1
        return 0

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        """Starts one write; returns its batch id for ``transfer_check_status``, or -1."""
        bid = self._async("transfer_submit_write", "write", target_hostname, [buffer], [peer_buffer_address], [length])
        return bid if bid > 0 else -1

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed (batch freed), 0 still running, -1 failed (freed), -2 unknown id."""
        r = self._call("transfer_check_status", lambda: self._native().mc_poll_batch(batch_id), failure=None)
        if r is None:
            return -2
        return {"completed": 1, "pending": 0}.get(r, -1)

    # ---------------------------------------------------------------- helpers

    def _native(self) -> Any:
        if self._engine is None:
            raise Error("the TransferEngine is not initialized: call initialize() first")
        return self._engine._native

    @property
    def engine(self) -> Optional[Engine]:
        """The underlying :class:`multirail.Engine` (None before ``initialize``)."""
        return self._engine

    def traffic_stats(self) -> Dict[str, Dict[str, Any]]:
        """Per-rail counters of the underlying engine (multirail extra)."""
        return self._engine.traffic_stats() if self._engine is not None else {}


def _opcode(opcode: Any) -> Optional[str]:
    try:
        op = TransferOpcode(int(opcode))
    except (ValueError, TypeError):
        return None
    return "read" if op == TransferOpcode.Read else "write"
