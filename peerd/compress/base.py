"""The codec interface the averaging core uses (protocol/codecs.md).

A codec turns one datagram range of the flat float32 vector into a self-contained body and back. The core needs
four things from it, and only these: the body size of a range (``body_size``), the largest range that fits a
payload (``max_count``), encode (one range, or a block of consecutive equal ranges), and a decode that validates
every byte it reads and raises ``CodecError`` on anything malformed (the daemon counts it as a dropped datagram).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from ..wire.errors import WireError
from .rounding import RoundingKey

FLOAT32 = np.dtype("<f4")
MAX_COUNT = 0xFFFF  # the tensor header's u16 element count
_BLOCK_ELEMENTS = 1 << 16  # elements per numpy pass in the block paths (keeps temporaries in cache)


def decode_natively(bodies: np.ndarray, count: int, decode: Callable[[np.ndarray, np.ndarray, np.ndarray], object]
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """((rows, count) float32, (rows,) ok) from a native decoder ``decode(bodies, values, ok)`` (ok as bytes), or
    None where the rows do not lie as the extension takes them (each contiguous, ``strides[0]`` apart)."""
    rows = bodies.shape[0]
    if rows == 0 or bodies.strides[1] != 1 or bodies.strides[0] < bodies.shape[1]:
        return None
    values = np.empty((rows, count), dtype=FLOAT32)
    ok = np.empty(rows, dtype=np.uint8)
    decode(bodies, values, ok)
    return values, ok.view(bool)


class CodecError(WireError):
    """A body that must be dropped: wrong size, a non-finite or non-positive scale, a nonzero padding nibble."""

    def __init__(self, detail: str) -> None:
        super().__init__("malformed", detail)


class Codec(ABC):
    """One encoding of float32 ranges. Subclasses are immutable; ``wire_id`` is the tensor header's codec byte."""

    name: str
    wire_id: int
    stochastic: bool = False  # True when encode needs a RoundingKey

    @abstractmethod
    def body_size(self, count: int) -> int:
        """Bytes of the body of a range of ``count`` elements (the tensor header not included)."""

    def max_count(self, payload: int, limit: int = MAX_COUNT) -> int:
        """The largest count (at most ``limit``) whose body fits ``payload`` bytes; 0 when not even one fits."""
        lo, hi = 0, limit
        while lo < hi:  # body_size is monotonic; 16 steps at most
            mid = (lo + hi + 1) // 2
            if self.body_size(mid) <= payload:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @abstractmethod
    def _encode_rows(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        """(rows, count) finite float32 -> (rows, body_size(count)) uint8; row i is the range at
        ``offset + i * count``."""

    @abstractmethod
    def _decode_rows(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, body_size(count)) uint8 -> ((rows, count) float32, (rows,) bool ok). Rows not ok are zero."""

    # -- the public, checked entry points --------------------------------------------------------------------

    def encode(self, values: np.ndarray, *, key: RoundingKey | None = None, offset: int = 0) -> bytes:
        """One body for the range of ``values`` starting at element ``offset`` of the flat vector.

        Raises ValueError (a local bug, not network input) on a non-finite value, a value the codec cannot hold,
        or a stochastic codec without a key."""
        v = np.ascontiguousarray(values, dtype=FLOAT32).reshape(1, -1)
        return self.encode_block(v, key=key, offset=offset).tobytes()

    def encode_block(self, values: np.ndarray, *, key: RoundingKey | None = None, offset: int = 0) -> np.ndarray:
        """Bodies for consecutive ranges of equal length: ``values`` is (rows, count), row i starting at element
        ``offset + i * count``. Returns (rows, body_size(count)) uint8."""
        v = np.ascontiguousarray(values, dtype=FLOAT32)
        if v.ndim != 2 or v.shape[1] < 1:
            raise ValueError(f"encode_block takes (rows, count >= 1) values, got shape {v.shape}")
        if self.stochastic and key is None:
            raise ValueError(f"{self.name} rounds stochastically and needs a RoundingKey")
        if offset < 0 or offset + v.size > 1 << 32:
            raise ValueError(f"elements [{offset}, {offset + v.size}) do not fit u32 offsets")
        rows, count = v.shape
        out = np.empty((rows, self.body_size(count)), dtype=np.uint8)
        step = max(1, _BLOCK_ELEMENTS // count)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            chunk = v[a:b]
            if not np.isfinite(chunk).all():
                raise ValueError(f"{self.name}: refusing to encode a non-finite value")
            out[a:b] = self._encode_rows(chunk, key, offset + a * count)
        return out

    def decode(self, body: bytes | memoryview | np.ndarray, count: int) -> np.ndarray:
        """The ``count`` float32 values of one body; CodecError unless every byte of it is valid."""
        raw = np.frombuffer(body, dtype=np.uint8) if not isinstance(body, np.ndarray) else body.reshape(-1)
        values, ok = self.decode_block(raw.reshape(1, -1), count)
        if not ok[0]:
            raise CodecError(f"{self.name} body fails validation (non-finite or non-positive scale or value, "
                             "or nonzero padding)")
        return values[0]

    def decode_block(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """A block of bodies, each of a range of ``count`` elements: ((rows, count) float32, (rows,) ok).

        Raises CodecError when the block's width is not ``body_size(count)`` (the sizes are checked before
        anything is allocated); a row that fails the per-row checks comes back zero with ok False, so the
        caller drops and counts exactly that datagram."""
        if not isinstance(count, (int, np.integer)) or not 1 <= count <= MAX_COUNT:
            raise CodecError(f"element count {count!r} out of 1..{MAX_COUNT}")
        if bodies.ndim != 2 or bodies.dtype != np.uint8:
            raise CodecError(f"bodies must be a (rows, bytes) uint8 block, got {bodies.dtype} {bodies.shape}")
        count = int(count)
        rows, size = bodies.shape
        want = self.body_size(count)
        if size != want:
            raise CodecError(f"{self.name} body of {size} bytes for {count} elements; it must be {want}")
        values = np.empty((rows, count), dtype=FLOAT32)
        ok = np.empty(rows, dtype=bool)
        step = max(1, _BLOCK_ELEMENTS // count)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            values[a:b], ok[a:b] = self._decode_rows(bodies[a:b], count)
        return values, ok

    # -- a shard cut into datagram ranges ----------------------------------------------------------------------

    def encode_ranges(self, values: np.ndarray, per: int, *, key: RoundingKey | None = None,
                      offset: int = 0) -> list[bytes]:
        """The bodies of a shard starting at ``offset``, cut into ranges of ``per`` elements (the last fewer),
        exactly as the layout cuts it (protocol/allreduce.md, "Shards and ranges")."""
        v = np.ascontiguousarray(values, dtype=FLOAT32).reshape(-1)
        full = len(v) // per
        out: list[bytes] = []
        if full:
            block = self.encode_block(v[: full * per].reshape(full, per), key=key, offset=offset)
            out.extend(bytes(row) for row in block)
        if len(v) > full * per:
            out.append(self.encode(v[full * per:], key=key, offset=offset + full * per))
        return out

    def roundtrip(self, values: np.ndarray, per: int, *, key: RoundingKey | None = None,
                  offset: int = 0) -> np.ndarray:
        """What every receiver decodes from ``encode_ranges`` of the same arguments: the value an owner keeps
        as its own all-gather result, so that replicas agree bit for bit."""
        v = np.ascontiguousarray(values, dtype=FLOAT32).reshape(-1)
        out = np.empty_like(v)
        full = len(v) // per
        if full:
            block = self.encode_block(v[: full * per].reshape(full, per), key=key, offset=offset)
            dec, _ = self.decode_block(block, per)
            out[: full * per] = dec.reshape(-1)
        if len(v) > full * per:
            tail = len(v) - full * per
            block = self.encode_block(v[full * per:].reshape(1, tail), key=key, offset=offset + full * per)
            dec, _ = self.decode_block(block, tail)
            out[full * per:] = dec.reshape(-1)
        return out

    def __repr__(self) -> str:
        return f"<codec {self.name}>"
