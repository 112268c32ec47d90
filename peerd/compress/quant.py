"""int8 and int4 bodies: group-wise asymmetric quantization (protocol/codecs.md, "Integer codecs").

After Flash Communication: each group of G consecutive values of a body (default 128; groups restart at every
body, so a lost datagram loses only its own range, and the last group of a body may be short) is sent as a
scale and a min, both fp16, and one code per value, q in 0..L (L = 255 for int8, 15 for int4, two codes a byte,
low nibble first). A receiver computes x = min + q * scale in float32.

The stored min is rounded down and the scale up, so [min, min + L * scale] still covers the group after the
fp16 rounding: that is what keeps stochastic rounding unbiased (no value is clipped). A group whose values are
all equal gets the smallest positive scale, so a valid scale is always finite and > 0.
"""

from __future__ import annotations

import numpy as np

from ..wire.native import native as _native
from .base import FLOAT32, Codec, decode_natively
from .rounding import RoundingKey, uniforms

FLOAT16 = np.dtype("<f2")
SCALE_BYTES = 4  # fp16 scale + fp16 min per group
TINY16 = np.float16(2.0**-24)  # the smallest positive fp16: the scale of a constant group
ROUNDINGS = ("stochastic", "nearest")
MIN_UNHELD = "int codecs: a value beyond the fp16 range of the group min (|x| > 65504)"
SCALE_UNHELD = "int codecs: a group's range exceeds what an fp16 scale can hold"


def group_params(lo: np.ndarray, hi: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """fp16 (scale, min) per group such that float32 min + levels * scale >= hi and min <= lo.

    Raises ValueError when a group cannot be held (its min beyond +-65504, or its range beyond 65504 * levels)."""
    with np.errstate(over="ignore"):
        m = lo.astype(FLOAT16)
    down = m.astype(FLOAT32) > lo
    with np.errstate(over="ignore"):  # +inf (a min beyond 65504) steps down to 65504
        m[down] = np.nextafter(m[down], np.float16(-np.inf))
    if not np.isfinite(m).all():
        raise ValueError(MIN_UNHELD)
    need = (hi.astype(np.float64) - m.astype(np.float64)) / levels
    with np.errstate(over="ignore"):
        s = need.astype(FLOAT16)
    up = s.astype(np.float64) < need
    s[up] = np.nextafter(s[up], np.float16(np.inf))
    s[s < TINY16] = TINY16
    m32 = m.astype(FLOAT32)
    for _ in range(4):  # float32 rounding of min + L * scale may still fall short by an ulp: step the scale up
        short = m32 + np.float32(levels) * s.astype(FLOAT32) < hi
        if not short.any():
            break
        s[short] = np.nextafter(s[short], np.float16(np.inf))
    if not np.isfinite(s).all():
        raise ValueError(SCALE_UNHELD)
    return s, m


class IntCodec(Codec):
    """Group-wise asymmetric integer codes of ``bits`` (8 or 4) bits; see the module docstring."""

    def __init__(self, bits: int, group: int = 128, rounding: str = "stochastic") -> None:
        if bits not in (8, 4):
            raise ValueError(f"int codecs have 8 or 4 bits, not {bits}")
        if not 1 <= group <= 0xFFFF:
            raise ValueError(f"quantization group must be 1..65535 values, got {group}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.bits = bits
        self.group = group
        self.rounding = rounding
        self.levels = (1 << bits) - 1
        self.name = f"int{bits}"
        self.wire_id = 3 if bits == 8 else 4
        self.stochastic = rounding == "stochastic"

    def __repr__(self) -> str:
        return f"<codec {self.name} G={self.group} {self.rounding}>"

    def groups(self, count: int) -> int:
        return -(-count // self.group)

    def code_bytes(self, count: int) -> int:
        return count if self.bits == 8 else (count + 1) // 2

    def body_size(self, count: int) -> int:
        return SCALE_BYTES * self.groups(count) + self.code_bytes(count)

    def _padded(self, a: np.ndarray, count: int) -> np.ndarray:
        """(rows, count) -> (rows * groups, G), the short last group filled with the row's last value (which
        changes neither its min nor its max)."""
        rows = a.shape[0]
        ng = self.groups(count)
        width = ng * self.group
        if width != count:
            p = np.empty((rows, width), dtype=a.dtype)
            p[:, :count] = a
            p[:, count:] = a[:, count - 1 : count]
            a = p
        return a.reshape(rows * ng, self.group)

    def _encode_rows(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        """The native pass where the extension is built (dataplane's quant.c: the same bytes), else numpy."""
        if _native is None:
            return self._encode_rows_numpy(values, key, offset)
        rows, count = values.shape
        out = np.empty((rows, self.body_size(count)), dtype=np.uint8)
        stream = key.key if self.stochastic and key is not None else 0
        why = _native.quant_encode(np.ascontiguousarray(values, dtype=FLOAT32), rows, count, out, self.bits,
                                   self.group, self.stochastic, stream, offset)
        if why:
            raise ValueError(MIN_UNHELD if why == 1 else SCALE_UNHELD)
        return out

    def _decode_rows(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The native pass where the extension is built and the rows lie as it takes them, else numpy."""
        got = None if _native is None else decode_natively(bodies, count, lambda b, v, k: _native.quant_decode(
            b, 0, b.strides[0], len(b), count, self.bits, self.group, v, k))
        return got if got is not None else self._decode_rows_numpy(bodies, count)

    def _encode_rows_numpy(self, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
        rows, count = values.shape
        ng = self.groups(count)
        x = self._padded(values, count)
        # + 0: a group whose min is a zero stores +0 (numpy's min picks either sign of zero, as its SIMD order has it)
        s, m = group_params(x.min(axis=1) + np.float32(0), x.max(axis=1), self.levels)
        inv = np.float32(1.0) / s.astype(FLOAT32)
        t = x - m.astype(FLOAT32)[:, None]
        t *= inv[:, None]
        if self.stochastic:
            u = uniforms(key.key, offset, rows * count).reshape(rows, count)  # type: ignore[union-attr]
            t += self._padded(u, count)
            np.floor(t, out=t)
        else:
            np.rint(t, out=t)
        np.clip(t, 0, self.levels, out=t)
        q = t.astype(np.uint8).reshape(rows, ng * self.group)[:, :count]
        out = np.empty((rows, self.body_size(count)), dtype=np.uint8)
        head = SCALE_BYTES * ng
        sm = np.empty((rows * ng, 2), dtype=FLOAT16)
        sm[:, 0] = s
        sm[:, 1] = m
        out[:, :head] = sm.view(np.uint8).reshape(rows, head)
        if self.bits == 8:
            out[:, head:] = q
        else:
            if count % 2:
                q = np.concatenate((q, np.zeros((rows, 1), dtype=np.uint8)), axis=1)
            out[:, head:] = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
        return out

    def _decode_rows_numpy(self, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        rows = bodies.shape[0]
        ng = self.groups(count)
        head = SCALE_BYTES * ng
        sm = np.ascontiguousarray(bodies[:, :head]).view(FLOAT16).reshape(rows, ng, 2).astype(FLOAT32)
        s = sm[:, :, 0]
        m = sm[:, :, 1]
        ok = (np.isfinite(s) & (s > 0) & np.isfinite(m)).all(axis=1)
        codes = bodies[:, head:]
        if self.bits == 8:
            q = codes
        else:
            q = np.empty((rows, 2 * codes.shape[1]), dtype=np.uint8)
            q[:, 0::2] = codes & np.uint8(0x0F)
            q[:, 1::2] = codes >> np.uint8(4)
            if count % 2:
                ok &= q[:, count] == 0  # the padding nibble
            q = q[:, :count]
        width = ng * self.group
        if width != count:
            qp = np.zeros((rows, width), dtype=np.uint8)
            qp[:, :count] = q
            q = qp
        v = q.reshape(rows, ng, self.group).astype(FLOAT32)
        with np.errstate(invalid="ignore", over="ignore"):  # rows with bad scales are zeroed below
            v *= s[:, :, None]
            v += m[:, :, None]
        out = v.reshape(rows, width)[:, :count]
        if not ok.all():
            out = out.copy()
            out[~ok] = 0.0
        return out, ok

    def step(self, body: bytes | np.ndarray, count: int) -> np.ndarray:
        """Each element's quantization step (its group's scale) in a valid body: for error bounds in tests."""
        raw = np.frombuffer(body, dtype=np.uint8) if not isinstance(body, np.ndarray) else body.reshape(-1)
        self.decode(raw, count)
        ng = self.groups(count)
        s = raw[: SCALE_BYTES * ng].view(FLOAT16).reshape(ng, 2)[:, 0].astype(FLOAT32)
        return np.repeat(s, self.group)[:count]
