"""State sync over an in-memory lossy network (virtual time): a joiner downloads a snapshot in chunks from
several donors that advertise it in the DHT, verified by hash; donors that lost it or lie are survived."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio

from peerd.statesync import StateSyncError
from peerd.statesync.advert import Advert
from peerd.statesync.choice import candidates, founder_candidates
from peerd.wire import messages as m

from .support.memnet import MemNet, run_on_memnet
from .support.statesync import KEY, LAYOUT, RUN, swarm_with_sync  # noqa: E402
from .support.virtual import counter_value


@pytest.mark.parametrize("drop", [0.0, 0.1])
def test_joiner_downloads_from_several_donors_and_verifies(drop: float) -> None:
    blob = os.urandom(60_000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 6)
        donors, joiner = nodes[:3], nodes[5]
        for d in donors:
            sha = d.sync.keep(KEY, blob)
            assert await d.sync.advertise_state(RUN, KEY, LAYOUT, step=100, size=len(blob), sha=sha)
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=120)
        assert fetched is not None and fetched.blob == blob and fetched.step == 100
        assert fetched.sha == hashlib.sha256(blob).digest()
        assert fetched.donors == 3  # chunks came from every donor
        assert fetched.chunks >= 60_000 // m.MAX_CHUNK
        served = [counter_value(d.metrics.trainer_state_bytes_served) for d in donors]
        assert all(s > 0 for s in served) and sum(served) >= len(blob)

    run_on_memnet(main, seed=7, drop=drop, jitter=0.01)


def test_nothing_advertised_is_none_and_another_model_is_ignored() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 4)
        assert await nodes[3].sync.fetch(RUN, KEY, timeout=30) is None
        # a donor of a different model (other run key) is never used
        sha = nodes[0].sync.keep("r/ffffffffffffffff", b"x" * 1000)
        await nodes[0].sync.advertise_state(RUN, "r/ffffffffffffffff", "f" * 64, step=5, size=1000, sha=sha)
        # "training, no snapshot yet" adverts are not donors either
        await nodes[1].sync.advertise_state(RUN, KEY, LAYOUT)
        assert await nodes[3].sync.fetch(RUN, KEY, timeout=30) is None
        ads = await nodes[3].sync.adverts(RUN)
        assert {a.layout for a in ads} == {"f" * 64, LAYOUT}

    run_on_memnet(main, seed=1)


def test_donor_that_forgot_or_lies_is_survived() -> None:
    good = os.urandom(20_000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 5)
        honest, forgetful, liar, joiner = nodes[0], nodes[1], nodes[2], nodes[4]
        sha = hashlib.sha256(good).digest()
        for d in (honest, forgetful, liar):
            await d.sync.advertise_state(RUN, KEY, LAYOUT, step=50, size=len(good), sha=sha)
        honest.sync.keep(KEY, good)
        # forgetful holds nothing (answers ERROR "gone"); liar serves other bytes under the same hash
        liar.sync._snapshots[KEY] = {sha: bytes(len(good))}
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=120)
        # the liar's chunks fail the hash check; the joiner then tries donors one by one and gets the
        # honest one's bytes (the forgetful one refuses: "gone")
        assert fetched is not None and fetched.blob == good and fetched.donors == 1
        assert counter_value(joiner.metrics.trainer_state_fetches, outcome="ok") == 1

    run_on_memnet(main, seed=3)


def test_a_snapshot_nobody_completes_fails_loudly() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 4)
        sha = hashlib.sha256(b"gone").digest()
        await nodes[0].sync.advertise_state(RUN, KEY, LAYOUT, step=9, size=5000, sha=sha)
        with pytest.raises(StateSyncError, match="offset"):
            await nodes[3].sync.fetch(RUN, KEY, timeout=60)
        assert counter_value(nodes[3].metrics.trainer_state_fetches, outcome="failed") == 1

    run_on_memnet(main, seed=4)


def test_candidates_prefer_newest_then_most_donors() -> None:
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    ads = [Advert(bytes([i]) * 32, KEY, LAYOUT, step, 10, sha, None)
           for i, (step, sha) in enumerate([(100, a), (100, b), (100, b), (90, c)])]
    ranked = candidates(ads)
    assert [r.sha for r in ranked] == [b, a, c]  # newest first; at step 100, b has two donors
    assert len(ranked[0].donors) == 2 and len(ranked[1].donors) == 1
    assert Advert.decode(b"x" * 32, b"\x00garbage") is None
    assert Advert.decode(ads[0].node_id, ads[0].encode()) == ads[0]


def test_founders_take_the_lowest_initial_hash_and_the_lowest_keeps_its_own() -> None:
    a, b, c, d = b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32
    initial = [Advert(bytes([i]) * 32, KEY, LAYOUT, 0, 10, sha, None) for i, sha in enumerate([c, b, b, d])]
    # every founder but the one holding the lowest hash takes it, whatever the donor counts
    assert [r.sha for r in founder_candidates(initial, d)] == [b, c]
    assert [r.sha for r in founder_candidates(initial, c)] == [b]
    assert founder_candidates([x for x in initial if x.sha != a], a) == []  # a: its own is the lowest
    assert founder_candidates([x for x in initial if x.sha != b], b) == []
    # a run already under way (a later step) comes first: it is a joiner's choice, not a founder's
    later = Advert(b"\x09" * 32, KEY, LAYOUT, 5, 10, d, None)
    assert [r.sha for r in founder_candidates([*initial, later], a)] == [d]
