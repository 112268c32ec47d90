"""Relaying, the last resort, sans I/O (PROTOCOL.md section 18.4).

When a punch fails (a symmetric NAT on either side of a pair that is not public), the two talk through a public
peer that agrees to relay: the sender wraps its already-sealed datagram, unchanged, in a RELAY to the relay
(``to``: the destination's node id); the relay sends it on in a RELAYED (``src``: the sender's node id) to the
address it has itself reached the destination at. The inner datagram stays sealed end to end: the relay never
opens it (it could, holding the swarm key, as any member can read any member's traffic in v2; it has no need to).

The relay is not an open reflector: a RELAY is a sealed control message, so only members send one; it goes only
to a destination the relay has reached itself (an answer from it, within ``ROUTE_TTL``), never to an address the
sender names; one RELAY makes one RELAYED of the same size (no amplification); and each sender has a byte budget
(a token bucket: ``rate`` bytes per second, ``burst`` at once) and the relay a total one. ``RelayServer``
decides; the shell only sends. ``RelayClient`` keeps, per peer reached through a relay, which relay, so the
endpoint can wrap what it sends there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Address = tuple[str, int]

ROUTE_TTL = 150.0  # seconds a destination counts as reached after its last answer (a NAT keeps a replied flow 120 s)
MAX_ROUTES = 4096
MAX_SENDERS = 1024
DEFAULT_RATE = 2_000_000.0  # bytes per second per sender
DEFAULT_BURST = 1_000_000.0  # half a second of DEFAULT_RATE: a relay on a loaded host takes in what queued
# in its socket while it was not scheduled at one instant (a quarter of it refuses honest paced senders' data)
DEFAULT_TOTAL_RATE = 12_500_000.0  # bytes per second for all senders together (100 Mbit/s)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float

    def take(self, n: int, rate: float, burst: float, now: float) -> bool:
        self.tokens = min(burst, self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


@dataclass(slots=True)
class RelayServer:
    """A relay's decisions. ``enabled`` false: every RELAY is refused (a node that does not agree to relay)."""

    enabled: bool = True
    rate: float = DEFAULT_RATE
    burst: float = DEFAULT_BURST
    total_rate: float = DEFAULT_TOTAL_RATE
    _routes: dict[bytes, tuple[Address, float]] = field(default_factory=dict)  # node id -> (address, when reached)
    _buckets: dict[bytes, _Bucket] = field(default_factory=dict)
    _total: _Bucket | None = None
    relayed: int = 0
    relayed_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def reached(self, node_id: bytes, addr: Address, now: float) -> None:
        """``node_id`` answered this node at ``addr`` (a validated address): RELAYs to it may go there."""
        routes = self._routes
        if node_id not in routes and len(routes) >= MAX_ROUTES:
            oldest = min(routes, key=lambda n: routes[n][1])
            del routes[oldest]
        routes[node_id] = (addr, now)

    def forget(self, node_id: bytes) -> None:
        self._routes.pop(node_id, None)

    def route(self, node_id: bytes, now: float) -> Address | None:
        entry = self._routes.get(node_id)
        if entry is None or now - entry[1] > ROUTE_TTL:
            return None
        return entry[0]

    def forward(self, sender: bytes, to: bytes, size: int, now: float) -> Address | str:
        """Where to send a RELAYED of ``size`` bytes for ``sender``, or why not (a drop reason)."""
        why = ""
        addr = None
        if not self.enabled:
            why = "relay_off"
        elif to == sender:
            why = "relay_loop"
        else:
            addr = self.route(to, now)
            if addr is None:
                why = "relay_unreached"
            elif self.route(sender, now) is None:
                why = "relay_unreached"  # only peers it reached itself may use it (their address is validated)
        if not why:
            bucket = self._buckets.get(sender)
            if bucket is None:
                if len(self._buckets) >= MAX_SENDERS:
                    self._buckets = {k: b for k, b in self._buckets.items() if now - b.at < 10.0}
                bucket = self._buckets[sender] = _Bucket(self.burst, now)
            total = self._total if self._total is not None else _Bucket(self.total_rate, now)
            self._total = total
            mine = bucket.take(size, self.rate, self.burst, now)
            if not mine or not total.take(size, self.total_rate, self.total_rate, now):
                why = "relay_budget"
        if why:
            self.refused[why] = self.refused.get(why, 0) + 1
            return why
        self.relayed += 1
        self.relayed_bytes += size
        assert addr is not None
        return addr


@dataclass(slots=True)
class RelayClient:
    """Peers this node reaches through a relay: node id -> (relay's node id, relay's address)."""

    via: dict[bytes, tuple[bytes, Address]] = field(default_factory=dict)

    def use(self, peer: bytes, relay_id: bytes, relay: Address) -> None:
        if peer not in self.via and len(self.via) >= MAX_ROUTES:
            self.via.pop(next(iter(self.via)))
        self.via[peer] = (relay_id, relay)

    def relay_for(self, peer: bytes) -> tuple[bytes, Address] | None:
        return self.via.get(peer)

    def drop(self, peer: bytes) -> None:
        self.via.pop(peer, None)
