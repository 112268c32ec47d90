"""Robust aggregation (allreduce/robust.py, AverageOptions.robust): norm clipping at the shard owner, and
members that point against the others left out.

Each scenario runs whole groups of the sans-I/O core over the in-test network of test_allreduce_core, with
one member corrupting its reduce-scatter contributions through the fault injector (``peerd.tools.faults``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from peerd.allreduce.group import GROUP_OPTIONS, GroupAverage
from peerd.allreduce.robust import Robust, parse_robust
from peerd.tools.faults import byzantine

from .support.groups import GROUP, RS_DATA, GroupNet, payload_for

N, LENGTH, PER = 5, 3000, 50


def honest_inputs(seed: int = 0) -> tuple[list[np.ndarray], list[float], np.ndarray]:
    """Members' gradients: a common signal plus noise of the same size, as honest replicas would have."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(LENGTH)
    xs = [(signal + 0.5 * rng.standard_normal(LENGTH)).astype(np.float32) for _ in range(N)]
    # sample counts within WEIGHT_BOUND of each other, as DropCompute's are: no honest weight is bounded
    ws = [float(w) for w in rng.integers(10, 20, N)]
    return xs, ws, signal


def run(xs, ws, *, bad: int | None = None, mode: str | None = None, robust: Robust | None = None,
        center: np.ndarray | None = None, drop=None) -> list[GroupAverage]:
    m = [
        byzantine(mode if i == bad else None)(GROUP, len(xs), i, xs[i], ws[i], 0.0, max_payload=payload_for(PER),
                                              options=replace(GROUP_OPTIONS, robust=robust), center=center)
        for i in range(len(xs))
    ]
    GroupNet(m, **({"drop": drop} if drop else {})).run()
    return m


def weighted_mean(xs, ws, members) -> np.ndarray:
    return sum(ws[i] * xs[i].astype(np.float64) for i in members) / sum(ws[i] for i in members)


def test_parse_robust() -> None:
    assert parse_robust(None) is None and parse_robust("off") is None and parse_robust("") is None
    assert parse_robust("clip") == Robust("clip", 1.0)
    assert parse_robust("centered:3.5") == Robust("centered", 3.5)
    for bad in ("median", "clip:0", "clip:x", "clip:inf", 3):
        with pytest.raises(ValueError):
            parse_robust(bad)


def test_scaled_member_is_clipped_and_the_result_stays_near_the_honest_mean() -> None:
    xs, ws, _ = honest_inputs()
    honest = weighted_mean(xs, ws, range(1, N))
    plain = run(xs, ws, bad=0, mode="scale")
    clipped = run(xs, ws, bad=0, mode="scale", robust=Robust("clip", 2.0))
    err_plain = np.sqrt(np.mean((plain[1].result() - honest) ** 2))
    err_clip = np.sqrt(np.mean((clipped[1].result() - honest) ** 2))
    assert err_plain > 50  # x1000 from one member of five, weighted: the plain mean is ruined
    # clipped to 2x the median norm, the bad member still moves the mean, but by about its weight share
    assert err_clip < 2.0 and err_clip < err_plain / 50
    for i, core in enumerate(clipped):
        refused = core.statistics().refused
        assert refused.get("clipped", 0) == (1 if i != 0 else 0)  # the bad member's own shard is honest
        assert np.isfinite(core.result()).all()


def test_sign_flipped_member_of_normal_size_is_left_out() -> None:
    """Norm clipping bounds the size of a contribution, not its direction: a sign-flipped gradient of normal
    size passes clipping. Its direction gives it away: it points against the sum of the others, so every
    honest owner leaves it out, and their shards hold the honest members' weighted mean."""
    xs, ws, _ = honest_inputs(1)
    ws[0] = 19.0  # the heaviest member flips
    plain = run(xs, ws, bad=0, mode="signflip")
    robust = run(xs, ws, bad=0, mode="signflip", robust=Robust("clip", 2.0))
    flipped = [-xs[0]] + xs[1:]
    a = LENGTH // N  # shards 1.., owned by honest members
    np.testing.assert_allclose(plain[2].result()[a:], weighted_mean(flipped, ws, range(N))[a:], atol=1e-5)
    honest = weighted_mean(xs, ws, range(1, N))
    for i, r in enumerate(robust):
        assert r.statistics().refused.get("clipped", 0) == 0
        assert r.statistics().refused.get("opposed", 0) == (1 if i != 0 else 0)  # owner 0 never leaves itself out
        np.testing.assert_allclose(r.result()[a:], honest[a:], atol=1e-5)
    assert robust[1].statistics().weight_total == pytest.approx(sum(ws[1:]))


def test_honest_members_are_never_left_out() -> None:
    """Honest gradients share a signal: none points against the sum of the others, so none is left out."""
    for seed in range(5):
        xs, ws, _ = honest_inputs(10 + seed)
        for r in run(xs, ws, robust=Robust("clip", 1e6)):
            assert "opposed" not in r.statistics().refused


@pytest.mark.parametrize("mode", ["clip", "centered"])
def test_all_honest_with_a_large_c_is_the_plain_mean(mode: str) -> None:
    xs, ws, signal = honest_inputs(2)
    center = signal.astype(np.float32) if mode == "centered" else None
    plain = run(xs, ws)
    robust = run(xs, ws, robust=Robust(mode, 1e6), center=center)
    for p, r in zip(plain, robust, strict=True):
        np.testing.assert_allclose(r.result(), p.result(), rtol=0, atol=2e-6)
        assert r.statistics().refused == {}


def test_centered_clips_around_the_center() -> None:
    """Centered: distances from the previous average; a member far from it is pulled in, the result is the
    center plus the weighted mean of the clipped differences."""
    xs, ws, signal = honest_inputs(3)
    center = signal.astype(np.float32)
    honest = weighted_mean(xs, ws, range(1, N))
    m = run(xs, ws, bad=0, mode="scale", robust=Robust("centered", 2.0), center=center)
    err = np.sqrt(np.mean((m[1].result() - honest) ** 2))
    assert err < 2.0
    # without a center it is clip around zero: the same bound holds
    m0 = run(xs, ws, bad=0, mode="scale", robust=Robust("centered", 2.0))
    assert np.sqrt(np.mean((m0[1].result() - honest) ** 2)) < 2.0


def test_lost_datagrams_do_not_favour_a_member_and_ranges_stay_unbiased() -> None:
    """Norms are per element delivered: a bad member that lost most of its datagrams is clipped all the
    same, and a range that lost a sender is averaged over the senders that arrived (with their factors)."""
    xs, ws, _ = honest_inputs(4)
    # member 0 (scaled) reaches owners only with every third range; member 2 loses range 1 of every shard
    def drop(w) -> bool:
        if w.mtype != RS_DATA:
            return False
        if w.src == 0:
            return (w.offset // PER) % 3 != 0
        return w.src == 2 and w.offset % (LENGTH // N) == PER

    m = run(xs, ws, bad=0, mode="scale", robust=Robust("clip", 2.0), drop=drop)
    honest = weighted_mean(xs, ws, range(1, N))
    for i in range(1, N):
        assert m[i].statistics().refused.get("clipped", 0) == 1
    assert np.sqrt(np.mean((m[1].result() - honest) ** 2)) < 2.0
    # owner 1's range 1: members 1, 3, 4 arrived (0 and 2 lost it), none clipped: their plain weighted mean
    a = LENGTH // N + PER
    np.testing.assert_allclose(m[1].result()[a : a + PER], weighted_mean(xs, ws, [1, 3, 4])[a : a + PER], atol=1e-5)


def test_a_nan_member_is_refused_before_the_norms() -> None:
    xs, ws, _ = honest_inputs(5)
    m = run(xs, ws, bad=0, mode="nan", robust=Robust("clip", 2.0))
    honest = weighted_mean(xs, ws, range(1, N))
    a = LENGTH // N
    for core in m[1:]:
        assert np.isfinite(core.result()).all()
        assert core.statistics().refused.get("nonfinite", 0) >= 1
    np.testing.assert_allclose(m[1].result()[a : 2 * a], honest[a : 2 * a], atol=1e-5)


def test_robust_arguments_are_checked() -> None:
    v = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="robust"):
        GroupAverage(GROUP, 2, 0, v, 1.0, 0.0, options=replace(GROUP_OPTIONS, robust="clip"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="center"):
        GroupAverage(GROUP, 2, 0, v, 1.0, 0.0, options=replace(GROUP_OPTIONS, robust=Robust("centered")),
                     center=np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="center"):
        GroupAverage(GROUP, 2, 0, v, 1.0, 0.0, options=replace(GROUP_OPTIONS, robust=Robust("centered")),
                     center=np.full(8, np.nan, np.float32))


def test_huge_finite_values_are_clipped_not_refused() -> None:
    """Squares of 1e30 overflow float32: the norms are taken again in float64, so a huge but finite member
    is clipped (not refused as non-finite), and the result stays finite and near the honest mean."""
    xs, ws, _ = honest_inputs(6)
    xs[0] = (xs[0] * np.float32(1e30)).astype(np.float32)
    m = run(xs, ws, robust=Robust("clip", 2.0))
    honest = weighted_mean(xs, ws, range(1, N))
    for core in m[1:]:
        assert core.statistics().refused == {"clipped": 1}
        assert np.isfinite(core.result()).all()
    assert np.sqrt(np.mean((m[1].result() - honest) ** 2)) < 2.0
