"""peerd.torch on a CUDA GPU: what moves between the device, the pinned staging buffer and the arena.

These run only where torch sees a GPU (they skip with a reason elsewhere); the CPU suite covers the same
logic on CPU tensors. They check bytes, not only closeness, where the arithmetic allows it: SGD with lr=1 makes
``p - g`` one rounding on both devices, so a replica's update must be exactly the daemon's average."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peerd.torch import DiLoCo, Optimizer  # noqa: E402

from .support.diloco import batch, replay  # noqa: E402
from .support.overlap import mlp as overlap_mlp  # noqa: E402
from .support.overlap import run_pair  # noqa: E402
from .support.torch_models import flat  # noqa: E402
from .support.torch_models import model as diloco_model  # noqa: E402
from .support.trainer_harness import InProcessAverager, ThreadDaemon, thread_daemon  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def big_model(seed: int) -> torch.nn.Module:
    """A few million parameters in tensors of odd sizes: staging copies at real DMA sizes, offsets not aligned."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(517, 1999), torch.nn.Tanh(), torch.nn.Linear(1999, 1001),
                               torch.nn.Tanh(), torch.nn.Linear(1001, 3))


def run_threads(fns) -> None:
    errors: list[BaseException] = []

    def wrap(fn) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


@pytest.fixture
def daemon(tmp_path):
    with thread_daemon(tmp_path, group_size=2, wait_s=30.0) as d:
        yield d


@pytest.mark.parametrize("devices", [("cuda", "cuda"), ("cuda", "cpu")])
def test_the_update_is_the_daemons_average_to_the_bit(daemon, devices) -> None:
    """Two replicas (both on the GPU, or one on each side) of a 3-million-parameter model: after each step
    both hold exactly ``p - mean(g)`` where mean is the harness's float64 weighted mean of the gradients as
    the GPU computed them, so nothing is lost or misplaced between device, pinned buffer and arena."""
    models = [big_model(0).to(dev) for dev in devices]
    opts = [Optimizer(torch.optim.SGD(m.parameters(), lr=1.0), run="big", socket=daemon.path, sync_state=False,
                      average_params_every=0, state_every=0) for m in models]
    assert opts[0]._staging is not None and opts[0]._staging.is_pinned()
    assert (opts[1]._staging is not None) == (devices[1] == "cuda")
    weights = [3.0, 5.0]
    for s in range(3):
        grads: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
        before = [flat(m.parameters()) for m in models]

        def step(i: int, s: int = s, grads: list = grads) -> None:
            g = torch.Generator().manual_seed(10 * s + i)
            x = torch.randn(16, 517, generator=g).to(devices[i])
            y = torch.randint(0, 3, (16,), generator=g).to(devices[i])
            opts[i].zero_grad()
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            grads[i] = flat(p.grad for p in models[i].parameters())
            r = opts[i].step(samples=weights[i])
            assert r["outcome"] == "averaged", r

        run_threads([lambda i=i: step(i) for i in range(2)])
        w = np.array(weights)
        mean = ((w[:, None] * np.stack([g.double().numpy() for g in grads])).sum(0) / w.sum()).astype(np.float32)
        for i in range(2):
            assert torch.equal(flat(models[i].parameters()), before[i] - torch.from_numpy(mean)), (s, i)
            assert torch.equal(flat(p.grad for p in models[i].parameters()), torch.from_numpy(mean))
    for o in opts:
        o.close()


def test_parameter_averages_and_snapshots_move_between_devices(daemon) -> None:
    """Adam on the GPU: a snapshot loads into a CPU replica and back (parameters and optimizer state equal),
    and an average of parameters leaves GPU and CPU replicas with the same bytes."""
    daemon.averager.wait_s = 0.2
    g, c = big_model(1).cuda(), big_model(2)
    og = Optimizer(torch.optim.Adam(g.parameters(), lr=1e-3), run="snap", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    oc = Optimizer(torch.optim.Adam(c.parameters(), lr=1e-3), run="snap", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    x, y = torch.randn(8, 517).cuda(), torch.randint(0, 3, (8,)).cuda()
    for _ in range(2):
        og.zero_grad()
        torch.nn.functional.cross_entropy(g(x), y).backward()
        assert og.step(samples=8)["outcome"] == "alone"
    assert oc.load_snapshot(og.snapshot()) == 2
    assert torch.equal(flat(g.parameters()), flat(c.parameters()))
    sg, sc = og.state_dict()["state"], oc.state_dict()["state"]
    assert all(torch.equal(sg[k]["exp_avg_sq"].cpu(), sc[k]["exp_avg_sq"]) for k in sg)
    assert all(sc[k]["exp_avg"].device.type == "cpu" for k in sc)
    # and back: the CPU replica's snapshot onto the GPU one (state lands on the parameters' device)
    c2 = big_model(3).cuda()
    o2 = Optimizer(torch.optim.Adam(c2.parameters(), lr=1e-3), run="snap", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    assert o2.load_snapshot(oc.snapshot()) == 2
    assert torch.equal(flat(c2.parameters()), flat(c.parameters()))
    assert all(v["exp_avg"].is_cuda for v in o2.state_dict()["state"].values())
    # a parameter average between the GPU replica and a CPU replica that drifted
    with torch.no_grad():
        for p in c.parameters():
            p.add_(0.5)
    daemon.averager.wait_s = 30.0
    want = ((flat(g.parameters()).double() + flat(c.parameters()).double()) / 2).float()
    replies: list[dict] = []
    run_threads([lambda: replies.append(og.average_parameters(round_no=1)),
                 lambda: replies.append(oc.average_parameters(round_no=1))])
    assert [r["outcome"] for r in replies] == ["averaged", "averaged"]
    assert torch.equal(flat(g.parameters()), want) and torch.equal(flat(c.parameters()), want)
    for o in (og, oc, o2):
        o.close()


def test_non_finite_gradients_on_the_gpu_skip_the_step(daemon) -> None:
    m = big_model(4).cuda()
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="nan", socket=daemon.path, sync_state=False,
                    state_every=0)
    before = flat(m.parameters())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(torch.randn(4, 517).cuda()), torch.tensor([0, 1, 2, 0]).cuda()).backward()
    next(m.parameters()).grad[0, 0] = float("nan")
    r = opt.step(samples=4)
    assert r["outcome"] == "nonfinite" and opt.step_count == 0
    assert torch.equal(flat(m.parameters()), before)
    assert daemon.averager.calls == []  # the daemon was never asked
    opt.close()


def test_overlap_on_the_gpu_gives_the_parameters_of_synchronous_steps(daemon) -> None:
    """DeAR on the GPU: buckets leave from the gradient hooks (scaled on the device for DropCompute's sum of
    micro-batches), updates are applied in the forward pre-hooks with the averaged gradient moved back. Same
    seeds: the same parameters as synchronous steps on the GPU and as overlap on the CPU (float round-off)."""
    daemon.averager.wait_s = 1.0
    sync = run_pair(daemon, overlap=False, steps=4, micro=2, run="gs", average_every=2, device="cuda")
    over = run_pair(daemon, overlap=True, steps=4, micro=2, run="gv", average_every=2, device="cuda")
    cpu = run_pair(daemon, overlap=True, steps=4, micro=2, run="cv", average_every=2)
    assert all(p.is_cuda for m in over for p in m.parameters())
    assert torch.equal(flat(over[0].parameters()), flat(over[1].parameters()))
    torch.testing.assert_close(flat(over[0].parameters()), flat(sync[0].parameters()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat(over[0].parameters()), flat(cpu[0].parameters()), rtol=1e-4, atol=1e-5)
    assert not torch.equal(flat(over[0].parameters()), flat(overlap_mlp(0).parameters()))  # it trained


def test_diloco_on_the_gpu_follows_the_replay(tmp_path) -> None:
    """Three DiLoCo trainers with their models on the GPU (outer state on the host) against DiLoCo replayed
    on the CPU: the same global parameters and momentum to float tolerance, identical across members."""
    d = ThreadDaemon(str(tmp_path / "dl.sock"), InProcessAverager(group_size=3, wait_s=30.0))
    try:
        models = [diloco_model(0).cuda() for _ in range(3)]
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dlg", socket=d.path, sync_every=4,
                       fragments=2, sync_state=False, state_every=0) for m in models]

        def train(i: int) -> None:
            for s in range(1, 9):
                x, y = batch(i, s)
                opts[i].zero_grad()
                torch.nn.functional.cross_entropy(models[i](x.cuda()), y.cuda()).backward()
                opts[i].step(samples=len(x))

        run_threads([lambda i=i: train(i) for i in range(3)])
        glob, mom = replay(3, 8, 4, 2)
        assert len({o.state_sha() for o in opts}) == 1
        for o, m in zip(opts, models, strict=True):
            assert o.outer_steps == 4 and o.global_params.device.type == "cpu"
            torch.testing.assert_close(o.global_params, glob, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(o.momentum, mom, rtol=1e-4, atol=1e-5)
            a, b = o.bounds[0]
            assert torch.equal(flat(m.parameters())[a:b], o.global_params[a:b])
            assert all(p.is_cuda for p in m.parameters())
        # a snapshot of the GPU trainer's outer state restores the outer state and the model
        j = diloco_model(9).cuda()
        oj = DiLoCo(j, torch.optim.SGD(j.parameters(), lr=0.1), run="dlg", socket=d.path, sync_every=4,
                    fragments=2, sync_state=False, state_every=0)
        assert oj.load_snapshot(opts[0].snapshot()) == 8
        assert oj.state_sha() == opts[0].state_sha()
        assert torch.equal(flat(j.parameters()), oj.global_params)
        for o in (*opts, oj):
            o.close()
    finally:
        d.stop()
