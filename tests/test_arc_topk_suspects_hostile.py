"""arc-topk's sketch phase and the dense phase's verdict: a sketch shard holds too few values for its owner's own
direction test to tell a sign flip from noise, so an owner leaves out of its sketch shard the members its recent
dense phases found opposed (robust.Suspects)."""

from __future__ import annotations

import numpy as np
import pytest

from peerd.allreduce.options import AverageOptions
from peerd.allreduce.robust import MAX_C, MAX_SUSPECTS, SUSPECT_ROUNDS, Robust, Suspects

from .support.arctopk import plan_for, run_group, wmean

N = 8
BAD = 0
ROBUST = Robust("clip", MAX_C)  # what a trainer's gradient averages run with by default
SHAPES = [(256, 32)]
RATIO = 0.125


def gradients(seed: int) -> list[np.ndarray]:
    """Honest members' gradients as training makes them: a shared signal in an eighth of the rows (those the
    selection picks), noise everywhere. Over a whole row shard's sketch the members barely agree (a correlation
    of about 0.06); over the selected rows they do (about 0.33)."""
    rng = np.random.default_rng(seed)
    signal = np.zeros(SHAPES[0])
    signal[::8] = 0.7 * rng.standard_normal((SHAPES[0][0] // 8, SHAPES[0][1]))
    return [(signal + rng.standard_normal(SHAPES[0])).astype(np.float32).ravel() for _ in range(N)]


def _flip(i: int, phase: int, vector: np.ndarray) -> np.ndarray:
    """Member BAD sends its sketches and rows sign-flipped (its selection as an owner stays honest)."""
    return -vector if i == BAD and phase != 1 else vector


def _round(plan, xs, ws, suspects: list[Suspects] | None):
    ids = [bytes([k]) * 32 for k in range(N)]
    exclude = None if suspects is None else [suspects[k].among(ids, k) for k in range(N)]
    results, nets = run_group(plan, xs, ws, tamper=_flip, robust=ROBUST, sketch_exclude=exclude)
    if suspects is not None:
        for k, core in enumerate(nets[2].m):
            suspects[k].observe(ids, core.statistics().opposed)
    return results, nets


def test_a_sign_flipper_the_dense_phase_found_is_left_out_of_the_next_sketches_hostile() -> None:
    """One of 8 flips its sketches and rows. Its sketch got into honest owners' sketch shards (too few values for
    the direction test: tens a shard), skewing their row selections; each honest owner's dense phase does find it
    (hundreds of values a shard). Now that verdict leaves it out of the owner's next sketch shards: every honest
    owner's sketch average is the honest members' mean exactly."""
    plan = plan_for(N, ratio=RATIO, shapes=SHAPES)
    ws = [8.0] * N
    suspects = [Suspects() for _ in range(N)]
    xs = gradients(3)
    _, nets = _round(plan, xs, ws, suspects)
    for k in range(1, N):
        assert nets[2].m[k].statistics().opposed == (BAD,)  # the dense verdict
        assert suspects[k].among([bytes([j]) * 32 for j in range(N)], k) == (BAD,)
    xs = gradients(4)
    sketches = [plan.sketch_vector(x, 0xFEED, 7) for x in xs]
    honest = wmean(sketches, ws, range(1, N))
    plain, plain_nets = run_group(plan, xs, ws, tamper=_flip, robust=ROBUST)
    _, nets = _round(plan, xs, ws, suspects)
    seg = plan.sketch_segment
    skewed = 0
    for k in range(1, N):
        lo, hi = k * seg, (k + 1) * seg
        got = nets[0].m[k].result()[lo:hi]
        np.testing.assert_allclose(got, honest[lo:hi], rtol=0, atol=1e-5)
        skewed += not np.allclose(plain_nets[0].m[k].result()[lo:hi], honest[lo:hi], rtol=0, atol=1e-5)
    assert skewed >= 3  # without the verdict the flipped sketches got in at most honest owners


def test_honest_members_keep_their_sketches_in() -> None:
    """No member flips: over a few rounds the dense phases leave nobody out, so no sketch shard does either."""
    plan = plan_for(N, ratio=RATIO, shapes=SHAPES)
    ws = [8.0] * N
    suspects = [Suspects() for _ in range(N)]
    for seed in range(3):
        xs = gradients(10 + seed)
        ids = [bytes([k]) * 32 for k in range(N)]
        _, nets = run_group(plan, xs, ws, robust=ROBUST, sketch_exclude=[s.among(ids, k) for k, s in
                                                                        enumerate(suspects)])
        for k, core in enumerate(nets[2].m):
            suspects[k].observe(ids, core.statistics().opposed)
            assert core.statistics().opposed == ()
        assert all(not s.left for s in suspects)


def test_suspicion_ages_out_and_is_bounded_hostile() -> None:
    """A suspect is left out for SUSPECT_ROUNDS averages after its last verdict, never the owner itself; a member
    naming many identities cannot grow the record past MAX_SUSPECTS."""
    s = Suspects()
    ids = [b"a", b"b", b"c"]
    s.observe(ids, (1, 7, -1))  # out-of-range indices are ignored
    assert s.among(ids, 0) == (1,)
    assert s.among(ids, 1) == ()  # the owner never leaves itself out
    for _ in range(SUSPECT_ROUNDS - 1):
        s.observe(ids, ())
        assert s.among(ids, 0) == (1,)
    s.observe(ids, ())
    assert s.among(ids, 0) == ()
    many = [i.to_bytes(4, "little") for i in range(MAX_SUSPECTS + 50)]
    s.observe(many, tuple(range(len(many))))
    assert len(s.left) == MAX_SUSPECTS


def test_exclude_takes_member_indices_only() -> None:
    assert AverageOptions(exclude=[2, 3]).exclude == (2, 3)
    with pytest.raises(ValueError, match="exclude"):
        AverageOptions(exclude=(-1,))
