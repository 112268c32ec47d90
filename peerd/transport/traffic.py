"""What the endpoint tells a traffic observer (per-peer accounting, peerd/peers) about each datagram it moves.

The endpoint only calls these; it keeps no per-peer accounting itself. Every call is synchronous and cheap:
an observer that needs more than a few dictionary updates defers the work to its own timer.
"""

from __future__ import annotations

from typing import Any, Protocol

Address = tuple[str, int]


class TrafficHooks(Protocol):
    def sent(self, addr: Address, mtype: int, nbytes: int, relay: bytes | None) -> None:
        """``nbytes`` of datagrams of type ``mtype`` went to ``addr`` (through the relay ``relay`` if not None)."""

    def received(self, source: Address, peer: bytes | None, mtype: int, nbytes: int, relayed: bool, now: float,
                 fields: dict[str, Any] | None = None) -> None:
        """``nbytes`` of datagrams of type ``mtype`` from node ``peer`` (None: not bound yet) opened; ``fields``:
        a control message's decoded fields."""

    def control(self, peer: bytes, mtype: int, fields: dict[str, Any], outgoing: bool) -> None:
        """A one-way control message this node sends (its REPORTs carry what arrived from ``peer``)."""

    def answered(self, addr: Address, peer: bytes, rtt: float | None, now: float) -> None:
        """A request to ``addr`` was answered; ``rtt`` when on its first transmission (Karn's rule)."""

    def unanswered(self, addr: Address, now: float) -> None:
        """A request to ``addr`` got no answer after all its retries."""
