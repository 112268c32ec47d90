"""`peerd bench soak`: 4 sealed daemons average continuously while a member attacker and an outsider replay
every wire attack of docs/security.md at them.

Phases: a calm phase (averaging only: the no-attack pacing rate, ping and memory baselines), an outsider-only
phase (averages paused: an idle baseline, then only keyless datagrams, for the daemons' CPU per datagram that no
key opens), the attack (a separate process, peerd/tools/bench/soak_attack.py: steady, a burst as fast as it goes, a
steady tail), then a last round after it. Every honest average is checked exact against the weighted mean
of its group's known inputs; a member's PING round trip to the daemons is sampled all along (its own process:
soak_probe.py; a PING unanswered for 1 s counts as 1000 ms); RSS comes from /proc/PID/status and the refusal
counters from each daemon's Prometheus metrics. A fifth daemon run with ``--fault-byzantine nan`` (a hostile member
too) averages a small side run with one honest daemon at weight 1e30, for the owners' refusal of
non-finite and outsized contributions, which the wire attacker (not a group member) cannot reach.
Only 127.0.0.1 daemons this bench started are ever sent to; every process and temp dir is removed at the
end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...localsock.client import DaemonError
from ..swarm import LocalSwarm, Node
from .moshpit import _wait_connected
from .runner import run_bench
from .soak_attack import CLASSES, OUTSIDER_CPU_CLASSES
from .soak_monitor import (
    _Cpu,
    _cpu_s,
    _hostport,
    _Monitor,
    _percentile,
    _Probe,
    _progress,
    _Queues,
    _scrape,
    _task_cpu_s,
)

RUN = "bench-soak"
BAIT_RUN = "bench-soak-bait"
BAIT_SIZE = 4096
PEERS = 4
DROP_METRICS = ("peerd_datagrams_dropped_total", "peerd_dht_store_refused_total", "peerd_ignored_records_total",
                "peerd_contributions_refused_total", "peerd_background_errors_total")
TOLERANCE = 1e-5  # relative: max |result - exact| <= TOLERANCE * max |exact|
GOALS = {"rss_growth_mb": 256.0, "ping_p99_ms": 50.0, "seconds_per_million": 300.0, "outsider_cpu_us": 5.0}
SETTLE_S = 0.5  # after the averages pause, before the idle baseline


@dataclass
class SoakConfig:
    datagrams: int = 1_000_000
    size: int = 1_000_000
    rate: float = 6000.0  # datagrams/s outside the burst
    burst_share: float = 0.3  # of the datagrams, sent as fast as the attacker can
    calm_s: float = 8.0  # the no-attack phase lasts at least this long (and two averages)
    window_s: float = 3.0
    seed: int = 0
    identities: int = 64  # member identities the attacker signs with (a Sybil: node ids are free to mint)
    classes: tuple[str, ...] = CLASSES  # the attack classes to send (all by default)
    outsider_s: float = 3.0  # the outsider-only phase (its daemon CPU per datagram); 0 skips it
    outsider_rate: float = 20000.0  # datagrams/s in it

    def check(self) -> None:
        if self.datagrams < len(CLASSES) * 10:
            raise ValueError(f"--datagrams must be at least {len(CLASSES) * 10} (ten per attack class)")
        if self.size < 1:
            raise ValueError("--size must be at least 1")
        if not 100 <= self.rate <= 1e6:
            raise ValueError("--rate must be 100..1000000 datagrams/s")
        if not 0 <= self.burst_share <= 1:
            raise ValueError("--burst-share must be in [0, 1]")
        unknown = set(self.classes) - set(CLASSES)
        if unknown or not self.classes:
            raise ValueError(f"--classes: unknown {sorted(unknown)}; choose from {', '.join(CLASSES)}")
        if not 1 <= self.identities <= 4096:
            raise ValueError("--identities must be 1..4096")
        if not 0 <= self.calm_s <= 600:
            raise ValueError("--calm must be 0..600 seconds")
        if not 0 <= self.outsider_s <= 60 or not 100 <= self.outsider_rate <= 1e6:
            raise ValueError("the outsider phase must last 0..60 s at 100..1000000 datagrams/s")


class _Averager:
    """Moshpit rounds of the 4 daemons, back to back, each with known inputs; every result checked exact."""

    def __init__(self, nodes: list[Node], cfg: SoakConfig) -> None:
        self.nodes = nodes
        self.cfg = cfg
        self.ids = {n.status["peer_id"]: i for i, n in enumerate(nodes)}
        self.ok = self.failed = self.alone = 0
        self.rounds = 0
        self.round_s: list[float] = []
        self.errors: list[str] = []
        self.alone_notes: list[str] = []
        self.phase = "calm"
        self.by_phase: dict[str, dict[str, int]] = {}
        self.max_rel_err = 0.0
        self.stop = threading.Event()
        self.hold = threading.Event()  # set: start no new round (the outsider phase measures idle daemons)
        self.idle = threading.Event()  # set by the loop once it holds (no round in flight)
        self.pool = ThreadPoolExecutor(max_workers=len(nodes))
        self.thread = threading.Thread(target=self._loop, name="soak-averager", daemon=True)

    def _inputs(self, r: int) -> tuple[list[np.ndarray], list[float]]:
        vectors, weights = [], []
        for i in range(len(self.nodes)):
            rng = np.random.default_rng([self.cfg.seed, r, i])
            vectors.append(rng.standard_normal(self.cfg.size, dtype=np.float32))
            weights.append(float(rng.integers(1, 100)))
        return vectors, weights

    def _loop(self) -> None:
        r = 0
        while not self.stop.is_set():
            if self.hold.is_set():
                self.idle.set()
                time.sleep(0.05)
                continue
            self.idle.clear()
            vectors, weights = self._inputs(r)
            t0 = time.monotonic()
            phase = self.phase

            def call(i: int, vectors: list[np.ndarray] = vectors, weights: list[float] = weights) -> Any:
                try:
                    return self.nodes[i].call("avg_round", timeout=150, run=RUN, vector=vectors[i].tobytes(),
                                              weight=weights[i], timeout_s=60.0)
                except (DaemonError, OSError) as e:
                    return e

            replies = list(self.pool.map(call, range(len(self.nodes))))
            for i, reply in enumerate(replies):
                self._check(i, reply, vectors, weights, phase)
            self.round_s.append(time.monotonic() - t0)
            self.rounds += 1
            r += 1
            if all(not n.alive() for n in self.nodes):
                break

    def _check(self, i: int, reply: Any, vectors: list[np.ndarray], weights: list[float], phase: str) -> None:
        """Count one daemon's result of one round, also by the phase the round started in."""
        counts = (self.ok, self.failed, self.alone)
        self._verdict(i, reply, vectors, weights)
        tally = self.by_phase.setdefault(phase, {"ok": 0, "failed": 0, "alone": 0})
        for name, was, now in zip(("ok", "failed", "alone"), counts, (self.ok, self.failed, self.alone), strict=True):
            tally[name] += now - was

    def _verdict(self, i: int, reply: Any, vectors: list[np.ndarray], weights: list[float]) -> None:
        if isinstance(reply, Exception):
            self.failed += 1
            self.errors.append(f"peer {i}: {reply}"[:200])
            return
        stats = reply["stats"]
        result = np.frombuffer(reply["vector"], dtype="<f4")
        if stats["outcome"] == "alone":
            self.alone += 1
            if len(self.alone_notes) < 10:
                self.alone_notes.append(f"peer {i} round {stats['round']}: alone after seeing {stats['seen']} "
                                        f"({stats['matchmaking_s']:.2f} s matchmaking) {stats.get('error', '')}"[:200])
            if not np.array_equal(result, vectors[i]):
                self.failed += 1
                self.errors.append(f"peer {i}: alone, but its vector changed")
            return
        if stats["outcome"] != "averaged":
            self.failed += 1
            self.errors.append(f"peer {i}: {stats['outcome']}: {stats.get('error', '')}"[:200])
            return
        members = [self.ids.get(h) for h in stats["members"]]
        if None in members or i not in members:
            self.failed += 1
            self.errors.append(f"peer {i}: a group with members that are not the bench's daemons")
            return
        acc = np.zeros(self.cfg.size, dtype=np.float64)
        total = 0.0
        for j in members:
            acc += weights[j] * vectors[j].astype(np.float64)
            total += weights[j]
        exact = acc / total
        err = float(np.max(np.abs(result - exact))) / max(float(np.max(np.abs(exact))), 1e-30)
        self.max_rel_err = max(self.max_rel_err, err)
        if err <= TOLERANCE:
            self.ok += 1
        else:
            self.failed += 1
            self.errors.append(f"peer {i}: relative error {err:.3g} (received fraction "
                               f"{stats['received_fraction']:.4f}, group of {stats['group_size']})")


class _Bait:
    """A second hostile member: a real daemon run with ``--fault-byzantine nan`` that averages a small side run
    with one honest daemon, asking for a weight of 1e30. The honest shard owner must refuse its non-finite
    contributions and cap its weight (``peerd_contributions_refused_total``), and its result stay finite."""

    def __init__(self, honest: Node, hostile: Node) -> None:
        self.honest, self.hostile = honest, hostile
        self.rounds = self.finite = 0
        self.stop = threading.Event()
        self.phase = "calm"
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.thread = threading.Thread(target=self._loop, name="soak-bait", daemon=True)

    def _loop(self) -> None:
        ones = np.ones(BAIT_SIZE, dtype="<f4")
        while not self.stop.wait(1.0):
            if self.phase in ("calm", "outsider"):
                continue

            def call(node: Node, weight: float) -> Any:
                try:
                    return node.call("avg_round", timeout=60, run=BAIT_RUN, vector=ones.tobytes(), weight=weight,
                                     timeout_s=20.0)
                except (DaemonError, OSError) as e:
                    return e

            honest = self.pool.submit(call, self.honest, 1.0)
            self.pool.submit(call, self.hostile, 1e30)
            reply = honest.result()
            self.rounds += 1
            if not isinstance(reply, Exception) and np.isfinite(np.frombuffer(reply["vector"], "<f4")).all():
                self.finite += 1


def _counters(nodes: list[Node]) -> dict[int, dict]:
    out = {}
    for i, node in enumerate(nodes):
        addr = node.status.get("metrics")
        if addr and node.alive():
            out[i] = _scrape(addr)
    return out


def _drops(before: dict[int, dict], after: dict[int, dict]) -> dict[str, dict[str, int]]:
    """The refusal counters' growth during the attack, summed over the daemons, by label values."""
    out: dict[str, dict[str, int]] = {name: {} for name in DROP_METRICS}
    for i, samples in after.items():
        base = before.get(i, {})
        for (name, labels), value in samples.items():
            if name not in out:
                continue
            delta = int(value - base.get((name, labels), 0.0))
            if delta:
                label = "/".join(v for _, v in labels) or "total"
                out[name][label] = out[name].get(label, 0) + delta
    return out


def _handled(samples: dict) -> float:
    """Datagrams one daemon took off its socket: accepted plus dropped (what its kernel dropped is not seen)."""
    return sum(v for (name, _), v in samples.items()
               if name in ("peerd_datagrams_received_total", "peerd_datagrams_dropped_total"))


def _outsider_phase(cfg: SoakConfig, nodes: list[Node], key_file: str, workdir: str, averager: _Averager,
                    threads: list[Any], quiet: bool) -> dict[str, Any]:
    """The daemons' CPU per outsider datagram: ONLY the outsider sends (random_token, random, mutated, wrong_key at
    ``outsider_rate``), for ``outsider_s``.

    The honest averages are paused for both windows (a round's CPU would swamp the figure): first an idle baseline
    of ``outsider_s`` (daemons idle but for the PING prober and the metrics scrapes, which go on in both windows),
    then the outsider window. Per daemon: (CPU in the window - baseline CPU scaled to the window's length) /
    (datagrams it handled in the window - those of the baseline, scaled the same way)."""
    averager.hold.set()
    attacker: subprocess.Popen | None = None
    try:
        if not averager.idle.wait(timeout=150):
            raise DaemonError("the averages did not pause for the outsider phase")
        for t in threads:
            t.phase = "outsider"
        _progress(f"outsider only: idle baseline {cfg.outsider_s:.0f} s, then {cfg.outsider_rate:.0f} datagrams/s "
                  f"for {cfg.outsider_s:.0f} s ...", quiet)
        time.sleep(SETTLE_S)
        pids = [n.proc.pid for n in nodes]
        t0, cpu0, got0 = time.monotonic(), [_Cpu(p) for p in pids], _counters(nodes)
        time.sleep(cfg.outsider_s)
        t1, cpu1, got1 = time.monotonic(), [_Cpu(p) for p in pids], _counters(nodes)
        out_cfg = {
            "targets": [list(_hostport(n.listen)) for n in nodes], "key_file": key_file, "run": RUN,
            "victims": [n.status["peer_id"] for n in nodes], "datagrams": int(cfg.outsider_rate * cfg.outsider_s),
            "rate": cfg.outsider_rate, "burst_share": 0.0, "seed": cfg.seed + 1, "identities": 4,
            "classes": list(OUTSIDER_CPU_CLASSES), "responder": False, "flood_stores": 1,
        }
        with open(os.path.join(workdir, "outsider.log"), "wb") as log:
            attacker = subprocess.Popen([sys.executable, "-m", "peerd.tools.bench.soak_attack", json.dumps(out_cfg)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
        assert attacker.stdout is not None
        t2 = cpu2 = got2 = None
        summary: dict[str, Any] = {}
        for line in attacker.stdout:
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if t2 is None:  # its first line comes as it starts sending (its signing before is not counted)
                t2, cpu2, got2 = time.monotonic(), [_Cpu(p) for p in pids], _counters(nodes)
            if info.get("done"):
                summary = info
        t3, cpu3, got3 = time.monotonic(), [_Cpu(p) for p in pids], _counters(nodes)
        rc = attacker.wait(timeout=30)
        if rc != 0 or not summary or t2 is None or cpu2 is None or got2 is None:
            with open(os.path.join(workdir, "outsider.log"), errors="replace") as f:
                raise RuntimeError(f"the outsider failed (exit {rc}):\n{f.read()[-2000:]}")
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        averager.hold.clear()
    scale = (t3 - t2) / max(t1 - t0, 1e-9)
    sent = int(summary["sent"])
    per_daemon: list[float | None] = []
    handled: list[int] = []
    for i in range(len(nodes)):
        n = _handled(got3.get(i, {})) - _handled(got2.get(i, {}))
        n -= scale * (_handled(got1.get(i, {})) - _handled(got0.get(i, {})))
        if n <= 0:
            n = sent / len(nodes)  # no metrics: what was sent to it
        cpu = cpu3[i].since(cpu2[i]) - scale * cpu1[i].since(cpu0[i])
        handled.append(int(n))
        per_daemon.append(round(cpu / n * 1e6, 2))
    values = [v for v in per_daemon if v is not None]
    return {
        "outsider_cpu_us_per_datagram": max(values) if values else None,
        "outsider_cpu_us_per_datagram_by_daemon": per_daemon,
        "outsider_datagrams": sent,
        "outsider_datagrams_handled_by_daemon": handled,
        "outsider_seconds": round(summary["seconds"], 2),
        "outsider_datagrams_per_second": round(sent / summary["seconds"], 1) if summary["seconds"] > 0 else 0.0,
        "outsider_sent_by_class": {k: v for k, v in summary["by_class"].items() if v},
        "outsider_drops": _drops(got2, got3),
        "outsider_baseline_cpu_s": [round(b.since(a), 3) for a, b in zip(cpu0, cpu1, strict=True)],
    }


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_soak(cfg: SoakConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Run the soak; SIGTERM, like Ctrl-C, stops it and still removes every process and temp dir."""
    cfg.check()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupted) if main else None
    try:
        return _run_soak(cfg, quiet)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _run_soak(cfg: SoakConfig, quiet: bool) -> dict[str, Any]:
    begin = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="peerd-bench-soak-")
    swarm = LocalSwarm(os.path.join(workdir, "swarm"), metrics=True, extra_args=("--log-level", "warning"))
    attacker: subprocess.Popen | None = None
    threads: list[Any] = []
    averager: _Averager | None = None
    try:
        _progress(f"starting {PEERS} sealed daemons ...", quiet)
        nodes = swarm.start_many(PEERS)
        _wait_connected(nodes)
        for i, node in enumerate(nodes):
            node.call("avg_open", timeout=30, run=RUN, grid=str(PEERS), adapt=False, min_size=PEERS, cell=i,
                      window_s=cfg.window_s)
        hostile = swarm.start(extra=("--fault-byzantine", "nan"))
        swarm.wait_ready(hostile)
        for node in (nodes[-1], hostile):
            node.call("avg_open", timeout=30, run=BAIT_RUN, grid="2", adapt=False, min_size=2, window_s=cfg.window_s)
        bait = _Bait(nodes[-1], hostile)
        monitor = _Monitor(nodes)
        queues = _Queues(nodes)
        prober = _Probe(workdir, swarm.key_file, [_hostport(n.listen) for n in nodes],
                        [n.status["peer_id"] for n in nodes])
        averager = _Averager(nodes, cfg)
        threads = [monitor, queues, prober, averager, bait]
        for t in (monitor, queues, averager, bait):
            t.thread.start()

        # -- calm: the no-attack baselines ------------------------------------------------------------------
        _progress(f"calm phase: averaging {cfg.size} float32 without attack ...", quiet)
        calm_end = time.monotonic() + cfg.calm_s
        hard = time.monotonic() + 180.0
        last_print = time.monotonic()
        while (time.monotonic() < calm_end or averager.rounds < 2) and time.monotonic() < hard:
            if monitor.exited:
                raise DaemonError(f"a daemon exited before the attack: peers {sorted(monitor.exited)}")
            time.sleep(0.2)
            if time.monotonic() - last_print >= 3.0:
                last_print = time.monotonic()
                _progress(f"  calm   rounds {averager.rounds}  averages ok {averager.ok} failed {averager.failed}"
                          f"  rss max {max(monitor.rss_by_node):.0f} MB", quiet)
        if averager.rounds < 1:
            raise DaemonError("no honest average completed in the calm phase: "
                              + "; ".join(averager.errors[-3:]))
        monitor.sample()
        calm_ok, calm_failed = averager.ok, averager.failed
        rss_base = list(monitor.rss_by_node)

        # -- outsider only: the daemons' CPU per datagram that no key opens ----------------------------------
        outsider: dict[str, Any] = {"outsider_cpu_us_per_datagram": None}
        if cfg.outsider_s > 0:
            outsider = _outsider_phase(cfg, nodes, swarm.key_file, workdir, averager, threads, quiet)
            _progress(f"  outsider {outsider['outsider_datagrams']:,} datagrams "
                      f"({outsider['outsider_datagrams_per_second']:,.0f}/s): daemon CPU "
                      f"{outsider['outsider_cpu_us_per_datagram']} us/datagram (max over daemons)", quiet)
        before = _counters(nodes)
        cpu_before = [_cpu_s(n.proc.pid) for n in nodes]
        status = nodes[0].call("status").get("moshpit", {}).get(RUN, {})

        # -- the attack -----------------------------------------------------------------------------------------
        for t in threads:
            t.phase = "attack"
        attack_cfg = {
            "targets": [list(_hostport(n.listen)) for n in nodes], "key_file": swarm.key_file, "run": RUN,
            "victims": [n.status["peer_id"] for n in nodes], "round": int(status.get("round", 0)),
            "group_key": status.get("key", ""), "datagrams": cfg.datagrams, "rate": cfg.rate,
            "burst_share": cfg.burst_share, "seed": cfg.seed, "identities": cfg.identities,
            "classes": list(cfg.classes),
        }
        with open(os.path.join(workdir, "attacker.log"), "wb") as log:
            attacker = subprocess.Popen([sys.executable, "-m", "peerd.tools.bench.soak_attack", json.dumps(attack_cfg)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
        _progress(f"attack: {cfg.datagrams} datagrams, {len(cfg.classes)} classes, steady {cfg.rate:.0f}/s "
                  f"and a burst of {cfg.burst_share:.0%} ...", quiet)
        t_attack = time.monotonic()
        summary: dict[str, Any] = {}
        last_print = 0.0
        assert attacker.stdout is not None
        for line in attacker.stdout:  # ends when the attacker exits (it sends a bounded number)
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if info.get("done"):
                summary = info
            elif info.get("phase") in ("steady", "burst"):  # the PINGs of the burst are told apart too
                mark = "burst" if info["phase"] == "burst" else "attack"
                if prober.phase != mark:
                    prober.phase = mark
                    queues.phase = mark
            now = time.monotonic()
            if now - last_print >= 3.0:
                last_print = now
                got = prober.samples()[0]
                p99 = _percentile(got.get("attack", []) + got.get("burst", []), 99)
                speed = info["sent"] / max(now - t_attack, 1e-9)
                _progress(f"  {info.get('phase', '?'):6s} sent {info['sent']:>9,} ({speed:,.0f}/s)"
                          f"  averages ok {averager.ok} failed {averager.failed} alone {averager.alone}"
                          f"  rss max {max(monitor.rss_by_node):.0f} MB  ping p99 "
                          f"{'-' if p99 is None else f'{p99:.1f}'} ms  exited {sorted(monitor.exited)}", quiet)
        rc = attacker.wait(timeout=30)
        cpu_attack = sum(_cpu_s(n.proc.pid) - c for n, c in zip(nodes, cpu_before, strict=True))
        attack_s = time.monotonic() - t_attack
        if rc != 0 or not summary:
            with open(os.path.join(workdir, "attacker.log"), errors="replace") as f:
                raise RuntimeError(f"the attacker failed (exit {rc}):\n{f.read()[-2000:]}")

        # -- after: one more complete round, to see the swarm still averages ---------------------------------
        for t in threads:
            t.phase = "after"
        rounds_then = averager.rounds
        hard = time.monotonic() + 150.0
        _progress("after the attack: two more rounds ...", quiet)
        last_print = time.monotonic()
        while averager.rounds < rounds_then + 2 and time.monotonic() < hard and averager.thread.is_alive():
            time.sleep(0.2)
            if time.monotonic() - last_print >= 3.0:
                last_print = time.monotonic()
                _progress(f"  after  rounds {averager.rounds}  averages ok {averager.ok} failed {averager.failed}"
                          f" alone {averager.alone}  exited {sorted(monitor.exited)}", quiet)
        monitor.sample()
        after = _counters(nodes)
        averager.stop.set()
        bait.stop.set()
        prober.stop.set()
        monitor.stop.set()
        queues.stop.set()
        averager.thread.join(timeout=150)
        crashes = sum(1 for n in nodes if not n.alive())
        relayed = _relayed_datagrams(nodes)

        growth = 0.0
        for i in range(len(nodes)):
            seen = monitor.rss.get(f"attack:{i}", []) + monitor.rss.get(f"after:{i}", [])
            if seen:
                growth = max(growth, max(seen) - rss_base[i])
        prober.close()
        rtts, lost = prober.samples()
        steady_rtt = rtts.get("attack", [])
        attack_rtt = steady_rtt + rtts.get("burst", [])
        calm_rates = monitor.rates.get("calm", [])
        attack_rates = monitor.rates.get("attack", []) + monitor.rates.get("after", [])
        sent = int(summary["sent"])
        out: dict[str, Any] = {
            "datagrams_sent": sent,
            "sent_by_class": summary["by_class"],
            "crashes": crashes,
            "rss_growth_mb": round(growth, 1),
            "ping_p99_ms": _round(_percentile(attack_rtt, 99)),
            "averages_ok": averager.ok,
            "averages_failed": averager.failed,
            "rate_floor": min(attack_rates) if attack_rates else None,
            "rate_no_attack": min(calm_rates) if calm_rates else None,
            "drops": _drops(before, after),
            # the attacker's own clock: from its first datagram to its last (its key signing before is not counted)
            "seconds": round(summary["seconds"], 2),
            "datagrams_per_second": round(sent / summary["seconds"], 1) if summary["seconds"] > 0 else 0.0,
            "attack_wall_seconds": round(attack_s, 2),
            # CPU the 4 honest daemons used during the attack (averaging included), and per attack datagram
            "daemon_cpu_s": round(cpu_attack, 2),
            "daemon_cpu_us_per_datagram": round(cpu_attack / max(sent, 1) * 1e6, 1),
            **outsider,
            # more detail
            "burst_datagrams_per_second": round(summary.get("burst_datagrams_per_second", 0.0), 1),
            "responder_answers": summary.get("responder_answers", 0),
            # datagrams the daemons sent back to the cross-receiver replayer (expected 0)
            "cross_receiver_answers": summary.get("cross_receiver_answers", 0),
            # datagrams the daemons sent to the address connect_reflect's CONNECTs named (expected 0)
            "connect_reflected": summary.get("connect_reflected", 0),
            # datagrams the honest daemons sent one another through a relay (expected 0: they reach each other)
            "honest_relayed_datagrams": relayed,
            "averages_alone": averager.alone,
            "averages_by_phase": averager.by_phase,
            "dht_peers_max": {p: int(max(v)) for p, v in monitor.peers.items() if v},
            "dht_records_max": {p: int(max(v)) for p, v in monitor.records.items() if v},
            "bait_rounds": bait.rounds,
            "bait_results_finite": bait.finite,
            "alone_notes": averager.alone_notes,
            "averages_ok_calm": calm_ok,
            "averages_failed_calm": calm_failed,
            "rounds": averager.rounds,
            "round_s_median": _round(statistics.median(averager.round_s) if averager.round_s else None),
            "max_rel_err": averager.max_rel_err,
            "average_errors": averager.errors[:10],
            "ping_p50_ms": _round(_percentile(attack_rtt, 50)),
            "ping_p95_ms": _round(_percentile(attack_rtt, 95)),
            "ping_p99_ms_steady": _round(_percentile(steady_rtt, 99)),
            "ping_p99_ms_burst": _round(_percentile(rtts.get("burst", []), 99)),
            "ping_p99_ms_no_attack": _round(_percentile(rtts.get("calm", []), 99)),
            "ping_p99_ms_after": _round(_percentile(rtts.get("after", []), 99)),
            "ping_p99_ms_outsider": _round(_percentile(rtts.get("outsider", []), 99)),
            "ping_lost": lost.get("attack", 0) + lost.get("burst", 0),
            "ping_lost_no_attack": lost.get("calm", 0),
            "ping_lost_by_phase": lost,
            "ping_samples_by_phase": {p: len(v) for p, v in rtts.items()},
            # the daemons' kernel receive queues by phase: where PINGs wait (or are lost) before the receive loop
            "kernel_by_phase": queues.report(),
            "ping_samples": len(attack_rtt),
            "rss_base_mb": [round(x, 1) for x in rss_base],
            "rate_median_no_attack": statistics.median(calm_rates) if calm_rates else None,
            "rate_median_attack": statistics.median(attack_rates) if attack_rates else None,
            "total_seconds": round(time.monotonic() - begin, 2),
            "config": asdict(cfg),
        }
        out["goals"] = {
            "no_crashes": crashes == 0,
            "rss_growth": growth <= GOALS["rss_growth_mb"],
            "averages_exact": averager.failed == 0 and averager.ok > 0,
            "ping_p99": out["ping_p99_ms"] is not None and out["ping_p99_ms"] <= GOALS["ping_p99_ms"],
            "rate_floor": out["rate_floor"] is None or out["rate_no_attack"] is None
            or out["rate_floor"] >= out["rate_no_attack"],
            "speed": summary["seconds"] <= GOALS["seconds_per_million"] * sent / 1e6,
            "outsider_cpu": out["outsider_cpu_us_per_datagram"] is None
            or out["outsider_cpu_us_per_datagram"] <= GOALS["outsider_cpu_us"],
            "every_class_sent": all(summary["by_class"].get(c, 0) > 0 for c in cfg.classes),
        }
        return out
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        for t in threads:
            t.stop.set()
            if isinstance(t, _Probe):
                t.close()
        swarm.stop()
        if averager is not None:
            averager.pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _relayed_datagrams(nodes: list[Node]) -> int:
    """Datagrams the live daemons sent through a relay (their ``path_datagrams``), summed."""
    total = 0
    for node in nodes:
        if node.alive():
            try:
                total += int(node.call("status", timeout=10).get("path_datagrams", {}).get("relayed", 0))
            except (DaemonError, OSError):
                pass
    return total


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def cmd_bench_soak(args: Any, parser: Any) -> int:
    """`peerd bench soak` (argparse glue kept here, so tools/cli_tools.py carries only the parser and the dispatch)."""
    cfg = SoakConfig(datagrams=args.datagrams, size=args.size, rate=args.rate, burst_share=args.burst_share,
                     calm_s=args.calm, seed=args.seed, identities=getattr(args, "identities", 64),
                     outsider_s=getattr(args, "outsider_seconds", 3.0),
                     classes=tuple(args.classes.split(",")) if getattr(args, "classes", None) else CLASSES)
    result = run_bench(cfg, parser, lambda say: run_soak(cfg, quiet=args.json), print_json=args.json, indent=2)
    if isinstance(result, int):
        return result
    print(f"{result['datagrams_sent']:,} datagrams in {result['seconds']:.1f} s "
          f"({result['datagrams_per_second']:,.0f}/s, burst {result['burst_datagrams_per_second']:,.0f}/s)")
    print(f"outsider only: daemon CPU {result['outsider_cpu_us_per_datagram']} us/datagram (max over daemons, "
          f"goal <= {GOALS['outsider_cpu_us']:g})")
    print(f"crashes {result['crashes']}, rss growth {result['rss_growth_mb']} MB, ping p99 {result['ping_p99_ms']} ms "
          f"(no attack: {result['ping_p99_ms_no_attack']} ms)")
    print(f"averages ok {result['averages_ok']}, failed {result['averages_failed']}, alone {result['averages_alone']}; "
          f"pacing floor {result['rate_floor']} B/s (no attack: {result['rate_no_attack']} B/s)")
    for name, by in result["drops"].items():
        print(f"{name}: " + (", ".join(f"{k} {v}" for k, v in sorted(by.items())) or "-"))
    print("goals: " + ", ".join(f"{k} {'ok' if v else 'NOT MET'}" for k, v in result["goals"].items()))
    return 0


# -- the receive path alone: bare endpoints under the outsider's classes (no daemons, no averaging) -------------
def _serve_endpoint(key_file: str) -> None:
    """One sealed Endpoint on a UDP socket of 127.0.0.1 (what a daemon's receive loop is, without the rest);
    prints {"port", "id"} and serves until killed."""
    import socket

    import trio

    from ...metrics import Metrics
    from ...transport.endpoint import Endpoint
    from ...transport.udp import UdpSocket
    from ...wire.identity import Identity, load_swarm_key

    async def main() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        ident = Identity.generate()
        endpoint = Endpoint(UdpSocket(sock), ident, load_swarm_key(key_file), Metrics())
        print(json.dumps({"port": sock.getsockname()[1], "id": ident.node_id.hex()}), flush=True)
        await endpoint.serve()

    trio.run(main)


def outsider_endpoints(endpoints: int = 4, rate: float = 20000.0, seconds: float = 3.0, seed: int = 1) -> dict:
    """CPU per outsider datagram of the receive path alone: ``endpoints`` bare endpoints (each its own process)
    take ``rate`` datagrams/s in all of the outsider's classes (soak_attack, as in the soak's outsider phase) for
    ``seconds``; (CPU in the window - idle CPU over as long) / datagrams sent. About 10 s in all; what the soak's
    ``outsider_cpu_us_per_datagram`` measures, without 4 daemons' averaging and DHT around it."""
    from ...wire.identity import write_swarm_key

    workdir = tempfile.mkdtemp(prefix="peerd-bench-outsider-")
    servers: list[subprocess.Popen] = []
    attacker: subprocess.Popen | None = None
    try:
        key = os.path.join(workdir, "swarm.key")
        write_swarm_key(key)
        for _ in range(endpoints):
            servers.append(subprocess.Popen([sys.executable, "-m", "peerd.tools.bench.soak", "endpoint", key],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True))
        infos = [json.loads(s.stdout.readline()) for s in servers]  # type: ignore[union-attr]

        def cpu() -> float:
            return sum(_task_cpu_s(s.pid) for s in servers)

        time.sleep(1.0)
        t0, c0 = time.monotonic(), cpu()
        time.sleep(2.0)
        idle = (cpu() - c0) / (time.monotonic() - t0)
        cfg = {"targets": [["127.0.0.1", i["port"]] for i in infos], "key_file": key, "run": RUN,
               "victims": [i["id"] for i in infos], "datagrams": int(rate * seconds), "rate": rate,
               "burst_share": 0.0, "seed": seed, "identities": 4, "classes": list(OUTSIDER_CPU_CLASSES),
               "responder": False, "flood_stores": 1}
        attacker = subprocess.Popen([sys.executable, "-m", "peerd.tools.bench.soak_attack", json.dumps(cfg)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        t1 = c1 = None
        summary: dict[str, Any] = {}
        for line in attacker.stdout:  # type: ignore[union-attr]
            if t1 is None:  # its first line comes as it starts sending
                t1, c1 = time.monotonic(), cpu()
            info = json.loads(line)
            if info.get("done"):
                summary = info
        attacker.wait(timeout=30)
        time.sleep(0.1)  # what is queued is taken
        t2, c2 = time.monotonic(), cpu()
        if not summary or t1 is None or c1 is None:
            raise RuntimeError("the outsider sent nothing")
        sent = int(summary["sent"])
        used = (c2 - c1) - idle * (t2 - t1)
        return {"endpoints": endpoints, "datagrams": sent, "seconds": round(t2 - t1, 2),
                "datagrams_per_second": round(sent / summary["seconds"], 1) if summary["seconds"] > 0 else 0.0,
                "cpu_s": round(c2 - c1, 4), "idle_cpu_s_per_s": round(idle, 5),
                "cpu_us_per_datagram": round(used / max(sent, 1) * 1e6, 2)}
    finally:
        for p in ([attacker] if attacker is not None else []) + servers:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``python -m peerd.tools.bench.soak outsider [ENDPOINTS [RATE [SECONDS]]]``: prints outsider_endpoints() as JSON.
    (``endpoint KEY_FILE`` is its server process.)"""
    if argv[:1] == ["endpoint"] and len(argv) == 2:
        _serve_endpoint(argv[1])
        return 0
    if argv[:1] == ["outsider"] and len(argv) <= 4:
        try:
            args = [int(argv[1]) if len(argv) > 1 else 4] + [float(x) for x in argv[2:]]
        except ValueError:
            args = []
        if args and 1 <= args[0] <= 16 and all(x > 0 for x in args[1:]):
            print(json.dumps(outsider_endpoints(*args)))  # type: ignore[arg-type]
            return 0
    print("usage: python -m peerd.tools.bench.soak outsider [ENDPOINTS (1..16) [RATE [SECONDS]]]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
