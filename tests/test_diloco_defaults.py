"""DiLoCo's defaults are what the docs say: the library's (docs/trainer-api.md) and the GPT demo script's outer rule
and period (docs/benchmarks.md, where the loss they reach is measured)."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_library_defaults_are_the_ones_trainer_api_names() -> None:
    from peerd.torch import DiLoCo

    text = (DOCS / "trainer-api.md").read_text()
    m = re.search(r"DiLoCo\(model, inner_optimizer, \*, run, sync_every=(\d+),\s+fragments=(\d+), "
                  r"outer_lr=([\d.]+), outer_momentum=([\d.]+)", text)
    assert m, "docs/trainer-api.md no longer states DiLoCo's defaults"
    params = inspect.signature(DiLoCo.__init__).parameters
    assert params["sync_every"].default == int(m[1]) and params["fragments"].default == int(m[2])
    assert params["outer_lr"].default == float(m[3]) and params["outer_momentum"].default == float(m[4])


def test_the_gpt_scripts_outer_rule_and_period_are_the_ones_benchmarks_measures() -> None:
    from peerd.tools.demo_gpt import add_arguments

    text = (DOCS / "benchmarks.md").read_text()
    m = re.search(r"GPT script's DiLoCo defaults: `--sync-every (\d+) --outer-lr ([\d.]+) --outer-momentum ([\d.]+)`",
                  text)
    assert m, "docs/benchmarks.md no longer states the GPT script's DiLoCo defaults"
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert (args.sync_every, args.outer_lr, args.outer_momentum) == (int(m[1]), float(m[2]), float(m[3]))


def _outer_rule():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "outer_rule.py"
    spec = importlib.util.spec_from_file_location("outer_rule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_outer_rule_replay_is_ddp_where_one_replica_averages_every_step(capsys) -> None:
    """scripts/outer_rule.py (the replay benchmarks.md measures the outer rule with): one replica whose progress is
    averaged every step under plain averaging trains exactly as the DDP loop on its batch; a second replica and
    momentum move the curve."""
    rule = _outer_rule()
    common = ["--steps", "6", "--sync-every", "2", "--peers", "1", "--warmup", "2"]
    assert rule.main([*common, "--ddp"]) == 0
    ddp = json.loads(capsys.readouterr().out)
    assert rule.main([*common, "--outer-momentum", "0", "--sync-every", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert [s for s, _ in ddp["curve"]] == [2, 4, 6] and len(one["curve"]) == 6
    assert dict(map(tuple, one["curve"]))[6] == pytest.approx(dict(map(tuple, ddp["curve"]))[6], abs=2e-4)
    assert rule.main([*common, "--peers", "2", "--target", "9.9"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["reached_at"] == 2 and len(two["curve"]) == 1 and two["curve"][0][1] != ddp["curve"][0][1]
    # an outer learning rate of 0 keeps the global parameters where they started: every replica restarts there
    # at each outer step (and none trains another's parameters), so every point of the curve is the first one's
    assert rule.main([*common, "--peers", "2", "--outer-lr", "0", "--outer-momentum", "0"]) == 0
    still = json.loads(capsys.readouterr().out)
    assert len({loss for _, loss in still["curve"]}) == 1 and still["curve"][0][1] > ddp["curve"][-1][1]


def test_the_replay_averages_through_the_codec_as_the_all_reduce_does() -> None:
    """``--compression``: each member's pseudo-gradient and then the mean pass through the codec (stochastic
    rounding, a draw per sender and phase): int8 lands close to the exact mean, int4 further off, both unbiased
    enough that the mean's error is small against the values; fp32 is the exact mean."""
    import numpy as np
    import torch

    rule = _outer_rule()
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(20_000, generator=gen) for _ in range(4)]
    exact = torch.stack(deltas).mean(0)
    assert torch.equal(rule._average(deltas, None, 0), exact)
    err = {}
    for name in ("int8", "int4"):
        got = rule._average(deltas, rule.make_codec(name), 0)
        assert got.shape == exact.shape and torch.isfinite(got).all()
        err[name] = float((got - exact).abs().mean())
        assert abs(float((got - exact).mean())) < 0.01  # no drift: the rounding is unbiased
    assert 0 < err["int8"] < err["int4"] < 0.3 * float(exact.abs().mean())
    assert np.isclose(err["int8"], float((rule._average(deltas, rule.make_codec("int8"), 1) - exact).abs().mean()),
                      rtol=0.2)  # another round's draws: another error of the same size
