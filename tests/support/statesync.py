"""A swarm of DHT nodes with state sync, and a run's names."""

from __future__ import annotations

from peerd.statesync import StateSync

from .dht_swarm import start_swarm

RUN, KEY, LAYOUT = "r", "r/0123456789abcdef", "0123456789abcdef" + "0" * 48


async def swarm_with_sync(nursery, net, count):
    nodes = await start_swarm(nursery, net, count)
    for n in nodes:
        n.sync = StateSync(n.endpoint, n.dht, n.metrics, advertise=n.addr)
    return nodes
