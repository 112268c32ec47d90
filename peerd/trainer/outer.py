"""Agreement on a DiLoCo outer average: every member of the swarm ends an outer step with the same bytes.

A Moshpit group average is not exact: a range lost in the all-gather leaves a member with its own value
there, and a member that missed the group holds only its own vector. Parameter averaging pulls sync-mode
replicas back together, but DiLoCo's global parameters and outer momentum are applied from this vector,
so any difference would stay for good. After the group average every member therefore:

1. **Repairs from owners.** In a group of n, member j owns shard j (elements [j*L//n, (j+1)*L//n), as
   peerd.allreduce.shards cuts them): its shard never crosses the all-gather, so the owner's bytes are the
   group's average there. Each member publishes (in the DHT, under the run key and the outer round) the
   SHA-256 of the shard it owns and of its whole vector, keeps the vector for others to read (state sync's
   STATE_GET), and fetches every shard whose hash differs from its owner's, verified against that hash.
   The owner of shard k is the group's k-th member as the averaging round knows it (``members``), never a
   record that claims index k: no other record repairs anything. Each shard is fetched as soon as its
   owner's record is read: the owner's piece index (a short hash of every PIECE bytes, kept after its
   vector) in sections, and as each section arrives only its pieces that differ, in chunks with many
   requests outstanding, each asked afresh after a few round trips when its answer is late. An owner that has
   published nothing once every other shard is settled is waited for OWNER_GRACE_S more, not the whole
   repair phase; one whose bytes do not verify is asked REPAIR_TRIES times.
   Without loss nothing is fetched; after repair every member of a group holds the owners' concatenation. A
   member whose group average reached it whole (every owner's shard arrived) holds it already: it publishes its
   final with its first record and goes straight to step 2, without waiting for the others' records.
   With a codec (the run's compression), an owner keeps the dequantized encoding of its shard, the value the
   all-gather hands the others, so the hashes and the repaired bytes are those dequantized values too.
2. **Agrees across the swarm.** Each member publishes the SHA-256 of its repaired vector (``final``). The
   final that most members hold wins (ties: the one from the larger group, then the lower hash); a member
   holding another downloads the winner (verified against its hash) and publishes it. Only the round's
   known participants (``participants``: the group members and the members whose progress says they took
   part in the step) are counted; records of any other node are ignored (a progress record is its writer's
   own claim, so minted ids that also write progress still count: what the repair binding to ``members``
   protects does not rest on this count). The step ends as soon as this
   member holds the winner and either a strict majority of the round's members hold it (no other final can
   then win, so the rest adopt it) or every member it has read has published it; after half the deadline,
   members that never publish a final are no longer waited for. The step also waits for a first read of who
   took part (the run's progress), which finds groups of the step that finished first, except in a kept group
   (every member the run expected is in it, and it skips matchmaking: it finishes first). A member that cannot
   get the winner by the deadline raises OuterError, never diverges silently.

A member's records go out in the background (newest only, in order), so reading and fetching never wait
for a DHT store, nor does the step wait for its last put (given a ``background`` nursery); the step's phases
(seconds in "repair", "participants" and "agree") are in the Agreement. The round's records
are read in the background too (a DHT read costs round trips, seconds under loss): the phases decide on the
latest read merged with the records the group's members pushed to this node (a ``PushBoard``: OUTER_RECORD,
sent to every member it averaged with as soon as a record exists), and wake as soon as either changes. So a
group whose members' pushes arrive agrees without waiting for any DHT read; the DHT copy stays for members
of other groups and for a push that was lost.

The decisions (which shards to repair, which final wins, when the step is agreed, when to read again) are
made by a sans-I/O core (peerd.trainer.agreement.OuterAgreement) from the records (peerd.trainer.records);
``agree`` is its trio shell: it carries out the core's actions on a ``Board`` (the DHT and state sync in a
daemon, memory in tests) and feeds back what they return. Records are members' claims: they are bounded on
decode, and every byte fetched is checked against a hash.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import trio

from ..transport.endpoint import Address
from .agreement import (
    FetchFinal,
    FetchShard,
    Keep,
    OuterAgreement,
    Publish,
    ReadParticipants,
    ReadRecords,
    StopShardFetches,
)
from .records import (
    MAX_GROUP,
    PIECE,
    PIECE_HASH,
    OuterRecord,
    differing_runs,
    record_key,
    sha256,
    shard_bounds,
    store_key,
)

log = logging.getLogger("peerd.trainer.outer")

OUTER_TTL_S = 600.0  # a round's records outlive the slowest member's agreement by far
FETCH_WINDOW = 48  # chunk requests a member has in flight while it repairs: more overflow the owners' link queues
FETCH_TIMEOUT_S = 0.3  # a repair request's first retransmission at most (before the owner's round trip is known)
FETCH_MIN_WAIT_S = 0.015  # ... and at least: below this, scheduling jitter on a busy host looks like loss
FETCH_RTTS = 4  # ... else this many smoothed round trips to the owner (its learned RTO may be far longer)
FETCH_ATTEMPTS = 10  # requests for one repair chunk: their waits then span seconds, as the default's do
FETCH_FLAT = 3  # ... the first this many each wait the same few round trips (random loss is not congestion),
# the later ones twice as long each (an owner that stopped answering is not asked ever faster)
INDEX_SECTION = 100  # pieces of an owner's piece index asked at once: what one STATE_GET answer carries
PUSH_TIMEOUT_S = 0.3  # a pushed record's first retransmission at most (the learned RTO usually comes first)
PUSH_ATTEMPTS = 4  # sends of a pushed record before it is left to the DHT copy


class OuterError(Exception):
    """The members of an outer step could not agree on its average within the deadline."""


class Board(Protocol):
    """Where a round's records are published and read, and blobs kept and fetched (DHT + state sync)."""

    def keep(self, blob: bytes, sha: bytes) -> bytes: ...
    async def publish(self, record: OuterRecord) -> None: ...
    async def read(self) -> list[OuterRecord]: ...
    async def fetch_range(self, holder: OuterRecord, sha: bytes, offset: int, length: int) -> bytes: ...
    async def fetch(self, sha: bytes, size: int, holders: list[OuterRecord]) -> bytes | bytearray: ...


@runtime_checkable
class PushBoard(Board, Protocol):
    """A Board whose members also send their records straight to each other, so that they are read without
    a DHT read. ``pushed``: the records pushed to this node for the round, each attributed to its
    authenticated sender (whatever it claims); ``listen(wake)`` calls ``wake`` when one arrives and returns
    what stops it."""

    async def push(self, record: OuterRecord) -> None: ...
    def pushed(self) -> list[OuterRecord]: ...
    def listen(self, wake: Callable[[], None]) -> Callable[[], None]: ...


@dataclass(frozen=True)
class Agreement:
    """How an outer step ended for this member: the vector every member holds and its hash, and what it cost."""

    vector: np.ndarray
    final: bytes
    repaired_bytes: int = 0  # fetched from shard owners
    adopted_bytes: int = 0  # fetched because another final won
    adopted: bool = False
    members: int = 1  # records whose final equals ours when the step ended
    dissent: int = 0  # records without our final when the step ended (dead, or still to adopt it)
    states: int = 1  # of those, how many named our pre-step state hash
    state_winner: bytes = b""  # the pre-step state hash most members named
    ignored: int = 0  # records read from nodes that were not the round's known participants
    pushed: int = 0  # members whose records were pushed to this node (PushBoard) when the step ended
    reads: int = 0  # reads of the board that had returned when the step ended
    phases: dict[str, float] = field(default_factory=dict)  # seconds: "repair", "agree"
    group_wait_s: float | None = None  # the median wait the group's other members' records told (None: none did)


async def fetch_shard(board: Board, owner: OuterRecord, mine: bytes | bytearray | memoryview,
                      vector_bytes: int, *, section: int = INDEX_SECTION) -> tuple[bytes, int] | None:
    """The owner's shard (its bytes, and how many were fetched), verified against its published hash, or None
    when what it serves does not verify. Reads the owner's piece index (kept after its vector in the blob
    ``owner.avg``) in sections of ``section`` pieces, all at once, and as each section arrives fetches the runs
    of its pieces that differ (so one lost index request delays only its own section's pieces); if the result
    does not verify (the index lied, or the blob is not what the record says), the whole shard once."""
    start, stop = shard_bounds(owner.length, owner.size, owner.index)
    a, b = 4 * start, 4 * stop
    pieces = -(-(b - a) // PIECE)
    got = bytearray(mine)
    fetched = 0
    whole = True

    async def one_section(first: int) -> None:
        nonlocal fetched, whole
        count = min(section, pieces - first)
        index = await board.fetch_range(owner, owner.avg, vector_bytes + first * PIECE_HASH, count * PIECE_HASH)
        fetched += len(index)
        if len(index) != count * PIECE_HASH:
            whole = False
            return
        lo, hi = first * PIECE, min(b - a, (first + count) * PIECE)
        runs = differing_runs(memoryview(mine)[lo:hi], index)

        async def run(off: int, n: int) -> None:
            nonlocal fetched, whole
            part = await board.fetch_range(owner, owner.avg, a + lo + off, n)
            if len(part) != n:
                whole = False
                return
            got[lo + off: lo + off + n] = part
            fetched += n

        async with trio.open_nursery() as nursery:
            for off, n in runs:
                nursery.start_soon(run, off, n)

    async with trio.open_nursery() as nursery:
        for first in range(0, pieces, section):
            nursery.start_soon(one_section, first)
    if whole and sha256(got) == owner.shard:
        return bytes(got), fetched
    data = await board.fetch_range(owner, owner.avg, a, b - a)
    if sha256(data) != owner.shard:
        return None
    return data, fetched + len(data)


def fetch_timeout(srtt: float | None) -> float:
    """A repair request's first retransmission wait, from the smoothed round trip to the owner (None: unknown).
    A STATE_GET is idempotent, so asking again early costs one more small datagram, never a wrong answer."""
    if srtt is None:
        return FETCH_TIMEOUT_S
    return min(FETCH_TIMEOUT_S, max(FETCH_MIN_WAIT_S, FETCH_RTTS * srtt))


Participants = Callable[[], Awaitable[frozenset[bytes]]]


async def agree(board: Board, node: bytes, vector: np.ndarray, *, group: str, size: int, index: int,
                state: bytes, repair_s: float, deadline_s: float, addr: Address | None = None,
                members: list[bytes] | None = None, expect: int = 1,
                participants: frozenset[bytes] | None = None, refresh: Participants | None = None,
                refresh_first: bool = False, complete: bool = False, clock: Callable[[], float] = trio.current_time,
                background: trio.Nursery | None = None, wait_s: float | None = None) -> Agreement:
    """Run both phases (module docstring) for this member's averaged ``vector``; raises OuterError.
    ``members``: the group's node ids in its order: shard k is repaired only from ``members[k]``'s record
    (without them nothing is repaired), and an owner whose record names another group (it left the group, or
    never knew it formed) is not waited for. ``expect``: how many members the round has (e.g. the peers
    matchmaking saw): a member that averaged alone waits for them rather than end alone. ``participants``:
    the node ids whose records count in the agreement (``members`` and this node always do; None: every
    record counts); ``refresh`` re-reads them (at most every REFRESH_S) while records of others show up.
    ``refresh_first``: ``refresh`` also runs once from the start, while the repair runs (a DHT read is not
    waited for before it); what it reads joins ``participants`` and raises ``expect`` to its number (at most
    MAX_GROUP) before the swarm phase, which waits for that first read. ``complete``: the group average reached
    this member whole (nothing to repair; OuterAgreement). ``background``: a nursery that outlives
    the call, where this member's last record is still put after agree returns (None: agree waits for it).
    ``wait_s``: how long this member waited for its group to start, told in its record (OuterRecord.wait)."""
    data = bytearray(np.ascontiguousarray(vector, dtype=np.float32).data)  # one copy, which the core takes over
    core = OuterAgreement(node, data, group=group, size=size, index=index, state=state, repair_s=repair_s,
                          deadline_s=deadline_s, addr=addr, members=members, expect=expect,
                          participants=participants, refresh=refresh is not None,
                          refresh_first=refresh_first, complete=complete, wait_s=wait_s)
    async with trio.open_nursery() as nursery:
        shell = _Shell(board, core, nursery, refresh, clock, background or nursery)
        try:
            await shell.run()
        finally:
            shell.close()  # the last record still goes out (before agree returns unless in the background)
    stats = core.statistics()
    if core.error:
        raise OuterError(core.error)
    log.info("outer agreement: repaired in %.3f s (%d bytes fetched), participants read after %.3f s more, "
             "agreed in %.3f s (%d reads, %d pushed)", stats.phases["repair"], stats.repaired_bytes,
             stats.phases.get("participants", 0.0), stats.phases["agree"], stats.reads, stats.pushed)
    return Agreement(np.frombuffer(core.data, dtype=np.float32), stats.final,  # the core is done with its bytes
                     repaired_bytes=stats.repaired_bytes, adopted_bytes=stats.adopted_bytes, adopted=stats.adopted,
                     members=stats.members, dissent=stats.dissent, states=stats.states,
                     state_winner=stats.state_winner, ignored=stats.ignored, pushed=stats.pushed, reads=stats.reads,
                     phases=dict(stats.phases), group_wait_s=stats.group_wait_s)


class _Shell:
    """Carries out an OuterAgreement's actions on a board and feeds back what they return; it only waits.
    Every I/O runs in its own task and hands its result to the loop, which alone calls the core."""

    def __init__(self, board: Board, core: OuterAgreement, nursery: trio.Nursery, refresh: Participants | None,
                 clock: Callable[[], float], background: trio.Nursery) -> None:
        self.board, self.core, self.nursery = board, core, nursery
        self.background = background
        self.refresh = refresh
        self.clock = clock
        self.publisher = _Publisher(board, background)
        self.pushes = board if isinstance(board, PushBoard) else None
        self.inputs: list[Callable[[float], None]] = []
        self.wake = trio.Event()
        self.read_scope: trio.CancelScope | None = None
        self.tasks: set[trio.CancelScope] = set()  # reads of participants and fetches: dropped at the end
        self.fetches: set[trio.CancelScope] = set()
        self._unlisten = self.pushes.listen(self._pushed) if self.pushes is not None else None

    def _pushed(self) -> None:
        assert self.pushes is not None
        pushes = self.pushes
        self._input(lambda now: self.core.receive_pushed(pushes.pushed(), now))  # the latest when it is fed

    def _input(self, feed: Callable[[float], None]) -> None:
        self.inputs.append(feed)
        self.wake.set()

    async def run(self) -> None:
        self.background.start_soon(self.publisher.run)
        self.core.start(self.clock())
        if self.pushes is not None:
            self._pushed()
        while True:
            self._carry_out()
            if self.core.done:
                return
            timer = self.core.get_timer()
            with trio.move_on_at(math.inf if timer is None else timer):
                await self.wake.wait()
            self.wake = trio.Event()
            inputs, self.inputs = self.inputs, []
            for feed in inputs:
                feed(self.clock())
            now = self.clock()
            if timer is not None and now >= timer:
                self.core.handle_timer(now)

    def _carry_out(self) -> None:
        for action in self.core.take_actions():
            if isinstance(action, Keep):
                self.board.keep(action.blob, action.sha)
            elif isinstance(action, Publish):
                self.publisher.put(action.record)
            elif isinstance(action, ReadRecords):
                if self.read_scope is not None:
                    self.read_scope.cancel()
                self.read_scope = trio.CancelScope()
                self.nursery.start_soon(self._read, action.number, self.read_scope)
            elif isinstance(action, ReadParticipants):
                self._spawn(self._participants, self.tasks)
            elif isinstance(action, FetchShard):
                self._spawn(self._fetch_shard, self.fetches, action)
            elif isinstance(action, StopShardFetches):
                for scope in self.fetches:
                    scope.cancel()
            elif isinstance(action, FetchFinal):
                self._spawn(self._fetch_final, self.tasks, action)

    def _spawn(self, fn: Callable[..., Awaitable[None]], scopes: set[trio.CancelScope], *args: object) -> None:
        scope = trio.CancelScope()
        scopes.add(scope)

        async def task() -> None:
            try:
                with scope:
                    await fn(*args)
            finally:
                scopes.discard(scope)

        self.nursery.start_soon(task)

    async def _read(self, number: int, scope: trio.CancelScope) -> None:
        with scope:
            try:
                got: list[OuterRecord] | None = await self.board.read()
            except Exception as e:  # the next read, or the pushed records, settle it
                log.info("outer agreement: reading the round's records failed: %s", e)
                got = None
            self._input(lambda now: self.core.receive_records(number, got, now))

    async def _participants(self) -> None:
        assert self.refresh is not None
        try:
            ids: frozenset[bytes] | None = await self.refresh()
        except Exception as e:  # the agreement runs on the participants it has
            log.info("outer agreement: reading the round's participants failed: %s", e)
            ids = None
        self._input(lambda now: self.core.receive_participants(ids, now))

    async def _fetch_shard(self, action: FetchShard) -> None:
        try:
            got = await fetch_shard(self.board, action.owner, action.mine, action.vector_bytes)
        except Exception as e:  # the owner went away or lost the blob: the swarm phase settles it
            log.info("outer repair: shard %d from %s failed: %s", action.index, action.owner.node.hex()[:12], e)
            got = None
        data, fetched = got if got is not None else (None, 0)
        self._input(lambda now: self.core.receive_shard(action.index, data, fetched, now))

    async def _fetch_final(self, action: FetchFinal) -> None:
        try:
            got: bytes | bytearray | None = await self.board.fetch(action.sha, action.size, list(action.holders))
        except Exception as e:
            log.info("outer agreement: fetching the winning average %s failed: %s", action.sha.hex()[:12], e)
            got = None
        self._input(lambda now: self.core.receive_final(action.sha, got, now))

    def close(self) -> None:
        if self.read_scope is not None:
            self.read_scope.cancel()
        for scope in [*self.tasks, *self.fetches]:
            scope.cancel()
        if self._unlisten is not None:
            self._unlisten()
        self.publisher.close()


class _Publisher:
    """Puts this member's records on the board in the background, newest only and in order, so that reading
    and fetching do not wait for a DHT store (a put costs round trips, and more under loss). On a PushBoard
    each record is also pushed at once, every push in its own task (the receivers keep the newest); pushes
    still retrying when the last put is done are given up (the others read that record from the DHT)."""

    def __init__(self, board: Board, nursery: trio.Nursery) -> None:
        self.board = board
        self.nursery = nursery
        self.pusher = board if isinstance(board, PushBoard) else None
        self.latest: OuterRecord | None = None
        self.closed = False
        self.done = False
        self.pushes: set[trio.CancelScope] = set()
        self.wake = trio.Event()

    def put(self, record: OuterRecord) -> None:
        self.latest = record
        self.wake.set()
        if self.pusher is not None:
            self.nursery.start_soon(self._push, self.pusher.push(record))

    async def _push(self, pushing: Awaitable[None]) -> None:
        scope = trio.CancelScope()
        if self.done:
            scope.cancel()
        self.pushes.add(scope)
        try:
            with scope:
                await pushing
        except Exception as e:  # the DHT copy is the fallback
            log.info("outer agreement: pushing this member's record failed: %s", e)
        finally:
            self.pushes.discard(scope)

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.done = True
            for scope in list(self.pushes):
                scope.cancel()

    async def _run(self) -> None:
        while True:
            if self.latest is None:
                if self.closed:
                    return
                await self.wake.wait()
                self.wake = trio.Event()
                continue
            record, self.latest = self.latest, None
            try:
                await self.board.publish(record)
            except Exception as e:  # the next record, or the others' reads, settle it
                log.info("outer agreement: publishing this member's record failed: %s", e)


class DhtBoard:
    """A PushBoard over a daemon's DHT and state sync (``statesync``: peerd.statesync.StateSync). ``inbox``
    (peerd.trainer.inbox.OuterInbox) holds the records pushed to this daemon; ``peers``: the node ids this
    member pushes its records to (the members of the groups it averaged with in the round)."""

    def __init__(self, statesync: object, run_key: str, round_no: int, *, read_timeout: float = 5.0,
                 inbox: object = None, peers: Iterable[bytes] = ()) -> None:
        self.sync = statesync
        self.run_key, self.round_no = run_key, round_no
        self.key = record_key(run_key, round_no)
        self.store = store_key(run_key, round_no)
        self.read_timeout = read_timeout
        self.window = trio.CapacityLimiter(FETCH_WINDOW)  # chunk requests in flight, over every range fetched
        self.inbox = inbox
        self.peers = sorted(set(peers))[:4 * MAX_GROUP]
        self.seq = 0  # records pushed for this round: the receivers keep the highest

    @property
    def node(self) -> bytes:
        return self.sync.node_id  # type: ignore[attr-defined]

    @property
    def addr(self) -> Address | None:
        return self.sync.advertise  # type: ignore[attr-defined]

    def keep(self, blob: bytes, sha: bytes) -> bytes:
        return self.sync.keep(self.store, blob, sha=sha)  # type: ignore[attr-defined]

    async def publish(self, record: OuterRecord) -> None:
        dht = self.sync.dht  # type: ignore[attr-defined]
        await dht.put(self.key, self.node.hex().encode(), record.encode(), OUTER_TTL_S)

    async def push(self, record: OuterRecord) -> None:
        """Send ``record`` to every peer (OUTER_RECORD, retried; one that does not answer has the DHT copy)."""
        from ..transport.endpoint import RpcError
        from ..wire import messages as m

        self.seq += 1
        fields = {"run": self.run_key.encode(), "round": self.round_no, "seq": self.seq, "record": record.encode()}
        endpoint = self.sync.endpoint  # type: ignore[attr-defined]

        async def one(peer: bytes) -> None:
            addr = endpoint.addr_of(peer) or await self.sync.resolve(peer, None)  # type: ignore[attr-defined]
            if addr is None:
                return
            try:
                await endpoint.request(addr, m.MsgType.OUTER_RECORD, fields, timeout=PUSH_TIMEOUT_S,
                                       attempts=PUSH_ATTEMPTS, node_id=peer)
            except RpcError as e:
                log.info("outer agreement: pushing a record to %s failed: %s", peer.hex()[:12], e)

        async with trio.open_nursery() as nursery:
            for peer in self.peers:
                if peer != self.node:
                    nursery.start_soon(one, peer)

    def pushed(self) -> list[OuterRecord]:
        if self.inbox is None:
            return []
        return self.inbox.records(self.run_key, self.round_no)  # type: ignore[attr-defined]

    def listen(self, wake: Callable[[], None]) -> Callable[[], None]:
        if self.inbox is None:
            return lambda: None
        return self.inbox.listen(self.run_key, self.round_no, wake)  # type: ignore[attr-defined]

    async def read(self) -> list[OuterRecord]:
        from ..wire.identity import node_id_of

        dht = self.sync.dht  # type: ignore[attr-defined]
        records = []
        with trio.move_on_after(self.read_timeout):
            records = await dht.get(self.key)
        out = []
        for r in records:
            owner = node_id_of(r.owner)
            if r.subkey != owner.hex().encode():
                continue  # a record is valid only under its owner's own subkey
            rec = OuterRecord.decode(owner, r.value)
            if rec is not None:
                out.append(rec)
        return out

    async def _addr(self, holder: OuterRecord) -> Address:
        addr = await self.sync.resolve(holder.node, holder.addr)  # type: ignore[attr-defined]
        if addr is None:
            raise OuterError(f"no address for {holder.node.hex()[:12]}")
        return addr

    async def _ask(self, addr: Address, sha: bytes, offset: int, length: int) -> bytes:
        """One chunk of the blob ``sha`` from ``addr``, within this board's window: each request waits a few
        round trips to ``addr`` (``fetch_timeout``, re-read each time) and is then asked afresh; after FETCH_FLAT
        requests each waits twice as long as the last, FETCH_ATTEMPTS in all. A refusal ends it at once (a
        read is idempotent: a late answer to an earlier request is dropped, never mistaken for another)."""
        from ..transport.endpoint import RpcError

        scale = 1.0
        async with self.window:
            for attempt in range(FETCH_ATTEMPTS):
                if attempt >= FETCH_FLAT:
                    scale *= 2.0
                wait = fetch_timeout(self._srtt(addr)) * scale
                try:
                    return await self.sync.fetch_range(  # type: ignore[attr-defined]
                        addr, self.store, sha, offset, length, timeout=wait, attempts=1)
                except RpcError as e:
                    if "refused" in str(e) or attempt == FETCH_ATTEMPTS - 1:
                        raise
        raise AssertionError("unreachable")

    def _srtt(self, addr: Address) -> float | None:
        """The smoothed round trip to ``addr``, or before its first sample the longest one known to this round's
        peers: a repair's first requests then wait a few of the swarm's round trips when one is lost, not
        FETCH_TIMEOUT_S. None: no round trip to any of them is known."""
        endpoint = self.sync.endpoint  # type: ignore[attr-defined]
        srtt = endpoint.rto.srtt(addr)
        if srtt is not None:
            return srtt
        addrs = [endpoint.addr_of(p) for p in self.peers if p != self.node]
        known = [endpoint.rto.srtt(a) for a in addrs if a is not None]
        return max((k for k in known if k is not None), default=None)

    async def fetch_range(self, holder: OuterRecord, sha: bytes, offset: int, length: int) -> bytes:
        """The range in one request per chunk, up to FETCH_WINDOW of this board's requests in flight (one at a
        time, a range costs a round trip per chunk: seconds for a shard on a lossy link). A chunk's request is
        asked again after a few round trips to the owner (``_ask``): a lost datagram costs that, not the
        transport's default first wait and its doubling, which back off under loss to hundreds of milliseconds."""
        from ..statesync.service import CHUNK_OVERHEAD
        from ..wire import messages as m

        addr = await self._addr(holder)
        chunk = max(1, min(m.MAX_CHUNK, self.sync.endpoint.max_body - CHUNK_OVERHEAD))  # type: ignore[attr-defined]
        offsets = iter(range(offset, offset + length, chunk))
        out = bytearray(length)

        async def worker() -> None:
            for off in offsets:  # shared by the workers: each chunk is taken once
                n = min(chunk, offset + length - off)
                got = await self._ask(addr, sha, off, n)
                if len(got) != n:
                    raise OuterError(f"{holder.node.hex()[:12]} sent {len(got)} bytes of {n}")
                out[off - offset: off - offset + n] = got

        async with trio.open_nursery() as nursery:
            for _ in range(min(FETCH_WINDOW, -(-length // chunk))):
                nursery.start_soon(worker)
        return bytes(out)

    async def fetch(self, sha: bytes, size: int, holders: list[OuterRecord]) -> bytes | bytearray:
        """The whole vector ``sha`` (``size`` bytes) from ``holders``: chunks spread over them, up to FETCH_WINDOW
        requests in flight, each retransmitted after a few round trips to its holder (as ``fetch_range``); a
        chunk that fails at one holder is asked of the next. Verified against ``sha``; raises OuterError."""
        from ..statesync.service import CHUNK_OVERHEAD
        from ..wire import messages as m

        addrs: list[Address] = []
        for h in holders[:16]:
            try:
                addr = await self._addr(h)
            except OuterError:
                continue
            if addr not in addrs:
                addrs.append(addr)
        if not addrs:
            raise OuterError("no holder of the winning average could be reached")
        endpoint = self.sync.endpoint  # type: ignore[attr-defined]
        chunk = max(1, min(m.MAX_CHUNK, endpoint.max_body - CHUNK_OVERHEAD))
        count = -(-size // chunk)
        chunks = iter(range(count))
        out = bytearray(size)
        failed: list[int] = []

        async def get(i: int) -> bool:
            off = i * chunk
            n = min(chunk, size - off)
            for k in range(2 * len(addrs)):  # from holder i mod h first, so that chunks spread over the holders
                addr = addrs[(i + k) % len(addrs)]
                try:
                    got = await self._ask(addr, sha, off, n)
                except Exception as e:  # (RpcError, StateSyncError): the next holder
                    log.debug("outer agreement: chunk at %d from %s: %s", off, addr, e)
                    continue
                if len(got) == n:
                    out[off: off + n] = got
                    return True
            return False

        async def worker(nursery: trio.Nursery) -> None:
            for i in chunks:  # shared by the workers: each chunk is taken once
                if not await get(i):
                    failed.append(i * chunk)
                    nursery.cancel_scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(min(FETCH_WINDOW, count)):
                nursery.start_soon(worker, nursery)
        if failed:
            raise OuterError(f"no holder served the winning average's bytes at offset {failed[0]}")
        if sha256(out) != sha:
            raise OuterError("the winning average's bytes do not match its hash")
        return out
