"""How one group's member turns what arrived into its result (a part of ``GroupAverage``): the own shard's ranges
from weighted sums into averages a block at a time (float32, float64 where that overflows), robust clipping's
norms and weight bound, the all-gather's encoded bodies, and own values where nothing arrived.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from . import kernels
from .frames import F32_DTYPE
from .kernels import FINALIZE_BLOCK_ELEMENTS
from .robust import WEIGHT_BOUND, member_cosines, opposed_members


class Finalize:
    """GroupAverage's end of the reduce-scatter: the own shard's sums into averages, robust clipping, the result."""

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
        """Turn ranges [finalized, k_end) of the own shard from weighted sums into averages (with ``robust``, each
        segment's ranges with that segment's decision: every range of a segment must be final)."""
        step = max(1, FINALIZE_BLOCK_ELEMENTS // self.layout.per)
        while self._finalized < k_end:
            stop = k_end
            if self._robust is not None:
                while not self._robust_ready():
                    pass
                stop = min(k_end, self._seg_ends[self._seg])
            k1 = min(stop, self._finalized + step)
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
                if s == self.index or s in self._excluded or not mask.any():
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
        if not aside and kernels.finalize_native(own, acc, self._acc_set[k0:k1], got, self.weight, out2d):
            self._wsum[k0:k1] = wsum
            return
        res = None if aside else kernels.finalize_f32(own, acc, self._acc_set[k0:k1], got, self.weight)
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
            if s == self.index or s in self._excluded or not mask.any():
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

    def _robust_ready(self) -> bool:
        """One slice of robust work for the segment that holds the next range to finalize (robust.segment_ends:
        the whole shard, or the segment after one whose ranges are all finalized); True once its factors are known.
        The segment's ranges must all be final (``ag_frontier`` stops at segment ends)."""
        if (self._scale is not None and self._finalized >= self._seg_ends[self._seg]
                and self._seg + 1 < len(self._seg_ends)):
            self._next_segment()
        return self._robust_step()

    def _next_segment(self) -> None:
        """The next segment's decision is taken anew over every range up to its end (robust.segment_ends): the
        norms and dot products measured so far count again, the factors, weight bound and exclusions are its own."""
        self._opposed_all = self._opposed_all | (self._excluded - self._preset)
        self._seg += 1
        self._scale = None
        self._excluded = self._preset
        self._wcap = self._max_weight

    def _count_once(self, reason: str, member: int) -> None:
        """Count ``member`` under ``reason`` in the statistics once a round, however many segments it held for."""
        if (reason, member) not in self._counted:
            self._counted.add((reason, member))
            self._refused[reason] += 1

    def _robust_step(self) -> bool:
        """Measure the next slice of the contributions' norms up to the segment's end (robust); True once the
        factors are known.

        Per member (the own contribution included): the sum of squares of its finite ranges (minus the
        center, if any) and how many elements they hold; a range holding NaN or inf is refused here. Then
        the RMS per element delivered (so a member that lost datagrams is neither favoured nor penalized),
        the median over the members that delivered anything, and each member's factor min(1, C * median /
        its RMS). The same members' weights (each capped at max_weight) give the weight bound: WEIGHT_BOUND
        times their median, so that no claimed weight multiplies a clipped contribution past it."""
        assert self._robust is not None
        if self._scale is not None:
            return True
        end = self._seg_ends[self._seg]
        if self._norm_pos < end:
            k_end = min(end, self._norm_pos + max(1, FINALIZE_BLOCK_ELEMENTS // self.layout.per))
            for k0, k1, lo, _hi, width in self._pieces(self._norm_pos, k_end):
                self._measure(k0, k1, lo, width)
            self._norm_pos = k_end
            return False
        rms = [math.sqrt(self._sumsq[s] / self._elements[s]) if self._elements[s] else math.nan
               for s in range(self.n)]
        heard = [r for r in rms if math.isfinite(r)]
        weights = {s: min(self.weight if s == self.index else self._sender_weight[s], self._max_weight)
                   for s in range(self.n) if self._elements[s] and (s == self.index or
                                                                    self._sender_weight[s] is not None)}
        if weights:
            bound = WEIGHT_BOUND * float(np.median(list(weights.values())))
            if bound < self._wcap:
                self._wcap = bound
                for s, w in weights.items():
                    if w > bound:
                        self._count_once("weight_bounded", s)
        scale = [1.0] * self.n
        if heard:
            med = float(np.median(heard))
            limit = self._robust.c * med
            for s, r in enumerate(rms):
                if math.isfinite(r) and r > limit:
                    scale[s] = limit / r
                    self._count_once("clipped", s)
        if self._robust.mode == "clip":  # differences from a center are not expected to agree in direction
            self._exclude_opposed(scale)
        self._scale = scale
        return True

    def _exclude_opposed(self, scale: list[float]) -> None:
        """With 3 or more members heard: leave out of the average every other member whose contribution, as it
        would count (clipped and with its bounded weight), points against the sum of the others' (robust.py's
        opposed_members, from the Gram matrix): a sign-flipped gradient of normal size, which clipping lets
        through. The owner never leaves itself out."""
        heard = [s for s in range(self.n) if self._elements[s] and s not in self._excluded and
                 (s == self.index or self._sender_weight[s] is not None)]
        if len(heard) < 3:
            return
        eff = np.zeros(self.n)
        for s in heard:
            w = self.weight if s == self.index else self._sender_weight[s]
            eff[s] = min(w, self._wcap) * scale[s]  # type: ignore[type-var]
        g = self._gram * np.outer(eff, eff)
        if not np.isfinite(g).all():
            return
        self._cosines = member_cosines(g, heard, self.index)
        prior = {k: (w, n) for k, w, n in self.options.prior if k < self.n}
        opposed = opposed_members(g, heard, self.index, self._elements, prior)
        for s in opposed:
            self._count_once("opposed", s)
        if opposed:
            self._excluded = self._excluded | opposed

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
        if self._robust is not None and self._robust.mode == "clip":
            self._measure_directions(k0, rows, width, lo)

    def _measure_directions(self, k0: int, rows: int, width: int, lo: int) -> None:
        """Add ranges [k0, k0 + rows) to the members' Gram matrix (every pair's dot product, the own contribution
        included; a range a member did not deliver, or had refused, counts as zeros): from it ``_robust_step``
        tells which members point against the others, whatever their clipping and weights turn out to be."""
        base = lo - self._lo
        own = self._vec[lo : lo + rows * width]
        others = [s for s in range(self.n) if s != self.index]
        if all(self._rs_seen[s, k0 : k0 + rows].all() for s in others):
            # every sender delivered every range: one product over the stage's rows in place (the own row of the
            # stage is unused, whatever it holds; its row and column are replaced by the own values' products)
            stage = self._stage[:, base : base + rows * width]
            with np.errstate(all="ignore"):
                gram = (stage @ stage.T).astype(np.float64)
                mine = (stage @ own).astype(np.float64)
                mine[self.index] = float(own @ own)
                gram[self.index, :] = mine
                gram[:, self.index] = mine
                if np.isfinite(gram).all():
                    self._gram += gram
                    return
        block = np.zeros((self.n, rows * width), dtype=F32_DTYPE)
        for s in range(self.n):
            x = block[s].reshape(rows, width)
            if s == self.index:
                x[...] = own.reshape(rows, width)
            else:
                mask = self._rs_seen[s, k0 : k0 + rows]
                if not mask.any():
                    continue
                staged = self._stage[s, base : base + rows * width].reshape(rows, width)
                x[mask] = staged[mask]
        with np.errstate(all="ignore"):
            gram = (block @ block.T).astype(np.float64)
            if not np.isfinite(gram).all():  # overflowed in float32 (the values themselves are finite)
                wide = block.astype(np.float64)
                gram = wide @ wide.T
        self._gram += gram

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

