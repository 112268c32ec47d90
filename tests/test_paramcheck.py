"""The check round before a parameter average (peerd/trainer/paramcheck.py): replicas that hold the same
parameters skip the average, replicas that differ average as before, and a member that lies in the check can
only make an honest member keep its own parameters."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from peerd.allreduce.shards import Layout
from peerd.moshpit.service import RoundResult
from peerd.trainer.paramcheck import (
    BITS,
    CHECK_ELEMENTS,
    SKETCH,
    UNIT,
    check_vector,
    close,
    identical,
    rounding_noise,
    sketch,
    spread,
)
from peerd.trainer.records import MAX_GROUP

from .support.sessions import open_session, run_sessions, step
from .support.trainer_harness import InProcessAverager, ThreadDaemon


def averaged(vector: np.ndarray, size: int = 2, complete: bool = True) -> RoundResult:
    return RoundResult(vector, "averaged", "00000001", size, [str(i) for i in range(size)], 1.0, 1, 0.01,
                       complete=complete)


def test_check_vector_is_the_parameters_hash_in_bits() -> None:
    rng = np.random.default_rng(0)
    params = rng.standard_normal(1000).astype(np.float32)
    probe = check_vector(params)
    assert probe.shape == (CHECK_ELEMENTS,) and probe.dtype == np.float32
    units = probe.reshape(-1, UNIT)
    assert set(np.unique(units[:, :BITS])) <= {0.0, 1.0}
    assert (units == units[0]).all()  # the unit repeated
    assert np.array_equal(probe, check_vector(params.copy()))
    nudged = params.copy()
    nudged[500] = np.nextafter(nudged[500], np.float32(np.inf))  # one ulp of one parameter
    assert not np.array_equal(probe, check_vector(nudged))


def test_every_owners_shard_holds_every_bit_of_the_hash() -> None:
    """An owner's own contribution always counts in its shard: with every position of the unit (the hash's bits,
    the sketch) in every shard, an owner whose parameters differ from this member's shows in the result, whatever
    the group's size."""
    for n in range(2, MAX_GROUP + 1):
        layout = Layout(CHECK_ELEMENTS, n, 300)
        for j in range(n):
            start, stop = layout.shard(j)
            assert stop - start >= UNIT, (n, j)
            assert {i % UNIT for i in range(start, stop)} == set(range(UNIT))


def test_only_a_complete_exact_echo_of_a_full_group_counts_as_identical() -> None:
    probe = check_vector(np.arange(16, dtype=np.float32))
    assert identical(averaged(probe.copy()), probe, 0)
    assert identical(averaged(probe.copy(), size=4), probe, 4)
    assert not identical(averaged(probe.copy(), size=3), probe, 4)  # a member of the last group missed the check
    assert not identical(averaged(probe.copy(), complete=False), probe, 0)  # an owner's shard did not arrive
    assert not identical(RoundResult(probe.copy(), "alone", "", 1, [], 0.0, 1, 0.01), probe, 0)
    half = probe.copy()
    half[7] = 0.5  # two members disagree on one bit
    assert not identical(averaged(half), probe, 0)
    assert not identical(averaged(probe[:-1].copy()), probe, 0)


def test_an_owners_float32_mean_of_equal_probes_still_reads_identical() -> None:
    """An owner sums in float32: three equal values can round, so the mean of equal sketches may differ from them
    in the last place. Identity is read from the hash's bits alone (0.0 and 1.0 average exactly)."""
    probe = check_vector(np.random.default_rng(4).standard_normal(5000).astype(np.float32), 0.01)
    total = np.zeros_like(probe)
    for _ in range(3):
        total = (total + probe).astype(np.float32)
    mean = (total / np.float32(3)).astype(np.float32)
    assert not np.array_equal(mean, probe)  # (the case this guards against happens with these values)
    assert identical(averaged(mean, size=3), probe, 3)


def test_the_sketch_estimates_the_distance_between_two_replicas() -> None:
    rng = np.random.default_rng(1)
    p = (0.05 * rng.standard_normal(200_000)).astype(np.float32)
    assert np.array_equal(sketch(p), sketch(p.copy()))  # the same partition for every replica
    for scale in (1e-5, 1e-3):
        q = p + (scale * rng.standard_normal(p.size)).astype(np.float32)
        ratio = float(np.sum((sketch(q).astype(np.float64) - sketch(p)) ** 2)) / float(np.sum((q - p) ** 2.0))
        assert 0.5 < ratio < 1.6, (scale, ratio)  # within about sqrt(2 / SKETCH) of 1, a few sigma


def test_rounding_noise_follows_the_codec() -> None:
    p = np.tile(np.linspace(0.0, 2.55, 128, dtype=np.float32), 10)  # every group spans 2.55: int8 steps of 0.01
    assert rounding_noise(p, "fp32") == rounding_noise(p, None) == 0.0
    np.testing.assert_allclose(rounding_noise(p, "int8"), np.sqrt(p.size * 0.01**2 / 6), rtol=1e-3)
    assert rounding_noise(p, "int4") > 10 * rounding_noise(p, "int8")
    assert 0.0 < rounding_noise(p, "fp16") < rounding_noise(p, "bf16")


def group_result(params: list[np.ndarray], codec: str, complete: bool = True) -> tuple[RoundResult, list]:
    """The exact check round of these replicas (what every member of a complete round holds), and their probes."""
    probes = [check_vector(p, rounding_noise(p, codec)) for p in params]
    return averaged(np.mean(probes, axis=0).astype(np.float32), size=len(params), complete=complete), probes


def test_replicas_nearer_than_the_codecs_rounding_keep_their_parameters_all_alike() -> None:
    rng = np.random.default_rng(2)
    p = (0.05 * rng.standard_normal(100_000)).astype(np.float32)
    int8_step = float(np.ptp(p[:128])) / 255

    def replicas(drift: float) -> list[np.ndarray]:
        # one replica that missed a round, its distance from the others what its moments still drift
        return [p, p.copy(), p.copy(), p + (drift * rng.standard_normal(p.size)).astype(np.float32)]

    near, probes = group_result(replicas(0.02 * int8_step), "int8")
    assert not any(identical(near, pr, 4) for pr in probes)
    assert all(close(near, pr, 4) for pr in probes)  # every member reads the same verdict from the same result
    far, probes = group_result(replicas(2 * int8_step), "int8")
    assert not any(close(far, pr, 4) for pr in probes)
    # fp32 parameter averages add no rounding: only identical replicas skip them
    exact, probes = group_result(replicas(1e-9), "fp32")
    assert not any(close(exact, pr, 4) for pr in probes)
    # a result that cannot say: incomplete, or a group smaller than the last gradient round's
    partial, probes = group_result(replicas(0.02 * int8_step), "int8", complete=False)
    assert not close(partial, probes[0], 4)
    assert not close(near, probes[0], 5)


def test_the_verdict_survives_a_few_mixed_copies() -> None:
    """An owner averages each datagram range over the contributions that reached it: a copy of the unit across two
    ranges that different members reached mixes two means. A few such copies do not move the median."""
    rng = np.random.default_rng(3)
    p = (0.05 * rng.standard_normal(50_000)).astype(np.float32)
    step = float(np.ptp(p[:128])) / 255
    params = [p, p + (0.02 * step * rng.standard_normal(p.size)).astype(np.float32)]
    result, probes = group_result(params, "int8")
    units = result.vector.reshape(-1, UNIT)  # (a view: the copies are changed in place)
    noise2 = spread(result)[1]
    for k in range(0, 6):  # 6 of 65 copies read far too high: mean |s|^2 from more members than mean s
        units[k, BITS + SKETCH] += 100 * noise2
    for k in range(6, 9):  # ... 3 too low: the sketch from one replica alone
        units[k, BITS:BITS + SKETCH] = probes[1].reshape(-1, UNIT)[0, BITS:BITS + SKETCH]
    assert spread(result)[0] <= noise2 and all(close(result, pr, 2) for pr in probes)


def params_round(d: ThreadDaemon, vectors: list[np.ndarray]) -> list[tuple]:
    """Each vector as one session's parameter average of round 1, at once."""
    return run_sessions(d, vectors, kind="params", round=1)


@pytest.fixture
def pair(tmp_path):
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=3.0))
    yield d
    d.stop()


def kinds(d: ThreadDaemon) -> list[str]:
    return [run_id.rsplit(".", 1)[1] for run_id, _ in d.averager.calls]


def test_replicas_with_the_same_parameters_skip_the_average(pair) -> None:
    same = np.linspace(-1, 1, 16).astype(np.float32)
    replies = params_round(pair, [same, same.copy()])
    for reply, result in replies:
        assert reply["outcome"] == "averaged" and reply["identical"] and reply["group_size"] == 2
        assert np.array_equal(result, same)
    assert kinds(pair) == ["c", "c"]  # the check round only
    assert pair.counter(pair.metrics.trainer_params_identical) == 2


def test_replicas_that_differ_average_as_before(pair) -> None:
    a = np.linspace(-1, 1, 16).astype(np.float32)
    b = a.copy()
    b[3] += 1e-3  # one replica left on its own values for one range
    replies = params_round(pair, [a, b])
    for reply, result in replies:
        assert reply["outcome"] == "averaged" and not reply["identical"]
        np.testing.assert_allclose(result, (a + b) / 2, rtol=1e-6)
    assert sorted(kinds(pair)) == ["c", "c", "p", "p"]
    assert pair.counter(pair.metrics.trainer_params_identical) == 0


def test_int8_replicas_nearer_than_the_rounding_skip_the_average_and_farther_ones_do_not(pair) -> None:
    a = np.linspace(-1, 1, 16).astype(np.float32)  # one int8 group: steps of 2 / 255
    near = a.copy()
    near[3] += 1e-4  # a replica whose moments drifted a little: far under the step
    replies = run_sessions(pair, [a, near], opened={"compression": "int8"}, kind="params", round=1)
    for (reply, result), own in zip(replies, (a, near), strict=True):
        assert reply["outcome"] == "averaged" and reply["close"] and not reply["identical"]
        assert np.array_equal(result, own)  # each keeps its own
    assert kinds(pair) == ["c", "c"]
    assert pair.counter(pair.metrics.trainer_params_close) == 2
    far = a.copy()
    far[3] += 0.5
    replies = run_sessions(pair, [a, far], opened={"compression": "int8"}, kind="params", round=2)
    for reply, result in replies:
        assert reply["outcome"] == "averaged" and not reply["close"] and not reply["identical"]
        np.testing.assert_allclose(result, (a + far) / 2, rtol=1e-6)  # (the harness averages exactly)
    assert kinds(pair).count("p") == 2


def test_a_check_group_smaller_than_the_last_gradient_group_is_no_verdict(tmp_path) -> None:
    """A member that missed the check would average its parameters alone while the others skipped: a check group
    smaller than the session's last gradient group sends everyone to the full average."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=3, wait_s=0.5))
    try:
        sessions = [open_session(d.path) for _ in range(3)]
        same = np.ones(16, dtype=np.float32)
        out: dict[int, tuple] = {}

        def go(i: int, n: int) -> None:
            out[i] = step(*sessions[i], 1, same, 1)  # a gradient round of 3
            if i < n:
                out[i] = step(*sessions[i], 2, same, 1, kind="params", round=1)

        threads = [threading.Thread(target=go, args=(i, 2)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        for i in range(2):
            reply, result = out[i]
            assert not reply["identical"] and np.array_equal(result, same)
        assert kinds(d).count("p") == 2  # the two went on to the parameter average
        for c, a, _ in sessions:
            c.close()
            a.close()
    finally:
        d.stop()


class LyingCheck(InProcessAverager):
    """A member that contributes to the check round the honest member's check vector (as if its parameters were
    the same), while its parameters differ: the check's run, the second caller's vector replaced by the first's."""

    def __init__(self) -> None:
        super().__init__(group_size=2, wait_s=1.0)
        self.first: np.ndarray | None = None

    async def average(self, run_id: str, vector: np.ndarray, weight: float, **kw) -> RoundResult:
        if run_id.endswith(".c"):
            if self.first is None:
                self.first = vector.copy()
            else:
                vector = self.first.copy()
        return await super().average(run_id, vector, weight, **kw)


def test_a_member_lying_in_the_check_only_makes_an_honest_member_keep_its_own_parameters_hostile(tmp_path) -> None:
    d = ThreadDaemon(str(tmp_path / "d.sock"), LyingCheck())
    try:
        honest = np.linspace(-1, 1, 16).astype(np.float32)
        liar = np.full(16, 1e6, dtype=np.float32)  # parameters an average with it would pull toward
        # the liar's check comes second
        out = run_sessions(d, [honest, liar], may_go=lambda i: not i or d.averager.first is not None,
                           kind="params", round=1)
        reply, result = out[0]
        assert reply["outcome"] == "averaged" and reply["identical"]
        assert np.array_equal(result, honest)  # its own parameters: nothing of the liar's
    finally:
        d.stop()


class InflatedNoise(InProcessAverager):
    """A member that claims a huge rounding noise in the check (the unit's last element) so that the group reads
    "close" whatever the distance: every check vector but the first gets it."""

    def __init__(self) -> None:
        super().__init__(group_size=3, wait_s=1.0)
        self.seen = 0

    async def average(self, run_id: str, vector: np.ndarray, weight: float, **kw) -> RoundResult:
        if run_id.endswith(".c"):
            self.seen += 1
            if self.seen == 3:  # the liar: 3 x its claim in a group of 3 dominates the mean
                vector = vector.copy()
                vector.reshape(-1, UNIT)[:, -1] = 1e30
        return await super().average(run_id, vector, weight, **kw)


def test_a_member_claiming_a_large_rounding_only_makes_honest_members_keep_their_own_parameters_hostile(
        tmp_path) -> None:
    """The most a lie in the check's noise can do is what a lie in its bits can: the group skips one average, and
    every honest member keeps exactly its own parameters (nothing of the liar's reaches them)."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), InflatedNoise())
    try:
        a = np.linspace(-1, 1, 16).astype(np.float32)
        b = a + 0.3  # honest replicas far apart: they would average
        liar = np.full(16, 1e6, dtype=np.float32)
        vectors = [a, b, liar]
        # in order: the liar's check is the third
        out = run_sessions(d, vectors, opened={"compression": "int8"}, may_go=lambda i: d.averager.seen >= i,
                           kind="params", round=1)
        for i in range(2):
            reply, result = out[i]
            assert reply["close"] and np.array_equal(result, vectors[i])  # its own, exactly
        assert kinds(d) == ["c", "c", "c"]
    finally:
        d.stop()
