"""The check round before a parameter average (peerd/trainer/paramcheck.py): replicas that hold the same
parameters skip the average, replicas that differ average as before, and a member that lies in the check can
only make an honest member keep its own parameters."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from peerd.allreduce.shards import Layout
from peerd.moshpit.service import RoundResult
from peerd.trainer.paramcheck import BITS, CHECK_ELEMENTS, check_vector, identical
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
    assert set(np.unique(probe)) <= {0.0, 1.0}
    assert np.array_equal(probe, check_vector(params.copy()))
    nudged = params.copy()
    nudged[500] = np.nextafter(nudged[500], np.float32(np.inf))  # one ulp of one parameter
    assert not np.array_equal(probe, check_vector(nudged))


def test_every_owners_shard_holds_every_bit_of_the_hash() -> None:
    """An owner's own contribution always counts in its shard: with every bit position in every shard, an owner
    whose parameters differ from this member's shows in the result, whatever the group's size."""
    for n in range(2, MAX_GROUP + 1):
        layout = Layout(CHECK_ELEMENTS, n, 300)
        for j in range(n):
            start, stop = layout.shard(j)
            assert stop - start >= BITS, (n, j)
            assert {i % BITS for i in range(start, stop)} == set(range(BITS))


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
        sessions = [open_session(d.path) for _ in range(2)]
        out: dict[int, tuple] = {}
        vectors = [honest, liar]

        def go(i: int) -> None:
            if i:  # the liar's check comes second
                while d.averager.first is None:
                    threading.Event().wait(0.01)
            out[i] = step(*sessions[i], 1, vectors[i], 1, kind="params", round=1)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        reply, result = out[0]
        assert reply["outcome"] == "averaged" and reply["identical"]
        assert np.array_equal(result, honest)  # its own parameters: nothing of the liar's
        for c, a, _ in sessions:
            c.close()
            a.close()
    finally:
        d.stop()
