"""take.c take_coded, receive_block's native path for int8 and int4 blocks, against its numpy path (the reference).

Two copies of a group run in lock step; one takes coded blocks natively, the other with that take switched off.
Blocks are cut from real senders' output and damaged as a hostile or lossy network would: rows lost, duplicated,
reordered, a header byte changed, a weight changed, a scale or min that is not finite or not positive, int4's
padding nibble set. After every block both copies must hold the same state, and in the end the same result.
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
from peerd.allreduce.robust import MAX_C, Robust
from peerd.compress import codec
from peerd.wire.native import native as _native

pytestmark = pytest.mark.skipif(_native is None, reason="the native data plane is not built (PEERD_DATAPLANE=python)")

from .support.lockstep import lockstep  # noqa: E402

GROUP = 0x7A4E0002


def _group(n: int, length: int, per: int, seed: int, take: bool, name: str, qgroup: int,
           robust: bool) -> list[GroupAverage]:
    rng = np.random.default_rng(seed)
    c = codec(name, group=qgroup)
    cores = [GroupAverage(GROUP, n, i, rng.standard_normal(length).astype(np.float32), 1.0 + i, 0.0,
                          options=replace(GROUP_OPTIONS, floor_s=1.0, codec=c, run=seed,
                                          robust=Robust("clip", MAX_C) if robust else None),
                          max_payload=HEADER_SIZE + c.body_size(per), out=np.zeros(length, np.float32))
             for i in range(n)]
    for core in cores:
        assert core._take_bits == int(name[3:])  # (int8 or int4 into an aligned vector: the native take applies)
        if not take:
            core._take_bits = 0
    return cores


def _state(c: GroupAverage) -> tuple:
    rs, ag = c._rs, c._ag
    per = c._per
    staged = [c._stage[s][: len(c._rs_seen[s]) * per][np.repeat(c._rs_seen[s], per)[: c._stage.shape[1]]].tobytes()
              for s in range(c.n)]
    return (staged, c._rs_seen.tobytes(), [s.tobytes() for s in c._ag_seen], c._out.tobytes(), dict(c._drops),
            dict(c._refused), list(c._sender_weight), rs.received, rs.top, rs.remaining, rs.open, ag.received, ag.top,
            ag.remaining, ag.open, rs.ended_at, ag.ended_at, c.phase_changes, rs.weight_received)


def _damage(rows: np.ndarray, rnd: random.Random, bits: int, per: int, qgroup: int) -> np.ndarray:
    """One of the ways a block goes wrong, or none."""
    rows = rows.copy()
    n = len(rows)
    kind = rnd.randrange(10)
    i = rnd.randrange(n)
    groups = -(-per // qgroup)
    if kind == 0:  # a header byte
        rows[i, rnd.randrange(HEADER_SIZE)] ^= 1 << rnd.randrange(8)
    elif kind == 1:  # a scale or min that is not finite (fp16 0x7C00: inf; 0x7E00: NaN)
        g = rnd.randrange(groups)
        at = HEADER_SIZE + 4 * g + rnd.choice([0, 2])
        rows[i, at : at + 2] = np.frombuffer(rnd.choice([0x7C00, 0xFC00, 0x7E00]).to_bytes(2, "little"), np.uint8)
    elif kind == 2:  # a scale that is zero or negative
        at = HEADER_SIZE + 4 * rnd.randrange(groups)
        rows[i, at : at + 2] = np.frombuffer(rnd.choice([0x0000, 0xBC00]).to_bytes(2, "little"), np.uint8)
    elif kind == 3 and bits == 4 and per % 2:  # int4's padding nibble
        rows[i, -1] |= 0x30
    elif kind == 4:  # a weight in every row (the sender's weight is one value)
        rows[:, 15:19] = np.frombuffer(np.float32(rnd.choice([0.5, 7.0, 1e30, -1.0, 0.0, np.nan])).tobytes(), np.uint8)
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
    name=st.sampled_from(["int8", "int4"]),
    qgroup=st.sampled_from([2, 5, 128]),
    robust=st.booleans(),
    wide=st.booleans(),
)
def test_native_coded_take_matches_numpy(n, length, per, rows, seed, loss, dup, shuffle, name, qgroup, robust,
                                         wide) -> None:
    rnd = random.Random(seed)
    bits = int(name[3:])
    lockstep(_group(n, length, per, seed, True, name, qgroup, robust),
             _group(n, length, per, seed, False, name, qgroup, robust), rows=rows, rnd=rnd, loss=loss, dup=dup,
             shuffle=shuffle, wide=wide, body=HEADER_SIZE + codec(name, group=qgroup).body_size(per),
             damage=lambda block: _damage(block, rnd, bits, per, qgroup), state=_state)


def _coded_block(rows: int, per: int, full: int, bits: int = 8, qgroup: int = 2) -> tuple[np.ndarray, int, np.ndarray]:
    c = codec(f"int{bits}", group=qgroup, rounding="nearest")
    values = np.arange(rows * per, dtype=np.float32).reshape(rows, per)
    bodies = c.encode_block(values)
    width = HEADER_SIZE + bodies.shape[1]
    block = np.zeros((rows, width), np.uint8)
    for i in range(rows):
        block[i, :HEADER_SIZE] = np.frombuffer(
            GROUP.to_bytes(4, "little") + bytes([c.wire_id]) + full.to_bytes(4, "little")
            + (i * per).to_bytes(4, "little") + per.to_bytes(2, "little") + np.float32(1.0).tobytes(), np.uint8)
    block[:, HEADER_SIZE:] = bodies
    return block, c.wire_id, c.decode_block(bodies, per)[0].reshape(-1)


def _args(rows=2, per=4, full=4, mode=0, bits=8, **over):
    block, cid, decoded = _coded_block(rows, per, full, bits)
    a = dict(decoded=decoded, bodies=block, stride=block.shape[1], rows=rows, mode=mode, group=GROUP, codec=cid,
             per=per, total=full, start=0, full=full, known=float("nan"), bits=bits, qgroup=2,
             seen=np.zeros(full, np.uint8), dst=np.zeros(full * per, np.float32), dst_base=0,
             status=np.zeros(rows, np.uint8))
    a.update(over)
    return a


def _take(a: dict):
    return _native.take_coded(**{k: v for k, v in a.items() if k != "decoded"})


@pytest.mark.parametrize("bits", [8, 4])
def test_take_coded_decodes_a_clean_run_into_place(bits) -> None:
    a = _args(bits=bits)
    assert _take(a) == (2, 0, 1, 1.0, 0.0, 0)
    assert a["seen"].tolist() == [1, 1, 0, 0]
    assert a["dst"][:8].tobytes() == a["decoded"].tobytes() and not a["dst"][8:].any()  # the codec's own decode
    assert _take(a) == (0, 2, -1, 1.0, 0.0, 0)  # the same rows again: duplicates
    assert a["status"].tolist() == [3, 3]
    ag = _args(bits=bits, mode=1, dst=np.zeros(24, np.float32), dst_base=8)
    assert _take(ag) == (2, 0, 1, 1.0, 2.0, 0)
    assert ag["dst"][8:16].tobytes() == ag["decoded"].tobytes() and not ag["dst"][:8].any() and not ag["dst"][16:].any()


def test_take_coded_leaves_everything_as_it_was_for_a_body_that_does_not_decode() -> None:
    a = _args()
    a["bodies"][1, HEADER_SIZE : HEADER_SIZE + 2] = np.frombuffer((0x7C00).to_bytes(2, "little"), np.uint8)
    assert _take(a) is None
    assert not a["seen"].any() and not a["dst"].any()
    a["seen"][1] = 1  # ... unless that row is a duplicate, which is not decoded
    assert _take(a) == (1, 1, 0, 1.0, 0.0, 0)


@pytest.mark.parametrize("bad", [
    dict(seen=np.zeros(3, np.uint8)),  # fewer ranges than full
    dict(status=np.zeros(1, np.uint8)),  # fewer than rows
    dict(dst=np.zeros(15, np.float32)),  # too short for full ranges
    dict(dst_base=1),  # a stage row starts at 0
    dict(stride=10),  # shorter than a row
    dict(bits=5), dict(bits=16),
    dict(qgroup=0), dict(qgroup=1 << 16),
    dict(per=0),
    dict(mode=2),
    dict(full=-1),
])
def test_take_coded_refuses_spans_that_do_not_fit(bad) -> None:
    a = _args()
    a.update(bad)
    before = a["dst"].tobytes()
    with pytest.raises(ValueError):
        _take(a)
    assert a["dst"].tobytes() == before


def test_take_coded_refuses_a_destination_inside_the_block() -> None:
    a = _args(mode=1)
    a["dst"] = a["bodies"].reshape(-1)[:16].view(np.float32)
    with pytest.raises(ValueError):
        _take(a)
