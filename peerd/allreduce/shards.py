"""Where shards and datagram ranges lie in the flat vector (protocol/allreduce.md, "Shards and ranges").

Every member derives the same boundaries from (vector length, n, elements per datagram), so no
boundaries travel: a receiver checks that a datagram names exactly one of the ranges it expects and
accounts for it by its datagram index. That is what makes the per-range bookkeeping O(1) per datagram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..compress import Codec
from ..wire.errors import WireError
from .frames import HEADER_SIZE, MAX_COUNT

MAX_ELEMENTS = 2**32 - 1  # offsets travel as u32


def elements_per_datagram(max_payload: int, codec: Codec | None = None) -> int:
    """Elements whose body fits ``max_payload`` bytes after the header (at most 65535): float32 values, or
    the largest count whose ``codec`` body fits (protocol/codecs.md), which fixes the group's ranges."""
    if codec is None or codec.wire_id == 0:
        per = min((max_payload - HEADER_SIZE) // 4, MAX_COUNT)
    else:
        per = codec.max_count(max_payload - HEADER_SIZE, MAX_COUNT) if max_payload > HEADER_SIZE else 0
    if per < 1:
        raise ValueError(
            f"max_payload={max_payload} leaves no room for one element after the {HEADER_SIZE}-byte header"
        )
    return per


MAX_SHARE = 2  # a member's shard is at most this many times the equal share (n members: 1/n of the vector each)


def capped_shares(capped: Sequence[bool]) -> tuple[int, ...] | None:
    """The shares of a group whose members ``capped`` advertised bandwidth caps (PROTOCOL.md 16, Begin): a capped
    member sends and receives the vector plus (n - 2) times its shard in a round, so the least it can carry is
    the vector, with no shard. The uncapped members take the capped ones' shards, each up to MAX_SHARE equal
    shares, and the capped members split what is left equally. None (equal shares) when all or none are capped.
    The bound is what a leader that marks members capped can win: at most MAX_SHARE equal shares for any member."""
    n, u = len(capped), sum(not c for c in capped)
    c = n - u
    if u == 0 or c == 0:
        return None
    # in units of 1/(n*u*c) of the vector: an uncapped member min(MAX_SHARE, n/u) equal shares, a capped one the rest
    free = min(MAX_SHARE * u, n) * c
    rest = n * u - u * min(MAX_SHARE * u, n)
    return tuple(rest if cap else free for cap in capped)


@dataclass(frozen=True, slots=True)
class Layout:
    """Shard j is elements [j*L//n, (j+1)*L//n): shards differ in size by at most one element, some empty when
    L < n. With ``shares`` (one non-negative int per member, not all 0) shard j is elements [S_j*L//T,
    S_{j+1}*L//T) instead, S_j the sum of the shares before j and T their total (a capped member's smaller shard:
    ``capped_shares``). Datagram k of a shard covers ``per`` elements from the shard start (the last one fewer)."""

    length: int
    n: int
    per: int
    shares: tuple[int, ...] | None = None
    _cuts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"a group has at least one member, got n={self.n}")
        if not 0 <= self.length <= MAX_ELEMENTS:
            raise ValueError(f"vector length {self.length} does not fit the u32 element offsets")
        if not 1 <= self.per <= MAX_COUNT:
            raise ValueError(f"elements per datagram must be 1..{MAX_COUNT}, got {self.per}")
        shares = self.shares
        if shares is None:
            cuts = tuple((j * self.length) // self.n for j in range(self.n + 1))
        else:
            if (len(shares) != self.n or any(type(s) is not int or s < 0 for s in shares)
                    or not 0 < sum(shares) < 2**32):
                raise ValueError(f"shares must be {self.n} non-negative ints, not all 0, got {shares!r}")
            total, acc, cuts_l = sum(shares), 0, [0]
            for s in shares:
                acc += s
                cuts_l.append((acc * self.length) // total)
            cuts = tuple(cuts_l)
        object.__setattr__(self, "_cuts", cuts)

    def shard(self, j: int) -> tuple[int, int]:
        """(start, stop) element bounds of member j's shard."""
        return self._cuts[j], self._cuts[j + 1]

    def largest(self) -> int:
        """Elements of the largest shard."""
        return max(b - a for a, b in zip(self._cuts, self._cuts[1:], strict=False))

    def datagrams(self, j: int) -> int:
        """Data datagrams in a stream carrying shard j (the END marker not counted)."""
        start, stop = self.shard(j)
        return -(-(stop - start) // self.per)

    def range(self, j: int, k: int) -> tuple[int, int]:
        """(offset, count) of datagram k of shard j."""
        start, stop = self.shard(j)
        offset = start + k * self.per
        return offset, min(self.per, stop - offset)

    def index_of(self, j: int, offset: int, count: int) -> int:
        """The datagram index that (offset, count) names in shard j; WireError unless it is exactly one."""
        start, stop = self.shard(j)
        rel = offset - start
        if rel < 0 or offset + count > stop or rel % self.per:
            raise WireError(
                "malformed", f"range [{offset}, {offset + count}) is not a datagram range of shard [{start}, {stop})"
            )
        if count != min(self.per, stop - offset):
            raise WireError(
                "malformed", f"range at {offset} has {count} elements, the layout says {min(self.per, stop - offset)}"
            )
        return rel // self.per
