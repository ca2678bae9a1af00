"""A peer that stops answering fails a transfer within transports.tcp.timeout_ms (+ 1 s)."""

import hashlib
import os
import signal
import time

import numpy as np
import pytest

import multirail

MIB = 1 << 20
TIMEOUT_MS = 1500


def test_stopped_peer_fails_a_transfer_within_the_timeout(spawn_peer):
    peer = spawn_peer("native", 64 * MIB, "tcp")
    engine = multirail.Engine(
        {"transports": {"tcp": {"timeout_ms": TIMEOUT_MS, "connect_timeout_ms": 1000}}},
        name="127.0.0.1",
        transport="tcp",
    )
    buf = engine.allocate(64 * MIB)
    np.frombuffer(buf, dtype=np.uint8)[:] = 7
    seg = engine.open_segment(peer.name)
    reqs = [
        multirail.Request(multirail.WRITE, buf.addr + i * 4 * MIB, seg, peer.addr + i * 4 * MIB, 4 * MIB)
        for i in range(16)
    ]
    engine.transfer(reqs, timeout=30)  # connections up, as in a running job
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(multirail.TransferTimeoutError) as err:
            engine.transfer(reqs, timeout=30)
        took = time.monotonic() - t0
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert f"within {TIMEOUT_MS} ms" in str(err.value)
    assert took <= TIMEOUT_MS / 1000 + 1.0, f"raised {took:.2f} s after the stop"
    # Back on its feet, the peer takes the same transfer.
    engine.transfer(reqs, timeout=30)
    assert peer.call(op="sha256", off=0, len=64 * MIB)["sha256"] == hashlib.sha256(bytes(buf)).hexdigest()
