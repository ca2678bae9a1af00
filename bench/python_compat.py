#!/usr/bin/env python3
# bench/python_compat.py: the same KV-transfer workload from Python, once with Mooncake's
# `mooncake.engine.TransferEngine` (PyPI mooncake-transfer-engine-non-cuda) and once with
# `multirail.mooncake.TransferEngine`, in one run, on loopback (127.0.0.1) only.
#
# Usage: bench/python_compat.py [--duration S] [--repeat N] [--skip-setup] [--protocol tcp|rdma]
#   --duration S   seconds of batch_transfer_sync_write per run (default 10)
#   --repeat N     runs per implementation, alternating; the median is reported (default 1)
#   --skip-setup   do not run bench/setup-peers nor install multirail into the venv
#   --protocol P   the `protocol` argument of initialize() for multirail (default tcp, as for
#                  Mooncake; "rdma" makes multirail use its best transport, shared memory here)
# Environment: MOONCAKE_VENV (default bench/.venv): the interpreter that runs both workers.
#   bench/setup-peers creates it with mooncake-transfer-engine-non-cuda (and libibverbs1 from
#   apt, which Mooncake's engine links); this script then installs multirail into it with
#   `pip install ./crates/python` when `import multirail` fails there.
#
# The workload (one worker module, run twice; only the import differs, chosen by
# MR_COMPAT_IMPL=mooncake|multirail):
#   target     TransferEngine(); initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "");
#              register_memory() of a 256 MiB anonymous mapping (4096 pages of 64 KiB);
#              session id "127.0.0.1:<get_rpc_port()>"; then idles until stdin closes.
#   initiator  the same initialize(); registers its own 256 MiB; one warm-up call; then for
#              --duration seconds: batch_transfer_sync_write(session, 64 local page addresses,
#              64 remote page addresses, 64 x 64 KiB) - 4 MiB per call, pages chosen from a
#              rotating window so successive calls touch different pages on both sides (the
#              remote pages are a fixed permutation, like a KV cache's block table).
#              GB/s = 1e9 bytes/s over whole calls that returned 0.
#              Then 4 KiB transfer_sync_write, one at a time, for 3 s (at most 20000 calls):
#              median and p99 latency of one call, as Python sees it.
# Both workers pin nothing and share the machine's cores with each other (2-core VM here).
#
# Measured on this 2-core VM (Mooncake 0.3.13.post1; other sessions were building, load average
# 2-5), 2026-11-22, --duration 10 --repeat 3, medians:
#   06:06  mooncake 0.804 GB/s, multirail (tcp) 1.962 GB/s: 2.44x
#          (runs: mooncake 0.886 / 0.804 / 0.514, multirail 2.174 / 1.840 / 1.962);
#          4 KiB transfer_sync_write median: mooncake 44.3 us, multirail 30.7 us.
#   06:11  (engine at 166daf6) mooncake 1.492 GB/s, multirail 3.224 GB/s: 2.16x
#          (runs: 1.492 / 1.496 / 1.464 vs 3.224 / 3.292 / 2.911);
#          4 KiB: mooncake 60.8 us (p99 ~84), multirail 45.1 us (runs 45.1 / 20.5 / 47.2).
#   --protocol rdma (multirail over shared memory), one run at 06:08: mooncake tcp 0.599 GB/s,
#          multirail 6.537 GB/s (10.9x); 4 KiB: 43.6 us vs 11.3 us.
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KIB, MIB = 1 << 10, 1 << 20
PAGE = 64 * KIB
PAGES_PER_CALL = 64
BUFFER = 256 * MIB
SMALL = 4 * KIB
LATENCY_SECONDS = 3.0
LATENCY_MAX_CALLS = 20000


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- worker


def load_engine_class():
    impl = os.environ.get("MR_COMPAT_IMPL", "mooncake")
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    elif impl == "multirail":
        from multirail.mooncake import TransferEngine
    else:
        raise SystemExit(f"MR_COMPAT_IMPL must be mooncake or multirail, got {impl!r}")
    return TransferEngine


def mapped_buffer(size):
    """Anonymous shared mapping, touched so page faults stay out of the measurement."""
    import ctypes
    import mmap

    mm = mmap.mmap(-1, size)
    for off in range(0, size, 4096):
        mm[off] = 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return mm, addr


def worker(role, protocol, duration, session=None, remote=None):
    TransferEngine = load_engine_class()
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise SystemExit(f"initialize returned {rc}")
    mm, addr = mapped_buffer(BUFFER)
    rc = te.register_memory(addr, BUFFER)
    if rc != 0:
        raise SystemExit(f"register_memory returned {rc}")
    if role == "target":
        print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}), flush=True)
        sys.stdin.read()  # until the driver closes our stdin
        return

    pages = BUFFER // PAGE
    windows = pages // PAGES_PER_CALL
    perm = [(i * 1031) % pages for i in range(pages)]  # 1031 is prime to 4096: a permutation
    calls = []
    for w in range(windows):
        idx = range(w * PAGES_PER_CALL, (w + 1) * PAGES_PER_CALL)
        calls.append(
            (
                [addr + i * PAGE for i in idx],
                [remote + perm[i] * PAGE for i in idx],
                [PAGE] * PAGES_PER_CALL,
            )
        )
    if te.batch_transfer_sync_write(session, *calls[0]) != 0:
        raise SystemExit("warm-up batch_transfer_sync_write failed")

    done = failed = 0
    k = 0
    start = time.perf_counter()
    deadline = start + duration
    while True:
        now = time.perf_counter()
        if now >= deadline:
            break
        rc = te.batch_transfer_sync_write(session, *calls[k % windows])
        k += 1
        if rc == 0:
            done += 1
        else:
            failed += 1
    elapsed = time.perf_counter() - start
    moved = done * PAGES_PER_CALL * PAGE

    lat = []
    t_end = time.perf_counter() + LATENCY_SECONDS
    lat_failed = 0
    while len(lat) < LATENCY_MAX_CALLS and time.perf_counter() < t_end:
        t0 = time.perf_counter_ns()
        rc = te.transfer_sync_write(session, addr, remote, SMALL)
        t1 = time.perf_counter_ns()
        if rc == 0:
            lat.append(t1 - t0)
        else:
            lat_failed += 1
    lat.sort()
    out = {
        "calls": done,
        "failed_calls": failed,
        "seconds": elapsed,
        "bytes": moved,
        "gb_per_s": moved / elapsed / 1e9 if elapsed > 0 else 0.0,
        "latency_calls": len(lat),
        "latency_failed": lat_failed,
        "latency_median_us": statistics.median(lat) / 1e3 if lat else None,
        "latency_p99_us": lat[int(len(lat) * 0.99) - 1] / 1e3 if lat else None,
    }
    print(json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------- driver


def run_pair(python, impl, protocol, duration):
    env = dict(os.environ, MR_COMPAT_IMPL=impl, GLOG_minloglevel="2", RUST_LOG="")
    env.pop("MULTIRAIL_CONF", None)
    me = os.path.abspath(__file__)
    errfile = open(os.path.join(ROOT, "bench", "out", f"python_compat-{impl}-target.log"), "w")
    target = subprocess.Popen(
        [python, me, "--worker", "target", "--protocol", protocol],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errfile,
        text=True,
        env=env,
    )
    try:
        line = target.stdout.readline()
        if not line:
            return {"ok": False, "error": f"target exited with {target.wait()} (see {errfile.name})"}
        info = json.loads(line)
        init = subprocess.run(
            [python, me, "--worker", "initiator", "--protocol", protocol, "--duration", str(duration),
             "--session", info["session"], "--remote", str(info["addr"])],
            capture_output=True,
            text=True,
            env=env,
            timeout=duration + LATENCY_SECONDS + 120,
        )
        if init.returncode != 0 or not init.stdout.strip():
            tail = "\n".join(init.stderr.strip().splitlines()[-5:])
            return {"ok": False, "error": f"initiator exit {init.returncode}: {tail}"}
        res = json.loads(init.stdout.strip().splitlines()[-1])
        res["ok"] = res["calls"] > 0
        return res
    finally:
        try:
            target.stdin.close()
        except OSError:
            pass
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
        errfile.close()


def ensure_setup(python, skip):
    if skip:
        return
    subprocess.run([os.path.join(HERE, "setup-peers")], check=False)
    if subprocess.run([python, "-c", "import multirail.mooncake"], capture_output=True).returncode == 0:
        log("python_compat: multirail already installed in the venv (reinstall: pip install ./crates/python)")
        return
    log("python_compat: installing multirail into the venv (pip install ./crates/python)")
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", os.path.join(ROOT, "crates", "python")], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", choices=["target", "initiator"])
    ap.add_argument("--session")
    ap.add_argument("--remote", type=int)
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-setup", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.protocol, a.duration, a.session, a.remote)
        return

    venv = os.environ.get("MOONCAKE_VENV", os.path.join(HERE, ".venv"))
    python = os.path.join(venv, "bin", "python")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    ensure_setup(python, a.skip_setup)
    runs = {"mooncake": [], "multirail": []}
    for r in range(a.repeat):
        for impl in ("mooncake", "multirail"):
            proto = "tcp" if impl == "mooncake" else a.protocol
            log(f"python_compat: run {r + 1}/{a.repeat}: {impl} (protocol {proto}, {a.duration:g} s + {LATENCY_SECONDS:g} s latency)")
            res = run_pair(python, impl, proto, a.duration)
            if not res["ok"]:
                log(f"python_compat: {impl} failed: {res.get('error')}")
            runs[impl].append(res)

    def med(impl, key):
        vals = [x[key] for x in runs[impl] if x.get("ok") and x.get(key) is not None]
        return statistics.median(vals) if vals else None

    mc_gbps, mr_gbps = med("mooncake", "gb_per_s"), med("multirail", "gb_per_s")
    mc_lat, mr_lat = med("mooncake", "latency_median_us"), med("multirail", "latency_median_us")
    fmt = lambda v, f: "failed" if v is None else format(v, f)
    print(f"KV workload: batch_transfer_sync_write of {PAGES_PER_CALL} x {PAGE // KIB} KiB pages per call, "
          f"{a.duration:g} s, loopback, {a.repeat} run(s) each (median)")
    print(f"{'':28}{'GB/s':>10}{'4 KiB sync write median (us)':>32}")
    print(f"{'mooncake.engine (tcp)':28}{fmt(mc_gbps, '.3f'):>10}{fmt(mc_lat, '.1f'):>32}")
    print(f"{'multirail.mooncake (' + a.protocol + ')':28}{fmt(mr_gbps, '.3f'):>10}{fmt(mr_lat, '.1f'):>32}")
    if mc_gbps and mr_gbps:
        ratio = mr_gbps / mc_gbps
        print(f"throughput ratio multirail/mooncake: {ratio:.2f}x (target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})")
    if mc_lat and mr_lat:
        print(f"latency ratio mooncake/multirail: {mc_lat / mr_lat:.2f}x (higher = multirail faster)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(HERE, "out", f"python_compat-{stamp}.json")
    with open(out, "w") as f:
        json.dump({"duration": a.duration, "protocol": a.protocol, "runs": runs}, f, indent=2)
    log(f"python_compat: raw results in {out}")


if __name__ == "__main__":
    main()
