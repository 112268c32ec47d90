"""End to end: `peerd bench soak` (issue 11): 4 sealed daemons average while a member attacker and an
outsider replay every wire attack at them; no daemon exits and every honest average stays exact."""

from __future__ import annotations

import json

import pytest

from peerd.tools.bench.soak_attack import CLASSES

from .support.processes import peerd

pytestmark = pytest.mark.e2e

FIELDS = ("datagrams_sent", "sent_by_class", "crashes", "rss_growth_mb", "ping_p99_ms", "averages_ok",
          "averages_failed", "rate_floor", "rate_no_attack", "drops", "seconds", "datagrams_per_second")
DROP_METRICS = ("peerd_datagrams_dropped_total", "peerd_dht_store_refused_total", "peerd_ignored_records_total",
                "peerd_contributions_refused_total", "peerd_background_errors_total")


def test_small_soak_no_crash_and_exact_averages() -> None:
    # A gentler rate and a short burst than the full soak's: a burst that overflows the daemons' socket buffers
    # loses honest tensor data too, and an average with a lost range is (by design) not the exact mean.
    run = peerd("bench", "soak", "--datagrams", "20000", "--size", "100000", "--calm", "3", "--rate", "3000",
                "--burst-share", "0.15", "--json", timeout=180)
    out = json.loads(run.stdout)  # stdout is pure JSON
    for name in FIELDS:
        assert name in out, name
    assert set(DROP_METRICS) <= set(out["drops"])
    # where PINGs wait or are lost: the daemons' kernel receive queues, sampled in every phase the soak ran
    assert {"calm", "attack"} <= set(out["kernel_by_phase"]), out["kernel_by_phase"]
    assert all(v["deepest_queue_kb"] >= 0 and v["kernel_drops"] >= 0 for v in out["kernel_by_phase"].values())
    assert set(out["ping_lost_by_phase"]) <= set(out["ping_samples_by_phase"]) | {"calm"}
    assert out["crashes"] == 0, out
    assert out["averages_failed"] == 0, out["average_errors"]
    assert out["averages_ok"] > 0
    assert set(out["sent_by_class"]) == set(CLASSES)
    assert all(count > 0 for count in out["sent_by_class"].values()), out["sent_by_class"]
    assert out["datagrams_sent"] >= 20000
    assert out["rss_growth_mb"] <= 256  # measured 3-63 MB, also over 1,000,000 datagrams
    # not asserted (machine load and other fixes decide them): ping_p99_ms <= 50, rate_floor >= rate_no_attack
    # the attacks arrived and were refused (reasons other fixes may rename are not pinned here)
    dropped = out["drops"]["peerd_datagrams_dropped_total"]
    assert dropped.get("auth", 0) > 0 and dropped.get("replay", 0) > 0, dropped  # the outsider, replays
    # issue 12: a datagram sealed for one daemon is refused at the others, random tokens are rationed
    assert out["sent_by_class"]["cross_receiver_replay"] > 0 and out["sent_by_class"]["random_token"] > 0
    assert dropped.get("auth_limited", 0) > 0, dropped
    # relay_hijack, connect_reflect: no daemon relays another's traffic or punches where a CONNECT pointed
    assert out["connect_reflected"] == 0, out
    # loss is not a NAT: a request the flood left unanswered, or one to an identity nobody vouches for, is no
    # reason to relay (a few PINGs of a relay attempt with evidence are allowed; it was thousands of datagrams)
    assert out["honest_relayed_datagrams"] <= 20, out["honest_relayed_datagrams"]
    # the outsider-only phase: its daemon CPU per datagram (the <= 5 us goal is not asserted: a shared machine)
    cpu = out["outsider_cpu_us_per_datagram"]
    # (measured: a float; its sign is not asserted: it is the window's CPU less the idle window's, and an idle
    # window busier than the attack's, on a shared 2-core machine, left all four daemons at -0.1 to -1 us in CI)
    assert isinstance(cpu, float), out.get("outsider_cpu_us_per_datagram_by_daemon")
    assert out["outsider_datagrams"] > 0
    outsider_dropped = out["outsider_drops"]["peerd_datagrams_dropped_total"]
    assert outsider_dropped.get("auth", 0) + outsider_dropped.get("auth_limited", 0) > 0, outsider_dropped
    assert sum(dropped.values()) >= 1000, dropped


def test_outsider_endpoints_measure_the_receive_path_alone() -> None:
    """The bench's receive-path figure without daemons: bare endpoints under the outsider's classes."""
    from peerd.tools.bench.soak import main, outsider_endpoints

    out = outsider_endpoints(2, 4000.0, 1.0)
    assert out["endpoints"] == 2 and out["datagrams"] == 4000
    assert 0 < out["cpu_us_per_datagram"] < 1000, out  # not pinned: a shared machine
    assert main(["outsider", "0"]) == 2 and main(["bogus"]) == 2
