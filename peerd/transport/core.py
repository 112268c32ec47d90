"""The transport's decisions, sans-I/O: every input carries ``now``, request ids come from an injected rng.

- **Requests.** ``open_request`` draws a request id (never one already pending) and queues its first
  ``Transmit``; ``handle_timer`` queues what a request whose wait ran out needs (``Transmit`` again, or
  ``Expired``), and the answer's arrival queues ``Answered``: the shell carries these out from ``take_actions``,
  like every other action. The schedule: the first wait is the destination's learned retransmission timeout
  (``rto``, never above the caller's ``timeout``), each later wait doubles, and the request gives up when the
  fixed schedule ``timeout, 2*timeout, ...`` (``attempts`` waits) would have ended. Karn's rule: only an answer to
  a request sent once is a round-trip sample; a first wait that runs out backs the destination off (RFC 6298 5.5).
  At most ``max_pending`` requests are open at once; an expired one is closed by the core, an answered one keeps
  its id (a second answer is dropped unseen) until its caller ``close``s it.
- **Demultiplexing.** ``receive_message`` takes an authenticated control message and queues what it asks of the
  shell: the answer to a pending request (``Answered``), the PONG to this node's address-validation PING
  (``AddressValidated``), a message for a registered handler (``Deliver``), or nothing for one this node does not
  expect (a late answer, an unsolicited response: counted ``unexpected``).
- **Outsiders.** The amplification guard, the answers held for addresses not yet validated, the validation
  challenges, and the rationing of authentication failures (``AuthLimiter``) live here, bounded.
- **Receivers.** Which node id is at which address (an LRU), to seal each datagram for its receiver.
- **Receiving.** What a receive pass accepts, refuses, handles first and counts, and the pause after it: the
  ``ReceivePolicy`` (transport/receive.py) at ``receiving``; ``receive_pass`` queues one ``PassDecision`` per
  pass among the actions.

The trio endpoint (transport/endpoint.py) seals, sends, waits until ``get_timer`` and carries out the actions;
the tests drive this class directly in virtual time.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ..entropy import default_rng
from .guard import AmplificationGuard, AuthLimiter, NativeAuthLimiter
from .guard import auth_limiter as default_auth_limiter
from .paths import Paths
from .receive import JUNK_IDLE_PAUSE_S, JUNK_PAUSE_S, PassDecision, ReceivePolicy, ReceiveStatistics
from .rto import RtoEstimator

MAX_PENDING = 16384  # requests open at once (a DHT lookup has alpha=3 in flight; thousands mean a bug or a flood)
MAX_KNOWN_IDS = 4096  # addresses whose node id this node remembers (LRU), to seal for their receiver
MAX_HELD_ADDRESSES = 256  # unvalidated addresses with answers held until their address validation completes
MAX_HELD_PER_ADDRESS = 4
RID_DRAWS = 64  # attempts at a fresh request id before the pending map is called full (2^64 ids: never reached)

PING = 0x01
PONG = 0x02
ERROR = 0x0F


class PendingFull(Exception):
    """No room for another open request (``max_pending``)."""


@dataclass(frozen=True, slots=True)
class Transmit:
    """Send request ``rid`` now. ``attempt`` 0 is the first transmission."""

    rid: int
    attempt: int


@dataclass(frozen=True, slots=True)
class Answered:
    """The request's answer (the message ``receive_message`` was given); ``rtt`` is the Karn sample taken, or
    None. The request stays open until its caller ``close``s it."""

    rid: int
    reply: Any
    rtt: float | None
    attempts: int


@dataclass(frozen=True, slots=True)
class Expired:
    """No answer within the schedule (the core closed the request); ``waited``: from the first transmission to
    the deadline."""

    rid: int
    waited: float
    attempts: int


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """A snapshot of the core: open requests, addresses with held answers, open validations, the receive loop."""

    open_requests: int
    held_addresses: int
    challenges: int
    receiving: ReceiveStatistics


@dataclass(frozen=True, slots=True)
class AddressValidated:
    """``addr`` answered this node's validating PING: send what was held for it (``release``)."""

    addr: Hashable


@dataclass(frozen=True, slots=True)
class Deliver:
    """A message for the handler registered for ``mtype`` (its answer, if any, goes back to ``source``)."""

    mtype: int
    rid: int
    source: Hashable
    message: Any


RequestAction = Transmit | Answered | Expired  # what one request needs: its caller carries these out
Action = Transmit | Answered | Expired | AddressValidated | Deliver | PassDecision


@dataclass(slots=True)
class Pending:
    """One open request: where it goes, what answers it, and where it is in its schedule."""

    rid: int
    addr: Hashable
    expect: int  # the response type (an ERROR answers too)
    deadline: float
    wait: float  # the current wait after a transmission
    start: float = 0.0
    sent_at: float | None = None  # last transmission; None before the first
    next_at: float = 0.0  # when the current wait ends
    attempts: int = 0
    reply: Any = None
    karn: bool = True  # no wait has run out yet: an answer now is an unambiguous round trip
    done: bool = False


class TransportCore:
    """Request matching, retransmission schedule, demultiplexing and outsider bookkeeping for one node.

    ``rng``: draws request ids and validation challenges (a daemon passes one seeded from os entropy; tests and the
    simulator a seeded ``random.Random``)."""

    def __init__(
        self,
        rng: random.Random,
        *,
        rto: RtoEstimator | None = None,
        guard: AmplificationGuard | None = None,
        auth_limiter: AuthLimiter | NativeAuthLimiter | None = None,
        max_pending: int = MAX_PENDING,
        max_known_ids: int = MAX_KNOWN_IDS,
        max_held_addresses: int = MAX_HELD_ADDRESSES,
        max_held_per_address: int = MAX_HELD_PER_ADDRESS,
        junk_pause_s: float = JUNK_PAUSE_S,
        junk_idle_pause_s: float = JUNK_IDLE_PAUSE_S,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.rng = rng
        self.rto = rto or RtoEstimator()
        self.guard = guard or AmplificationGuard()
        # the C table where the native receive pass runs (it rations junk in C); its hash seed only places entries,
        # every decision is the same whatever it is, so it need not come from ``rng``
        self.auth_limiter = auth_limiter or default_auth_limiter(default_rng(None).getrandbits(64))
        self.max_pending = max_pending
        self.max_known_ids = max_known_ids
        self.max_held_addresses = max_held_addresses
        self.max_held_per_address = max_held_per_address
        # what a receive pass accepts, refuses and counts, and the pause after it (transport/receive.py)
        self.receiving = ReceivePolicy(self.auth_limiter, junk_pause_s=junk_pause_s,
                                       junk_idle_pause_s=junk_idle_pause_s)
        self._pending: dict[int, Pending] = {}
        self._handled: dict[int, int] = {}  # registered message type -> its response type (itself: one-way)
        self._ids: OrderedDict[Hashable, bytes] = OrderedDict()
        self._held: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self._challenges: OrderedDict[int, Hashable] = OrderedDict()  # rid of a validating PING -> its address
        self._actions: list[Action] = []  # what the inputs asked of the shell, until take_actions
        self._waits: list[tuple[float, int]] = []  # (when a request's wait ends, its rid): a heap, stale entries kept
        self.paths = Paths(max_known_ids)  # where datagrams to each peer go (NAT traversal), and the counts per path

    # -- ids -------------------------------------------------------------------------------------------------
    def new_id(self) -> int:
        """A 64-bit id for a message that expects no answer (a notification's rid)."""
        return self.rng.getrandbits(64)

    def _fresh_rid(self) -> int:
        for _ in range(RID_DRAWS):
            rid = self.rng.getrandbits(64)
            if rid not in self._pending and rid not in self._challenges:
                return rid
        raise PendingFull("no fresh request id found")  # only with a broken rng

    # -- the receive loop (the decisions are transport/receive.py's) ---------------------------------------------
    def receive_pass(self, datagrams: int, backlog: bool, started: float, now: float) -> None:
        """A receive pass ended (see ReceivePolicy.receive_pass): queues what the loop does before the next (a
        ``PassDecision``)."""
        receiving = self.receiving
        receiving.receive_pass(datagrams, backlog, started, now)
        self._actions += receiving.take_actions()

    # -- requests --------------------------------------------------------------------------------------------
    def open_request(self, addr: Hashable, expect: int, *, timeout: float, attempts: int, now: float) -> int:
        """Open a request to ``addr`` answered by type ``expect``; returns its id, and its first ``Transmit`` is
        queued."""
        if not timeout > 0 or attempts < 1:
            raise ValueError(f"request needs timeout > 0 and attempts >= 1, got {timeout!r}, {attempts!r}")
        if len(self._pending) >= self.max_pending:
            raise PendingFull(f"{len(self._pending)} requests already open")
        rid = self._fresh_rid()
        p = self._pending[rid] = Pending(rid, addr, expect, deadline=now + timeout * (2**attempts - 1),
                                         wait=self.rto.timeout(addr, timeout), start=now)
        self._transmit(p, now)
        return rid

    def pending(self, rid: int) -> Pending | None:
        return self._pending.get(rid)

    def open_requests(self) -> int:
        return len(self._pending)

    def _transmit(self, p: Pending, now: float) -> None:
        p.sent_at = now
        p.next_at = min(p.deadline, now + p.wait)
        p.attempts += 1
        heapq.heappush(self._waits, (p.next_at, p.rid))
        if len(self._waits) > 4 * len(self._pending) + 64:  # answered requests' entries: drop them now and then
            self._waits[:] = [(at, rid) for at, rid in self._waits if self._waiting(at, rid)]
            heapq.heapify(self._waits)
        self._actions.append(Transmit(p.rid, p.attempts - 1))

    def _waiting(self, at: float, rid: int) -> bool:
        """Whether the heap's entry (at, rid) is a wait that still runs: its request open, unanswered, due then."""
        p = self._pending.get(rid)
        return p is not None and p.reply is None and p.next_at == at

    def _wait_ran_out(self, p: Pending, now: float) -> None:
        """Request ``p``'s wait ended unanswered: send it again with a doubled wait, or it expires."""
        if p.karn:  # the first wait ran out: this destination backs off until its next sample
            self.rto.timed_out(p.addr)
            p.karn = False
        if now >= p.deadline:
            self.close(p.rid)
            self._actions.append(Expired(p.rid, p.deadline - p.start, p.attempts))
            return
        p.wait *= 2
        self._transmit(p, now)

    def get_timer(self) -> float | None:
        """The earliest time something here needs ``handle_timer``: a request's wait ends, or the receive loop's
        pause ends. None: nothing scheduled."""
        waits = self._waits
        while waits and not self._waiting(*waits[0]):
            heapq.heappop(waits)
        pause = self.receiving.get_timer()
        if not waits:
            return pause
        return waits[0][0] if pause is None else min(waits[0][0], pause)

    def handle_timer(self, now: float) -> None:
        """The timer came: each request whose wait ran out is sent again or expires (queued ``Transmit`` or
        ``Expired``), and the receive loop's pause ends."""
        waits = self._waits
        while waits and waits[0][0] <= now:
            at, rid = heapq.heappop(waits)
            if self._waiting(at, rid):
                self._wait_ran_out(self._pending[rid], now)
        self.receiving.handle_timer(now)

    def take_actions(self) -> list[Action]:
        """What the inputs since the last call asked the shell to do, in order (drained)."""
        actions, self._actions = self._actions, []
        return actions

    def statistics(self) -> TransportStatistics:
        r = self.receiving.statistics()
        return TransportStatistics(len(self._pending), len(self._held), len(self._challenges), r)

    def close(self, rid: int) -> None:
        """Forget request ``rid`` (answered, expired, or abandoned by its caller); later answers are unexpected."""
        p = self._pending.pop(rid, None)
        if p is not None:
            p.done = True

    # -- demultiplexing --------------------------------------------------------------------------------------
    def register(self, mtype: int, response: int) -> None:
        """A handler takes messages of ``mtype`` and answers with ``response`` (``mtype`` itself: one-way)."""
        self._handled[mtype] = response

    def response_type(self, mtype: int) -> int | None:
        return self._handled.get(mtype)

    def receive_message(self, mtype: int, rid: int, source: Hashable, message: Any, now: float) -> None:
        """An authenticated control message of ``mtype`` with ``rid`` from ``source``: an answer (``message``)
        is its request's ``Answered``, with a round-trip sample under Karn's rule; the PONG to a validating PING
        validates ``source`` (``AddressValidated``); a registered type goes to its handler (``Deliver``); anything
        else is counted ``unexpected`` (a second answer before the caller closed the request: not counted, nothing
        to do)."""
        if mtype == PONG and self._challenges.get(rid) == source:
            for challenge in [c for c, a in self._challenges.items() if a == source]:
                del self._challenges[challenge]
            self.guard.validate(source)
            self._actions.append(AddressValidated(source))
            return
        p = self._pending.get(rid)
        if p is not None and (mtype == p.expect or mtype == ERROR):
            if p.reply is not None:
                return
            p.reply = message
            rtt = None
            if p.karn and p.sent_at is not None:
                rtt = max(0.0, now - p.sent_at)
                self.rto.sample(p.addr, rtt)
            if source == p.addr:  # it read this request's random rid: it receives at this address
                self.guard.validate(source)
            self.receiving.answers += 1
            self._actions.append(Answered(rid, message, rtt, p.attempts))
            return
        if mtype in self._handled:
            self._actions.append(Deliver(mtype, rid, source, message))
            return
        self.receiving.dropped("unexpected")

    # -- answers to addresses not yet validated -----------------------------------------------------------------
    def may_answer(self, addr: Hashable, nbytes: int) -> bool:
        """Whether an answer of ``nbytes`` to ``addr`` fits its amplification budget (if so it is charged)."""
        return self.guard.may_send(addr, nbytes)

    def hold(self, addr: Hashable, answer: Any) -> None:
        """Keep ``answer`` until ``addr`` is validated (at most ``max_held_per_address`` for at most
        ``max_held_addresses`` addresses: the oldest address is forgotten first)."""
        held = self._held.get(addr)
        if held is None:
            held = self._held[addr] = []
            while len(self._held) > self.max_held_addresses:
                self._held.popitem(last=False)
        if len(held) < self.max_held_per_address:
            held.append(answer)

    def challenge(self, addr: Hashable) -> int:
        """A request id for a PING that validates ``addr`` (call ``challenge_sent`` once it went out)."""
        return self._fresh_rid()

    def challenge_sent(self, rid: int, addr: Hashable) -> None:
        self._challenges[rid] = addr
        while len(self._challenges) > self.max_held_addresses:
            self._challenges.popitem(last=False)

    def release(self, addr: Hashable) -> list[Any]:
        """The answers held for ``addr`` (now validated), oldest first."""
        return self._held.pop(addr, [])

    # -- receivers' node ids -----------------------------------------------------------------------------------
    def learn(self, addr: Hashable, node_id: bytes) -> None:
        ids = self._ids
        ids[addr] = node_id
        ids.move_to_end(addr)
        while len(ids) > self.max_known_ids:
            ids.popitem(last=False)

    def node_id_at(self, addr: Hashable) -> bytes | None:
        return self._ids.get(addr)

    def addr_of(self, node_id: bytes) -> Hashable | None:
        """Where ``node_id`` was last learned to be (None if nowhere): a scan, for the few sends per round that
        name a node rather than an address."""
        for addr, known in reversed(self._ids.items()):
            if known == node_id:
                return addr
        return None
