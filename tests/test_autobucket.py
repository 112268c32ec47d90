"""bucket_mb="auto" (overlap): the trial of a split plan, its decision, the run's agreement, and its wiring."""

import pytest

from peerd.torch.auto import MAX_ANNOUNCED
from peerd.torch.autobucket import (
    AGREE_AT,
    DECIDE_AT,
    SPLIT_AT,
    TIMED_LARGE,
    TIMED_SMALL,
    BucketTrial,
    announced_sizes,
    candidates,
    elems_of,
    proposal_key,
)

GPT = 842_496  # peerd demo --model gpt's parameters


def test_candidates_are_ddps_size_and_half_the_model():
    large, small = candidates(GPT)
    assert large == elems_of(25.0) and small == (GPT + 1) // 2
    big = 50 * 2**20  # 200 MB of float32: 25 MB buckets against 12.5 MB ones
    assert candidates(big) == (elems_of(25.0), elems_of(12.5))


def test_a_small_model_is_not_tried():
    t = BucketTrial(elems_of(1.5))  # under two buckets of 1 MB
    assert t.agreed == t.large and "too small" in t.reason
    assert {t.plan_at(s) for s in range(30)} == {t.large}


def test_the_plan_is_a_function_of_the_step_alone():
    a, b = BucketTrial(GPT), BucketTrial(GPT)
    plans = [a.plan_at(s) for s in range(AGREE_AT)]
    assert plans == [b.plan_at(s) for s in range(AGREE_AT)]  # every member cuts every step alike
    assert plans == [a.small if SPLIT_AT <= s < DECIDE_AT else a.large for s in range(AGREE_AT)]


def _timed(small_s: float, large_s: float = 0.4) -> BucketTrial:
    t = BucketTrial(GPT)
    for s in range(AGREE_AT):
        t.record(s, small_s if s in TIMED_SMALL else large_s if s in TIMED_LARGE else 9.9)  # untimed: ignored
    return t


def test_the_split_is_proposed_only_when_it_is_faster():
    assert _timed(0.30).propose() == _timed(0.30).small  # 25 % faster
    slower = _timed(0.45)
    assert slower.propose() == slower.large and "not 5% faster" in slower.reason
    assert _timed(0.39).propose() == _timed(0.39).large  # 2.5 % faster: within the noise, not taken


def test_too_few_timed_steps_abstain():
    t = BucketTrial(GPT)
    t.record(TIMED_LARGE[0], 0.4)
    t.record(TIMED_SMALL[0], 0.1)
    assert t.propose() is None and t.decided and "too few" in t.reason
    assert t.agree([]) == t.large  # nobody proposed: the large plan
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        u = BucketTrial(GPT)
        u.record(TIMED_LARGE[0], bad)
        assert u.walls == {}


def test_the_run_agrees_on_the_largest_bucket():
    fast = _timed(0.30)
    fast.propose()
    assert fast.agree([fast.small, fast.small]) == fast.small
    fast2 = _timed(0.30)
    fast2.propose()
    assert fast2.agree([fast2.small, fast2.large]) == fast2.large  # the split did not pay for one member
    assert "agreed" in fast2.reason


def test_bucket_announcements_hostile():
    """Announcements are members' claims: only a decimal of one of the model's two candidates counts, and at most
    MAX_ANNOUNCED are read; a member can at worst ask for the large plan (speed, never accuracy)."""
    large, small = candidates(GPT)
    junk = [b"", b"-1", b"0", b"1e9", b"99999999999999", str(small + 1).encode(), "x" * 10_000, None, 7, {"a": 1},
            str(small).encode() + b"\x00", " " + str(small)]
    assert announced_sizes(junk, (large, small)) == []
    assert announced_sizes([str(small).encode(), str(large)], (large, small)) == [small, large]
    flood = [str(small).encode()] * (10 * MAX_ANNOUNCED)
    assert len(announced_sizes(flood, (large, small))) == MAX_ANNOUNCED
    t = BucketTrial(GPT)
    assert not t.take(small + 1) and not t.take(0) and t.agreed is None  # a donor's claim that is no candidate
    assert t.take(small) and t.plan_at(0) == small


# -- wired into peerd.torch.Optimizer (an in-process daemon: real socket, arena and TrainerService) -------------

def _run(tmp_path, steps: int, announce: list[bytes] = ()):
    """Two replicas of a 1M-parameter model (4 MB: the trial runs) with overlap and bucket_mb "auto" (the
    default), ``steps`` steps; ``announce``: announcements of other members already in the DHT."""
    import torch

    from peerd.torch import Optimizer

    from .support.trainer_harness import in_threads, thread_daemon

    with thread_daemon(tmp_path, group_size=2, wait_s=5.0) as d:
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(torch.nn.Sequential(torch.nn.Linear(1000, 500), torch.nn.Linear(500, 1000)))
        opts = [Optimizer(torch.optim.SGD(m.parameters(), lr=0.01), run="auto", socket=d.path, sync_state=False,
                          average_params_every=0, state_every=0, compression=None, overlap=True, model=m)
                for m in models]
        for i, v in enumerate(announce):
            d.dht.setdefault(proposal_key(opts[0].run_key), {})[f"other/{i}"] = v
        replies: list[list[dict]] = [[], []]
        plans: list[list[int]] = [[], []]

        def worker(i: int) -> None:
            for s in range(steps):
                g = torch.Generator().manual_seed(100 * i + s)
                opts[i].zero_grad()
                opts[i].last_microbatch(4)
                models[i](torch.randn(4, 1000, generator=g)).pow(2).mean().backward()
                plans[i].append(len(opts[i]._overlap.schedule.buckets))
                replies[i].append(opts[i].step(samples=4))

        in_threads(2, worker)
        for o in opts:
            o.flush()
        status = d.service.statistics().sessions
        snap = opts[0].snapshot()
        for o in opts:
            o.close()
        return replies, models, opts, plans, status, snap


def test_overlap_auto_tries_the_split_and_the_run_agrees(tmp_path) -> None:
    import torch

    replies, models, opts, plans, status, _ = _run(tmp_path, AGREE_AT + 3)
    for p in plans:  # the same cut at every step on both replicas: one bucket, two in the trial, then the agreed
        assert p[:SPLIT_AT] == [1] * SPLIT_AT and p[SPLIT_AT:DECIDE_AT] == [2] * (DECIDE_AT - SPLIT_AT), p
        assert p[DECIDE_AT:AGREE_AT] == [1] * (AGREE_AT - DECIDE_AT), p
    assert plans[0] == plans[1] and len(set(plans[0][AGREE_AT:])) == 1
    for r in replies:
        assert all(x["outcome"] == "averaged" for x in r[1:]), r
        assert "bucket_mb" in r[-1]["auto"]["applied"] and "agreed" in r[-1]["auto"]["reason"]
        assert "1 from the others" in r[-1]["auto"]["reason"]  # this session's own announcement counted once
        assert r[SPLIT_AT]["auto"]["bucket_mb"] in (1.91, 2.0)  # the next step cut in half of 4 MB, as reported
    assert opts[0]._overlap.bucket_elems == opts[1]._overlap.bucket_elems
    assert bool(torch.equal(models[0][0].weight, models[1][0].weight))  # every step averaged alike
    assert all("bucket_mb" in t.auto["applied"] for t in status), status


def test_one_member_asking_for_the_large_plan_keeps_it(tmp_path) -> None:
    """Another member announced the large plan: the split is never applied, whatever these two measured; junk
    announcements beside it change nothing."""
    large, _ = candidates(1000 * 500 + 500 + 500 * 1000 + 1000)
    replies, _, opts, plans, _, snap = _run(tmp_path, AGREE_AT + 2, [str(large).encode(), b"junk", b"12"])
    assert all(o._overlap.bucket_elems == large for o in opts) and plans[0][AGREE_AT:] == [1, 1]
    assert all(r[-1]["auto"]["bucket_mb"] == 25.0 for r in replies)
    import torch

    state = torch.load(__import__("io").BytesIO(snap), weights_only=True)
    assert state["auto_buckets"] == large  # a joiner takes the agreed plan with the state


def test_a_joiner_takes_the_swarms_buckets(tmp_path) -> None:
    import io

    import torch

    from peerd.torch import Optimizer

    from .support.trainer_harness import thread_daemon

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(1000, 500), torch.nn.Linear(500, 1000))

    with thread_daemon(tmp_path, group_size=1, wait_s=0.2) as d:
        donor_m, joiner_m = model(), model()
        donor = Optimizer(torch.optim.SGD(donor_m.parameters(), lr=0.01), run="j", socket=d.path, sync_state=False,
                          state_every=0, overlap=True, model=donor_m)
        trial = donor._bucket_trial
        assert trial is not None
        trial.take(trial.small)
        donor._overlap.replan(trial.small)
        blob = donor.snapshot()
        joiner = Optimizer(torch.optim.SGD(joiner_m.parameters(), lr=0.01), run="j", socket=d.path,
                           sync_state=False, state_every=0, overlap=True, model=joiner_m)
        joiner.load_snapshot(blob)
        assert joiner._overlap.bucket_elems == trial.small and len(joiner._overlap.schedule.buckets) == 2
        assert "the swarm's choice" in joiner._bucket_trial.reason
        state = torch.load(io.BytesIO(blob), weights_only=True)
        state["auto_buckets"] = trial.small + 7  # a donor's claim that is no candidate of this model: ignored
        buf = io.BytesIO()
        torch.save(state, buf)
        other_m = model()
        other = Optimizer(torch.optim.SGD(other_m.parameters(), lr=0.01), run="j", socket=d.path,
                          sync_state=False, state_every=0, overlap=True, model=other_m)
        other.load_snapshot(buf.getvalue())
        assert other._overlap.bucket_elems == trial.large and other._bucket_trial.agreed is None
        for o in (donor, joiner, other):
            o.close()


def test_bucket_mb_is_checked() -> None:
    import torch

    from peerd.torch import Optimizer

    m = torch.nn.Linear(4, 4)
    for bad in ("big", 0, -1.0, 2000, True, float("nan")):
        with pytest.raises(ValueError, match="bucket_mb"):
            Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="x", socket="/nonexistent", overlap=True,
                      model=m, bucket_mb=bad)
