"""One group's averaging over lossy datagrams: the sans-I/O state machine (protocol/allreduce.md).

The driver feeds it bodies (``receive``) and timer ticks (``handle_timer``) with an injected ``now``, sends
what ``next_datagrams`` hands out, and sleeps until ``next_deadline()``. Nothing here blocks, reads a clock
or touches a socket, so the simulator and the tests run it in virtual time with exact loss patterns.

A driver's loop, in outline::

    core = GroupAverage(group_id, n, index, vector, weight, now)
    while not core.finished:
        while core.wants_to_send:                      # ~1 ms of work per batch; yield between batches
            for o in core.next_datagrams(64):
                send(o.to, o.type, o.body, times=o.repeat)   # END bodies: o.repeat == 3
        wait for a datagram or until core.next_deadline()
        on a datagram: core.receive(member index of its sender, type, body, now)  # WireError: count, drop
        on the deadline: core.handle_timer(now)
    averaged = core.result()

Cost model (so a trio driver can cut work into ~1 ms slices): ``receive`` is O(1) Python plus O(datagram)
numpy; ``next_datagrams(limit)`` does at most ``limit`` datagrams of work (plus the division of one block of
ranges, ~64k elements, when the all-gather reaches it); ``result()`` may copy own values into ranges that
never arrived, which is O(missing elements).

Members are not trusted (every member holds the swarm key). The owner of a shard refuses what would
poison it, and counts it in ``GroupStats.refused``:

* ``nonfinite``: a reduce-scatter range holding NaN or inf is not averaged in (as if it had been lost);
  the check costs one numpy call per block of ranges at finalization, none per datagram. An all-gather
  range holding NaN or inf is dropped at the member, which keeps its own values for it.
* ``weight_capped``: every weight (the own one too) is capped at ``max_weight`` (default 2**24 samples),
  so one member cannot claim the whole average by announcing weight 3e38.
* ``clipped`` (``robust`` only, see ``peerd.allreduce.robust``): a member whose contribution to this shard
  is more than C times the median norm is scaled down to it.
* ``weight_bounded`` (``robust`` only): a member whose weight is more than WEIGHT_BOUND times the median
  weight of the members that delivered to this shard counts for that bound, so a claimed weight cannot undo
  the clipping (equal honest weights are never bounded, so their average stays exact).
* ``solo`` (``solo=True``): the owner's result for its shard is its own values alone; what others send for it
  is not averaged in (a broadcast from each owner, e.g. arc-topk's selection bitmaps).

Codecs (protocol/codecs.md): with ``codec`` fp32 (the default) the values travel as their own bytes and land
by one copy. With fp16, bf16, int8 or int4 every body is a self-contained codec body: each reduce-scatter range
is encoded by its sender (rounding draws keyed by (run, group id, sender index, phase 0)), decoded and
validated at the owner (a row that fails is a ``malformed`` drop, a body in another codec a ``codec`` drop),
summed in float32 as above, and each averaged range is encoded again for the all-gather (phase 1 draws); the
owner keeps as its own result exactly what its bodies decode to, so replicas agree bit for bit. A range this
member cannot encode (a value beyond the codec's range, or not finite) is not sent, and counted under
``refused["unencodable"]``: to its receiver it is a lost range.

Sums are formed in float32 and checked per block; a block that overflowed (finite values times capped
weights) is summed again in float64, where it cannot, so finite own input never gives a non-finite
result. Non-finite *own* input is the caller's problem: it stays in the ranges it touches.
"""

from __future__ import annotations

import enum
import logging
import math
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..compress import PHASE_AG, PHASE_RS, Codec, RoundingKey
from ..compress.floats import Float32Codec
from ..wire.errors import WireError
from ..wire.native import native as _native
from .frames import (
    END_REPEATS,
    F32_DTYPE,
    FP32_WIRE_ID,
    HEADER,
    HEADER_SIZE,
    BodyType,
    check_header,
    pack_block,
    pack_coded,
    pack_end,
    view_block,
    view_coded,
)
from .robust import MODES as ROBUST_MODES
from .robust import WEIGHT_BOUND, Robust
from .shards import Layout, elements_per_datagram

DEFAULT_MAX_PAYLOAD = 1200 - 37  # default datagram payload minus envelope (21) and AEAD tag (16)
DEFAULT_FLOOR_S = 1.0
DEFAULT_SAFETY = 2.0
IN_ORDER_GRACE_S = 0.005  # an END of a stream that came in order so far: the wait for the rest (_Phase.note_end)
DEFAULT_BLOCK_ROWS = 32  # bodies per OutBlock unless the driver asks for another size (GSO: up to 64)
FINALIZE_BLOCK_ELEMENTS = 1 << 16  # the all-gather divides this many elements at a time (~50 us)
# A compressed codec encodes as it packs (int4 stochastic: ~30 ms for a block of 432 full datagrams): its blocks
# hold at most this many elements, and a ``next_blocks`` batch stops after about four of them, so one call stays
# a few milliseconds of work however many datagrams the driver asks for (fp32 packs by copying: no cap)
CODED_BLOCK_ELEMENTS = 1 << 16
CODED_BATCH_ELEMENTS = 1 << 18
DEFAULT_MAX_WEIGHT = float(2**24)  # samples: the cap on any member's weight unless the caller gives one
_F32_MAX = float(np.finfo(np.float32).max)
_GROUP = struct.Struct("<I")
_DONE = object()  # a send generator that is exhausted
_U64 = (1 << 64) - 1
FP32_CODEC = Float32Codec()  # the default body codec (values travel as their own float32 bytes)

log = logging.getLogger("peerd.allreduce")
_RS_DATA, _RS_END, _AG_DATA, _AG_END = (int(t) for t in BodyType)

COMPLETION = "completion"
DEADLINE = "deadline"


class Outcome(enum.Enum):
    """What ``receive`` did with a body that was not malformed."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # a range (or END) this sender already delivered: not counted twice
    LATE = "late"  # the phase it belongs to has ended at this receiver
    OTHER_GROUP = "group"  # another group's body (a straggler from an earlier round)
    UNKNOWN_SENDER = "sender"  # sender index out of range, or this member itself


class OutBlock(NamedTuple):
    """Bodies of equal size for member ``to``, envelope type ``type``, each sent ``repeat`` times (3 for
    END markers): ``bodies`` is (rows, body bytes) uint8, one body per row, ready for one GSO send."""

    to: int
    type: int
    bodies: np.ndarray
    repeat: int
    # With ``GroupAverage.split_values``: ``bodies`` holds only each body's tensor header and ``values`` the float32
    # values (rows, count) that follow it, a view of the vector or result: sealed straight from there, no packed copy.
    values: np.ndarray | None = None

    def whole(self) -> np.ndarray:
        """The complete bodies (rows, body bytes) uint8: ``bodies`` itself, or headers and values joined."""
        if self.values is None:
            return self.bodies
        return np.concatenate((self.bodies, np.ascontiguousarray(self.values, dtype=F32_DTYPE).view(np.uint8)), axis=1)


class Outgoing(NamedTuple):
    """A body to send: to member ``to`` with envelope type ``type``, ``repeat`` times (3 for END markers)."""

    to: int
    type: int
    body: bytes
    repeat: int


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """One receive phase as this member saw it.

    Datagram counts are data datagrams (END markers not included). Weights are summed per data datagram:
    reduce-scatter counts this member's own weight for each of its ranges in both columns, and expects
    each other sender's weight once it has heard from that sender (a sender never heard from is in
    ``silent`` and adds nothing to ``weight_expected``). All-gather datagrams carry the total weight that
    arrived at the owner; its ``weight_expected`` assumes every range could reach the weight of all
    members this member heard from, so it is an approximation.
    """

    datagrams_expected: int
    datagrams_received: int
    weight_expected: float
    weight_received: float
    ends_received: int  # streams whose END marker arrived
    silent: tuple[int, ...]  # live senders from which nothing at all arrived in this phase
    datagrams_sent: int  # data datagrams this member produced for this phase
    started_at: float | None
    ended_at: float | None
    ended_by: str | None  # "completion", "deadline", or None while running

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at


@dataclass(frozen=True, slots=True)
class GroupStats:
    group_id: int
    n: int
    index: int
    reduce_scatter: PhaseStats
    all_gather: PhaseStats
    drops: dict[str, int]  # reason -> count: group, sender, duplicate, late, malformed, type
    # END markers that arrived when no longer needed (a repeat, or after their phase ended): the driver
    # sends each END 3 times, so these are routine and not counted as drops
    ends_ignored: int
    # Contributions refused or limited (reason -> count): nonfinite (ranges, both phases), weight_capped
    # (members), clipped and weight_bounded (members, robust only), solo (ranges). The driver adds them to
    # contributions_refused.
    refused: dict[str, int] = field(default_factory=dict)
    # the weight this member's average stands for: its own and every member's it heard from (each capped at
    # max_weight, and with robust at the median bound): a later Moshpit round on another grid axis averages with
    # this weight
    weight_total: float = 0.0


class _Phase:
    """Stream bookkeeping for one receive phase: which streams are still open, how many data datagrams
    are still expected from them, and the arrival times the deadline is computed from."""

    __slots__ = (
        "expected",
        "received",
        "top",
        "reordered",
        "first_at",
        "last_at",
        "done",
        "end_seen",
        "open",
        "remaining",
        "t0",
        "t_first",
        "t_last",
        "data",
        "weight_received",
        "sent",
        "ended_at",
        "ended_by",
        "ending",
        "grace",
    )

    def __init__(self, expected: list[int], me: int, t0: float | None) -> None:
        self.expected = expected
        self.received = [0] * len(expected)
        self.top = [0] * len(expected)  # per sender: one past the highest datagram index that arrived
        self.reordered = [False] * len(expected)  # per sender: a datagram arrived after one sent later
        self.first_at = [0.0] * len(expected)  # per sender: when its first data arrived
        self.last_at = [0.0] * len(expected)  # per sender: when its latest data arrived
        # a stream with nothing to carry (empty shard, or this member itself) is complete from the start
        self.done = [s == me or e == 0 for s, e in enumerate(expected)]
        self.end_seen = [False] * len(expected)
        self.open = self.done.count(False)
        self.remaining = sum(e for s, e in enumerate(expected) if not self.done[s])
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.data = 0
        self.weight_received = 0.0
        self.sent = 0
        self.ended_at: float | None = None
        self.ended_by: str | None = None
        # Streams whose END overtook some of their data: sender -> when to stop waiting for the rest.
        self.ending: dict[int, float] = {}
        self.grace = 0.0

    def _progress(self, now: float) -> None:
        if self.t_first is None:
            self.t_first = now
        if self.t_last is None or now > self.t_last:
            self.t_last = now

    def note_data(self, s: int, k: int, now: float) -> bool:
        """One new data datagram, index k, of stream s. True when it started a grace (``last_arrived``)."""
        self.data += 1
        self._progress(now)
        received = self.received[s] = self.received[s] + 1
        if k >= self.top[s]:
            self.top[s] = k + 1
        else:
            self.reordered[s] = True
        if received == 1:
            self.first_at[s] = now
        self.last_at[s] = now
        if not self.done[s]:
            self.remaining -= 1
            if self.received[s] >= self.expected[s]:
                self.done[s] = True
                self.open -= 1
                self.ending.pop(s, None)
            elif k + 1 >= self.expected[s]:
                return self.last_arrived(s, now)
        return False

    def last_arrived(self, s: int, now: float) -> bool:
        """The stream's last datagram arrived with some before it missing: it acts as the stream's END (the
        same grace; ``note_end``). Streams go in index order, so what is missing was sent before it. Without this
        a stream whose three END copies were all lost waited out the phase floor (1 s) though its tail had come:
        seen in `bench allreduce --peers 4 --size 5000000 --link 100mbit --link-loss 0.05`, a slow path's stream
        whose last datagram arrived and no END after it. True when a grace started (the deadline moved)."""
        if self.grace <= 0 or self.done[s] or s in self.ending:
            return False
        self.ending[s] = now + (self.grace if self.reordered[s] else min(self.grace, IN_ORDER_GRACE_S))
        return True

    def close(self, s: int) -> None:
        """Stop waiting for stream s (its END arrived, or its sender was removed)."""
        self.ending.pop(s, None)
        if not self.done[s]:
            self.remaining -= self.expected[s] - self.received[s]
            self.done[s] = True
            self.open -= 1

    def note_block(self, s: int, count: int, k_max: int, now: float) -> bool:
        """``note_data`` for ``count`` new datagrams of stream s at once, the highest index ``k_max``."""
        self.data += count
        self._progress(now)
        received = self.received[s] = self.received[s] + count
        if k_max - count + 1 < self.top[s]:  # (the block's lowest index is at most this: in order it is not)
            self.reordered[s] = True
        if k_max >= self.top[s]:
            self.top[s] = k_max + 1
        if received == count:
            self.first_at[s] = now
        self.last_at[s] = now
        if not self.done[s]:
            self.remaining -= count
            if received >= self.expected[s]:
                self.done[s] = True
                self.open -= 1
                self.ending.pop(s, None)
            elif k_max + 1 >= self.expected[s]:
                return self.last_arrived(s, now)
        return False

    def note_end(self, s: int, now: float) -> None:
        """An END closes its stream, after a short grace when it overtook some of the stream's data
        (reordering): datagrams sent just before it may still be in flight. On a path that kept the stream in
        order so far, what is missing was sent before the END that arrived, so it is nearly surely lost, not
        late: the wait is IN_ORDER_GRACE_S at most (under random loss nearly every stream misses some, and the
        full grace would cost every phase its length; not waiting at all loses reordered data in the host tests
        with 3 ms of jitter). A stream seen reordered keeps the full grace."""
        self.end_seen[s] = True
        self._progress(now)
        if self.done[s]:
            return
        if self.grace > 0 and self.received[s] < self.expected[s]:
            self.ending[s] = now + (self.grace if self.reordered[s] else min(self.grace, IN_ORDER_GRACE_S))
        else:
            self.close(s)

    def expire_ending(self, now: float) -> None:
        for s, until in list(self.ending.items()):
            if now >= until:
                del self.ending[s]
                self.close(s)

    def rate(self) -> float | None:
        """New data datagrams per second since the phase started (or since the first arrival, if earlier)."""
        if self.data == 0 or self.t_last is None or self.t_first is None:
            return None
        ref = self.t_first if self.t0 is None else min(self.t0, self.t_first)
        dt = self.t_last - ref
        return math.inf if dt <= 0 else self.data / dt

    def deadline(
        self, floor_s: float, safety: float, cap_s: float | None, prior_rate: float | None, slack_s: float
    ) -> float:
        """max(t0, t_last) + slack_s + max(floor_s, safety * remaining / rate), capped at t0 + cap_s.

        It only moves later as data arrives, and fires once the flow has stopped for long enough that the
        rest, at the pace seen so far, would have come by now (times ``safety``)."""
        assert self.t0 is not None
        rate = self.rate() or prior_rate
        wait = floor_s if rate is None else max(floor_s, safety * self.remaining / rate)
        base = self.t0 if self.t_last is None else max(self.t0, self.t_last)
        d = base + slack_s + wait
        if cap_s is not None:
            d = min(d, self.t0 + cap_s)
        if self.ending:
            d = min(d, min(self.ending.values()))
        return d

    def snapshot(self, weight_expected: float, weight_received: float, live: list[bool], me: int) -> PhaseStats:
        silent = tuple(
            s
            for s in range(len(self.expected))
            if s != me and live[s] and self.received[s] == 0 and not self.end_seen[s]
        )
        return PhaseStats(
            datagrams_expected=sum(self.expected),
            datagrams_received=self.data,
            weight_expected=weight_expected,
            weight_received=weight_received,
            ends_received=sum(self.end_seen),
            silent=silent,
            datagrams_sent=self.sent,
            started_at=self.t0,
            ended_at=self.ended_at,
            ended_by=self.ended_by,
        )


# The per-row fields of a tensor header (HEADER): each row's offset and weight, at their byte positions.
_HEAD_ITEM = np.dtype(f"V{HEADER_SIZE}")
_HEAD_FIELDS = np.dtype({"names": ["offset", "weight"], "formats": ["<u4", "<f4"], "offsets": [9, 15],
                         "itemsize": HEADER_SIZE})


def _heads(group: int, total: int, offset: int, weight: float | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor headers ``pack_block`` puts before (rows, count) values from element ``offset`` on, alone:
    (rows, HEADER_SIZE) uint8, for a sealer that reads the values from where they are."""
    rows, count = shape
    out = np.empty((rows, HEADER_SIZE), dtype=np.uint8)
    # one HEADER_SIZE-byte item a row (a third of the time of broadcasting the header's bytes)
    out.view(_HEAD_ITEM).reshape(rows)[:] = np.frombuffer(
        HEADER.pack(group, FP32_WIRE_ID, total, offset, count, 0.0), _HEAD_ITEM)[0]
    fields = out.view(_HEAD_FIELDS).reshape(rows)  # (4-byte fields: a fifth of numpy's strided byte copies)
    fields["offset"] = np.arange(offset, offset + rows * count, count, dtype="<u4")
    fields["weight"] = weight
    return out


def _same_heads(bodies: np.ndarray, split: int, end: int) -> bool:
    """Every row's bytes [0, split) and [split + 4, end) are row 0's (the offset, a u32 at ``split``, may differ)."""
    if _native_rows(bodies):
        stride = bodies.strides[0]
        return (_native.same_lead(bodies, 0, stride, len(bodies), split)
                and _native.same_lead(bodies, split + 4, stride, len(bodies), end - split - 4))
    rows = len(bodies)
    return (bodies[:, :split].tobytes() == bodies[0, :split].tobytes() * rows
            and bodies[:, split + 4 : end].tobytes() == bodies[0, split + 4 : end].tobytes() * rows)


def _native_rows(bodies: np.ndarray) -> bool:
    """The native data plane takes this block of bodies as it is: a 2-D byte array whose rows are each contiguous
    and ``strides[0]`` apart (a view past the datagrams' envelopes too), no copy."""
    return (_native is not None and bodies.dtype == np.uint8 and bodies.ndim == 2 and len(bodies) > 0
            and bodies.strides[1] == 1 and bodies.strides[0] >= bodies.shape[1])


def _values_finite(bodies: np.ndarray, length: int) -> bool:
    """No NaN or inf among the float32 values (``length`` bytes after each body's header) of a block: one native
    pass where the extension is built (numpy's check of unaligned float32 is several times slower)."""
    if not _native_rows(bodies):
        return bool(np.isfinite(bodies[:, HEADER_SIZE : HEADER_SIZE + length].view(F32_DTYPE)).all())
    return _native.first_nonfinite(bodies, HEADER_SIZE, bodies.strides[0], len(bodies), length) < 0


def _place(bodies: np.ndarray, dst: np.ndarray, at: int, length: int) -> bool:
    """Copy each body's values (``length`` bytes after its header) into ``dst`` (contiguous) from byte ``at`` on,
    one after the other, in one native pass; False (nothing copied) where the extension is not built or the block
    is not laid out for it, and numpy does it."""
    if not _native_rows(bodies):
        return False
    _native.place_rows(bodies, HEADER_SIZE, bodies.strides[0], len(bodies), length, dst, at, length)
    return True


def _accumulate(bodies: np.ndarray, length: int, acc: np.ndarray, per: int, ks: np.ndarray, filled: np.ndarray,
                factor: float) -> np.ndarray:
    """Add each body's values (``length`` bytes after its header) times ``factor`` (as float32) into the owner's
    float32 sums ``acc`` at range ``ks[i]`` (``per`` elements apart); ``filled`` marks the ranges that hold a sum.
    Per row: 0 added, 1 refused (a NaN or inf), 2 left out (the float32 sum would overflow); such a row changes
    nothing. One native pass where the extension is built; ``_accumulate_numpy`` is the reference, bit for bit."""
    if _native_rows(bodies) and acc.flags.aligned:
        status = _native.accumulate_rows(bodies, HEADER_SIZE, bodies.strides[0], len(bodies), length, acc, 4 * per,
                                         ks, filled, factor)
        return np.frombuffer(status, np.uint8)
    values = np.ascontiguousarray(bodies[:, HEADER_SIZE : HEADER_SIZE + length]).view(F32_DTYPE)
    return _accumulate_numpy(values, acc, per, ks, filled, factor)


def _finalize_f32(own: np.ndarray, acc: np.ndarray, summed: np.ndarray, got: np.ndarray, weight: float
                  ) -> np.ndarray | None:
    """The streaming finalize's float32 path (the reference of accum.c finalize_rows): per range, own * weight plus
    its sum where ``summed``, divided by the weight that arrived (``got`` + weight), or the own values where nothing
    arrived (``got`` not > 0). None where own * weight (+ sum) is not finite somewhere: the caller sums in float64."""
    summed = summed != 0
    with np.errstate(all="ignore"):  # overflow is found below, in one call
        res = own * np.float32(weight)
        if summed.all():
            res += acc
        else:
            res[summed] += acc[summed]
    if not np.isfinite(res).all():
        return None
    np.divide(res, (got + weight).astype(np.float32)[:, None], out=res)
    arrived = got > 0
    if not arrived.all():
        res[~arrived] = own[~arrived]
    return res


def _finalize_native(own: np.ndarray, acc: np.ndarray, summed: np.ndarray, got: np.ndarray, weight: float,
                     out: np.ndarray) -> bool:
    """``_finalize_stream``'s float32 path in one native pass (accum.c finalize_rows; the numpy code after the
    call is the reference, bit for bit): True once ``out`` holds the averages; False where the extension is not
    built, the arrays are not plain contiguous ones, or a value is not finite (nothing written: numpy decides)."""
    if (_native is None or not own.flags.c_contiguous or not acc.flags.c_contiguous or not out.flags.c_contiguous
            or not out.flags.writeable or own.dtype != F32_DTYPE or acc.dtype != F32_DTYPE or out.dtype != F32_DTYPE
            or not own.flags.aligned or not acc.flags.aligned or not out.flags.aligned):
        return False
    rows, width = own.shape
    return bool(_native.finalize_rows(own, acc, summed, got, weight, out, rows, width))


def _accumulate_numpy(values: np.ndarray, acc: np.ndarray, per: int, ks: np.ndarray, filled: np.ndarray,
                      factor: float) -> np.ndarray:
    """``_accumulate`` over aligned float32 rows ``values``: the same float32 operations in the same order."""
    rows, m = values.shape
    if m == per:  # full ranges: rows of a 2-D view
        grid = acc[: (len(acc) // per) * per].reshape(-1, per)
        where: tuple = (ks,)
    else:  # a short last range
        grid = acc
        where = (ks[:, None] * per + np.arange(m),)
    f = np.float32(factor)
    was = filled[ks] != 0
    with np.errstate(all="ignore"):
        prod = values * f
        total = np.where(was[:, None], grid[where] + prod, prod)
        status = np.where(~np.isfinite(values).all(axis=1), 1, np.where(np.isfinite(total).all(axis=1), 0, 2))
    ok = status == 0
    grid[tuple(w[ok] for w in where)] = total[ok]
    filled[ks[ok]] = 1
    return status.astype(np.uint8)


def stage_elements(length: int, n: int) -> int:
    """float32 elements of the stage a member of an ``n``-member group averaging ``length`` elements needs (its
    largest shard, once per member): what a ``stage`` buffer passed to ``GroupAverage`` must hold at least."""
    return n * (-(-length // n)) if n > 0 else 0


def _stage_rows(stage: np.ndarray | None, n: int, width: int) -> np.ndarray:
    """(n, width) float32 rows for the stage: a view of ``stage`` when it is a big enough writable contiguous
    float32 buffer, else fresh memory."""
    if stage is None:
        return np.empty((n, width), dtype=F32_DTYPE)
    if (not isinstance(stage, np.ndarray) or stage.dtype != F32_DTYPE or stage.ndim != 1
            or not stage.flags.c_contiguous or not stage.flags.writeable or stage.size < n * width):
        raise ValueError(f"stage must be a writable contiguous 1-D float32 buffer of at least {n * width} elements")
    return stage[: n * width].reshape(n, width)


def _row(body: bytes) -> np.ndarray:
    return np.frombuffer(body, dtype=np.uint8).reshape(1, -1)


class GroupAverage:
    """Member ``index`` of ``n`` averaging ``vector`` (weight = its sample count) in group ``group_id``.

    Reduce-scatter: shard j of the vector goes to member j; this member keeps, per datagram range of its
    own shard, the weighted sum and the total weight that arrived (its own always counts), and the
    range's average is sum / weight. All-gather: it sends its averaged shard to every other member and
    writes the averaged shards it receives into the result; a range that never arrives keeps this
    member's own value.

    ``out`` receives the result (a new array by default). ``out=vector`` averages in place: safe, because
    this member never sends its own shard, and an owner's all-gather only overwrites a shard after that
    owner has stopped accepting this member's reduce-scatter data for it.

    All members of a group must use the same ``max_payload``: the ranges are derived from it, and a body
    whose range does not match this member's layout is malformed.

    ``max_weight`` caps every weight this owner uses, its own included (None: 2**24 samples). ``robust``
    (``robust.Robust``) clips each member's contribution to this shard to C times the median norm, around
    ``center`` (a full-length vector, the previous round's average) for "centered"; it bounds one member's
    pull on the average but does not stop a sign-flipped contribution of normal size.

    ``codec`` (a ``peerd.compress`` body codec; None: fp32) must be the one every member of the group uses:
    it fixes the ranges too. ``run`` (u64) keys the stochastic rounding draws with the group id, this
    member's index and the phase, so draws are independent across runs, groups, senders and phases and a
    test replays them exactly.

    ``solo``: this owner's result for its shard is its own values alone, whatever others send for it (each
    shard is its owner's broadcast); the all-gather is unchanged.

    ``stage``: scratch memory for the reduce-scatter's staged values (``stage_elements(len(vector), n)`` float32
    elements at least, contents ignored); ``stage_buffer`` hands it back for the next group once this one is done.
    """

    def __init__(
        self,
        group_id: int,
        n: int,
        index: int,
        vector: np.ndarray,
        weight: float,
        now: float,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        floor_s: float = DEFAULT_FLOOR_S,
        safety: float = DEFAULT_SAFETY,
        max_phase_s: float | None = None,
        out: np.ndarray | None = None,
        end_grace_s: float = 0.0,
        max_weight: float | None = None,
        robust: Robust | None = None,
        center: np.ndarray | None = None,
        codec: Codec | None = None,
        run: int = 0,
        stage: np.ndarray | None = None,
        solo: bool = False,
    ) -> None:
        if type(group_id) is not int or not 0 <= group_id <= 0xFFFFFFFF:
            raise ValueError(f"group_id must be a u32, got {group_id!r}")
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if type(index) is not int or not 0 <= index < n:
            raise ValueError(f"index must be in 0..{n - 1}, got {index!r}")
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"weight must be a number (the sample count), got {weight!r}") from None
        with np.errstate(over="ignore"):
            w32 = np.float32(w)
        if not (math.isfinite(w) and w > 0 and math.isfinite(float(w32)) and w32 > 0):
            raise ValueError(
                f"weight must be finite and > 0 (the sample count behind this vector), got {weight!r};"
                " a member with nothing to contribute should not join the group"
            )
        if max_weight is None:
            max_weight = DEFAULT_MAX_WEIGHT
        try:
            cap = float(max_weight)
        except (TypeError, ValueError):
            raise ValueError(f"max_weight must be a number (samples), got {max_weight!r}") from None
        if not (math.isfinite(cap) and 0 < cap <= _F32_MAX and np.float32(cap) > 0):
            raise ValueError(f"max_weight must be finite and > 0 (the most samples a member may claim), got {cap!r}")
        refused: Counter[str] = Counter()
        if w > cap:
            refused["weight_capped"] += 1
            w32 = np.float32(cap)
        if robust is not None and (not isinstance(robust, Robust) or robust.mode not in ROBUST_MODES
                                   or not (math.isfinite(robust.c) and robust.c > 0)):
            raise ValueError(f"robust must be None or a Robust (parse_robust: clip[:C], centered[:C]), got {robust!r}")
        if not (math.isfinite(floor_s) and floor_s >= 0):
            raise ValueError(f"floor_s must be finite and >= 0, got {floor_s!r}")
        if not (math.isfinite(safety) and safety > 0):
            raise ValueError(f"safety must be finite and > 0, got {safety!r}")
        if max_phase_s is not None and not max_phase_s > 0:
            raise ValueError(f"max_phase_s must be > 0 or None, got {max_phase_s!r}")
        if codec is None:
            codec = FP32_CODEC
        if not isinstance(codec, Codec):
            raise ValueError(f"codec must be a peerd.compress body codec (compress.codec(name)), got {codec!r}")
        if type(run) is not int or not 0 <= run <= _U64:
            raise ValueError(f"run must be a u64 (the run's rounding key), got {run!r}")
        if not isinstance(vector, np.ndarray) or vector.ndim != 1:
            raise ValueError("vector must be a 1-D numpy array")
        if out is vector:
            if vector.dtype != F32_DTYPE or not vector.flags.c_contiguous or not vector.flags.writeable:
                raise ValueError("averaging in place needs a writable, contiguous little-endian float32 vector")
            vec = vector
        else:
            vec = np.ascontiguousarray(vector, dtype=F32_DTYPE)
        if out is None:
            out = np.empty(len(vec), dtype=F32_DTYPE)
        elif out is not vec:
            if (
                not isinstance(out, np.ndarray)
                or out.shape != vec.shape
                or out.dtype != F32_DTYPE
                or not out.flags.c_contiguous
                or not out.flags.writeable
            ):
                raise ValueError("out must be a writable contiguous float32 array of the vector's length")
            if np.may_share_memory(out, vec):
                raise ValueError("out overlaps vector; pass out=vector to average in place")

        self.group_id = group_id
        self.n = n
        self.index = index
        self.codec = codec
        self.layout = Layout(len(vec), n, elements_per_datagram(max_payload, codec))
        self.weight = float(w32)  # what travels, so every member uses the same value for it
        self.floor_s = float(floor_s)
        self.safety = float(safety)
        self.max_phase_s = max_phase_s
        self._vec = vec
        self._out = out
        self._max_weight = cap
        # the cap in force at finalizing: max_weight, lowered with ``robust`` to WEIGHT_BOUND times the median
        # weight once every contribution is in (``_robust_step``)
        self._wcap = cap
        self._robust = robust
        self._solo = bool(solo)
        self._refused = refused
        self._center: np.ndarray | None = None
        if robust is not None and robust.mode == "centered" and center is not None:
            if not isinstance(center, np.ndarray) or center.shape != vec.shape:
                raise ValueError("center must be a float32 vector of the averaged vector's length (or None)")
            lo, hi = self.layout.shard(index)
            own_center = np.array(center[lo:hi], dtype=F32_DTYPE)  # a copy: the caller may reuse its array
            if not np.isfinite(own_center).all():
                raise ValueError("center must be finite (the previous round's average); pass None for none")
            self._center = own_center
        # robust: per member, the factor (<= 1) its contribution is scaled by; None until computed, after
        # the reduce-scatter (it needs every contribution), by ``_robust_step`` a slice at a time
        self._scale: list[float] | None = None
        self._norm_pos = 0  # ranges of the own shard whose norms are summed so far
        self._sumsq = [0.0] * n
        self._elements = [0] * n
        self._out_bytes = memoryview(out).cast("B")
        self._inplace = out is vec
        # Blocks carry headers and value views apart (OutBlock.values), for a driver that seals from them. Values
        # are then read when sealed, not when the block is made: with ``out is vec`` a member's average of its shard
        # can land in the vector in between, but only once that member's reduce-scatter has ended, when it drops
        # whatever reduce-scatter data still comes as late; the own shard's average is final before it is sent.
        self.split_values = False
        self._w32 = w32
        self._lo, self._hi = self.layout.shard(index)
        self._per = self.layout.per
        self._nranges = self.layout.datagrams(index)
        # Per range: the weight that arrived (own always does), filled in when the range is finalized.
        self._wsum = np.full(self._nranges, self.weight, dtype=np.float64)
        # Reduce-scatter values land unweighted, one row per sender (one memoryview copy per datagram, no
        # numpy call); the weighted sums are formed block by block, vectorized, when the all-gather reaches
        # them. Costs one shard per member of memory (about the vector's size) to save ~2 us per datagram.
        # ``stage``: a caller's scratch buffer to hold it (``stage_elements``; its contents do not matter), so a
        # node that averages again and again does not allocate and fault in ~a vector's worth of fresh pages each
        # time (AveragingHost keeps one between averages).
        self._stage = _stage_rows(stage, n, self._hi - self._lo)
        if stage is not None and (np.may_share_memory(stage, vec) or np.may_share_memory(stage, out)):
            raise ValueError("stage overlaps the vector or out")
        self._stage_buffer = self._stage.reshape(-1) if stage is None else stage
        self._stage_bytes = [memoryview(row).cast("B") for row in self._stage]
        self._rs_seen = np.zeros((n, self._nranges), dtype=bool)
        # A compressed codec: its byte, the body size of a full range, the rounding keys, and the own shard's
        # all-gather bodies, encoded once when each range is finalized (the owner's own result is what they
        # decode to) with a mask of the ranges that could be encoded (the rest is not sent).
        self._cid = codec.wire_id
        self._coded = codec.wire_id != FP32_CODEC.wire_id
        self._rs_key = RoundingKey(run, group_id, index, PHASE_RS)
        self._ag_key = RoundingKey(run, group_id, index, PHASE_AG)
        if self._coded:
            full = (self._hi - self._lo) // self._per
            self._body_per = codec.body_size(self._per)
            self._ag_full = np.empty((full, self._body_per), dtype=np.uint8)
            self._ag_tail: np.ndarray | None = None
            self._ag_sendable = np.ones(self._nranges, dtype=bool)
        # fp32 without robust aggregation streams: each reduce-scatter row is added, times its sender's weight, into
        # float32 sums (``_acc``, the stage's first shard) as it arrives, so only one shard of the stage is touched
        # and nothing is read back. Per range: whether ``_acc`` holds a sum, the senders' weight that arrived, and
        # rows whose float32 sum would overflow (summed in float64 when the range is finalized). On the Python data
        # path the staged reconstruction stays: in numpy, streaming takes a gather, two finiteness checks, a select
        # and a scatter per block where the stage takes one copy (its sums are vectorized later either way).
        self._stream = not self._coded and robust is None and not solo and _native is not None
        self._acc = self._stage_buffer[: self._hi - self._lo]
        self._acc_set = np.zeros(self._nranges, dtype=np.uint8)
        self._wsum_in = np.zeros(self._nranges, dtype=np.float64)
        self._aside: dict[int, list[tuple[float, np.ndarray]]] = {}
        self._ag_seen = [np.zeros(self.layout.datagrams(j) if j != index else 0, dtype=bool) for j in range(n)]
        self._sender_weight: list[float | None] = [None] * n
        # take.c take_rows takes plain fp32 blocks in one call (receive_block): where the buffers it writes are
        # aligned float32 (a caller's ``out`` need not be), and a reduce-scatter only where sums stream
        self._take = (_native is not None and not self._coded and self._out.dtype == F32_DTYPE
                      and self._out.flags.c_contiguous and self._out.flags.writeable and self._out.flags.aligned
                      and self._acc.flags.aligned)
        self._take_status = np.empty(0, dtype=np.uint8)
        self._live = [True] * n
        self._drops: Counter[str] = Counter()
        self._ends_ignored = 0
        self._finalized = 0  # ranges of the own shard already divided into their average
        self._filled = self._inplace
        self._rs = _Phase([self._nranges if s != index else 0 for s in range(n)], index, now)
        self._ag = _Phase([self.layout.datagrams(j) if j != index else 0 for j in range(n)], index, None)
        self._rs.grace = self._ag.grace = float(end_grace_s)
        self._gen: Iterator[OutBlock | None] | None = self._rs_blocks()
        self._block_rows = DEFAULT_BLOCK_ROWS
        self._left: list[Outgoing] = []  # rows of a block ``next_datagrams`` has not handed out yet
        # Counts phase ends and deadlines brought forward (an END that overtook data starts a short grace):
        # a driver compares it before and after ``receive`` (cheaper than reading ``finished``,
        # ``wants_to_send`` and ``next_deadline``) to know when to wake up and re-read the deadline.
        self.phase_changes = 0
        self._ag_started = False
        self._maybe_end(now)

    # ---- state -------------------------------------------------------------------------------------

    @property
    def stage_buffer(self) -> np.ndarray:
        """The 1-D float32 buffer under the stage (the caller's ``stage``, or this group's own): a driver done with
        this group (its result taken, or given up) may pass it to the next one as ``stage``."""
        return self._stage_buffer

    @property
    def reduce_scatter_done(self) -> bool:
        return self._rs.ended_at is not None

    @property
    def all_gather_done(self) -> bool:
        return self._ag.ended_at is not None

    @property
    def result_ready(self) -> bool:
        """Both receive phases have ended: ``result()`` may be called."""
        return self._rs.ended_at is not None and self._ag.ended_at is not None

    @property
    def wants_to_send(self) -> bool:
        """``next_datagrams`` may have something: call it (in batches) until it returns short."""
        return (
            self._gen is not None or bool(self._left) or (not self._ag_started and self._rs.ended_at is not None)
        )

    @property
    def finished(self) -> bool:
        """Result ready and every datagram produced: the driver can forget this group."""
        return self.result_ready and not self.wants_to_send

    def next_deadline(self) -> float | None:
        """When ``handle_timer`` should next be called; None once both receive phases have ended.

        It moves later whenever new data arrives, so re-read it after every ``receive``.
        """
        if self._rs.ended_at is None:
            return self._rs_deadline()
        if self._ag.ended_at is None:
            return self._ag_deadline()
        return None

    def _rs_deadline(self) -> float:
        return self._rs.deadline(self.floor_s, self.safety, self.max_phase_s, None, 0.0)

    def _ag_deadline(self) -> float:
        # One extra floor: an owner may end its reduce-scatter (by its own deadline) up to about a floor
        # after this member ended its own, and only then starts sending its shard.
        return self._ag.deadline(self.floor_s, self.safety, self.max_phase_s, self._rs.rate(), self.floor_s)

    def handle_timer(self, now: float) -> None:
        """End whichever phase's deadline has passed; what has not arrived by then is lost."""
        if self._rs.ended_at is None:
            self._rs.expire_ending(now)
            self._maybe_end(now)
            if self._rs.ended_at is None:
                if now >= self._rs_deadline():
                    self._end_rs(now, DEADLINE)
                else:
                    return
        if self._ag.ended_at is None:
            self._ag.expire_ending(now)
            self._maybe_end(now)
            if self._ag.ended_at is None and now >= self._ag_deadline():
                self._end_ag(now, DEADLINE)

    def remove_member(self, member: int, now: float) -> None:
        """Stop waiting for ``member`` (it left the swarm): its missing ranges are averaged out / kept own.

        What it already delivered stays counted; what it sends from now on is late; nothing more is sent to it.
        """
        if not 0 <= member < self.n or member == self.index:
            raise ValueError(f"member {member} is not another member of this group")
        self._live[member] = False
        self._rs.close(member)
        self._ag.close(member)
        self._maybe_end(now)

    def _maybe_end(self, now: float) -> None:
        if self._rs.ended_at is None and self._rs.open == 0:
            self._end_rs(now, COMPLETION)
        if self._rs.ended_at is not None and self._ag.ended_at is None and self._ag.open == 0:
            self._end_ag(now, COMPLETION)

    def _end_rs(self, now: float, by: str) -> None:
        self.phase_changes += 1
        self._rs.ended_at = now
        self._rs.ended_by = by
        self._ag.t0 = now  # the all-gather clock starts when this member's own shard is final
        if self._ag.open == 0:
            self._end_ag(now, COMPLETION)

    def _end_ag(self, now: float, by: str) -> None:
        self.phase_changes += 1
        self._ag.ended_at = now
        self._ag.ended_by = by

    # ---- receiving ---------------------------------------------------------------------------------

    def receive(self, sender: int, mtype: int, body: bytes | memoryview, now: float) -> Outcome:
        """Take one body of envelope type ``mtype`` from member ``sender``.

        Malformed bodies are counted and raise WireError("malformed") (WireError("type") for a type that
        is not 0x40..0x43); everything else that is not used is counted and reported as an Outcome.
        """
        try:
            return self._receive(sender, mtype, body, now)
        except WireError as e:
            self._drops[e.reason] += 1
            raise

    def _receive(self, sender: int, mtype: int, body: bytes | memoryview, now: float) -> Outcome:
        if len(body) >= 4 and _GROUP.unpack_from(body)[0] != self.group_id:
            self._drops["group"] += 1
            return Outcome.OTHER_GROUP
        _, _, total, offset, count, weight = check_header(mtype, body, self.codec)
        if type(sender) is not int or not 0 <= sender < self.n or sender == self.index:
            self._drops["sender"] += 1
            return Outcome.UNKNOWN_SENDER
        if not self._live[sender]:  # removed (remove_member): given up on, as a phase deadline gives up
            return self._late(mtype)
        if mtype == _RS_DATA:
            # the hot path: checks inlined rather than Layout.index_of, O(1) Python, two numpy calls
            rel = offset - self._lo
            k, r = divmod(rel, self._per)
            if total != self._nranges or rel < 0 or r or k >= total or count != min(self._per, self._hi - offset):
                self.layout.index_of(self.index, offset, count)  # raises the precise error
                raise WireError("malformed", f"stream of {total} datagrams, this shard takes {self._nranges}")
            self._check_weight(sender, weight)
            seen = self._rs_seen[sender]
            if seen[k]:
                self._drops["duplicate"] += 1
                return Outcome.DUPLICATE
            rs = self._rs
            if rs.ended_at is not None:
                return self._late(mtype)
            if self._coded:  # decoded and validated before anything is marked: CodecError is a malformed drop
                self._stage[sender, rel : rel + count] = self.codec.decode(memoryview(body)[HEADER_SIZE:], count)
            elif self._stream:
                self._add_rows(sender, np.frombuffer(body, np.uint8)[None, :], np.array([k], np.int64), 4 * count)
            else:
                at = 4 * rel
                self._stage_bytes[sender][at : at + 4 * count] = memoryview(body)[HEADER_SIZE:]
            seen[k] = True
            rs.weight_received += weight
            if rs.note_data(sender, k, now):
                self.phase_changes += 1  # the deadline moved earlier (the tail's grace): the driver re-reads it
            if rs.open == 0:
                self._end_rs(now, COMPLETION)
            return Outcome.ACCEPTED

        if mtype == _RS_END:
            rs = self._rs
            if total != self._nranges or offset != self._lo:
                raise WireError(
                    "malformed",
                    f"END of a {total}-datagram stream at {offset}; shard [{self._lo}, {self._hi})"
                    f" takes {self._nranges}",
                )
            self._check_weight(sender, weight)
            if rs.end_seen[sender]:
                self._ends_ignored += 1
                return Outcome.DUPLICATE
            if rs.ended_at is not None:
                return self._late(mtype)
            rs.note_end(sender, now)
            if rs.ending:
                self.phase_changes += 1  # the deadline moved earlier (an END's grace): the driver re-reads it
            if rs.open == 0:
                self._end_rs(now, COMPLETION)
            return Outcome.ACCEPTED

        ag = self._ag
        expected = ag.expected[sender]
        if total != expected:
            raise WireError("malformed", f"stream of {total} datagrams, shard {sender} takes {expected}")
        if mtype == _AG_DATA:
            k = self.layout.index_of(sender, offset, count)
            seen = self._ag_seen[sender]
            if seen[k]:
                self._drops["duplicate"] += 1
                return Outcome.DUPLICATE
            if ag.ended_at is not None:
                return self._late(mtype)
            if self._coded:  # a valid body decodes to finite values
                self._out[offset : offset + count] = self.codec.decode(memoryview(body)[HEADER_SIZE:], count)
                seen[k] = True
                ag.weight_received += weight
            elif np.isfinite(np.frombuffer(body, F32_DTYPE, count, HEADER_SIZE)).all():
                seen[k] = True
                self._out_bytes[4 * offset : 4 * (offset + count)] = memoryview(body)[HEADER_SIZE:]
                ag.weight_received += weight
            else:  # a broken or hostile owner: this range keeps the own values (counts as arrived)
                seen[k] = True
                self._refused["nonfinite"] += 1
                if not self._inplace:
                    self._out[offset : offset + count] = self._vec[offset : offset + count]
            if ag.note_data(sender, k, now):
                self.phase_changes += 1
        else:
            start = self.layout.shard(sender)[0]
            if offset != start:
                raise WireError("malformed", f"END offset {offset}, shard {sender} starts at {start}")
            if ag.end_seen[sender]:
                self._ends_ignored += 1
                return Outcome.DUPLICATE
            if ag.ended_at is not None:
                return self._late(mtype)
            ag.note_end(sender, now)
            if ag.ending:
                self.phase_changes += 1
        if ag.open == 0 and self._rs.ended_at is not None:
            self._end_ag(now, COMPLETION)
        return Outcome.ACCEPTED

    def receive_block(self, sender: int, mtype: int, bodies: np.ndarray, now: float) -> tuple[int, int, int] | None:
        """Take many full-size DATA bodies of type ``mtype`` from ``sender`` at once (one GRO block):
        vectorized checks, one copy into place, O(1) Python. Returns (accepted, duplicates, late), or None
        when the block is not a clean run of this group's ranges; the caller then feeds it to ``receive``
        body by body, which finds and counts whatever is wrong."""
        if mtype != _RS_DATA and mtype != _AG_DATA:
            return None
        if type(sender) is not int or not 0 <= sender < self.n or sender == self.index or not self._live[sender]:
            return None  # (a removed sender's rows: ``receive`` counts them late one by one)
        per, coded = self._per, self._coded
        if self._take and bodies.shape[1] == HEADER_SIZE + 4 * per and _native_rows(bodies):
            taken = self._take_native(sender, mtype, bodies, now)
            if taken is not None:
                return taken
        if coded:
            rec = view_coded(bodies) if bodies.shape[1] == HEADER_SIZE + self._body_per else None
        else:
            rec = view_block(bodies)
            if rec is not None and rec.dtype["values"].shape != (per,):
                return None
        if rec is None:
            return None
        rows = len(rec)
        first = rec[0]
        w0 = float(first["weight"])
        if mtype == _RS_DATA:
            start, stop, phase, total = self._lo, self._hi, self._rs, self._nranges
            known = self._sender_weight[sender]
            if not (0.0 < w0 < math.inf) or (known is not None and known != w0):
                return None
            same = 19  # group, codec, total, offset (checked below), count and weight: all as in row 0
        else:
            start, stop = self.layout.shard(sender)
            phase, total = self._ag, self._ag.expected[sender]
            same = 15  # the weight is per range in the all-gather
        if (int(first["group"]) != self.group_id or int(first["codec"]) != self._cid or int(first["count"]) != per
                or int(first["total"]) != total):
            return None
        # Every row as row 0 but for the offset (bytes 9..13): natively a memcmp per row where the rows lie, else as
        # bytes (a fifth of numpy's ``==``, after a strided copy of each row's head).
        if rows > 1 and not _same_heads(bodies, 9, same):
            return None
        if mtype == _AG_DATA and not (
            np.isfinite(rec["weight"]).all() and (rec["weight"] >= 0).all()
            and (coded or _values_finite(bodies, 4 * per))
        ):
            return None  # body by body: ``receive`` finds the range that is not finite and keeps own values
        full = (stop - start) // per
        k0, r = divmod(int(first["offset"]) - start, per)
        consecutive = rows == 1 or rec["offset"].tobytes() == np.arange(  # as bytes: a third of numpy's ==
            first["offset"], first["offset"] + rows * per, per, dtype="<u4").tobytes()
        if consecutive:
            if r or k0 < 0 or k0 + rows > full:
                return None
            ks: np.ndarray | slice = slice(k0, k0 + rows)
            k_last = k0 + rows - 1
        else:
            rel = rec["offset"].astype(np.int64) - start
            ks = rel // per
            if (rel - ks * per).any() or ks[0] < 0 or ks.max() >= full or not (np.diff(ks) > 0).all():
                return None
            k_last = int(ks[-1])
        seen = self._rs_seen[sender] if mtype == _RS_DATA else self._ag_seen[sender]
        # Values are copied as bytes: in the packed records they sit at odd offsets, and numpy's
        # unaligned float32 copy is several times slower than a byte copy.
        values, weights = bodies[:, HEADER_SIZE:], rec["weight"]
        was = seen[ks]
        duplicates = int(np.count_nonzero(was))  # (count_nonzero: a tenth of .any()'s reduction machinery)
        accepted = rows - duplicates
        late = phase.ended_at is not None
        if duplicates and accepted and not late:
            fresh = ~was
            idx = np.arange(k0, k0 + rows) if isinstance(ks, slice) else ks
            ks, values, weights = idx[fresh], values[fresh], weights[fresh]
            k_last = int(ks[-1])
        decoded = None
        if coded and accepted and not late:  # decoded before anything changes: a bad row sends the block back
            decoded, ok = self.codec.decode_block(values, per)
            if not ok.all():
                return None  # body by body: ``receive`` counts exactly the malformed rows
        if duplicates:
            self._drops["duplicate"] += duplicates
        if late:  # as in ``receive``: a duplicate is a duplicate, the rest is late
            self._drops["late"] += accepted
            return 0, duplicates, accepted
        if not accepted:
            return 0, duplicates, 0
        seen[ks] = True
        if mtype == _RS_DATA:
            if known is None:
                self._check_weight(sender, w0)
            if decoded is not None:
                self._stage[sender, : full * per].reshape(full, per)[ks] = decoded
            elif self._stream:
                if isinstance(ks, slice):
                    self._add_rows(sender, bodies, np.arange(ks.start, ks.stop, dtype=np.int64), 4 * per)
                else:
                    self._add_rows(sender, bodies if len(ks) == rows else bodies[fresh], ks, 4 * per)
            elif not (isinstance(ks, slice) and _place(bodies, self._stage[sender], 4 * per * ks.start, 4 * per)):
                self._stage[sender, : full * per].view(np.uint8).reshape(full, 4 * per)[ks] = values
            phase.weight_received += w0 * accepted
        else:
            if decoded is not None:
                self._out[start : start + full * per].reshape(full, per)[ks] = decoded
            elif not (isinstance(ks, slice) and _place(bodies, self._out, 4 * (start + per * ks.start), 4 * per)):
                self._out[start : start + full * per].view(np.uint8).reshape(full, 4 * per)[ks] = values
            phase.weight_received += float(weights.sum(dtype=np.float64))
        self._noted_block(phase, sender, mtype, accepted, k_last, now)
        return accepted, duplicates, 0

    def _take_native(self, sender: int, mtype: int, bodies: np.ndarray, now: float) -> tuple[int, int, int] | None:
        """receive_block for a plain fp32 block in one native call (take.c take_rows): the run's checks, the seen
        bitmap, and the values into the sums or the result. None, with nothing changed, for a block it does not
        take (a late phase, a block that is not a clean run): receive_block's numpy path, the reference, then
        does, and counts what is wrong."""
        per, rows = self._per, len(bodies)
        status = self._take_status
        if len(status) < rows:
            status = self._take_status = np.empty(max(rows, 1024), dtype=np.uint8)
        if mtype == _RS_DATA:
            phase, known = self._rs, self._sender_weight[sender]
            if not self._stream or phase.ended_at is not None:
                return None
            lo = self._lo
            taken = _native.take_rows(bodies, bodies.strides[0], rows, 0, self.group_id, self._cid, per, self._nranges,
                                      lo, (self._hi - lo) // per, math.nan if known is None else known,
                                      self._max_weight, self._rs_seen[sender], self._acc, 0, self._acc_set,
                                      self._wsum_in, status)
        else:
            phase = self._ag
            if phase.ended_at is not None:
                return None
            start, stop = self.layout.shard(sender)
            taken = _native.take_rows(bodies, bodies.strides[0], rows, 1, self.group_id, self._cid, per,
                                      phase.expected[sender], start, (stop - start) // per, math.nan, 0.0,
                                      self._ag_seen[sender], self._out, start, self._acc_set, self._wsum_in, status)
        if taken is None:
            return None
        accepted, duplicates, k_last, w0, weights, odd = taken
        if duplicates:
            self._drops["duplicate"] += duplicates
        if not accepted:
            return 0, duplicates, 0
        if mtype == _RS_DATA:
            if known is None:
                self._check_weight(sender, w0)
            if odd:
                self._take_odd(sender, bodies, status[:rows])
            phase.weight_received += w0 * accepted
        else:
            phase.weight_received += weights
        self._noted_block(phase, sender, mtype, accepted, k_last, now)
        return accepted, duplicates, 0

    def _noted_block(self, phase: _Phase, sender: int, mtype: int, accepted: int, k_last: int, now: float) -> None:
        """A block's ``accepted`` new rows noted in their phase, which ends once every stream is complete."""
        if phase.note_block(sender, accepted, k_last, now):
            self.phase_changes += 1
        if phase.open == 0:
            if mtype == _RS_DATA:
                self._end_rs(now, COMPLETION)
            elif self._rs.ended_at is not None:
                self._end_ag(now, COMPLETION)

    def _take_odd(self, sender: int, bodies: np.ndarray, status: np.ndarray) -> None:
        """What take_rows did not add of a reduce-scatter block, as ``_add_rows`` counts it: rows refused for a NaN
        or inf (status 1), and rows whose float32 sum would overflow (2), kept aside for the float64 sum."""
        refused = int(np.count_nonzero(status == 1))
        if refused:
            self._refused["nonfinite"] += refused
        ws = min(self._sender_weight[sender], self._max_weight)  # type: ignore[type-var]
        length = 4 * self._per
        for i in np.flatnonzero(status == 2).tolist():
            k = (int.from_bytes(bodies[i, 9:13].tobytes(), "little") - self._lo) // self._per
            values = np.frombuffer(bytes(bodies[i, HEADER_SIZE : HEADER_SIZE + length]), F32_DTYPE)
            self._aside.setdefault(k, []).append((ws, values))

    def _check_weight(self, sender: int, weight: float) -> None:
        """A sender has one weight; a body that says otherwise is corrupt (it would skew the sums)."""
        known = self._sender_weight[sender]
        if known is None:
            self._sender_weight[sender] = weight
            if weight > self._max_weight:
                self._refused["weight_capped"] += 1
        elif known != weight:
            raise WireError("malformed", f"sender {sender} changed its weight from {known} to {weight}")

    def _add_rows(self, sender: int, bodies: np.ndarray, ks: np.ndarray, length: int) -> None:
        """Streaming: add ``sender``'s reduce-scatter rows for ranges ``ks`` into the sums. A row with NaN or inf is
        refused (as if lost); one whose float32 sum would overflow is kept for the float64 sum at finalizing."""
        ws = min(self._sender_weight[sender], self._max_weight)  # type: ignore[type-var]
        ks = np.ascontiguousarray(ks, dtype=np.int64)
        status = _accumulate(bodies, length, self._acc, self._per, ks, self._acc_set, ws)
        if np.count_nonzero(status):
            refused = int(np.count_nonzero(status == 1))
            if refused:
                self._refused["nonfinite"] += refused
            for i in np.flatnonzero(status == 2):
                values = np.frombuffer(bytes(bodies[i, HEADER_SIZE : HEADER_SIZE + length]), F32_DTYPE)
                self._aside.setdefault(int(ks[i]), []).append((ws, values))
            ks = ks[status != 1]
        self._wsum_in[ks] += ws

    def _late(self, mtype: int) -> Outcome:
        if mtype in (BodyType.RS_END, BodyType.AG_END):
            self._ends_ignored += 1  # the repeats of a stream's END routinely outlive its phase
        else:
            self._drops["late"] += 1
        return Outcome.LATE

    # ---- sending -----------------------------------------------------------------------------------

    def next_blocks(self, rows: int, limit: int) -> list[OutBlock]:
        """Blocks of at most ``rows`` bodies each, about ``limit`` bodies in all, reduce-scatter first, then
        (once this member's reduce-scatter phase has ended) the all-gather. An empty list means nothing to
        send until something changes."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if self._coded:
            rows = min(rows, max(1, CODED_BLOCK_ELEMENTS // self._per))
            limit = min(limit, max(1, CODED_BATCH_ELEMENTS // self._per))
        self._block_rows = rows
        batch: list[OutBlock] = []
        count = 0
        while count < limit:
            if self._gen is None:
                if self._ag_started or self._rs.ended_at is None:
                    break
                self._ag_started = True
                self._gen = self._ag_blocks()
            block = next(self._gen, _DONE)
            if block is _DONE:
                self._gen = None
                continue
            if block is None:  # a slice of work with nothing to send (robust norms): the driver's turn
                break
            batch.append(block)
            count += len(block.bodies)
        return batch

    def next_datagrams(self, limit: int) -> list[Outgoing]:
        """``next_blocks`` one body at a time, for drivers (and tests) that send datagram by datagram."""
        batch: list[Outgoing] = []
        while len(batch) < limit:
            if not self._left:
                blocks = self.next_blocks(self._block_rows, 1)
                if not blocks:
                    break
                for b in blocks:
                    self._left.extend(Outgoing(b.to, b.type, bytes(row), b.repeat) for row in b.whole())
            take = min(limit - len(batch), len(self._left))
            batch.extend(self._left[:take])
            del self._left[:take]
        return batch

    def _dest_order(self) -> list[int]:
        """The other members, starting after this one (i + 1, i + 2, ... mod n). The driver sends one part per
        destination in turn, so member i's k-th part goes to i + k: at any moment every member receives one
        sender's part, not several (in index order all senders began with member 0, then all but one moved
        to 2, and the lab's 4 peers met queues of ~9 ms at the downlinks that two or three senders shared)."""
        n, i = self.n, self.index
        return [(i + d) % n for d in range(1, n)]

    def _rs_blocks(self) -> Iterator[OutBlock]:
        """Round-robin over destinations a block at a time, so every owner sees a steady stream."""
        layout, per, group, w = self.layout, self.layout.per, self.group_id, self.weight
        vec = self._vec
        dests = self._dest_order()
        plan = {j: (*layout.shard(j), layout.datagrams(j)) for j in dests}
        rs, live, cid = self._rs, self._live, self._cid
        top = max((p[2] for p in plan.values()), default=-1)
        k = 0
        while k <= top:
            rows = self._block_rows
            for j in dests:
                start, stop, total = plan[j]
                if k > total or not live[j]:
                    continue
                full = (stop - start) // per
                k1 = min(k + rows, full)
                pieces = []
                if k < k1:
                    off = start + k * per
                    pieces.append((off, vec[off : start + k1 * per].reshape(k1 - k, per)))
                if full < total and k <= full < k + rows:  # the shard's short last range
                    off = start + full * per
                    pieces.append((off, vec[off:stop].reshape(1, -1)))
                for off, values in pieces:
                    if self._coded:
                        bodies = self._pack_coded(total, off, w, values, self._rs_key)
                    elif self.split_values:
                        rs.sent += len(values)
                        yield OutBlock(j, _RS_DATA, _heads(group, total, off, w, values.shape), 1, values)
                        continue
                    else:
                        bodies = pack_block(group, total, off, w, values)
                    if len(bodies):
                        rs.sent += len(bodies)
                        yield OutBlock(j, _RS_DATA, bodies, 1)
                if k <= total < k + rows:
                    yield OutBlock(j, _RS_END, _row(pack_end(group, total, start, w, cid)), END_REPEATS)
            k += rows

    def _encode(self, values: np.ndarray, key: RoundingKey, offset: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Codec bodies of ``values`` (rows of equal ranges from element ``offset``), and None, or when some row
        cannot be encoded (a value beyond the codec's range, or not finite: a local ValueError, never the
        network's), a mask of the rows that could; the others are zero and counted ``unencodable``."""
        codec = self.codec
        try:
            return codec.encode_block(values, key=key, offset=offset), None
        except ValueError:
            pass
        rows, count = values.shape
        out = np.zeros((rows, codec.body_size(count)), dtype=np.uint8)
        ok = np.ones(rows, dtype=bool)
        for i in range(rows):
            try:
                out[i] = codec.encode_block(values[i : i + 1], key=key, offset=offset + i * count)[0]
            except ValueError:
                ok[i] = False
        self._refused["unencodable"] += int(np.count_nonzero(~ok))
        return out, ok

    def _pack_coded(self, total: int, offset: int, weight: float | np.ndarray, values: np.ndarray,
                    key: RoundingKey) -> np.ndarray:
        """Reduce-scatter DATA bodies of a compressed codec; rows that cannot be encoded are left out."""
        count = values.shape[1]
        bodies, ok = self._encode(values, key, offset)
        block = pack_coded(self.group_id, self._cid, total, offset, count, weight, bodies)
        return block if ok is None else block[ok]

    def _ag_blocks(self) -> Iterator[OutBlock | None]:
        """The averaged own shard to every other member; each block is built once and sent to all. With
        ``robust``, the contributions' norms are measured first, a slice per step (None: no block yet)."""
        while self._robust is not None and not self._robust_step():
            yield None
        per, group, total = self.layout.per, self.group_id, self._nranges
        lo, hi = self._lo, self._hi
        full = (hi - lo) // per
        out = self._out
        dests = self._dest_order()
        ahead = max(1, FINALIZE_BLOCK_ELEMENTS // per)
        ag, live = self._ag, self._live
        k = 0
        while k < total:
            k1 = min(k + self._block_rows, full) if k < full else total
            if self._finalized < k1:
                self._finalize_through(min(total, max(k1, k + ahead)))
            weights = np.minimum(self._wsum[k:k1], _F32_MAX)
            off = lo + k * per
            if self._coded:  # the bodies encoded when these ranges were finalized
                coded = self._ag_full[k:k1] if k < full else self._ag_tail
                assert coded is not None
                bodies = pack_coded(group, self._cid, total, off, per if k < full else hi - off, weights, coded)
                sendable = self._ag_sendable[k:k1]
                if not sendable.all():
                    bodies = bodies[sendable]
            else:
                values = out[off : min(hi, lo + k1 * per)].reshape(k1 - k, -1)
                if self.split_values:
                    heads = _heads(group, total, off, weights, values.shape)
                    for j in dests:
                        if live[j]:
                            ag.sent += len(heads)
                            yield OutBlock(j, _AG_DATA, heads, 1, values)
                    k = k1
                    continue
                bodies = pack_block(group, total, off, weights, values)
            if len(bodies):
                for j in dests:
                    if live[j]:
                        ag.sent += len(bodies)
                        yield OutBlock(j, _AG_DATA, bodies, 1)
            k = k1
        end = _row(pack_end(group, total, lo, 0.0, self._cid))
        for j in dests:
            if live[j]:
                yield OutBlock(j, _AG_END, end, END_REPEATS)

    # ---- the result --------------------------------------------------------------------------------

    def _pieces(self, k_start: int, k_end: int) -> Iterator[tuple[int, int, int, int, int]]:
        """Ranges [k_start, k_end) of the own shard as (k0, k1, lo, hi, width) pieces of equal-width ranges,
        at most about FINALIZE_BLOCK_ELEMENTS elements each (the short last range is a piece of its own)."""
        per = self.layout.per
        step = max(1, FINALIZE_BLOCK_ELEMENTS // per)
        k0 = k_start
        while k0 < k_end:
            k1 = min(k_end, k0 + step)
            lo = self._lo + k0 * per
            hi = min(self._lo + k1 * per, self._hi)
            full = (hi - lo) // per
            if full:
                yield k0, k0 + full, lo, lo + full * per, per
            if k0 + full < k1:  # the shard's short last range
                yield k1 - 1, k1, lo + full * per, hi, hi - lo - full * per
            k0 = k1

    def _finalize_through(self, k_end: int) -> None:
        """Turn ranges [finalized, k_end) of the own shard from weighted sums into averages."""
        while self._robust is not None and not self._robust_step():
            pass
        step = max(1, FINALIZE_BLOCK_ELEMENTS // self.layout.per)
        while self._finalized < k_end:
            k1 = min(k_end, self._finalized + step)
            for piece in self._pieces(self._finalized, k1):
                self._finalize_rows(*piece)
                if self._coded:
                    self._encode_ag(*piece)
            self._finalized = k1

    def _encode_ag(self, k0: int, k1: int, lo: int, hi: int, width: int) -> None:
        """Encode finalized ranges [k0, k1) for the all-gather and keep, as this owner's own result, exactly
        what its bodies decode to (every replica then holds the same bits). A range that cannot be encoded is
        not sent; the owner keeps its float32 average there and the others their own values, as if lost."""
        out2d = self._out[lo:hi].reshape(k1 - k0, width)
        bodies, ok = self._encode(out2d, self._ag_key, lo)
        decoded, valid = self.codec.decode_block(bodies, width)
        if ok is not None:
            valid &= ok
            self._ag_sendable[k0:k1] = ok
        out2d[valid] = decoded[valid]
        if width == self._per:
            self._ag_full[k0:k1] = bodies
        else:
            self._ag_tail = bodies

    def _finalize_rows(self, k0: int, k1: int, lo: int, hi: int, width: int) -> None:
        """Ranges [k0, k1) (elements [lo, hi), ``width`` each): own * weight plus each sender's staged values
        times its (capped) weight where they arrived, divided by the weight that arrived. A range nothing
        arrived for keeps the own value exactly.

        With ``robust``, each member's contribution is scaled by its factor (around the center, if any).
        Fast path: a float32 sum, checked with one numpy call; if it is not finite (a sender's NaN or inf,
        or an overflow), ``_finalize_careful`` refuses the non-finite ranges and sums again in float64."""
        if self._stream:
            self._finalize_stream(k0, k1, lo, hi, width)
            return
        rows = k1 - k0
        own = self._vec[lo:hi].reshape(rows, width)
        out2d = self._out[lo:hi].reshape(rows, width)
        seen = self._rs_seen[:, k0:k1]
        if self._solo and seen.any():
            self._refused["solo"] += int(np.count_nonzero(seen.any(axis=0)))
            seen = np.zeros_like(seen)
        if not seen.any():
            if not self._inplace:
                out2d[...] = own
            return
        arrived = seen.any(axis=0)
        scale = self._scale
        own_w = min(self.weight, self._wcap)
        wsum = np.full(rows, own_w, dtype=np.float64)
        base = lo - self._lo
        center = None
        if self._center is not None:
            center = self._center[base : base + rows * width].reshape(rows, width)
        with np.errstate(all="ignore"):  # overflow and NaN are found below, in one call
            acc = own - center if center is not None else own.copy()
            acc *= np.float32(own_w * (scale[self.index] if scale is not None else 1.0))
            for s in range(self.n):
                mask = seen[s]
                if s == self.index or not mask.any():
                    continue
                ws = min(self._sender_weight[s], self._wcap)  # type: ignore[type-var]
                factor = np.float32(ws * (scale[s] if scale is not None else 1.0))
                staged = self._stage[s, base : base + rows * width].reshape(rows, width)
                term = (staged - center) * factor if center is not None else staged * factor
                if not mask.all():  # whole rows zeroed, then one add: half the time of a masked gather and add
                    term[~mask] = 0.0
                acc += term
                wsum += mask * ws
        if not np.isfinite(acc).all():
            self._finalize_careful(k0, k1, lo, width, own, out2d)
            return
        self._wsum[k0:k1] = wsum
        np.divide(acc, wsum.astype(np.float32)[:, None], out=acc)
        if center is not None:
            acc += center
        if not arrived.all():
            acc[~arrived] = own[~arrived]
        out2d[...] = acc

    def _finalize_stream(self, k0: int, k1: int, lo: int, hi: int, width: int) -> None:
        """``_finalize_rows`` from the running sums: own * weight plus the senders' sum, divided by the weight that
        arrived; in float64 where that overflows float32 or a range has rows kept aside (their sum would have)."""
        rows = k1 - k0
        own = self._vec[lo:hi].reshape(rows, width)
        out2d = self._out[lo:hi].reshape(rows, width)
        got = self._wsum_in[k0:k1]
        arrived = got > 0
        if not arrived.any():
            if not self._inplace:
                out2d[...] = own
            return
        base = lo - self._lo
        acc = self._acc[base : base + rows * width].reshape(rows, width)
        wsum = got + self.weight
        aside = [k for k in self._aside if k0 <= k < k1] if self._aside else []
        if not aside and _finalize_native(own, acc, self._acc_set[k0:k1], got, self.weight, out2d):
            self._wsum[k0:k1] = wsum
            return
        res = None if aside else _finalize_f32(own, acc, self._acc_set[k0:k1], got, self.weight)
        if res is None:
            summed = self._acc_set[k0:k1] != 0
            wide = own.astype(np.float64) * self.weight
            wide[summed] += acc[summed]
            for k in aside:
                for ws, values in self._aside.pop(k):  # (each range is finalized once)
                    wide[k - k0] += values.astype(np.float64) * ws
            wide /= wsum[:, None]
            res = wide.astype(F32_DTYPE)
            if not arrived.all():
                res[~arrived] = own[~arrived]
        self._wsum[k0:k1] = wsum
        out2d[...] = res

    def _finalize_careful(self, k0: int, k1: int, lo: int, width: int, own: np.ndarray, out2d: np.ndarray) -> None:
        """``_finalize_rows`` in float64, where capped weights times finite float32 values cannot overflow:
        ranges holding NaN or inf are refused (as if lost), and with ``robust`` each member's contribution
        is scaled by its factor (around the center, if any). The result is a convex combination of finite
        float32 values (and the center), so it is finite whenever the own values are."""
        rows = k1 - k0
        base = lo - self._lo
        scale = self._scale
        seen = self._rs_seen[:, k0:k1]  # a view: refused ranges are cleared in place (as if lost)
        center = None
        if self._center is not None:
            center = self._center[base : base + rows * width].reshape(rows, width).astype(np.float64)
        acc = own.astype(np.float64)
        if center is not None:
            acc -= center
        own_w = min(self.weight, self._wcap)
        acc *= own_w * (scale[self.index] if scale is not None else 1.0)
        wsum = np.full(rows, own_w, dtype=np.float64)
        for s in range(self.n):
            mask = seen[s]
            if s == self.index or not mask.any():
                continue
            staged = self._stage[s, base : base + rows * width].reshape(rows, width)
            if scale is None:  # (robust: ``_robust_step`` has refused them already)
                with np.errstate(invalid="ignore"):  # unused rows of the stage hold anything
                    bad = mask & ~np.isfinite(staged).all(axis=1)
                if bad.any():
                    self._refused["nonfinite"] += int(np.count_nonzero(bad))
                    mask &= ~bad
                    if not mask.any():
                        continue
            ws = min(self._sender_weight[s], self._wcap)  # type: ignore[type-var]
            factor = ws * (scale[s] if scale is not None else 1.0)
            x = staged.astype(np.float64) if mask.all() else staged[mask].astype(np.float64)
            if center is not None:
                x -= center if mask.all() else center[mask]
            x *= factor
            if mask.all():
                acc += x
            else:
                acc[mask] += x
            wsum += mask * ws
        self._wsum[k0:k1] = wsum
        acc /= wsum[:, None]
        if center is not None:
            acc += center
        result = acc.astype(F32_DTYPE)
        arrived = seen.any(axis=0)
        if not arrived.all():
            result[~arrived] = own[~arrived]
        out2d[...] = result

    def _robust_step(self) -> bool:
        """Measure the next slice of the contributions' norms (robust); True once the factors are known.

        Per member (the own contribution included): the sum of squares of its finite ranges (minus the
        center, if any) and how many elements they hold; a range holding NaN or inf is refused here. Then
        the RMS per element delivered (so a member that lost datagrams is neither favoured nor penalized),
        the median over the members that delivered anything, and each member's factor min(1, C * median /
        its RMS). The same members' weights (each capped at max_weight) give the weight bound: WEIGHT_BOUND
        times their median, so that no claimed weight multiplies a clipped contribution past it."""
        assert self._robust is not None
        if self._scale is not None:
            return True
        if self._norm_pos < self._nranges:
            k_end = min(self._nranges, self._norm_pos + max(1, FINALIZE_BLOCK_ELEMENTS // self.layout.per))
            for k0, k1, lo, _hi, width in self._pieces(self._norm_pos, k_end):
                self._measure(k0, k1, lo, width)
            self._norm_pos = k_end
            return False
        rms = [math.sqrt(self._sumsq[s] / self._elements[s]) if self._elements[s] else math.nan
               for s in range(self.n)]
        heard = [r for r in rms if math.isfinite(r)]
        weights = sorted(min(self.weight if s == self.index else self._sender_weight[s], self._max_weight)
                         for s in range(self.n) if self._elements[s] and (s == self.index or
                                                                          self._sender_weight[s] is not None))
        if weights:
            bound = WEIGHT_BOUND * float(np.median(weights))
            if bound < self._wcap:
                self._wcap = bound
                over = sum(w > bound for w in weights)
                if over:
                    self._refused["weight_bounded"] += over
        scale = [1.0] * self.n
        if heard:
            med = float(np.median(heard))
            limit = self._robust.c * med
            for s, r in enumerate(rms):
                if math.isfinite(r) and r > limit:
                    scale[s] = limit / r
                    self._refused["clipped"] += 1
        self._scale = scale
        return True

    def _measure(self, k0: int, k1: int, lo: int, width: int) -> None:
        """Add ranges [k0, k1) to each member's sum of squares: in float32 (one einsum per member), rows
        that overflowed again in float64 (finite float32 values cannot overflow there), and rows still not
        finite (NaN or inf in the values) refused."""
        rows = k1 - k0
        base = lo - self._lo
        seen = self._rs_seen[:, k0:k1]
        center = None
        if self._center is not None:
            center = self._center[base : base + rows * width].reshape(rows, width)
        for s in range(self.n):
            if s == self.index:
                x = self._vec[lo : lo + rows * width].reshape(rows, width)
                mask = None
            else:
                mask = seen[s]
                if not mask.any():
                    continue
                staged = self._stage[s, base : base + rows * width].reshape(rows, width)
                x = staged if mask.all() else staged[mask]
                mask = None if mask.all() else mask
            c = None if center is None else (center if mask is None else center[mask])
            with np.errstate(all="ignore"):
                d = x - c if c is not None else x
                ss = np.einsum("ij,ij->i", d, d).astype(np.float64)
                ok = np.isfinite(ss)
                if not ok.all():  # overflowed in float32, or NaN / inf: float64 tells which
                    redo = x[~ok].astype(np.float64)
                    if c is not None:
                        redo -= c[~ok]
                    ss[~ok] = np.einsum("ij,ij->i", redo, redo)
                    ok = np.isfinite(ss)
            if s != self.index and not ok.all():
                rows_of = np.flatnonzero(seen[s])  # the rows x holds, in order
                bad = rows_of[~ok]
                self._refused["nonfinite"] += len(bad)
                seen[s, bad] = False  # a view of _rs_seen: refused as if lost
            self._sumsq[s] += float(ss[ok].sum())
            self._elements[s] += int(np.count_nonzero(ok)) * width

    def _fill_missing(self) -> None:
        """Ranges of other shards whose all-gather never arrived keep this member's own values."""
        per = self.layout.per
        for j in range(self.n):
            if j == self.index:
                continue
            seen = self._ag_seen[j]
            if seen.all():
                continue
            lo, hi = self.layout.shard(j)
            if not seen.any():
                self._out[lo:hi] = self._vec[lo:hi]
                continue
            full = (hi - lo) // per
            rows = ~seen[:full]
            mid = lo + full * per
            self._out[lo:mid].reshape(-1, per)[rows] = self._vec[lo:mid].reshape(-1, per)[rows]
            if full < len(seen) and not seen[full]:
                self._out[mid:hi] = self._vec[mid:hi]

    def result(self) -> np.ndarray:
        """The averaged vector (``out``). Do not modify it until ``finished``: the all-gather reads from it."""
        if not self.result_ready:
            raise RuntimeError("the group's receive phases have not ended yet")
        self._finalize_through(self._nranges)
        if not self._filled:
            self._fill_missing()
            self._filled = True
        return self._out

    # ---- statistics --------------------------------------------------------------------------------

    def received_per_sender(self, phase: int) -> list[tuple[int, int]]:
        """(expected, received) data datagrams per sender in phase 0 (reduce-scatter) or 1 (all-gather)."""
        ph = self._rs if phase == 0 else self._ag
        return list(zip(ph.expected, ph.received, strict=True))

    def progress(self, phase: int) -> tuple[list[int], list[int], list[int], list[float], list[float]]:
        """Per sender in phase 0 or 1: (expected, received, top, first and last arrival times), where top is one past
        the highest datagram index that arrived. Streams go out in index order, so ``top`` is how far the
        sender has got, as far as this receiver can tell; a driver samples these on a timer to report
        delivery to the sender (transport.pacing.DeliveryMeter). The lists are live: do not modify them."""
        ph = self._rs if phase == 0 else self._ag
        return ph.expected, ph.received, ph.top, ph.first_at, ph.last_at

    def phase_state(self, phase: int) -> tuple[float | None, float | None]:
        """(started_at, ended_at) of receive phase 0 or 1 (None: not yet)."""
        ph = self._rs if phase == 0 else self._ag
        return ph.t0, ph.ended_at

    def statistics(self) -> GroupStats:
        own = self.weight
        heard = [w for s, w in enumerate(self._sender_weight) if w is not None and s != self.index]
        rs_expected = self._nranges * (own + sum(heard))
        rs_received = self._nranges * own + self._rs.weight_received
        ag_expected = sum(self._ag.expected) * (own + sum(heard))
        return GroupStats(
            group_id=self.group_id,
            n=self.n,
            index=self.index,
            reduce_scatter=self._rs.snapshot(rs_expected, rs_received, self._live, self.index),
            all_gather=self._ag.snapshot(ag_expected, self._ag.weight_received, self._live, self.index),
            drops=dict(self._drops),
            ends_ignored=self._ends_ignored,
            refused=dict(self._refused),
            weight_total=min(own, self._wcap) + sum(min(w, self._wcap) for w in heard),
        )
