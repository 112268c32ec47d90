"""Reachability, sans I/O: what a node's NAT does to it, learned by verification only (PROTOCOL.md section 18).

The node asks several peers where they see it (OBSERVE -> OBSERVED ``seen``). One seen address from every
observer: one mapping for all destinations (no NAT, or a cone NAT). Different seen addresses: the NAT maps per
destination (``symmetric-nat``). Then it asks a helper to have a *third* node, one it has not sent to, PROBE it
unsolicited at the seen address (REACH_PROBE); the PROBE arriving proves that anyone can reach it (``public``);
none arriving within ``probe_timeout`` from ``probes`` helpers: only peers it sent to first can (``cone-nat``; a
PROBE from an address it sent to proves nothing and does not count, and a node its observers saw untranslated runs
again ``reruns_public`` times first).
Address ranges never decide anything (a private address can be reachable in a LAN, a public one firewalled).

The shell feeds in peers it has reached, answers, probes and ``now``; the core queues actions (``Observe``,
``AskProbe``, drained by ``take_actions``) and says when it wakes (``get_timer``/``handle_timer``). Randomness
(nonces, helper choice) comes from the injected rng.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

PUBLIC, CONE, SYMMETRIC, UNKNOWN = "public", "cone-nat", "symmetric-nat", "unknown"
VERDICTS = (PUBLIC, CONE, SYMMETRIC, UNKNOWN)

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Observe:
    """Send OBSERVE to ``node_id`` at ``addr``; report ``receive_observed`` or ``request_failed``."""

    node_id: bytes
    addr: Address


@dataclass(frozen=True, slots=True)
class AskProbe:
    """Send REACH_PROBE(``nonce``, ``avoid``) to the helper; report ``receive_probe_asked``."""

    node_id: bytes
    addr: Address
    nonce: bytes
    avoid: tuple[bytes, ...]


Action = Observe | AskProbe


@dataclass(slots=True)
class _Probe:
    nonce: bytes
    helper: bytes
    deadline: float


@dataclass(frozen=True, slots=True)
class ReachStatistics:
    verdict: str
    basis: str
    observed_addr: Address | None
    changed_at: float
    peers: int  # possible observers and helpers
    probes_proved: int = 0  # PROBEs that proved ``public``
    probes_late: int = 0  # ... of them, after their helper's time ran out
    probes_solicited: int = 0  # PROBEs of this node's nonce from an address it had sent to: proved nothing
    probes_unknown: int = 0  # PROBEs with no nonce of the current run
    reruns: int = 0  # runs repeated because a public-looking node's arranged probes never came


@dataclass(slots=True)
class Reach:
    """One node's reachability. ``observers``: distinct peers whose OBSERVED answers decide the mapping;
    ``probes``: helpers asked before it settles on ``cone-nat``; ``recheck``: seconds between runs once
    settled (a router reboot or a new network changes everything)."""

    rng: random.Random
    observers: int = 3
    probes: int = 2
    probe_timeout: float = 4.0
    observe_timeout: float = 3.0
    recheck: float = 300.0
    max_avoid: int = 16
    reruns_public: int = 2  # runs repeated, ``rerun_s`` apart, before a public-looking node settles on cone-nat
    rerun_s: float = 5.0
    verdict: str = UNKNOWN
    observed_addr: Address | None = None
    changed_at: float = 0.0
    _peers: dict[bytes, Address] = field(default_factory=dict)  # peers reached (node id -> address)
    _seen: dict[bytes, Address] = field(default_factory=dict)  # observer -> where it saw this node
    _asked: dict[bytes, float] = field(default_factory=dict)  # observer asked -> deadline
    _failed: set[bytes] = field(default_factory=set)
    _helpers_tried: list[bytes] = field(default_factory=list)
    _probe: _Probe | None = None
    _nonces: set[bytes] = field(default_factory=set)  # every probe asked for in this run (a late one still proves)
    _sent_to: dict[Address, float] = field(default_factory=dict)  # recent destinations (shell reports them)
    _heard: dict[Address, bytes] = field(default_factory=dict)  # requests' sources -> sender (answered there)
    _next_run: float = float("inf")  # not before ``start``
    _running: bool = False
    _arranged: set[bytes] = field(default_factory=set)  # nonces of this run whose helper found a prober
    _solicited: set[bytes] = field(default_factory=set)  # ... whose PROBE came from an address this node sent to
    _reruns_left: int = 0
    _rerun: bool = False  # the next run repeats this one (its nonces still prove)
    local: set[Address] = field(default_factory=set)  # this node's own socket addresses (the shell's view)
    probe_source: Address | None = None  # where the PROBE that proved ``public`` came from
    basis: str = ""  # why the verdict: "probe", "no-probe", "mappings", "no-translation"
    _actions: list[Action] = field(default_factory=list)
    probes_proved: int = 0
    probes_late: int = 0
    probes_solicited: int = 0
    probes_unknown: int = 0
    reruns: int = 0

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def statistics(self) -> ReachStatistics:
        return ReachStatistics(self.verdict, self.basis, self.observed_addr, self.changed_at, len(self._peers),
                               self.probes_proved, self.probes_late, self.probes_solicited, self.probes_unknown,
                               self.reruns)

    # -- inputs -----------------------------------------------------------------------------------------
    def add_peer(self, node_id: bytes, addr: Address) -> None:
        """A peer this node has reached (it answered a request): a possible observer or helper."""
        if len(self._peers) < 256 or node_id in self._peers:
            self._peers[node_id] = addr

    def remove_peer(self, node_id: bytes) -> None:
        self._peers.pop(node_id, None)

    def datagram_sent(self, addr: Address, now: float) -> None:
        """This node sent a datagram to ``addr`` (a probe from there would not be unsolicited)."""
        sent_to = self._sent_to
        sent_to[addr] = now
        if len(sent_to) > 4096:
            for key in list(sent_to)[:1024]:  # insertion order: the oldest first
                del sent_to[key]

    def receive_request(self, node_id: bytes, source: Address, now: float) -> None:
        """A request from ``node_id`` came in from ``source`` (this node answers it there): a peer it sends to
        that it may not have reached itself, to be avoided as a prober like those it has."""
        heard = self._heard
        heard.pop(source, None)
        heard[source] = node_id
        if len(heard) > 4096:
            for key in list(heard)[:1024]:  # insertion order: the oldest first
                del heard[key]

    def receive_observed(self, node_id: bytes, seen: Address, now: float) -> None:
        if self._asked.pop(node_id, None) is None:
            return  # nobody asked it (or its time was up)
        self._seen[node_id] = seen

    def request_failed(self, node_id: bytes, now: float) -> None:
        """An OBSERVE or REACH_PROBE got no answer."""
        self._asked.pop(node_id, None)
        self._failed.add(node_id)
        if self._probe is not None and self._probe.helper == node_id:
            self._probe.deadline = now  # no answer: no probe will come; try the next helper

    def receive_probe_asked(self, node_id: bytes, ok: bool, now: float) -> None:
        """The helper's REACH_PROBED: ``ok`` false means it had no third node to ask."""
        if self._probe is None or self._probe.helper != node_id:
            return
        if ok:
            self._arranged.add(self._probe.nonce)
        else:
            self._probe.deadline = now

    def receive_probe(self, nonce: bytes, source: Address, now: float) -> bool:
        """A PROBE arrived from ``source``. True when it proves this node reachable: it carries the nonce of
        a probe asked for in this run (one that arrives after its helper's time ran out, even after a ``cone-nat``
        verdict, proves as much as a prompt one) and comes from an address this node has not sent to within
        ``NAT_WINDOW`` (else its own NAT's mapping let it in, which proves nothing)."""
        if nonce not in self._nonces:
            self.probes_unknown += 1
            return False
        last = self._sent_to.get(source)
        if last is not None and now - last <= NAT_WINDOW:
            # its own NAT would have let it in: it proves nothing either way, so that helper's try does not
            # count towards ``cone-nat`` and the next helper is asked at once
            self.probes_solicited += 1
            self._solicited.add(nonce)
            if self._probe is not None and self._probe.nonce == nonce:
                self._probe.deadline = min(self._probe.deadline, now)
            return False
        self.probes_proved += 1
        if self._probe is None or self._probe.nonce != nonce or now >= self._probe.deadline:
            self.probes_late += 1
        self._probe = None
        self.probe_source = source
        self._settle(PUBLIC, now, "probe")
        return True

    # -- the machine ------------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Run again now (the shell calls it at startup, when the network changed, or after peers came)."""
        self._next_run = now
        self._running = False
        self._rerun = False
        self._reruns_left = self.reruns_public

    def soon(self, delay: float, now: float) -> None:
        """Run within ``delay`` seconds if idle (a new peer while undecided)."""
        if not self._running and self._next_run > now + delay:
            self._next_run = now + delay

    def get_timer(self) -> float:
        """When ``handle_timer`` has something to do next."""
        times = [self._next_run] if not self._running else []
        times += self._asked.values()
        if self._probe is not None:
            times.append(self._probe.deadline)
        return min(times) if times else self._next_run

    def handle_timer(self, now: float) -> None:
        actions = self._actions
        if not self._running:
            if now < self._next_run:
                return
            self._running = True
            self._seen.clear()
            self._asked.clear()
            self._failed.clear()
            self._helpers_tried.clear()
            self._probe = None
            if not self._rerun:
                self._nonces.clear()
            self._rerun = False
            self._arranged.clear()
            self._solicited.clear()
        for node_id, deadline in list(self._asked.items()):
            if now >= deadline:
                self.request_failed(node_id, now)
        # 1. observers, until ``observers`` answered (or nobody is left to ask)
        if len(self._seen) + len(self._asked) < self.observers:
            fresh = [n for n in sorted(self._peers) if n not in self._seen and n not in self._asked
                     and n not in self._failed]
            self.rng.shuffle(fresh)
            for node_id in fresh[: self.observers - len(self._seen) - len(self._asked)]:
                self._asked[node_id] = now + self.observe_timeout
                actions.append(Observe(node_id, self._peers[node_id]))
        if self._asked:
            return  # wait for the observers
        seen = set(self._seen.values())
        if not seen:
            self._give_up(now)
            return
        if len(seen) > 1:
            self.observed_addr = max(seen, key=list(self._seen.values()).count)
            self._settle(SYMMETRIC, now, "mappings")
            return
        self.observed_addr = next(iter(seen))
        # 2. probes from a third node
        probe = self._probe
        if probe is not None and now < probe.deadline:
            return
        if probe is not None:
            self._probe = None
        helpers = [n for n in sorted(self._seen) if n not in self._helpers_tried and n not in self._failed]
        if not helpers:
            helpers = [n for n in sorted(self._peers) if n not in self._helpers_tried and n not in self._failed]
        if len(self._helpers_tried) >= self.probes + min(len(self._solicited), self.probes) or not helpers:
            self._no_probe(now)
            return
        helper = self.rng.choice(helpers)
        self._helpers_tried.append(helper)
        nonce = self.rng.getrandbits(128).to_bytes(16, "big")
        self._probe = _Probe(nonce, helper, now + self.probe_timeout)
        self._nonces.add(nonce)
        actions.append(AskProbe(helper, self._peers[helper], nonce, self._avoid(now)))

    def _avoid(self, now: float) -> tuple[bytes, ...]:
        """Node ids of peers this node sent to recently: a probe from them would pass its own NAT's filter."""
        last: dict[bytes, float] = {}
        for addr, node_id in [*self._heard.items(), *((a, n) for n, a in self._peers.items())]:
            t = self._sent_to.get(addr)
            if t is not None and now - t <= NAT_WINDOW and t > last.get(node_id, -1.0):
                last[node_id] = t
        ids = sorted(last, key=lambda n: -last[n])  # the most recent first
        return tuple(ids[: self.max_avoid])

    def _no_probe(self, now: float) -> None:
        """No unsolicited PROBE came. Probes were sent and lost in its NAT's filter: ``cone-nat`` (one mapping,
        seen by at least 2 observers). None could be arranged (every candidate prober is a peer this node
        sent to, or every probe came from one) and no observer saw a translated address: ``public`` on that
        evidence; the observers saw one translated address (a small swarm leaves no third node): ``cone-nat``.
        Else undecided. A node that sees no translation runs again soon, ``reruns_public`` times, before it
        settles on ``cone-nat``: a PROBE_ASK is one datagram, and a prober's NAT may have forgotten its helper."""
        arranged = len(self._arranged - self._solicited)
        translated = self.observed_addr not in self.local
        if arranged and len(self._seen) >= 2 and not translated and self._reruns_left > 0:
            self._reruns_left -= 1
            self.reruns += 1
            self._rerun = True
            self._running = False
            self._next_run = now + self.rerun_s
        elif arranged and len(self._seen) >= 2:
            self._settle(CONE, now, "no-probe")
        elif not arranged and not translated:
            self._settle(PUBLIC, now, "no-translation")
        elif len(self._seen) >= 2 and self._helpers_tried and translated:
            self._settle(CONE, now, "no-probe")
        else:
            self._give_up(now)

    def _give_up(self, now: float) -> None:
        """Not enough peers to decide: stay as it is and try again soon."""
        self._running = False
        self._next_run = now + min(self.recheck, 30.0)

    def _settle(self, verdict: str, now: float, basis: str) -> None:
        self._reruns_left = self.reruns_public
        if verdict != self.verdict:
            self.changed_at = now
        self.verdict = verdict
        self.basis = basis
        self._running = False
        self._asked.clear()
        self._next_run = now + self.recheck


PROBER_FRESH_S = 20.0  # a prober heard from this recently still has its NAT's flow toward the helper (30 s unreplied)
NAT_WINDOW = 180.0  # seconds a NAT may keep a filter open after this node sent (Linux: 30 s unreplied, 120 s replied)


def choose_prober(requester: bytes, avoid: tuple[bytes, ...] | list[bytes], reached: dict[bytes, Address],
                  rng: random.Random, fresh: Collection[bytes] = ()) -> tuple[bytes, Address] | None:
    """The helper's side of REACH_PROBE: a third node it has reached itself, neither the requester nor one the
    requester asked it to avoid (peers the requester sent to: their probe would pass its NAT's filter); one of
    ``fresh`` (heard from within ``PROBER_FRESH_S``) when it can: the PROBE_ASK is one datagram, and a NATed
    prober's router lets it in only while the flow toward this helper is fresh."""
    skip = set(avoid)
    skip.add(requester)
    candidates = sorted(n for n in reached if n not in skip)
    if not candidates:
        return None
    recent = [n for n in candidates if n in fresh]
    if recent:
        candidates = recent
    node_id = rng.choice(candidates)
    return node_id, reached[node_id]


@dataclass(slots=True)
class ProbeLimiter:
    """The prober's side of PROBE_ASK: a member can make this node send unsolicited PROBEs to an address of its
    choosing, so it sends at most ``per_target`` per ``window`` seconds to one IP and ``total`` per window in
    all (one PROBE per PROBE_ASK, of about its size: no amplification)."""

    per_target: int = 2
    total: int = 20
    window: float = 10.0
    _sent: dict[str, list[float]] = field(default_factory=dict)
    refused: int = 0

    def allow(self, host: str, now: float) -> bool:
        cut = now - self.window
        self._sent = {h: kept for h, ts in self._sent.items() if (kept := [t for t in ts if t > cut])}
        mine = self._sent.get(host, [])
        if len(mine) >= self.per_target or sum(map(len, self._sent.values())) >= self.total:
            self.refused += 1
            return False
        self._sent.setdefault(host, []).append(now)
        return True
