"""Issue 16's benches on the link lab: `bench moshpit --link`, `demo --model wide --baseline gloo --link`, and the
arithmetic behind the new JSON fields (bus_fraction, excess_loss, p99, time-to-accuracy). The e2e tests need root
(the lab builds network namespaces) and skip with that reason elsewhere; the arithmetic runs everywhere."""

from __future__ import annotations

import os

import numpy as np
import pytest

from peerd.tools.bench.allreduce import bus_fraction, injected_loss, p99
from peerd.tools.bench.ddp_baseline import time_to_accuracy

from .support.processes import peerd_json

NOT_ROOT = "the link lab needs root (network namespaces, tc, nftables)"


def test_bus_fraction_is_the_butterfly_bound_over_the_time() -> None:
    # 4 peers, 5M float32: each uplink carries 2 * 3/4 * 20 MB = 30 MB; at 100 Mbit (12.5 MB/s) that is 2.4 s.
    assert bus_fraction(4, 5_000_000, 2.4, 100_000_000) == pytest.approx(1.0)
    assert bus_fraction(4, 5_000_000, 4.8, 100_000_000) == pytest.approx(0.5)
    assert bus_fraction(2, 1000, 0.0, 100_000_000) == 0.0


def test_injected_loss_combines_independent_drops() -> None:
    assert injected_loss(0.0, 0.0) == 0.0
    assert injected_loss(0.1, 0.0) == pytest.approx(0.1)
    assert injected_loss(0.1, 0.1) == pytest.approx(0.19)


def test_p99_interpolates_and_is_the_worst_for_few_runs() -> None:
    times = [float(i) for i in range(1, 101)]
    assert p99(times) == pytest.approx(99.01)
    assert p99([1.0, 2.0, 10.0]) == pytest.approx(9.84)
    assert p99([]) == 0.0


def test_time_to_accuracy_waits_for_every_member_and_the_mean() -> None:
    evals = {
        10: {0: (0.95, 11.0), 1: (0.80, 12.0)},  # mean 0.875: not yet
        20: {0: (0.94, 21.0)},  # member 1 has not evaluated step 20: incomplete, skipped
        30: {0: (0.94, 31.0), 1: (0.93, 33.5)},  # mean 0.935: reached when the slower member finished
    }
    assert time_to_accuracy(evals, 1.0, 0.93, 2) == pytest.approx(32.5)
    assert time_to_accuracy(evals, 1.0, 0.99, 2) is None


def test_wide_model_has_millions_of_parameters_and_mlp_is_unchanged() -> None:
    pytest.importorskip("torch")
    from peerd.tools.demo_train import build_model, sample_batch

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(build_model(64, 0, "wide")) == 2_241_546
    assert count(build_model(64, 0)) == count(build_model(64, 0, "mlp")) == 4_810
    with pytest.raises(ValueError, match="expected one of"):
        build_model(64, 0, "huge")
    # the DDP baseline draws exactly what `peerd train` draws, step after step
    shard = np.arange(3, 1437, 4)
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    for _ in range(3):
        drawn = sample_batch(shard, a, 32, 4)
        assert [len(x) for x in drawn] == [8, 8, 8, 8]
        for x in drawn:
            assert np.array_equal(x, shard[b.integers(0, len(shard), 8)])


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason=NOT_ROOT)
def test_bench_moshpit_on_lab_links() -> None:
    """A 2x2 grid, every daemon in its own namespace on a 100 Mbit link that drops 5 % of what arrives: the rounds
    still pull the peers together, and the JSON says what the lab saw."""
    out = peerd_json("bench", "moshpit", "--peers", "4", "--grid", "2x2", "--rounds", "2", "--size", "20000",
                     "--link", "100mbit", "--link-loss", "0.05", timeout=300)
    assert out["link_rate"] == "100mbit" and out["link_loss"] == 0.05, out
    assert out["link_packets_seen"] > 200 and 0.01 < out["link_drop_fraction"] < 0.12, out
    assert all(sum(o.values()) == 4 for o in out["outcomes"]), out
    assert out["outcomes"][-1].get("averaged", 0) >= 2, out
    # lost ranges keep own values, so not exactly 0 as without loss, but far below the start
    assert out["deviation"][-1] < 0.5, out
    assert all(0.7 < f <= 1.0 for f in out["received_fraction"]), out
    # per round, what the token buckets' queues dropped (the senders' own overrun, apart from the link's loss)
    assert len(out["link_queue_drops"]) == 2, out
    assert all(set(q) == {"up", "down"} and all(0.0 <= v < 0.2 for v in q.values()) for q in out["link_queue_drops"])


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason=NOT_ROOT)
def test_demo_wide_against_gloo_ddp_on_lab_links() -> None:
    """`demo --model wide --baseline gloo` on 100 Mbit links losing 5 %: both train the same 2.24 M-parameter model
    on the same shards; both reach the (low, 10-step) target, end close in accuracy, and report their times."""
    out = peerd_json("demo", "--peers", "2", "--steps", "10", "--model", "wide", "--link", "100mbit",
                     "--link-loss", "0.05", "--baseline", "gloo", "--target-accuracy", "0.5", timeout=600)
    base = out["baseline"]
    assert out["model"] == "wide" and out["target_accuracy"] == 0.5 and out["link_rate"] == "100mbit", out
    assert 0.01 < out["link_drop_fraction"] < 0.12, out
    assert out["time_to_accuracy_s"] is not None and 0 < out["time_to_accuracy_s"] <= out["train_wall_s"], out
    assert base["kind"] == "gloo" and base["steps"] == 10, base
    assert base["time_to_accuracy_s"] is not None and 0 < base["time_to_accuracy_s"] <= base["wall_s"], base
    assert base["accuracy"] > 0.5 and out["accuracy"] > 0.5, out
    assert abs(base["accuracy"] - out["accuracy"]) < 0.1, out
