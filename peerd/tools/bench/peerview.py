"""`peerd bench peerview`: daemons in the link lab average continuously; does node 0's per-peer view (``peerd status
--json``'s ``peer_view``) agree with the lab's own counters?

Every peer sits in its own namespace of the link lab (peerd.tools.lab.links) behind ``--link RATE`` losing
``--link-loss`` of what arrives on it, with per-pair counters in the kernel (peerd.tools.lab.pairs: UDP each peer
sent to each other peer, and what of it arrived). Each daemon averages a vector of ``--params`` float32 values with
the others, round after round (``avg_round`` on its local socket). Meanwhile the bench reads every namespace's
counters every ``SAMPLE_S`` and pings every peer from node 0 (ICMP, peerd.tools.lab.ping); after ``--warmup``
seconds it runs ``peerd status --json`` on node 0 ``--reads`` times, ``--every`` seconds apart, and sets each
peer's figures beside the lab's:

- ``send_bps``, ``recv_bps``, ``goodput_out_bps``, ``goodput_in_bps``: the view's rates are over its last
  ``rate_window_s`` seconds, ending ``rates_age_s`` before the read; the lab's are the UDP payload bytes over the
  same window (its counters interpolated to the window's ends): node 0's sent to the peer, what arrived at node 0
  from it, what arrived at the peer from node 0, what arrived at node 0 from it;
- ``loss_out``, ``loss_in``: the view's are the averages' REPORTs (data datagrams counted by the receivers) since
  the daemon began; the lab's are the datagrams lost between the two stacks since the first round (either queue
  or the random drop). ``settled_loss`` compares the two once the rounds stopped, both from the warm-up's end on
  (the view's ``loss_*_counts`` then and at the end), with ``loss_stderr`` the binomial standard error of the
  lab's count, ``loss_configured``, and ``within_noise``: the two differ by at most NOISE_SE standard errors (the
  view counts the averages' datagrams, the lab every UDP byte between the pair: two samples of one random drop);
- ``rtt_ms``: the view's smoothed RTT of answered requests; the lab's is the median ICMP round trip over the last
  ``RTT_WINDOW_S`` seconds (``lab_p99_ms`` its p99, ``lab_min_ms`` its least: the path with no queue), which has
  no daemon in the loop.

Each figure carries its relative error (``err``: |view - lab| / lab) and ``within_10pct``. The lab has no delay
emulation (no netem): its RTT is the tbf queues' and the hosts'.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...localsock.client import DaemonError
from ..lab.links import LinkLab, parse_rate
from ..lab.pairs import PairCounters
from ..lab.ping import Pinger
from ..swarm import LocalSwarm
from .runner import run_bench

RUN = "bench-peerview"
VIEWER = 0  # the node whose view is read
SAMPLE_S = 0.2  # the lab's counters are read this often
RTT_WINDOW_S = 5.0
PING_S = 0.05
TOLERANCE = 0.10
RATES = ("send_bps", "recv_bps", "goodput_out_bps", "goodput_in_bps")


@dataclass
class PeerviewBenchConfig:
    peers: int = 4
    link: str = "100mbit"
    link_loss: float = 0.05
    params: int = 500_000
    warmup_s: float = 10.0
    reads: int = 3
    every_s: float = 3.0

    def check(self) -> None:
        if not 2 <= self.peers <= 16:
            raise ValueError("--peers must be in [2, 16]")
        parse_rate(self.link)
        if not 0.0 <= self.link_loss < 0.5:
            raise ValueError("--link-loss must be in [0, 0.5)")
        if not 1000 <= self.params <= 1 << 26:
            raise ValueError("--params must be in [1000, 2**26]")
        if self.warmup_s < 7.0:
            raise ValueError("--warmup must be at least 7 s (the view's rates cover its last 5 s)")
        if self.reads < 1 or self.every_s <= 0:
            raise ValueError("--reads must be at least 1 and --every positive")


class _LabClock:
    """Every peer's per-pair counters, read every SAMPLE_S (a thread), interpolated to any moment."""

    def __init__(self, lab: LinkLab) -> None:
        self.lab = lab
        self.samples: list[list[tuple[float, dict[int, PairCounters]]]] = [[] for _ in range(lab.peers)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i in range(self.lab.peers):
                before = time.monotonic()
                pairs = self.lab.pairs(i)
                self.samples[i].append(((before + time.monotonic()) / 2, pairs))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> _LabClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, peer: int, other: int, field: str, t: float, packets: bool = False) -> float:
        """Peer ``peer``'s counter ``field`` (sent, arrived, delivered) about ``other`` at ``t``: UDP payload bytes
        (or packets), linear between the samples around ``t``."""
        rows = self.samples[peer]

        def value(row: tuple[float, dict[int, PairCounters]]) -> float:
            count = getattr(row[1][other], field)
            return float(count.packets if packets else count.payload)

        if not rows or t <= rows[0][0]:
            return value(rows[0]) if rows else 0.0
        for a, b in zip(rows, rows[1:], strict=False):
            if a[0] <= t <= b[0]:
                share = (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 1.0
                return value(a) + share * (value(b) - value(a))
        return value(rows[-1])


    def rate(self, peer: int, other: int, field: str, window: tuple[float, float]) -> float | None:
        """UDP payload bytes per second of that counter over ``window`` (None for an empty window)."""
        start, end = window
        if end <= start:
            return None
        return (self.at(peer, other, field, end) - self.at(peer, other, field, start)) / (end - start)


def _compare(view: float | None, lab: float | None) -> dict[str, Any]:
    if view is None or lab is None:
        return {"view": view, "lab": lab, "err": None, "within_10pct": False}
    err = abs(view - lab) / lab if lab > 0 else (0.0 if view == 0 else math.inf)
    return {"view": round(view, 6), "lab": round(lab, 6), "err": round(err, 4), "within_10pct": err <= TOLERANCE}


def _queue_share(before: dict[str, list[Any]], after: dict[str, list[Any]], side: str, peer: int) -> float:
    """The share of packets one tbf (peer ``peer``'s ``up`` or ``down``) dropped for a full queue between two
    readings: every flow through that queue loses about the same share."""
    drops = after[side][peer].drops - before[side][peer].drops
    offered = after[side][peer].packets - before[side][peer].packets + drops
    return drops / offered if offered > 0 else 0.0


def _loss(clock: _LabClock, src: int, dst: int, since: float, until: float, queues: tuple[float, float]
          ) -> tuple[float | None, int]:
    """The lab's loss from ``src``'s stack to ``dst``'s over [since, until], and of how many datagrams: the random
    drop's share, from ``dst``'s own two counters (what arrived from ``src`` and what of it the drop let through,
    read together), and what ``queues`` (the share ``src``'s upload tbf and ``dst``'s download tbf dropped) took
    before. In bytes: the drop takes a datagram whatever its size, so the byte share estimates the datagram share."""
    def delta(field: str, packets: bool = False) -> float:
        return clock.at(dst, src, field, until, packets) - clock.at(dst, src, field, since, packets)

    arrived, delivered = delta("arrived"), delta("delivered")
    if arrived <= 0:
        return None, 0
    kept = (delivered / arrived) * (1.0 - queues[0]) * (1.0 - queues[1])
    return max(0.0, 1.0 - kept), round(delta("arrived", True))


def compare_read(view: dict[str, Any], at: float, clock: _LabClock, pinger: Pinger, ids: list[str],
                 addrs: list[str], loss: list[float], since: float, tbfs: tuple[dict, dict]) -> list[dict[str, Any]]:
    """Each other peer's figures in node VIEWER's ``view`` (read at ``at``) beside the lab's; ``tbfs``: every
    token bucket's counters at ``since`` and at ``at`` (LinkLab.tbf_sides)."""
    peers = {p["peer"]: p for p in view["peers"]}
    age = view.get("rates_age_s") or 0.0
    out = []
    for j, peer_id in enumerate(ids):
        if j == VIEWER:
            continue
        p = peers.get(peer_id)
        if p is None:
            out.append({"peer": j, "id": peer_id[:16], "missing": True})
            continue
        end = at - age
        window = (end - (p["rate_window_s"] or 0.0), end)
        lab_rates = {"send_bps": clock.rate(VIEWER, j, "sent", window),
                     "recv_bps": clock.rate(VIEWER, j, "delivered", window),
                     "goodput_out_bps": clock.rate(j, VIEWER, "delivered", window),
                     "goodput_in_bps": clock.rate(VIEWER, j, "delivered", window)}
        q = {(side, i): _queue_share(*tbfs, side, i) for side in ("up", "down") for i in (VIEWER, j)}
        loss_out, n_out = _loss(clock, VIEWER, j, since, at, (q[("up", VIEWER)], q[("down", j)]))
        loss_in, n_in = _loss(clock, j, VIEWER, since, at, (q[("up", j)], q[("down", VIEWER)]))
        rtts = sorted(pinger.rtts(addrs[j], at - RTT_WINDOW_S, at))
        rtt_lab = statistics.median(rtts) * 1e3 if rtts else None
        row: dict[str, Any] = {
            "peer": j, "id": peer_id[:16], "path": p["path"], "path_lab": "direct", "verdict": p["verdict"],
            "rate_window_s": p["rate_window_s"], "rates_age_s": age,
            **{k: _compare(p[k], lab_rates[k]) for k in RATES},
            "loss_out": {**_compare(p["loss_out"], loss_out), "datagrams": n_out,
                         "loss_stderr": _stderr(loss_out, n_out), "loss_configured": loss[j],
                         "queue_drops": round(q[("up", VIEWER)] + q[("down", j)], 5)},
            "loss_in": {**_compare(p["loss_in"], loss_in), "datagrams": n_in,
                        "loss_stderr": _stderr(loss_in, n_in), "loss_configured": loss[VIEWER],
                        "queue_drops": round(q[("up", j)] + q[("down", VIEWER)], 5)},
            "rtt_ms": {**_compare(p["rtt_ms"], rtt_lab), "view_samples": p["rtt_samples"], "pings": len(rtts),
                       "view_p99_ms": p["rtt_p99_ms"],
                       "lab_p99_ms": round(rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))] * 1e3, 3) if rtts else None,
                       "lab_min_ms": round(rtts[0] * 1e3, 3) if rtts else None},
        }
        row["within_10pct"] = all(row[k]["within_10pct"] for k in (*RATES, "rtt_ms"))  # (loss: settled_loss)
        out.append(row)
    return out


NOISE_SE = 3.0  # two loss samples of one link agree where they differ by at most this many standard errors


def _stderr(p: float | None, n: int) -> float | None:
    return None if p is None or n <= 0 else round(math.sqrt(p * (1 - p) / n), 5)


def settled_loss(view: dict[str, Any], lab: LinkLab, clock: _LabClock, ids: list[str], since: float,
                 before: dict[str, Any]) -> list[dict[str, Any]]:
    """Loss both ways once the averaging stopped, so the lab's counters and the view's REPORTs are both final,
    from ``since`` (the warm-up's end) on, where the view's counts (``loss_*_counts``) are taken from ``before``,
    its read then: the warm-up's rounds are left out of both (a member's first round on a fresh swarm may run on
    after the others left it, its datagrams delivered but never REPORTed). The lab's is what each pair's receiver
    delivered to its stack of what its sender's stack sent, in UDP payload bytes (a GSO send is one packet where
    it is counted, pairs.py; the random drop takes a datagram whatever its size)."""
    now = {i: lab.pairs(i) for i in range(lab.peers)}
    peers = {p["peer"]: p for p in view["peers"]}
    earlier = {p["peer"]: p for p in before["peers"]}

    def lost(src: int, dst: int) -> tuple[float | None, int]:
        sent = now[src][dst].sent.payload - clock.at(src, dst, "sent", since)
        got = now[dst][src].delivered.payload - clock.at(dst, src, "delivered", since)
        n = round(now[dst][src].arrived.packets - clock.at(dst, src, "arrived", since, True))
        return (max(0.0, 1.0 - got / sent) if sent > 0 else None), n

    out = []
    for j, peer_id in enumerate(ids):
        p = peers.get(peer_id)
        if j == VIEWER or p is None:
            continue
        row: dict[str, Any] = {"peer": j, "id": peer_id[:16]}
        for key, (src, dst) in (("loss_out", (VIEWER, j)), ("loss_in", (j, VIEWER))):
            lab_loss, n = lost(src, dst)
            se = _stderr(lab_loss, n)
            seen = _view_loss(p[f"{key}_counts"], earlier.get(peer_id, {}).get(f"{key}_counts"))
            row[key] = {**_compare(seen, lab_loss), "datagrams": n, "loss_stderr": se,
                        "loss_configured": lab.loss[dst]}
            # the view counts the averages' data datagrams, the lab every UDP byte between the pair: two samples of
            # one random drop, so they may differ by the sampling's noise as well as by 10 %
            row[key]["within_noise"] = (seen is not None and se is not None
                                        and abs(seen - lab_loss) <= NOISE_SE * se)
        out.append(row)
    return out


def _view_loss(now: dict[str, int], before: dict[str, int] | None) -> float | None:
    """The view's loss between two reads of a peer's ``loss_*_counts`` (None: nothing expected between them)."""
    expected = now["expected"] - (before or {}).get("expected", 0)
    arrived = now["arrived"] - (before or {}).get("arrived", 0)
    if expected <= 0:
        return None
    return max(0.0, 1.0 - arrived / expected)


class _Averaging:
    """Every daemon averages its vector round after round (a thread each) until stopped."""

    def __init__(self, swarm: LocalSwarm, params: int) -> None:
        self.nodes, self.params = swarm.nodes, params
        self.rounds = [0] * len(swarm.nodes)
        self.outcomes: dict[str, int] = {}
        self.stopping: dict[str, int] = {}  # outcomes of rounds that ended once the averaging was told to stop
        self.warmup: dict[str, int] = {}  # of rounds that ended in the warmup (also in ``outcomes``)
        self.measuring = threading.Event()  # set once the warmup is over
        self.errors: list[str] = []
        self.first_round_at: float | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(self.nodes))]
        self._lock = threading.Lock()

    def _run(self, i: int) -> None:
        vector = np.random.default_rng(i).standard_normal(self.params).astype("<f4")
        while not self._stop.is_set():
            try:
                reply = self.nodes[i].call("avg_round", timeout=90, run=RUN, vector=vector.tobytes(), weight=1.0,
                                           timeout_s=30.0)
            except DaemonError as e:
                self.errors.append(f"node {i}: {e}")
                return
            vector = np.frombuffer(reply["vector"], dtype="<f4").copy()
            with self._lock:
                outcome = reply["stats"]["outcome"]
                if self._stop.is_set():  # a round that began as the others stopped has nobody to average with
                    self.stopping[outcome] = self.stopping.get(outcome, 0) + 1
                    continue
                if not self.measuring.is_set():  # the swarm's first rounds, before the reads: counted apart
                    self.warmup[outcome] = self.warmup.get(outcome, 0) + 1
                self.rounds[i] += 1
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def __enter__(self) -> _Averaging:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def status_text(socket_path: str) -> str:
    """``peerd status`` on a node, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "peerd", "status", "--socket", socket_path],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"peerd status failed: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def table_lines(text: str, ids: list[str]) -> dict[str, int]:
    """How many lines of ``peerd status``'s peer table start with each of ``ids`` (its first 16 hex digits)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("PEER ")), len(lines))
    return {peer[:16]: sum(line.startswith(peer[:16]) for line in lines[header:]) for peer in ids}


def run_peerview_bench(cfg: PeerviewBenchConfig, *, say: Any = print) -> dict[str, Any]:
    cfg.check()
    workdir = tempfile.mkdtemp(prefix="peerd-bench-peerview-")
    lab = LinkLab(cfg.peers, cfg.link, cfg.link_loss, pair_counters=True)
    say(f"link lab: {cfg.peers} namespaces, {cfg.link} links losing {cfg.link_loss:.1%} of what arrives")
    lab.start()
    reads: list[dict[str, Any]] = []
    try:
        swarm = LocalSwarm(os.path.join(workdir, "swarm"), lab=lab)
        try:
            statuses = [swarm.wait_ready(swarm.start()) for _ in range(cfg.peers)]
            ids = [s["peer_id"] for s in statuses]
            deadline = time.monotonic() + 30
            while min(n.call("status")["peers"] for n in swarm.nodes) < cfg.peers - 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("the daemons did not meet within 30 s")
                time.sleep(0.2)
            for n in swarm.nodes:
                n.call("avg_open", timeout=30, run=RUN, min_size=cfg.peers, window_s=2.0)
            addrs = [lab.addr(i) for i in range(cfg.peers)]
            with _LabClock(lab) as clock, Pinger(lab, VIEWER, addrs[1:], PING_S) as pinger:
                time.sleep(2 * SAMPLE_S)
                since, tbf_since = time.monotonic(), lab.tbf_sides()
                say(f"{cfg.peers} daemons average {cfg.params} float32 values round after round ...")
                with _Averaging(swarm, cfg.params) as avg:
                    time.sleep(cfg.warmup_s)
                    avg.measuring.set()
                    t0 = time.monotonic()
                    view0 = swarm.nodes[VIEWER].call("status")["peer_view"]  # the view's counts at the warm-up's end
                    measured_from = (t0 + time.monotonic()) / 2
                    for r in range(cfg.reads):
                        if r:
                            time.sleep(cfg.every_s)
                        before = time.monotonic()  # (the op `peerd status` calls, timed to a few ms)
                        view = swarm.nodes[VIEWER].call("status")["peer_view"]
                        at = (before + time.monotonic()) / 2
                        tbfs = (tbf_since, lab.tbf_sides())
                        time.sleep(2 * SAMPLE_S)  # the lab's counters past the read
                        reads.append({"at_s": round(at - since, 2), "peers": compare_read(
                            view, at, clock, pinger, ids, addrs, lab.loss, since, tbfs)})
                        say(f"read {r + 1}: " + ", ".join(
                            f"peer {row['peer']} {'ok' if row.get('within_10pct') else 'OFF'}"
                            for row in reads[-1]["peers"]))
                    text = status_text(swarm.nodes[VIEWER].socket)
                if avg.errors:
                    raise RuntimeError("; ".join(avg.errors))
                time.sleep(1.0)  # the last rounds' REPORTs and datagrams arrive
                settled = settled_loss(swarm.nodes[VIEWER].call("status")["peer_view"], lab, clock, ids,
                                       measured_from, view0)
        finally:
            swarm.cleanup()
    finally:
        lab.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "peers": cfg.peers, "link": cfg.link, "link_loss": cfg.link_loss, "params": cfg.params,
        "rounds": avg.rounds, "outcomes": avg.outcomes,
        "outcomes_stopping": avg.stopping, "outcomes_warmup": avg.warmup, "pings_sent": pinger.sent, "reads": reads,
        "status_table_lines": table_lines(text, [i for j, i in enumerate(ids) if j != VIEWER]),
        "settled_loss": settled,
        "within_10pct": all(row.get("within_10pct", False) for rd in reads for row in rd["peers"])
        and all(row[k]["within_10pct"] or row[k]["within_noise"] for row in settled for k in ("loss_out", "loss_in")),
        "delay": "none (no netem): RTT is the tbf queues' and the hosts'",
    }


def add_parser(bench: Any) -> None:
    """The `bench peerview` sub-parser."""
    b = bench.add_parser("peerview", help="daemons in the link lab average continuously: does `peerd status`'s "
                                          "per-peer view agree with the lab's counters within 10 %%? (root)")
    b.add_argument("--peers", type=int, default=4, metavar="N", help="daemons (default 4)")
    b.add_argument("--link", default="100mbit", metavar="RATE", help="every peer's link (default 100mbit)")
    b.add_argument("--link-loss", type=float, default=0.05, metavar="P",
                   help="random loss of what arrives on each link (default 0.05)")
    b.add_argument("--params", type=float, default=500_000, metavar="P",
                   help="float32 values each daemon averages each round (default 500000)")
    b.add_argument("--warmup", type=float, default=10.0, metavar="S",
                   help="seconds of averaging before the first read (default 10)")
    b.add_argument("--reads", type=int, default=3, metavar="R", help="reads of node 0's view (default 3)")
    b.add_argument("--every", type=float, default=3.0, metavar="S", help="seconds between reads (default 3)")
    b.add_argument("--json", action="store_true", help="print JSON only")



def cmd_bench_peerview(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = PeerviewBenchConfig(peers=args.peers, link=args.link, link_loss=args.link_loss, params=int(args.params),
                              warmup_s=args.warmup, reads=args.reads, every_s=args.every)
    result = run_bench(cfg, parser, lambda say: run_peerview_bench(cfg, say=say), print_json=args.json,
                       left="every daemon, namespace and temp dir")
    if isinstance(result, int):
        return result
    print(f"{result['peers']} peers on {result['link']} links losing {result['link_loss']:.1%}; node 0's view "
          f"against the lab (relative error; * over 10 %)")
    for rd in result["reads"]:
        print(f"  read at {rd['at_s']} s")
        for row in rd["peers"]:
            if row.get("missing"):
                print(f"    peer {row['peer']}: not in the view")
                continue
            cells = [f"{k} {row[k]['err'] if row[k]['err'] is not None else '-'}"
                     f"{'' if row[k]['within_10pct'] else '*'}" for k in (*RATES, "loss_out", "loss_in", "rtt_ms")]
            print(f"    peer {row['peer']}: " + "  ".join(cells))
    print(f"  within_10pct: {result['within_10pct']}")
    return 0
