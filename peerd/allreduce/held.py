"""Tensor bodies kept until they can be used (sans-I/O: every call takes ``now``).

A member may start sending before this node has started the group (its data is held for the group), and
its data may arrive before the control message that binds its sealing token to its identity (held for
the token). Every member holds the swarm key and may invent tokens and group ids, so what is held is
bounded in bytes, in total and per token, and in time: a bucket of bodies (one group, one token) is
dropped ``max_age_s`` after its first body arrived, on a timer (``expire``) as well as on arrival.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_BYTES = 64 << 20  # all held bodies together
MAX_TOKEN_BYTES = 16 << 20  # held bodies of one sealing token
MAX_AGE_S = 10.0
ENTRY_OVERHEAD = 128  # bytes charged per body for its bookkeeping (tuple, list slot, bytes header)
MAX_WASTING = 4096  # tokens whose held data went unused, remembered (as many as the transport keeps tokens)


def bodies_in(item: Any) -> int:
    """Bodies in a held item: one (a body's bytes), or a held block's rows (an array of them)."""
    return 1 if isinstance(item, bytes | bytearray | memoryview) else len(item)


class _Bucket:
    __slots__ = ("first_at", "nbytes", "count", "items")

    def __init__(self, first_at: float) -> None:
        self.first_at = first_at
        self.nbytes = 0
        self.count = 0  # bodies (an item may be a block of several)
        self.items: list[Any] = []


class HeldData:
    """Bodies held per (group, token), oldest bucket first.

    ``add`` refuses a body that would take its token over ``max_token_bytes`` (a flood from one token
    cannot push out the others' data) and evicts the oldest buckets while the total would exceed
    ``max_bytes`` (new tokens cost nothing to invent, so the total is what bounds memory)."""

    def __init__(
        self, *, max_bytes: int = MAX_BYTES, max_token_bytes: int = MAX_TOKEN_BYTES, max_age_s: float = MAX_AGE_S
    ) -> None:
        self.max_bytes = max_bytes
        self.max_token_bytes = max_token_bytes
        self.max_age_s = max_age_s
        self._buckets: OrderedDict[tuple[int, int], _Bucket] = OrderedDict()
        self._by_group: dict[int, set[int]] = {}
        self._token_bytes: dict[int, int] = {}
        self.nbytes = 0
        self.count = 0
        # token -> when a bucket of it last went unused (expired, or dropped to make room for another), oldest
        # first: honest data is taken when its group starts, so these sent data for groups that never started here
        self._wasted: OrderedDict[int, float] = OrderedDict()

    def add(self, group: int, token: int, item: Any, nbytes: int, now: float, *, count: int = 1) -> tuple[bool, int]:
        """Hold ``item``: a body of ``nbytes``, or a block of ``count`` bodies of ``nbytes`` together (charged
        as that many bodies). Returns (held, bodies dropped to make room or expired)."""
        dropped = self.expire(now)
        size = nbytes + ENTRY_OVERHEAD * count
        if self._token_bytes.get(token, 0) + size > self.max_token_bytes or size > self.max_bytes:
            return False, dropped
        while self.nbytes + size > self.max_bytes and self._buckets:
            dropped += self._drop(next(iter(self._buckets)), now)
        key = (group, token)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(now)
            self._by_group.setdefault(group, set()).add(token)
        bucket.items.append(item)
        bucket.nbytes += size
        bucket.count += count
        self._token_bytes[token] = self._token_bytes.get(token, 0) + size
        self.nbytes += size
        self.count += count
        return True, dropped

    def tokens(self) -> dict[int, int]:
        """The tokens holding data now (read-only: bytes held per token)."""
        return self._token_bytes

    def pop(self, group: int, token: int) -> list[Any]:
        """What is held for ``group`` from ``token`` (its binding arrived), oldest first."""
        bucket = self._take((group, token))
        return bucket.items if bucket is not None else []

    def pop_group(self, group: int) -> list[Any]:
        """Everything held for ``group`` (it starts), oldest bucket first."""
        items: list[Any] = []
        for token in sorted(self._by_group.get(group, ()), key=lambda t: self._buckets[(group, t)].first_at):
            bucket = self._take((group, token))
            if bucket is not None:
                items.extend(bucket.items)
        return items

    def holds(self, group: int) -> bool:
        return bool(self._by_group.get(group))

    def count_of(self, group: int) -> int:
        return sum(self._buckets[(group, t)].count for t in self._by_group.get(group, ()))

    def expire(self, now: float) -> int:
        """Drop buckets older than ``max_age_s``; returns how many bodies went."""
        dropped = 0
        while self._buckets:
            key, bucket = next(iter(self._buckets.items()))
            # the same sum as ``next_expiry``: a timer set for it must find the bucket expired (now - max_age_s
            # may round below first_at, and a timer loop would spin at that instant)
            if bucket.first_at + self.max_age_s > now:
                break
            dropped += self._drop(key, now)
        return dropped

    def next_expiry(self) -> float | None:
        """When the oldest bucket expires (None: nothing held)."""
        for bucket in self._buckets.values():
            return bucket.first_at + self.max_age_s
        return None

    def wasting(self, token: int, now: float) -> bool:
        """Whether data held from ``token`` went unused (expired, or dropped to make room) within ``max_age_s``
        before ``now``."""
        at = self._wasted.get(token)
        return at is not None and now < at + self.max_age_s

    def _drop(self, key: tuple[int, int], now: float) -> int:
        """Drop a bucket unused; its token is remembered as wasting (``wasting``)."""
        bucket = self._take(key)
        if bucket is None:
            return 0
        token = key[1]
        self._wasted[token] = now
        self._wasted.move_to_end(token)
        if len(self._wasted) > MAX_WASTING:
            self._wasted.popitem(last=False)
        return bucket.count

    def _take(self, key: tuple[int, int]) -> _Bucket | None:
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            return None
        group, token = key
        tokens = self._by_group[group]
        tokens.discard(token)
        if not tokens:
            del self._by_group[group]
        left = self._token_bytes[token] - bucket.nbytes
        if left > 0:
            self._token_bytes[token] = left
        else:
            del self._token_bytes[token]
        self.nbytes -= bucket.nbytes
        self.count -= bucket.count
        return bucket
