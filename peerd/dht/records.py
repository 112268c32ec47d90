"""Signed, expiring DHT records and the store that keeps them (sans-I/O, injected time).

A record's ``expires`` is absolute in the writer's clock and is signed: it orders versions of one
subkey (newest wins). How long a node keeps a record is set by the relative ``ttl`` carried on the
wire, so clock skew between machines cannot break records.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

import msgpack

from ..wire import messages as m
from ..wire.errors import WireError
from ..wire.identity import Identity, node_id_of, verify

RECORD_DOMAIN = "peerd-v1 record"
MAX_RECORDS_STORED = 100_000  # records one node keeps, in all
MAX_SUBKEYS = 1024  # subkeys under one key: a run's progress key has one per peer
MAX_PER_OWNER = 1000  # records of one owner key at one node (1 % of the store)
_HEX = frozenset(b"0123456789abcdef")


def location(key: bytes) -> bytes:
    """Where a key lives in the id space."""
    return hashlib.sha256(key).digest()


def named_node(subkey: bytes) -> bytes | None:
    """The node id a subkey names (32 raw bytes, or its 64 lowercase hex digits), or None."""
    if len(subkey) == 32:
        return subkey
    if len(subkey) == 64 and _HEX.issuperset(subkey):
        return bytes.fromhex(subkey.decode())
    return None


def slot_allows(subkey: bytes, owner: bytes) -> bool:
    """A subkey that names a node is that node's alone: only the key whose hash is that id writes it.

    Without this rule the first writer of a slot owns it, so a member could take a victim's slots
    (its adverts, its progress, its place in matchmaking) before the victim writes them."""
    node = named_node(subkey)
    return node is None or node_id_of(owner) == node


def signed_message(key: bytes, subkey: bytes, value: bytes, expires: float) -> bytes:
    return msgpack.packb([RECORD_DOMAIN, key, subkey, value, float(expires)], use_bin_type=True)


@dataclass(frozen=True, slots=True)
class Record:
    key: bytes
    subkey: bytes
    value: bytes
    expires: float  # writer's clock, signed
    owner: bytes  # Ed25519 public key
    signature: bytes
    deadline: float  # this node's monotonic clock: when to forget it

    @classmethod
    def create(
        cls, identity: Identity, key: bytes, subkey: bytes, value: bytes, ttl: float, *, wall: float, now: float
    ) -> Record:
        if not 0 < ttl <= m.MAX_TTL:
            raise ValueError(f"ttl must be in (0, {m.MAX_TTL:.0f}] seconds")
        if not 1 <= len(key) <= m.MAX_KEY or len(subkey) > m.MAX_SUBKEY or len(value) > m.MAX_VALUE:
            raise ValueError(
                f"key must be 1..{m.MAX_KEY} bytes, subkey at most {m.MAX_SUBKEY}, value at most {m.MAX_VALUE}"
            )
        expires = round(wall + ttl, 3)
        sig = identity.sign(signed_message(key, subkey, value, expires))
        return cls(key, subkey, value, expires, identity.public_key, sig, now + ttl)

    @classmethod
    def from_wire(cls, fields: tuple, now: float, *, check: bool = True) -> Record:
        """A decoded wire record; raises WireError("signature") unless it verifies.

        ``check=False`` skips the signature (about 60 us): for deciding cheaply whether the record
        would be refused anyway; call ``check_signature`` before keeping or using it."""
        key, subkey, value, expires, ttl, owner, sig = fields
        if ttl <= 0:
            raise WireError("malformed", "record with no time left to live")
        record = cls(key, subkey, value, expires, owner, sig, now + ttl)
        if check:
            record.check_signature()
        return record

    def check_signature(self) -> None:
        if not verify(self.owner, self.signature, signed_message(self.key, self.subkey, self.value, self.expires)):
            raise WireError("signature", "record signature does not verify")

    def ttl(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    def to_wire(self, now: float) -> list:
        """Rounded up, so a live record never travels with ttl 0 (which readers refuse)."""
        ttl = math.ceil(self.ttl(now) * 1000) / 1000
        return [self.key, self.subkey, self.value, self.expires, ttl, self.owner, self.signature]


class VerifiedCache:
    """Records whose signature verified, so that no copy of them is checked again (bounded, LRU).

    Keyed by everything the signature covers plus the owner and the signature itself, never by the
    signature alone: a record that reuses a valid signature over other content misses the cache and
    is checked. An Ed25519 check costs ~60 us; a get reads the same record from up to k holders, and
    Moshpit polls the same keys every round."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self.hits = 0

    def check(self, record: Record) -> None:
        """Raise WireError("signature") unless the record verifies (or already did)."""
        slot = (record.signature, record.owner, record.key, record.subkey, record.value, record.expires)
        if slot in self._seen:
            self._seen.move_to_end(slot)
            self.hits += 1
            return
        record.check_signature()
        self._seen[slot] = None
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)


class RecordStore:
    """Records by (key, subkey), bounded so that no member can exhaust a node's memory or CPU.

    Bounds: ``max_records`` in all, ``max_subkeys`` per key, ``max_per_owner`` per owner public key.
    A full store keeps the keys nearest its own id (XOR distance of the key's location): a new key
    evicts a record of the farthest key held, and a key at least as far is refused. Expiry pops a
    deadline heap, so storing, refusing and expiring a record each cost O(log n), never a scan.
    ``check`` decides without the signature, so a record that would be refused costs no Ed25519 check.
    """

    def __init__(
        self,
        own_id: bytes | None = None,
        *,
        max_records: int = MAX_RECORDS_STORED,
        max_subkeys: int = MAX_SUBKEYS,
        max_per_owner: int = MAX_PER_OWNER,
    ) -> None:
        self._by_key: dict[bytes, OrderedDict[bytes, Record]] = {}
        self._count = 0
        self.own = int.from_bytes(own_id if own_id is not None else bytes(32), "big")
        self.max_records = max_records
        self.max_subkeys = max_subkeys
        self.max_per_owner = max_per_owner
        self._per_owner: dict[bytes, int] = {}
        # (deadline, key, subkey): pushed whenever a slot takes a record; an entry whose record has since
        # been renewed, replaced or evicted is skipped when it comes up (lazy deletion)
        self._deadlines: list[tuple[float, bytes, bytes]] = []
        # (-distance, key): one entry per key, the farthest on top; entries of keys gone are skipped
        self._far: list[tuple[int, bytes]] = []
        self._in_far: set[bytes] = set()
        self._sorted: dict[bytes, list[Record]] = {}  # a key's records by subkey, until the key changes

    def __len__(self) -> int:
        return self._count

    @property
    def loaded(self) -> bool:
        """Over half full: the node stores only keys it is responsible for (see DhtCore)."""
        return self._count >= self.max_records // 2

    def distance(self, key: bytes) -> int:
        return int.from_bytes(location(key), "big") ^ self.own

    def holds(self, key: bytes, subkey: bytes) -> bool:
        subkeys = self._by_key.get(key)
        return subkeys is not None and subkey in subkeys

    def check(self, record: Record, now: float) -> str | None:
        """Why ``record`` would be refused, or None if ``store`` would keep it. Reads no signature.

        Refusals: "slot" (the subkey names another node), "owner" (a live subkey is another owner's),
        "stale" (an older or rival version), "full" (the key's subkeys, or the whole store with no
        farther key to evict), "quota" (the owner holds ``max_per_owner`` records here)."""
        if not slot_allows(record.subkey, record.owner):
            return "slot"
        self.expire(now)
        subkeys = self._by_key.get(record.key)
        current = subkeys.get(record.subkey) if subkeys else None
        if current is not None:
            if current.owner != record.owner:
                return "owner"  # only the owner of a live subkey may overwrite it
            if record.expires < current.expires:
                return "stale"
            if record.expires == current.expires and record.signature != current.signature:
                return "stale"
            return None
        if subkeys is not None and len(subkeys) >= self.max_subkeys:
            return "full"
        if self._per_owner.get(record.owner, 0) >= self.max_per_owner:
            return "quota"
        if self._count >= self.max_records:
            farthest = self._farthest()
            if farthest is None or self.distance(record.key) >= farthest[0]:
                return "full"
        return None

    def store(self, record: Record, now: float) -> str | None:
        """Keep ``record`` if it may replace what is there; returns None, or why it was refused.

        The caller has checked the signature (``Record.from_wire``) or signed the record itself."""
        why = self.check(record, now)
        if why is not None:
            return why
        subkeys = self._by_key.get(record.key)
        current = subkeys.get(record.subkey) if subkeys else None
        if current is not None:
            if record.expires == current.expires and record.deadline <= current.deadline:
                return None  # already held, and for longer
            subkeys[record.subkey] = record
            self._sorted.pop(record.key, None)
            self._schedule(record)
            self._compact()
            return None
        if self._count >= self.max_records:
            farthest = self._farthest()
            assert farthest is not None  # check() found one
            victims = self._by_key[farthest[1]]
            _, victim = victims.popitem(last=True)  # the newest slot of the farthest key
            self._forget(victim)
            subkeys = self._by_key.get(record.key)
        if subkeys is None:
            subkeys = self._by_key[record.key] = OrderedDict()
            if record.key not in self._in_far:
                self._in_far.add(record.key)
                heapq.heappush(self._far, (-self.distance(record.key), record.key))
        subkeys[record.subkey] = record
        self._sorted.pop(record.key, None)
        self._count += 1
        self._per_owner[record.owner] = self._per_owner.get(record.owner, 0) + 1
        self._schedule(record)
        self._compact()
        return None

    def get(self, key: bytes, now: float) -> list[Record]:
        """Live records under ``key``, sorted by subkey (the paging order of VALUE).

        The order is kept until the key changes, so paging through a key of 1024 subkeys does not
        sort them again for every FIND_VALUE a member sends."""
        subkeys = self._by_key.get(key)
        if not subkeys:
            return []
        ordered = self._sorted.get(key)
        if ordered is None:
            ordered = self._sorted[key] = sorted(subkeys.values(), key=lambda r: r.subkey)
        return [r for r in ordered if r.deadline > now]

    def records(self, now: float) -> list[Record]:
        return [r for subkeys in self._by_key.values() for r in subkeys.values() if r.deadline > now]

    def expire(self, now: float) -> None:
        """Forget every record whose deadline has come: O(log n) per record forgotten, nothing else scanned."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, key, subkey = heapq.heappop(heap)
            subkeys = self._by_key.get(key)
            record = subkeys.get(subkey) if subkeys else None
            if record is not None and record.deadline <= now:
                del subkeys[subkey]  # type: ignore[union-attr]
                self._forget(record)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _schedule(self, record: Record) -> None:
        heapq.heappush(self._deadlines, (record.deadline, record.key, record.subkey))

    def _forget(self, record: Record) -> None:
        """Account for a record already taken out of its key's map."""
        self._count -= 1
        self._sorted.pop(record.key, None)
        left = self._per_owner[record.owner] - 1
        if left:
            self._per_owner[record.owner] = left
        else:
            del self._per_owner[record.owner]
        if not self._by_key[record.key]:
            del self._by_key[record.key]  # its entry in _far is skipped when it comes up

    def _farthest(self) -> tuple[int, bytes] | None:
        """(distance, key) of the farthest key held."""
        far = self._far
        while far and far[0][1] not in self._by_key:
            self._in_far.discard(heapq.heappop(far)[1])
        return (-far[0][0], far[0][1]) if far else None

    def _compact(self) -> None:
        """Rebuild a heap once most of it is skipped entries: amortized O(1) per record stored."""
        if len(self._deadlines) > 2 * self._count + 1024:
            self._deadlines = [(r.deadline, r.key, r.subkey) for s in self._by_key.values() for r in s.values()]
            heapq.heapify(self._deadlines)
        if len(self._far) > 2 * len(self._by_key) + 1024:
            self._far = [(-self.distance(key), key) for key in self._by_key]
            heapq.heapify(self._far)
            self._in_far = set(self._by_key)


def merge_newest(records: list[Record]) -> list[Record]:
    """One record per (key, subkey, owner): the newest expiry."""
    best: dict[tuple[bytes, bytes, bytes], Record] = {}
    for r in records:
        slot = (r.key, r.subkey, r.owner)
        if slot not in best or r.expires > best[slot].expires:
            best[slot] = r
    return sorted(best.values(), key=lambda r: (r.key, r.subkey))
