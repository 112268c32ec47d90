"""`peerd bench moshpit`: N real daemons average random vectors by Moshpit rounds; deviation per round.

Each round every live peer hands its current vector to its daemon (avg_round) at the same moment;
the bench then measures how far the live peers are from their own mean, relative to before round 1.
With ``link`` (root) every daemon runs in its own namespace of a link lab (peerd.tools.lab): links shaped at that rate
both ways, losing ``link_loss`` of what arrives at each peer in the kernel.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...localsock.client import DaemonError
from ...moshpit.keys import Grid
from ..lab.links import LinkLab
from ..swarm import LocalSwarm, Node
from .vectors import seeded_vector

RUN = "bench-moshpit"


@dataclass
class MoshpitBenchConfig:
    peers: int
    grid: Grid | None = None
    rounds: int = 3
    size: int = 10_000
    kill: int = 0
    loss: float = 0.0
    seed: int = 0
    window_s: float = 3.0
    link: str | None = None  # a link lab (root): every daemon in its own namespace on a link shaped at this rate
    link_loss: float = 0.0  # ... which drops this fraction of what arrives at each peer (nftables, all protocols)
    link_queue_ms: float = 20.0  # ... each tbf queueing this many ms of the rate before it drops
    compression: str | None = None  # the run's codec (None: fp32); quant_group and rounding for int8/int4
    quant_group: int | None = None
    rounding: str | None = None

    def check(self) -> None:
        if self.peers < 2:
            raise ValueError("--peers must be at least 2")
        if self.grid is not None and self.grid.cells != self.peers:
            raise ValueError(f"--grid {self.grid} has {self.grid.cells} cells: pass --peers {self.grid.cells}")
        if not 0 <= self.kill <= self.peers - 2:
            raise ValueError(f"--kill must leave at least 2 peers alive (0..{self.peers - 2})")
        if self.rounds < 1 or self.size < 1:
            raise ValueError("--rounds and --size must be at least 1")
        if not 0.0 <= self.link_loss < 1.0:
            raise ValueError("--link-loss must be in [0, 1)")
        if self.link_loss and not self.link:
            raise ValueError("--link-loss needs --link RATE")
        if self.compression is not None:
            from ...moshpit.service import MoshpitError, check_compression

            try:
                check_compression(self.compression, self.quant_group, self.rounding)
            except MoshpitError as e:
                raise ValueError(str(e)) from None
        elif self.quant_group is not None or self.rounding is not None:
            raise ValueError("--quant-group and --rounding go with --compression int8 or int4")

    def codec_options(self) -> dict[str, Any]:
        """avg_open's codec keywords: only those set."""
        return {k: v for k, v in (("compression", self.compression), ("quant_group", self.quant_group),
                                  ("rounding", self.rounding)) if v is not None}


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def deviation(vectors: list[np.ndarray]) -> float:
    """RMS distance of the vectors from their mean."""
    stack = np.stack([v.astype(np.float64) for v in vectors])
    return float(np.sqrt(np.mean(np.sum((stack - stack.mean(axis=0)) ** 2, axis=1))))


def _wait_connected(nodes: list[Node], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        counts = [n.call("status")["peers"] for n in nodes]
        if min(counts) >= len(nodes) - 1:
            return
        if time.monotonic() > deadline:
            raise DaemonError(f"the daemons do not all see each other after {timeout:.0f} s: peers {counts}")
        time.sleep(0.2)


def _killer(victims: list[Node], killed: list[str], stop: threading.Event) -> None:
    """SIGKILL each victim as soon as its daemon says it is averaging (or when the round is over)."""
    pending = list(victims)
    while pending:
        for node in list(pending):
            state = "gone"
            if not stop.is_set():
                try:
                    runs = node.call("status", timeout=2.0).get("moshpit", {})
                    state = runs.get(RUN, {}).get("state", "idle")
                except DaemonError:
                    state = "gone"
            if state == "averaging" or stop.is_set():
                node.proc.kill()
                node.proc.wait()
                killed.append("averaging" if state == "averaging" else "after_round")
                pending.remove(node)
        time.sleep(0.002)


def run_moshpit_bench(cfg: MoshpitBenchConfig, *, quiet: bool = False) -> dict[str, Any]:
    cfg.check()
    rng = random.Random(cfg.seed)
    workdir = tempfile.mkdtemp(prefix="peerd-bench-moshpit-")
    extra = ["--log-level", "warning"]
    lab: LinkLab | None = None
    try:
        if cfg.link:
            lab = LinkLab(cfg.peers, cfg.link, cfg.link_loss, queue_ms=cfg.link_queue_ms)
            _progress(f"building a link lab: {cfg.peers} namespaces at {cfg.link}, link loss {cfg.link_loss} ...",
                      quiet)
            lab.start()  # LabError (not root, a tool missing) before anything else starts; it cleans up itself
        swarm = LocalSwarm(os.path.join(workdir, "swarm"), metrics=False, lab=lab)
    except BaseException:
        if lab is not None:
            lab.close(raise_errors=False)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        _progress(f"starting {cfg.peers} daemons ...", quiet)
        nodes = swarm.start_lossy(cfg.peers, tuple(extra), cfg.loss, cfg.seed)
        _wait_connected(nodes)
        if lab is not None:
            lab.reset_counters()  # the drop fraction below covers the rounds, not the daemons' startup
        open_args: dict[str, Any] = {"run": RUN, "window_s": cfg.window_s, **cfg.codec_options()}
        if cfg.grid is not None:  # Moshpit's exact conditions: groups close at exactly M members
            open_args.update(grid=str(cfg.grid), adapt=False, min_size=cfg.grid.size)
        cells = list(range(cfg.peers))
        rng.shuffle(cells)
        for i, node in enumerate(nodes):
            node.call("avg_open", timeout=30, **open_args, **({"cell": cells[i]} if cfg.grid else {}))
        vectors = {i: seeded_vector(cfg.seed * 1000 + i, cfg.size) for i in range(cfg.peers)}
        start_dev = deviation(list(vectors.values()))
        live = set(range(cfg.peers))
        victims = sorted(rng.sample(range(cfg.peers), cfg.kill))
        out_dev: list[float] = []
        group_sizes: list[list[int]] = []
        round_s: list[float] = []
        fractions: list[float] = []
        sent: list[float] = []  # bytes sent per averaged peer, per round
        outcomes: list[dict[str, int]] = []
        killed: list[str] = []
        pool = ThreadPoolExecutor(max_workers=cfg.peers + 1)

        def call(i: int) -> dict[str, Any] | None:
            try:
                return nodes[i].call("avg_round", timeout=120, run=RUN, vector=vectors[i].tobytes(), weight=1.0,
                                     timeout_s=60.0)
            except DaemonError:
                if i not in victims:
                    raise
                nodes[i].proc.wait(timeout=10)
                return None  # killed

        queue_drops: list[dict[str, float]] = []  # per round: what the tbfs dropped over what they were offered
        for r in range(cfg.rounds):
            tbf_before = lab.tbf_sides() if lab is not None else {}
            stop = threading.Event()
            killer = None
            if r == 0 and victims:
                killer = pool.submit(_killer, [nodes[i] for i in victims], killed, stop)
            order = sorted(live)
            replies = list(pool.map(call, order))
            stop.set()
            if lab is not None:
                queue_drops.append(lab.queue_drop_fractions(tbf_before, lab.tbf_sides()))
            if killer is not None:
                killer.result()
                live -= set(victims)
                # from now on a group closes at its deadline with whoever is present
                for i in sorted(live):
                    nodes[i].call("avg_open", timeout=30, run=RUN, min_size=2, window_s=cfg.window_s)
            stats = {}
            for i, reply in zip(order, replies, strict=True):
                if reply is None or i not in live:
                    continue
                vectors[i] = np.frombuffer(reply["vector"], dtype="<f4").copy()
                stats[i] = reply["stats"]
            out_dev.append(deviation([vectors[i] for i in sorted(live)]) / start_dev)
            groups: dict[str, int] = {}
            count: dict[str, int] = {}
            for i, st in stats.items():
                count[st["outcome"]] = count.get(st["outcome"], 0) + 1
                groups[st["group_id"] or f"alone-{i}"] = st["group_size"]
            group_sizes.append(sorted(groups.values(), reverse=True))
            round_s.append(statistics.median(st["seconds"] for st in stats.values()))
            fractions.append(statistics.mean(st["received_fraction"] for st in stats.values()))
            averaged = [st.get("bytes_sent", 0) for st in stats.values() if st["outcome"] == "averaged"]
            sent.append(statistics.mean(averaged) if averaged else 0.0)
            outcomes.append(count)
            _progress(f"round {r + 1}/{cfg.rounds}: deviation {out_dev[-1]:.3g}, groups {group_sizes[-1]}, "
                      f"{round_s[-1]:.3f} s", quiet)
        pool.shutdown()
        out: dict[str, Any] = {
            "peers": cfg.peers,
            "grid": str(cfg.grid) if cfg.grid else None,
            "rounds": cfg.rounds,
            "size": cfg.size,
            "kill": cfg.kill,
            "loss": cfg.loss,
            "deviation": out_dev,
            "group_sizes": group_sizes,
            "round_s": round_s,
            "received_fraction": fractions,
            "compression": cfg.compression or "fp32",
            **({"quant_group": cfg.quant_group or 128, "rounding": cfg.rounding or "stochastic"}
               if (cfg.compression or "").startswith("int") else {}),
            # UDP payload bytes one averaged peer sent for its group's average, per round (compare codecs at
            # the same --size and --grid: the group size sets the fp32 figure, 2 (M-1)/M x 4 x size + headers)
            "bytes_sent_per_peer": sent,
            "outcomes": outcomes,
            "survivors": len(live),
        }
        if cfg.kill:
            out["killed_during"] = killed
        if lab is not None:
            counters = [lab.counters(i) for i in range(lab.peers)]
            seen = sum(c.seen for c in counters)
            out.update(link_rate=lab.describe()["link_rate"], link_loss=cfg.link_loss,
                       link_drop_fraction=sum(c.dropped for c in counters) / seen if seen else 0.0,
                       link_packets_seen=seen, link_queue_drops=queue_drops)
        return out
    finally:
        swarm.stop()
        if lab is not None:
            lab.close()
        shutil.rmtree(workdir, ignore_errors=True)
