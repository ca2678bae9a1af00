"""multirail.Engine.prepare / PreparedList: transfers checked once and posted by index many
times, over tcp and over shared memory between two engines of this process, every byte checked;
bad indices and entries refused before anything moves."""

import time

import numpy as np
import pytest

import multirail
from conftest import pattern

BLOCKS, BLOCK = 256, 4096


def engines(transport):
    init = multirail.Engine(name="127.0.0.1", transport=transport)
    target = multirail.Engine(name="127.0.0.1", transport=transport)
    return init, target


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_blocks_written_read_back_and_reposted(transport):
    """256 blocks of 4 KiB written to reversed slots and read back, both lists reposted 20
    times with a new pattern each time; "auto" between engines of one host is shared memory."""
    init, target = engines(transport)
    with init, target:
        remote = target.allocate(BLOCKS * BLOCK)
        src = init.allocate(BLOCKS * BLOCK)
        back = init.allocate(BLOCKS * BLOCK)
        seg = init.open_segment(target.name)
        slot = lambda i: remote.addr + (BLOCKS - 1 - i) * BLOCK  # noqa: E731
        writes = init.prepare([(src.addr + i * BLOCK, seg, slot(i), BLOCK) for i in range(BLOCKS)])
        reads = init.prepare([(back.addr + i * BLOCK, seg.id, slot(i), BLOCK) for i in range(BLOCKS)])
        assert len(writes) == len(reads) == BLOCKS
        s = np.frombuffer(src, dtype=np.uint8)
        r = np.frombuffer(remote, dtype=np.uint8).reshape(BLOCKS, BLOCK)
        b = np.frombuffer(back, dtype=np.uint8)
        for round_ in range(20):
            s[:] = pattern(round_, BLOCKS * BLOCK)
            b[:] = 0
            batch = writes.post(multirail.WRITE)
            batch.wait(30)
            assert len(batch) == BLOCKS and batch.status() == multirail.Status.COMPLETED
            assert np.array_equal(r[::-1].reshape(-1), s), f"round {round_}: blocks not in their slots"
            reads.post(multirail.READ, priority=multirail.PRIO_LOW).wait(30)
            assert np.array_equal(b, s), f"round {round_}: read back differs"
        rails = init.traffic_stats()
        if transport == "auto":
            assert rails.get("shm", {}).get("bytes", 0) >= 40 * BLOCKS * BLOCK, rails
        else:
            assert "shm" not in rails or rails["shm"]["bytes"] == 0, rails
        writes.free()
        reads.free()


def test_indices_pick_entries_in_order_and_bad_ones_raise():
    init, target = engines("tcp")
    with init, target:
        remote = target.allocate(4 * BLOCK)
        src = init.allocate(4 * BLOCK)
        seg = init.open_segment(target.name)
        s = np.frombuffer(src, dtype=np.uint8).reshape(4, BLOCK)
        for i in range(4):
            s[i] = i + 1
        with init.prepare([(src.addr + i * BLOCK, seg, remote.addr + i * BLOCK, BLOCK) for i in range(4)], transport="tcp") as lst:
            batch = lst.post(multirail.WRITE, indices=np.array([3, 1, 1], dtype=np.int32))
            batch.wait(10)
            assert len(batch) == 3
            landed = np.frombuffer(remote, dtype=np.uint8).reshape(4, BLOCK)
            assert (landed[0] == 0).all() and (landed[2] == 0).all(), "entries 0 and 2 were not posted"
            assert (landed[1] == 2).all() and (landed[3] == 4).all()
            for bad in ([4], [-1], [0, 99], []):
                with pytest.raises(multirail.InvalidArgumentError):
                    lst.post(multirail.WRITE, indices=bad)
            with pytest.raises(multirail.InvalidArgumentError):
                lst.post("copy")
            with pytest.raises(multirail.InvalidArgumentError):
                lst.post(multirail.WRITE, priority=7)
            with pytest.raises(TypeError):
                lst.post(multirail.WRITE, indices=[1.5])
        # The with block freed the list.
        with pytest.raises(multirail.InvalidArgumentError):
            lst.post(multirail.WRITE)
        with pytest.raises(multirail.InvalidArgumentError):
            lst.free()


def test_bad_entries_are_refused_keeping_nothing():
    init, target = engines("tcp")
    with init, target:
        remote = target.allocate(BLOCK)
        src = init.allocate(BLOCK)
        seg = init.open_segment(target.name)
        with pytest.raises(multirail.InvalidArgumentError):
            init.prepare([])
        with pytest.raises(multirail.SourceNotRegisteredError):
            init.prepare([(src.addr, seg, remote.addr, BLOCK), (src.addr + BLOCK, seg, remote.addr, BLOCK)])
        with pytest.raises(multirail.TargetOutOfRangeError):
            init.prepare([(src, seg, remote.addr + 1, BLOCK)])
        with pytest.raises(multirail.InvalidArgumentError):
            init.prepare([(src, seg, remote.addr, 0)])
        with pytest.raises(multirail.UnknownSegmentError):
            init.prepare([(src, 12345, remote.addr, BLOCK)])
        with pytest.raises(multirail.InvalidArgumentError):
            init.prepare([(src, seg, remote.addr, BLOCK)], transport="carrier-pigeon")
        with pytest.raises(ValueError):
            init.prepare([(src, seg, remote.addr)])
        # A source unregistered after prepare is refused at post.
        mem = np.zeros(BLOCK, dtype=np.uint8)
        reg = init.register(mem)
        lst = init.prepare([(reg, seg, remote.addr, BLOCK)])
        lst.post(multirail.WRITE).wait(10)
        init.unregister(reg)
        with pytest.raises(multirail.SourceNotRegisteredError):
            lst.post(multirail.WRITE)


def test_a_notification_posted_with_a_list_arrives_after_its_data():
    init, target = engines("tcp")
    with init, target:
        remote = target.allocate(BLOCKS * BLOCK)
        src = init.allocate(BLOCKS * BLOCK)
        seg = init.open_segment(target.name)
        lst = init.prepare([(src.addr + i * BLOCK, seg, remote.addr + i * BLOCK, BLOCK) for i in range(BLOCKS)])
        np.frombuffer(src, dtype=np.uint8)[:] = pattern(5, BLOCKS * BLOCK)
        lst.post(multirail.WRITE, notify="blocks-ready")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = target.notifications()
            if got:
                # Checked at once: the data must already be there.
                assert np.array_equal(np.frombuffer(remote, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
                assert got == [(init.name, "blocks-ready")]
                break
            time.sleep(0.001)
        else:
            pytest.fail("the notification never came")
