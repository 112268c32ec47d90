"""A node running AllreduceService over the in-memory network."""

from __future__ import annotations

from peerd.allreduce.service import AllreduceService, Member
from peerd.metrics import Metrics
from peerd.transport import Endpoint
from peerd.wire.identity import Identity

from .memnet import MemNet

SECRET = bytes(range(32))


class AllreduceNode:
    def __init__(self, net: MemNet, i: int) -> None:
        self.addr = ("127.0.0.1", 30000 + i)
        self.metrics = Metrics()
        self.identity = Identity.generate()
        self.endpoint = Endpoint(net.socket(*self.addr), self.identity, SECRET, self.metrics)
        self.service = AllreduceService(self.endpoint, self.metrics)

    def member(self) -> Member:
        return Member(self.identity.public_key, self.identity.node_id, self.addr)
