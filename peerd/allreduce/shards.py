"""Where shards and datagram ranges lie in the flat vector (protocol/allreduce.md, "Shards and ranges").

Every member derives the same boundaries from (vector length, n, elements per datagram), so no
boundaries travel: a receiver checks that a datagram names exactly one of the ranges it expects and
accounts for it by its datagram index. That is what makes the per-range bookkeeping O(1) per datagram.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Layout:
    """Shard j is elements [j*L//n, (j+1)*L//n); its datagram k covers per elements from the shard start
    (the last one fewer). Shards differ in size by at most one element; some are empty when L < n."""

    length: int
    n: int
    per: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"a group has at least one member, got n={self.n}")
        if not 0 <= self.length <= MAX_ELEMENTS:
            raise ValueError(f"vector length {self.length} does not fit the u32 element offsets")
        if not 1 <= self.per <= MAX_COUNT:
            raise ValueError(f"elements per datagram must be 1..{MAX_COUNT}, got {self.per}")

    def shard(self, j: int) -> tuple[int, int]:
        """(start, stop) element bounds of member j's shard."""
        return (j * self.length) // self.n, ((j + 1) * self.length) // self.n

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
