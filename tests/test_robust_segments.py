"""The default gradient robust (``clip`` at MAX_C: the weight bound and the direction test) decides a large shard's
head as soon as it is final, over the head alone, and its tail at the end over the whole shard (robust.segment_ends),
so an owner sends its head's average while the tail's last contributions still arrive; the tail holds what one
decision over the shard gives. A member is counted once a round, however many decisions left it out.

Whole groups of the sans-I/O core over the in-test network (virtual time), with the tail's least size lowered so
that small vectors hold a head and a tail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from peerd.allreduce import robust as robust_module
from peerd.allreduce.group import GROUP_OPTIONS, GroupAverage
from peerd.allreduce.options import AverageOptions
from peerd.allreduce.robust import MAX_C, WEIGHT_BOUND, Robust, segment_ends

from .support.groups import AG_DATA, GROUP, RS_DATA, GroupNet, Wire, payload_for

N, SHARD, PER, TAIL = 4, 3200, 50, 400  # 64 ranges a shard: a head of 56, a tail of 8
HEAD = SHARD - TAIL  # values
LENGTH = N * SHARD
DEFAULT = Robust("clip", MAX_C)  # what a gradient average runs with when the trainer sets no robust


@pytest.fixture(autouse=True)
def small_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(robust_module, "TAIL_ELEMENTS", TAIL)


def honest(seed: int = 0) -> tuple[list[np.ndarray], list[float]]:
    """Gradients with a common signal, and sample counts within WEIGHT_BOUND of each other."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(LENGTH)
    xs = [(signal + 0.5 * rng.standard_normal(LENGTH)).astype(np.float32) for _ in range(N)]
    return xs, [float(w) for w in rng.integers(10, 20, N)]


def run(xs: list[np.ndarray], ws: list[float], robust: Robust | None, options: AverageOptions = GROUP_OPTIONS,
        drop: Callable[[Wire], bool] = lambda w: False) -> tuple[list[GroupAverage], dict[int, float]]:
    """The group's cores after the average, and when each owner first sent all-gather data."""
    cores = [GroupAverage(GROUP, N, i, xs[i], ws[i], 0.0, max_payload=payload_for(PER),
                          options=replace(options, robust=robust)) for i in range(N)]
    first_ag: dict[int, float] = {}
    for i, core in enumerate(cores):
        send = core.datagrams_to_send

        def recorded(now: float, limit: int, send=send, i=i) -> list:
            out = send(now, limit)
            if any(o.type == AG_DATA for o in out):
                first_ag.setdefault(i, now)
            return out

        core.datagrams_to_send = recorded  # type: ignore[method-assign]
    GroupNet(cores, drop=drop).run()
    return cores, first_ag


def mean(xs: list[np.ndarray], ws: list[float], members: list[int]) -> np.ndarray:
    return sum(ws[i] * xs[i].astype(np.float64) for i in members) / sum(ws[i] for i in members)


def test_only_the_default_gradient_robust_on_a_large_shard_decides_its_head_early() -> None:
    assert segment_ends(64, SHARD, DEFAULT) == [56, 64]
    assert segment_ends(64, SHARD, Robust("clip", 1.0)) == [64]  # a clipping the user chose: one decision
    assert segment_ends(64, SHARD, Robust("centered", MAX_C)) == [64]
    assert segment_ends(64, SHARD, None) == [64]
    assert segment_ends(64, 2 * TAIL - 1, DEFAULT) == [64]  # too few values for a head as large as the tail
    assert segment_ends(1, SHARD, DEFAULT) == [1]
    assert segment_ends(1000, 1000 * TAIL, DEFAULT) == [875, 1000]  # the tail an eighth of a large shard


def test_the_head_goes_before_the_reduce_scatter_ends_and_no_honest_value_changes() -> None:
    """Honest members: the owner's first all-gather data goes out while its reduce-scatter still runs (a whole-
    shard decision waits for the last contribution), and the result is the plain weighted mean either way."""
    xs, ws = honest()
    segmented, early = run(xs, ws, DEFAULT)
    whole, late = run(xs, ws, Robust("clip", 1e5))  # (clipping only far past the median, decided per shard)
    expect = mean(xs, ws, list(range(N)))
    for i in range(N):
        assert early[i] < segmented[i].phase_state(0)[1]
        assert late[i] >= whole[i].phase_state(0)[1]
        np.testing.assert_allclose(segmented[i].result(), expect, rtol=0, atol=2e-5)
        np.testing.assert_array_equal(segmented[i].result(), whole[i].result())
        assert not segmented[i].statistics().refused
        assert segmented[i].overlaps and not whole[i].overlaps


def test_under_loss_head_and_tail_average_what_arrived_as_one_decision_would() -> None:
    """Every seventh reduce-scatter datagram lost: each range is averaged over what arrived, exactly as a decision
    over the whole shard averages it (honest members: no factor, no one left out)."""
    xs, ws = honest(3)

    def lossy(w: Wire) -> bool:
        return w.mtype == RS_DATA and w.seq % 7 == 3

    segmented, _ = run(xs, ws, DEFAULT, drop=lossy)
    whole, _ = run(xs, ws, Robust("clip", 1e5), drop=lossy)
    for i in range(N):
        np.testing.assert_array_equal(segmented[i].result(), whole[i].result())
        rs = segmented[i].statistics().reduce_scatter
        assert rs.datagrams_received < rs.datagrams_expected


def test_a_flip_in_the_head_is_left_out_and_one_in_the_tail_meets_the_whole_shard_test_hostile() -> None:
    """A member sign-flipped in its contributions' heads only is left out of the head (tested there alone) and of
    the tail (its flip is most of the shard), counted once; one flipped in the tails only meets the test one
    decision over the whole shard gives: the owner's result is that decision's, value for value."""
    xs, ws = honest(1)
    bad = 2
    heads, tails = xs[bad].copy(), xs[bad].copy()
    for j in range(N):
        heads[j * SHARD : j * SHARD + HEAD] *= -1
        tails[j * SHARD + HEAD : (j + 1) * SHARD] *= -1
    attacked = [heads if i == bad else x for i, x in enumerate(xs)]
    cores, _ = run(attacked, ws, DEFAULT)
    without = mean(attacked, ws, [i for i in range(N) if i != bad])
    for owner in (0, 1, 3):
        base = owner * SHARD
        got = cores[owner].result()[base : base + SHARD]
        np.testing.assert_allclose(got, without[base : base + SHARD], rtol=0, atol=2e-5)
        assert cores[owner].statistics().refused.get("opposed") == 1
        assert cores[owner].statistics().opposed == (bad,)
    attacked = [tails if i == bad else x for i, x in enumerate(xs)]
    cores, _ = run(attacked, ws, DEFAULT)
    whole, _ = run(attacked, ws, Robust("clip", 1e5))  # one decision a shard, clipping as far off as MAX_C's
    for owner in (0, 1, 3):
        base = owner * SHARD
        np.testing.assert_array_equal(cores[owner].result()[base + HEAD : base + SHARD],
                                      whole[owner].result()[base + HEAD : base + SHARD])


def test_a_whole_flip_is_left_out_of_head_and_tail_and_a_huge_weight_bounded_in_both_hostile() -> None:
    """One member sign-flips everything, another claims 10^6 samples: the head and the tail of every honest owner's
    shard leave the first out and bound the second at WEIGHT_BOUND times the median weight, each counted once."""
    xs, ws = honest(2)
    flip, heavy = 1, 3
    attacked = [-x if i == flip else x for i, x in enumerate(xs)]
    claimed = [1e6 if i == heavy else w for i, w in enumerate(ws)]
    cores, _ = run(attacked, claimed, DEFAULT)
    for owner in (0, 2):
        heard = sorted(claimed)
        bound = WEIGHT_BOUND * float(np.median(heard))
        weights = [min(w, bound) for w in claimed]
        expect = mean(attacked, weights, [i for i in range(N) if i != flip])
        base = owner * SHARD
        np.testing.assert_allclose(cores[owner].result()[base : base + SHARD], expect[base : base + SHARD], rtol=0,
                                   atol=2e-5)
        refused = cores[owner].statistics().refused
        assert refused.get("opposed") == 1 and refused.get("weight_bounded") == 1


def test_arc_topk_phases_keep_one_test_per_shard() -> None:
    """arc-topk's suspects take each round's verdicts as evidence: its phases decide a shard at once."""
    from peerd.allreduce.arctopk import phase_options

    for phase in (0, 2):
        assert not phase_options(replace(GROUP_OPTIONS, robust=DEFAULT), phase).segments
    with pytest.raises(ValueError, match="segments"):
        AverageOptions(segments=1)  # type: ignore[arg-type]
