"""arc-topk building blocks: shared sketches, per-shard row selection, dense row gather/scatter, EF21M state
(protocol/codecs.md, "arc-topk").

After ARC-Top-K (Chen et al. 2025): each 2-D tensor G (n x m) of the layout (a tensor of more dimensions is
viewed as shape[0] x the rest; 0-D and 1-D tensors go whole) is sketched as G V with V an m x r (r = 4) +-1
matrix every member derives from the run and round, so no indices travel. Loss-tolerant agreement: the selectable
rows (all rows of all matrices, in layout order) are cut into n row shards; member j owns the sketch rows of
shard j, averages them in a reduce-scatter (no all-gather), picks the top ``ratio`` rows of each (tensor, shard)
piece by the squared norm of its averaged sketch, and sends that selection to every member before the dense
phase. Top-k is therefore per (tensor, shard) piece, not per tensor. Because every piece selects a fixed number
of rows, the dense phase's shard sizes are known in advance; a member that did not receive shard j's selection
sends nothing for it (it is counted out of those rows, never averaged into the wrong ones) and keeps its own
state there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .base import FLOAT32, CodecError
from .rounding import PHASE_SKETCH, draw_bits, stream_key

SKETCH_RANK = 4
MIN_TOPK_ROWS = 2  # a matrix whose top ``ratio`` is a single row goes whole: see TopKLayout.matrices
DEFAULT_MAX_AGE = 64  # EF21M: rounds an element of u may go unrefreshed before it is reset (ratio 0.1: ~6x the usual)


@dataclass(frozen=True, slots=True)
class Piece:
    """The rows [lo, hi) of matrix ``tensor`` that fall in one row shard, and how many of them are selected."""

    tensor: int
    lo: int
    hi: int
    k: int


@dataclass(frozen=True)
class TopKLayout:
    """Where matrices, rows, sketches and dense shards lie, derived by every member from (shapes, n, ratio)."""

    shapes: tuple[tuple[int, ...], ...]
    n: int
    ratio: float
    rank: int = SKETCH_RANK
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        if self.n < 1:
            raise ValueError(f"a group has at least one member, got n={self.n}")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"topk ratio must be in (0, 1], got {self.ratio}")
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError("negative dimension in layout")

    # -- tensors -------------------------------------------------------------------------------------------

    @cached_property
    def offsets(self) -> np.ndarray:
        sizes = [math.prod(s) for s in self.shapes]
        return np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))

    @property
    def length(self) -> int:
        return int(self.offsets[-1])

    @cached_property
    def matrices(self) -> list[tuple[int, int, int, int]]:
        """(tensor index, flat offset, rows, cols) of every tensor sent by rows: ndim >= 2, nonempty, and at least
        MIN_TOPK_ROWS rows in its top ``ratio``."""
        return [(t, int(self.offsets[t]), s[0], math.prod(s[1:])) for t, s in enumerate(self.shapes)
                if self._by_rows(s)]

    def _by_rows(self, s: tuple[int, ...]) -> bool:
        return len(s) >= 2 and math.prod(s) > 0 and math.ceil(self.ratio * s[0] - 1e-9) >= MIN_TOPK_ROWS

    @cached_property
    def whole(self) -> list[tuple[int, int]]:
        """(flat offset, size) of every tensor sent whole: 0-D and 1-D, and matrices with too few rows to select
        among (MIN_TOPK_ROWS)."""
        return [(int(self.offsets[t]), math.prod(s)) for t, s in enumerate(self.shapes) if not self._by_rows(s)]

    @cached_property
    def whole_length(self) -> int:
        return sum(size for _, size in self.whole)

    @cached_property
    def row_starts(self) -> np.ndarray:
        """Global row index of each matrix's first row (plus the total R at the end)."""
        return np.concatenate(([0], np.cumsum([r for _, _, r, _ in self.matrices], dtype=np.int64)))

    @property
    def rows(self) -> int:
        return int(self.row_starts[-1])

    # -- shards --------------------------------------------------------------------------------------------

    def row_shard(self, j: int) -> tuple[int, int]:
        """Global rows [lo, hi) of row shard j (j * R // n ...)."""
        return (j * self.rows) // self.n, ((j + 1) * self.rows) // self.n

    def sketch_shard(self, j: int) -> tuple[int, int]:
        """Element bounds of shard j of the sketch vector (row aligned: ``rank`` values a row)."""
        lo, hi = self.row_shard(j)
        return lo * self.rank, hi * self.rank

    def pieces(self, j: int) -> list[Piece]:
        """The (matrix, rows) pieces of row shard j, each with its fixed selection count ceil(ratio * rows)."""
        cached = self._cache.get(("pieces", j))
        if cached is not None:
            return cached
        lo, hi = self.row_shard(j)
        out = []
        for i, (t, _, _, _) in enumerate(self.matrices):
            a, b = int(self.row_starts[i]), int(self.row_starts[i + 1])
            plo, phi = max(lo, a) - a, min(hi, b) - a
            if plo < phi:
                out.append(Piece(t, plo, phi, math.ceil(self.ratio * (phi - plo) - 1e-9)))
        self._cache[("pieces", j)] = out
        return out

    @cached_property
    def _by_tensor(self) -> dict[int, tuple[int, int, int, int]]:
        return {m[0]: m for m in self.matrices}

    def _matrix(self, t: int) -> tuple[int, int, int, int]:
        return self._by_tensor[t]

    def whole_shard(self, j: int) -> tuple[int, int]:
        """Bounds of shard j of the concatenated whole (1-D) tensors."""
        return (j * self.whole_length) // self.n, ((j + 1) * self.whole_length) // self.n

    def dense_size(self, j: int) -> int:
        """Elements of dense shard j: the selected rows of its pieces then its whole-tensor shard. Fixed by
        (shapes, n, ratio) alone, whatever rows are selected."""
        lo, hi = self.whole_shard(j)
        return sum(p.k * self._matrix(p.tensor)[3] for p in self.pieces(j)) + hi - lo

    @cached_property
    def _dense_starts(self) -> list[int]:
        starts = [0]
        for j in range(self.n):
            starts.append(starts[-1] + self.dense_size(j))
        return starts

    def dense_shard(self, j: int) -> tuple[int, int]:
        """Bounds of dense shard j in the dense vector (the concatenation of the n dense shards)."""
        return self._dense_starts[j], self._dense_starts[j + 1]

    @property
    def dense_length(self) -> int:
        return self._dense_starts[-1]

    @property
    def sketch_length(self) -> int:
        return self.rows * self.rank

    # -- sketch ----------------------------------------------------------------------------------------------

    def sketch_matrix(self, run: int, round: int, t: int) -> np.ndarray:
        """V (cols x rank, +-1 float32) of tensor t: bit 23 of the draws of stream (run, round, t, PHASE_SKETCH),
        element c * rank + i, set means -1."""
        cols = self._matrix(t)[3]
        bits = draw_bits(stream_key(run, round, t, PHASE_SKETCH), 0, cols * self.rank)
        v = np.where((bits >> np.uint32(23)) & np.uint32(1), np.float32(-1), np.float32(1))
        return v.astype(FLOAT32).reshape(cols, self.rank)

    def sketch(self, flat: np.ndarray, run: int, round: int) -> np.ndarray:
        """The sketch vector of a member's flat vector: G V of every matrix, rows in layout order (R x rank)."""
        flat = np.asarray(flat, dtype=FLOAT32)
        if flat.shape != (self.length,):
            raise ValueError(f"flat vector of {flat.shape} for a layout of {self.length} elements")
        out = np.empty((self.rows, self.rank), dtype=FLOAT32)
        for i, (t, off, rows, cols) in enumerate(self.matrices):
            g = flat[off : off + rows * cols].reshape(rows, cols)
            out[self.row_starts[i] : self.row_starts[i + 1]] = g @ self.sketch_matrix(run, round, t)
        return out.reshape(-1)

    # -- selection ------------------------------------------------------------------------------------------

    def select(self, j: int, sketch_shard: np.ndarray) -> list[np.ndarray]:
        """Owner j's selection: per piece, the sorted local row indices of its top k rows by the squared norm of
        the averaged sketch (ties to the lower row)."""
        lo, hi = self.row_shard(j)
        s = np.asarray(sketch_shard, dtype=FLOAT32)
        if s.shape != ((hi - lo) * self.rank,):
            raise ValueError(f"sketch shard of {s.shape} for {hi - lo} rows")
        score = np.square(s.reshape(-1, self.rank).astype(np.float64)).sum(axis=1)
        out, at = [], 0
        for p in self.pieces(j):
            sc = score[at : at + p.hi - p.lo]
            top = np.argsort(-sc, kind="stable")[: p.k]
            out.append(np.sort(top).astype(np.int64) + p.lo)
            at += p.hi - p.lo
        return out

    def selection_size(self, j: int) -> int:
        lo, hi = self.row_shard(j)
        return (hi - lo + 7) // 8

    def encode_selection(self, j: int, selection: list[np.ndarray]) -> bytes:
        """The selection body: one bit per row of row shard j (LSB first), zero padding bits."""
        lo, hi = self.row_shard(j)
        bits = np.zeros(hi - lo, dtype=bool)
        at = 0
        for p, rows in zip(self.pieces(j), selection, strict=True):
            if len(rows) != p.k:
                raise ValueError(f"piece of tensor {p.tensor} selects {p.k} rows, got {len(rows)}")
            bits[at + np.asarray(rows) - p.lo] = True
            at += p.hi - p.lo
        return np.packbits(bits, bitorder="little").tobytes()

    def decode_selection(self, j: int, body: bytes | memoryview) -> list[np.ndarray]:
        """A selection body for row shard j, validated: exact size, zero padding bits, exactly k rows per piece.
        Raises CodecError otherwise (a counted drop)."""
        lo, hi = self.row_shard(j)
        size = self.selection_size(j)
        if len(body) != size:
            raise CodecError(f"selection of {len(body)} bytes for shard {j}; it must be {size}")
        bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8), bitorder="little")
        if bits[hi - lo :].any():
            raise CodecError("selection padding bits are not zero")
        out, at = [], 0
        for p in self.pieces(j):
            idx = np.flatnonzero(bits[at : at + p.hi - p.lo])
            if len(idx) != p.k:
                raise CodecError(f"selection names {len(idx)} rows of a piece that selects {p.k}")
            out.append(idx.astype(np.int64) + p.lo)
            at += p.hi - p.lo
        return out

    # -- dense rows --------------------------------------------------------------------------------------------

    def dense_index(self, j: int, selection: list[np.ndarray]) -> np.ndarray:
        """Flat-vector element indices of dense shard j, in dense order (int64)."""
        parts = []
        for p, rows in zip(self.pieces(j), selection, strict=True):
            _, off, _, cols = self._matrix(p.tensor)
            parts.append((off + np.asarray(rows, dtype=np.int64)[:, None] * cols + np.arange(cols)).reshape(-1))
        wlo, whi = self.whole_shard(j)
        parts.append(self.whole_index()[wlo:whi])
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def whole_index(self) -> np.ndarray:
        idx = [np.arange(off, off + size, dtype=np.int64) for off, size in self.whole]
        return np.concatenate(idx) if idx else np.empty(0, np.int64)

    def gather(self, flat: np.ndarray, j: int, selection: list[np.ndarray]) -> np.ndarray:
        """A member's values of dense shard j (what it sends to owner j)."""
        return np.asarray(flat, dtype=FLOAT32)[self.dense_index(j, selection)]

    def scatter(self, flat: np.ndarray, j: int, selection: list[np.ndarray], dense: np.ndarray) -> None:
        """Write dense shard j's averaged values back into ``flat`` in place."""
        flat[self.dense_index(j, selection)] = dense

    def shard_elements(self, j: int) -> np.ndarray:
        """All flat indices whose values row shard j and whole shard j cover (selected or not)."""
        full = [np.arange(p.lo, p.hi, dtype=np.int64) for p in self.pieces(j)]
        return self.dense_index(j, full)

    def fingerprint(self) -> tuple:
        """What an EF21M state (h, e: per element) is valid for: the tensor shapes alone, not the group size or
        ratio (see EF21M.begin)."""
        return self.shapes


def ratio_formula(layout: TopKLayout) -> float:
    """Values sent per element of the layout by one member in one average, relative to a dense fp32 all-reduce
    (reduce-scatter + all-gather both count (n-1)/n of their vector): sketch reduce-scatter only, then the
    dense rows both ways; the selection bodies (bits) are left out."""
    n = layout.n
    dense = 2 * layout.dense_length * (n - 1) / n
    sketch = layout.sketch_length * (n - 1) / n
    return (dense + sketch) / (2 * layout.length * (n - 1) / n) if layout.length else 0.0


class EF21M:
    """EF21 with momentum, per member, over the flat vector (all tensors at once; state per tensor is the
    tensor's slice), with every averaged row anchored to the values it averages:

        h = (1 - eta) h + eta g   (h = g on the first round after a reset)
        v = h - u                 (what is sketched: how far this member's h is from the group's estimate)
        the selected rows of h are averaged (not of v)
        u = the average of h where it arrived, unchanged elsewhere (u: the optimizer's update direction)

    EF21M's error state e (what the "server" holds of this member) is u itself: the rows' stored estimate is the
    group's average, so the sketched mean of v is mean_j h_j - u, the error of the estimate every member applies.

    Without loss and in a fixed group this is EF21M exactly: textbook EF21M keeps u = mean_j e_j with e_j = h_j on
    every row sent, so its mean_j (h_j - e_j) is mean_j h_j - u, the same sketched mean, the same rows, and
    u + mean_j C(v_j) = mean_j h_j on them. It differs where members' states part: a textbook member whose
    all-gather range was lost, or whose group changed, carries the difference in u for as long as the row goes
    unselected, and adds every later increment on top of it. Here every row that arrives is the group's mean again.

    Under loss the rule matters. An average whose reduce-scatter lost a member's datagram is the mean of the
    others: unbiased, but it stays in u for as long as the row goes unselected (about 1 / ratio rounds), where a
    dense average's error lasts one round. With e = u the score sees that error (mean_j h_j - u), and the row comes
    back when it is among the largest; with e_j = h_j such a row looks fresh to every member (in the demo under
    --loss 0.1 that cost twice the final loss over fp32: README). Where the member's own average was lost, u keeps
    the last average it had, and so v keeps asking for the row; where it never learnt a shard's selection it sent
    nothing, and u keeps the last average too. So u only ever holds group averages, some older than others.
    h is the member's own and u holds averages of whatever group it was in, so a group change keeps both; a new
    layout (``key``) resets everything.

    An element of u that no average has refreshed for ``max_age`` rounds is reset to 0 (counted in ``aged_out``):
    whatever got into u (an average a member poisoned, a row whose selection never reached this member) is not
    applied by the optimizer for ever, and v = h - 0 asks for the row again.
    """

    def __init__(self, eta: float = 0.1, max_age: int = DEFAULT_MAX_AGE) -> None:
        if not 0.0 < eta <= 1.0:
            raise ValueError(f"eta must be in (0, 1], got {eta}")
        if type(max_age) is not int or not 1 <= max_age <= 255:
            raise ValueError(f"max_age must be an integer in [1, 255] (rounds), got {max_age!r}")
        self.eta = np.float32(eta)
        self.max_age = max_age
        self.key: object = None
        self.h: np.ndarray | None = None
        self.u: np.ndarray | None = None
        self.age: np.ndarray | None = None  # per element: rounds since u was last refreshed (up to max_age)
        self.aged_out = 0  # elements of u reset to 0 for want of a refresh

    @property
    def e(self) -> np.ndarray | None:
        """EF21M's error state: the group's estimate, u (see the class)."""
        return self.u

    def reset(self) -> None:
        self.key = None
        self.h = self.u = self.age = None

    def begin(self, grad: np.ndarray, key: object) -> np.ndarray:
        """Fold this round's gradient into h; returns v = h - u, the vector to sketch. ``key`` names the layout (a
        different one resets the state). The rows selected are then averaged from ``self.h``."""
        g = np.asarray(grad, dtype=FLOAT32)
        if key != self.key or self.h is None or self.h.shape != g.shape:
            self.key = key
            self.h = g.copy()
            self.u = np.zeros_like(g)
            self.age = np.zeros(g.shape, dtype=np.uint8)
        else:
            self.h *= np.float32(1) - self.eta
            self.h += self.eta * g
        return self.h - self.u

    def finish(self, *, got: np.ndarray, avg: np.ndarray) -> np.ndarray:
        """Apply one average of h's selected rows: ``got`` marks the elements whose averaged value arrived (the
        owner's own shard included), ``avg`` holding them. Returns u (a view: copy to keep)."""
        if self.h is None or self.u is None or self.age is None:
            raise RuntimeError("EF21M.finish before begin")
        self.u[got] = avg[got]
        age = self.age
        np.add(age, 1, out=age, where=age < self.max_age)
        age[got] = 0
        stale = age >= self.max_age
        if stale.any():
            stale &= self.u != 0  # (what aged out before is 0 already)
            self.aged_out += int(np.count_nonzero(stale))
            self.u[stale] = 0.0
        return self.u
