"""The replay window's block operations in C (peerd/_dataplane/replay.c) against the Python reference
(peerd.wire.replay.ReplayWindow): for any window state and any block of sequence numbers, the same verdicts and the
same window afterwards; and every bound refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from peerd.wire.envelope import HEADER_SIZE, SEQ_OFFSET
from peerd.wire.native import native
from peerd.wire.replay import ReplayWindow

pytestmark = pytest.mark.skipif(getattr(native, "replay_check", None) is None,
                                reason="the native extension is not built")

ROW = HEADER_SIZE + 16  # a header, then a body the window never reads


def _block(seqs: list[int]) -> np.ndarray:
    rows = np.zeros((len(seqs), ROW), dtype=np.uint8)
    for i, s in enumerate(seqs):
        rows[i, SEQ_OFFSET : SEQ_OFFSET + 8] = np.frombuffer(s.to_bytes(8, "big"), dtype=np.uint8)
    return rows


def _window(size: int, history: list[list[int]]) -> ReplayWindow:
    w = ReplayWindow(size)
    for block in history:
        seqs = np.array(block, dtype=np.uint64)
        ok = w.would_accept_block(seqs)
        w.accept_block(seqs[ok])
    return w


def _copy(w: ReplayWindow) -> ReplayWindow:
    c = ReplayWindow(w.size)
    c.highest = w.highest
    c.ring[:] = w.ring
    return c


SEQ = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1), st.integers(2**64 - 50, 2**64 - 1))


@settings(max_examples=300, deadline=None)
# the last sequence number: the advance's end slot, (newest + 1) % size, must not wrap newest + 1 to 0 (that
# cleared the whole ring, and with it the mark of 2**64 - 2)
@example(size=3, history=[[2**64 - 2]], block=[2**64 - 1], fails=[])
@given(size=st.sampled_from([1, 3, 8, 64, 8192]), history=st.lists(st.lists(SEQ, min_size=1, max_size=12), max_size=4),
       block=st.lists(SEQ, min_size=1, max_size=80), fails=st.lists(st.booleans(), max_size=80))
def test_same_verdicts_and_the_same_window_afterwards(size: int, history: list[list[int]], block: list[int],
                                                      fails: list[bool]) -> None:
    ref = _window(size, history)
    c = _copy(ref)
    rows = _block(block)
    ok = ref.would_accept_block(np.array(block, dtype=np.uint64))
    mask = np.full(len(block), 7, dtype=np.uint8)
    replays = native.replay_check(c.ring, c.highest, rows, 0, ROW, len(block), mask)
    assert mask.tolist() == ok.astype(np.uint8).tolist()
    assert replays == len(block) - int(ok.sum())
    # some of the passed rows fail authentication: only the rest are accepted
    for i, bad in enumerate(fails[: len(block)]):
        if bad:
            ok[i] = False
            mask[i] = 0
    ref.accept_block(np.array(block, dtype=np.uint64)[ok])
    c.highest = native.replay_accept(c.ring, c.highest, rows, 0, ROW, len(block), mask)
    assert c.highest == ref.highest
    assert c.ring.tolist() == ref.ring.tolist()


def test_long_blocks_out_of_order_keep_each_repeats_first_row() -> None:
    """Past 64 rows the repeats are found by sorting: still the first row of each sequence is the one kept."""
    rng = np.random.default_rng(1)
    block = [int(x) for x in rng.integers(0, 300, 500)]
    w = ReplayWindow(8192)
    ok = w.would_accept_block(np.array(block, dtype=np.uint64))
    mask = np.empty(len(block), dtype=np.uint8)
    native.replay_check(w.ring, w.highest, _block(block), 0, ROW, len(block), mask)
    assert mask.tolist() == ok.astype(np.uint8).tolist()


def test_every_bound_is_refused() -> None:
    w = ReplayWindow(64)
    rows = _block([1, 2, 3])
    mask = np.empty(3, dtype=np.uint8)
    bad = [
        (w.ring, w.highest, rows, 0, ROW, 4, mask),  # more rows than src holds
        (w.ring, w.highest, rows, ROW, ROW, 3, mask),  # from an offset past the first row
        (w.ring, w.highest, rows, -1, ROW, 3, mask),
        (w.ring, w.highest, rows, 0, -ROW, 3, mask),
        (w.ring, w.highest, rows, 0, ROW, 3, mask[:2]),  # a short mask
        (w.ring, w.highest, rows, 0, ROW, -1, mask),
        (w.ring[:0], w.highest, rows, 0, ROW, 3, mask),  # an empty window
        (w.ring, -2, rows, 0, ROW, 3, mask),  # highest is -1 or a sequence
        (w.ring, 2**64, rows, 0, ROW, 3, mask),
        (w.ring, "1", rows, 0, ROW, 3, mask),
        (bytes(64), w.highest, rows, 0, ROW, 3, mask),  # a read-only window
        (w.ring, w.highest, rows[:1, :SEQ_OFFSET + 7], 0, ROW, 1, mask),  # a row too short for its sequence
    ]
    for args in bad:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            native.replay_check(*args)
    with pytest.raises((ValueError, TypeError)):
        native.replay_check(w.ring, w.highest, rows, 0, ROW, 3, bytes(3))  # check writes its mask
    assert native.replay_accept(w.ring, -1, rows, 0, ROW, 3, bytes([1, 0, 1])) == 3
    assert w.ring[1] and not w.ring[2] and w.ring[3]
