"""The numpy and native kernels under one group's averaging: tensor headers, finiteness checks, placing and
summing blocks of bodies, and the float32 finalize (each native call has its numpy reference here, bit for bit).

``native`` is the C data plane where it is built (None: numpy does all of it); tests swap it to compare the two.
"""

from __future__ import annotations

import numpy as np

from ..wire.native import native
from .frames import F32_DTYPE, FP32_WIRE_ID, HEADER, HEADER_SIZE

FINALIZE_BLOCK_ELEMENTS = 1 << 16  # the all-gather divides this many elements at a time (~50 us)
F32_MAX = float(np.finfo(np.float32).max)
# The per-row fields of a tensor header (HEADER): each row's offset and weight, at their byte positions.
_HEAD_ITEM = np.dtype(f"V{HEADER_SIZE}")
_HEAD_FIELDS = np.dtype({"names": ["offset", "weight"], "formats": ["<u4", "<f4"], "offsets": [9, 15],
                         "itemsize": HEADER_SIZE})


def heads(group: int, total: int, offset: int, weight: float | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor headers ``frames.pack_block`` puts before (rows, count) values from element ``offset`` on, alone:
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


def same_heads(bodies: np.ndarray, split: int, end: int) -> bool:
    """Every row's bytes [0, split) and [split + 4, end) are row 0's (the offset, a u32 at ``split``, may differ)."""
    if native_rows(bodies):
        stride = bodies.strides[0]
        return (native.same_lead(bodies, 0, stride, len(bodies), split)
                and native.same_lead(bodies, split + 4, stride, len(bodies), end - split - 4))
    rows = len(bodies)
    return (bodies[:, :split].tobytes() == bodies[0, :split].tobytes() * rows
            and bodies[:, split + 4 : end].tobytes() == bodies[0, split + 4 : end].tobytes() * rows)


def native_rows(bodies: np.ndarray) -> bool:
    """The native data plane takes this block of bodies as it is: a 2-D byte array whose rows are each contiguous
    and ``strides[0]`` apart (a view past the datagrams' envelopes too), no copy."""
    return (native is not None and bodies.dtype == np.uint8 and bodies.ndim == 2 and len(bodies) > 0
            and bodies.strides[1] == 1 and bodies.strides[0] >= bodies.shape[1])


def values_finite(bodies: np.ndarray, length: int) -> bool:
    """No NaN or inf among the float32 values (``length`` bytes after each body's header) of a block: one native
    pass where the extension is built (numpy's check of unaligned float32 is several times slower)."""
    if not native_rows(bodies):
        return bool(np.isfinite(bodies[:, HEADER_SIZE : HEADER_SIZE + length].view(F32_DTYPE)).all())
    return native.first_nonfinite(bodies, HEADER_SIZE, bodies.strides[0], len(bodies), length) < 0


def place(bodies: np.ndarray, dst: np.ndarray, at: int, length: int) -> bool:
    """Copy each body's values (``length`` bytes after its header) into ``dst`` (contiguous) from byte ``at`` on,
    one after the other, in one native pass; False (nothing copied) where the extension is not built or the block
    is not laid out for it, and numpy does it."""
    if not native_rows(bodies):
        return False
    native.place_rows(bodies, HEADER_SIZE, bodies.strides[0], len(bodies), length, dst, at, length)
    return True


def accumulate(bodies: np.ndarray, length: int, acc: np.ndarray, per: int, ks: np.ndarray, filled: np.ndarray,
                factor: float) -> np.ndarray:
    """Add each body's values (``length`` bytes after its header) times ``factor`` (as float32) into the owner's
    float32 sums ``acc`` at range ``ks[i]`` (``per`` elements apart); ``filled`` marks the ranges that hold a sum.
    Per row: 0 added, 1 refused (a NaN or inf), 2 left out (the float32 sum would overflow); such a row changes
    nothing. One native pass where the extension is built; ``accumulate_numpy`` is the reference, bit for bit."""
    if native_rows(bodies) and acc.flags.aligned:
        status = native.accumulate_rows(bodies, HEADER_SIZE, bodies.strides[0], len(bodies), length, acc, 4 * per,
                                         ks, filled, factor)
        return np.frombuffer(status, np.uint8)
    values = np.ascontiguousarray(bodies[:, HEADER_SIZE : HEADER_SIZE + length]).view(F32_DTYPE)
    return accumulate_numpy(values, acc, per, ks, filled, factor)


def finalize_f32(own: np.ndarray, acc: np.ndarray, summed: np.ndarray, got: np.ndarray, weight: float
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


def finalize_native(own: np.ndarray, acc: np.ndarray, summed: np.ndarray, got: np.ndarray, weight: float,
                     out: np.ndarray) -> bool:
    """``_finalize_stream``'s float32 path in one native pass (accum.c finalize_rows; the numpy code after the
    call is the reference, bit for bit): True once ``out`` holds the averages; False where the extension is not
    built, the arrays are not plain contiguous ones, or a value is not finite (nothing written: numpy decides)."""
    if (native is None or not own.flags.c_contiguous or not acc.flags.c_contiguous or not out.flags.c_contiguous
            or not out.flags.writeable or own.dtype != F32_DTYPE or acc.dtype != F32_DTYPE or out.dtype != F32_DTYPE
            or not own.flags.aligned or not acc.flags.aligned or not out.flags.aligned):
        return False
    rows, width = own.shape
    return bool(native.finalize_rows(own, acc, summed, got, weight, out, rows, width))


def accumulate_numpy(values: np.ndarray, acc: np.ndarray, per: int, ks: np.ndarray, filled: np.ndarray,
                      factor: float) -> np.ndarray:
    """``accumulate`` over aligned float32 rows ``values``: the same float32 operations in the same order."""
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


def stage_elements(length: int, n: int, shares: tuple[int, ...] | None = None) -> int:
    """float32 elements of the stage a member of an ``n``-member group averaging ``length`` elements needs (its
    largest shard, once per member; ``shares``: the group's, shards.Layout): what a ``stage`` buffer passed to
    ``GroupAverage`` must hold at least."""
    if n <= 0:
        return 0
    if shares:
        return n * (-(-max(shares) * length // max(1, sum(shares))) + 1)
    return n * (-(-length // n))


def stage_rows(stage: np.ndarray | None, n: int, width: int) -> np.ndarray:
    """(n, width) float32 rows for the stage: a view of ``stage`` when it is a big enough writable contiguous
    float32 buffer, else fresh memory."""
    if stage is None:
        return np.empty((n, width), dtype=F32_DTYPE)
    if (not isinstance(stage, np.ndarray) or stage.dtype != F32_DTYPE or stage.ndim != 1
            or not stage.flags.c_contiguous or not stage.flags.writeable or stage.size < n * width):
        raise ValueError(f"stage must be a writable contiguous 1-D float32 buffer of at least {n * width} elements")
    return stage[: n * width].reshape(n, width)


def one_row(body: bytes) -> np.ndarray:
    return np.frombuffer(body, dtype=np.uint8).reshape(1, -1)

