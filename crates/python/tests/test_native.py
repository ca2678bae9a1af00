"""The Pythonic API between two Python processes, bytes checked with NumPy, and its errors."""

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import multirail
from conftest import HERE, RAILS, pattern

MIB = 1 << 20


@pytest.fixture
def engine():
    e = multirail.Engine(name="127.0.0.1")
    yield e
    e.close()


def test_buffer_protocol_exposes_engine_memory(engine):
    buf = engine.allocate(MIB)
    assert isinstance(buf, multirail.Buffer) and len(buf) == buf.size == MIB
    mv = memoryview(buf)
    assert (mv.format, mv.shape, mv.readonly, mv.nbytes) == ("B", (MIB,), False, MIB)
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert not arr.any(), "allocated memory starts zeroed"
    arr[:4] = [1, 2, 3, 4]
    assert bytes(mv[:4]) == b"\x01\x02\x03\x04"
    assert np.frombuffer(buf, dtype=np.uint32).size == MIB // 4
    # A view keeps the memory alive after the Buffer and the registration are gone.
    engine.unregister(buf)
    del buf
    gc.collect()
    mv[5] = 9
    assert arr[5] == 9


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_write_and_read_between_processes(spawn_peer, transport):
    peer = spawn_peer("native", 8 * MIB, transport)
    with multirail.Engine(name="127.0.0.1", transport=transport) as engine:
        src = engine.allocate(8 * MIB)
        local = np.frombuffer(src, dtype=np.uint8)
        local[:] = pattern(1, 8 * MIB)
        seg = engine.open_segment(peer.name)
        assert seg.buffers == [(peer.addr, 8 * MIB)] and seg.first_buffer_address() == peer.addr

        # Write: this process -> peer, in 8 requests of 1 MiB at shuffled offsets.
        order = [3, 0, 7, 1, 6, 2, 5, 4]
        reqs = [multirail.Request(multirail.WRITE, src.addr + i * MIB, seg, peer.addr + i * MIB, MIB) for i in order]
        batch = engine.submit(reqs)
        batch.wait(timeout=30)
        assert batch.status() is multirail.Status.COMPLETED
        assert all(batch.status(i) is multirail.Status.COMPLETED for i in range(len(batch)))
        assert batch.error() is None
        assert peer.call(op="verify", off=0, len=8 * MIB, seed=1)["ok"]

        # Read: peer -> this process, into a registered NumPy array.
        assert peer.call(op="fill", off=MIB, len=3 * MIB, seed=2)["ok"]
        dst = np.zeros(3 * MIB, dtype=np.uint8)
        reg = engine.register(dst)
        assert reg.addr == dst.ctypes.data and reg.size == 3 * MIB
        engine.transfer(multirail.Request(multirail.READ, reg, seg, peer.addr + MIB, 3 * MIB, multirail.PRIO_LOW))
        assert np.array_equal(dst, pattern(2, 3 * MIB))

        stats = engine.traffic_stats()
        rail = "shm" if transport == "auto" else "lo"
        assert stats[rail]["bytes"] >= 11 * MIB and stats[rail]["errors"] == 0
        # The writes went at the default priority (HIGH), the read at LOW.
        by_priority = stats[rail]["priority_bytes"]
        assert by_priority["high"] >= 8 * MIB and by_priority["low"] >= 3 * MIB, by_priority
        qos = engine.qos_stats()
        assert qos["priorities"]["high"]["dequeued"] >= 8 and qos["priorities"]["low"]["dequeued"] >= 1, qos
        assert qos["priorities"]["low"]["queued"] == 0 and qos["global_slot"] is None


def test_peer_initiates_both_ways(spawn_peer):
    """The other process writes into and reads from this one's memory."""
    peer = spawn_peer("native", 2 * MIB, "tcp")
    with multirail.Engine(name="127.0.0.1") as engine:
        buf = engine.allocate(2 * MIB)
        arr = np.frombuffer(buf, dtype=np.uint8)
        assert peer.call(op="fill", off=0, len=2 * MIB, seed=3)["ok"]
        assert peer.call(op="write_to", name=engine.name, remote=buf.addr, off=0, len=2 * MIB)["rc"] == 0
        assert np.array_equal(arr, pattern(3, 2 * MIB))
        arr[:] = pattern(4, 2 * MIB)
        assert peer.call(op="read_from", name=engine.name, remote=buf.addr, off=0, len=2 * MIB)["rc"] == 0
        assert peer.call(op="verify", off=0, len=2 * MIB, seed=4)["ok"]


def test_register_address_bytearray_and_partial_length(engine, spawn_peer):
    peer = spawn_peer("native", MIB, "tcp")
    seg = engine.open_segment(peer.name)
    ba = bytearray(pattern(5, 4096).tobytes())
    reg = engine.register(ba, 4000)
    assert reg.size == 4000
    engine.transfer([multirail.Request("write", reg, seg, peer.addr, 4000)])
    assert peer.call(op="verify", off=0, len=4000, seed=5)["ok"]
    engine.unregister(reg)
    arr = np.zeros(MIB, dtype=np.uint8)
    reg2 = engine.register(arr.ctypes.data, MIB)
    engine.transfer([multirail.Request("read", reg2.addr, seg.id, peer.addr, 4000)])
    assert np.array_equal(arr[:4000], pattern(5, 4000))
    engine.unregister(reg2.addr)


def test_gil_released_while_waiting(engine, spawn_peer):
    """Another Python thread runs while the main thread waits for a 256 MiB transfer."""
    peer = spawn_peer("native", 256 * MIB, "tcp")
    seg = engine.open_segment(peer.name)
    src = engine.allocate(256 * MIB)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.0005)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.01)
        batch = engine.submit(multirail.Request(multirail.WRITE, src, seg, peer.addr, 256 * MIB, transport="tcp"))
        t0 = time.monotonic()
        batch.wait(60)
        t1 = time.monotonic()
    finally:
        stop.set()
        t.join()
    during = [x for x in ticks if t0 < x < t1]
    assert t1 - t0 < 0.002 or during, "no other thread ran during wait(): the GIL was held"


# ------------------------------------------------------------------------------------ errors


def test_closed_engine_stops_serving(spawn_peer):
    peer = spawn_peer("native", MIB, "tcp")
    a = multirail.Engine(name="127.0.0.1")
    seg = a.open_segment(peer.name)
    src = a.allocate(MIB)
    a.transfer(multirail.Request(multirail.WRITE, src, seg, peer.addr, MIB))
    name = a.name
    a.close()
    a.close()
    with pytest.raises(multirail.Error, match="closed"):
        a.allocate(10)
    # Its names stay readable, for logs and messages about it.
    assert a.name == name and a.segment_name == name
    assert repr(a) == f"<multirail.Engine {name} (closed)>"
    memoryview(src)[0] = 1  # buffers stay usable as memory
    with multirail.Engine(name="127.0.0.1") as b:
        with pytest.raises(multirail.SegmentUnreachableError):
            b.open_segment(name)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_close_ends_waits_in_other_threads(transport):
    """close() in one thread ends a recv or notification wait without a timeout in others:
    nothing can arrive any more, and the waits return None and [] instead of blocking (or
    spinning) for good."""
    e = multirail.Engine(name="127.0.0.1", transport=transport)
    got = {}

    def wait(what, call):
        got[what] = call()

    waiters = [
        threading.Thread(target=wait, args=("recv", lambda: e.recv(timeout=None)), daemon=True),
        threading.Thread(target=wait, args=("notifications", lambda: e.notifications(timeout=None)), daemon=True),
    ]
    for w in waiters:
        w.start()
    time.sleep(0.3)
    closed = time.monotonic()
    e.close()
    for w in waiters:
        w.join(timeout=5)
    took = time.monotonic() - closed
    assert got == {"recv": None, "notifications": []}, got
    assert took < 2, f"the waits ended {took:.2f} s after close()"


def test_every_error_is_a_multirail_error():
    names = [n for n in multirail.__all__ if n.endswith("Error")]
    assert len(names) == 22
    for n in names:
        assert issubclass(getattr(multirail, n), multirail.Error)
    assert issubclass(multirail.Error, Exception)


def test_config_errors():
    with pytest.raises(multirail.ConfigError, match="bogus"):
        multirail.Engine(config={"bogus": 1})
    with pytest.raises(multirail.ConfigError, match="transports.rdma.bandwidth_learning_rate"):
        multirail.Engine(config={"transports": {"rdma": {"bandwidth_learning_rate": 1.5}}})
    with pytest.raises(multirail.ConfigError, match="cannot read"):
        multirail.Engine(config="/nonexistent/multirail.json")
    with pytest.raises(multirail.ConfigError):
        multirail.Engine(config='{"transport": "carrier-pigeon"}')
    with pytest.raises(TypeError):
        multirail.Engine(config=42)


def test_config_file_and_inline(tmp_path):
    path = tmp_path / "mr.json"
    path.write_text('{"transport": "tcp", "workers": {"block_size": 65536}}')
    with multirail.Engine(config=path, name="127.0.0.1") as e:
        assert e.config["transport"] == "tcp" and e.config["workers"]["block_size"] == 65536
    with multirail.Engine(config={"transport": "shm"}, name="127.0.0.1") as e:
        assert e.config["transport"] == "shm"


def test_name_errors_and_mapping():
    with pytest.raises(multirail.InvalidArgumentError, match="port"):
        multirail.Engine(name="127.0.0.1:99999")
    with pytest.raises(multirail.InvalidArgumentError):
        multirail.Engine(name="")
    with multirail.Engine(name="127.0.0.1") as a:
        host, port = a.name.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        # The port is taken: binding it again fails with the OS's reason.
        with pytest.raises(multirail.Error):
            multirail.Engine(name=a.name)
    # How names map to (listen address, published host), checked without binding 0.0.0.0.
    assert multirail._listen_for(None) == ("0.0.0.0:0", None)
    assert multirail._listen_for("127.0.0.1") == ("127.0.0.1:0", None)
    assert multirail._listen_for("127.0.0.1:4000") == ("127.0.0.1:4000", None)
    assert multirail._listen_for("kv-node-3") == ("0.0.0.0:0", "kv-node-3")
    assert multirail._listen_for("kv-node-3:4000") == ("0.0.0.0:4000", "kv-node-3")
    assert multirail._listen_for("[::1]:4000") == ("[::1]:4000", None)


def test_memory_errors(engine):
    with pytest.raises(multirail.InvalidArgumentError):
        engine.allocate(0)
    with pytest.raises(multirail.AllocationError):
        engine.allocate(1 << 60)
    with pytest.raises(multirail.InvalidArgumentError, match="null"):
        engine.register(0, 10)
    with pytest.raises(multirail.InvalidArgumentError, match="length"):
        engine.register(0x1000)
    with pytest.raises(TypeError, match="writable"):
        engine.register(b"read-only bytes")
    with pytest.raises(TypeError):
        engine.register("not memory")
    ba = bytearray(4096)
    engine.register(ba)
    with pytest.raises(multirail.InvalidArgumentError, match="overlaps"):
        engine.register(ba)
    with pytest.raises(multirail.InvalidArgumentError, match="not the start"):
        engine.unregister(12345)
    with pytest.raises(multirail.InvalidArgumentError):
        engine.unregister(-1)


def test_segment_errors(engine):
    with pytest.raises(multirail.SegmentUnreachableError, match="host:port"):
        engine.open_segment("nonsense")
    with pytest.raises(multirail.SegmentUnreachableError, match="refused"):
        engine.open_segment("127.0.0.1:1")
    with pytest.raises(TypeError):
        engine.open_segment(1234)


def test_request_and_submit_errors(engine, spawn_peer):
    peer = spawn_peer("native", MIB, "tcp")
    seg = engine.open_segment(peer.name)
    src = engine.allocate(MIB)
    W = multirail.WRITE
    with pytest.raises(multirail.InvalidArgumentError, match="opcode"):
        multirail.Request("frob", src, seg, peer.addr, 1)
    with pytest.raises(multirail.InvalidArgumentError, match="transport"):
        multirail.Request(W, src, seg, peer.addr, 1, transport="infiniband")
    with pytest.raises(multirail.InvalidArgumentError, match="target_offset"):
        multirail.Request(W, src, seg, -5, 1)
    with pytest.raises(TypeError):
        multirail.Request(W, "src", seg, peer.addr, 1)
    # The request carries a typed priority, so a bad one is refused when the request is made.
    with pytest.raises(multirail.InvalidArgumentError, match="priority"):
        multirail.Request(W, src, seg, peer.addr, 1, priority=7)
    cases = [
        (multirail.Request(W, src, seg, peer.addr, 0), multirail.InvalidArgumentError, "length"),
        (multirail.Request(W, 0x1000, seg, peer.addr, 1), multirail.SourceNotRegisteredError, "registered"),
        (multirail.Request(W, src.addr + MIB - 1, seg, peer.addr, 2), multirail.SourceNotRegisteredError, "registered"),
        (multirail.Request(W, src, seg, peer.addr + MIB, 1), multirail.TargetOutOfRangeError, "outside"),
        (multirail.Request(W, src, 999, peer.addr, 1), multirail.UnknownSegmentError, "999"),
    ]
    for req, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            # A bad request among good ones: nothing starts.
            engine.submit([multirail.Request(W, src, seg, peer.addr, 16), req])
    with pytest.raises(multirail.InvalidArgumentError):
        engine.submit([])
    with pytest.raises(TypeError):
        engine.submit(["not a request"])


def test_batch_errors(engine, spawn_peer):
    peer = spawn_peer("native", 256 * MIB, "tcp")
    seg = engine.open_segment(peer.name)
    src = engine.allocate(256 * MIB)
    batch = engine.submit(multirail.Request(multirail.WRITE, src, seg, peer.addr, 256 * MIB, transport="tcp"))
    with pytest.raises(multirail.WaitTimeoutError, match="in flight"):
        batch.wait(timeout=0)
    with pytest.raises(multirail.BatchBusyError):
        batch.free()
    with pytest.raises(multirail.InvalidArgumentError, match="timeout"):
        batch.wait(timeout=-1)
    batch.wait(timeout=60)
    batch.free()
    with pytest.raises(multirail.UnknownBatchError):
        batch.free()
    with pytest.raises(multirail.UnknownBatchError):
        batch.status()


def test_dead_peer_fails_requests(engine, spawn_peer):
    peer = spawn_peer("native", MIB, "tcp")
    seg = engine.open_segment(peer.name)
    src = engine.allocate(MIB)
    engine.transfer(multirail.Request(multirail.WRITE, src, seg, peer.addr, MIB))
    peer.kill()
    with pytest.raises((multirail.PeerDisconnectedError, multirail.SegmentUnreachableError)) as info:
        engine.transfer(multirail.Request(multirail.WRITE, src, seg, peer.addr, MIB), timeout=30)
    assert str(info.value)


def test_rdma_transport_without_rdma_is_a_clear_error(engine, spawn_peer):
    # On a host without RDMA devices (every test machine but the soft-RoCE VM), asking for the
    # rdma transport names the transport and why, at submit; nothing hangs.
    peer = spawn_peer("native", MIB, "tcp")
    seg = engine.open_segment(peer.name)
    src = engine.allocate(MIB)
    req = multirail.Request(multirail.WRITE, src, seg, peer.addr, 16, transport="rdma")
    try:
        engine.submit(req).wait(timeout=10)
    except multirail.TransportUnavailableError as e:
        assert "rdma" in str(e)
    else:
        pytest.skip("this host has RDMA: the request went through")


def test_lanes_follow_the_traffic():
    """A sender notifying a receiver continuously gets a dedicated lane; lanes() shows it at
    both ends, with the negotiation's counters, and a bad lanes key is a configuration error."""
    conf = {"lanes": {"sample_period": 1, "max_dedicated": 2}}
    with multirail.Engine(name="127.0.0.1", config=conf) as rx, multirail.Engine(name="127.0.0.1", config=conf) as tx:
        seg = tx.open_segment(rx.name)
        got = []
        deadline = time.monotonic() + 20
        i = 0
        while True:
            tx.notify(seg, str(i))
            i += 1
            time.sleep(0.0002)
            got.extend(m for _, m in rx.notifications())
            out = tx.lanes()["outgoing"]
            inc = rx.lanes()["incoming"]
            if out and out[0]["lane"] == "dedicated" and inc and inc[0]["lane"] == "dedicated":
                break
            assert time.monotonic() < deadline, (tx.lanes(), rx.lanes())
        sent = tx.lanes()
        assert sent["dynamic"] and sent["max_dedicated"] == 2
        assert sent["outgoing"][0]["peer"] == rx.name and sent["outgoing"][0]["promotions"] == 1
        assert sent["outgoing"][0]["score"] >= 0.5
        assert sent["requesting"]["accepts_received"] == 1
        received = rx.lanes()
        assert received["incoming"][0]["peer"] == tx.name and received["granting"]["accepts_sent"] == 1
        assert received["receive_bytes"] > 0
        # Every notification arrives once, in order, across the switch.
        deadline = time.monotonic() + 10
        while len(got) < i:
            got.extend(m for _, m in rx.notifications())
            assert time.monotonic() < deadline
        assert got == [str(k) for k in range(i)]
    with pytest.raises(multirail.ConfigError, match="lanes.min_score"):
        multirail.Engine(config={"lanes": {"min_score": 2}})


def test_a_target_sees_what_it_serves_and_the_metadata_store_state():
    size = 1 << 20
    with multirail.Engine(name="127.0.0.1", transport="tcp") as target, multirail.Engine(
        name="127.0.0.1", transport="tcp"
    ) as initiator:
        dst = target.allocate(size)
        src = initiator.allocate(size)
        memoryview(src)[:] = b"\x3c" * size
        seg = initiator.open_segment(target.name)
        initiator.transfer(multirail.Request(multirail.WRITE, src, seg, dst.addr, size), timeout=10)
        initiator.transfer(multirail.Request(multirail.READ, src, seg, dst.addr, size), timeout=10)
        # A write is counted before it is acknowledged; a read once its answer is written to
        # the socket, which the reader can see a moment before the target has counted it.
        deadline = time.monotonic() + 5
        while True:
            served = target.served_stats()
            written = sum(r["write"]["bytes"] for r in served["rails"].values())
            read = sum(r["read"]["bytes"] for r in served["rails"].values())
            if read >= size or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert written == size and read == size, served
        assert sum(p["write"]["bytes"] for p in served["peers"].values()) == size, served
        # The initiator served nothing.
        assert all(r["write"]["bytes"] == 0 for r in initiator.served_stats()["rails"].values())
        meta = target.metadata_stats()
        assert meta["store"] == "not_used" and meta["store_failures_in_a_row"] == 0, meta
        assert initiator.metadata_stats()["lookups"] >= 1


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_messages_arrive_in_order_and_a_waiting_recv_sleeps(transport):
    """Two-sided messages between two engines: every kind of buffer is sent, each arrives once,
    in order with the notifications; a receive with nothing to get ends at its timeout with
    None, having slept rather than spun; a notification wait wakes on a notification sent
    while it sleeps; a message larger than the peer's receive buffers is an error naming it."""
    with multirail.Engine(name="127.0.0.1", transport=transport) as rx, multirail.Engine(
        name="127.0.0.1", transport=transport
    ) as tx:
        seg = tx.open_segment(rx.name)
        arr = np.arange(256, dtype=np.uint32)
        sent = [b"first", bytearray(b"second"), memoryview(b"third"), arr, b""]
        for i, data in enumerate(sent):
            tx.send(seg, data)
            tx.notify(seg, f"after {i}")
        for data in sent:
            got = rx.recv(timeout=10)
            assert got is not None
            assert got == (tx.name, bytes(memoryview(data).cast("B")))
        assert rx.notifications(timeout=10) == [(tx.name, f"after {i}") for i in range(len(sent))]

        # Nothing comes: the wait sleeps (a spinning wait would use the whole second).
        cpu, wall = time.thread_time(), time.monotonic()
        assert rx.recv(timeout=1.0) is None
        waited, used = time.monotonic() - wall, time.thread_time() - cpu
        assert waited >= 1.0 and used < 0.3, (waited, used)
        assert rx.notifications() == [] and rx.notifications(timeout=0.05) == []

        def later():
            time.sleep(0.3)
            tx.notify(seg, "woke")

        t = threading.Thread(target=later)
        t.start()
        assert rx.notifications(timeout=10) == [(tx.name, "woke")]
        t.join()

        with pytest.raises(multirail.Error, match=r"\d"):
            tx.send(seg, bytes(64 << 20))
        with pytest.raises(TypeError):
            tx.send(seg, "a str has no buffer")
        with pytest.raises(multirail.InvalidArgumentError, match="timeout"):
            rx.recv(timeout=-1)
        # The engine still works after the refused sends.
        tx.send(seg, b"still here")
        assert rx.recv(timeout=10) == (tx.name, b"still here")


def test_a_write_retried_off_a_lost_rail_never_lands_late(spawn_peer, two_rails):
    # Rail 0 goes down under a write: its slices are retried on rail 1 and the write completes.
    # The connections given up on rail 0 must not deliver their old bytes once it is back,
    # over the newer write of the same range.
    target = spawn_peer("mooncake", 32 << 20, "tcp", host="10.77.0.1", netns=f"{two_rails}a")
    out = subprocess.run(
        ["ip", "netns", "exec", f"{two_rails}b", sys.executable, os.path.join(HERE, "lost_rail_writer.py"),
         target.name, str(target.addr), RAILS, two_rails],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rail0_errors"] > 0, f"rail 0 was never lost under the write: {got}"
    assert got["not_b"] == 0, f"{got['a']} bytes of the older write landed after the newer one: {got}"
