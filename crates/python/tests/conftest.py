import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pattern(seed: int, n: int) -> np.ndarray:
    """Deterministic bytes both processes can generate."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Peer:
    """A peer.py child process: another engine, in another Python process."""

    def __init__(self, api: str, size: int, transport: str, host: str = "127.0.0.1", netns=None) -> None:
        env = dict(os.environ)
        env.pop("MULTIRAIL_CONF", None)
        inside = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen(
            [*inside, sys.executable, os.path.join(HERE, "peer.py"), api, str(size), transport, host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"peer {api} exited with {self.proc.wait()} before saying hello")
        info = json.loads(hello)
        self.name, self.addr, self.size = info["name"], info["addr"], info["size"]

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer died: exit {self.proc.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
            except (BrokenPipeError, RuntimeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def spawn_peer():
    peers = []

    def spawn(api: str = "native", size: int = 8 << 20, transport: str = "tcp", host: str = "127.0.0.1", netns=None) -> Peer:
        """A peer process; `host` is the address it is named after, `netns` a network namespace
        to run it in."""
        p = Peer(api, size, transport, host, netns)
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.close()


RAILS = os.path.join(HERE, "..", "..", "..", "scripts", "rails")


@pytest.fixture
def two_rails():
    """Two veth rails between two network namespaces (scripts/rails); skips where they cannot be
    made (not root, no iproute2). Yields the prefix P: namespaces Pa and Pb, rail i is
    10.77.i.1 (in Pa) <-> 10.77.i.2 (in Pb)."""
    prefix = f"py{os.getpid() % 100000}"
    up = subprocess.run([RAILS, "up", "2", "1gbit", "1gbit", "--prefix", prefix], capture_output=True, text=True)
    if up.returncode == 77:
        pytest.skip(f"no rails here: {up.stderr.strip()}")
    assert up.returncode == 0, up.stderr
    try:
        yield prefix
    finally:
        subprocess.run([RAILS, "teardown", "--prefix", prefix], capture_output=True)
