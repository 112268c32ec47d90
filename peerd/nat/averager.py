"""The allreduce service as Moshpit sees it, with NAT traversal first: before a group average, a path to every
member (direct, punched or relayed), since tensor data is never retransmitted and what goes out before a path
exists is lost. One the node already talks to costs nothing; group membership is untouched (Moshpit's grid decides
it: reachability only finds paths)."""

from __future__ import annotations

import logging
from typing import Any

import trio

from .service import NatService

log = logging.getLogger("peerd.nat")

CONNECT_S = 10.0  # at most this long for the paths, then the average starts with what there is


class PathsFirst:
    """Wraps ``allreduce`` (an AllreduceService): ``average`` connects to the members first; everything else is
    the wrapped service's."""

    def __init__(self, allreduce: Any, nat: NatService, *, timeout: float = CONNECT_S) -> None:
        self._inner = allreduce
        self._nat = nat
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def average(self, group_id: int, members: list, *args: Any, **kwargs: Any) -> Any:
        me = self._nat.endpoint.identity.node_id
        start = trio.current_time()
        kinds = await self._nat.connect_all([(m.addr, m.node_id) for m in members if m.node_id != me], self._timeout)
        took = trio.current_time() - start
        if took > 0.5 or None in kinds.values():  # a late start costs the whole group: say who held it up
            log.info("paths to group %08x's members took %.1f s: %s", group_id, took,
                     ", ".join(f"{n.hex()[:8]} {k or 'none'}" for n, k in kinds.items()))
        return await self._inner.average(group_id, members, *args, **kwargs)
