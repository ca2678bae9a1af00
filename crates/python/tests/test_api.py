"""The public surface: Mooncake's method names and defaults, stubs and docstrings for every name."""

import inspect
import os

import multirail
import multirail.mooncake as mc

PKG = os.path.dirname(multirail.__file__)

# The methods SGLang's and vLLM's Mooncake connectors call, with Mooncake's parameter names.
MOONCAKE_METHODS = {
    "initialize": ["local_hostname", "metadata_server", "protocol", "device_name"],
    "get_rpc_port": [],
    "register_memory": ["buffer_addr", "capacity", "location"],
    "unregister_memory": ["buffer_addr"],
    "batch_register_memory": ["buffer_addresses", "capacities", "location"],
    "batch_unregister_memory": ["buffer_addresses"],
    "transfer_sync_write": ["target_hostname", "buffer", "peer_buffer_address", "length", "transport_hint"],
    "transfer_sync_read": ["target_hostname", "buffer", "peer_buffer_address", "length", "transport_hint"],
    "batch_transfer_sync_write": ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "transport_hint"],
    "batch_transfer_sync_read": ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "transport_hint"],
    "batch_transfer_async_write": ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "transport_hint"],
    "batch_transfer_async_read": ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "transport_hint"],
    "get_batch_transfer_status": ["batch_ids"],
    "allocate_managed_buffer": ["length"],
    "free_managed_buffer": ["buffer_addr", "length"],
    "write_bytes_to_buffer": ["dest_address", "src_ptr", "length"],
    "read_bytes_from_buffer": ["source_address", "length"],
    "get_first_buffer_address": ["segment_name"],
    "get_notifies": [],
    "transfer_sync": ["target_hostname", "buffer", "peer_buffer_address", "length", "opcode", "notify", "transport_hint"],
    "batch_transfer_sync": ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "opcode", "notify", "transport_hint"],
    "batch_transfer_async": ["target_hostname", "buffers", "peer_buffer_addresses", "lengths", "opcode", "transport_hint"],
    "transfer_submit_write": ["target_hostname", "buffer", "peer_buffer_address", "length", "transport_hint"],
    "transfer_check_status": ["batch_id"],
}


def test_mooncake_method_names_and_arguments():
    for name, params in MOONCAKE_METHODS.items():
        fn = getattr(mc.TransferEngine, name)
        got = list(inspect.signature(fn).parameters)[1:]
        assert got == params, name
        assert fn.__doc__, name


def test_stubs_cover_public_names():
    with open(os.path.join(PKG, "__init__.pyi")) as f:
        stub = f.read()
    for name in multirail.__all__:
        assert f"{name}" in stub, name
    with open(os.path.join(PKG, "mooncake.pyi")) as f:
        mstub = f.read()
    for name in MOONCAKE_METHODS:
        assert f"def {name}(" in mstub, name
    assert os.path.exists(os.path.join(PKG, "py.typed"))


def test_docstrings_everywhere():
    assert multirail.__doc__ and mc.__doc__
    for name in multirail.__all__:
        obj = getattr(multirail, name)
        if inspect.isclass(obj) or callable(obj):
            assert obj.__doc__, name
    for cls in (multirail.Engine, multirail.Batch, multirail.Segment, multirail.Buffer):
        for attr, member in vars(cls).items():
            if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                assert member.__doc__, f"{cls.__name__}.{attr}"
