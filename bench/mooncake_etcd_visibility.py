#!/usr/bin/env python3
"""The peer's figure for bench/etcd: Mooncake's Python TransferEngine (its PyPI wheel) with etcd
as metadata store. N times, an engine named mc-vis-<pid>-<i> starts (initialize) and registers
4 KiB while an observer engine, started first, keeps asking for the segment's first buffer
address; one sample is the time from the start of initialize to the observer's first answer
naming the buffer, looked for every 0.5 ms in the same thread after registration returns (what
multirail's metadata_visibility measures, with Mooncake's calls). Mooncake's binding cannot
close an engine, so every started engine stays up until the end.

Usage: mooncake_etcd_visibility.py HOST:PORT N   (prints one JSON object)
"""
import ctypes
import json
import os
import sys
import time

from mooncake.engine import TransferEngine

etcd, n = sys.argv[1], int(sys.argv[2])
observer = TransferEngine()
if observer.initialize("mc-observer", etcd, "tcp", "") != 0:
    print(json.dumps({"error": "the observer engine does not start"}))
    sys.exit(1)
samples, alive = [], []
for i in range(n):
    name = f"mc-vis-{os.getpid()}-{i}"
    buf = ctypes.create_string_buffer(4096)
    t0 = time.perf_counter()
    engine = TransferEngine()
    if engine.initialize(name, etcd, "tcp", "") != 0 or engine.register_memory(ctypes.addressof(buf), 4096) != 0:
        print(json.dumps({"error": f"engine {i} does not start or register"}))
        sys.exit(1)
    deadline = t0 + 30
    while observer.get_first_buffer_address(name) != ctypes.addressof(buf):
        if time.perf_counter() > deadline:
            print(json.dumps({"error": f"{name} not visible within 30 s"}))
            sys.exit(1)
        time.sleep(0.0005)
    samples.append((time.perf_counter() - t0) * 1e3)
    alive.append((engine, buf))
samples.sort()
rank = lambda p: samples[min(len(samples), max(1, -(-len(samples) * p // 100))) - 1]
print(json.dumps({"starts": n, "p50_ms": rank(50), "p99_ms": rank(99), "max_ms": samples[-1]}))
