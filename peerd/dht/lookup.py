"""Iterative Kademlia lookup as a sans-I/O state machine: the driver asks whom to query next."""

from __future__ import annotations

import math
from bisect import insort
from enum import Enum

from .routing import Contact, distance

# A lookup passes over a query still unanswered after ``slow_after`` of it: SLOW_RTOS retransmission timeouts of
# the contact (srtt + 4 rttvar: one lost datagram and its retransmission's round trip), at least SLOW_FLOOR_S and
# at most SLOW_QUERY_S. The query keeps going and its late answer still counts while the lookup runs (the SLOW
# state): a wait too short for a live contact costs the lookup a query to the next closest, not the answer.
SLOW_QUERY_S = 0.6  # the most a lookup waits, and its wait before any round trip is measured (first retry: 0.5 s)
SLOW_RTOS = 2.0
# The RTO's own floor (20 ms) is a retransmission and its answer with 20 ms to spare: a daemon on a loaded 2-core
# host may take 10-20 ms to answer, and on a LAN the measured RTO is that floor.
SLOW_FLOOR_S = 0.05


def slow_after(rto: float | None) -> float:
    """How long a lookup waits for a query before passing over it, from the contact's retransmission timeout (or
    the node's typical one; None: nothing measured yet)."""
    if rto is None or not math.isfinite(rto):
        return SLOW_QUERY_S
    return min(SLOW_QUERY_S, max(SLOW_FLOOR_S, SLOW_RTOS * rto))


class _State(Enum):
    NEW = 0
    IN_FLIGHT = 1
    ANSWERED = 2
    FAILED = 3
    SLOW = 4  # no answer yet after the first timeout: ranked like a failure, but a late answer counts


# The members as module constants: ``_State.FAILED`` is a class attribute lookup through the enum's metaclass
# (about 0.14 us on CPython 3.11, ten times a local's), and these loops test every contact seen per call
_NEW = _State.NEW
_IN_FLIGHT = _State.IN_FLIGHT
_ANSWERED = _State.ANSWERED
_FAILED = _State.FAILED
_SLOW = _State.SLOW


class Lookup:
    """Finds the k closest live nodes to ``target``.

    Ends when no query is in flight and every one of the k closest non-failed candidates seen so
    far has answered (Kademlia's termination rule).

    Queries go alpha at a time until an answer brings no contact closer than the closest already
    seen; from then on every one of the k closest not yet asked is asked at once (the Kademlia
    paper's rule). On a routing table that already holds the k closest, that is two round trips
    instead of k/alpha. ``wide`` starts that way: for seeds that are a recent lookup's result.
    """

    def __init__(
        self,
        target: bytes,
        seeds: list[Contact],
        *,
        own_id: bytes,
        k: int = 20,
        alpha: int = 3,
        wide: bool = False,
        widen: bool = True,
        retry_slow: bool = False,
    ):
        self.target = target
        self._retry_slow = retry_slow
        self._retried: set[bytes] = set()
        self.k = k
        self.alpha = alpha
        self.wide = wide
        self._widen = widen
        self._stalled = False  # an answer brought no contact closer than the closest seen before it
        self._own = own_id
        self._contacts: dict[bytes, Contact] = {}
        self._state: dict[bytes, _State] = {}
        self._order: list[tuple[int, bytes]] = []  # (distance, id) of every contact seen, closest first
        self._flying = 0  # queries in flight
        self._t = int.from_bytes(target, "big")
        self.add(seeds)

    @property
    def width(self) -> int:
        """Queries in flight at most: alpha, or k once widened."""
        return max(self.k, self.alpha) if self.wide else self.alpha

    def add(self, contacts: list[Contact]) -> None:
        state = self._state
        known = self._contacts
        order = self._order
        own = self._own
        t = self._t
        for c in contacts:
            node_id = c.node_id
            if node_id not in state and node_id != own:
                known[node_id] = c
                state[node_id] = _NEW
                insort(order, (c.num ^ t, node_id))

    def unseen(self, raw: list[tuple[bytes, str, int]]) -> list[Contact]:
        """Contacts for the (node id, host, port) of an answer that this lookup has not seen yet: in a small
        swarm every answer repeats the same k, and making a Contact of each cost a reader more than the rest of
        the answer."""
        state = self._state
        return [Contact(node_id, host, port) for node_id, host, port in raw if node_id not in state]

    def _ranked(self) -> list[bytes]:
        """The k closest contacts not failed or slow (kept in order as they come, never re-sorted)."""
        out = []
        state = self._state
        k = self.k
        failed, slow = _FAILED, _SLOW
        for _, node_id in self._order:
            s = state[node_id]
            if s is not failed and s is not slow:
                out.append(node_id)
                if len(out) == k:
                    break
        return out

    def _closest_seen(self) -> int | None:
        state = self._state
        failed, slow = _FAILED, _SLOW
        for d, node_id in self._order:
            s = state[node_id]
            if s is not failed and s is not slow:
                return d
        return None

    def in_flight(self) -> int:
        return self._flying

    def next_queries(self) -> list[Contact]:
        """Contacts to query now (marked in flight); empty when nothing more is worth asking.

        The new ones among the k closest not failed or slow, walked in place (no ranked list is built:
        this runs after every answer)."""
        budget = self.width - self._flying
        chosen: list[Contact] = []
        if budget <= 0:
            return chosen
        state = self._state
        contacts = self._contacts
        k = self.k
        failed, slow, new, in_flight = _FAILED, _SLOW, _NEW, _IN_FLIGHT
        ranked = 0
        for _, node_id in self._order:
            s = state[node_id]
            if s is failed or s is slow:
                continue
            if s is new:
                state[node_id] = in_flight
                self._flying += 1
                chosen.append(contacts[node_id])
                budget -= 1
                if budget <= 0:
                    break
            ranked += 1
            if ranked == k:
                break
        if not chosen and not self._flying and self._retry_slow:
            chosen = self._retry()
        return chosen

    def _retry(self) -> list[Contact]:
        """A record's lookup about to end asks once more each slow contact closer than its farthest ranked one:
        a holder whose query or answer was lost once must not be passed over for good (the record lives only at
        the few closest), where the transport's own retransmission to an unmeasured contact comes only after the
        lookup has ended."""
        state = self._state
        ranked = self._ranked()
        if not ranked:
            return []
        edge = self._contacts[ranked[-1]].num ^ self._t if len(ranked) == self.k else math.inf
        chosen = []
        for d, node_id in self._order:
            if d > edge:
                break
            if state[node_id] is _SLOW and node_id not in self._retried:
                self._retried.add(node_id)
                state[node_id] = _IN_FLIGHT
                self._flying += 1
                chosen.append(self._contacts[node_id])
        return chosen

    def on_reply(self, node_id: bytes, nodes: list[Contact]) -> None:
        state = self._state.get(node_id)
        if state is _IN_FLIGHT or state is _SLOW:
            self._flying -= state is _IN_FLIGHT
            self._state[node_id] = _ANSWERED
        best = self._closest_seen()
        self.add(nodes)
        if best is not None and not self._stalled:
            after = self._closest_seen()
            self._stalled = after is not None and after >= best
        if self._widen and self._stalled:
            self.wide = True  # nothing closer came: ask the rest at once

    def on_failure(self, node_id: bytes) -> None:
        if node_id in self._state:
            self._flying -= self._state[node_id] is _IN_FLIGHT
            self._state[node_id] = _FAILED

    def on_slow(self, node_id: bytes) -> None:
        """A query is taking long (a dead node, usually): stop waiting for it, free its slot."""
        if self._state.get(node_id) is _IN_FLIGHT:
            self._flying -= 1
            self._state[node_id] = _SLOW

    @property
    def finished(self) -> bool:
        """Nothing in flight, and each of the k closest not failed or slow has answered."""
        if self._flying:
            return False
        state = self._state
        k = self.k
        failed, slow, answered = _FAILED, _SLOW, _ANSWERED
        ranked = 0
        for _, node_id in self._order:
            s = state[node_id]
            if s is failed or s is slow:
                continue
            if s is not answered:
                return False
            ranked += 1
            if ranked == k:
                break
        return True

    @property
    def settled(self) -> bool:
        """The neighbourhood is known: an answer brought nothing closer and the alpha closest have answered.

        A writer may stop here and STORE on the k closest seen (its STOREs show which are alive)
        instead of waiting for each of them to answer a FIND_NODE first."""
        if not self._stalled:
            return self.finished
        near = self._ranked()[: self.alpha]
        return bool(near) and all(self._state[n] is _ANSWERED for n in near)

    def closest_ids(self) -> set[bytes]:
        """The node ids of the k closest seen that have not failed (nor turned slow)."""
        return set(self._ranked())

    def candidates(self) -> list[Contact]:
        """The k closest seen that have not failed, answered or not."""
        return [self._contacts[n] for n in self._ranked()]

    def result(self) -> list[Contact]:
        answered = [n for n in self._ranked() if self._state[n] is _ANSWERED]
        return [self._contacts[n] for n in answered]

    def closest_distance(self) -> int | None:
        ranked = self._ranked()
        return distance(ranked[0], self.target) if ranked else None
