"""End to end: a swarm with a Byzantine daemon (issue 11). Four real daemons and `peerd train` processes; one
daemon runs with --fault-byzantine nan and puts NaN into every contribution it sends. The honest peers' shard
owners refuse non-finite ranges, and their trainers apply no non-finite average, so no NaN reaches an
honest model and the run finishes."""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_nan_byzantine_daemon_never_puts_nan_into_honest_models(tmp_path) -> None:
    from peerd.tools.demo import DemoConfig, run_demo

    cfg = DemoConfig(peers=4, steps=20, byzantine=1, byzantine_mode="nan", json=True, average_every=5,
                     final_average=1, timeout_s=5.0, workdir=str(tmp_path), wall_limit_s=240)
    summary = run_demo(cfg)
    with open(os.path.join(str(tmp_path), "swarm", "peer3.log")) as f:
        assert "FAULT INJECTION" in f.read()  # the Byzantine daemon really corrupted its contributions
    assert summary["byzantine"] == 1 and summary["byzantine_mode"] == "nan" and summary["robust"] == "off"
    honest = [p for p in summary["per_peer"] if not p["byzantine"]]
    assert len(honest) == 3 and [p["peer"] for p in summary["per_peer"] if p["byzantine"]] == [3]
    for p in honest:
        assert p["steps"] == 20 and p["params_finite"] is True, p
        assert math.isfinite(p["held_out_loss"]) and math.isfinite(p["accuracy"]), p
        with open(os.path.join(str(tmp_path), f"result{p['peer']}.json")) as f:
            params = json.load(f)["params"]
        assert all(math.isfinite(v) for v in params)
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["max_param_divergence"])
    # 20 steps of the digits MLP from the shared seed: far better than chance (0.1) on the honest peers
    assert summary["accuracy"] >= 0.5, summary
    # the honest peers averaged with each other (the NaN member's ranges were refused, not the whole round)
    assert summary["outcomes"].get("averaged", 0) >= 20, summary["outcomes"]
