"""How a test runs its agents: child processes started with `spawn` (forking a process that
has loaded libnixl and its threads is not safe), talking over multiprocessing pipes."""

import multiprocessing
import uuid

import pytest

ctx = multiprocessing.get_context("spawn")


class Agents:
    """The child processes of one test, killed at its end whatever happened."""

    def __init__(self):
        self.procs = []
        self.tag = uuid.uuid4().hex[:8]

    def name(self, role):
        return f"{role}-{self.tag}"

    def start(self, fn, *args):
        p = ctx.Process(target=fn, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def close(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def receive(conn, what, timeout):
    """The next message on `conn`, which must be `what`; fails the test on an agent's error
    report, on another message, or when nothing comes within `timeout` seconds."""
    if not conn.poll(timeout):
        pytest.fail(f"no {what!r} from the agent within {timeout} s")
    msg = conn.recv()
    if msg[0] == "error":
        pytest.fail("an agent failed:\n" + msg[1])
    assert msg[0] == what, msg
    return msg[1] if len(msg) == 2 else msg[1:]
