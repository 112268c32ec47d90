"""Leaders chosen by reachability (issue 19), in virtual time: membership stays the key's; only who leads
depends on what the peers announced (``reach``), so followers behind NATs can reach their leader."""

from __future__ import annotations

import dataclasses

import pytest

from peerd.moshpit.matchmaking import (
    REACH_CONE,
    REACH_PUBLIC,
    REACH_SYMMETRIC,
    REACH_UNKNOWN,
    Candidate,
    lead_key,
)
from peerd.moshpit.records import decode_announce, encode_announce
from peerd.wire.identity import node_id_of

from .support.matchmaking import BoardNet, cand


def ranked(i: int, expiry: float, reach: int) -> Candidate:
    return dataclasses.replace(cand(i, expiry), reach=reach)


@pytest.mark.parametrize("seed", range(5))
def test_a_public_peer_leads_though_it_announced_last(seed: int) -> None:
    # the symmetric peers look first, the public one last: it leads anyway, every peer in one group
    peers = [ranked(1, 10.0, REACH_SYMMETRIC), ranked(2, 10.5, REACH_SYMMETRIC), ranked(3, 11.0, REACH_CONE),
             ranked(4, 12.0, REACH_PUBLIC)]
    net = BoardNet(peers, target=4, seed=seed)
    net.run()
    groups = net.groups()
    assert len(groups) == 1
    (members,) = groups.values()
    assert {c.node_id for c in members} == {c.node_id for c in peers}
    assert {mm.group.leader for mm in net.mm.values()} == {peers[3].node_id}


def test_cone_before_symmetric_and_unknown_then_expiry() -> None:
    peers = [ranked(1, 10.0, REACH_SYMMETRIC), ranked(2, 11.0, REACH_UNKNOWN), ranked(3, 12.0, REACH_CONE)]
    net = BoardNet(peers, target=3)
    net.run()
    assert {mm.group.leader for mm in net.mm.values()} == {peers[2].node_id}
    # equal reachability: the earliest expiry leads, as before
    same = [ranked(1, 10.0, REACH_CONE), ranked(2, 11.0, REACH_CONE), ranked(3, 12.0, REACH_CONE)]
    net = BoardNet(same, target=3)
    net.run()
    assert {mm.group.leader for mm in net.mm.values()} == {same[0].node_id}
    assert sorted(peers, key=lead_key) == [peers[2], peers[1], peers[0]]


def test_reach_in_the_announcement() -> None:
    class Rec:
        def __init__(self, value: bytes) -> None:
            self.owner = bytes(range(32))
            self.subkey = node_id_of(self.owner)
            self.value = value

    old = encode_announce(12.5, "203.0.113.7", 4000)
    assert decode_announce(Rec(old)).reach == REACH_UNKNOWN  # no verdict: the v2 record, unchanged
    assert old == encode_announce(12.5, "203.0.113.7", 4000, REACH_UNKNOWN)
    for reach in (REACH_PUBLIC, REACH_CONE, REACH_SYMMETRIC):
        assert decode_announce(Rec(encode_announce(12.5, "203.0.113.7", 4000, reach))).reach == reach
    import msgpack

    ip = bytes([203, 0, 113, 7])
    for bad in ([12.5, ip, 4000, 4], [12.5, ip, 4000, -1], [12.5, ip, 4000, "0"], [12.5, ip, 4000, 0, 0]):
        assert decode_announce(Rec(msgpack.packb(bad))) is None
