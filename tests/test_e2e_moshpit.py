"""End to end: Moshpit rounds among real daemons, through the averaging API on the local socket."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from peerd.localsock.client import DaemonError

from .conftest import metric_value, peerd, scrape, wait_until

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
    # 4 rounds take the spread down by an order of magnitude or more: measured
    # 0.017 and (on a clean CI run) 0.059 after round 4, from 0.47-0.50 after round 1.
    assert out["deviation"][-1] <= 0.1, out["deviation"]
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
    assert node.call("status")["moshpit"]["alone"]["last"]["outcome"] == "alone"


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


def _lockstep(nodes, run: str, vectors: list[np.ndarray]) -> list[dict]:
    with ThreadPoolExecutor(len(nodes)) as pool:
        return [s for _, s in pool.map(lambda i: _round(nodes[i], run, vectors[i]), range(len(nodes)))]


def test_a_complete_group_is_kept_and_re_forms_when_its_leader_dies(swarm) -> None:
    nodes = swarm.start_many(3)
    wait_until(lambda: min(n.call("status")["peers"] for n in nodes) >= 2, 30, 0.2, what="peers to see each other")
    for n in nodes:
        assert n.call("avg_open", run="sticky", window_s=2.0, keep_rounds=4)["sticky"]["keep_rounds"] == 4
    vectors = [np.full(1000, float(i), np.float32) for i in range(3)]
    history = [_lockstep(nodes, "sticky", vectors) for _ in range(5)]
    kept = [r for stats in history for r in stats if r["kept"]]
    assert kept, "a complete group of the run's three peers is kept after it forms"
    assert all(r["group_size"] == 3 and r["matchmaking_s"] < 2.0 for r in kept)
    ids = {n.call("status")["peer_id"] for n in nodes}
    statuses = [n.call("status")["moshpit"]["sticky"]["sticky"] for n in nodes]
    assert sum(s["renewed"] for s in statuses) == len(kept)
    # Kill the kept group's leader (if it is kept right now; else any peer): the others must not hang.
    leader = next((s["kept"]["leader"] for s in statuses if s["kept"]), None)
    victim = next(i for i, n in enumerate(nodes) if n.call("status")["peer_id"] == leader) if leader else 0
    nodes[victim].proc.kill()
    nodes[victim].proc.wait(10)
    survivors = [n for i, n in enumerate(nodes) if i != victim]
    after = [_lockstep(survivors, "sticky", vectors[:2]) for _ in range(6)]
    assert all(r["outcome"] in ("averaged", "alone") for stats in after for r in stats), after
    last = after[-1]
    assert all(r["outcome"] == "averaged" and r["group_size"] == 2 for r in last), last
    assert set(last[0]["members"]) == set(last[1]["members"]) < ids


def test_a_kept_group_waits_for_a_member_that_starts_its_round_late(swarm) -> None:
    """Each round one peer (in turn, so sometimes the leader, sometimes a follower) starts 1.5 s after the
    others, as a trainer busy with its other run's round does. Renewals wait until every member asked
    (PROTOCOL.md section 16, step 7): the late peer is averaged in, not averaged out as silent."""
    import time

    nodes = swarm.start_many(3)
    wait_until(lambda: min(n.call("status")["peers"] for n in nodes) >= 2, 30, 0.2, what="peers to see each other")
    for n in nodes:
        n.call("avg_open", run="late", window_s=3.0, keep_rounds=4)
    vectors = [np.full(500, float(i), np.float32) for i in range(3)]

    def late_round(r: int, i: int) -> dict:
        if i == r % 3:
            time.sleep(1.5)
        return _round(nodes[i], "late", vectors[i])[1]

    history = []
    for r in range(8):
        with ThreadPoolExecutor(3) as pool:
            history.append(list(pool.map(lambda i, r=r: late_round(r, i), range(3))))
    kept = [s for stats in history for s in stats if s["kept"]]
    assert len(kept) >= 6, history  # rounds 2-4 and 6-7 are renewals once round 1's group is complete
    assert all(s["outcome"] == "averaged" and s["group_size"] == 3 for s in kept), kept
    assert all(s["received_fraction"] == 1.0 for s in kept), kept  # nobody was averaged out
    # No silence broke it. Under a heavily loaded CI machine one renewal was once refused (a retry that came
    # too late); the group then re-formed through the DHT, as it must, and the rounds above still held.
    broken = []
    for n in nodes:
        dropped = n.call("status")["moshpit"]["late"]["sticky"]["dropped"]
        assert "silent" not in dropped, dropped
        broken.append(sum(v for k, v in dropped.items() if k not in ("used_up", "round")))
    assert sum(broken) <= 1, broken
