"""How much of the machine other work took while we timed something.

A timing taken while another process computes reads slow, and nothing in the timing says so: a
calibration run beside a test suite measured llama.cpp's 32-token prefill at 2.1 s (0.1 s on an
idle machine) and its step at 20 ms (7.4 ms), so every request of its two-engine profile went to
the torch engine. :class:`CpuWatch` measures, over a span of wall time, the **others' share**: the
CPU time the rest of the machine used (other processes, and the hypervisor's *steal*: time our
virtual CPUs waited while the host ran someone else) over the CPU time the machine had::

    others_share = (busy_all + steal_all - busy_ours) / (wall * n_cpus)

``busy_all`` and ``steal_all`` from ``/proc/stat`` (Linux; ``None`` elsewhere), ``busy_ours``
this process's user and system time (all its threads: torch's and llama.cpp's). Example: on 2
CPUs over 10 s, the machine busy for 17 s of which this process 8 s, and no steal: the others
took (17 - 8) / 20 = 0.45 of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Others' share above which a timing is reported as taken on a busy machine: the CPU left to the
# timed work then falls below ~4/5 of the machine, and a compute-bound timing reads ~1.25x slow or
# more (for a workload that uses every CPU, as ours does).
BUSY_SHARE = 0.2

_PROC_STAT = Path("/proc/stat")


def _machine_jiffies(stat: Path = _PROC_STAT) -> tuple[int, int] | None:
    """``(busy + steal, n_cpus)`` from the first line of ``/proc/stat`` (in clock ticks), or ``None``
    where there is none. The fields: user nice system idle iowait irq softirq steal [guest ...];
    guest time is already counted in user."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    fields = lines[0].split() if lines else []
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return user + nice + system + irq + softirq + steal, max(cpus, 1)


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuWatch:
    """The others' share (module docstring) over a span: ``with CpuWatch() as w: ...``, or
    ``w = CpuWatch().start(); ...; w.stop()``, then ``w.others_share`` (``None`` where the machine's
    counters cannot be read, or before the span ended). ``stat``: the counters' file (tests)."""

    def __init__(self, stat: Path = _PROC_STAT):
        self.stat = Path(stat)
        self.others_share: float | None = None
        self._start: tuple | None = None

    def start(self) -> CpuWatch:
        self._start = (_machine_jiffies(self.stat), _own_seconds(), time.perf_counter())
        return self

    def stop(self) -> float | None:
        """End the span: its others' share (also kept in :attr:`others_share`)."""
        if self._start is None:
            raise RuntimeError("stop() before start()")
        (start, own0, wall0), self._start = self._start, None
        end = _machine_jiffies(self.stat)
        wall = time.perf_counter() - wall0
        if start is not None and end is not None and wall > 0:
            hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
            self.others_share = others_share((end[0] - start[0]) / hz, _own_seconds() - own0, wall, end[1])
        return self.others_share

    def __enter__(self) -> CpuWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def others_share(machine_busy_s: float, own_busy_s: float, wall_s: float, cpus: int) -> float:
    """The others' share of ``cpus`` CPUs over ``wall_s`` seconds, the machine busy (steal included)
    for ``machine_busy_s`` of which this process for ``own_busy_s``, clipped to [0, 1] (the two
    counters tick at different granularities). Example: ``others_share(17, 8, 10, 2)`` = 0.45."""
    if wall_s <= 0 or cpus <= 0:
        raise ValueError(f"need a positive span and CPU count, got {wall_s} s on {cpus}")
    return min(max((machine_busy_s - own_busy_s) / (wall_s * cpus), 0.0), 1.0)


def is_busy(share: float | None) -> bool:
    """Whether timings taken while others took ``share`` of the machine read slow: above
    :data:`BUSY_SHARE` (``None``: not measured, not said to be)."""
    return share is not None and share > BUSY_SHARE


def busy_warning(what: str, share: float | None) -> str | None:
    """A one-line warning where ``share`` (the others' share while ``what`` was timed) :func:`is_busy`,
    else ``None``."""
    if not is_busy(share):
        return None
    return (f"other work used {share:.0%} of this machine's CPU while {what} was timed: its timings read slow "
            "(and the engine choice and decisions they price with them); time it again on an idle machine")
