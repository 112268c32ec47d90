"""The DHT's request handling (sans-I/O): answers PING, FIND_NODE, FIND_VALUE and STORE."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..wire import messages as m
from ..wire.errors import WireError
from .records import Record, RecordStore, VerifiedCache, location
from .routing import Contact, RoutingTable


@functools.lru_cache(maxsize=4096)
def _packed(contact: Contact) -> tuple:
    """A contact's wire form: parsing its address costs more than the rest of a NODES answer, and every
    FIND_NODE/FIND_VALUE sends the same few contacts again (bounded: at most 4096 kept)."""
    return tuple(m.pack_contact(contact.node_id, contact.host, contact.port))


def pack_contacts(contacts: list[Contact]) -> list[list]:
    return [list(_packed(c)) for c in contacts]


def unpack_contacts(raw: list[tuple]) -> list[Contact]:
    return [Contact(node_id, host, port) for node_id, host, port in raw]


class DhtCore:
    """``on_refused(reason)`` is told of every STORE record refused (the driver counts it in metrics)."""

    def __init__(
        self,
        node_id: bytes,
        *,
        k: int = 20,
        store: RecordStore | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.k = k
        self.table = RoutingTable(node_id, k)
        self.store = store if store is not None else RecordStore(node_id)
        self.refused: dict[str, int] = {}  # STORE refusals by reason, for statistics
        self.verified = VerifiedCache()  # shared with the driver's reads: a record is checked once
        self._on_refused = on_refused

    def handle(self, mtype: m.MsgType, body: dict[str, Any], now: float) -> dict[str, Any]:
        """Response fields for a request (rid/from are the transport's)."""
        if mtype is m.MsgType.PING:
            return {}
        if mtype is m.MsgType.FIND_NODE:
            return {"nodes": pack_contacts(self.table.closest(body["target"]))}
        if mtype is m.MsgType.FIND_VALUE:
            return self._find_value(body["key"], body["offset"], now)
        if mtype is m.MsgType.STORE:
            return {"ok": [self._store(fields, now) for fields in body["records"]]}
        raise WireError("type", f"{mtype.name} is not a DHT request")

    def _find_value(self, key: bytes, offset: int, now: float) -> dict[str, Any]:
        records = self.store.get(key, now)
        page = records[offset : offset + m.MAX_RECORDS]
        return {
            "records": [r.to_wire(now) for r in page],
            "total": min(len(records), 65535),
            "nodes": pack_contacts(self.table.closest(location(key))) if offset == 0 else [],
        }

    def responsible(self, key: bytes) -> bool:
        """Whether this node is among the 2k nodes it knows closest to ``key`` (k of slack for tables
        that differ): a writer's lookup would pick it as one of the k to store on."""
        return self.table.closer_than_me(location(key), 2 * self.k) < 2 * self.k

    def admit(self, record: Record, now: float) -> str | None:
        """Why a STOREd record is refused, decided before its signature is checked (cheap refusals).

        Beyond the store's own rules: a node over half full takes no new slot under a key it is not
        responsible for ("far"), so members cannot fill it with keys that belong elsewhere."""
        why = self.store.check(record, now)
        if (
            why is None
            and self.store.loaded
            and not self.store.holds(record.key, record.subkey)
            and not self.responsible(record.key)
        ):
            why = "far"
        return why

    def _store(self, fields: tuple, now: float) -> bool:
        try:
            record = Record.from_wire(fields, now, check=False)
            why = self.admit(record, now)
            if why is None:
                self.verified.check(record)
                why = self.store.store(record, now)
        except WireError as e:
            why = e.reason
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            if self._on_refused is not None:
                self._on_refused(why)
            return False
        return True
