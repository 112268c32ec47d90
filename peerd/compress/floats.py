"""fp32, fp16 and bf16 bodies: raw little-endian values, no scales (protocol/codecs.md, "Float codecs").

fp16 and bf16 halve the bytes with round-to-nearest-even; a finite float32 that would become infinite (fp16
beyond 65504, bf16 beyond about 3.39e38) is refused at encode rather than sent as inf, and a decoded non-finite
value is a malformed body: no member can poison an average with inf through a narrower codec.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from ..wire.native import native as _native
from .base import FLOAT32, Codec, decode_natively
from .rounding import RoundingKey

FLOAT16 = np.dtype("<f2")
U16 = np.dtype("<u2")
HALF_OVERFLOW = "fp16: refusing to encode a value beyond the fp16 range (it would be sent as inf)"
BF16_OVERFLOW = "bf16: refusing to encode a value that rounds to inf"


class Float32Codec(Codec):
    """Today's encoding: the values' own bytes."""

    name = "fp32"
    wire_id = 0

    def body_size(self, count: int) -> int:
        return 4 * count

    def _encode_rows(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        return values.astype(FLOAT32, copy=False).view(np.uint8)

    def _decode_rows(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        v = np.ascontiguousarray(bodies).view(FLOAT32).copy()
        ok = np.isfinite(v).all(axis=1)
        v[~ok] = 0.0
        return v, ok


class _Native16(Codec):
    """fp16 and bf16: two bytes a value, made and read in one native pass where the extension is built
    (quant.c's half_encode/half_decode, numpy's bytes; F16C for fp16 where the CPU has it), else by numpy."""

    bf16 = False
    overflow = ""

    def body_size(self, count: int) -> int:
        return 2 * count

    def _encode_rows(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        if _native is None:
            return self._encode_rows_numpy(values, key, offset)
        out = np.empty((values.shape[0], 2 * values.shape[1]), dtype=np.uint8)
        if _native.half_encode(np.ascontiguousarray(values, dtype=FLOAT32), values.size, out, self.bf16):
            raise ValueError(self.overflow)
        return out

    def _decode_rows(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        got = None if _native is None else decode_natively(bodies, count, lambda b, v, k: _native.half_decode(
            b, 0, b.strides[0], len(b), count, v, k, self.bf16))
        return got if got is not None else self._decode_rows_numpy(bodies, count)

    @abstractmethod
    def _encode_rows_numpy(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        """The reference: numpy's rounding and overflow check."""

    @abstractmethod
    def _decode_rows_numpy(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The reference: numpy's conversion and validity check."""


class Float16Codec(_Native16):
    """IEEE binary16, round to nearest even."""

    name = "fp16"
    wire_id = 1
    overflow = HALF_OVERFLOW

    def _encode_rows_numpy(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = values.astype(FLOAT16)
        if not np.isfinite(h).all():
            raise ValueError(HALF_OVERFLOW)
        return h.view(np.uint8)

    def _decode_rows_numpy(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        v = np.ascontiguousarray(bodies).view(FLOAT16).astype(FLOAT32)
        ok = np.isfinite(v).all(axis=1)
        v[~ok] = 0.0
        return v, ok


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of finite float32 values, rounded to nearest even."""
    u = np.ascontiguousarray(values, dtype=FLOAT32).view(np.uint32)
    r = (u >> np.uint32(16)) & np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= np.uint32(16)
    return r.astype(U16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits (exact: bf16 is float32's top half)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(FLOAT32)


class BFloat16Codec(_Native16):
    """bfloat16: float32's exponent range with 8 significant bits, round to nearest even."""

    name = "bf16"
    wire_id = 2
    bf16 = True
    overflow = BF16_OVERFLOW

    def _encode_rows_numpy(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        bits = to_bf16_bits(values)
        if ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
            raise ValueError(BF16_OVERFLOW)
        return bits.view(np.uint8)

    def _decode_rows_numpy(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        bits = np.ascontiguousarray(bodies).view(U16)
        ok = ((bits & np.uint16(0x7F80)) != np.uint16(0x7F80)).all(axis=1)
        v = from_bf16_bits(bits)
        v[~ok] = 0.0
        return v, ok
