"""A hostile member against the DiLoCo outer agreement (peerd.trainer.outer), written from the attacks:

- a node outside the group publishes a record claiming shard 0 of the group with its own bytes and hash:
  no member may take those bytes (repairs of shard k come only from the group's k-th member);
- nodes that were not in the round publish a forged final under many ids: the members must not adopt it
  (only the round's known participants count);
- a group member publishes its record but never a final, or an owner publishes nothing: the step ends as
  soon as the rest agree, not after half its deadline (or the whole repair phase);
- a record whose fetch address is not an IP literal and port is refused when it is decoded;
- a DiLoCo run that asks for robust aggregation gets it on its outer averages.

The board is in memory (outer.Board: records and blobs in dicts), and time is virtual (trio's MockClock).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
import trio.testing

from peerd.trainer.outer import agree
from peerd.trainer.records import OuterRecord, piece_hashes, shard_bounds

from .support.virtual import sha  # noqa: E402


class Shared:
    """What the DHT and state sync hold for one outer round: each node's record (encoded, as the DHT keeps it)
    and the blobs each node keeps; reads return records in the order they were first published."""

    def __init__(self) -> None:
        self.records: dict[bytes, bytes] = {}
        self.blobs: dict[bytes, dict[bytes, bytes]] = {}
        self.fetched: dict[bytes, int] = {}  # bytes served, by holder


class MemBoard:
    def __init__(self, shared: Shared, node: bytes) -> None:
        self.shared, self.node = shared, node

    def keep(self, blob: bytes, given: bytes) -> bytes:
        h = sha(blob)
        assert given == h  # the core names every blob it keeps by its own hash
        self.shared.blobs.setdefault(self.node, {})[h] = blob
        return h

    async def publish(self, record: OuterRecord) -> None:
        self.shared.records[record.node] = record.encode()

    async def read(self) -> list[OuterRecord]:
        await trio.sleep(0.01)
        out = [OuterRecord.decode(node, value) for node, value in self.shared.records.items()]
        return [r for r in out if r is not None]

    async def fetch_range(self, holder: OuterRecord, h: bytes, offset: int, length: int) -> bytes:
        await trio.sleep(0.01)
        blob = self.shared.blobs.get(holder.node, {}).get(h)
        if blob is None:
            raise OSError("gone")
        self.shared.fetched[holder.node] = self.shared.fetched.get(holder.node, 0) + length
        return blob[offset: offset + length]

    async def fetch(self, h: bytes, size: int, holders: list[OuterRecord]) -> bytes:
        await trio.sleep(0.01)
        for r in holders:
            blob = self.shared.blobs.get(r.node, {}).get(h)
            if blob is not None:
                self.shared.fetched[r.node] = self.shared.fetched.get(r.node, 0) + len(blob)
                return blob[:size]
        raise OSError("gone")


def ids(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def lossy(truth: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    """Member i's view after a lossy all-gather: the truth in its own shard, some ranges of others' shards its own."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        v = truth.copy()
        for j in range(n):
            a, b = shard_bounds(truth.size, n, j)
            if j != i:
                for off in range(a, b, 300):
                    if rng.random() < 0.4:
                        v[off: min(b, off + 300)] = rng.standard_normal(min(b, off + 300) - off)
        out.append(v)
    return out


def run(main) -> Any:
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def agree_each(shared: Shared, members: list[bytes], vectors: list[np.ndarray], running: int | None = None,
                     **options: Any) -> tuple[dict[int, Any], dict[int, float]]:
    """The first ``running`` members (default: all) agree at once on the outer step of group "g" (every one of
    ``members``), each from a copy of its ``vectors[i]``: their results and the time each took, by index."""
    results: dict[int, Any] = {}
    took: dict[int, float] = {}
    size = len(members)

    async def one(i: int) -> None:
        t0 = trio.current_time()
        results[i] = await agree(MemBoard(shared, members[i]), members[i], vectors[i].copy(), group="g", size=size,
                                 index=i, state=b"", repair_s=30, deadline_s=60, members=members, expect=size,
                                 **options)
        took[i] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        for i in range(size if running is None else running):
            nursery.start_soon(one, i)
    return results, took


async def forge(shared: Shared, node: bytes, group: str, size: int, index: int, vector: np.ndarray,
                final: bool = True) -> bytes:
    """Publish a hostile record that claims shard ``index`` of ``group`` with ``vector``'s bytes (and its hash
    as the final when ``final``); returns the forged final."""
    board = MemBoard(shared, node)
    data = vector.astype(np.float32).tobytes()
    a, b = shard_bounds(vector.size, size, index)
    blob = data + piece_hashes(data[4 * a: 4 * b])
    avg = board.keep(blob, sha(blob))
    fin = board.keep(data, sha(data))
    rec = OuterRecord(node, group, size, index, sha(data[4 * a: 4 * b]), avg, fin if final else b"", b"",
                      vector.size, ("127.0.0.1", 9))
    await board.publish(rec)
    return fin


def test_a_non_member_cannot_repair_a_shard_hostile() -> None:
    """Before: any record with the group's id, size and length repaired shard ``index`` from its own bytes,
    checked only against its own hash; the honest members took 1e6 into shard 0 and agreed on it."""
    truth = np.random.default_rng(1).standard_normal(6_000).astype(np.float32)
    held = lossy(truth, 3, 2)
    members = ids(3)
    attacker = ids(1, tag=9)[0]
    forged = truth.copy()
    forged[slice(*shard_bounds(truth.size, 3, 0))] = 1e6

    async def main() -> tuple[dict[int, Any], dict[int, float]]:
        shared = Shared()
        await forge(shared, attacker, "g", 3, 0, forged)  # published first: read before the real owner's
        return await agree_each(shared, members, held)

    results, _ = run(main)
    for i in range(3):
        np.testing.assert_array_equal(results[i].vector, truth)
        assert results[i].final == sha(truth.tobytes())


def test_nodes_outside_the_round_cannot_outvote_it_hostile() -> None:
    """Before: every record counted in the vote on the final, so five ids that were never in the round,
    all naming one forged vector, outvoted the three members of the group, who adopted it."""
    truth = np.random.default_rng(3).standard_normal(3_000).astype(np.float32)
    members = ids(3)
    sybils = ids(5, tag=7)

    async def main() -> tuple[dict[int, Any], dict[int, float]]:
        shared = Shared()
        for s in sybils:
            await forge(shared, s, "other", 1, 0, np.full(truth.size, 1e6, np.float32))
        return await agree_each(shared, members, [truth] * 3, participants=frozenset(members))

    results, _ = run(main)
    for i in range(3):
        np.testing.assert_array_equal(results[i].vector, truth)
        assert not results[i].adopted and results[i].ignored == len(sybils)


def test_a_member_that_never_publishes_a_final_does_not_stall_the_step_hostile() -> None:
    """Before: a group member whose record had no final held every other member until half the deadline
    (30 s of a 60 s deadline here); the three others agree, a majority of the round: they end at once."""
    truth = np.random.default_rng(4).standard_normal(4_000).astype(np.float32)
    members = ids(4)

    async def main() -> tuple[dict[int, Any], dict[int, float]]:
        shared = Shared()
        await forge(shared, members[3], "g", 4, 3, truth, final=False)  # its shard is right; no final, ever
        return await agree_each(shared, members, [truth] * 4, running=3, participants=frozenset(members))

    results, took = run(main)
    assert {results[i].final for i in range(3)} == {sha(truth.tobytes())}
    assert max(took.values()) < 2.0, took


def test_an_owner_that_publishes_nothing_does_not_hold_the_repair_phase_hostile() -> None:
    """Before: an owner that never published a record held every member for the whole repair phase (30 s)."""
    truth = np.random.default_rng(5).standard_normal(4_000).astype(np.float32)
    members = ids(4)

    async def main() -> tuple[dict[int, Any], dict[int, float]]:
        return await agree_each(Shared(), members, [truth] * 4, running=3)

    _, took = run(main)
    assert max(took.values()) < 5.0, took


def test_an_owner_serving_bytes_that_do_not_verify_is_given_up_on_hostile() -> None:
    """An owner whose record names a shard hash that its blob never matches: members stop asking it after a
    few tries instead of fetching until the repair phase ends, and still agree among themselves."""
    truth = np.random.default_rng(6).standard_normal(4_000).astype(np.float32)
    members = ids(4)
    held = lossy(truth, 4, 7)

    async def main() -> tuple[dict[int, Any], dict[int, float]]:
        shared = Shared()
        await forge(shared, members[3], "g", 4, 3, truth, final=False)
        rec = OuterRecord.decode(members[3], shared.records[members[3]])
        assert rec is not None
        shared.records[members[3]] = replace(rec, shard=bytes(32)).encode()  # no bytes hash to this
        return await agree_each(shared, members, held, running=3)

    results, took = run(main)
    assert len({results[i].final for i in range(3)}) == 1
    assert max(took.values()) < 10.0, took


def test_repairs_fetch_only_the_pieces_that_differ() -> None:
    """Members fetch the owners' piece index and the pieces they lost, not whole shards; the result is the
    owners' concatenation."""
    truth = np.random.default_rng(8).standard_normal(30_000).astype(np.float32)
    members = ids(3)
    held = lossy(truth, 3, 9)

    async def main() -> tuple[dict[int, Any], dict[int, float]]:
        return await agree_each(Shared(), members, held)

    results, _ = run(main)
    for i in range(3):
        np.testing.assert_array_equal(results[i].vector, truth)
        lost = int(np.count_nonzero(held[i] != truth)) * 4
        assert 0 < results[i].repaired_bytes < 2 * lost + 4096  # the lost ranges (rounded to pieces) and the index
        assert set(results[i].phases) == {"repair", "agree"}


@pytest.mark.parametrize("addr", [["example.com", 80], ["127.0.0.1", 0], ["127.0.0.1", 70000], ["0.0.0.0", 5],
                                  ["224.0.0.1", 5], ["1" * 60, 5], [b"\x7f\0\0\1", 5], ["127.0.0.1", True]])
def test_a_record_whose_address_is_not_one_is_refused_hostile(addr) -> None:
    """Before: any string and port passed, so a record could point every member's fetches at any host name."""
    h = bytes(32)
    good = OuterRecord(b"n" * 32, "g", 2, 0, h, h, h, b"", 10, ("127.0.0.1", 5))
    assert OuterRecord.decode(good.node, good.encode()) == good
    raw = msgpack.unpackb(good.encode(), raw=False)
    raw["d"] = addr
    assert OuterRecord.decode(good.node, msgpack.packb(raw, use_bin_type=True)) is None
    six = replace(good, addr=("::1", 5))
    assert OuterRecord.decode(six.node, six.encode()) == six


def test_robust_applies_to_diloco_outer_averages_hostile(tmp_path) -> None:
    """Before: DiLoCo took no ``robust`` and the daemon's outer rounds never passed it, so a member scaling its
    pseudo-gradient x1000 went unclipped in a run that asked for clipping."""
    torch = pytest.importorskip("torch")
    from peerd.allreduce.robust import Robust
    from peerd.torch import DiLoCo

    from .support.trainer_harness import thread_daemon

    with thread_daemon(tmp_path, group_size=1, wait_s=0.1) as daemon:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="rb", socket=daemon.path, sync_every=2,
                     sync_state=False, state_every=0, robust="centered:2")
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
            opt.step()
        assert opt.outer_steps == 1
        outer = daemon.averager.outer_options()
        assert outer and all(o.get("robust") == Robust("clip", 2.0) for o in outer), outer
        opt.close()
