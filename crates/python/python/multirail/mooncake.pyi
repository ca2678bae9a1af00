"""Type stubs of multirail.mooncake: a drop-in for mooncake.engine.TransferEngine.

Return conventions are Mooncake's: 0 on success, -1 on failure (logged on the
"multirail.mooncake" logger); batch ids / addresses are 0 on failure."""

import enum
from typing import Any, Dict, List, Optional, Sequence

from . import Engine

P2PHANDSHAKE: str

class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1

Read: TransferOpcode
Write: TransferOpcode

class TransferNotify:
    """A notification: name (the sender's session id on receipt) and msg."""

    name: str
    msg: str
    def __init__(self, name: str = "", msg: str = "") -> None: ...

class TransferEngine:
    """Mooncake-compatible transfer engine; call initialize() first."""

    def __init__(self) -> None: ...
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """metadata_server must be "P2PHANDSHAKE"; protocol "tcp" or "rdma". 0 or -1."""
    def get_rpc_port(self) -> int:
        """Port of the session id host:port; -1 before initialize."""
    def get_session_id(self) -> str:
        """host:port (multirail extra)."""
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int: ...
    def unregister_memory(self, buffer_addr: int) -> int: ...
    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*") -> int:
        """All or nothing. 0 or -1."""
    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int: ...
    def allocate_managed_buffer(self, length: int) -> int:
        """Address, 0 on failure."""
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """Raises multirail.SourceNotRegisteredError outside registered memory."""
    def get_first_buffer_address(self, segment_name: str) -> int:
        """Address, 0 on failure."""
    def get_notifies(self) -> List[TransferNotify]:
        """Notifications received since the last call."""
    def send_notify(self, target_hostname: str, notify: TransferNotify) -> int: ...
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "") -> int: ...
    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "") -> int: ...
    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int: ...
    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int: ...
    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode: int, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int: ...
    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int: ...
    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int:
        """Batch id (> 0), 0 on failure."""
    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], transport_hint: str = "") -> int:
        """Batch id (> 0), 0 on failure."""
    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode: int, transport_hint: str = "") -> int: ...
    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits; 0 when all completed, -1 on a failure, timeout or unknown id."""
    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "") -> int:
        """Batch id, -1 on failure."""
    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 running, -1 failed, -2 unknown."""
    @property
    def engine(self) -> Optional[Engine]: ...
    def traffic_stats(self) -> Dict[str, Dict[str, Any]]: ...
