"""What a Moshpit round does for members with bandwidth caps (linkcap): learn unknown members' caps from the round's
records, and give a phase the time its slowest capped member's share needs."""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..linkcap.advert import PLAN_MARGIN, CapAdvert, PeerCaps, share_seconds
from .matchmaking import Group
from .records import decode_announce

log = logging.getLogger("peerd.moshpit")
CAPS_READ_S = 0.5  # the most a round's start waits to read unknown members' caps (linkcap)


async def learn_caps(dht: Any, peer_caps: PeerCaps, allreduce: Any, me: bytes, group: Group, members: list[Any],
                     mm_key: bytes) -> None:
    """A member whose matchmaking record this node never read (it joined its leader before the record came) may
    have caps: read the round's records once, briefly, while the average starts, and hand what it learnt to the
    averager's plan (its limits toward download-capped members)."""
    if all(c.node_id == me or peer_caps.known(c.node_id) for c in group.members):
        return
    records = []
    with trio.move_on_after(CAPS_READ_S):
        try:
            records = await dht.get(mm_key)
        except Exception as e:  # (the average goes ahead with the caps it knows)
            log.debug("reading the caps of group %08x's members failed: %s", group.group_id, e)
    for r in records:
        a = decode_announce(r)
        if a is not None:
            peer_caps.note(a.node_id, a.cap)
    plan = getattr(allreduce, "plan", None)
    if plan is not None and any(peer_caps.get(c.node_id) for c in group.members):
        plan(members)


def capped_phase_s(own: CapAdvert | None, peer_caps: PeerCaps, me: bytes, group: Group, nbytes: int,
                   mtu: int, shares: tuple[int, ...] | None = None) -> float:
    """A phase's deadline is at least PLAN_MARGIN x what its slowest capped member's part takes at its cap
    (linkcap.share_seconds, over the group's ``shares``), so a capped member is not cut off as a straggler."""
    adverts = [own if c.node_id == me else peer_caps.get(c.node_id) for c in group.members]
    return PLAN_MARGIN * share_seconds(nbytes, adverts, mtu, shares)
