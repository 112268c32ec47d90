"""The Moshpit service in one process, in virtual time: real daemons' services (endpoint, DHT, allreduce,
Moshpit) over tests/memnet.py under trio's MockClock, with one clock for the service and the DHT.

These replace what tests/test_e2e_moshpit.py could only show with sleeps and tolerances: a round forming,
joiners, kept groups, a leader killed, a member 1.5 s late every round, a full grid, members killed
mid-average. No load can make them flaky: their timing is exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import trio
import trio.testing

from peerd.deadlines import WINDOW_FLOOR_S, DeadlineTuner
from peerd.moshpit.keys import Grid
from peerd.moshpit.service import MoshpitError, RoundResult

from .support.memnet import MemNet, run_on_memnet
from .support.moshpit_swarm import MoshpitNode, lockstep, swarm, tuned_swarm  # noqa: E402
from .support.virtual import (
    counter_value,  # noqa: E402
)


def deviation(vectors: list[np.ndarray]) -> float:
    stack = np.stack([v.astype(np.float64) for v in vectors])
    return float(np.sqrt(np.mean(np.sum((stack - stack.mean(axis=0)) ** 2, axis=1))))


def test_a_round_forms_weighted_and_joiners_land_in_the_runs_group() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 4)
        for n in nodes:
            st = await n.moshpit.open("joiners", window_s=2.0)
            assert str(st.grid) == "4" and st.round == 0
        rng = np.random.default_rng(0)
        vectors = [rng.standard_normal(500).astype(np.float32) for _ in nodes]
        weights = [1.0, 2.0, 3.0, 4.0]
        exact = sum(w * v.astype(np.float64) for w, v in zip(weights, vectors, strict=True)) / sum(weights)
        t0 = trio.current_time()
        results = await lockstep(nodes, "joiners", vectors, weights=weights)
        # everyone under the one key joined: the leader closes at the target at once, no window waited out
        assert trio.current_time() - t0 < 1.0
        assert {r.group_id for r in results} != {""} and len({r.group_id for r in results}) == 1
        for r in results:
            assert r.outcome == "averaged" and r.group_size == 4 and r.round == 0 and r.received_fraction == 1
            assert np.abs(r.vector - exact).max() < 1e-5  # a sample-weighted mean
        # one member led, all name it, and its status and counter say so (the NAT lab checks it is public)
        (leader,) = {r.leader for r in results}
        assert [r.led for r in results] == [n.identity.node_id.hex() == leader for n in nodes]
        assert sum(r.led for r in results) == 1 and leader in results[0].members
        for n, r in zip(nodes, results, strict=True):
            last = n.moshpit.statistics().runs["joiners"].last
            assert (last.leader, last.led) == (leader, r.led)
            assert counter_value(n.metrics.moshpit_led) == r.led
        # the run grows to groups of 8; two peers join between rounds and take its grid and next round
        for n in nodes:
            assert (await n.moshpit.open("joiners", grid=Grid(1, 8), window_s=2.0)).round == 1
        late = await swarm(nursery, net, 2, first=4, bootstrap=nodes[0])
        for n in late:
            st = await n.moshpit.open("joiners", window_s=2.0)
            assert st.round == 1 and str(st.grid) == "8"
        everyone = nodes + late
        vectors = [r.vector for r in results] + [np.full(500, 10.0, np.float32) for _ in late]
        results = await lockstep(everyone, "joiners", vectors)
        ids = {n.identity.node_id.hex() for n in everyone}
        assert all(r.outcome == "averaged" and r.round == 1 and set(r.members) == ids for r in results), results
        assert len({r.group_id for r in results}) == 1
        assert np.allclose(results[0].vector, np.mean(np.stack(vectors), axis=0), atol=1e-5)
        assert counter_value(nodes[0].metrics.moshpit_rounds, outcome="averaged") == 2

    run_on_memnet(main, seed=1)


def test_a_run_opened_before_the_dht_found_every_peer_is_sized_for_its_min_size() -> None:
    """A trainer that asks for groups of 4 as soon as its daemon is up (its DHT knows 1 other peer) gets a grid that
    holds groups of 4, not an error about a grid sized from the peers it happened to know."""
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        (node,) = await swarm(nursery, net, 1)
        st = await node.moshpit.open("early", min_size=4, window_s=0.5)
        assert st.grid.size >= 4 and st.core.min_size == 4
        with pytest.raises(MoshpitError, match="min_size must be in"):
            await node.moshpit.open("fixed", grid=Grid(1, 3), min_size=4, window_s=0.5)

    run_on_memnet(main, seed=2)


def test_a_lonely_peer_waits_its_window_and_keeps_its_vector() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        (node,) = await swarm(nursery, net, 1)
        await node.moshpit.open("alone", window_s=0.5)
        vec = np.arange(100, dtype=np.float32)
        t0 = trio.current_time()
        (r,) = await lockstep([node], "alone", [vec])
        assert r is not None and r.outcome == "alone" and r.group_size == 1 and r.group_id == ""
        assert np.array_equal(r.vector, vec) and r.vector is not vec
        assert 0.5 <= trio.current_time() - t0 < 1.0  # its window, then it gives up
        last = node.moshpit.statistics().runs["alone"].last
        assert (last.outcome, last.leader, last.led) == ("alone", "", False)

    run_on_memnet(main, seed=2)


def test_a_complete_group_is_kept_and_re_forms_when_its_leader_dies() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 3)
        for n in nodes:
            assert (await n.moshpit.open("sticky", window_s=2.0, keep_rounds=4)).sticky.keep_rounds == 4
        vectors = [np.full(300, float(i), np.float32) for i in range(3)]
        history = [await lockstep(nodes, "sticky", vectors) for _ in range(4)]
        # round 0 matchmakes with nobody to expect yet (not kept); round 1's group holds everyone the run
        # expects and is kept; rounds 2 and 3 renew it without reading the DHT
        assert [[r.kept for r in stats] for stats in history] == [[False] * 3] * 2 + [[True] * 3] * 2
        assert all(r.outcome == "averaged" and r.group_size == 3 for stats in history for r in stats)
        kept = [r for stats in history for r in stats if r.kept]
        assert all(r.matchmaking_s < 0.05 for r in kept), [r.matchmaking_s for r in kept]
        stats = [n.moshpit.runs["sticky"].sticky for n in nodes]
        assert sum(s.renewed for s in stats) == len(kept) == 6
        # kill the kept group's leader before round 4, a renewal: the followers must not hang
        leader = stats[0].kept.leader
        assert all(s.kept is not None and s.kept.leader == leader for s in stats)
        victim = next(i for i, n in enumerate(nodes) if n.identity.node_id == leader)
        nodes[victim].kill(net)
        survivors = [n for n in nodes if n.alive]
        t0 = trio.current_time()
        after = await lockstep(survivors, "sticky", vectors[:2])
        # each follower PINGed the leader's daemon when no BEGIN came: three unanswered probes (0.35 s) and it
        # gave up on the group, then they matchmade without it, waiting their window (2 s) for the dead peer the
        # run still expects (with only its renewal request's retries to tell, the round took 5.8 s)
        assert trio.current_time() - t0 < 0.5 + 2.0 + 0.5
        assert [n.moshpit.runs["sticky"].sticky.dropped for n in survivors] == [{"dead": 1}] * 2
        after = [after] + [await lockstep(survivors, "sticky", vectors[:2]) for _ in range(3)]
        assert all(r.outcome == "averaged" and r.group_size == 2 for stats in after for r in stats), after
        ids = {n.identity.node_id.hex() for n in survivors}
        assert set(after[-1][0].members) == set(after[-1][1].members) == ids

    run_on_memnet(main, seed=3)


def test_a_kept_group_waits_for_a_member_that_starts_its_round_late() -> None:
    """Each round one peer (in turn: sometimes the leader, sometimes a follower) starts 1.5 s after the others,
    as a trainer busy with its other run's round does. Renewals wait until every member asked (PROTOCOL.md
    section 16, step 7): the late peer is averaged in, never averaged out, and no renewal is ever refused
    (the e2e version tolerates one refusal under a loaded CI machine; in virtual time there is none)."""

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 3)
        for n in nodes:
            await n.moshpit.open("late", window_s=3.0, keep_rounds=4)
        vectors = [np.full(200, float(i), np.float32) for i in range(3)]
        history = [await lockstep(nodes, "late", vectors, late=r % 3) for r in range(8)]
        assert all(r.outcome == "averaged" and r.group_size == 3 for stats in history for r in stats)
        assert all(r.received_fraction == 1.0 for stats in history for r in stats)  # nobody averaged out
        kept = [[r.kept for r in stats] for stats in history]
        # round 1's group is the first that holds everyone the run expects: rounds 2-4 renew it, 5 re-forms
        # it (used up) and keeps it again, 6-7 renew that one
        assert kept == [[False] * 3] * 2 + [[True] * 3] * 3 + [[False] * 3] + [[True] * 3] * 2, kept
        for n in nodes:
            assert n.moshpit.runs["late"].sticky.dropped == {"used_up": 1}

    run_on_memnet(main, seed=4)


def test_a_kept_group_waits_past_its_tuned_window_for_a_live_member_and_drops_a_dead_one_fast() -> None:
    """Four daemons whose window tuned itself down to 1 s (a 3 s cap). One member's trainer comes 2 s late (its
    evaluation ran long): its daemon answers the PINGs the waiting side sends, so the kept group waits for it
    and averages complete, whether the late one is a follower or the leader. Then a follower dies right after a
    round: the leader's PINGs go unanswered and it renews the group without it at once instead of waiting its
    window."""

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await tuned_swarm(nursery, net, 4, "late", window_s=3.0, keep_rounds=20)
        vectors = [np.full(100, float(i), np.float32) for i in range(4)]
        for _ in range(7):  # enough quick rounds for every tuner to bring the window to its floor
            assert all(r is not None and r.group_size == 4 for r in await lockstep(nodes, "late", vectors))
        assert all(n.moshpit.deadlines.window(3.0).seconds == WINDOW_FLOOR_S for n in nodes)
        leader = nodes[0].moshpit.runs["late"].sticky.kept.leader
        lead = next(i for i, n in enumerate(nodes) if n.identity.node_id == leader)
        for late in ((lead + 1) % 4, lead):
            t0 = trio.current_time()
            results = await lockstep(nodes, "late", vectors, late=late, late_s=2 * WINDOW_FLOOR_S)
            assert all(r is not None and r.outcome == "averaged" and r.kept and r.group_size == 4 for r in results)
            assert all(r.received_fraction == 1.0 for r in results)  # nobody averaged out
            assert 2.0 <= trio.current_time() - t0 < 2.3
        assert all(n.moshpit.runs["late"].sticky.dropped == {} for n in nodes)
        window = nodes[lead].moshpit.deadlines.window(3.0).seconds  # (the 2 s renewals stretched it)
        nodes[(lead + 2) % 4].kill(net)
        survivors = [n for n in nodes if n.alive]
        t0 = trio.current_time()
        results = await lockstep(survivors, "late", vectors[:3])
        assert all(r is not None and r.outcome == "averaged" and r.group_size == 3 and r.kept for r in results)
        assert nodes[lead].moshpit.runs["late"].sticky.statistics().shrunk == 1
        # the leader went on without it after three unanswered PINGs (0.35 s), not at its window's end, and
        # renewed the group of the others instead of matchmaking through the DHT
        took = trio.current_time() - t0
        assert 0.3 < took < 0.45 < WINDOW_FLOOR_S <= window, (took, window)

    run_on_memnet(main, seed=5)


async def _grid_run(nursery: trio.Nursery, net: MemNet, *, kill: int, rounds: int, seed: int, at_once: bool = False
                    ) -> tuple[list[float], list[list[RoundResult | None]], list[MoshpitNode]]:
    """`peerd bench moshpit --peers 16 --grid 4x4` in one process: exact grid (groups close at 4), cells
    shuffled; ``kill`` peers die as soon as they start averaging in round 0 (then groups close at 2): 1 ms into
    it, or ``at_once``, so that a victim that leads its group dies before its BEGIN reaches the followers."""
    grid = Grid(2, 4)
    rng = random.Random(seed)
    nodes = await swarm(nursery, net, grid.cells)
    cells = list(range(grid.cells))
    rng.shuffle(cells)
    for n, cell in zip(nodes, cells, strict=True):
        await n.moshpit.open("grid", grid=grid, cell=cell, adapt=False, min_size=grid.size, window_s=3.0)
    victims = set(rng.sample(range(len(nodes)), kill))
    for i in victims:
        inner = nodes[i].allreduce.average

        async def dying(*args, _i=i, _inner=inner, **kwargs):
            if at_once:
                nodes[_i].kill(net)
            else:
                nursery.start_soon(_kill_soon, nodes[_i], net)
            return await _inner(*args, **kwargs)

        nodes[i].allreduce.average = dying  # type: ignore[method-assign]
    data = np.random.default_rng(seed)
    vectors = [data.standard_normal(1000).astype(np.float32) for _ in nodes]
    start = deviation(vectors)
    devs, history = [], []
    for r in range(rounds):
        results = await lockstep(nodes, "grid", vectors)
        history.append(results)
        vectors = [res.vector if res is not None else v for res, v in zip(results, vectors, strict=True)]
        if r == 0 and victims:
            for n in nodes:
                if n.alive:
                    await n.moshpit.open("grid", min_size=2, window_s=3.0)
        devs.append(deviation([v for n, v in zip(nodes, vectors, strict=True) if n.alive]) / start)
    return devs, history, nodes


async def _kill_soon(node: MoshpitNode, net: MemNet) -> None:
    await trio.sleep(0.001)  # mid-average: its reduce-scatter has started
    node.kill(net)


def test_a_full_grid_is_exact_in_two_rounds() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        devs, history, _ = await _grid_run(nursery, net, kill=0, rounds=2, seed=5)
        for results in history:
            sizes = sorted(r.group_size for r in results if r is not None)
            assert sizes == [4] * 16 and len({r.group_id for r in results if r is not None}) == 4
            assert all(r is not None and r.received_fraction == 1.0 for r in results)
        assert devs[0] > 0.1 and devs[1] <= 1e-6, devs

    run_on_memnet(main, seed=5)


@pytest.mark.parametrize("seed", [11, 12])
def test_survivors_finish_every_round_after_two_die_mid_average(seed: int) -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        devs, history, nodes = await _grid_run(nursery, net, kill=2, rounds=4, seed=seed)
        alive = [i for i, n in enumerate(nodes) if n.alive]
        assert len(alive) == 14
        for results in history:
            assert all(results[i] is not None and results[i].outcome in ("averaged", "alone") for i in alive)
        assert all(d2 <= d1 + 1e-9 for d1, d2 in zip(devs, devs[1:], strict=False)), devs
        assert devs[-1] <= 0.05, devs

    run_on_memnet(main, seed=seed)


@pytest.mark.parametrize("seed", [1, 4])
def test_the_followers_of_a_leader_killed_before_its_begin_spread_and_converge(seed: int) -> None:
    """The followers end round 0 alone (an exact grid closes at 4 only). They used to move on as index 0 each,
    overfilling that key: a peer was left over every round after and the spread stayed at 0.13-0.15 after
    round 4 (seeds 1, 4, 5; `peerd bench moshpit --kill 2` once on CI). Now they take the indices a group of
    everyone they saw would have given them, and a peer left over by a full key the last index."""
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        devs, history, nodes = await _grid_run(nursery, net, kill=2, rounds=4, seed=seed, at_once=True)
        alive = [i for i, n in enumerate(nodes) if n.alive]
        assert len(alive) == 14
        assert sum(history[0][i].outcome == "alone" for i in alive) == 3  # a leader and a member died
        assert all(history[-1][i].outcome == "averaged" for i in alive)
        assert devs[-1] <= 0.03, devs

    run_on_memnet(main, seed=seed)


def test_parts_of_a_round_share_one_matchmaking_and_average_apart() -> None:
    """average_parts: one group for three vectors of different sizes (a trainer step's buckets), each averaged
    under its own group id as soon as its vector is there; a late part does not hold back the others; a part
    whose vector never comes fails alone, and its member is out of the parts that start after that."""
    from peerd.moshpit.service import Part, part_group_id

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 3)
        for n in nodes:
            await n.moshpit.open("parts", window_s=2.0)
        rng = np.random.default_rng(3)
        sizes = [300, 5000, 40]
        vectors = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in nodes]
        weights = [1.0, 2.0, 5.0]
        out: list[list] = [[] for _ in nodes]
        ended: list[list[tuple[int, float]]] = [[] for _ in nodes]

        async def one(i: int) -> None:
            def part(k: int) -> Part:
                async def fetch() -> np.ndarray:
                    if k == 1:
                        await trio.sleep(6.0)  # backward still producing this bucket
                    if k == 2 and i == 0:
                        raise ValueError("the trainer skipped it")
                    return vectors[i][k]
                return Part(fetch, lambda r: ended[i].append((k, trio.current_time())))

            out[i] = await nodes[i].moshpit.average_parts("parts", [part(k) for k in range(3)], weights[i],
                                                          timeout_s=30.0)

        async with trio.open_nursery() as inner:
            for i in range(3):
                inner.start_soon(one, i)

        def mean(k: int, among: list[int]) -> np.ndarray:
            total = sum(weights[j] * vectors[j][k].astype(np.float64) for j in among)
            return total / sum(weights[j] for j in among)

        for i, results in enumerate(out):
            assert isinstance(results[2], ValueError) if i == 0 else results[2].outcome == "averaged"
            r = results[0]  # every member, from the start
            assert r.outcome == "averaged" and r.group_size == 3 and r.round == 0
            assert np.abs(r.vector - mean(0, [0, 1, 2])).max() < 1e-5
            for k in (0, 1):
                assert results[k].group_id == f"{part_group_id(int(results[0].group_id, 16), k):08x}"
            # part 0 ended well before the late part 1 (the late one did not hold it back)
            times = dict(ended[i])
            assert set(times) == {0, 1, 2} and times[1] - times[0] >= 5.0
            # one round, one matchmaking: the run moved on by one
            assert nodes[i].moshpit.runs["parts"].round == 1
            assert counter_value(nodes[i].metrics.moshpit_rounds, outcome="averaged") == 1
        index0 = out[1][0].members.index(nodes[0].identity.node_id.hex())
        for i in (1, 2):
            # part 2 without node 0: the others average what came; node 0's shard, never averaged, stays theirs
            got = out[i][2].vector
            fine = np.abs(got - mean(2, [1, 2])) < 1e-5
            assert np.all(fine | (got == vectors[i][2])) and 0.5 <= fine.mean() < 1.0
            assert index0 in out[i][2].out
            # part 1 started after that: node 0 is out of it (not waited for, sent nothing)
            got = out[i][1].vector
            fine = np.abs(got - mean(1, [1, 2])) < 1e-5
            assert np.all(fine | (got == vectors[i][1])) and 0.5 <= fine.mean() < 1.0
        assert np.abs(out[0][1].vector - vectors[0][1]).max() < 1e-6  # nobody sent node 0 anything of it

    run_on_memnet(main, seed=7)


@pytest.mark.parametrize("wait", [None, 10.0])
@pytest.mark.parametrize("keep", [1, 20])
def test_a_round_told_to_wait_gathers_a_member_late_past_the_runs_window_cap(keep: int, wait: float | None) -> None:
    """The final average of training: four daemons whose window tuned itself down to 1 s (a 3 s cap); one trainer
    comes 4 s late (its last evaluation ran long). A step's round through the DHT leaves it alone; a kept group's
    renewal waits for it (its daemon answers PINGs: up to half the round's budget); a round with ``wait_s`` (what
    ``Optimizer.finish`` asks) gathers all four, and starts as the late one arrives, not at the wait's end."""

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 4)
        for n in nodes:
            n.moshpit.deadlines = DeadlineTuner()
            await n.moshpit.open("final", window_s=3.0, keep_rounds=keep)
        vectors = [np.full(100, float(i), np.float32) for i in range(4)]
        for _ in range(7):  # enough quick rounds for every tuner to bring the window to its floor
            assert all(r is not None and r.group_size == 4 for r in await lockstep(nodes, "final", vectors))
        out: list[RoundResult | None] = [None] * 4
        extra = {} if wait is None else {"wait_s": wait}

        async def one(i: int) -> None:
            await trio.sleep(4.0 if i == 2 else 0.0)
            out[i] = await nodes[i].moshpit.average("final", vectors[i], 1.0, timeout_s=30.0, **extra)

        t0 = trio.current_time()
        async with trio.open_nursery() as inner:
            for i in range(4):
                inner.start_soon(one, i)
        if wait is None and keep == 1:
            assert [(r.outcome, r.group_size) for r in out if r is not None] == [("averaged", 3)] * 2 + [
                ("alone", 1), ("averaged", 3)]
            return
        assert all(r is not None and r.outcome == "averaged" and r.group_size == 4 for r in out)
        assert all(np.allclose(r.vector, 1.5) for r in out if r is not None)
        assert trio.current_time() - t0 < 4.5
        with pytest.raises(MoshpitError, match="wait_s"):
            await nodes[0].moshpit.average("final", vectors[0], 1.0, timeout_s=10.0, wait_s=6.0)

    run_on_memnet(main, seed=6)
