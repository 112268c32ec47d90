"""The CPU time a bench's processes and the whole machine spent over a window: a step's figure is the link's
only where the cores had time to spare.

``CpuWatch`` samples ``/proc/<pid>/stat`` of each watched process and ``/proc/stat`` every ``interval_s`` in a
thread, stamped with ``time.monotonic()`` (one clock for every process of the host, network namespaces
included, so trainers' step times line up with it). ``CpuWatch.window(t0, t1)`` gives what each process and the
machine spent between the samples around ``t0`` and ``t1``. Linux only; elsewhere nothing is sampled.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
INTERVAL_S = 0.05


def process_cpu(pid: int) -> float | None:
    """User plus system CPU seconds process ``pid`` has used (None: it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # (the command name may hold spaces and parentheses)
    try:
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (IndexError, ValueError):
        return None


def machine_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of all cores since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    ticks = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return (total - ticks[3] - ticks[4]) / CLK_TCK, total / CLK_TCK


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    machine: tuple[float, float] | None
    procs: dict[str, float | None]


@dataclass(frozen=True)
class CpuWindow:
    """CPU seconds spent in a window of ``seconds``: per watched process (by name; None: not sampled at both
    ends), and by the whole machine (``busy`` of ``total``, all cores; None: unknown)."""

    seconds: float
    procs: dict[str, float | None]
    busy: float | None
    total: float | None


class CpuWatch:
    """Samples named processes' CPU time and the machine's in a background thread (module docstring)."""

    def __init__(self, pids: dict[str, int], interval_s: float = INTERVAL_S) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> Sample:
        s = Sample(time.monotonic(), machine_cpu(), {name: process_cpu(pid) for name, pid in self.pids.items()})
        self.samples.append(s)
        return s

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cpuwatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def window(self, t0: float, t1: float) -> CpuWindow | None:
        """What was spent from the last sample at or before ``t0`` to the first at or after ``t1`` (None: the
        samples do not cover the window)."""
        before = [s for s in self.samples if s.at <= t0]
        after = [s for s in self.samples if s.at >= t1]
        if not before or not after or t1 <= t0:
            return None
        a, b = before[-1], after[0]
        procs: dict[str, float | None] = {}
        for name in self.pids:
            x, y = a.procs.get(name), b.procs.get(name)
            procs[name] = None if x is None or y is None else max(0.0, y - x)
        busy = total = None
        if a.machine is not None and b.machine is not None:
            busy, total = b.machine[0] - a.machine[0], b.machine[1] - a.machine[1]
        return CpuWindow(b.at - a.at, procs, busy, total)
