"""The DiLoCo outer agreement as a sans-I/O core: every decision of an outer step after its group average.

The protocol is described in peerd.trainer.outer (repair from owners, then one final across the swarm). This
core holds the member's vector and the records it knows, and decides: which shards to fetch and from whom
(only ``members[k]`` for shard k, bytes checked against that owner's shard hash), when the repair ends, which
final wins among the round's known participants, when this member may end the step, and when to read the
board again. Its inputs are what the shell's I/O returned (``receive_*``, ``now`` last), its timer says when
it must look again (``get_timer``/``handle_timer``), and its output is a queue of frozen actions
(``take_actions``) that the shell carries out: keep a blob, publish a record, read the records or the
participants, fetch a shard or the winning vector. Time is injected, so the hostile cases run in virtual time.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import statistics
from dataclasses import dataclass, field, replace

from .records import (
    MAX_GROUP,
    MAX_WAIT_S,
    Address,
    OuterRecord,
    agreed,
    merged,
    owner_record,
    piece_hashes,
    shard_bounds,
    winner,
)

log = logging.getLogger("peerd.trainer.outer")

POLL_S = 0.25  # how often a member re-reads the round's records while it waits (at most)
POLL_FIRST_S = 0.05  # the first re-read of a phase: the records it waits for are usually a moment away
ALONE_SETTLE_S = 1.0  # a member that averaged alone reads this long before it may end with its own vector
OWNER_GRACE_S = 2.0  # once every other shard is settled, how long an owner that published nothing is waited for
REPAIR_TRIES = 3  # fetches of one shard that fail (or do not verify) before it is left as it is
REFRESH_S = 1.0  # how often the known participants are re-read while records of unknown nodes show up


def _sha(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


# -- actions (the shell carries them out in order) -----------------------------------------------------------
@dataclass(frozen=True)
class Keep:
    """Hold ``blob`` where the round's members can fetch it (``sha``, its SHA-256, names it: the core hashed it
    already, so the board does not hash megabytes again on the outer step's path)."""

    blob: bytes
    sha: bytes


@dataclass(frozen=True)
class Publish:
    """Make ``record`` this member's record of the round (newest wins), and push it to the group."""

    record: OuterRecord


@dataclass(frozen=True)
class ReadRecords:
    """Start read ``number`` of the round's records now; a read still in flight is dropped."""

    number: int


@dataclass(frozen=True)
class ReadParticipants:
    """Read who took part in the round (answer with ``receive_participants``)."""


@dataclass(frozen=True)
class FetchShard:
    """Fetch shard ``index`` from its owner's record ``owner`` (``mine``: the bytes held now, so that only the
    pieces that differ travel; ``vector_bytes``: where the owner's piece index starts in its blob)."""

    index: int
    owner: OuterRecord
    mine: bytes
    vector_bytes: int


@dataclass(frozen=True)
class StopShardFetches:
    """The repair phase is over: fetches still running are dropped."""


@dataclass(frozen=True)
class FetchFinal:
    """Download the whole vector whose SHA-256 is ``sha`` (``size`` bytes) from one of ``holders``."""

    sha: bytes
    size: int
    holders: tuple[OuterRecord, ...]


Action = Keep | Publish | ReadRecords | ReadParticipants | FetchShard | StopShardFetches | FetchFinal


class Phase(enum.Enum):
    REPAIR = "repair"  # every shard from its owner
    SWARM = "swarm"  # one final across the swarm (it ends only once the first read of participants is in)
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class AgreementStatistics:
    """Where an agreement stands (final once ``done``)."""

    phase: str
    final: bytes  # this member's final hash (empty before the swarm phase)
    repaired_bytes: int  # fetched from shard owners
    adopted_bytes: int  # fetched because another final won
    adopted: bool
    members: int  # records whose final equals ours when the step ended (this member included)
    dissent: int  # records without our final when the step ended (dead, or still to adopt it)
    states: int  # of those holding our final, how many named our pre-step state hash
    state_winner: bytes  # the pre-step state hash most members named
    ignored: int  # records read from nodes that were not the round's known participants
    pushed: int  # members whose records were pushed to this node when the step ended
    reads: int  # reads of the board that had returned
    phases: dict[str, float] = field(default_factory=dict)  # seconds: "repair", "participants", "agree"
    # the median of the waits (OuterRecord.wait) the group's other members' records told, None where none did: how
    # long the others waited for their group to start, beside this member's own wait
    group_wait_s: float | None = None


class Backoff:
    """Waits between reads of a phase: POLL_FIRST_S, growing by half each time up to POLL_S (a phase usually
    ends within a few round trips, and a long wait should not read the DHT more often than POLL_S)."""

    def __init__(self) -> None:
        self.wait = POLL_FIRST_S

    def next(self) -> float:
        wait, self.wait = self.wait, min(POLL_S, self.wait * 1.5)
        return wait


class OuterAgreement:
    """One member's agreement on an outer step's average. ``data``: its averaged vector (float32 bytes);
    ``members``: the group's node ids in its order (shard k is repaired only from ``members[k]``'s record; None:
    nothing is repaired); ``expect``: how many members the round has; ``participants``: the node ids whose
    records count (None: every record); ``refresh``: participants may be re-read (``ReadParticipants``) while
    records of unknown nodes show up; ``refresh_first``: they are also read from the start, and the step
    ends only once that first read is in (what it reads joins ``participants`` and raises ``expect``); the
    finals are exchanged meanwhile, so a read that returns last costs nothing beyond itself. ``complete``: the
    group average's all-gather brought every owner's shard here whole (RoundResult.complete), so this vector is
    the owners' concatenation as they sent it and there is nothing to repair: its final is published at the start
    (with its owner record, which the others still repair from) and the step may end as soon as a strict majority
    holds it, without waiting for the slowest member's record. An owner that sent this member other bytes than it
    published is outvoted or adopted over in the swarm phase, as one that does not serve its repair is."""

    def __init__(self, node: bytes, data: bytes | bytearray, *, group: str, size: int, index: int, state: bytes,
                 repair_s: float, deadline_s: float, addr: Address | None = None,
                 members: list[bytes] | None = None, expect: int = 1, participants: frozenset[bytes] | None = None,
                 refresh: bool = False, refresh_first: bool = False, complete: bool = False,
                 wait_s: float | None = None) -> None:
        if not group:  # alone: a group of one owns every shard
            size, index, members = 1, 0, None
        if members is not None and (len(members) != size or not 0 <= index < size or members[index] != node):
            members = None  # not this group's order: no owner is known
        self.node, self.group, self.size, self.index = node, group, size, index
        self.members = members
        self.complete = complete and members is not None
        self.state_hash = state
        self.repair_s, self.deadline_s = repair_s, deadline_s
        self.addr = addr
        self.wait_s = wait_s if wait_s is not None and 0.0 <= wait_s <= MAX_WAIT_S else None
        self.expect = expect
        self.participants = participants
        self.refresh = refresh
        self.data = data if isinstance(data, bytearray) else bytearray(data)  # a bytearray is taken over, not copied
        self.length = len(self.data) // 4
        self._vector: bytes | None = None  # the averaged vector as kept at the start, and its hash: while no
        self._vector_sha = b""  # repair has changed a byte, they are the final's blob and hash (no second pass)
        self.phase = Phase.REPAIR
        self.error = ""
        self.me: OuterRecord | None = None
        self._actions: list[Action] = []
        self._t0 = self._t_repaired = self._t_end = 0.0
        self._t_first = 0.0  # when the first read of the participants returned
        # reads of the records: numbered as they start; a phase counts only reads that started after it began
        self._pushed: list[OuterRecord] = []
        self._read: list[OuterRecord] = []
        self._read_no = 0
        self._started = 0
        self._reading = False
        self._next_read = 0.0
        self._poll = Backoff()
        self._fresh = 0
        self._reads = 0
        # repair
        self._done: set[int] = {index} if members else set(range(size))
        self._inflight: dict[int, OuterRecord] = {}
        self._tries: dict[int, int] = {}
        self._settled_at: float | None = None  # when every owner that had published was settled
        self._repaired_bytes = 0
        # participants
        self._first_pending = self._first_read = refresh and refresh_first
        self._refreshing = self._first_pending
        self._refreshed = 0.0
        self._known: frozenset[bytes] | None = None
        self._unknown_seen = False
        self._unknown_at: dict[bytes, float] = {}  # node -> when a final of a node outside ``_known`` was first read
        self._refresh_started = 0.0  # when the read of the participants in flight started
        self._checked_at = -math.inf  # when the latest read of the participants that returned started
        # swarm
        self._fetching: bytes | None = None
        self._fetch_again = 0.0
        self._adopted_bytes = 0
        self._adopted = False
        self._view: list[OuterRecord] = []
        self._ignored = 0
        self._now = 0.0  # the latest time an input or the timer brought

    # -- output -------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def get_timer(self) -> float | None:
        """The next moment this core must look again without an input (None once it is done)."""
        if self.done:
            return None
        times = []
        if not self._reading:
            times.append(self._next_read)  # due: a read starts
        if self.phase is Phase.REPAIR:
            times.append(self._t0 + self.repair_s)  # due: the repair ends
            if self._settled_at is not None:
                times.append(self._settled_at + OWNER_GRACE_S)  # due: the repair ends, or fetches started
        else:
            times.append(self._t0 + self.deadline_s)  # due: the step fails
        if self.phase is Phase.SWARM:
            if self._unknown_seen and not self._refreshing:
                times.append(self._refreshed + REFRESH_S)  # due: a read of the participants starts
            # moments after which a decision may change (each only while it is still ahead)
            later = [self._t0 + self.deadline_s / 2, self._fetch_again]
            if not self.group:
                later.append(self._t0 + ALONE_SETTLE_S)
            times.extend(t for t in later if t > self._now)
        return min(times)

    def statistics(self) -> AgreementStatistics:
        counts: dict[bytes, int] = {}
        me = self.me
        final = me.final if me is not None else b""
        same = [r for r in self._view if r.final == final] if final else []
        for r in [*same, *([me] if me is not None else [])]:
            if r.state:
                counts[r.state] = counts.get(r.state, 0) + 1
        winner_state = min(counts, key=lambda h: (-counts[h], h)) if counts else b""
        phases: dict[str, float] = {}
        if self.phase is not Phase.REPAIR:
            phases["repair"] = self._t_repaired - self._t0
        if self._first_read and not self._first_pending:
            # how long the end waited for the first read of them beyond the repair (0: it came during the repair)
            phases["participants"] = max(0.0, self._t_first - self._t_repaired) if self.phase is not Phase.REPAIR \
                else 0.0
        if self.done:
            phases["agree"] = self._t_end - self._t_repaired
        return AgreementStatistics(
            phase=self.phase.value, final=final, repaired_bytes=self._repaired_bytes,
            adopted_bytes=self._adopted_bytes, adopted=self._adopted, members=1 + len(same),
            dissent=sum(1 for r in self._view if r.final != final), states=counts.get(self.state_hash, 0) if counts
            else 1, state_winner=winner_state, ignored=self._ignored,
            pushed=len({r.node for r in self._pushed}), reads=self._reads, phases=phases,
            group_wait_s=self._group_wait())

    def _group_wait(self) -> float | None:
        """The median wait the group's other members' records tell (one record per member: the latest known)."""
        if not self.members or not self.group:
            return None
        others = set(self.members) - {self.node}
        waits = sorted(r.wait for r in self._records() if r.node in others and r.group == self.group
                       and r.wait is not None)
        return statistics.median(waits) if waits else None

    # -- inputs -------------------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Keep the averaged vector (with the owned shard's piece index) and publish this member's record."""
        start, stop = shard_bounds(self.length, self.size, self.index)
        self._vector = vector = bytes(self.data)
        h = hashlib.sha256(vector)  # the vector's hash, then on through the piece index: the blob's (one pass)
        self._vector_sha = h.digest()
        shard = memoryview(vector)[4 * start: 4 * stop]
        pieces = piece_hashes(shard)
        h.update(pieces)
        blob, blob_sha = vector + pieces, h.digest()
        self._actions.append(Keep(blob, blob_sha))
        self.me = OuterRecord(self.node, self.group, self.size, self.index, _sha(shard), blob_sha, b"",
                              self.state_hash, self.length, self.addr, self.wait_s)
        self._t0 = now
        if self._first_pending:
            self._refresh_started = now
            self._actions.append(ReadParticipants())
        if self.complete:  # nothing to repair: straight to the swarm phase, whose record holds the shard hash too
            self._end_repair(now)
        else:
            self._actions.append(Publish(self.me))
            self._read_now()
        self._decide(now)

    def receive_records(self, number: int, records: list[OuterRecord] | None, now: float) -> None:
        """Read ``number`` returned ``records`` (None: it failed). A read that was dropped is ignored."""
        if self.done or number != self._started:
            return
        self._reading = False
        self._next_read = now + self._poll.next()
        if records is not None:
            self._read, self._read_no = list(records), number
            self._reads += 1
        self._decide(now)

    def receive_pushed(self, records: list[OuterRecord], now: float) -> None:
        """The records pushed to this node for the round, each attributed to its authenticated sender."""
        if self.done:
            return
        self._pushed = list(records)
        self._decide(now)

    def receive_shard(self, index: int, got: bytes | None, fetched: int, now: float) -> None:
        """A shard fetch ended: the owner's bytes (None: it failed) and how many bytes it moved. The bytes
        count only if they hash to the shard hash of ``members[index]``'s record that was fetched from."""
        owner = self._inflight.pop(index, None)
        if self.phase is not Phase.REPAIR or owner is None:
            return
        a, b = shard_bounds(self.length, self.size, index)
        if got is not None and len(got) == 4 * (b - a) and _sha(got) == owner.shard:
            self.data[4 * a: 4 * b] = got
            self._vector = None  # the vector changed: the final is hashed afresh
            self._repaired_bytes += fetched
            self._done.add(index)
        else:
            self._tries[index] = self._tries.get(index, 0) + 1
            if self._tries[index] >= REPAIR_TRIES:
                self._done.add(index)  # its owner cannot or will not serve it: the swarm phase settles it
        self._decide(now)

    def receive_participants(self, ids: frozenset[bytes] | None, now: float) -> None:
        """A read of the round's participants returned (None: it failed; what is known stays known)."""
        if self.done:
            return
        self._refreshing = False
        self._checked_at = self._refresh_started
        if self._first_pending:
            self._first_pending = False
            self._t_first = now
            self.participants = (self.participants or frozenset()) | (ids or frozenset())
            self.expect = max(self.expect, min(MAX_GROUP, len(ids or ())))
            if self._known is not None:  # the swarm phase began before it: they count from now on
                self._known = self._known | self.participants
        elif ids and self._known is not None:
            self._known = self._known | ids
        self._decide(now)

    def receive_final(self, sha: bytes, got: bytes | bytearray | None, now: float) -> None:
        """The winning vector's download ended (None: it failed)."""
        if self.done or sha != self._fetching:
            return
        self._fetching = None
        assert self.me is not None
        if got is not None and len(got) == len(self.data) and _sha(got) == sha:
            self.data = bytearray(got)
            self._adopted_bytes += len(got)
            self._adopted = True
            self._actions.append(Keep(got if isinstance(got, bytes) else bytes(got), sha))
            self.me = replace(self.me, final=sha)
            self._actions.append(Publish(self.me))
            self._fetch_again = 0.0
        else:
            self._fetch_again = now + POLL_S  # ask again a little later (the holders, or the winner, may change)
        self._decide(now)

    def handle_timer(self, now: float) -> None:
        if self.done:
            return
        if not self._reading and now >= self._next_read:
            self._read_now()
        self._decide(now)

    # -- decisions ----------------------------------------------------------------------------------------
    def _read_now(self) -> None:
        self._started += 1
        self._reading = True
        self._actions.append(ReadRecords(self._started))

    def _records(self, since: int = 0) -> list[OuterRecord]:
        """The records known now: pushed ones, and those of the latest read if it started ``since`` or later."""
        return merged(self._read if self._read_no >= since else [], self._pushed)

    def _decide(self, now: float) -> None:
        self._now = max(self._now, now)
        if self.phase is Phase.REPAIR:
            self._repair(now)
        if self.phase is Phase.SWARM:
            self._swarm(now)

    def _repair(self, now: float) -> None:
        """Fetch every shard whose owner's record is read and differs; end when every shard is settled, when
        the owners left have published nothing for OWNER_GRACE_S, or at the repair deadline."""
        assert self.me is not None
        if now - self._t0 >= self.repair_s:
            return self._end_repair(now)
        records = self._records()
        owners = self.members or []
        started = False
        for k in range(self.size):
            if k in self._done or k in self._inflight:
                continue
            if any(r.node == owners[k] and r.group != self.group for r in records):
                self._done.add(k)  # its own account has it outside the group: nothing to fetch
                continue
            r = owner_record(self.me, k, records, self.members)
            if r is None:
                continue  # not published yet
            a, b = shard_bounds(self.length, self.size, k)
            mine = memoryview(self.data)[4 * a: 4 * b]
            if b == a or _sha(mine) == r.shard:
                self._done.add(k)
                continue
            self._inflight[k] = r
            self._actions.append(FetchShard(k, r, bytes(mine), 4 * self.length))
            started = True
        if started or self._inflight:
            self._settled_at = None
        elif len(self._done) == self.size:
            self._end_repair(now)
        elif self._settled_at is None:
            self._settled_at = now
        elif now - self._settled_at >= OWNER_GRACE_S:
            self._end_repair(now)  # the owners left have published nothing: their shards stay as they are

    def _end_repair(self, now: float) -> None:
        self._t_repaired = now
        if self._inflight:
            self._inflight.clear()
            self._actions.append(StopShardFetches())
        self._enter_swarm(now)

    def _enter_swarm(self, now: float) -> None:
        """Publish this member's final (the hash of its repaired vector) and read afresh: what was read before
        it is not what the others hold now. The first read of the participants may still be in flight: the
        finals are exchanged meanwhile, and only the end waits for it (it can raise what the step waits for)."""
        assert self.me is not None
        self.phase = Phase.SWARM
        members = frozenset(self.members or ())
        self._known = None if self.participants is None else self.participants | members | {self.node}
        self._refreshed = now
        if self._vector is not None:  # nothing was repaired: the vector kept at the start is the final's
            blob, final = self._vector, self._vector_sha
        else:
            blob = bytes(self.data)
            final = _sha(blob)
        self._vector = None
        self._actions.append(Keep(blob, final))
        self.me = replace(self.me, final=final)
        self._actions.append(Publish(self.me))
        self._poll = Backoff()
        self._read_now()
        self._fresh = self._started

    def _swarm(self, now: float) -> None:
        """Adopt the winning final if it is not ours; end once ours wins and enough members hold it."""
        assert self.me is not None
        read = [r for r in self._records(self._fresh) if r.length == self.length and r.node != self.node]
        known = self._known
        self._unknown_seen = known is not None and self.refresh and any(r.node not in known for r in read)
        if self._unknown_seen:
            for r in read:
                if r.final and r.node not in known:
                    self._unknown_at.setdefault(r.node, now)
        # a final of a node this member does not know as a participant, read after the latest read of them
        # started: it may be a member of another group of this step whose progress was not written yet, and
        # ending on a majority that leaves it out could leave its group waiting on a tie it cannot win
        unchecked = self.refresh and any(t > self._checked_at for n, t in self._unknown_at.items()
                                         if known is None or n not in known)
        if self._unknown_seen and not self._refreshing and (now - self._refreshed >= REFRESH_S or unchecked):
            self._refreshed = self._refresh_started = now
            self._refreshing = True
            self._actions.append(ReadParticipants())
        records = read if known is None else [r for r in read if r.node in known]
        self._ignored = len(read) - len(records)
        self._view = records
        win = winner([*records, self.me])
        if win is not None and win != self.me.final:
            if self._fetching is None and now >= self._fetch_again:
                self._fetching = win
                self._actions.append(FetchFinal(win, len(self.data), tuple(r for r in records if r.final == win)))
        else:
            # alone: give the others time to publish, unless another member holds this final already (adopted)
            settled = bool(self.group) or now - self._t0 >= ALONE_SETTLE_S \
                or any(r.final == self.me.final for r in records)
            patient = now - self._t0 < self.deadline_s / 2
            if settled and not self._first_pending and not (patient and unchecked) \
                    and agreed(self.me, records, patient=patient, expect=max(self.expect, self.size)):
                self.phase = Phase.DONE
                self._t_end = now
                return
        if now - self._t0 >= self.deadline_s:
            self._fail(now, records)

    def _fail(self, now: float, records: list[OuterRecord]) -> None:
        assert self.me is not None
        finals = sorted({r.final.hex()[:12] for r in records if r.final} | {self.me.final.hex()[:12]})
        self.error = (f"the outer average did not agree within {self.deadline_s:.0f} s: finals {finals} "
                      f"({len(records) + 1} members read)")
        self.phase = Phase.FAILED
        self._t_end = now
