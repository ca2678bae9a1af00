"""multirail.nixl, NIXL's Python agent API on multirail: two processes exchanging agent metadata,
1,000 descriptors of 16 KiB (NumPy) written and read back with every byte checked, a
notification that arrives after its data, one prepared handle reposted 100 times, a killed peer
reported as "ERR", teardown, the "UCX" backend name, NIXL's signatures, and misuse raising.

The other process is this file run as a script (``python test_nixl.py peer BACKEND CONFIG``):
a nixl_agent with 1,000 x 16 KiB registered that obeys JSON commands, one per line.
"""

import base64
import inspect
import json
import os
import subprocess
import sys
import time

import numpy as np

N, BLOCK = 1000, 16 << 10
#: Where remote descriptor i lands in the peer's buffer: a permutation (7919 is prime).
PERM = (np.arange(N) * 7919) % N


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def config(tcp_timeout_ms=None):
    conf = {"transport": "tcp"}
    if tcp_timeout_ms is not None:
        conf["transports"] = {"tcp": {"timeout_ms": tcp_timeout_ms}}
    return conf


def blocks(base: int, order=None) -> np.ndarray:
    """Nx3 descriptors of N blocks at ``base`` (block ``order[i]`` as descriptor i)."""
    idx = np.arange(N, dtype=np.uint64) if order is None else np.asarray(order, dtype=np.uint64)
    return np.stack([base + idx * BLOCK, np.full(N, BLOCK, np.uint64), np.zeros(N, np.uint64)], axis=1)


# ------------------------------------------------------------------------- the peer


def _peer_main(backend: str, conf: str) -> None:
    from multirail.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(
        f"peer-{os.getpid()}",
        nixl_agent_config(backends=[backend], engine_config=json.loads(conf), engine_name="127.0.0.1"),
    )
    mem = np.zeros(N * BLOCK, dtype=np.uint8)
    reg = agent.register_memory([(mem.ctypes.data, mem.nbytes, 0, "kv")], "DRAM")
    cache = {}

    def expected(seed: int) -> np.ndarray:
        """What the buffer holds after a write of pattern(seed) through PERM."""
        if seed not in cache:
            exp = np.empty(N * BLOCK, dtype=np.uint8)
            exp.reshape(N, BLOCK)[PERM] = pattern(seed, N * BLOCK).reshape(N, BLOCK)
            cache[seed] = exp
        return cache[seed]

    hello = {"name": agent.name, "addr": mem.ctypes.data, "meta": base64.b64encode(agent.get_agent_metadata()).decode()}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "await":
            # Waits for a notification from `agent` with `payload`; the moment it is seen, the
            # data it follows must be in place: pattern(seed) through PERM, plus `add`.
            want = base64.b64decode(cmd["payload"])
            deadline = time.monotonic() + cmd.get("timeout", 10)
            found, data_ok, got = False, False, {}
            while time.monotonic() < deadline and not found:
                for sender, msgs in agent.get_new_notifs().items():
                    for m in msgs:
                        if sender == cmd["agent"] and m == want and not found:
                            found = True
                            exp = expected(cmd["seed"])
                            data_ok = bool(np.array_equal(mem, exp + np.uint8(cmd.get("add", 0))))
                        else:
                            got.setdefault(sender, []).append(base64.b64encode(m).decode())
                if not found:
                    time.sleep(0.0005)
            out = {"found": found, "data_ok": data_ok, "others": got}
        elif op == "fill":
            mem[:] = expected(cmd["seed"])
            out = {"ok": True}
        elif op == "conns":
            out = agent.engine.connection_stats()
        elif op == "deregister":
            agent.deregister_memory(reg)
            out = {"ok": True}
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "peer":
    _peer_main(sys.argv[2], sys.argv[3])
    sys.exit(0)


# -------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

import multirail  # noqa: E402
from multirail import nixl  # noqa: E402
from multirail.nixl import nixl_agent, nixl_agent_config  # noqa: E402


class Peer:
    """Another process with a nixl_agent serving N x BLOCK bytes."""

    def __init__(self, backend: str, conf: dict) -> None:
        env = dict(os.environ)
        env.pop("MULTIRAIL_CONF", None)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "peer", backend, json.dumps(conf)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"peer exited with {self.proc.wait()} before saying hello")
        info = json.loads(hello)
        self.name, self.addr, self.meta = info["name"], info["addr"], base64.b64decode(info["meta"])

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer died: exit {self.proc.wait()}")
        return json.loads(line)

    def await_notif(self, agent: str, payload: bytes, seed: int, add: int = 0):
        return self.call(op="await", agent=agent, payload=base64.b64encode(payload).decode(), seed=seed, add=add)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=10)
            except (BrokenPipeError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture
def peers():
    started = []

    def spawn(backend="MULTIRAIL", conf=None) -> Peer:
        p = Peer(backend, conf or config())
        started.append(p)
        return p

    yield spawn
    for p in started:
        p.close()


def agent(name, backend="MULTIRAIL", conf=None):
    return nixl_agent(name, nixl_agent_config(backends=[backend], engine_config=conf or config(), engine_name="127.0.0.1"))


def wait_done(a, handle, timeout=30.0) -> str:
    deadline = time.monotonic() + timeout
    state = a.check_xfer_state(handle)
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0002)
        state = a.check_xfer_state(handle)
    return state


class Initiator:
    """This process's side: an agent with a source and a read-back buffer registered, the
    peer loaded, and the three prepared descriptor lists."""

    def __init__(self, peer: Peer, backend="MULTIRAIL", conf=None) -> None:
        self.a = agent("initiator", backend, conf)
        self.src = np.zeros(N * BLOCK, dtype=np.uint8)
        self.back = np.zeros(N * BLOCK, dtype=np.uint8)
        self.reg = self.a.register_memory(
            [(self.src.ctypes.data, self.src.nbytes, 0, ""), (self.back.ctypes.data, self.back.nbytes, 0, "")], "DRAM"
        )
        assert self.a.add_remote_agent(peer.meta) == peer.name
        self.local = self.a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(self.src.ctypes.data), "DRAM")
        self.local_back = self.a.prep_xfer_dlist("", blocks(self.back.ctypes.data), "DRAM")
        self.remote = self.a.prep_xfer_dlist(peer.name, blocks(peer.addr, PERM), "DRAM")
        self.ids = np.arange(N, dtype=np.int32)


@pytest.mark.parametrize("backend", ["MULTIRAIL", "UCX"])
def test_write_then_read_back_with_a_notification_after_the_data(peers, backend):
    """1,000 x 16 KiB written to a peer process through a permutation, a notification whose
    bytes are not UTF-8 seen only once the data is in place, then everything read back."""
    peer = peers(backend)
    me = Initiator(peer, backend)
    a = me.a
    me.src[:] = pattern(1, N * BLOCK)
    tag = b"\x00\xff\xfe write-1 \x80"
    h = a.make_prepped_xfer("WRITE", me.local, me.ids, me.remote, me.ids, notif_msg=tag)
    assert a.transfer(h) in ("PROC", "DONE")
    assert wait_done(a, h) == "DONE"
    assert a.query_xfer_backend(h) == backend
    t = a.get_xfer_telemetry(h)
    assert t.totalBytes == N * BLOCK and 1 <= t.descCount <= N and t.xferDuration > 0 and t.startTime > 0
    got = peer.await_notif(a.name, tag, seed=1)
    assert got == {"found": True, "data_ok": True, "others": {}}
    a.release_xfer_handle(h)

    # Read every block back (the peer's slot PERM[i] into local block i) and compare here.
    r = a.make_prepped_xfer("READ", me.local_back, list(range(N)), me.remote, me.ids)
    with pytest.raises(nixl.nixlNotPostedError):
        a.check_xfer_state(r)
    a.transfer(r)
    assert wait_done(a, r) == "DONE"
    assert np.array_equal(me.back, me.src)
    a.release_xfer_handle(r)
    for d in (me.local, me.local_back, me.remote):
        a.release_dlist_handle(d)
    a.remove_remote_agent(peer.name)
    a.deregister_memory(me.reg)


def test_one_handle_reposted_100_times(peers):
    """The same prepared handle posted 100 times, a new pattern and a new notification each
    time; the peer checks every byte the moment each notification arrives."""
    peer = peers()
    me = Initiator(peer)
    a = me.a
    base = pattern(2, N * BLOCK)
    h = a.make_prepped_xfer("WRITE", me.local, me.ids, me.remote, me.ids, notif_msg=b"never sent")
    start = time.monotonic()
    for k in range(100):
        np.add(base, np.uint8(k), out=me.src)
        assert a.transfer(h, notif_msg=f"round-{k}".encode()) in ("PROC", "DONE")
        assert wait_done(a, h) == "DONE", f"round {k}"
        got = peer.await_notif(a.name, f"round-{k}".encode(), seed=2, add=k)
        assert got == {"found": True, "data_ok": True, "others": {}}, f"round {k}: {got}"
    elapsed = time.monotonic() - start
    print(f"100 posts of {N} x {BLOCK} B, each checked at the peer: {elapsed:.2f} s")
    a.release_xfer_handle(h)


def test_a_killed_peer_is_err_within_the_timeout(peers):
    conf = config(tcp_timeout_ms=1000)
    peer = peers(conf=conf)
    me = Initiator(peer, conf=conf)
    a = me.a
    h = a.make_prepped_xfer("WRITE", me.local, me.ids, me.remote, me.ids)
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    peer.kill()
    start = time.monotonic()
    state = a.transfer(h)
    if state == "PROC":
        state = wait_done(a, h, timeout=10)
    elapsed = time.monotonic() - start
    assert state == "ERR" and elapsed < 3.0, (state, elapsed)
    assert a.check_xfer_state(h) == "ERR"
    with pytest.raises(multirail.Error):
        a.send_notif(peer.name, b"anyone?")
    a.release_xfer_handle(h)


def test_teardown_leaves_no_connection(peers):
    """What vLLM's shutdown does: release handles and lists, remove the remote agent,
    deregister memory; the peer then holds no connection from us."""
    peer = peers()
    me = Initiator(peer)
    a = me.a
    h = a.make_prepped_xfer("WRITE", me.local, me.ids, me.remote, me.ids, notif_msg=b"x")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert peer.await_notif(a.name, b"x", seed=0, add=0)["found"]
    assert peer.call(op="conns")["open"] > 0
    a.release_xfer_handle(h)
    for d in (me.local, me.local_back, me.remote):
        a.release_dlist_handle(d)
    a.remove_remote_agent(peer.name)
    a.deregister_memory(me.reg)
    assert peer.call(op="deregister")["ok"]
    assert _until(lambda: peer.call(op="conns")["open"] == 0, timeout=2.0), peer.call(op="conns")


def test_closing_the_agent_leaves_no_connection(peers):
    peer = peers()
    me = Initiator(peer)
    a = me.a
    h = a.make_prepped_xfer("WRITE", me.local, me.ids, me.remote, me.ids, notif_msg=b"y")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert peer.await_notif(a.name, b"y", seed=0, add=0)["found"]
    assert peer.call(op="conns")["open"] > 0
    a.close()
    assert _until(lambda: peer.call(op="conns")["open"] == 0, timeout=5.0), peer.call(op="conns")


# ----------------------------------------------------------------- in one process


@pytest.fixture
def pair():
    a, b = agent("alpha"), agent("beta ✓")
    yield a, b
    a.close()
    b.close()


def test_metadata_and_notifications_carry_names_and_any_bytes(pair):
    a, b = pair
    assert isinstance(a.get_agent_metadata(), bytes)
    assert a.add_remote_agent(b.get_agent_metadata()) == "beta ✓"
    assert b.add_remote_agent(a.get_agent_metadata()) == "alpha"
    every_byte = bytes(range(256))
    a.send_notif("beta ✓", every_byte)
    a.send_notif("beta ✓", "text works too")
    b.send_notif("alpha", b"")
    deadline = time.monotonic() + 5
    got = {}
    while time.monotonic() < deadline and len(got.get("alpha", [])) < 2:
        for k, v in b.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    assert got == {"alpha": [every_byte, b"text works too"]}
    while not a.check_remote_xfer_done("beta ✓", b"", tag_is_prefix=True) and time.monotonic() < deadline:
        time.sleep(0.001)
    # check_remote_xfer_done consumes one matching notification from update_notifs' map.
    a.send_notif("beta ✓", b"req-7:2")
    b.send_notif("alpha", b"req-7:2")
    assert _until(lambda: a.check_remote_xfer_done("beta ✓", b"req-7"))
    assert not a.check_remote_xfer_done("beta ✓", b"req-7")
    assert _until(lambda: b.check_remote_xfer_done("alpha", b"7:", tag_is_prefix=False))
    with pytest.raises(nixl.nixlNotFoundError):
        a.send_notif("nobody", b"x")
    with pytest.raises(nixl.nixlInvalidParamError):
        a.add_remote_agent(b"not metadata")


def _until(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.001)
    return False


def test_loopback_initialize_xfer_and_descriptor_forms(pair):
    a, _ = pair
    src = pattern(3, 64 << 10)
    dst = np.zeros(64 << 10, dtype=np.uint8)
    reg = a.register_memory([(src.ctypes.data, src.nbytes, 0), (dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    assert len(reg) == 2 and reg.getType() == "DRAM" and reg[0][3] == ""
    # Tuples, an Nx3 array and strided Nx5 runs describe the same 16 blocks of 4 KiB.
    tuples = [(src.ctypes.data + i * 4096, 4096, 0) for i in range(16)]
    local = a.get_xfer_descs(tuples, "DRAM")
    assert local == a.get_xfer_descs(np.array(tuples, dtype=np.uint64), "DRAM") and local.descCount() == 16
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[src.ctypes.data, 4096, 0, 4096, 16]], dtype=np.uint64), "DRAM")
    rh = a.prep_xfer_dlist(a.name, [(dst.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, list(range(16)), rh, list(range(15, -1, -1)))
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert np.array_equal(dst[: 16 * 4096].reshape(16, 4096)[::-1], src[: 16 * 4096].reshape(16, 4096))
    # Contiguous pairs are merged: one descriptor for a straight copy.
    h2 = a.make_prepped_xfer("WRITE", lh, list(range(16)), rh, list(range(16)))
    a.transfer(h2)
    assert wait_done(a, h2) == "DONE" and a.get_xfer_telemetry(h2).descCount == 1
    assert np.array_equal(dst[: 16 * 4096], src[: 16 * 4096])
    # initialize_xfer: the whole second half in one descriptor.
    half = 32 << 10
    x = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([(src.ctypes.data + half, half, 0)], "DRAM"),
        a.get_xfer_descs([(dst.ctypes.data + half, half, 0)], "DRAM"),
        a.name,
        notif_msg=b"half",
    )
    a.transfer(x)
    assert wait_done(a, x) == "DONE"
    assert np.array_equal(dst, src)
    assert _until(lambda: a.check_remote_xfer_done(a.name, b"half"))
    # Descriptor lists pickle.
    assert a.deserialize_descs(a.get_serialized_descs(local)) == local
    for hh in (h, h2, x):
        a.release_xfer_handle(hh)
    a.release_dlist_handle(lh)
    a.release_dlist_handle(rh)
    a.deregister_memory(reg)


def test_misuse_raises(pair):
    a, b = pair
    src = np.zeros(8 << 10, dtype=np.uint8)
    other = np.zeros(8 << 10, dtype=np.uint8)
    reg = a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    peer_mem = np.zeros(8 << 10, dtype=np.uint8)
    b.register_memory(np.array([[peer_mem.ctypes.data, peer_mem.nbytes, 0]]), "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    two = lambda base: [(base, 4096, 0), (base + 4096, 4096, 0)]  # noqa: E731
    # Malformed or unsupported descriptors.
    with pytest.raises(nixl.nixlInvalidParamError):
        a.get_xfer_descs(two(src.ctypes.data))  # no mem_type
    with pytest.raises(nixl.nixlInvalidParamError):
        a.get_xfer_descs(reg)
    with pytest.raises(nixl.nixlInvalidParamError):
        a.get_xfer_descs([(1, 2)], "DRAM")
    with pytest.raises(nixl.nixlInvalidParamError):
        a.get_xfer_descs(np.array([[-1, 2, 0]]), "DRAM")
    with pytest.raises(nixl.nixlInvalidParamError):
        a.get_xfer_descs(two(src.ctypes.data), "HBM")
    with pytest.raises(nixl.nixlNotSupportedError):
        a.prep_xfer_dlist("", two(src.ctypes.data), "VRAM")
    with pytest.raises(ValueError):
        a.prep_xfer_dlist("", np.zeros((1, 5), dtype=np.uint64))
    # Memory that is not registered here, or not the remote agent's.
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", two(other.ctypes.data), "DRAM")
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist(b.name, two(other.ctypes.data), "DRAM")
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist("stranger", two(peer_mem.ctypes.data), "DRAM")
    with pytest.raises(KeyError):
        a.prep_xfer_dlist("", two(src.ctypes.data), "DRAM", backends=["GDS"])
    lh = a.prep_xfer_dlist("", two(src.ctypes.data), "DRAM")
    rh = a.prep_xfer_dlist(b.name, two(peer_mem.ctypes.data), "DRAM")
    short = a.prep_xfer_dlist(b.name, [(peer_mem.ctypes.data, 100, 0)], "DRAM")
    # Bad indices: out of range, negative, counts that differ, none; bad operation; lengths.
    for li, ri in (([0, 2], [0, 1]), ([0, 1], [0, -1]), ([0, 1], [0]), ([], [])):
        with pytest.raises(nixl.nixlInvalidParamError) as e:
            a.make_prepped_xfer("WRITE", lh, li, rh, ri)
        assert isinstance(e.value, multirail.InvalidArgumentError)
    with pytest.raises(nixl.nixlInvalidParamError):
        a.make_prepped_xfer("COPY", lh, [0], rh, [0])
    with pytest.raises(nixl.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", lh, [0], short, [0])
    with pytest.raises(nixl.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", rh, [0], lh, [0])
    h = a.make_prepped_xfer("WRITE", lh, np.array([1, 0], dtype=np.uint32), rh, [0, 1])
    with pytest.raises(nixl.nixlNotPostedError):
        a.check_xfer_state(h)
    a.release_xfer_handle(h)
    a.release_xfer_handle(h)  # released twice: nothing happens, as in NIXL
    with pytest.raises(nixl.nixlNotFoundError):
        a.transfer(h)
    a.release_dlist_handle(lh)
    with pytest.raises(nixl.nixlNotFoundError):
        a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    # A removed agent's lists cannot make transfers; removing twice is harmless.
    a.remove_remote_agent(b.name)
    a.remove_remote_agent(b.name)
    lh = a.prep_xfer_dlist("", two(src.ctypes.data), "DRAM")
    with pytest.raises(nixl.nixlNotFoundError):
        a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    with pytest.raises(nixl.nixlNotFoundError):
        a.deregister_memory(a.get_reg_descs([(other.ctypes.data, other.nbytes, 0, "")], "DRAM"))
    with pytest.raises(nixl.nixlNotSupportedError):
        a.send_local_metadata()
    with pytest.raises(nixl.nixlNotSupportedError):
        a.fetch_remote_metadata(b.name)


def test_backends_and_config():
    a = nixl_agent("cfg", nixl_agent_config(backends=["UCX", "GDS", "MULTIRAIL"], engine_name="127.0.0.1"))
    try:
        assert list(a.backends) == ["UCX", "MULTIRAIL"]  # GDS skipped, as NIXL skips a missing plugin
        assert a.get_plugin_list() == ["MULTIRAIL", "UCX"]
        assert a.get_backend_mem_types("UCX") == ["DRAM"] and a.get_backend_params("MULTIRAIL") == {}
        with pytest.raises(nixl.nixlNotFoundError):
            a.create_backend("GDS")
        assert a.engine.name.startswith("127.0.0.1:")
    finally:
        a.close()
    with pytest.raises(TypeError):
        nixl_agent_config(sync_mode="strict")
    with pytest.raises(multirail.ConfigError):
        nixl_agent("bad", nixl_agent_config(engine_config={"no_such_key": 1}))


#: NIXL 1.5.1's nixl._api signatures of what a connector calls: parameter names and defaults.
NIXL_SIGNATURES = {
    "nixl_agent_config.__init__": "(self, enable_prog_thread=True, enable_listen_thread=False, listen_port=8888, capture_telemetry=False, num_threads=0, backends=['UCX'], sync_mode=None)",
    "nixl_agent.__init__": "(self, agent_name, nixl_conf=None, instantiate_all=False)",
    "get_agent_metadata": "(self)",
    "get_partial_agent_metadata": "(self, descs, inc_conn_info=False, backends=[])",
    "add_remote_agent": "(self, metadata)",
    "remove_remote_agent": "(self, agent)",
    "register_memory": "(self, reg_list, mem_type=None, backends=[])",
    "deregister_memory": "(self, dereg_list, backends=[])",
    "query_memory": "(self, reg_list, backend, mem_type=None)",
    "make_connection": "(self, remote_agent, backends=[])",
    "get_xfer_descs": "(self, descs, mem_type=None)",
    "get_reg_descs": "(self, descs, mem_type=None)",
    "prep_xfer_dlist": "(self, agent_name, xfer_list, mem_type=None, backends=[])",
    "make_prepped_xfer": "(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices, notif_msg=b'', backends=[], skip_desc_merge=False)",
    "initialize_xfer": "(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b'', backends=[])",
    "transfer": "(self, handle, notif_msg=b'')",
    "check_xfer_state": "(self, handle)",
    "get_xfer_telemetry": "(self, handle)",
    "query_xfer_backend": "(self, handle)",
    "release_xfer_handle": "(self, handle)",
    "release_dlist_handle": "(self, handle)",
    "get_new_notifs": "(self, backends=[])",
    "update_notifs": "(self, backends=[])",
    "check_remote_xfer_done": "(self, remote_agent_name, lookup_tag, backends=[], tag_is_prefix=True)",
    "send_notif": "(self, remote_agent_name, notif_msg, backend=None)",
    "get_plugin_list": "(self)",
    "get_backend_mem_types": "(self, backend)",
    "get_backend_params": "(self, backend)",
    "create_backend": "(self, backend, initParams={})",
    "check_remote_metadata": "(self, agent, descs=None)",
    "get_serialized_descs": "(self, descs)",
    "deserialize_descs": "(self, serialized_descs)",
}


def _plain(sig: inspect.Signature, keep_kw_only: bool) -> str:
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in sig.parameters.values()
        if keep_kw_only or p.kind != inspect.Parameter.KEYWORD_ONLY
    ]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_signatures_match_nixl():
    for name, want in NIXL_SIGNATURES.items():
        if name == "nixl_agent_config.__init__":
            fn = nixl_agent_config.__init__
        elif name == "nixl_agent.__init__":
            fn = nixl_agent.__init__
        else:
            fn = getattr(nixl_agent, name)
        # multirail's own keyword-only extras (engine_config, engine_name) come after NIXL's.
        assert _plain(inspect.signature(fn), keep_kw_only=False) == want, name
