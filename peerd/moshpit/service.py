"""The Moshpit service: the trio shell around the round machine (rounds.py).

Every protocol decision (renew a kept group or matchmake, whom to JOIN, BEGIN or DISBAND, which group to
average with, the key and round that come next, which progress records to believe) is the round
machine's. This shell only waits: it executes the machine's actions (DHT reads and writes, MM_* messages,
the group average through AllreduceService), feeds back their answers, the MM_* messages peers send and
timer ticks, all stamped with one injected clock (``clock``, wall-clock seconds: expiries are compared
across peers).

Members are not trusted: background sends and DHT work are guarded (a failure is logged and counted in
``peerd_background_errors_total{task}``, never fatal), progress records far ahead of the run are ignored
(records.py), and an average that is not finite never replaces the caller's vector.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import random
import socket
import time
from collections.abc import Awaitable, Callable

import numpy as np
import trio

from ..allreduce.arctopk import ArcTopKPlan, phase_totals, service_arc_topk
from ..allreduce.options import AverageOptions
from ..allreduce.robust import Robust
from ..allreduce.service import Averager, Member
from ..allreduce.shards import capped_shares
from ..compress import Codec
from ..deadlines import DeadlineTuner
from ..dht.records import Record
from ..dht.service import DhtService
from ..entropy import default_rng
from ..linkcap.advert import CapAdvert, PeerCaps
from ..metrics import Metrics
from ..nurseries import service_nursery
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..wire import messages as m
from ..wire.identity import node_id_of
from .capsplan import capped_phase_s, learn_caps
from .keys import Grid, KeyManager
from .matchmaking import REACH_UNKNOWN, Candidate, Group
from .records import (
    CONFIG_TTL_S,
    MAX_AHEAD,
    MAX_ROUND,
    PROGRESS_FRESH_S,
    PROGRESS_TTL_S,
    STRANGER_AHEAD,
    MoshpitError,
    check_run_id,
    config_key,
    encode_grid,
    group_dht_key,
    pack_members,
    plausible_progress,
    progress_key,
    published_grid,
)
from .rounds import (
    DEFAULT_WINDOW_S,
    KNOWN_PEERS,
    SYNC_S,
    Average,
    Count,
    Get,
    Note,
    Notify,
    Put,
    Request,
    RoundMachine,
)
from .runstate import (
    FINITE_SLICE,
    MAX_GROUP_DEFAULT,
    MAX_PARTS,
    MOSHPIT_CODECS,
    MoshpitStatistics,
    Part,
    RoundResult,
    RoundStatistics,
    RunState,
    RunStatistics,
    TopK,
    all_finite,
    check_compression,
    check_max_weight,
    check_robust,
    check_topk,
    codec_run_key,
    part_group_id,
)
from .sticky import RENEW_KEY, StickyGroups
from .tuning import SILENCE_CAP_S, note_round, phase_deadlines, probes_silent, tune_round

__all__ = [
    "CONFIG_TTL_S", "DEFAULT_WINDOW_S", "KNOWN_PEERS", "MAX_AHEAD", "MAX_ROUND", "PROGRESS_FRESH_S", "PROGRESS_TTL_S",
    "STRANGER_AHEAD", "MAX_GROUP_DEFAULT", "MOSHPIT_CODECS", "MoshpitError", "MoshpitService", "MoshpitStatistics",
    "Part", "RoundResult", "RoundStatistics", "RunState", "RunStatistics", "all_finite", "check_compression",
    "check_max_weight", "check_robust", "check_run_id", "codec_run_key", "part_group_id", "plausible_progress",
    "published_grid",
]

log = logging.getLogger("peerd.moshpit")
DEFAULT_KEEP_ROUNDS = 1  # groups re-form through the DHT every round unless a run asks to keep them (sticky.py)


class MoshpitService:
    def __init__(self, endpoint: Endpoint, dht: DhtService, allreduce: Averager, metrics: Metrics, *, address: Address,
                 rng: random.Random | None = None, keep_rounds: int | None = None,
                 clock: Callable[[], float] | None = None, max_group: int = MAX_GROUP_DEFAULT,
                 deadlines: DeadlineTuner | None = None) -> None:
        """``keep_rounds``: the default for runs that do not set it (None: DEFAULT_KEEP_ROUNDS, i.e. matchmake
        every round; groups are only ever kept on 1-D grids, where one key holds the whole run).
        ``max_group``: the largest group of a grid this node sizes for a run (Grid.for_swarm); a run's published
        grid wins over it. ``deadlines``: the matchmaking window and phase deadlines tune themselves from what it
        measured (peerd/deadlines.py), the run's window and the round's budget as their caps; None: the caps.
        ``clock``: wall-clock seconds (default time.time); virtual-time tests pass trio's clock plus a base."""
        self.endpoint = endpoint
        self.keep_rounds = keep_rounds
        if type(max_group) is not int or not 2 <= max_group <= m.MAX_GROUP:
            raise MoshpitError(f"max_group must be an integer in [2, {m.MAX_GROUP}], got {max_group!r}")
        self.max_group = max_group
        self.dht, self.allreduce, self.metrics, self.address = dht, allreduce, metrics, address
        self.reach = REACH_UNKNOWN  # this node's reachability rank (the daemon sets it): who leads first
        self.cap_ad: CapAdvert | None = None  # this node's bandwidth caps, announced (the daemon sets it)
        self.peer_caps = PeerCaps()  # the caps of peers seen in matchmaking records, every run's
        self.identity = endpoint.identity
        self.rng = default_rng(rng)
        self.clock = clock or time.time
        self.deadlines = deadlines
        self.runs: dict[str, RunState] = {}
        self._nursery: trio.Nursery | None = None
        endpoint.on_request(m.MsgType.MM_JOIN, self._on_join)
        endpoint.on_request(m.MsgType.MM_BEGIN, self._on_begin)
        endpoint.on_message(m.MsgType.MM_DISBAND, self._on_disband)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery for work that outlives a round (BEGIN retries, progress records)."""
        async with service_nursery(self):
            task_status.started()
            await trio.sleep_forever()

    def statistics(self) -> MoshpitStatistics:
        return MoshpitStatistics({run_id: st.statistics() for run_id, st in self.runs.items()})

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
        compression: str | Codec | None = None,
        quant_group: int | None = None,
        rounding: str | None = None,
        topk_layout: list | None = None,
        topk_ratio: float = 0.1,
        ef_eta: float | None = 0.1,
    ) -> RunState:
        """Start (or reconfigure) a run. Without ``grid``, take the run's published grid or size one from the
        swarm the DHT sees (for ``min_size`` at least). ``keep_rounds``: keep a full group so many rounds (1: never).
        ``max_weight``: shard owners count no member's weight above this (math.inf: no cap); ``robust``:
        how owners clip contributions (a Robust or ``off``/``clip[:C]``/``centered[:C]``). ``compression``,
        ``quant_group``, ``rounding``: the body codec of every average of the run (check_compression). All are
        kept by the run; None leaves what the run had."""
        check_run_id(run_id)
        cap = check_max_weight(max_weight) if max_weight is not None else None
        robust_mode = check_robust(robust) if robust is not None else None
        codec = self._check_codec(compression, quant_group, rounding, topk_layout, topk_ratio, ef_eta)
        if not 0.2 <= window_s <= 600:
            raise MoshpitError(f"window_s must be in [0.2, 600] seconds, got {window_s}")
        if keep_rounds is not None and (type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000):
            raise MoshpitError(f"keep_rounds must be an integer in [1, 1000], got {keep_rounds!r}")
        if grid is None and run_id in self.runs:
            grid = self.runs[run_id].grid
        elif grid is None:
            grid = await self._published_grid(run_id)
            if grid is None:
                grid = Grid.for_swarm(max(self.dht.peer_count() + 1, min_size), self.max_group)
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
        if keep_rounds is None and old is not None and not regrid:
            keep_rounds = old.sticky.keep_rounds  # reconfiguring without saying: keep what the run had
        elif keep_rounds is None:
            keep_rounds = self.keep_rounds if self.keep_rounds is not None else DEFAULT_KEEP_ROUNDS
        if old is not None:  # in place: a round under way keeps counting on the same state
            st = old
            core = st.core
            core.grid, core.keys, core.min_size, core.window_s = grid, keys, min_size, window_s
            if core.sticky.keep_rounds != keep_rounds or regrid:
                core.sticky = StickyGroups(self.identity.node_id, keep_rounds)
        else:
            me = Candidate(0.0, self.identity.node_id, self.identity.public_key, self.address, self.reach)
            core = RoundMachine(run_id, grid, keys, me, min_size=min_size, window_s=window_s,
                                keep_rounds=keep_rounds, rng=self.rng, resolve=self._resolve)
            core.cap_ad, core.peer_caps, core.rtt = self.cap_ad, self.peer_caps, self.endpoint.rto.srtt
            st = self.runs[run_id] = RunState(core)
        self._configure(st, max_weight, cap, robust, robust_mode, codec)
        if not st.synced:
            await self._sync_round(st)
        return st

    @staticmethod
    def _check_codec(compression: object, quant_group: object, rounding: object, topk_layout: object = None,
                     topk_ratio: object = 0.1, ef_eta: object = 0.1) -> tuple[Codec | TopK | None] | None:
        """(codec,) when the caller names a compression (None inside: fp32; a TopK for arc-topk), None when it
        leaves the run's."""
        if compression is None:
            if quant_group is not None or rounding is not None or topk_layout is not None:
                raise MoshpitError("quant_group, rounding and topk_layout need compression (int8, int4, arc-topk)")
            return None
        if compression == "arc-topk":
            if quant_group is not None or rounding is not None:
                raise MoshpitError("quant_group and rounding apply to int8 and int4, not to arc-topk")
            return (check_topk(topk_layout, topk_ratio, ef_eta),)
        if topk_layout is not None:
            raise MoshpitError(f"topk_layout applies to arc-topk, not to {compression}")
        return (check_compression(compression, quant_group, rounding),)

    @staticmethod
    def _configure(st: RunState, max_weight: object, cap: float | None, robust: object,
                   robust_mode: Robust | None, codec: tuple[Codec | TopK | None] | None = None) -> None:
        if codec is not None:
            chosen = codec[0]
            if isinstance(chosen, TopK):
                same = st.topk is not None and (st.topk.shapes, st.topk.ratio) == (chosen.shapes, chosen.ratio) \
                    and (st.topk.ef is None) == (chosen.ef is None)
                if not same:  # a new configuration: a new EF21M state (the same one keeps the run's)
                    st.topk = chosen
                st.codec = None
            else:
                st.codec, st.topk = chosen, None
        if max_weight is not None:
            st.max_weight = cap
        if robust is not None:
            if robust_mode is None or robust_mode.mode != "centered":
                st.center = None
            st.robust = robust_mode

    def _check_fits(self, size: int) -> None:
        members = [[bytes(32), ipaddress.ip_address(self._loopback()).packed, 65535, True]] * size
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
                      center: np.ndarray | None = None, compression: str | Codec | None = None,
                      quant_group: int | None = None, rounding: str | None = None, topk_layout: list | None = None,
                      topk_ratio: float = 0.1, ef_eta: float | None = 0.1,
                      ready: Callable[[], Awaitable[None]] | None = None,
                      chain_from: float | None = None, wait_s: float | None = None,
                      shares: str | None = None) -> RoundResult:
        """One Moshpit round for ``run_id``: find a group, average in it. Never raises for churn.

        ``ready``: awaited once the group is known (or none formed), before ``vector`` is read: the caller fills
        ``vector`` meanwhile (a trainer's gradient bucket that backward is still producing: matchmaking overlaps
        it, peerd.torch.overlap); what it raises ends the round. Its time comes out of the average's budget.

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
        ``compression``, ``quant_group``, ``rounding``: set the run's body codec (as ``open`` does); None leaves it.
        ``compression="arc-topk"`` with ``topk_layout`` (the tensor shapes of the vector), ``topk_ratio`` and
        ``ef_eta`` (None: no error feedback) averages the top rows instead (peerd.allreduce.arctopk); with EF21M
        the result is its update direction u, not an average of the vectors.

        The result is never non-finite: an average that holds NaN or infinity is reported ``failed`` and the
        caller gets its own vector back. A run past its last round (MAX_ROUND) raises MoshpitError.

        ``chain_from``: the ``window_end`` of the round before this one in the same step (a DiLoCo outer step's
        rounds, one per grid axis): this round's matchmaking window ends one window after it (RoundMachine
        .start_round), so members that spent that round alone still meet the ones that averaged at once.
        ``wait_s``: this round waits at least this long for its members (tuning.tune_round), below timeout_s / 2.
        ``shares``: ``"caps"`` (a run's default: members that announced bandwidth caps own smaller shards) or
        ``"equal"`` (every member an equal shard, as DiLoCo's outer agreement expects); None leaves the run's."""
        if chain_from is not None and not (isinstance(chain_from, int | float) and math.isfinite(chain_from)):
            raise MoshpitError(f"chain_from must be a wall-clock time (a RoundResult's window_end), got {chain_from!r}")
        if vector.dtype != np.float32 or vector.ndim != 1:
            raise MoshpitError("the vector must be flat float32")
        if center is not None and (center.dtype != np.float32 or center.shape != vector.shape
                                   or not np.isfinite(center).all()):
            raise MoshpitError("the center must be a finite float32 vector of the vector's shape")
        codec = self._check_codec(compression, quant_group, rounding, topk_layout, topk_ratio, ef_eta)
        if codec is not None and isinstance(codec[0], TopK) and codec[0].length != vector.size:
            raise MoshpitError(f"the arc-topk layout holds {codec[0].length} elements, the vector {vector.size}")

        async def fetch() -> np.ndarray:
            if ready is not None:
                await ready()
            return vector

        if wait_s is not None and not (isinstance(wait_s, int | float) and 0.2 <= wait_s <= timeout_s / 2):
            raise MoshpitError(f"wait_s must be in [0.2, timeout_s / 2 = {timeout_s / 2}] seconds, got {wait_s!r}")
        results = await self._run_round(run_id, [Part(fetch)], weight, timeout_s, keep_rounds, round_no,
                                        max_weight, robust, codec, center=center, chain_from=chain_from, wait_s=wait_s,
                                        shares=shares)
        outcome = results[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    average.accepts_ready = True  # type: ignore[attr-defined]  # (peerd.trainer.service asks for it)

    async def average_parts(self, run_id: str, parts: list[Part], weight: float, *, timeout_s: float = 30.0,
                            keep_rounds: int | None = None, round_no: int | None = None,
                            max_weight: float | None = None, robust: Robust | str | None = None,
                            compression: str | Codec | None = None, quant_group: int | None = None,
                            rounding: str | None = None) -> list[RoundResult | Exception]:
        """One Moshpit round for ``run_id`` that averages several vectors in the group it finds: one
        matchmaking for all (a trainer's gradient buckets of one step, peerd.torch.overlap). Each part's
        ``fetch`` is awaited once the group is known and returns that part's vector; part ``i`` averages
        under its own group id (part_group_id) as soon as its vector is there, and ``done`` gets its result
        at once, while other parts go on. Every member must hand the same number of parts of the same sizes
        in the same order (the caller's run id should say so). A part whose ``fetch`` raises gets that
        exception (in the list and through ``done``); the other parts still average. Options as ``average``;
        arc-topk is refused (a part is not the whole layout)."""
        if not parts or len(parts) > MAX_PARTS:
            raise MoshpitError(f"a round averages 1 to {MAX_PARTS} parts, got {len(parts)}")
        codec = self._check_codec(compression, quant_group, rounding)
        return await self._run_round(run_id, parts, weight, timeout_s, keep_rounds, round_no, max_weight, robust,
                                     codec, split=True)

    async def _run_round(self, run_id: str, parts: list[Part], weight: float, timeout_s: float,
                         keep_rounds: int | None, round_no: int | None, max_weight: float | None,
                         robust: Robust | str | None, codec: tuple[Codec | TopK | None] | None, *,
                         center: np.ndarray | None = None, split: bool = False, chain_from: float | None = None,
                         wait_s: float | None = None, shares: str | None = None) -> list[RoundResult | Exception]:
        """Check the options both forms share, configure the run and drive one round under its lock."""
        check_run_id(run_id)
        if round_no is not None and (type(round_no) is not int or not 0 <= round_no <= MAX_ROUND):
            raise MoshpitError(f"round must be an integer in [0, {MAX_ROUND}], got {round_no!r}")
        cap = check_max_weight(max_weight) if max_weight is not None else None
        robust_mode = check_robust(robust) if robust is not None else None
        if keep_rounds is not None and (type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000):
            raise MoshpitError(f"keep_rounds must be an integer in [1, 1000], got {keep_rounds!r}")
        if not (math.isfinite(weight) and weight > 0):
            raise MoshpitError(f"weight must be a positive number (a sample count), got {weight}")
        if not 1.0 <= timeout_s <= 3600:
            raise MoshpitError(f"timeout_s must be in [1, 3600], got {timeout_s}")
        if shares not in (None, "caps", "equal"):
            raise MoshpitError(f"shares must be 'caps' or 'equal', got {shares!r}")
        st = self.runs.get(run_id) or await self.open(run_id, keep_rounds=keep_rounds)
        async with st.lock:
            if keep_rounds is not None:
                st.core.set_keep_rounds(keep_rounds)
            self._configure(st, max_weight, cap, robust, robust_mode, codec)
            st.shares = shares or st.shares
            if split and st.topk is not None:
                raise MoshpitError(f"run {run_id!r} averages in arc-topk, which needs the whole layout: "
                                   f"not in parts (use a body codec)")
            if round_no is not None:
                st.core.round = round_no
            if st.round > MAX_ROUND:
                raise MoshpitError(f"run {run_id!r} has averaged its last round ({MAX_ROUND}): round numbers are "
                                   f"uint32 and do not wrap; continue under a new run id")
            return await self._round(st, parts, float(weight), timeout_s, numbered=round_no is not None,
                                     center=center, split=split, chain_from=chain_from, wait_s=wait_s)

    async def _round(self, st: RunState, parts: list[Part], weight: float, timeout_s: float,
                     numbered: bool = False, center: np.ndarray | None = None, split: bool = False,
                     chain_from: float | None = None, wait_s: float | None = None) -> list[RoundResult | Exception]:
        """Drive the machine through one round: execute its actions, wait for an input or its deadline. Once
        a group is known, average each part in it (``split``: each under its own group id, concurrently)."""
        core = st.core
        t0 = self.clock()
        st.state = "matchmaking"
        st.in_round = True
        window_cap = core.window_s  # the run's window: the tuned one's cap, back in place when the round ends
        window_used = tune_round(self.deadlines, core, window_cap, wait_s)
        core.start_round(timeout_s=timeout_s, numbered=numbered, chain_from=chain_from, now=t0)
        round_no, key = core.round, core.key
        results: list[RoundResult | Exception] | None = None
        mm_s: float | None = None
        average: Average | None = None
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    st.wake = trio.Event()
                    average = self._execute(st, core.take_actions(), nursery)
                    if core.phase in ("renew", "match", "average"):
                        round_no, key = core.round, core.key  # (a node behind the run moves to its round)
                    if mm_s is None and core.phase not in ("renew", "match"):
                        mm_s = self.clock() - t0
                    if average is not None:
                        st.state, group = "averaging", average.group
                        assert mm_s is not None
                        results = await self._average_parts(st, group, parts, weight, timeout_s - mm_s, round_no,
                                                            key, core.seen, center, split, mm_s, t0, average.kept)
                        done = [r for r in results if isinstance(r, RoundResult)]
                        if not done:  # no part's vector came: the round ends unfinished (abandoned below)
                            break
                        core.on_averaged(averaged=any(r.outcome == "averaged" for r in done),
                                         silent=any(r.silent for r in done), members=[c.node_id for c in group.members],
                                         dead=frozenset(group.members[i].node_id for r in done for i in r.dead),
                                         now=self.clock())
                        continue
                    if core.done:
                        break
                    timer = core.get_timer()
                    with trio.move_on_after(math.inf if timer is None else max(0.0, timer - self.clock())):
                        await st.wake.wait()
                    core.handle_timer(self.clock())
                nursery.cancel_scope.cancel()
        finally:
            st.state = "idle"
            st.in_round = False
            core.window_s = window_cap if core.window_s == window_used else core.window_s  # (unless open() set one)
            if not core.done:
                core.abandon()
            self._drain(st)
        if results is None:  # no group formed: each part alone
            results = []
            for part in parts:
                try:
                    vector = await part.fetch()
                except Exception as e:
                    results.append(e)
                    continue
                alone = RoundResult(vector.copy(), "alone", "", 1, [self.identity.node_id.hex()], 1.0, round_no,
                                    0.0, 0.0, key, core.seen)
                results.append(self._finished(st, alone, mm_s if mm_s is not None else 0.0, t0, False))
            for part, r in zip(parts, results, strict=True):
                if part.done is not None:
                    part.done(r)
        first = next((r for r in results if isinstance(r, RoundResult)), None)
        if first is not None:
            outcome = "averaged" if any(isinstance(r, RoundResult) and r.outcome == "averaged" for r in results) \
                else first.outcome
            self.metrics.moshpit_rounds.labels(outcome, st.compression).inc()
            self.metrics.moshpit_group_size.set(first.group_size)
            if first.led:
                self.metrics.moshpit_led.inc()
            self.metrics.moshpit_round_seconds.observe(self.clock() - t0)
            note_round(self.deadlines, first, window_used, t0, self.clock())
            st.log_round(round_no, outcome, first.group_size, self.clock() - t0, self.clock())
        return results

    def _finished(self, st: RunState, result: RoundResult, mm_s: float, t0: float, kept: bool,
                  group: Group | None = None) -> RoundResult:
        """Stamp a part's result with the round's facts (st.last: the run's latest)."""
        result.kept = kept
        if group is not None:
            result.leader, result.led = group.leader.hex(), group.leader == self.identity.node_id
        result.matchmaking_s = mm_s
        result.dims = st.grid.dims
        result.window_end = st.core.window_end
        result.compression = st.compression
        result.seconds = self.clock() - t0
        st.last = result
        return result

    async def _average_parts(self, st: RunState, group: Group, parts: list[Part], weight: float, budget_s: float,
                             round_no: int, key: str, seen: int, center: np.ndarray | None, split: bool,
                             mm_s: float, t0: float, kept: bool) -> list[RoundResult | Exception]:
        """Each part in ``group``: wait for its vector, average it (under part_group_id when ``split``), hand
        its result to ``done`` at once. A part's own wait comes out of its budget."""
        results: list[RoundResult | Exception] = [MoshpitError("not averaged")] * len(parts)
        out: set[int] = set()  # members averaged out of a part: out for the parts that start after it

        async def one(i: int, part: Part) -> None:
            w0 = self.clock()
            try:
                vector = await part.fetch()
            except Exception as e:
                if not split:
                    raise  # the plain form: the round ends with it (as before parts)
                results[i] = e
            else:
                w1 = self.clock()
                res = await self._average_group(st, group, vector, weight, budget_s - (w1 - w0), round_no,
                                                key, seen, center, part=i if split else None, absent=tuple(out))
                out.update(res.out)
                res.members_s, res.transfer_s = w1 - w0, self.clock() - w1
                results[i] = self._finished(st, res, mm_s, t0, kept, group)
            if part.done is not None:
                part.done(results[i])

        if len(parts) == 1:
            await one(0, parts[0])
        else:
            async with trio.open_nursery() as nursery:
                for i, part in enumerate(parts):
                    nursery.start_soon(one, i, part)
        return results

    async def _average_group(self, st: RunState, group: Group, vector: np.ndarray, weight: float, budget_s: float,
                             round_no: int, key: str, seen: int, center: np.ndarray | None = None,
                             part: int | None = None, absent: tuple[int, ...] = ()) -> RoundResult:
        """Average in ``group`` through the allreduce service (``part``: one part of a split round, under its
        own group id and rounding draws; ``absent``: members an earlier part left out, not waited for). A
        failed or non-finite average hands back the caller's own vector (outcome ``failed``); the machine then
        keeps the group no longer."""
        members = [Member(c.public_key, c.node_id, c.addr) for c in group.members]
        hexes = [c.node_id.hex() for c in group.members]
        group_id = group.group_id if part is None else part_group_id(group.group_id, part)
        gid = f"{group_id:08x}"
        around = None
        if st.robust is not None and st.robust.mode == "centered":
            if center is not None:
                around = center
            elif st.center is not None and st.center.shape == vector.shape:
                around = st.center
        coded = {} if st.codec is None else {  # fp32 goes its zero-copy way, no codec
            "codec": st.codec, "run": codec_run_key(st.run_id if part is None else f"{st.run_id}#{part}", round_no)}
        if st.topk is not None:
            return await self._average_topk(st, group, members, hexes, vector, weight, budget_s, round_no, key, seen)
        if self._nursery is not None:  # (alongside the average: senders' limits may start a moment late)
            self._nursery.start_soon(learn_caps, self.dht, self.peer_caps, self.allreduce, self.identity.node_id, group,
                                     members, group_dht_key(st.run_id, round_no, key))
        try:
            shares = capped_shares([c.capped for c in group.members]) if st.shares == "caps" else None
            capped = capped_phase_s(self.cap_ad, self.peer_caps, self.identity.node_id, group, vector.nbytes,
                                    self.endpoint.mtu, shares)
            floor_s, longest = phase_deadlines(self.deadlines, vector.nbytes, max(1.0, budget_s / 2, capped), capped)
            options = AverageOptions(floor_s=floor_s, owner_lag_s=SILENCE_CAP_S, max_phase_s=longest,
                                     max_weight=st.max_weight, robust=st.robust, absent=absent,
                                     probe_silent=probes_silent(self.deadlines), shares=shares, **coded)
            res = await self.allreduce.average(group_id, members, group.index, vector, weight, options, center=around)
            finite = await self._finite(res.vector)
        except (ValueError, RpcError) as e:  # e.g. the same group id twice: keep my own vector
            log.warning("run %s round %d: averaging in group %s failed: %s", st.run_id, round_no, gid, e)
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key,
                               seen, str(e))
        if not finite:  # a member sent NaN/inf that got through, or the sums overflowed: never hand it over
            self.metrics.contributions_refused.labels("nonfinite_average").inc()
            log.warning("run %s round %d: the average in group %s holds NaN or infinity; keeping this node's "
                        "own vector", st.run_id, round_no, gid)
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key,
                               seen, "the group's average held NaN or infinity (a member sent non-finite values, "
                               "or the sum overflowed float32): kept this node's own vector")
        if st.robust is not None and st.robust.mode == "centered":
            st.center = res.vector.copy()  # only an averaged, finite round becomes the next center
        sent = int(getattr(res, "bytes_sent", 0))  # (an averager without it, in tests, sent nothing we know of)
        self.metrics.moshpit_bytes_sent.labels(st.compression).inc(sent)
        rs, ag, dead = res.stats.reduce_scatter, res.stats.all_gather, tuple(getattr(res.stats, "dead", ()))
        expected = rs.datagrams_expected + ag.datagrams_expected
        fraction = (rs.datagrams_received + ag.datagrams_received) / expected if expected else 1.0
        return RoundResult(res.vector, "averaged", gid, len(members), hexes, fraction, round_no, 0.0, 0.0, key, seen,
                           silent=bool({*rs.silent, *ag.silent} - {*dead}), dead=dead, out=(*rs.silent, *absent, *dead),
                           weight_total=float(getattr(res.stats, "weight_total", 0.0)), bytes_sent=sent,
                           complete=bool(getattr(res.stats, "complete", False)))

    async def _average_topk(self, st: RunState, group: Group, members: list[Member], hexes: list[str],
                            vector: np.ndarray, weight: float, budget_s: float, round_no: int, key: str, seen: int
                            ) -> RoundResult:
        """An arc-topk round: three group averages (sketch, selection, dense rows) and the run's EF21M state."""
        topk = st.topk
        assert topk is not None
        gid = f"{group.group_id:08x}"
        if vector.size != topk.length:
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key, seen,
                               f"the arc-topk layout holds {topk.length} elements, the vector {vector.size}")
        try:
            options = AverageOptions(floor_s=1.0, max_phase_s=max(1.0, budget_s / 6), max_weight=st.max_weight,
                                     robust=st.robust, probe_silent=probes_silent(self.deadlines))
            plan = ArcTopKPlan.build(topk.shapes, len(members), topk.ratio, self.allreduce.max_body)
            ids, sus, me = [mb.node_id for mb in members], topk.suspects, group.index  # robust: opposed lately
            res = await service_arc_topk(self.allreduce, group.group_id, members, me, vector, weight, plan, ef=topk.ef,
                                         run=codec_run_key(st.run_id, round_no), round=round_no, options=options,
                                         suspects=sus.among(ids, me), banned=sus.banned_among(ids, me),
                                         prior=sus.prior(ids, me))
            dense = res.phases[2].stats
            sus.observe(ids, getattr(dense, "opposed", ()), getattr(dense, "cosines", ()))
            finite = await self._finite(res.vector)
        except (ValueError, RpcError) as e:
            log.warning("run %s round %d: arc-topk in group %s failed: %s", st.run_id, round_no, gid, e)
            if topk.ef is not None:
                topk.ef.reset()  # its h, e may hold half a round
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key,
                               seen, str(e))
        if not finite:
            self.metrics.contributions_refused.labels("nonfinite_average").inc()
            if topk.ef is not None:
                topk.ef.reset()
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, 0.0, round_no, 0.0, 0.0, key,
                               seen, "the arc-topk result held NaN or infinity: kept this node's own vector")
        totals = phase_totals(res.phases)
        self.metrics.moshpit_bytes_sent.labels("arc-topk").inc(res.bytes_sent)
        if not res.complete:  # some rows were never averaged: not an average (EF21M's u holds only averages still)
            unknown = [j for j, sel in enumerate(res.selections) if sel is None]
            log.warning("run %s round %d: arc-topk in group %s: the selection of shard(s) %s did not reach this "
                        "node; keeping its own vector", st.run_id, round_no, gid, unknown)
            return RoundResult(vector.copy(), "failed", gid, len(members), hexes, res.got_fraction, round_no, 0.0,
                               0.0, key, seen, f"the arc-topk selection of shard(s) {unknown} did not decode here: "
                               f"{1 - res.got_fraction:.1%} of the round's rows were not averaged",
                               bytes_sent=res.bytes_sent)
        fraction = totals["datagrams_received"] / totals["datagrams_expected"] if totals["datagrams_expected"] else 1.0
        silent = any(p.stats.reduce_scatter.silent or p.stats.all_gather.silent or p.stats.dead for p in res.phases)
        return RoundResult(res.vector, "averaged", gid, len(members), hexes, fraction, round_no, 0.0, 0.0, key, seen,
                           silent=silent, bytes_sent=res.bytes_sent)

    @staticmethod
    async def _finite(vector: np.ndarray) -> bool:
        if vector.size <= FINITE_SLICE:
            return all_finite(vector)
        return await trio.to_thread.run_sync(all_finite, vector)  # ~50 ms for 100 MB: not on the event loop

    # -- executing the machine's actions --------------------------------------------------------
    def _execute(self, st: RunState, actions: list, nursery: trio.Nursery | None) -> Average | None:
        """Start what the machine asked for; return the Average it asks for, if any (the caller awaits it).
        Round-scoped work (reads, JOINs) runs in ``nursery`` and ends with the round; the rest outlives it."""
        average = None
        for a in actions:
            if isinstance(a, Put):
                self._spawn(self._put, a)
            elif isinstance(a, Get):
                if a.detached:
                    self._spawn(self._get, st, a)
                elif nursery is None:
                    log.warning("run %s: a DHT read outside a round was dropped", st.run_id)
                else:
                    nursery.start_soon(self._guarded, self._get, st, a)
            elif isinstance(a, Request):
                if a.detached or nursery is None:
                    self._spawn(self._send_request, st, a)
                else:
                    nursery.start_soon(self._guarded, self._send_request, st, a)
            elif isinstance(a, Notify):
                self._spawn(self.endpoint.notify, a.to.addr, a.mtype, a.fields)
            elif isinstance(a, Average):
                average = a
            elif isinstance(a, Count):
                getattr(self.metrics, a.metric).labels(*a.labels).inc(a.n)
            elif isinstance(a, Note):
                log.info("%s", a.text)
        if average is not None and nursery is None:
            log.warning("run %s: an average outside a round was dropped", st.run_id)
            return None
        return average

    def _drain(self, st: RunState) -> None:
        """After an input outside the round loop: a round under way executes the actions; else do it now."""
        if st.in_round:
            st.wake.set()
        else:
            self._execute(st, st.core.take_actions(), None)

    async def _put(self, a: Put) -> None:
        await self.dht.put(a.key, self.identity.node_id, a.value, ttl=a.ttl)

    async def _get(self, st: RunState, a: Get) -> None:
        records: list[Record] = []
        try:
            records = await self.dht.get(a.key, enough=a.enough)
        finally:  # a failed read reads as empty: the machine must not wait for it
            st.core.on_records(a.token, records, self.clock())
            self._drain(st)

    async def _send_request(self, st: RunState, a: Request) -> None:
        fields = dict(a.fields)
        if "members" in fields:
            fields["members"] = pack_members(fields["members"], self.identity.node_id, self._loopback())
        try:
            reply = await self.endpoint.request(a.to.addr, a.mtype, fields, timeout=a.timeout, attempts=a.attempts)
        except RpcError as e:
            if a.mtype is m.MsgType.MM_BEGIN:
                log.info("BEGIN not acknowledged by %s:%d: %s (it is averaged out)", a.to.addr[0], a.to.addr[1], e)
            st.core.on_failed(a.token, self.clock())
        else:
            st.core.on_reply(a.token, reply.peer.node_id, bool(reply.body.get("ok", True)),  # (a PONG: answered)
                             reply.body.get("reason", ""), self.clock())
        self._drain(st)

    def _loopback(self) -> str:
        return "::1" if self.endpoint.family == socket.AF_INET6 else "127.0.0.1"

    def _resolve(self, node_id: bytes, host: str) -> str | None:
        """Where to reach a peer that announced ``host`` (the machine's ``resolve``): a wildcard means the
        address the DHT saw it at; None for an address this node cannot use (counted)."""
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
        return host

    # -- handlers (synchronous: the endpoint sends what they return) -----------------------------
    def _on_join(self, incoming: Incoming) -> dict:
        b = incoming.body
        st = self.runs.get(b["run"])
        if st is None:
            return {"ok": False, "reason": "closed" if b["key"] == RENEW_KEY else "not_ready"}
        peer = incoming.peer
        ok, reason = st.core.on_join(Candidate(b["expiry"], peer.node_id, peer.public_key, (peer.host, peer.port)),
                                     b["round"], b["key"], self.clock())
        self._drain(st)
        return {"ok": ok, "reason": reason}

    def _on_begin(self, incoming: Incoming) -> dict:
        b = incoming.body
        peer = incoming.peer
        members = []
        for pk, host, port, *capped in b["members"]:
            if pk == peer.public_key:  # the leader: reach it where its BEGIN came from (it may list a wildcard)
                host, port = peer.host, peer.port
            elif self.endpoint.unreachable(host):  # (the decoder refused the rest; this is the other family)
                self.metrics.datagrams_dropped.labels("address").inc()
                return {"ok": False}
            members.append(Candidate(0.0, node_id_of(pk), pk, (host, port), capped=bool(capped and capped[0])))
        st = self.runs.get(b["run"])
        if st is None:
            return {"ok": False}
        ok = st.core.on_begin(peer.node_id, b["round"], b["group"], members, self.clock())
        self._drain(st)
        return {"ok": ok}

    def _on_disband(self, incoming: Incoming) -> None:
        b = incoming.body
        st = self.runs.get(b["run"])
        if st is not None:
            st.core.on_disband(incoming.peer.node_id, b["round"], self.clock())
            self._drain(st)

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
        await self.dht.put(config_key(run_id), self.identity.node_id, encode_grid(grid), ttl=CONFIG_TTL_S)

    async def _published_grid(self, run_id: str) -> Grid | None:
        records: list[Record] = []
        with trio.move_on_after(5.0):
            records = await self.dht.get(config_key(run_id))
        return published_grid(records, self._fits)

    def _fits(self, grid: Grid) -> bool:
        try:
            self._check_fits(grid.size)
        except MoshpitError:
            return False
        return True

    async def _sync_round(self, st: RunState) -> None:
        """Start at the round after the latest one any peer of the run finished (for joiners)."""
        records: list[Record] = []
        with trio.move_on_after(SYNC_S):
            records = await self.dht.get(progress_key(st.run_id))
        if st.core.phase in ("idle", "done"):  # a round under way catches up by itself when it ends
            st.core.apply_sync(records, self.clock())
            self._drain(st)
