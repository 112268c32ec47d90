"""The transport: a sans-I/O core (request matching, retransmission schedule, demux: core.py) under the trio UDP
endpoint (one socket, sealing, the receive loop), socket capabilities (caps.py) and fault injection (faults.py)."""

from .caps import SocketCaps
from .core import TransportCore
from .endpoint import Endpoint, Incoming, Peer, RpcError, RpcTimeout
from .faults import LossySocket

__all__ = ["Endpoint", "Incoming", "LossySocket", "Peer", "RpcError", "RpcTimeout", "SocketCaps", "TransportCore"]
