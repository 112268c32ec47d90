"""NAT traversal in the daemon's services (endpoint + DHT + NatService) over an in-memory network with NAT boxes
(peerd/sim/net.py's NatBox) under trio's virtual clock: verdicts, peers_known, punched and relayed paths."""

from __future__ import annotations

import random

import trio
import trio.testing

from peerd.dht import DhtService
from peerd.metrics import Metrics
from peerd.nat.service import NatService
from peerd.sim.net import NatBox
from peerd.transport import Endpoint
from peerd.transport.endpoint import RpcError
from peerd.wire import messages as m
from peerd.wire.identity import Identity

from .memnet import MemNet

SECRET = bytes(range(32))
KINDS = {"p1": None, "p2": None, "c1": "cone", "c2": "cone", "s1": "symmetric", "s2": "symmetric"}
EXPECT = {"p1": "public", "p2": "public", "c1": "cone-nat", "c2": "cone-nat", "s1": "symmetric-nat",
          "s2": "symmetric-nat"}


class NatMemNet(MemNet):
    """MemNet with NAT boxes: a datagram from a node behind a box leaves from its mapped address, and one to a
    box's public address reaches the node behind it only through the box's filter."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.nat_of: dict[tuple[str, int], NatBox] = {}
        self.boxes: dict[str, NatBox] = {}

    def add_nat(self, host: str, kind: str, inside: tuple[str, int]) -> NatBox:
        box = self.boxes[host] = NatBox(host, kind)
        self.nat_of[inside] = box
        return box

    def deliver(self, src, dst, data) -> None:
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


class Node:
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
        async with trio.open_nursery() as nursery:
            await nursery.start(self.endpoint.serve)
            await nursery.start(self.dht.run)
            await nursery.start(self.nat.run)
            task_status.started()


def test_six_nodes_behind_nats_verdicts_and_paths() -> None:
    async def main() -> None:
        net = NatMemNet(seed=7, latency=0.005)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = {name: Node(net, name, i) for i, name in enumerate(KINDS)}
            for node in nodes.values():
                await nursery.start(node.run)
            p1 = nodes["p1"]
            p1.dht.bootstrapped.set()
            for node in list(nodes.values())[1:]:
                await node.dht.bootstrap([p1.addr], timeout=30)
            await trio.sleep(5)
            for node in nodes.values():
                node.nat.start()
            await trio.sleep(40)
            got = {name: node.nat.verdict for name, node in nodes.items()}
            assert got == EXPECT

            # every node reaches every other one: direct, punched through p1, or relayed by p1
            by_id = {node.identity.node_id: node for node in nodes.values()}
            for a in nodes.values():
                await a.dht.find_nodes(a.identity.node_id)  # NODES from p1 name the others (introducer: p1)
            for a in nodes.values():
                for b in nodes.values():
                    if a is b:
                        continue
                    bid = b.identity.node_id
                    # where a knows b: where b answered a, else where its DHT saw b, else where p1 reached b
                    addr = (a.nat.reached.get(bid)
                            or next((c.addr for c in a.dht.core.table.contacts() if c.node_id == bid), None)
                            or p1.nat.reached[bid])
                    kind = await a.nat.connect(addr, bid)  # a PING; unanswered: a punch, then a relay
                    for _ in range(3 if kind else 0):
                        try:
                            reply = await a.endpoint.request(addr, m.MsgType.PING, {}, node_id=b.identity.node_id)
                        except RpcError:
                            await trio.sleep(5)
                            continue
                        assert by_id[reply.peer.node_id] is b
                        assert a.nat.path_to(addr, bid) == kind
                        break
                    else:
                        name = {n.identity.node_id: n.name for n in nodes.values()}
                        info = (a.nat.kind.get(bid), name.get(a.nat.introducer.get(bid)),
                                {n.name: dict(n.nat.relay.refused) for n in nodes.values()},
                                a.nat.puncher.failures, [name[n] for n in a.nat.reached], trio.current_time(),
                                a.endpoint.relay_of(addr), bid in a.nat._active)
                        raise AssertionError(f"{a.name} never reached {b.name}: {info}")
            for a in nodes.values():
                known = set(a.nat.peers_known())
                assert known >= {n.identity.node_id for n in nodes.values() if n is not a}, a.name
            relayed = {(a.name, by_id[n].name) for a in nodes.values() for n, k in a.nat.kind.items()
                       if k == "relayed"}
            # symmetric with symmetric, symmetric with cone (either side may have set the relay up)
            pairs = {frozenset(p) for p in relayed}
            want = {frozenset(p) for p in [("s1", "s2"), ("s1", "c1"), ("s1", "c2"), ("s2", "c1"), ("s2", "c2")]}
            assert pairs == want, sorted(relayed)
            assert nodes["p1"].nat.relay.relayed + nodes["p2"].nat.relay.relayed > 0  # only public nodes relay
            assert all(n.nat.relay.relayed == 0 for n in nodes.values() if KINDS[n.name])
            # tensor data of a full MTU goes through the relay too (its RELAY is up to MTU + 240 bytes)
            s1, s2 = nodes["s1"], nodes["s2"]
            got: list[bytes] = []
            s2.endpoint.on_raw(0x40, lambda header, body, state, source: got.append(body))
            addr = next(a for a, e in s1.endpoint._relayed.items() if e[0] == s2.identity.node_id)
            body = bytes(range(256)) * 4 + bytes(1200 - 37 - 1024)
            await s1.endpoint.send_raw(addr, 0x40, [body, body[::-1]], node_id=s2.identity.node_id)
            await trio.sleep(1)
            assert sorted(got) == sorted([body, body[::-1]])  # (equal delays: trio may deliver in either order)
            status = nodes["s1"].nat.status()
            assert status["reachability"] == "symmetric-nat" and status["path_datagrams"]["relayed"] > 0
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
