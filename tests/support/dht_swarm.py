"""A swarm of DHT nodes over the in-memory network."""

from __future__ import annotations

import hashlib
import random

import trio
import trio.testing

from peerd.dht import DhtService
from peerd.metrics import Metrics
from peerd.transport import Endpoint
from peerd.wire.identity import Identity

from .memnet import MemNet

SECRET = bytes(range(32))


class DhtNode:
    def __init__(self, net: MemNet, index: int, secret: bytes | None = SECRET, *, replicas: int | None = None) -> None:
        self.addr = ("127.0.0.1", 20000 + index)
        self.sock = net.socket(*self.addr)
        self.metrics = Metrics()
        # Node ids (and so who is close to whom) follow the network's seed, as its losses do: a run repeats.
        self.identity = Identity.from_seed(hashlib.sha256(b"dht node %d %d" % (net.seed, index)).digest())
        self.endpoint = Endpoint(self.sock, self.identity, secret, self.metrics, rng=random.Random(index))
        self.dht = DhtService(self.endpoint, self.metrics, rng=random.Random(index), refresh_interval=30.0,
                              **({} if replicas is None else {"replicas": replicas}))
        self.scope = trio.CancelScope()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.endpoint.serve)
                await nursery.start(self.dht.run)
                task_status.started()

    def kill(self, net: MemNet) -> None:
        net.partition(self.addr)
        self.scope.cancel()


async def start_swarm(nursery: trio.Nursery, net: MemNet, count: int, *, replicas: int | None = None) -> list[DhtNode]:
    """``count`` nodes bootstrapped from the first. Node ids follow the network's seed: which nodes hold a key
    differs per seed, unless ``replicas`` is the swarm's size (every node then holds every key)."""
    nodes = [DhtNode(net, i, replicas=replicas) for i in range(count)]
    for node in nodes:
        await nursery.start(node.run)
    nodes[0].dht.bootstrapped.set()
    for node in nodes[1:]:
        await node.dht.bootstrap([nodes[0].addr], timeout=60)
    return nodes
