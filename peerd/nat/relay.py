"""Relaying, the last resort, sans I/O (PROTOCOL.md section 18.4).

When a punch fails (a symmetric NAT on either side of a pair that is not public), the two talk through a public
peer that agrees to relay: the sender wraps its already-sealed datagram, unchanged, in a RELAY to the relay
(``to``: the destination's node id); the relay sends it on in a RELAYED (``src``: the sender's node id) to the
address it has itself reached the destination at. The inner datagram stays sealed end to end: the relay never
opens it (it could, holding the swarm key, as any member can read any member's traffic in v2; it has no need to).

The relay is not an open reflector: a RELAY is a sealed control message, so only members send one; it goes only
to a destination the relay has reached itself (an answer from it, within ``ROUTE_TTL``), never to an address the
sender names; one RELAY makes one RELAYED of the same size (no amplification); and each sender has a byte budget
(a token bucket: ``rate`` bytes per second, ``burst`` at once) and the relay a total one, shared max-min fairly
among its senders: each bucket fills at its sender's share, from water-filling ``total_rate`` over what the
senders offered lately, first among the hosts they were reached at and then among each host's senders, and holds
the same time's worth of it as ``burst`` does of ``rate``. Identities are free to mint, addresses are not: ids
minted on one host split that host's share, a sender asking for less than an equal share gets all it asks, and a
new sender starts with its share's burst, not a full one. ``RelayServer`` decides;
the shell only sends. ``RelayClient`` keeps, per peer reached through a relay, which relay, so the endpoint can wrap
what it sends there.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypeVar

Address = tuple[str, int]
K = TypeVar("K", bound=Hashable)

ROUTE_TTL = 150.0  # seconds a destination counts as reached after its last answer (a NAT keeps a replied flow 120 s)
MAX_ROUTES = 4096
MAX_SENDERS = 1024
DEFAULT_RATE = 2_000_000.0  # bytes per second per sender
DEFAULT_BURST = 1_000_000.0  # half a second of DEFAULT_RATE: a relay on a loaded host takes in what queued
# in its socket while it was not scheduled at one instant (a quarter of it refuses honest paced senders' data)
DEFAULT_TOTAL_RATE = 12_500_000.0  # bytes per second for all senders together (100 Mbit/s)
DEMAND_S = 1.0  # time constant of a sender's offered rate (an exponential average)
ACTIVE_S = 2.0  # a sender that offered nothing this long has no share
SHARE_S = 0.1  # shares are recomputed at most this often (and when a sender appears)
HEADROOM = 2.0  # a sender's demand counts double in the water-filling: room to grow before the next recompute
MIN_BUCKET = 8192.0  # bytes a sender's bucket holds at least (a RELAY's data is at most 4096)


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
class _Sender:
    """A sender's bucket, what it offered lately (``demand``, bytes per second as of ``seen``) and its share."""

    bucket: _Bucket
    demand: float = 0.0
    seen: float = 0.0
    share: float = 0.0

    def offer(self, n: int, now: float) -> None:
        self.demand = self.demand_at(now) + n / DEMAND_S
        self.seen = now

    def demand_at(self, now: float) -> float:
        return self.demand * math.exp(-max(0.0, now - self.seen) / DEMAND_S)


def max_min_shares(demands: dict[K, float], capacity: float) -> dict[K, float]:
    """Water-filling: each gets its demand if that is under an equal share of what is left, the rest split
    ``capacity`` equally; what no one asked for is shared equally on top (all of it is given out)."""
    shares: dict[K, float] = {}
    left = capacity
    order = sorted(demands, key=demands.__getitem__)
    for i, key in enumerate(order):
        give = min(demands[key], left / (len(order) - i))
        shares[key] = give
        left -= give
    if order and left > 0:
        extra = left / len(order)
        for key in order:
            shares[key] += extra
    return shares


@dataclass(slots=True)
class RelayServer:
    """A relay's decisions. ``enabled`` false: every RELAY is refused (a node that does not agree to relay)."""

    enabled: bool = True
    rate: float = DEFAULT_RATE
    burst: float = DEFAULT_BURST
    total_rate: float = DEFAULT_TOTAL_RATE
    _routes: dict[bytes, tuple[Address, float]] = field(default_factory=dict)  # node id -> (address, when reached)
    _senders: dict[bytes, _Sender] = field(default_factory=dict)
    _next_share: float = -math.inf
    relayed: int = 0
    relayed_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def _reshare(self, now: float) -> None:
        """Recompute every active sender's share of ``total_rate``: max-min fair over the hosts they were reached
        at, then over each host's senders, by demand (each at most ``rate``); an idle sender's bucket keeps what
        it has but no longer fills."""
        self._next_share = now + SHARE_S
        hosts: dict[str, dict[bytes, float]] = {}
        for k, s in self._senders.items():
            if now - s.seen <= ACTIVE_S:
                route = self._routes.get(k)
                host = route[0][0] if route is not None else ""
                hosts.setdefault(host, {})[k] = min(self.rate, HEADROOM * s.demand_at(now))
        host_shares = max_min_shares({h: sum(d.values()) for h, d in hosts.items()}, self.total_rate)
        shares: dict[bytes, float] = {}
        for host, demands in hosts.items():
            shares.update(max_min_shares(demands, host_shares[host]))
        for k, s in self._senders.items():
            s.bucket.take(0, s.share, self._cap(s.share), now)  # (fill at the old share up to now)
            s.share = min(self.rate, shares.get(k, 0.0))

    def _cap(self, share: float) -> float:
        """A bucket's size at ``share``: ``burst`` scaled as the share is to ``rate`` (at least a few of the largest
        RELAYs); the shares sum to at most ``total_rate``, so the buckets together hold about its burst's worth."""
        return max(min(MIN_BUCKET, self.burst), self.burst * share / self.rate) if self.rate > 0 else self.burst

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
            s = self._senders.get(sender)
            if s is None:
                if len(self._senders) >= MAX_SENDERS:
                    self._senders = {k: v for k, v in self._senders.items() if now - v.seen < 10.0}
                    if len(self._senders) >= MAX_SENDERS:
                        del self._senders[min(self._senders, key=lambda k: self._senders[k].seen)]
                s = self._senders[sender] = _Sender(_Bucket(0.0, now), seen=now)
                s.offer(size, now)
                self._reshare(now)  # a newcomer gets its share at once, and its share's burst
                s.bucket.tokens = self._cap(s.share)
            elif now - s.seen > ACTIVE_S:
                # back from idle: its share may be none (another sender's recompute found it idle) and its bucket
                # cut to that; it comes back as a newcomer does, at once, with its share's burst (no more than a
                # new identity gets); else it would lose what it sends until the next recompute
                s.offer(size, now)
                self._reshare(now)
                s.bucket.tokens = max(s.bucket.tokens, self._cap(s.share))
            else:
                s.offer(size, now)
                if now >= self._next_share:
                    self._reshare(now)
            if not s.bucket.take(size, s.share, self._cap(s.share), now):
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
