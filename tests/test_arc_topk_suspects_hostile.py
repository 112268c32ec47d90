"""arc-topk's sketch phase and the dense phase's verdict: a sketch shard holds too few values for its owner's own
direction test to tell a sign flip from noise, so an owner leaves out of its sketch shard the members its recent
dense phases found opposed (robust.Suspects)."""

from __future__ import annotations

import numpy as np
import pytest

from peerd.allreduce.options import AverageOptions
from peerd.allreduce.robust import (
    BAN_ROUNDS,
    MAX_BAN_ROUNDS,
    MAX_C,
    MAX_SUSPECTS,
    PRIOR_TESTS,
    STRIKE_WINDOW,
    STRIKES,
    SUSPECT_ROUNDS,
    Robust,
    Suspects,
    member_cosines,
    opposed_members,
)
from peerd.tools.faults import byzantine

from .support.arctopk import plan_for, run_group, wmean

N = 8
BAD = 0
ROBUST = Robust("clip", MAX_C)  # what a trainer's gradient averages run with by default
SHAPES = [(256, 32)]
RATIO = 0.125


def gradients(seed: int, signal_rms: float = 0.7) -> list[np.ndarray]:
    """Honest members' gradients as training makes them: a shared signal in an eighth of the rows (those the
    selection picks), noise everywhere. Over a whole row shard's sketch the members barely agree (a correlation
    of about 0.06); over the selected rows they do (about 0.33; less with a weaker ``signal_rms``)."""
    rng = np.random.default_rng(seed)
    signal = np.zeros(SHAPES[0])
    signal[::8] = signal_rms * rng.standard_normal((SHAPES[0][0] // 8, SHAPES[0][1]))
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


def _daemon_attacker(k: int):
    """The cores as a daemon run with --fault-byzantine inflate-signflip has them: member BAD's negates every
    sketch and row it sends another owner and claims 2**24 samples (its own shard and all-gather stay honest)."""
    return byzantine("inflate-signflip" if k == BAD else None)


def test_a_member_found_opposed_repeatedly_stays_out_of_the_dense_rows_hostile() -> None:
    """The daemon's attacker (a --fault-byzantine core) flips its sketches and rows. A dense shard's direction
    test finds it in rounds where the members' rows agree, and misses it where they barely do: there, with one
    round's verdict alone, its negated rows got into every honest owner's dense average, and stayed in EF21M's
    estimate. An owner that found it opposed in STRIKES rounds bans it: in the round its own test misses it, the
    owner's dense shard is the mean of the honest members it kept, without the attacker's rows."""
    plan = plan_for(N, ratio=RATIO, shapes=SHAPES)
    ws = [8.0] * N
    ids = [bytes([k]) * 32 for k in range(N)]
    suspects = [Suspects() for _ in range(N)]

    def average(xs: list[np.ndarray], banning: bool):
        sketch = [s.among(ids, k) for k, s in enumerate(suspects)]
        dense = [s.banned_among(ids, k) if banning else () for k, s in enumerate(suspects)]
        _, nets = run_group(plan, xs, ws, robust=ROBUST, sketch_exclude=sketch, dense_exclude=dense,
                            factory=_daemon_attacker)
        return nets

    for r in range(STRIKES):  # rows that agree: most honest owners find the attacker every round
        nets = average(gradients(20 + r), True)
        for k, core in enumerate(nets[2].m):
            suspects[k].observe(ids, core.statistics().opposed)
    banning = [k for k in range(N) if k != BAD and BAD in suspects[k].banned_among(ids, k)]
    assert len(banning) >= 4
    weak = gradients(30, signal_rms=0.15)  # rows that barely agree: one round's test misses the attacker
    plain = average(weak, False)
    # owners whose own test misses it: without the ban, its negated rows are in their dense averages
    missed = [k for k in banning if BAD not in plain[2].m[k].statistics().opposed]
    assert len(missed) >= 3
    assert all(BAD not in plain[2].m[k].options.exclude for k in missed)
    nets = average(weak, True)
    dense_in = [plan.dense_vector(k, weak[k], [plan.read_selection(nets[1].m[k].result(), j) for j in range(N)])
                for k in range(N)]
    for k in missed:
        core = nets[2].m[k]
        kept = [j for j in range(N) if j not in core.options.exclude and j not in core.statistics().opposed]
        assert BAD not in kept
        slots = plan._slots(k)  # owner k's dense values (its segment, canaries left out)
        honest = wmean([v[slots] for v in dense_in], ws, kept)
        np.testing.assert_allclose(core.result()[slots], honest, rtol=0, atol=1e-5)
    for k in banning:  # the ban is served, then the attacker is tested again
        for _ in range(BAN_ROUNDS):
            suspects[k].observe(ids, ())
        assert BAD not in suspects[k].banned_among(ids, k)


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


def test_an_owners_verdicts_are_counted_for_its_status_and_bounded_hostile() -> None:
    """``statistics()`` (``peerd status``'s ``suspects``): the dense phases that tested each member, its bans ever,
    and who is banned now; a member out on a ban is not tested meanwhile, and many identities cannot grow the
    record past MAX_SUSPECTS."""
    s = Suspects()
    ids = [b"\x01", b"\x02", b"\x03"]
    for _ in range(STRIKES):
        s.observe(ids, (2,))
    st = s.statistics()
    assert st.tests == {"01": STRIKES, "02": STRIKES, "03": STRIKES} and st.bans == {"03": 1}
    assert st.banned_now == ["03"]
    for _ in range(BAN_ROUNDS + 1):
        s.observe(ids, ())
    st = s.statistics()
    assert st.tests["03"] == STRIKES + 1 and st.tests["01"] == STRIKES + BAN_ROUNDS + 1  # untested while banned
    assert st.bans == {"03": 1} and st.banned_now == []
    many = [i.to_bytes(4, "little") for i in range(MAX_SUSPECTS + 50)]
    s.observe(many, ())
    assert len(s.tested) == MAX_SUSPECTS and len(s.banned_total) <= MAX_SUSPECTS


def _banned_for(s: Suspects, ids: list[bytes], k: int) -> int:
    """Averages until member ``k`` is tested again (its ban's length), the owner (index 0) finding nobody opposed."""
    n = 0
    while k in s.banned_among(ids, 0):
        s.observe(ids, ())
        n += 1
    return n


def test_a_member_banned_again_is_banned_twice_as_long_hostile() -> None:
    """A flipper caught again at each retest serves bans of BAN_ROUNDS, twice that, and so on up to MAX_BAN_ROUNDS:
    the rounds its retests miss it (its rows then get in) come ever more rarely."""
    s = Suspects()
    ids = [b"own", b"bad", b"ok"]
    for _ in range(STRIKES):
        s.observe(ids, (1,))
    lengths = [_banned_for(s, ids, 1)]
    while lengths[-1] < MAX_BAN_ROUNDS:
        s.observe(ids, (1,))  # tested again and found opposed once more: 3 of its last 4 tests
        lengths.append(_banned_for(s, ids, 1))
    assert lengths[:3] == [BAN_ROUNDS, 2 * BAN_ROUNDS, 4 * BAN_ROUNDS] and lengths[-1] == MAX_BAN_ROUNDS
    s.observe(ids, (1,))
    assert _banned_for(s, ids, 1) == MAX_BAN_ROUNDS  # capped
    assert 2 not in s.banned_among(ids, 0) and 2 not in s.bans


def test_a_clean_window_forgives_earlier_bans() -> None:
    """An honest member banned once (a rare run of noisy verdicts) and then tested clean STRIKE_WINDOW times starts
    over: its next ban, if one comes, is BAN_ROUNDS again."""
    s = Suspects()
    ids = [b"own", b"unlucky"]
    for _ in range(STRIKES):
        s.observe(ids, (1,))
    assert _banned_for(s, ids, 1) == BAN_ROUNDS
    for _ in range(STRIKE_WINDOW):
        s.observe(ids, ())
    assert not s.bans
    for _ in range(STRIKES):
        s.observe(ids, (1,))
    assert _banned_for(s, ids, 1) == BAN_ROUNDS


def test_exclude_takes_member_indices_only() -> None:
    assert AverageOptions(exclude=[2, 3]).exclude == (2, 3)
    with pytest.raises(ValueError, match="exclude"):
        AverageOptions(exclude=(-1,))


def _shard_round(rng: np.random.Generator, elements: int, agreement: float) -> np.ndarray:
    """One dense shard's contributions as an owner sees them: 8 members whose values share a signal (cosine about
    ``agreement`` between two of them), member BAD's negated, at equal weights; their Gram matrix."""
    signal = rng.standard_normal(elements)
    a = np.sqrt(agreement / (1 - agreement))
    x = np.stack([a * signal + rng.standard_normal(elements) for _ in range(N)])
    x[BAD] = -x[BAD]
    return x @ x.T


def test_pooling_a_members_last_tests_finds_a_flipped_one_a_single_round_misses_hostile() -> None:
    """A dense shard of 150 values where honest members barely agree (cosine 0.08 between two): one round's test
    alone misses the flipped member in about 2 rounds of 5; pooled with its last PRIOR_TESTS tests (what
    Suspects.prior hands the next one) it misses it rarely, and leaves honest members out no more often."""
    rng = np.random.default_rng(3)
    elements, heard, own = [150] * N, list(range(N)), N - 1
    single = {"bad": 0, "honest": 0}
    pooled = {"bad": 0, "honest": 0}
    ids = [bytes([i + 1]) * 32 for i in range(N)]
    sus = Suspects()
    trials = 300
    for _ in range(trials):
        g = _shard_round(rng, 150, 0.08)
        alone = opposed_members(g, heard, own, elements)
        prior = {k: (w, n) for k, w, n in sus.prior(ids, own)}
        out = opposed_members(g, heard, own, elements, prior)
        for verdict, tally in ((alone, single), (out, pooled)):
            tally["bad"] += BAD in verdict
            tally["honest"] += len(verdict - {BAD})
        cos = member_cosines(g, heard, own)
        sus.cosines = {}  # (each trial's record of earlier tests: three fresh rounds before it)
        for _ in range(PRIOR_TESTS):
            g0 = _shard_round(rng, 150, 0.08)
            sus.observe(ids, (), tuple((k, c, 150) for k, c in member_cosines(g0, heard, own).items()))
        assert set(cos) == set(range(N)) - {own}
    assert single["bad"] < 0.75 * trials, single  # (one round alone misses it often)
    assert pooled["bad"] > 0.95 * trials, pooled
    assert pooled["honest"] <= single["honest"] + 3, (single, pooled)


def test_suspects_keep_each_members_last_tests_for_the_next_one() -> None:
    ids = [bytes([i + 1]) * 32 for i in range(3)]
    sus = Suspects()
    assert sus.prior(ids, 0) == ()
    for c in (-0.1, 0.2, 0.3, 0.4):
        sus.observe(ids, (), ((1, c, 100), (2, 0.5, 50), (7, -1.0, 10), (0, float("nan"), 10)))
    assert sus.cosines[ids[1]] == ((0.2, 100), (0.3, 100), (0.4, 100))  # the last PRIOR_TESTS, oldest first
    prior = dict((k, (w, n)) for k, w, n in sus.prior(ids, 0))
    assert prior[1] == (pytest.approx(90.0), 300) and prior[2] == (pytest.approx(75.0), 150) and 0 not in prior
    assert ids[0] not in sus.cosines  # (a NaN cosine is never kept)
    with pytest.raises(ValueError):
        AverageOptions(prior=((0, float("inf"), 3),))
