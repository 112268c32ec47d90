"""arc-topk in the average: three ordinary group averages (GroupAverage, unchanged) that together average the
top rows of every matrix, with the row selection agreed under loss (protocol/codecs.md, "arc-topk over group
averages").

Every member derives the same plan from (tensor shapes, group size n, ratio, elements per datagram). Each phase
averages a vector of n equal segments, so the averaging core's shard j (elements [j L / n, (j+1) L / n)) is
exactly segment j, which belongs to member j, the owner of row shard j (peerd.compress.topk):

1. **Sketch.** Segment j holds the sketch rows G V of row shard j (V shared from run and round). Owner j's own
   result for its segment is the weighted mean of the sketches that arrived; it selects each (tensor, shard)
   piece's top k rows from it. Top-k is therefore per piece, not per tensor. (The core also all-gathers the
   sketch; nobody reads that copy: 2 x 4 values per selectable row, 0.8 % of a 1000-column layout.)
2. **Selection.** Segment j holds owner j's selection bitmap as 24-bit integers in float32 (exact), in
   SELECTION_COPIES copies, each starting at a datagram range. Everyone else puts NaN there, and the phase runs
   ``solo``: the owner's result for its segment is its own bitmap alone, whatever others send for it (a member
   that sends finite words there cannot blend them in and make the selection decode for nobody), and the
   all-gather sends it to all. A member knows selection j if one copy arrived whole and decodes as a valid
   selection (exact k bits per piece). The owner decodes its own result the same way, so it uses what the
   others received.
3. **Dense.** Segment j holds the selected rows of row shard j and shard j of the whole (0-/1-D) tensors, in
   datagram ranges whose first element is a canary: at the owner the RMS of its values there (a positive
   number of their size, so robust clipping measures the owner as it measures the others), 0 elsewhere. A
   member that does not know selection j puts NaN in all of segment j: it is counted out of those rows
   (refused, as if lost), never averaged into the wrong rows, and it ignores segment j's all-gather. After the
   all-gather a range arrived iff its canary is not this member's own (their average is w_owner c / sum w > 0).

EF21M (peerd.compress.topk.EF21M) is the caller's, one per run: v = h - e is sketched, and the dense phase
averages the selected rows of h itself; ``sent`` are the rows it contributed, ``got`` the ranges whose average
arrived (u takes them); where it contributed but the all-gather range was lost, and in rows of a shard whose
selection it never learnt, u keeps the last average it had. The state resets when the layout changes and survives group
changes (every averaged row is the group's mean again). A round in which a member did not learn every selection
has rows that were never averaged: ``ArcTopKResult.complete`` is False and ``got_fraction`` counts them as not
arrived. ``robust`` (clip; centered clips around zero here) applies to the sketch and dense phases, never to the
selection phase, whose non-owners' NaN must be refused, not clipped. An owner's sketch shard also leaves out its
``suspects`` (robust.Suspects: the members its recent dense phases found opposed): a sketch shard holds tens of
values, too few for the direction test to tell a sign flip from noise. Its dense shard also leaves out the
``banned`` (members those phases found opposed repeatedly): a dense shard's test misses a flipped member now and
then, and the rows it lets in stay in EF21M's estimate until they are selected again. Dense values travel in fp32
or bf16 (the canary needs the exponent range of float32: w_owner / sum w may be below fp16's smallest value).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..compress import Codec, CodecError
from ..compress.topk import EF21M, TopKLayout
from .options import DEFAULT_OPTIONS, AverageOptions
from .robust import Robust
from .shards import elements_per_datagram

if TYPE_CHECKING:
    from .service import Averager

FLOAT32 = np.dtype("<f4")
CANARY_FLOOR = 2.0**-64  # the owner's canary when its values are all zero: still not 0 once averaged (float32)
SELECTION_COPIES = 3  # selection bitmaps sent per owner: each copy is lost only if one of its datagrams is
WORD_BITS = 24  # bits of a selection word (integers below 2**24 are exact in float32)
PHASES = ("sketch", "selection", "dense")
_PHASE_STRIDE = 0x9E3779B9  # phase p averages under group id (group_id + p * stride) mod 2**32
DENSE_CODECS = ("fp32", "bf16")
OFF_LOOP_ELEMS = 1 << 20  # a layout this large has its whole-vector passes run in a worker thread (see offload)


def phase_group_id(group_id: int, phase: int) -> int:
    """The core's group id for phase 0 (sketch), 1 (selection) or 2 (dense) of arc-topk group ``group_id``."""
    return (group_id + phase * _PHASE_STRIDE) & 0xFFFFFFFF


@dataclass(frozen=True)
class ArcTopKPlan:
    """Where every phase's values lie; the same at every member of the group."""

    layout: TopKLayout
    per: int  # fp32 elements per datagram range (sketch and selection phases)
    dense_per: int  # elements per datagram range of the dense phase's value codec
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], n: int, ratio: float,
              max_payload: int, codec: Codec | None = None) -> ArcTopKPlan:
        """The plan for ``shapes`` (the layout, in flat order), ``n`` members, ``ratio`` of each piece's rows,
        datagrams of ``max_payload`` bytes, dense values in ``codec`` (fp32 or bf16; None: fp32)."""
        if codec is not None and codec.name not in DENSE_CODECS:
            raise ValueError(f"arc-topk's dense rows travel in {' or '.join(DENSE_CODECS)}, not {codec.name}")
        per = elements_per_datagram(max_payload)
        dense_per = elements_per_datagram(max_payload, codec)
        if dense_per < 2:
            raise ValueError("a datagram must hold a canary and at least one value")
        return cls(TopKLayout(tuple(tuple(s) for s in shapes), n, ratio), per, dense_per)

    @property
    def n(self) -> int:
        return self.layout.n

    # -- sketch ----------------------------------------------------------------------------------------------

    @cached_property
    def sketch_segment(self) -> int:
        lay = self.layout
        return max(1, max((lay.row_shard(j)[1] - lay.row_shard(j)[0]) * lay.rank for j in range(lay.n)))

    def sketch_vector(self, flat: np.ndarray, run: int, round: int) -> np.ndarray:
        """Phase 1's vector: segment j holds the sketch rows of row shard j (zero padding after them)."""
        lay = self.layout
        sketch = lay.sketch(flat, run, round)
        out = np.zeros(self.n * self.sketch_segment, dtype=FLOAT32)
        for j in range(self.n):
            lo, hi = lay.sketch_shard(j)
            out[j * self.sketch_segment : j * self.sketch_segment + hi - lo] = sketch[lo:hi]
        return out

    def own_sketch(self, averaged: np.ndarray, j: int) -> np.ndarray:
        """Owner j's averaged sketch rows out of phase 1's result."""
        lo, hi = self.layout.sketch_shard(j)
        return averaged[j * self.sketch_segment : j * self.sketch_segment + hi - lo]

    # -- selection -------------------------------------------------------------------------------------------

    def _words(self, j: int) -> int:
        return -(-self.layout.selection_size(j) // 3)

    @cached_property
    def copy_size(self) -> int:
        """Elements of one selection copy: whole datagram ranges, so a lost datagram costs one copy."""
        words = max((self._words(j) for j in range(self.n)), default=1)
        return max(1, -(-words // self.per)) * self.per

    @cached_property
    def selection_segment(self) -> int:
        return SELECTION_COPIES * self.copy_size

    def selection_vector(self, index: int, selection: list[np.ndarray]) -> np.ndarray:
        """Phase 2's vector at member ``index``: its selection in its own segment, NaN in everyone else's."""
        body = self.layout.encode_selection(index, selection)
        raw = np.frombuffer(body + bytes(-len(body) % 3), dtype=np.uint8).reshape(-1, 3).astype(np.uint32)
        words = (raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)).astype(FLOAT32)
        out = np.full(self.n * self.selection_segment, np.nan, dtype=FLOAT32)
        seg = out[index * self.selection_segment : (index + 1) * self.selection_segment]
        seg[:] = 0.0
        for c in range(SELECTION_COPIES):
            seg[c * self.copy_size : c * self.copy_size + len(words)] = words
        return out

    def read_selection(self, averaged: np.ndarray, j: int) -> list[np.ndarray] | None:
        """Selection j from phase 2's result: the first copy that arrived whole and decodes; None if none."""
        seg = averaged[j * self.selection_segment : (j + 1) * self.selection_segment]
        size = self.layout.selection_size(j)
        for c in range(SELECTION_COPIES):
            copy = seg[c * self.copy_size : (c + 1) * self.copy_size]
            if not np.isfinite(copy).all():
                continue  # a range of this copy was lost (this member's own NaN is still there)
            words = copy[: self._words(j)]
            if (words < 0).any() or (words >= 1 << WORD_BITS).any() or (words != np.floor(words)).any():
                continue
            if copy[self._words(j):].any():
                continue
            w = words.astype(np.uint32)
            raw = np.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=1).astype(np.uint8).reshape(-1)
            if raw[size:].any():
                continue
            try:
                return self.layout.decode_selection(j, raw[:size].tobytes())
            except CodecError:
                continue
        return None

    # -- dense -----------------------------------------------------------------------------------------------

    @cached_property
    def dense_segment(self) -> int:
        slots = self.dense_per - 1
        ranges = max((-(-self.layout.dense_size(j) // slots) for j in range(self.n)), default=1)
        return max(1, ranges) * self.dense_per

    def _slots(self, j: int) -> np.ndarray:
        """Positions (in the dense phase's vector) of dense shard j's values, in dense order: every range's
        first element is the canary."""
        cached = self._cache.get(("slots", j))
        if cached is None:
            count = self.layout.dense_size(j)
            k = np.arange(count, dtype=np.int64)
            slots = self.dense_per - 1
            cached = j * self.dense_segment + (k // slots) * self.dense_per + 1 + k % slots
            self._cache[("slots", j)] = cached
        return cached

    def _canaries(self, j: int) -> np.ndarray:
        ranges = self.dense_segment // self.dense_per
        return j * self.dense_segment + np.arange(ranges, dtype=np.int64) * self.dense_per

    def dense_vector(self, index: int, flat: np.ndarray, selections: list[list[np.ndarray] | None]) -> np.ndarray:
        """Phase 3's vector at member ``index``: known shards' selected rows with canaries (1 in its own
        segment, 0 in others), NaN in the segments of shards whose selection it does not know."""
        out = np.zeros(self.n * self.dense_segment, dtype=FLOAT32)
        for j, sel in enumerate(selections):
            if sel is None:
                out[j * self.dense_segment : (j + 1) * self.dense_segment] = np.nan
                continue
            values = self.layout.gather(flat, j, sel)
            out[self._slots(j)] = values
            out[self._canaries(j)] = self._canary(values) if j == index else 0.0
        return out

    @staticmethod
    def _canary(values: np.ndarray) -> np.float32:
        """The owner's canary: the RMS of its values (so it adds nothing unusual to its norm under robust
        clipping), at least CANARY_FLOOR (so its average is never 0)."""
        rms = float(np.sqrt(np.mean(np.square(values, dtype=np.float64)))) if len(values) else 0.0
        return np.float32(max(rms, CANARY_FLOOR) if np.isfinite(rms) else 1.0)

    def read_dense(self, index: int, averaged: np.ndarray, selections: list[list[np.ndarray] | None]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(avg, sent, got) over the flat vector from phase 3's result: ``avg`` holds the averages where ``got``;
        ``sent``: elements this member contributed (none of the shards whose selection it did not know)."""
        lay = self.layout
        avg = np.zeros(lay.length, dtype=FLOAT32)
        sent = np.zeros(lay.length, dtype=bool)
        got = np.zeros(lay.length, dtype=bool)
        slots_per = self.dense_per - 1
        for j, sel in enumerate(selections):
            if sel is None:
                continue
            idx = lay.dense_index(j, sel)
            sent[idx] = True
            values = averaged[self._slots(j)]
            if j == index:
                arrived = np.ones(len(idx), dtype=bool)  # the owner's own shard: its result is the average
            else:
                canary = averaged[self._canaries(j)]
                ok = np.isfinite(canary) & (canary != 0)  # lost: this member's own 0 is still there
                arrived = np.repeat(ok, slots_per)[: len(idx)] & np.isfinite(values)
            avg[idx[arrived]] = values[arrived]
            got[idx[arrived]] = True
        return avg, sent, got


@dataclass
class ArcTopKResult:
    vector: np.ndarray  # the output: EF21M's u, or (no error feedback) own values with the averaged rows in
    known: int  # row shards whose selection this member knew (n: all)
    got_fraction: float  # of the round's dense elements (every shard's, known or not), the share averaged here
    bytes_sent: int = 0
    phases: list = field(default_factory=list)  # what the injected average returned per phase
    selections: list = field(default_factory=list)  # per row shard: the agreed selection, None where not known

    @property
    def complete(self) -> bool:
        """Every shard's selection was known here: no row of the round was left out for want of it."""
        return self.known == len(self.selections)


Average = Callable[[int, int, np.ndarray], Awaitable[tuple[np.ndarray, object, int]]]
Offload = Callable[[Callable[[], Any]], Awaitable[Any]]


async def _inline(fn: Callable[[], Any]) -> Any:
    return fn()


async def arc_topk_average(average: Average, plan: ArcTopKPlan, group_id: int, index: int, vector: np.ndarray,
                           *, run: int, round: int, ef: EF21M | None = None,
                           offload: Offload = _inline) -> ArcTopKResult:
    """One arc-topk average of ``vector`` (flat, the plan's layout) as member ``index`` of ``group_id``.

    ``average(phase, group_id, vector)`` runs one ordinary group average (the same members, weight and options;
    the caller picks the value codec: fp32 for phases 0 and 1, the plan's dense codec for phase 2) and returns
    (result, what to keep in ``phases``, bytes sent). ``run`` (u64) and ``round`` seed the shared sketch matrix.
    ``ef``: this run's EF21M state (a new layout resets it; see EF21M).
    Without ``ef`` the output is this member's vector with the averaged rows written in.
    ``offload(fn)`` runs the passes over the whole vector (checks, EF21M, sketch, gather, scatter): a daemon passes
    trio.to_thread.run_sync, so its event loop keeps reading datagrams meanwhile (on 25M values they take a few
    hundred ms, and a receiver that stops reading looks like a growing queue to its senders' pacers)."""
    lay = plan.layout
    flat = np.ascontiguousarray(vector, dtype=FLOAT32)
    if flat.shape != (lay.length,):
        raise ValueError(f"vector of {flat.shape} for a layout of {lay.length} elements")

    def prepare() -> tuple[np.ndarray, np.ndarray] | None:
        if not np.isfinite(flat).all():
            return None
        v = ef.begin(flat, lay.fingerprint()) if ef is not None else flat
        return v, plan.sketch_vector(v, run, round)

    prepared = await offload(prepare)
    if prepared is None:
        raise ValueError("arc-topk: refusing to average a vector holding NaN or infinity")
    phases: list = []
    sent_bytes = 0
    sketch, info, b = await average(0, phase_group_id(group_id, 0), prepared[1])
    del prepared
    phases.append(info)
    sent_bytes += b
    mine = lay.select(index, plan.own_sketch(sketch, index))
    chosen, info, b = await average(1, phase_group_id(group_id, 1), plan.selection_vector(index, mine))
    phases.append(info)
    sent_bytes += b
    selections = [plan.read_selection(chosen, j) for j in range(plan.n)]
    rows = ef.h if ef is not None else flat  # EF21M averages h's rows (v only chose them)
    dense_in = await offload(lambda: plan.dense_vector(index, rows, selections))
    dense, info, b = await average(2, phase_group_id(group_id, 2), dense_in)
    del dense_in
    phases.append(info)
    sent_bytes += b

    def finish() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        avg, sent, got = plan.read_dense(index, dense, selections)
        if ef is not None:
            out = ef.finish(got=got, avg=avg).copy()
        else:
            out = flat.copy()
            out[got] = avg[got]
        return out, sent, got

    out, sent, got = await offload(finish)
    total = sum(lay.dense_size(j) for j in range(plan.n))  # unknown selections' rows count as not averaged
    return ArcTopKResult(out, sum(s is not None for s in selections),
                         int(np.count_nonzero(got & sent)) / total if total else 1.0, sent_bytes, phases, selections)


def phase_options(options: AverageOptions, phase: int) -> AverageOptions:
    """``options`` as ``phase`` of an arc-topk average runs them: the selection phase runs ``solo`` (each owner's
    segment is its bitmap alone) with no clipping; the sketch and dense phases clip when ``options.robust`` is set
    (a centered mode clips around zero: no center is kept for sketches or rows), one test per shard (its verdicts
    are the suspects' evidence)."""
    robust = options.robust
    if phase == 1:
        return replace(options, robust=None, solo=True)
    if robust is None or robust.mode == "clip":
        return replace(options, solo=False, segments=False)
    return replace(options, robust=Robust("clip", robust.c), solo=False, segments=False)


async def service_arc_topk(service: Averager, group_id: int, members: list, index: int, vector: np.ndarray,
                           weight: float, plan: ArcTopKPlan, *, run: int, round: int, codec: Codec | None = None,
                           ef: EF21M | None = None, options: AverageOptions = DEFAULT_OPTIONS,
                           suspects: tuple[int, ...] = (), banned: tuple[int, ...] = (),
                           prior: tuple[tuple[int, float, int], ...] = ()) -> ArcTopKResult:
    """arc_topk_average through an Averager (``service.average``): the three phases under derived group ids, with
    the same members, weight and ``options`` (deadlines, max_weight, robust); ``codec`` the dense rows' (the
    plan's). ``options.robust`` applies to the sketch and dense phases (a centered mode clips around zero: no
    center is kept for sketches or rows); the selection phase runs ``solo`` (each owner's segment is its bitmap
    alone). ``suspects``: members (indices) this member's own sketch shard leaves out (robust.Suspects: the
    members its recent dense phases found opposed); ``banned``: members its own sketch and dense shards both leave
    out (found opposed repeatedly); ``prior``: the dense phase's test pools each member's cosine with these of its
    earlier tests (robust.Suspects.prior). ``result.phases`` holds the three AverageResults (the dense phase's
    ``stats.opposed`` and ``stats.cosines`` are the next verdicts: robust.Suspects.observe)."""
    base = replace(options, codec=None, run=0, solo=False)
    dense = replace(base, codec=codec, run=run) if codec is not None and codec.wire_id != 0 else base
    dense = replace(dense, exclude=tuple(sorted(set(base.exclude) | set(banned))), prior=prior)
    sketch = replace(base, exclude=tuple(sorted(set(base.exclude) | set(suspects) | set(banned))))

    async def average(phase: int, gid: int, values: np.ndarray) -> tuple[np.ndarray, object, int]:
        res = await service.average(gid, members, index, values, weight,
                                    phase_options((sketch, base, dense)[phase], phase))
        return res.vector, res, res.bytes_sent

    offload = trio.to_thread.run_sync if plan.layout.length >= OFF_LOOP_ELEMS else _inline
    return await arc_topk_average(average, plan, group_id, index, vector, run=run, round=round, ef=ef,
                                  offload=offload)


def phase_totals(phases: list) -> dict[str, Any]:
    """What a bench reports of one arc-topk average, summed over its three AverageResults: seconds, bytes and
    data datagrams, drops and refusals (non-owners' selection ranges are ``solo``: by design),
    and how the phases ended (``deadline`` if any of them did)."""
    out: dict[str, Any] = {"seconds": 0.0, "handshake_s": 0.0, "bytes_sent": 0, "datagrams_sent": 0,
                           "datagrams_received": 0, "datagrams_expected": 0, "drops": {}, "refused": {},
                           "rs_ended_by": "completion", "ag_ended_by": "completion"}
    for res in phases:
        st = res.stats
        out["seconds"] += res.seconds
        out["handshake_s"] += res.handshake_s
        out["bytes_sent"] += res.bytes_sent
        for ph, name in ((st.reduce_scatter, "rs_ended_by"), (st.all_gather, "ag_ended_by")):
            out["datagrams_sent"] += ph.datagrams_sent
            out["datagrams_received"] += ph.datagrams_received
            out["datagrams_expected"] += ph.datagrams_expected
            if ph.ended_by != "completion":
                out[name] = ph.ended_by
        for field_name in ("drops", "refused"):
            for reason, count in getattr(st, field_name).items():
                out[field_name][reason] = out[field_name].get(reason, 0) + count
    return out


def ratio_of_plan(plan: ArcTopKPlan, dense_bytes: int = 4) -> float:
    """Value bytes one member sends per average over a dense fp32 average's (both count (n - 1)/n of their
    vectors in each direction; headers left out): the three phases as built here, padding and canaries included,
    dense values of ``dense_bytes`` bytes."""
    length = plan.layout.length
    sent = plan.n * (4 * plan.sketch_segment + 4 * plan.selection_segment + dense_bytes * plan.dense_segment)
    return sent / (4 * length) if length else 0.0


def matrix_shapes(size: int, rows: int, cols: int) -> list[tuple[int, ...]]:
    """``peerd bench allreduce --layout RxC``: ``size`` elements as a stack of R x C matrices, the rest a 1-D
    tail (so the layout always covers the vector)."""
    if rows < 1 or cols < 1:
        raise ValueError(f"--layout {rows}x{cols}: both sides must be at least 1")
    count, tail = divmod(size, rows * cols)
    shapes: list[tuple[int, ...]] = [(rows, cols)] * count
    if tail:
        shapes.append((tail,))
    if not shapes:
        raise ValueError("the layout holds no elements")
    return shapes


__all__ = ["DENSE_CODECS", "PHASES", "SELECTION_COPIES", "ArcTopKPlan", "ArcTopKResult", "arc_topk_average",
           "matrix_shapes", "phase_group_id", "phase_options", "phase_totals", "ratio_of_plan", "service_arc_topk"]
