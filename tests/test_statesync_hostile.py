"""State sync against hostile members (issue 11): adverts are claims of anyone holding the swarm key, so
a joiner never allocates from an advertised size beyond its model's bound, runs a fixed pool of chunk
workers, moves past every failing candidate, and ranks donors it averaged with above strangers whose
step is far ahead. In-memory network, virtual time."""

from __future__ import annotations

import hashlib
import os

import trio

from peerd.statesync import StateSync
from peerd.statesync.advert import Advert
from peerd.statesync.choice import AHEAD_STEPS, candidates
from peerd.statesync.service import MAX_NOTED, WORKERS
from peerd.wire import messages as m

from .support.memnet import MemNet, run_on_memnet
from .support.statesync import KEY, LAYOUT, RUN, swarm_with_sync
from .support.virtual import counter_value


def advert(i: int, step: int, sha: bytes, size: int = 10) -> Advert:
    return Advert(bytes([i]) * 32, KEY, LAYOUT, step, size, sha, None)


def test_huge_advert_is_ignored_and_counted_and_the_honest_snapshot_is_fetched() -> None:
    """An advert of 2**33 bytes at a newer step used to be allocated (OOM, or MemoryError that aborted the
    fetch); now it is beyond the model's bound: ignored, counted, and the honest donor serves."""
    good = os.urandom(5000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 4)
        honest, attacker, joiner = nodes[0], nodes[1], nodes[3]
        sha = honest.sync.keep(KEY, good)
        await honest.sync.advertise_state(RUN, KEY, LAYOUT, step=100, size=len(good), sha=sha)
        await attacker.sync.advertise_state(RUN, KEY, LAYOUT, step=10**9, size=2**33, sha=b"\x01" * 32)
        # another model's advert (same run, other layout) is ignored and counted too
        await nodes[2].sync.advertise_state(RUN, KEY, "e" * 64, step=10**9, size=100, sha=b"\x02" * 32)
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=60, max_size=1 << 20, layout=LAYOUT)
        assert fetched is not None and fetched.blob == good and fetched.step == 100
        assert counter_value(joiner.metrics.ignored_records, kind="state_advert", reason="size") == 1
        assert counter_value(joiner.metrics.ignored_records, kind="state_advert", reason="layout") == 1

    run_on_memnet(main, seed=11)


def test_a_failing_candidate_of_any_kind_falls_through_to_the_next() -> None:
    """MemoryError (a size within bound that still does not fit), a hash mismatch from the only donor, and a
    donor that never answers: each candidate fails in turn and the joiner still gets the honest snapshot."""
    good = os.urandom(3000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 6)
        honest, oom, liar, silent, joiner = nodes[0], nodes[1], nodes[2], nodes[3], nodes[5]
        sha = honest.sync.keep(KEY, good)
        await honest.sync.advertise_state(RUN, KEY, LAYOUT, step=100, size=len(good), sha=sha)
        oom_sha = b"\x03" * 32
        await oom.sync.advertise_state(RUN, KEY, LAYOUT, step=103, size=4000, sha=oom_sha)
        lie_sha = hashlib.sha256(b"L" * 3000).digest()
        liar.sync._snapshots[KEY] = {lie_sha: bytes(3000)}  # other bytes under the advertised hash
        await liar.sync.advertise_state(RUN, KEY, LAYOUT, step=102, size=3000, sha=lie_sha)
        await silent.sync.advertise_state(RUN, KEY, LAYOUT, step=101, size=3000, sha=b"\x04" * 32)
        net.partition(silent.addr)  # advertised, then gone: every chunk request times out
        real = joiner.sync._download

        async def download(run_key, want_sha, size, step, donors):
            if want_sha == oom_sha:
                raise MemoryError
            return await real(run_key, want_sha, size, step, donors)

        joiner.sync._download = download
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=120, max_size=1 << 20)
        assert fetched is not None and fetched.blob == good and fetched.step == 100
        assert counter_value(joiner.metrics.trainer_state_fetches, outcome="ok") == 1

    run_on_memnet(main, seed=12)


def test_a_donor_that_trickles_bytes_is_dropped() -> None:
    """A donor that answers each chunk request with one byte would keep a joiner busy for ever: it is dropped
    after its first short answer and the next candidate serves."""
    good, slow = os.urandom(4000), os.urandom(4000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 4)
        honest, trickler, joiner = nodes[0], nodes[1], nodes[3]
        sha = honest.sync.keep(KEY, good)
        await honest.sync.advertise_state(RUN, KEY, LAYOUT, step=100, size=len(good), sha=sha)
        slow_sha = trickler.sync.keep(KEY, slow)
        await trickler.sync.advertise_state(RUN, KEY, LAYOUT, step=200, size=len(slow), sha=slow_sha)
        served = trickler.sync._on_get

        def one_byte(incoming):
            reply = served(incoming)
            return {**reply, "data": reply["data"][:1]}

        trickler.endpoint.on_request(m.MsgType.STATE_GET, one_byte)
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=60, max_size=1 << 20)
        assert fetched is not None and fetched.blob == good

    run_on_memnet(main, seed=13)


def test_a_big_snapshot_runs_a_bounded_pool_of_workers() -> None:
    """Hundreds of chunks, yet the joiner runs WORKERS chunk tasks (it used to start one task per chunk)."""
    blob = os.urandom(400 * 1000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 3)
        donor, joiner = nodes[0], nodes[2]
        sha = donor.sync.keep(KEY, blob)
        await donor.sync.advertise_state(RUN, KEY, LAYOUT, step=7, size=len(blob), sha=sha)
        base = trio.lowlevel.current_statistics().tasks_living
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, trio.lowlevel.current_statistics().tasks_living - base)
                await trio.sleep(0.0005)

        nursery.start_soon(watch)
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=120, max_size=1 << 20)
        assert fetched is not None and fetched.blob == blob and fetched.chunks >= 400
        # workers, plus the in-memory network's datagrams in flight (a request and a reply per worker)
        assert peak <= 3 * WORKERS + 10, peak

    run_on_memnet(main, seed=14)


def test_known_donors_first_then_not_far_ahead_then_step_then_agreement() -> None:
    a, b, c, d = (bytes([x]) * 32 for x in b"abcd")
    ads = [advert(1, 100, a), advert(2, 100, b), advert(3, 100, b), advert(4, 90, c),
           advert(5, 100 + AHEAD_STEPS + 1, d), advert(6, 100 + AHEAD_STEPS + 1, d)]
    # strangers only: a far-ahead claim ranks after every snapshot near the median step
    assert [c_.sha for c_ in candidates(ads)] == [b, a, c, d]
    # a donor this node averaged with outranks strangers, whatever step they claim
    known = {bytes([4]).hex() * 32}
    ranked = candidates(ads, known)
    assert [c_.sha for c_ in ranked] == [c, b, a, d] and ranked[0].known
    # an attacker advertising the honest hash with another size does not split the honest donors off
    ads2 = [advert(7, 100, a, size=99), advert(1, 100, a), advert(8, 100, a)]
    ranked = candidates(ads2)
    assert [(r.size, len(r.donors)) for r in ranked] == [(10, 2), (99, 1)]
    # nor does one donor claiming a higher step for the same bytes move the snapshot's step
    ads3 = [advert(1, 100, a), advert(2, 100, a), advert(9, 10**12, a)]
    assert candidates(ads3)[0].step == 100
    # known donors are asked first within a snapshot
    assert candidates(ads3, {bytes([9]).hex() * 32})[0].donors[0].node_id == bytes([9]) * 32


def test_known_peers_come_from_rounds_and_an_injected_source() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 1)
        sync = nodes[0].sync
        sync.note_peers(["ab" * 32, "not-an-id", 5, "CD" * 32])
        assert sync.known_peers() == {"ab" * 32, "cd" * 32}
        sync.set_known_peers(lambda: ["ef" * 32])
        assert sync.known_peers() == {"ab" * 32, "cd" * 32, "ef" * 32}

        def broken():
            raise RuntimeError("moshpit is restarting")

        sync.set_known_peers(broken)  # a ranking hint: its failure never fails a download
        assert sync.known_peers() == {"ab" * 32, "cd" * 32}
        for i in range(MAX_NOTED + 10):
            sync.note_peers([f"{i:064x}"])
        assert len(sync.known_peers()) == MAX_NOTED
        with_source = StateSync(nodes[0].endpoint, None, nodes[0].metrics, known_peers={"12" * 32})
        assert with_source.known_peers() == {"12" * 32}

    run_on_memnet(main, seed=15)


def test_adverts_with_out_of_range_numbers_do_not_decode() -> None:
    ok = advert(1, 5, b"a" * 32)
    assert Advert.decode(ok.node_id, ok.encode()) == ok
    for bad in (advert(1, -2, b"a" * 32), advert(1, 2**63, b"a" * 32), advert(1, 5, b"a" * 32, size=2**63)):
        assert Advert.decode(bad.node_id, bad.encode()) is None


def test_a_lone_donor_claiming_a_high_step_does_not_win_a_fresh_joiner_hostile() -> None:
    """A fresh joiner knows no donor. The attacker advertises its own snapshot at a step just inside what used to
    be "not far ahead" (median + 9,999): ranked by step first, it won alone. Now two honest donors agreeing on
    their bytes outrank one donor's claim, and a claim past median + AHEAD_STEPS ranks last even against lone
    honest donors; a snapshot the trainer refused (``exclude``) is skipped for the next one."""
    honest = os.urandom(4000)
    other = os.urandom(4000)
    poison = os.urandom(4000)

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm_with_sync(nursery, net, 6)
        a, b, c, attacker, joiner = nodes[0], nodes[1], nodes[2], nodes[3], nodes[5]
        for d in (a, b):
            sha = d.sync.keep(KEY, honest)
            await d.sync.advertise_state(RUN, KEY, LAYOUT, step=100, size=len(honest), sha=sha)
        bad = attacker.sync.keep(KEY, poison)
        await attacker.sync.advertise_state(RUN, KEY, LAYOUT, step=100 + 9_999, size=len(poison), sha=bad)
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=60, layout=LAYOUT)
        assert fetched is not None and fetched.blob == honest and fetched.step == 100
        # honest donors that never hold the same bytes: the far-ahead claim still ranks after them
        b.sync.forget(KEY)
        sha = b.sync.keep(KEY, other)
        await b.sync.advertise_state(RUN, KEY, LAYOUT, step=101, size=len(other), sha=sha)
        c.sync.keep(KEY, os.urandom(10))
        await c.sync.advertise_state(RUN, KEY, LAYOUT, step=99, size=10, sha=hashlib.sha256(b"x").digest())
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=60, layout=LAYOUT)
        assert fetched is not None and fetched.blob == other and fetched.step == 101
        # the trainer refused it (say, it held NaN): the next candidate comes, never the far-ahead one first
        fetched = await joiner.sync.fetch(RUN, KEY, timeout=60, layout=LAYOUT, exclude=[sha])
        assert fetched is not None and fetched.blob == honest and fetched.step == 100

    run_on_memnet(main, seed=21)
