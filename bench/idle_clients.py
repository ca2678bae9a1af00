#!/usr/bin/env python3
"""bench/idle_clients.py: hold idle connections open against a multirail target (used by bench/soak).

Two kinds of connection, spread round-robin over the given addresses:
  members    complete the membership handshake of crates/multirail/src/transport/handshake.rs
             (hello, challenge, proof, verdict) as a control, data or message connection (in
             turn), then say nothing. The target should keep them open as long as they live.
  strangers  connect and send nothing. The target should turn them away once its
             connect_timeout_ms passes (3 s by default); each is then reconnected after a pause,
             so the target sees a steady trickle of unproven connections.

The handshake, as the module documents it:
  client -> server  hello      40 B  "MRAL", version u16 LE, kind u8, flags u8 = 0, client nonce [32]
  server -> client  challenge  72 B  "MRAC", version u16 LE, auth u8, 0, server nonce [32], server proof [32]
  client -> server  proof      32 B  HMAC-SHA256(token, "multirail-client\\0" | kind | server nonce | client nonce),
                                     zeros without a token
  server -> client  verdict     4 B  0xA7, status (0 accepted, 1 refused), 0, 0
With a token the server's proof, HMAC-SHA256(token, "multirail-server\\0" | kind | client nonce |
server nonce), is checked too, as an engine does.

Token: MULTIRAIL_TOKEN in the environment (kept off the command line), or --token.
Prints one JSON status line on stdout every --interval seconds and a last one on exit; exits on
SIGTERM/SIGINT or when stdin closes (so it never outlives the script that started it).
Usage: bench/idle_clients.py --addr HOST:PORT [--addr ...] [--members N] [--strangers N]
       [--interval S] [--protocol-version V]
"""
import argparse
import errno
import hashlib
import hmac
import json
import os
import selectors
import signal
import socket
import statistics
import struct
import sys
import time

HELLO_MAGIC = b"MRAL"
CHALLENGE_MAGIC = b"MRAC"
VERDICT_MARK = 0xA7
SERVER_LABEL = b"multirail-server\0"
CLIENT_LABEL = b"multirail-client\0"
KINDS = {1: "control", 2: "data", 3: "message"}


class HandshakeError(Exception):
    pass


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise HandshakeError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def mac(token, label, kind, first, second):
    return hmac.new(token, label + bytes([kind]) + first + second, hashlib.sha256).digest()


def handshake(s, kind, token, version):
    """Runs the client side on a connected blocking socket; raises HandshakeError."""
    client_nonce = os.urandom(32)
    s.sendall(HELLO_MAGIC + struct.pack("<HBB", version, kind, 0) + client_nonce)
    ch = recv_exact(s, 72)
    if ch[:4] != CHALLENGE_MAGIC:
        raise HandshakeError(f"bad challenge magic {ch[:4]!r}")
    v = struct.unpack("<H", ch[4:6])[0]
    if v != version:
        raise HandshakeError(f"server speaks protocol version {v}, this client {version}")
    auth, server_nonce, server_proof = ch[6], ch[8:40], ch[40:72]
    if token:
        if auth != 1:
            raise HandshakeError("server requires no token but this client holds one")
        if not hmac.compare_digest(server_proof, mac(token, SERVER_LABEL, kind, client_nonce, server_nonce)):
            raise HandshakeError("server could not prove the token")
        proof = mac(token, CLIENT_LABEL, kind, server_nonce, client_nonce)
    else:
        proof = bytes(32)
    s.sendall(proof)
    verdict = recv_exact(s, 4)
    if verdict[0] != VERDICT_MARK:
        raise HandshakeError(f"bad verdict marker {verdict[0]:#04x}")
    if verdict[1] != 0:
        raise HandshakeError(f"refused (verdict status {verdict[1]})")


class Conn:
    def __init__(self, index, member, addr, kind):
        self.index, self.member, self.addr, self.kind = index, member, addr, kind
        self.sock = None
        self.since = None      # when it opened
        self.retry_at = 0.0    # when to (re)connect
        self.backoff = 0.5


class Pool:
    def __init__(self, addrs, members, strangers, token, version):
        self.token, self.version = token, version
        self.sel = selectors.DefaultSelector()
        self.conns = []
        for i in range(members):
            self.conns.append(Conn(i, True, addrs[i % len(addrs)], 1 + i % 3))
        for i in range(strangers):
            self.conns.append(Conn(members + i, False, addrs[i % len(addrs)], 0))
        self.c = {
            "member_opens": 0, "member_drops": 0, "member_drops_by_kind": {k: 0 for k in KINDS.values()},
            "member_drop_reasons": {}, "member_refusals": 0, "handshake_errors": 0,
            "stranger_opens": 0, "stranger_evictions": 0, "stranger_unexpected_bytes": 0,
            "connect_errors": 0,
        }
        self.errors = {}  # error text -> count
        self.last_error = None
        self.member_lifetimes = []  # seconds a dropped member lived
        self.stranger_lifetimes = []  # seconds until the target turned a stranger away (last 1000)

    def error(self, text):
        self.last_error = text
        self.errors[text] = self.errors.get(text, 0) + 1

    def open(self, c, now):
        host, port = c.addr.rsplit(":", 1)
        try:
            s = socket.create_connection((host, int(port)), timeout=3.0)
        except OSError as e:
            self.c["connect_errors"] += 1
            self.error(f"connect {c.addr}: {e.strerror or e}")
            c.retry_at = now + c.backoff
            c.backoff = min(c.backoff * 2, 8.0)
            return
        if c.member:
            try:
                s.settimeout(5.0)
                handshake(s, c.kind, self.token, self.version)
            except (OSError, HandshakeError) as e:
                s.close()
                if isinstance(e, HandshakeError) and "refused" in str(e):
                    self.c["member_refusals"] += 1
                self.c["handshake_errors"] += 1
                self.error(f"handshake {c.addr} ({KINDS[c.kind]}): {e}")
                c.retry_at = now + c.backoff
                c.backoff = min(c.backoff * 2, 8.0)
                return
            self.c["member_opens"] += 1
        else:
            self.c["stranger_opens"] += 1
        s.setblocking(False)
        c.sock, c.since, c.backoff = s, time.monotonic(), 0.5
        self.sel.register(s, selectors.EVENT_READ, c)

    def readable(self, c, now):
        try:
            data = c.sock.recv(4096)
            reason = "closed by the target (EOF)" if not data else "target sent unexpected bytes"
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            data, reason = b"", f"reset: {e.strerror or e}"
        lived = now - c.since
        if c.member:
            self.c["member_drops"] += 1
            self.c["member_drops_by_kind"][KINDS[c.kind]] += 1
            self.c["member_drop_reasons"][reason] = self.c["member_drop_reasons"].get(reason, 0) + 1
            self.member_lifetimes.append(round(lived, 2))
            c.retry_at = now + 1.0
        else:
            if data:
                self.c["stranger_unexpected_bytes"] += 1
            self.c["stranger_evictions"] += 1
            self.stranger_lifetimes.append(lived)
            del self.stranger_lifetimes[:-1000]
            c.retry_at = now + 0.5
        self.sel.unregister(c.sock)
        c.sock.close()
        c.sock = None

    def status(self, t0, final=False):
        sl = self.stranger_lifetimes
        return {
            "t": round(time.monotonic() - t0, 2),
            "final": final,
            "members_open": sum(1 for c in self.conns if c.member and c.sock),
            "members_total": sum(1 for c in self.conns if c.member),
            "strangers_open": sum(1 for c in self.conns if not c.member and c.sock),
            "strangers_total": sum(1 for c in self.conns if not c.member),
            **self.c,
            "stranger_eviction_s_p50": round(statistics.median(sl), 2) if sl else None,
            "stranger_eviction_s_max": round(max(sl), 2) if sl else None,
            "member_lifetimes_s": self.member_lifetimes[-20:],
            "errors": dict(sorted(self.errors.items(), key=lambda kv: -kv[1])[:10]),
            "last_error": self.last_error,
        }

    def close(self):
        for c in self.conns:
            if c.sock:
                c.sock.close()


def main():
    ap = argparse.ArgumentParser(description="hold idle member and stranger connections open against a multirail target")
    ap.add_argument("--addr", action="append", required=True, help="target HOST:PORT (repeat to spread over several)")
    ap.add_argument("--members", type=int, default=160)
    ap.add_argument("--strangers", type=int, default=40)
    ap.add_argument("--token", help="membership token (default: MULTIRAIL_TOKEN, else none)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between status lines (default 5)")
    ap.add_argument("--protocol-version", type=int, default=3, help="PROTOCOL_VERSION in segment.rs (default 3)")
    args = ap.parse_args()
    token = (args.token or os.environ.get("MULTIRAIL_TOKEN") or "").encode() or None
    pool = Pool(args.addr, args.members, args.strangers, token, args.protocol_version)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    # stdin closing (the parent died or is done) ends the helper.
    pool.sel.register(sys.stdin, selectors.EVENT_READ, None)
    t0 = time.monotonic()
    next_status = t0
    while not stop:
        now = time.monotonic()
        # (Re)connect what is due, a bounded number per round so events keep being served.
        due = [c for c in pool.conns if c.sock is None and c.retry_at <= now][:64]
        for c in due:
            pool.open(c, now)
        if now >= next_status:
            print(json.dumps(pool.status(t0)), flush=True)
            next_status = now + args.interval
        try:
            events = pool.sel.select(timeout=0.2)
        except InterruptedError:
            continue
        now = time.monotonic()
        for key, _ in events:
            if key.data is None:
                if not os.read(sys.stdin.fileno(), 4096):
                    stop.append(1)
                    pool.sel.unregister(sys.stdin)
                continue
            pool.readable(key.data, now)
    print(json.dumps(pool.status(t0, final=True)), flush=True)
    pool.close()


if __name__ == "__main__":
    main()
