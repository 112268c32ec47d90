"""The members this node averaged with lately (sans-I/O: every call takes ``now``): whose datagrams an overloaded
receive pass keeps sparing between two averages (AveragingHost.protected_tokens)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

# By time, not by a count of groups: a node averaging in several runs at once (a small side run's groups every
# second) must not forget the members of its main run between two of their averages.
RECENT_MEMBER_S = 60.0
MAX_RECENT_MEMBERS = 4096  # members remembered (the oldest go first)


class RecentMembers:
    """Members of the groups that ended here, each with when its latest one did."""

    def __init__(self, window_s: float = RECENT_MEMBER_S, max_members: int = MAX_RECENT_MEMBERS) -> None:
        self.window_s = window_s
        self.max_members = max_members
        self._ended: OrderedDict[bytes, float] = OrderedDict()

    def ended(self, members: Iterable[bytes], now: float) -> None:
        """A group of ``members`` ended at ``now``."""
        for p in members:
            self._ended[p] = now
            self._ended.move_to_end(p)
        while len(self._ended) > self.max_members:
            self._ended.popitem(last=False)

    def within(self, now: float) -> tuple[set[bytes], float]:
        """The members whose latest group ended within ``window_s`` before ``now``, and when the first of them
        drops out (infinity: none will)."""
        members: set[bytes] = set()
        until = math.inf
        for p, at in self._ended.items():
            if at + self.window_s > now:
                members.add(p)
                until = min(until, at + self.window_s)
        return members, until
