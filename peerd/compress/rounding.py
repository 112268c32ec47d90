"""Seeded stochastic-rounding draws (protocol/codecs.md, "Rounding draws").

Stochastic rounding is unbiased only if its draws are independent across rounds, senders and ranges, and tests
need them exact. So a draw is a pure function of (run, round, sender, phase) and the element's absolute index in
the flat vector: a 64-bit stream key from splitmix64, then one murmur3 ``fmix32`` per element. The 32-bit
per-element hash runs at about four times the speed of a 64-bit one in numpy, and every body of a range draws
the same values however the vector is cut into datagrams.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

M64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15
GOLDEN32 = 0x9E3779B9
DRAW_BITS = 24  # uniforms are k / 2**24: exact in float32, and t + u never rounds up past the next integer
PHASE_RS = 0  # a reduce-scatter body
PHASE_AG = 1  # an all-gather body
PHASE_SKETCH = 2  # arc-topk's shared sketch matrices
_CHUNK = 1 << 18  # elements hashed per numpy pass (keeps temporaries in cache)


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (scalars only: numpy scalars warn on wrap-around)."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def stream_key(run: int, round: int, sender: int, phase: int) -> int:
    """The 64-bit key of one sender's stream in one phase of one round of one run (all inputs u64)."""
    for name, v in (("run", run), ("round", round), ("sender", sender), ("phase", phase)):
        if not 0 <= v <= M64:
            raise ValueError(f"{name}={v} is not a u64")
    k = mix64(run + GOLDEN64)
    k = mix64(k ^ round)
    k = mix64(k ^ sender)
    return mix64(k ^ phase)


@dataclass(frozen=True, slots=True)
class RoundingKey:
    """Who draws: a stochastic encode needs one; ``nearest`` ignores it."""

    run: int
    round: int
    sender: int
    phase: int = PHASE_RS

    @property
    def key(self) -> int:
        return stream_key(self.run, self.round, self.sender, self.phase)


def draw_bits(key: int, start: int, count: int) -> np.ndarray:
    """The 24-bit draws (uint32) of elements [start, start + count) of the stream ``key``."""
    if start < 0 or count < 0 or start + count > 1 << 32:
        raise ValueError(f"elements [{start}, {start + count}) do not fit u32 indices")
    lo = np.uint32(key & 0xFFFFFFFF)
    hi = np.uint32(key >> 32)
    out = np.empty(count, dtype=np.uint32)
    for a in range(0, count, _CHUNK):
        b = min(a + _CHUNK, count)
        z = np.arange(start + a, start + b, dtype=np.uint32)
        z *= np.uint32(GOLDEN32)
        z += lo
        z ^= hi
        z ^= z >> np.uint32(16)
        z *= np.uint32(0x85EBCA6B)
        z ^= z >> np.uint32(13)
        z *= np.uint32(0xC2B2AE35)
        z ^= z >> np.uint32(16)
        z >>= np.uint32(32 - DRAW_BITS)
        out[a:b] = z
    return out


def uniforms(key: int, start: int, count: int) -> np.ndarray:
    """Draws in [0, 1) as float32 (k / 2**24, exact) for elements [start, start + count)."""
    u = draw_bits(key, start, count).astype(np.float32)
    u *= np.float32(2.0**-DRAW_BITS)
    return u
