"""The DiLoCo outer agreement's sans-I/O core (peerd.trainer.agreement), driven by hand in virtual time: records
and fetch results go in with ``now``, actions come out. No trio, no board: each test is a handful of calls."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from peerd.trainer.agreement import (
    OWNER_GRACE_S,
    POLL_FIRST_S,
    FetchFinal,
    FetchShard,
    Keep,
    OuterAgreement,
    Publish,
    ReadParticipants,
    ReadRecords,
    StopShardFetches,
)
from peerd.trainer.records import OuterRecord, piece_hashes, shard_bounds

from .support.virtual import sha  # noqa: E402

IDS = [bytes([0, i]) * 16 for i in range(4)]
TRUTH = np.random.default_rng(1).standard_normal(4_000).astype(np.float32)


def record(i: int, vector: np.ndarray, *, final: bool = False, node: bytes | None = None, size: int = 3,
           group: str = "g") -> OuterRecord:
    """Member i's record over ``vector`` (its own shard i of a group of ``size``), with its final if asked."""
    data = vector.astype(np.float32).tobytes()
    a, b = shard_bounds(vector.size, size, i)
    shard = data[4 * a: 4 * b]
    return OuterRecord(node or IDS[i], group, size, i, sha(shard), sha(data + piece_hashes(shard)),
                       sha(data) if final else b"", b"", vector.size, ("127.0.0.1", 9))


def core(i: int, vector: np.ndarray, **kw) -> OuterAgreement:
    opts = {"group": "g", "size": 3, "index": i, "state": b"", "repair_s": 30.0, "deadline_s": 60.0,
            "members": IDS[:3], "expect": 3, **kw}
    return OuterAgreement(IDS[i], vector.astype(np.float32).tobytes(), **opts)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_start_keeps_the_vector_publishes_and_reads() -> None:
    c = core(0, TRUTH)
    c.start(0.0)
    acts = c.take_actions()
    assert [type(a) for a in acts] == [Keep, Publish, ReadRecords]
    assert of(acts, Publish)[0].record == replace(record(0, TRUTH), addr=None)
    assert c.get_timer() == OWNER_GRACE_S  # no owner has published yet (a read is in flight)
    c.receive_records(1, [], 0.01)
    assert c.get_timer() == 0.01 + POLL_FIRST_S  # the next read (before the owners' grace ends)


def test_a_differing_shard_is_fetched_from_its_owner_only_and_checked_against_its_hash_hostile() -> None:
    mine = TRUTH.copy()
    a, b = shard_bounds(TRUTH.size, 3, 1)
    mine[a: a + 50] = 7.0  # a range of shard 1 lost in the all-gather
    c = core(0, mine)
    c.start(0.0)
    c.take_actions()
    forged = TRUTH.copy()
    forged[a:b] = 1e6
    stranger = record(1, forged, node=b"\x09" * 32)  # claims shard 1 of the group: owns nothing
    c.receive_records(1, [stranger, record(1, TRUTH), record(2, TRUTH)], 0.1)
    fetches = of(c.take_actions(), FetchShard)
    assert [(f.index, f.owner.node) for f in fetches] == [(1, IDS[1])]
    # the owner's server answers with other bytes: refused, and asked again (a try is counted)
    c.receive_shard(1, forged.tobytes()[4 * a: 4 * b], 999, 0.2)
    assert c.statistics().repaired_bytes == 0
    again = of(c.take_actions(), FetchShard)
    assert [f.index for f in again] == [1]
    c.receive_shard(1, TRUTH.tobytes()[4 * a: 4 * b], 400, 0.3)
    acts = c.take_actions()
    assert c.statistics().repaired_bytes == 400
    (final,) = [p.record.final for p in of(acts, Publish)]
    assert final == sha(TRUTH.tobytes())  # every shard settled: the swarm phase publishes the final


def test_an_owner_that_publishes_nothing_is_waited_for_owner_grace_only_hostile() -> None:
    mine = TRUTH.copy()
    c = core(0, mine)
    c.start(0.0)
    c.receive_records(1, [record(1, TRUTH)], 0.1)  # owner 2 never publishes
    assert c.phase.value == "repair"
    assert c.get_timer() == min(0.1 + POLL_FIRST_S, 0.1 + OWNER_GRACE_S)
    c.handle_timer(0.1 + OWNER_GRACE_S)
    assert c.phase.value == "swarm"
    assert c.statistics().phases["repair"] == 0.1 + OWNER_GRACE_S


def test_repair_ends_at_its_deadline_and_drops_the_fetches_in_flight() -> None:
    mine = TRUTH.copy()
    mine[0] = 5.0
    c = core(1, mine, repair_s=4.0)
    c.start(0.0)
    c.receive_records(1, [record(0, TRUTH)], 0.1)
    assert of(c.take_actions(), FetchShard)
    c.handle_timer(4.0)
    assert of(c.take_actions(), StopShardFetches)
    c.receive_shard(0, TRUTH.tobytes()[:4 * shard_bounds(TRUTH.size, 3, 0)[1]], 10, 4.5)  # too late: ignored
    assert c.statistics().repaired_bytes == 0


def swarm(c: OuterAgreement, now: float = 0.0) -> None:
    """Start ``c`` with nothing to repair (every owner's record agrees) and bring it to the swarm phase."""
    c.start(now)
    c.receive_records(1, [record(k, TRUTH) for k in range(3)], now + 0.01)
    assert c.phase.value == "swarm"
    c.take_actions()


def test_without_repair_the_final_is_the_vector_kept_at_the_start_with_its_hash() -> None:
    c = core(0, TRUTH)
    c.start(0.0)
    (avg_blob,) = [k.blob for k in of(c.take_actions(), Keep)]
    c.receive_records(1, [record(k, TRUTH) for k in range(3)], 0.01)
    acts = c.take_actions()
    (final_blob,) = [k.blob for k in of(acts, Keep)]
    (final,) = [p.record.final for p in of(acts, Publish)]
    assert final_blob == TRUTH.tobytes() and avg_blob[: len(final_blob)] == final_blob
    assert final == sha(TRUTH.tobytes())
    mine = TRUTH.copy()
    mine[0] = 5.0  # a lost range: repaired, so the final is the repaired vector's, hashed afresh
    c = core(1, mine)
    c.start(0.0)
    c.take_actions()
    c.receive_records(1, [record(k, TRUTH) for k in range(3)], 0.01)
    c.receive_shard(0, TRUTH.tobytes()[:4 * shard_bounds(TRUTH.size, 3, 0)[1]], 10, 0.02)
    acts = c.take_actions()
    assert [k.blob for k in of(acts, Keep)] == [TRUTH.tobytes()]
    assert [p.record.final for p in of(acts, Publish)] == [sha(TRUTH.tobytes())]


def test_the_step_ends_once_a_strict_majority_of_the_round_holds_the_final() -> None:
    c = core(0, TRUTH)
    swarm(c)
    fresh = c._started  # a read that started after the final was published
    c.receive_records(fresh, [record(1, TRUTH, final=True)], 0.05)
    assert c.done and c.statistics().members == 2  # 2 of 3: no other final can win


def test_records_read_before_the_final_do_not_count() -> None:
    c = core(0, TRUTH)
    swarm(c)
    c.receive_records(1, [record(1, TRUTH, final=True)], 0.05)  # the read of the repair phase: dropped
    assert not c.done


def test_nodes_outside_the_round_neither_vote_nor_are_adopted_hostile() -> None:
    c = core(0, TRUTH, participants=frozenset(IDS[:3]))
    swarm(c)
    forged = np.full(TRUTH.size, 1e6, np.float32)
    sybils = [record(0, forged, final=True, node=bytes([7, i]) * 16, size=1, group="x") for i in range(5)]
    c.receive_pushed(sybils, 0.05)
    assert not of(c.take_actions(), FetchFinal) and c.statistics().ignored == 5
    c.receive_pushed([*sybils, record(1, TRUTH, final=True)], 0.06)
    assert c.done and not c.statistics().adopted


def test_a_member_holding_another_final_adopts_the_winner_verified() -> None:
    mine = TRUTH.copy()
    mine[-1] = 3.0  # its own final differs; the two others hold the truth's
    c = core(0, mine, members=None)
    c.start(0.0)
    c.receive_records(1, [], 0.01)
    c.handle_timer(0.01 + OWNER_GRACE_S)
    c.take_actions()
    c.receive_pushed([record(1, TRUTH, final=True), record(2, TRUTH, final=True)], 3.0)
    (fetch,) = of(c.take_actions(), FetchFinal)
    assert fetch.sha == sha(TRUTH.tobytes())
    c.receive_final(fetch.sha, b"\x00" * TRUTH.nbytes, 3.1)  # other bytes: refused, fetched again later
    assert not c.statistics().adopted and c.get_timer() is not None
    c.handle_timer(3.1 + 0.25)
    (again,) = of(c.take_actions(), FetchFinal)
    c.receive_final(again.sha, TRUTH.tobytes(), 3.5)
    assert c.done and c.statistics().adopted and bytes(c.data) == TRUTH.tobytes()


def test_a_member_without_a_final_stalls_nothing_and_a_tie_waits_for_half_the_deadline_hostile() -> None:
    c = core(0, TRUTH, size=4, members=IDS, expect=4)
    c.start(0.0)
    c.receive_records(1, [record(k, TRUTH, size=4) for k in range(4)], 0.01)
    c.take_actions()
    silent = record(3, TRUTH, size=4)  # its record, never a final
    c.receive_pushed([silent, record(1, TRUTH, size=4, final=True)], 0.1)
    assert not c.done  # 2 of 4: not a majority, and one member is still pending
    c.receive_pushed([silent, record(1, TRUTH, size=4, final=True), record(2, TRUTH, size=4, final=True)], 0.2)
    assert c.done  # 3 of 4


def test_the_first_read_of_participants_raises_what_the_step_waits_for() -> None:
    c = core(0, TRUTH, refresh=True, refresh_first=True)
    c.start(0.0)
    assert of(c.take_actions(), ReadParticipants)
    c.receive_records(1, [record(k, TRUTH) for k in range(3)], 0.01)
    assert c.phase.value == "swarm"  # repaired: the final goes out while the participants' read is in flight
    assert of(c.take_actions(), Publish)[-1].record.final == sha(TRUTH.tobytes())
    others = frozenset([bytes([5, i]) * 16 for i in range(3)])
    c.receive_participants(frozenset(IDS[:3]) | others, 0.3)
    assert c.phase.value == "swarm" and c.expect == 6
    c.receive_pushed([record(1, TRUTH, final=True)], 0.4)
    assert not c.done  # 2 of 6 is no majority
    assert c.statistics().phases["participants"] == 0.3 - 0.01


def test_the_finals_agree_while_the_first_read_of_participants_is_in_flight() -> None:
    """The group's finals are exchanged before the read of who took part returns; the step ends the moment
    it returns (one read, not a read and then a round of finals), and not before: it can raise the count."""
    c = core(0, TRUTH, refresh=True, refresh_first=True)
    c.start(0.0)
    c.receive_records(1, [record(k, TRUTH) for k in range(3)], 0.01)
    c.receive_pushed([record(k, TRUTH, final=True) for k in (1, 2)], 0.05)
    assert not c.done  # every member agrees, but the round may have more: the read is waited for
    c.receive_participants(frozenset(IDS[:3]), 0.2)
    assert c.done and c.statistics().phases["agree"] == 0.2 - 0.01


def test_a_first_read_naming_more_members_keeps_the_group_from_ending_alone_hostile() -> None:
    """A group of 3 whose finals all agree must not end when the round's first read names 8 participants: 3
    of 8 is no majority, so it waits for the others' finals (or half the deadline)."""
    c = core(0, TRUTH, refresh=True, refresh_first=True)
    c.start(0.0)
    c.receive_records(1, [record(k, TRUTH) for k in range(3)], 0.01)
    c.receive_pushed([record(k, TRUTH, final=True) for k in (1, 2)], 0.05)
    c.receive_participants(frozenset(IDS[:3]) | frozenset(bytes([6, i]) * 16 for i in range(5)), 0.2)
    assert not c.done and c.expect == 8


def test_without_agreement_the_step_fails_at_its_deadline() -> None:
    c = core(0, TRUTH, deadline_s=10.0)
    swarm(c)
    other = TRUTH.copy()
    other[0] = 1.0
    c.receive_pushed([record(1, other, final=True), record(2, other, final=True)], 0.1)
    assert of(c.take_actions(), FetchFinal)
    c.receive_final(sha(other.tobytes()), None, 0.2)
    while not c.done:
        t = c.get_timer()
        assert t is not None and t > c._now  # never a timer in the past (no busy loop)
        c.handle_timer(t)
        for a in c.take_actions():
            if isinstance(a, FetchFinal):
                c.receive_final(a.sha, None, t)
            elif isinstance(a, ReadRecords):
                c.receive_records(a.number, None, t)
    assert c.phase.value == "failed" and "did not agree within 10 s" in c.error


def test_a_late_or_dropped_read_is_ignored() -> None:
    c = core(0, TRUTH)
    swarm(c)
    before = c.statistics().reads
    c.receive_records(c._started + 5, [record(1, TRUTH, final=True)], 0.1)
    assert c.statistics().reads == before and not c.done
    assert replace(record(1, TRUTH), final=b"").final == b""


def _pair_read_before_the_other_pair() -> tuple[OuterAgreement, np.ndarray]:
    """Member 0 of group "a" (a pair) whose first read of the participants names only its pair, and then reads
    the finals of a second pair of the same step (group "b") whose progress was not yet written."""
    other = TRUTH.copy()
    other[:10] = 3.0
    c = core(0, TRUTH, size=2, members=IDS[:2], expect=2, participants=frozenset(IDS[:2]), refresh=True,
             refresh_first=True)
    c.start(0.0)
    c.receive_records(1, [record(k, TRUTH, size=2, group="a") for k in (0, 1)], 0.01)
    assert c.phase.value == "swarm"
    c.receive_participants(frozenset(IDS[:2]), 0.02)
    c.take_actions()
    b = [record(k, other, final=True, size=2, group="b", node=IDS[2 + k]) for k in (0, 1)]
    c.receive_records(c._started, [record(0, TRUTH, size=2, group="a", final=True), *b], 0.03)
    return c, other


def test_a_final_of_an_unknown_node_holds_the_end_until_the_participants_are_read_again() -> None:
    """Two pairs of one outer step: pair a read who took part before pair b's progress was written. Ending on
    its own pair's majority would leave pair b tied two to two against members that had gone, waiting out the
    deadline; pair a reads the participants again first, and once they name pair b, all four settle on one."""
    c, other = _pair_read_before_the_other_pair()
    c.receive_pushed([record(1, TRUTH, final=True, size=2, group="a")], 0.04)
    assert not c.done and of(c.take_actions(), ReadParticipants)
    c.receive_participants(frozenset(IDS[:4]), 0.3)
    assert c.statistics().members == 2 and c.statistics().dissent == 2
    fetches = of(c.take_actions(), FetchFinal)
    if sha(other.tobytes()) < sha(TRUTH.tobytes()):  # pair b's final wins the tie: pair a adopts it
        assert fetches and fetches[0].sha == sha(other.tobytes())
    else:  # pair a's wins: it waits for pair b to adopt it
        assert not fetches and not c.done


def test_records_of_nodes_outside_the_round_cost_one_read_of_the_participants_hostile() -> None:
    """Minted ids publishing finals hold a group's end for one more read of who took part, no longer: once
    that read does not name them, they are ignored and the group ends on its own majority."""
    c, _ = _pair_read_before_the_other_pair()
    c.receive_pushed([record(1, TRUTH, final=True, size=2, group="a")], 0.04)
    assert not c.done and of(c.take_actions(), ReadParticipants)
    c.receive_participants(frozenset(IDS[:2]), 0.3)
    assert c.done and c.statistics().ignored == 2


def test_a_member_that_got_the_whole_average_publishes_its_final_at_once_and_ends_on_a_majority() -> None:
    """``complete``: the all-gather brought every owner's shard whole, so nothing is repaired: the first record
    already holds the final (and the shard hash the others repair from), and the step ends as soon as a strict
    majority holds that final, before the slowest member has published anything."""
    c = core(0, TRUTH, complete=True)
    c.start(0.0)
    acts = c.take_actions()
    (pub,) = of(acts, Publish)
    assert pub.record.final == sha(TRUTH.tobytes()) and pub.record.shard == record(0, TRUTH).shard
    assert not of(acts, FetchShard) and c.statistics().phases["repair"] == 0.0
    assert TRUTH.tobytes() in [k.blob for k in of(acts, Keep)]  # the final's bytes, for a member adopting them
    c.receive_pushed([record(1, TRUTH, final=True)], 0.01)  # member 2 has not even published its record
    assert c.done and c.statistics().members == 2


def test_a_complete_member_still_waits_for_a_majority_and_adopts_the_winner_hostile() -> None:
    """An owner that sent this member other bytes than it sent the rest: this member's final is outvoted by the
    finals the others hold (they repaired to the owner's published shard) and it adopts theirs, verified."""
    mine = TRUTH.copy()
    mine[-1] = 7.0  # owner 2's range as owner 2 sent it here, not as it published it
    c = core(0, mine, complete=True)
    c.start(0.0)
    c.take_actions()
    c.receive_pushed([record(1, TRUTH, final=True)], 0.01)
    assert not c.done  # one other final, not this one: no majority
    c.receive_pushed([record(1, TRUTH, final=True), record(2, TRUTH, final=True)], 0.02)
    (fetch,) = of(c.take_actions(), FetchFinal)
    assert fetch.sha == sha(TRUTH.tobytes()) and not c.done
    c.receive_final(fetch.sha, mine.tobytes(), 0.03)  # bytes that do not hash to the winner: refused
    assert not c.done
    c.handle_timer(1.0)
    (fetch,) = of(c.take_actions(), FetchFinal)
    c.receive_final(fetch.sha, TRUTH.tobytes(), 1.01)
    assert c.done and bytes(c.data) == TRUTH.tobytes()


def test_complete_without_the_groups_order_repairs_as_before() -> None:
    """``complete`` counts only where the group's order (``members``) is known: otherwise no owner is known and
    the step runs as without it."""
    c = core(0, TRUTH, complete=True, members=None)
    c.start(0.0)
    assert [type(a) for a in c.take_actions()][:3] == [Keep, Publish, ReadRecords]  # the repair phase's record first
    assert not c.complete


def test_every_kept_blob_is_named_by_its_own_hash() -> None:
    """The core hands the board each blob's SHA-256 (so the board does not hash megabytes again): the vector with
    its piece index at the start, the repaired final, an adopted winner."""
    mine = TRUTH.copy()
    a, b = shard_bounds(TRUTH.size, 3, 1)
    mine[a: a + 50] = 7.0
    c = core(0, mine)
    c.start(0.0)
    kept = of(c.take_actions(), Keep)
    c.receive_records(1, [record(1, TRUTH), record(2, TRUTH)], 0.1)
    c.take_actions()
    c.receive_shard(1, TRUTH.tobytes()[4 * a: 4 * b], 400, 0.2)
    kept += of(c.take_actions(), Keep)
    assert len(kept) == 2 and kept[1].blob == TRUTH.tobytes()  # the start's blob, then the repaired final
    assert all(k.sha == sha(k.blob) for k in kept)


def _alone(expect: int) -> OuterAgreement:
    """A member that averaged alone (its round's group had closed, or had not formed yet) and whose swarm had
    ``expect`` members at its last outer step; its first read of who took part finds nobody else yet."""
    c = OuterAgreement(IDS[0], TRUTH.tobytes(), group="", size=1, index=0, state=b"", repair_s=30.0, deadline_s=60.0,
                       expect=expect, participants=frozenset(), refresh=True, refresh_first=True)
    c.start(0.0)
    c.receive_participants(frozenset(), 0.02)
    c.receive_records(c._started, [], 0.03)
    return c


def test_a_member_alone_before_its_swarm_waits_for_the_swarms_finals_and_adopts_them() -> None:
    """A member that reached the outer step before its swarm (a joiner counting forward, a trainer whose others
    were slow) and averaged alone must not end with its own vector: the swarm, averaging the round after it,
    would hold another state from then on. Told the swarm's size (``expect``), it waits past ALONE_SETTLE_S for
    the swarm's finals and takes the one they hold; told nothing (1), it ends alone as before."""
    told_nothing = _alone(1)
    told_nothing.handle_timer(1.0)
    assert told_nothing.done and not told_nothing.statistics().adopted
    c = _alone(4)
    for t in (1.0, 2.0, 5.0):
        c.handle_timer(t)
        assert not c.done, t
    swarm_avg = TRUTH + 1.0
    finals = [record(k, swarm_avg, final=True, size=3, group="s", node=IDS[k + 1]) for k in range(3)]
    c.take_actions()
    c.receive_records(c._started, finals, 6.0)  # nodes it does not know yet: who took part is read again
    assert not c.done and of(c.take_actions(), ReadParticipants)
    c.receive_participants(frozenset(IDS[1:4]), 6.1)
    fetch = of(c.take_actions(), FetchFinal)
    assert fetch and fetch[0].sha == sha(swarm_avg.tobytes())
    c.receive_final(fetch[0].sha, swarm_avg.tobytes(), 6.4)
    assert c.done and c.statistics().adopted and c.statistics().members == 4


def test_a_member_alone_whose_swarm_never_comes_ends_at_half_the_deadline_hostile() -> None:
    """The swarm it last agreed with is gone (or a member lied about its size): the wait ends at half the
    deadline, with this member's own vector, not at the deadline's failure."""
    c = _alone(4)
    c.handle_timer(29.9)
    assert not c.done
    c.handle_timer(30.0)
    assert c.done and c.phase.value == "done" and not c.statistics().adopted


def test_a_member_alone_that_adopted_the_swarms_final_ends_without_the_settle_wait() -> None:
    """ALONE_SETTLE_S gives the others time before a member alone ends with its own vector; one that adopted a
    final the swarm's majority holds (a member behind, taking rounds the swarm finished) ends at once."""
    c = _alone(1)
    swarm_avg = TRUTH - 1.0
    c.receive_records(c._started, [record(k, swarm_avg, final=True, size=3, group="s", node=IDS[k + 1])
                                   for k in range(3)], 0.1)
    c.take_actions()
    c.receive_participants(frozenset(IDS[1:4]), 0.15)
    fetch = of(c.take_actions(), FetchFinal)
    c.receive_final(fetch[0].sha, swarm_avg.tobytes(), 0.3)
    assert c.done and c.statistics().adopted and c.statistics().phases["agree"] < 0.31
