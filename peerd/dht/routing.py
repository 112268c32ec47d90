"""Kademlia routing table (sans-I/O): XOR metric, k-buckets with least-recently-seen eviction."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

ID_BITS = 256
# A full bucket PINGs its least-recently-seen contact when a newcomer is heard, at most once per this many seconds
# (when told the time). Each request from a node that waits as a replacement heard it again; at 64 daemons, where
# buckets overflow, that was one more PING (a third daemon woken) for about every third DHT request. A dead
# contact still leaves at once when a request to it fails (DhtService._forget).
EVICT_CHECK_S = 10.0
# A contact that let this many queries in a row go unanswered past a lookup's wait for them (DhtCore.missed) leaves
# the table, as one whose request failed outright does: a dead peer then costs the lookups that meet it this many
# waits, not one each until its first request's retries end (3.5 s). An answer, however late, starts the count
# again, and a contact that answers later is heard and enters again like any other.
MISSES = 2


@dataclass(frozen=True, slots=True)
class Contact:
    node_id: bytes
    host: str
    port: int
    # the id as an integer, for XOR distances: computed once, not in every sort and comparison of a lookup
    num: int = field(init=False, repr=False, compare=False)
    # (host, port), made once: every request to the contact reads it
    addr: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num", int.from_bytes(self.node_id, "big"))
        object.__setattr__(self, "addr", (self.host, self.port))


def distance(a: bytes, b: bytes) -> int:
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


def bucket_index(own: bytes, other: bytes) -> int:
    """Bucket i holds ids at XOR distance in [2**i, 2**(i+1))."""
    return distance(own, other).bit_length() - 1


class Bucket:
    """``contacts`` is changed only through the table, which drops ``_view`` whenever the set of contacts (not
    their order) changes: ``closest`` reads the view, a tuple, instead of walking the OrderedDict per call."""

    __slots__ = ("contacts", "replacements", "touched", "pinging", "checked", "_view")

    def __init__(self) -> None:
        self.contacts: OrderedDict[bytes, Contact] = OrderedDict()  # least recently seen first
        self.replacements: OrderedDict[bytes, Contact] = OrderedDict()
        self.touched = 0.0  # last time a lookup targeted this bucket's range
        self.pinging: bytes | None = None
        self.checked = -float("inf")  # when the last PING of the oldest contact began
        self._view: tuple[Contact, ...] | None = None

    def view(self) -> tuple[Contact, ...]:
        """The contacts, in no particular order (cached until one enters, leaves or changes address)."""
        view = self._view
        if view is None:
            view = self._view = tuple(self.contacts.values())
        return view


class Buckets:
    """The table's ID_BITS buckets, each made when first used: a table has a handful occupied, and ten
    thousand tables of 256 made up front (the simulator's) would cost about 850 MB."""

    __slots__ = ("made",)

    def __init__(self) -> None:
        self.made: dict[int, Bucket] = {}

    def __getitem__(self, index: int) -> Bucket:
        if index < 0:
            index += ID_BITS  # as a list would (own id's "bucket" -1: it is never added, see observe)
        bucket = self.made.get(index)
        if bucket is None:
            if not 0 <= index < ID_BITS:
                raise IndexError(f"bucket index {index} out of range")
            bucket = self.made[index] = Bucket()
        return bucket

    def __len__(self) -> int:
        return ID_BITS

    def __iter__(self) -> Iterator[Bucket]:
        return (self[i] for i in range(ID_BITS))


class RoutingTable:
    def __init__(self, node_id: bytes, k: int = 20) -> None:
        self.node_id = node_id
        self.k = k
        self.buckets = Buckets()
        self._count = 0
        self._occupied = 0  # bit i set: bucket i holds contacts
        self._own = int.from_bytes(node_id, "big")
        self.ids: set[bytes] = set()  # every contact's id (read-only outside): membership without finding its bucket
        # bumped whenever a contact enters, leaves or changes address (with the buckets' views): what ``closest``
        # answers for a target can only change then, so its callers may keep an answer until this moves
        self.version = 0
        self._misses: dict[bytes, int] = {}  # contact id -> queries unanswered in a row (contacts in the table only)

    def __len__(self) -> int:
        return self._count

    def holds(self, contact: Contact) -> bool:
        """``contact.node_id in self`` (kept for callers that hold a Contact)."""
        return contact.node_id in self.ids

    def __contains__(self, node_id: bytes) -> bool:
        return node_id in self.ids

    def contacts(self) -> list[Contact]:
        """Every contact, from the occupied buckets only (a table has a handful of its 256 occupied)."""
        out: list[Contact] = []
        bits = self._occupied
        while bits:
            i = bits.bit_length() - 1
            out.extend(self.buckets[i].contacts.values())
            bits ^= 1 << i
        return out

    def _index(self, node_id: bytes) -> int:
        """bucket_index(own id, node_id), with own id's integer computed once."""
        return (self._own ^ int.from_bytes(node_id, "big")).bit_length() - 1

    def _bucket(self, node_id: bytes) -> Bucket:
        return self.buckets[self._index(node_id)]

    def observe(self, contact: Contact, now: float | None = None) -> Contact | None:
        """Note that ``contact`` was heard from.

        Returns the bucket's least-recently-seen contact when the bucket is full: the caller pings
        it and reports through ``ping_result``; meanwhile the newcomer waits as a replacement. Given
        ``now``, a bucket asks for such a PING at most once per EVICT_CHECK_S.
        """
        if contact.node_id == self.node_id:
            return None
        index = (self._own ^ contact.num).bit_length() - 1
        bucket = self.buckets.made.get(index) or self.buckets[index]
        contacts = bucket.contacts
        node_id = contact.node_id
        if node_id in self.ids:
            if self._misses:
                self._misses.pop(node_id, None)
            old = contacts[node_id]
            if old is not contact and old != contact:
                contacts[node_id] = contact  # the address changed
                bucket._view = None
                self.version += 1
            contacts.move_to_end(node_id)
            return None
        if len(contacts) < self.k:
            contacts[node_id] = contact
            bucket._view = None
            self.version += 1
            self.ids.add(node_id)
            bucket.replacements.pop(node_id, None)
            self._count += 1
            self._occupied |= 1 << index
            return None
        bucket.replacements[contact.node_id] = contact
        bucket.replacements.move_to_end(contact.node_id)
        while len(bucket.replacements) > self.k:
            bucket.replacements.popitem(last=False)
        if bucket.pinging is not None or (now is not None and now - bucket.checked < EVICT_CHECK_S):
            return None
        oldest = next(iter(bucket.contacts.values()))
        bucket.pinging = oldest.node_id
        if now is not None:
            bucket.checked = now
        return oldest

    def waiting(self, contact: Contact) -> bool:
        """Whether ``contact`` (this id at this address) waits as a replacement: it was heard from there."""
        return self._bucket(contact.node_id).replacements.get(contact.node_id) == contact

    def ping_result(self, contact: Contact, alive: bool) -> None:
        bucket = self._bucket(contact.node_id)
        if bucket.pinging == contact.node_id:
            bucket.pinging = None
        if alive:
            if contact.node_id in bucket.contacts:
                bucket.contacts.move_to_end(contact.node_id)
        else:
            self.remove(contact.node_id)

    def holds_at(self, contact: Contact) -> bool:
        """Whether the table holds ``contact``'s node at ``contact``'s address (not merely its id)."""
        if contact.node_id not in self.ids:
            return False
        held = self._bucket(contact.node_id).contacts.get(contact.node_id)
        return held is not None and held.addr == contact.addr

    def missed(self, contact: Contact) -> bool:
        """A query to ``contact`` went unanswered past its wait: after MISSES in a row the contact leaves (True).

        Counted only for the address the table holds: a query to the id at another address (one a member named in
        an answer) shows nothing about the contact here."""
        if not self.holds_at(contact):
            return False
        node_id = contact.node_id
        count = self._misses.get(node_id, 0) + 1
        if count < MISSES:
            self._misses[node_id] = count
            return False
        self.remove(node_id)
        return True

    def remove(self, node_id: bytes) -> None:
        """Forget a contact that failed to answer; the freshest replacement takes its place."""
        bucket = self._bucket(node_id)
        bucket.replacements.pop(node_id, None)
        self._misses.pop(node_id, None)
        if bucket.contacts.pop(node_id, None) is None:
            return
        bucket._view = None
        self.version += 1
        self.ids.discard(node_id)
        self._count -= 1
        if bucket.replacements:
            _, replacement = bucket.replacements.popitem(last=True)
            bucket.contacts[replacement.node_id] = replacement
            self.ids.add(replacement.node_id)
            self._count += 1
        elif not bucket.contacts:
            self._occupied &= ~(1 << bucket_index(self.node_id, node_id))

    def closest(self, target: bytes, count: int | None = None, *, ordered: bool = True) -> list[Contact]:
        """The ``count`` contacts nearest ``target`` by XOR, nearest first (``ordered``; else in no particular
        order, for callers that rank them themselves: only the last bucket read is sorted, to pick from it).

        Reads only the buckets that can hold them. Bucket i's contacts share distance(own, target)'s bits
        above i and differ from it at bit i, so the buckets at set bits of that distance come first (highest
        first), then those at clear bits (lowest first), each one's distances an interval before the next's:
        the answer is the first buckets in that order that hold ``count`` contacts, sorted. Every FIND_NODE
        answer and every lookup's seeds come from here; scanning the whole table was most of their cost."""
        count = self.k if count is None else count
        if count <= 0 or not self._count:
            return []
        t = int.from_bytes(target, "big")
        d = self._own ^ t
        made = self.buckets.made  # every occupied bucket has been made
        picked: list[Contact] = []
        last: tuple[Contact, ...] = ()
        bits = d & self._occupied
        while bits and len(picked) < count:
            i = bits.bit_length() - 1
            bucket = made[i]
            last = bucket._view or bucket.view()  # the cached view, without a call (a bucket in use is not empty)
            picked += last
            bits ^= 1 << i
        bits = self._occupied & ~d
        while bits and len(picked) < count:
            low = bits & -bits
            bucket = made[low.bit_length() - 1]
            last = bucket._view or bucket.view()
            picked += last
            bits ^= low
        if len(picked) <= 1:
            return picked
        if not ordered:
            if len(picked) > count:  # the buckets before the last are nearer than all of it: pick from the last
                before = len(picked) - len(last)
                del picked[before:]
                picked += sorted(last, key=lambda c: c.num ^ t)[: count - before]
            return picked
        # ids differ, so the distances do: the order is total (a key per contact sorts faster than pairs)
        picked.sort(key=lambda c: c.num ^ t)
        if len(picked) > count:
            del picked[count:]
        return picked

    def complete_near(self, target: bytes, count: int | None = None) -> bool:
        """Whether ``closest(target, count)`` finds ``count`` contacts, in buckets that each hold fewer than k.

        A bucket turns a newcomer away only when full, so a bucket below k holds every live node this node
        has heard of in its range: the table's closest are then the closest it knows of, as a lookup's
        first answers would show (a small swarm, or the ranges next to a node's own id)."""
        count = self.k if count is None else count
        if count <= 0 or not self._count:
            return False
        d = self._own ^ int.from_bytes(target, "big")
        made = self.buckets.made
        seen = 0
        for bits, high_first in ((d & self._occupied, True), (self._occupied & ~d, False)):
            while bits and seen < count:
                i = bits.bit_length() - 1 if high_first else (bits & -bits).bit_length() - 1
                size = len(made[i].contacts)
                if size >= self.k:
                    return False
                seen += size
                bits ^= 1 << i
        return seen >= count

    def closer_than_me(self, target: bytes, limit: int) -> int:
        """How many contacts are closer to ``target`` than this node is, counted up to ``limit``.

        A contact in bucket i first differs from this node at bit i, so it is closer to ``target``
        exactly when bit i of distance(own, target) is set: only occupied buckets at set bits count.
        Costs O(occupied buckets), not O(contacts), so STORE can ask it per record."""
        bits = distance(self.node_id, target) & self._occupied
        count = 0
        while bits and count < limit:
            i = bits.bit_length() - 1
            count += len(self.buckets[i].contacts)
            bits ^= 1 << i
        return min(count, limit)

    def touch(self, target: bytes, now: float) -> None:
        if target != self.node_id:
            self._bucket(target).touched = now

    def buckets_to_refresh(self, now: float, interval: float) -> list[int]:
        """Stale buckets from the closest occupied one outwards (nearer ones are empty by nature)."""
        if not self._occupied:
            return []
        made = self.buckets.made
        first = (self._occupied & -self._occupied).bit_length() - 1
        return [i for i in range(first, ID_BITS) if now - (made[i].touched if i in made else 0.0) >= interval]

    def random_id_in_bucket(self, index: int, rng: random.Random) -> bytes:
        offset = (1 << index) | rng.getrandbits(index) if index else 1
        value = int.from_bytes(self.node_id, "big") ^ offset
        return value.to_bytes(ID_BITS // 8, "big")
