"""What the averaging host asks its driver to do: frozen action dataclasses (counts, wake-ups, timers, pings,
liveness probes, REPORTs, pacer verdicts, finished groups, blocks to send)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..transport.pacing import Verdict
from .phase import GroupStats


@dataclass(frozen=True, slots=True)
class Dropped:
    """Count ``count`` inputs dropped for ``reason`` (peerd_datagrams_dropped_total{reason})."""

    reason: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class Wake:
    """Group ``group_id`` changed (a phase ended, a deadline moved up, held data arrived): its driver should
    send what it wants now and re-read its deadline."""

    group_id: int


@dataclass(frozen=True, slots=True)
class HeldTimer:
    """Something is held and nothing was before: call the host's ``handle_timer`` at ``at``, then at its
    ``get_timer()`` while that is not None (held data is freed on a timer, also on a node that receives nothing
    more)."""

    at: float


@dataclass(frozen=True, slots=True)
class Bind:
    """PING member ``to`` (node id ``peer``) of ``group_id``: the request binds this node's token there, the
    response the member's here. Data from a token not bound yet is held until its binding arrives."""

    group_id: int
    to: int
    peer: bytes


@dataclass(frozen=True, slots=True)
class ProbeMember:
    """PING member ``to`` (node id ``peer``) of ``group_id``, whose stream went silent, ``timeout`` seconds (resent
    within it); report the answering node id (None: no answer) to ``AveragingHost.receive_probe(group_id, token,
    ...)``."""

    group_id: int
    to: int
    peer: bytes
    token: int
    timeout: float


@dataclass(frozen=True, slots=True)
class SendReport:
    """Send a REPORT (``fields``, the message's) to member ``to`` (node id ``peer``) of ``group_id``."""

    group_id: int
    to: int
    peer: bytes
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PacerVerdict:
    """What a member's REPORT did to the pacer (``verdict``: decrease, increase, hold, ...); ``rate`` is the
    sending rate now, bytes/s."""

    rate: float
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class Completed:
    """Group ``group_id`` is done: ``vector`` is the average (the caller's ``out`` when it gave one)."""

    group_id: int
    vector: np.ndarray
    stats: GroupStats


@dataclass(frozen=True, slots=True)
class SendBlock:
    """Bodies for member ``to`` (node id ``peer``) of ``group_id``, envelope type ``type``: ``bodies`` is
    (rows, body bytes) uint8, END markers already repeated. Sealed and sent a part at a time
    (``AveragingHost.part_rows``: whole GSO sends of ``part`` rows where the rate allows), each part when
    ``AveragingHost.pace`` says."""

    group_id: int
    to: int
    peer: bytes
    type: int
    bodies: np.ndarray
    part: int
    values: np.ndarray | None = None  # OutBlock.values: ``bodies`` is then only the tensor headers
    later: int = 0  # END copies still to send after this one, spaced in time (AveragingHost ``end_spacing_s``)


Action = Dropped | Wake | HeldTimer | Bind | ProbeMember | SendReport | PacerVerdict | Completed


def merged(actions: list[Action], drops: Counter[str] | None = None) -> list[Action]:
    """``actions`` with a Dropped per reason counted in ``drops`` added, then one Dropped per reason and one Wake per
    group (a block fed body by body makes many of each)."""
    if drops:
        actions.extend(Dropped(reason, count) for reason, count in drops.items())
    if len(actions) < 2:
        return actions
    counts: Counter[str] = Counter()
    out: list[Action] = []
    woken: set[int] = set()
    for a in actions:
        if type(a) is Dropped:
            counts[a.reason] += a.count
        elif type(a) is Wake:
            if a.group_id not in woken:
                woken.add(a.group_id)
                out.append(a)
        else:
            out.append(a)
    out.extend(Dropped(reason, count) for reason, count in counts.items())
    return out
