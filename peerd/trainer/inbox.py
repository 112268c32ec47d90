"""Outer records that group members pushed to this daemon (OUTER_RECORD, PROTOCOL.md section 15.1).

A member of a DiLoCo outer round sends its records straight to the members it averaged with, so that they
read them the moment they exist instead of through DHT lookups (round trips each, seconds under loss). The
sender is untrusted: a record is attributed to the datagram's authenticated sender (the identity its token
is bound to), never to anything in the body, decoded with OuterRecord.decode's bounds, and held only for run
keys this daemon trains, one per sender and round (the highest ``seq``), for at most MAX_ROUNDS rounds and
MAX_SENDERS senders a round. Which of them count is the agreement's business (its known participants).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..transport.endpoint import Incoming
from ..wire import messages as m
from .records import OuterRecord

log = logging.getLogger("peerd.trainer.inbox")

MAX_ROUNDS = 16  # (run key, outer round) slots held at once; the oldest goes first
MAX_SENDERS = 256  # senders held per round (a group is at most 64; four rounds of groups per outer step)

Listener = Callable[[], None]


@dataclass
class _Slot:
    records: dict[bytes, tuple[int, OuterRecord]] = field(default_factory=dict)  # sender -> (seq, record)
    listeners: list[Listener] = field(default_factory=list)


class OuterInbox:
    """Pushed outer records by (run key, round). ``trains(run_key)``: whether this daemon trains that run key
    (a record of any other run is refused and never stored)."""

    def __init__(self, trains: Callable[[str], bool]) -> None:
        self.trains = trains
        self._slots: OrderedDict[tuple[str, int], _Slot] = OrderedDict()
        self.refused = 0  # pushes refused (another run, a malformed record, no room, an older seq)

    def register(self, endpoint: object) -> None:
        endpoint.on_request(m.MsgType.OUTER_RECORD, self.on_record)  # type: ignore[attr-defined]

    def on_record(self, incoming: Incoming) -> dict:
        body = incoming.body
        run_key = body["run"].decode("utf-8", "replace")
        ok = self.put(run_key, body["round"], incoming.peer.node_id, body["seq"], body["record"])
        return {"ok": ok}

    def _slot(self, run_key: str, round_no: int, *, create: bool) -> _Slot | None:
        key = (run_key, round_no)
        slot = self._slots.get(key)
        if slot is None and create:
            slot = self._slots[key] = _Slot()
            if len(self._slots) > MAX_ROUNDS:  # the oldest round nobody waits on goes
                for old in list(self._slots):
                    if not self._slots[old].listeners and old != key:
                        del self._slots[old]
                        break
        return slot

    def put(self, run_key: str, round_no: int, sender: bytes, seq: int, value: bytes) -> bool:
        """Hold ``sender``'s record (the authenticated sender: the record is its own claim, whatever it says);
        whether it was held."""
        if not self.trains(run_key):
            self.refused += 1
            return False
        record = OuterRecord.decode(sender, value)
        if record is None:
            self.refused += 1
            return False
        slot = self._slot(run_key, round_no, create=True)
        assert slot is not None
        held = slot.records.get(sender)
        if held is not None and held[0] >= seq:
            return held[0] == seq  # a retransmission (same seq) or an older record: the newer one stays
        if held is None and len(slot.records) >= MAX_SENDERS:
            self.refused += 1
            return False
        slot.records[sender] = (seq, record)
        for listener in list(slot.listeners):
            try:
                listener()
            except Exception as e:  # a waiter's wake-up never takes the receive loop down
                log.warning("outer inbox: a listener failed: %s", e)
        return True

    def records(self, run_key: str, round_no: int) -> list[OuterRecord]:
        slot = self._slot(run_key, round_no, create=False)
        return [] if slot is None else [r for _, r in slot.records.values()]

    def listen(self, run_key: str, round_no: int, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` whenever a record of that round arrives; returns what stops it."""
        slot = self._slot(run_key, round_no, create=True)
        assert slot is not None
        slot.listeners.append(listener)

        def stop() -> None:
            if listener in slot.listeners:
                slot.listeners.remove(listener)

        return stop

    def forget(self, run_key: str, round_no: int) -> None:
        self._slots.pop((run_key, round_no), None)
