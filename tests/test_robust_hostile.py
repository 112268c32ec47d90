"""A member against robust aggregation and arc-topk, written from the attacks: a claimed weight that undoes
clipping, arc-topk rows that go unclipped where the run asks for robust, a selection segment blended with a
non-owner's words, and an EF21M state that keeps what got into it for ever. In process, over the in-test
network of test_allreduce_core (virtual time)."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio

from peerd.allreduce.arctopk import ArcTopKPlan, ArcTopKResult
from peerd.allreduce.group import DEFAULT_MAX_WEIGHT, GROUP_OPTIONS, GroupAverage
from peerd.allreduce.options import DEFAULT_OPTIONS
from peerd.allreduce.robust import OPPOSED_COS, WEIGHT_BOUND, Robust, opposed_cos, opposed_members
from peerd.compress.topk import EF21M
from peerd.moshpit.keys import Grid
from peerd.tools.faults import byzantine

from .support.arctopk import SHAPES, plan_for, run_group, wmean
from .support.gradients import cos, gradients  # noqa: E402
from .support.groups import GROUP, GroupNet, payload_for
from .support.memnet import run_on_memnet
from .support.moshpit_groups import asked_options  # noqa: E402

PER = 50


def test_a_claimed_huge_weight_does_not_undo_clipping_hostile() -> None:
    """One of 8 sends its gradient sign-flipped and claims 2**24 samples (the old cap) against honest 32s:
    clipped to the median norm, it still was the whole average (cos -0.88 with the honest mean). Its weight
    now counts for at most WEIGHT_BOUND times the median weight, and the average points the honest way."""
    n, length = 8, 4000
    xs = gradients(n, length, 0)
    ws = [32.0] * n
    ws[0] = DEFAULT_MAX_WEIGHT
    honest = np.mean(np.stack(xs[1:]).astype(np.float64), axis=0)
    cores = [byzantine("signflip" if i == 0 else None)(GROUP, n, i, xs[i], ws[i], 0.0, max_payload=payload_for(PER),
                                                       options=replace(GROUP_OPTIONS, robust=Robust("clip", 1.0)))
             for i in range(n)]
    GroupNet(cores).run()
    a, b = length // n, length  # shards 1..7: honest owners
    for i in range(1, n):
        got = cores[i].result()
        assert cos(got[a:b], honest[a:b]) > 0.999  # bounded, then left out for pointing against the others
        assert cores[i].statistics().refused.get("weight_bounded") == 1
        assert cores[i].statistics().refused.get("opposed") == 1
        assert cores[i].statistics().weight_total == pytest.approx(32.0 * (n - 1))
    assert WEIGHT_BOUND * 32.0 < DEFAULT_MAX_WEIGHT
    # honest members of equal weight are never bounded: a robust average of them is their plain mean
    plain = [GroupAverage(GROUP, n, i, xs[i], 32.0, 0.0, max_payload=payload_for(PER)) for i in range(n)]
    bounded = [GroupAverage(GROUP, n, i, xs[i], 32.0, 0.0, options=replace(GROUP_OPTIONS, robust=Robust("clip", 1e6)),
                            max_payload=payload_for(PER)) for i in range(n)]
    GroupNet(plain).run()
    GroupNet(bounded).run()
    for p, r in zip(plain, bounded, strict=True):
        np.testing.assert_allclose(r.result(), p.result(), rtol=0, atol=2e-6)
        assert "weight_bounded" not in r.statistics().refused


def _attacked(n: int, bad: set[int], seed: int, robust: Robust | None) -> tuple[list[GroupAverage], np.ndarray]:
    """n members of equal weight, those in ``bad`` sign-flipping their contributions at normal size."""
    xs = gradients(n, 400 * n, seed)
    cores = [byzantine("signflip" if i in bad else None)(GROUP, n, i, xs[i], 32.0, 0.0, max_payload=payload_for(PER),
                                                          options=replace(GROUP_OPTIONS, robust=robust))
             for i in range(n)]
    GroupNet(cores).run()
    honest = np.mean(np.stack([x for i, x in enumerate(xs) if i not in bad]).astype(np.float64), axis=0)
    return cores, honest


def test_a_sign_flip_of_normal_size_is_left_out_hostile() -> None:
    """One of 8 sends its gradient sign-flipped at its own size: clipping let it through (it is no larger than
    anyone's), and it cancelled a member's worth of the honest signal besides its own. It is now left out."""
    n = 8
    plain, honest = _attacked(n, {0}, 6, None)
    cores, _ = _attacked(n, {0}, 6, Robust("clip", 1.0))
    a = 400  # shards 1..7: honest owners
    assert cos(plain[1].result()[a:], honest[a:]) < 0.99
    for core in cores[1:]:
        assert core.statistics().refused.get("opposed") == 1
        assert cos(core.result()[a:], honest[a:]) > 0.999


def test_two_colluding_sign_flippers_of_8_never_reverse_the_honest_direction_hostile() -> None:
    """Two of 8 flip together (each looks, to the others' sum, like a member against them): each honest owner's
    shard still points the honest way, and the colluders are left out."""
    n = 8
    for seed in range(3):
        cores, honest = _attacked(n, {0, 1}, 7 + seed, Robust("clip", 1.0))
        for i in range(2, n):
            lo, hi = 400 * i, 400 * (i + 1)
            assert cos(cores[i].result()[lo:hi], honest[lo:hi]) > 0.9
            assert cores[i].statistics().refused.get("opposed") == 2


def test_arc_topk_rows_are_clipped_where_the_run_asks_for_robust_hostile() -> None:
    """One of 4 multiplies its dense rows by 1000 in an arc-topk average whose run asks for robust clip:
    the rows were averaged unclipped (max 1135 against honest 3.9). Now the dense phase clips them."""
    plan = plan_for(4)
    xs = gradients(4, plan.layout.length, 1)
    ws = [8.0] * 4

    def scale(i: int, phase: int, vector: np.ndarray) -> np.ndarray:
        return vector * np.float32(1000) if i == 3 and phase == 2 else vector

    honest = wmean(xs, ws, range(3))
    plain, _ = run_group(plan, xs, ws, tamper=scale)
    clipped, _ = run_group(plan, xs, ws, tamper=scale, robust=Robust("clip", 1.0))
    top = float(np.abs(honest).max())
    assert max(float(np.abs(r.vector).max()) for r in plain[:3]) > 100 * top  # the attack, unclipped
    for r in clipped[:3]:
        assert r.known == 4 and r.got_fraction == 1.0
        assert float(np.abs(r.vector).max()) < 3 * top
    # honest members, clip at a large C: arc-topk with robust is arc-topk without it
    calm, _ = run_group(plan, xs, ws)
    wide, _ = run_group(plan, xs, ws, robust=Robust("centered", 1e6))  # centered clips around zero here
    for c, w in zip(calm, wide, strict=True):
        np.testing.assert_allclose(w.vector, c.vector, rtol=0, atol=1e-5)


def test_a_non_owner_cannot_blend_words_into_an_owners_selection_hostile() -> None:
    """A member puts finite words in owner 0's selection segment instead of NaN: they were averaged in, the
    selection then decoded for nobody, shard 0's rows were never averaged, and every member still reported
    got_fraction 1.0. The selection phase now runs solo: owner 0's segment is its bitmap alone."""
    plan = plan_for(4)
    xs = gradients(4, plan.layout.length, 2)
    ws = [8.0] * 4
    seg = plan.selection_segment

    def poison(i: int, phase: int, vector: np.ndarray) -> np.ndarray:
        if i == 3 and phase == 1:
            vector[:seg] = 1e6  # owner 0's segment
        return vector

    res, _ = run_group(plan, xs, ws, tamper=poison)
    clean, _ = run_group(plan, xs, ws)
    for r, c in zip(res, clean, strict=True):
        assert r.known == 4 and r.complete and r.got_fraction == 1.0
        np.testing.assert_array_equal(r.vector, c.vector)


def test_a_lost_selection_is_not_reported_as_averaged_and_counts_its_rows_hostile() -> None:
    """A member that never learns a shard's selection averages none of its rows: the round is incomplete, and
    got_fraction counts those rows as not averaged (it said 1.0: only the rows it had contributed counted)."""
    from .support.groups import AG_DATA

    plan = plan_for(4)
    xs = gradients(4, plan.layout.length, 3)
    ws = [8.0] * 4

    def drop(phase: int, w) -> bool:  # member 2 never hears owner 0's selection
        return phase == 1 and w.mtype == AG_DATA and w.src == 0 and w.dst == 2

    res, _ = run_group(plan, xs, ws, drop)
    assert [r.complete for r in res] == [True, True, False, True]
    lay = plan.layout
    missing = lay.dense_size(0) / sum(lay.dense_size(j) for j in range(4))
    assert res[2].got_fraction == pytest.approx(1.0 - missing)
    assert ArcTopKResult(np.zeros(1), 3, 0.5, selections=[None, 1, 1, 1]).complete is False


def test_ef21m_forgets_what_no_average_refreshed_hostile() -> None:
    """A poisoned average in u (573 against honest 3.8) stayed there for as long as its rows went unselected:
    for ever, if their selection never decoded. An element of u not refreshed for max_age rounds is reset."""
    ef = EF21M(0.5, max_age=8)
    length = 40
    g = np.ones(length, np.float32)
    nothing = np.zeros(length, bool)
    ef.begin(g, "layout")
    poisoned = np.full(length, 573.0, np.float32)
    ef.finish(got=np.ones(length, bool), avg=poisoned)
    fresh = np.arange(length) < 10  # these rows keep being averaged
    for _ in range(7):
        ef.begin(g, "layout")
        u = ef.finish(got=fresh, avg=np.ones(length, np.float32))
    assert (u[~fresh] == 573.0).all()  # 7 rounds unrefreshed: kept (an ordinary unselected row)
    ef.begin(g, "layout")
    u = ef.finish(got=fresh, avg=np.ones(length, np.float32))
    assert (u[~fresh] == 0.0).all() and (u[fresh] == 1.0).all()
    assert ef.aged_out == length - 10
    v = ef.begin(g, "layout")
    assert (v[~fresh] == ef.h[~fresh]).all()  # the score asks for the rows again
    ef.finish(got=nothing, avg=np.zeros(length, np.float32))
    assert ef.aged_out == length - 10  # zeros are not counted again
    with pytest.raises(ValueError, match="max_age"):
        EF21M(0.5, max_age=0)


def test_the_owner_canary_is_of_the_values_size() -> None:
    """Under robust clipping the owner's canary adds nothing unusual to its norm: tiny gradients (1e-4) with a
    canary of 1 would clip the owner's own rows by 100x and bias every selected row."""
    plan = ArcTopKPlan.build(SHAPES, 4, 0.25, 4 * 40 + 20)
    xs = [x * np.float32(1e-4) for x in gradients(4, plan.layout.length, 4)]
    ws = [8.0] * 4
    calm, _ = run_group(plan, xs, ws)
    clipped, _ = run_group(plan, xs, ws, robust=Robust("clip", 2.0))
    for c, r in zip(calm, clipped, strict=True):
        np.testing.assert_allclose(r.vector, c.vector, rtol=0, atol=1e-9)


class PhaseAllreduce:
    """An averager that hands every phase's vector back as it came (each member alone with its own values: only
    its own selection decodes) and records the keywords each phase got."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.max_body = 4 * 40 + 20

    async def average(self, group_id, members, index, vector, weight, options=DEFAULT_OPTIONS, *, out=None,
                      center=None):
        self.calls.append(asked_options(options, center))
        phase = SimpleNamespace(silent=(), datagrams_expected=4, datagrams_received=4, datagrams_sent=4,
                                ended_by="completion")
        stats = SimpleNamespace(reduce_scatter=phase, all_gather=phase, drops={}, refused={})
        return SimpleNamespace(vector=vector.copy(), stats=stats, seconds=0.0, handshake_s=0.0, bytes_sent=10)


def test_an_arc_topk_round_takes_the_runs_robust_and_is_not_averaged_without_every_selection_hostile() -> None:
    """The run says robust clip:1, and its arc-topk rounds averaged unclipped; a round whose selections did not
    all decode reported ``averaged``. Now the sketch and dense phases get the run's robust mode (clip), the
    selection phase runs solo, and such a round is ``failed`` with the member's own vector."""
    from .support.moshpit_groups import _group, node

    async def main(net: Any, nursery: trio.Nursery) -> None:
        fake = PhaseAllreduce()
        a = node(net, 0, allreduce=fake)
        shapes = [list(s) for s in SHAPES]
        st = await a.moshpit.open("run", grid=Grid(1, 4), window_s=1.0, robust="centered:2",
                                  compression="arc-topk", topk_layout=shapes, topk_ratio=0.25)
        vec = gradients(1, st.topk.length, 5)[0]
        res = await a.moshpit._average_group(st, _group(a), vec, 1.0, 10.0, 0, "k", 2)
        assert [c.get("robust") for c in fake.calls] == [Robust("clip", 2.0), None, Robust("clip", 2.0)]
        assert [c.get("solo", False) for c in fake.calls] == [False, True, False]
        assert res.outcome == "failed" and "did not decode" in res.error
        assert np.array_equal(res.vector, vec) and res.received_fraction < 1.0

    run_on_memnet(main)


def _left_out(n: int, shard: int, signal: float, seeds: range, bad: set[int]) -> tuple[int, int]:
    """Over groups of n members with ``shard`` elements per owner (a common signal of ``signal`` times the noise,
    those in ``bad`` sign-flipped): (honest members left out, bad members left out), summed over owners."""
    honest_out = bad_out = 0
    options = replace(GROUP_OPTIONS, robust=Robust("clip", 1e6))
    for seed in seeds:
        rng = np.random.default_rng(seed)
        common = signal * rng.standard_normal(n * shard)
        xs = [(common + rng.standard_normal(n * shard)).astype(np.float32) for _ in range(n)]
        cores = [byzantine("signflip" if i in bad else None)(GROUP, n, i, xs[i], 32.0, 0.0,
                                                              max_payload=payload_for(PER),
                                                              options=options)
                 for i in range(n)]
        GroupNet(cores).run()
        for i, core in enumerate(cores):
            if i not in bad:
                honest_out += len(core._excluded - bad)
                bad_out += len(core._excluded & bad)
    return honest_out, bad_out


def test_honest_members_over_few_elements_are_not_left_out_hostile() -> None:
    """arc-topk's sketches and rows hold tens of values per owner: honest cosines with the others' sum scatter by
    about 1/sqrt(elements) there, and a fixed -0.05 left an honest member out of nearly every owner's average (the
    8-member MLP demo's honest arc-topk runs 2 points short). The threshold now grows as 2/sqrt(elements) over few
    elements: honest members stay in, and a sign flip of a member that agrees with the others is still left out."""
    n, shard = 8, 40
    honest_out, _ = _left_out(n, shard, 0.3, range(6), set())
    assert honest_out <= 2, honest_out  # of 6 x 8 x 7 = 336 (a fixed -0.05 left out 32)
    honest_out, bad_out = _left_out(n, shard, 1.0, range(6), {0})
    assert bad_out == 6 * (n - 1) and honest_out == 0
    assert opposed_cos(shard) == pytest.approx(2.0 / math.sqrt(shard)) and opposed_cos(10**6) == OPPOSED_COS


def test_a_sign_flipped_member_does_not_take_honest_members_out_with_it_hostile() -> None:
    """Owner 0 and two honest members agree; member 3 sends the negated vector at twice their weight. Measured
    all at once, each honest member's others' sum held the attacker's -2 x signal, which cancelled the honest
    signal in it: both honest members pointed against it (cosines -0.23 and -0.5) and were left out with the
    attacker, so the owner's shard was its own vector alone. Left out one at a time (the most opposed first, then
    measured again without it), only the attacker goes."""
    x = np.array([[1.0, 0.5, 0.0], [1.0, -0.8, 0.3], [1.0, 0.5, -0.3], [-2.0, -1.0, 0.0]])
    gram = x @ x.T
    big = [10**6] * 4  # threshold -OPPOSED_COS
    others = x.sum(axis=0) - x
    at_once = {s for s in (1, 2, 3) if cos(x[s], others[s]) < -OPPOSED_COS}
    assert at_once == {1, 2, 3}  # what measuring every member against the same sums left out
    assert opposed_members(gram, [0, 1, 2, 3], 0, big) == {3}
    assert 3 not in opposed_members(gram, [0, 1, 2, 3], 3, big)  # the owner never leaves itself out
    assert opposed_members(gram, [0, 1, 3], 0, big) == {3}  # then 2 are left: no further test
