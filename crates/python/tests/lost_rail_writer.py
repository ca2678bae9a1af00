"""The initiator of test_native's lost-rail test, run inside the rails' second namespace:

    python lost_rail_writer.py TARGET REMOTE_ADDR RAILS_SCRIPT PREFIX

Writes 0xAA over 32 MiB of the target while rail 0's link goes down (its slices are retried on
rail 1), writes 0xBB over the same range, brings rail 0 back, waits for what a connection left
on it could still deliver, reads the range back, and prints one JSON line: {"not_b": bytes that
are not 0xBB, "a": bytes that are 0xAA, "rail0_errors": N}.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

import multirail

SIZE = 32 << 20
MIB = 1 << 20


def main() -> None:
    target, remote, rails, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    engine = multirail.Engine(name=None, transport="tcp")
    buf = engine.allocate(SIZE)
    arr = np.frombuffer(buf, dtype=np.uint8)
    seg = engine.open_segment(target)

    def submit_write() -> multirail.Batch:
        return engine.submit(
            [multirail.Request("write", buf.addr + i * MIB, seg, remote + i * MIB, MIB) for i in range(SIZE // MIB)]
        )

    def write() -> None:
        submit_write().wait(60)

    def rail0(action: str) -> None:
        subprocess.run([rails, action, "0", "--prefix", prefix], check=True, capture_output=True)

    # Slow enough that rail 0 is still carrying the write when its link goes down.
    for rail in ("0", "1"):
        subprocess.run([rails, "rate", rail, "200mbit", "--prefix", prefix], check=True, capture_output=True)
    arr[:] = 0xAA
    write()  # both rails connected and measured
    # Under the write: what rail 0's connections hold unsent waits for the link to come back.
    batch = submit_write()
    rail0("down")
    try:
        batch.wait(60)
        arr[:] = 0xBB
        write()
    finally:
        rail0("restore")
    # A connection left on rail 0 retransmits what it held on its next timer, within seconds
    # of a link that was down for less than one.
    time.sleep(6)
    arr[:] = 0
    engine.submit([multirail.Request("read", buf.addr, seg, remote, SIZE)]).wait(60)
    print(json.dumps({
        "not_b": int(np.count_nonzero(arr != 0xBB)),
        "a": int(np.count_nonzero(arr == 0xAA)),
        "rail0_errors": engine.traffic_stats()[f"{prefix}b0"]["errors"],
    }), flush=True)


if __name__ == "__main__":
    main()
