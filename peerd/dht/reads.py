"""What a DHT read needs before it may stop (sans-I/O): ``DhtService.get(key, enough=...)``.

A get without ``enough`` reads every one of the r closest nodes, its holders (PROTOCOL.md 10.5). A get with one ends
its lookup as soon as the records read so far satisfy it, and otherwise runs to the end like a full read,
so an early form never returns less than it says: it only stops sooner when the answer is known.

``done`` is asked after each responder has been read, with every verified record so far (this node's
own copies included) and, per responder read in full, the signatures it sent. This node counts as one of those
holders when it is one of the r closest to the key that it knows (its own copies, read in full).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from ..wire.errors import WireError
from ..wire.identity import node_id_of
from .records import Record, VerifiedCache, merge_newest, slot_allows


@dataclass(slots=True)
class Page:
    """One VALUE page read: the records it added, the last subkey so far, and why the responder is read no
    further (``dropped``: a record that does not decode or verify; ``ignored``: "key" or "slot", a record no
    honest node would hold)."""

    records: list[Record] = field(default_factory=list)
    last: bytes | None = None
    dropped: str | None = None
    ignored: str | None = None

    @property
    def ok(self) -> bool:
        return self.dropped is None and self.ignored is None


def read_page(key: bytes, raw: list, now: float, after: bytes | None, verified: set[tuple],
              cache: VerifiedCache) -> Page:
    """Check one VALUE page of a read of ``key``; ``after`` is the last subkey read from this responder.

    Pages come sorted by subkey; a record written between two pages shifts the next one, so a page may start
    with subkeys already read: those are skipped, never checked twice. ``verified`` holds the signed parts
    of records this read has seen verified (a copy needs no second check); ``cache`` is the node's."""
    page = Page(last=after)
    for fields in raw:
        try:
            record = Record.from_wire(fields, now, check=False)
        except WireError as e:
            page.dropped = e.reason
            return page
        if after is not None and record.subkey <= after:
            continue
        if record.key != key:
            page.ignored = "key"
            return page
        if not slot_allows(record.subkey, record.owner):
            page.ignored = "slot"  # signed by a member that took a slot naming another node
            return page
        signed = signed_part(record)
        if signed not in verified:
            try:
                cache.check(record)  # a copy verified by an earlier read or STORE is not again
            except WireError as e:
                page.dropped = e.reason
                return page
            verified.add(signed)
        page.records.append(record)
        page.last = after = record.subkey
    return page


def signed_part(record: Record) -> tuple:
    return (record.key, record.subkey, record.value, record.expires, record.owner, record.signature)


def near_holders(holders: Sequence[tuple[bytes, frozenset[bytes]]], near: Container[bytes]) -> list[frozenset[bytes]]:
    """The holders (responder's node id, signatures it holds) that are ``near``: the lookup's closest so far, and
    the reader itself where it is one of them. An early read trusts only the key's neighbourhood as the lookup
    knows it then: a member whose table is still filling asks farther nodes first, which hold nothing, and three
    of them "agreed" on that (3 of 60 Agreed(3) reads by a new member of 64 daemons, at 8 replicas)."""
    return [h for node_id, h in holders if node_id in near]


class Enough:
    """Never enough: the full read."""

    def done(self, records: Sequence[Record], holders: Sequence[frozenset[bytes]]) -> bool:
        return False


class Newer(Enough):
    """Any record of ``subkey`` (of ``owner``'s node id, if given) whose ``expires`` is after ``after``."""

    def __init__(self, subkey: bytes, after: float, owner: bytes | None = None) -> None:
        self.subkey, self.after, self.owner = subkey, after, owner

    def done(self, records: Sequence[Record], holders: Sequence[frozenset[bytes]]) -> bool:
        return any(
            r.subkey == self.subkey and r.expires > self.after
            and (self.owner is None or node_id_of(r.owner) == self.owner)
            for r in records
        )


class Owners(Enough):
    """A record of each of these owners (node ids)."""

    def __init__(self, owners: Iterable[bytes]) -> None:
        self.owners = frozenset(owners)

    def done(self, records: Sequence[Record], holders: Sequence[frozenset[bytes]]) -> bool:
        return self.owners <= {node_id_of(r.owner) for r in records}


class Agreed(Enough):
    """``n`` responders, each read in full, that all hold the newest version of every record seen so far.

    The answer "what the first n holders agree on": every writer stores on the same r closest nodes, so
    when n of them hold the same records, the rest hold them too unless a write is racing this read (a
    reader that polls sees it next time) or writers saw other nodes (churn). A responder that holds
    less, an older version or nothing (a stale or hostile node) does not count, and the read goes on;
    with no n agreeing it is a full read. Meant for keys that are polled: matchmaking, progress, adverts."""

    def __init__(self, n: int = 3) -> None:
        if n < 1:
            raise ValueError("Agreed needs n >= 1")
        self.n = n

    def done(self, records: Sequence[Record], holders: Sequence[frozenset[bytes]]) -> bool:
        if len(holders) < self.n:
            return False
        newest = {r.signature for r in merge_newest(list(records))}
        return sum(1 for h in holders if newest <= h) >= self.n


class AnyOf(Enough):
    """Enough when any of ``forms`` is."""

    def __init__(self, *forms: Enough) -> None:
        self.forms = forms

    def done(self, records: Sequence[Record], holders: Sequence[frozenset[bytes]]) -> bool:
        return any(f.done(records, holders) for f in self.forms)
