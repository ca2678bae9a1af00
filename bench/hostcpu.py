"""bench/hostcpu.py: what else the host did with the CPUs around a measurement, from /proc/stat.

Two figures a comparison needs beside its own:
  busy_pct   the share of all CPUs' time that was not idle over a short sample taken before a
             measurement (other processes on this machine: a build, a leftover child);
  steal_pct  the share of all CPUs' time the hypervisor gave to someone else *during* the
             measurement ("steal" in /proc/stat). On a shared virtual machine that share
             swings from 0 to a quarter within minutes, and work that wakes threads often
             (small tcp requests, a first message after a silence) loses far more than its
             share: a vCPU that was descheduled takes the wake-up late. A figure taken while
             steal was high says more about the host than about the program.

Used by bench/small, bench/compare and bench/idle; import it with the bench directory on
sys.path (they add it).
"""

import time

# A measurement during which the hypervisor took more than this share of the CPUs is flagged.
STEAL_WARN_PCT = 5.0


def _sample():
    """(total, idle, steal) jiffies of all CPUs, or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    # guest and guest_nice (v[8], v[9]) are already counted in user and nice.
    return sum(v[:8]), idle, steal


def busy_pct(seconds=0.5):
    """Share (%) of all CPUs' time that was not idle over the next `seconds`; None when
    /proc/stat cannot be read."""
    a = _sample()
    time.sleep(seconds)
    b = _sample()
    if a is None or b is None:
        return None
    return round(100.0 * (1 - (b[1] - a[1]) / max(1, b[0] - a[0])), 1)


class Steal:
    """Measures the hypervisor's share of the CPUs over a span: `with Steal() as s: ...`, then
    `s.pct` (None when /proc/stat cannot be read)."""

    def __init__(self):
        self.pct = None
        self._start = None

    def __enter__(self):
        self._start = _sample()
        return self

    def __exit__(self, *exc):
        end = _sample()
        if self._start is not None and end is not None:
            self.pct = round(100.0 * (end[2] - self._start[2]) / max(1, end[0] - self._start[0]), 1)
        return False


def steal_note(pcts, what="measurements"):
    """One line saying how many of `pcts` (steal shares, None ignored) were above
    STEAL_WARN_PCT and the largest, or None when none was."""
    known = [p for p in pcts if p is not None]
    high = [p for p in known if p > STEAL_WARN_PCT]
    if not high:
        return None
    return (f"warning: in {len(high)} of {len(known)} {what} the hypervisor took more than "
            f"{STEAL_WARN_PCT:g} % of the CPUs (up to {max(high):.0f} %; steal in /proc/stat): "
            f"those figures say more about the host than about the programs")
