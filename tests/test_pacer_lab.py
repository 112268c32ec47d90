"""The pacer on real shaped links (root: a LinkLab of network namespaces, tc tbf, nftables random loss).

tests/test_pacing.py holds the pacer's behaviour in virtual time; this checks that the daemon's pacing, with its
REPORTs crossing the same lossy links and its receivers stamping arrivals on a loaded 2-core machine, keeps what
the simulation promises where it matters most: it does not lose its own data to its own overrun, and random
link loss does not collapse its rate (the old pacer started 8x over a 100 Mbit/s link and lost up to a fifth of
what it sent; later it crawled at a fifth of the link).

Sizes are small so the test runs in well under a minute: 3 daemons, 1M float32 each (per daemon 5.3 MB through
its uplink per average), 100 Mbit/s, 5 % link loss, 3 averages. The first average includes the pacer's startup
from 16 Mbit/s.
"""

from __future__ import annotations

import os

import pytest

from peerd.tools.bench.allreduce import AllreduceBenchConfig, run_allreduce_bench

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the link lab needs root (network namespaces, tc, nft)")


def test_paced_average_over_lossy_shaped_links() -> None:
    cfg = AllreduceBenchConfig(peers=3, size=1_000_000, repeat=3, link="100mbit", link_loss=0.05, seed=3)
    full = run_allreduce_bench(cfg, quiet=True)
    # (the figures a failure needs first: pytest cuts a long dict short)
    keys = ("peerd_s_all", "phases_ended_by_deadline", "excess_loss", "link_drop_fraction", "received_fraction",
            "deadline_phases", "drops", "kernel_drops", "cpu_s_per_peer", "link_utilization")
    out = {k: full[k] for k in keys if k in full} | full
    # 5 % link loss realized (nftables counters), so the loss below is measured against a real floor
    assert 0.03 <= out["link_drop_fraction"] <= 0.07, out
    # What peerd lost beyond the link's random loss: its own overrun of the tbf queues, mostly the startup's
    # overshoot at this small size (three 0.4 s averages). Measured in this configuration: the old pacer (a
    # 100 MB/s start) 0.116; this one 0.053 at 5 % link loss, 0.011 with none. The goal is 0.01: not
    # met here; the bound catches a return to the old overrun.
    assert out["excess_loss"] <= 0.08, out
    # Random loss must not collapse the rate. Each average moves 2 x (2/3) x 4 MB through each uplink, 0.43 s
    # at the link's rate; measured 1.5-2.0 s (startup from 16 Mbit/s, and the CPU of a loaded 2-core machine).
    # A pacer stuck at its floor (a bug this caught: REPORTs that came in after their phase was judged never
    # moved it again) took 14-21 s.
    assert max(out["peerd_s_all"]) <= 4.0, out
    assert out["phases_ended_by_deadline"] == 0, out
