"""Averaging groups of cores fed block by block, the way the native receive path hands datagrams over."""

from __future__ import annotations

import random

import numpy as np

from peerd.allreduce import GroupAverage

from .groups import AG_END, RS_END


def _feed_rows(core: GroupAverage, sender: int, mtype: int, rows: list[bytes], now: float) -> None:
    for body in rows:
        core.receive(sender, mtype, body, now)


def _average(cores: list[GroupAverage], loss: float, seed: int, blocks: bool = True) -> list[np.ndarray]:
    """Run a group to the end, blocks through ``receive_block`` (body by body where it declines, or always without
    ``blocks``), ``loss`` of the bodies lost; returns copies of the results."""
    rnd = random.Random(seed)
    now = 0.0
    for _ in range(10_000):
        if all(c.finished for c in cores):
            break
        now += 0.3
        for i, core in enumerate(cores):
            for blk in core.blocks_to_send(4, 10**9):
                kept = [r for r in blk.whole() for _ in range(blk.repeat) if rnd.random() >= loss]
                if not kept:
                    continue
                arr = np.stack(kept)
                if (not blocks or blk.type in (RS_END, AG_END)
                        or cores[blk.to].receive_block(i, blk.type, arr, now) is None):
                    _feed_rows(cores[blk.to], i, blk.type, [bytes(r) for r in kept], now)
        for core in cores:
            core.handle_timer(now)
    assert all(c.finished for c in cores)
    return [c.result().copy() for c in cores]
