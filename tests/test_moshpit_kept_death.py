"""A kept group whose member dies mid-average goes on without it (moshpit/sticky.py): real services in virtual time
(tests/support/memnet.py), the daemons' self-tuned deadlines on, so the averaging PINGs a member gone silent."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from .support.memnet import MemNet, run_on_memnet
from .support.moshpit_swarm import lockstep, tuned_swarm


@pytest.mark.parametrize("leader_dies", [False, True])
def test_the_round_after_a_death_mid_average_is_the_kept_group_without_it(leader_dies: bool) -> None:
    """A follower or the leader dies mid-average: the next round is a renewal of the other three (the leader's
    successor, the first member left, leading it where the leader died)."""
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await tuned_swarm(nursery, net, 4, "k", window_s=3.0, keep_rounds=20)
        vectors = [np.full(20000, float(i), np.float32) for i in range(4)]
        for _ in range(3):
            assert all(r is not None and r.group_size == 4 for r in await lockstep(nodes, "k", vectors))
        leader = nodes[0].moshpit.runs["k"].sticky.kept.leader
        victim = next(n for n in nodes if (n.identity.node_id == leader) == leader_dies)
        inner = victim.allreduce.average

        async def dying(*args, **kwargs):
            async def kill() -> None:
                await trio.sleep(0.002)  # mid-average: its reduce-scatter has started
                victim.kill(net)
            nursery.start_soon(kill)
            return await inner(*args, **kwargs)

        victim.allreduce.average = dying  # type: ignore[method-assign]
        caught = await lockstep(nodes, "k", vectors)
        survivors = [n for n in nodes if n.alive]
        assert len(survivors) == 3 and all(caught[nodes.index(n)].outcome == "averaged" for n in survivors)
        t0 = trio.current_time()
        after = [r for r in await lockstep(nodes, "k", vectors) if r is not None]
        took = trio.current_time() - t0
        assert len(after) == 3
        for r in after:  # a renewal of the three: no matchmaking through the DHT, no window waited out
            assert r.outcome == "averaged" and r.kept and r.group_size == 3 and r.received_fraction == 1.0
        assert took < 0.3, took
        for n in survivors:
            st = n.moshpit.runs["k"].sticky.statistics()
            assert st.shrunk == 1 and st.succeeded == int(leader_dies) and st.dropped == {}, st
            assert st.kept is not None and st.kept.size == 3 and (st.kept.leader != leader.hex()) == leader_dies
        exact = np.mean(np.stack([vectors[nodes.index(n)] for n in survivors]), axis=0)
        assert all(np.allclose(r.vector, exact, atol=1e-5) for r in after)

    run_on_memnet(main, seed=4)
