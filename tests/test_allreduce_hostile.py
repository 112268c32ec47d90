"""Hostile or broken members (every member holds the swarm key): what a shard owner, the averaging host and
its driver refuse, cap and bound. Core scenarios run the sans-I/O GroupAverage over the in-test network of
test_allreduce_core; host scenarios feed AveragingHost directly; driver scenarios run AllreduceService over
the in-memory network in virtual time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import trio
import trio.testing

from peerd.allreduce import HEADER_SIZE, GroupAverage, Layout, pack_data
from peerd.allreduce.frames import pack_block
from peerd.allreduce.group import DEFAULT_MAX_WEIGHT, GROUP_OPTIONS
from peerd.allreduce.held import ENTRY_OVERHEAD, HeldData
from peerd.allreduce.host import RECENT_GROUPS, AveragingHost, Dropped, PacerVerdict
from peerd.allreduce.options import AverageOptions
from peerd.allreduce.service import AllreduceService
from peerd.tools.faults import byzantine
from peerd.transport.pacing import Pacer, Report
from peerd.wire.errors import WireError

from .support.allreduce_nodes import AllreduceNode
from .support.groups import AG_DATA, GROUP, RS_DATA, GroupNet, payload_for
from .support.host_lab import MAX_BODY, MTU, PER
from .support.memnet import MemNet

F32_MAX = float(np.finfo(np.float32).max)


def group(xs, ws, per: int = 16, **kw) -> list[GroupAverage]:
    return [GroupAverage(GROUP, len(xs), i, xs[i], ws[i], 0.0, options=replace(GROUP_OPTIONS, **kw),
                         max_payload=payload_for(per))
            for i in range(len(xs))]


def honest(n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(length).astype(np.float32) for _ in range(n)]


# ---- the owner's checks (core) ------------------------------------------------------------------------


def test_a_huge_weight_is_capped() -> None:
    """Member 0 claims weight 3e38: it caps its own at its max_weight (the default 2**24 travels), and the
    owners of the other shards cap that at theirs."""
    xs = honest(3, 300)
    ws = [3e38, 2.0, 5.0]
    m = group(xs, ws, max_weight=100.0)
    m[0] = GroupAverage(GROUP, 3, 0, xs[0], ws[0], 0.0, max_payload=payload_for(16))
    GroupNet(m).run()
    capped = [100.0, 2.0, 5.0]
    want = sum(w * x.astype(np.float64) for w, x in zip(capped, xs, strict=True)) / sum(capped)
    layout = Layout(300, 3, 16)
    for core in m:
        assert core.statistics().refused == {"weight_capped": 1}  # own at member 0, a sender's elsewhere
        for owner in (1, 2):
            a, b = layout.shard(owner)
            np.testing.assert_allclose(core.result()[a:b], want[a:b], atol=1e-5)
    a, b = layout.shard(0)
    assert m[0].statistics().all_gather.weight_received > 0
    own_capped = [DEFAULT_MAX_WEIGHT, 2.0, 5.0]
    want0 = sum(w * x.astype(np.float64) for w, x in zip(own_capped, xs, strict=True)) / sum(own_capped)
    np.testing.assert_allclose(m[1].result()[a:b], want0[a:b], atol=1e-5)


def test_default_cap_is_2_to_the_24() -> None:
    xs = honest(2, 64)
    m = group(xs, [3e38, 1.0])
    GroupNet(m).run()
    want = (DEFAULT_MAX_WEIGHT * xs[0].astype(np.float64) + xs[1]) / (DEFAULT_MAX_WEIGHT + 1)
    np.testing.assert_allclose(m[1].result(), want, rtol=1e-6)


def test_finite_input_never_gives_a_non_finite_result() -> None:
    """Capped weights times the largest finite float32 overflow a float32 sum: the owner sums that block
    again in float64, and the result is the (finite) weighted mean."""
    n, length = 4, 200
    xs = [np.full(length, F32_MAX * (1 - 0.1 * i), np.float32) for i in range(n)]
    xs[3][:50] = -F32_MAX
    ws = [float(2**24)] * n
    m = group(xs, ws)
    GroupNet(m).run()
    want = sum(x.astype(np.float64) for x in xs) / n
    for core in m:
        r = core.result()
        assert np.isfinite(r).all()
        np.testing.assert_allclose(r, want, rtol=1e-6)


def test_a_nan_member_is_refused_everywhere_and_the_rest_average() -> None:
    xs = honest(4, 400, seed=1)
    ws = [1.0, 2.0, 3.0, 4.0]
    m = group(xs, ws)
    m[2] = byzantine("nan")(GROUP, 4, 2, xs[2], ws[2], 0.0, max_payload=payload_for(16))
    GroupNet(m).run()
    layout = Layout(400, 4, 16)
    rest = [0, 1, 3]
    want = sum(ws[i] * xs[i].astype(np.float64) for i in rest) / sum(ws[i] for i in rest)
    for i, core in enumerate(m):
        r = core.result()
        assert np.isfinite(r).all()
        for owner in rest:
            a, b = layout.shard(owner)
            np.testing.assert_allclose(r[a:b], want[a:b], atol=1e-5)
        if i != 2:
            assert core.statistics().refused["nonfinite"] == layout.datagrams(i)  # every range member 2 sent
    # member 2's own shard stays honest: everyone gets the mean of all four there
    a, b = layout.shard(2)
    full = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)
    np.testing.assert_allclose(m[0].result()[a:b], full[a:b], atol=1e-5)


@pytest.mark.parametrize("as_block", [False, True])
def test_a_non_finite_all_gather_range_keeps_own_values(as_block: bool) -> None:
    """A bad owner's all-gather with NaN is dropped at the member (body by body or as a GRO block), which
    keeps its own values for that range; the finite ranges of the same block are taken."""
    per, length = 4, 16
    xs = honest(2, length, seed=2)
    for inplace in (False, True):
        vec = xs[0].copy()
        core = GroupAverage(GROUP, 2, 0, vec, 1.0, 0.0, max_payload=payload_for(per),
                            out=vec if inplace else None)
        # member 1 owns [8, 16) in ranges of 4: its all-gather, the second range poisoned
        avg = np.arange(8, dtype=np.float32)
        avg[5] = np.nan
        block = pack_block(GROUP, 2, 8, np.full(2, 2.0, np.float32), avg.reshape(2, per))
        if as_block:
            assert core.receive_block(1, AG_DATA, block, 0.0) is None  # declined: fed body by body
        for row in block:
            core.receive(1, AG_DATA, bytes(row), 0.0)
        for k in range(2):  # and member 1's reduce-scatter of shard 0, so the group can end
            core.receive(1, RS_DATA, pack_data(GROUP, 2, 4 * k, 1.0, xs[1][4 * k : 4 * k + 4]), 0.0)
        while not core.finished:
            core.datagrams_to_send(0.0, 64)
            core.handle_timer(100.0)
        r = core.result()
        np.testing.assert_array_equal(r[8:12], avg[:4])
        np.testing.assert_array_equal(r[12:16], xs[0][12:16])
        assert core.statistics().refused == {"nonfinite": 1}
        assert not core.statistics().complete  # a range kept the own values: not the group's common result


def test_bad_max_weight_is_a_value_error() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e39, "x"):
        with pytest.raises(ValueError, match="max_weight"):
            GroupAverage(GROUP, 2, 0, np.zeros(4, np.float32), 1.0, 0.0, options=replace(GROUP_OPTIONS, max_weight=bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="byzantine"):
        byzantine("evil")


def test_byzantine_modes_corrupt_only_what_is_sent() -> None:
    xs = honest(2, 64, seed=3)
    for mode in ("scale", "signflip", "random"):
        m = group(xs, [1.0, 1.0], per=8)
        m[0] = byzantine(mode)(GROUP, 2, 0, xs[0], 1.0, 0.0, max_payload=payload_for(8))
        GroupNet(m).run()
        a, b = 32, 64  # shard 1, owned by the honest member 1: corrupted input
        sent = 2 * m[1].result()[a:b] - xs[1][a:b]
        if mode == "scale":
            np.testing.assert_allclose(sent, 1000 * xs[0][a:b], rtol=1e-4)
        elif mode == "signflip":
            np.testing.assert_allclose(sent, -xs[0][a:b], atol=1e-5)
        else:
            assert np.std(sent) > 30 * np.std(xs[0])
        np.testing.assert_allclose(m[0].result()[:32], (xs[0][:32] + xs[1][:32]) / 2, atol=1e-6)  # own: honest


# ---- held data (sans-I/O) ------------------------------------------------------------------------------


def test_held_data_is_bounded_per_token_in_total_and_in_time() -> None:
    body = 1000
    size = body + ENTRY_OVERHEAD
    h = HeldData(max_bytes=10 * size, max_token_bytes=4 * size, max_age_s=10.0)
    assert all(h.add(1, 7, ("a", i), body, 0.0) == (True, 0) for i in range(4))
    assert h.add(1, 7, ("a", 4), body, 0.0) == (False, 0)  # token 7 is full
    for i in range(6):
        assert h.add(2, 8 + i, ("b", i), body, 1.0 + i)[0]
    assert h.nbytes == 10 * size
    held, dropped = h.add(3, 99, ("c", 0), body, 7.0)  # over the total: the oldest bucket (group 1) goes
    assert held and dropped == 4 and h.count == 7 and not h.holds(1)
    assert h.next_expiry() == 11.0
    assert h.expire(11.5) == 1  # group 2's first bucket
    assert h.pop(2, 9) == [("b", 1)]
    assert h.pop_group(2) == [("b", i) for i in range(2, 6)]
    assert h.expire(1e9) == 1 and h.count == 0 and h.nbytes == 0 and h.next_expiry() is None


def test_held_data_refuses_a_body_larger_than_the_caps() -> None:
    h = HeldData(max_bytes=1000, max_token_bytes=1000)
    assert h.add(1, 1, "x", 2000, 0.0) == (False, 0)
    assert h.count == 0


def test_a_token_whose_held_data_goes_unused_is_no_longer_protected_hostile() -> None:
    """A member floods data for groups that never start here, under tokens of its own (bound to minted ids). Were
    its tokens protected for holding that data, none of its datagrams would ever be shed, and the receive queue
    filled behind them to the full shedding depth (`peerd bench soak`: a 36 MB queue, an honest round's data past
    its deadline). Its first bucket to expire unused ends its token's protection, for as long as its held data keeps
    going unused and ``max_age_s`` after; a running group's members, and an honest member's data held for a group
    about to start here, keep theirs meanwhile."""
    me, b, c, minted = (bytes([i]) * 32 for i in b"abcz")
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU)
    age = host.held.max_age_s
    host.receive_bind(11, b, 0.0)
    host.receive_bind(12, c, 0.0)
    host.receive_bind(50, minted, 0.0)
    host.start(3, [me, b], 0, np.zeros(4 * PER, np.float32), 1.0, 0.0)

    def flood(at: float) -> None:
        host.receive_data(minted, 50, RS_DATA, pack_data(1000 + int(at * 10), 2, 0, 1.0, np.ones(PER, np.float32)),
                          at)

    flood(0.0)
    assert host.protected_tokens(0.0) == {11: None, 50: None}  # nothing of it has gone unused yet
    t = 0.0
    while t < age + 2:  # the flood goes on; its first bucket expires at ``age``
        t = round(t + 0.5, 1)
        flood(t)
        host.handle_timer(t)
    assert 50 in host.held.tokens()
    assert host.protected_tokens(t) == {11: None}  # the running group's member only
    host.receive_data(c, 12, RS_DATA, pack_data(9, 2, 0, 1.0, np.ones(PER, np.float32)), t)  # c's next group
    assert host.protected_tokens(t) == {11: None, 12: None}  # (its held data has not gone unused)
    host.start(9, [me, c], 0, np.zeros(4 * PER, np.float32), 1.0, t + 0.1)  # and it is taken
    assert not host.held.wasting(12, t + 0.1)
    quiet = t + age  # the flood stopped at t: its last bucket expires at quiet, unused
    host.handle_timer(quiet)
    flood(quiet + 1)
    assert host.protected_tokens(quiet + 1) == {11: None, 12: None}
    assert host.protected_tokens(quiet + age + 0.1) == {11: None, 12: None, 50: None}  # forgiven after max_age_s


def test_held_data_pushed_out_by_a_flood_ends_its_tokens_protection_hostile() -> None:
    """A flood that fills the held data's bound pushes out the oldest buckets before any expires: that too ends the
    protection of the token whose data went unused."""
    size = MAX_BODY + ENTRY_OVERHEAD
    host = AveragingHost(max_body=MAX_BODY, mtu=MTU, held=HeldData(max_bytes=4 * size))
    minted = b"z" * 32
    host.receive_bind(50, minted, 0.0)
    body = np.ones((MAX_BODY - HEADER_SIZE) // 4, np.float32)
    for k in range(4):
        host.receive_data(minted, 50, RS_DATA, pack_data(100 + k, 2, 0, 1.0, body), 0.01 * k)
    assert host.protected_tokens(0.05) == {50: None}
    host.receive_data(minted, 50, RS_DATA, pack_data(200, 2, 0, 1.0, body), 0.05)  # pushes group 100's out
    assert host.held.count == 4
    assert host.protected_tokens(0.05) == {}


# ---- the driver ----------------------------------------------------------------------------------------


def test_reports_count_only_from_members_of_a_running_or_recent_group() -> None:
    """The host, fed REPORTs directly: a stranger, a non-member and a member naming another group change
    nothing; a member of a recent (finished) group still moves the pacer."""
    fields = {"group": 5, "phase": 0, "expected": 1000, "received": 0, "bytes": 0, "seconds": 0.1,
              "kernel_drops": 0, "position": 1000}
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    host = AveragingHost(max_body=HEADER_SIZE + 4, mtu=HEADER_SIZE + 41)  # one element per datagram
    rate = host.pacer.rate

    def report(peer: bytes, group: int, now: float) -> list:
        host.receive_report(peer, {**fields, "group": group}, now)
        return host.take_actions()

    assert report(b, 5, 0.0) == [Dropped("report")]  # no such group here: a stranger must not throttle us
    assert host.pacer.rate == rate and not host.pacer._sent and not host.pacer._hot and not host.pacer._caps
    host.start(5, [a, b], 0, np.zeros(2000, np.float32), 1.0, 0.0)
    host.take_actions()  # (the Bind to b)
    blocks = host.datagrams_to_send(0.0, 1000, group_id=5)
    assert sum(len(blk.bodies) for blk in blocks) >= 1000
    for blk in blocks:  # member 1's whole reduce-scatter stream goes out (and is paced)
        host.pace(blk, len(blk.bodies), blk.bodies.size, 0.0)
    host.finish(5, 0, 0.05)  # cancelled before it finished: still a recent group
    assert report(c, 5, 0.1) == [Dropped("report")]  # not a member of group 5
    assert report(b, 6, 0.1) == [Dropped("report")]  # a member, but of no group 6
    assert report(a, 5, 0.1) == [Dropped("report")]  # this node itself
    assert host.pacer.rate == rate
    out = report(b, 5, 0.1)  # a member of a recent group 5: its report reaches the pacer (pooled into the phase
    # its datagrams were sent in, judged once that phase ends: the pacer of ec7d2bc)
    assert len(out) == 1 and isinstance(out[0], PacerVerdict) and out[0].verdict.action in ("pooled", "decrease")
    for g in range(6, 6 + RECENT_GROUPS):  # four later groups push group 5 out of the recent ones
        host.start(g, [a, b], 0, np.zeros(10, np.float32), 1.0, 0.2)
        host.finish(g, 0, 0.2)
        host.take_actions()
    assert report(b, 5, 0.3) == [Dropped("report")]


def test_pacer_paths_are_bounded() -> None:
    p = Pacer(max_paths=8)
    for i in range(100):
        p.receive_report(i, Report(100, 100, 120_000, 0.01, 0, 100), None, 0.0, float(i))
        p.reserve(1200, i, float(i))
    assert len(p._sent) == 8 and len(p._hot) <= 8 and len(p._caps) <= 8
    assert list(p._sent) == list(range(92, 100))  # the least recently used went first


def test_held_data_expires_on_a_timer_and_oversized_bodies_are_not_held() -> None:
    async def main() -> None:
        net = MemNet()
        a, b = AllreduceNode(net, 0), AllreduceNode(net, 1)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            for node in (a, b):
                nursery.start_soon(node.endpoint.serve)
            bodies = [pack_data(77, 10, 286 * k, 1.0, np.ones(286, np.float32)) for k in range(10)]
            await b.endpoint.send_raw(a.addr, RS_DATA, bodies, node_id=a.endpoint.identity.node_id)
            await trio.sleep(1.0)
            held = a.service.host.held
            assert held.count == 10 and held.holds(77)
            await trio.sleep(10.0)  # nothing else arrives: the timer frees them
            assert held.count == 0 and held.nbytes == 0
            assert a.metrics.datagrams_dropped.labels("held")._value.get() == 10
            # a body larger than a's payload size fits no group of a's: dropped at once
            oversize = pack_data(78, 1, 0, 1.0, np.ones((a.endpoint.max_body - HEADER_SIZE) // 4 + 1, np.float32))
            with pytest.raises(WireError, match="malformed"):
                a.service.host.receive_data(None, 1, RS_DATA, oversize, trio.current_time())
            assert held.count == 0
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_service_counts_refused_contributions_and_caps_weights() -> None:
    """Four daemons over the in-memory network, one of them injecting NaN: the others' results are finite
    and their refusals show in contributions_refused; a weight over max_weight is capped."""
    n, size = 4, 4000
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    ws = [1.0, 2.0, 1e9, 4.0]
    results: dict[int, object] = {}
    nodes_out: list[AllreduceNode] = []

    async def main() -> None:
        net = MemNet(seed=5)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = [AllreduceNode(net, i) for i in range(n)]
            nodes[1].service = AllreduceService(nodes[1].endpoint, nodes[1].metrics, group_factory=byzantine("nan"))
            nodes_out.extend(nodes)
            for node in nodes:
                nursery.start_soon(node.endpoint.serve)
            members = [node.member() for node in nodes]

            async def one(i: int) -> None:
                results[i] = await nodes[i].service.average(
                    9, members, i, xs[i], ws[i], AverageOptions(floor_s=0.5, max_weight=None if i == 2 else 100.0))

            async with trio.open_nursery() as g:
                for i in range(n):
                    g.start_soon(one, i)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    layout = Layout(size, n, (nodes_out[0].endpoint.max_body - HEADER_SIZE) // 4)
    capped = [1.0, 2.0, 100.0, 4.0]  # member 2 sends 2**24 (its own default cap), the others cap it at 100
    rest = [0, 2, 3]
    want = sum(capped[i] * xs[i].astype(np.float64) for i in rest) / sum(capped[i] for i in rest)
    for i in (0, 3):
        r = results[i].vector  # type: ignore[attr-defined]
        assert np.isfinite(r).all()
        for owner in (0, 3):  # (owner 2 weighs itself 2**24)
            a, b = layout.shard(owner)
            np.testing.assert_allclose(r[a:b], want[a:b], atol=1e-5)
        mt = nodes_out[i].metrics.contributions_refused
        assert mt.labels("nonfinite")._value.get() == layout.datagrams(i)
        assert mt.labels("weight_capped")._value.get() == 1


@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_the_fault_injector_sends_what_a_member_holding_the_corrupted_vector_would_hostile(name: str) -> None:
    """The injector wraps the core from outside: its reduce-scatter bodies are, byte for byte, an honest core's
    for the negated vector (a codec's too: encoded from the corrupted values with the member's own draws)."""
    from peerd.compress import codec

    x = honest(1, 400, seed=7)[0]
    if name == "fp32":
        options, payload = GROUP_OPTIONS, payload_for(16)
    else:
        options, payload = replace(GROUP_OPTIONS, codec=codec(name), run=3), 400
    bad = byzantine("signflip")(GROUP, 2, 0, x, 1.0, 0.0, options=options, max_payload=payload)
    twin = GroupAverage(GROUP, 2, 0, -x, 1.0, 0.0, options=options, max_payload=payload)
    sent = [o.body for o in bad.datagrams_to_send(0.0, 1000) if o.type == RS_DATA]
    assert sent and sent == [o.body for o in twin.datagrams_to_send(0.0, 1000) if o.type == RS_DATA]
