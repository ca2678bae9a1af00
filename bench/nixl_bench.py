#!/usr/bin/env python3
# bench/nixl_bench.py: the driver and the two roles of bench/nixl (run that script, which sets up
# the virtualenv and the plugin first; see its header for what is measured and how).
#
# One process pair per configuration, started with multiprocessing's `spawn` (a process that
# loaded libnixl and its threads must not fork): a target that registers a buffer and idles, and
# an initiator that loads the target's metadata, then for every block size prepares one WRITE
# and one READ handle of N descriptors, checks the bytes once, warms up and reposts each handle
# for a fixed time. The driver relays nothing but the results; the two roles talk over a pipe of
# their own.

import argparse
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import signal
import sys
import time
import traceback

CONFIGS = {
    # name: (implementation, transport, label)
    "nixl-ucx": ("nixl", "UCX", "NIXL / UCX"),
    "nixl-mr-shm": ("nixl", "shm", "NIXL / MULTIRAIL shm"),
    "nixl-mr-tcp": ("nixl", "tcp", "NIXL / MULTIRAIL tcp"),
    "mr-nixl-shm": ("mrnixl", "shm", "multirail.nixl shm"),
    "native-shm": ("native", "shm", "multirail prepared shm"),
}
ORDER = list(CONFIGS)
BASELINE = "nixl-ucx"
# Seconds the initiator sleeps between two polls of a running post (--poll-sleep-us); 0 spins.
POLL_SLEEP = 0.0

ctx = multiprocessing.get_context("spawn")


# ------------------------------------------------------------------ helpers of both roles

def _env_for(impl, transport, plugin_dir):
    """NIXL_PLUGIN_DIR replaces the wheel's plugin directory: set for the MULTIRAIL rows only,
    so the UCX rows load the wheel's own UCX plugin. Must run before libnixl is loaded. Also
    sends what the role's libraries print (NIXL logs INFO lines to stdout) to stderr, so the
    driver's stdout holds only the table or the JSON."""
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if impl == "nixl" and transport != "UCX" and plugin_dir:
        os.environ["NIXL_PLUGIN_DIR"] = plugin_dir
    else:
        os.environ.pop("NIXL_PLUGIN_DIR", None)


def _aligned(np, nbytes):
    """A zeroed uint8 array of nbytes starting on a 4 KiB boundary (every row and every
    implementation gets the same alignment)."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + nbytes]


def _pattern(np, seed, nbytes):
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _perm(np, n):
    """Remote block of local block i: a fixed permutation, as a KV cache's block table is, so no
    implementation can merge neighbouring descriptors into one."""
    return np.random.default_rng(12345 + n).permutation(n).astype(np.int64)


def _expect(conn, what, timeout=300):
    if not conn.poll(timeout):
        raise RuntimeError(f"nothing from the other process within {timeout} s (waiting for {what!r})")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("the other process failed:\n" + msg[1])
    if msg[0] != what:
        raise RuntimeError(f"expected {what!r}, got {msg[0]!r}")
    return msg[1:]


def _loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# ------------------------------------------------------------------ the implementations

class NixlSide:
    """A NIXL-API agent: the wheel's nixl_cu12 (UCX or the MULTIRAIL plugin) or multirail.nixl."""

    def __init__(self, impl, transport, name):
        self.impl = impl
        if impl == "nixl":
            from nixl_cu12._api import nixl_agent, nixl_agent_config

            if transport == "UCX":
                self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
            else:
                self.agent = nixl_agent(name, nixl_agent_config(backends=[]))
                # 127.0.0.1: the engine's segment name is a loopback address, so its
                # connections (data over tcp, messages over both) stay on loopback.
                self.agent.create_backend("MULTIRAIL", {"transport": transport, "listen": "127.0.0.1:0"})
        else:
            from multirail.nixl import nixl_agent, nixl_agent_config

            conf = nixl_agent_config(backends=["MULTIRAIL"], engine_config={"transport": transport},
                                     engine_name="127.0.0.1")
            self.agent = nixl_agent(name, conf)
        self.peer = None

    def register(self, arr):
        return self.agent.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")

    def metadata(self):
        return self.agent.get_agent_metadata()

    def add_peer(self, md):
        p = self.agent.add_remote_agent(md)
        self.peer = p.decode() if isinstance(p, bytes) else p

    def prepare(self, np, local_base, remote_base, n, size, perm):
        """One WRITE and one READ handle: local block i <-> remote block perm[i]."""
        a = self.agent
        offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
        lrows = np.stack([np.uint64(local_base) + offs, np.full(n, size, np.uint64), np.zeros(n, np.uint64)], axis=1)
        rrows = np.stack([np.uint64(remote_base) + offs, np.full(n, size, np.uint64), np.zeros(n, np.uint64)], axis=1)
        self.local = a.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM")
        self.remote = a.prep_xfer_dlist(self.peer, rrows, "DRAM")
        li = list(range(n))
        ri = perm.tolist()
        self.handles = {"WRITE": a.make_prepped_xfer("WRITE", self.local, li, self.remote, ri),
                        "READ": a.make_prepped_xfer("READ", self.local, li, self.remote, ri)}

    def loop(self, op, until_ns, lat, max_posts=None):
        """Posts the handle again and again, each post polled to DONE, until `until_ns` (a
        perf_counter_ns value) has passed; appends each post's latency in ns to `lat`."""
        a, h = self.agent, self.handles[op]
        transfer, check = a.transfer, a.check_xfer_state
        clock, sleep, nap = time.perf_counter_ns, time.sleep, POLL_SLEEP
        posts = 0
        while True:
            t0 = clock()
            st = transfer(h)
            while st == "PROC":
                if nap:
                    sleep(nap)
                st = check(h)
            t1 = clock()
            if st != "DONE":
                raise RuntimeError(f"{op} post {posts} ended {st}")
            lat.append(t1 - t0)
            posts += 1
            if t1 >= until_ns or (max_posts is not None and posts >= max_posts):
                return

    def release(self):
        a = self.agent
        for h in self.handles.values():
            a.release_xfer_handle(h)
        a.release_dlist_handle(self.local)
        a.release_dlist_handle(self.remote)


class NativeSide:
    """multirail's own API: an Engine, registered NumPy memory, one prepared list posted as a
    WRITE or a READ batch."""

    def __init__(self, impl, transport, name):
        import multirail

        self.mr = multirail
        self.transport = transport
        self.engine = multirail.Engine(name="127.0.0.1", transport=transport)
        self.seg = None

    def register(self, arr):
        return self.engine.register(arr)

    def metadata(self):
        return self.engine.segment_name.encode()

    def add_peer(self, md):
        self.seg = self.engine.open_segment(md.decode())

    def prepare(self, np, local_base, remote_base, n, size, perm):
        entries = [(local_base + i * size, self.seg, remote_base + int(perm[i]) * size, size) for i in range(n)]
        self.list = self.engine.prepare(entries, transport=self.transport)
        self.handles = {"WRITE": self.mr.WRITE, "READ": self.mr.READ}

    def loop(self, op, until_ns, lat, max_posts=None):
        post = self.list.post
        opcode = self.handles[op]
        pending = self.mr.Status.PENDING
        completed = self.mr.Status.COMPLETED
        clock, sleep, nap = time.perf_counter_ns, time.sleep, POLL_SLEEP
        posts = 0
        while True:
            t0 = clock()
            b = post(opcode)
            st = b.status()
            while st is pending:
                if nap:
                    sleep(nap)
                st = b.status()
            t1 = clock()
            if st is not completed:
                raise RuntimeError(f"{op} post {posts} failed: {b.error()}")
            lat.append(t1 - t0)
            posts += 1
            if t1 >= until_ns or (max_posts is not None and posts >= max_posts):
                return

    def release(self):
        self.list.free()


def _side(impl, transport, name):
    return NativeSide(impl, transport, name) if impl == "native" else NixlSide(impl, transport, name)


# ------------------------------------------------------------------ the two roles

def target_role(conn, impl, transport, plugin_dir, nbytes, tag):
    try:
        _env_for(impl, transport, plugin_dir)
        import numpy as np

        side = _side(impl, transport, f"target-{tag}")
        buf = _aligned(np, nbytes)
        reg = side.register(buf)
        conn.send(("md", side.metadata(), buf.ctypes.data, os.getpid()))
        while True:
            cmd = conn.recv()
            op = cmd[0]
            if op == "add":
                side.add_peer(cmd[1])
                conn.send(("added",))
            elif op == "fill":
                _, seed, n = cmd
                buf[:n] = _pattern(np, seed, n)
                conn.send(("filled",))
            elif op == "hash":
                conn.send(("hash", hashlib.blake2b(buf[:cmd[1]].tobytes(), digest_size=16).hexdigest()))
            elif op == "exit":
                del reg
                conn.send(("bye",))
                return
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass


def _cpu_jiffies(pid="self"):
    """utime + stime of a whole process (every thread), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _busy_jiffies():
    """Clock ticks the machine's CPUs spent busy (everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]


def _measure(side, np, op, total, n, seconds, warmup, tpid):
    side.loop(op, time.perf_counter_ns() + int(warmup * 1e9), [])
    lat = []
    load = _loadavg()
    hz = os.sysconf("SC_CLK_TCK")
    c0 = (_busy_jiffies(), _cpu_jiffies(), _cpu_jiffies(tpid))
    t0 = time.perf_counter_ns()
    side.loop(op, t0 + int(seconds * 1e9), lat)
    elapsed = (time.perf_counter_ns() - t0) / 1e9
    c1 = (_busy_jiffies(), _cpu_jiffies(), _cpu_jiffies(tpid))
    ours = (c1[1] - c0[1]) + (c1[2] - c0[2])
    a = np.array(lat, dtype=np.float64) / 1e3
    posts = len(lat)
    return {
        "size": total // n, "blocks": n, "op": op, "posts": posts, "seconds": elapsed,
        "gb_per_s": posts * total / elapsed / 1e9,
        "desc_per_s": posts * n / elapsed,
        "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
        # CPU time over the timed window, in cores: this pair's (initiator + target, every
        # thread) and everything else on the machine's.
        "cpu_pair": ours / hz / elapsed,
        "cpu_others": max(0.0, (c1[0] - c0[0]) - ours) / hz / elapsed,
        "loadavg": load,
    }


def initiator_role(report, tconn, impl, transport, plugin_dir, nbytes, tag, poll_sleep):
    """Sets up, says ready, then runs the driver's ("row", size, n, seconds, warmup, verify)
    commands until ("exit",)."""
    global POLL_SLEEP
    POLL_SLEEP = poll_sleep
    try:
        _env_for(impl, transport, plugin_dir)
        import numpy as np

        side = _side(impl, transport, f"initiator-{tag}")
        buf = _aligned(np, nbytes)
        reg = side.register(buf)
        md, remote_base, tpid = _expect(tconn, "md")
        side.add_peer(md)
        tconn.send(("add", side.metadata()))
        _expect(tconn, "added")
        report.send(("ready", os.getpid(), tpid))

        while True:
            cmd = report.recv()
            if cmd[0] == "exit":
                break
            _, size, n, seconds, warmup, verify = cmd
            total = n * size
            perm = _perm(np, n)
            t_prep = time.perf_counter()
            side.prepare(np, buf.ctypes.data, remote_base, n, size, perm)
            prep_s = time.perf_counter() - t_prep

            ok = {"WRITE": None, "READ": None}
            if verify:
                # The bytes (not timed): a WRITE of a random pattern must land block i at
                # remote block perm[i]; a READ of another pattern must bring remote block
                # perm[i] to block i.
                src = _pattern(np, 1000 + size, total)
                buf[:total] = src
                side.loop("WRITE", 0, [], max_posts=1)
                want = np.empty_like(src)
                want.reshape(n, size)[perm] = src.reshape(n, size)
                tconn.send(("hash", total))
                (got,) = _expect(tconn, "hash")
                ok["WRITE"] = got == hashlib.blake2b(want.tobytes(), digest_size=16).hexdigest()
                tconn.send(("fill", 2000 + size, total))
                _expect(tconn, "filled")
                buf[:total] = 0
                side.loop("READ", 0, [], max_posts=1)
                remote = _pattern(np, 2000 + size, total)
                ok["READ"] = bool(np.array_equal(buf[:total].reshape(n, size), remote.reshape(n, size)[perm]))
                del src, want, remote

            for op in ("WRITE", "READ"):
                row = _measure(side, np, op, total, n, seconds, warmup, tpid)
                row["verified"] = ok[op]
                row["prepare_s"] = prep_s
                report.send(("row", row))
            side.release()
            report.send(("rowdone",))
        del reg
        tconn.send(("exit",))
        _expect(tconn, "bye")
        report.send(("bye",))
    except BaseException:
        try:
            report.send(("error", traceback.format_exc()))
        except Exception:
            pass


# ------------------------------------------------------------------ the driver

class Pair:
    """The two processes of one configuration. Between its rows the pair is stopped
    (SIGSTOP), so its threads (NIXL's progress thread polls UCX without pause) take no CPU from
    the configuration being measured; all pairs live from start to end, and the rows of every
    configuration for one size run back to back, so a change of machine load hits them alike."""

    def __init__(self, name, args, nbytes):
        self.name = name
        impl, transport, _ = CONFIGS[name]
        tag = f"{name}-{os.getpid()}"
        t_a, t_b = ctx.Pipe()
        self.conn, r_b = ctx.Pipe()
        self.procs = [
            ctx.Process(target=target_role, args=(t_b, impl, transport, args.plugin_dir, nbytes, tag), daemon=True),
            ctx.Process(target=initiator_role, args=(r_b, t_a, impl, transport, args.plugin_dir, nbytes, tag,
                                                               args.poll_sleep_us / 1e6), daemon=True),
        ]
        self.error = None
        self.rows = []
        self.stopped = False
        for p in self.procs:
            p.start()
        try:
            _expect(self.conn, "ready", timeout=120)
            self.stop()
        except Exception as e:
            self.fail(e)

    def fail(self, e):
        text = str(e).strip()
        self.error = text.splitlines()[-1] if text else repr(e)
        self.detail = text
        self.kill()

    def _signal(self, sig):
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, sig)

    def stop(self):
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self):
        self._signal(signal.SIGCONT)
        self.stopped = False

    def row(self, size, n, args, verify, log):
        if self.error:
            return
        self.cont()
        try:
            self.conn.send(("row", size, n, args.seconds, args.warmup, verify))
            budget = 120 + 2 * (args.seconds + args.warmup) * 4
            deadline = time.monotonic() + budget
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.conn.poll(left):
                    raise RuntimeError(f"no result within {budget:.0f} s")
                msg = self.conn.recv()
                if msg[0] == "error":
                    raise RuntimeError(msg[1])
                if msg[0] == "rowdone":
                    break
                r = msg[1]
                r["config"] = self.name
                self.rows.append(r)
                v = {True: "bytes ok", False: "BYTES WRONG", None: ""}[r["verified"]]
                log(f"  {self.name:12} {fmt_size(r['size']):>7} x {r['blocks']:<5} {r['op']:5} "
                    f"{r['gb_per_s']:7.2f} GB/s  p50 {r['p50_us']:9.1f} us  p99 {r['p99_us']:9.1f} us  "
                    f"cpu {r['cpu_pair']:.2f} + others {r['cpu_others']:.2f}  {v}")
            self.stop()
        except Exception as e:
            log(f"  {self.name}: FAILED: {e}")
            self.fail(e)

    def close(self):
        if self.error:
            return
        self.cont()
        try:
            self.conn.send(("exit",))
            _expect(self.conn, "bye", timeout=30)
        except Exception as e:
            self.fail(e)
        for p in self.procs:
            p.join(10)
        self.kill()

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
                p.kill()
            p.join(5)


def parse_size(text):
    t = text.strip().lower()
    for suffix, mult in (("kib", 1024), ("k", 1024), ("mib", 1 << 20), ("m", 1 << 20), ("b", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def fmt_size(b):
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return f"{b >> 20} MiB"
    if b >= 1024 and b % 1024 == 0:
        return f"{b >> 10} KiB"
    return f"{b} B"


def machine():
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "kernel": platform.release(),
            "python": platform.python_version()}


def pick(rows, name, size, op):
    """The row of (configuration, size, op); with several rounds, the round of median GB/s."""
    rs = sorted((x for x in rows if x["config"] == name and x["size"] == size and x["op"] == op),
                key=lambda x: x["gb_per_s"])
    return rs[(len(rs) - 1) // 2] if rs else None


def table(pairs, args, info):
    rows = [r for p in pairs for r in p.rows]
    lines = []
    m = info["machine"]
    lines.append(f"date {info['date']}; machine: {m['nproc']} cores, {m['cpu']}, kernel {m['kernel']}")
    lines.append(f"load average (1/5/15 min): {info['load_start']} at start, {info['load_end']} at end")
    lines.append(f"command: {info['command']}")
    if args.rounds > 1:
        lines.append(f"{args.rounds} rounds; each row is the round of median GB/s")
    if args.poll_sleep_us:
        lines.append(f"the initiator sleeps {args.poll_sleep_us:g} us between polls")
    lines.append("")
    lines.append("| B x N | op | configuration | GB/s | desc/s | p50 us | p99 us | posts | vs UCX | CPU pair | CPU others |")
    lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        for op in ("WRITE", "READ"):
            b = pick(rows, BASELINE, size, op)
            for p in pairs:
                r = pick(rows, p.name, size, op)
                head = f"| {fmt_size(size)} x {args.blocks_for[size]} | {op} | {CONFIGS[p.name][2]} |"
                if r is None:
                    lines.append(f"{head} failed: {p.error or 'no result'} | | | | | | | |")
                    continue
                ratio = f"{r['gb_per_s'] / b['gb_per_s']:.2f}x" if b and b["gb_per_s"] > 0 else "-"
                mark = " (BYTES WRONG)" if r["verified"] is False else ""
                lines.append(f"{head} {r['gb_per_s']:.2f}{mark} | {r['desc_per_s'] / 1e6:.3f} M | {r['p50_us']:.0f} | "
                             f"{r['p99_us']:.0f} | {r['posts']} | {ratio} | {r['cpu_pair']:.2f} | {r['cpu_others']:.2f} |")
    lines.append("")
    lines.append("GB/s = 1e9 bytes/s; desc/s = descriptors moved per second; p50/p99 = one post, transfer() to DONE; "
                 "vs UCX = GB/s over NIXL / UCX's; CPU = cores busy during the timed seconds: the pair measured "
                 "(initiator + target, all threads), and everything else on the machine")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(prog="bench/nixl", description="vLLM-shaped KV transfers through NIXL/UCX, "
                                 "NIXL/MULTIRAIL (shm, tcp), multirail.nixl and multirail's prepared lists.")
    ap.add_argument("--sizes", default="4KiB,16KiB,64KiB,1MiB",
                    help="descriptor sizes B, comma-separated (default 4KiB,16KiB,64KiB,1MiB)")
    ap.add_argument("--blocks", default=None,
                    help="descriptors per transfer N, one per size or one for all (default: 16 MiB / B each)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per row (default 3)")
    ap.add_argument("--warmup", type=float, default=0.5, help="warm-up seconds per row, not timed (default 0.5)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times every row is measured, the rounds interleaved; the table shows the round "
                         "of median GB/s, the JSON all (default 1)")
    ap.add_argument("--poll-sleep-us", type=float, default=0.0,
                    help="microseconds the initiator sleeps between two polls of a running post "
                         "(default 0: it spins, as a busy inference loop would)")
    ap.add_argument("--configs", default=",".join(ORDER),
                    help=f"configurations to run, comma-separated (default all: {','.join(ORDER)})")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--out", default="bench/out", help="directory of the JSON record (default bench/out)")
    ap.add_argument("--plugin-dir", default=os.environ.get("MULTIRAIL_NIXL_PLUGIN_DIR", ""),
                    help="directory holding libplugin_MULTIRAIL.so (bench/nixl passes it)")
    ap.add_argument("--command", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--parse-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        if not args.sizes or min(args.sizes) <= 0:
            raise ValueError("no size")
    except ValueError:
        ap.error(f"--sizes: expected sizes like 4KiB,16KiB,1MiB, got {args.sizes!r}")
    if len(set(args.sizes)) != len(args.sizes):
        ap.error("--sizes: a size is given twice")
    if args.blocks is None:
        blocks = [max(1, (16 << 20) // s) for s in args.sizes]
    else:
        try:
            blocks = [int(x) for x in args.blocks.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--blocks: expected integers, got {args.blocks!r}")
        if len(blocks) == 1:
            blocks = blocks * len(args.sizes)
        if len(blocks) != len(args.sizes) or min(blocks) <= 0:
            ap.error("--blocks: give one positive count, or one per --sizes entry")
    args.blocks_for = dict(zip(args.sizes, blocks))
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs or len(set(args.configs)) != len(args.configs):
        ap.error(f"--configs: unknown or repeated {bad or args.configs}; choose from {list(CONFIGS)}")
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1 or args.poll_sleep_us < 0:
        ap.error("--seconds must be > 0, --warmup >= 0, --rounds >= 1, --poll-sleep-us >= 0")
    if any(CONFIGS[c][0] == "nixl" and CONFIGS[c][1] != "UCX" for c in args.configs) and not args.plugin_dir:
        ap.error("--plugin-dir (the directory of libplugin_MULTIRAIL.so) is needed for the MULTIRAIL rows")

    if args.parse_only:
        return 0

    log = lambda m: print(m, file=sys.stderr, flush=True)
    info = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "machine": machine(), "load_start": _loadavg(),
            "command": args.command or " ".join(["bench/nixl"] + sys.argv[1:])}
    nbytes = max(args.blocks_for[s] * s for s in args.sizes)
    pairs = []
    try:
        for name in args.configs:
            log(f"== starting {name} ({CONFIGS[name][2]})")
            pairs.append(Pair(name, args, nbytes))
            if pairs[-1].error:
                log(f"  {name}: FAILED: {pairs[-1].detail}")
        for rnd in range(args.rounds):
            for size in args.sizes:
                log(f"== {fmt_size(size)} x {args.blocks_for[size]}" + (f", round {rnd + 1}" if args.rounds > 1 else "")
                    + f", load {_loadavg()}")
                for p in pairs:
                    p.row(size, args.blocks_for[size], args, rnd == 0, log)
                    for r in p.rows:
                        r.setdefault("round", rnd)
    finally:
        for p in pairs:
            p.close()
    info["load_end"] = _loadavg()

    doc = {"info": info, "seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds,
           "poll_sleep_us": args.poll_sleep_us,
           "rows": [r for p in pairs for r in p.rows],
           "configs": [{"config": p.name, "label": CONFIGS[p.name][2], "error": p.error} for p in pairs]}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "nixl-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(table(pairs, args, info))
    log(f"results: {path}")
    failed = any(p.error for p in pairs) or any(r["verified"] is False for r in doc["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
