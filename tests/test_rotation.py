"""Token rotation (issue 12, PROTOCOL.md 4.2): a sender that crosses its sealer's datagram limit (set low here)
moves to a fresh token, bound by a signed control message before it carries data, and keeps averaging: no
failed round, no datagram of the old token refused."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from peerd.allreduce.options import AverageOptions
from peerd.allreduce.service import AllreduceService, Member
from peerd.metrics import Metrics
from peerd.transport import Endpoint
from peerd.wire.identity import Identity
from peerd.wire.seal import Opener, Sealer

from .support.memnet import MemNet
from .support.virtual import counter_value  # noqa: E402

SECRET = bytes(range(32))




def test_sealer_counts_what_it_sealed() -> None:
    sealer = Sealer(SECRET)
    sealer.seal(0x01, b"")
    sealer.seal_block(0x40, np.zeros((5, 8), np.uint8), bytes(32))
    assert sealer.sent == 6


def test_rounds_across_several_rotations_stay_exact() -> None:
    n, size, rounds, limit = 3, 20_000, 6, 120  # one round: about 60 datagrams per sender
    rng = np.random.default_rng(3)
    tokens: list[set[int]] = [set() for _ in range(n)]
    outcomes: list[list] = []

    async def main() -> None:
        net = MemNet(seed=1, jitter=0.002)  # reordering: old-token datagrams arrive after new-token ones
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            idents = [Identity.generate() for _ in range(n)]
            addrs = [("127.0.0.1", 31000 + i) for i in range(n)]
            metrics = [Metrics() for _ in range(n)]
            eps = [Endpoint(net.socket(*addrs[i]), idents[i], SECRET, metrics[i], rotate_after=limit)
                   for i in range(n)]
            services = [AllreduceService(eps[i], metrics[i]) for i in range(n)]
            for ep in eps:
                nursery.start_soon(ep.serve)
            members = [Member(idents[i].public_key, idents[i].node_id, addrs[i]) for i in range(n)]
            for r in range(rounds):
                vectors = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
                weights = [float(w) for w in rng.integers(1, 50, n)]
                results: dict[int, object] = {}

                async def one(i: int, r: int = r, vectors: list = vectors, weights: list = weights,
                              results: dict = results) -> None:
                    results[i] = await services[i].average(100 + r, members, i, vectors[i], weights[i],
                                                          AverageOptions(floor_s=0.5))

                async with trio.open_nursery() as group:
                    for i in range(n):
                        group.start_soon(one, i)
                exact = sum(w * v.astype(np.float64) for v, w in zip(vectors, weights, strict=True)) / sum(weights)
                outcomes.append([(results[i], exact) for i in range(n)])
                for i in range(n):
                    tokens[i].add(eps[i].sealer.token)
            for i in range(n):
                assert eps[i].rotations >= 2, eps[i].rotations
                for reason in ("auth", "replay", "unbound", "identity", "auth_limited"):
                    assert counter_value(metrics[i].datagrams_dropped, reason=reason) == 0, reason
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for round_results in outcomes:
        for result, exact in round_results:
            np.testing.assert_allclose(result.vector, exact, atol=1e-5)
            assert result.stats.reduce_scatter.ended_by == "completion"
            assert result.stats.all_gather.ended_by == "completion"
    assert all(len(t) >= 3 for t in tokens), [len(t) for t in tokens]


def test_rotate_after_is_bounded() -> None:
    with pytest.raises(ValueError):
        Endpoint(MemNet().socket("127.0.0.1", 1), Identity.generate(), SECRET, Metrics(), rotate_after=1)


def test_the_old_token_still_opens_after_the_new_one_is_bound() -> None:
    me = bytes(32)
    opener = Opener(SECRET, me)
    old, new = Sealer(SECRET), Sealer(SECRET)
    late = old.seal(0x40, b"in flight", me)
    opener.open(new.seal(0x01, b""))
    assert opener.open(late)[1] == b"in flight"
