"""Group multicast from Python (multirail.Engine.join_group): every message to every member
exactly once in per-sender order, one total order, k:N batching and flush, a member killed in
another process, bad settings, and send_into's view of the slot.

Run as a script (``python test_group.py member CONFIG_JSON``), this file is the member process
of the kill test."""

import concurrent.futures as cf
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import multirail

MAX = 10240
POOL = np.random.default_rng(17).integers(0, 256, 3 * MAX, dtype=np.uint8).tobytes()


def size_of(sender: int, i: int) -> int:
    """1..10240 bytes, varying from message to message."""
    return 1 + (i * 997 + sender * 4099) % MAX


def payload(sender: int, i: int, n: int) -> bytes:
    off = (sender * 7919 + i * 131) % (2 * MAX)
    return POOL[off : off + n]


def conf(timeout_ms: int) -> dict:
    return {"transports": {"tcp": {"timeout_ms": timeout_ms}}}


@pytest.fixture
def engines():
    made = []

    def make(n: int, transport: str = "tcp", timeout_ms: int = 5000):
        new = [multirail.Engine(conf(timeout_ms), name="127.0.0.1", transport=transport) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for e in made:
        e.close()


def run_all(jobs):
    """Runs every callable in its own thread; returns their results, raising the first failure."""
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futures = [ex.submit(job) for job in jobs]
        return [f.result() for f in futures]


def join_all(es, name, members=None, **settings):
    """Every engine joins from its own thread, as separate processes would."""
    members = members or [e.segment_name for e in es]
    settings.setdefault("join_timeout_ms", 10000)
    return run_all([lambda e=e: e.join_group(name, members, **settings) for e in es])


def leave_all(groups):
    """leave() is a barrier: every member leaves at once."""
    return run_all([g.leave for g in groups])


PER_SENDER = 2000


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_three_senders_deliver_every_message_once_in_fifo_order(engines, transport):
    es = engines(3, transport)
    members = [e.segment_name for e in es]
    groups = join_all(es, "fifo", max_payload=MAX, window_size=32, transport=transport)
    assert [g.members for g in groups] == [members] * 3 and groups[0].max_payload == MAX

    def send(s, g):
        # Each sender hands its bytes over differently: bytes; send_into; bytearray,
        # memoryview and NumPy arrays.
        for i in range(PER_SENDER):
            data = payload(s, i, size_of(s, i))
            if s == 0:
                index = g.send(data)
            elif s == 1:
                index = g.send_into(len(data), lambda view, d=data: view.__setitem__(slice(None), d))
            else:
                kind = i % 3
                obj = bytearray(data) if kind == 0 else memoryview(data) if kind == 1 else np.frombuffer(data, np.uint8)
                index = g.send(obj)
            assert index == i
        g.flush()

    def receive(r, g):
        expected = [0, 0, 0]
        for _ in range(3 * PER_SENDER):
            got = g.recv(timeout=10)
            assert got is not None, f"member {r}: nothing for 10 s after {expected}"
            sender, index, data = got
            s = members.index(sender)
            assert index == expected[s], f"member {r}: {sender} #{index} after #{expected[s] - 1}"
            assert data == payload(s, index, size_of(s, index)), f"member {r}: bytes of {sender} #{index}"
            expected[s] += 1
        assert g.recv(timeout=0.1) is None, f"member {r}: a message beyond the {3 * PER_SENDER} sent"
        return expected

    t0 = time.monotonic()
    results = run_all(
        [lambda s=s, g=g: send(s, g) for s, g in enumerate(groups)]
        + [lambda r=r, g=g: receive(r, g) for r, g in enumerate(groups)]
    )
    took = time.monotonic() - t0
    assert results[3:] == [[PER_SENDER] * 3] * 3
    stats = leave_all(groups)
    print(f"{transport}: {3 * PER_SENDER} messages to 3 members in {took:.2f} s; stats {stats[0]}")
    for s, st in enumerate(stats):
        assert st["sent"] == PER_SENDER and st["delivered"] == 3 * PER_SENDER, st
        assert st["sent_bytes"] == sum(size_of(s, i) for i in range(PER_SENDER))
    assert all(g.left for g in groups)


def test_ordered_delivery_is_identical_everywhere_with_an_idle_sender(engines):
    es = engines(3, "tcp")
    groups = join_all(es, "ordered", delivery="ordered", transport="tcp")
    n = 1000

    def tagged(s, i):
        return struct.pack("<II", s, i) + payload(s, i, 8 + (i * 37) % 300)

    def send(s, g):
        for i in range(n):
            g.send(tagged(s, i))  # indices may skip: null messages of the order take some

    def receive(g):
        return [g.recv(timeout=10) for _ in range(2 * n)]

    # Members 0 and 1 send; member 2 is a sender that never sends (it sends nulls).
    results = run_all([lambda s=s: send(s, groups[s]) for s in (0, 1)] + [lambda g=g: receive(g) for g in groups])
    sequences = results[2:]
    assert None not in sequences[0], "a member stalled"
    assert sequences[0] == sequences[1] == sequences[2]
    for s in (0, 1):
        mine = [data for sender, _, data in sequences[0] if sender == es[s].segment_name]
        assert mine == [tagged(s, i) for i in range(n)]
    stats = leave_all(groups)
    assert stats[2]["null_records"] > 0 and stats[2]["sent"] == 0, stats[2]


def test_k_batching_holds_a_lone_message_until_the_deadline_and_flush_pushes_at_once(engines):
    es = engines(3, "tcp")
    members = [e.segment_name for e in es]
    deadline_s = 0.4
    groups = join_all(es, "k25", batching="k:25", window_size=64, flush_us=int(deadline_s * 1e6), transport="tcp")
    t0 = time.monotonic()
    assert groups[0].send(b"lone") == 0
    got = groups[1].recv(timeout=5)
    waited = time.monotonic() - t0
    assert got == (members[0], 0, b"lone")
    assert waited >= deadline_s - 0.01, f"a lone message is held until flush_us, came after {waited:.3f} s"
    for g in (groups[0], groups[2]):
        assert g.recv(timeout=5) == (members[0], 0, b"lone")

    # Ten messages (under k) and flush(): there at once, not after flush_us.
    t0 = time.monotonic()
    for i in range(10):
        groups[0].send(payload(0, i, 32))
    groups[0].flush()
    got = [groups[2].recv(timeout=5) for _ in range(10)]
    took = time.monotonic() - t0
    assert got == [(members[0], i + 1, payload(0, i, 32)) for i in range(10)]
    assert took < deadline_s / 2, f"flush delivered in {took:.3f} s"
    stats = leave_all(groups)
    assert stats[0]["sent"] == 11 and stats[1]["delivered"] == 11, stats


def _member_process() -> None:
    """The member of the kill test: joins, sends one message, then receives until killed."""
    engine = multirail.Engine(json.loads(sys.argv[2]), name="127.0.0.1", transport="tcp")
    print(json.dumps({"name": engine.segment_name}), flush=True)
    members = json.loads(sys.stdin.readline())
    group = engine.join_group("dies", members, transport="tcp", join_timeout_ms=10000)
    group.send(b"from the child")
    print(json.dumps({"joined": True}), flush=True)
    while True:
        group.recv(timeout=1)


def test_a_killed_member_fails_recv_send_and_leave_at_the_survivors(engines):
    timeout_ms = 1000
    es = engines(2, "tcp", timeout_ms)
    env = dict(os.environ)
    env.pop("MULTIRAIL_CONF", None)
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "member", json.dumps(conf(timeout_ms))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        hello = child.stdout.readline()
        assert hello, f"the member process exited with {child.wait()}"
        dead = json.loads(hello)["name"]
        members = [es[0].segment_name, es[1].segment_name, dead]
        child.stdin.write(json.dumps(members) + "\n")
        child.stdin.flush()
        groups = join_all(es, "dies", members=members, transport="tcp")
        assert json.loads(child.stdout.readline()) == {"joined": True}
        groups[0].send(b"before")
        for g in groups:
            got = {g.recv(timeout=5), g.recv(timeout=5)}
            assert got == {(dead, 0, b"from the child"), (members[0], 0, b"before")}

        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        child.wait()
        with pytest.raises(multirail.GroupMemberFailedError) as err:
            groups[0].recv(timeout=10)
        took = time.monotonic() - t0
        print(f"recv raised {took:.3f} s after the kill: {err.value}")
        assert took <= timeout_ms / 1000 + 2.0
        assert err.value.member == dead and err.value.group == "dies" and dead in str(err.value)
        assert isinstance(err.value, multirail.GroupError) and isinstance(err.value, multirail.Error)
        with pytest.raises(multirail.GroupMemberFailedError, match=dead):
            groups[0].send(b"after")
        # The other survivor sees it too, whichever of send and flush comes first.
        with pytest.raises(multirail.GroupMemberFailedError, match=dead):
            groups[1].send(b"after")
            groups[1].flush()
        t0 = time.monotonic()
        with pytest.raises(multirail.GroupMemberFailedError, match=dead):
            groups[0].leave()
        assert time.monotonic() - t0 <= timeout_ms / 1000 + 2.0
        assert groups[0].left
        with pytest.raises(multirail.GroupError, match="group dies was left"):
            groups[0].recv(timeout=0)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_bad_settings_are_refused_naming_the_setting(engines):
    es = engines(2, "tcp")
    members = [e.segment_name for e in es]
    e = es[0]
    for settings, key in [
        ({"delivery": "bogus"}, "delivery"),
        ({"delivery": "sideways"}, "delivery"),
        ({"window_size": -1}, "window_size"),
        ({"window_size": 0}, "window_size"),
        ({"max_payload": 0}, "max_payload"),
        ({"max_payload": 1 << 40}, "max_payload"),
        ({"batching": "k:17"}, "batching"),  # k above the window (16)
        ({"batching": "sometimes"}, "batching"),
        ({"batching": "k:4", "flush_us": 0}, "flush_us"),
        ({"flush_us": -5}, "flush_us"),
        ({"senders": ["nobody:1"]}, "senders"),
        ({"senders": []}, "senders"),
        ({"transport": "pigeon"}, "transport"),
        ({"join_timeout_ms": 0}, "join_timeout_ms"),
    ]:
        with pytest.raises(multirail.InvalidArgumentError, match=f"`{key}`"):
            e.join_group("bad", members, **settings)
    with pytest.raises(multirail.InvalidArgumentError, match="`members`"):
        e.join_group("bad", [members[0]])
    with pytest.raises(TypeError):
        e.join_group("bad", ",".join(members))
    with pytest.raises(TypeError):
        e.join_group("bad", members, window_size="16")
    with pytest.raises(multirail.GroupJoinError, match="not among the members"):
        e.join_group("bad", ["a:1", "b:2"])

    # Members that disagree on window_size: refused, naming it and both values.
    def join(i, e):
        try:
            e.join_group("w", members, window_size=16 if i == 0 else 32, join_timeout_ms=1500)
        except multirail.GroupJoinError as err:
            return str(err)
        return None

    errors = run_all([lambda i=i, e=e: join(i, e) for i, e in enumerate(es)])
    assert all(errors), errors
    assert any("different window_size" in m for m in errors), errors

    # A message over max_payload, and a member that is not a sender; `with` leaves.
    def member(i, e):
        with e.join_group("sz", members, senders=[members[0]], max_payload=100, join_timeout_ms=10000) as g:
            if i == 0:
                with pytest.raises(multirail.GroupError, match=r"max_payload \(100 bytes\)"):
                    g.send(bytes(101))
                called = []
                with pytest.raises(multirail.GroupError, match="max_payload"):
                    g.send_into(101, called.append)
                assert not called, "fill is not called for a refused message"
                assert g.send(bytes(range(100))) == 0
            else:
                with pytest.raises(multirail.GroupError, match="not among the group's senders"):
                    g.send(b"hi")
            assert g.recv(timeout=5) == (members[0], 0, bytes(range(100)))
        assert g.left
        for call in (lambda: g.recv(0), lambda: g.send(b"x"), g.flush, g.stats, g.leave):
            with pytest.raises(multirail.GroupError, match="group sz was left"):
                call()

    run_all([lambda i=i, e=e: member(i, e) for i, e in enumerate(es)])


def test_send_into_lends_the_slot_only_during_fill(engines):
    es = engines(2, "shm")
    members = [e.segment_name for e in es]
    groups = join_all(es, "slot", max_payload=4096, transport="shm")
    g = groups[0]

    def fill(view):
        assert isinstance(view, memoryview) and not view.readonly and view.nbytes == 1000
        np.frombuffer(view, np.uint8)[:] = np.arange(1000) % 251  # the array dies before we return

    assert g.send_into(1000, fill) == 0
    expect = (np.arange(1000) % 251).astype(np.uint8).tobytes()
    for h in groups:
        assert h.recv(timeout=5) == (members[0], 0, expect)

    # The view, and views derived from it, are unusable once fill returned.
    kept = []
    g.send_into(8, lambda view: (view.__setitem__(slice(None), b"12345678"), kept.append(view)))
    with pytest.raises(ValueError):
        kept[0][0]
    kept.clear()
    with pytest.raises(BufferError, match="kept a view"):
        g.send_into(8, lambda view: (view.__setitem__(slice(None), b"abcdefgh"), kept.append(view[2:])))
    with pytest.raises(BufferError):
        memoryview(kept[0].obj)  # the slot refuses new views
    kept.clear()

    # fill raising: the exception propagates and nothing is sent.
    def boom(view):
        view[:4] = b"half"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        g.send_into(6, boom)
    # Calls that would deadlock from inside fill are refused.
    with pytest.raises(multirail.GroupError, match="inside send_into's fill"):
        g.send_into(4, lambda view: g.send(b"nested"))
    with pytest.raises(TypeError):
        g.send_into(4, b"not callable")
    with pytest.raises(TypeError):
        g.send("a str is not bytes")
    # What went out: the kept and the escaped views' bytes; the two fills that raised sent
    # nothing (and the nested send never happened). The next message takes index 3.
    assert g.send(b"after") == 3
    sent = [(1, b"12345678"), (2, b"abcdefgh"), (3, b"after")]
    for h in groups:
        assert [h.recv(timeout=5) for _ in sent] == [(members[0], i, d) for i, d in sent]
        assert h.recv(timeout=0.05) is None

    # leave() from another thread ends a recv that waits without a timeout.
    outcome = []

    def wait_forever():
        try:
            groups[1].recv()
        except multirail.GroupError as err:
            outcome.append(str(err))

    waiter = threading.Thread(target=wait_forever)
    waiter.start()
    time.sleep(0.2)
    leave_all(groups)
    waiter.join(timeout=5)
    assert outcome == ["group slot was left"]


if __name__ == "__main__" and sys.argv[1:2] == ["member"]:
    _member_process()
