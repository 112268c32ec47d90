"""Moshpit group keys (sans-I/O).

A peer's key is the indices it held inside its last d-1 groups. Peers that share a key this round
average together; each then appends its index within the group and drops the oldest, so peers that
met land in different groups next round. On a full M^d grid that gives the exact mean in d rounds.

When the swarm is not a full grid, the key also carries ``extra_bits`` bits drawn per round from the
peer id: a crowded key splits in two, a key whose groups cannot fill loses a bit.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from ..entropy import default_rng

MAX_EXTRA_BITS = 8


@dataclass(frozen=True)
class Grid:
    dims: int  # d
    size: int  # M: target group size

    def __post_init__(self) -> None:
        if not 1 <= self.dims <= 8:
            raise ValueError(f"a grid has 1 to 8 dimensions, not {self.dims}")
        if not 2 <= self.size <= 64:
            raise ValueError(f"a grid dimension is 2 to 64 peers wide, not {self.size}")

    @classmethod
    def parse(cls, text: str) -> Grid:
        """``"4x4"`` -> Grid(2, 4). Moshpit's grid has equal sides."""
        try:
            sides = [int(p) for p in text.lower().split("x")]
        except ValueError:
            raise ValueError(f"grid {text!r} is not like 4x4 or 8x8x8") from None
        if len(set(sides)) != 1:
            raise ValueError(f"grid {text!r}: every side must be equal (a group closes at M members)")
        return cls(len(sides), sides[0])

    @classmethod
    def for_swarm(cls, peers: int, max_group: int = 16) -> Grid:
        """The smallest grid with groups of at most ``max_group`` that holds ``peers``."""
        peers = max(peers, 2)
        size = max(2, min(max_group, peers))
        dims = max(1, math.ceil(math.log(peers) / math.log(size) - 1e-9))
        return cls(dims, size)

    @property
    def cells(self) -> int:
        return self.size**self.dims

    def __str__(self) -> str:
        return "x".join([str(self.size)] * self.dims)

    def cell_chunks(self, cell: int) -> tuple[int, ...]:
        """The key of the peer that starts in grid cell ``cell`` (its last d-1 base-M digits)."""
        if not 0 <= cell < self.cells:
            raise ValueError(f"cell {cell} is outside a {self} grid")
        digits = []
        for _ in range(self.dims):
            digits.append(cell % self.size)
            cell //= self.size
        return tuple(digits[1:])


class KeyManager:
    def __init__(
        self,
        grid: Grid,
        node_id: bytes,
        *,
        chunks: tuple[int, ...] | None = None,
        adapt: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self.grid = grid
        self.node_id = node_id
        self.adapt = adapt
        rng = default_rng(rng)
        if chunks is None:
            chunks = tuple(rng.randrange(grid.size) for _ in range(grid.dims - 1))
        if len(chunks) != grid.dims - 1 or not all(0 <= c < grid.size for c in chunks):
            raise ValueError(f"a {grid} grid key is {grid.dims - 1} indices in [0, {grid.size})")
        self.chunks = tuple(chunks)
        self.extra_bits = 0

    def group_key(self, round_no: int) -> str:
        """The key this peer looks for a group under in round ``round_no``."""
        key = ".".join(str(c) for c in self.chunks) or "-"
        if self.extra_bits:
            h = int.from_bytes(hashlib.sha256(self.node_id + round_no.to_bytes(8, "big")).digest()[:4], "big")
            key += "." + format(h >> (32 - self.extra_bits), f"0{self.extra_bits}b")
        return key

    def after_group(self, index: int, size: int, seen: int) -> None:
        """Append my index in the group just averaged; ``seen`` is how many peers announced under my key."""
        if self.chunks:
            self.chunks = (*self.chunks[1:], index % self.grid.size)
        if not self.adapt:
            return
        if seen > 2 * self.grid.size:
            self.extra_bits = min(MAX_EXTRA_BITS, self.extra_bits + 1)
        elif size * 2 < self.grid.size:
            self.extra_bits = max(0, self.extra_bits - 1)

    def after_alone(self, seen: int = 1, rank: int = 0) -> None:
        """No group formed. ``seen``: how many peers announced under my key (me included); ``rank``: my place
        among them by node id, the index a group of them all would have given me.

        A peer whose key held more than a group takes (``seen`` > M) was left over: it moves on as the last
        index of a group would, the key every group short of M members leaves room in. Any other lonely peer
        moves on as index ``rank`` (mod M): peers whose group failed together (its leader died before BEGIN)
        spread as that group's members would have, and a peer alone under its key moves on as index 0 of a
        group: every group has a member 0, so that key is never empty while the run has peers. Keeping the key
        instead would leave a peer whose key emptied (a swarm shrinking under failures) alone for good, and the
        spread would stop falling (`peerd sim moshpit --grid 16x16x16 --fail 0.1`). Sending every lonely peer to
        index 0 would overfill that key where several end alone at once (a leader killed before its BEGIN): a
        peer or more would be left over every round after (`peerd bench moshpit --peers 16 --grid 4x4 --kill 2`)."""
        full = seen > self.grid.size
        if self.chunks:
            self.chunks = (*self.chunks[1:], self.grid.size - 1 if full else rank % self.grid.size)
        if self.adapt and not full:
            self.extra_bits = max(0, self.extra_bits - 1)
