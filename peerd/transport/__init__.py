"""The trio UDP endpoint: one socket, sealing, request/response matching with retries, demux."""

from .endpoint import Endpoint, Incoming, Peer, RpcError, RpcTimeout

__all__ = ["Endpoint", "Incoming", "Peer", "RpcError", "RpcTimeout"]
