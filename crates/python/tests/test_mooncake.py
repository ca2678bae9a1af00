"""multirail.mooncake.TransferEngine, Mooncake's Python API: two processes, NumPy-checked bytes,
and the documented return codes of every failure."""

import hashlib
import http.server
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

import multirail
from multirail.mooncake import TransferEngine, TransferNotify, TransferOpcode
from conftest import pattern

# Loopback servers are never reached through an HTTP proxy the environment may name.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

KIB, MIB = 1 << 10, 1 << 20
PAGE = 64 * KIB


@pytest.fixture
def te():
    t = TransferEngine()
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return t


def session(t):
    return f"127.0.0.1:{t.get_rpc_port()}"


def test_initialize_and_session_id(te):
    port = te.get_rpc_port()
    assert 0 < port < 65536
    assert te.get_session_id() == session(te)
    assert te.engine.config["transport"] == "tcp"
    other = TransferEngine()
    assert other.initialize("127.0.0.1:12345", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    assert other.get_rpc_port() != 12345 or port == 12345  # the port is picked, as in Mooncake
    assert other.engine.config["transport"] == "auto"


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_kv_pages_both_ways(spawn_peer, protocol):
    """Scattered 64 KiB pages written to and read from a peer process, as a KV-cache connector does."""
    peer = spawn_peer("mooncake", 8 * MIB, "tcp" if protocol == "tcp" else "auto")
    t = TransferEngine()
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    local = np.zeros(8 * MIB, dtype=np.uint8)
    base = local.ctypes.data
    assert t.register_memory(base, local.nbytes) == 0
    local[:] = pattern(11, local.nbytes)
    pages = 8 * MIB // PAGE
    src_pages = list(range(pages))
    dst_pages = [(i * 37) % pages for i in src_pages]  # a permutation
    bufs = [base + i * PAGE for i in src_pages]
    peers = [peer.addr + j * PAGE for j in dst_pages]
    lens = [PAGE] * pages
    assert t.batch_transfer_sync_write(peer.name, bufs, peers, lens) == 0
    expected = np.empty_like(local)
    for i, j in zip(src_pages, dst_pages):
        expected[j * PAGE : (j + 1) * PAGE] = local[i * PAGE : (i + 1) * PAGE]
    # The peer holds exactly the permuted pages.
    assert peer.call(op="sha256", off=0, len=8 * MIB)["sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()
    # Read everything back into a second buffer and compare here.
    back = np.zeros(8 * MIB, dtype=np.uint8)
    assert t.register_memory(back.ctypes.data, back.nbytes) == 0
    assert t.batch_transfer_sync_read(peer.name, [back.ctypes.data], [peer.addr], [8 * MIB]) == 0
    assert np.array_equal(back, expected)
    # The peer fills a range; a single read fetches it.
    assert peer.call(op="fill", off=MIB, len=MIB, seed=12)["ok"]
    assert t.transfer_sync_read(peer.name, back.ctypes.data, peer.addr + MIB, MIB) == 0
    assert np.array_equal(back[:MIB], pattern(12, MIB))
    # And a single write lands exactly.
    assert t.transfer_sync_write(peer.name, base, peer.addr + 2 * MIB, MIB) == 0
    assert peer.call(op="verify", off=2 * MIB, len=MIB, seed=13)["ok"] is False
    local[:MIB] = pattern(13, MIB)
    assert t.transfer_sync_write(peer.name, base, peer.addr + 2 * MIB, MIB) == 0
    assert peer.call(op="verify", off=2 * MIB, len=MIB, seed=13)["ok"]
    assert t.unregister_memory(back.ctypes.data) == 0
    assert t.unregister_memory(base) == 0


def test_peer_writes_into_us(spawn_peer, te):
    peer = spawn_peer("mooncake", 2 * MIB, "tcp")
    mem = np.zeros(2 * MIB, dtype=np.uint8)
    assert te.register_memory(mem.ctypes.data, mem.nbytes) == 0
    assert peer.call(op="fill", off=0, len=2 * MIB, seed=21)["ok"]
    assert peer.call(op="write_to", name=session(te), remote=mem.ctypes.data, off=0, len=2 * MIB)["rc"] == 0
    assert np.array_equal(mem, pattern(21, 2 * MIB))
    mem[:] = pattern(22, 2 * MIB)
    assert peer.call(op="read_from", name=session(te), remote=mem.ctypes.data, off=0, len=2 * MIB)["rc"] == 0
    assert peer.call(op="verify", off=0, len=2 * MIB, seed=22)["ok"]


def test_async_batches_and_status(spawn_peer, te):
    peer = spawn_peer("mooncake", 4 * MIB, "tcp")
    mem = np.frombuffer(pattern(31, 4 * MIB).tobytes(), dtype=np.uint8).copy()
    assert te.batch_register_memory([mem.ctypes.data], [mem.nbytes]) == 0
    ids = []
    for k in range(4):
        bid = te.batch_transfer_async_write(
            peer.name, [mem.ctypes.data + k * MIB], [peer.addr + k * MIB], [MIB]
        )
        assert bid > 0
        ids.append(bid)
    assert te.get_batch_transfer_status(ids) == 0
    assert peer.call(op="verify", off=0, len=4 * MIB, seed=31)["ok"]
    mem[:] = 0
    bid = te.batch_transfer_async_read(peer.name, [mem.ctypes.data], [peer.addr], [4 * MIB])
    assert bid > 0 and te.get_batch_transfer_status([bid]) == 0
    assert np.array_equal(mem, pattern(31, 4 * MIB))
    bid = te.batch_transfer_async(peer.name, [mem.ctypes.data], [peer.addr], [MIB], TransferOpcode.Write)
    assert bid > 0 and te.get_batch_transfer_status([bid]) == 0
    bid = te.transfer_submit_write(peer.name, mem.ctypes.data, peer.addr, KIB)
    assert bid > 0
    deadline = time.time() + 10
    while (rc := te.transfer_check_status(bid)) == 0 and time.time() < deadline:
        time.sleep(0.001)
    assert rc == 1
    assert te.transfer_sync(peer.name, mem.ctypes.data, peer.addr, KIB, TransferOpcode.Read) == 0
    assert te.batch_transfer_sync(peer.name, [mem.ctypes.data], [peer.addr], [KIB], TransferOpcode.Write) == 0
    assert te.batch_unregister_memory([mem.ctypes.data]) == 0


def test_managed_buffers_and_byte_copies(spawn_peer, te):
    peer = spawn_peer("mooncake", MIB, "tcp")
    addr = te.allocate_managed_buffer(MIB)
    assert addr != 0
    data = pattern(41, 4096).tobytes()
    assert te.write_bytes_to_buffer(addr + 100, data, len(data)) == 0
    assert te.read_bytes_from_buffer(addr + 100, len(data)) == data
    assert te.transfer_sync_write(peer.name, addr + 100, peer.addr, 4096) == 0
    assert peer.call(op="verify", off=0, len=4096, seed=41)["ok"]
    assert te.get_first_buffer_address(peer.name) == peer.addr
    assert te.get_first_buffer_address(session(te)) == addr  # our own segment too
    assert te.free_managed_buffer(addr, MIB) == 0


def test_notifications_arrive_after_the_data(spawn_peer, te):
    peer = spawn_peer("mooncake", MIB, "tcp")
    mem = np.frombuffer(pattern(51, MIB).tobytes(), dtype=np.uint8).copy()
    assert te.register_memory(mem.ctypes.data, MIB) == 0
    assert te.get_notifies() == []
    rc = te.transfer_sync(peer.name, mem.ctypes.data, peer.addr, MIB, TransferOpcode.Write, TransferNotify("req-7", "kv ready"))
    assert rc == 0
    deadline = time.time() + 10
    got = []
    while not got and time.time() < deadline:
        got = peer.call(op="notifies")["notifies"]
        time.sleep(0.01)
    assert got == [[session(te), "kv ready"]]
    assert peer.call(op="verify", off=0, len=MIB, seed=51)["ok"]


# ------------------------------------------------------------------ HTTP metadata server


class _MooncakeMetadataHandler(http.server.BaseHTTPRequestHandler):
    """Mooncake's HTTP metadata protocol, written here from its description (GET/PUT/DELETE
    /metadata?key=K; 200 with the raw value, 404 "metadata not found"), so the engine is
    checked against a server it shares no code with."""

    store: dict = {}

    def _key(self):
        url = urllib.parse.urlsplit(self.path)
        keys = urllib.parse.parse_qs(url.query).get("key")
        return url.path, (keys[0] if keys else None)

    def _answer(self, code, body):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path, key = self._key()
        if path == "/metadata" and key in self.store:
            self._answer(200, self.store[key])
        else:
            self._answer(404, b"metadata not found")

    def do_PUT(self):
        path, key = self._key()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if path != "/metadata" or not key:
            self._answer(400, b"Missing key parameter")
            return
        self.store[key] = body
        self._answer(200, b"metadata updated")

    def do_DELETE(self):
        path, key = self._key()
        if path == "/metadata" and self.store.pop(key, None) is not None:
            self._answer(200, b"metadata deleted")
        else:
            self._answer(404, b"metadata not found")

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A client that hangs up early (an engine closing) is not a test failure; anything
        # else still is printed.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


@pytest.fixture
def metadata_server():
    _MooncakeMetadataHandler.store = {}
    server = _QuietServer(("127.0.0.1", 0), _MooncakeMetadataHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metadata", _MooncakeMetadataHandler.store
    server.shutdown()
    server.server_close()


def test_engines_find_each_other_through_an_http_metadata_server(metadata_server):
    url, store = metadata_server
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", url, "tcp", "") == 0
    assert b.initialize("127.0.0.1", url, "tcp", "") == 0
    assert f"multirail/{session(a)}" in store and f"multirail/{session(b)}" in store
    # Memory registered after start is published again before the call returns.
    src = np.frombuffer(pattern(7, MIB), dtype=np.uint8).copy()
    dst = np.zeros(MIB, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    assert a.transfer_sync_write(session(b), src.ctypes.data, dst.ctypes.data, MIB) == 0
    assert hashlib.sha256(dst.tobytes()).digest() == hashlib.sha256(src.tobytes()).digest()
    back = np.zeros(MIB, dtype=np.uint8)
    assert a.register_memory(back.ctypes.data, back.nbytes) == 0
    assert a.transfer_sync_read(session(b), back.ctypes.data, dst.ctypes.data, MIB) == 0
    assert np.array_equal(back, src)
    # A closed engine withdraws its descriptor.
    name_b = session(b)
    b.engine.close()
    assert f"multirail/{name_b}" not in store


@pytest.fixture
def mooncake_metadata_server(tmp_path):
    """Mooncake's own HTTP metadata server, from its PyPI wheel in this virtualenv
    (scripts/test-python installs it); yields its URL."""
    server = shutil.which("mooncake_http_metadata_server", path=os.path.dirname(sys.executable))
    assert server, "mooncake_http_metadata_server missing: pip install mooncake-transfer-engine"
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "wb"),
    )
    url = f"http://127.0.0.1:{port}/metadata"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _DIRECT.open(f"{url}?key=probe", timeout=1)
            except urllib.error.HTTPError:
                break  # 404: it answers
            except OSError:
                pass
            else:
                break
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "Mooncake's metadata server did not answer within 30 s"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stored(url, key):
    try:
        with _DIRECT.open(f"{url}?key={urllib.parse.quote(key, safe='')}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_engines_use_mooncakes_own_http_metadata_server(mooncake_metadata_server):
    url = mooncake_metadata_server
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", url, "tcp", "") == 0
    assert b.initialize("127.0.0.1", url, "tcp", "") == 0
    assert _stored(url, f"multirail/{session(b)}") == 200
    src = np.frombuffer(pattern(13, MIB), dtype=np.uint8).copy()
    dst = np.zeros(MIB, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    assert a.transfer_sync_write(session(b), src.ctypes.data, dst.ctypes.data, MIB) == 0
    assert np.array_equal(dst, src)
    name_b = session(b)
    b.engine.close()
    assert _stored(url, f"multirail/{name_b}") == 404, "a closed engine withdraws its key"


def test_an_unreachable_metadata_server_fails_lookups_in_time(caplog):
    caplog.set_level(logging.ERROR, logger="multirail.mooncake")
    t = TransferEngine()
    with pytest.raises(multirail.InvalidArgumentError, match="etcd://HOST:PORT"):
        multirail.Engine(None, "127.0.0.1", metadata="zk://127.0.0.1:2181")
    # A server that is not there: opening a segment fails within the store's timeout.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert t.initialize("127.0.0.1", f"http://127.0.0.1:{port}/metadata", "tcp", "") == 0
    start = time.monotonic()
    assert t.get_first_buffer_address("127.0.0.1:1") == 0
    assert time.monotonic() - start < 10


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    """A real etcd (Debian's etcd-server, which scripts/test installs) on free loopback ports;
    yields its client address ``127.0.0.1:PORT``."""
    binary = shutil.which(os.environ.get("MULTIRAIL_ETCD", "etcd"))
    assert binary, "etcd not found: apt-get install etcd-server (scripts/test does)"
    port, peer = _free_port(), _free_port()
    client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [binary, "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"t={peer_url}", "--logger", "zap", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with _DIRECT.open(f"{client}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            assert proc.poll() is None, "etcd exited before it was healthy"
            assert time.monotonic() < deadline, "etcd not healthy within 30 s"
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_engines_find_each_other_through_etcd(etcd):
    # As Mooncake reads them: a bare host:port is etcd, and so is etcd://.
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", etcd, "tcp", "") == 0
    assert b.initialize("127.0.0.1", f"etcd://{etcd}", "tcp", "") == 0
    src = np.frombuffer(pattern(11, MIB), dtype=np.uint8).copy()
    dst = np.zeros(MIB, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    assert a.transfer_sync_write(session(b), src.ctypes.data, dst.ctypes.data, MIB) == 0
    assert np.array_equal(dst, src)
    back = np.zeros(MIB, dtype=np.uint8)
    assert a.register_memory(back.ctypes.data, back.nbytes) == 0
    assert a.transfer_sync_read(session(b), back.ctypes.data, dst.ctypes.data, MIB) == 0
    assert np.array_equal(back, src)


def test_native_engines_open_each_other_by_segment_name_through_etcd(etcd):
    with multirail.Engine(None, "127.0.0.1", metadata=f"etcd://{etcd}", segment_name="prefill-0") as a, \
            multirail.Engine(None, "127.0.0.1", metadata=etcd) as b:
        assert a.segment_name == "prefill-0" and a.name != "prefill-0"
        assert b.segment_name == b.name
        dst = np.zeros(MIB, dtype=np.uint8)
        a.register(dst.ctypes.data, MIB)
        src = np.frombuffer(pattern(12, MIB), dtype=np.uint8).copy()
        reg = b.register(src.ctypes.data, MIB)
        seg = b.open_segment("prefill-0")
        b.transfer([multirail.Request("write", reg, seg, dst.ctypes.data, MIB)])
        assert np.array_equal(dst, src)


# ------------------------------------------------------------------------------------ errors


def test_initialize_failures(caplog):
    caplog.set_level(logging.ERROR, logger="multirail.mooncake")
    t = TransferEngine()
    assert t.initialize("127.0.0.1", "zk://127.0.0.1:2181", "tcp", "") == -1
    assert "P2PHANDSHAKE" in caplog.text and "etcd" in caplog.text
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    assert t.initialize("", "P2PHANDSHAKE", "tcp", "") == -1
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # already initialized


def test_calls_before_initialize_fail_softly():
    t = TransferEngine()
    assert t.get_rpc_port() == -1
    assert t.register_memory(0x1000, 10) == -1
    assert t.unregister_memory(0x1000) == -1
    assert t.batch_register_memory([0x1000], [10]) == -1
    assert t.batch_unregister_memory([0x1000]) == -1
    assert t.transfer_sync_write("127.0.0.1:1", 0x1000, 0x1000, 10) == -1
    assert t.batch_transfer_sync_read("127.0.0.1:1", [0x1000], [0x1000], [10]) == -1
    assert t.batch_transfer_async_write("127.0.0.1:1", [0x1000], [0x1000], [10]) == 0
    assert t.get_batch_transfer_status([1]) == -1
    assert t.allocate_managed_buffer(10) == 0
    assert t.free_managed_buffer(0x1000, 10) == -1
    assert t.write_bytes_to_buffer(0x1000, b"x", 1) == -1
    assert t.get_first_buffer_address("127.0.0.1:1") == 0
    assert t.get_notifies() == []
    with pytest.raises(multirail.Error, match="initialize"):
        t.read_bytes_from_buffer(0x1000, 1)


def test_memory_failures(te):
    mem = np.zeros(MIB, dtype=np.uint8)
    assert te.register_memory(0, 10) == -1
    assert te.register_memory(mem.ctypes.data, 0) == -1
    assert te.register_memory(mem.ctypes.data, MIB) == 0
    assert te.register_memory(mem.ctypes.data + 10, 10) == -1  # overlap
    assert te.unregister_memory(mem.ctypes.data + 1) == -1
    # batch registration is all or nothing
    other = np.zeros(MIB, dtype=np.uint8)
    assert te.batch_register_memory([other.ctypes.data, mem.ctypes.data], [MIB, MIB]) == -1
    assert te.register_memory(other.ctypes.data, MIB) == 0  # was rolled back
    assert te.batch_register_memory([1, 2], [10]) == -1
    assert te.batch_unregister_memory([other.ctypes.data, 12345]) == -1
    assert te.free_managed_buffer(mem.ctypes.data, MIB) == -1  # not a managed buffer
    assert te.allocate_managed_buffer(0) == 0
    assert te.write_bytes_to_buffer(0x1000, b"abc", 3) == -1  # outside registered memory
    assert te.write_bytes_to_buffer(mem.ctypes.data, b"abc", 4) == -1  # more than given
    with pytest.raises(multirail.SourceNotRegisteredError):
        te.read_bytes_from_buffer(0x1000, 3)
    with pytest.raises(multirail.SourceNotRegisteredError):
        te.read_bytes_from_buffer(mem.ctypes.data + MIB - 1, 2)


def test_transfer_failures(spawn_peer, te):
    peer = spawn_peer("mooncake", MIB, "tcp")
    mem = np.zeros(MIB, dtype=np.uint8)
    a = mem.ctypes.data
    assert te.register_memory(a, MIB) == 0
    assert te.transfer_sync_write("127.0.0.1:1", a, 0x1000, 10) == -1  # unreachable
    assert te.transfer_sync_write("nonsense", a, 0x1000, 10) == -1
    assert te.transfer_sync_write(peer.name, 0x1000, peer.addr, 10) == -1  # local not registered
    assert te.transfer_sync_write(peer.name, a, peer.addr + MIB, 10) == -1  # remote out of range
    assert te.transfer_sync_read(peer.name, a, peer.addr, 0) == -1  # zero length
    assert te.batch_transfer_sync_write(peer.name, [a, a], [peer.addr], [10, 10]) == -1
    assert te.batch_transfer_sync_write(peer.name, [], [], []) == -1
    assert te.batch_transfer_async_read(peer.name, [a], [peer.addr + MIB], [10]) == 0
    assert te.batch_transfer_async_write("127.0.0.1:1", [a], [0], [10]) == 0
    assert te.batch_transfer_sync(peer.name, [a], [peer.addr], [10], 7) == -1  # bad opcode
    assert te.batch_transfer_async(peer.name, [a], [peer.addr], [10], 7) == 0
    assert te.get_batch_transfer_status([987654]) == -1
    assert te.transfer_check_status(987654) == -2
    assert te.transfer_submit_write(peer.name, 0x1000, peer.addr, 10) == -1
    assert te.get_first_buffer_address("127.0.0.1:1") == 0
    # Everything still works afterwards.
    assert te.transfer_sync_write(peer.name, a, peer.addr, MIB) == 0
    # A peer that dies: transfers to it fail with -1, no exception.
    peer.kill()
    assert te.transfer_sync_write(peer.name, a, peer.addr, MIB) == -1


def test_a_host_address_names_the_engine_without_pinning_it_to_one_interface(spawn_peer, two_rails):
    # Mooncake's connectors pass the host's own address as local_hostname; that names the
    # engine, and the transfer is still sprayed over every interface.
    target = spawn_peer("mooncake", 16 * MIB, "tcp", host="10.77.0.1", netns=f"{two_rails}a")
    initiator = spawn_peer("mooncake", 16 * MIB, "tcp", host="10.77.0.2", netns=f"{two_rails}b")
    assert target.name.startswith("10.77.0.1:"), target.name
    initiator.call(op="fill", off=0, len=16 * MIB, seed=33)
    assert initiator.call(op="write_to", name=target.name, remote=target.addr, off=0, len=16 * MIB) == {"rc": 0}
    assert target.call(op="verify", off=0, len=16 * MIB, seed=33) == {"ok": True}
    carried = initiator.call(op="traffic")["traffic"]
    for rail in (f"{two_rails}b0", f"{two_rails}b1"):
        assert carried.get(rail, 0) > 0, f"rail {rail} carried nothing: {carried}"
    assert sum(carried.values()) == 16 * MIB, carried
