"""Gradient values that reached a member from no one else are left out of its step, not applied alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peerd.torch import Optimizer  # noqa: E402
from peerd.torch.unreceived import MAX_UNRECEIVED_SHARE, drop_unreceived  # noqa: E402

from .support.diloco import model  # noqa: E402
from .support.trainer_harness import InProcessAverager, ThreadDaemon  # noqa: E402

torch.set_num_threads(1)


def test_values_equal_to_the_members_own_are_zeroed_and_the_rest_kept() -> None:
    own = [torch.tensor([1.0, 2.0, 0.0, 4.0]), None, torch.tensor([[5.0, 6.0]])]
    result = torch.tensor([1.0, 9.0, 0.0, 7.0, 3.0, 3.0, 5.0, 8.0])  # [4:6] is a parameter this member did not use
    assert drop_unreceived(result, own, [4, 2, 2]) == 2
    assert result.tolist() == [0.0, 9.0, 0.0, 7.0, 3.0, 3.0, 0.0, 8.0]


def test_a_result_equal_to_the_own_vector_almost_everywhere_is_left_as_it_is() -> None:
    own = [torch.arange(1.0, 11.0)]
    result = own[0].clone()
    result[: int(10 * (1 - MAX_UNRECEIVED_SHARE)) - 1] += 1.0  # the same data everywhere, or averaged alone
    before = result.clone()
    assert drop_unreceived(result, own, [10]) == 0
    assert torch.equal(result, before)


def test_a_length_that_does_not_match_the_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="holds 3 values"):
        drop_unreceived(torch.zeros(3), [torch.ones(4)], [4])


def test_leaving_lost_values_out_keeps_the_error_of_the_groups_average() -> None:
    """4 members' noisy gradients, a tenth of each member's result lost: the member's own value there puts the
    estimate's error well above the loss-free average's; leaving it out keeps it near (beside a shorter step)."""
    rng = np.random.default_rng(0)
    n, size, lost = 4, 200_000, 0.1
    truth = rng.normal(0.0, 0.1, size).astype(np.float32)
    grads = truth + rng.normal(0.0, 1.0, (n, size)).astype(np.float32)
    mean = grads.mean(0)
    errs = {"lossless": [], "own": [], "left_out": []}
    for i in range(n):
        miss = rng.random(size) < lost
        result = torch.from_numpy(np.where(miss, grads[i], mean))
        errs["lossless"].append(float(np.mean((mean - truth) ** 2)))
        errs["own"].append(float(np.mean((result.numpy() - truth) ** 2)))
        drop_unreceived(result, [torch.from_numpy(grads[i])], [size])
        assert int((result.numpy() == 0).sum()) == int(miss.sum())
        errs["left_out"].append(float(np.mean((result.numpy() - truth) ** 2)))
    err = {k: float(np.mean(v)) for k, v in errs.items()}
    assert err["own"] > 1.25 * err["lossless"]
    assert err["left_out"] < 1.06 * err["lossless"]


def test_a_lossy_round_steps_on_the_groups_average_and_nothing_where_it_missed(tmp_path) -> None:
    averager = InProcessAverager(group_size=2, wait_s=5.0)
    averager.own_every = 5  # a fifth of each result holds the member's own values, received_fraction 0.8
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), averager)
    try:
        models = [model(0), model(0)]
        opts = [Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="lossy", socket=daemon.path,
                          sync_state=False, state_every=0, average_params_every=0, compression="fp32")
                for m in models]
        own: list = [None, None]
        applied: list = [None, None]
        replies: list = [None, None]

        def worker(i: int) -> None:
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            opts[i].zero_grad()
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            own[i] = torch.cat([p.grad.reshape(-1) for p in models[i].parameters()]).clone()
            replies[i] = opts[i].step(samples=8)
            applied[i] = torch.cat([p.grad.reshape(-1) for p in models[i].parameters()]).clone()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        mean = (own[0] + own[1]) / 2
        for i in range(2):
            lost = torch.zeros_like(mean, dtype=torch.bool)
            lost[::5] = True
            lost &= own[i] != 0
            assert replies[i]["unreceived"] == int(lost.sum()) > 0
            assert torch.equal(applied[i][lost], torch.zeros(int(lost.sum())))
            kept = ~lost
            kept[::5] = False
            assert torch.allclose(applied[i][kept], mean[kept])
            assert opts[i].unreceived_values == replies[i]["unreceived"]
        for o in opts:
            o.close()
    finally:
        daemon.stop()
