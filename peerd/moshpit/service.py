"""The Moshpit round scheduler: matchmaking through the DHT, then one group average per round.

One ``RunState`` per run id keeps the grid key and the round counter. A round: announce under
``run/round/key``, run the ``Matchmaker`` against DHT reads and JOIN/BEGIN/DISBAND messages, then
average with exactly the leader's member list. A member that dies mid-round is averaged out by the
group's deadline; a peer that finds no group keeps its own vector and says so.

Members are not trusted: background sends and DHT work are guarded (a failure is logged and counted in
``peerd_background_errors_total{task}``, never fatal), progress records far ahead of the run are ignored,
and an average that is not finite never replaces the caller's vector.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import numbers
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgpack
import numpy as np
import trio

from ..allreduce.robust import Robust, parse_robust
from ..allreduce.service import AllreduceService, Member
from ..dht.reads import Agreed
from ..dht.records import Record
from ..dht.service import DhtService
from ..metrics import Metrics
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..wire import messages as m
from ..wire.identity import node_id_of
from .keys import Grid, KeyManager
from .matchmaking import BUSY_RETRY_S, FOLLOW_SLACK_S, SETTLE_S, Begin, Candidate, Disband, Group, Join, Matchmaker
from .sticky import RENEW_KEY, Kept, StickyGroups

log = logging.getLogger("peerd.moshpit")
# Reads that are polled (matchmaking, the kept group's watch) stop once three of the key's holders agree
# on its records: a write racing the read shows up at the next poll. Every FULL_READ_EVERY-th poll reads
# all k holders, so members that minted ids nearest a key can hide a record for a few polls at most.
POLL_READ = Agreed(3)
FULL_READ_EVERY = 4


def _poll_read(i: int) -> Agreed | None:
    return None if i % FULL_READ_EVERY == FULL_READ_EVERY - 1 else POLL_READ

DEFAULT_WINDOW_S = 3.0
POLL_S = (0.05, 0.1, 0.2, 0.3)  # DHT reads of the key: fast at first, then every 0.3 s
PROGRESS_TTL_S = 600.0
DEFAULT_KEEP_ROUNDS = 1  # groups re-form through the DHT every round unless a run asks to keep them (sticky.py)
WATCH_S = 1.0  # how long a kept group's leader reads the DHT for outsiders before it renews anyway
OUTSIDER_S = 15.0  # a peer outside a kept group that published progress this recently is still training
CONFIG_TTL_S = 3600.0
# Rounds travel as uint32; 2**32 - 1 is never used, so the last round a run can average is MAX_ROUND. A run
# that reaches it stops with a MoshpitError (use a new run id): nothing wraps, so no round number repeats.
MAX_ROUND = 2**32 - 2
# A progress record more than MAX_AHEAD rounds ahead of both this node's round and the median of the fresh
# records is ignored (counted): one member's record could otherwise move the whole run to its last round.
MAX_AHEAD = 1000
# A node that has averaged in a run follows peers it averaged with up to MAX_AHEAD rounds ahead, strangers (ids are
# free to mint, so any number of them may agree) at most STRANGER_AHEAD: an honest swarm's rounds move together.
STRANGER_AHEAD = 16
KNOWN_PEERS = 256  # the last peers this node averaged with, per run
PROGRESS_FRESH_S = 60.0  # records stored this recently make the median (stale ones only when none is fresh)
FINITE_SLICE = 1 << 20  # elements per isfinite pass (a 4 MB slice: no 100 MB temporary)


class MoshpitError(Exception):
    """A request the scheduler refuses (bad run id, vector, grid); the message says what to fix."""


@dataclass
class RoundResult:
    vector: np.ndarray
    outcome: str  # "averaged" | "alone" | "failed"
    group_id: str  # hex; "" when alone
    group_size: int
    members: list[str]  # node ids, hex, in the group's order
    received_fraction: float
    round: int
    seconds: float
    matchmaking_s: float = 0.0
    key: str = ""
    seen: int = 1
    error: str = ""
    kept: bool = False  # averaged in a group kept from an earlier round (no matchmaking)

    def stats(self) -> dict:
        return {
            "round": self.round,
            "outcome": self.outcome,
            "group_id": self.group_id,
            "group_size": self.group_size,
            "members": self.members,
            "received_fraction": self.received_fraction,
            "seconds": self.seconds,
            "matchmaking_s": self.matchmaking_s,
            "key": self.key,
            "seen": self.seen,
            "error": self.error,
            "kept": self.kept,
        }


@dataclass
class RunState:
    run_id: str
    grid: Grid
    keys: KeyManager
    min_size: int = 2
    window_s: float = DEFAULT_WINDOW_S
    round: int = 0
    synced: bool = False  # round number taken from the swarm's progress records
    lock: trio.Lock = field(default_factory=trio.Lock)
    last: RoundResult | None = None
    state: str = "idle"  # idle | matchmaking | averaging
    sticky: StickyGroups | None = None
    begin_wake: trio.Event = field(default_factory=trio.Event)  # a renewal BEGIN, JOIN or DISBAND arrived
    max_weight: float | None = None  # owners cap each member's weight (sample count) at this; None: no cap
    robust: Robust | None = None  # owners clip contributions (allreduce/robust.py); None: plain mean
    center: np.ndarray | None = None  # the last averaged vector: the center of robust "centered" mode
    known: dict[bytes, int] = field(default_factory=dict)  # node id -> last round averaged with it (bounded)

    def note_members(self, members: list[bytes], round_no: int) -> None:
        """Remember whom this node averaged with: their progress records are believed further than strangers'."""
        for node_id in members:
            self.known.pop(node_id, None)
            self.known[node_id] = round_no
        while len(self.known) > KNOWN_PEERS:
            del self.known[next(iter(self.known))]

    def statistics(self) -> dict:
        return {
            "sticky": self.sticky.statistics() if self.sticky else None,
            "grid": str(self.grid),
            "key": self.keys.group_key(self.round),
            "round": self.round,
            "state": self.state,
            "min_size": self.min_size,
            "window_s": self.window_s,
            "max_weight": self.max_weight,
            "robust": str(self.robust) if self.robust else "off",
            "last": self.last.stats() if self.last else None,
        }


@dataclass
class _Active:
    mm: Matchmaker
    key: str
    wake: trio.Event = field(default_factory=trio.Event)


def check_max_weight(max_weight: object) -> float | None:
    """A weight cap: a positive number (math.inf: no cap, stored as None)."""
    if not isinstance(max_weight, numbers.Real) or isinstance(max_weight, bool) or not max_weight > 0:
        raise MoshpitError(f"max_weight must be a positive number of samples (inf: no cap), got {max_weight!r:.40}")
    return None if math.isinf(max_weight) else float(max_weight)


def check_robust(robust: object) -> Robust | None:
    """A Robust, or its text (``off``, ``clip[:C]``, ``centered[:C]``, parsed as the CLI does)."""
    if isinstance(robust, Robust):
        return robust
    try:
        return parse_robust(robust)
    except ValueError as e:
        raise MoshpitError(str(e)) from None


def plausible_progress(records: list[tuple[bytes, int, float]], own_round: int, now: float,
                       known: frozenset[bytes] | set[bytes] | dict = frozenset(),
                       ) -> tuple[list[tuple[bytes, int, float]], int]:
    """The progress records (owner, round, stored) to believe, and how many were ignored as too far ahead.

    Node ids are free to mint, so agreement among owners proves nothing. A node that has averaged in the run
    (``known``: whom with) believes those peers up to MAX_AHEAD rounds past its own round and strangers up to
    STRANGER_AHEAD, however many of them agree. A joiner knows nobody: it ignores records more than MAX_AHEAD
    rounds past both its round and the (lower) median of the fresh records, which one member alone cannot move
    (a member with many ids can: a joiner trusts the swarm it first sees)."""
    if not records:
        return [], 0
    if known:
        kept = [r for r in records
                if r[1] <= own_round + (MAX_AHEAD if r[0] in known else STRANGER_AHEAD)]
        return kept, len(records) - len(kept)
    values = sorted(v for _, v, stored in records if stored > now - PROGRESS_FRESH_S) or sorted(
        v for _, v, _ in records)
    limit = max(own_round, values[(len(values) - 1) // 2]) + MAX_AHEAD
    kept = [r for r in records if r[1] <= limit]
    return kept, len(records) - len(kept)


def all_finite(vector: np.ndarray) -> bool:
    """No NaN or infinity, checked a slice at a time (no temporary as large as the vector)."""
    return all(np.isfinite(vector[i:i + FINITE_SLICE]).all() for i in range(0, vector.size, FINITE_SLICE))


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not 1 <= len(run_id.encode()) <= m.MAX_RUN or "/" in run_id:
        raise MoshpitError(f"run id must be 1..{m.MAX_RUN} bytes of text without '/', got {run_id!r:.80}")
    return run_id


def published_grid(records: list[Record], fits: Callable[[Grid], bool] = lambda g: True) -> Grid | None:
    """The grid a run's publishers name most often (ties: the smaller grid), among grids that parse and fit.

    Each publisher writes under its own node id, so no member can hide another's record; ids are free to mint,
    though, so a Sybil member can still outvote: runs that must not be steered pass their grid explicitly."""
    votes: dict[Grid, int] = {}
    for r in records:
        try:
            grid = Grid.parse(r.value.decode())
        except (ValueError, UnicodeDecodeError):
            continue
        if not fits(grid):
            continue
        votes[grid] = votes.get(grid, 0) + 1
    if not votes:
        return None
    return min(votes, key=lambda g: (-votes[g], g.size, g.dims))


class MoshpitService:
    def __init__(
        self,
        endpoint: Endpoint,
        dht: DhtService,
        allreduce: AllreduceService,
        metrics: Metrics,
        *,
        address: Address,
        rng: random.Random | None = None,
        keep_rounds: int | None = None,
    ) -> None:
        """``keep_rounds``: the default for runs that do not set it (None: DEFAULT_KEEP_ROUNDS, i.e. matchmake
        every round; groups are only ever kept on 1-D grids, where one key holds the whole run)."""
        self.endpoint = endpoint
        self.keep_rounds = keep_rounds
        self.dht = dht
        self.allreduce = allreduce
        self.metrics = metrics
        self.address = address
        self.identity = endpoint.identity
        self.rng = rng or random.Random()
        self.runs: dict[str, RunState] = {}
        self._active: dict[tuple[str, int], _Active] = {}
        self._nursery: trio.Nursery | None = None
        endpoint.on_request(m.MsgType.MM_JOIN, self._on_join)
        endpoint.on_request(m.MsgType.MM_BEGIN, self._on_begin)
        endpoint.on_message(m.MsgType.MM_DISBAND, self._on_disband)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery for work that outlives a round (BEGIN retries, progress records)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def statistics(self) -> dict:
        return {run_id: st.statistics() for run_id, st in self.runs.items()}

    # -- runs -----------------------------------------------------------------------------------
    async def open(
        self,
        run_id: str,
        *,
        grid: Grid | None = None,
        cell: int | None = None,
        min_size: int = 2,
        window_s: float = DEFAULT_WINDOW_S,
        adapt: bool | None = None,
        keep_rounds: int | None = None,
        max_weight: float | None = None,
        robust: Robust | str | None = None,
    ) -> RunState:
        """Start (or reconfigure) a run. Without ``grid``, take the run's published grid or size one
        from the swarm the DHT sees. ``keep_rounds``: keep a complete group this many rounds (1: never).
        ``max_weight``: shard owners count no member's weight above this (math.inf: no cap); ``robust``:
        how owners clip contributions (a Robust or ``off``/``clip[:C]``/``centered[:C]``). Both are kept by
        the run; None leaves what the run had."""
        check_run_id(run_id)
        cap = check_max_weight(max_weight) if max_weight is not None else None
        robust_mode = check_robust(robust) if robust is not None else None
        if not 0.2 <= window_s <= 600:
            raise MoshpitError(f"window_s must be in [0.2, 600] seconds, got {window_s}")
        if keep_rounds is not None and (type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000):
            raise MoshpitError(f"keep_rounds must be an integer in [1, 1000], got {keep_rounds!r}")
        if grid is None and run_id in self.runs:
            grid = self.runs[run_id].grid
        elif grid is None:
            grid = await self._published_grid(run_id)
            if grid is None:
                grid = Grid.for_swarm(self.dht.peer_count() + 1)
        else:
            self._spawn(self._publish_grid, run_id, grid)
        if not 2 <= min_size <= grid.size:
            raise MoshpitError(f"min_size must be in [2, {grid.size}] for a {grid} grid, got {min_size}")
        self._check_fits(grid.size)
        old = self.runs.get(run_id)
        regrid = old is not None and old.grid != grid
        if old is not None and cell is None and old.grid == grid:
            keys = old.keys  # reconfiguring a running run (e.g. its min_size) keeps its place on the grid
            if adapt is not None:
                keys.adapt = adapt
        else:
            chunks = grid.cell_chunks(cell) if cell is not None else None
            keys = KeyManager(grid, self.identity.node_id, chunks=chunks,
                              adapt=cell is None if adapt is None else adapt, rng=self.rng)
        if old is not None:  # in place: a round under way keeps counting on the same state
            st = old
            st.grid, st.keys, st.min_size, st.window_s = grid, keys, min_size, window_s
        else:
            st = self.runs[run_id] = RunState(run_id, grid, keys, min_size=min_size, window_s=window_s)
        if keep_rounds is None and st.sticky is not None and not regrid:
            keep_rounds = st.sticky.keep_rounds  # reconfiguring without saying: keep what the run had
        elif keep_rounds is None:
            keep_rounds = self.keep_rounds if self.keep_rounds is not None else DEFAULT_KEEP_ROUNDS
        if st.sticky is None or st.sticky.keep_rounds != keep_rounds or regrid:
            st.sticky = StickyGroups(self.identity.node_id, keep_rounds)
        self._configure(st, max_weight, cap, robust, robust_mode)
        if not st.synced:
            await self._sync_round(st)
        return st

    @staticmethod
    def _configure(st: RunState, max_weight: object, cap: float | None, robust: object,
                   robust_mode: Robust | None) -> None:
        if max_weight is not None:
            st.max_weight = cap
        if robust is not None:
            if robust_mode is None or robust_mode.mode != "centered":
                st.center = None
            st.robust = robust_mode

    def _check_fits(self, size: int) -> None:
        members = [[bytes(32), ipaddress.ip_address(self._loopback()).packed, 65535]] * size
        body = m.encode(m.MsgType.MM_BEGIN, {"rid": 2**64 - 1, "from": self.endpoint._from, "run": "r" * m.MAX_RUN,
                                             "round": 2**32 - 1, "group": 2**32 - 1, "members": members})
        if size > m.MAX_GROUP or len(body) > self.endpoint.max_body:
            raise MoshpitError(
                f"groups of {size} do not fit one datagram at --mtu {self.endpoint.mtu}; "
                f"use a smaller grid side or a larger --mtu"
            )

    async def average(self, run_id: str, vector: np.ndarray, weight: float, *, timeout_s: float = 30.0,
                      keep_rounds: int | None = None, round_no: int | None = None,
                      max_weight: float | None = None, robust: Robust | str | None = None,
                      center: np.ndarray | None = None) -> RoundResult:
        """One Moshpit round for ``run_id``: find a group, average in it. Never raises for churn.

        ``keep_rounds``: set the run's kept-group rounds (as ``open`` does) if it differs, so a trainer
        session can choose it without a separate open; None leaves the run as it is.
        ``round_no``: average in exactly this round (the caller numbers rounds, e.g. a trainer's parameter
        averages by its step, which every peer shares); None: the run's next round, kept in step with the
        swarm through progress records. Rounds that happen every K steps need it: a peer that opened the
        run a moment after others finished its first round would otherwise start one round ahead of them,
        and the two halves would wait out each other's deadlines every time.
        ``max_weight``, ``robust``: set the run's weight cap and robust mode (as ``open`` does); None leaves them.
        ``center``: the center of robust "centered" mode for this round only (e.g. the caller's own parameters,
        which honest replicas stay close to); None: the run's last average.

        The result is never non-finite: an average that holds NaN or infinity is reported ``failed`` and the
        caller gets its own vector back. A run past its last round (MAX_ROUND) raises MoshpitError."""
        check_run_id(run_id)
        if round_no is not None and (type(round_no) is not int or not 0 <= round_no <= MAX_ROUND):
            raise MoshpitError(f"round must be an integer in [0, {MAX_ROUND}], got {round_no!r}")
        cap = check_max_weight(max_weight) if max_weight is not None else None
        robust_mode = check_robust(robust) if robust is not None else None
        if keep_rounds is not None and (type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000):
            raise MoshpitError(f"keep_rounds must be an integer in [1, 1000], got {keep_rounds!r}")
        if vector.dtype != np.float32 or vector.ndim != 1:
            raise MoshpitError("the vector must be flat float32")
        if center is not None and (center.dtype != np.float32 or center.shape != vector.shape
                                   or not np.isfinite(center).all()):
            raise MoshpitError("the center must be a finite float32 vector of the vector's shape")
        if not (math.isfinite(weight) and weight > 0):
            raise MoshpitError(f"weight must be a positive number (a sample count), got {weight}")
        if not 1.0 <= timeout_s <= 3600:
            raise MoshpitError(f"timeout_s must be in [1, 3600], got {timeout_s}")
        st = self.runs.get(run_id) or await self.open(run_id, keep_rounds=keep_rounds)
        async with st.lock:
            if keep_rounds is not None and (st.sticky is None or st.sticky.keep_rounds != keep_rounds):
                st.sticky = StickyGroups(self.identity.node_id, keep_rounds)
            self._configure(st, max_weight, cap, robust, robust_mode)
            if round_no is not None:
                st.round = round_no
            if st.round > MAX_ROUND:
                raise MoshpitError(f"run {run_id!r} has averaged its last round ({MAX_ROUND}): round numbers are "
                                   f"uint32 and do not wrap; continue under a new run id")
            return await self._round(st, vector, float(weight), timeout_s, numbered=round_no is not None,
                                     center=center)

    async def _round(self, st: RunState, vector: np.ndarray, weight: float, timeout_s: float,
                     numbered: bool = False, center: np.ndarray | None = None) -> RoundResult:
        round_no = st.round
        key = st.keys.group_key(round_no)
        wall0 = time.perf_counter()
        st.state = "matchmaking"
        group: Group | None = None
        seen, kept = 1, False
        sticky = st.sticky
        assert sticky is not None
        try:
            if sticky.kept is not None:
                group = await self._renew(st, sticky, round_no, key, timeout_s)
                kept = group is not None
            if group is None:
                expected: list[frozenset[bytes] | None] = [None]
                with trio.move_on_after(max(0.0, min(timeout_s - (time.perf_counter() - wall0), st.window_s + 10.0))):
                    group, seen = await self._matchmake(st, round_no, key, expected)
                sticky.after_matchmaking(group, round_no, seen, expected[0])
                if (group is not None and sticky.keep_rounds > 1 and sticky.kept is None
                        and group.leader != self.identity.node_id):
                    # the leader may think the group complete: tell it now, or it would wait out a window
                    # next round for this node's renewal request
                    self._tell_not_kept(st, group, round_no)
            mm_s = time.perf_counter() - wall0
            if group is None:
                st.keys.after_alone()
                result = RoundResult(vector.copy(), "alone", "", 1, [self.identity.node_id.hex()], 1.0,
                                     round_no, mm_s, mm_s, key, seen)
                st.synced = False  # perhaps the swarm is in another round: look at its progress next time
            else:
                st.state = "averaging"
                result = await self._average_group(st, group, vector, weight, timeout_s - mm_s, round_no, key, seen,
                                                   center)
                result.matchmaking_s = mm_s
                result.kept = kept
                if kept:
                    sticky.renewed += 1
                else:  # a kept round skips the key rotation: the group is the one this key formed
                    st.keys.after_group(group.index, len(group.members), seen)
        finally:
            st.state = "idle"
        result.seconds = time.perf_counter() - wall0
        st.round = round_no + 1
        st.last = result
        if not st.synced and not numbered:  # the caller numbers this run's rounds: nothing to catch up with
            await self._sync_round(st)
        self._spawn(self._publish_progress, st.run_id, round_no)
        self.metrics.moshpit_rounds.labels(result.outcome).inc()
        self.metrics.moshpit_group_size.set(result.group_size)
        self.metrics.moshpit_round_seconds.observe(result.seconds)
        log.info("run %s round %d: %s, group of %d, %.3f s", st.run_id, round_no, result.outcome,
                 result.group_size, result.seconds)
        return result

    async def _average_group(self, st, group, vector, weight, budget_s, round_no, key, seen,
                             center: np.ndarray | None = None) -> RoundResult:
        members = [Member(c.public_key, c.node_id, c.addr) for c in group.members]
        hexes = [c.node_id.hex() for c in group.members]
        gid = f"{group.group_id:08x}"
        extra: dict = {}  # only what the run set (an allreduce without these options still serves the rest)
        if st.max_weight is not None:
            extra["max_weight"] = st.max_weight
        if st.robust is not None:
            extra["robust"] = st.robust
            if st.robust.mode == "centered" and center is not None:
                extra["center"] = center
            elif st.robust.mode == "centered" and st.center is not None and st.center.shape == vector.shape:
                extra["center"] = st.center
        try:
            res = await self.allreduce.average(
                group.group_id, members, group.index, vector, weight, floor_s=1.0,
                max_phase_s=max(1.0, budget_s / 2), **extra,
            )
            finite = await self._finite(res.vector)
        except (ValueError, RpcError) as e:  # e.g. the same group id twice: keep my own vector
            log.warning("run %s round %d: averaging in group %s failed: %s", st.run_id, round_no, gid, e)
            if st.sticky is not None:
                st.sticky.after_round(True)
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key,
                               seen, str(e))
        if not finite:  # a member sent NaN/inf that got through, or the sums overflowed: never hand it over
            self.metrics.contributions_refused.labels("nonfinite_average").inc()
            log.warning("run %s round %d: the average in group %s holds NaN or infinity; keeping this node's "
                        "own vector", st.run_id, round_no, gid)
            if st.sticky is not None:
                st.sticky.after_round(True)  # do not keep averaging with whoever caused it
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key,
                               seen, "the group's average held NaN or infinity (a member sent non-finite values, "
                               "or the sum overflowed float32): kept this node's own vector")
        if st.robust is not None and st.robust.mode == "centered":
            st.center = res.vector.copy()  # only an averaged, finite round becomes the next center
        rs, ag = res.stats.reduce_scatter, res.stats.all_gather
        if st.sticky is not None:  # a member never heard from: do not keep averaging with it
            st.sticky.after_round(bool(rs.silent or ag.silent))
        expected = rs.datagrams_expected + ag.datagrams_expected
        received = rs.datagrams_received + ag.datagrams_received
        fraction = received / expected if expected else 1.0
        st.note_members([c.node_id for c in group.members if c.node_id != self.identity.node_id], round_no)
        return RoundResult(res.vector, "averaged", gid, len(members), hexes, fraction, round_no, 0.0, 0.0, key, seen)

    @staticmethod
    async def _finite(vector: np.ndarray) -> bool:
        if vector.size <= FINITE_SLICE:
            return all_finite(vector)
        return await trio.to_thread.run_sync(all_finite, vector)  # ~50 ms for 100 MB: not on the event loop

    # -- matchmaking driver ---------------------------------------------------------------------
    async def _matchmake(self, st: RunState, round_no: int, key: str,
                         expected: list[frozenset[bytes] | None] | None = None) -> tuple:
        now = time.time()
        me = Candidate(round(now + st.window_s, 3), self.identity.node_id, self.identity.public_key, self.address)
        # min_size == M is Moshpit's exact grid: groups close at exactly M, never early
        settle = None if st.min_size >= st.grid.size else SETTLE_S
        mm = Matchmaker(me, target=st.grid.size, min_size=st.min_size, now=now, rng=self.rng, settle_s=settle)
        active = self._active[(st.run_id, round_no)] = _Active(mm, key)
        dht_key = f"{st.run_id}/{round_no}/{key}".encode()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._guarded, self._announce, dht_key, me, st.window_s)
                nursery.start_soon(self._guarded, self._poll, active, dht_key)
                if st.grid.dims == 1 and st.keys.extra_bits == 0:  # one key: the whole run looks under it
                    nursery.start_soon(self._guarded, self._expect, active, st, round_no)
                while True:
                    self._perform(active, st.run_id, round_no, nursery)
                    if mm.done:
                        break
                    active.wake = trio.Event()
                    with trio.move_on_after(max(0.0, mm.next_deadline() - time.time())):
                        await active.wake.wait()
                    mm.handle_timer(time.time())
                nursery.cancel_scope.cancel()
        finally:
            del self._active[(st.run_id, round_no)]
            if expected is not None:
                expected[0] = mm.expected
        return mm.group, mm.seen

    # -- kept groups ----------------------------------------------------------------------------
    async def _renew(self, st: RunState, sticky: StickyGroups, round_no: int, key: str,
                     timeout_s: float) -> Group | None:
        """This round's group without matchmaking, if the kept group can be renewed; None: matchmake.

        Synchronised like matchmaking: each follower asks the leader (MM_JOIN with RENEW_KEY) once it
        has started the round, and the leader sends the renewal BEGIN only when every follower has asked,
        so nobody starts averaging while a member is still busy elsewhere. Both waits are bounded; when
        one runs out, the member tells the others (MM_DISBAND) and the round matchmakes through the DHT."""
        kept = sticky.kept
        if kept is not None and sticky.broken:
            self._disband_kept(st, kept, round_no)  # the others need not wait for a renewal that will not come
        kept = sticky.usable(round_no)
        if kept is None:
            return None
        leads = sticky.leads(kept)
        if leads:
            watched = trio.Event()  # the DHT check for peers outside the group is done (begin only then)
            self._spawn(self._watch_newcomers, st, sticky, kept, round_no, key, watched)
            wait_s = min(st.window_s, timeout_s / 2)
        else:
            self._spawn(self._ask_renewal, st, sticky, kept, round_no)
            wait_s = min(st.window_s + FOLLOW_SLACK_S, timeout_s / 2)
        with trio.move_on_after(max(0.0, wait_s)):
            while not sticky.broken and sticky.kept is kept:
                if leads:
                    group = self._renewed(st, sticky, kept, round_no) if watched.is_set() else None
                else:
                    group = sticky.take_begin(round_no)
                if group is not None:
                    return group
                st.begin_wake = trio.Event()
                await st.begin_wake.wait()
        # the wait ran out (a member is gone or slow) or the group broke: everyone looks through the DHT
        reason = sticky.broken or ("not_ready" if leads else "no_begin")
        if sticky.kept is kept:
            self._disband_kept(st, kept, round_no)
        sticky.drop(reason)
        return None

    def _renewed(self, st: RunState, sticky: StickyGroups, kept: Kept, round_no: int) -> Group | None:
        """As the leader: once every follower asked for round ``round_no``, send the renewal BEGIN."""
        if sticky.missing(round_no):
            return None
        group = sticky.renewal(self.rng.randrange(1, 2**32), round_no)
        fields = {"run": st.run_id, "round": round_no, "group": group.group_id,
                  "members": self._pack_members(kept.members)}
        for c in kept.members:
            if c.node_id != self.identity.node_id:
                self._spawn(self._send_renewal, st, sticky, kept, c.addr, fields)
        return group

    async def _ask_renewal(self, st: RunState, sticky: StickyGroups, kept: Kept, round_no: int) -> None:
        """As a follower: tell the kept group's leader this node is ready for ``round_no``. A refusal
        (it does not keep the group, or matchmakes this round) or no answer breaks the group at once."""
        leader = kept.leader_candidate
        fields = {"run": st.run_id, "round": round_no, "key": RENEW_KEY, "expiry": round(time.time() + st.window_s, 3)}
        reason = ""
        with trio.move_on_after(st.window_s + FOLLOW_SLACK_S):
            while sticky.kept is kept and not sticky.broken:
                try:
                    reply = await self.endpoint.request(leader.addr, m.MsgType.MM_JOIN, fields, timeout=0.25,
                                                        attempts=4)
                except RpcError as e:
                    if sticky.begun >= round_no:
                        return
                    log.info("run %s round %d: the kept group's leader did not answer: %s", st.run_id, round_no, e)
                    reason = "unreachable"
                    break
                if reply.body["ok"] or sticky.begun >= round_no:
                    return  # (a late answer to a retry after the renewal already began: not a refusal)
                if reply.peer.node_id != kept.leader:
                    reason = "unreachable"
                    break
                if reply.body["reason"] not in ("busy", "not_ready"):
                    reason = "refused"
                    break
                await trio.sleep(BUSY_RETRY_S)
        if reason:
            sticky.break_(reason, kept)
            st.begin_wake.set()

    def _disband_kept(self, st: RunState, kept: Kept, round_no: int) -> None:
        """Tell the kept group's other members that this node will not renew it (twice: it is one-way)."""
        for c in kept.members:
            if c.node_id != self.identity.node_id:
                for _ in range(2):
                    self._spawn(self.endpoint.notify, c.addr, m.MsgType.MM_DISBAND,
                                {"run": st.run_id, "round": round_no})

    def _tell_not_kept(self, st: RunState, group: Group, round_no: int) -> None:
        leader = next(c for c in group.members if c.node_id == group.leader)
        for _ in range(2):
            self._spawn(self.endpoint.notify, leader.addr, m.MsgType.MM_DISBAND, {"run": st.run_id, "round": round_no})

    async def _send_renewal(self, st: RunState, sticky: StickyGroups, kept: Kept, addr: Address,
                            fields: dict) -> None:
        try:
            reply = await self.endpoint.request(addr, m.MsgType.MM_BEGIN, fields, timeout=0.25, attempts=4)
        except RpcError as e:
            log.info("run %s: renewal not acknowledged by %s:%d: %s", st.run_id, addr[0], addr[1], e)
            sticky.break_("unacknowledged", kept)
            return
        if not reply.body["ok"]:
            sticky.break_("refused", kept)

    async def _watch_newcomers(self, st: RunState, sticky: StickyGroups, kept: Kept, round_no: int,
                               key: str, done: trio.Event) -> None:
        """The leader of a kept group reads the run's group key (this round's and the next) and progress
        records: a peer outside the group looking for one, or still training, means the group must re-form
        through the DHT to take it in (else the run would split into groups that never meet). The leader
        begins a renewal only after this check (the reads run while it waits for its followers anyway), so
        a newcomer is taken in this round, not a round later: for a run that averages every K steps, a
        round later is K steps later."""
        ids = kept.node_ids()
        now = time.time()

        async def progress() -> None:
            for record in await self.dht.get(f"{st.run_id}/progress".encode(), enough=_poll_read(round_no)):
                owner = node_id_of(record.owner)
                if owner not in ids and record.expires - PROGRESS_TTL_S > now - OUTSIDER_S:
                    log.info("run %s round %d: a peer outside the kept group trains; re-forming", st.run_id, round_no)
                    sticky.break_("outsider", kept)
                    return

        async def looking(r: int) -> None:
            for record in await self.dht.get(f"{st.run_id}/{r}/{key}".encode(), enough=_poll_read(round_no)):
                c = self._candidate(record)
                if c is not None and c.node_id not in ids and c.expiry > now:
                    log.info("run %s round %d: a newcomer looks for a group; re-forming", st.run_id, r)
                    sticky.break_("newcomer", kept)
                    return

        try:
            with trio.move_on_after(min(WATCH_S, st.window_s / 2)):  # a slow DHT delays a renewal this much at most
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(progress)
                    nursery.start_soon(looking, round_no)
                    nursery.start_soon(looking, round_no + 1)
        finally:
            done.set()
            st.begin_wake.set()

    def _perform(self, active: _Active, run_id: str, round_no: int, nursery: trio.Nursery) -> None:
        for action in active.mm.take_actions():
            if isinstance(action, Join):
                nursery.start_soon(self._guarded, self._send_join, active, run_id, round_no, action.leader)
            elif isinstance(action, Begin):
                fields = {"run": run_id, "round": round_no, "group": action.group.group_id,
                          "members": self._pack_members(action.group.members)}
                for c in action.to:
                    self._spawn(self._send_begin, c.addr, fields)
            elif isinstance(action, Disband):
                for c in action.to:
                    self._spawn(self.endpoint.notify, c.addr, m.MsgType.MM_DISBAND, {"run": run_id, "round": round_no})

    def _loopback(self) -> str:
        return "::1" if self.endpoint.family == socket.AF_INET6 else "127.0.0.1"

    def _pack_members(self, members: tuple[Candidate, ...] | list[Candidate]) -> list[list]:
        """MM_BEGIN's member list. This node's own entry may hold the wildcard it listens on (no --announce),
        which no decoder accepts: it travels as loopback, and receivers reach the sender of a BEGIN where
        the BEGIN came from anyway (``_on_begin``)."""
        out = []
        for c in members:
            host = c.addr[0]
            if c.node_id == self.identity.node_id and ipaddress.ip_address(host).is_unspecified:
                host = self._loopback()
            out.append([c.public_key, ipaddress.ip_address(host).packed, c.addr[1]])
        return out

    async def _send_join(self, active: _Active, run_id: str, round_no: int, leader: Candidate) -> None:
        fields = {"run": run_id, "round": round_no, "key": active.key, "expiry": active.mm.me.expiry}
        try:
            reply = await self.endpoint.request(leader.addr, m.MsgType.MM_JOIN, fields, timeout=0.25, attempts=3)
        except RpcError:
            active.mm.on_join_failed(leader.node_id, time.time())
        else:
            if reply.peer.node_id != leader.node_id:
                active.mm.on_join_failed(leader.node_id, time.time())  # someone else lives at that address
            else:
                active.mm.on_join_response(leader.node_id, reply.body["ok"], reply.body["reason"], time.time())
        active.wake.set()

    async def _send_begin(self, addr: Address, fields: dict) -> None:
        try:
            await self.endpoint.request(addr, m.MsgType.MM_BEGIN, fields, timeout=0.25, attempts=4)
        except RpcError as e:
            log.info("BEGIN not acknowledged by %s:%d: %s (it is averaged out)", addr[0], addr[1], e)

    async def _announce(self, dht_key: bytes, me: Candidate, window_s: float) -> None:
        value = msgpack.packb([me.expiry, ipaddress.ip_address(me.addr[0]).packed, me.addr[1]])
        await self.dht.put(dht_key, self.identity.node_id, value, ttl=window_s + 10.0)

    async def _poll(self, active: _Active, dht_key: bytes) -> None:
        for i in range(10**9):
            records = await self.dht.get(dht_key, enough=_poll_read(i))
            entries = [c for c in (self._candidate(r) for r in records) if c is not None]
            active.mm.on_entries(entries, time.time())
            active.wake.set()
            await trio.sleep(POLL_S[min(i, len(POLL_S) - 1)])

    async def _expect(self, active: _Active, st: RunState, round_no: int) -> None:
        """Tell the matchmaker who finished one of the last rounds: a leader waits a little longer for them.

        A peer that already finished this round or a later one is ahead: this peer re-reads the run's
        progress after the round and jumps to it, else two halves of a run that fell out of step (a stall)
        would wait for each other at different round numbers, every round, forever."""
        recent = set()
        # With kept groups, a peer whose progress lags (a joiner chasing a kept group: the group's rounds
        # take milliseconds, so the joiner's jump ahead always lands on a round the group already left) is
        # still expected while it keeps trying: its record was refreshed within two windows. The group,
        # broken by this outsider, then waits for it in this round, where the joiner's next jump lands.
        lagging_s = 2 * st.window_s if st.sticky is not None and st.sticky.keep_rounds > 1 else None
        now = time.time()
        for owner, value, stored in await self._progress_records(st, stamped=True):
            if value >= round_no - 3 or (lagging_s is not None and stored > now - lagging_s):
                recent.add(owner)
            if value >= round_no and owner != self.identity.node_id:
                st.synced = False
        if not recent:
            # nobody finished a recent round (a run's first round): whom to expect is unknown, so the
            # leader waits for a pause without newcomers (1.5 s), not 0.3 s: peers whose first step took a
            # moment longer would otherwise find the others' round over and start out of step
            return
        active.mm.set_expected(frozenset(recent), time.time())
        active.wake.set()

    async def _progress_records(self, st: RunState, stamped: bool = False) -> list:
        """(node id, last finished round) of the run's peers; with ``stamped``, (node id, round, when stored).
        Malformed records and those too far ahead (``plausible_progress``) are counted and left out."""
        out: list = []
        ignored = self.metrics.ignored_records
        for r in await self.dht.get(f"{st.run_id}/progress".encode()):
            try:
                value = msgpack.unpackb(r.value)
            except (ValueError, msgpack.UnpackException):
                ignored.labels("progress", "malformed").inc()
                continue
            if type(value) is int and 0 <= value <= MAX_ROUND:
                out.append((node_id_of(r.owner), value, r.expires - PROGRESS_TTL_S))
            else:
                ignored.labels("progress", "range").inc()
        out, ahead = plausible_progress(out, st.round, time.time(), st.known)
        if ahead:
            ignored.labels("progress", "ahead").inc(ahead)
            log.info("run %s: ignored %d progress record(s) more than %d rounds ahead", st.run_id, ahead, MAX_AHEAD)
        return out if stamped else [(owner, value) for owner, value, _ in out]

    def _candidate(self, record: Record) -> Candidate | None:
        """A matchmaking record, or None for one that is not well-formed (counted, skipped)."""
        try:
            expiry, ip, port = msgpack.unpackb(record.value)
            node_id = node_id_of(record.owner)
            if record.subkey != node_id or not isinstance(expiry, float) or not 0 < port < 65536:
                raise ValueError("fields")
            host = str(ipaddress.ip_address(ip))
        except (ValueError, TypeError, msgpack.UnpackException):
            self.metrics.datagrams_dropped.labels("mm_record").inc()
            return None
        if ipaddress.ip_address(host).is_unspecified:  # listening on a wildcard: use the address the DHT saw
            contact = next((c for c in self.dht.core.table.contacts() if c.node_id == node_id), None)
            if contact is None:
                return None
            host = contact.host
        why = self.endpoint.unreachable(host)
        if why:  # broadcast, multicast, the other family: a JOIN or BEGIN sent there would fail or spray
            self.metrics.ignored_records.labels("matchmaking", "address").inc()
            log.debug("matchmaking record of %s ignored: %s is %s", node_id.hex()[:12], host, why)
            return None
        return Candidate(expiry, node_id, record.owner, (host, port))

    # -- handlers (synchronous: the endpoint sends what they return) -----------------------------
    def _on_join(self, incoming: Incoming) -> dict:
        b = incoming.body
        active = self._active.get((b["run"], b["round"]))
        if active is None and b["key"] == RENEW_KEY:  # a follower of my kept group is ready for this round
            st = self.runs.get(b["run"])
            if st is None or st.sticky is None:
                return {"ok": False, "reason": "closed"}
            ok = st.sticky.offer_join(incoming.peer.node_id, b["round"], st.round)
            if ok:
                st.begin_wake.set()
            return {"ok": ok, "reason": "ok" if ok else "closed"}
        if active is None:
            st = self.runs.get(b["run"])
            behind = st is None or st.round <= b["round"]
            return {"ok": False, "reason": "not_ready" if behind else "closed"}
        if active.key != b["key"]:
            return {"ok": False, "reason": "key"}
        peer = incoming.peer
        ok, reason = active.mm.on_join_request(
            Candidate(b["expiry"], peer.node_id, peer.public_key, (peer.host, peer.port)), time.time()
        )
        active.wake.set()
        return {"ok": ok, "reason": reason}

    def _on_begin(self, incoming: Incoming) -> dict:
        b = incoming.body
        active = self._active.get((b["run"], b["round"]))
        peer = incoming.peer
        members = []
        for pk, host, port in b["members"]:
            if pk == peer.public_key:  # the leader: reach it where its BEGIN came from (it may list a wildcard)
                host, port = peer.host, peer.port
            elif self.endpoint.unreachable(host):  # (the decoder refused the rest; this is the other family)
                self.metrics.datagrams_dropped.labels("address").inc()
                return {"ok": False}
            members.append(Candidate(0.0, node_id_of(pk), pk, (host, port)))
        if active is None:  # no matchmaking waits for it: the renewal of a kept group?
            st = self.runs.get(b["run"])
            if st is None or st.sticky is None:
                return {"ok": False}
            ok = st.sticky.offer_begin(incoming.peer.node_id, b["round"], st.round, b["group"], members)
            if ok:
                st.begin_wake.set()
            return {"ok": ok}
        ok = active.mm.on_begin(incoming.peer.node_id, b["group"], members)
        active.wake.set()
        return {"ok": ok}

    def _on_disband(self, incoming: Incoming) -> None:
        b = incoming.body
        active = self._active.get((b["run"], b["round"]))
        if active is not None:
            active.mm.on_disband(incoming.peer.node_id, time.time())
            active.wake.set()
        st = self.runs.get(b["run"])
        kept = st.sticky.kept if st is not None and st.sticky is not None else None
        if kept is None or incoming.peer.node_id not in kept.node_ids():
            return
        assert st is not None and st.sticky is not None
        if b["round"] > kept.formed or (b["round"] == kept.formed and kept.leader == self.identity.node_id):
            # a member of my kept group will not renew it (for the formation round: it never kept it)
            st.sticky.break_("disbanded" if b["round"] > kept.formed else "not_kept", kept)
            st.begin_wake.set()

    # -- run-wide records -----------------------------------------------------------------------
    def _spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._guarded, fn, *args)

    async def _guarded(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run background work so that its failure (a send the kernel refuses, a DHT error, a bug) is logged
        and counted in ``peerd_background_errors_total{task}``, never raised into the service's nursery,
        which would take the daemon down."""
        try:
            await fn(*args)
        except Exception as e:
            task = "moshpit_" + getattr(fn, "__name__", "task").lstrip("_")
            self.metrics.background_errors.labels(task).inc()
            if isinstance(e, RpcError):  # a lost route, an address the kernel refuses: expected under churn
                log.info("%s: %s", task, e)
            else:
                log.warning("%s failed", task, exc_info=True)

    async def _publish_grid(self, run_id: str, grid: Grid) -> None:
        # Under this node's own id: a shared subkey would belong to whoever wrote it first (slot squatting).
        await self.dht.put(f"{run_id}/config".encode(), self.identity.node_id, str(grid).encode(), ttl=CONFIG_TTL_S)

    async def _published_grid(self, run_id: str) -> Grid | None:
        records: list[Record] = []
        with trio.move_on_after(5.0):
            records = await self.dht.get(f"{run_id}/config".encode())
        return published_grid(records, self._fits)

    def _fits(self, grid: Grid) -> bool:
        try:
            self._check_fits(grid.size)
        except MoshpitError:
            return False
        return True

    async def _publish_progress(self, run_id: str, round_no: int) -> None:
        value = msgpack.packb(round_no)
        await self.dht.put(f"{run_id}/progress".encode(), self.identity.node_id, value, ttl=PROGRESS_TTL_S)

    async def _sync_round(self, st: RunState) -> None:
        """Start at the round after the latest one any peer of the run finished (for joiners)."""
        latest = -1
        with trio.move_on_after(5.0):
            for _, value in await self._progress_records(st):
                latest = max(latest, value)
        st.round = max(st.round, latest + 1)
        st.synced = True
