"""`peerd bench caps`: 4 daemons in the link lab average continuously, one of them under --max-upload or
--max-download; does it keep to its cap, and does the group's round keep to what the cap allows?

Every peer sits in its own namespace of the link lab (peerd.tools.lab.links) behind ``--link RATE``; member
``CAPPED`` runs ``peerd join --max-upload CAP`` (``--cap-upload``) or ``--max-download CAP`` (``--cap-download``).
Trainers (the ``bench step`` worker: seeded noise gradients, so a step costs no compute) take ``--steps`` sync steps of
``--params`` float32 parameters. While they run, the capped member's link is read from the lab's own counters, its
tbf's byte count (``tc -s``, payload plus IP, UDP and Ethernet headers) every second. The figures (``--json``):

- ``upload_max_1s_mbit`` / ``download_max_1s_mbit``: the capped member's largest 1 s window in the capped direction,
  against ``cap_mbit``;
- ``windows_mbit``: every window's rate in the capped direction, in order;
- ``averages_complete``: every step of every trainer averaged with all members (``incomplete``: the first steps
  that did not, as (trainer, step, outcome, group size); ``timeline``: every trainer's steps as (start, end,
  outcome, group size), seconds from the first step's start);
- ``capped_received_min``: the least share of an average's data that reached the capped member (its
  all-gather; 1.0 on a lossless link);
- ``round_s``: the median step of the capped member's trainer (after ``--warmup`` steps);
- ``round_bound_s``: the least a round can take with the group's shards (the capped member's smaller one:
  allreduce.shards.capped_shares): each of the two phases lasts at least as long as its slowest member's part at
  its rate, the capped member at its cap and the others at the link's. In the reduce-scatter member j, with a
  shard of s_j of the vector, sends 1 - s_j and receives (n - 1) s_j of it; in the all-gather the other way
  round. The sum of the two phases' longest parts, in datagrams of 1200 bytes each with 98 bytes of headers.
  With n = 4 and an upload cap the capped member owns no shard: its part is the vector once in the
  reduce-scatter, and the all-gather is the others' (a third of the vector to each of three peers at the link's
  rate). ``round_bound_equal_s``: the same with equal shards, 2 (n - 1)/n of the vector at the cap, what a round
  took before capped members had smaller shards.
The lab has no delay emulation: its RTT is the queue's and the hosts'.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from ...allreduce.shards import capped_shares
from ...linkcap.rates import parse_rate as parse_cap
from ..lab.links import LinkLab, parse_rate
from ..swarm import LocalSwarm
from .runner import run_bench
from .step import (
    CODEC_BYTES,
    DATAGRAM_OVERHEAD,
    DATAGRAM_PAYLOAD,
    StepBenchConfig,
    start_workers,
    stop_workers,
    transfer_seconds,
    wait_workers,
)

CAPPED = 1  # the capped member (not node 0, which the others bootstrap from)
SAMPLE_S = 1.0
READ_SLACK_S = 0.05  # a counter read slower than this is left out (see _Sampler)


@dataclass
class CapsBenchConfig:
    peers: int = 4
    link: str = "100mbit"
    cap_upload: str | None = None
    cap_download: str | None = None
    params: int = 2_000_000
    steps: int = 8
    warmup: int = 2
    timeout_s: float = 60.0

    def check(self) -> None:
        if self.peers < 2:
            raise ValueError("--peers must be at least 2")
        if (self.cap_upload is None) == (self.cap_download is None):
            raise ValueError("give one of --cap-upload RATE or --cap-download RATE")
        parse_rate(self.link)
        cap = self.cap_bps()
        if cap >= parse_rate(self.link):
            raise ValueError("the cap must be under the link's rate (else the link, not the cap, binds)")
        if self.steps < 1 or not 0 <= self.warmup < self.steps:
            raise ValueError("--steps must be at least 1 and --warmup in [0, steps)")

    @property
    def direction(self) -> str:
        return "upload" if self.cap_upload is not None else "download"

    def cap_bps(self) -> int:
        return int(parse_cap(self.cap_upload or self.cap_download or "") * 8)


class _Sampler:
    """Reads the capped member's tbf byte counters every SAMPLE_S (a thread: the trainers run meanwhile).

    Each counter read is one ``tc`` process, which a loaded machine can hold for a good part of a second: a read is
    stamped at its midpoint, and one that took over READ_SLACK_S is left out, since its bytes could belong to any
    instant of that span (a slow read followed by a fast one would otherwise show a window over the link's rate)."""

    def __init__(self, lab: LinkLab, peer: int) -> None:
        self.lab, self.peer = lab, peer
        self.samples: dict[str, list[tuple[float, int]]] = {"up": [], "down": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for side, samples in self.samples.items():
                t0 = time.monotonic()
                got = self.lab.tbf_side(self.peer, side).bytes
                t1 = time.monotonic()
                if t1 - t0 <= READ_SLACK_S:
                    samples.append(((t0 + t1) / 2, got))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def windows_mbit(self) -> list[tuple[float, float]]:
        """(upload, download) over each window between consecutive samples, Mbit/s (a side's windows in order; the
        two lists are cut to the shorter, since a slow read drops a sample on one side only)."""
        sides = [_windows(self.samples[side]) for side in ("up", "down")]
        return list(zip(*sides, strict=False))


def _windows(samples: list[tuple[float, int]]) -> list[float]:
    """Mbit/s between consecutive (time, bytes) samples at least half a SAMPLE_S apart."""
    out = []
    for (t0, b0), (t1, b1) in zip(samples, samples[1:], strict=False):
        dt = t1 - t0
        if dt > 0.5 * SAMPLE_S:
            out.append((b1 - b0) * 8 / dt / 1e6)
    return out


def round_bound_seconds(cfg: CapsBenchConfig) -> float:
    """The sum over the two phases of the slowest member's part at its rate, with the group's shards (the module's
    ``round_bound_s``)."""
    n, vector = cfg.peers, cfg.params * CODEC_BYTES["fp32"]
    shares = capped_shares([j == CAPPED for j in range(n)]) or (1,) * n
    link, cap = parse_rate(cfg.link), cfg.cap_bps()
    up = [cap if j == CAPPED and cfg.direction == "upload" else link for j in range(n)]
    down = [cap if j == CAPPED and cfg.direction == "download" else link for j in range(n)]

    def seconds(payload: float, rate: int) -> float:
        return (payload + payload / DATAGRAM_PAYLOAD * DATAGRAM_OVERHEAD) * 8 / rate

    parts = [s / sum(shares) * vector for s in shares]
    scatter = max(max(seconds(vector - p, up[j]), seconds((n - 1) * p, down[j])) for j, p in enumerate(parts))
    gather = max(max(seconds((n - 1) * p, up[j]), seconds(vector - p, down[j])) for j, p in enumerate(parts))
    return scatter + gather


def summarize(records: list[list[dict[str, Any]]], cfg: CapsBenchConfig, windows: list[tuple[float, float]],
              node_caps: Any) -> dict[str, Any]:
    up = max((w[0] for w in windows), default=0.0)
    down = max((w[1] for w in windows), default=0.0)
    cap_mbit = cfg.cap_bps() / 1e6
    bound = round_bound_seconds(cfg)
    bound_equal = transfer_seconds(cfg.params, cfg.peers, "fp32", cfg.cap_bps())
    mine = [r["seconds"] for r in records[CAPPED][cfg.warmup:]]
    complete = all(r["outcome"] == "averaged" and r["group_size"] == cfg.peers for rs in records for r in rs) and all(
        len(rs) == cfg.steps for rs in records)
    round_s = statistics.median(mine) if mine else float("nan")
    t_first = min((rs[0]["t0"] for rs in records if rs), default=0.0)
    return {
        "peers": cfg.peers, "link": cfg.link, "direction": cfg.direction, "params": cfg.params, "steps": cfg.steps,
        "cap_mbit": round(cap_mbit, 3),
        "upload_max_1s_mbit": round(up, 3), "download_max_1s_mbit": round(down, 3),
        "max_1s_over_cap": round((up if cfg.direction == "upload" else down) / cap_mbit, 4),
        "windows_mbit": [round(w[0 if cfg.direction == "upload" else 1], 2) for w in windows],
        "averages_complete": complete,
        "round_s": round(round_s, 4), "round_bound_s": round(bound, 4), "round_over_bound": round(round_s / bound, 4),
        "round_bound_equal_s": round(bound_equal, 4),
        # the least of the capped member's averages that reached it (its all-gather; 1.0 on a lossless link): the
        # average it trains on is the group's, not its own vector kept for want of the owners' shards
        "capped_received_min": min((float(r["received_fraction"]) for r in records[CAPPED]
                                    if r.get("received_fraction") is not None), default=None),
        "outcomes": sorted({r["outcome"] for rs in records for r in rs}),
        # (trainer, step, outcome, group size) of the first steps that did not average with every member
        "incomplete": [(i, k, r["outcome"], r["group_size"]) for i, rs in enumerate(records) for k, r in enumerate(rs)
                       if r["outcome"] != "averaged" or r["group_size"] != cfg.peers][:8],
        "node_caps": node_caps,
        # every trainer's steps as (start, end, outcome, group size), seconds from the first step's start: which
        # member left a group, and whether its rounds ended before or after the others'
        "timeline": [[(round(r["t0"] - t_first, 3), round(r["t1"] - t_first, 3), r["outcome"], r["group_size"])
                      for r in rs] for rs in records],
    }


def run_caps_bench(cfg: CapsBenchConfig, *, say: Any = print) -> dict[str, Any]:
    cfg.check()
    workdir = tempfile.mkdtemp(prefix="peerd-bench-caps-")
    flag = "--max-upload" if cfg.direction == "upload" else "--max-download"
    cap_text = cfg.cap_upload or cfg.cap_download or ""
    lab = LinkLab(cfg.peers, cfg.link)
    say(f"link lab: {cfg.peers} namespaces, {cfg.link} links; member {CAPPED} {flag} {cap_text}")
    lab.start()
    try:
        swarm = LocalSwarm(os.path.join(workdir, "swarm"), lab=lab)
        procs: list[tuple[subprocess.Popen, str, Any]] = []
        try:
            for i in range(cfg.peers):
                swarm.wait_ready(swarm.start(extra=(flag, cap_text) if i == CAPPED else ()))
            swarm.wait_settled()  # every daemon's routing table holds the others
            step_cfg = StepBenchConfig(peers=cfg.peers, steps=cfg.steps, params=cfg.params, link=cfg.link,
                                       warmup=cfg.warmup, timeout_s=cfg.timeout_s)
            with _Sampler(lab, CAPPED) as sampler:
                start_workers(procs, swarm, workdir, step_cfg, lab.exec_prefix)
                say(f"{cfg.peers} trainers: {cfg.steps} sync steps of {cfg.params} parameters ...")
                records = wait_workers(procs, workdir, step_cfg)
            node_caps = swarm.nodes[CAPPED].call("status").get("caps")
        finally:
            stop_workers(procs)
            swarm.cleanup()
    finally:
        lab.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(records, cfg, sampler.windows_mbit(), node_caps)


def add_parser(bench: Any) -> None:
    """The `bench caps` sub-parser (registered by name in tools/cli_tools.py's BENCH_MODULES)."""
    b = bench.add_parser("caps", help="4 daemons in the link lab average continuously, one capped: does it keep "
                                      "to its cap, and the group's round to what the cap allows? (root)")
    b.add_argument("--peers", type=int, default=4, metavar="N", help="daemons and trainers (default 4)")
    b.add_argument("--link", default="100mbit", metavar="RATE", help="every peer's link (default 100mbit)")
    cap = b.add_mutually_exclusive_group(required=True)
    cap.add_argument("--cap-upload", metavar="RATE", help="member 1 runs with --max-upload RATE (e.g. 20mbit)")
    cap.add_argument("--cap-download", metavar="RATE", help="member 1 runs with --max-download RATE")
    b.add_argument("--params", type=float, default=2_000_000, metavar="P",
                   help="float32 parameters averaged each step (default 2000000)")
    b.add_argument("--steps", type=int, default=8, metavar="M", help="steps per trainer (default 8)")
    b.add_argument("--warmup", type=int, default=2, metavar="W", help="first steps left out of round_s (default 2)")
    b.add_argument("--json", action="store_true", help="print JSON only")


def cmd_bench_caps(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = CapsBenchConfig(peers=args.peers, link=args.link, cap_upload=args.cap_upload,
                          cap_download=args.cap_download, params=int(args.params), steps=args.steps,
                          warmup=min(args.warmup, args.steps - 1))
    result = run_bench(cfg, parser, lambda say: run_caps_bench(cfg, say=say), print_json=args.json,
                       left="every daemon, namespace and temp dir")
    if isinstance(result, int):
        return result
    d = result["direction"]
    print(f"{result['peers']} peers on {result['link']} links, member {CAPPED} capped at {result['cap_mbit']} Mbit/s "
          f"({d})")
    print(f"  {d}_max_1s_mbit: {result[f'{d}_max_1s_mbit']} ({result['max_1s_over_cap']:.3f} x cap)")
    print(f"  round_s: {result['round_s']}  round_bound_s: {result['round_bound_s']} "
          f"({result['round_over_bound']:.3f} x)")
    print(f"  averages_complete: {result['averages_complete']}  outcomes: {result['outcomes']}  "
          f"capped_received_min: {result['capped_received_min']}")
    return 0
