"""Overlapped averaging against an in-process daemon (the ``daemon`` fixture): a small model and a pair of
trainers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from peerd.torch import Optimizer  # noqa: E402

from .trainer_harness import in_threads  # noqa: E402


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 2))


def batch(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)




def run_pair(daemon, *, overlap: bool, steps: int, micro: int = 1, run: str = "o", opt_cls=torch.optim.Adam,
             bucket_mb: float = 0.0001, average_every: int = 0, log: list | None = None,
             device: str = "cpu") -> list[torch.nn.Module]:
    """Two replicas (seeds alike, data apart) for ``steps`` steps of ``micro`` micro-batches each."""
    models = [mlp(0).to(device), mlp(0).to(device)]
    kw = {"overlap": True, "model": None, "bucket_mb": bucket_mb} if overlap else {}
    opts = []
    for m in models:
        if overlap:
            kw["model"] = m
        opts.append(Optimizer(opt_cls(m.parameters(), lr=0.01), run=run, socket=daemon.path, sync_state=False,
                              state_every=0, average_params_every=average_every, **kw))

    def worker(i: int) -> None:
        m, opt = models[i], opts[i]
        for s in range(steps):
            opt.zero_grad()
            n = 4 * (i + 1)
            for k in range(micro):
                if overlap and k == micro - 1:
                    opt.last_microbatch(n * micro)
                x, y = batch(1000 * i + 10 * s + k, n)
                torch.nn.functional.cross_entropy(m(x.to(device)), y.to(device), reduction="sum").backward()
            if not overlap:
                for p in m.parameters():
                    p.grad.div_(n * micro)
            reply = opt.step(samples=n * micro)
            if log is not None:
                log.append((i, s, reply))
        opt.flush()

    in_threads(2, worker)
    for o in opts:
        assert o.outcomes.get("averaged", 0) == steps, o.outcomes
        o.close()
    return models
