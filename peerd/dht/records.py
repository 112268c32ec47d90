"""Signed, expiring DHT records and the store that keeps them (sans-I/O, injected time).

A record's ``expires`` is absolute in the writer's clock and is signed: it orders versions of one
subkey (newest wins). How long a node keeps a record is set by the relative ``ttl`` carried on the
wire, so clock skew between machines cannot break records.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import msgpack

from ..wire import messages as m
from ..wire.errors import WireError
from ..wire.identity import Identity, verify

RECORD_DOMAIN = "peerd-v1 record"


def location(key: bytes) -> bytes:
    """Where a key lives in the id space."""
    return hashlib.sha256(key).digest()


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
    def from_wire(cls, fields: tuple, now: float) -> Record:
        """Check the signature of a decoded wire record; raises WireError("signature")."""
        key, subkey, value, expires, ttl, owner, sig = fields
        if ttl <= 0:
            raise WireError("malformed", "record with no time left to live")
        if not verify(owner, sig, signed_message(key, subkey, value, expires)):
            raise WireError("signature", "record signature does not verify")
        return cls(key, subkey, value, expires, owner, sig, now + ttl)

    def ttl(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    def to_wire(self, now: float) -> list:
        """Rounded up, so a live record never travels with ttl 0 (which readers refuse)."""
        ttl = math.ceil(self.ttl(now) * 1000) / 1000
        return [self.key, self.subkey, self.value, self.expires, ttl, self.owner, self.signature]


class RecordStore:
    """Records by (key, subkey); bounded so a member cannot exhaust a node's memory."""

    def __init__(self, *, max_records: int = 100_000, max_subkeys: int = 1024) -> None:
        self._by_key: dict[bytes, OrderedDict[bytes, Record]] = {}
        self._count = 0
        self.max_records = max_records
        self.max_subkeys = max_subkeys

    def __len__(self) -> int:
        return self._count

    def store(self, record: Record, now: float) -> str | None:
        """Keep ``record`` if it may replace what is there; returns None, or why it was refused."""
        subkeys = self._by_key.get(record.key)
        current = subkeys.get(record.subkey) if subkeys else None
        if current is not None and current.deadline <= now:
            current = None
        if current is not None:
            if current.owner != record.owner:
                return "owner"  # only the owner of a live subkey may overwrite it
            if record.expires < current.expires:
                return "stale"
            if record.expires == current.expires:
                if record.signature != current.signature:
                    return "stale"
                if record.deadline <= current.deadline:
                    return None  # already held, and for longer
        else:
            if subkeys is not None and len(subkeys) >= self.max_subkeys:
                self._expire_key(record.key, now)
                subkeys = self._by_key.get(record.key)  # expiry may have dropped the key's map
                if subkeys is not None and len(subkeys) >= self.max_subkeys:
                    return "full"
            if self._count >= self.max_records:
                self.expire(now)
                subkeys = self._by_key.get(record.key)
                if self._count >= self.max_records:
                    return "full"
        if subkeys is None:
            subkeys = self._by_key[record.key] = OrderedDict()
        if record.subkey not in subkeys:
            self._count += 1
        subkeys[record.subkey] = record
        return None

    def get(self, key: bytes, now: float) -> list[Record]:
        """Live records under ``key``, sorted by subkey (the paging order of VALUE)."""
        subkeys = self._by_key.get(key)
        if not subkeys:
            return []
        return sorted((r for r in subkeys.values() if r.deadline > now), key=lambda r: r.subkey)

    def records(self, now: float) -> list[Record]:
        return [r for subkeys in self._by_key.values() for r in subkeys.values() if r.deadline > now]

    def _expire_key(self, key: bytes, now: float) -> None:
        subkeys = self._by_key.get(key)
        if subkeys is None:
            return
        for subkey in [s for s, r in subkeys.items() if r.deadline <= now]:
            del subkeys[subkey]
            self._count -= 1
        if not subkeys:
            del self._by_key[key]

    def expire(self, now: float) -> None:
        for key in list(self._by_key):
            self._expire_key(key, now)


def merge_newest(records: list[Record]) -> list[Record]:
    """One record per (key, subkey, owner): the newest expiry."""
    best: dict[tuple[bytes, bytes, bytes], Record] = {}
    for r in records:
        slot = (r.key, r.subkey, r.owner)
        if slot not in best or r.expires > best[slot].expires:
            best[slot] = r
    return sorted(best.values(), key=lambda r: (r.key, r.subkey))
