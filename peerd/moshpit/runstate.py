"""What the Moshpit shell holds per run and hands back: a run's state and options, a round's result, their
statistics, and the checks of a run's averaging options (the shell in service.py drives the rounds)."""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from ..allreduce.robust import Robust, Suspects, SuspectStatistics, parse_robust
from ..compress import Codec
from ..compress import codec as make_codec
from ..compress.topk import EF21M
from .keys import Grid, KeyManager
from .records import MoshpitError
from .roundlog import RoundLog
from .rounds import RoundMachine
from .sticky import StickyGroups, StickyStatistics

log = logging.getLogger("peerd.moshpit")

FINITE_SLICE = 1 << 20  # elements per isfinite pass (a 4 MB slice: no 100 MB temporary)
MOSHPIT_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")  # body codecs a run may average in (protocol/codecs.md)

MAX_GROUP_DEFAULT = 16  # a run's groups hold at most this many members unless the daemon says otherwise
MAX_PARTS = 1000  # parts of one split round (a trainer step's gradient buckets: peerd.trainer MAX_BUCKETS)
PART_STRIDE = 0x9E3779B1  # odd: part_group_id maps parts 0..2**32-1 of one group to distinct ids


def part_group_id(group_id: int, part: int) -> int:
    """The allreduce group id of part ``part`` of a split round: every member derives the same one from the
    group's id, and distinct parts never share an id (a group average runs once per id on a node)."""
    return (group_id + PART_STRIDE * part) % 2**32


@dataclass
class Part:
    """One vector of a split round (MoshpitService.average_parts): ``fetch`` is awaited once the group is
    known (or none formed) and returns the vector; ``done`` gets the part's result (or the exception its
    fetch raised) the moment its average ends."""

    fetch: Callable[[], Awaitable[np.ndarray]]
    done: Callable[[RoundResult | Exception], None] | None = None


@dataclass(frozen=True)
class RoundStatistics:
    """A round's result as `peerd status` and the moshpit ops show it (RoundResult without the vector)."""

    round: int
    outcome: str
    group_id: str
    group_size: int
    members: list[str]
    received_fraction: float
    seconds: float
    matchmaking_s: float
    key: str
    seen: int
    error: str
    kept: bool
    compression: str
    bytes_sent: int
    leader: str
    led: bool
    members_s: float
    transfer_s: float
    complete: bool  # every all-gather range arrived here (RoundResult.complete)


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
    compression: str = "fp32"  # the body codec the group averaged in
    bytes_sent: int = 0  # UDP payload bytes this node sent for the group average
    leader: str = ""  # node id (hex) of the member that closed the group ("" when alone): NAT labs check it is public
    led: bool = False  # this node led its group
    silent: bool = field(default=False, repr=False)  # some member was never heard from (not in stats)
    # members (indices in the group's order) this node heard nothing from in the reduce-scatter, or did
    # not wait for (absent): a split round's later parts leave them out
    out: tuple[int, ...] = field(default=(), repr=False)
    dead: tuple[int, ...] = field(default=(), repr=False)  # members given up on mid-average (daemons silent to PINGs)
    dims: int = 1  # the run's grid dimensions: rounds until every member's value reached every other's
    weight_total: float = 0.0  # the weight the group's average stands for (its members' weights; 0: unknown)
    window_end: float = 0.0  # wall clock: when this round's matchmaking window ended (0: a kept group's round)
    members_s: float = 0.0  # from the group being known to this part's vector being there (a deferred part waits)
    transfer_s: float = 0.0  # the group average itself (reduce-scatter and all-gather, handshake included)
    # averaged, and every range of the others' shards arrived here: this node holds the group's common result
    # (GroupStats.complete); an arc-topk round, or one that failed or found no group, is never complete
    complete: bool = False

    def statistics(self) -> RoundStatistics:
        return RoundStatistics(
            self.round, self.outcome, self.group_id, self.group_size, list(self.members), self.received_fraction,
            self.seconds, self.matchmaking_s, self.key, self.seen, self.error, self.kept, self.compression,
            self.bytes_sent, self.leader, self.led, self.members_s, self.transfer_s, self.complete,
        )


@dataclass
class TopK:
    """A run's arc-topk configuration and its EF21M state (peerd.allreduce.arctopk): the trainer's tensor shapes
    (1-D tensors go whole), the share of rows averaged, and EF21M (None: no error feedback). The state is the
    run's: h, e and u survive group changes (every averaged row is the group's mean again), and everything resets on
    a new layout or a failed round (see EF21M)."""

    shapes: tuple[tuple[int, ...], ...]
    ratio: float
    ef: EF21M | None
    suspects: Suspects = field(default_factory=Suspects)  # who this member's dense phases left out lately

    @property
    def length(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def check_topk(shapes: object, ratio: object, eta: object) -> TopK:
    """arc-topk's configuration; MoshpitError unless ``shapes`` is a list of shapes (lists of non-negative ints)
    with at least one element, ``ratio`` in (0, 1], ``eta`` None (no error feedback) or in (0, 1]."""
    if not isinstance(shapes, list | tuple) or not 1 <= len(shapes) <= 100_000 or not all(
            isinstance(sh, list | tuple) and len(sh) <= 8 and all(type(d) is int and d >= 0 for d in sh)
            for sh in shapes):
        raise MoshpitError("arc-topk needs the layout: a list of tensor shapes (lists of non-negative integers)")
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        raise MoshpitError(f"topk_ratio must be in (0, 1], got {ratio!r:.40}")
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, int | float) or not 0.0 < eta <= 1.0):
        raise MoshpitError(f"ef_eta must be in (0, 1] (or None: no error feedback), got {eta!r:.40}")
    topk = TopK(tuple(tuple(sh) for sh in shapes), float(ratio), None if eta is None else EF21M(float(eta)))
    if topk.length == 0:
        raise MoshpitError("the arc-topk layout holds no elements")
    return topk


@dataclass(frozen=True)
class RunStatistics:
    """One run in `peerd status`: its kept group, grid, round, state and averaging options, and its last round
    (``topk_ratio``/``ef``: arc-topk runs only; ``quant_group``/``rounding``: int8/int4 runs only)."""

    sticky: StickyStatistics
    grid: str
    key: str
    round: int
    state: str
    min_size: int
    window_s: float
    max_weight: float | None
    robust: str
    compression: str
    topk_ratio: float | None
    ef: bool | None
    quant_group: int | None
    rounding: str | None
    last: RoundStatistics | None
    suspects: SuspectStatistics | None = None  # arc-topk runs: the direction test's verdicts (robust.Suspects)


@dataclass(frozen=True)
class MoshpitStatistics:
    """Every run this node has opened, by run id."""

    runs: dict[str, RunStatistics]


@dataclass
class RunState:
    """One run as the shell holds it: the round machine, plus what only the shell needs (the lock that
    serialises rounds, the wake-up for the round under way, the averaging options, the last result)."""

    core: RoundMachine
    lock: trio.Lock = field(default_factory=trio.Lock)
    wake: trio.Event = field(default_factory=trio.Event)  # an input reached the machine mid-round
    in_round: bool = False
    last: RoundResult | None = None
    state: str = "idle"  # idle | matchmaking | averaging
    max_weight: float | None = None  # owners cap each member's weight (sample count) at this; None: no cap
    robust: Robust | None = None  # owners clip contributions (allreduce/robust.py); None: plain mean
    center: np.ndarray | None = None  # the last averaged vector: the center of robust "centered" mode
    codec: Codec | None = None  # the body codec every average of the run uses (None: fp32, the zero-copy path)
    topk: TopK | None = None  # arc-topk instead of a body codec (then ``codec`` is None)
    shares: str = "caps"  # "caps": capped members own smaller shards (allreduce.shards.capped_shares); "equal"
    round_log: RoundLog = field(default_factory=RoundLog)  # what the log says of the run's rounds

    def log_round(self, round_no: int, outcome: str, group_size: int, seconds: float, now: float) -> None:
        """Each round at DEBUG; at INFO the run's first and, every roundlog.SUMMARY_S, a summary (RoundLog)."""
        log.debug("run %s round %d: %s, group of %d, %.3f s", self.run_id, round_no, outcome, group_size, seconds)
        line = self.round_log.note(self.run_id, outcome, group_size, seconds, now)
        if line is not None:
            log.info("%s", line)

    @property
    def compression(self) -> str:
        """The codec's name, as metrics label it."""
        if self.topk is not None:
            return "arc-topk"
        return self.codec.name if self.codec is not None else "fp32"

    # the machine's state, read through (the shell decides none of it)
    @property
    def run_id(self) -> str:
        return self.core.run_id

    @property
    def grid(self) -> Grid:
        return self.core.grid

    @property
    def keys(self) -> KeyManager:
        return self.core.keys

    @property
    def min_size(self) -> int:
        return self.core.min_size

    @property
    def window_s(self) -> float:
        return self.core.window_s

    @property
    def round(self) -> int:
        return self.core.round

    @property
    def synced(self) -> bool:
        return self.core.synced

    @property
    def sticky(self) -> StickyGroups:
        return self.core.sticky

    @property
    def known(self) -> dict[bytes, int]:
        return self.core.known

    def statistics(self) -> RunStatistics:
        int_codec = self.codec is not None and self.compression.startswith("int")
        return RunStatistics(
            sticky=self.sticky.statistics(), grid=str(self.grid), key=self.keys.group_key(self.round),
            round=self.round, state=self.state, min_size=self.min_size, window_s=self.window_s,
            max_weight=self.max_weight, robust=str(self.robust) if self.robust else "off",
            compression=self.compression,
            topk_ratio=self.topk.ratio if self.topk is not None else None,
            ef=(self.topk.ef is not None) if self.topk is not None else None,
            quant_group=self.codec.group if int_codec else None,  # type: ignore[union-attr]
            rounding=self.codec.rounding if int_codec else None,  # type: ignore[union-attr]
            last=self.last.statistics() if self.last else None,
            suspects=self.topk.suspects.statistics() if self.topk is not None else None,
        )


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


def check_compression(compression: object, quant_group: object = None, rounding: object = None) -> Codec | None:
    """The run's body codec from its configuration: ``compression`` one of MOSHPIT_CODECS (or a Codec),
    ``quant_group`` (int8/int4: values per scale and min, default 128) and ``rounding`` (int8/int4: stochastic,
    the default, or nearest). None for fp32 (averages keep fp32's zero-copy path). MoshpitError otherwise.

    Every member of a group must use the same codec: a body in another codec is a counted drop at its receiver
    (``peerd_datagrams_dropped_total{reason="codec"}``), so trainers of one run declare the same configuration."""
    if isinstance(compression, Codec):
        return None if compression.wire_id == 0 else compression
    if compression == "arc-topk":
        raise MoshpitError("compression arc-topk is not a body codec: it needs the layout (open/average with "
                           "compression='arc-topk', topk_layout=[shapes], topk_ratio, ef_eta; see "
                           "peerd.allreduce.arctopk)")
    if not isinstance(compression, str) or compression not in MOSHPIT_CODECS:
        raise MoshpitError(f"compression must be one of {', '.join(MOSHPIT_CODECS)}, got {compression!r:.40}")
    params: dict[str, object] = {}
    if compression.startswith("int"):
        if quant_group is not None:
            if type(quant_group) is not int or not 1 <= quant_group <= 0xFFFF:
                raise MoshpitError(f"quant_group must be an integer in [1, 65535], got {quant_group!r:.40}")
            params["group"] = quant_group
        if rounding is not None:
            if rounding not in ("stochastic", "nearest"):
                raise MoshpitError(f"rounding must be stochastic or nearest, got {rounding!r:.40}")
            params["rounding"] = rounding
    elif quant_group is not None or rounding is not None:
        raise MoshpitError(f"quant_group and rounding apply to int8 and int4, not to {compression}")
    made = make_codec(compression, **params)
    return None if made.wire_id == 0 else made


def codec_run_key(run_id: str, round_no: int) -> int:
    """The u64 ``run`` of a round's stochastic-rounding draws (peerd.compress.rounding): from the run id and the
    round, so draws differ from round to round and run to run (the group id and sender make the rest of the
    key) while every member derives the same value."""
    digest = hashlib.sha256(f"peerd-codec-run-v1/{run_id}/{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def all_finite(vector: np.ndarray) -> bool:
    """No NaN or infinity, checked a slice at a time (no temporary as large as the vector)."""
    return all(np.isfinite(vector[i:i + FINITE_SLICE]).all() for i in range(0, vector.size, FINITE_SLICE))
