"""One group's averaging over lossy datagrams: the sans-I/O state machine (protocol/allreduce.md).

Its parts, by phase: ``intake`` (what arrives), ``outbox`` (what to send next), ``finalize`` (sums into averages,
the result), ``phase`` (the states and their transition tables, the per-stream bookkeeping), ``kernels`` (numpy
and native array work).

The driver feeds it bodies (``receive``) and timer ticks (``handle_timer``) with an injected ``now``, sends
what ``datagrams_to_send`` hands out, and sleeps until ``get_timer()``. Nothing here blocks, reads a clock
or touches a socket, so the simulator and the tests run it in virtual time with exact loss patterns.

A driver's loop, in outline::

    core = GroupAverage(group_id, n, index, vector, weight, now)
    while not core.finished:
        while core.wants_to_send:                      # ~1 ms of work per batch; yield between batches
            for o in core.datagrams_to_send(now, 64):
                send(o.to, o.type, o.body, times=o.repeat)   # END bodies: o.repeat == 3
        wait for a datagram or until core.get_timer()
        on a datagram: core.receive(member index of its sender, type, body, now)  # WireError: count, drop
        on the deadline: core.handle_timer(now)
    averaged = core.result()

Cost model (so a trio driver can cut work into ~1 ms slices): ``receive`` is O(1) Python plus O(datagram)
numpy; ``datagrams_to_send(now, limit)`` does at most ``limit`` datagrams of work (plus the division of one block of
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
* ``opposed`` (``robust`` clip only): a member whose contribution, clipped and at its bounded weight, points
  against the sum of the others' (3 or more members) is left out of this shard's average.
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

import math
from collections import Counter
from collections.abc import Iterator

import numpy as np

from ..compress import PHASE_AG, PHASE_RS, RoundingKey
from ..compress.floats import Float32Codec
from . import kernels
from .finalize import Finalize
from .frames import F32_DTYPE
from .intake import Intake, Outcome
from .kernels import stage_elements
from .options import DEFAULT_MAX_WEIGHT, AverageOptions, check_max_weight
from .outbox import DEFAULT_BLOCK_ROWS, OutBlock, Outbox, Outgoing
from .phase import (
    COMPLETION,
    DEADLINE,
    IN_ORDER_GRACE_S,
    TAIL_DATAGRAMS,
    TRANSITIONS,
    Event,
    GroupStats,
    Phase,
    PhaseStats,
    Sending,
    State,
    advance,
)
from .repair import SERVE_S, Repair
from .robust import WEIGHT_BOUND, segment_ends
from .shards import Layout, elements_per_datagram

__all__ = [  # the core's public names, wherever in the package they are defined
    "COMPLETION", "DEADLINE", "DEFAULT_FLOOR_S", "DEFAULT_MAX_PAYLOAD", "DEFAULT_MAX_WEIGHT", "DEFAULT_SAFETY",
    "FP32_CODEC", "GROUP_OPTIONS", "IN_ORDER_GRACE_S", "GroupAverage", "GroupStats", "OutBlock", "Outcome",
    "Outgoing", "PhaseStats", "State", "stage_elements",
]

DEFAULT_MAX_PAYLOAD = 1200 - 37  # default datagram payload minus envelope (21) and AEAD tag (16)
DEFAULT_FLOOR_S = 1.0
DEFAULT_SAFETY = 2.0
LATE_START_FLOORS = 3.0  # a live member not heard from yet holds a phase at most this many floors past its start
FP32_CODEC = Float32Codec()  # the default body codec (values travel as their own float32 bytes)
# The core's own defaults: no cap on a phase's deadline, no grace after an END that overtook data and no repair of
# lost all-gather ranges (a daemon's
# averages run with AverageOptions()'s).
GROUP_OPTIONS = AverageOptions(floor_s=DEFAULT_FLOOR_S, max_phase_s=None, end_grace_s=0.0, repair_rounds=0)


class GroupAverage(Intake, Outbox, Finalize, Repair):
    """Member ``index`` of ``n`` averaging ``vector`` (weight = its sample count) in group ``group_id``.

    Reduce-scatter: shard j of the vector goes to member j; this member keeps, per datagram range of its
    own shard, the weighted sum and the total weight that arrived (its own always counts), and the
    range's average is sum / weight. All-gather: it sends its averaged shard to every other member and
    writes the averaged shards it receives into the result; a range that never arrives keeps this
    member's own value.

    ``out`` receives the result (a new array by default). ``out=vector`` averages in place: safe, because
    this member never sends its own shard, and an owner's all-gather only overwrites a range once that owner
    has stopped accepting this member's reduce-scatter data for it (it arrived, or data this member sent
    after it did).

    All members of a group must use the same ``max_payload``: the ranges are derived from it, and a body
    whose range does not match this member's layout is malformed.

    ``options`` (AverageOptions, checked where it is made; GROUP_OPTIONS by default) say how the average runs:
    the phase deadline's floor and cap, the END grace, and the following. ``absent`` members are removed at
    once (``remove_member``).

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
        options: AverageOptions = GROUP_OPTIONS,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        safety: float = DEFAULT_SAFETY,
        out: np.ndarray | None = None,
        center: np.ndarray | None = None,
        stage: np.ndarray | None = None,
    ) -> None:
        if not isinstance(options, AverageOptions):
            raise ValueError(f"options must be an AverageOptions, got {options!r}")
        self.options = options
        floor_s, max_phase_s, robust, codec = options.floor_s, options.max_phase_s, options.robust, options.codec
        if robust is not None and robust.mode == "clip" and min(robust.c, WEIGHT_BOUND) >= 2 and n == 2:
            # Of two members the median is their mean, so each norm and weight is at most twice it: neither bound
            # can bind, and the direction test needs three. Without the step the all-gather overlaps the
            # reduce-scatter instead of waiting for every contribution (the same result, sooner).
            robust = None
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
        cap = check_max_weight(options.max_weight)  # (None: the default cap)
        refused: Counter[str] = Counter()
        if w > cap:
            refused["weight_capped"] += 1
            w32 = np.float32(cap)
        if not (math.isfinite(safety) and safety > 0):
            raise ValueError(f"safety must be finite and > 0, got {safety!r}")
        if codec is None:
            codec = FP32_CODEC
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
        if options.shares is not None and len(options.shares) != n:
            raise ValueError(f"shares must hold one int per member ({n}), got {len(options.shares)}")
        self.layout = Layout(len(vec), n, elements_per_datagram(max_payload, codec), options.shares)
        self.weight = float(w32)  # what travels, so every member uses the same value for it
        self.floor_s = float(floor_s)
        self.owner_lag_s = self.floor_s if options.owner_lag_s is None else float(options.owner_lag_s)
        self.safety = float(safety)
        self.max_phase_s = max_phase_s
        self._vec = vec
        self._out = out
        self._max_weight = cap
        # the cap in force at finalizing: max_weight, lowered with ``robust`` to WEIGHT_BOUND times the median
        # weight once every contribution is in (``_robust_step``)
        self._wcap = cap
        self._robust = robust
        self._solo = options.solo
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
        # robust: per member, the factor (<= 1) its contribution is scaled by in the segment being finalized
        # (``segment_ends``; the whole shard by default); None until computed, once every contribution to the
        # segment is in, by ``_robust_step`` a slice at a time
        self._scale: list[float] | None = None
        self._norm_pos = 0  # ranges of the own shard whose norms are summed so far
        self._sumsq = [0.0] * n
        self._elements = [0] * n
        self._gram = np.zeros((n, n))  # robust: every pair of members' dot product over the own shard
        # members left out of the own shard: the caller's ``exclude``, and (robust) those pointing against the others
        self._preset = frozenset(a for a in options.exclude if a < n and a != index)
        self._excluded: frozenset[int] = self._preset
        self._cosines: dict[int, float] = {}  # (robust clip) each member's cosine with the others, as tested
        self._opposed_all: frozenset[int] = frozenset()  # (robust) members left out of an earlier segment
        self._counted: set[tuple[str, int]] = set()  # (robust) (reason, member) already counted in ``refused``
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
        self._stage = kernels.stage_rows(stage, n, self._hi - self._lo)
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
        self._rs_key = RoundingKey(options.run, group_id, index, PHASE_RS)
        self._ag_key = RoundingKey(options.run, group_id, index, PHASE_AG)
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
        self._stream = (not self._coded and robust is None and not options.solo and not options.exclude
                        and kernels.native is not None)
        self._acc = self._stage_buffer[: self._hi - self._lo]
        self._acc_set = np.zeros(self._nranges, dtype=np.uint8)
        self._wsum_in = np.zeros(self._nranges, dtype=np.float64)
        self._aside: dict[int, list[tuple[float, np.ndarray]]] = {}
        self._ag_seen = [np.zeros(self.layout.datagrams(j) if j != index else 0, dtype=bool) for j in range(n)]
        self._ag_kept = 0  # all-gather ranges that arrived non-finite and keep this member's own values
        self._sender_weight: list[float | None] = [None] * n
        # take.c take_rows takes plain fp32 blocks in one call (receive_block): where the buffers it writes are
        # aligned float32 (a caller's ``out`` need not be), and a reduce-scatter only where sums stream
        self._take = (kernels.native is not None and not self._coded and self._out.dtype == F32_DTYPE
                      and self._out.flags.c_contiguous and self._out.flags.writeable and self._out.flags.aligned
                      and self._acc.flags.aligned)
        self._take_status = np.empty(0, dtype=np.uint8)
        # take.c take_coded takes int8 and int4 blocks in one call: decoded into the sender's stage row (the
        # reduce-scatter) or the result (the all-gather), where those are aligned float32
        bits = getattr(codec, "bits", None)
        self._take_bits = (bits if kernels.native is not None and self._coded and bits in (8, 4)
                           and self._out.dtype == F32_DTYPE and self._out.flags.c_contiguous
                           and self._out.flags.writeable and self._out.flags.aligned and self._stage.flags.aligned
                           else 0)
        self._live = [True] * n
        self._dead: set[int] = set()  # members given up on as dead (``give_up``)
        self._drops: Counter[str] = Counter()
        self._ends_ignored = 0
        self._finalized = 0  # ranges of the own shard already divided into their average
        self._filled = self._inplace
        self._rs = Phase([self._nranges if s != index else 0 for s in range(n)], index, now)
        self._ag = Phase([self.layout.datagrams(j) if j != index else 0 for j in range(n)], index, None)
        self._rs.grace = self._ag.grace = float(options.end_grace_s)
        self.state = State.REDUCE_SCATTER  # receiving (phase.TRANSITIONS)
        self.sending = Sending.REDUCE_SCATTER  # sending (phase.SEND_TRANSITIONS)
        self._rs_gen: Iterator[OutBlock] | None = self._rs_blocks()  # the contributions' blocks (None: all out)
        # the average's blocks: started once a range of the own shard is final (None: not yet; EXHAUSTED: all out)
        self._ag_gen: Iterator[OutBlock | None] | object | None = None
        # With ``overlap`` a range of the own shard is final, and its average goes out, as soon as every other
        # member's datagram for it arrived or is known lost (``ag_frontier``): the all-gather overlaps the
        # reduce-scatter instead of waiting for its end. Robust aggregation needs every contribution to what it
        # decides: the whole shard (no overlap), or its head earlier where ``segment_ends`` allows.
        self._seg_ends = [self._nranges]
        if robust is not None and options.segments and self._center is None and not (options.solo or options.prior):
            self._seg_ends = segment_ends(self._nranges, self._hi - self._lo, robust)
        self._seg = 0  # the segment whose robust decision is measured or in force
        self._early = options.overlap and (robust is None or len(self._seg_ends) > 1)
        self._ag_next = 0  # the first range of the own shard the all-gather has not handed out
        self._ag_woken = False  # a wake-up for final ranges is pending (``note_ready``)
        self._contig = [0] * n  # per sender: ranges below it all arrived or final (where its stream has a gap)
        self._gap_at: list[tuple[int, float] | None] = [None] * n  # per sender: its first gap, when first seen
        self._block_rows = DEFAULT_BLOCK_ROWS
        self._contributed = False  # the driver said its reduce-scatter blocks are all on the wire (``note_sent``)
        self._init_repair(options.repair_rounds, max_payload)
        self._left: list[Outgoing] = []  # rows of a block ``datagrams_to_send`` has not handed out yet
        # Counts phase ends, deadlines brought forward (an END that overtook data starts a short grace) and ranges
        # of the own shard that became final while nothing else was left to send: a driver compares it before and
        # after ``receive`` (cheaper than reading ``finished``, ``wants_to_send`` and ``get_timer``) to know when to
        # wake up, re-read the timer and send again.
        self.phase_changes = 0
        for a in sorted(set(options.absent)):
            self.remove_member(a, now)
        self._maybe_end(now)

    # ---- state -------------------------------------------------------------------------------------

    @property
    def stage_buffer(self) -> np.ndarray:
        """The 1-D float32 buffer under the stage (the caller's ``stage``, or this group's own): a driver done with
        this group (its result taken, or given up) may pass it to the next one as ``stage``."""
        return self._stage_buffer

    @property
    def reduce_scatter_done(self) -> bool:
        return self.state is not State.REDUCE_SCATTER

    @property
    def all_gather_done(self) -> bool:
        return self.state is State.DONE

    @property
    def result_ready(self) -> bool:
        """Both receive phases have ended: ``result()`` may be called."""
        return self.state is State.DONE

    @property
    def overlaps(self) -> bool:
        """Whether this member sends its shard's final ranges while the reduce-scatter runs (``options.overlap``)."""
        return self._early

    @property
    def wants_to_send(self) -> bool:
        """``datagrams_to_send`` may have something: call it (in batches) until it returns short."""
        return self._data_pending or self._repair_pending

    @property
    def _data_pending(self) -> bool:
        sending = self.sending
        return (sending is Sending.REDUCE_SCATTER or sending is Sending.ALL_GATHER or bool(self._left)
                or (sending is Sending.HOLDING and (self.state is not State.REDUCE_SCATTER or self.ag_ready())))

    @property
    def own_part_done(self) -> bool:
        """Result ready and every datagram of this member's own data handed out: what may be left is repair (done
        messages, other members' requests), which a driver can serve after handing the result on (``keep_shard``
        first). Once true it stays true."""
        return self.result_ready and not self._data_pending

    @property
    def finished(self) -> bool:
        """Result ready, every datagram produced, and no member this owner serves may still ask it for ranges: the
        driver can forget this group."""
        return self.result_ready and not self.wants_to_send and not self._serving

    @property
    def awaits_tail(self) -> bool:
        """What arrives next ends one of this group's waits: a receive phase's last TAIL_DATAGRAMS, an END's grace, a
        repair round, or (an owner serving, its own phases over) a member's request. The receive loop reads such data
        at once instead of letting it queue to save passes (``Inbound.reads_now``): a phase's end waits for it.
        While this member's own phases run, only their tails count: serving from the first datagram on would read
        every trickle of the round at once (a quarter more CPU a round at 4 peers), for requests that come only
        after the own stream's END."""
        phase = self._rs if self.state is State.REDUCE_SCATTER else self._ag if self.state is State.ALL_GATHER else None
        if phase is None:
            return self._serving
        return bool(phase.remaining <= TAIL_DATAGRAMS or phase.ending or phase.repairing)

    def get_timer(self) -> float | None:
        """When ``handle_timer`` should next be called; None once both receive phases have ended.

        It moves later whenever new data arrives, so re-read it after every ``receive``.
        """
        if self.state is State.REDUCE_SCATTER:
            d = self._rs_deadline()
            repairing = self._ag.repairing  # (all-gather streams may end, and be repaired, while this runs)
            return min(d, min(repairing.values())) if repairing else d
        if self.state is State.ALL_GATHER:
            return self._ag_deadline()
        return self._serve_until if self._serving else None

    def _rs_deadline(self) -> float:
        return self._rs.deadline(self.floor_s, self.safety, self.max_phase_s, None, 0.0)

    def _ag_deadline(self) -> float:
        # While this member's own contributions are still being handed out, no owner can have finished its shard:
        # the all-gather's silence means nothing yet and only its cap applies (a member without a shard, whose
        # all-gather starts with the round, sends its whole vector first: 3.5 s at an upload cap of 20 Mbit/s).
        if self.sending is Sending.REDUCE_SCATTER:
            return math.inf if self.max_phase_s is None else self._ag.t0 + self.max_phase_s
        # An owner may end its reduce-scatter (by its own deadline, or late on a loaded CPU) after this member ended
        # its own, and only then starts sending its shard: the phase allows for that lag once.
        return self._ag.deadline(self.floor_s, self.safety, self.max_phase_s, self._rs.rate(), self.owner_lag_s)

    def handle_timer(self, now: float) -> None:
        """End whichever phase's deadline has passed; what has not arrived by then is lost (but for the all-gather's
        repair rounds: at its deadline, the missing ranges of streams still open are asked for first)."""
        ag = self._ag
        if ag.repairing:
            ag.expire_repairs(now)
        if self.state is State.REDUCE_SCATTER:
            self._rs.expire_ending(now)
            self._maybe_end(now)
            if self.state is State.REDUCE_SCATTER:
                if now >= self._rs_deadline():
                    self._end_rs(now, DEADLINE)
                else:
                    self.note_ready(None)
                    return
        if self.state is State.ALL_GATHER:
            ag.expire_ending(now)
            self._maybe_end(now)
            if self.state is State.ALL_GATHER and now >= self._ag_deadline():
                if ag.repair_open(now):
                    self._maybe_end(now)
                else:
                    self._end_ag(now, DEADLINE)
        elif self.state is State.DONE:
            self._serve_timer(now)
        if ag.ask or ag.settled:
            self.phase_changes += 1

    @property
    def repair_timer(self) -> float | None:
        """When an all-gather stream's END grace or repair round is next over (``take_repair`` acts on it then);
        None: none is running."""
        ag = self._ag
        times = [*ag.repairing.values(), *(ag.ending.values() if self.state is State.ALL_GATHER else ())]
        return min(times) if times and self._rounds else None

    def take_repair(self, now: float, *, expire: bool = True) -> list[OutBlock]:
        """What repair has to send by ``now``, for a driver still busy sending the group's data: with ``expire``,
        the all-gather streams whose END grace or repair round is over (``repair_timer``) are asked for their
        missing ranges (or close) first; the requests, done messages and resends due go ahead of the data (they
        wait for nothing it carries; behind it, a block's time at the pacer's rate, tens of milliseconds, on every
        round). Phase deadlines are not looked at: those wait until this member's own data is out (the driver's
        timer). A driver passes ``expire`` only once it has read what reached its socket before the
        ``repair_timer``: a resend waiting there is not lost."""
        if not self._rounds:
            return []
        ag = self._ag
        if expire:
            if ag.repairing:
                ag.expire_repairs(now)
            if self.state is State.ALL_GATHER and ag.ending:
                ag.expire_ending(now)
                self._maybe_end(now)
        return self._repair_blocks() if self._repair_pending else []

    def remove_member(self, member: int, now: float) -> None:
        """Stop waiting for ``member`` (it left the swarm): its missing ranges are averaged out / kept own.

        What it already delivered stays counted; what it sends from now on is late; nothing more is sent to it.
        """
        if not 0 <= member < self.n or member == self.index:
            raise ValueError(f"member {member} is not another member of this group")
        self._live[member] = False
        self._awaiting.discard(member)
        self._rs.close(member)
        self._ag.close(member)
        self._maybe_end(now)
        self.note_ready(None)

    def give_up(self, member: int, now: float) -> None:
        """``member`` is dead (its daemon stopped answering: allreduce/liveness.py): ``remove_member``, and it is
        listed in ``GroupStats.dead``."""
        self.remove_member(member, now)
        self._dead.add(member)

    def note_sent(self, now: float) -> None:
        """The driver has put every block it was handed on the wire by ``now``. Owners average a shard only once
        this member's contributions have reached them, so an all-gather that began before those were out (no shard
        of its own: its reduce-scatter had nothing to wait for) counts its silence from when they were, not from its
        start. (An upload-capped member without a shard, whose vector took 3.5 s to leave at its cap, otherwise
        found its all-gather long silent the moment its sending ended, closed it with nothing in and kept its own
        vector as the average.)"""
        if self._contributed or self.sending is Sending.REDUCE_SCATTER:
            return
        self._contributed = True
        self._contributions_out(now)

    def _contributions_out(self, now: float) -> None:
        """This member's contributions went out by ``now``: an all-gather running since before counts its silence
        from there (one that starts later counts from its own start)."""
        if self.state is State.ALL_GATHER:
            self._ag.alive_at = max(self._ag.alive_at, now)

    def note_alive(self, member: int, now: float) -> None:
        """``member``'s daemon answered a PING at ``now`` (liveness.py): a receive phase that has had nothing of it
        yet counts its silence from there, as from an arrival, within ``LATE_START_FLOORS`` floors of the phase's
        start. A member late to start (opening its paths on a loaded CPU) is then not taken for lost while it
        answers; one that answers and never sends holds the phase that much longer, no more."""
        ph = self._rs if self.state is State.REDUCE_SCATTER else self._ag if self.state is State.ALL_GATHER else None
        if ph is None or ph.t0 is None or ph.done[member] or ph.received[member] or ph.end_seen[member]:
            return
        ph.alive_at = max(ph.alive_at, min(now, ph.t0 + LATE_START_FLOORS * self.floor_s))

    def waiting_for(self) -> list[int]:
        """The members whose stream the receive phase now running still waits for (none once both ended)."""
        ph = self._rs if self.state is State.REDUCE_SCATTER else self._ag if self.state is State.ALL_GATHER else None
        return [] if ph is None else [s for s, done in enumerate(ph.done) if not done]

    def stream_counts(self, member: int) -> tuple[int, int]:
        """(datagrams received, one past the highest index arrived) of ``member``'s stream in the receive phase now
        running ((0, 0) when none runs): the loss on its path, which a probe of its daemon meets too
        (liveness.SilenceWatch)."""
        ph = self._rs if self.state is State.REDUCE_SCATTER else self._ag if self.state is State.ALL_GATHER else None
        return (0, 0) if ph is None else (ph.received[member], ph.top[member])

    def heard_at(self, member: int) -> float:
        """When the latest data of ``member`` arrived, in either phase (0.0: none yet)."""
        return max(self._rs.last_at[member], self._ag.last_at[member])

    def _maybe_end(self, now: float) -> None:
        if self.state is State.REDUCE_SCATTER and self._rs.open == 0:
            self._end_rs(now, COMPLETION)
        if self.state is State.ALL_GATHER and self._ag.open == 0:
            self._end_ag(now, COMPLETION)

    def _end_rs(self, now: float, by: str) -> None:
        self.state = advance(TRANSITIONS, self.state, Event.REDUCE_SCATTER_ENDED)
        self.phase_changes += 1
        self._rs.ended_at = now
        self._rs.ended_by = by
        self._ag.t0 = now  # the all-gather clock starts when this member's own shard is final
        if self._ag.open == 0:
            self._end_ag(now, COMPLETION)

    def _end_ag(self, now: float, by: str) -> None:
        self.state = advance(TRANSITIONS, self.state, Event.ALL_GATHER_ENDED)
        self.phase_changes += 1
        self._ag.ended_at = now
        self._ag.ended_by = DEADLINE if self._ag.passed else by
        self._tell_all()
        self._serve_until = now + SERVE_S

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

    def latest_behind(self, s: int) -> bool:
        """Whether the latest data from sender s lay below its stream's top (a resend or reordered datagram): the
        socket's time for it is then not when the stream's top arrived."""
        rs, ag = self._rs, self._ag
        return ag.behind[s] if ag.last_at[s] >= rs.last_at[s] else rs.behind[s]

    def phase_state(self, phase: int) -> tuple[float | None, float | None]:
        """(started_at, ended_at) of receive phase 0 or 1 (None: not yet)."""
        ph = self._rs if phase == 0 else self._ag
        return ph.t0, ph.ended_at

    def statistics(self) -> GroupStats:
        own = self.weight
        left_out = self._excluded | self._opposed_all
        heard = [w for s, w in enumerate(self._sender_weight) if w is not None and s != self.index
                 and s not in left_out]
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
            opposed=tuple(sorted(left_out - self._preset)),
            cosines=tuple((k, c, self._elements[k]) for k, c in sorted(self._cosines.items())),
            repair_asked=sum(self._asked_first),
            repair_received=self._repaired(),
            repair_resent=self._resent,
            complete=not self._ag_kept and all(seen.all() for seen in self._ag_seen),
            dead=tuple(sorted(self._dead)),
        )
