"""arc-topk in the average (peerd/allreduce/arctopk.py): three unchanged GroupAverage phases over the one in-memory
network (peerd/tools/sim/net.py, via tests/support/groups.GroupNet) with exact loss patterns. The selection is agreed
(or known not to be) under loss, members that do not know a selection are counted out of its rows, and EF21M
through the wired path matches a reference replay of its update rule."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

from peerd.allreduce.arctopk import (
    SELECTION_COPIES,
    ArcTopKPlan,
    matrix_shapes,
    ratio_of_plan,
    service_arc_topk,
)
from peerd.allreduce.options import AverageOptions
from peerd.allreduce.service import Member
from peerd.compress import codec
from peerd.compress.topk import EF21M

from .support.arctopk import GROUP, ROUND, RUN, SHAPES, plan_for, run_group, wmean  # noqa: E402
from .support.groups import AG_DATA, RS_DATA, Wire
from .support.memnet import MemNet, run_on_memnet
from .support.moshpit_swarm import swarm


def inputs(n: int, length: int, seed: int) -> tuple[list[np.ndarray], list[float]]:
    rng = np.random.default_rng(seed)
    return ([(rng.standard_normal(length) * (1 + i)).astype(np.float32) for i in range(n)],
            [float(w) for w in rng.integers(1, 20, n)])




def exact_selection(plan: ArcTopKPlan, vs, ws, who=None) -> list[list[np.ndarray]]:
    lay = plan.layout
    sk = wmean([lay.sketch(v, RUN, ROUND) for v in vs], ws, who or range(len(vs))).astype(np.float32)
    return [lay.select(j, sk[slice(*lay.sketch_shard(j))]) for j in range(lay.n)]


def test_the_whole_vector_passes_can_run_in_a_worker_thread() -> None:
    """A daemon runs the passes over the whole vector (checks, EF21M, sketch, gather, scatter) in worker threads,
    so its event loop keeps reading datagrams: the same bytes as inline, EF21M state included."""
    plan = plan_for(4)
    xs, ws = inputs(4, plan.layout.length, 9)
    calls: list[str] = []

    async def threaded(fn):
        calls.append(threading.current_thread().name)
        return await trio.to_thread.run_sync(fn)

    for rnd in range(2):  # the second round starts from the first one's EF21M state
        efs_a, efs_b = [EF21M(0.5) for _ in range(4)], [EF21M(0.5) for _ in range(4)]
        a, _ = run_group(plan, xs, ws, efs=efs_a, rnd=rnd)
        b, _ = run_group(plan, xs, ws, efs=efs_b, rnd=rnd, offload=threaded)
        for ra, rb, ea, eb in zip(a, b, efs_a, efs_b, strict=True):
            assert np.array_equal(ra.vector, rb.vector) and np.array_equal(ea.e, eb.e) and np.array_equal(ea.u, eb.u)
    assert len(calls) == 2 * 4 * 3  # three passes per member and round
    bad = [x.copy() for x in xs]
    bad[1][3] = np.nan
    with pytest.raises(BaseExceptionGroup) as info:  # (the members run in a nursery)
        run_group(plan, bad, ws, offload=threaded)
    assert info.group_contains(ValueError, match="NaN")


def test_no_loss_every_member_knows_every_selection_and_holds_the_same_rows() -> None:
    plan = plan_for(4)
    xs, ws = inputs(4, plan.layout.length, 1)
    res, nets = run_group(plan, xs, ws)
    lay = plan.layout
    sel = exact_selection(plan, xs, ws)
    exact = wmean(xs, ws, range(4))
    for r in res:
        assert r.known == 4 and r.got_fraction == 1.0
    for j in range(4):
        idx = lay.dense_index(j, sel[j])
        for i, r in enumerate(res):
            np.testing.assert_allclose(r.vector[idx], exact[idx], rtol=0, atol=1e-5)
            assert np.array_equal(r.vector[idx], res[0].vector[idx])  # replicas agree bit for bit
            rest = np.setdiff1d(lay.shard_elements(j), idx)
            assert np.array_equal(r.vector[rest], xs[i][rest])  # rows not selected: own values
        # top-k per (tensor, shard) piece: k = ceil(ratio * rows of the piece)
        assert [len(s) for s in sel[j]] == [p.k for p in lay.pieces(j)]
    # whole tensors are always averaged: the 30-element vector
    whole = np.arange(480, 510)
    np.testing.assert_allclose(res[2].vector[whole], exact[whole], atol=1e-5)


def test_a_member_that_lost_every_copy_of_a_selection_is_counted_out_of_its_rows() -> None:
    plan = plan_for(4)
    xs, ws = inputs(4, plan.layout.length, 2)
    lay = plan.layout

    def drop(phase: int, w: Wire) -> bool:  # member 2 never hears owner 0's selection (every copy)
        return phase == 1 and w.mtype == AG_DATA and w.src == 0 and w.dst == 2

    res, _ = run_group(plan, xs, ws, drop)
    assert [r.known for r in res] == [4, 4, 3, 4]
    sel = exact_selection(plan, xs, ws)
    idx = lay.dense_index(0, sel[0])
    without_2 = wmean(xs, ws, (0, 1, 3))  # member 2's rows never reach owner 0: not averaged into any row
    for i in (0, 1, 3):
        np.testing.assert_allclose(res[i].vector[idx], without_2[idx], rtol=0, atol=1e-5)
        assert np.array_equal(res[i].vector[idx], res[0].vector[idx])
    shard0 = lay.shard_elements(0)
    assert np.array_equal(res[2].vector[shard0], xs[2][shard0])  # it keeps its own values there
    for j in (1, 2, 3):  # the other shards are averaged by everyone
        jdx = lay.dense_index(j, sel[j])
        assert all(np.array_equal(r.vector[jdx], res[j].vector[jdx]) for r in res)


def test_one_lost_copy_is_not_a_lost_selection_and_hostile_words_are_refused() -> None:
    plan = plan_for(3)
    xs, ws = inputs(3, plan.layout.length, 3)
    copy0 = plan.copy_size

    def drop(phase: int, w: Wire) -> bool:  # the first datagram of copy 0 of every owner's selection, to everyone
        j = w.src
        return phase == 1 and w.mtype == AG_DATA and w.offset == j * plan.selection_segment

    res, _ = run_group(plan, xs, ws, drop)
    assert all(r.known == 3 for r in res)

    def drop_all(phase: int, w: Wire) -> bool:  # the first datagram of every copy: nobody learns another's
        starts = {w.src * plan.selection_segment + c * copy0 for c in range(SELECTION_COPIES)}
        return phase == 1 and w.mtype == AG_DATA and w.offset in starts

    res, _ = run_group(plan, xs, ws, drop_all)
    assert all(r.known == 1 for r in res)
    for i, r in enumerate(res):  # each averaged only its own shard's rows (alone there: its own values)
        assert np.array_equal(np.delete(r.vector, plan.layout.shard_elements(i)),
                              np.delete(xs[i], plan.layout.shard_elements(i)))
    # a selection vector whose words name the wrong number of rows, or are not integers, is no selection
    sel = plan.layout.select(0, plan.own_sketch(plan.sketch_vector(xs[0], RUN, ROUND), 0))
    good = plan.selection_vector(0, sel)
    assert plan.read_selection(good, 0) is not None
    for bad_value in (0.5, -1.0, float(1 << 24)):
        bad = good.copy()
        for c in range(SELECTION_COPIES):
            bad[c * copy0] = bad_value
        assert plan.read_selection(bad, 0) is None
    flipped = good.copy()
    for c in range(SELECTION_COPIES):
        flipped[c * copy0] = float(int(good[c * copy0]) ^ 1)  # one row more or less in a piece
    assert plan.read_selection(flipped, 0) is None


def test_lost_dense_ranges_count_only_their_rows() -> None:
    plan = plan_for(4)
    xs, ws = inputs(4, plan.layout.length, 4)
    lay = plan.layout
    seg1 = plan.dense_segment  # owner 1's dense segment starts here

    def drop(phase: int, w: Wire) -> bool:
        if phase != 2:
            return False
        if w.mtype == RS_DATA and w.src == 3 and w.dst == 1 and w.offset == seg1:  # 3's first range to owner 1
            return True
        return w.mtype == AG_DATA and w.src == 1 and w.dst == 2 and w.offset == seg1  # 1's first range to 2

    res, _ = run_group(plan, xs, ws, drop)
    sel = exact_selection(plan, xs, ws)
    idx = lay.dense_index(1, sel[1])
    first = idx[: plan.dense_per - 1]  # the values of the first range (after its canary)
    np.testing.assert_allclose(res[1].vector[first], wmean(xs, ws, (0, 1, 2))[first], atol=1e-5)
    np.testing.assert_allclose(res[1].vector[idx[len(first):]], wmean(xs, ws, range(4))[idx[len(first):]], atol=1e-5)
    assert np.array_equal(res[2].vector[first], xs[2][first])  # its all-gather range was lost: own values
    assert np.array_equal(res[0].vector[first], res[1].vector[first])
    assert res[2].got_fraction < 1.0 and res[0].got_fraction == 1.0


def reference_ef21m(plan: ArcTopKPlan, grads: list[list[np.ndarray]], ws: list[float], eta: float) -> list:
    """EF21M's rule replayed without any of the wired code: h, e per member; v = h - e; rows selected from the
    exact weighted mean of the sketches of v; u += weighted mean of C(v) on them; e += C(v)."""
    n, lay = len(ws), plan.layout
    h = [None] * n
    e = [np.zeros(lay.length, np.float64) for _ in range(n)]
    u = np.zeros(lay.length, np.float64)
    for rnd, gs in enumerate(grads):
        for i in range(n):
            h[i] = gs[i].astype(np.float64) if h[i] is None else (1 - eta) * h[i] + eta * gs[i]
        vs = [(h[i] - e[i]).astype(np.float32) for i in range(n)]
        sk = wmean([lay.sketch(v, RUN, rnd) for v in vs], ws, range(n)).astype(np.float32)
        mask = np.zeros(lay.length, bool)
        for j in range(n):
            mask[lay.dense_index(j, lay.select(j, sk[slice(*lay.sketch_shard(j))]))] = True
        u[mask] += wmean(vs, ws, range(n))[mask]
        for i in range(n):
            e[i][mask] += vs[i][mask]
    return u


def test_ef21m_through_the_wired_path_matches_a_reference_replay() -> None:
    plan = plan_for(3, ratio=0.2)
    n, eta = 3, 0.3
    rng = np.random.default_rng(9)
    grads = [[rng.standard_normal(plan.layout.length).astype(np.float32) for _ in range(n)] for _ in range(5)]
    ws = [1.0, 2.0, 5.0]
    efs = [EF21M(eta) for _ in range(n)]
    for rnd, gs in enumerate(grads):
        res, _ = run_group(plan, gs, ws, efs=efs, rnd=rnd)
        assert all(np.array_equal(r.vector, res[0].vector) for r in res)  # every member's u is the same
    u = reference_ef21m(plan, grads, ws, eta)
    np.testing.assert_allclose(res[0].vector, u, rtol=0, atol=1e-4)
    assert np.abs(u).max() > 0.1  # (not a vacuous comparison)


def test_bf16_dense_rows_and_the_codecs_it_refuses() -> None:
    bf16 = codec("bf16")
    plan = plan_for(3, dense=bf16)
    xs, ws = inputs(3, plan.layout.length, 5)
    res, _ = run_group(plan, xs, ws, dense=bf16)
    sel = exact_selection(plan, xs, ws)
    idx = plan.layout.dense_index(1, sel[1])
    np.testing.assert_allclose(res[0].vector[idx], wmean(xs, ws, range(3))[idx], rtol=2**-7, atol=1e-2)
    assert all(np.array_equal(r.vector[idx], res[0].vector[idx]) for r in res)
    for name in ("fp16", "int8"):
        with pytest.raises(ValueError, match="dense rows travel in"):
            plan_for(3, dense=codec(name))


def test_wire_ratio_of_the_plan_at_6250x1000() -> None:
    plan = ArcTopKPlan.build(matrix_shapes(25_000_000, 6250, 1000), 4, 0.1, 1200 - 37)
    assert ratio_of_plan(plan) <= 0.106
    assert matrix_shapes(10, 2, 3) == [(2, 3), (4,)]


@pytest.mark.parametrize("drop", [0.0, 0.1])
def test_through_the_allreduce_service_selections_agree_and_nothing_unknown_lands(drop: float) -> None:
    """Real daemons' endpoints and AllreduceService over memnet (seeded loss), virtual time."""
    results: list = []

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 4)
        members = [Member(n.identity.public_key, n.identity.node_id, n.addr) for n in nodes]
        plan = ArcTopKPlan.build(SHAPES, 4, 0.25, nodes[0].allreduce.host.max_body)
        xs, ws = inputs(4, plan.layout.length, 6)
        out: list = [None] * 4

        async def one(i: int) -> None:
            out[i] = await service_arc_topk(nodes[i].allreduce, GROUP, members, i, xs[i], ws[i], plan, run=RUN,
                                            round=ROUND, options=AverageOptions(max_phase_s=5.0))

        async with trio.open_nursery() as inner:
            for i in range(4):
                inner.start_soon(one, i)
        results.extend([plan, xs, ws, out])

    run_on_memnet(main, seed=11, drop=drop)
    plan, xs, ws, out = results
    for j in range(4):
        known = [r.selections[j] for r in out if r.selections[j] is not None]
        assert out[j].selections[j] is not None  # an owner knows its own
        assert all(all(np.array_equal(a, b) for a, b in zip(k, known[0], strict=True)) for k in known)
    for r in out:
        assert np.isfinite(r.vector).all() and len(r.phases) == 3 and r.bytes_sent > 0
    if drop == 0.0:
        assert all(r.known == 4 and r.got_fraction == 1.0 for r in out)
        sel = exact_selection(plan, xs, ws)
        assert all(all(np.array_equal(a, b) for a, b in zip(out[0].selections[j], sel[j], strict=True))
                   for j in range(4))
        idx = np.concatenate([plan.layout.dense_index(j, sel[j]) for j in range(4)])
        np.testing.assert_allclose(out[3].vector[idx], wmean(xs, ws, range(4))[idx], atol=1e-5)


def test_a_moshpit_run_in_arc_topk_keeps_its_ef21m_state_and_every_member_holds_the_same_u() -> None:
    from .support.virtual import counter_value

    results: list = []
    xs, ws = inputs(3, 48 * 10 + 30 + 20 * 6 + 9 * 6, 8)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 3)
        shapes = [list(s) for s in SHAPES]

        async def one(i: int, rnd: int, out: list) -> None:
            out[i] = await nodes[i].moshpit.average("topk", xs[i] * (rnd + 1), ws[i], timeout_s=30.0,
                                                    compression="arc-topk", topk_layout=shapes, topk_ratio=0.25,
                                                    ef_eta=0.5)

        for rnd in range(2):
            out: list = [None] * 3
            async with trio.open_nursery() as inner:
                for i in range(3):
                    inner.start_soon(one, i, rnd, out)
            results.append(out)
        st = nodes[0].moshpit.runs["topk"]
        results.append((st.statistics(), st.topk.ef.h.copy()))
        results.append([counter_value(n.metrics.moshpit_rounds, codec="arc-topk") for n in nodes])
        with pytest.raises(Exception, match="layout holds"):
            await nodes[0].moshpit.average("topk2", xs[0][:10], 1.0, compression="arc-topk", topk_layout=shapes)

    run_on_memnet(main, seed=21)
    for out in results[:2]:
        assert all(r.outcome == "averaged" and r.group_size == 3 and r.compression == "arc-topk" for r in out)
        assert all(np.array_equal(r.vector, out[0].vector) for r in out)  # the same u everywhere
        assert all(r.bytes_sent > 0 for r in out)
    stats, h = results[2]
    assert stats.compression == "arc-topk" and stats.topk_ratio == 0.25 and stats.ef
    assert results[3] == [2, 2, 2]
    # the same layout and group in round 2: the run kept its state, h = 0.5 x + 0.5 (2 x) (a reset: h = 2 x)
    np.testing.assert_allclose(h, 1.5 * xs[0], rtol=1e-6)
