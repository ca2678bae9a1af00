"""The other process of the tests: an engine (native API or the Mooncake drop-in) that serves a
buffer and obeys JSON commands, one per line on stdin, answering one JSON line on stdout.

    python peer.py native|mooncake SIZE TRANSPORT [HOST]

HOST (default 127.0.0.1) is the address the engine is named after. First line out: {"name": segment name, "addr": buffer address, "size": SIZE}. Commands:
  {"op": "fill", "off", "len", "seed"}             fill a range with pattern(seed)
  {"op": "verify", "off", "len", "seed"}           -> {"ok": bool}: range equals pattern(seed)
  {"op": "write_to"|"read_from", "name", "remote", "off", "len"}
                                                   this process initiates a transfer -> {"rc": 0|...}
  {"op": "sha256", "off", "len"}                  -> {"sha256": hex digest of the range}
  {"op": "notifies"}                              -> {"notifies": [[name, msg], ...]}
  {"op": "traffic"}                               -> {"traffic": {rail: bytes it carried}}
  {"op": "exit"}
"""

import hashlib
import json
import sys

import numpy as np


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def main() -> None:
    api, size, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
    if api == "native":
        import multirail

        engine = multirail.Engine(name=host, transport=transport)
        stats = engine.traffic_stats
        buf = engine.allocate(size)
        arr = np.frombuffer(buf, dtype=np.uint8)
        name, addr = engine.name, buf.addr
        segments = {}

        def transfer(op, peer, remote, off, length):
            if peer not in segments:
                segments[peer] = engine.open_segment(peer)
            req = multirail.Request(op, buf.addr + off, segments[peer], remote, length)
            try:
                engine.submit([req]).wait(30)
                return 0
            except multirail.Error as e:
                return type(e).__name__

    else:
        from multirail.mooncake import TransferEngine

        te = TransferEngine()
        rc = te.initialize(host, "P2PHANDSHAKE", "tcp" if transport == "tcp" else "rdma", "")
        assert rc == 0, rc
        stats = te.traffic_stats
        arr = np.zeros(size, dtype=np.uint8)
        addr = arr.ctypes.data
        assert te.register_memory(addr, size) == 0
        name = f"{host}:{te.get_rpc_port()}"

        def transfer(op, peer, remote, off, length):
            f = te.transfer_sync_write if op == "write" else te.transfer_sync_read
            return f(peer, addr + off, remote, length)

    print(json.dumps({"name": name, "addr": addr, "size": size}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "fill":
            arr[cmd["off"] : cmd["off"] + cmd["len"]] = pattern(cmd["seed"], cmd["len"])
            out = {"ok": True}
        elif op == "verify":
            got = arr[cmd["off"] : cmd["off"] + cmd["len"]]
            out = {"ok": bool(np.array_equal(got, pattern(cmd["seed"], cmd["len"])))}
        elif op in ("write_to", "read_from"):
            kind = "write" if op == "write_to" else "read"
            out = {"rc": transfer(kind, cmd["name"], cmd["remote"], cmd["off"], cmd["len"])}
        elif op == "sha256":
            out = {"sha256": hashlib.sha256(arr[cmd["off"] : cmd["off"] + cmd["len"]].tobytes()).hexdigest()}
        elif op == "notifies":
            if api == "native":
                out = {"notifies": [list(n) for n in engine.notifications()]}
            else:
                out = {"notifies": [[n.name, n.msg] for n in te.get_notifies()]}
        elif op == "traffic":
            out = {"traffic": {rail: s["bytes"] for rail, s in stats().items()}}
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
