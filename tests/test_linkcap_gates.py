"""The traffic a capped node does besides its own averaging keeps to the caps (peerd.linkcap.core): answers to
state-sync requests within the serving share of the upload limit, its own state-sync requests paced to the download
limit less what else arrives, relaying within its share; and, end to end over the in-memory network in virtual time,
a state download from a capped donor and by a capped joiner."""

from __future__ import annotations

import os

import pytest
import trio

from peerd.linkcap import CapConfig, LinkCap
from peerd.linkcap.advert import WIRE_OVERHEAD
from peerd.linkcap.core import FETCH_SHARE, RELAY_SHARE, SERVE_SHARE
from peerd.linkcap.shell import CapGate
from peerd.nat.relay import DEFAULT_TOTAL_RATE
from peerd.statesync.service import CHUNK_OVERHEAD

from .support.memnet import MemNet
from .support.statesync import KEY, LAYOUT, RUN, swarm_with_sync
from .support.virtual import run_virtual

MB = 1e6


def test_state_answers_over_the_serving_share_are_not_sent() -> None:
    cap = LinkCap(CapConfig(max_upload=2 * MB), 0.0)
    cap.start(0.0)
    admitted, t = 0, 0.0
    while t < 10.0:  # a joiner asking for 10x what the share allows
        if cap.admit_serving(1200, t):
            admitted += 1200 + WIRE_OVERHEAD
        t += 1242 / (10 * SERVE_SHARE * 2 * MB)
    assert admitted / 10.0 == pytest.approx(SERVE_SHARE * 2 * MB, rel=0.02)
    assert cap.statistics().serve_refused > 0
    assert LinkCap(CapConfig(max_download=1 * MB), 0.0).admit_serving(1200, 0.0)  # no upload cap: always


def test_state_requests_wait_for_the_download_limit_less_what_else_arrives() -> None:
    cap = LinkCap(CapConfig(max_download=4 * MB), 0.0)
    cap.start(0.0)

    def fetched_in(seconds: float, t0: float) -> float:
        t, asked = t0, 0
        while t < t0 + seconds:
            t += cap.fetch(1158, t)
            asked += 1158 + WIRE_OVERHEAD
        return asked / seconds

    assert fetched_in(5.0, 0.0) == pytest.approx(FETCH_SHARE * 4 * MB, rel=0.02)
    # averaging data arrives at 1 MB/s beside it: the requests leave it room
    for s in range(1, 4):
        cap.receive_total(int(s * 1 * MB + cap.fetched), 0, 5.0 + s)
        cap.handle_timer(5.0 + s)
    assert cap.fetch_limit() == pytest.approx(FETCH_SHARE * 4 * MB - 1 * MB, rel=0.02)
    assert fetched_in(5.0, 9.0) == pytest.approx(FETCH_SHARE * 4 * MB - 1 * MB, rel=0.05)
    assert LinkCap(CapConfig(max_upload=1 * MB), 0.0).fetch(1158, 0.0) == 0.0  # no download cap: never waits


def test_relaying_gets_a_share_of_the_lower_cap() -> None:
    assert LinkCap(CapConfig(max_upload=2 * MB, max_download=8 * MB), 0.0).relay_rate(DEFAULT_TOTAL_RATE) == \
        RELAY_SHARE * 2 * MB
    assert LinkCap(CapConfig(max_download=1 * MB), 0.0).relay_rate(DEFAULT_TOTAL_RATE) == RELAY_SHARE * MB
    assert LinkCap(CapConfig(max_upload=1e9), 0.0).relay_rate(DEFAULT_TOTAL_RATE) == DEFAULT_TOTAL_RATE


def download_s(donor_cap: CapConfig | None, joiner_cap: CapConfig | None, size: int) -> tuple[float, LinkCap | None]:
    """Virtual seconds a joiner takes to download ``size`` bytes from one donor, each gated by its caps if any."""
    blob = os.urandom(size)
    out: list[float] = []
    cores: dict[str, LinkCap] = {}

    async def main() -> None:
        net = MemNet(seed=3)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = await swarm_with_sync(nursery, net, 3)
            donor, joiner = nodes[0], nodes[2]
            for name, node, cfg in (("donor", donor, donor_cap), ("joiner", joiner, joiner_cap)):
                if cfg is not None:
                    cores[name] = LinkCap(cfg, trio.current_time())
                    cores[name].start(trio.current_time())
                    node.sync.gate = CapGate(cores[name])
            sha = donor.sync.keep(KEY, blob)
            assert await donor.sync.advertise_state(RUN, KEY, LAYOUT, step=9, size=len(blob), sha=sha)
            ads = [a for a in await joiner.sync.adverts(RUN) if a.sha == sha]
            t0 = trio.current_time()
            got = await joiner.sync.download(KEY, sha, len(blob), [ads[0].addr])
            out.append(trio.current_time() - t0)
            assert got == blob
            nursery.cancel_scope.cancel()

    run_virtual(main)
    return out[0], cores.get("donor") or cores.get("joiner")


def test_a_capped_donor_serves_a_snapshot_within_its_serving_share() -> None:
    size = 400_000
    plain, _ = download_s(None, None, size)
    capped, core = download_s(CapConfig(max_upload=1 * MB), None, size)
    at_share = size / (SERVE_SHARE * 1 * MB)
    assert plain < 0.5 * at_share  # the gate, not the network, sets the pace
    assert at_share * 0.9 <= capped <= at_share * 3  # the joiner's retransmissions slow it to about the share
    assert core is not None and core.statistics().serve_refused > 0


def test_a_capped_joiner_asks_for_no_more_than_its_download_cap() -> None:
    size = 400_000
    capped, core = download_s(None, CapConfig(max_download=0.5 * MB), size)
    assert core is not None
    at_cap = core.fetched / (FETCH_SHARE * 0.5 * MB)  # each answer on the wire: its chunk, its fields, its headers
    assert core.fetched >= size + (size // 1200) * (CHUNK_OVERHEAD + WIRE_OVERHEAD)
    assert at_cap * 0.95 <= capped <= at_cap * 1.3
    assert core.statistics().fetch_held_s > 0
