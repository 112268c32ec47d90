"""`peerd bench allreduce`: N real daemons average seeded vectors as one group; optional gloo baseline.

peerd and gloo are measured alternately in the same run (peerd, gloo, peerd, gloo, ...) because these
machines are shared and noisy: only the ratio between them means much.

``--nat cone|symmetric`` (root) puts the daemons in the NAT lab (peerd/tools/lab/nat.py): the first peer public, every
other peer behind its own router of that kind, and for ``symmetric`` one more public daemon outside the group for
the members to relay through. Members are addressed where the public segment sees them (their ``observed_addr``);
how a datagram gets there (direct, punched, relayed) is the daemons' business, and the JSON reports what they say
they did: ``relayed_fraction`` (of the bytes the members sent during the averages) and ``direct_pairs``. Nothing
is estimated: a daemon that does not report these fails the bench with what is missing.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...allreduce.arctopk import PHASES
from ...localsock.client import DaemonError
from ..lab.links import PEER_IF, LinkLab, NetnsLab, QdiscStats
from ..lab.nat import NatLab
from ..swarm import LocalSwarm, Node
from .vectors import seeded_vector


@dataclass
class AllreduceBenchConfig:
    peers: int = 4
    size: int = 1_000_000
    repeat: int = 5
    loss: float = 0.0
    delay_ms: float = 0.0  # each daemon's --delay: a one-way propagation delay on what it receives
    mtu: int = 1200
    insecure: bool = False
    no_gso: bool = False
    compare_gloo: bool = False
    seed: int = 0
    robust: str = "off"  # off | clip[:C] | centered[:C]: norm clipping at each shard owner (robust.py)
    link: str | None = None  # a link lab (root): every peer in its own namespace on a link shaped at this rate
    link_loss: float = 0.0  # ... which drops this fraction of what arrives at each peer (nftables, all protocols)
    link_queue_ms: float = 20.0  # ... each tbf queueing this many ms of the rate before it drops
    # CPU seconds per daemon by stage of the data path (seal, open, pack, finalize, syscalls, ...) in the JSON;
    # PEERD_BENCH_PROFILE=1 turns it on too (for a CLI without --profile)
    profile: bool = False
    compression: str = "fp32"  # fp32 | fp16 | bf16 | int8 | int4 | arc-topk (protocol/codecs.md)
    layout: tuple[int, int] | None = None  # arc-topk: the vector as a stack of rows x cols matrices (--layout RxC)
    topk_ratio: float = 0.1  # arc-topk: rows selected per (matrix, shard) piece
    quant_group: int = 128  # int8/int4: values per scale and min
    rounding: str = "stochastic"  # int8/int4: stochastic | nearest
    nat: str = "none"  # none | cone | symmetric: the NAT lab (root); see the module's docstring


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooBaseline:
    """N torch.distributed gloo ranks that stay up across repeats, each run triggered over stdin."""

    def __init__(self, cfg: AllreduceBenchConfig, seeds: list[int], weights: list[float],
                 lab: NetnsLab | None = None) -> None:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise DaemonError("--baseline gloo needs torch: pip install 'peerd[torch]'") from None
        # In a lab, rank r runs in peer r's namespace and rank 0's store listens on peer 0's lab address (a fresh
        # namespace: the port is free); gloo binds the lab interface, so its TCP crosses the same links.
        port = 29500 if lab is not None else _free_port()
        env = dict(os.environ)
        if lab is not None:
            env.update(MASTER_ADDR=lab.addr(0), GLOO_SOCKET_IFNAME=PEER_IF)

        def start(r: int) -> subprocess.Popen:
            argv = [sys.executable, "-m", "peerd.tools.bench.gloo_worker", str(r), str(cfg.peers), str(port),
                    str(cfg.size), str(seeds[r]), str(weights[r])]
            kw: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
            return lab.popen(r, argv, **kw) if lab is not None else subprocess.Popen(argv, **kw)

        self.cpu: list[tuple[float, float]] = []  # (CPU seconds, the kernel's part) per rank and run
        self.procs = [start(r) for r in range(cfg.peers)]
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                self.close()
                raise DaemonError("a gloo worker failed to start")

    def run(self) -> float:
        """One timed all-reduce: the slowest rank's seconds (each rank's CPU goes to ``cpu``)."""
        for p in self.procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        times = []
        for p in self.procs:
            line = p.stdout.readline().split()  # type: ignore[union-attr]
            if not line or line[0] != "done":
                raise DaemonError("a gloo worker died mid-run")
            times.append(float(line[1]))
            if len(line) >= 4:
                self.cpu.append((float(line[2]), float(line[3])))
        return max(times)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.close()  # type: ignore[union-attr]
            except (BrokenPipeError, OSError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def fp32_bytes_per_peer(size: int, peers: int, mtu: int, insecure: bool) -> float:
    """What a member sends in one fp32 average of ``size`` elements, on average over the members (data datagrams
    and END repeats, sealed): the denominator of ``wire_ratio``."""
    from ...allreduce.frames import END_REPEATS
    from ...allreduce.frames import HEADER_SIZE as TENSOR_HEADER
    from ...allreduce.shards import Layout, elements_per_datagram
    from ...wire.envelope import HEADER_SIZE as ENVELOPE
    from ...wire.seal import TAG_SIZE

    overhead = ENVELOPE + (0 if insecure else TAG_SIZE) + TENSOR_HEADER
    per = elements_per_datagram(mtu - overhead + TENSOR_HEADER)
    layout = Layout(size, peers, per)

    def stream(j: int) -> int:
        start, stop = layout.shard(j)
        full, tail = divmod(stop - start, per)
        return full * (overhead + 4 * per) + (overhead + 4 * tail if tail else 0) + END_REPEATS * overhead

    s = [stream(j) for j in range(peers)]
    return sum(sum(s) - s[i] + (peers - 1) * s[i] for i in range(peers)) / peers


NAT_KINDS = ("none", "cone", "symmetric")
NAT_SETTLE_S = 90.0  # how long the daemons get to settle their reachability before the first average
NAT_STATUS = ("reachability", "observed_addr", "peers_known", "paths", "path_bytes")  # in `peerd status`


class NatReportMissing(DaemonError):
    """The daemons do not report what ``--nat`` needs (the daemon side of NAT traversal); the message says what."""


def nat_kinds(peers: int, nat: str) -> list[str]:
    """The NAT lab's peers for ``peers`` members: the first public, the rest behind ``nat``; a relay for symmetric."""
    if nat not in NAT_KINDS[1:]:
        raise ValueError(f"--nat {nat!r}: expected one of {', '.join(NAT_KINDS)}")
    return ["public"] + [nat] * (peers - 1) + (["public"] if nat == "symmetric" else [])


def _nat_status(node: Node) -> dict[str, Any]:
    st = node.call("status", timeout=30)
    missing = [k for k in NAT_STATUS if k not in st]
    if missing:
        raise NatReportMissing(
            f"bench allreduce --nat: daemon {node.index}'s `peerd status --json` has no {', '.join(missing)}: the "
            "daemon side of NAT traversal (reachability, observed address, per-peer paths) is not there, "
            "so there is nothing true to report")
    return st


def _nat_members(nodes: list[Node], quiet: bool) -> list[list[Any]]:
    """Wait until every daemon has a reachability verdict and knows every other member (a path, direct or
    relayed, is set up: what is sent before it is lost); members at their observed (mapped) addresses."""
    deadline = time.monotonic() + NAT_SETTLE_S
    while True:
        statuses = [_nat_status(n) for n in nodes]
        ids = {st["peer_id"] for st in statuses}
        pending = [n.index for n, st in zip(nodes, statuses, strict=True)
                   if st["reachability"] == "unknown" or not st["observed_addr"]
                   or not ids - {st["peer_id"]} <= set(st["peers_known"])]
        if not pending:
            break
        if time.monotonic() > deadline:
            # what each of them lacks, and what its paths say (which member has no path, and why no relay)
            why = "; ".join(f"daemon {i}: {st['reachability']}, knows no "
                            f"{sorted(p[:8] for p in ids - {st['peer_id']} - set(st['peers_known']))}, "
                            f"paths {st.get('paths')}, relays not tried {st.get('relays_not_tried')}"
                            for i, st in enumerate(statuses) if i in pending)
            raise DaemonError(f"bench allreduce --nat: daemons {pending} had no reachability verdict or did not "
                              f"know every other member after {NAT_SETTLE_S:.0f} s ({why})")
        time.sleep(1.0)
    _progress("reachability: " + ", ".join(st["reachability"] for st in statuses), quiet)
    return [[st["peer_id"], *st["observed_addr"].rsplit(":", 1)] for st in statuses]


def path_bytes(nodes: list[Node]) -> list[dict[str, int]]:
    """Each member's bytes sent so far by path kind (direct, punched, relayed), from its status ``path_bytes``."""
    return [{k: int(v) for k, v in _nat_status(n)["path_bytes"].items()} for n in nodes]


def nat_fields(nodes: list[Node], before: list[dict[str, int]], after: list[dict[str, int]]) -> dict[str, Any]:
    """``relayed_fraction``: of the bytes the members sent during the averages (their ``path_bytes`` counters
    before and after: the tensors, and the little control traffic of that window), those sent through a relay;
    ``direct_pairs``: member pairs both of whose ends reach the other directly: punched (``paths``), or known
    (``peers_known``) and not in ``paths``, which lists only the peers a node punched to or relays to."""
    delta = [{k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys()} for a, b in zip(after, before, strict=True)]
    sent = sum(sum(d.values()) for d in delta)
    relayed = sum(d.get("relayed", 0) for d in delta)
    statuses = [_nat_status(n) for n in nodes]
    ids = [st["peer_id"] for st in statuses]

    def kind(a: int, b: int) -> str | None:
        how = statuses[a]["paths"].get(ids[b])
        if how is None:
            return "direct" if ids[b] in statuses[a]["peers_known"] else None
        return how if isinstance(how, str) else how.get("kind")

    pairs = [(a, b) for a in range(len(nodes)) for b in range(a + 1, len(nodes))]
    direct = sum(1 for a, b in pairs if kind(a, b) in ("direct", "punched") and kind(b, a) in ("direct", "punched"))
    return {"relayed_fraction": relayed / sent if sent else 0.0,
            "direct_pairs": direct, "member_pairs": len(pairs),
            "reachability": [st["reachability"] for st in statuses]}


def relayed_for_others(nodes: list[Node]) -> dict[str, Any]:
    """What the nodes relayed for others, summed (a public member relays too): datagrams, bytes, and refusals
    by reason (``relay_budget``: a sender faster than its relay's grant; data lost, never retransmitted)."""
    out: dict[str, Any] = {"datagrams": 0, "bytes": 0, "refused": {}}
    for node in nodes:
        mine = _nat_status(node).get("relayed_for_others") or {}
        out["datagrams"] += int(mine.get("datagrams", 0))
        out["bytes"] += int(mine.get("bytes", 0))
        for why, n in (mine.get("refused") or {}).items():
            out["refused"][why] = out["refused"].get(why, 0) + int(n)
    return out


def _exact_mean(seeds: list[int], weights: list[float], size: int) -> np.ndarray:
    acc = np.zeros(size, dtype=np.float64)
    for seed, w in zip(seeds, weights, strict=True):
        acc += np.float64(np.float32(w)) * seeded_vector(seed, size)
    acc /= sum(float(np.float32(w)) for w in weights)
    return acc


def _per_average(runs: list[dict[str, Any]], peers: int) -> dict[str, list[float]]:
    """Per average (``peers`` replies each, in order): the pacer's end rate (MB/s, median over peers) and the
    means over peers of its phases' seconds, sendmsg calls and receive passes."""
    averages = [runs[i:i + peers] for i in range(0, len(runs), peers)]
    out: dict[str, list[float]] = {
        "pacer_rate_mb_s": [round(statistics.median(r.get("pacer_rate", 0.0) for r in a) / 1e6, 3)
                            for a in averages]}
    for key in ("rs_s", "ag_s", "send_calls", "receive_passes"):
        out[key] = [round(statistics.mean(r.get(key) or 0.0 for r in a), 4) for a in averages]
    return out


def _arc_phase_s(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """arc-topk's three phases over every member and repeat: median and max seconds, and the handshake's median."""
    out: dict[str, dict[str, float]] = {}
    for i, name in enumerate(PHASES):
        ph = [rep["arc_phases"][i] for rep in runs if len(rep.get("arc_phases", ())) > i]
        if ph:
            out[name] = {"median": round(statistics.median(p["s"] for p in ph), 4),
                         "max": round(max(p["s"] for p in ph), 4),
                         "handshake_median": round(statistics.median(p["handshake_s"] for p in ph), 4),
                         "deadline_halves": sum(p["ended_by"].count("deadline") for p in ph)}
    return out


def run_allreduce_bench(cfg: AllreduceBenchConfig, *, quiet: bool = False) -> dict[str, Any]:
    if cfg.nat != "none" and cfg.compare_gloo:
        raise ValueError("--compare-gloo cannot run behind --nat (gloo's TCP does not traverse NATs)")
    rng = random.Random(cfg.seed)
    seeds = [cfg.seed * 1000 + i for i in range(cfg.peers)]
    weights = [float(rng.randint(1, 64)) for _ in range(cfg.peers)]
    workdir = tempfile.mkdtemp(prefix="peerd-bench-")
    extra: list[str] = ["--mtu", str(cfg.mtu), "--log-level", os.environ.get("PEERD_BENCH_LOG", "warning")]
    if cfg.delay_ms:
        extra += ["--delay", f"{cfg.delay_ms:g}"]
    if cfg.no_gso:
        extra.append("--no-gso")
    profile = cfg.profile or os.environ.get("PEERD_BENCH_PROFILE", "") == "1"
    lab: NetnsLab | None = None
    try:
        if cfg.nat != "none":
            kinds = nat_kinds(cfg.peers, cfg.nat)
            lab = NatLab(kinds, cfg.link, cfg.link_loss, queue_ms=cfg.link_queue_ms)
            _progress(f"building a NAT lab: 1 public peer, {cfg.peers - 1} behind {cfg.nat} NATs"
                      + (", 1 public relay" if cfg.nat == "symmetric" else "")
                      + (f", links at {cfg.link}" if cfg.link else "") + " ...", quiet)
            lab.start()
        elif cfg.link:
            lab = LinkLab(cfg.peers, cfg.link, cfg.link_loss, queue_ms=cfg.link_queue_ms)
            _progress(f"building a link lab: {cfg.peers} namespaces at {cfg.link}, link loss {cfg.link_loss} ...",
                      quiet)
            lab.start()  # LabError (not root, a tool missing) before anything else starts; it cleans up itself
        swarm = LocalSwarm(os.path.join(workdir, "swarm"), insecure=cfg.insecure, metrics=False, lab=lab)
    except BaseException:
        if lab is not None:
            lab.close(raise_errors=False)
        if not os.environ.get("PEERD_BENCH_LOG"):  # (set: the daemons log at that level, and their logs stay)
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    gloo: GlooBaseline | None = None
    try:
        _progress(f"starting {cfg.peers} daemons ...", quiet)
        nodes = swarm.start_lossy(cfg.peers, tuple(extra), cfg.loss, cfg.seed)
        relay_node: Node | None = None
        if cfg.nat == "symmetric":  # the relay: a public daemon in the swarm, not in the group
            relay_node = swarm.start(extra=tuple(extra))
            swarm.wait_ready(relay_node)
        if cfg.nat != "none":
            members = _nat_members(nodes, quiet)
        else:
            members = [[n.status["peer_id"], *n.status["listen"].rsplit(":", 1)] for n in nodes]
        members = [[pid, host, int(port)] for pid, host, port in members]
        if cfg.compare_gloo:
            _progress("starting gloo workers ...", quiet)
            gloo = GlooBaseline(cfg, seeds, weights, lab)
        exact = _exact_mean(seeds, weights, cfg.size)
        peerd_times: list[float] = []
        gloo_times: list[float] = []
        runs: list[dict[str, Any]] = []
        errors: list[float] = []
        biases: list[float] = []
        rmses: list[float] = []
        uplink_bytes: list[int] = []  # bytes every peer's uplink tbf sent during the peerd averages (lab only)
        queue_drops = {"up": [0, 0], "down": [0, 0]}  # per side: packets the tbfs dropped, packets offered
        if lab is not None:
            lab.reset_counters()  # the drop fraction below covers the averages, not the daemons' startup
        nat_before = path_bytes(nodes) if cfg.nat != "none" else []
        pool = ThreadPoolExecutor(max_workers=cfg.peers)
        arc: dict[str, Any] = {}
        if cfg.compression == "arc-topk":
            if cfg.layout is None:
                raise ValueError("arc-topk needs a layout (--layout RxC)")
            arc = {"layout": list(cfg.layout), "topk_ratio": cfg.topk_ratio}
        for r in range(cfg.repeat):
            group = rng.getrandbits(32)
            list(pool.map(lambda i, g=group: nodes[i].call(
                "bench_prepare", timeout=600, group_id=g, members=members, index=i, seed=seeds[i],
                size=cfg.size, weight=weights[i], robust=cfg.robust, profile=profile, compression=cfg.compression,
                quant_group=cfg.quant_group, rounding=cfg.rounding, run=cfg.seed, **arc), range(cfg.peers)))
            up_before = _uplinks(lab)
            tbf_before = lab.tbf_sides() if lab is not None else {}
            t0 = time.time()
            replies = list(pool.map(lambda n, g=group: n.call("bench_run", timeout=600, group_id=g), nodes))
            elapsed = max(rep["done_at"] for rep in replies) - t0
            uplink_bytes += [a.bytes - b.bytes for a, b in zip(_uplinks(lab), up_before, strict=True)]
            if lab is not None:
                for side, (d, offered) in lab.queue_drop_shares(tbf_before, lab.tbf_sides()).items():
                    queue_drops[side][0] += d
                    queue_drops[side][1] += offered
            peerd_times.append(elapsed)
            runs.extend(replies)
            for i, node in enumerate(nodes):
                path = os.path.join(workdir, f"result-{i}.npy")
                node.call("bench_result", timeout=600, group_id=group, path=path)
                diff = np.load(path).astype(np.float64) - exact
                os.unlink(path)
                errors.append(float(np.max(np.abs(diff))) if cfg.size else 0.0)
                biases.append(float(diff.mean()) if cfg.size else 0.0)
                rmses.append(float(np.sqrt(np.mean(diff * diff))) if cfg.size else 0.0)
            line = f"repeat {r + 1}/{cfg.repeat}: peerd {elapsed:.3f} s"
            if gloo is not None:
                gloo_times.append(gloo.run())
                line += f", gloo {gloo_times[-1]:.3f} s"
            _progress(line, quiet)
        pool.shutdown()
        sent = sum(rep["datagrams_sent"] for rep in runs)
        received = sum(rep["datagrams_received"] for rep in runs)
        drops: dict[str, int] = {}
        for rep in runs:
            for reason, count in rep["drops"].items():
                drops[reason] = drops.get(reason, 0) + count
        endpoint_drops: dict[str, int] = {}
        for rep in runs:
            for reason, count in rep.get("endpoint_drops", {}).items():
                endpoint_drops[reason] = endpoint_drops.get(reason, 0) + count
        planes = sorted({rep.get("dataplane", "unknown") for rep in runs})
        out: dict[str, Any] = {
            "dataplane": planes[0] if len(planes) == 1 else planes,  # "native" or "python" (every daemon's)
            "peers": cfg.peers,
            "size": cfg.size,
            "mtu": cfg.mtu,
            "loss": cfg.loss,
            "delay_ms": cfg.delay_ms,
            "repeat": cfg.repeat,
            "insecure": cfg.insecure,
            "robust": cfg.robust,
            "compression": cfg.compression,
            **({"quant_group": cfg.quant_group, "rounding": cfg.rounding} if cfg.compression.startswith("int")
               else {}),
            # arc-topk: rows x cols of the layout, the ratio, and per average and peer the row shards whose
            # selection it knew and the share of its contributed rows whose average came back
            **({"layout": "x".join(map(str, cfg.layout or ())), "topk_ratio": cfg.topk_ratio,
                "known_selections": statistics.mean(rep.get("known_selections", 0) for rep in runs),
                "got_fraction": statistics.mean(rep.get("got_fraction", 0.0) for rep in runs),
                "arc_phase_s": _arc_phase_s(runs)}
               if cfg.compression == "arc-topk" else {}),
            "gso": bool(nodes[0].status.get("gso")) and not cfg.no_gso,
            "peerd_s": statistics.median(peerd_times),
            "peerd_s_all": [round(t, 6) for t in peerd_times],
            "received_fraction": received / sent if sent else 1.0,
            "datagrams_sent": sent,  # tensor datagrams sent, every peer and repeat: what ``drops`` are counted of
            "kernel_drops": sum(rep["kernel_drops"] for rep in runs),
            "drops": drops,  # datagrams the groups did not use, by reason (late, duplicate, ...)
            # datagrams the daemons' endpoints dropped, by reason (injected, overload, replay, at relays too), and
            # tensor datagrams sent through a relay (a loopback run that relays lost a punch: its data is lost twice)
            "endpoint_drops": dict(sorted(endpoint_drops.items())),
            "datagrams_relayed": sum(rep.get("datagrams_relayed", 0) for rep in runs),
            "bytes_sent_per_peer": statistics.mean(rep["bytes_sent"] for rep in runs),
            # CPU seconds one daemon spends per average (mean over peers and repeats): steadier than peerd_s
            # on a shared machine, and what an optimization of the data path should move.
            "cpu_s_per_peer": statistics.mean(rep.get("cpu_s", 0.0) for rep in runs),
            # ... per average (mean over peers), in order: the first holds the pacer's startup from START_RATE and
            # the daemons' first touch of the stage and result memory, which later averages reuse
            "cpu_s_per_peer_all": [round(statistics.mean(rep.get("cpu_s", 0.0) for rep in runs[i:i + cfg.peers]), 6)
                                   for i in range(0, len(runs), cfg.peers)],
            # ... and, per average in the same order, what tells a startup's cost from steady state's: the pacer's
            # rate at its end (MB/s, median over peers), each phase's seconds, sends and receive wake-ups
            "per_average": _per_average(runs, cfg.peers),
            # ... and the kernel's part of it (syscalls: the copies into and out of the socket, loopback delivery)
            "sys_s_per_peer": statistics.mean(rep.get("sys_s", 0.0) for rep in runs),
            # Minor page faults and involuntary context switches per daemon per average: on a shared machine the
            # wall time a daemon loses to other processes shows here, not in cpu_s_per_peer
            "page_faults_per_peer": statistics.mean(rep.get("page_faults", 0) for rep in runs),
            "preempted_per_peer": statistics.mean(rep.get("preempted", 0) for rep in runs),
            # Syscall batching per average and peer: recvmsg calls, receive passes (wake-ups), sendmsg calls.
            "receive_calls_per_peer": statistics.mean(rep.get("receive_calls", 0) for rep in runs),
            "receive_passes_per_peer": statistics.mean(rep.get("receive_passes", 0) for rep in runs),
            "send_calls_per_peer": statistics.mean(rep.get("send_calls", 0) for rep in runs),
            # The pacer at each average's end (median over peers and repeats, MB/s) and its decreases over the
            # run (mean per peer): under injected random loss it must not decrease (random loss is not congestion)
            "pacer_rate_mb_s": round(statistics.median(rep.get("pacer_rate", 0.0) for rep in runs) / 1e6, 3),
            "pacer_decreases_per_peer": (statistics.mean(rep.get("pacer_decreases", 0) for rep in runs[-cfg.peers:])
                                         if runs else 0),
            # where an average's time goes (median over peers and repeats, seconds): the handshake, then each phase
            # from its start to its end at this member
            "phase_s": {k: round(statistics.median(v), 4) for k in ("handshake_s", "rs_s", "ag_s")
                        if (v := [rep[k] for rep in runs if rep.get(k) is not None])},
            "phases_ended_by_deadline": sum((rep["rs_ended_by"] == "deadline") + (rep["ag_ended_by"] == "deadline")
                                            for rep in runs),
            # each of those phases, with the run (repeat) and member it belongs to
            "deadline_phases": [d | {"run": i // cfg.peers, "member": i % cfg.peers}
                                for i, rep in enumerate(runs) for d in rep.get("deadline_phases", ())],
        }
        # bytes a member sent over what it sends in fp32 for the same size (computed: the fp32 layout is fixed)
        out["wire_ratio"] = out["bytes_sent_per_peer"] / fp32_bytes_per_peer(cfg.size, cfg.peers, cfg.mtu,
                                                                             cfg.insecure)
        if profile:
            # CPU seconds per daemon per average by stage (mean over peers and repeats); "other" is the rest
            # of cpu_s_per_peer: trio, handlers, metrics, reports
            stages = sorted({k for rep in runs for k in rep.get("stages", {})})
            out["profile"] = {k: round(statistics.mean(rep.get("stages", {}).get(k, 0.0) for rep in runs), 4)
                              for k in stages}
            # calls per daemon per average by stage: CPU per call tells per-call cost from per-byte cost
            out["profile_calls"] = {k: round(statistics.mean(rep.get("stage_calls", {}).get(k, 0) for rep in runs))
                                    for k in stages if k != "other"}
        if cfg.loss == 0 and cfg.link_loss == 0:
            out["max_abs_err"] = max(errors)
        # Also without --loss: real loss (a namespace's nftables or tc) is measured by these.
        out["bias"] = statistics.mean(biases)
        out["rmse"] = statistics.mean(rmses)
        # Tail latency of one average: only meaningful with --repeat >= 20 (below that it is near the worst run)
        out["peerd_p99_s"] = p99(peerd_times)
        # What was lost beyond what was injected (--loss and --link-loss, independent: 1 - (1-a)(1-b)): the
        # data path's own losses (the pacer's overrun of the link, a full socket buffer), floored at 0.
        out["excess_loss"] = max(0.0, 1.0 - out["received_fraction"] - injected_loss(cfg.loss, cfg.link_loss))
        if cfg.nat != "none":
            out["nat"] = cfg.nat
            out.update(nat_fields(nodes, nat_before, path_bytes(nodes)))
            out["relayed_for_others"] = relayed_for_others(nodes + ([relay_node] if relay_node else []))
        if lab is not None and lab.rate_bps is not None:
            out.update(_link_fields(lab, cfg, peerd_times, uplink_bytes, queue_drops))
            out["bus_fraction"] = bus_fraction(cfg.peers, cfg.size, out["peerd_s"], lab.rate_bps)
        if gloo is not None:
            out["gloo_s"] = statistics.median(gloo_times)
            out["gloo_s_all"] = [round(t, 6) for t in gloo_times]
            out["gloo_p99_s"] = p99(gloo_times)
            out["ratio"] = out["peerd_s"] / out["gloo_s"]
            if gloo.cpu:  # gloo's CPU per rank and all-reduce, all threads, and the kernel's part: the same bytes
                out["gloo_cpu_s_per_peer"] = round(statistics.mean(c for c, _ in gloo.cpu), 6)
                out["gloo_sys_s_per_peer"] = round(statistics.mean(k for _, k in gloo.cpu), 6)
        return out
    finally:
        if gloo is not None:
            gloo.close()
        swarm.stop()
        if lab is not None:
            lab.close()
        if not os.environ.get("PEERD_BENCH_LOG"):  # (set: the daemons log at that level, and their logs stay)
            shutil.rmtree(workdir, ignore_errors=True)


def p99(times: list[float]) -> float:
    """The 99th percentile (linear interpolation) of the averages' times; with few repeats, near the worst."""
    return float(np.percentile(np.asarray(times, dtype=np.float64), 99)) if times else 0.0


def injected_loss(loss: float, link_loss: float) -> float:
    """The loss the bench injects: the daemon's --loss and the link's nftables drop act independently."""
    return 1.0 - (1.0 - loss) * (1.0 - link_loss)


def bus_fraction(peers: int, size: int, seconds: float, rate_bps: int) -> float:
    """How close one average came to the link's bound: a butterfly all-reduce must move 2(N-1)/N x 4S bytes
    through each peer's uplink, so at RATE it cannot take less than that over RATE (frame overhead caps the
    fraction near 0.92 at a 1200-byte payload)."""
    if seconds <= 0 or rate_bps <= 0:
        return 0.0
    return 2 * (peers - 1) / peers * 4 * size / seconds / (rate_bps / 8)


def _uplinks(lab: NetnsLab | None) -> list[QdiscStats]:
    return [lab.qdisc_stats(i)["up"] for i in range(lab.peers)] if lab is not None and lab.tbf is not None else []


def _link_fields(lab: NetnsLab, cfg: AllreduceBenchConfig, peerd_times: list[float],
                 uplink_bytes: list[int], queue_drops: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The lab's share of the JSON: its parameters, what its counters saw, how full peerd kept the links."""
    counters = [lab.counters(i) for i in range(lab.peers)]
    seen = sum(c.seen for c in counters)
    dropped = sum(c.dropped for c in counters)
    wire_s = sum(peerd_times) * lab.peers  # peer-seconds of uplink during the averages (a NAT lab's relay included)
    return {
        "link_rate": lab.describe()["link_rate"],
        "link_loss": cfg.link_loss,
        "link_tbf": {"burst_bytes": lab.tbf.burst_bytes, "limit_bytes": lab.tbf.limit_bytes,
                     "queue_ms": lab.tbf.queue_ms},
        # What nftables dropped of everything that arrived on the links (peerd's and, with --compare-gloo,
        # gloo's packets): the realized link loss, next to the configured one.
        "link_drop_fraction": dropped / seen if seen else 0.0,
        "link_packets_seen": seen,
        # Wire bytes (Ethernet frames, as tbf counts them) over rate x time, every uplink over every average.
        "link_utilization": sum(uplink_bytes) * 8 / (lab.rate_bps * wire_s) if wire_s > 0 else 0.0,
        # What the token buckets' queues dropped (overflow: peerd's own overrun) of the packets offered to them
        # during the peerd averages, uplinks and downlinks apart: the excess loss's cause, located.
        "link_queue_drops": {side: d / offered if offered else 0.0
                             for side, (d, offered) in (queue_drops or {}).items()},
    }


def parse_size(text: str) -> int:
    """Elements of float32: 1000, 250K, 25M; or bytes with a B suffix: 100MB, 4KB."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    as_bytes = t.endswith("B")
    if as_bytes:
        t = t[:-1]
    mult = 1
    if t and t[-1] in scale:
        mult, t = scale[t[-1]], t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError(f"{text!r}: expected a count like 1000, 250K, 25M or a byte size like 100MB") from None
    n = int(value // 4) if as_bytes else int(value)
    if n < 0:
        raise ValueError(f"{text!r}: size must not be negative")
    return n
