"""What an outsider may cost this node before it proves anything (PROTOCOL.md 4.6 and 8.5): sans-I/O, ``now``
injected.

- ``AuthLimiter``: a datagram under a token this node has no key for costs an HKDF and an AES-GCM setup
  (about 55 us) before it fails; so such datagrams are tried only while their source has not failed too often
  and the node has derivations left this second. Past either limit they are dropped (and counted) before any
  crypto.
- ``AmplificationGuard``: a node answers an address it has not validated with at most 3x the bytes it
  received from it (the QUIC rule), so a spoofed request reflects little at its victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from ..wire.native import native
from .caps import native_receive

AMPLIFICATION_FACTOR = 3
MAX_ADDRESSES = 4096  # per table: sources with failures, addresses with a budget, validated addresses


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def has(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= 1

    def take(self, now: float, n: float = 1) -> bool:
        """Take ``n`` tokens if there is at least one (a debt below zero is paid back by the refill)."""
        self._refill(now)
        if self.tokens < 1:
            return False
        self.tokens -= n
        return True


def _lru_put(table: OrderedDict, key: Hashable, value: object, bound: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > bound:
        table.popitem(last=False)


class AuthLimiter:
    """Rations the datagrams that fail to authenticate, per source address and for the whole node.

    ``may_derive`` is asked before a key is derived for an unknown token: no when the source has used up its
    failures (``failure_rate`` a second, ``failure_burst`` at once) or the node its derivations
    (``derive_rate`` a second, ``derive_burst`` at once, whatever the source: spoofed sources are free).
    Datagrams under a token already known are never refused here (they cost one AES-GCM call, and a source
    address can be spoofed: a member's traffic must not be silenced by failures forged in its name).
    """

    def __init__(
        self,
        *,
        failure_rate: float = 10.0,
        failure_burst: float = 32.0,
        derive_rate: float = 1000.0,
        derive_burst: float = 1000.0,
        max_sources: int = MAX_ADDRESSES,
    ) -> None:
        self.failure_rate, self.failure_burst = failure_rate, failure_burst
        self._sources: OrderedDict[Hashable, TokenBucket] = OrderedDict()
        self._derive: TokenBucket | None = None
        self.derive_rate, self.derive_burst = derive_rate, derive_burst
        self.max_sources = max_sources

    def may_derive(self, source: Hashable, now: float) -> bool:
        bucket = self._sources.get(source)
        if bucket is not None and not bucket.has(now):
            return False
        if self._derive is None:
            self._derive = TokenBucket(self.derive_rate, self.derive_burst, now)
        return self._derive.take(now)

    def failed(self, source: Hashable, count: int, now: float) -> None:
        """``count`` datagrams from ``source`` failed to authenticate."""
        bucket = self._sources.get(source)
        if bucket is None:
            bucket = TokenBucket(self.failure_rate, self.failure_burst, now)
        _lru_put(self._sources, source, bucket, self.max_sources)
        bucket.take(now, count)


class NativeAuthLimiter:
    """``AuthLimiter`` with its buckets in the C extension's fixed-size table (``_native.Ration``), the same
    decisions, so that the native receive pass can ration junk from a refused source before Python sees it
    (``table``: what ``UdpSocket.recv_screened`` hands to C). A source that is not an IP (host, port) (in-memory
    test sockets) keeps its bucket in a Python ``AuthLimiter`` beside it, sharing the table's derivations."""

    def __init__(
        self,
        *,
        failure_rate: float = 10.0,
        failure_burst: float = 32.0,
        derive_rate: float = 1000.0,
        derive_burst: float = 1000.0,
        max_sources: int = MAX_ADDRESSES,
        seed: int = 0,
    ) -> None:
        ration = getattr(native, "Ration", None)
        if ration is None:
            raise RuntimeError("NativeAuthLimiter needs the native extension's Ration (Linux, built)")
        self.table = ration(failure_rate=failure_rate, failure_burst=failure_burst, derive_rate=derive_rate,
                            derive_burst=derive_burst, max_sources=max_sources, seed=seed & (2**64 - 1))
        self._other = AuthLimiter(failure_rate=failure_rate, failure_burst=failure_burst, max_sources=max_sources)
        self.failure_rate, self.failure_burst = failure_rate, failure_burst
        self.derive_rate, self.derive_burst = derive_rate, derive_burst
        self.max_sources = max_sources

    def may_derive(self, source: Hashable, now: float) -> bool:
        allowed = self.table.may_derive(source, now)
        if allowed is not None:
            return allowed
        bucket = self._other._sources.get(source)
        if bucket is not None and not bucket.has(now):
            return False
        return self.table.derive(now)

    def failed(self, source: Hashable, count: int, now: float) -> None:
        if not self.table.failed(source, now, count):
            self._other.failed(source, count, now)


def auth_limiter(seed: int = 0) -> AuthLimiter | NativeAuthLimiter:
    """The limiter a node's transport core gets: the C table where the native receive pass runs (it consults
    the table), else the Python reference."""
    if native_receive() is not None and getattr(native, "Ration", None) is not None:
        return NativeAuthLimiter(seed=seed)
    return AuthLimiter()


class AmplificationGuard:
    """Bytes received from and sent to each address not yet validated; validated addresses (bounded, LRU).

    An address is validated when this node sent it a request and a sealed response came back from it (the
    response carries the request's random ``rid``, which only the addressee could read)."""

    def __init__(self, *, factor: int = AMPLIFICATION_FACTOR, max_addresses: int = MAX_ADDRESSES) -> None:
        self.factor = factor
        self.max_addresses = max_addresses
        self._budget: OrderedDict[Hashable, list[int]] = OrderedDict()  # address -> [received, sent]
        self._validated: OrderedDict[Hashable, None] = OrderedDict()

    def is_validated(self, addr: Hashable) -> bool:
        return addr in self._validated

    def validate(self, addr: Hashable) -> None:
        self._budget.pop(addr, None)
        _lru_put(self._validated, addr, None, self.max_addresses)

    def received(self, addr: Hashable, nbytes: int) -> None:
        """An authenticated datagram of ``nbytes`` arrived from ``addr``."""
        if addr in self._validated:
            self._validated.move_to_end(addr)
            return
        entry = self._budget.get(addr) or [0, 0]
        entry[0] += nbytes
        _lru_put(self._budget, addr, entry, self.max_addresses)

    def allowance(self, addr: Hashable) -> int | None:
        """How many more bytes this node may send ``addr`` in answers; None: no limit (validated)."""
        if addr in self._validated:
            return None
        received, sent = self._budget.get(addr) or (0, 0)
        return max(0, self.factor * received - sent)

    def may_send(self, addr: Hashable, nbytes: int) -> bool:
        """Whether an answer of ``nbytes`` fits; if so it is charged."""
        if addr in self._validated:
            return True
        entry = self._budget.get(addr)
        if entry is None or self.factor * entry[0] - entry[1] < nbytes:
            return False
        entry[1] += nbytes
        return True
