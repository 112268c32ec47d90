"""Where datagrams to a peer go, sans-I/O: direct, to an alias (the port a NAT mapped the peer to for this node),
or wrapped in RELAYs through a relay (PROTOCOL.md 18.4); and how many datagrams and bytes went each way.

NAT traversal (peerd/nat/service.py) decides the paths; the endpoint looks each send up here and counts it with
``sent``, the one place where a sent datagram's destination, size and path kind are known together.
"""

from __future__ import annotations

from collections.abc import Hashable

PATH_KINDS = ("direct", "punched", "relayed")
MAX_ALIASES = 4096


class Paths:
    """The relayed, aliased and punched addresses of one node (bounded) and its per-path counts."""

    def __init__(self, max_aliases: int = MAX_ALIASES) -> None:
        self.max_aliases = max_aliases
        self.relayed: dict[Hashable, tuple[bytes, bytes, Hashable]] = {}  # addr -> (peer id, relay id, relay addr)
        self.punched: set[Hashable] = set()
        self.alias: dict[Hashable, Hashable] = {}  # an address a peer is known at -> where it answers
        self.counts: dict[str, list[int]] = {k: [0, 0] for k in PATH_KINDS}  # kind -> [datagrams, bytes]

    def set_relay(self, addr: Hashable, peer_id: bytes, relay_id: bytes, relay: Hashable) -> None:
        if addr == relay:
            raise ValueError("a peer cannot be its own relay")
        self.relayed[addr] = (peer_id, relay_id, relay)
        self.punched.discard(addr)

    def clear_relay(self, addr: Hashable) -> None:
        self.relayed.pop(addr, None)

    def set_alias(self, addr: Hashable, to: Hashable) -> None:
        if addr == to:
            self.alias.pop(addr, None)
            return
        if addr not in self.alias and len(self.alias) >= self.max_aliases:
            self.alias.pop(next(iter(self.alias)))
        self.alias[addr] = to

    def alias_of(self, addr: Hashable) -> Hashable:
        return self.alias.get(addr, addr) if self.alias else addr

    def relay_of(self, addr: Hashable) -> tuple[bytes, bytes, Hashable] | None:
        return self.relayed.get(addr)

    def set_punched(self, addr: Hashable) -> None:
        self.punched.add(addr)
        self.relayed.pop(addr, None)

    def is_relayed(self, addr: Hashable) -> bool:
        return bool(self.relayed) and addr in self.relayed

    def sent(self, addr: Hashable, datagrams: int, nbytes: int, *, relayed: bool = False) -> None:
        """``datagrams`` (``nbytes`` together, inner bytes for a relayed one) went to ``addr``."""
        kind = "relayed" if relayed else "punched" if self.punched and addr in self.punched else "direct"
        counts = self.counts[kind]
        counts[0] += datagrams
        counts[1] += nbytes
