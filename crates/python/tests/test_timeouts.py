"""A peer that stops answering (SIGSTOP) fails a transfer within transports.tcp.timeout_ms
(+ 1 s), through the native API and through the Mooncake drop-in, and takes transfers again
once it resumes."""

import hashlib
import json
import logging
import os
import signal
import time

import numpy as np
import pytest

import multirail
from multirail.mooncake import TransferEngine

MIB = 1 << 20
TIMEOUT_MS = 1500
CONF = {"transports": {"tcp": {"timeout_ms": TIMEOUT_MS, "connect_timeout_ms": 1000}}}
PIECES, PIECE = 16, 4 * MIB


def test_stopped_peer_fails_a_transfer_within_the_timeout(spawn_peer):
    peer = spawn_peer("native", PIECES * PIECE, "tcp")
    engine = multirail.Engine(CONF, name="127.0.0.1", transport="tcp")
    buf = engine.allocate(PIECES * PIECE)
    np.frombuffer(buf, dtype=np.uint8)[:] = 7
    seg = engine.open_segment(peer.name)
    reqs = [
        multirail.Request(multirail.WRITE, buf.addr + i * PIECE, seg, peer.addr + i * PIECE, PIECE)
        for i in range(PIECES)
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
    print(f"native: raised {took:.3f} s after the stop")
    assert f"within {TIMEOUT_MS} ms" in str(err.value)
    assert took <= TIMEOUT_MS / 1000 + 1.0, f"raised {took:.2f} s after the stop"
    # Back on its feet, the peer takes the same transfer (same bytes as any write it may still
    # apply from before the stop).
    engine.transfer(reqs, timeout=30)
    assert peer.call(op="sha256", off=0, len=PIECES * PIECE)["sha256"] == hashlib.sha256(bytes(buf)).hexdigest()


def test_mooncake_drop_in_fails_a_transfer_within_the_timeout(spawn_peer, monkeypatch, caplog):
    peer = spawn_peer("native", PIECES * PIECE, "tcp")
    monkeypatch.setenv("MULTIRAIL_CONF", json.dumps(CONF))
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = np.full(PIECES * PIECE, 9, dtype=np.uint8)
    base = local.ctypes.data
    assert te.register_memory(base, local.nbytes) == 0
    bufs = [base + i * PIECE for i in range(PIECES)]
    remotes = [peer.addr + i * PIECE for i in range(PIECES)]
    lens = [PIECE] * PIECES
    assert te.batch_transfer_sync_write(peer.name, bufs, remotes, lens) == 0
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="multirail.mooncake"):
            rc = te.batch_transfer_sync_write(peer.name, bufs, remotes, lens)
        took = time.monotonic() - t0
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    print(f"mooncake: returned {rc} {took:.3f} s after the stop")
    assert rc == -1
    assert f"within {TIMEOUT_MS} ms" in caplog.text, caplog.text
    assert took <= TIMEOUT_MS / 1000 + 1.0, f"returned {took:.2f} s after the stop"
    assert te.batch_transfer_sync_write(peer.name, bufs, remotes, lens) == 0
    assert peer.call(op="sha256", off=0, len=local.nbytes)["sha256"] == hashlib.sha256(local.tobytes()).hexdigest()
