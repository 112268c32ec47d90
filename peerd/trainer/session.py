"""A trainer's session on the daemon and what its rounds hand back: run ids, codec keywords, phases, replies."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from ..allreduce.robust import Robust
from ..localsock.arena import Arena
from ..localsock.phases import empty_phases
from ..localsock.server import Connection, OpError
from ..moshpit.service import RoundResult, all_finite
from .options import MAX_BLOB

OFF_LOOP_ELEMS = 1 << 22  # a slot this large (16 MB) is copied and checked in a worker thread, off the event loop

Average = Callable[..., Awaitable[RoundResult]]  # Moshpit's average (peerd.moshpit.service.MoshpitService.average)


def _copy_checked(src: np.ndarray) -> tuple[np.ndarray, bool]:
    out = src.copy()
    return out, all_finite(out)


async def take_slot(src: np.ndarray) -> tuple[np.ndarray, bool]:
    """A copy of (part of) a trainer's slot, which averaging must not see change, and whether it is finite. A large
    one is taken in a worker thread (numpy releases the GIL): at 67M values it is tens of ms during which the
    daemon would answer nothing. (The view keeps the arena's mapping alive should the session close meanwhile.)"""
    if src.size < OFF_LOOP_ELEMS:
        return _copy_checked(src)
    return await trio.to_thread.run_sync(_copy_checked, src)

@dataclass
class Session:
    id: int
    run: str
    run_key: str
    layout: str  # hash, hex
    elems: int
    arena: Arena
    conn: Connection
    latest: int = -1  # newest step id requested
    steps: int = 0
    late_results: int = 0
    closed: bool = False
    last: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # the trainer's latest reported step, by phase
    grad_group: int = 0  # the group size of the latest averaged gradient round (a parameter check needs as many)
    keep_rounds: int | None = None  # Moshpit kept-group rounds for this session's runs (None: the daemon's)
    max_samples: float | None = None  # the most samples one member's contribution may claim (None: the default)
    robust: Robust | None = None  # robust aggregation asked for by the trainer (None: the defaults)
    robust_off: bool = False  # the trainer asked for robust "off": its gradient and outer averages run none of it
    snapshot_max: int = MAX_BLOB  # the most bytes a snapshot of this model can hold (a download's bound)
    outer_rounds: list[int] = field(default_factory=list)  # outer rounds whose blobs this daemon still keeps
    outer_at: float | None = None  # when this session's last outer step was asked for, or it opened (OuterSteps' clock)
    keeping: trio.Event | None = None  # set once the periodic snapshot being kept in the background is kept
    outer_swarm: int = 0  # the members that held this session's final at its last outer step (its swarm's size)
    # overlap: (step, bucket) -> the event a deferred bucket waits on and whether it was skipped (bounded by
    # MAX_BUCKETS per step and MAX_DEFERRED_STEPS steps)
    deferred: dict[tuple[int, int], tuple[trio.Event, list[bool]]] = field(default_factory=dict)
    # overlap: (step, bucket) -> skip, for a trainer_bucket_ready that ran before its trainer_bucket (requests with
    # ids run concurrently, in no set order); the bucket's request takes it (steps from latest on, bounded)
    early_ready: dict[tuple[int, int], bool] = field(default_factory=dict)
    # overlap with one matchmaking per step: step -> the round its deferred buckets share (at most
    # MAX_DEFERRED_STEPS unfinished ones)
    rounds: dict[int, StepRound] = field(default_factory=dict)
    compression: dict[str, Any] = field(default_factory=dict)  # the run's codec keywords (parse_compression)
    auto: dict[str, Any] = field(default_factory=dict)  # the trainer's compression="auto" choice and its reason
    shapes: list[list[int]] = field(default_factory=list)  # the layout's shapes (arc-topk's rows and columns)

    def average_id(self, kind: str) -> str:
        """The Moshpit run id of this session's gradients or parameters: the layout hash is part of it,
        so models that differ never meet in a group, and gradients never mix with parameters."""
        return f"{self.run}.{self.layout[:12]}.{kind[0]}"

    def bucket_id(self, bucket: int) -> str:
        """The Moshpit run id of gradient bucket ``bucket`` (overlap): one run per bucket, so buckets of a step
        average concurrently (a run averages one round at a time)."""
        return f"{self.run}.{self.layout[:8]}.b{bucket}"

    def step_id(self, plan: str) -> str:
        """The Moshpit run id of this session's gradient steps whose buckets share one round (overlap): the
        bucket plan is part of it, so trainers that cut the model into other buckets never meet in a group."""
        return f"{self.run}.{hashlib.sha256((self.layout + plan).encode()).hexdigest()[:10]}.s"


@dataclass
class StepRound:
    """The deferred buckets of one step that share one Moshpit round (``average_parts``: one matchmaking).
    Bucket b's request fills ``fetches[b]`` and sets ``arrived[b]``; the round sets ``results[b]`` and
    ``done[b]`` the moment b's average ends. ``after``: the session's previous step's round, which must end
    before this one starts (both are Moshpit rounds of one run; taken out of order, this step's group would wait
    for gradients the trainer sends only once the previous step's average is back)."""

    count: int
    plan: str
    arrived: list[trio.Event]
    fetches: list[Callable[[], Awaitable[np.ndarray]] | None]
    results: list[Any]
    done: list[trio.Event]
    after: StepRound | None = None
    ended: trio.Event = field(default_factory=trio.Event)

    @classmethod
    def new(cls, count: int, plan: str, after: StepRound | None = None) -> StepRound:
        return cls(count, plan, [trio.Event() for _ in range(count)], [None] * count, [None] * count,
                   [trio.Event() for _ in range(count)], after)

    def settle(self, bucket: int, result: Any) -> None:
        if not self.done[bucket].is_set():
            self.results[bucket] = result
            self.done[bucket].set()



def codec_keywords(session: Session, kind: str, size: int) -> dict[str, Any]:
    """What an average of ``kind`` over ``size`` elements passes to Moshpit for the session's codec: arc-topk only
    for whole gradient vectors (the layout's shapes fit nothing else; parameter and outer averages of such a
    session go in fp32, under their own run ids), the body codecs for every average."""
    opts = session.compression
    if opts.get("compression") != "arc-topk":
        return dict(opts)
    if kind != "grad":
        return {}
    if size != session.elems:
        raise OpError("arc-topk averages whole gradient vectors: not with overlap buckets (use a body codec)")
    return {**opts, "topk_layout": session.shapes}



def round_phases(result: RoundResult | None, *, copy_in: float, round_s: float, copy_out: float) -> dict[str, float]:
    """The daemon's part of a step, by phase (peerd.localsock.phases). A kept group's renewal is a wait for
    the group's members, a DHT matchmaking is matchmaking; what the round spent beyond matchmaking, the
    members' wait and the transfer (a failed round's deadline, bookkeeping) counts as matchmaking too."""
    phases = empty_phases()
    mm = members = transfer = 0.0
    if result is not None:
        mm, members, transfer = float(result.matchmaking_s), float(result.members_s), float(result.transfer_s)
        if result.kept:
            members, mm = members + mm, 0.0
    mm += max(0.0, round_s - mm - members - transfer)
    phases.update(copy_in=copy_in, matchmaking=mm, members=members, transfer=transfer, copy_out=copy_out)
    return {k: round(v, 6) for k, v in phases.items()}


def round_reply(step: int, outcome: str, result: RoundResult | None, seconds: float, error: str) -> dict[str, Any]:
    """A step's reply to the trainer from its round's result (None: the round failed)."""
    if result is None:
        result = RoundResult(np.empty(0, np.float32), outcome, "", 1, [], 0.0, 0, seconds)
    return {
        "step": step,
        "outcome": outcome,
        "group_id": result.group_id,
        "group_size": int(result.group_size),
        "members": list(result.members),
        "received_fraction": float(result.received_fraction),
        # this node's result is its group's common one (every range of the others' shards arrived, repairs included)
        "complete": outcome == "averaged" and bool(result.complete),
        "round": int(result.round),
        "seconds": round(seconds, 6),
        "matchmaking_s": round(float(result.matchmaking_s), 6),
        "kept": bool(result.kept),
        "bytes_sent": int(result.bytes_sent),  # UDP payload bytes this node sent for it
        "error": error,
    }


def node_ids(hexes: list[str]) -> list[bytes]:
    """The node ids among a round result's ``members`` (hex strings; anything else is skipped)."""
    out = []
    for h in hexes:
        try:
            out.append(bytes.fromhex(h))
        except (TypeError, ValueError):
            continue
    return out
