#!/usr/bin/env python3
"""bench/metadata_load.py: load generator for HTTP metadata servers speaking Mooncake's protocol
(GET/PUT/DELETE /metadata?key=K), used by bench/metadata. Standard library only.

Usage:
  bench/metadata_load.py register --url URL [--keys N] [--value-bytes B] [--timeout S]
      PUTs N keys (bench/ram/node-00000:17000 ...), each with a B-byte JSON value shaped like a
      segment descriptor, one after another on one keep-alive connection, then GETs every key
      back and compares the bytes. Prints one JSON object: puts/s, PUT p50/p99 (µs), errors,
      mismatches.
  bench/metadata_load.py lookup --url URL [--keys N] [--value-bytes B] [--clients C]
                                [--duration S] [--warmup S] [--rate R] [--server-pid PID]
                                [--timeout S]
      C client processes (not threads: on a 2-core machine the GIL would cap one process), each
      with one keep-alive http.client connection, GET random registered keys for --warmup
      seconds (not counted) and then --duration seconds. Without --rate each client sends its
      next request when the previous one is answered (closed loop: the most the server and
      these clients manage together). With --rate R the clients together send R lookups/s on a
      fixed schedule (each R/C per second, staggered); a request that cannot go on time goes as
      soon as the client is free, and its latency counts from when it should have gone
      (so a server that falls behind shows it in the latency, not only in the rate); nothing
      is sent after the end. "sustained": at least 99 % of the lookups due in the measured
      window answered, no errors, and a median latency from the due time of at most 10 ms (a
      server that falls behind builds a queue, which pushes the median up).
      An answer counts when it is 200 with a body of B bytes.
      Prints one JSON object: lookups/s, p50/p99 latency (µs), errors by kind, and the CPU
      the server (--server-pid, from /proc), the clients and everything else used meanwhile.

Every request has a timeout (--timeout, default 2 s, per connect and per read); a client that
hits one counts an error, reconnects and goes on. Clients stop at the end of the run whatever
state they are in; the parent waits at most --timeout + 30 s beyond it for their results and
kills any that have not reported. Exit 0 when the run completed (errors are counted, not fatal),
1 when it could not run (server unreachable, clients lost), 2 on a usage error.
"""
import argparse
import http.client
import json
import math
import multiprocessing
import os
import queue
import random
import sys
import time
import urllib.parse


def log(msg):
    print(f"metadata_load: {msg}", file=sys.stderr, flush=True)


def parse_url(url):
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ValueError(f"want http://HOST:PORT/PATH, not {url!r}")
    if u.hostname not in ("127.0.0.1", "localhost", "::1") and not u.hostname.startswith("127."):
        raise ValueError(f"this benchmark talks to loopback servers only, not {u.hostname}")
    return u.hostname, u.port, u.path or "/metadata"


def key_name(i):
    return f"bench/ram/node-{i:05d}:{17000 + i % 1000}"


def key_path(base, i):
    return f"{base}?key={urllib.parse.quote(key_name(i), safe='')}"


def value_for(i, size):
    """A JSON object like a segment descriptor (name, protocol, buffers, devices), padded to
    exactly `size` bytes so every answer's length can be checked."""
    name = key_name(i)
    desc = {
        "name": name,
        "protocol": "tcp",
        "tcp_data_port": 15000 + i % 1000,
        "timestamp": "2026-01-01 00:00:00.000000",
        "devices": [{"name": f"mlx5_{d}", "lid": d, "gid": "fe80:0000:0000:0000:0000:0000:0000:%04x" % d}
                    for d in range(4)],
        "buffers": [],
        "pad": "",
    }
    b = 0
    while len(json.dumps(desc, separators=(",", ":"))) < size - 200:
        desc["buffers"].append({"name": "cpu:0", "addr": 0x7F0000000000 + b * (1 << 30), "length": 1 << 30,
                                "rkey": [1000 + b, 2000 + b], "lkey": [3000 + b, 4000 + b]})
        b += 1
    body = json.dumps(desc, separators=(",", ":"))
    if len(body) > size:
        raise ValueError(f"--value-bytes {size} is too small for a descriptor (at least {len(body)})")
    desc["pad"] = "x" * (size - len(body))
    body = json.dumps(desc, separators=(",", ":")).encode()
    assert len(body) == size
    return body


def pct(sorted_vals, p):
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_vals:
        return None
    k = max(0, min(len(sorted_vals) - 1, math.ceil(p / 100.0 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def proc_cpu_s(pid):
    """utime + stime of process `pid` and its descendants (all their threads), seconds; None
    when `pid` is unreadable. Descendants count so that a server started through a wrapper
    (a shell, env) is measured all the same."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                stats[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
            except (OSError, IndexError, ValueError):
                pass
    if pid not in stats:
        return None
    children = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(children.get(p, []))
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy_s():
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def register(a):
    host, port, base = parse_url(a.url)
    conn = http.client.HTTPConnection(host, port, timeout=a.timeout)
    lat, errors, mismatched = [], {}, 0

    def count(kind):
        errors[kind] = errors.get(kind, 0) + 1

    def call(method, path, body=None):
        nonlocal conn
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            r = conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=a.timeout)
            return type(e).__name__, None

    deadline = time.monotonic() + 30.0 + a.keys * 0.05  # both phases; ~1 ms per request is usual
    t0 = time.monotonic()
    for i in range(a.keys):
        if time.monotonic() > deadline:
            count("gave up (deadline)")
            break
        s = time.monotonic()
        st, _ = call("PUT", key_path(base, i), value_for(i, a.value_bytes))
        if st == 200:
            lat.append(time.monotonic() - s)
        else:
            count(f"PUT {st}")
    put_s = time.monotonic() - t0
    for i in range(a.keys):
        if time.monotonic() > deadline:
            count("gave up (deadline)")
            break
        st, body = call("GET", key_path(base, i))
        if st != 200:
            count(f"GET {st}")
        elif body != value_for(i, a.value_bytes):
            mismatched += 1
    conn.close()
    lat_us = sorted(x * 1e6 for x in lat)
    out = {
        "keys": a.keys, "value_bytes": a.value_bytes, "puts_ok": len(lat), "seconds": put_s,
        "puts_per_s": len(lat) / put_s if put_s > 0 else None,
        "put_p50_us": pct(lat_us, 50), "put_p99_us": pct(lat_us, 99),
        "errors": errors, "mismatched": mismatched,
    }
    print(json.dumps(out))
    return 0 if lat else 1


def lookup_worker(idx, a, t_start, t_warm, t_end, results):
    """One client process: see the module doc. Puts one dict into `results`."""
    host, port, base = parse_url(a.url)
    paths = [key_path(base, i) for i in range(a.keys)]
    rng = random.Random(1000 + idx)
    errors = {}
    lat, svc = [], []
    conn = http.client.HTTPConnection(host, port, timeout=a.timeout)
    try:
        conn.connect()
    except OSError as e:
        errors[f"connect: {type(e).__name__}"] = 1
    if a.rate:
        interval = a.clients / a.rate
        next_t = t_start + idx / a.rate
    now = time.monotonic()
    if now < t_start:
        time.sleep(t_start - now)
    cpu0 = None
    scheduled = 0
    while True:
        now = time.monotonic()
        if now >= t_end:
            break
        if a.rate:
            if next_t >= t_end:
                break
            if next_t > now:
                time.sleep(next_t - now)
            sched = next_t
            next_t += interval
        else:
            sched = now
        measured = sched >= t_warm
        if measured:
            if cpu0 is None:
                cpu0 = time.process_time()
            scheduled += 1
        path = paths[rng.randrange(len(paths))]
        sent = time.monotonic()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            status = r.status
        except (OSError, http.client.HTTPException) as e:
            if measured:
                kind = type(e).__name__
                errors[kind] = errors.get(kind, 0) + 1
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=a.timeout)
            continue
        done = time.monotonic()
        if not measured:
            continue
        if status == 200 and len(body) == a.value_bytes:
            lat.append(done - sched)
            svc.append(done - sent)
        else:
            kind = f"HTTP {status}" if status != 200 else "short body"
            errors[kind] = errors.get(kind, 0) + 1
    if a.rate:
        # slots of this client's schedule inside the measured window, sent or not
        first = t_start + idx / a.rate
        k0 = max(0, int((t_warm - first) / interval + 0.999999))
        k1 = max(0, int((t_end - first) / interval + 0.999999))
        scheduled = k1 - k0
    conn.close()
    results.put({
        "idx": idx, "ok": len(lat), "scheduled": scheduled, "errors": errors,
        "cpu_s": time.process_time() - cpu0 if cpu0 is not None else 0.0,
        "lat_us": [int(x * 1e6) for x in lat], "svc_us": [int(x * 1e6) for x in svc],
    })


def lookup(a):
    host, port, base = parse_url(a.url)
    # the server must answer a registered key before clients start
    try:
        c = http.client.HTTPConnection(host, port, timeout=a.timeout)
        c.request("GET", key_path(base, 0))
        r = c.getresponse()
        body = r.read()
        c.close()
        if r.status != 200 or len(body) != a.value_bytes:
            print(json.dumps({"error": f"key 0 not registered (HTTP {r.status}, {len(body)} bytes)"}))
            return 1
    except (OSError, http.client.HTTPException) as e:
        print(json.dumps({"error": f"server unreachable: {e}"}))
        return 1
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    t_start = time.monotonic() + 1.0
    t_warm = t_start + a.warmup
    t_end = t_warm + a.duration
    procs = [ctx.Process(target=lookup_worker, args=(i, a, t_start, t_warm, t_end, results), daemon=True)
             for i in range(a.clients)]
    for p in procs:
        p.start()
    time.sleep(max(0.0, t_warm - time.monotonic()))
    srv0, busy0, w0 = (proc_cpu_s(a.server_pid) if a.server_pid else None), machine_busy_s(), time.monotonic()
    time.sleep(max(0.0, t_end - time.monotonic()))
    srv1, busy1, w1 = (proc_cpu_s(a.server_pid) if a.server_pid else None), machine_busy_s(), time.monotonic()
    got = []
    give_up = time.monotonic() + a.timeout + 30
    while len(got) < len(procs) and time.monotonic() < give_up:
        try:
            got.append(results.get(timeout=max(0.1, give_up - time.monotonic())))
        except queue.Empty:
            break
    for p in procs:
        p.join(timeout=max(0.1, give_up - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    lost = len(procs) - len(got)
    window = a.duration
    lat = sorted(x for g in got for x in g["lat_us"])
    svc = sorted(x for g in got for x in g["svc_us"])
    errors = {}
    for g in got:
        for k, v in g["errors"].items():
            errors[k] = errors.get(k, 0) + v
    if lost:
        errors["client lost (no report)"] = lost
    ok = sum(g["ok"] for g in got)
    scheduled = sum(g["scheduled"] for g in got)
    clients_cpu = sum(g["cpu_s"] for g in got)
    wall = w1 - w0
    server_cpu = (srv1 - srv0) if srv0 is not None and srv1 is not None else None
    busy = (busy1 - busy0) if busy0 is not None and busy1 is not None else None
    out = {
        "mode": f"fixed rate {a.rate:g}/s" if a.rate else "closed loop",
        "clients": a.clients, "duration_s": window, "warmup_s": a.warmup, "keys": a.keys,
        "value_bytes": a.value_bytes, "rate_target": a.rate or None,
        "lookups_ok": ok, "lookups_per_s": ok / window,
        "scheduled": scheduled if a.rate else None,
        # kept up: (nearly) every due lookup answered, no errors, and no growing queue (which
        # would push the median latency from the due time up)
        "sustained": (bool(ok >= 0.99 * scheduled and not errors and lat and pct(lat, 50) <= 10_000)
                      if a.rate else None),
        "p50_us": pct(lat, 50), "p99_us": pct(lat, 99), "max_us": lat[-1] if lat else None,
        "service_p50_us": pct(svc, 50), "service_p99_us": pct(svc, 99),
        "errors": errors,
        "cpu": {
            "wall_s": wall, "cores": os.cpu_count(),
            "server_s": server_cpu, "clients_s": clients_cpu, "machine_busy_s": busy,
            "other_s": (busy - clients_cpu - (server_cpu or 0)) if busy is not None else None,
            "server_us_per_lookup": (server_cpu / ok * 1e6) if server_cpu is not None and ok else None,
        },
    }
    print(json.dumps(out))
    return 0 if got else 1


def main():
    ap = argparse.ArgumentParser(description="load generator for HTTP metadata servers (see the module doc)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("register", "lookup"):
        p = sub.add_parser(name)
        p.add_argument("--url", required=True)
        p.add_argument("--keys", type=int, default=1000)
        p.add_argument("--value-bytes", type=int, default=2048)
        p.add_argument("--timeout", type=float, default=2.0)
        if name == "lookup":
            p.add_argument("--clients", type=int, default=8)
            p.add_argument("--duration", type=float, default=10.0)
            p.add_argument("--warmup", type=float, default=1.0)
            p.add_argument("--rate", type=float, default=0.0)
            p.add_argument("--server-pid", type=int, default=0)
    a = ap.parse_args()
    try:
        parse_url(a.url)
        if a.keys < 1 or a.value_bytes < 1 or a.timeout <= 0:
            raise ValueError("--keys, --value-bytes and --timeout must be positive")
        if a.cmd == "lookup" and (a.clients < 1 or a.duration <= 0 or a.warmup < 0 or a.rate < 0):
            raise ValueError("--clients and --duration must be positive, --warmup and --rate not negative")
        value_for(0, a.value_bytes)
    except ValueError as e:
        print(f"metadata_load: {e}", file=sys.stderr)
        return 2
    return register(a) if a.cmd == "register" else lookup(a)


if __name__ == "__main__":
    sys.exit(main())
