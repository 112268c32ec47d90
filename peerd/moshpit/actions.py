"""The round machine's actions (moshpit/rounds.py): what it asks its driver to do, as frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from ..dht.reads import Agreed
from ..wire import messages as m
from .matchmaking import Candidate, Group


@dataclass(frozen=True)
class Put:
    """Store ``value`` under ``key`` in the DHT, subkey this node's id (fire and forget)."""

    key: bytes
    value: bytes
    ttl: float


@dataclass(frozen=True)
class Get:
    """Read every record under ``key``; answer with ``on_records(token, ...)`` (an empty list on failure).
    ``detached``: the answer matters past this round (a kept group's watch): do not cancel it when the round ends."""

    key: bytes
    token: int
    enough: Agreed | None = None
    detached: bool = False


@dataclass(frozen=True)
class Request:
    """Send an MM_JOIN, MM_BEGIN or PING request; answer with ``on_reply(token, ...)`` (a PONG: ``ok`` true) or
    ``on_failed(token, ...)``.
    ``detached``: the answer matters past this round (a BEGIN's ack): do not cancel it when the round ends."""

    to: Candidate
    mtype: m.MsgType
    fields: dict
    token: int
    timeout: float
    attempts: int
    detached: bool = False


@dataclass(frozen=True)
class Notify:
    """Send a one-way message (MM_DISBAND)."""

    to: Candidate
    mtype: m.MsgType
    fields: dict


@dataclass(frozen=True)
class Average:
    """Average in ``group`` now; report the result with ``on_averaged``."""

    group: Group
    kept: bool


@dataclass(frozen=True)
class Count:
    """Count a refused input: ``metric`` is a Metrics counter name, ``labels`` its label values."""

    metric: str
    labels: tuple[str, ...]
    n: int = 1


@dataclass(frozen=True)
class Note:
    """Something an operator may want in the log (info level)."""

    text: str


Action = Put | Get | Request | Notify | Average | Count | Note
