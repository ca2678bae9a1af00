"""The agents of the NIXL plugin tests, one per child process.

Each runs a real `nixl_agent` from the nixl-cu12 wheel with only the MULTIRAIL backend. The
target owns a landing buffer and obeys commands; the initiator runs one scenario, driving the
target over a pipe of their own, and reports what it saw to the test over another. A role that
fails sends ("error", traceback) instead of going silent, so the test reports the failure
instead of timing out.
"""

import json
import os
import time
import traceback

import numpy as np

BLOCK = 16 * 1024
BLOCKS = 1000

# The remote block local block i goes to: a permutation, so NIXL cannot merge the 1,000
# descriptors into one contiguous range, and every pairing of local i with remote i is checked.
PERM = [(i * 7 + 3) % BLOCKS for i in range(BLOCKS)]

# A notification that is not text: NUL, bytes that are not UTF-8, the framing's own separator.
BINARY_NOTIF = b"done:\x00\xff\xfe:nixl1:\x80" + bytes(range(256))


def make_agent(name, transport, config=None):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    params = {"transport": transport}
    if config is not None:
        params["config"] = json.dumps(config)
    agent.create_backend("MULTIRAIL", params)
    return agent


def register(agent, array):
    return agent.register_memory([(array.ctypes.data, array.nbytes, 0, "")], "DRAM")


def block_descs(array):
    return [(array.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]


_BASE = np.random.default_rng(2024).integers(0, 256, size=BLOCKS * BLOCK, dtype=np.uint8)


def pattern(seed):
    """BLOCKS blocks of BLOCK bytes, all different, and different for every seed mod 256:
    random bytes once, shifted by the seed (cheap enough to make 100 times)."""
    return _BASE + np.uint8(seed % 256)


def written_by(source):
    """What the target buffer holds once block i of `source` went to block PERM[i]."""
    out = np.empty_like(source)
    src = source.reshape(BLOCKS, BLOCK)
    out.reshape(BLOCKS, BLOCK)[PERM] = src
    return out


# The class of the exception behind the latest "ERR" (NIXL raises one per error status, e.g.
# nixlRemoteDisconnectError for NIXL_ERR_REMOTE_DISCONNECT).
LAST_ERR = {"class": None}


def wait_done(agent, handle, timeout):
    """Polls a posted handle: "DONE", "ERR" (NIXL raises on an error status) or "TIMEOUT"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = agent.check_xfer_state(handle)
        except Exception as e:
            LAST_ERR["class"] = type(e).__name__
            return "ERR"
        if state != "PROC":
            return state
        if time.monotonic() > deadline:
            return "TIMEOUT"


def post(agent, handle, notif=b""):
    try:
        return agent.transfer(handle, notif)
    except Exception as e:
        LAST_ERR["class"] = type(e).__name__
        return "ERR"


def run_xfer(agent, handle, notif=b"", timeout=30.0):
    state = post(agent, handle, notif)
    if state == "PROC":
        state = wait_done(agent, handle, timeout)
    return state


def _own_socket_inodes():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def _tcp_sockets(state):
    """(local port, remote port) of this process's TCP sockets in `state` (hex, as the kernel
    writes it). /proc/net/tcp lists the whole network namespace, so sockets are matched to this
    process's descriptors by inode."""
    inodes = _own_socket_inodes()
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == state and f[9] in inodes:
                out.append((int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16)))
    return out


def established_tcp():
    return _tcp_sockets("01")


def wait_no_tcp(timeout=5.0):
    """Waits for this process's established TCP connections to close; returns those left."""
    deadline = time.monotonic() + timeout
    while True:
        left = established_tcp()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def guarded(role):
    def run(*args):
        conn = args[0]
        try:
            role(*args)
        except BaseException:
            try:
                conn.send(("error", traceback.format_exc()))
            except Exception:
                pass

    run.__name__ = role.__name__
    run.__qualname__ = role.__qualname__
    return run


def expect(conn, what):
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("the other agent failed:\n" + msg[1])
    if msg[0] != what:
        raise RuntimeError(f"expected {what!r}, got {msg!r}")
    return msg[1:]


# ---- the target ----


@guarded
def target(conn, name, transport, config):
    agent = make_agent(name, transport, config)
    bufs = [np.zeros(BLOCKS * BLOCK, dtype=np.uint8)]
    regs = [register(agent, bufs[0])]
    conn.send(("md", agent.get_agent_metadata(), bufs[0].ctypes.data))
    peer = None
    while True:
        cmd = conn.recv()
        op = cmd[0]
        if op == "add":
            peer = agent.add_remote_agent(cmd[1])
            peer = peer.decode() if isinstance(peer, bytes) else peer
            conn.send(("added", peer))
        elif op == "register":
            # One more buffer, registered after the peer loaded our metadata.
            bufs.append(np.zeros(BLOCKS * BLOCK, dtype=np.uint8))
            regs.append(register(agent, bufs[-1]))
            conn.send(("md", agent.get_agent_metadata(), bufs[-1].ctypes.data))
        elif op == "expect":
            # Wait for `message` from the peer; check buffer `region` the moment it is seen.
            _, message, seed, timeout, region = cmd
            buf = bufs[region]
            want = written_by(pattern(seed)) if seed is not None else None
            deadline = time.monotonic() + timeout
            seen, match, others = False, None, []
            while not seen and time.monotonic() < deadline:
                for sender, msgs in agent.get_new_notifs().items():
                    for m in msgs:
                        if not seen and sender == peer and m == message:
                            seen = True
                            if want is not None:
                                match = bool(np.array_equal(buf, want))
                        else:
                            others.append((sender, m))
            conn.send(("expected", seen, match, others))
        elif op == "notify":
            agent.send_notif(peer, cmd[1])
            conn.send(("notified",))
        elif op == "cleanup":
            if peer is not None:
                agent.remove_remote_agent(peer)
            for reg in regs:
                agent.deregister_memory(reg)
            conn.send(("cleaned", wait_no_tcp()))
        elif op == "exit":
            conn.send(("bye",))
            return


# ---- the initiator's scenarios ----


class Session:
    """The initiator's agent with its buffers registered, the target's metadata loaded and
    ours loaded by the target, and one prepared 1,000-descriptor handle per direction."""

    def __init__(self, tconn, name, transport, config):
        self.tconn = tconn
        self.agent = a = make_agent(name, transport, config)
        self.src = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
        self.back = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
        self.regs = [register(a, self.src), register(a, self.back)]
        md, remote_addr = expect(tconn, "md")
        peer = a.add_remote_agent(md)
        self.peer = peer.decode() if isinstance(peer, bytes) else peer
        tconn.send(("add", a.get_agent_metadata()))
        expect(tconn, "added")

        remote = [(remote_addr + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
        self.remote = a.prep_xfer_dlist(self.peer, remote, "DRAM")
        self.local_src = a.prep_xfer_dlist("", block_descs(self.src), "DRAM")
        self.local_back = a.prep_xfer_dlist("", block_descs(self.back), "DRAM")
        idx = list(range(BLOCKS))
        # Local block i pairs with remote block PERM[i], in both directions.
        self.write = a.make_prepped_xfer("WRITE", self.local_src, idx, self.remote, PERM)
        self.read = a.make_prepped_xfer("READ", self.local_back, idx, self.remote, PERM)

    def target_saw(self, message, seed, timeout=30.0, region=0):
        """Has the target check buffer `region` when `message` arrives: (seen, bytes matched,
        other notifications)."""
        self.tconn.send(("expect", message, seed, timeout, region))
        seen, match, others = expect(self.tconn, "expected")
        return seen, match, others

    def close(self):
        a = self.agent
        for h in (self.write, self.read):
            a.release_xfer_handle(h)
        for d in (self.remote, self.local_src, self.local_back):
            a.release_dlist_handle(d)
        a.remove_remote_agent(self.peer)
        for r in self.regs:
            a.deregister_memory(r)


@guarded
def roundtrip(report, tconn, name, transport, config):
    """WRITE 1,000 x 16 KiB with a binary notification the target checks its bytes on, READ
    them back, and standalone notifications both ways."""
    s = Session(tconn, name, transport, config)
    out = {"descriptors": BLOCKS}
    s.src[:] = pattern(1)
    t0 = time.monotonic()
    out["write"] = run_xfer(s.agent, s.write, BINARY_NOTIF)
    out["write_s"] = time.monotonic() - t0
    out["seen"], out["match"], out["others"] = s.target_saw(BINARY_NOTIF, 1)

    # A READ's notification goes to the agent read from, once the bytes are here.
    out["read"] = run_xfer(s.agent, s.read, b"read done")
    out["read_match"] = bool(np.array_equal(s.back, s.src))
    out["read_notif_seen"] = s.target_saw(b"read done", None)[0]

    # Memory the target registers after we loaded its metadata: its metadata loaded again
    # (NIXL adds the new region), and a transfer into it.
    tconn.send(("register",))
    md, addr2 = expect(tconn, "md")
    s.agent.add_remote_agent(md)
    remote2 = s.agent.prep_xfer_dlist(s.peer, [(addr2 + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM")
    h2 = s.agent.make_prepped_xfer("WRITE", s.local_src, list(range(BLOCKS)), remote2, PERM)
    s.src[:] = pattern(2)
    out["late_write"] = run_xfer(s.agent, h2, b"late")
    out["late_seen"], out["late_match"], _ = s.target_saw(b"late", 2, region=1)
    s.agent.release_xfer_handle(h2)
    s.agent.release_dlist_handle(remote2)

    s.agent.send_notif(s.peer, b"ping\x00\xff")
    out["standalone_seen"] = s.target_saw(b"ping\x00\xff", None)[0]
    tconn.send(("notify", b"pong\x00\xfe"))
    expect(tconn, "notified")
    got = {}
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = s.agent.get_new_notifs()
    out["pong"] = {k: [bytes(m) for m in v] for k, v in got.items()}
    out["target_name"] = s.peer

    s.close()
    tconn.send(("exit",))
    expect(tconn, "bye")
    report.send(("result", out))


@guarded
def repost(report, tconn, name, transport, config, times):
    """The same prepared WRITE handle posted `times` times, the source changed each time; the
    target checks its bytes when each post's notification arrives."""
    s = Session(tconn, name, transport, config)
    bad = []
    t0 = time.monotonic()
    for k in range(times):
        s.src[:] = pattern(100 + k)
        state = run_xfer(s.agent, s.write, b"post %d" % k)
        if state != "DONE":
            bad.append((k, state))
            break
        seen, match, others = s.target_saw(b"post %d" % k, 100 + k)
        if not (seen and match) or others:
            bad.append((k, seen, match, others))
            break
    elapsed = time.monotonic() - t0
    s.close()
    tconn.send(("exit",))
    expect(tconn, "bye")
    report.send(("result", {"posts": times, "bad": bad, "seconds": elapsed}))


@guarded
def until_error(report, tconn, name, transport, config, limit_s):
    """Posts the WRITE handle again and again; once the test says the target was killed,
    reports when the first error came (CLOCK_MONOTONIC, comparable across processes)."""
    s = Session(tconn, name, transport, config)
    s.src[:] = pattern(7)
    first = run_xfer(s.agent, s.write)
    report.send(("running", first))
    (killed_at,) = expect(report, "killed")
    state, at, posts = None, None, 0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        posts += 1
        state = post(s.agent, s.write)
        if state == "PROC":
            state = wait_done(s.agent, s.write, limit_s)
        if state == "ERR":
            at = time.monotonic()
            break
    report.send(("result", {"state": state, "after_s": None if at is None else at - killed_at,
                            "posts": posts, "error": LAST_ERR["class"]}))


@guarded
def cleanup(report, tconn, name, transport, config):
    """After a transfer, releasing everything and removing the remote agent leaves no TCP
    connection in either process."""
    s = Session(tconn, name, transport, config)
    s.src[:] = pattern(3)
    state = run_xfer(s.agent, s.write, b"x")
    seen, match, _ = s.target_saw(b"x", 3)
    during = established_tcp()
    s.close()
    left = wait_no_tcp()
    tconn.send(("cleanup",))
    (target_left,) = expect(tconn, "cleaned")
    tconn.send(("exit",))
    expect(tconn, "bye")
    report.send(("result", {"state": state, "seen": seen, "match": match, "during": during,
                            "left": left, "target_left": target_left}))


@guarded
def loopback(report, name, transport, config):
    """A transfer between two buffers of one agent (NIXL's local transfers)."""
    a = make_agent(name, transport, config)
    src = pattern(9)
    dst = np.zeros_like(src)
    regs = [register(a, src), register(a, dst)]
    local = a.prep_xfer_dlist("", block_descs(src), "DRAM")
    mine = a.prep_xfer_dlist(name, block_descs(dst), "DRAM")
    h = a.make_prepped_xfer("WRITE", local, list(range(BLOCKS)), mine, PERM, b"self")
    state = run_xfer(a, h)
    match = bool(np.array_equal(dst, written_by(src)))
    got = {}
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = a.get_new_notifs()
    a.release_xfer_handle(h)
    a.release_dlist_handle(local)
    a.release_dlist_handle(mine)
    for r in regs:
        a.deregister_memory(r)
    report.send(("result", {"state": state, "match": match,
                            "notifs": {k: [bytes(m) for m in v] for k, v in got.items()}}))


@guarded
def options(report, name):
    """What the plugin advertises, and that a bad option fails backend creation."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(backends=[]))
    out = {
        "plugins": list(a.get_plugin_list()),
        "params": dict(a.get_plugin_params("MULTIRAIL")),
        "mems": list(a.get_plugin_mem_types("MULTIRAIL")),
    }
    bad = {}
    for i, (key, value) in enumerate((("transport", "carrier-pigeon"), ("priority", "urgent"),
                                      ("config", '{"no_such_key": 1}'),
                                      ("config", "/nonexistent/multirail.json"))):
        # A fresh agent each time: an agent holds one backend of a type.
        b = nixl_agent(f"{name}-bad{i}", nixl_agent_config(backends=[]))
        try:
            b.create_backend("MULTIRAIL", {key: value})
            bad[f"{key}={value}"] = "created"
        except Exception as e:
            bad[f"{key}={value}"] = type(e).__name__
    out["bad"] = bad
    a.create_backend("MULTIRAIL", {"transport": "tcp", "priority": "low", "config": "{}"})
    out["created"] = "MULTIRAIL" in a.backends
    report.send(("result", out))
