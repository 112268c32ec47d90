"""`peerd bench soak`'s instruments: CPU, memory, kernel queues and the ping probe it samples while a swarm is
under attack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ..swarm import Node
from .soak_probe import PING_TIMEOUT_S

RATE_METRIC = "peerd_pacing_rate_bytes"
SAMPLE_S = 0.5  # RSS and pacing-rate samples
QUEUE_S = 0.05  # the daemons' kernel receive queues are sampled this often



def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _scrape(addr: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One daemon's metrics as {(sample name, labels): value}; {} when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=2.0) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/PID/stat), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Cpu:
    """A process's CPU at one moment, for differences over a few seconds: its threads' schedstat (nanoseconds; the
    ticks of /proc/PID/stat are 10 ms, 0.7 us a datagram over the outsider phase's 15,000 a daemon) where the same
    threads ran at both ends, else the ticks (an exited thread's time is only in those)."""

    def __init__(self, pid: int) -> None:
        self.ticks = _cpu_s(pid)
        self.tids: set[str] = set()
        self.fine = 0.0
        try:
            self.tids = set(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            return
        self.fine = _task_cpu_s(pid, self.tids)

    def since(self, earlier: _Cpu) -> float:
        if self.tids and self.tids == earlier.tids:
            return self.fine - earlier.fine
        return self.ticks - earlier.ticks


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values), q))


class _Monitor:
    """Samples every daemon's RSS and pacing rate, tagged with the bench's current phase."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.phase = "calm"
        self.rss: dict[str, list[float]] = {}  # phase -> samples (max over daemons)
        self.rss_by_node: list[float] = [0.0] * len(nodes)
        self.rates: dict[str, list[float]] = {}  # phase -> nonzero pacing rates seen (any daemon)
        self.exited: set[int] = set()
        self.peers: dict[str, list[float]] = {}  # phase -> routing-table sizes seen (peerd_dht_peers)
        self.records: dict[str, list[float]] = {}  # phase -> DHT store sizes seen (peerd_dht_records)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="soak-monitor", daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        phase = self.phase
        top = 0.0
        for i, node in enumerate(self.nodes):
            if not node.alive():
                self.exited.add(i)
                continue
            rss = _rss_mb(node.proc.pid)
            if rss is not None:
                self.rss_by_node[i] = rss
                top = max(top, rss)
                self.rss.setdefault(f"{phase}:{i}", []).append(rss)
            metrics = node.status.get("metrics")
            if metrics:
                samples = _scrape(metrics)
                rate = samples.get((RATE_METRIC, ()), 0.0)
                self.peers.setdefault(phase, []).append(samples.get(("peerd_dht_peers", ()), 0.0))
                self.records.setdefault(phase, []).append(samples.get(("peerd_dht_records", ()), 0.0))
                if rate > 0:
                    self.rates.setdefault(phase, []).append(rate)
        self.rss.setdefault(phase, []).append(top)


def _udp_queues(ports: set[int]) -> dict[int, tuple[int, int]]:
    """Port -> (bytes queued in its receive buffer, datagrams the kernel dropped there) from /proc/net/udp (and
    udp6): where a PING waits, or is lost, before a daemon's receive loop sees it."""
    out: dict[int, tuple[int, int]] = {}
    for name in ("/proc/net/udp", "/proc/net/udp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            try:
                port = int(cols[1].rsplit(":", 1)[1], 16)
                if port in ports:
                    out[port] = (int(cols[4].split(":")[1], 16), int(cols[-1]))
            except (IndexError, ValueError):
                continue
    return out


class _Queues:
    """Samples the honest daemons' kernel receive queues every QUEUE_S, tagged with the bench's phase: the
    deepest queue seen and the kernel's drops, per phase."""

    def __init__(self, nodes: list[Node]) -> None:
        self.ports = {_hostport(n.listen)[1] for n in nodes}
        self.phase = "calm"
        self.deepest: dict[str, int] = {}  # phase -> the most bytes queued at one daemon
        self.drops: dict[str, int] = {}  # phase -> datagrams dropped by the kernel (all daemons)
        self._last: dict[int, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="soak-queues", daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(QUEUE_S):
            self.sample()

    def sample(self) -> None:
        phase = self.phase
        for port, (queued, dropped) in _udp_queues(self.ports).items():
            self.deepest[phase] = max(self.deepest.get(phase, 0), queued)
            if port in self._last and dropped > self._last[port]:
                self.drops[phase] = self.drops.get(phase, 0) + dropped - self._last[port]
            self._last[port] = dropped

    def report(self) -> dict[str, dict[str, float]]:
        return {p: {"deepest_queue_kb": round(self.deepest.get(p, 0) / 1024, 1), "kernel_drops": self.drops.get(p, 0)}
                for p in self.deepest}


class _Probe:
    """The PING prober (peerd/tools/bench/soak_probe.py) in its own process; its samples are cut into the bench's
    phases by their CLOCK_MONOTONIC timestamps (the same clock in every process)."""

    def __init__(self, workdir: str, key_file: str, targets: list[tuple[str, int]], ids: list[str]) -> None:
        self.path = os.path.join(workdir, "pings.txt")
        cfg = {"key_file": key_file, "targets": [list(t) for t in targets], "ids": ids, "out": self.path,
               "max_s": 3600}
        self.proc = subprocess.Popen([sys.executable, "-m", "peerd.tools.bench.soak_probe", json.dumps(cfg)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.marks: list[tuple[float, str]] = [(0.0, "calm")]
        self.stop = threading.Event()  # (the interface of the bench's other workers)

    @property
    def phase(self) -> str:
        return self.marks[-1][1]

    @phase.setter
    def phase(self, name: str) -> None:
        self.marks.append((time.monotonic(), name))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def samples(self, now: float | None = None) -> tuple[dict[str, list[float]], dict[str, int]]:
        """Round trips (ms, a lost PING counted as PING_TIMEOUT_S) and lost PINGs, by phase."""
        rtt: dict[str, list[float]] = {}
        lost: dict[str, int] = {}
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except OSError:
            return rtt, lost
        for line in lines:
            try:
                t, ms = (float(x) for x in line.split()[:2])  # (a third column: the daemon it went to)
            except ValueError:
                continue  # a line cut short
            phase = self.marks[0][1]
            for at, name in self.marks:
                if t >= at:
                    phase = name
            if ms < 0:
                lost[phase] = lost.get(phase, 0) + 1
                ms = PING_TIMEOUT_S * 1000
            rtt.setdefault(phase, []).append(ms)
        return rtt, lost


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _task_cpu_s(pid: int, tasks: Iterable[str] | None = None) -> float:
    """CPU seconds of every thread of ``pid`` (or of its threads ``tasks``) from /proc/PID/task/*/schedstat
    (nanoseconds: /proc/PID/stat's ticks are 10 ms, too coarse for a few seconds of a few percent)."""
    total = 0
    if tasks is None:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return 0.0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9
