"""The cap a node publishes in its matchmaking record (PROTOCOL.md 16.1's ``cap``), the table of its peers' caps,
and what a group plans from them: how long a capped member's share takes, and how fast to send to it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_ADVERT_RATE = 2**40  # bytes/s: anything above is refused as malformed
MAX_PEERS = 4096  # peers whose caps are remembered (LRU)
WIRE_OVERHEAD = 42  # IPv4 + UDP + Ethernet headers per datagram: what a link and its meter count beyond the payload
PLAN_MARGIN = 1.5  # a phase's deadline: at least this many times its slowest capped member's share at its cap
SENDER_SHARE = 0.97  # of a download-capped member's cap, shared by its senders: the rest is for its DHT and control


@dataclass(frozen=True, slots=True)
class CapAdvert:
    """Caps in bytes/s on the wire (0: none in that direction)."""

    up: int = 0
    down: int = 0

    def encode(self) -> list[int]:
        return [self.up, self.down]

    @classmethod
    def decode(cls, value: object) -> CapAdvert:
        """Raises ValueError for anything but a list of two uints up to MAX_ADVERT_RATE (a member is untrusted)."""
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ValueError("cap must be [up, down]")
        up, down = value
        if type(up) is not int or type(down) is not int or not (0 <= up <= MAX_ADVERT_RATE and
                                                                0 <= down <= MAX_ADVERT_RATE):
            raise ValueError("cap rates must be uints")
        return cls(up, down)

    @property
    def capped(self) -> bool:
        return bool(self.up or self.down)


class PeerCaps:
    """node id -> the cap its latest matchmaking record carried, None for a record without one (bounded, least
    recently noted evicted)."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._caps: OrderedDict[bytes, CapAdvert | None] = OrderedDict()
        self._max = max_peers

    def note(self, node_id: bytes, advert: CapAdvert | None) -> None:
        self._caps[node_id] = advert if advert is not None and advert.capped else None
        self._caps.move_to_end(node_id)
        while len(self._caps) > self._max:
            self._caps.popitem(last=False)

    def get(self, node_id: bytes) -> CapAdvert | None:
        return self._caps.get(node_id)

    def known(self, node_id: bytes) -> bool:
        """Whether a record of ``node_id``'s was seen (capped or not)."""
        return node_id in self._caps

    def __len__(self) -> int:
        return len(self._caps)


def wire_bytes(payload_bytes: float, datagram: int) -> float:
    """What ``payload_bytes`` cost on the link in datagrams of ``datagram`` payload bytes."""
    return payload_bytes * (1.0 + WIRE_OVERHEAD / datagram)


def share_seconds(vector_bytes: float, adverts: list[CapAdvert | None], datagram: int = 1200,
                  shares: tuple[int, ...] | None = None) -> float:
    """The longest time any capped member's part of one butterfly phase takes at its cap: member j with a shard of
    s_j of the vector (in the run's codec: ``vector_bytes``) sends the rest of the vector (1 - s_j) in the
    reduce-scatter and its shard to the n - 1 others in the all-gather, and receives as much the other way round,
    in datagrams of ``datagram`` bytes with their headers. Equal shares (None): (n - 1)/n of the vector each way in
    each phase. 0 when no member is capped. A round is two phases."""
    n = len(adverts)
    if n < 2:
        return 0.0
    total = sum(shares) if shares else n
    worst = 0.0
    for j, a in enumerate(adverts):
        if a is None:
            continue
        part = (shares[j] if shares else 1) / total
        share = wire_bytes(vector_bytes * max(1 - part, (n - 1) * part), datagram)
        for rate in (a.up, a.down):
            if rate:
                worst = max(worst, share / rate)
    return worst


def sender_rate(advert: CapAdvert | None, members: int, datagram: int = 1200) -> float | None:
    """Payload bytes/s each of a group's other members may send to a member with ``advert``: its download cap shared
    among the ``members - 1`` senders (None: it has none)."""
    if advert is None or not advert.down or members < 2:
        return None
    return SENDER_SHARE * advert.down / (members - 1) * datagram / (datagram + WIRE_OVERHEAD)
