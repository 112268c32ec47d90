"""When a request tells NAT traversal that its peer is silent (Endpoint.request -> NatHooks.silent): only once the
peer has been silent NAT_SILENT_S after the first transmission, however short the learned retransmission timeout
(a peer a few ms away retransmits after 20 ms: one lost datagram must not look like a NAT's filter)."""

from __future__ import annotations

import trio
import trio.testing

from peerd.metrics import Metrics
from peerd.transport import Endpoint, RpcError
from peerd.transport.endpoint import NAT_SILENT_S
from peerd.wire import messages as m
from peerd.wire.identity import Identity

from .support.memnet import MemNet

SECRET = bytes(range(32))


class Hooks:
    """NatHooks that record the silent calls."""

    def __init__(self) -> None:
        self.silent_at: list[float] = []

    def sent(self, addr, now) -> None: ...
    def answered(self, addr, reply, now) -> None: ...
    def unreached(self, addr, node_id) -> None: ...
    def heard(self, source, node_id, now) -> None: ...

    def silent(self, addr, node_id, now) -> None:
        self.silent_at.append(now)


def test_a_peer_is_reported_silent_only_after_nat_silent_s() -> None:
    async def main() -> None:
        net = MemNet(seed=1)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            a, b = (Endpoint(net.socket("127.0.0.1", 32000 + i), Identity.generate(), SECRET, Metrics())
                    for i in range(2))
            for ep in (a, b):
                nursery.start_soon(ep.serve)
            hooks = Hooks()
            a.nat = hooks
            addr = ("127.0.0.1", 32001)
            for _ in range(8):  # samples: the learned timeout falls to its least
                await a.request(addr, m.MsgType.PING, {})
            assert a.rto.timeout(addr, 0.5) < NAT_SILENT_S
            assert hooks.silent_at == []
            net.partition(addr)  # b is silent from now on
            start = trio.current_time()
            try:
                await a.request(addr, m.MsgType.PING, {}, attempts=4)
            except RpcError:
                pass
            # retransmitted before NAT_SILENT_S (the least timeout), but reported once, and only after it
            assert len(hooks.silent_at) == 1 and hooks.silent_at[0] - start >= NAT_SILENT_S, hooks.silent_at
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
