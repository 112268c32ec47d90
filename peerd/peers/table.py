"""Per-peer accounting (sans-I/O): bytes by kind, RTT, loss both ways, goodput and reachability of every peer this
node exchanged data with recently, in bounded memory.

It takes what the endpoint already sees (datagrams sent and opened, answered requests, REPORTs both ways) and a
``now`` with each input; ``handle_timer`` turns byte totals into rates once a second. At most ``capacity`` peers are
tracked: a new one evicts the least recently active. ``statistics()`` is a frozen snapshot for ``peerd status``,
``peerd top``, the status page and the metrics.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

KINDS = ("averaging", "dht", "state_sync", "relay", "other")
PATHS = ("direct", "punched", "relayed")
VERDICTS = ("reachable", "unanswered", "quiet")
DEFAULT_CAPACITY = 256
TICK_S = 1.0  # rates are sampled this often
RATE_TICKS = 5  # ... over the last this many samples
RTT_SAMPLES = 128  # the p99 is over the latest this many round trips
QUIET_S = 60.0  # a peer not heard from for this long is "quiet"
LOSS_HALF = 100_000  # delivery counts are halved past this many expected datagrams (the loss stays recent)
ALPHA = 1 / 8  # smoothing gain of the RTT (RFC 6298's)


def kind_of(mtype: int) -> str:
    """The accounting kind of a message type (protocol/PROTOCOL.md's type table)."""
    if mtype >= 0x40:
        return "averaging"  # tensor data
    if mtype in (0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x1A, 0x1B):
        return "averaging"  # REPORT, matchmaking, outer agreement
    if mtype <= 0x08:
        return "dht"  # PING, PONG, FIND_NODE, NODES, FIND_VALUE, VALUE, STORE, STORED
    if mtype in (0x18, 0x19):
        return "state_sync"
    if mtype in (0x29, 0x2A):
        return "relay"
    return "other"  # ERROR, NAT traversal


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """One peer as this node sees it. Rates are bytes per second over the last few seconds; loss is a fraction of
    the datagrams the averages' REPORTs counted (None: no REPORT yet)."""

    peer: str  # node id, hex
    addr: str  # host:port it was last heard from or sent to
    path: str  # direct | punched | relayed
    via: str | None  # the relay's node id (hex) when relayed
    rtt_s: float | None  # smoothed round-trip time of answered requests
    rtt_p99_s: float | None
    rtt_samples: int
    loss_out: float | None  # of what this node sent it (its REPORTs)
    loss_in: float | None  # of what it sent this node (this node's REPORTs)
    # the datagram counts behind them, (expected, arrived): the difference of two reads is the loss between them,
    # where expected did not drop meanwhile (both are halved together past LOSS_HALF expected)
    loss_out_counts: tuple[int, int]
    loss_in_counts: tuple[int, int]
    send_bps: float
    recv_bps: float
    rate_window_s: float  # the rates are over this many seconds, ending at the table's latest sample
    goodput_out_bps: float  # send rate times what arrived (1 - loss_out)
    goodput_in_bps: float  # what arrived from it
    sent_bytes: dict[str, int]  # by kind (KINDS)
    received_bytes: dict[str, int]
    verdict: str  # reachable | unanswered | quiet
    last_heard_s: float | None  # seconds since it was last heard from (None: never)
    unanswered: int  # requests to it that got no answer

    @property
    def total_bytes(self) -> int:
        return sum(self.sent_bytes.values()) + sum(self.received_bytes.values())


@dataclass(frozen=True, slots=True)
class TableStatistics:
    """Every tracked peer (busiest first) and this node's totals."""

    peers: tuple[PeerStatistics, ...]
    tracked: int
    capacity: int
    evicted: int  # peers forgotten to stay within capacity
    unattributed_bytes: int  # bytes to or from no known node (a PING to a new address)
    send_bps: float  # all peers together
    recv_bps: float
    rates_age_s: float | None  # how long before ``now`` the rates' window ended (the latest sample; None: none yet)
    sent_bytes: int
    received_bytes: int
    relayed_bytes: int  # of sent_bytes + received_bytes, over relayed paths
    sent_by_kind: dict[str, int]  # every peer's, evicted ones included
    received_by_kind: dict[str, int]


@dataclass(slots=True)
class _Peer:
    addr: str
    path: str = "direct"
    via: bytes | None = None
    srtt: float | None = None
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    rtt_count: int = 0
    out_expected: float = 0.0  # from its REPORTs
    out_received: float = 0.0
    in_expected: float = 0.0  # from this node's REPORTs to it
    in_received: float = 0.0
    sent: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    received: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    relayed: int = 0
    samples: deque = field(default_factory=lambda: deque(maxlen=RATE_TICKS + 1))  # (now, sent, received)
    heard: float | None = None
    unanswered_at: float | None = None
    unanswered: int = 0


def _p99(values: deque) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _loss(expected: float, received: float) -> float | None:
    return None if expected <= 0 else min(1.0, max(0.0, 1.0 - received / expected))


class PeerTable:
    """Per-peer accounting core; inputs are named for what happened, each with ``now`` last."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()
        self._evicted = 0
        self._unattributed = 0
        self._now = 0.0
        self._next_tick: float | None = None
        self._sampled: float | None = None  # the latest tick's time
        self._totals = [0, 0, 0]  # sent, received, relayed
        self._sent_by_kind = dict.fromkeys(KINDS, 0)
        self._received_by_kind = dict.fromkeys(KINDS, 0)

    @property
    def now(self) -> float:
        """The latest time an input or the timer brought."""
        return self._now

    def tracks(self, node: bytes) -> bool:
        return node in self._peers

    # -- inputs ----------------------------------------------------------------------------------
    def _peer(self, node: bytes, addr: str, now: float) -> _Peer:
        self._now = max(self._now, now)
        if self._next_tick is None:
            self._next_tick = now + TICK_S
        p = self._peers.get(node)
        if p is None:
            p = self._peers[node] = _Peer(addr)
            p.samples.append((now, 0, 0))
            if len(self._peers) > self.capacity:
                self._peers.popitem(last=False)
                self._evicted += 1
        else:
            self._peers.move_to_end(node)
        return p

    def receive_sent(self, node: bytes | None, addr: str, mtype: int, nbytes: int, relay: bytes | None,
                     now: float) -> None:
        """This node sent ``nbytes`` of type ``mtype`` to ``node`` at ``addr`` (through ``relay`` if given)."""
        self._totals[0] += nbytes
        kind = kind_of(mtype)
        self._sent_by_kind[kind] += nbytes
        if relay is not None:
            self._totals[2] += nbytes
        if node is None:
            self._unattributed += nbytes
            return
        p = self._peer(node, addr, now)
        p.addr = addr
        p.sent[kind] += nbytes
        if relay is not None:
            p.path, p.via = "relayed", relay
            p.relayed += nbytes
        elif p.path == "relayed":  # no longer through its relay (NAT traversal's view says punched, if it was)
            p.path, p.via = "direct", None

    def receive_received(self, node: bytes | None, addr: str, mtype: int, nbytes: int, relayed: bool,
                         now: float) -> None:
        """``nbytes`` of type ``mtype`` from ``node`` were opened (``relayed``: they came through a relay)."""
        self._totals[1] += nbytes
        kind = kind_of(mtype)
        self._received_by_kind[kind] += nbytes
        if relayed:
            self._totals[2] += nbytes
        if node is None:
            self._unattributed += nbytes
            return
        p = self._peer(node, addr, now)
        p.received[kind] += nbytes
        p.heard = now
        if not relayed:
            p.addr = addr

    def receive_path(self, node: bytes, path: str, via: bytes | None, now: float) -> None:
        """What NAT traversal says the path to ``node`` is (only for a peer already tracked)."""
        p = self._peers.get(node)
        if p is not None and path in PATHS:
            p.path, p.via = path, via if path == "relayed" else None

    def receive_rtt(self, node: bytes, rtt: float, now: float) -> None:
        """A request to ``node`` answered on its first transmission after ``rtt`` seconds."""
        self._now = max(self._now, now)
        if not (math.isfinite(rtt) and rtt >= 0):
            return
        p = self._peers.get(node)
        if p is None:
            return
        p.srtt = rtt if p.srtt is None else (1 - ALPHA) * p.srtt + ALPHA * rtt
        p.rtts.append(rtt)
        p.rtt_count += 1
        p.heard = now
        p.unanswered_at = None

    def receive_unanswered(self, node: bytes, now: float) -> None:
        self._now = max(self._now, now)
        p = self._peers.get(node)
        if p is not None:
            p.unanswered += 1
            p.unanswered_at = now

    def receive_report(self, node: bytes, expected: int, received: int, outgoing: bool, now: float) -> None:
        """A REPORT's delivery counts: one ``node`` sent this node (about this node's data to it), or one this
        node sent it (``outgoing``: about its data to this node)."""
        if not 0 <= received <= expected or expected == 0:
            return
        p = self._peers.get(node)
        if p is None:
            return
        if outgoing:
            p.in_expected += expected
            p.in_received += received
            if p.in_expected > LOSS_HALF:
                p.in_expected /= 2
                p.in_received /= 2
        else:
            p.out_expected += expected
            p.out_received += received
            if p.out_expected > LOSS_HALF:
                p.out_expected /= 2
                p.out_received /= 2

    # -- timer -----------------------------------------------------------------------------------
    def get_timer(self) -> float | None:
        return self._next_tick

    def handle_timer(self, now: float) -> None:
        """Sample every peer's byte totals (its rates are over the last RATE_TICKS samples)."""
        self._now = max(self._now, now)
        if self._next_tick is None or now < self._next_tick:
            return
        for p in self._peers.values():
            p.samples.append((now, sum(p.sent.values()), sum(p.received.values())))
        self._sampled = now
        self._next_tick = now + TICK_S

    # -- output ----------------------------------------------------------------------------------
    def statistics(self) -> TableStatistics:
        now = self._now
        peers = []
        for node, p in self._peers.items():
            send_bps = recv_bps = window = 0.0
            if len(p.samples) >= 2:
                (t0, s0, r0), (t1, s1, r1) = p.samples[0], p.samples[-1]
                if t1 > t0:
                    window = t1 - t0
                    send_bps, recv_bps = (s1 - s0) / window, (r1 - r0) / window
            loss_out = _loss(p.out_expected, p.out_received)
            if p.unanswered_at is not None and (p.heard is None or p.unanswered_at >= p.heard):
                verdict = "unanswered"  # its latest request went unanswered
            elif p.heard is None or now - p.heard > QUIET_S:
                verdict = "quiet"
            else:
                verdict = "reachable"
            peers.append(PeerStatistics(
                peer=node.hex(), addr=p.addr, path=p.path, via=p.via.hex() if p.via else None,
                rtt_s=p.srtt, rtt_p99_s=_p99(p.rtts), rtt_samples=p.rtt_count,
                loss_out=loss_out, loss_in=_loss(p.in_expected, p.in_received),
                loss_out_counts=(round(p.out_expected), round(p.out_received)),
                loss_in_counts=(round(p.in_expected), round(p.in_received)),
                send_bps=send_bps, recv_bps=recv_bps, rate_window_s=window,
                goodput_out_bps=send_bps * (1.0 - (loss_out or 0.0)), goodput_in_bps=recv_bps,
                sent_bytes=dict(p.sent), received_bytes=dict(p.received), verdict=verdict,
                last_heard_s=None if p.heard is None else max(0.0, now - p.heard), unanswered=p.unanswered,
            ))
        peers.sort(key=lambda s: (-(s.send_bps + s.recv_bps), -s.total_bytes, s.peer))
        sent, received, relayed = self._totals
        return TableStatistics(
            peers=tuple(peers), tracked=len(peers), capacity=self.capacity, evicted=self._evicted,
            unattributed_bytes=self._unattributed, send_bps=sum(s.send_bps for s in peers),
            recv_bps=sum(s.recv_bps for s in peers),
            rates_age_s=None if self._sampled is None else max(0.0, now - self._sampled), sent_bytes=sent,
            received_bytes=received, relayed_bytes=relayed, sent_by_kind=dict(self._sent_by_kind),
            received_by_kind=dict(self._received_by_kind),
        )
