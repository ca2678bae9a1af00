"""Type stubs of multirail.nixl: a drop-in for NIXL's Python agent API (nixl._api).

Signatures are NIXL 1.5.1's. Peer failures make transfer()/check_xfer_state() return "ERR";
misuse raises multirail.Error subclasses (the nixl* ones below)."""

import enum
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from . import BatchBusyError, Engine, Error, InvalidArgumentError

DEFAULT_COMM_PORT: int
NIXL_INIT_AGENT: str

class nixlInvalidParamError(InvalidArgumentError):
    """Malformed descriptors, bad indices, paired descriptors of different lengths."""

class nixlNotFoundError(Error):
    """An agent not loaded, a released handle, memory not registered."""

class nixlNotPostedError(Error):
    """The state of a handle never posted was asked for."""

class nixlRepostActiveError(BatchBusyError):
    """A handle was posted again while its previous post was in progress."""

class nixlNotSupportedError(Error):
    """GPU memory, NIXL's own metadata exchange, cost estimates."""

class nixl_thread_sync_t(enum.Enum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3

nixl_backend_handle = int

class nixl_agent_config:
    """NIXL's agent configuration; "MULTIRAIL" and "UCX" backends both mean multirail.
    engine_config / engine_name (keyword only) configure the engine underneath."""

    backends: List[str]
    enable_pthread: bool
    enable_listen: bool
    port: int
    capture_telemetry: bool
    num_threads: int
    sync_mode: Optional[nixl_thread_sync_t]
    engine_config: Any
    engine_name: Optional[str]
    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = ...,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: List[str] = ...,
        sync_mode: Optional[nixl_thread_sync_t] = None,
        *,
        engine_config: Any = None,
        engine_name: Optional[str] = None,
    ) -> None: ...

class _DescList:
    mem_type: str
    def __init__(self, mem_type: str, descs: Any = ...) -> None: ...
    def descCount(self) -> int: ...
    def isEmpty(self) -> bool: ...
    def getType(self) -> str: ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Tuple[int, ...]: ...
    def __iter__(self) -> Iterator[Tuple[int, ...]]: ...

class nixlXferDList(_DescList):
    """(addr, len, dev_id) descriptors of one memory type."""

class nixlRegDList(_DescList):
    """(addr, len, dev_id, meta) descriptors of one memory type."""

    metas: List[Any]
    def __init__(self, mem_type: str, descs: Any = ..., metas: Optional[List[Any]] = None) -> None: ...

class nixlXferTelemetry:
    """startTime, postDuration, xferDuration (microseconds), totalBytes, descCount."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int

class nixl_prepped_dlist_handle:
    def release(self) -> None:
        """Frees the prepared list; nixlNotFoundError when the agent no longer knows it."""

class nixl_xfer_handle:
    def release(self) -> None:
        """Frees the transfer (a post in progress finishes on its own)."""

class nixl_agent:
    """A NIXL agent on the multirail engine."""

    name: str
    notifs: Dict[str, List[bytes]]
    backends: Dict[str, int]
    backend_mems: Dict[str, List[str]]
    backend_options: Dict[str, Dict[str, str]]
    plugin_list: List[str]
    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False) -> None: ...
    @property
    def engine(self) -> Engine:
        """The multirail.Engine underneath (multirail extra)."""
    def close(self) -> None:
        """Stops the engine and drops every handle of this agent (multirail extra)."""
    def get_plugin_list(self) -> List[str]: ...
    def get_plugin_mem_types(self, backend: str) -> List[str]: ...
    def get_plugin_params(self, backend: str) -> Dict[str, str]: ...
    def get_backend_mem_types(self, backend: str) -> List[str]: ...
    def get_backend_params(self, backend: str) -> Dict[str, str]: ...
    def create_backend(self, backend: str, initParams: Dict[str, str] = ...) -> None: ...
    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, backends: List[str] = ...) -> nixlRegDList:
        """Registers regions with the engine (all or none); raises nixlInvalidParamError,
        nixlNotSupportedError, multirail.AllocationError, KeyError."""
    def deregister_memory(self, dereg_list: nixlRegDList, backends: List[str] = ...) -> None:
        """Deregisters regions; nixlNotFoundError for one not registered."""
    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> List[Optional[Dict[str, str]]]: ...
    def make_connection(self, remote_agent: str, backends: List[str] = ...) -> None: ...
    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None, backends: List[str] = ...) -> nixl_prepped_dlist_handle:
        """Local ("NIXL_INIT_AGENT") or remote descriptors for make_prepped_xfer; raises
        nixlNotFoundError, nixlInvalidParamError, nixlNotSupportedError, ValueError, KeyError."""
    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> Tuple[int, int, int]: ...
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Union[List[int], np.ndarray],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Union[List[int], np.ndarray],
        notif_msg: bytes = b"",
        backends: List[str] = ...,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """Pairs local_indices[k] with remote_indices[k]; one multirail prepared list."""
    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: List[str] = ...,
    ) -> nixl_xfer_handle: ...
    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Posts the transfer: "DONE", "PROC" or "ERR"; nixlRepostActiveError while in progress."""
    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR"; nixlNotPostedError for a handle never posted."""
    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry: ...
    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str: ...
    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None: ...
    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None: ...
    def prep_mem_view(self, dlist: Any, *, backends: Optional[List[str]] = None) -> int: ...
    def release_mem_view(self, mvh: int) -> None: ...
    def get_new_notifs(self, backends: List[str] = ...) -> Dict[str, List[bytes]]:
        """{agent name: [payload, ...]} received since the last call."""
    def update_notifs(self, backends: List[str] = ...) -> Dict[str, List[bytes]]: ...
    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: List[str] = ..., tag_is_prefix: bool = True) -> bool: ...
    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def get_partial_agent_metadata(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: List[str] = ...) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> str: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def send_local_metadata(self, ip_addr: str = "", port: int = ...) -> None: ...
    def send_partial_agent_metadata(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: List[str] = ..., ip_addr: str = "", port: int = ..., label: str = "") -> None: ...
    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = ..., label: str = "") -> None: ...
    def invalidate_local_metadata(self, ip_addr: str = "", port: int = ...) -> None: ...
    def check_remote_metadata(self, agent: str, descs: Optional[nixlXferDList] = None) -> bool: ...
    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlXferDList: ...
    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlRegDList: ...
    def get_serialized_descs(self, descs: Any) -> bytes: ...
    def deserialize_descs(self, serialized_descs: bytes) -> Any: ...
