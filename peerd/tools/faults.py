"""Fault injection for demos and benches: a member that corrupts its own averaging contributions.

``ByzantineGroupAverage`` wraps the averaging core from outside: it takes the blocks an honest
``GroupAverage`` hands out and rewrites its reduce-scatter contributions before they leave, so the core
itself never knows it is being used to attack. Its own shard and its all-gather stay honest. The daemon gets
it only through ``peerd join --fault-byzantine MODE`` (a hidden lab flag), as a ``group_factory``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..allreduce.frames import F32_DTYPE, HEADER_SIZE, BodyType
from ..allreduce.group import GroupAverage, OutBlock
from ..compress import PHASE_RS, RoundingKey

# "scale": x1000; "signflip": x-1; "nan": NaN everywhere; "random": gaussian noise of NOISE times the vector's
# RMS; "inflate-signflip": x-1 claiming WEIGHT samples in every reduce-scatter header (weight inflation: without a
# weight bound the owner's average becomes the attacker's negated vector).
MODES = ("scale", "signflip", "nan", "random", "inflate-signflip")
SCALE = 1000.0
NOISE = 100.0  # times the vector's RMS
WEIGHT = float(2**24)  # samples an "inflate-signflip" member claims: the default max_weight
_WEIGHT_AT = HEADER_SIZE - 4  # the header's last field, f32: the sender's weight in reduce-scatter bodies
_OFFSET_AT = slice(9, 13)
_COUNT_AT = slice(13, 15)
_RS_DATA, _RS_END = int(BodyType.RS_DATA), int(BodyType.RS_END)

log = logging.getLogger("peerd.allreduce")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"byzantine mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class ByzantineGroupAverage(GroupAverage):
    """An honest ``GroupAverage`` whose outgoing reduce-scatter blocks are corrupted as ``mode`` says."""

    def __init__(self, *args: Any, mode: str, **kwargs: Any) -> None:
        self.mode = check_mode(mode)
        super().__init__(*args, **kwargs)
        self._key = RoundingKey(self.options.run, self.group_id, self.index, PHASE_RS)
        # the member's own values, read as the core reads them (when a block is made): a codec's bodies are
        # encoded from the corrupted values, as a hostile member would, not from a decoded honest body
        self._vector = np.asarray(args[3] if len(args) > 3 else kwargs["vector"])
        self._noise_rms = 0.0
        self._noise: np.random.Generator | None = None
        if mode == "random":
            vec = self._vector.astype(np.float64)
            rms = math.sqrt(float(np.mean(np.square(vec)))) if len(vec) else 0.0
            self._noise_rms = NOISE * (rms if math.isfinite(rms) and rms > 0 else 1.0)
            self._noise = np.random.default_rng((self.group_id, self.index))
        log.warning("BYZANTINE FAULT INJECTION: this node corrupts its own reduce-scatter contributions (%s)"
                    " in group %#x; for demos and benchmarks only", mode, self.group_id)

    def blocks_to_send(self, rows: int, limit: int, now: float | None = None) -> list[OutBlock]:
        out = []
        for block in super().blocks_to_send(rows, limit, now):
            if block.type == _RS_DATA:
                block = self._corrupt_block(block)
            elif block.type == _RS_END and self.mode == "inflate-signflip":
                block = block._replace(bodies=_claim(block.bodies))
            if len(block.bodies):
                out.append(block)
        return out

    def _corrupt(self, values: np.ndarray) -> np.ndarray:
        """What a hostile member would send instead of ``values`` (rows of float32)."""
        with np.errstate(over="ignore"):
            if self.mode == "scale":
                return values * np.float32(SCALE)
            if self.mode in ("signflip", "inflate-signflip"):
                return -values
            if self.mode == "nan":
                return np.full_like(values, np.nan)
            assert self._noise is not None
            return (self._noise.standard_normal(values.shape) * self._noise_rms).astype(F32_DTYPE)

    def _corrupt_block(self, block: OutBlock) -> OutBlock:
        heads = block.bodies if self.mode != "inflate-signflip" else _claim(block.bodies)
        if block.values is not None:  # split: headers apart from the float32 values
            return block._replace(bodies=heads, values=self._corrupt(np.asarray(block.values, F32_DTYPE)))
        width = heads.shape[1] - HEADER_SIZE
        count = int.from_bytes(heads[0, _COUNT_AT].tobytes(), "little")
        if self.codec.wire_id == 0:  # fp32 bodies: the values follow the header
            values = np.ascontiguousarray(heads[:, HEADER_SIZE:]).view(F32_DTYPE)
            out = heads.copy()
            out[:, HEADER_SIZE:] = np.ascontiguousarray(self._corrupt(values), F32_DTYPE).view(np.uint8)
            return block._replace(bodies=out)
        offsets = [int.from_bytes(heads[i, _OFFSET_AT].tobytes(), "little") for i in range(len(heads))]
        own = np.stack([np.asarray(self._vector[o : o + count], F32_DTYPE) for o in offsets])
        bad = self._corrupt(own)
        out = heads.copy()
        keep = np.ones(len(heads), dtype=bool)
        for i, offset in enumerate(offsets):  # a row the codec cannot encode (NaN, out of range) is not sent
            try:
                body = self.codec.encode_block(bad[i : i + 1], key=self._key, offset=offset)[0]
            except ValueError:
                keep[i] = False
                continue
            out[i, HEADER_SIZE : HEADER_SIZE + width] = body
        return block._replace(bodies=out if keep.all() else out[keep])


def _claim(bodies: np.ndarray) -> np.ndarray:
    """The bodies with WEIGHT written into every header's weight field."""
    out = bodies.copy()
    out[:, _WEIGHT_AT:HEADER_SIZE] = np.frombuffer(np.float32(WEIGHT).astype("<f4").tobytes(), np.uint8)
    return out


def byzantine(mode: str | None) -> Callable[..., GroupAverage]:
    """A ``group_factory`` (AveragingHost, AllreduceService): honest cores for None, else corrupting ones."""
    if mode is None:
        return GroupAverage
    check_mode(mode)

    def factory(*args: Any, **kwargs: Any) -> GroupAverage:
        return ByzantineGroupAverage(*args, mode=mode, **kwargs)

    return factory
