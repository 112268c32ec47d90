"""The averaging host in virtual time, with no trio and no sockets: several nodes' AveragingHosts over the
one in-memory network (peerd/tools/sim/net.py) with exact loss patterns, token bindings that arrive when the test
says, and start times per node. The harness plays the trio shell's part (it executes the host's actions
and calls it back at the times it names) and the transport's (a token's peer is None until its binding
arrives at the receiver; GRO blocks).

Expected averages come from the inputs and the network's own log of which data bodies arrived, by the
reconstruction rule of protocol/allreduce.md (test_allreduce_core.expected_results).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.allreduce import HEADER_SIZE, Layout, pack_data, parse_header
from peerd.allreduce.held import ENTRY_OVERHEAD, HeldData
from peerd.allreduce.host import (
    RECENT_GROUPS,
    AveragingHost,
    Dropped,
    HeldTimer,
    PacerVerdict,
    SendBlock,
    Wake,
    send_shape,
)
from peerd.allreduce.options import AverageOptions
from peerd.allreduce.recent import RECENT_MEMBER_S
from peerd.tools.sim.net import Link
from peerd.transport.pacing import Pacer, Report

from .support.groups import AG_DATA, RS_DATA, RS_END, inputs  # noqa: E402
from .support.host_lab import INF, MAX_BODY, MTU, PER, Datagram, Lab


def mean(xs: list[np.ndarray], ws: list[float]) -> np.ndarray:
    return sum(w * x.astype(np.float64) for x, w in zip(xs, ws, strict=True)) / sum(ws)


def every(k: int) -> Callable[[Datagram], bool]:
    """Drops every k-th datagram of every link, END markers included."""
    return lambda d: d.k % k == k - 1


# ---- several groups, loss, duplicates -----------------------------------------------------------------


def test_several_groups_at_once_over_a_lossy_network() -> None:
    """Three groups share nodes (node 1 and 2 average in two at once, node 0 in two): each group's result is
    what its own arrived data gives, with every 7th datagram of every link lost."""
    lab = Lab(5, drop=every(7))
    groups = {11: [0, 1, 2], 12: [1, 2, 3, 4], 13: [4, 0]}
    data = {g: inputs(len(m), 40 * PER + 5, seed=g) for g, m in groups.items()}
    for g, m in groups.items():
        lab.start(0.001 * (g - 11), g, m, *data[g], floor_s=0.2)
    lab.run()
    for g, m in groups.items():
        lab.check(g, *data[g])
        for node in m:
            assert lab.nodes[node].drops["late"] == 0
    assert all(not nd.host.held.count and not nd.host._groups for nd in lab.nodes)
    # the loss pattern did lose data, and some of it was averaged out
    assert any(nd.done[g].stats.reduce_scatter.datagrams_received < nd.done[g].stats.reduce_scatter.datagrams_expected
               for g, m in groups.items() for nd in (lab.nodes[i] for i in m))


@pytest.mark.parametrize("seed", [3, 4])
def test_random_loss_duplication_and_reordering_of_the_network(seed: int) -> None:
    """The network's own seeded faults (10 % loss, 5 % duplicates, jitter that reorders): every result is
    what arrived, END markers lost too."""
    xs, ws = inputs(4, 50 * PER + 3, seed=seed)
    lab = Lab(4, link=Link(loss=0.1, duplicate=0.05, latency=0.01, jitter=0.003), seed=seed)
    lab.start(0.0, 91, [0, 1, 2, 3], xs, ws, floor_s=0.3)
    lab.run()
    lab.check(91, xs, ws)
    assert lab.net.lost > 0 and lab.net.duplicated > 0
    assert all(nd.drops["late"] == 0 and nd.done[91].stats.drops.get("late", 0) == 0 for nd in lab.nodes)


@pytest.mark.parametrize("spacing", [None, (0.008, 0.03)])
def test_an_end_whose_first_copy_dies_in_a_burst_costs_a_spacing_not_the_floor(spacing) -> None:
    """A burst of loss (a full queue's tail drop) that takes a stream's last data datagram and everything
    sent with it: the END's copies sent together all die, and the receiver waits out its phase floor; with
    the copies spaced (the daemon's END_SPACING_S), the second one closes the stream 8 ms later. (Had the last
    data datagram arrived, it would have closed the stream itself: the next test.)"""
    burst: list[float] = []

    def drop(d: Datagram) -> bool:
        if d.src != 1 or d.dst != 0 or d.mtype not in (RS_DATA, RS_END):
            return False
        if d.mtype == RS_DATA:  # the stream's last datagram (shard 0 starts at offset 0): the burst's start
            h = parse_header(d.mtype, d.body)
            return h.offset // PER == h.total - 1
        if not burst:
            burst.append(lab.now)  # the instant the first END copy goes: everything 1 sends 0 then is lost
        return lab.now == burst[0]

    xs, ws = inputs(3, 30 * PER + 3)
    lab = Lab(3, drop=drop, end_spacing_s=spacing)
    lab.start(0.0, 61, [0, 1, 2], xs, ws, floor_s=0.5)
    lab.run()
    lab.check(61, xs, ws)
    rs = lab.nodes[0].done[61].stats.reduce_scatter
    assert rs.datagrams_received < rs.datagrams_expected
    if spacing is None:
        assert rs.ended_by == "deadline" and rs.ended_at - rs.started_at >= 0.5
    else:
        assert rs.ended_by == "completion" and rs.ended_at - rs.started_at < 0.1
        assert all(not nd.host._groups for nd in lab.nodes)


@pytest.mark.parametrize("block", [False, True])
def test_a_streams_last_datagram_closes_it_when_every_end_is_lost(block: bool) -> None:
    """Every END copy from 1 to 0 lost, one datagram in the middle of the stream lost: the stream's last
    datagram acts as its END (after the in-order grace), so the phase ends by completion, not at its floor; as
    single datagrams and as GRO blocks."""
    def drop(d: Datagram) -> bool:
        return d.src == 1 and d.dst == 0 and (d.mtype == RS_END or d.mtype == RS_DATA and d.k == 5)

    xs, ws = inputs(3, 30 * PER + 3)
    lab = Lab(3, drop=drop, link=Link(latency=0.01, jitter=0.0 if block else 0.0005), seed=2)
    lab.start(0.0, 62, [0, 1, 2], xs, ws, floor_s=0.5)
    lab.run()
    lab.check(62, xs, ws)
    rs = lab.nodes[0].done[62].stats.reduce_scatter
    assert rs.datagrams_received == rs.datagrams_expected - 1 and rs.ends_received == 1
    assert rs.ended_by == "completion" and rs.ended_at - rs.started_at < 0.1


def test_end_copies_are_spaced_from_when_the_first_goes() -> None:
    """``datagrams_to_send`` hands out one copy of each END (``later`` = 2); ``pace`` schedules the others from the
    first's departure; the host's timer wakes the driver for them and ``due_copies(inf)`` flushes the rest."""
    a, b = bytes([1]) * 32, bytes([2]) * 32
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU, end_spacing_s=(0.008, 0.03))
    host.start(5, [a, b], 0, np.ones(3 * PER, np.float32), 1.0, 0.0, options=AverageOptions(floor_s=1.0))
    ends = [blk for blk in host.datagrams_to_send(0.0, 100, group_id=5) if blk.type == RS_END]
    assert len(ends) == 1 and len(ends[0].bodies) == 1 and ends[0].later == 2
    assert host.due_copies(5, INF) == []  # nothing before the first copy is paced
    at = host.pace(ends[0], 1, ends[0].bodies.size, 0.25)
    assert host.get_timer() == pytest.approx(at + 0.008)
    host.handle_timer(at + 0.008)
    assert Wake(5) in host.take_actions()
    assert host.due_copies(5, at + 0.0079) == []
    (second,) = host.due_copies(5, at + 0.008)
    assert second.later == 0 and second.bodies.tobytes() == ends[0].bodies.tobytes()
    (third,) = host.due_copies(5, INF)
    assert host.due_copies(5, INF) == []
    with pytest.raises(ValueError, match="end_spacing_s"):
        AveragingHost(max_body=MAX_BODY, mtu=MTU, end_spacing_s=(float("nan"),))
    # without spacing the copies go together, as before
    plain = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    plain.start(5, [a, b], 0, np.ones(3 * PER, np.float32), 1.0, 0.0)
    assert [len(blk.bodies) for blk in plain.datagrams_to_send(0.0, 100, group_id=5) if blk.type == RS_END] == [3]


def test_a_member_that_crashes_mid_average() -> None:
    """HostNode 3 dies 5 ms in, its reduce-scatter on the wire and its all-gather not sent yet: the others use
    its contributions, keep their own values for its shard, and end their all-gather by deadline."""
    xs, ws = inputs(4, 60 * PER, seed=5)
    lab = Lab(4, link=Link(latency=0.01))
    lab.start(0.0, 95, [0, 1, 2, 3], xs, ws, floor_s=0.3)
    lab.at(0.005, lab.net.crash, 3)
    lab.run()
    lab.check(95, xs, ws, skip=(3,))
    got = lab.delivered(95)
    assert any(s == 3 for s, _, t, _ in got if t == RS_DATA)
    assert not any(s == 3 for s, _, t, _ in got if t == AG_DATA)
    for nd in lab.nodes[:3]:
        st = nd.done[95].stats
        assert st.all_gather.ended_by == "deadline" and 3 in st.all_gather.silent


@st.composite
def arrivals(draw):
    """A group whose members start at different times, whose tokens are bound at each other late, over
    links that lose every k-th datagram (or nothing): all within the floor, so nothing is given up on."""
    n = draw(st.integers(2, 4))
    length = draw(st.integers(0, 30 * PER))
    starts = {i: draw(st.sampled_from([0.0, 0.01, 0.05, 0.2])) for i in range(n)}
    bind_at = {(s, d): draw(st.sampled_from([0.0, 0.0, 0.02, 0.15, 0.3])) for s in range(n) for d in range(n) if s != d}
    k = draw(st.sampled_from([0, 3, 5, 11]))
    return n, length, starts, bind_at, k, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals())
def test_late_starts_and_late_bindings_lose_nothing_that_arrived(sc) -> None:
    n, length, starts, bind_at, k, seed = sc
    xs, ws = inputs(n, length, seed=seed)
    lab = Lab(n, drop=every(k) if k else (lambda d: False), bind_at=bind_at)
    lab.start(starts, 97, list(range(n)), xs, ws, floor_s=0.5)
    lab.run()
    lab.check(97, xs, ws)
    for nd in lab.nodes:
        # nothing late, nothing held to expiry, nothing unbound at the end; but a member whose shard is
        # empty (length < n) waits for no stream, so it may finish before an unbound END marker is bound
        assert not nd.drops or (length < n and set(nd.drops) == {"unbound"}), nd.drops
        assert nd.host.held.count == 0 and not nd.host.running(97)


def test_the_same_inputs_give_the_same_run() -> None:
    """No clock and no randomness inside: two runs of the same scenario agree bit for bit."""
    def once() -> tuple:
        lab = Lab(4, drop=lambda d: (d.k * 2654435761 + d.src * 7 + d.dst) % 11 == 0)
        xs, ws = inputs(4, 30 * PER)
        lab.start(0.0, 9, [0, 1, 2, 3], xs, ws, floor_s=0.3)
        lab.run()
        return tuple((nd.done[9].vector.tobytes(), nd.done[9].stats, tuple(sorted(nd.drops.items())),
                      tuple(v.verdict for v in nd.verdicts)) for nd in lab.nodes) + (lab.now,)

    assert once() == once()


def test_duplicated_and_late_blocks_change_nothing() -> None:
    xs, ws = inputs(3, 25 * PER)
    lab = Lab(3, dup=lambda d: True)  # every datagram twice, the copy 5 ms later
    lab.start(0.0, 21, [0, 1, 2], xs, ws, floor_s=0.2)
    lab.run()
    for nd in lab.nodes:
        np.testing.assert_allclose(nd.done[21].vector, mean(xs, ws), atol=1e-5)
        assert nd.done[21].stats.drops.get("duplicate", 0) + nd.drops["late"] > 0
    # a block that turns up after its group finished is late: counted, not held for a group that is over
    node = lab.nodes[0]
    late = [d for d in lab.arrived if d.dst == 0 and d.mtype == RS_DATA][:3]
    bodies = np.frombuffer(b"".join(d.body for d in late), np.uint8).reshape(len(late), -1)
    before = node.drops["late"]
    node.host.receive_block(lab.nodes[late[0].src].peer, 0x1000 + late[0].src, RS_DATA, bodies, 99.0)
    lab.apply(node)
    assert node.drops["late"] == before + 3 and node.host.held.count == 0


# ---- data before its group, tokens bound late ---------------------------------------------------------


def test_data_for_a_group_not_started_yet_is_held_and_used() -> None:
    """HostNode 2 starts 0.15 s after the others: their data waits for it, and nothing is lost."""
    xs, ws = inputs(3, 20 * PER)
    lab = Lab(3)
    lab.start({0: 0.0, 1: 0.0, 2: 0.15}, 31, [0, 1, 2], xs, ws, floor_s=0.5)
    seen = []
    lab.at(0.1, lambda: seen.append((lab.nodes[2].host.held.count, lab.nodes[2].host.running(31))))
    lab.run()
    assert seen[0][0] > 0 and not seen[0][1]  # held while node 2 had not started
    for nd in lab.nodes:
        np.testing.assert_allclose(nd.done[31].vector, mean(xs, ws), atol=1e-5)
        assert nd.done[31].stats.reduce_scatter.ended_by == "completion"
        assert not nd.drops and nd.host.held.count == 0
    assert [b.to for b in lab.nodes[2].binds] == [0, 1]  # it asked to PING the other two


def test_blocks_held_for_a_group_not_started_are_taken_whole(monkeypatch) -> None:
    """What a late member holds arrived as blocks: it is held as blocks (an item per block, charged per body)
    and handed to the group whole when it starts, not body by body (a late member holds thousands of bodies
    on loopback: ~20 us each one by one, 6 % of a daemon's CPU in a 100 MB average)."""
    from peerd.allreduce.group import GroupAverage

    one_by_one = Counter()
    receive = GroupAverage.receive

    def counted(self, sender, mtype, body, now):
        one_by_one[mtype] += 1
        return receive(self, sender, mtype, body, now)

    xs, ws = inputs(3, 40 * PER)
    lab = Lab(3)
    late = lab.nodes[2].host
    start = late.start

    def start_counted(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(GroupAverage, "receive", counted)
            return start(*args, **kwargs)

    late.start = start_counted
    lab.start({0: 0.0, 1: 0.0, 2: 0.15}, 33, [0, 1, 2], xs, ws, floor_s=0.5)
    seen = []
    def charged(body: Any) -> int:  # what the per-body path charges for the bodies of an item
        return len(body) + ENTRY_OVERHEAD if isinstance(body, bytes) else body.size + ENTRY_OVERHEAD * len(body)

    lab.at(0.1, lambda: seen.append((late.held.count, [item for b in late.held._buckets.values() for item in b.items],
                                     late.held.nbytes)))
    lab.run()
    bodies, items, nbytes = seen[0]
    assert bodies >= 20 and len(items) * 2 <= bodies  # blocks of several bodies each ...
    assert nbytes == sum(charged(body) for _, _, body, _ in items)  # ... charged as that many bodies
    singles = sum(1 for mtype, _, body, _ in items if mtype == RS_DATA and isinstance(body, bytes))
    assert one_by_one[RS_DATA] == singles < bodies / 4  # blocks taken whole when the group started
    lab.check(33, xs, ws)
    for nd in lab.nodes:
        np.testing.assert_allclose(nd.done[33].vector, mean(xs, ws), atol=1e-5)
        assert not nd.drops and nd.host.held.count == 0


def test_a_held_block_that_would_pass_its_tokens_bound_is_held_body_by_body_up_to_it() -> None:
    """A block bigger than what its token may still hold is not refused whole: the bodies that fit are held,
    the rest dropped as before."""
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU, held=HeldData(max_token_bytes=5 * (MAX_BODY + ENTRY_OVERHEAD)))
    bodies = np.frombuffer(b"".join(pack_data(77, 10 * PER, i * PER, 2.0, np.ones(PER, np.float32))
                                    for i in range(8)), np.uint8).reshape(8, -1)
    host.receive_block(b"p" * 32, 0x99, RS_DATA, bodies, 0.0)
    actions = host.take_actions()
    drops = Counter()
    for a in actions:
        if isinstance(a, Dropped):
            drops[a.reason] += a.count
    assert host.held.count == 5 and drops == {"held": 3}


@pytest.mark.parametrize("gate", [True, False])
def test_a_member_not_heard_from_gets_its_share_once_it_runs_the_group(gate: bool, monkeypatch) -> None:
    """HostNode 2 starts 0.3 s late and holds at most 20 bodies per sender: the others give it 10 datagrams
    (GATE_BYTES) and the rest once its data or REPORTs show it runs the group, so nothing is dropped. Without
    the gate (a budget past the vector) its hold overflows and the average loses that data."""
    import peerd.allreduce.host as host_module

    monkeypatch.setattr(host_module, "GATE_BYTES", 10 * MTU if gate else 1 << 40)
    xs, ws = inputs(3, 200 * PER)
    lab = Lab(3, held=lambda: HeldData(max_token_bytes=20 * (MAX_BODY + ENTRY_OVERHEAD)))
    lab.start({0: 0.0, 1: 0.0, 2: 0.3}, 32, [0, 1, 2], xs, ws, floor_s=1.0)
    waiting = []
    lab.at(0.25, lambda: waiting.append([len(nd.host._groups[32].waiting) for nd in lab.nodes[:2]]))
    lab.run()
    if gate:
        lab.check(32, xs, ws)
        assert waiting == [[1, 1]]  # each of the first two kept node 2's share back
        for nd in lab.nodes:
            np.testing.assert_allclose(nd.done[32].vector, mean(xs, ws), atol=1e-5)
            assert not nd.drops
            assert nd.done[32].stats.reduce_scatter.ended_by == "completion"
    else:  # (what its hold dropped had arrived: the results lack it)
        assert lab.nodes[2].drops["held"] > 0
        assert np.abs(lab.nodes[2].done[32].vector - mean(xs, ws)).max() > 0.1


def test_an_unbound_token_is_resolved_when_its_group_starts() -> None:
    """HostNode 1's data reaches node 0 before node 0 has started the group and before 1's token is bound there;
    the binding arrives (node 0 remembers it) and only then does node 0 start: the held data is used."""
    xs, ws = inputs(2, 10 * PER)
    lab = Lab(2, bind_at={(1, 0): 0.05})
    lab.start({0: 0.1, 1: 0.0}, 41, [0, 1], xs, ws, floor_s=0.5)
    lab.run()
    for nd in lab.nodes:
        np.testing.assert_allclose(nd.done[41].vector, mean(xs, ws), atol=1e-5)
        assert not nd.drops


def test_data_from_an_unbound_token_waits_for_its_binding() -> None:
    """HostNode 1's token is bound at node 0 only at 0.3 s, long after its data arrived: held, then delivered."""
    xs, ws = inputs(3, 20 * PER)
    lab = Lab(3, bind_at={(1, 0): 0.3})
    lab.start(0.0, 51, [0, 1, 2], xs, ws, floor_s=0.5)
    held = []
    lab.at(0.2, lambda: held.append(lab.nodes[0].host.held.count))
    lab.run()
    assert held[0] > 0
    lab.check(51, xs, ws)
    for nd in lab.nodes:
        np.testing.assert_allclose(nd.done[51].vector, mean(xs, ws), atol=1e-5)
        assert not nd.drops and nd.host.held.count == 0


def test_the_deadline_waits_one_floor_for_a_binding_in_flight() -> None:
    """While unbound data waits for its binding, the phase deadline waits up to one floor_s more than for
    silence: a binding that comes in that time still counts, one that comes later does not."""
    floor = 0.4
    xs, ws = inputs(3, 20 * PER)

    def run(**kw: Any) -> Lab:
        lab = Lab(3, **kw)
        lab.start(0.0, 61, [0, 1, 2], xs, ws, floor_s=floor)
        lab.run()
        return lab

    silent = run(drop=lambda d: (d.src, d.dst) == (1, 0))  # nothing of node 1's reaches node 0
    t_silent = silent.nodes[0].done[61].stats.reduce_scatter.ended_at
    never = run(bind_at={(1, 0): INF})  # it reaches node 0 but is never bound there
    st = never.nodes[0].done[61].stats.reduce_scatter
    assert st.ended_by == "deadline" and t_silent < st.ended_at <= t_silent + floor + 1e-9
    assert never.nodes[0].drops["unbound"] > 0 and never.nodes[0].host.held.count == 0
    both = [silent.nodes[0].done[61].vector, never.nodes[0].done[61].vector]
    np.testing.assert_array_equal(both[0], both[1])  # node 1 averaged out alike

    in_time = run(bind_at={(1, 0): (t_silent + st.ended_at) / 2})
    in_time.check(61, xs, ws)
    np.testing.assert_allclose(in_time.nodes[0].done[61].vector, mean(xs, ws), atol=1e-5)
    assert not in_time.nodes[0].drops

    # too late for the reduce-scatter (node 1 is averaged out of node 0's shard), in time for the all-gather
    too_late = run(bind_at={(1, 0): st.ended_at + 0.01})
    done = too_late.nodes[0].done[61]
    assert done.stats.reduce_scatter.silent == (1,) and not done.stats.all_gather.silent
    a, b = Layout(len(xs[0]), 3, PER).shard(0)
    np.testing.assert_array_equal(done.vector[a:b], both[0][a:b])
    np.testing.assert_allclose(done.vector[b:], in_time.nodes[0].done[61].vector[b:], atol=1e-5)


# ---- members that are silent, strangers, hostile volumes ----------------------------------------------


def test_a_member_that_never_sends_is_averaged_out_at_a_finite_deadline() -> None:
    xs, ws = inputs(4, 24 * PER)
    lab = Lab(4)
    lab.start({0: 0.0, 1: 0.0, 2: None, 3: 0.0}, 71, [0, 1, 2, 3], xs, ws, floor_s=0.3, max_phase_s=5.0)
    lab.run()
    live = [0, 1, 3]
    want = mean([xs[i] for i in live], [ws[i] for i in live])
    layout = Layout(len(xs[0]), 4, PER)
    for i in live:
        done = lab.nodes[i].done[71]
        assert done.stats.reduce_scatter.ended_by == "deadline" and 2 in done.stats.reduce_scatter.silent
        assert done.stats.all_gather.ended_at < 5.0
        for owner in live:
            a, b = layout.shard(owner)
            np.testing.assert_allclose(done.vector[a:b], want[a:b], atol=1e-5)
        a, b = layout.shard(2)
        np.testing.assert_array_equal(done.vector[a:b], xs[i][a:b])  # the silent owner's shard: own values
    # what the others sent to node 2, which never started, is held there and freed on its timer
    assert lab.nodes[2].drops["held"] > 0 and lab.nodes[2].host.held.count == 0


def test_a_report_from_a_non_member_moves_nothing() -> None:
    """HostNode 3 is not in group 81 and claims total loss on node 0's path: dropped; members' REPORTs count."""
    xs, ws = inputs(3, 200 * PER)
    lab = Lab(4)
    lab.start(0.0, 81, [0, 1, 2], xs, ws, floor_s=0.3)
    fields = {"group": 81, "phase": 0, "expected": 500, "received": 0, "bytes": 0, "seconds": 0.01,
              "kernel_drops": 0, "position": 500}
    rates = []
    lab.at(0.005, lambda: rates.append(lab.nodes[0].host.pacer.rate))
    lab.at(0.006, lambda: lab.net.send(3, 0, fields, 100))
    lab.at(0.017, lambda: rates.append(lab.nodes[0].host.pacer.rate))
    lab.run()
    assert rates[0] == rates[1] and lab.nodes[0].drops["report"] == 1
    assert lab.nodes[0].verdicts  # the members' own REPORTs reached the pacer
    assert all(lab.nodes[0].verdicts[k].verdict.action != "decrease" for k in range(len(lab.nodes[0].verdicts)))
    for nd in lab.nodes[:3]:
        np.testing.assert_allclose(nd.done[81].vector, mean(xs, ws), atol=1e-5)


def test_held_data_stays_within_its_bounds_under_a_flood() -> None:
    """A member invents tokens and group ids: what is held stays under the total and per-token caps, old
    buckets go first, remembered bindings and the per-group token cache stay bounded."""
    body = pack_data(1, 10, 0, 1.0, np.ones(PER, np.float32))
    size = len(body) + ENTRY_OVERHEAD
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU, held=HeldData(max_bytes=50 * size, max_token_bytes=8 * size),
                         max_bindings=64)
    drops: Counter[str] = Counter()
    for k in range(2000):
        group, token = 1000 + k % 37, 5000 + k % 13
        b = pack_data(group, 10, 0, 1.0, np.ones(PER, np.float32))
        host.receive_data(None, token, RS_DATA, b, k * 1e-3)
        for a in host.take_actions():
            if isinstance(a, Dropped):
                drops[a.reason] += a.count
        assert host.held.nbytes <= 50 * size
        assert all(v <= 8 * size for v in host.held._token_bytes.values())
    assert drops["held"] >= 2000 - 50
    assert host.held.count == 50
    for t in range(1000):
        host.receive_bind(t, bytes([t % 251]) * 32, 3.0)
    assert len(host._bound) == 64
    # one member's many tokens: the group's token cache stays within 4 per member
    peers = [b"a" * 32, b"b" * 32]
    host.start(7, peers, 0, np.zeros(4 * PER, np.float32), 1.0, 3.0)
    rs = pack_data(7, 2, 0, 1.0, np.ones(PER, np.float32))  # member 1's first range of shard 0
    for t in range(100):
        host.receive_data(peers[1], 90_000 + t, RS_DATA, rs, 3.0)
    assert len(host._groups[7].by_token) <= 8
    # and the held data of everything else expires on time
    host.handle_timer(3.0 + host.held.max_age_s + 2.1)
    assert host.take_actions() and host.held.count == 0 and host.held.nbytes == 0


def test_host_refuses_what_no_group_takes() -> None:
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    big = pack_data(1, 10, 0, 1.0, np.ones(PER + 1, np.float32))
    with pytest.raises(Exception, match="bytes"):
        host.receive_data(None, 1, RS_DATA, big, 0.0)
    assert host.held.count == 0
    host.start(3, [b"a" * 32, b"b" * 32], 0, np.zeros(4 * PER, np.float32), 1.0, 0.0)
    rs = pack_data(3, 2, 0, 1.0, np.ones(PER, np.float32))
    with pytest.raises(Exception, match="not in this group"):
        host.receive_data(b"z" * 32, 9, RS_DATA, rs, 0.0)
    with pytest.raises(ValueError, match="already averaging"):
        host.start(3, [b"a" * 32, b"b" * 32], 0, np.zeros(4, np.float32), 1.0, 0.0)
    with pytest.raises(ValueError, match="distinct"):
        host.start(4, [b"a" * 32, b"a" * 32], 0, np.zeros(4, np.float32), 1.0, 0.0)


def test_send_shape() -> None:
    assert send_shape(1200, True) == (54, 864)  # 64 KB GSO sends, ~1 MB blocks
    assert send_shape(1200, False) == (16, 864)
    assert send_shape(9000, True) == (7, 112)
    assert send_shape(600, True) == (64, 1728)  # (at most 64 segments a GSO send)


@pytest.mark.parametrize(("rate", "gso", "rows"), [
    (12.08e6, True, 10),  # 100 Mbit/s: 1 ms of it, not a whole 64 KB GSO send (5 ms)
    (6e6, True, 5),
    (2e6, True, 2),  # (startup: at least MIN_PART)
    (0.25e6, True, 2),
    (125e6, True, 54),  # 1 Gbit/s: one whole GSO send
    (700e6, True, 540),  # loopback: as many whole GSO sends as fit in 1 ms (one reservation, not ten)
    (12.08e6, False, 10),
    (125e6, False, 96),
])
def test_a_paced_send_carries_about_a_millisecond_of_the_rate(rate: float, gso: bool, rows: int) -> None:
    host = AveragingHost(max_body=1200 - 37, mtu=1200, pacer=Pacer(rate))
    part, _ = send_shape(1200, gso)
    block = SendBlock(1, 1, b"b" * 32, RS_DATA, np.zeros((432, 8), np.uint8), part)
    assert host.part_rows(block) == rows


def test_held_data_is_expired_by_the_timer_it_asks_for() -> None:
    """A timer set for ``get_timer()`` finds the bucket expired even where ``now - max_age_s`` rounds below
    the bucket's arrival time (here (t + 10) - 10 < t): a driver looping on the timer would spin at that
    instant (under trio's MockClock: forever)."""
    t = 0.13436424411240122
    assert (t + 10.0) - 10.0 < t
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    host.receive_data(None, 5, RS_DATA, pack_data(1, 10, 0, 1.0, np.ones(PER, np.float32)), t)
    actions = host.take_actions()
    timers = [a for a in actions if isinstance(a, HeldTimer)]
    assert timers == [HeldTimer(host.get_timer())]
    host.handle_timer(timers[0].at)
    assert host.take_actions() == [Dropped("held", 1)]
    assert host.get_timer() is None


def test_a_report_counts_only_what_was_sent() -> None:
    """A receiver that gave up on a phase reports positions this node never sent as lost: the host cuts the
    REPORT down to what it sent before the pacer sees it, so a clean path is not taken for a congested one;
    loss within what was sent still counts, with the send span of those positions."""
    a, b = b"a" * 32, b"b" * 32

    class Recording(Pacer):
        def receive_report(self, dest, report, sent_span, placed, now):  # type: ignore[override]
            seen.append((dest, report, sent_span))
            return super().receive_report(dest, report, sent_span, placed, now)

    seen: list = []

    def report(received: int) -> Report:
        seen.clear()
        host = AveragingHost(max_body=HEADER_SIZE + 4, mtu=HEADER_SIZE + 41, pacer=Recording())
        host.start(5, [a, b], 0, np.zeros(400, np.float32), 1.0, 0.0)
        sent = 0
        for blk in host.datagrams_to_send(0.0, 100, group_id=5):
            if blk.to == 1 and blk.type == RS_DATA:
                sent += len(blk.bodies)
                host.pace(blk, len(blk.bodies), blk.bodies.size, 0.01 * sent / 100)
        assert sent == 200
        fields = {"group": 5, "phase": 0, "expected": 1000, "received": received, "bytes": received * 80,
                  "seconds": 0.05, "kernel_drops": 0, "position": 1000}
        host.take_actions()  # (the Bind to b)
        host.receive_report(b, fields, 0.1)
        (out,) = host.take_actions()
        assert isinstance(out, PacerVerdict)
        ((dest, rep, span),) = seen
        assert dest == b and span is not None and 0.0 <= span[0] <= span[1] <= 0.02
        return rep

    rep = report(200)  # all it sent arrived: 800 "lost" positions were never sent
    assert (rep.expected, rep.received, rep.position) == (200, 200, 200)
    rep = report(100)  # half of what it sent was lost
    assert (rep.expected, rep.received, rep.position) == (200, 100, 200)


def test_protected_tokens_are_those_of_the_running_groups_members() -> None:
    """The receive pass never sheds these (issue 11): the tokens bound to a member of a running group, not an
    outsider's (an attacker's session is as known as a member's); a finished group's members stay protected for
    RECENT_MEMBER_S (the next average's data comes before it starts here)."""
    a, b, c, outsider = (bytes([i]) * 32 for i in b"abcz")
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU, recent_groups=1)
    host.receive_bind(11, b, 0.0)
    host.receive_bind(99, outsider, 0.0)
    assert host.protected_tokens(0.0) == {}
    host.start(3, [a, b], 0, np.zeros(4 * PER, np.float32), 1.0, 0.0)
    assert host.protected_tokens(0.0) == {11: None}
    assert host.protected_tokens(0.0) is host.protected_tokens(0.0)  # the pass may keep it until something changes
    host.receive_bind(12, b, 0.1)  # b's next token
    host.start(4, [a, c], 0, np.zeros(4 * PER, np.float32), 1.0, 0.0)
    host.receive_bind(13, c, 0.2)
    assert host.protected_tokens(0.2) == {11: None, 12: None, 13: None}
    host.finish(3, 0, 1.0)
    assert host.protected_tokens(1.0) == {11: None, 12: None, 13: None}  # 3 is recent, 4 runs
    host.finish(4, 0, 2.0)
    assert host.protected_tokens(2.0) == {11: None, 12: None, 13: None}
    assert host.protected_tokens(1.0 + RECENT_MEMBER_S) == {13: None}  # b's group ended RECENT_MEMBER_S ago
    host.start(5, [a, outsider], 0, np.zeros(4 * PER, np.float32), 1.0, 70.0)
    host.finish(5, 0, 71.0)
    assert host.protected_tokens(71.0) == {99: None}


def test_a_member_stays_protected_however_many_other_groups_end_between_its_averages() -> None:
    """A node that averages in a side run too (the soak's daemon 3: a 2-member group every second) ends several
    groups between two of its main run's; counted by groups, the main run's members fell out of the protected set
    before their next average, whose first data was then shed under a flood (an honest round inexact)."""
    a, b, side = (bytes([i]) * 32 for i in b"abs")
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    host.receive_bind(11, b, 0.0)
    host.receive_bind(21, side, 0.0)
    host.start(1, [a, b], 0, np.zeros(4 * PER, np.float32), 1.0, 0.0)
    host.finish(1, 0, 0.5)
    for k in range(2 * RECENT_GROUPS):  # the side run's groups, one a second
        host.start(100 + k, [a, side], 0, np.zeros(4 * PER, np.float32), 1.0, 1.0 + k)
        host.finish(100 + k, 0, 1.5 + k)
    assert host.protected_tokens(2.0 + 2 * RECENT_GROUPS) == {11: None, 21: None}


def test_tokens_holding_data_for_a_group_not_started_here_are_protected() -> None:
    """A group that started elsewhere first sends its data before it starts here: with no group running here,
    the low shedding depth cut exactly that data (issue 11, round 3: every datagram shed in a 4-peer bench).
    Tokens holding data are protected while they hold it, and not once it is delivered or expired."""
    a, b = b"a" * 32, b"b" * 32
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    host.receive_bind(11, b, 0.0)
    assert host.protected_tokens(0.0) == {}
    body = pack_data(7, 2, 0, 1.0, np.ones(PER, np.float32))  # member 1's first range of shard 0
    host.receive_data(b, 11, RS_DATA, body, 0.0)
    host.receive_data(None, 12, RS_DATA, body, 0.0)  # a token not bound yet
    assert host.protected_tokens(0.0) == {11: None, 12: None}
    host.start(7, [a, b], 0, np.zeros(4 * PER, np.float32), 1.0, 0.1)  # 11's data delivered; 12's still waits
    assert host.protected_tokens(0.1) == {11: None, 12: None}
    host.receive_bind(12, b, 0.2)
    assert host.protected_tokens(0.2) == {11: None, 12: None}  # both bound to a running group's member now
    host.finish(7, 0, 1.0)
    assert host.protected_tokens(1.0) == {11: None, 12: None}  # (7 is a recent group)
    host.receive_data(None, 13, RS_DATA, pack_data(8, 2, 0, 1.0, np.ones(PER, np.float32)), 2.0)
    assert host.protected_tokens(2.0) == {11: None, 12: None, 13: None}
    host.handle_timer(2.0 + host.held.max_age_s + 1)
    assert host.protected_tokens(2.0 + host.held.max_age_s + 1) == {11: None, 12: None}


def test_a_report_carries_the_arrival_time_only_while_the_senders_latest_data_is_its_groups() -> None:
    """The socket stamps each source's latest data, whatever its group. Once the sender has moved on to another
    group (arc-topk's next phase, the next average), that stamp is a later datagram's: a REPORT of the earlier
    group carries 0 (unknown), or the sender's pacer would read the gap as a growing queue."""
    me, sender = b"a" * 32, b"b" * 32
    ranges = 40  # the sender's reduce-scatter stream to this node: enough for a REPORT

    def reported(moved_on: bool) -> float:
        host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
        host.start(3, [me, sender], 0, np.zeros(2 * ranges * PER, np.float32), 1.0, 0.0)
        host.start(4, [me, sender], 0, np.zeros(2 * ranges * PER, np.float32), 1.0, 0.0)
        for k in range(ranges):
            host.receive_data(sender, 9, RS_DATA, pack_data(3, ranges, k * PER, 1.0, np.ones(PER, np.float32)), 0.01)
        if moved_on:
            host.receive_data(sender, 9, RS_DATA, pack_data(4, ranges, 0, 1.0, np.ones(PER, np.float32)), 0.02)
        (rep,) = host.reports(3, 0, 1.0, arrivals=[0.0, 1234.5])
        assert rep.fields["position"] == ranges
        return rep.fields["arrived"]

    assert reported(moved_on=False) == 1234.5
    assert reported(moved_on=True) == 0.0


def test_a_finished_groups_stage_and_kept_shard_serve_the_next_group_of_the_same_size() -> None:
    """Averages of one size back to back: the next group's stage and its owner's kept shard (Repair.keep_shard) both
    come from the spares the last group handed back, so neither faults in fresh pages."""
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    stage, kept = np.empty(4000, np.float32), np.empty(1000, np.float32)  # a group of 4: the stage and one shard
    host._keep_spare(stage, kept)
    assert host._take_spare(4000) is stage
    assert host._take_spare(1000) is kept
    assert host._take_spare(1000) is None
