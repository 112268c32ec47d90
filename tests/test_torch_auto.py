"""peerd.torch.auto: the rule behind compression="auto" (codec, parameter-averaging period)."""

import re

import pytest

from peerd.torch.auto import (
    AGREE_STEP,
    INT8_SHARE,
    MIN_INT8_PARAMS,
    PERIOD_LADDER,
    Measured,
    agreed_period,
    announced_periods,
    applied_period,
    choose,
    fp32_transfer_s,
    proposal_subkey,
)
from peerd.torch.autostep import clean_round

GPT = 842_496  # peerd demo --model gpt's parameters


def test_transfer_estimate_is_an_all_reduce():
    # 4 peers: each sends 2 * 3/4 of 4 bytes a value; 1e6 values at 100 Mbit/s = 0.48 s
    assert fp32_transfer_s(100e6, 1_000_000, 4) == pytest.approx(0.48)
    assert fp32_transfer_s(100e6, 1_000_000, 1) == 0.0


def test_slow_link_picks_int8_with_its_reason():
    # the GPT at 100 Mbit among 4: fp32 takes 0.40 s a step against 0.3 s of compute
    c = choose(Measured(link_bps=100e6, compute_s=0.3, params=GPT, peers=4))
    assert c.compression == "int8"
    assert c.fp32_transfer_s == pytest.approx(0.404, abs=0.001)
    assert "int8" in c.reason and "unbiased" in c.reason and "(max - min) / 255" in c.reason


def test_fast_link_keeps_fp32():
    # loopback-like rates: the transfer is a few ms against 300 ms of compute
    c = choose(Measured(link_bps=20e9, compute_s=0.3, params=GPT, peers=4))
    assert c.compression == "fp32" and c.reason.startswith("fp32: its transfer")


def test_threshold_is_a_share_of_compute():
    params, peers, bps = 1_000_000, 4, 100e6
    t = fp32_transfer_s(bps, params, peers)
    just_over = choose(Measured(bps, t / INT8_SHARE * 0.99, params, peers))
    just_under = choose(Measured(bps, t / INT8_SHARE * 1.01, params, peers))
    assert (just_over.compression, just_under.compression) == ("int8", "fp32")


def test_small_model_keeps_fp32_whatever_the_link():
    c = choose(Measured(link_bps=1e6, compute_s=0.001, params=MIN_INT8_PARAMS - 1, peers=4))
    assert c.compression == "fp32" and "too few" in c.reason


def test_unmeasured_keeps_the_defaults():
    for m in (Measured(None, 0.3, GPT, 4), Measured(100e6, None, GPT, 4),
              Measured(float("nan"), 0.3, GPT, 4), Measured(100e6, 0.0, GPT, 4)):
        c = choose(m)
        assert (c.compression, c.average_every, c.bucket_mb) == ("fp32", 10, 25.0), m
        assert "not measured" in c.reason


def test_average_period_keeps_parameter_averages_cheap():
    # a float32 parameter average costs one fp32 transfer; the period keeps that under 10 % of training
    cheap = choose(Measured(100e6, 3.0, GPT, 4))
    assert cheap.average_every == 10
    dear = choose(Measured(10e6, 0.05, GPT, 4))  # 4 s fp32 transfers against 1 s int8 steps: ~40
    assert dear.compression == "int8" and 30 <= dear.average_every <= 50
    mid = choose(Measured(100e6, 0.3, GPT, 4))
    assert 10 <= mid.average_every <= 50


def test_applied_period_is_on_the_ladder_and_only_when_rounds_were_clean():
    dear = choose(Measured(10e6, 1e-4, GPT, 4))  # int8 steps of almost no compute: the rule asks for 40
    assert applied_period(dear, clean=True)[0] == 40 and "costs no accuracy" in applied_period(dear, clean=True)[1]
    assert applied_period(dear, clean=False) == (10, applied_period(dear, clean=False)[1])
    assert "drift" in applied_period(dear, clean=False)[1]
    for every, k in ((10, 10), (18, 10), (19, 20), (20, 20), (36, 20), (37, 40), (39, 40), (40, 40), (50, 40)):
        c = choose(Measured(100e6, 0.3, GPT, 4))
        c = type(c)(c.compression, every, c.bucket_mb, c.reason, c.fp32_transfer_s, c.reasons)
        assert applied_period(c, clean=True)[0] == k
    assert all(b % a == 0 for a, b in zip(PERIOD_LADDER[:-1], PERIOD_LADDER[1:], strict=True))  # they still meet


def test_bad_sizes_refused():
    with pytest.raises(ValueError):
        choose(Measured(100e6, 0.3, 0, 4))


# -- wired into peerd.torch.Optimizer (an in-process daemon: real socket, arena and TrainerService) -------------

def _replicas(tmp_path, delay_s: float, compute_s: float | tuple[float, float], steps: int = 8,
              every: int | str = 0, received_fraction: float = 1.0, complete: bool = True, overlap: bool = False):
    """Two replicas of a 262,656-parameter model with compression="auto" (the default) train ``steps`` steps
    against rounds that take ``delay_s`` and compute that takes ``compute_s`` (one for both, or each its own), each
    round reporting ``received_fraction`` and ``complete`` (``overlap``: DeAR buckets); their replies and
    models."""
    import threading
    import time

    import torch

    from peerd.torch import Optimizer

    from .support.trainer_harness import thread_daemon

    with thread_daemon(tmp_path, group_size=2, wait_s=5.0, delay_s=delay_s) as d:
        d.averager.received_fraction, d.averager.complete = received_fraction, complete
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(torch.nn.Linear(512, 512))
        more = [{"overlap": True, "model": m, "bucket_mb": 0.5} if overlap else {} for m in models]
        opts = [Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="auto", socket=d.path, sync_state=False,
                          average_params_every=every, state_every=0, **kw) for m, kw in zip(models, more, strict=True)]
        replies: list[list[dict]] = [[], []]

        def worker(i: int) -> None:
            for s in range(steps):
                g = torch.Generator().manual_seed(100 * i + s)
                opts[i].zero_grad()
                opts[i].last_microbatch(4)  # (overlap: its buckets go out during backward; else nothing)
                models[i](torch.randn(4, 512, generator=g)).pow(2).mean().backward()
                time.sleep(compute_s[i] if isinstance(compute_s, tuple) else compute_s)
                replies[i].append(opts[i].step(samples=4))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        threads = [threading.Thread(target=o.flush) for o in opts]  # (overlap: the last step's updates)
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        status = d.service.statistics().sessions if hasattr(d, "service") else None
        for o in opts:
            o.close()
        return replies, models, opts, status


def test_optimizer_auto_switches_both_replicas_to_int8_on_a_slow_link(tmp_path) -> None:
    import torch

    replies, models, opts, status = _replicas(tmp_path, delay_s=0.2, compute_s=0.0)
    for r in replies:
        assert len(r) == 8 and all(x["outcome"] == "averaged" for x in r), r
        assert "auto" not in r[3] and r[4]["auto"]["compression"] == "int8"  # chosen at step 5, then every reply
        assert r[-1]["auto"]["compression"] == "int8" and "unbiased" in r[-1]["auto"]["reason"]
    assert all(o.compression == "int8" for o in opts)
    assert bool(torch.equal(models[0].weight, models[1].weight))  # the replicas averaged alike after the switch
    # `peerd status` (the daemon's trainer sessions): the codec and the choice with its reason
    assert len(status) == 2 and all(t.compression == "int8" and t.auto["compression"] == "int8"
                                    and "int8" in t.auto["reason"] for t in status), status


def test_optimizer_auto_switches_overlapping_replicas_to_int8_on_a_slow_link(tmp_path) -> None:
    """With overlap=True too: the buckets of the choosing step come back first, then both replicas average in
    int8 (a step's reply reports the step before it: overlap's buckets come back during the next forward)."""
    import torch

    replies, models, opts, status = _replicas(tmp_path, delay_s=0.2, compute_s=0.0, overlap=True)
    for r in replies:
        assert len(r) == 8 and all(x["outcome"] == "averaged" for x in r[1:]), r
        assert "auto" not in r[3] and r[4]["auto"]["compression"] == "int8", r
        assert r[-1]["auto"]["compression"] == "int8" and "unbiased" in r[-1]["auto"]["reason"]
    assert all(o.compression == "int8" and o.overlap for o in opts)
    assert bool(torch.equal(models[0].weight, models[1].weight))  # the replicas averaged alike after the switch
    assert len(status) == 2 and all(t.compression == "int8" for t in status), status


def test_overlap_auto_measures_compute_without_the_waits_for_buckets(tmp_path) -> None:
    """Overlap's forward waits for the last step's buckets (rounds of 0.3 s here): that wait is communication, so
    the compute the choice weighs is the replica's own (50 ms), not 0.3 s."""
    import re

    replies, _, opts, _ = _replicas(tmp_path, delay_s=0.3, compute_s=0.05, steps=6, overlap=True)
    for r, o in zip(replies, opts, strict=True):
        why = r[-1]["auto"]["reason"]
        compute_ms = float(re.search(r"against (\d+) ms of compute", why).group(1))
        assert 40 <= compute_ms < 150 and o._overlap.waited_s > 0.5, why


def test_optimizer_auto_keeps_fp32_when_compute_dominates(tmp_path) -> None:
    replies, _, opts, _ = _replicas(tmp_path, delay_s=0.0, compute_s=0.4, steps=6)
    for r in replies:
        assert r[-1]["auto"]["compression"] == "fp32" and all(x["outcome"] == "averaged" for x in r), r
    assert all(o.compression is None for o in opts)  # the run's default codec, float32


def test_optimizer_auto_applies_a_longer_period_after_clean_rounds(tmp_path) -> None:
    """Slow rounds that all averaged every datagram: both replicas propose a longer period at step 5, apply it
    from AGREE_STEP, and say so (reply, `peerd status`)."""
    replies, _, opts, status = _replicas(tmp_path, delay_s=0.2, compute_s=0.0, every="auto", steps=AGREE_STEP + 1)
    for r in replies:
        assert all(x["outcome"] == "averaged" for x in r), r
        assert r[4]["auto"]["applied"] == "compression,average_every" and "costs no accuracy" in r[4]["auto"]["reason"]
        assert r[-1]["auto"]["average_every"] in (20, 40) and "agreed" in r[-1]["auto"]["reason"]
    k = opts[0].average_params_every
    assert k in (20, 40) and [o.average_params_every for o in opts] == [k, k]
    assert all(t.auto["average_every"] == k for t in status), status


def test_a_step_is_clean_when_its_result_is_the_groups_not_when_every_datagram_arrived():
    # a round at 5 % loss: reduce-scatter data lost (received_fraction < 1), the all-gather complete after repair
    assert clean_round({"outcome": "averaged", "received_fraction": 0.97, "complete": True})
    # an all-gather range never arrived: this replica kept its own values there
    assert not clean_round({"outcome": "averaged", "received_fraction": 0.99, "complete": False})
    # no group, a failed round, an older daemon's reply without the field
    assert not clean_round({"outcome": "alone", "received_fraction": 1.0, "complete": False})
    assert not clean_round({"outcome": "failed", "received_fraction": 0.0, "complete": True})
    assert not clean_round({"outcome": "averaged", "received_fraction": 1.0})


def test_optimizer_auto_applies_a_longer_period_on_a_lossy_link_whose_results_are_complete(tmp_path) -> None:
    """Rounds that lost datagrams (received_fraction 0.97) but ended on the group's common result: the period still
    goes past the default; rounds that missed an all-gather range keep it at 10."""
    replies, _, opts, _ = _replicas(tmp_path, delay_s=0.2, compute_s=0.0, every="auto", steps=AGREE_STEP + 1,
                                    received_fraction=0.97)
    for r in replies:
        assert all(x["outcome"] == "averaged" and x["complete"] and x["received_fraction"] == 0.97 for x in r), r
        assert "common result" in r[4]["auto"]["reason"]
    assert [o.average_params_every for o in opts][0] in (20, 40)
    assert opts[0].average_params_every == opts[1].average_params_every


def test_optimizer_auto_keeps_the_default_period_when_all_gather_ranges_were_missed(tmp_path) -> None:
    replies, _, opts, _ = _replicas(tmp_path, delay_s=0.2, compute_s=0.0, every="auto", steps=AGREE_STEP + 1,
                                    received_fraction=0.97, complete=False)
    assert [o.average_params_every for o in opts] == [10, 10]
    assert all("missed all-gather ranges" in r[4]["auto"]["reason"] and not r[4]["complete"] for r in replies)


def test_the_announcement_fits_the_dhts_subkey_and_keeps_sessions_apart():
    """A daemon's node id is 64 hex digits: the subkey must still fit the wire's bound, or every put is refused and
    no member ever reads another's proposal."""
    from peerd.wire.messages import MAX_SUBKEY

    node = "ab" * 32
    assert len(proposal_subkey(node, 2**31).encode()) <= MAX_SUBKEY
    assert proposal_subkey(node, 1) != proposal_subkey(node, 2)
    assert proposal_subkey(node, 1) != proposal_subkey("cd" * 32, 1)


def test_agreed_period_is_the_least_announced_and_ignores_odd_claims_hostile():
    assert agreed_period(40, [40, 20, 40]) == (20, agreed_period(40, [40, 20, 40])[1])
    assert "this member proposed 40" in agreed_period(40, [20])[1]
    assert agreed_period(20, [])[0] == 20
    # a member's announcement is a claim: only short decimals naming a rung count, and only so many are read
    assert announced_periods([b"20", b"7", b"-1", b"1000000", "40", b"\xff", None, 5, b"10 "]) == [20, 40]
    assert len(announced_periods([b"40"] * 10_000)) <= 64


def test_replicas_measuring_differently_agree_on_one_period(tmp_path) -> None:
    """One replica computes nothing (its rule asks for 40 steps), the other 0.1 s a step (10): each announces its
    own, and from AGREE_STEP both apply the least, so their parameter averages meet."""
    replies, models, opts, status = _replicas(tmp_path, delay_s=0.2, compute_s=(0.0, 0.1), steps=AGREE_STEP + 2,
                                              every="auto")
    proposed = [r[4]["auto"]["reason"] for r in replies]
    assert "proposed" in proposed[0] and "proposed" in proposed[1], proposed
    assert replies[0][4]["auto"]["average_every"] == replies[1][4]["auto"]["average_every"] == 10  # until agreed
    own = [int(re.search(r"parameters every (\d+) steps[^;]*; proposed", p).group(1)) for p in proposed]
    assert own[0] != own[1], proposed  # they measured differently and proposed different periods
    ks = [o.average_params_every for o in opts]
    assert ks[0] == ks[1] == min(own) and all(o.auto_proposed is None for o in opts), ks
    assert all("agreed" in r[-1]["auto"]["reason"] for r in replies), replies[0][-1]["auto"]
    assert {t.auto["average_every"] for t in status} == {ks[0]}, status
    assert all(r[AGREE_STEP - 1]["params"]["outcome"] == "averaged" for r in replies)  # the step-10 average met


def test_explicit_period_wins(tmp_path) -> None:
    replies, _, opts, _ = _replicas(tmp_path, delay_s=0.2, compute_s=0.0, steps=6, every=10)
    assert [o.average_params_every for o in opts] == [10, 10]
    assert all(r[-1]["auto"]["applied"] == "compression" and "set by the caller" in r[-1]["auto"]["reason"]
               for r in replies)


def test_explicit_compression_wins(tmp_path) -> None:
    import torch

    from peerd.torch import Optimizer

    from .support.trainer_harness import thread_daemon

    with thread_daemon(tmp_path, group_size=1) as d:
        m = torch.nn.Linear(512, 512)
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="x", socket=d.path, sync_state=False,
                        compression="fp32", state_every=0, average_params_every=10)
        for _ in range(6):
            m(torch.ones(1, 512)).sum().backward()
            reply = opt.step()
        assert "auto" not in reply and opt.auto is None and opt.compression == "fp32"
        opt.close()
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="x2", socket=d.path, sync_state=False,
                        compression="fp32", state_every=0)  # the period is auto: the codec is still the caller's
        for _ in range(6):
            m(torch.ones(1, 512)).sum().backward()
            reply = opt.step()
        assert reply["auto"]["compression"] == "fp32" and reply["auto"]["applied"] == "average_every"
        assert reply["auto"]["reason"].startswith("fp32: set by the caller") and opt.compression == "fp32"
        opt.close()
        with pytest.raises(ValueError, match="not with compression='auto'"):
            Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="y", socket=d.path, compression="auto",
                      quant_group=64)


def test_trainer_report_auto_is_bounded_hostile(tmp_path) -> None:
    """A trainer's auto report is kept for `peerd status`: a huge, nested or odd one is refused, not stored."""
    import torch

    from peerd.localsock.client import DaemonError
    from peerd.torch import Optimizer

    from .support.trainer_harness import thread_daemon

    with thread_daemon(tmp_path, group_size=1) as d:
        opt = Optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), run="h", socket=d.path,
                        sync_state=False, state_every=0)
        for bad in ({"reason": "x" * 10_000}, {"reason": {"nested": 1}}, {f"k{i}": 1 for i in range(9)},
                    {"k" * 100: 1}, ["int8"], {"compression": True}):
            with pytest.raises(DaemonError, match="auto must be"):
                opt._call("trainer_report", auto=bad)
        assert all(not t.auto for t in d.service.statistics().sessions)
        opt._call("trainer_report", auto={"compression": "fp32", "reason": "ok"})
        assert [t.auto for t in d.service.statistics().sessions] == [{"compression": "fp32", "reason": "ok"}]
        opt.close()


def test_diloco_outer_codec_is_int8_from_min_int8_params_values_a_fragment() -> None:
    from peerd.torch.auto import MIN_INT8_PARAMS, outer_codec

    assert outer_codec(MIN_INT8_PARAMS)[0] == "int8" and outer_codec(842_496)[0] == "int8"
    codec, why = outer_codec(MIN_INT8_PARAMS - 1)
    assert codec == "fp32" and why.startswith("fp32: a fragment of 262,143 values")
