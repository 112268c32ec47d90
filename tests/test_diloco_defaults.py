"""DiLoCo's defaults are what the docs say: the library's (docs/trainer-api.md) and the GPT demo script's outer rule
and period (docs/benchmarks.md, where the loss they reach is measured)."""

from __future__ import annotations

import argparse
import inspect
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
