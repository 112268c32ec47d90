"""Nodes with NAT traversal over an in-memory network that models NAT kinds."""

from __future__ import annotations

import random

import trio
import trio.testing

from peerd.dht import DhtService
from peerd.metrics import Metrics
from peerd.nat.service import NatService
from peerd.tools.sim.net import NatBox
from peerd.transport import Endpoint
from peerd.wire.identity import Identity

from .memnet import MemNet, run_all

SECRET = bytes(range(32))


KINDS = {"p1": None, "p2": None, "c1": "cone", "c2": "cone", "s1": "symmetric", "s2": "symmetric"}


class NatMemNet(MemNet):
    """MemNet with NAT boxes: a datagram from a node behind a box leaves from its mapped address, and one to a
    box's public address reaches the node behind it only through the box's filter."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.nat_of: dict[tuple[str, int], NatBox] = {}
        self.boxes: dict[str, NatBox] = {}
        self.blocked: set[tuple[tuple[str, int], tuple[str, int]]] = set()  # (src, dst) pairs that never arrive

    def add_nat(self, host: str, kind: str, inside: tuple[str, int]) -> NatBox:
        box = self.boxes[host] = NatBox(host, kind)
        self.nat_of[inside] = box
        return box

    def deliver(self, src, dst, data) -> None:
        if (src, dst) in self.blocked:
            return
        box = self.nat_of.get(src)
        if box is not None:
            src = box.outbound(src, dst, trio.current_time())
        super().deliver(src, dst, data)

    async def _arrive(self, delay, src, dst, data) -> None:
        await trio.sleep(delay)
        box = self.boxes.get(dst[0])
        if box is not None:
            inner = box.inbound(dst[1], src, trio.current_time())
            if inner is None:
                return
            dst = inner
        sock = self.sockets.get(dst)
        if sock is not None:
            sock.inbox_send.send_nowait((data, src))


class NatNode:
    def __init__(self, net: NatMemNet, name: str, index: int) -> None:
        self.name = name
        kind = KINDS[name]
        if kind is None:
            self.addr = (f"203.0.113.{index + 1}", 7000)
        else:
            self.addr = (f"10.0.{index}.2", 7000)
            net.add_nat(f"203.0.113.{100 + index}", kind, self.addr)
        self.sock = net.socket(*self.addr)
        self.metrics = Metrics()
        self.identity = Identity.from_seed(bytes([index + 1]) * 32)
        self.endpoint = Endpoint(self.sock, self.identity, SECRET, self.metrics, rng=random.Random(index + 1))
        self.dht = DhtService(self.endpoint, self.metrics, rng=random.Random(index), refresh_interval=30.0)
        self.nat = NatService(self.endpoint, self.metrics, rng=random.Random(50 + index))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await run_all(self.endpoint.serve, self.dht.run, self.nat.run, task_status=task_status)
