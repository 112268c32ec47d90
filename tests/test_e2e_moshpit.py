"""End to end: Moshpit rounds among real daemons, through the averaging API on the local socket."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from peerd.localsock.client import DaemonError

from .support.processes import metric_value, peerd, scrape, wait_until

pytestmark = pytest.mark.e2e


def bench(*args: str, timeout: float = 400) -> dict:
    return json.loads(peerd("bench", "moshpit", *args, "--json", timeout=timeout).stdout)


def test_full_grid_is_exact_in_d_rounds() -> None:
    out = bench("--peers", "16", "--grid", "4x4", "--rounds", "2")
    assert out["group_sizes"] == [[4, 4, 4, 4], [4, 4, 4, 4]]
    assert out["deviation"][0] > 0.1  # one round mixes rows only
    assert out["deviation"][-1] <= 1e-6
    assert out["received_fraction"] == [1.0, 1.0]


def test_survivors_finish_every_round_after_two_die_mid_average() -> None:
    out = bench("--peers", "16", "--grid", "4x4", "--rounds", "4", "--kill", "2")
    assert out["survivors"] == 14
    assert all(sum(o.values()) == 14 for o in out["outcomes"]), out["outcomes"]
    # The protocol takes the spread to about 0.012 after round 4 (tests/test_moshpit_service.py, in virtual time:
    # 0.010-0.013 over 12 seeds; here 0.010 and 0.011 on two runs), from 0.47-0.53 after round 1. The bound
    # leaves room for a loaded machine, where a group may close at its deadline without a slow member (once
    # 0.059 on CI, before this bound): the outcomes and group sizes say which round that was. A victim killed as
    # it closed its group, before its BEGIN went out, once left 0.131 here (its followers all moved on as index
    # 0 and overfilled that key every round after); they now spread (keys.after_alone): 0.012-0.038 in virtual
    # time, tests/test_moshpit_service.py.
    assert out["deviation"][-1] <= 0.05, (out["deviation"], out["outcomes"], out["group_sizes"])
    assert all(d2 <= d1 + 1e-9 for d1, d2 in zip(out["deviation"], out["deviation"][1:], strict=False))


def _round(node, run: str, vector: np.ndarray, weight: float = 1.0) -> tuple[np.ndarray, dict]:
    reply = node.call("avg_round", timeout=90, run=run, vector=vector.astype("<f4").tobytes(), weight=weight,
                      timeout_s=30.0)
    return np.frombuffer(reply["vector"], dtype="<f4"), reply["stats"]


def test_weighted_round_and_joiners_are_absorbed(swarm) -> None:
    nodes = swarm.start_many(4)
    wait_until(lambda: min(n.call("status")["peers"] for n in nodes) >= 3, 30, 0.2, what="peers to see each other")
    for n in nodes:
        opened = n.call("avg_open", run="joiners", window_s=2.0)
        assert opened["grid"] == "4" and opened["round"] == 0
    rng = np.random.default_rng(0)
    vectors = [rng.standard_normal(5000).astype(np.float32) for _ in nodes]
    weights = [1.0, 2.0, 3.0, 4.0]
    exact = sum(w * v.astype(np.float64) for w, v in zip(weights, vectors, strict=True)) / sum(weights)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _round(nodes[i], "joiners", vectors[i], weights[i]), range(4)))
    for vec, stats in results:
        assert stats["outcome"] == "averaged" and stats["group_size"] == 4 and stats["round"] == 0
        assert np.abs(vec - exact).max() < 1e-5  # a sample-weighted mean
    assert len({s["group_id"] for _, s in results}) == 1
    assert all(n.call("status")["moshpit"]["joiners"]["last"]["complete"] for n in nodes)  # a lossless round
    vectors = [v for v, _ in results]

    # the run grows: groups of up to 8 from now on (published in the run's DHT record)
    for n in nodes:
        assert n.call("avg_open", run="joiners", grid="8", window_s=2.0)["round"] == 1
    # two peers join between rounds: they take the run's grid, start at its next round and land in its group
    late = swarm.start_many(2)
    everyone = nodes + late
    wait_until(lambda: min(n.call("status")["peers"] for n in everyone) >= 5, 30, 0.2, what="joiners to be seen")
    for n in late:
        opened = n.call("avg_open", run="joiners", window_s=2.0)
        assert opened["round"] == 1 and opened["grid"] == "8"
    vectors += [np.full(5000, 10.0, np.float32) for _ in late]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _round(everyone[i], "joiners", vectors[i]), range(6)))
    stats = [s for _, s in results]
    assert {s["round"] for s in stats} == {1}
    assert all(s["outcome"] == "averaged" for s in stats), stats
    ids = {n.call("status")["peer_id"] for n in everyone}
    assert len({s["group_id"] for s in stats}) == 1, "everyone looking, the 4 the run expects included, is one group"
    assert all(set(s["members"]) == ids and s["group_size"] == 6 for s in stats)
    metrics = scrape(nodes[0].status["metrics"])
    assert metric_value(metrics, "peerd_moshpit_rounds_total", outcome="averaged") == 2
    assert metric_value(metrics, "peerd_moshpit_group_size") >= 2


def test_lonely_peer_keeps_its_vector_and_says_so(swarm) -> None:
    (node,) = swarm.start_many(1)
    node.call("avg_open", run="alone", window_s=0.5)
    vec = np.arange(100, dtype=np.float32)
    out, stats = _round(node, "alone", vec)
    assert stats["outcome"] == "alone" and stats["group_size"] == 1 and stats["group_id"] == ""
    assert np.array_equal(out, vec)
    last = node.call("status")["moshpit"]["alone"]["last"]
    assert last["outcome"] == "alone" and last["complete"] is False  # no group's common result


def test_bad_requests_get_clear_errors(swarm) -> None:
    (node,) = swarm.start_many(1)
    cases = [
        ({"run": "a/b", "vector": b"\0" * 8}, "run id"),
        ({"run": "", "vector": b"\0" * 8}, "run id"),
        ({"run": "x", "vector": b"\0" * 7}, "float32"),
        ({"run": "x", "vector": "text"}, "float32"),
        ({"run": "x", "vector": b"\0" * 8, "weight": 0}, "weight"),
        ({"run": "x", "vector": b"\0" * 8, "weight": "many"}, "number"),
        ({"run": "x", "vector": np.array([np.nan], np.float32).tobytes()}, "NaN"),
        ({"run": "x", "vector": b"\0" * 8, "timeout_s": 0.01}, "timeout_s"),
        ({"run": "x", "vector": b"\0" * 8, "round": -1}, "round"),
        ({"run": "x", "vector": b"\0" * 8, "round": "next"}, "round"),
        ({"run": "x", "vector": b"\0" * 8, "round": 2**32 - 1}, "round"),
        ({"run": "x", "vector": b"\0" * 8, "max_samples": 0}, "max_samples"),
        ({"run": "x", "vector": b"\0" * 8, "robust": "median"}, "clip"),
    ]
    for args, words in cases:
        with pytest.raises(DaemonError, match=words):
            node.call("avg_round", **args)
    for args, words in [({"run": "x", "grid": "4x5"}, "equal"), ({"run": "x", "grid": "64x64"}, "fit"),
                        ({"run": "x", "grid": "4x4", "min_size": 9}, "min_size"),
                        ({"run": "x", "window_s": 0.01}, "window_s"),
                        ({"run": "x", "grid": "4x4", "cell": 99}, "cell"),
                        ({"run": "x", "max_samples": -1.5}, "max_samples"), ({"run": "x", "robust": "clip:0"}, "C")]:
        with pytest.raises(DaemonError, match=words):
            node.call("avg_open", **args)
    assert node.call("status")["peers"] == 0  # still healthy


# Kept groups (formed, renewed, their leader killed, a member 1.5 s late each round) are tested in virtual time
# in tests/test_moshpit_service.py: exact timings, no sleeps, no tolerance for a loaded machine.
