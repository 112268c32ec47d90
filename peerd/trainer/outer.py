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
   owner's record is read: first the owner's piece index (a short hash of every PIECE bytes, kept after its
   vector), then only the pieces that differ, in chunks with many requests outstanding. An owner that has
   published nothing once every other shard is settled is waited for OWNER_GRACE_S more, not the whole
   repair phase; one whose bytes do not verify is asked REPAIR_TRIES times.
   Without loss nothing is fetched; after repair every member of a group holds the owners' concatenation.
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
   members that never publish a final are no longer waited for. A member that cannot get the winner by the
   deadline raises OuterError, never diverges silently.

A member's records go out in the background (newest only, in order), so reading and fetching never wait
for a DHT store; the step's phases (seconds in "repair" and "agree") are in the Agreement. The round's records
are read in the background too (a DHT read costs round trips, seconds under loss): the phases decide on the
latest read merged with the records the group's members pushed to this node (a ``PushBoard``: OUTER_RECORD,
sent to every member it averaged with as soon as a record exists), and wake as soon as either changes. So a
group whose members' pushes arrive agrees without waiting for any DHT read; the DHT copy stays for members
of other groups and for a push that was lost.

The decisions (which shards to repair, which final wins, when the step is agreed) are pure functions of
the records; ``agree`` only waits on a ``Board`` (the DHT and state sync in a daemon, memory in tests).
Records are members' claims: they are bounded on decode, and every byte fetched is checked against a hash.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import msgpack
import numpy as np
import trio

from ..transport.endpoint import Address

log = logging.getLogger("peerd.trainer.outer")

OUTER_TTL_S = 600.0  # a round's records outlive the slowest member's agreement by far
POLL_S = 0.25  # how often a member re-reads the round's records while it waits (at most)
POLL_FIRST_S = 0.05  # the first re-read of a phase: the records it waits for are usually a moment away
ALONE_SETTLE_S = 1.0  # a member that averaged alone reads this long before it may end with its own vector
MAX_GROUP = 64  # members of one group (Moshpit's MAX_GROUP)
MAX_LENGTH = 2**32 - 1  # elements (allreduce offsets are u32)
SHA = 32
MAX_HOST = 45  # characters of an IP literal (IPv6 with an embedded IPv4 address)
OWNER_GRACE_S = 2.0  # once every other shard is settled, how long an owner that published nothing is waited for
REPAIR_TRIES = 3  # fetches of one shard that fail (or do not verify) before it is left as it is
PIECE = 1024  # bytes of a shard one piece hash covers (a lost datagram's range is about as long)
PIECE_HASH = 16  # bytes kept of each piece's SHA-256 (it only picks what to fetch; the shard hash checks)
FETCH_WINDOW = 256  # chunk requests a member has in flight while it repairs (a lost one waits out its timeout)
REFRESH_S = 1.0  # how often the known participants are re-read while records of unknown nodes show up
PUSH_TIMEOUT_S = 0.3  # a pushed record's first retransmission at most (the learned RTO usually comes first)
PUSH_ATTEMPTS = 4  # sends of a pushed record before it is left to the DHT copy


class OuterError(Exception):
    """The members of an outer step could not agree on its average within the deadline."""


@dataclass(frozen=True)
class OuterRecord:
    """One member's claim about an outer round: its group, the hash of the shard it owns and of its averaged
    vector (``avg``), the hash of its repaired vector once it has one (``final``; empty before), the hash
    of its outer state before the step (``state``), the vector's length in elements, where to fetch. The blob
    ``avg`` names holds the averaged vector followed by the piece index of the member's shard (piece_hashes)."""

    node: bytes
    group: str
    size: int
    index: int
    shard: bytes
    avg: bytes
    final: bytes
    state: bytes
    length: int
    addr: Address | None = None

    def encode(self) -> bytes:
        return msgpack.packb({"g": self.group, "n": self.size, "i": self.index, "s": self.shard, "a": self.avg,
                              "f": self.final, "t": self.state, "l": self.length,
                              "d": list(self.addr) if self.addr else None}, use_bin_type=True)

    @classmethod
    def decode(cls, node: bytes, value: bytes) -> OuterRecord | None:
        """None for anything that is not a well-formed record (DHT values are untrusted input)."""
        try:
            v = msgpack.unpackb(value, raw=False, max_bin_len=64, max_str_len=64, max_array_len=4, max_map_len=16)
            addr = v["d"]
            if addr is not None:
                host, port = addr
                if not valid_addr(host, port):
                    return None
                addr = (host, port)
            rec = cls(node, v["g"], v["n"], v["i"], v["s"], v["a"], v["f"], v["t"], v["l"], addr)
        except Exception:
            return None
        ok = (isinstance(rec.group, str) and len(rec.group) <= 16 and type(rec.size) is int
              and 1 <= rec.size <= MAX_GROUP and type(rec.index) is int and 0 <= rec.index < rec.size
              and all(isinstance(h, bytes) and len(h) == SHA for h in (rec.shard, rec.avg))
              and isinstance(rec.final, bytes) and len(rec.final) in (0, SHA)
              and isinstance(rec.state, bytes) and len(rec.state) in (0, SHA)
              and type(rec.length) is int and 1 <= rec.length <= MAX_LENGTH)
        return rec if ok else None


def valid_addr(host: object, port: object) -> bool:
    """Whether a record's fetch address is one: an IP literal (no name to resolve) and a port in 1..65535."""
    if not isinstance(host, str) or not 1 <= len(host) <= MAX_HOST or type(port) is not int or not 1 <= port <= 65535:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not (ip.is_unspecified or ip.is_multicast)


def shard_bounds(length: int, n: int, j: int) -> tuple[int, int]:
    """Member j's shard of a group of n (peerd.allreduce.shards.Layout.shard: boundaries every member derives)."""
    return (j * length) // n, ((j + 1) * length) // n


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def piece_hashes(shard: bytes | bytearray | memoryview) -> bytes:
    """The owner's index of its shard: a PIECE_HASH-byte prefix of the SHA-256 of every PIECE bytes, so that a
    member fetches only the pieces it holds other bytes of (the whole shard's hash still checks the result)."""
    view = memoryview(shard)
    return b"".join(sha256(view[i: i + PIECE])[:PIECE_HASH] for i in range(0, len(view), PIECE))


def differing_runs(mine: bytes | bytearray | memoryview, index: bytes) -> list[tuple[int, int]]:
    """(offset, length) in bytes of the runs of pieces of ``mine`` whose hash is not the one in ``index``."""
    view = memoryview(mine)
    runs: list[tuple[int, int]] = []
    for n, i in enumerate(range(0, len(view), PIECE)):
        if sha256(view[i: i + PIECE])[:PIECE_HASH] == index[n * PIECE_HASH: (n + 1) * PIECE_HASH]:
            continue
        stop = min(len(view), i + PIECE)
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], stop - runs[-1][0])
        else:
            runs.append((i, stop - i))
    return runs


async def fetch_shard(board: Board, owner: OuterRecord, mine: memoryview,
                      vector_bytes: int) -> tuple[bytes, int] | None:
    """The owner's shard (its bytes, and how many were fetched), verified against its published hash, or None
    when what it serves does not verify. Reads the owner's piece index first (kept after its vector in the
    blob ``owner.avg``) and fetches only the runs of pieces that differ, all at once; if the result does not
    verify (the index lied, or the blob is not what the record says), the whole shard once."""
    start, stop = shard_bounds(owner.length, owner.size, owner.index)
    a, b = 4 * start, 4 * stop
    pieces = -(-(b - a) // PIECE)
    index = await board.fetch_range(owner, owner.avg, vector_bytes, pieces * PIECE_HASH)
    fetched = len(index)
    if len(index) == pieces * PIECE_HASH:
        runs = differing_runs(mine, index)
        got = bytearray(mine)
        parts: dict[int, bytes] = {}

        async def one(off: int, n: int) -> None:
            parts[off] = await board.fetch_range(owner, owner.avg, a + off, n)

        async with trio.open_nursery() as nursery:
            for off, n in runs:
                nursery.start_soon(one, off, n)
        for off, n in runs:
            if len(parts[off]) != n:
                break
            got[off: off + n] = parts[off]
            fetched += n
        if sha256(got) == owner.shard:
            return bytes(got), fetched
    whole = await board.fetch_range(owner, owner.avg, a, b - a)
    if sha256(whole) != owner.shard:
        return None
    return whole, fetched + len(whole)


def owner_record(me: OuterRecord, k: int, records: list[OuterRecord],
                 members: list[bytes] | None) -> OuterRecord | None:
    """The record of shard k's owner in my group: the one published by ``members[k]`` (the group's k-th member
    as the averaging round knows it) that names my group, size, length and index k; None when there is none
    (a record that only claims index k owns nothing)."""
    if not me.group or not members or len(members) != me.size or not 0 <= k < me.size:
        return None
    for r in records:
        if r.node == members[k] and r.node != me.node and r.group == me.group and r.size == me.size \
                and r.length == me.length and r.index == k:
            return r
    return None


def repairs(data: bytes | bytearray, me: OuterRecord, records: list[OuterRecord],
            members: list[bytes] | None) -> list[OuterRecord]:
    """The owners in my group whose shard I hold other bytes of (so I must fetch it from them)."""
    out = []
    for k in range(me.size):
        r = owner_record(me, k, records, members)
        if r is None:
            continue
        start, stop = shard_bounds(me.length, me.size, k)
        if stop > start and sha256(memoryview(data)[4 * start: 4 * stop]) != r.shard:
            out.append(r)
    return out


def winner(records: list[OuterRecord]) -> bytes | None:
    """The final hash the swarm converges on: held by the most members, then from the largest group, then
    the lowest hash (any total order that every member computes alike from the same records)."""
    holders: dict[bytes, list[OuterRecord]] = {}
    for r in records:
        if r.final:
            holders.setdefault(r.final, []).append(r)
    if not holders:
        return None
    return min(holders, key=lambda h: (-len(holders[h]), -max(r.size for r in holders[h]), h))


def agreed(me: OuterRecord, records: list[OuterRecord], *, patient: bool = True, expect: int = 1) -> bool:
    """Whether this member may end the step: it holds the winning final, and either a strict majority of the
    round's members (``expect``, this one included, or the members read if more) hold it, so no other final
    can ever win and the rest adopt it, or (``patient``: until half the deadline) every member it has read has
    published the same final. After that, a member that never publishes a final (dead) is no longer waited
    for, but this member's final must be held by a strict majority of the members read, pending ones counted
    against it: a member that left its group (or found none) must not leave with its own vector while the
    group is still repairing. ``records``: the round's known participants' only."""
    others = [r for r in records if r.node != me.node]
    if winner([*others, me]) != me.final:
        return False
    same = 1 + sum(r.final == me.final for r in others)
    if 2 * same > max(expect, 1 + len(others)):
        return True
    if patient:
        return 1 + len(others) >= expect and same == 1 + len(others)
    return 2 * same > 1 + len(others)


class Board(Protocol):
    """Where a round's records are published and read, and blobs kept and fetched (DHT + state sync)."""

    def keep(self, blob: bytes) -> bytes: ...
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


def merged(read: list[OuterRecord], pushed: list[OuterRecord]) -> list[OuterRecord]:
    """One record per node from what was read and what was pushed: the pushed one (it is usually the newer)
    unless only the read one holds a final."""
    out = {r.node: r for r in read}
    for r in pushed:
        old = out.get(r.node)
        if old is None or r.final or not old.final:
            out[r.node] = r
    return list(out.values())


@dataclass
class Agreement:
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


class Backoff:
    """Waits between reads of a phase: POLL_FIRST_S, growing by half each time up to POLL_S (a phase usually
    ends within a few round trips, and a long wait should not read the DHT more often than POLL_S)."""

    def __init__(self) -> None:
        self.wait = POLL_FIRST_S

    def next(self) -> float:
        wait, self.wait = self.wait, min(POLL_S, self.wait * 1.5)
        return wait


Participants = Callable[[], Awaitable[frozenset[bytes]]]


async def agree(board: Board, node: bytes, vector: np.ndarray, *, group: str, size: int, index: int,
                state: bytes, repair_s: float, deadline_s: float, addr: Address | None = None,
                members: list[bytes] | None = None, expect: int = 1,
                participants: frozenset[bytes] | None = None, refresh: Participants | None = None,
                refresh_first: bool = False, clock: Callable[[], float] = trio.current_time) -> Agreement:
    """Run both phases (module docstring) for this member's averaged ``vector``; raises OuterError.
    ``members``: the group's node ids in its order: shard k is repaired only from ``members[k]``'s record
    (without them nothing is repaired), and an owner whose record names another group (it left the group, or
    never knew it formed) is not waited for. ``expect``: how many members the round has (e.g. the peers
    matchmaking saw): a member that averaged alone waits for them rather than end alone. ``participants``:
    the node ids whose records count in the agreement (``members`` and this node always do; None: every
    record counts); ``refresh`` re-reads them (at most every REFRESH_S) while records of others show up.
    ``refresh_first``: ``refresh`` also runs once from the start, while the repair runs (a DHT read is not
    waited for before it); what it reads joins ``participants`` and raises ``expect`` to its number (at most
    MAX_GROUP) before the swarm phase, which waits for that first read."""
    failed: Exception | None = None
    async with trio.open_nursery() as nursery:
        publisher = _Publisher(board, nursery)
        reader = _Reader(board)
        first = _FirstRead(refresh if refresh_first else None)
        nursery.start_soon(publisher.run)
        nursery.start_soon(reader.run)
        nursery.start_soon(first.run)
        try:
            out = await _agree(publisher.put, reader, board, node, vector, group=group, size=size, index=index,
                               state=state, repair_s=repair_s, deadline_s=deadline_s, addr=addr, members=members,
                               expect=expect, participants=participants, refresh=refresh, first=first,
                               clock=clock)
        except Exception as e:  # raised as itself, not in the nursery's exception group
            failed = e
        finally:
            reader.stop()
            publisher.close()  # the last record still goes out before agree returns
    if failed is not None:
        raise failed
    return out


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


class _FirstRead:
    """The round's participants as first read (``refresh``), run beside the repair phase."""

    def __init__(self, refresh: Participants | None) -> None:
        self.refresh = refresh
        self.ids: frozenset[bytes] = frozenset()
        self.done = trio.Event()
        if refresh is None:
            self.done.set()

    async def run(self) -> None:
        if self.refresh is None:
            return
        try:
            self.ids = await self.refresh()
        except Exception as e:  # the agreement runs on the participants it has
            log.info("outer agreement: reading the round's participants failed: %s", e)
        finally:
            self.done.set()


class _Reader:
    """The round's records as this member knows them: the board's latest read, run in the background (a DHT
    read costs round trips, seconds under loss), merged with the records pushed to this node (PushBoard),
    which count the moment they arrive. ``version`` grows with every change; ``wait`` returns on the next.
    Reads are numbered as they start: a phase counts only reads that started after it began (``hurry``), so
    that it never decides on what others had published before (a member's final replaces its earlier record)."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.pushes = board if isinstance(board, PushBoard) else None
        self.read_records: list[OuterRecord] = []
        self.read_no = 0  # the number of the read that read_records come from
        self.started = 0  # reads started
        self.version = 0
        self.reads = 0  # reads of the board that returned
        self.poll = Backoff()
        self._event = trio.Event()
        self._scope = trio.CancelScope()
        self._step: trio.CancelScope | None = None
        self._unlisten = self.pushes.listen(self.poke) if self.pushes is not None else None

    def poke(self) -> None:
        """Something changed (a read returned, a record was pushed, a fetch ended): wake the waiter."""
        self.version += 1
        self._event.set()
        self._event = trio.Event()

    def view(self, since: int = 0) -> list[OuterRecord]:
        """The records known now: pushed ones, and those of the latest read if it is read ``since`` or later."""
        read = self.read_records if self.read_no >= since else []
        return merged(read, self.pushes.pushed() if self.pushes is not None else [])

    async def wait(self, version: int, timeout: float) -> None:
        """Until something changed after ``version`` was seen, ``timeout`` at most."""
        if self.version != version:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(timeout):
            await self._event.wait()

    def hurry(self) -> int:
        """A new phase: a read starts now (the one in flight, or the wait before the next, is dropped) and the
        next ones come soon again (what it waits for is usually a moment away). Returns that read's number."""
        self.poll = Backoff()
        if self._step is not None:
            self._step.cancel()
        return self.started + 1

    def stop(self) -> None:
        self._scope.cancel()
        if self._unlisten is not None:
            self._unlisten()

    async def run(self) -> None:
        with self._scope:
            while True:
                with trio.CancelScope() as self._step:
                    self.started += 1
                    number = self.started
                    try:
                        got: list[OuterRecord] | None = await self.board.read()
                    except Exception as e:  # the next read, or the pushed records, settle it
                        log.info("outer agreement: reading the round's records failed: %s", e)
                        got = None
                    if got is not None:
                        self.read_records, self.read_no = got, number
                        self.reads += 1
                        self.poke()
                    await trio.sleep(self.poll.next())
                self._step = None


async def _agree(publish: Callable[[OuterRecord], None], reader: _Reader, board: Board, node: bytes,
                 vector: np.ndarray, *,
                 group: str, size: int, index: int, state: bytes, repair_s: float, deadline_s: float,
                 addr: Address | None = None, members: list[bytes] | None = None, expect: int = 1,
                 participants: frozenset[bytes] | None = None, refresh: Participants | None = None,
                 first: _FirstRead | None = None, clock: Callable[[], float] = trio.current_time) -> Agreement:
    """agree's body; ``publish`` hands a record to the background publisher, ``reader`` holds the records."""
    if not group:  # alone: a group of one owns every shard
        size, index, members = 1, 0, None
    if members is not None and (len(members) != size or not 0 <= index < size or members[index] != node):
        members = None  # not this group's order: no owner is known
    owners = members or []
    data = bytearray(np.ascontiguousarray(vector, dtype=np.float32).tobytes())
    length = len(data) // 4
    start, stop = shard_bounds(length, size, index)
    avg = board.keep(bytes(data) + piece_hashes(memoryview(data)[4 * start: 4 * stop]))
    me = OuterRecord(node, group, size, index, sha256(memoryview(data)[4 * start: 4 * stop]), avg, b"", state,
                     length, addr)
    t0 = clock()
    publish(me)
    seen_all: float | None = None  # when every owner's record had been read
    out = Agreement(vector, b"")
    # 1. every shard from its owner (an owner that never publishes leaves its shard as it is)
    done: set[int] = {index} if members else set(range(size))
    settled_at: float | None = None  # when every owner that had published was settled
    tries: dict[int, int] = {}  # failed fetches of a shard
    inflight: set[int] = set()  # shards being fetched
    changed = trio.Event()  # a fetch ended

    async def repair(k: int, r: OuterRecord) -> None:
        try:
            await repair_once(k, r)
        finally:
            inflight.discard(k)
            changed.set()
            reader.poke()

    async def repair_once(k: int, r: OuterRecord) -> None:
        a, b = shard_bounds(length, size, k)
        try:
            got = await fetch_shard(board, r, memoryview(data)[4 * a: 4 * b], 4 * length)
        except Exception as e:  # the owner went away or lost the blob: the swarm phase settles it
            log.info("outer repair: shard %d from %s failed: %s", k, r.node.hex()[:12], e)
            got = None
        if got is not None:
            data[4 * a: 4 * b] = got[0]
            out.repaired_bytes += got[1]
            done.add(k)
            return
        tries[k] = tries.get(k, 0) + 1
        if tries[k] >= REPAIR_TRIES:
            done.add(k)  # its owner cannot or will not serve it: the swarm phase settles it

    with trio.move_on_after(max(0.0, repair_s)):
        # each shard is fetched as soon as its owner's record is read, while the others are still awaited
        async with trio.open_nursery() as fetches:
            while len(done) < size:
                if inflight and all(k in done or k in inflight for k in range(size)):
                    await changed.wait()  # nothing left to read for: wait for a fetch to end
                    changed = trio.Event()
                    continue
                seen = reader.version
                records = reader.view()
                todo: list[tuple[int, OuterRecord]] = []
                for k in range(size):
                    if k in done or k in inflight:
                        continue
                    mine = [r for r in records if r.node == owners[k]]
                    if any(r.group != group for r in mine):
                        done.add(k)  # its own account has it outside the group: nothing to fetch
                        continue
                    r = owner_record(me, k, records, members)
                    if r is None:
                        continue  # not published yet
                    if r not in repairs(data, me, [r], members):
                        done.add(k)
                    else:
                        todo.append((k, r))
                if seen_all is None and all(k in done or owner_record(me, k, records, members)
                                            for k in range(size)):
                    seen_all = clock()
                for k, r in todo:
                    inflight.add(k)
                    fetches.start_soon(repair, k, r)
                if todo or inflight:
                    settled_at = None
                elif len(done) == size:
                    break
                elif settled_at is None:
                    settled_at = clock()
                elif clock() - settled_at >= OWNER_GRACE_S:
                    break  # the owners left have published nothing: their shards stay as they are
                await reader.wait(seen, POLL_S)
    t_repaired = clock()
    out.phases["repair"] = t_repaired - t0
    log.info("outer repair: every owner read after %s s, done after %.3f s, %d bytes fetched",
             "-" if seen_all is None else f"{seen_all - t0:.3f}", t_repaired - t0, out.repaired_bytes)
    # 2. one final across the swarm
    if first is not None and first.refresh is not None:
        await first.done.wait()
        participants = (participants or frozenset()) | first.ids
        expect = max(expect, min(MAX_GROUP, len(first.ids)))
    known = None if participants is None else frozenset(participants) | frozenset(members or ()) | {node}
    refreshed = clock()
    final = board.keep(bytes(data))
    me = replace(me, final=final)
    publish(me)
    fresh = reader.hurry()  # what was read before this member's final is not what the others hold now
    last_view: list[OuterRecord] = []
    while True:
        seen = reader.version
        read = [r for r in reader.view(fresh) if r.length == length and r.node != node]
        if known is not None and refresh is not None and any(r.node not in known for r in read) \
                and clock() - refreshed >= REFRESH_S:
            refreshed = clock()
            try:
                known = known | await refresh()
            except Exception as e:  # what is known stays known
                log.info("outer agreement: re-reading the round's participants failed: %s", e)
        records = read if known is None else [r for r in read if r.node in known]
        out.ignored = len(read) - len(records)
        last_view = records
        win = winner([*records, me])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("outer %s: mine %s, winner %s, read %s", node.hex()[:6], me.final.hex()[:8],
                      win.hex()[:8] if win else None, [(r.node.hex()[:6], r.final.hex()[:8], r.group) for r in records])
        if win is not None and win != me.final:
            holders = [r for r in records if r.final == win]
            try:
                got = await board.fetch(win, len(data), holders)
            except Exception as e:
                log.info("outer agreement: fetching the winning average %s failed: %s", win.hex()[:12], e)
            else:
                if sha256(got) == win:
                    data = bytearray(got)
                    out.adopted_bytes += len(got)
                    out.adopted = True
                    board.keep(bytes(data))
                    me = replace(me, final=win)
                    publish(me)
                    continue
        settled = bool(group) or clock() - t0 >= ALONE_SETTLE_S  # alone: give the others time to publish
        if settled and agreed(me, records, patient=clock() - t0 < deadline_s / 2, expect=max(expect, size)):
            break
        if clock() - t0 > deadline_s:
            finals = sorted({r.final.hex()[:12] for r in records if r.final} | {me.final.hex()[:12]})
            raise OuterError(f"the outer average did not agree within {deadline_s:.0f} s: finals {finals} "
                             f"({len(records) + 1} members read)")
        await reader.wait(seen, POLL_S)
    out.phases["agree"] = clock() - t_repaired
    out.pushed = len(reader.pushes.pushed()) if reader.pushes is not None else 0
    out.reads = reader.reads
    out.vector = np.frombuffer(bytes(data), dtype=np.float32).copy()
    out.final = me.final
    same = [r for r in last_view if r.final == me.final]
    out.members = 1 + len(same)
    out.dissent = sum(1 for r in last_view if r.final != me.final)
    counts: dict[bytes, int] = {}
    for r in [*same, me]:
        if r.state:
            counts[r.state] = counts.get(r.state, 0) + 1
    if counts:
        out.state_winner = min(counts, key=lambda h: (-counts[h], h))
        out.states = counts.get(state, 0)
    return out


def record_key(run_key: str, round_no: int) -> bytes:
    """The DHT key of an outer round's records (subkeys: the members' node ids)."""
    return f"peerd/outer/{run_key}/{round_no}".encode()


def store_key(run_key: str, round_no: int) -> str:
    """The state-sync key an outer round's blobs are kept under (STATE_GET names it)."""
    return f"{run_key}/o{round_no}"


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

    def keep(self, blob: bytes) -> bytes:
        return self.sync.keep(self.store, blob)  # type: ignore[attr-defined]

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

    async def fetch_range(self, holder: OuterRecord, sha: bytes, offset: int, length: int) -> bytes:
        """The range in one request per chunk, up to FETCH_WINDOW of this board's requests in flight (one at a
        time, a range costs a round trip per chunk: seconds for a shard on a lossy link)."""
        from ..statesync.service import CHUNK_OVERHEAD
        from ..wire import messages as m

        addr = await self._addr(holder)
        chunk = max(1, min(m.MAX_CHUNK, self.sync.endpoint.max_body - CHUNK_OVERHEAD))  # type: ignore[attr-defined]
        offsets = iter(range(offset, offset + length, chunk))
        out = bytearray(length)

        async def worker() -> None:
            for off in offsets:  # shared by the workers: each chunk is taken once
                n = min(chunk, offset + length - off)
                async with self.window:
                    got = await self.sync.fetch_range(addr, self.store, sha, off, n)  # type: ignore[attr-defined]
                if len(got) != n:
                    raise OuterError(f"{holder.node.hex()[:12]} sent {len(got)} bytes of {n}")
                out[off - offset: off - offset + n] = got

        async with trio.open_nursery() as nursery:
            for _ in range(min(FETCH_WINDOW, -(-length // chunk))):
                nursery.start_soon(worker)
        return bytes(out)

    async def fetch(self, sha: bytes, size: int, holders: list[OuterRecord]) -> bytes | bytearray:
        addrs = []
        for h in holders[:16]:
            try:
                addrs.append(await self._addr(h))
            except OuterError:
                continue
        return await self.sync.download(self.store, sha, size, addrs)  # type: ignore[attr-defined]
