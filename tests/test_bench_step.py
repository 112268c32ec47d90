"""`peerd bench step`'s arithmetic (the bytes' time, the figures from step records) and its command line."""

from __future__ import annotations

import argparse

import pytest

from peerd.localsock.phases import PHASES
from peerd.tools.bench.step import StepBenchConfig, add_parser, summarize, transfer_seconds


def test_transfer_is_the_butterflys_bytes_with_their_headers_at_the_link_rate() -> None:
    assert transfer_seconds(800_000, 4, "fp32", None) == 0.0  # loopback: no link rate
    payload = 2 * 3 / 4 * 800_000 * 4  # bytes each member sends (and receives) for 4 peers, fp32
    expected = (payload + payload / 1200 * (56 + 28 + 14)) * 8 / 100e6
    assert transfer_seconds(800_000, 4, "fp32", 100_000_000) == pytest.approx(expected)
    assert transfer_seconds(800_000, 4, "int8", 100_000_000) < expected / 3


def test_summary_leaves_out_the_warmup_and_takes_medians() -> None:
    cfg = StepBenchConfig(peers=2, steps=4, warmup=1)

    def rec(seconds: float, transfer: float) -> dict:
        return {"seconds": seconds, "outcome": "averaged", "kept": False,
                "phases": {**dict.fromkeys(PHASES, 0.0), "transfer": transfer}}

    records = [[rec(9.0, 9.0), rec(0.5, 0.4), rec(0.6, 0.5), rec(0.7, 0.6)],
               [rec(9.0, 9.0), rec(0.5, 0.4), rec(0.6, 0.5), rec(0.8, 0.6)]]
    out = summarize(records, cfg, transfer_s=0.4, rtt_s=0.001)
    assert out["steps"] == 6 and out["step_s"] == pytest.approx(0.6)
    assert out["fixed_s"] == pytest.approx(0.2) and out["bound_s"] == pytest.approx(0.43)
    assert out["phases"]["transfer"] == pytest.approx(0.5) and set(out["phases"]) == set(PHASES)
    assert out["outcomes"] == {"averaged": 6}


def test_the_command_line_checks_its_arguments() -> None:
    top = argparse.ArgumentParser()
    add_parser(top.add_subparsers(dest="bench_command"))
    args = top.parse_args(["step", "--peers", "4", "--params", "1e6", "--mode", "diloco", "--link", "100mbit",
                           "--link-loss", "0.05", "--json"])
    assert (args.peers, int(args.params), args.mode, args.link, args.link_loss) == (4, 1_000_000, "diloco",
                                                                                     "100mbit", 0.05)
    for bad in (StepBenchConfig(peers=1), StepBenchConfig(mode="ring"), StepBenchConfig(link_loss=0.1),
                StepBenchConfig(steps=3, warmup=3), StepBenchConfig(compression="zip")):
        with pytest.raises(ValueError):
            bad.check()
