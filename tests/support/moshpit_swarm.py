"""A swarm of nodes running Moshpit (DHT, allreduce) over the in-memory network."""

from __future__ import annotations

import random

import numpy as np
import trio
import trio.testing

from peerd.allreduce.service import AllreduceService
from peerd.dht.service import DhtService
from peerd.metrics import Metrics
from peerd.moshpit.service import MoshpitService, RoundResult
from peerd.transport.endpoint import Endpoint
from peerd.wire.identity import Identity

from .dht_swarm import SECRET
from .memnet import MemNet

BASE = 1_800_000_000.0  # the wall clock at virtual time 0


def clock() -> float:
    return BASE + trio.current_time()


class MoshpitNode:
    """One daemon's services over the in-memory network, all on the virtual wall clock."""

    def __init__(self, net: MemNet, index: int) -> None:
        self.addr = ("127.0.0.1", 21000 + index)
        self.metrics = Metrics()
        self.identity = Identity.from_seed(index.to_bytes(32, "big"))
        self.endpoint = Endpoint(net.socket(*self.addr), self.identity, SECRET, self.metrics)
        self.dht = DhtService(self.endpoint, self.metrics, rng=random.Random(index), refresh_interval=30.0,
                              wall=clock)
        self.allreduce = AllreduceService(self.endpoint, self.metrics)
        self.moshpit = MoshpitService(self.endpoint, self.dht, self.allreduce, self.metrics, address=self.addr,
                                      rng=random.Random(index), clock=clock)
        self.scope = trio.CancelScope()  # the daemon
        self.calls: set[trio.CancelScope] = set()  # its trainer's calls under way
        self.alive = True

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.endpoint.serve)
                await nursery.start(self.dht.run)
                await nursery.start(self.moshpit.run)
                task_status.started()

    def kill(self, net: MemNet) -> None:
        """SIGKILL: nothing reaches it, it sends nothing, its calls end."""
        self.alive = False
        net.partition(self.addr)
        self.scope.cancel()
        for scope in self.calls:
            scope.cancel()


async def swarm(nursery: trio.Nursery, net: MemNet, count: int, first: int = 0, bootstrap: MoshpitNode | None = None
                ) -> list[MoshpitNode]:
    nodes = [MoshpitNode(net, first + i) for i in range(count)]
    for n in nodes:
        await nursery.start(n.run)
    if bootstrap is None:
        bootstrap = nodes[0]
        bootstrap.dht.bootstrapped.set()
    for n in nodes:
        if n is not bootstrap:
            await n.dht.bootstrap([bootstrap.addr], timeout=60)
    return nodes


async def tuned_swarm(nursery: trio.Nursery, net: MemNet, count: int, run: str, **open_kw: object
                      ) -> list[MoshpitNode]:
    """``count`` nodes with self-tuned deadlines (``peerd join --deadlines auto``: a silent member is PINGed), each
    with ``run`` open as ``open_kw`` say."""
    from peerd.deadlines import DeadlineTuner

    nodes = await swarm(nursery, net, count)
    for n in nodes:
        n.moshpit.deadlines = DeadlineTuner()
        await n.moshpit.open(run, **open_kw)
    return nodes


async def lockstep(nodes: list[MoshpitNode], run: str, vectors: list[np.ndarray], *, weights: list[float] | None = None,
                   late: int | None = None, late_s: float = 1.5) -> list[RoundResult | None]:
    """Every node averages one round at the same moment (``late``: that one starts ``late_s`` later).
    A node killed during the round gives None."""
    out: list[RoundResult | None] = [None] * len(nodes)

    async def one(i: int) -> None:
        with trio.CancelScope() as scope:
            nodes[i].calls.add(scope)
            if i == late:
                await trio.sleep(late_s)
            out[i] = await nodes[i].moshpit.average(run, vectors[i], weights[i] if weights else 1.0, timeout_s=30.0)
        nodes[i].calls.discard(scope)

    async with trio.open_nursery() as nursery:
        for i, n in enumerate(nodes):
            if n.alive:
                nursery.start_soon(one, i)
    return out
