"""A member that inflates its weight and flips its sign (the fault injector's ``inflate-signflip``), written from
the attack: it claims 2**24 samples in every reduce-scatter header and sends its negated vector, so an owner
that believes the claim returns the attacker's vector, reversed. The trainer's default weight cap (two of its
own batches) and robust's weight bound keep the honest direction; a 4-peer demo with one such daemon trains."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from peerd.allreduce.group import DEFAULT_MAX_WEIGHT, GROUP_OPTIONS, GroupAverage
from peerd.allreduce.robust import Robust
from peerd.compress import codec
from peerd.tools.faults import WEIGHT as BYZANTINE_WEIGHT
from peerd.tools.faults import byzantine
from peerd.torch.optimizer import MAX_SAMPLES_FACTOR

from .support.gradients import cos, gradients  # noqa: E402
from .support.groups import GROUP, GroupNet, payload_for

PER = 50


def average(xs: list[np.ndarray], bad: int, **options: object) -> list[GroupAverage]:
    """Every member averages its vector at 32 samples; member ``bad`` runs the inflate-signflip injector."""
    n = len(xs)
    cores = [byzantine("inflate-signflip" if i == bad else None)(GROUP, n, i, xs[i], 32.0, 0.0,
                                                                 max_payload=payload_for(PER),
                                                                 options=replace(GROUP_OPTIONS, **options))
             for i in range(n)]
    GroupNet(cores).run()
    return cores


@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_inflate_signflip_takes_an_unbounded_owner_and_not_a_bounded_one_hostile(name: str) -> None:
    """One of 8. Unbounded (max_weight 2**24, the daemon's default for other callers), every honest owner's
    shard is the attacker's negated vector; capped at MAX_SAMPLES_FACTOR batches (the trainer's default) or with
    robust's weight bound, the shard points the honest way, and the attacker's weight is counted as capped or
    bounded."""
    n, length, bad = 8, 800, 0
    xs = gradients(n, length, 3)
    honest = np.mean(np.stack(xs[1:]).astype(np.float64), axis=0)
    lo = length // n  # shards 1..3: honest owners
    options = {} if name == "fp32" else {"codec": codec(name), "run": 7}
    assert BYZANTINE_WEIGHT == DEFAULT_MAX_WEIGHT  # the most a claim can be without being capped by default
    open_ = average(xs, bad, **options)
    for i in range(1, n):
        st = open_[i].statistics()
        assert st.weight_total == pytest.approx(BYZANTINE_WEIGHT + 32.0 * (n - 1))
        assert cos(open_[i].result()[lo:], -xs[bad][lo:]) > 0.99  # the attacker's reversed vector, nothing else
    for kw, reason in (({"max_weight": MAX_SAMPLES_FACTOR * 32.0}, "weight_capped"), ({"robust": Robust("clip", 1e6)},
                                                                      "weight_bounded")):
        cores = average(xs, bad, **options, **kw)
        for i in range(1, n):
            got = cores[i].result()
            assert cos(got[lo:], honest[lo:]) > 0.3, (kw, i)
            assert cores[i].statistics().refused.get(reason, 0) >= 1, cores[i].statistics().refused


def test_a_gradient_averages_default_leaves_an_inflated_sign_flip_out_hostile() -> None:
    """One of 8 at a trainer's defaults. Its weight capped at two batches, the negated gradient still counted as
    two honest members against the other seven (the honest signal at 5/9 of its size: the 8-peer demo 5 points
    short of the clean run at 40 steps). A gradient average's default robust (the weight bound and the direction
    test, clipping only past MAX_C times the median) leaves it out: each honest owner's shard is the honest mean."""
    from peerd.allreduce.robust import MAX_C

    n, length, bad = 8, 800, 0
    xs = gradients(n, length, 3)
    honest = np.mean(np.stack(xs[1:]).astype(np.float64), axis=0)
    lo = length // n  # shards 1..7: honest owners
    capped = average(xs, bad, max_weight=MAX_SAMPLES_FACTOR * 32.0)
    cores = average(xs, bad, max_weight=MAX_SAMPLES_FACTOR * 32.0, robust=Robust("clip", MAX_C))
    for i in range(1, n):
        assert cos(capped[i].result()[lo:], honest[lo:]) < 0.95  # the attack as the cap alone leaves it
        st = cores[i].statistics()
        assert st.refused.get("opposed") == 1 and "clipped" not in st.refused, st.refused
        assert st.weight_total == pytest.approx(32.0 * (n - 1))
        a, b = i * lo, (i + 1) * lo
        np.testing.assert_allclose(cores[i].result()[a:b], honest[a:b], rtol=0, atol=1e-5)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_weight_inflating_sign_flipping_daemon_does_not_wreck_the_demo_hostile(tmp_path) -> None:
    """4 real daemons and trainers, one daemon claiming 2**24 samples with its negated gradients and parameters,
    defaults otherwise: believed, it makes every average its reversed vector (and at 4 batches it still
    outweighed the 3 honest ones); now the trainers' cap of 2 batches and the clipped parameter averages leave
    the honest peers training, more slowly (the flip still cancels part of each average): the loss falls below
    chance's (ln 10 = 2.30), where believing the claimed weight makes it climb."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from peerd.tools.demo import DemoConfig, run_demo

    cfg = DemoConfig(peers=4, steps=30, byzantine=1, byzantine_mode="inflate-signflip", json=True,
                     timeout_s=5.0, workdir=str(tmp_path), wall_limit_s=240)
    summary = run_demo(cfg)
    with open(tmp_path / "swarm" / "peer3.log") as f:
        assert "inflate-signflip" in f.read()  # the attacker's daemon really ran the injector
    assert summary["byzantine_mode"] == "inflate-signflip"
    honest = [p for p in summary["per_peer"] if not p["byzantine"]]
    assert len(honest) == 3 and all(p["steps"] == 30 and p["params_finite"] for p in honest), honest
    assert summary["final_loss"] < 2.2 and summary["accuracy"] >= 0.25, summary


def test_diloco_outer_averages_bound_claimed_weights_by_default_hostile(tmp_path) -> None:
    """A DiLoCo trainer that sets neither robust nor max_samples: its outer rounds passed no weight bound and the
    daemon's 2**24 cap, so one member claiming 2**24 samples was the whole outer step. Now they cap weights at
    MAX_SAMPLES_FACTOR times this trainer's first outer step and ask for the weight bound (clip only past MAX_C
    times the median)."""
    torch = pytest.importorskip("torch")
    from peerd.allreduce.robust import MAX_C
    from peerd.torch import DiLoCo

    from .support.trainer_harness import thread_daemon

    with thread_daemon(tmp_path, group_size=1, wait_s=0.1) as daemon:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="wb", socket=daemon.path, sync_every=2,
                     sync_state=False, state_every=0)
        for _ in range(4):
            opt.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
            opt.step(samples=3)
        cap = MAX_SAMPLES_FACTOR * 2 * 3.0  # the first outer step stands for 2 inner steps of 3 samples
        assert opt.outer_steps == 2 and opt.max_samples == cap
        outer = daemon.averager.outer_options()
        assert len(outer) == 2, outer
        assert all(o.get("robust") == Robust("clip", MAX_C) and o.get("max_weight") == cap for o in outer), outer
        opt.close()


def test_the_demo_sums_the_direction_tests_verdicts_by_honest_and_byzantine_member() -> None:
    """`peerd demo --byzantine K --compression arc-topk` reports ``direction_test``: the honest daemons' verdicts
    (``peerd status``: moshpit.<run>.suspects) summed apart for honest and byzantine members."""
    from peerd.tools.demo import direction_bans

    statuses = [{"moshpit": {"r": {"suspects": {"tests": {"aa": 10, "bb": 10, "ff": 6}, "bans": {"ff": 2},
                                                 "banned_now": ["ff"]}},
                             "other": {"suspects": None}}},
                {"moshpit": {"r": {"suspects": {"tests": {"aa": 9, "ff": 5}, "bans": {"aa": 1, "ff": 1}}}}},
                {"moshpit": {}}]
    assert direction_bans(statuses, {"ff"}) == {"honest_tests": 29, "honest_bans": 1, "byzantine_tests": 11,
                                                "byzantine_bans": 3}
