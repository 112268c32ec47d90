"""The block data path (one GRO receive at a time) against the datagram-by-datagram path.

Two copies of the same group run in lock step on identical inputs: one is fed every surviving body
through ``receive``, the other the same bodies as blocks through ``receive_block`` (falling back to
``receive`` when it declines a block, as the driver does). Whatever is dropped, duplicated or reordered,
both must end with bit-identical results and the same counts.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.allreduce import HEADER_SIZE, GroupAverage
from peerd.allreduce.frames import pack_block, pack_data, view_block
from peerd.allreduce.group import GROUP_OPTIONS, IN_ORDER_GRACE_S
from peerd.allreduce.phase import REORDER_SAFETY
from peerd.compress import codec
from peerd.wire import Opener, Sealer

from .support.blocks import _average, _feed_rows  # noqa: E402
from .support.groups import AG_DATA, AG_END, RS_DATA, RS_END  # noqa: E402

GROUP = 0x5EED0001


def _group(n: int, length: int, per: int, seed: int, name: str = "fp32") -> list[GroupAverage]:
    rng = np.random.default_rng(seed)
    c = codec(name)
    return [
        GroupAverage(GROUP, n, i, rng.standard_normal(length).astype(np.float32), 1.0 + i, 0.0,
                     options=replace(GROUP_OPTIONS, floor_s=1.0, codec=c, run=seed),
                     max_payload=HEADER_SIZE + c.body_size(per))
        for i in range(n)
    ]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 4),
    length=st.integers(0, 300),
    per=st.sampled_from([1, 3, 8]),
    rows=st.sampled_from([1, 4, 7]),
    seed=st.integers(0, 2**16),
    loss=st.sampled_from([0.0, 0.1, 0.5]),
    dup=st.sampled_from([0.0, 0.2]),
    shuffle=st.booleans(),
    name=st.sampled_from(["fp32", "fp16", "bf16", "int8", "int4"]),
)
def test_blocks_match_datagrams(n, length, per, rows, seed, loss, dup, shuffle, name) -> None:
    a, b = _group(n, length, per, seed, name), _group(n, length, per, seed, name)
    rnd = random.Random(seed)
    now = 0.0
    for _ in range(10_000):
        if all(c.finished for c in a) and all(c.finished for c in b):
            break
        now += 0.3
        for i in range(n):
            blocks_a = a[i].blocks_to_send(rows, 10**9)
            blocks_b = b[i].blocks_to_send(rows, 10**9)
            assert [(x.to, x.type, x.bodies.tobytes()) for x in blocks_a] == [
                (x.to, x.type, x.bodies.tobytes()) for x in blocks_b
            ]
            for blk in blocks_b:
                kept = [bytes(r) for r in blk.bodies for _ in range(blk.repeat) if rnd.random() >= loss]
                if shuffle and rnd.random() < 0.3:
                    rnd.shuffle(kept)
                if kept and rnd.random() < dup:
                    kept += kept[: rnd.randint(1, len(kept))]
                _feed_rows(a[blk.to], i, blk.type, kept, now)
                if not kept:
                    continue
                sizes = {len(k) for k in kept}
                done = None
                if len(sizes) == 1:
                    arr = np.frombuffer(b"".join(kept), dtype=np.uint8).reshape(len(kept), -1)
                    if rnd.random() < 0.5:  # as unsealed blocks arrive: rows cut out of whole datagrams
                        wide = np.zeros((len(kept), 21 + arr.shape[1]), dtype=np.uint8)
                        wide[:, 21:] = arr
                        arr = wide[:, 21:]
                    done = b[blk.to].receive_block(i, blk.type, arr, now)
                if done is None:
                    _feed_rows(b[blk.to], i, blk.type, kept, now)
        for core in a + b:
            core.handle_timer(now)
    assert all(c.finished for c in a + b)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.result(), y.result(), equal_nan=True)
        sx, sy = x.statistics(), y.statistics()
        assert sx.reduce_scatter.datagrams_received == sy.reduce_scatter.datagrams_received
        assert sx.all_gather.datagrams_received == sy.all_gather.datagrams_received
        assert sx.reduce_scatter.weight_received == pytest.approx(sy.reduce_scatter.weight_received)


@pytest.mark.parametrize("wide", [False, True])
def test_a_block_with_gaps_is_placed_whole_and_matches_datagrams(wide: bool) -> None:
    """A lossy path's block (rows missing in between, as the loss injector and a real lossy link leave it) is
    taken by ``receive_block`` in one go, each run of consecutive rows by the native copy where it is built, and
    ends as the same result as its bodies fed one by one."""
    a, b = _group(2, 2000, 40, 3), _group(2, 2000, 40, 3)
    now = 0.0
    taken = 0
    for _ in range(200):
        if all(c.finished for c in a + b):
            break
        now += 0.3
        for i in range(2):
            for blk_a, blk_b in zip(a[i].blocks_to_send(16, 10**9), b[i].blocks_to_send(16, 10**9), strict=True):
                keep = [r for j, r in enumerate(blk_b.bodies) if j % 5 not in (1, 3)]  # gaps of one and of two
                rows = [bytes(r) for r in keep]
                _feed_rows(a[blk_a.to], i, blk_a.type, rows, now)
                if blk_b.type in (RS_END, AG_END) or not rows:
                    _feed_rows(b[blk_b.to], i, blk_b.type, rows, now)
                    continue
                arr = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
                if wide:  # rows inside whole datagrams, as a sealed block is opened in place
                    w = np.zeros((len(rows), 37 + arr.shape[1]), dtype=np.uint8)
                    w[:, 37:] = arr
                    arr = w[:, 37:]
                done = b[blk_b.to].receive_block(i, blk_b.type, arr, now)
                assert done is not None and done[0] == len(rows)
                taken += len(rows) > 1
        for core in a + b:
            core.handle_timer(now)
    assert all(c.finished for c in a + b) and taken >= 4
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.result(), y.result())


def test_pack_block_is_pack_data_per_row() -> None:
    values = np.arange(15, dtype=np.float32).reshape(3, 5)
    weights = np.array([1.5, 2.0, 0.25], dtype=np.float32)
    block = pack_block(9, 40, 100, weights, values)
    for i in range(3):
        assert bytes(block[i]) == pack_data(9, 40, 100 + 5 * i, float(weights[i]), values[i])
    rec = view_block(block)
    assert rec is not None and rec["offset"].tolist() == [100, 105, 110]
    assert view_block(block[:, :-1].copy()) is None  # not whole float32 bodies


def test_receive_block_declines_what_is_not_a_clean_run() -> None:
    """A block with another group's body, a changed weight or a foreign range is declined (None), so the
    driver feeds it body by body and every fault is counted there."""
    a = _group(2, 64, 8, 1)
    rows = [o.bodies for o in a[1].blocks_to_send(4, 100) if o.to == 0 and o.type == RS_DATA][0]
    good = rows.copy()
    other = rows.copy()
    other[2, :4] = np.frombuffer((GROUP + 1).to_bytes(4, "little"), np.uint8)
    reweighted = np.vstack([rows[:2], pack_block(GROUP, 4, 16, 9.0, np.zeros((1, 8), np.float32))])
    assert a[0].receive_block(1, RS_DATA, other, 0.0) is None
    assert a[0].receive_block(1, RS_DATA, reweighted, 0.0) is None
    assert a[0].receive_block(0, RS_DATA, good, 0.0) is None  # from itself
    assert a[0].receive_block(1, RS_END, good, 0.0) is None
    assert a[0].receive_block(1, RS_DATA, good, 0.0) == (4, 0, 0)
    assert a[0].receive_block(1, RS_DATA, good, 0.0) == (0, 4, 0)  # all duplicates, counted
    assert a[0].statistics().drops["duplicate"] == 4


@pytest.mark.parametrize("byte", [*range(9), *range(13, 19)])
def test_receive_block_declines_one_changed_header_byte(byte: int) -> None:
    """Every header byte that must match row 0's (all but the offset, 9..13) is compared: one changed byte in
    the last row declines the block, and nothing is taken from it."""
    a = _group(2, 64, 8, 1)
    rows = [o.bodies for o in a[1].blocks_to_send(4, 100) if o.to == 0 and o.type == RS_DATA][0].copy()
    rows[-1, byte] ^= 1
    assert a[0].receive_block(1, RS_DATA, rows, 0.0) is None
    assert a[0].statistics().drops.get("duplicate", 0) == 0


@pytest.mark.parametrize("byte", range(13))
def test_open_block_declines_one_changed_lead_byte(byte: int) -> None:
    """Magic, version, type, flags and token (bytes 0..13) must be row 0's in every row: one changed byte in
    the last row sends the block to the row-by-row path (None), and the replay window is untouched."""
    me, secret = bytes(32), os.urandom(32)
    sealer, opener = Sealer(secret), Opener(secret, me)
    opener.open(sealer.seal(RS_DATA, b"\0" * 40, me))
    block = sealer.seal_block(RS_DATA, np.zeros((3, 50), np.uint8), me).copy()
    block[-1, byte] ^= 1
    assert opener.open_block(block) is None
    block[-1, byte] ^= 1
    opened = opener.open_block(block)
    assert opened is not None and len(opened.bodies) == 3 and opened.replays == 0


@pytest.mark.parametrize("secret", [os.urandom(32), None], ids=["sealed", "insecure"])
def test_open_block_matches_open(secret) -> None:
    """Sealing a block and opening it whole gives the bodies; a replayed block gives nothing; a forged row
    is dropped and counted; a mixed block is declined for the row-by-row path."""
    me = bytes(32)  # the receiver's node id: tensor data is sealed for one receiver
    sealer, opener = Sealer(secret), Opener(secret, me)
    opener.open(sealer.seal(RS_DATA, b"\0" * 40, me))  # the token becomes known
    bodies = np.random.default_rng(0).integers(0, 256, (6, 50), dtype=np.uint8)
    block = sealer.seal_block(RS_DATA, bodies, me)
    check = Opener(secret, me)
    check.open(Sealer(secret, token=sealer.token).seal(RS_DATA, b"\0" * 40, me))
    for row, body in zip(block, bodies, strict=True):  # each row is an ordinary sealed datagram
        header, plain, _ = check.open(row.tobytes())
        assert plain == body.tobytes() and header.type == RS_DATA
    opened = opener.open_block(block)
    assert opened is not None and np.array_equal(opened.bodies, bodies)
    if secret is None:  # unsealed: the bodies are a view of the datagrams, not a copy
        assert np.shares_memory(opened.bodies, block)
    again = opener.open_block(block)
    assert again is not None and again.replays == 6 and len(again.bodies) == 0
    fresh = sealer.seal_block(RS_DATA, bodies, me)
    if secret is not None:
        fresh[3, -1] ^= 1
        got = opener.open_block(fresh)
        assert got is not None and got.auth_failures == 1 and len(got.bodies) == 5
    mixed = np.vstack([sealer.seal_block(RS_DATA, bodies[:2], me), sealer.seal_block(AG_DATA, bodies[:2], me)])
    assert opener.open_block(mixed) is None
    unknown = Sealer(secret).seal_block(RS_DATA, bodies, me)
    assert opener.open_block(unknown) is None  # a token's first datagrams take the row-by-row path


def _two_cores() -> tuple[list[GroupAverage], list, object]:
    cores = [
        GroupAverage(GROUP, 2, i, np.ones(64, np.float32), 1.0, 0.0, options=replace(GROUP_OPTIONS, end_grace_s=0.05),
                     max_payload=HEADER_SIZE + 32)
        for i in range(2)
    ]
    out = cores[1].datagrams_to_send(0.0, 1000)
    data = [o for o in out if o.to == 0 and o.type == RS_DATA]
    end = next(o for o in out if o.to == 0 and o.type == RS_END)
    assert len(data) > 2
    return cores, data, end


def test_end_overtaking_data_wakes_the_driver() -> None:
    """An END that overtakes lost data brings the deadline forward to its short grace (an in-order stream:
    IN_ORDER_GRACE_S); the driver only re-reads the deadline when ``phase_changes`` moves, so it must move
    (else it sleeps ~1 s too long)."""
    cores, data, end = _two_cores()
    cores[0].receive(1, RS_DATA, data[0].body, 0.0)  # the rest of the stream is lost
    before, deadline = cores[0].phase_changes, cores[0].get_timer()
    cores[0].receive(1, RS_END, end.body, 0.01)
    assert cores[0].phase_changes != before
    assert cores[0].get_timer() == pytest.approx(0.01 + IN_ORDER_GRACE_S) and deadline > 0.5
    cores[0].handle_timer(0.011 + IN_ORDER_GRACE_S)
    assert cores[0].reduce_scatter_done


def test_end_after_an_in_order_streams_last_datagram_waits_only_briefly() -> None:
    """What is missing before a stream's last datagram was sent before one that arrived: lost, not late, when the
    stream came in order. The END closes it after IN_ORDER_GRACE_S, not the full grace (under random loss
    nearly every stream misses some: the grace cost every phase its length)."""
    cores, data, end = _two_cores()
    cores[0].receive(1, RS_DATA, data[0].body, 0.0)
    cores[0].receive(1, RS_DATA, data[-1].body, 0.0)  # the middle is lost
    cores[0].receive(1, RS_END, end.body, 0.01)
    assert cores[0].get_timer() == pytest.approx(0.01 + IN_ORDER_GRACE_S)
    cores[0].handle_timer(0.011 + IN_ORDER_GRACE_S)
    assert cores[0].reduce_scatter_done


def test_end_of_a_reordered_stream_waits_by_how_late_its_data_came() -> None:
    """A stream seen reordered waits IN_ORDER_GRACE_S plus REORDER_SAFETY times the longest one of its datagrams
    came after a later one (here 10 ms: 35 ms in all, within the 50 ms grace); data in that wait still counts."""
    cores, data, end = _two_cores()
    cores[0].receive(1, RS_DATA, data[-1].body, 0.0)
    cores[0].receive(1, RS_DATA, data[0].body, 0.01)  # came 10 ms after a later one: this path reorders
    cores[0].receive(1, RS_END, end.body, 0.02)
    assert cores[0].get_timer() == pytest.approx(0.02 + IN_ORDER_GRACE_S + REORDER_SAFETY * 0.01)
    cores[0].receive(1, RS_DATA, data[1].body, 0.05)  # late, still in time
    assert not cores[0].reduce_scatter_done and cores[0]._rs.received[1] == 3
    cores[0].handle_timer(0.056)
    assert cores[0].reduce_scatter_done


def test_end_of_a_stream_reordered_within_one_receive_waits_the_short_grace() -> None:
    """Reordered by no measurable time (two datagrams of one receive pass, out of order): the in-order wait."""
    cores, data, end = _two_cores()
    cores[0].receive(1, RS_DATA, data[-1].body, 0.0)
    cores[0].receive(1, RS_DATA, data[0].body, 0.0)
    cores[0].receive(1, RS_END, end.body, 0.01)
    assert cores[0]._rs.reordered[1]
    assert cores[0].get_timer() == pytest.approx(0.01 + IN_ORDER_GRACE_S)


# groups of 2-4 members averaging up to 200 values, a few per datagram, with or without loss
LOSSY_GROUPS = {"n": st.integers(2, 4), "length": st.integers(0, 200), "per": st.sampled_from([1, 3, 8]),
                "seed": st.integers(0, 2**16), "loss": st.sampled_from([0.0, 0.3])}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **LOSSY_GROUPS,
    robust=st.sampled_from([None, "clip:1.5"]),
    name=st.sampled_from(["fp32", "int8"]),
    junk=st.sampled_from([np.nan, np.inf, 3e38, 0.0]),
)
def test_a_reused_stage_gives_the_same_result(n, length, per, seed, loss, robust, name, junk) -> None:
    """A stage handed from one group to the next (AveragingHost keeps one between averages) holds the last group's
    values, or anything: the result is the same bits as with fresh memory, whatever was lost."""
    from peerd.allreduce.group import stage_elements
    from peerd.allreduce.robust import parse_robust

    rob = parse_robust(robust)
    c = codec(name)

    def cores(stages: list[np.ndarray | None]) -> list[GroupAverage]:
        rng = np.random.default_rng(seed)
        return [GroupAverage(GROUP, n, i, rng.standard_normal(length).astype(np.float32), 1.0 + i, 0.0,
                             options=replace(GROUP_OPTIONS, codec=c, run=seed, robust=rob),
                             max_payload=HEADER_SIZE + c.body_size(per), stage=stages[i]) for i in range(n)]

    fresh = _average(cores([None] * n), loss, seed)
    stages: list[np.ndarray | None] = [np.full(stage_elements(length, n) + i, junk, np.float32) for i in range(n)]
    reused = cores(stages)
    assert all(core.stage_buffer is stages[i] for i, core in enumerate(reused))
    first = _average(reused, loss, seed)
    second = _average(cores([core.stage_buffer for core in reused]), loss, seed)  # holds the first's values now
    for f, x, y in zip(fresh, first, second, strict=True):
        assert np.array_equal(f, x, equal_nan=True) and np.array_equal(f, y, equal_nan=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **LOSSY_GROUPS,
    inplace=st.booleans(),
)
def test_split_values_send_the_same_bodies(n, length, per, seed, loss, inplace) -> None:
    """With ``split_values`` a group's DATA blocks carry tensor headers and views of the values apart (for a sealer
    that reads them in place): joined, they are the packed bodies, block for block, and the results are the same
    bits, also when the result is the input vector itself (``out is vec``) and averages land in it meanwhile."""
    rnd = random.Random(seed)

    def cores(split: bool) -> list[GroupAverage]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            vec = rng.standard_normal(length).astype(np.float32)
            core = GroupAverage(GROUP, n, i, vec, 1.0 + i, 0.0, options=replace(GROUP_OPTIONS, run=seed),
                                max_payload=HEADER_SIZE + 4 * per, out=vec if inplace else None)
            core.split_values = split
            out.append(core)
        return out

    a, b = cores(False), cores(True)
    now = 0.0
    for _ in range(10_000):
        if all(c.finished for c in a):
            break
        now += 0.3
        for i in range(n):
            blocks_a, blocks_b = a[i].blocks_to_send(4, 10**9), b[i].blocks_to_send(4, 10**9)
            assert [(x.to, x.type, x.repeat, x.bodies.tobytes()) for x in blocks_a] == [
                (x.to, x.type, x.repeat, x.whole().tobytes()) for x in blocks_b]
            assert all((x.values is not None) == (x.type in (RS_DATA, AG_DATA)) for x in blocks_b)
            for blk in blocks_a:
                kept = [r for r in blk.bodies for _ in range(blk.repeat) if rnd.random() >= loss]
                for cores_ in (a, b):
                    arr = np.stack(kept) if kept else None
                    if arr is None:
                        continue
                    if blk.type in (RS_END, AG_END) or cores_[blk.to].receive_block(i, blk.type, arr, now) is None:
                        _feed_rows(cores_[blk.to], i, blk.type, [bytes(r) for r in kept], now)
        for core in a + b:
            core.handle_timer(now)
    assert all(c.finished for c in a + b)
    for x, y in zip(a, b, strict=True):
        assert x.result().tobytes() == y.result().tobytes()


def test_stage_must_fit_and_not_overlap() -> None:
    vec = np.ones(64, np.float32)
    with pytest.raises(ValueError, match="stage"):
        GroupAverage(GROUP, 4, 0, vec, 1.0, 0.0, stage=np.empty(63, np.float32))
    with pytest.raises(ValueError, match="stage"):
        GroupAverage(GROUP, 4, 0, vec, 1.0, 0.0, stage=np.empty(64, np.float64))
    big = np.empty(200, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        GroupAverage(GROUP, 4, 0, big[:64], 1.0, 0.0, stage=big[64:200], out=big[100:164])
    assert GroupAverage(GROUP, 4, 0, vec, 1.0, 0.0, stage=big).stage_buffer is big


def test_the_host_hands_a_finished_groups_stage_to_the_next() -> None:
    from peerd.allreduce.host import AveragingHost, Completed

    host = AveragingHost(max_body=HEADER_SIZE + 32, mtu=1200)
    me, other = b"a" * 32, b"b" * 32

    def run(group: int, length: int, peers: list[bytes], finish: bool = True) -> GroupAverage:
        host.start(group, peers, 0, np.arange(length, dtype=np.float32), 1.0, 0.0)
        core = host._groups[group].core
        while finish and host.wants_to_send(group):
            host.datagrams_to_send(0.0, group_id=group)
        host.finish(group, 0, 1.0)
        done = host.take_actions()
        assert any(type(a) is Completed for a in done) == finish
        return core

    first = run(1, 100, [me])
    assert run(2, 100, [me]).stage_buffer is first.stage_buffer  # same size: the same memory
    assert run(3, 20, [me, other], finish=False).stage_buffer is first.stage_buffer  # smaller fits; cancelled too
    bigger = run(4, 1000, [me])
    assert bigger.stage_buffer is not first.stage_buffer  # did not fit: fresh, and kept as the larger one
    assert run(5, 1000, [me]).stage_buffer is bigger.stage_buffer
    stingy = AveragingHost(max_body=HEADER_SIZE + 32, mtu=1200, spare_stage_bytes=100)
    stingy.start(1, [me], 0, np.ones(1000, np.float32), 1.0, 0.0)
    stingy.finish(1, 0, 1.0)
    assert stingy.spare_stage_nbytes() == 0  # over the bound: not kept


def test_groups_that_run_at_once_each_reuse_a_kept_stage() -> None:
    """A step's overlap buckets average at once, one group each: every one of them finds a warm stage at the next
    step (not only one), and what is kept stays under the host's bound, the largest first."""
    from peerd.allreduce.host import AveragingHost

    me = b"a" * 32
    host = AveragingHost(max_body=HEADER_SIZE + 32, mtu=1200, spare_stage_bytes=4 * 1000 * 4)

    def step(first_group: int, lengths: list[int]) -> list[np.ndarray]:
        for i, n in enumerate(lengths):  # all started before any finishes
            host.start(first_group + i, [me], 0, np.ones(n, np.float32), 1.0, 0.0)
        stages = [host._groups[first_group + i].core.stage_buffer for i in range(len(lengths))]
        for i in range(len(lengths)):
            host.finish(first_group + i, 0, 1.0)
        return stages

    one = step(10, [1000, 1000, 500])
    two = step(20, [500, 1000, 1000])
    assert {id(s) for s in two} == {id(s) for s in one}  # every group of the second step reused a stage
    assert two[0] is one[2]  # the smallest that fits: the 500-element group did not take a 1000-element stage
    assert host.spare_stage_nbytes() == (1000 + 1000 + 500) * 4
    three = step(30, [1000, 1000, 1000, 1000])  # one more than kept: fresh memory for it, then over the bound
    assert sum(any(s is t for t in two) for s in three) == 2
    assert host.spare_stage_nbytes() <= 4 * 1000 * 4
    assert sorted(s.size for s in host._spares) == [1000] * 4  # the 500-element stage went first
