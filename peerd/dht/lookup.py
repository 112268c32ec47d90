"""Iterative Kademlia lookup as a sans-I/O state machine: the driver asks whom to query next."""

from __future__ import annotations

from enum import Enum

from .routing import Contact, distance


class _State(Enum):
    NEW = 0
    IN_FLIGHT = 1
    ANSWERED = 2
    FAILED = 3
    SLOW = 4  # no answer yet after the first timeout: ranked like a failure, but a late answer counts


class Lookup:
    """Finds the k closest live nodes to ``target``.

    Ends when no query is in flight and every one of the k closest non-failed candidates seen so
    far has answered (Kademlia's termination rule).
    """

    def __init__(self, target: bytes, seeds: list[Contact], *, own_id: bytes, k: int = 20, alpha: int = 3):
        self.target = target
        self.k = k
        self.alpha = alpha
        self._own = own_id
        self._contacts: dict[bytes, Contact] = {}
        self._state: dict[bytes, _State] = {}
        self._t = int.from_bytes(target, "big")
        self.add(seeds)

    def add(self, contacts: list[Contact]) -> None:
        for c in contacts:
            if c.node_id != self._own and c.node_id not in self._state:
                self._contacts[c.node_id] = c
                self._state[c.node_id] = _State.NEW

    def _ranked(self) -> list[bytes]:
        live = [n for n, s in self._state.items() if s not in (_State.FAILED, _State.SLOW)]
        live.sort(key=lambda n: int.from_bytes(n, "big") ^ self._t)
        return live[: self.k]

    def in_flight(self) -> int:
        return sum(1 for s in self._state.values() if s is _State.IN_FLIGHT)

    def next_queries(self) -> list[Contact]:
        """Contacts to query now (marked in flight); empty when nothing more is worth asking."""
        budget = self.alpha - self.in_flight()
        chosen = []
        for node_id in self._ranked():
            if budget <= 0:
                break
            if self._state[node_id] is _State.NEW:
                self._state[node_id] = _State.IN_FLIGHT
                chosen.append(self._contacts[node_id])
                budget -= 1
        return chosen

    def on_reply(self, node_id: bytes, nodes: list[Contact]) -> None:
        if self._state.get(node_id) in (_State.IN_FLIGHT, _State.SLOW):
            self._state[node_id] = _State.ANSWERED
        self.add(nodes)

    def on_failure(self, node_id: bytes) -> None:
        if node_id in self._state:
            self._state[node_id] = _State.FAILED

    def on_slow(self, node_id: bytes) -> None:
        """A query is taking long (a dead node, usually): stop waiting for it, free its slot."""
        if self._state.get(node_id) is _State.IN_FLIGHT:
            self._state[node_id] = _State.SLOW

    @property
    def finished(self) -> bool:
        if self.in_flight():
            return False
        return all(self._state[n] is _State.ANSWERED for n in self._ranked())

    def result(self) -> list[Contact]:
        answered = [n for n in self._ranked() if self._state[n] is _State.ANSWERED]
        return [self._contacts[n] for n in answered]

    def closest_distance(self) -> int | None:
        ranked = self._ranked()
        return distance(ranked[0], self.target) if ranked else None
