"""NAT path choice, sans I/O (PROTOCOL.md sections 18.3 and 18.4): how this node talks to each peer (direct,
punched or relayed), when an unanswered request starts a punch, when a failed punch relays, and when a relayed
peer goes back to direct.

Loss is not a NAT, and a relay once set up is kept: a relay is tried only for a peer that never answered this
node directly and that an introducer vouched for, once it stayed silent to direct PINGs while a peer this node
reached (the relay it would use) answered them at the same time. A relayed path exists only after a PING through
the relay was answered by the peer, and a direct answer ends it.

The shell reports what the endpoint sees (answers, requests, silences, relayed datagrams) and the outcome of the
PINGs this core asks for; it carries out the actions: PINGs, INTROs, OBSERVEs, probes, and the endpoint's relay
and alias tables, which this core mirrors (only it changes them). Reachability (``Reach``) and hole punching
(``Puncher``) are its parts. Time comes in as ``now``; randomness from the injected rng.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .punch import KEEPALIVE_S, Direct, Failed, Intro, Ping, Punched, Puncher
from .reach import UNKNOWN, AskProbe, Observe, Reach

Address = tuple[str, int]
RelayEntry = tuple[bytes, bytes, Address]  # (peer id, relay id, relay address)

PATH_KINDS = ("direct", "punched", "relayed")
MAX_REACHED = 4096  # peers remembered as reached (LRU)
HEARD_S = 60.0  # a request's source counts as a path to its sender this long (a NAT keeps a flow 30-120 s)
KNOWN_S = 180.0  # a peer that answered this long ago is no longer counted in peers_known
MAX_INTRODUCERS = 4096  # contacts remembered with the peer that named them
MAX_ACTIVE = 32  # punches/relay set-ups running at once
DISCOVER_S = 5.0  # how often ``handle_timer`` looks for peers the DHT named that this node cannot talk to yet
DISCOVER_PER_PASS = 4
RETRY_DISCOVER_S = 120.0  # (under KNOWN_S: a named peer drops out of peers_known only while it does not answer)
RETRY_DISCOVER_FIRST_S = 10.0  # ... the first retry (then twice as long each time, up to RETRY_DISCOVER_S)
DIRECT_RETRIES = 3  # direct PINGs before a failed punch relays (see ``_direct_check``)
DIRECT_RETRY_S = 0.25  # ... each this long unanswered (a NATed peer costs 0.75 s more before its relay)
RELAY_TRIES = 3  # relays asked for one peer before giving up (each costs a PING's timeout when it refuses)
MAX_STANDINS = 256  # reply paths through relays not (yet) confirmed as a peer's path (LRU)
DIRECT_CHECK_S = 10.0  # a relayed peer heard directly is PINGed there at most this often (answered: relay dropped)
MAX_ALIASES = 4096  # as the endpoint's alias table
PUNCH_PING_S = 0.25


@dataclass(frozen=True, slots=True)
class SendPing:
    """PING ``node_id`` at ``addr`` (``attempts`` tries; ``timeout`` None: the endpoint's default); report the
    answer's node id to ``receive_pong(token, ...)`` or the silence to ``ping_failed(token, ...)``."""

    token: int
    node_id: bytes
    addr: Address
    timeout: float | None = None
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class SetRelay:
    """What goes to ``addr`` (the node ``peer_id``) goes through the relay ``relay_id`` at ``relay``."""

    addr: Address
    peer_id: bytes
    relay_id: bytes
    relay: Address


@dataclass(frozen=True, slots=True)
class ClearRelay:
    addr: Address


@dataclass(frozen=True, slots=True)
class SetAlias:
    """What goes to ``addr`` goes to ``to`` (the same node answers there)."""

    addr: Address
    to: Address


@dataclass(frozen=True, slots=True)
class SetPunched:
    addr: Address


@dataclass(frozen=True, slots=True)
class Connect:
    """Set a path up to ``node_id`` at ``addr`` (the shell's ``connect``); report ``connect_done``."""

    addr: Address
    node_id: bytes


Action = SendPing | SetRelay | ClearRelay | SetAlias | SetPunched | Connect | Intro | Observe | AskProbe


@dataclass(frozen=True, slots=True)
class PathStatistics:
    reached: int
    paths: dict[str, int]  # peers by path kind (direct: reached and not otherwise set up)
    punched: int
    punch_failures: int
    relays_not_tried: dict[str, int]  # relays not tried for want of evidence of a NAT, by reason


@dataclass(slots=True)
class _Check:
    """Direct PINGs to a peer and, alongside, to a control peer; ``then(outcome, now)`` with "direct", "lossy"
    (neither answered: this node's own link) or "silent" (only the target stayed silent: a NAT's evidence)."""

    then: Callable[[str, float], None]
    target: bool | None = None
    control: bool | None = None


@dataclass(slots=True)
class _Trial:
    """A relay being tried for ``node_id``: after a failed punch (``addr``: where it was asked for), or to confirm
    a relay it spoke through (``confirm``: ``addr`` is the stand-in, ``final`` the address to use it for)."""

    node_id: bytes
    addr: Address
    relays: list[bytes]
    confirm: bool = False
    final: Address | None = None
    relay: Address | None = None  # (a confirmation: the relay's address)
    tried: int = 0


class Paths:
    """One node's path choice. ``node_id``: this node's; ``contact_of(node_id)``: where the routing table has a
    node (for peers first heard through a relay); ``ipv6``: stand-in addresses are IPv6."""

    def __init__(self, node_id: bytes, rng: random.Random, *, ipv6: bool = False,
                 contact_of: Callable[[bytes], Address | None] | None = None) -> None:
        self.node_id = node_id
        self.ipv6 = ipv6
        self.contact_of = contact_of
        self.reach = Reach(rng)
        self.puncher = Puncher()
        self.reached: OrderedDict[bytes, Address] = OrderedDict()  # node id -> where it answered this node
        self._answered_at: dict[bytes, float] = {}  # node id -> when it last answered (same keys as reached)
        self._heard_at: OrderedDict[bytes, tuple[Address, float]] = OrderedDict()  # requests' sources, not relayed
        self.introducer: OrderedDict[bytes, bytes] = OrderedDict()  # node id -> the peer that named it
        self.named_at: dict[bytes, Address] = {}  # node id -> the address it was named at (same keys)
        self._tried: dict[bytes, tuple[float, int]] = {}  # node id -> (when discovery last tried it, tries)
        self.kind: dict[bytes, str] = {}  # peer -> path kind, for peers this node set a path up for
        self.active: set[bytes] = set()  # punches and relay trials under way
        self._attempts: OrderedDict[bytes, int] = OrderedDict()  # punch-then-relay attempts started, per peer
        self.connecting: set[Address] = set()
        self.target_addr: OrderedDict[bytes, Address] = OrderedDict()  # punch/relay target -> its address
        # Confirmed relayed paths: peer -> (relay id, relay address, the address this node uses for the peer).
        self._via: OrderedDict[bytes, tuple[bytes, Address, Address]] = OrderedDict()
        self._standins: OrderedDict[Address, bytes] = OrderedDict()  # reply-only addresses through a relay
        self._confirming: set[bytes] = set()
        self._direct_tried: OrderedDict[bytes, float] = OrderedDict()
        self.relays: dict[Address, RelayEntry] = {}  # the endpoint's relay table (only this core changes it)
        self.aliases: dict[Address, Address] = {}  # the endpoint's alias table
        self.no_relay: dict[str, int] = {}
        # PING token -> (continuation, args, whether only a direct answer counts)
        self._waits: dict[int, tuple[Callable[..., None], tuple, bool]] = {}
        self._next_token = 1
        self._actions: list[Action] = []
        self.started = False
        self._next_discover = 0.0
        self._next_keepalive = 0.0
        self._now = 0.0  # the latest input's time (for what the parts queued: a failed punch)

    # -- the contract -------------------------------------------------------------------------------------
    def take_actions(self) -> list[Action]:
        self._pump()
        actions, self._actions = self._actions, []
        return actions

    def get_timer(self) -> float | None:
        times = [self.reach.get_timer(), self.puncher.get_timer() or math.inf]
        if self.started:
            times += [self._next_discover, self._next_keepalive]
        wake = min(times)
        return None if wake == math.inf else wake

    def handle_timer(self, now: float) -> None:
        self._now = now
        self.reach.handle_timer(now)
        self.puncher.handle_timer(now)
        if self.started and now >= self._next_discover:
            self._next_discover = now + DISCOVER_S
            self._discover(now)
        if self.started and now >= self._next_keepalive:
            self._next_keepalive = now + KEEPALIVE_S
            self._keepalives()
        self._pump()

    def statistics(self) -> PathStatistics:
        counts = {kind: 0 for kind in PATH_KINDS}
        for k in self.kind.values():
            counts[k] += 1
        counts["direct"] += sum(1 for n in self.reached if n not in self.kind)
        punch = self.puncher.statistics()
        return PathStatistics(len(self.reached), counts, punch.punched, punch.failures, dict(self.no_relay))

    # -- inputs ---------------------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Run reachability now (after joining: the peers it reached are its observers), and discovery."""
        self.started = True
        self.reach.start(now)

    def datagram_sent(self, addr: Address, now: float) -> None:
        self.reach.datagram_sent(addr, now)

    def receive_answer(self, addr: Address, node_id: bytes, nodes: list, now: float) -> None:
        """``node_id`` answered a request sent to ``addr`` (``nodes``: the contacts its answer named)."""
        if addr not in self.relays:
            self._reached(node_id, addr, now)
        if nodes:
            intro = self.introducer
            for contact in nodes:
                if contact[0] == self.node_id:
                    continue
                intro[contact[0]] = node_id
                intro.move_to_end(contact[0])
                self.named_at[contact[0]] = (contact[1], contact[2])
            while len(intro) > MAX_INTRODUCERS:
                gone, _ = intro.popitem(last=False)
                self.named_at.pop(gone, None)

    def receive_request(self, source: Address, node_id: bytes, now: float) -> None:
        """A request from ``node_id`` came in from ``source``, not through a relay. When this node is punching
        towards it, that settles the punch (its NAT chose ``source`` for this node); a relayed peer heard here
        is PINGed here (answered, the relay goes)."""
        self.reach.receive_request(node_id, source, now)
        heard = self._heard_at
        heard[node_id] = (source, now)
        heard.move_to_end(node_id)
        if len(heard) > MAX_REACHED:
            heard.popitem(last=False)
        if node_id in self._via and now - self._direct_tried.get(node_id, -math.inf) >= DIRECT_CHECK_S:
            self._direct_tried[node_id] = now
            self._direct_tried.move_to_end(node_id)
            if len(self._direct_tried) > MAX_REACHED:
                self._direct_tried.popitem(last=False)
            entry = self.relays.get(source)
            if entry is not None:  # set aside while it is PINGed directly
                self._clear_relay(source)
            self._ping(node_id, source, self._checked_direct, (node_id, source, entry), DIRECT_RETRY_S,
                       DIRECT_RETRIES)
        if self.puncher.punching(node_id):
            self.puncher.receive_pong(node_id, source, now)

    def request_unanswered(self, addr: Address, node_id: bytes, now: float) -> None:
        """A request to ``node_id`` at ``addr`` went unanswered once: send where it answers, or through its
        relay, or (never reached, and some peer named it) punch through that peer; a failed punch may relay."""
        self._now = now
        if addr in self.relays or node_id in self.active:
            return
        via = self._via.get(node_id)
        if via is not None:  # relayed at another address already: the same relay serves this one
            self._set_relay(addr, node_id, via[0], via[1])
            return
        elsewhere = self.elsewhere(node_id, addr, now)
        if elsewhere is not None:  # it answers (or sends) from another address (its NAT's mapping): send there
            self._set_alias(addr, elsewhere)
            return
        if node_id in self.kind or node_id in self.reached or len(self.active) >= MAX_ACTIVE:
            return
        intro_id = self.introducer.get(node_id)
        if intro_id is None or intro_id not in self.reached or intro_id == node_id:
            # the peer that named it is out of reach: ask the peer that answered this node last (alive, and
            # likely to have reached the target: public peers answer everyone)
            intro_id = next((n for n in reversed(self.reached) if n != node_id), None)
        intro_addr = self.reached.get(intro_id) if intro_id is not None else None
        if intro_id is None or intro_addr is None:
            return
        self.active.add(node_id)
        self._attempts[node_id] = self._attempts.pop(node_id, 0) + 1
        while len(self._attempts) > MAX_INTRODUCERS:
            self._attempts.popitem(last=False)
        self.target_addr[node_id] = addr
        while len(self.target_addr) > MAX_INTRODUCERS:
            self.target_addr.popitem(last=False)
        self.puncher.punch(node_id, intro_id, intro_addr, self.dht_named(node_id) | {addr}, now,
                           direct_at=self._recent_source(node_id, now))

    def unreached(self, addr: Address, node_id: bytes, now: float) -> None:
        """Tensor data is about to go to ``addr`` with no path known there: set one up (``Connect``)."""
        if (addr in self.connecting or len(self.connecting) >= MAX_ACTIVE
                or self.path_to(addr, node_id, now) is not None):
            return
        self.connecting.add(addr)
        self._actions.append(Connect(addr, node_id))

    def connect_relayed(self, addr: Address, node_id: bytes, now: float) -> bool:
        """Whether ``node_id`` has a relayed path: then ``addr`` goes through the same relay too."""
        via = self._via.get(node_id)
        if via is None or self.kind.get(node_id) != "relayed":
            return False
        self._set_relay(addr, node_id, via[0], via[1])
        return True

    def connect_done(self, addr: Address, now: float) -> None:
        self.connecting.discard(addr)

    def answers_elsewhere(self, addr: Address, to: Address, now: float) -> None:
        """The node named at ``addr`` did not answer there, and answers at ``to``: send there."""
        self._set_alias(addr, to)

    def receive_connect(self, peer_id: bytes, addr: Address, now: float) -> None:
        """CONNECT from a reached introducer: ``peer_id`` wants to talk, from ``addr`` (where it answered this
        node lately: a direct path, whatever the punch for its sake finds)."""
        answered = self.reached.get(peer_id) == addr and self._answers_recently(peer_id, now)
        self.puncher.receive_connect(peer_id, addr, self.dht_named(peer_id), now, answered=answered)

    def receive_intro(self, target: bytes, addr: Address | None, now: float) -> None:
        self._now = now
        self.puncher.receive_intro(target, addr, now)

    def receive_pong(self, token: int, node_id: bytes, relayed: bool, now: float) -> None:
        """The PING ``token`` was answered by ``node_id`` (``relayed``: the answer came through a relay, the endpoint
        having one for that address). A punch or a direct check that a relay answered proves no direct path: for
        them it is silence (else a punch between two symmetric NATs would be taken for a path, and its relay
        dropped)."""
        wait = self._waits.pop(token, None)
        if wait is not None:
            wait[0](None if relayed and wait[2] else node_id, now, *wait[1])

    def ping_failed(self, token: int, now: float) -> None:
        wait = self._waits.pop(token, None)
        if wait is not None:
            wait[0](None, now, *wait[1])

    def receive_relayed(self, relay_id: bytes, relay: Address, src: bytes, now: float) -> tuple[Address | None, str]:
        """A RELAYED from ``relay_id`` at ``relay`` naming ``src``: the address its datagram is handled at (the
        relayed path, or a reply-only stand-in through that relay), or (None, why it is dropped)."""
        if self.reached.get(relay_id) != relay:
            return None, "unreached"  # only a relay this node reached, at that address
        if src == self.node_id:
            return None, "self"
        if src == relay_id:
            return None, "relay_loop"
        addr = self._relayed_addr(src, relay_id, relay)
        return (addr if addr is not None else self.standin(src, relay_id)), ""

    def relayed_opened(self, addr: Address, src: bytes, relay_id: bytes, relay: Address, now: float) -> None:
        """What came through ``relay`` at ``addr`` opened under a token bound to ``src``: answers go back through
        it; and ``src``, with no path to this node, gets the relay as its path once it is confirmed."""
        if addr != self._relayed_addr(src, relay_id, relay):
            self._use_standin(addr, src, relay_id, relay)
        if (src in self._via or src in self._confirming or src in self.active or self._answers_recently(src, now)
                or len(self._confirming) >= MAX_ACTIVE):
            return
        if src in self.reached:  # it answered this node directly: no relay for it (not counted: per datagram)
            return
        real = self.target_addr.get(src)
        if real is None and self.contact_of is not None:
            real = self.contact_of(src)
        if real is not None and (real == relay or real in self.relays):
            real = None
        self._confirming.add(src)
        trial = _Trial(src, addr, [relay_id], confirm=True, final=real if real is not None else addr, relay=relay)
        if real is None:
            self._try_next(trial, now)
        else:
            self._direct_check(src, real, relay_id, lambda outcome, t: self._checked(trial, outcome, t))

    def forget_relay(self, addr: Address) -> None:
        """The endpoint dropped ``addr``'s relay itself (a punched path replaced it)."""
        self.relays.pop(addr, None)

    # -- queries ----------------------------------------------------------------------------------------
    @property
    def verdict(self) -> str:
        return self.reach.verdict

    def relay_of(self, addr: Address) -> RelayEntry | None:
        return self.relays.get(addr)

    def relay_entry(self, node_id: bytes) -> RelayEntry | None:
        """(peer, relay id, relay address) of ``node_id``'s confirmed relayed path, if it has one."""
        via = self._via.get(node_id)
        return (node_id, via[0], via[1]) if via is not None else None

    def peers_known(self, now: float) -> list[bytes]:
        """Peers this node can talk to: answered it directly within ``KNOWN_S`` (a NAT forgets a mapping after
        120 s), or reached through a relay."""
        out = {n for n, t in self._answered_at.items() if now - t <= KNOWN_S and n in self.reached}
        out.update(n for n, k in self.kind.items() if k == "relayed")
        return sorted(out)

    def path_to(self, addr: Address, node_id: bytes, now: float) -> str | None:
        """How this node talks to ``node_id`` at ``addr`` now: "direct", "punched", "relayed", or None (no path
        known: it has not answered this node there)."""
        addr = self.aliases.get(addr, addr)
        if addr in self.relays:
            return "relayed"
        if self.reached.get(node_id) == addr or self._recent_source(node_id, now) == addr:
            return "punched" if self.kind.get(node_id) == "punched" else "direct"
        return None

    def elsewhere(self, node_id: bytes, addr: Address, now: float) -> Address | None:
        """Another address ``node_id`` can be sent to: where it answered this node, else where an authenticated
        request from it came from within ``HEARD_S`` (its NAT maps it toward this node there: a symmetric NAT's
        port for this node, which its published address is not)."""
        for candidate in (self.reached.get(node_id), self._recent_source(node_id, now)):
            if candidate is not None and candidate != addr and candidate not in self.relays:
                return candidate
        return None

    def attempts(self, node_id: bytes) -> int:
        return self._attempts.get(node_id, 0)

    def dht_named(self, node_id: bytes) -> set[Address]:
        """The addresses the DHT named ``node_id`` at: in a NODES answer (``named_at``), in the routing table."""
        out = set()
        named = self.named_at.get(node_id)
        if named is not None:
            out.add(named)
        contact = self.contact_of(node_id) if self.contact_of is not None else None
        if contact is not None:
            out.add(contact)
        return out

    def standin(self, node_id: bytes, relay_id: bytes) -> Address:
        """A reply-only address for ``node_id`` through ``relay_id`` (from 240.0.0.0/4 or 100::/64, never routed):
        only this node's relay table knows it, so nothing but answers to what came through that relay goes
        there."""
        digest = hashlib.sha256(b"peerd relayed " + node_id + relay_id).digest()
        if self.ipv6:
            host = str(ipaddress.IPv6Address(b"\x01\x00" + bytes(6) + digest[:8]))
        else:
            host = str(ipaddress.IPv4Address(bytes([240 | (digest[0] & 0x0F)]) + digest[1:4]))
        return (host, 1 + int.from_bytes(digest[4:6], "big") % 65535)

    # -- the machine ------------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Move the parts' actions into this core's queue, acting on punch outcomes."""
        self._actions += self.reach.take_actions()
        for a in self.puncher.take_actions():
            if isinstance(a, Ping):
                self._ping(a.node_id, a.addr, self._punch_pong, (a.node_id, a.addr), PUNCH_PING_S, 1)
            elif isinstance(a, Punched):
                self.kind[a.node_id] = "punched"
                self.relays.pop(a.addr, None)  # (the endpoint's set_punched drops it too)
                self._actions.append(SetPunched(a.addr))
                target = self.target_addr.get(a.node_id)
                if target is not None and target != a.addr:  # it answers elsewhere than where it was asked for
                    self._set_alias(target, a.addr)
                self.active.discard(a.node_id)
            elif isinstance(a, Direct):  # it answered where it was asked: the lost request was loss, not a NAT
                target = self.target_addr.get(a.node_id)
                if target is not None and target != a.addr:
                    self._set_alias(target, a.addr)
                self.active.discard(a.node_id)
            elif isinstance(a, Failed):
                self.punch_failed(a.node_id, a.introduced, self._now)
            else:
                self._actions.append(a)

    def _punch_pong(self, answered_by: bytes | None, now: float, node_id: bytes, addr: Address) -> None:
        """A punch or keepalive PING was answered (by ``answered_by``) or not (None)."""
        if answered_by == node_id:
            self.puncher.receive_pong(node_id, addr, now)

    def punch_failed(self, node_id: bytes, introduced: bool, now: float) -> None:
        """The punch to ``node_id`` failed (``introduced``: an introducer vouched for it): relay, with evidence."""
        addr = self.target_addr.get(node_id)
        if not introduced:  # no introducer has reached it: nothing says it exists, let alone behind a NAT
            self._refuse("unintroduced")
        elif node_id in self.reached:  # it answered this node directly: its silence is loss, not a NAT
            self._refuse("answered_before")
        elif addr is not None:
            intro_id = self.introducer.get(node_id)
            order = [intro_id] if intro_id is not None else []
            order += [n for n in reversed(self.reached) if n != intro_id]
            relays = [n for n in order if n is not None and self._relay_candidate(n, node_id, addr)]
            if relays:
                trial = _Trial(node_id, addr, relays)
                self._direct_check(node_id, addr, relays[0], lambda outcome, t: self._checked(trial, outcome, t))
                return
        self.active.discard(node_id)

    def _relay_candidate(self, relay_id: bytes, node_id: bytes, addr: Address) -> bool:
        """Whether ``relay_id`` could relay to ``node_id`` at ``addr``: reached directly, and not the target."""
        relay = self.reached.get(relay_id)
        return relay is not None and relay_id != node_id and relay != addr and relay not in self.relays

    def _direct_check(self, node_id: bytes, addr: Address, control_id: bytes,
                      then: Callable[[str, float], None]) -> None:
        """PING ``node_id`` at ``addr`` directly and, at the same time, ``control_id`` where it answered: one more
        chance to answer before relaying (a punch also fails on a lossy path the peer answers on), and a test
        of this node's own link (both silent: it is lossy or flooded, and a relay would not help)."""
        check = _Check(then)
        control = self.reached.get(control_id)
        if control is None:
            check.control = False
        else:
            self._ping(control_id, control, self._check_answer, (check, "control", control_id), DIRECT_RETRY_S,
                       DIRECT_RETRIES)
        self._ping(node_id, addr, self._check_answer, (check, "target", node_id), DIRECT_RETRY_S, DIRECT_RETRIES)

    def _check_answer(self, answered_by: bytes | None, now: float, check: _Check, which: str, node_id: bytes) -> None:
        setattr(check, which, answered_by == node_id)
        if check.target is None or check.control is None:
            return
        if check.target:
            check.then("direct", now)
        elif not check.control:
            self._refuse("lossy")
            check.then("lossy", now)
        else:
            check.then("silent", now)

    def _checked(self, trial: _Trial, outcome: str, now: float) -> None:
        if outcome == "silent":
            self._try_next(trial, now)
        else:
            self._end(trial)

    def _try_next(self, trial: _Trial, now: float) -> None:
        """PING ``trial.node_id`` through the next relay (a confirmation: through the one it spoke through)."""
        if trial.confirm:
            if trial.tried:
                self._end(trial)
                return
            trial.tried += 1
            self._ping(trial.node_id, trial.addr, self._relay_answer, (trial, trial.relays[0], trial.relay), None, 2,
                       direct=False)
            return
        while trial.relays:
            relay_id = trial.relays.pop(0)
            relay = self.reached.get(relay_id)
            if relay is None or not self._relay_candidate(relay_id, trial.node_id, trial.addr):
                continue
            if trial.tried >= RELAY_TRIES:
                break
            trial.tried += 1
            self._set_relay(trial.addr, trial.node_id, relay_id, relay)
            self._ping(trial.node_id, trial.addr, self._relay_answer, (trial, relay_id, relay), None, 2, direct=False)
            return
        self._end(trial)

    def _relay_answer(self, answered_by: bytes | None, now: float, trial: _Trial, relay_id: bytes,
                      relay: Address) -> None:
        node_id = trial.node_id
        if trial.confirm:
            if (answered_by == node_id and node_id not in self._via and node_id not in self.active
                    and not self._answers_recently(node_id, now)):
                self._use_relay(node_id, relay_id, relay, trial.final or trial.addr)
            self._end(trial)
            return
        if answered_by is None:
            self._clear_relay(trial.addr)
            self._try_next(trial, now)
            return
        if answered_by != node_id:
            self._clear_relay(trial.addr)
        else:
            self._use_relay(node_id, relay_id, relay, trial.addr)
        self._end(trial)

    def _end(self, trial: _Trial) -> None:
        (self._confirming if trial.confirm else self.active).discard(trial.node_id)

    def _checked_direct(self, answered_by: bytes | None, now: float, node_id: bytes, addr: Address,
                        entry: RelayEntry | None) -> None:
        """A relayed peer heard directly was PINGed there: answered, ``receive_answer`` dropped the relay;
        else the relay set aside comes back."""
        if entry is not None and node_id in self._via and addr not in self.relays:
            self._set_relay(addr, *entry)

    def _reached(self, node_id: bytes, addr: Address, now: float) -> None:
        self.reached[node_id] = addr
        self._answered_at[node_id] = now
        self.reached.move_to_end(node_id)
        while len(self.reached) > MAX_REACHED:
            gone, _ = self.reached.popitem(last=False)
            self._answered_at.pop(gone, None)
            self.reach.remove_peer(gone)
        self.reach.add_peer(node_id, addr)
        if node_id in self._via:
            self._drop_relay(node_id, addr)
        self.puncher.receive_answer(node_id, addr, now)
        if self.started and self.reach.verdict == UNKNOWN:
            self.reach.soon(2.0, now)  # undecided for want of peers: a new one may be enough

    def heard_within(self, seconds: float, now: float) -> set[bytes]:
        """Reached peers that answered or sent a request within ``seconds`` (their NAT's flow here is open)."""
        out = {n for n, t in self._answered_at.items() if now - t <= seconds}
        out.update(n for n, (_, t) in self._heard_at.items() if now - t <= seconds and n in self.reached)
        return out

    def _recent_source(self, node_id: bytes, now: float) -> Address | None:
        entry = self._heard_at.get(node_id)
        return entry[0] if entry is not None and now - entry[1] <= HEARD_S else None

    def _answers_recently(self, node_id: bytes, now: float) -> bool:
        """Whether ``node_id`` answered this node directly within ``KNOWN_S`` (then it needs no relay)."""
        return node_id in self.reached and now - self._answered_at.get(node_id, -math.inf) <= KNOWN_S

    def _relayed_addr(self, src: bytes, relay_id: bytes, relay: Address) -> Address | None:
        """The address this node uses for ``src`` through ``relay``: its confirmed relayed path, or the one a
        relay trial set up there; None if neither."""
        via = self._via.get(src)
        if via is not None and via[0] == relay_id and via[1] == relay:
            return via[2]
        target = self.target_addr.get(src)
        if target is not None and self.relays.get(target) == (src, relay_id, relay):
            return target
        return None

    def _use_standin(self, addr: Address, src: bytes, relay_id: bytes, relay: Address) -> None:
        self._set_relay(addr, src, relay_id, relay)
        standins = self._standins
        standins[addr] = src
        standins.move_to_end(addr)
        while len(standins) > MAX_STANDINS:
            gone, node_id = standins.popitem(last=False)
            via = self._via.get(node_id)
            if via is None or via[2] != gone:
                self._clear_relay(gone)

    def _use_relay(self, node_id: bytes, relay_id: bytes, relay: Address, addr: Address) -> None:
        """``node_id`` answered a PING through ``relay``: from now on what goes to ``addr`` goes through it."""
        self._set_relay(addr, node_id, relay_id, relay)
        self._standins.pop(addr, None)
        via = self._via
        via[node_id] = (relay_id, relay, addr)
        via.move_to_end(node_id)
        self.kind[node_id] = "relayed"
        while len(via) > MAX_REACHED:
            self._drop_relay(next(iter(via)), None)

    def _drop_relay(self, node_id: bytes, direct: Address | None) -> None:
        """``node_id`` answered directly (at ``direct``), or is forgotten (None): its relayed path goes, and what
        was sent to it through the relay goes to where it answered."""
        if self._via.pop(node_id, None) is None:
            return
        if self.kind.get(node_id) == "relayed":
            del self.kind[node_id]
        for addr, entry in list(self.relays.items()):
            if entry[0] == node_id and addr not in self._standins:
                self._clear_relay(addr)
                if direct is not None and addr != direct:
                    self._set_alias(addr, direct)

    def _discover(self, now: float) -> None:
        """Set paths up to peers the DHT named (NODES) that this node cannot talk to yet, a few per pass, each
        again after ``RETRY_DISCOVER_FIRST_S``, then twice as long each time up to ``RETRY_DISCOVER_S``: so
        ``peers_known`` fills, and a group's members have their paths before tensor data (which has no retries)
        goes out. A first try while the swarm forms can fail for what passes in seconds (a relay that has no
        verdict yet, or has not reached one end), and a member without a path for minutes holds up averages."""
        known = set(self.peers_known(now))
        started = 0
        for node_id in reversed(self.introducer):
            if started >= DISCOVER_PER_PASS or len(self.connecting) >= MAX_ACTIVE:
                break
            addr = self.named_at.get(node_id)
            at, tries = self._tried.get(node_id, (-math.inf, 0))
            wait = min(RETRY_DISCOVER_S, RETRY_DISCOVER_FIRST_S * 2 ** max(0, tries - 1))
            if node_id in known or addr is None or now - at < wait:
                continue
            self._tried[node_id] = (now, min(tries + 1, 16))
            started += 1
            self.unreached(addr, node_id, now)
        if len(self._tried) > MAX_INTRODUCERS:
            self._tried = {n: t for n, t in self._tried.items() if now - t[0] < RETRY_DISCOVER_S}

    def _keepalives(self) -> None:
        """Hold open the NAT mappings this node depends on (a NAT forgets an idle UDP flow after 30 s): toward
        every relay it uses, and, when it is behind a NAT, toward the 2 peers that answered it last (so that
        an introducer's CONNECT and a relay's RELAYED can still come in)."""
        targets: dict[Address, bytes] = {}
        for relay_id, relay, _addr in list(self._via.values())[:64]:
            targets[relay] = relay_id
        if self.reach.verdict in ("cone-nat", "symmetric-nat"):
            for node_id in list(reversed(self.reached))[:2]:
                targets.setdefault(self.reached[node_id], node_id)
        for addr, node_id in targets.items():
            self._ping(node_id, addr, self._punch_pong, (node_id, addr), PUNCH_PING_S, 1)

    # -- the endpoint's tables, mirrored ------------------------------------------------------------------
    def _ping(self, node_id: bytes, addr: Address, then: Callable[..., None], args: tuple,
              timeout: float | None, attempts: int, direct: bool = True) -> None:
        token = self._next_token
        self._next_token += 1
        self._waits[token] = (then, args, direct)
        self._actions.append(SendPing(token, node_id, addr, timeout, attempts))

    def _set_relay(self, addr: Address, peer_id: bytes, relay_id: bytes, relay: Address) -> None:
        self.relays[addr] = (peer_id, relay_id, relay)
        self._actions.append(SetRelay(addr, peer_id, relay_id, relay))

    def _clear_relay(self, addr: Address) -> None:
        self.relays.pop(addr, None)
        self._actions.append(ClearRelay(addr))

    def _set_alias(self, addr: Address, to: Address) -> None:
        if addr == to:
            self.aliases.pop(addr, None)
        else:
            if addr not in self.aliases and len(self.aliases) >= MAX_ALIASES:
                self.aliases.pop(next(iter(self.aliases)))
            self.aliases[addr] = to
        self._actions.append(SetAlias(addr, to))

    def _refuse(self, why: str) -> None:
        self.no_relay[why] = self.no_relay.get(why, 0) + 1

