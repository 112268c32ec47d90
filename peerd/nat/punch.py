"""Hole punching, sans I/O (PROTOCOL.md section 18.3).

To reach a NATed peer T, a node asks an introducer both can reach (INTRO): the introducer answers with T's
address as it reached it (INTRO_OK ``peer``: T's mapped address) and passes the requester's address as it saw
it on to T (CONNECT). Both then PING each other's mapped address at once, a few times: each side's first PING
opens its own NAT's filter for the other, and the next ones get through. A PONG settles the path; it is
remembered per peer and held open by keepalives (under the 30 s a NAT keeps an unreplied UDP flow) while the
path is used. A punch that gets no PONG by ``deadline`` fails: the caller falls back to a relay.

A punch is started by silence, and silence is also loss: a punch ends ``Direct`` (a direct path, kept open all
the same) when the peer answers this node's request at the punch's address before anything the peer sent arrived
(a NAT in front of it would have passed nothing before its own PINGs went out, and those come first), or when it
settles where the peer had answered or written to this node lately (its flow there was open before any punch). A
flat link that lost one request is no punched path.

A punch is PINGs at an address someone else named (the introducer, or the INTRO_OK of one), so a member could
point it at any host: a punch goes only to the address the DHT named that peer at (``named``), and each target
address gets at most ``TARGET_PUNCHES`` punches per ``TARGET_WINDOW_S``, however many CONNECTs name it.

The core contract: inputs take ``now`` last; ``get_timer``/``handle_timer``; ``take_actions`` drains the
actions (``Intro``, ``Ping``, ``Punched``, ``Direct``, ``Failed``); ``statistics()``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

Address = tuple[str, int]

PUNCH_PINGS = 6  # PINGs per punch, ``PUNCH_GAP`` apart
PUNCH_GAP = 0.25
PUNCH_DEADLINE = 3.0  # seconds from the start of a punch to its failure
KEEPALIVE_S = 20.0  # under 30 s: Linux conntrack drops an unreplied UDP flow after 30 s
IDLE_S = 120.0  # a path unused this long gets no more keepalives
RETRY_FAILED_S = 60.0  # a failed punch to a peer is not tried again before this
MAX_PUNCHES = 64  # punches under way at once
MAX_PATHS = 1024
TARGET_PUNCHES = 2  # punches towards one address per TARGET_WINDOW_S (each up to PUNCH_PINGS PINGs)
TARGET_WINDOW_S = 60.0
MAX_TARGETS = 4096  # target addresses whose punches are counted (more: the oldest window is forgotten)


@dataclass(frozen=True, slots=True)
class Intro:
    """Send INTRO(target) to the introducer; report ``receive_intro``."""

    introducer: Address
    introducer_id: bytes
    target: bytes


@dataclass(frozen=True, slots=True)
class Ping:
    """Send a PING (sealed for ``node_id``) to ``addr``: a punch or a keepalive."""

    node_id: bytes
    addr: Address
    keepalive: bool = False


@dataclass(frozen=True, slots=True)
class Punched:
    node_id: bytes
    addr: Address


@dataclass(frozen=True, slots=True)
class Direct:
    """The punch to ``node_id`` ended in a direct path at ``addr``: nothing on the peer's side needed opening."""

    node_id: bytes
    addr: Address


@dataclass(frozen=True, slots=True)
class Failed:
    """The punch got no PONG. ``introduced``: an introducer vouched for the target (its INTRO_OK named it, or
    its CONNECT came on the target's behalf), the only evidence that a relay could reach it at all."""

    node_id: bytes
    introduced: bool = False


Action = Intro | Ping | Punched | Direct | Failed


@dataclass(slots=True)
class _Punch:
    addr: Address | None  # None: waiting for INTRO_OK
    started: float
    named: tuple[Address, ...] = ()  # where the DHT named the target (INTRO_OK must give one of these)
    pings_left: int = PUNCH_PINGS
    next_ping: float = 0.0
    introduced: bool = False  # an introducer has reached the target (see ``Failed``)
    direct_at: Address | None = None  # where the peer answered or wrote to this node before: settled there, ``Direct``


@dataclass(slots=True)
class _Path:
    addr: Address
    used: float
    pinged: float


@dataclass(frozen=True, slots=True)
class PunchStatistics:
    punches: int  # under way
    paths: int  # punched paths remembered
    punched: int
    failures: int
    refused: dict[str, int]
    direct: int = 0  # punches that ended ``Direct``


@dataclass(slots=True)
class Puncher:
    """Punches and punched paths of one node."""

    _punches: dict[bytes, _Punch] = field(default_factory=dict)
    paths: dict[bytes, _Path] = field(default_factory=dict)
    _failed: dict[bytes, tuple[float, bool]] = field(default_factory=dict)  # target -> (when, introduced)
    _targets: dict[Address, tuple[float, int]] = field(default_factory=dict)  # address -> (window start, punches)
    punched: int = 0
    failures: int = 0
    direct: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # punches not started, by reason (unnamed, target_budget)
    _actions: list[Action] = field(default_factory=list)

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def statistics(self) -> PunchStatistics:
        return PunchStatistics(len(self._punches), len(self.paths), self.punched, self.failures, dict(self.refused),
                               self.direct)

    def _refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1

    def _allow(self, addr: Address, now: float) -> bool:
        """Charge one punch to ``addr``'s budget; False when it is spent for this window."""
        targets = self._targets
        start, n = targets.get(addr, (now, 0))
        if now - start >= TARGET_WINDOW_S:
            start, n = now, 0
        if n >= TARGET_PUNCHES:
            self._refuse("target_budget")
            return False
        if addr not in targets and len(targets) >= MAX_TARGETS:
            oldest = min(targets, key=lambda a: targets[a][0])
            del targets[oldest]
        targets[addr] = (start, n + 1)
        return True

    def path(self, node_id: bytes) -> Address | None:
        p = self.paths.get(node_id)
        return p.addr if p is not None else None

    def punching(self, node_id: bytes) -> bool:
        return node_id in self._punches

    def punch(self, target: bytes, introducer_id: bytes, introducer: Address, named: Collection[Address],
              now: float, *, direct_at: Address | None = None) -> None:
        """Start a punch to ``target`` through ``introducer`` (unless one runs, a path exists, or it failed
        recently). ``named``: the addresses the DHT named ``target`` at; the introducer's answer must be one.
        ``direct_at``: where ``target`` wrote to this node lately (its flow here is open: a path that settles
        there is direct)."""
        if target in self._punches or target in self.paths or len(self._punches) >= MAX_PUNCHES:
            return
        failed = self._failed.get(target)
        if failed is not None and now - failed[0] < RETRY_FAILED_S:
            self._actions.append(Failed(target, failed[1]))
            return
        self._punches[target] = _Punch(None, now, tuple(named), direct_at=direct_at)
        self._actions.append(Intro(introducer, introducer_id, target))

    def receive_intro(self, target: bytes, addr: Address | None, now: float) -> None:
        """INTRO_OK: ``addr`` is the target's mapped address (None: the introducer has not reached it)."""
        punch = self._punches.get(target)
        if punch is None or punch.addr is not None or not punch.pings_left:
            return
        if addr is None:
            self._fail(target, now)
            return
        punch.introduced = True
        if addr not in punch.named:  # (a symmetric NAT's mapping toward the introducer is named nowhere)
            self._refuse("unnamed")
            punch.pings_left = 0  # no PINGs there; the target's own PINGs (its CONNECT) may still settle it
            return
        if not self._allow(addr, now):
            punch.pings_left = 0
            return
        punch.addr = addr
        punch.next_ping = now
        self.handle_timer(now)

    def receive_connect(self, peer: bytes, addr: Address, named: Collection[Address], now: float, *,
                        answered: bool = False) -> None:
        """CONNECT from an introducer: ``peer`` wants to talk, from ``addr``; punch towards it at once, if the DHT
        named ``peer`` at ``addr`` (``named``) and ``addr``'s budget allows. ``answered``: ``peer`` answered this
        node at ``addr`` before (the PINGs still go, for its sake; the path settles ``Direct``)."""
        if peer in self.paths and self.paths[peer].addr == addr:
            self._actions.append(Ping(peer, addr))
            return
        if addr not in named:
            self._refuse("unnamed")
            return
        if peer not in self._punches and len(self._punches) >= MAX_PUNCHES:
            return
        if not self._allow(addr, now):
            return
        self._punches[peer] = _Punch(addr, now, (addr,), next_ping=now, introduced=True,
                                     direct_at=addr if answered else None)
        self.handle_timer(now)

    def receive_answer(self, peer: bytes, addr: Address, now: float) -> None:
        """``peer`` answered a request this node sent to ``addr``. At the address a punch under way is aimed at
        (before its INTRO_OK: one the DHT named), and with nothing from ``peer`` here first (that settles the
        punch), the answer came through no NAT the punch opened: ``Direct``. Else as ``receive_pong``."""
        punch = self._punches.get(peer)
        direct = punch is not None and (addr == punch.addr or (punch.addr is None and addr in punch.named))
        self._settle(peer, addr, now, direct)

    def receive_pong(self, peer: bytes, addr: Address, now: float) -> None:
        """A PONG (or any authenticated datagram) came from ``peer`` at ``addr``: the path works."""
        self._settle(peer, addr, now, False)

    def _settle(self, peer: bytes, addr: Address, now: float, direct: bool) -> None:
        """The path to ``peer`` at ``addr`` works: remember it (kept open by keepalives whatever its kind: a
        ``Direct`` verdict that loss of the peer's own PINGs misled still keeps a NAT's mapping open)."""
        punch = self._punches.pop(peer, None)
        known = self.paths.get(peer)
        if known is not None and known.addr == addr:
            known.pinged = now
            return
        if punch is None and known is None:
            return
        direct = direct or (punch is not None and addr == punch.direct_at)
        if len(self.paths) >= MAX_PATHS:
            oldest = min(self.paths, key=lambda n: self.paths[n].used)
            del self.paths[oldest]
        self.paths[peer] = _Path(addr, now, now)
        self._failed.pop(peer, None)
        if direct:
            self.direct += 1
            self._actions.append(Direct(peer, addr))
        else:
            self.punched += 1
            self._actions.append(Punched(peer, addr))

    def used(self, peer: bytes, now: float) -> None:
        """The path to ``peer`` carried something: keep it open."""
        p = self.paths.get(peer)
        if p is not None:
            p.used = now

    def forget(self, peer: bytes) -> None:
        self.paths.pop(peer, None)
        self._punches.pop(peer, None)

    def get_timer(self) -> float | None:
        times = []
        for punch in self._punches.values():
            times.append(punch.started + PUNCH_DEADLINE)
            if punch.addr is not None and punch.pings_left:
                times.append(punch.next_ping)
        for p in self.paths.values():
            due = p.pinged + KEEPALIVE_S
            if due - p.used <= IDLE_S:
                times.append(due)
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        actions = self._actions
        for target, punch in list(self._punches.items()):
            if now >= punch.started + PUNCH_DEADLINE:
                self._fail(target, now)
                continue
            while punch.addr is not None and punch.pings_left and punch.next_ping <= now:
                actions.append(Ping(target, punch.addr))
                punch.pings_left -= 1
                punch.next_ping += PUNCH_GAP
        for peer, p in list(self.paths.items()):
            if now - p.pinged >= KEEPALIVE_S and now - p.used <= IDLE_S:
                p.pinged = now
                actions.append(Ping(peer, p.addr, keepalive=True))

    def _fail(self, target: bytes, now: float) -> None:
        punch = self._punches.pop(target, None)
        introduced = punch is not None and punch.introduced
        self._failed[target] = (now, introduced)
        if len(self._failed) > MAX_PATHS:
            self._failed.pop(next(iter(self._failed)))
        self.failures += 1
        self._actions.append(Failed(target, introduced))

