"""What the endpoint hands its users: a remote peer as its token binding proved it, an incoming control message,
and the one error type a request or a send raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire import messages as m

Address = tuple[str, int]


class RpcError(Exception):
    """A request that failed: no answer, or an ERROR response."""


class RpcTimeout(RpcError):
    pass


@dataclass(frozen=True, slots=True)
class Peer:
    """A remote node as proven by its token binding; ``host``/``port`` is where to reach it."""

    node_id: bytes
    public_key: bytes
    host: str
    port: int


@dataclass(slots=True)
class Incoming:
    mtype: m.MsgType
    body: dict[str, Any]
    peer: Peer
    source: Address
    relayed: bool = False  # it came through a relay: ``source`` stands for the sender and teaches no address
