"""peerd.torch.Optimizer as scripts use a torch optimizer (schedulers, GradScaler, clipping, a final average),
its step reports (phases), and the first-lines rule it enforces (founders start alike, whatever the seeding)."""

from __future__ import annotations

import math
import threading
import time
import warnings

import pytest

torch = pytest.importorskip("torch")

from peerd.localsock.phases import PHASES, parse_phases  # noqa: E402
from peerd.torch import DiLoCo, Optimizer  # noqa: E402
from peerd.torch.founders import SAME_STEPS, SameData  # noqa: E402
from peerd.torch.report import StepReport  # noqa: E402

from .support.torch_models import flat, model  # noqa: E402
from .support.trainer_harness import InProcessAverager, MemoryStateSync, ThreadDaemon, thread_daemon  # noqa: E402

torch.set_num_threads(1)


def loss_of(m: torch.nn.Module, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    return torch.nn.functional.cross_entropy(m(x), y) * scale


@pytest.fixture
def alone(tmp_path):
    """A daemon whose rounds hold one member: every average hands back the trainer's own vector."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.01))
    yield d
    d.stop()


def wrapped(m: torch.nn.Module, daemon, opt: torch.optim.Optimizer | None = None, **kw) -> Optimizer:
    kw = {"run": "api", "socket": daemon.path, "sync_state": False, "state_every": 0, "average_params_every": 0,
          **kw}
    return Optimizer(opt or torch.optim.SGD(m.parameters(), lr=0.1), **kw)


def test_a_torch_lr_scheduler_drives_the_wrapped_optimizer(alone) -> None:
    m = model()
    opt = wrapped(m, alone)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for s in range(4):
            opt.zero_grad()
            loss_of(m, s).backward()
            opt.step(samples=8)
            sched.step()
            lrs.append(opt.opt.param_groups[0]["lr"])
    expected = [0.05 * (1 + math.cos(math.pi * (s + 1) / 4)) for s in range(4)]
    assert lrs == pytest.approx(expected)
    assert opt.param_groups is opt.opt.param_groups and opt.state is opt.opt.state
    with pytest.raises(NotImplementedError, match="before wrapping"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    opt.close()


def test_grad_scaler_and_clipping_step_as_in_plain_pytorch(alone) -> None:
    """Alone in its group, a wrapped optimizer under GradScaler and clip_grad_norm_ moves the model exactly as
    the plain optimizer does, and an overflowing step is skipped by the scaler without reaching the daemon."""
    mine, ref = model(1), model(1)
    opt = wrapped(mine, alone)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)]
    for s in range(3):
        for m, o, sc in ((mine, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            o.zero_grad()
            sc.scale(loss_of(m, s, scale=50.0)).backward()
            sc.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            sc.step(o, **({"samples": 8} if o is opt else {}))
            sc.update()
    assert torch.equal(flat(mine), flat(ref))
    assert opt.step_count == 3
    calls = len(alone.averager.calls)
    opt.zero_grad()
    scalers[0].scale(loss_of(mine, 9, scale=float("inf"))).backward()  # overflows: the scaler skips the step
    before = flat(mine)
    scalers[0].step(opt, samples=8)
    scalers[0].update()
    assert torch.equal(flat(mine), before) and opt.step_count == 3 and len(alone.averager.calls) == calls
    assert scalers[0].get_scale() < 1024.0
    opt.close()


def test_finish_leaves_every_replica_with_the_swarms_parameters(tmp_path) -> None:
    with thread_daemon(tmp_path, group_size=2, wait_s=5.0) as daemon:
        models = [model(0), model(7)]
        opts = [wrapped(m, daemon) for m in models]
        mean = (flat(models[0]) + flat(models[1])) / 2
        replies: list = [None, None]
        threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, opts[i].finish())) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r["outcome"] == "averaged" for r in replies)
        assert torch.equal(flat(models[0]), flat(models[1]))
        torch.testing.assert_close(flat(models[0]), mean)
        with pytest.raises(ValueError, match="rounds"):
            opts[0].finish(rounds=0)
        for o in opts:
            o.close()


def test_finish_waits_for_a_trainer_that_ends_training_after_a_steps_window(tmp_path) -> None:
    """A step's round waits its (tuned) window, 0.5 s here; one trainer reaches the end 2 s after the other (its
    last evaluation ran long). A plain parameter average leaves the first one alone; finish() waits for it."""
    with thread_daemon(tmp_path, group_size=2, wait_s=0.5) as daemon:
        models = [model(0), model(7)]
        opts = [wrapped(m, daemon) for m in models]

        def late_pair(call) -> list:
            replies: list = [None, None]

            def one(i: int) -> None:
                if i == 1:
                    time.sleep(2.0)
                replies[i] = call(opts[i])
            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            return replies

        assert [r["outcome"] for r in late_pair(lambda o: o.average_parameters())] == ["alone", "alone"]
        assert not torch.equal(flat(models[0]), flat(models[1]))
        mean = (flat(models[0]) + flat(models[1])) / 2
        t0 = time.monotonic()
        assert [r["outcome"] for r in late_pair(lambda o: o.finish())] == ["averaged", "averaged"]
        assert time.monotonic() - t0 < 5.0  # the average began as the late one came, not at the wait's end
        torch.testing.assert_close(flat(models[0]), mean)
        assert torch.equal(flat(models[0]), flat(models[1]))
        with pytest.raises(ValueError, match="wait_s"):
            opts[0].finish(wait_s=0.0)
        for o in opts:
            o.close()


def test_clip_grad_norm_clips_the_average_as_ddp_does(tmp_path) -> None:
    """Two replicas whose gradients are long but point apart: each one clipped alone (clip_grad_norm_ before
    step()) would give a short average; clip_grad_norm= clips the average, which is what DDP's clip sees."""
    with thread_daemon(tmp_path, group_size=2, wait_s=5.0) as daemon:
        models = [model(3), model(3)]
        ref = model(3)
        opts = [wrapped(m, daemon, clip_grad_norm=0.5) for m in models]
        losses = [loss_of(models[0], 1, scale=40.0), loss_of(models[1], 2, scale=40.0)]
        for loss in losses:
            loss.backward()
        grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in models]
        assert min(float(g.norm()) for g in grads) > 2.0  # each replica's own gradient is well past the bound
        mean = (grads[0] + grads[1]) / 2
        threads = [threading.Thread(target=lambda i=i: opts[i].step(samples=8)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # DDP: the mean gradient, clipped to 0.5, one SGD step of 0.1
        expected = flat(ref) - 0.1 * mean * min(1.0, 0.5 / (float(mean.norm()) + 1e-6))
        for m in models:
            torch.testing.assert_close(flat(m), expected)
        for o in opts:
            assert o.last_step is not None and o.last_step.outcome == "averaged"
            assert o.last_step.complete  # the harness averages exactly: every range arrived
            o.close()
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="clip_grad_norm"):
            Optimizer(torch.optim.SGD(model().parameters(), lr=0.1), run="api", clip_grad_norm=bad)
    with pytest.raises(ValueError, match="not with overlap"):
        m = model()
        Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="api", clip_grad_norm=1.0, overlap=True, model=m)


def test_every_step_reports_its_phases_to_the_trainer_the_daemon_and_its_metrics(alone) -> None:
    m = model()
    opt = wrapped(m, alone)
    for s in range(3):
        opt.zero_grad()
        loss_of(m, s).backward()
        reply = opt.step(samples=8)
        report = opt.last_step
        assert isinstance(report, StepReport) and report.step == s + 1 and report.outcome == "alone"
        assert set(report.phases) == set(PHASES) and all(v >= 0 for v in report.phases.values())
        assert report.phases["copy_in"] > 0 and report.phases["daemon"] > 0
        assert sum(report.phases.values()) <= report.seconds + 1e-3
        assert reply["phases"] == report.phases
    # each step's phases reached the daemon with the next request: its histogram and its status
    counts = {s.labels["phase"]: s.value for metric in alone.metrics.step_phase_seconds.collect()
              for s in metric.samples if s.name.endswith("_count")}
    assert counts == dict.fromkeys(PHASES, 2.0)
    (status,) = alone.service.statistics().sessions
    assert status.steps == 3 and set(status.phases) == set(PHASES)
    opt.close()


def test_reported_phases_are_checked_before_they_count_hostile() -> None:
    assert parse_phases({"transfer": 0.5, "copy_in": 0}) == {"transfer": 0.5, "copy_in": 0.0}
    for bad in ({"transfer": float("nan")}, {"transfer": -1.0}, {"transfer": 1e12}, {"nope": 1.0},
                {"transfer": True}, {"transfer": "1"}, [("transfer", 1.0)], dict.fromkeys(range(20), 1.0)):
        assert parse_phases(bad) is None


def test_a_group_that_averages_the_same_numbers_everywhere_is_told_why() -> None:
    same = SameData("fp32")
    own = [torch.ones(3), torch.full((2,), 2.0)]
    result = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
    warned = [same.check(result, own, [3, 2], {"group_size": 4}, s) for s in range(SAME_STEPS)]
    assert warned == [False] * (SAME_STEPS - 1) + [True]
    assert "same data in the same order" in same.warned and "seed" in same.warned
    other = SameData("fp32")
    for s in range(10):  # members that drew different batches: never
        assert not other.check(result * (1.5 + s), own, [3, 2], {"group_size": 4}, s)


class PeerProcess:
    """Emulates a peer's own process for the global random generator: every peer's script code runs under one
    lock with its own torch RNG state swapped in (threads share torch's generator; processes do not)."""

    lock = threading.Lock()

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None

    def __enter__(self) -> PeerProcess:
        self.lock.acquire()
        if self.state is not None:
            torch.set_rng_state(self.state)
        return self

    def __exit__(self, *exc: object) -> None:
        self.state = torch.get_rng_state()
        self.lock.release()


TEACHER = torch.linspace(-1.0, 1.0, 16).reshape(16, 1)


def user_script(daemon, run: str, convention: str, rank: int, mode: str, steps: int) -> dict:
    """A user's training script as one peer runs it: seeded by ``convention`` ("same": every peer alike, the
    single-process habit; "per_peer": each its own, the DDP habit; "right": the model alike, the data per peer),
    batches drawn from the global generator, the optimizer wrapped in peerd.torch (sync or DiLoCo)."""
    me = PeerProcess()
    with me:
        torch.manual_seed(rank if convention == "per_peer" else 0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        inner = torch.optim.SGD(net.parameters(), lr=0.05)
        common = {"run": run, "socket": daemon.path, "founder_window_s": 0.3, "timeout_s": 10.0}
        if mode == "diloco":
            opt = DiLoCo(net, inner, sync_every=5, state_every=0, **common)
        else:
            opt = Optimizer(inner, average_params_every=5, state_every=0, **common)
        if convention == "right":
            torch.manual_seed(100 + rank)
        start = flat(net)
    first = None
    for _ in range(steps):
        with me:
            x = torch.randn(32, 16)
            y = x @ TEACHER + 0.1 * torch.randn(32, 1)
            first = x if first is None else first
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step(samples=32)
    xv = torch.randn(256, 16, generator=torch.Generator().manual_seed(12345))
    with torch.no_grad():
        val = float(torch.nn.functional.mse_loss(net(xv), xv @ TEACHER))
    report = opt.last_step
    opt.close()
    return {"start": start, "first": first, "val": val, "phases": report.phases if report else None}


def test_founders_that_start_at_once_agree_on_one_initial_state(tmp_path) -> None:
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=5.0),
                          statesync=MemoryStateSync())
    try:
        models = [model(0), model(1)]
        assert not torch.equal(flat(models[0]), flat(models[1]))
        opts: list = [None, None]

        def found(i: int) -> None:
            opts[i] = Optimizer(torch.optim.SGD(models[i].parameters(), lr=0.1), run="f", socket=daemon.path,
                                founder_window_s=0.5, state_every=0)

        threads = [threading.Thread(target=found, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert torch.equal(flat(models[0]), flat(models[1]))
        took = sorted(bool(o.founder and o.founder["took_other"]) or o.synced_from is not None for o in opts)
        assert took == [False, True]  # one kept its own, the other took it
        assert opts[0].seed != opts[1].seed  # and each draws its own batches from here on
        for o in opts:
            o.close()
    finally:
        daemon.stop()


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_either_seeding_convention_trains_as_well_as_the_right_one(tmp_path, mode) -> None:
    """Peers seeded alike or each its own start from one state, draw different batches, and reach the loss
    the right convention (model alike, data per peer) reaches."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=5.0),
                          statesync=MemoryStateSync())
    try:
        results: dict[str, list] = {}
        for conv in ("right", "same", "per_peer"):
            peers: list = [None, None]

            def peer(rank: int, conv: str = conv, peers: list = peers) -> None:
                peers[rank] = user_script(daemon, f"{mode}-{conv}", conv, rank, mode, 30)

            threads = [threading.Thread(target=peer, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            results[conv] = peers
        for conv, peers in results.items():
            assert torch.equal(peers[0]["start"], peers[1]["start"]), f"{conv}: peers started from different weights"
            assert not torch.equal(peers[0]["first"], peers[1]["first"]), f"{conv}: both peers drew the same batches"
            assert set(peers[0]["phases"]) == set(PHASES)
        right = max(p["val"] for p in results["right"])
        assert right < 0.5  # it trains (the teacher's outputs have a variance of about 5.7)
        for conv in ("same", "per_peer"):
            assert max(p["val"] for p in results[conv]) < 1.5 * right + 0.02, (conv, right, results[conv])
    finally:
        daemon.stop()


def test_replicas_that_draw_the_same_batches_get_the_warning_in_their_step_report(tmp_path) -> None:
    with thread_daemon(tmp_path, group_size=2, wait_s=5.0) as daemon:
        models = [model(0), model(0)]
        opts = [wrapped(m, daemon) for m in models]
        warnings_seen: list[list[str]] = [[], []]

        def worker(i: int) -> None:
            for s in range(SAME_STEPS + 1):
                opts[i].zero_grad()
                loss_of(models[i], s).backward()  # the same batch on both replicas
                opts[i].step(samples=8)
                warnings_seen[i].append(opts[i].last_step.warning)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for seen in warnings_seen:
            assert seen[:SAME_STEPS - 1] == [""] * (SAME_STEPS - 1)
            assert "same data in the same order" in seen[SAME_STEPS - 1]
        for o in opts:
            o.close()
