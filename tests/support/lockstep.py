"""Two copies of one group fed the same damaged blocks in lock step: one through a native take, one through
receive_block's numpy path (the reference). tests/test_take_native.py (fp32) and tests/test_take_coded.py (int8,
int4) drive it; after every block both copies must hold the same state, and in the end the same result."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from peerd.allreduce import GroupAverage
from peerd.wire.errors import WireError

from .groups import AG_DATA, RS_DATA


def lockstep(a: list[GroupAverage], b: list[GroupAverage], *, rows: int, rnd: random.Random, loss: float, dup: float,
             shuffle: bool, wide: bool, body: int, damage: Callable[[np.ndarray], np.ndarray],
             state: Callable[[GroupAverage], tuple]) -> None:
    """Run ``a`` (native) and ``b`` (reference) to the end on the same blocks: rows lost, duplicated, reordered,
    DATA blocks of ``body`` bytes a row passed through ``damage``, rows inside wider datagrams (``wide``)."""
    n = len(a)
    now = 0.0
    for _ in range(1000):
        if all(c.finished for c in a + b):
            break
        now += 0.3
        for i in range(n):
            for blk_a, blk_b in zip(a[i].blocks_to_send(rows, 10**9), b[i].blocks_to_send(rows, 10**9), strict=True):
                assert blk_a.bodies.tobytes() == blk_b.bodies.tobytes()
                kept = [r for r in blk_a.bodies if rnd.random() >= loss]
                if not kept:
                    continue
                if shuffle and rnd.random() < 0.3:
                    rnd.shuffle(kept)
                if rnd.random() < dup:
                    kept += kept[: rnd.randint(1, len(kept))]
                block = np.array(kept, dtype=np.uint8)
                if blk_a.type in (RS_DATA, AG_DATA) and block.shape[1] == body:
                    block = damage(block)
                if wide:  # rows inside whole datagrams, as a sealed block is opened in place
                    w = np.zeros((len(block), 37 + block.shape[1]), dtype=np.uint8)
                    w[:, 37:] = block
                    block = w[:, 37:]
                x, y = a[blk_a.to], b[blk_b.to]
                if rnd.random() < 0.2:  # every other row first: the whole block then mixes new rows and duplicates
                    assert x.receive_block(i, blk_a.type, block[::2], now) == y.receive_block(i, blk_a.type,
                                                                                              block[::2], now)
                got = [c.receive_block(i, blk_a.type, block, now) for c in (x, y)]
                assert got[0] == got[1]
                if got[0] is not None and rnd.random() < 0.2:  # the block again (part of it new when cut short)
                    again = block[rnd.randrange(len(block)) :] if rnd.random() < 0.5 else block
                    got = [c.receive_block(i, blk_a.type, again, now) for c in (x, y)]
                    assert got[0] == got[1]
                if got[0] is None:  # as the driver does: body by body, each fault counted there
                    errors = []
                    for core in (x, y):
                        for row in block:
                            try:
                                core.receive(i, blk_a.type, row.tobytes(), now)
                            except WireError as e:
                                errors.append(e.reason)
                    assert errors[: len(errors) // 2] == errors[len(errors) // 2 :]
                assert state(x) == state(y)
        for core in a + b:
            core.handle_timer(now)
    for x, y in zip(a, b, strict=True):
        assert x.finished == y.finished
        if x.finished:
            assert np.array_equal(x.result(), y.result(), equal_nan=True)
        sx, sy = x.statistics(), y.statistics()
        assert sx.refused == sy.refused and sx.drops == sy.drops
        assert sx.all_gather.weight_received == pytest.approx(sy.all_gather.weight_received, rel=1e-12)
