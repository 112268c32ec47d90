"""End to end: a 3-daemon swarm that averaged a few rounds shows its self-tuned deadlines, each with the measurement
behind it, in `peerd status --json`, in `peerd status` and in the metrics."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from peerd.deadlines import DEFAULT_STEP_WAIT_S, DEFAULT_SYNC_TIMEOUT_S, MIN_SAMPLES, WINDOW_FLOOR_S
from peerd.tools.swarm import LocalSwarm

from .support.processes import metric_value, peerd, peerd_json, scrape, wait_until

pytestmark = pytest.mark.e2e

SIZE = 50_000  # floats: 200 KB a vector
WINDOW_S = 2.0  # the run's window: the tuned window's cap
ROUNDS = MIN_SAMPLES  # the tuner's least: each deadline that rounds measure is tuned after these
DEADLINES = ("window", "doubt", "phase_silence", "phase", "step_wait", "state_sync", "bucket_wait", "outer_wait")


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    """Three daemons that averaged ROUNDS rounds; yields (swarm, statuses)."""
    swarm = LocalSwarm(str(tmp_path_factory.mktemp("swarm")))
    try:
        nodes = swarm.start_many(3)
        wait_until(lambda: min(n.call("status")["peers"] for n in nodes) >= 2, 30, 0.2, what="peers to meet")
        for n in nodes:
            n.call("avg_open", run="tuned", window_s=WINDOW_S)
        rng = np.random.default_rng(2)
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(3) as pool:
                replies = list(pool.map(lambda n: n.call(
                    "avg_round", timeout=90, run="tuned", vector=rng.standard_normal(SIZE).astype("<f4").tobytes(),
                    weight=1.0, timeout_s=30.0), nodes))
            assert all(r["stats"]["outcome"] == "averaged" for r in replies), [r["stats"] for r in replies]
        time.sleep(1.5)  # a tick of the per-peer view: the tuner hears its RTTs, the metrics its deadlines
        yield swarm, [swarm.wait_ready(n) for n in nodes]
    finally:
        swarm.cleanup()


def test_status_json_carries_each_deadline_with_its_measurement(averaged) -> None:
    swarm, _ = averaged
    status = peerd_json("status", "--socket", swarm.nodes[0].socket)
    deadlines = status["deadlines"]
    assert set(deadlines) == set(DEADLINES) and status["deadline_mode"] == "auto"
    for name, d in deadlines.items():
        assert set(d) == {"seconds", "basis", "measurement", "measured", "samples", "floor_s", "cap_s"}, name
        assert d["floor_s"] <= d["seconds"] <= d["cap_s"] or d["seconds"] == d["cap_s"], (name, d)
    window = deadlines["window"]
    # every round gathered its group before the window ran out: the window is measured, within [floor, the run's]
    assert window["samples"] == ROUNDS and window["cap_s"] == WINDOW_S, window
    assert 0 < window["measured"] < WINDOW_S and window["basis"] in ("floor", "measured", "cap"), window
    assert WINDOW_FLOOR_S <= window["seconds"] <= WINDOW_S
    phase = deadlines["phase"]
    assert phase["samples"] >= ROUNDS - 1 and 0 < phase["measured"] < 30 and phase["seconds"] <= phase["cap_s"], phase
    silence = deadlines["phase_silence"]  # loopback round trips: the floor, under today's 1 s
    assert silence["samples"] >= 2 and silence["measured"] < 0.1 and silence["seconds"] == silence["floor_s"] < 1.0
    # no trainer stepped and no snapshot was fetched: today's values
    assert deadlines["step_wait"] == {**deadlines["step_wait"], "basis": "default", "seconds": DEFAULT_STEP_WAIT_S}
    assert deadlines["state_sync"]["seconds"] == DEFAULT_SYNC_TIMEOUT_S


def test_status_text_and_metrics_show_the_deadlines(averaged) -> None:
    swarm, statuses = averaged
    text = peerd("status", "--socket", swarm.nodes[0].socket).stdout
    lines = [line for line in text.splitlines() if line.startswith("deadline ")]
    assert len(lines) == len(DEADLINES) and "gather_p90_s" in text and "nothing measured yet" in text, text
    metrics = scrape(statuses[0]["metrics"])
    deadlines = peerd_json("status", "--socket", swarm.nodes[0].socket)["deadlines"]
    for name in DEADLINES:
        assert metric_value(metrics, "peerd_deadline_seconds", deadline=name) == pytest.approx(
            deadlines[name]["seconds"], rel=0.5), name
    assert metric_value(metrics, "peerd_deadline_measured", deadline="window",
                        measurement="gather_p90_s") == pytest.approx(deadlines["window"]["measured"])


def test_a_daemon_with_fixed_deadlines_says_so_and_keeps_the_constants(tmp_path) -> None:
    swarm = LocalSwarm(str(tmp_path))
    try:
        node = swarm.start(extra=("--deadlines", "fixed"))
        swarm.wait_ready(node)
        status = peerd_json("status", "--socket", node.socket)
        assert status["deadline_mode"] == "fixed"
        assert {d["basis"] for d in status["deadlines"].values()} == {"fixed"}, status["deadlines"]
        assert all(d["seconds"] == d["cap_s"] for d in status["deadlines"].values()), status["deadlines"]
        assert "deadlines  fixed" in peerd("status", "--socket", node.socket).stdout
    finally:
        swarm.cleanup()
