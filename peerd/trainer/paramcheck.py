"""Parameter averages that would change nothing are skipped: a cheap check round first.

A parameter average pulls replicas back together after rounds that left one on its own values for a range. When
every gradient round since the last one ended on the group's common result, the replicas are bit-identical and
the average (the whole model in float32, the slowest round of a run: 0.8-0.9 s of a 0.55 s step in the GPT demo on
100 Mbit/s links) hands every member back what it had. So before it, the group averages a check vector: the bits
of a hash of each member's parameters as 0.0 and 1.0, repeated so that every owner's shard holds every bit
(``check_vector``). Averaged exactly (float32, no codec, no robust step, equal weights), a bit comes out 0.0 or
1.0 only where every contribution to that range agreed on it, and every owner's own contribution always counts in
its own shard. So a member whose complete result (every owner's shard arrived) equals its own check vector
holds the parameters of every owner in the group, and keeps them: the average is skipped (``identical``).

Members decide alone, and a skip only ever keeps a member's own parameters: a member that lies in the check
(values that make an owner's shard echo another member's bits) can at most make an honest member keep its own
parameters for one period, or send the others into the full average without it. A check group smaller than the
session's last gradient group (a member missed it) is never taken for agreement: everyone averages as before.

Replicas that are merely close skip it too, where the session's codec would add more than it removes. Once a
replica has missed one round (a member that averaged alone after a long pause, an incomplete round), its optimizer
moments stay apart from the others' for a few hundred steps, so its parameters are never bit-identical again, and
every later average would run in full: each one moves the replicas by the little their moments still drift apart
(their gradients are the group's, so that distance does not grow), and rounds every parameter to the codec's grid
(int8: up to a step of (max - min) / 255 per group of 128, on every parameter). So the check vector also holds a
sketch of the parameters (``SKETCH`` signed sums over a fixed random partition of them, whose squared distance
between two replicas estimates their squared distance), its squared norm and the squared rounding noise of an
average of these parameters (``rounding_noise``). From the averages every member reads the same verdict: the
members' summed squared distance from their mean, n (mean |s|^2 - |mean s|^2), against the mean squared noise;
where the first is no larger, the whole group keeps its parameters (``close``), so no member is left to average
alone. With fp32 parameter averages (no rounding) only identical replicas skip.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

import numpy as np

from ..moshpit.service import RoundResult
from .records import MAX_GROUP

DIGEST_BYTES = 8  # 64 bits of blake2b over the parameters: a chance collision is 2^-64
BITS = 8 * DIGEST_BYTES
SKETCH = 64  # signed sums in the sketch: its squared distance estimates the parameters' within about sqrt(2/64)
UNIT = BITS + SKETCH + 2  # the hash's bits, the sketch, its squared norm, the squared rounding noise
# Shard j of L elements among n members is [j L / n, (j + 1) L / n): with L = UNIT (MAX_GROUP + 1), every
# shard of a group of up to MAX_GROUP has at least UNIT consecutive elements, i.e. every position of the unit once.
CHECK_ELEMENTS = UNIT * (MAX_GROUP + 1)
CHECK_SHARE = 0.25  # of the step's timeout: the most the check round may take (it normally takes a round trip)
SKETCH_SEED = 0x5EE7C4  # the partition and signs: the same for every replica of the same size
GROUP = 128  # values per scale in the integer codecs by default (compress.quant)
# the rounding an average adds, per value: int codecs' levels; fp16/bf16 as a relative half-ulp
LEVELS = {"int8": 255, "int4": 15}
HALF_ULP = {"fp16": 2.0**-11, "bf16": 2.0**-8}


@lru_cache(maxsize=4)
def _partition(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each parameter's bucket and sign in the sketch: fixed for a size, so every replica draws the same."""
    rng = np.random.default_rng([SKETCH_SEED, n])
    return rng.integers(0, SKETCH, n), rng.choice(np.array([-1.0, 1.0]), n)


def sketch(params: np.ndarray) -> np.ndarray:
    """SKETCH signed sums over a fixed random partition of the parameters (a count sketch): for two replicas,
    the expected squared distance of their sketches is the squared distance of their parameters."""
    flat = np.asarray(params, dtype=np.float32).reshape(-1)
    buckets, signs = _partition(flat.size)
    return np.bincount(buckets, weights=signs * flat, minlength=SKETCH).astype(np.float32)


def check_vector(params: np.ndarray, noise: float = 0.0) -> np.ndarray:
    """The check round's vector for these parameters: their hash's bits, 0.0 or 1.0, their sketch, its squared
    norm and ``noise`` squared (``rounding_noise``), the unit repeated to CHECK_ELEMENTS."""
    flat = np.ascontiguousarray(params, dtype=np.float32).reshape(-1)
    digest = hashlib.blake2b(flat.view(np.uint8).data, digest_size=DIGEST_BYTES).digest()
    bits = np.unpackbits(np.frombuffer(digest, dtype=np.uint8)).astype(np.float32)
    s = sketch(flat)
    norm2 = float(np.dot(s.astype(np.float64), s.astype(np.float64)))
    return np.tile(np.concatenate([bits, s, np.array([norm2, noise * noise], dtype=np.float32)]), MAX_GROUP + 1)


def rounding_noise(params: np.ndarray, codec: str | None, group: int = GROUP) -> float:
    """The norm of the rounding an average in ``codec`` (int codecs: ``group`` values per scale) adds to these
    parameters (0.0 for fp32 and anything unknown): stochastic rounding to a grid of step h adds a variance of
    about h^2 / 6 per value."""
    flat = np.asarray(params, dtype=np.float32).reshape(-1)
    if codec in LEVELS:
        full = flat.size // group * group
        groups = [flat[:full].reshape(-1, group)] + ([flat[full:][None, :]] if full < flat.size else [])
        var = sum(float(((g.max(axis=1) - g.min(axis=1)).astype(np.float64) ** 2).sum()) * g.shape[1]
                  for g in groups) / LEVELS[codec] ** 2 / 6.0
        return math.sqrt(var)
    if codec in HALF_ULP:
        return HALF_ULP[codec] * float(np.linalg.norm(flat.astype(np.float64))) / math.sqrt(3.0)
    return 0.0


def _agreed(result: RoundResult, probe: np.ndarray, last_group: int) -> bool:
    """A check result that can say anything: averaged with at least one other member and at least as many as the
    session's last gradient group (``last_group``; 0: none yet), complete, and of the probe's shape."""
    return (result.outcome == "averaged" and result.complete and result.group_size >= max(2, last_group)
            and result.vector.shape == probe.shape)


def identical(result: RoundResult, probe: np.ndarray, last_group: int) -> bool:
    """Whether the check round shows every member of its group holding this member's parameters: a result that
    can say (``_agreed``) and equal to ``probe`` in every bit of every copy of the hash. (Only the bits: a float32
    mean of equal sketch values can differ from them in the last place.)"""
    if not _agreed(result, probe, last_group):
        return False
    return bool(np.array_equal(result.vector.reshape(-1, UNIT)[:, :BITS], probe.reshape(-1, UNIT)[:, :BITS]))


def spread(result: RoundResult) -> tuple[float, float]:
    """(the members' summed squared distance from their mean, the mean squared rounding noise) as the averaged
    sketches say, the same for every member that holds the same result: per copy of the unit, n times its
    variance, mean |s|^2 - |mean s|^2, and the median over the copies. (Each datagram range of a copy is the
    average of the contributions that reached its owner: a copy across two ranges that different members reached
    mixes two means and reads far too high, one whose range missed a member reads that member's part too low; at
    a few per cent of lost contributions both are a minority of the copies.)"""
    units = result.vector.reshape(-1, UNIT).astype(np.float64)
    if not np.isfinite(units).all():
        return math.inf, 0.0
    s = units[:, BITS:BITS + SKETCH]
    variance = units[:, BITS + SKETCH] - (s * s).sum(axis=1)
    noise2 = units[:, -1]
    return float(result.group_size * max(0.0, float(np.median(variance)))), float(max(0.0, np.median(noise2)))


def close(result: RoundResult, probe: np.ndarray, last_group: int) -> bool:
    """Whether the group's parameters lie nearer their average than the rounding an average would add: every
    member keeps its own (the mean noise 0.0, as with fp32: never)."""
    if not _agreed(result, probe, last_group):
        return False
    distance2, noise2 = spread(result)
    return noise2 > 0.0 and distance2 <= noise2
