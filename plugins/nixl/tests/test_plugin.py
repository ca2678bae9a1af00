"""The MULTIRAIL backend under real NIXL agents (the nixl-cu12 1.5.1 wheel), two processes,
over each transport the plugin can be told to use."""

import os
import signal
import time

import pytest

import peer
from harness import ctx, receive

TRANSPORTS = ["tcp", "shm"]

# Short enough that the dead-peer test is quick, long enough for a loaded CI machine.
TCP_TIMEOUT_MS = 1000


def start_pair(agents, scenario, transport, config=None, *extra):
    """A target and an initiator running `scenario`; returns the initiator's report pipe."""
    t_end, i_end = ctx.Pipe()
    report, report_end = ctx.Pipe()
    target = agents.start(peer.target, t_end, agents.name("target"), transport, config)
    agents.start(scenario, report_end, i_end, agents.name("initiator"), transport, config, *extra)
    return report, target


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_write_read_and_notifications(agents, transport):
    report, _ = start_pair(agents, peer.roundtrip, transport)
    out = receive(report, "result", 90)
    assert out["write"] == "DONE"
    # The target looked at its buffer the moment the notification showed up: all 1,000
    # blocks were already in place, each where its pairing said.
    assert out["seen"], "the transfer's notification never arrived"
    assert out["match"], "the notification arrived before the data"
    assert out["others"] == []
    assert out["read"] == "DONE"
    assert out["read_match"], "the READ brought back other bytes"
    assert out["read_notif_seen"], "the READ's notification never reached the agent read from"
    # Memory registered after the metadata exchange is reachable once NIXL has it.
    assert out["late_write"] == "DONE" and out["late_seen"] and out["late_match"], out
    assert out["standalone_seen"]
    # The initiator's standalone notification came keyed by the target agent's name, bytes
    # intact.
    assert out["pong"] == {out["target_name"]: [b"pong\x00\xfe"]}
    print(f"{transport}: WRITE of 1000 x 16 KiB (a first post) in {out['write_s'] * 1000:.1f} ms")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_handle_posted_100_times(agents, transport):
    report, _ = start_pair(agents, peer.repost, transport, None, 100)
    out = receive(report, "result", 110)
    assert out["bad"] == [], out
    print(f"{transport}: 100 posts of 1000 x 16 KiB in {out['seconds']:.2f} s")


def stop_peer_and_time_err(agents, transport, sig):
    config = {"transports": {"tcp": {"timeout_ms": TCP_TIMEOUT_MS}}}
    limit_s = 30
    report, target = start_pair(agents, peer.until_error, transport, config, limit_s)
    first = receive(report, "running", 60)
    assert first == "DONE"
    os.kill(target.pid, sig)
    stopped_at = time.monotonic()
    report.send(("killed", stopped_at))
    out = receive(report, "result", limit_s + 10)
    assert out["state"] == "ERR", out
    # NIXL's status for a peer gone or silent, whether the post or the check found it.
    assert out["error"] == "nixlRemoteDisconnectError", out
    # Within the transport timeout, plus room for a busy machine.
    assert out["after_s"] <= TCP_TIMEOUT_MS / 1000 + 3.0, out
    print(f"{transport}: ERR {out['after_s']:.3f} s after {signal.Signals(sig).name} "
          f"({out['posts']} posts)")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_peer_turns_transfers_to_err(agents, transport):
    stop_peer_and_time_err(agents, transport, signal.SIGKILL)


def test_frozen_peer_turns_transfers_to_err_after_the_timeout(agents):
    """A peer that stops answering without closing anything (SIGSTOP: no FIN, no RST) is
    found out by the transport timeout alone. TCP only: shm copies into a stopped process's
    memory work, since the kernel does them."""
    stop_peer_and_time_err(agents, "tcp", signal.SIGSTOP)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_teardown_leaves_no_connection(agents, transport):
    report, _ = start_pair(agents, peer.cleanup, transport)
    out = receive(report, "result", 90)
    assert out["state"] == "DONE" and out["seen"] and out["match"], out
    # Notifications travel over TCP whatever carries the data, so there were connections.
    assert out["during"], "no TCP connection while the agents talked: the check sees nothing"
    assert out["left"] == [], "the initiator kept connections after remove_remote_agent"
    assert out["target_left"] == [], "the target kept connections after remove_remote_agent"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_local_transfer_within_one_agent(agents, transport):
    report, end = ctx.Pipe()
    name = agents.name("solo")
    agents.start(peer.loopback, end, name, transport, None)
    out = receive(report, "result", 60)
    assert out["state"] == "DONE"
    assert out["match"]
    assert out["notifs"] == {name: [b"self"]}


def test_options_and_their_errors(agents):
    report, end = ctx.Pipe()
    agents.start(peer.options, end, agents.name("options"))
    out = receive(report, "result", 60)
    assert out["plugins"] == ["MULTIRAIL"]
    assert out["params"] == {"config": "", "transport": "auto", "listen": "", "priority": "high"}
    assert out["mems"] == ["DRAM_SEG"]
    # A backend with a bad option is refused at creation, not at its first transfer.
    assert all(v != "created" for v in out["bad"].values()), out["bad"]
    assert out["created"]
