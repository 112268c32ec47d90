"""Outer records pushed to the group (OUTER_RECORD): agreement without DHT reads, and what a pusher cannot do.

Real endpoints over the in-memory network (virtual time); the boards' DHT reads never return, so whatever
the members agree on came from pushed records (and state sync's fetches for the repair).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgpack
import numpy as np
import trio

from peerd.trainer.inbox import MAX_ROUNDS, MAX_SENDERS, OuterInbox
from peerd.trainer.outer import DhtBoard, agree
from peerd.trainer.records import OuterRecord, shard_bounds
from peerd.wire import messages as m

RUN_KEY = "run/0123456789abcdef"


class _Rto:
    def __init__(self, srtt: Callable[[object], float | None]) -> None:
        self.srtt = srtt


class BoardSync:
    """The state sync a DhtBoard fetches through, as these tests fake it: node 1, no advert, 1100-byte bodies and
    the round trips ``srtt`` gives; a test's subclass answers ``fetch_range``."""

    node_id = b"\x01" * 32
    advertise = None

    def __init__(self, srtt: Callable[[object], float | None]) -> None:
        self.endpoint = type("E", (), {"max_body": 1100, "rto": _Rto(srtt)})()

    async def resolve(self, node: bytes, addr: object) -> object:
        return addr


class _NoReadBoard(DhtBoard):
    """A daemon's board whose DHT reads never return (a DHT under heavy loss, at its worst)."""

    reads = 0

    async def read(self) -> list[OuterRecord]:
        type(self).reads += 1
        await trio.sleep_forever()
        return []


async def _swarm_with_inboxes(nursery, net, count):
    from .support.diloco import _swarm

    nodes = await _swarm(nursery, net, count)
    for n in nodes:
        n.inbox = OuterInbox(lambda run_key: run_key == RUN_KEY)
        n.inbox.register(n.endpoint)
    return nodes


async def _agree_all(nodes, held, round_no, results, *, participants=None, board=_NoReadBoard) -> None:
    """Every node of ``nodes`` agrees on ``round_no`` at once (its vector: ``held``); each result into ``results``."""
    ids = [n.identity.node_id for n in nodes]

    async def one(i: int) -> None:
        node = nodes[i]
        b = board(node.sync, RUN_KEY, round_no, inbox=node.inbox, peers=ids)
        t0 = trio.current_time()
        results[i] = await agree(b, node.identity.node_id, held[i].copy(), group="00c0ffee", size=len(nodes),
                                 index=i, state=b"", repair_s=30, deadline_s=60, addr=node.addr, members=ids,
                                 expect=len(nodes), participants=participants)
        results[i].phases["total"] = trio.current_time() - t0

    async with trio.open_nursery() as inner:
        for i in range(len(nodes)):
            inner.start_soon(one, i)


def test_a_group_agrees_on_pushed_records_without_a_dht_read() -> None:
    from .support.diloco import _lossy_copies
    from .support.memnet import MemNet
    from .support.virtual import run_virtual

    truth = np.random.default_rng(11).standard_normal(12_000).astype(np.float32)
    held = _lossy_copies(truth, 3, np.random.default_rng(12))
    _NoReadBoard.reads = 0

    async def main() -> None:
        net = MemNet(seed=3)
        results: dict[int, object] = {}
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = await _swarm_with_inboxes(nursery, net, 3)
            await _agree_all(nodes, held, 21, results)
            nursery.cancel_scope.cancel()
        for i in range(3):
            np.testing.assert_array_equal(results[i].vector, truth)
            assert results[i].final == hashlib.sha256(truth.tobytes()).digest()
            assert results[i].repaired_bytes > 0  # the owners' records came by push, their shards by state sync
            assert results[i].members == 3
            assert results[i].pushed == 2 and results[i].reads == 0
            # woken by each record as it arrives: a few network round trips, no polling of a DHT
            assert results[i].phases["total"] < 0.5, results[i].phases
        assert _NoReadBoard.reads >= 3  # every member started a read; none ever returned

    run_virtual(main)


def test_a_pushed_record_counts_as_its_senders_only_hostile() -> None:
    """A member of the swarm (not of the round) pushes records to the group's members that name the owner of
    shard 0 in the body and carry a forged shard and final: the receivers attribute them to the pusher, so
    they neither repair shard 0 nor count in the agreement."""
    from .support.diloco import _lossy_copies
    from .support.memnet import MemNet
    from .support.virtual import run_virtual

    truth = np.random.default_rng(13).standard_normal(9_000).astype(np.float32)
    held = _lossy_copies(truth, 3, np.random.default_rng(14))
    forged = truth.copy()
    a, b = shard_bounds(truth.size, 3, 0)
    forged[a:b] = 1e6

    async def main() -> None:
        net = MemNet(seed=4)
        results: dict[int, object] = {}
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = await _swarm_with_inboxes(nursery, net, 4)
            members, attacker = nodes[:3], nodes[3]
            ids = [n.identity.node_id for n in members]
            data = forged.tobytes()
            shard_sha = hashlib.sha256(data[4 * a: 4 * b]).digest()
            avg = attacker.sync.keep(f"{RUN_KEY}/o22", data)
            fin = hashlib.sha256(data).digest()
            body = {"node": ids[0], "g": "00c0ffee", "n": 3, "i": 0, "s": shard_sha, "a": avg, "f": fin, "t": b"",
                    "l": truth.size, "d": list(attacker.addr)}
            for seq in (1, 2, 3):  # as many as it likes: one slot, its own
                for n in members:
                    reply = await attacker.endpoint.request(n.addr, m.MsgType.OUTER_RECORD, {
                        "run": RUN_KEY.encode(), "round": 22, "seq": seq,
                        "record": msgpack.packb(body, use_bin_type=True)}, node_id=n.identity.node_id)
                    assert reply.body["ok"]
            for n in members:
                held_records = n.inbox.records(RUN_KEY, 22)
                assert [r.node for r in held_records] == [attacker.identity.node_id]  # never ids[0]
            await _agree_all(members, held, 22, results, participants=frozenset(ids))
            nursery.cancel_scope.cancel()
        for i in range(3):
            np.testing.assert_array_equal(results[i].vector, truth)
            assert results[i].final == hashlib.sha256(truth.tobytes()).digest()
            assert results[i].ignored == 1  # the pusher's record, read and not counted

    run_virtual(main)


def _record(final: bytes = b"") -> bytes:
    return OuterRecord(b"", "g", 2, 0, b"s" * 32, b"a" * 32, final, b"", 100).encode()


def test_the_inbox_is_bounded_and_keeps_one_record_per_sender_hostile() -> None:
    inbox = OuterInbox(lambda run_key: run_key == RUN_KEY)
    sender = b"x" * 32
    assert not inbox.put("other/run", 1, sender, 1, _record())  # a run this daemon does not train
    assert not inbox.put(RUN_KEY, 1, sender, 1, b"\x81\xa1g\xa1g")  # not a record
    assert not inbox.put(RUN_KEY, 1, sender, 1, msgpack.packb({"g": "g" * 100}))
    assert inbox.records("other/run", 1) == [] and inbox.records(RUN_KEY, 1) == []
    woken = []
    stop = inbox.listen(RUN_KEY, 1, lambda: woken.append(1))
    assert inbox.put(RUN_KEY, 1, sender, 2, _record(b"f" * 32))
    assert inbox.put(RUN_KEY, 1, sender, 2, _record(b"f" * 32))  # a retransmission
    assert not inbox.put(RUN_KEY, 1, sender, 1, _record())  # older: the newer one stays
    assert [r.final for r in inbox.records(RUN_KEY, 1)] == [b"f" * 32]
    assert [r.node for r in inbox.records(RUN_KEY, 1)] == [sender]
    assert woken == [1]
    for i in range(MAX_SENDERS + 10):
        inbox.put(RUN_KEY, 1, i.to_bytes(32, "big"), 1, _record())
    assert len(inbox.records(RUN_KEY, 1)) == MAX_SENDERS
    for r in range(2, 2 + 4 * MAX_ROUNDS):  # many rounds: the oldest go, never the one being waited on
        inbox.put(RUN_KEY, r, sender, 1, _record())
    assert len(inbox._slots) <= MAX_ROUNDS + 1
    assert len(inbox.records(RUN_KEY, 1)) == MAX_SENDERS
    stop()
    inbox.put(RUN_KEY, 999, sender, 1, _record())
    assert inbox.records(RUN_KEY, 1) == []


def test_repair_requests_retransmit_after_a_few_round_trips() -> None:
    """A repair range is asked with a first wait of a few round trips to the owner (floored, and capped at the
    default while the round trip is unknown), so a lost datagram does not cost the transport's backed-off RTO."""
    from peerd.trainer.outer import FETCH_MIN_WAIT_S, FETCH_TIMEOUT_S, fetch_timeout

    assert fetch_timeout(None) == FETCH_TIMEOUT_S
    assert fetch_timeout(0.0005) == FETCH_MIN_WAIT_S
    assert fetch_timeout(0.01) == 0.04
    assert fetch_timeout(5.0) == FETCH_TIMEOUT_S

    asked: list[tuple[int, int, float, int]] = []

    def srtt(addr: object) -> float | None:
        return 0.01 if addr == ("10.0.0.2", 9) else None

    class Sync(BoardSync):
        async def fetch_range(self, addr: object, store: str, sha: bytes, off: int, n: int, *, timeout: float,
                              attempts: int) -> bytes:
            asked.append((off, n, timeout, attempts))
            return bytes(n)

    board = DhtBoard(Sync(srtt), "run", 3)
    holder = OuterRecord(b"\x02" * 32, "g", 2, 1, b"\x00" * 32, b"\x00" * 32, b"", b"", 1000, ("10.0.0.2", 9))
    got = trio.run(board.fetch_range, holder, b"\x00" * 32, 100, 2000)
    assert got == bytes(2000)
    assert sum(n for _, n, _, _ in asked) == 2000 and len(asked) > 1
    assert {(t, a) for _, _, t, a in asked} == {(0.04, 1)}  # each request waits a few round trips, then afresh

    # a chunk whose requests go unanswered is asked again at the same wait FETCH_FLAT times, then backing off
    from peerd.trainer.outer import FETCH_FLAT
    from peerd.transport.endpoint import RpcError

    waits: list[float] = []

    class Lossy(Sync):
        async def fetch_range(self, addr: object, store: str, sha: bytes, off: int, n: int, *, timeout: float,
                              attempts: int) -> bytes:
            waits.append(timeout)
            if len(waits) < 6:
                raise RpcError("no answer from 10.0.0.2:9 to state_get")
            return bytes(n)

    got = trio.run(DhtBoard(Lossy(srtt), "run", 3).fetch_range, holder, b"\x00" * 32, 0, 100)
    assert got == bytes(100)
    assert waits == [0.04] * FETCH_FLAT + [0.04 * 2 ** k for k in range(1, 7 - FETCH_FLAT)]

    class Refusing(Sync):
        async def fetch_range(self, *a: object, **k: object) -> bytes:
            waits.append(-1.0)
            raise RpcError("10.0.0.2:9 refused state_get: gone")

    waits.clear()
    refused = False
    try:
        trio.run(DhtBoard(Refusing(srtt), "run", 3).fetch_range, holder, b"\x00" * 32, 0, 100)
    except* RpcError:
        refused = True
    assert refused and waits == [-1.0]  # a refusal is not asked again


def test_a_repair_request_to_an_owner_without_a_round_trip_waits_the_swarms_not_the_default() -> None:
    """Before the owner's first round-trip sample (its record arrives before this member's push is answered), a
    lost repair request is asked again after a few of the round's peers' round trips, not FETCH_TIMEOUT_S."""
    from peerd.trainer.outer import FETCH_TIMEOUT_S, fetch_timeout

    owner, peer, me = b"\x02" * 32, b"\x03" * 32, b"\x01" * 32
    where = {owner: ("10.0.0.2", 9), peer: ("10.0.0.3", 9)}
    srtts: dict[object, float] = {}

    sync = BoardSync(srtts.get)
    sync.endpoint.addr_of = where.get
    assert sync.node_id == me
    board = DhtBoard(sync, "run", 3, peers=[me, owner, peer])
    assert board._srtt(where[owner]) is None  # nothing known: the default wait
    assert fetch_timeout(board._srtt(where[owner])) == FETCH_TIMEOUT_S
    srtts[where[peer]] = 0.01
    assert board._srtt(where[owner]) == 0.01  # the round's known round trip stands in
    srtts[where[owner]] = 0.002
    assert board._srtt(where[owner]) == 0.002  # the owner's own, once sampled


def test_the_winning_average_is_fetched_windowed_from_every_holder_and_verified_hostile() -> None:
    """Adopting the winner fetches its chunks spread over the holders with many requests in flight; a chunk that
    one holder refuses comes from the next, and bytes that do not hash to the winner are refused."""
    import pytest

    from peerd.trainer.outer import FETCH_WINDOW, OuterError
    from peerd.transport.endpoint import RpcError

    vector = np.random.default_rng(3).standard_normal(5_000).astype(np.float32).tobytes()
    sha = hashlib.sha256(vector).digest()
    good, mute, liar = ("10.0.0.2", 9), ("10.0.0.3", 9), ("10.0.0.4", 9)
    asked: list[tuple[object, int]] = []
    inflight = [0, 0]

    class Sync(BoardSync):
        async def fetch_range(self, addr: object, store: str, want: bytes, off: int, n: int, *, timeout: float,
                              attempts: int) -> bytes:
            asked.append((addr, off))
            inflight[0] += 1
            inflight[1] = max(inflight)
            await trio.sleep(0.01)
            inflight[0] -= 1
            if addr == mute:
                raise RpcError("refused: gone")
            if addr == liar:
                return bytes(n)
            return vector[off: off + n]

    def holder(addr: tuple[str, int], k: int) -> OuterRecord:
        return OuterRecord(bytes([k]) * 32, "g", 2, 0, b"\x00" * 32, b"\x00" * 32, sha, b"", 5_000, addr)

    board = DhtBoard(Sync(lambda addr: 0.01), "run", 3)
    got = trio.run(board.fetch, sha, len(vector), [holder(good, 2), holder(mute, 3)])
    assert bytes(got) == vector
    assert {a for a, _ in asked} == {good, mute}  # spread over both; the mute one's chunks came from the other
    assert 1 < inflight[1] <= FETCH_WINDOW
    with pytest.raises(OuterError, match="do not match"):
        trio.run(board.fetch, sha, len(vector), [holder(liar, 4)])


def test_a_shard_fetches_its_index_in_sections_and_only_the_differing_pieces_hostile() -> None:
    """The owner's piece index is read section by section, each section's differing pieces fetched as it arrives;
    an index that lies about its pieces still yields the owner's verified shard (fetched whole)."""
    from peerd.trainer.outer import INDEX_SECTION, fetch_shard
    from peerd.trainer.records import PIECE, PIECE_HASH, piece_hashes

    rng = np.random.default_rng(5)
    vector = rng.standard_normal(60_000).astype(np.float32)
    data = vector.tobytes()
    a, b = shard_bounds(vector.size, 2, 1)
    shard = data[4 * a: 4 * b]
    mine = bytearray(shard)
    for piece in (0, 3, 150, 151, 220):  # pieces in three sections of INDEX_SECTION
        mine[piece * PIECE + 7] ^= 0xFF
    blob = data + piece_hashes(shard)
    owner = OuterRecord(b"\x02" * 32, "g", 2, 1, hashlib.sha256(shard).digest(), hashlib.sha256(blob).digest(),
                        b"", b"", vector.size, ("10.0.0.2", 9))

    class Board:
        def __init__(self, blob: bytes) -> None:
            self.blob, self.asked = blob, []

        async def fetch_range(self, holder: OuterRecord, sha: bytes, offset: int, length: int) -> bytes:
            self.asked.append((offset, length))
            return self.blob[offset: offset + length]

    board = Board(blob)
    got = trio.run(fetch_shard, board, owner, bytes(mine), len(data))
    assert got is not None and got[0] == shard
    index_reads = [x for x in board.asked if x[0] >= len(data)]
    pieces = -(-len(shard) // PIECE)
    assert len(index_reads) == -(-pieces // INDEX_SECTION) == 3  # one read per section
    assert sum(n for _, n in index_reads) == pieces * PIECE_HASH
    runs = [x for x in board.asked if x[0] < len(data)]
    assert len(runs) == 4 and sum(n for _, n in runs) == 5 * PIECE  # pieces 150 and 151 are one run
    liar = Board(data + piece_hashes(bytes(mine)))  # the index says my bytes are the owner's: nothing fetched
    got = trio.run(fetch_shard, liar, owner, bytes(mine), len(data))
    assert got is not None and got[0] == shard and (4 * a, 4 * (b - a)) in liar.asked  # fetched whole, verified
