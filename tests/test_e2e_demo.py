"""End to end with real daemons and real `peerd train` processes on 127.0.0.1 (needs torch + scikit-learn):
the demo's accuracy and agreement, a late joiner, a trainer killed mid-step, a daemon killed mid-round,
and a trainer with a different model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .support.processes import metric_value, peerd_json, scrape, wait_until

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(900)
def test_demo_4_peers_200_steps(tmp_path) -> None:
    result = peerd_json("demo", "--peers", "4", "--steps", "200", timeout=900)
    assert result["peers"] == 4 and result["steps"] == 200
    assert result["accuracy"] >= 0.95, result
    assert result["max_param_divergence"] <= 0.01, result
    assert result["final_loss"] < 0.5
    assert result["outcomes"].get("averaged", 0) >= 0.9 * 4 * 200  # averaging happened, not local steps
    assert result["mode"] == "sync" and result["bytes_sent_per_peer"] > 0 and result["step_s"] > 0, result


@pytest.mark.timeout(600)
def test_demo_diloco_members_agree_and_send_a_fraction_of_sync() -> None:
    """`--mode diloco`: 3 peers, an outer step every 20 inner steps; every member ends on the same global state
    (SHA-256), and the bytes sent are about steps/H outer averages, not one per step."""
    result = peerd_json("demo", "--peers", "3", "--steps", "100", "--mode", "diloco", "--sync-every", "20",
                        timeout=600)
    assert result["mode"] == "diloco" and result["sync_every"] == 20 and result["state_sha_agree"] is True, result
    assert result["accuracy"] >= 0.9, result
    # 100 / 20 = 5 outer steps of the MLP's 4,810 float32 parameters (19.2 KB each); sync would send 100.
    assert 0 < result["bytes_sent_per_peer"] < 20 * 4 * 4810, result


@pytest.mark.timeout(600)
def test_demo_wide_model_matches_gloo_ddp_without_loss() -> None:
    """`--model wide --baseline gloo` on loopback, no loss: fp32 gradient averages are exact here (the default
    codec, auto, may switch to int8 after 5 steps), so its two
    peers must train the 2.24 M-parameter model as torch DDP does (same seeds, shards, draws, Adam): the same
    held-out loss and accuracy up to float rounding, and both report a time to the target."""
    out = peerd_json("demo", "--peers", "2", "--steps", "10", "--model", "wide", "--baseline", "gloo",
                     "--compression", "fp32", "--target-accuracy", "0.5", timeout=600)
    base = out["baseline"]
    assert out["model"] == "wide" and base["kind"] == "gloo", out
    # (the figures a failure needs first, since pytest cuts a long dict short)
    why = {k: out[k] for k in ("outcomes", "max_param_divergence", "min_received_fraction")}
    if out["outcomes"] == {"averaged": 20} and out["min_received_fraction"] == 1.0:
        # every round had every member's data: the averages are exact, so is the training
        assert out["final_loss"] == pytest.approx(base["final_loss"], rel=1e-3), (why, out)
        assert abs(out["accuracy"] - base["accuracy"]) <= 0.003, (why, out)  # one test digit of 359
    else:
        # A machine loaded from outside (a CI neighbour) can starve a daemon until its member's phase deadline
        # passes: that round averages what arrived (partial by design, and reported as min_received_fraction), so
        # the replicas train on slightly different averages and only closeness holds (seen: loss 3-7 % apart).
        assert out["min_received_fraction"] >= 0.5 and out["outcomes"].get("averaged", 0) >= 18, (why, out)
        assert out["final_loss"] == pytest.approx(base["final_loss"], rel=0.1), (why, out)
        assert abs(out["accuracy"] - base["accuracy"]) <= 0.03, (why, out)
    assert out["time_to_accuracy_s"] > 0 and base["time_to_accuracy_s"] > 0, out
    assert base["wall_s"] > 0 and base["step_s"] > 0, base


@pytest.mark.timeout(900)
def test_late_joiner_takes_the_swarms_state_before_its_first_step() -> None:
    """Slow (about 3.5 minutes on 2 cores). The founders' kept groups take a step in about 0.1 s, so they run
    400 steps: the joiner (a trainer to start, the state to download) comes in with steps left to average."""
    from peerd.tools.demo import DemoConfig, run_demo

    summary = run_demo(DemoConfig(peers=3, steps=400, join_late={2: 100}, json=True))
    late = summary["per_peer"][2]
    assert late["synced"] is not None and late["synced"]["donors"] >= 1
    assert 100 <= late["first_step"] == late["synced"]["step"] < 350, late
    # its own (differently seeded) weights would score about 0.1; the swarm's score far higher
    assert late["start_accuracy"] >= 0.8, late
    assert all(p["steps"] == 400 for p in summary["per_peer"])  # it finishes with the others
    # The replicas end with parameter averages that include the joiner (numbered by the swarm's gradient
    # round, not by its step count, which trails the founders' by the steps they took while it downloaded).
    # Measured 0.02 with kept groups (the joiner in the founders' group within a few steps of its first);
    # a joiner left out of the founders' kept group ends further apart than the bound.
    assert summary["max_param_divergence"] <= 0.1
    assert summary["accuracy"] >= 0.9


def _trainer(node, *extra: str, steps: int = 100000) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "peerd", "train", "--run", "e2e", "--socket", node.socket, "--steps", str(steps),
         "--no-sync", "--progress", "json", "--timeout", "5", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
    )


def _wait_steps(proc: subprocess.Popen, count: int, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"trainer exited {proc.wait()}: {proc.stderr.read()}")  # type: ignore[union-attr]
        ev = json.loads(line)
        if ev.get("event") == "step":
            last = ev
            if ev["step"] >= count:
                return ev
    raise AssertionError(f"no step {count} within {timeout} s (last {last})")


def test_kill_trainer_mid_step_kill_daemon_mid_round_and_a_different_model(swarm) -> None:
    nodes = swarm.start_many(3)
    trainers = [_trainer(n) for n in nodes]
    try:
        for t in trainers:
            _wait_steps(t, 5)
        # 1. a trainer dies mid-step (its steps are nearly all spent in rounds): its daemon stays healthy
        trainers[0].send_signal(signal.SIGKILL)
        trainers[0].wait(10)
        wait_until(lambda: metric_value(scrape(nodes[0].status["metrics"]), "peerd_trainer_sessions") == 0,
                   timeout=20, interval=0.5, what="the dead trainer's session to close")
        assert nodes[0].call("status")["peer_id"]
        assert metric_value(scrape(nodes[0].status["metrics"]), "peerd_trainer_steps_total") >= 5

        # 2. a daemon dies mid-round: its trainer gets a clear error quickly, not a hang
        nodes[1].proc.send_signal(signal.SIGKILL)
        start = time.monotonic()
        code = trainers[1].wait(60)
        err = trainers[1].stderr.read()  # type: ignore[union-attr]
        assert code == 1 and time.monotonic() - start < 60
        assert "peerd: error:" in err and "daemon" in err, err
        assert "Traceback" not in err

        # the survivor keeps training (alone or with the newcomer below)
        _wait_steps(trainers[2], _wait_steps(trainers[2], 1)["step"] + 3)

        # 3. a trainer with another model in the same run, on a daemon that trains the run's model, is refused
        #    with the reason (swarm adverts of another layout are only counted: a member's advert cannot make
        #    every trainer_open fail)
        other = _trainer(nodes[2], "--hidden", "32")
        assert other.wait(120) == 1
        err = other.stderr.read()  # type: ignore[union-attr]
        assert "different model" in err, err

        # 4. the daemon whose trainer died serves a new trainer of the right model, which averages again
        trainers[0] = _trainer(nodes[0])
        ev = _wait_steps(trainers[0], 5)
        assert ev["outcome"] in ("averaged", "alone")
        assert metric_value(scrape(nodes[0].status["metrics"]), "peerd_trainer_steps_total", outcome="averaged") > 0
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
                t.wait()


@pytest.mark.timeout(600)
def test_demo_overlap_trains_and_keeps_replicas_together() -> None:
    """`--mode overlap` (DeAR buckets through real daemons): every step averaged, replicas together, learning."""
    from peerd.tools.demo import DemoConfig, run_demo

    s = run_demo(DemoConfig(peers=3, steps=60, mode="overlap", bucket_mb=0.005, json=True), log=lambda *a, **k: None)
    assert s["mode"] == "overlap" and s["step_s"] > 0, s
    assert s["outcomes"].get("averaged", 0) >= 0.9 * 3 * 60, s["outcomes"]
    assert s["max_param_divergence"] <= 0.01 and s["accuracy"] >= 0.8, s
