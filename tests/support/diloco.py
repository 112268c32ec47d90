"""DiLoCo trainers against in-process daemons: models, batches, and swarms of them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from peerd.torch.diloco import due_fragments, fragment_bounds  # noqa: E402
from peerd.trainer.records import shard_bounds  # noqa: E402

from .torch_models import flat, model  # noqa: E402


def batch(i: int, s: int):
    g = torch.Generator().manual_seed(1000 * i + s)
    n = 4 * (i + 1)  # members take different sample counts: the average is weighted
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)


def replay(members: int, steps: int, sync_every: int, fragments: int, lr: float = 0.1) -> tuple[torch.Tensor, ...]:
    """DiLoCo computed centrally: every member SGD-steps from the shared global parameters on its batches;
    at each fragment's sync, the sample-weighted mean of (global - local) drives Nesterov SGD."""
    ref = [model(0) for _ in range(members)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in ref]
    numels = [p.numel() for p in ref[0].parameters()]
    bounds = fragment_bounds(numels, fragments)
    glob = flat(ref[0].parameters()).clone()
    mom = torch.zeros_like(glob)
    since = [[0.0] * fragments for _ in range(members)]
    for s in range(1, steps + 1):
        for i, (m, o) in enumerate(zip(ref, opts, strict=True)):
            x, y = batch(i, s)
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            for f in range(fragments):
                since[i][f] += len(x)
        for f in due_fragments(s, sync_every, fragments):
            a, b = bounds[f]
            deltas = [glob[a:b] - flat(m.parameters())[a:b] for m in ref]
            w = [since[i][f] for i in range(members)]
            avg = sum(d * wi for d, wi in zip(deltas, w, strict=True)) / sum(w)
            mom[a:b] = 0.9 * mom[a:b] + avg
            glob[a:b] = glob[a:b] - 0.7 * (avg + 0.9 * mom[a:b])
            for i, m in enumerate(ref):
                since[i][f] = 0.0
                off = 0
                with torch.no_grad():
                    for p in m.parameters():
                        lo, hi = max(a, off), min(b, off + p.numel())
                        if lo < hi:
                            p.view(-1)[lo - off: hi - off] = glob[lo:hi]
                        off += p.numel()
    return glob, mom


async def _swarm(nursery, net, count):
    from peerd.statesync import StateSync

    from .dht_swarm import start_swarm

    nodes = await start_swarm(nursery, net, count)
    for n in nodes:
        n.sync = StateSync(n.endpoint, n.dht, n.metrics, advertise=n.addr)
    return nodes


def _lossy_copies(truth: np.ndarray, n: int, rng: np.random.Generator, per: int = 290) -> list[np.ndarray]:
    """What each of n group members holds after an all-gather that lost datagrams: member i has the truth in
    its own shard, and in others' shards some ranges of ``per`` elements keep its own (different) values."""
    out = []
    for i in range(n):
        v = truth.copy()
        for j in range(n):
            if j == i:
                continue
            a, b = shard_bounds(truth.size, n, j)
            for off in range(a, b, per):
                if rng.random() < 0.3:
                    v[off: min(b, off + per)] = rng.standard_normal(min(b, off + per) - off)
        out.append(v)
    return out
