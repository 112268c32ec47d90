"""`peerd sim moshpit`: N peers' real Moshpit round machines (moshpit/rounds.py) in one process, in virtual time.

What is real: every peer's ``RoundMachine`` (keys, matchmaker, kept groups, progress records, round numbers)
decides exactly as it does in a daemon. What is modelled:

- the DHT is one shared dictionary with the DHT's record semantics (a record per (key, owner), the newest
  expiry wins, expired records are not read), each put and get taking a random 20-80 ms;
- messages (MM_JOIN, MM_BEGIN, MM_DISBAND and their answers) take 2-10 ms and are never lost; a request to a
  peer that has failed is answered by its timeout (timeout x attempts, as the endpoint retries);
- no sealing or signatures (a null sealer: record owners are 32 random bytes, node id = SHA-256 of them);
- a group's average is flow-level (``flow_average``): shard j of the vector belongs to member j, as in
  allreduce/group.py; every member that started the average and is alive when it ends gets, for each shard
  whose owner is such a member, the mean of those members' values, and keeps its own values for the shards of
  members that failed or never came. tests/test_sim_moshpit.py checks it against the real GroupAverage.

Peers step in lockstep, as trainers do: every live peer starts round r within 50 ms of the others, once every
live peer has finished round r-1. A peer fails in a round with probability F, at a time drawn uniformly from
the round's first second (it leaves for good: matchmaking or averaging, whichever it is in). ``mse`` after each
round is the mean over the surviving peers of the squared distance (summed over the 16 elements) of their
vector to the survivors' exact mean.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...allreduce.shards import Layout
from ...moshpit.keys import Grid, KeyManager
from ...moshpit.matchmaking import Candidate, Group
from ...moshpit.rounds import Average, Count, Get, Note, Notify, Put, Request, RoundMachine
from ...wire import messages as m
from ...wire.identity import node_id_of
from .net import Network

DIM = 16
TARGET_MSE = 1e-9
RUN = "sim"
DHT_LATENCY_S = (0.02, 0.08)
MSG_LATENCY_S = (0.002, 0.01)
START_JITTER_S = 0.05
FAIL_SPAN_S = 1.0
AVERAGE_S = 0.05  # a group's average takes this long once its last member started it
AVERAGE_WAIT_S = 1.0  # ... and ends this long after its first member started, whoever is missing (floor_s)
ROUND_GAP_S = 0.1
MAX_PEERS = 100_000
MAX_ROUNDS = 1000


# -- the flow-level average ---------------------------------------------------------------------------
def flow_average(vectors: list[np.ndarray | None], weights: list[float] | None = None) -> list[np.ndarray | None]:
    """A group's average at flow level: ``vectors[j]`` is member j's vector, None for a member that failed or
    never started. Shard j (allreduce.shards.Layout) is averaged by member j: the weighted mean of the present
    members' values when member j is present, else every member keeps its own values there. Returns each
    member's result (None for absent members)."""
    n = len(vectors)
    present = [j for j, v in enumerate(vectors) if v is not None]
    if not present:
        return [None] * n
    length = len(vectors[present[0]])  # type: ignore[arg-type]
    w = np.array([1.0 if weights is None else weights[j] for j in present], dtype=np.float64)
    stack = np.stack([vectors[j] for j in present]).astype(np.float64)  # type: ignore[misc]
    mean = (w[:, None] * stack).sum(axis=0) / w.sum()
    out = stack.copy()
    layout = Layout(length, n, 1)
    for j in present:
        lo, hi = layout.shard(j)
        out[:, lo:hi] = mean[lo:hi]
    results: list[np.ndarray | None] = [None] * n
    for row, j in enumerate(present):
        results[j] = out[row]
    return results


# -- the DHT and the peers -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SimRecord:
    subkey: bytes
    value: bytes
    expires: float
    owner: bytes


class DictDht:
    """One dictionary for the whole swarm: (key, owner) -> the newest record (by expiry), read while alive."""

    def __init__(self) -> None:
        self.keys: dict[bytes, dict[bytes, SimRecord]] = {}

    def put(self, key: bytes, owner: bytes, value: bytes, ttl: float, now: float) -> None:
        record = SimRecord(node_id_of(owner), value, round(now + ttl, 3), owner)
        slot = self.keys.setdefault(key, {})
        old = slot.get(owner)
        if old is None or old.expires <= record.expires:
            slot[owner] = record

    def get(self, key: bytes, now: float) -> list[SimRecord]:
        return [r for r in self.keys.get(key, {}).values() if r.expires > now]


@dataclass
class Peer:
    index: int
    public_key: bytes
    node_id: bytes
    core: RoundMachine
    vector: np.ndarray
    alive: bool = True
    fail_at: float = math.inf
    in_round: bool = False
    timer_version: int = 0
    outcome: str = ""
    group_id: int = 0
    group_size: int = 1


@dataclass
class _Averaging:
    group: Group
    started: dict[int, float] = field(default_factory=dict)  # peer index -> when it started the average
    ended: bool = False


@dataclass
class SimConfig:
    peers: int
    grid: Grid
    rounds: int = 10
    fail: float = 0.0
    seed: int = 0
    window_s: float = 3.0


class Sim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        # the event loop `peerd sim dht` and the tests' networks run on; messages here are scheduled calls with a
        # drawn latency, so no link of it is used
        self.net = Network(random.Random(cfg.seed))
        self.dht = DictDht()
        self.groups: dict[int, _Averaging] = {}
        self.counts: Counter[str] = Counter()
        self.busy = 0  # peers in a round
        self.round_start = 0.0
        vectors = np.random.default_rng(cfg.seed).standard_normal((cfg.peers, DIM))
        cells = list(range(cfg.grid.cells))
        self.rng.shuffle(cells)
        adapt = cfg.peers != cfg.grid.cells  # an exact grid keeps its keys; any other swarm adapts them
        self.peers: list[Peer] = []
        self.by_id: dict[bytes, Peer] = {}
        for i in range(cfg.peers):
            pk = hashlib.sha256(f"peerd sim {cfg.seed} {i}".encode()).digest()
            node_id = node_id_of(pk)
            addr = (f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}", 7411)
            me = Candidate(0.0, node_id, pk, addr)
            rng = random.Random(f"{cfg.seed}/{i}")
            keys = KeyManager(cfg.grid, node_id, chunks=cfg.grid.cell_chunks(cells[i % len(cells)]), adapt=adapt,
                              rng=rng)
            core = RoundMachine(RUN, cfg.grid, keys, me, min_size=2, window_s=cfg.window_s, rng=rng)
            core.synced = True
            peer = Peer(i, pk, node_id, core, vectors[i].copy())
            self.peers.append(peer)
            self.by_id[node_id] = peer

    # -- the event loop -------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.net.now

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self.net.schedule(t, fn, args)

    def run_until_idle(self, done: Callable[[], bool]) -> None:
        while self.net.next_time() is not None and not done():
            self.net.run(max_events=1)

    def _latency(self, span: tuple[float, float]) -> float:
        return self.rng.uniform(*span)

    # -- one peer's actions ---------------------------------------------------------------------
    def process(self, peer: Peer) -> None:
        if not peer.alive:
            return
        core = peer.core
        for action in core.take_actions():
            if isinstance(action, Put):
                self.at(self.now + self._latency(DHT_LATENCY_S), self.dht.put, action.key, peer.public_key,
                        action.value, action.ttl, self.now)
            elif isinstance(action, Get):
                self.at(self.now + self._latency(DHT_LATENCY_S), self._answer_get, peer, action)
            elif isinstance(action, Request):
                self._request(peer, action)
            elif isinstance(action, Notify):
                self.at(self.now + self._latency(MSG_LATENCY_S), self._deliver_notify, peer.node_id, action)
            elif isinstance(action, Average):
                self._start_average(peer, action.group)
            elif isinstance(action, Count):
                self.counts[f"{action.metric}:{','.join(action.labels)}"] += action.n
            elif isinstance(action, Note):
                self.counts["notes"] += 1
        if peer.in_round and core.done:
            peer.in_round = False
            self.busy -= 1
            peer.outcome = core.outcome
            group = core.group if core.outcome == "averaged" else None
            peer.group_id, peer.group_size = (group.group_id, len(group.members)) if group else (0, 1)
            return
        deadline = core.get_timer()
        peer.timer_version += 1
        if deadline is not None:
            self.at(deadline, self._timer, peer, peer.timer_version)

    def _timer(self, peer: Peer, version: int) -> None:
        if peer.alive and version == peer.timer_version:
            peer.core.handle_timer(self.now)
            self.process(peer)

    def _answer_get(self, peer: Peer, get: Get) -> None:
        if peer.alive:
            peer.core.on_records(get.token, self.dht.get(get.key, self.now), self.now)  # type: ignore[arg-type]
            self.process(peer)

    def _request(self, sender: Peer, req: Request) -> None:
        target = self.by_id.get(req.to.node_id)
        t = self.now + self._latency(MSG_LATENCY_S)
        if target is None or not target.alive:
            self.at(self.now + req.timeout * req.attempts, self._failed, sender, req.token)
            return
        self.at(t, self._serve, sender, target, req)

    def _serve(self, sender: Peer, target: Peer, req: Request) -> None:
        if not target.alive:
            self.at(self.now + req.timeout * req.attempts, self._failed, sender, req.token)
            return
        f = req.fields
        if req.mtype is m.MsgType.PING:  # (a kept round's probe of a late member: its daemon answers)
            ok, reason = True, ""
        elif req.mtype is m.MsgType.MM_JOIN:
            me = Candidate(f["expiry"], sender.node_id, sender.public_key, sender.core.me.addr)
            ok, reason = target.core.on_join(me, f["round"], f["key"], self.now)
        else:
            ok = target.core.on_begin(sender.node_id, f["round"], f["group"], list(f["members"]), self.now)
            reason = ""
        self.process(target)
        self.at(self.now + self._latency(MSG_LATENCY_S), self._reply, sender, target.node_id, req.token, ok, reason)

    def _reply(self, sender: Peer, by: bytes, token: int, ok: bool, reason: str) -> None:
        if sender.alive:
            sender.core.on_reply(token, by, ok, reason, self.now)
            self.process(sender)

    def _failed(self, sender: Peer, token: int) -> None:
        if sender.alive:
            sender.core.on_failed(token, self.now)
            self.process(sender)

    def _deliver_notify(self, from_id: bytes, note: Notify) -> None:
        target = self.by_id.get(note.to.node_id)
        if target is not None and target.alive:
            target.core.on_disband(from_id, note.fields["round"], self.now)
            self.process(target)

    # -- averaging ------------------------------------------------------------------------------
    def _start_average(self, peer: Peer, group: Group) -> None:
        avg = self.groups.get(group.group_id)
        if avg is None or avg.group.members != group.members:
            avg = self.groups[group.group_id] = _Averaging(group)
            self.at(self.now + AVERAGE_WAIT_S, self._end_average, group.group_id)
        if avg.ended:  # everyone else is done: this member keeps its own vector
            self.at(self.now + AVERAGE_S, self._averaged, peer, True, [peer.node_id])
            return
        avg.started[peer.index] = self.now
        if len(avg.started) == len(group.members):
            self.at(self.now + AVERAGE_S, self._end_average, group.group_id)

    def _end_average(self, group_id: int) -> None:
        avg = self.groups.get(group_id)
        if avg is None or avg.ended:
            return
        avg.ended = True
        members = [self.by_id[c.node_id] for c in avg.group.members]
        present = [p.alive and p.index in avg.started for p in members]
        results = flow_average([p.vector if ok else None for p, ok in zip(members, present, strict=True)])
        heard = [p.node_id for p, ok in zip(members, present, strict=True) if ok]
        silent = len(heard) < len(members)
        for p, res in zip(members, results, strict=True):
            if res is not None:
                p.vector = res
                self._averaged(p, silent, heard)

    def _averaged(self, peer: Peer, silent: bool, heard: list[bytes]) -> None:
        if peer.alive:
            peer.core.on_averaged(averaged=True, silent=silent, members=heard, now=self.now)
            self.process(peer)

    def _fail(self, peer: Peer) -> None:
        peer.alive = False
        if peer.in_round:
            peer.in_round = False
            self.busy -= 1

    def _round_over(self) -> bool:
        return self.busy == 0 and self.now > self.round_start + FAIL_SPAN_S

    # -- rounds ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        out: dict[str, Any] = {"mse": [], "group_sizes": [], "outcomes": [], "survivors": [], "virtual_s": []}
        alive = [p for p in self.peers]
        out["mse_initial"] = _mse([p.vector for p in alive])
        for _ in range(cfg.rounds):
            start = self.round_start = self.now + ROUND_GAP_S
            for p in alive:
                if cfg.fail and self.rng.random() < cfg.fail:
                    p.fail_at = start + self.rng.uniform(0.0, FAIL_SPAN_S)
                    self.at(p.fail_at, self._fail, p)
                self.at(start + self.rng.uniform(0.0, START_JITTER_S), self._start, p)
            self.run_until_idle(self._round_over)
            alive = [p for p in alive if p.alive]
            out["mse"].append(_mse([p.vector for p in alive]))
            outcomes: Counter[str] = Counter(p.outcome for p in alive)
            # the groups the survivors averaged in, as formed (failed members counted): size -> how many
            sizes = Counter({p.group_id: p.group_size for p in alive if p.group_id}.values())
            out["group_sizes"].append({str(s): sizes[s] for s in sorted(sizes, reverse=True)})
            out["outcomes"].append(dict(sorted(outcomes.items())))
            out["survivors"].append(len(alive))
            out["virtual_s"].append(round(self.now - start, 3))
        reached = next((i + 1 for i, v in enumerate(out["mse"]) if v <= TARGET_MSE), None)
        return {
            "peers": cfg.peers, "grid": str(cfg.grid), "rounds": cfg.rounds, "fail": cfg.fail, "seed": cfg.seed,
            "dimension": DIM, "window_s": cfg.window_s, **out, "rounds_to_1e-9": reached,
            "model": "real RoundMachine per peer; shared-dictionary DHT; flow-level averages (float64); "
                     "null sealer, no signatures; messages never lost",
        }

    def _start(self, peer: Peer) -> None:
        if not peer.alive:
            return
        peer.in_round = True
        self.busy += 1
        peer.outcome, peer.group_id, peer.group_size = "", 0, 1
        peer.core.start_round(timeout_s=30.0, now=self.now)
        self.process(peer)


def _mse(vectors: list[np.ndarray]) -> float:
    if not vectors:
        return 0.0
    stack = np.stack(vectors)
    return float(np.mean(np.sum((stack - stack.mean(axis=0)) ** 2, axis=1)))


# -- the command line -----------------------------------------------------------------------------------
def _int_in(lo: int, hi: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{what} must be in [{lo}, {hi}], got {value}")
        return value
    return parse


def _fail(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fail must be a probability like 0.01, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--fail must be in [0, 1), got {text}")
    return value


def _grid(text: str) -> Grid:
    try:
        return Grid.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _window(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window must be seconds, got {text!r}") from None
    if not 0.2 <= value <= 600:
        raise argparse.ArgumentTypeError(f"--window must be in [0.2, 600] seconds, got {text}")
    return value


def add_arguments(sim: Any) -> None:
    """Add the `sim moshpit` sub-parser to `sim`'s subparsers."""
    p = sim.add_parser("moshpit", help="Moshpit rounds of N peers' real round machines in virtual time",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=_int_in(2, MAX_PEERS, "--peers"), default=1024,
                   help="peers in the swarm (default: 1024)")
    p.add_argument("--grid", type=_grid, default=None,
                   help="the run's grid, like 32x32 (default: the smallest with sides of at most 16 that holds "
                        "--peers, as a daemon picks)")
    p.add_argument("--rounds", type=_int_in(1, MAX_ROUNDS, "--rounds"), default=10,
                   help="rounds to run (default: 10)")
    p.add_argument("--fail", type=_fail, default=0.0,
                   help="chance that a peer fails in each round, for good, at a random moment of its first "
                        "second (default: 0)")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1, "--seed"), default=0,
                   help="seed for the vectors, keys, latencies and failures: same seed, same JSON (default: 0)")
    p.add_argument("--window", type=_window, default=3.0,
                   help="the run's matchmaking window in seconds, as avg_open's window_s (default: 3.0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def simulate(cfg: SimConfig) -> dict[str, Any]:
    return Sim(cfg).run()


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    grid = args.grid or Grid.for_swarm(args.peers)
    cfg = SimConfig(args.peers, grid, rounds=args.rounds, fail=args.fail, seed=args.seed, window_s=args.window)
    wall = time.perf_counter()
    out = simulate(cfg)
    wall_s = time.perf_counter() - wall
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"{cfg.peers} peers on a {grid} grid, fail {cfg.fail:g} per round, seed {cfg.seed}")
        print(f"{'round':>5} {'mse':>10} {'survivors':>9} {'virtual s':>9}  groups (size: count)")
        print(f"{0:>5} {out['mse_initial']:>10.3g}")
        for r in range(cfg.rounds):
            groups = ", ".join(f"{s}: {c}" for s, c in out["group_sizes"][r].items())
            alone = out["outcomes"][r].get("alone", 0)
            print(f"{r + 1:>5} {out['mse'][r]:>10.3g} {out['survivors'][r]:>9} {out['virtual_s'][r]:>9.3f}  "
                  f"{groups}{f'; alone: {alone}' if alone else ''}")
        reached = out["rounds_to_1e-9"]
        print(f"mse <= 1e-9 after {reached} rounds" if reached else f"mse > 1e-9 after {cfg.rounds} rounds")
        print(f"model: {out['model']}")
    print(f"wall time {wall_s:.1f} s", file=sys.stderr)
    return 0
