"""The allreduce service as Moshpit sees it, with NAT traversal first: before a group average, a path to every
member (direct, punched or relayed), since tensor data is never retransmitted and what goes out before a path
exists is lost. One the node already talks to costs nothing; group membership is untouched (Moshpit's grid decides
it: reachability only finds paths)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import trio

from ..allreduce.options import DEFAULT_OPTIONS, AverageOptions
from ..allreduce.service import Averager, AverageResult, Member
from ..transport.pacing import Pacer
from .relay import DEFAULT_RATE
from .service import NatService

log = logging.getLogger("peerd.nat")

CONNECT_S = 10.0  # at most this long for the paths (less: NatService.connect gives up on a member once one whole
# attempt, punch then relays, failed), then the average starts with what there is
RELAY_SHARE = 0.9  # of a relay's grant per sender that this node's share uses (clocks and wake-ups differ)
RELAY_CATCHUP = 256_000.0  # bytes: a sender that woke late catches up at most half this at once (a relay's
# burst is bigger; the link's queue, 262 KB in the lab at 100 Mbit/s, is not)


class PathsFirst:
    """An Averager (allreduce.service) around ``allreduce``: ``average`` connects to the members first; ``inner``
    is the wrapped service (its metrics and endpoint, for a bench)."""

    def __init__(self, allreduce: Averager, nat: NatService, *, timeout: float = CONNECT_S) -> None:
        self._inner = allreduce
        self._nat = nat
        nat.uplink = getattr(allreduce, "pacer", None)  # what it relays shares the uplink with its own data
        self._timeout = timeout
        self.plan: Any = None  # plan(members) after the paths, before the average: the link caps' sender limits

    @property
    def inner(self) -> Averager:
        return self._inner

    @property
    def pacer(self) -> Pacer:
        return self._inner.pacer

    @property
    def max_body(self) -> int:
        return self._inner.max_body

    async def average(self, group_id: int, members: list[Member], index: int, vector: np.ndarray, weight: float,
                      options: AverageOptions = DEFAULT_OPTIONS, *, out: np.ndarray | None = None,
                      center: np.ndarray | None = None) -> AverageResult:
        me = self._nat.endpoint.identity.node_id
        start = trio.current_time()
        kinds = await self._nat.connect_all([(m.addr, m.node_id) for m in members if m.node_id != me], self._timeout)
        took = trio.current_time() - start
        if took > 0.5 or None in kinds.values():  # a late start costs the whole group: say who held it up
            log.info("paths to group %08x's members took %.1f s: %s", group_id, took,
                     ", ".join(f"{n.hex()[:8]} {k or 'none'}" for n, k in kinds.items()))
        self.pace_relayed(kinds)
        if self.plan is not None:
            self.plan(members)
        return await self._inner.average(group_id, members, index, vector, weight, options, out=out, center=center)

    def pace_relayed(self, kinds: dict[bytes, str | None]) -> None:
        """Members reached through a relay get the relay's grant (``DEFAULT_RATE`` per sender, all that goes
        through it together) as a limit in the pacer: what goes faster the relay drops, and tensor data is
        never retransmitted. The others lose any limit they had."""
        pacer = getattr(self._inner, "pacer", None)
        if pacer is None:
            return
        for node_id, kind in kinds.items():
            entry = self._nat.relay_entry(node_id) if kind == "relayed" else None
            if entry is None:
                pacer.limit(node_id)
            else:
                pacer.limit(node_id, ("relay", entry[1]), RELAY_SHARE * DEFAULT_RATE, RELAY_CATCHUP)
