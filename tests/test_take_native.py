"""take.c take_rows, receive_block's native path, against receive_block's numpy path (the reference).

Two copies of a group run in lock step; one takes blocks natively, the other with the native take switched off.
Blocks are cut from real senders' output and then damaged as a hostile or lossy network would: rows lost,
duplicated, reordered, a header byte changed, a weight changed, a NaN, an inf or a value that overflows the
float32 sum. After every block both copies must hold the same state, and in the end the same result.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.allreduce import HEADER_SIZE, GroupAverage
from peerd.allreduce.group import GROUP_OPTIONS
from peerd.compress import codec
from peerd.wire.native import native as _native

pytestmark = pytest.mark.skipif(_native is None, reason="the native data plane is not built (PEERD_DATAPLANE=python)")

from .support.lockstep import lockstep  # noqa: E402

GROUP = 0x7A4E0001


def _group(n: int, length: int, per: int, seed: int, take: bool, cap: float) -> list[GroupAverage]:
    rng = np.random.default_rng(seed)
    c = codec("fp32")
    cores = [GroupAverage(GROUP, n, i, rng.standard_normal(length).astype(np.float32), 1.0 + i, 0.0,
                          options=replace(GROUP_OPTIONS, floor_s=1.0, codec=c, run=seed, max_weight=cap),
                          max_payload=HEADER_SIZE + c.body_size(per), out=np.zeros(length, np.float32))
             for i in range(n)]
    for core in cores:
        assert core._take  # (plain fp32 into an aligned vector: the native take applies)
        core._take = take
    return cores


def _state(c: GroupAverage) -> tuple:
    rs, ag = c._rs, c._ag
    per = c._per
    summed = np.repeat(c._acc_set[: len(c._acc) // per] != 0, per)  # (the rest of the sums is not written yet)
    return (c._acc[: len(summed)][summed].tobytes(), c._acc_set.tobytes(), c._wsum_in.tobytes(), c._rs_seen.tobytes(),
            [s.tobytes() for s in c._ag_seen], c._out.tobytes(), dict(c._drops), dict(c._refused),
            {k: [(w, v.tobytes()) for w, v in vs] for k, vs in c._aside.items()}, list(c._sender_weight),
            rs.received, rs.top, rs.remaining, rs.open, ag.received, ag.top, ag.remaining, ag.open,
            rs.ended_at, ag.ended_at, c.phase_changes)


def _damage(rows: np.ndarray, rnd: random.Random, per: int) -> np.ndarray:
    """One of the ways a block goes wrong, or none."""
    rows = rows.copy()
    n = len(rows)
    kind = rnd.randrange(9)
    i = rnd.randrange(n)
    if kind == 0:  # a header byte
        rows[i, rnd.randrange(HEADER_SIZE)] ^= 1 << rnd.randrange(8)
    elif kind == 1:  # a NaN or an inf among the values
        v = rows[i, HEADER_SIZE:].view(np.float32)
        v[rnd.randrange(per)] = rnd.choice([np.nan, np.inf, -np.inf])
    elif kind == 2:  # a sum that overflows float32
        v = rows[i, HEADER_SIZE:].view(np.float32)
        v[rnd.randrange(per)] = 3.0e38
    elif kind == 3:  # a weight in every row (the sender's weight is one value)
        rows[:, 15:19] = np.frombuffer(np.float32(rnd.choice([0.5, 7.0, 1e30, -1.0, 0.0])).tobytes(), np.uint8)
    return rows


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 4),
    length=st.integers(1, 400),
    per=st.sampled_from([1, 3, 8, 17]),
    rows=st.sampled_from([2, 5, 9]),
    seed=st.integers(0, 2**16),
    loss=st.sampled_from([0.0, 0.2]),
    dup=st.sampled_from([0.0, 0.3]),
    shuffle=st.booleans(),
    cap=st.sampled_from([1e9, 2.0]),
    wide=st.booleans(),
)
def test_native_take_matches_numpy(n, length, per, rows, seed, loss, dup, shuffle, cap, wide) -> None:
    rnd = random.Random(seed)
    lockstep(_group(n, length, per, seed, True, cap), _group(n, length, per, seed, False, cap), rows=rows, rnd=rnd,
             loss=loss, dup=dup, shuffle=shuffle, wide=wide, body=HEADER_SIZE + 4 * per,
             damage=lambda block: _damage(block, rnd, per), state=_state)


def _args(rows=2, per=4, full=4, mode=0, **over):
    width = HEADER_SIZE + 4 * per
    block = np.zeros((rows, width), np.uint8)
    for i in range(rows):
        block[i, :HEADER_SIZE] = np.frombuffer(
            GROUP.to_bytes(4, "little") + b"\0" + full.to_bytes(4, "little") + (i * per).to_bytes(4, "little")
            + per.to_bytes(2, "little") + np.float32(1.0).tobytes(), np.uint8)
    a = dict(bodies=block, stride=width, rows=rows, mode=mode, group=GROUP, codec=0, per=per, total=full, start=0,
             full=full, known=float("nan"), max_weight=1e9, seen=np.zeros(full, np.uint8),
             dst=np.zeros(full * per, np.float32), dst_base=0, filled=np.zeros(full, np.uint8),
             wsum=np.zeros(full, np.float64), status=np.zeros(rows, np.uint8))
    a.update(over)
    return a


def _call(a: dict):
    return _native.take_rows(**a)


def test_take_rows_takes_a_clean_run() -> None:
    a = _args()
    assert _call(a) == (2, 0, 1, 1.0, 0.0, 0)
    assert a["seen"].tolist() == [1, 1, 0, 0] and a["filled"].tolist() == [1, 1, 0, 0]
    assert _call(a) == (0, 2, -1, 1.0, 0.0, 0)  # the same rows again: duplicates, nothing added
    assert a["status"].tolist() == [3, 3]


@pytest.mark.parametrize("bad", [
    dict(seen=np.zeros(3, np.uint8)),  # fewer ranges than full
    dict(status=np.zeros(1, np.uint8)),  # fewer than rows
    dict(dst=np.zeros(15, np.float32)),  # too short for full ranges
    dict(filled=np.zeros(3, np.uint8)),
    dict(wsum=np.zeros(3, np.float64)),
    dict(dst_base=1),  # the reduce-scatter's sums start at 0
    dict(bodies=np.zeros((1, HEADER_SIZE + 16), np.uint8)),  # fewer rows than ``rows``
    dict(stride=10),  # shorter than a row
    dict(per=0),
    dict(mode=2),
    dict(full=-1),
    dict(dst=np.zeros(16, np.float32)[1:]),  # a view one range short
])
def test_take_rows_refuses_spans_that_do_not_fit(bad) -> None:
    a = _args()
    a.update(bad)
    before = a["dst"].tobytes()
    with pytest.raises(ValueError):
        _call(a)
    assert a["dst"].tobytes() == before


def test_take_rows_refuses_overlapping_buffers() -> None:
    a = _args()
    a["status"] = a["seen"][:2]
    with pytest.raises(ValueError):
        _call(a)
    a = _args(mode=1, dst_base=0)
    a["dst"] = a["bodies"].reshape(-1)[:64].view(np.float32)  # writing into the block it reads
    with pytest.raises(ValueError):
        _call(a)


def test_take_rows_all_gather_places_at_base() -> None:
    a = _args(mode=1, dst=np.zeros(24, np.float32), dst_base=8, start=0)
    a["bodies"][:, HEADER_SIZE:] = np.arange(8, dtype=np.float32).reshape(2, 4).view(np.uint8)
    assert _call(a) == (2, 0, 1, 1.0, 2.0, 0)
    assert a["dst"][8:16].tolist() == list(range(8)) and not a["dst"][:8].any() and not a["dst"][16:].any()
    a["bodies"][1, HEADER_SIZE:HEADER_SIZE + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    a["seen"][:] = 0
    assert _call(a) is None  # a NaN in the all-gather: not taken, nothing changed
    assert a["seen"].tolist() == [0, 0, 0, 0]
