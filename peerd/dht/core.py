"""The DHT's request handling (sans-I/O): answers PING, FIND_NODE, FIND_VALUE and STORE."""

from __future__ import annotations

import functools
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..wire import messages as m
from ..wire.errors import WireError
from .lookup import Lookup
from .records import Record, RecordStore, VerifiedCache, location
from .routing import Contact, RoutingTable, distance

# The replication factor r: a record lives on the REPLICAS nodes closest to its key, and a full read asks those
# (PROTOCOL.md 10.1). Kademlia uses k for this too; every replica costs each put a STORE and each full read a
# FIND_VALUE, a sleeping daemon woken, and on a busy host that is what a read's time is made of.
REPLICAS = 5
# A finished lookup's k closest are reused for this long: a put after a get of the same key (a Moshpit
# announce, then its polls; progress written, then read) stores without a second lookup, and a get asks
# them all at once. Bounded: RECENT_LOOKUPS targets, the oldest forgotten first.
RECENT_S = 10.0
RECENT_LOOKUPS = 256
VERIFY_MAX = 64  # request senders PINGed at once before they may enter the routing table (more: not added yet)
# A joining node's lookup of its own id fills only the buckets near it; every farther bucket then gets a lookup
# of a random id in it that stops once the bucket holds this many contacts (alpha: enough to route through).
# A full lookup per bucket, as a periodic refresh does (and the daemon's join, DhtService.bootstrap), costs about
# nine times the RPCs per join of an own-id lookup plus these fills (`peerd sim dht --peers 1000 --join-refresh`).
FILL = 1
FILL_ALPHA = 1  # a fill lookup asks one contact at a time: it ends at the first answer from inside its bucket
# FIND_VALUE's ``held`` (PROTOCOL.md 10.5): the first HELD_PREFIX bytes of the signatures of records the asker
# holds already, at most MAX_HELD of them; the answer leaves those records out and says in ``have`` (a bitmap
# over ``held``) which of them it holds. Present only once the wire schema carries the fields (``HELD_ON_WIRE``).
HELD_PREFIX = 8
MAX_HELD = 64
HELD_ON_WIRE = "held" in m.SCHEMAS[m.MsgType.FIND_VALUE]
# NODES/VALUE answers' contacts in wire form, per target, kept while the table's contacts stay the same (see
# DhtCore.wire_closest): at most this many targets.
WIRE_NODES_MAX = 256


@dataclass(frozen=True, slots=True)
class Ping:
    """Action: PING ``contact`` and report the outcome with ``DhtCore.pinged``.

    ``why`` is "verify" (a request's sender not in the table: it enters only once it answers) or "evict"
    (a full bucket's least-recently-seen contact: it stays if it answers, else the newcomer takes its place)."""

    contact: Contact
    why: str


@functools.lru_cache(maxsize=4096)
def _packed(contact: Contact) -> tuple:
    """A contact's wire form: parsing its address costs more than the rest of a NODES answer, and every
    FIND_NODE/FIND_VALUE sends the same few contacts again (bounded: at most 4096 kept)."""
    return tuple(m.pack_contact(contact.node_id, contact.host, contact.port))


def pack_contacts(contacts: list[Contact]) -> list[list]:
    return [list(_packed(c)) for c in contacts]


def unpack_contacts(raw: list[tuple]) -> list[Contact]:
    return [Contact(node_id, host, port) for node_id, host, port in raw]


@dataclass(frozen=True, slots=True)
class DhtStatistics:
    """What a node's DHT holds and has refused: its routing table, its records, and refusals by reason."""

    contacts: int  # in the routing table
    records: int  # stored here, for any key
    verifying: int  # request senders being PINGed before they may enter the table
    refused: dict[str, int]  # STORE records refused, by reason


class DhtCore:
    """A node's DHT state: the routing table, the record store and the lookups' shared memory (sans-I/O).

    Inputs are the methods named for what arrived (``heard``, ``request_from``, ``pinged``, ``handle``, ...),
    ``now`` last; the PINGs it wants sent come out of ``take_actions`` (``Ping``, reported back with ``pinged``).
    It has no timer of its own: the shell's refresh asks ``table.buckets_to_refresh(now, interval)``.

    ``on_refused(reason)`` is told of every STORE record refused (the driver counts it in metrics).
    ``wide_start``: a full lookup starts wide from a table complete near its target (see start_lookup). Off by
    default: a bucket below k proves only that nobody was turned away, not that the node heard of everyone. In
    `peerd sim dht` (joins fill far buckets with one contact) it costs more RPCs per full read, and
    `peerd bench dht --peers 32` shows no gain."""

    def __init__(
        self,
        node_id: bytes,
        *,
        k: int = 20,
        replicas: int = REPLICAS,
        store: RecordStore | None = None,
        on_refused: Callable[[str], None] | None = None,
        wide_start: bool = False,
    ) -> None:
        self.node_id = node_id
        self.k = k
        self.replicas = min(replicas, k)  # a lookup finds at most k
        self.table = RoutingTable(node_id, k)
        self.store = store if store is not None else RecordStore(node_id)
        self.refused: dict[str, int] = {}  # STORE refusals by reason, for statistics
        self.verified = VerifiedCache()  # shared with the driver's reads: a record is checked once
        self.verifying: set[bytes] = set()  # request senders being PINGed before they may enter the table
        self.recent = RecentLookups()
        self._on_refused = on_refused
        self.wide_start = wide_start
        self._wire_nodes: dict[bytes, list[list]] = {}  # target -> wire_closest's answer, at _wire_version
        self._wire_version = -1
        self._actions: list[Ping] = []

    def take_actions(self) -> list[Ping]:
        """The PINGs to send (drained): report each one's outcome with ``pinged``."""
        actions, self._actions = self._actions, []
        return actions

    def statistics(self) -> DhtStatistics:
        return DhtStatistics(contacts=len(self.table), records=len(self.store), verifying=len(self.verifying),
                             refused=dict(self.refused))

    # -- the routing table: who enters it ---------------------------------------------------------
    def heard(self, contact: Contact, now: float | None = None) -> None:
        """``contact`` answered us (or is known and sent a request): note it. A full bucket asks for its
        least-recently-seen contact to be PINGed (the Kademlia eviction rule; given ``now``, at most once per
        routing.EVICT_CHECK_S per bucket)."""
        oldest = self.table.observe(contact, now)
        if oldest is not None:
            self._actions.append(Ping(oldest, "evict"))

    def request_from(self, contact: Contact, now: float | None = None) -> None:
        """A request came from ``contact``. A sender already in the table, or waiting as a replacement at
        this address (it answered before), is heard; any other enters it only once it answers a PING of ours:
        ids are free to mint, and identities that send but never answer would otherwise crowd the table and
        stall every lookup. At most VERIFY_MAX such PINGs at once."""
        if contact.node_id in self.table.ids or self.table.waiting(contact):
            self.heard(contact, now)
        elif contact.node_id not in self.verifying and len(self.verifying) < VERIFY_MAX:
            self.verifying.add(contact.node_id)
            self._actions.append(Ping(contact, "verify"))

    def pinged(self, ping: Ping, answer: Contact | None, now: float | None = None) -> None:
        """The outcome of a ``Ping``: ``answer`` is the contact that answered as ``ping.contact``'s node (its
        address as seen), or None (no answer, or another node answered)."""
        if ping.why == "verify":
            self.verifying.discard(ping.contact.node_id)
            if answer is not None:
                self.heard(answer, now)
            return
        self.table.ping_result(ping.contact, answer is not None)

    def failed(self, contact: Contact) -> None:
        """A request to ``contact`` went unanswered (or another node answered there): it leaves the table, its
        freshest replacement enters (or it stops waiting as one). Only if the table holds it at that address: a
        member that names an honest node at a dead address in its answers cannot have that node forgotten."""
        if self.table.holds_at(contact) or self.table.waiting(contact):
            self.table.remove(contact.node_id)

    def missed(self, contact: Contact) -> bool:
        """A lookup passed over its query to ``contact`` (unanswered past ``lookup.slow_after``): after
        routing.MISSES such in a row, with no answer between, it leaves the table (True)."""
        return self.table.missed(contact)

    # -- lookups ----------------------------------------------------------------------------------
    def start_lookup(self, target: bytes, now: float, *, alpha: int, early: bool = False,
                     settle: bool = False, record: bool = False) -> Lookup:
        """A lookup for ``target``, seeded from the table (and a recent lookup's result for the same target).
        It finds the k closest, or with ``record`` (a read's or a writer's) the ``replicas`` closest: the r - 1
        others where this node is one of them.

        Only a lookup that must hear from all k closest (neither ``early``, a read that may end once its
        records suffice, nor ``settle``, a writer's) asks them all at once: from a recent result, with
        ``wide_start`` from a table that holds every node it heard of near the target (``complete_near``: one
        round trip instead of two in a small swarm), or once an answer brings nothing closer. The others go
        alpha at a time, so that they end before the rest are asked."""
        self.table.touch(target, now)
        k = self.record_width(target) if record else self.k
        recent = self.recent.get(target, now, self.table, k)
        seeds = self.table.closest(target, ordered=False)  # Lookup ranks what it is given
        full = not early and not settle
        wide = full and (recent is not None or (self.wide_start and self.table.complete_near(target)))
        return Lookup(
            target, recent + seeds if recent else seeds, own_id=self.node_id, k=k, alpha=alpha,
            wide=wide, widen=full, retry_slow=record,
        )

    def end_lookup(self, lookup: Lookup, now: float, *, settle: bool = False) -> list[Contact]:
        """What a lookup found: the k closest that answered (remembered for RECENT_S when it finished), or,
        for a writer's (``settle``) that stopped before then, the k closest seen."""
        if lookup.finished:
            result = lookup.result()
            self.recent.remember(lookup.target, now, result)
            return result
        return lookup.candidates() if settle else lookup.result()

    def fill_targets(self, rng: random.Random) -> list[tuple[int, bytes]]:
        """(bucket index, a random id in it) for every bucket from the nearest occupied one outwards: what a
        node that has just looked up its own id fills next, nearest first (see FILL)."""
        table = self.table
        return [(i, table.random_id_in_bucket(i, rng)) for i in table.buckets_to_refresh(math.inf, 0.0)]

    def filled(self, index: int, want: int = FILL) -> bool:
        """Whether bucket ``index`` holds ``want`` contacts (or is full): its fill lookup may stop."""
        bucket = self.table.buckets.made.get(index)
        return bucket is not None and len(bucket.contacts) >= min(want, self.k)

    def record_width(self, target: bytes) -> int:
        """How many nodes a record lookup for ``target`` looks for: the replicas, or where this node is one of
        them (as far as it knows) the r - 1 others."""
        r = self.replicas
        return max(1, r - 1) if self.table.closer_than_me(target, r) < r else r

    def stores_here(self, target: bytes, closest: list[Contact]) -> bool:
        """Whether a writer keeps its own record too: it is one of the ``replicas`` closest to ``target`` it
        knows (``closest``: the others, closest first)."""
        return len(closest) < self.replicas or distance(self.node_id, target) < distance(closest[-1].node_id, target)

    def holds_key(self, key: bytes) -> bool:
        """Whether this node is one of the ``replicas`` closest to ``key`` it knows: a reader's own copies are
        then a holder's."""
        return self.table.closer_than_me(location(key), self.replicas) < self.replicas

    def stored_on(self, target: bytes, answered: list[Contact], now: float) -> None:
        """A put reached every one of its replicas: they are the closest, for the next read or write."""
        self.recent.remember(target, now, sorted(answered, key=lambda c: distance(c.node_id, target)))

    def handle(self, mtype: m.MsgType, body: dict[str, Any], now: float) -> dict[str, Any]:
        """Response fields for a request (rid/from are the transport's)."""
        if mtype is m.MsgType.PING:
            return {}
        if mtype is m.MsgType.FIND_NODE:
            return {"nodes": self.wire_closest(body["target"])}
        if mtype is m.MsgType.FIND_VALUE:
            held = body.get("held")
            key, offset = body["key"], body["offset"]
            records, total = self.value_page(key, offset, held or (), now)
            out = {"records": records, "total": total, "nodes": self.wire_closest(location(key)) if offset == 0 else []}
            if HELD_ON_WIRE:
                out["have"] = self.have(body["key"], held or (), now)
            return out
        if mtype is m.MsgType.STORE:
            return {"ok": self.store_records(body["records"], now)}
        raise WireError("type", f"{mtype.name} is not a DHT request")

    # The answers, before the wire form (the simulator passes them as they are).
    def find_node(self, target: bytes, *, ordered: bool = True) -> list[Contact]:
        """The k closest contacts to ``target``, nearest first (``ordered``: the wire's; the simulator, whose
        lookups rank them anyway, leaves them unsorted)."""
        return self.table.closest(target, ordered=ordered)

    def find_value(self, key: bytes, offset: int, held: Sequence[bytes], now: float, *, ordered: bool = True
                   ) -> tuple[list[list], int, list[Contact]]:
        """(one page of records in wire form, how many there are in all, the closest contacts on page 0, nearest
        first if ``ordered``).

        ``held``: signature prefixes of records the asker holds; those are left out of the pages and of the
        total (an asker pages with the same ``held``, so offsets stay consistent)."""
        records, total = self.value_page(key, offset, held, now)
        return records, total, self.table.closest(location(key), ordered=ordered) if offset == 0 else []

    def value_page(self, key: bytes, offset: int, held: Sequence[bytes], now: float) -> tuple[list[list], int]:
        """find_value's page of records in wire form and their total, without the contacts."""
        records = self.store.get(key, now)
        if held:
            skip = frozenset(held)
            records = [r for r in records if r.signature[:HELD_PREFIX] not in skip]
        page = records[offset : offset + m.MAX_RECORDS]
        return [r.to_wire(now) for r in page], min(len(records), 65535)

    def wire_closest(self, target: bytes) -> list[list]:
        """``pack_contacts(self.find_node(target))``, kept per target until a contact enters, leaves or moves
        (``RoutingTable.version``): every FIND_VALUE for a key, from every reader, is answered with the same
        contacts, and sorting and packing them was most of what answering cost. Shared: not to be changed."""
        if self._wire_version != self.table.version:
            self._wire_nodes.clear()
            self._wire_version = self.table.version
        nodes = self._wire_nodes.get(target)
        if nodes is None:
            if len(self._wire_nodes) >= WIRE_NODES_MAX:
                self._wire_nodes.clear()
            nodes = self._wire_nodes[target] = pack_contacts(self.find_node(target))
        return nodes

    def have(self, key: bytes, held: Sequence[bytes], now: float) -> bytes:
        """Which of ``held`` (signature prefixes) this node holds a live record of under ``key``: bit i of byte
        i // 8 (least significant first) for held[i]."""
        if not held:
            return b""
        mine = {r.signature[:HELD_PREFIX] for r in self.store.get(key, now)}
        bits = bytearray((len(held) + 7) // 8)
        for i, prefix in enumerate(held):
            if prefix in mine:
                bits[i >> 3] |= 1 << (i & 7)
        return bytes(bits)

    def store_records(self, records: list[tuple], now: float) -> list[bool]:
        return [self._store(fields, now) for fields in records]

    def responsible(self, key: bytes) -> bool:
        """Whether this node is among the 2k nodes it knows closest to ``key`` (ample slack for tables that
        differ): a writer's lookup would pick it as one of the ``replicas`` to store on."""
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


def held_prefixes(records: Sequence[Record]) -> list[bytes]:
    """FIND_VALUE's ``held`` for records a reader holds: their signature prefixes, distinct, at most MAX_HELD."""
    out = list(dict.fromkeys(r.signature[:HELD_PREFIX] for r in records))
    return out[:MAX_HELD]


def had(held: Sequence[bytes], have: bytes) -> list[int]:
    """The positions in ``held`` that a VALUE's ``have`` bitmap marks (bits past ``held`` are ignored)."""
    return [i for i in range(min(len(held), 8 * len(have))) if have[i >> 3] >> (i & 7) & 1]


class RecentLookups:
    """The k closest that recent lookups found, per target: reused for RECENT_S (bounded: RECENT_LOOKUPS)."""

    def __init__(self, ttl: float = RECENT_S, size: int = RECENT_LOOKUPS) -> None:
        self.ttl = ttl
        self.size = size
        self._entries: OrderedDict[bytes, tuple[float, list[Contact]]] = OrderedDict()

    def get(self, target: bytes, now: float, table: RoutingTable, k: int) -> list[Contact] | None:
        """The k closest a lookup for ``target`` found within ``ttl``, less those that have left the table."""
        entry = self._entries.get(target)
        if entry is None or now - entry[0] > self.ttl:
            return None
        alive = [c for c in entry[1] if c.node_id in table]
        return alive if len(alive) >= min(k, len(table)) else None

    def remember(self, target: bytes, now: float, result: list[Contact]) -> None:
        self._entries[target] = (now, result)
        self._entries.move_to_end(target)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
