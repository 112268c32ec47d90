"""The sans-I/O all-reduce core over the one in-memory network with exact loss patterns and virtual time.

The expected results are computed independently of the core: from the inputs and the network's own log
of which data bodies it delivered, by the reconstruction rule of protocol/allreduce.md.
"""

from __future__ import annotations

import re
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.allreduce import (
    COMPLETION,
    DEADLINE,
    END_REPEATS,
    HEADER_SIZE,
    GroupAverage,
    Layout,
    Outcome,
    elements_per_datagram,
    pack_data,
    pack_end,
    parse_header,
    peek_group,
)
from peerd.allreduce.frames import pack_nack, parse_nack
from peerd.allreduce.group import GROUP_OPTIONS
from peerd.allreduce.robust import Robust
from peerd.wire.errors import WireError

from .support.groups import (  # noqa: E402
    AG_DATA,
    AG_END,
    GROUP,
    RS_DATA,
    RS_END,
    GroupNet,
    Wire,
    deliver,
    expected_results,
    inputs,
    payload_for,
)

PROTOCOL_MD = Path(__file__).resolve().parents[1] / "protocol" / "allreduce.md"




# ---- the in-test network ---------------------------------------------------------------------------------






def make_group(xs: list[np.ndarray], ws: list[float], per: int, **kw) -> list[GroupAverage]:
    return [
        GroupAverage(GROUP, len(xs), i, xs[i], ws[i], 0.0, options=replace(GROUP_OPTIONS, **kw),
                     max_payload=payload_for(per)) for i in range(len(xs))
    ]




def check_results(members: list[GroupAverage], xs, ws, per, net: GroupNet) -> None:
    exp, exact = expected_results(xs, ws, per, net.delivered)
    scale = max((float(np.abs(x).max()) for x in xs if len(x)), default=1.0) or 1.0
    stack = np.stack(xs) if len(xs[0]) else None
    for i, core in enumerate(members):
        got = core.result()
        assert got.dtype == np.float32 and got.shape == xs[i].shape
        np.testing.assert_allclose(got, exp[i], rtol=0, atol=2e-6 * scale)
        np.testing.assert_array_equal(got[exact[i]], exp[i][exact[i]].astype(np.float32))
        if stack is not None:  # convex hull of the inputs
            assert np.all(got >= stack.min(axis=0) - 2e-6 * scale)
            assert np.all(got <= stack.max(axis=0) + 2e-6 * scale)


# ---- exact averages, deterministic loss patterns ---------------------------------------------------------


@pytest.mark.parametrize("shares", [None, (4, 4, 4, 0), (0, 8, 0, 8), (2, 2, 2, 6)])  # (capped members: shards.py)
def test_no_loss_exact_weighted_mean(shares):
    xs, ws = inputs(4, 10007, weights=[1.0, 7.0, 32.0, 3.5])
    m = make_group(xs, ws, per=97, shares=shares)
    net = GroupNet(m)
    net.run()
    mean = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)
    for core in m:
        np.testing.assert_allclose(core.result(), mean, rtol=0, atol=1e-6 * np.abs(mean).max())
        s = core.statistics()
        for ph in (s.reduce_scatter, s.all_gather):
            assert ph.ended_by == COMPLETION
            assert ph.datagrams_received == ph.datagrams_expected
            assert ph.weight_received == pytest.approx(ph.weight_expected)
            assert ph.silent == ()
        assert s.drops == {}
    assert net.max_body <= payload_for(97)


def test_drop_every_kth_copy():
    xs, ws = inputs(5, 4000, seed=2)
    m = make_group(xs, ws, per=33)
    net = GroupNet(m, drop=lambda w: w.seq % 7 == 3)
    net.run()
    check_results(m, xs, ws, 33, net)
    missing = [(s, d, t, o) for s, d, t, o in net.delivered]
    assert len(missing) < sum(1 for w in net.sent_bodies if w.mtype in (RS_DATA, AG_DATA))


def test_drop_specific_ranges_averages_exactly_what_arrived():
    n, per = 3, 10
    xs, ws = inputs(n, 300, seed=3, weights=[2.0, 3.0, 5.0])
    layout = Layout(300, n, per)
    s0, _ = layout.shard(0)
    dropped = {(1, 0, s0), (2, 0, s0), (2, 0, s0 + per)}  # range 0 of shard 0: only the owner; range 1: 0 and 1
    m = make_group(xs, ws, per)
    net = GroupNet(m, drop=lambda w: w.mtype == RS_DATA and (w.src, w.dst, w.offset) in dropped)
    net.run()
    check_results(m, xs, ws, per, net)
    r = m[1].result()
    np.testing.assert_array_equal(r[s0 : s0 + per], xs[0][s0 : s0 + per])  # owner's own value, via all-gather
    want = (2.0 * xs[0][per : 2 * per].astype(np.float64) + 3.0 * xs[1][per : 2 * per]) / 5.0
    np.testing.assert_allclose(r[per : 2 * per], want, atol=1e-6 * 3)
    st0 = m[0].statistics().reduce_scatter
    assert st0.datagrams_expected - st0.datagrams_received == 3
    assert st0.weight_expected - st0.weight_received == pytest.approx(3.0 + 5.0 + 5.0)


def test_missing_all_gather_stream_keeps_own_values_and_ends_at_deadline():
    n, per = 4, 25
    xs, ws = inputs(n, 1000, seed=4)
    m = make_group(xs, ws, per, floor_s=0.5)
    net = GroupNet(m, drop=lambda w: w.src == 1 and w.dst == 0 and w.mtype in (AG_DATA, AG_END))
    net.run()
    check_results(m, xs, ws, per, net)
    a, b = Layout(1000, n, per).shard(1)
    np.testing.assert_array_equal(m[0].result()[a:b], xs[0][a:b])
    ag = m[0].statistics().all_gather
    assert ag.ended_by == DEADLINE and ag.silent == (1,)
    assert ag.duration_s is not None and ag.duration_s >= 0.5 + 0.5  # the all-gather waits one floor more
    assert all(c.statistics().all_gather.ended_by == COMPLETION for c in m[1:])


def test_an_owners_lag_is_waited_for_apart_from_the_network_silence():
    # a short (tuned) floor is the network's silence; the all-gather still allows owner_lag_s for an owner whose
    # reduce-scatter ends late (a loaded CPU), once, before giving up on its shard
    n, per = 4, 25
    xs, ws = inputs(n, 1000, seed=4)
    m = make_group(xs, ws, per, floor_s=0.25, owner_lag_s=2.0)
    net = GroupNet(m, drop=lambda w: w.src == 1 and w.dst == 0 and w.mtype in (AG_DATA, AG_END))
    net.run()
    ag = m[0].statistics().all_gather
    assert ag.ended_by == DEADLINE and ag.silent == (1,)
    assert ag.duration_s is not None and 2.0 + 0.25 <= ag.duration_s < 4.0
    with pytest.raises(ValueError):
        replace(GROUP_OPTIONS, owner_lag_s=float("nan"))


def test_silent_member_is_averaged_out_at_a_finite_deadline_with_floor():
    n, per, floor = 4, 40, 0.75
    xs, ws = inputs(n, 3000, seed=5)
    m = make_group(xs, ws, per, floor_s=floor)
    assert m[0].get_timer() == pytest.approx(0.0 + floor)  # no rate yet: the floor
    net = GroupNet(m, drop=lambda w: w.src == 3)
    net.run()
    check_results(m, xs, ws, per, net)
    mean012 = sum(ws[s] * xs[s].astype(np.float64) for s in range(3)) / sum(ws[:3])
    a3, _ = Layout(3000, n, per).shard(3)
    for i in range(3):
        np.testing.assert_allclose(m[i].result()[:a3], mean012[:a3], atol=1e-6 * 4 * 3)
        np.testing.assert_array_equal(m[i].result()[a3:], xs[i][a3:])
        rs = m[i].statistics().reduce_scatter
        assert rs.ended_by == DEADLINE and rs.silent == (3,)
        assert floor <= rs.duration_s < 10.0
        assert rs.weight_expected == pytest.approx(rs.weight_received)  # the silent weight is unknown


def test_deadline_formula_follows_the_observed_rate():
    n, per, floor, safety = 3, 10, 0.05, 2.0
    xs, ws = inputs(n, 300, seed=6)
    core = GroupAverage(GROUP, n, 0, xs[0], ws[0], 10.0, options=replace(GROUP_OPTIONS, floor_s=floor),
                        max_payload=payload_for(per), safety=safety)
    sender = GroupAverage(GROUP, n, 1, xs[1], ws[1], 10.0, max_payload=payload_for(per))
    bodies = [o for o in sender.datagrams_to_send(0.0, 1000) if o.to == 0 and o.type == RS_DATA]
    total = len(bodies)
    assert total == Layout(300, n, per).datagrams(0) == 10
    t = 10.0
    for o in bodies:
        t += 0.1
        assert core.receive(1, o.type, o.body, t) is Outcome.ACCEPTED
    # member 1's stream is complete; member 2 still owes `total`: rate = total / (t - t0)
    rate = total / (t - 10.0)
    assert core.get_timer() == pytest.approx(t + max(floor, safety * total / rate))
    assert not core.reduce_scatter_done
    core.handle_timer(t + 0.5)
    assert not core.reduce_scatter_done
    core.handle_timer(core.get_timer())
    assert core.statistics().reduce_scatter.ended_by == DEADLINE
    # a cap bounds it
    capped = GroupAverage(GROUP, n, 0, xs[0], ws[0], 0.0, options=replace(GROUP_OPTIONS, floor_s=5.0, max_phase_s=2.0),
                          max_payload=payload_for(per))
    assert capped.get_timer() == pytest.approx(2.0)


def test_end_markers_end_the_phase_early():
    n, per = 3, 20
    xs, ws = inputs(n, 600, seed=7)
    m = make_group(xs, ws, per, floor_s=5.0)
    layout = Layout(600, n, per)

    def last_range(w: Wire) -> bool:  # the last DATA datagram of every stream of both phases
        a, b = layout.shard(w.dst if w.mtype == RS_DATA else w.src)
        return (
            w.mtype in (RS_DATA, AG_DATA)
            and w.offset == a + (layout.datagrams(w.dst if w.mtype == RS_DATA else w.src) - 1) * per
        )

    net = GroupNet(m, drop=last_range)
    net.run()
    check_results(m, xs, ws, per, net)
    for c in m:
        s = c.statistics()
        assert s.reduce_scatter.ended_by == COMPLETION and s.all_gather.ended_by == COMPLETION
        assert s.all_gather.ended_at < 1.0  # far before any 5 s floor
        assert s.reduce_scatter.datagrams_expected - s.reduce_scatter.datagrams_received == n - 1


def test_reorder_and_duplicates_change_nothing():
    xs, ws = inputs(4, 2500, seed=8)
    plain = make_group(xs, ws, per=31)
    GroupNet(plain).run()
    m = make_group(xs, ws, per=31)
    # data reordered by up to 50 ms; END markers (sent last) arrive after the jitter window, as they would
    # when reordering is small against a stream's length
    net = GroupNet(m, jitter=0.05, end_delay=0.05, dup=lambda w: w.seq % 3 == 0, seed=3)
    net.run()
    for a, b in zip(plain, m, strict=True):
        np.testing.assert_allclose(a.result(), b.result(), rtol=0, atol=1e-5)
        assert b.statistics().drops["duplicate"] > 0
    check_results(m, xs, ws, 31, net)


def test_end_overtaking_data_loses_the_data_behind_it():
    """An END that overtakes its stream's data closes the stream: what arrives later is late and lost."""
    xs, ws = inputs(3, 900, seed=13)
    m = make_group(xs, ws, per=10)
    net = GroupNet(m, jitter=0.05, seed=4)
    net.run(allow_late=True)
    check_results(m, xs, ws, 10, net)
    assert sum(c.statistics().drops.get("late", 0) for c in m) > 0


def test_remove_member_stops_waiting():
    xs, ws = inputs(3, 90, seed=9)
    m = make_group(xs, ws, per=10, floor_s=100.0)
    core = m[0]
    for o in m[1].datagrams_to_send(0.0, 1000):
        if o.to == 0:
            core.receive(1, o.type, o.body, 0.5)
    assert not core.reduce_scatter_done
    core.remove_member(2, 0.6)
    assert core.reduce_scatter_done and core.statistics().reduce_scatter.ended_by == COMPLETION
    assert all(o.to == 1 for o in core.datagrams_to_send(0.0, 1000))
    with pytest.raises(ValueError):
        core.remove_member(0, 0.7)


def test_a_removed_members_data_is_late_and_never_summed():
    """remove_member before its data came (a member out of a split round's later parts): what it sends is
    late, whole blocks included, and the owner's shard is the other members' mean."""
    xs, ws = inputs(3, 90, seed=4)
    m = make_group(xs, ws, per=10, floor_s=100.0)
    core = m[0]
    core.remove_member(2, 0.1)
    from2 = [o for o in m[2].datagrams_to_send(0.0, 1000) if o.to == 0 and o.type == RS_DATA]
    assert core.receive(2, RS_DATA, from2[0].body, 0.2) is Outcome.LATE
    assert core.receive_block(2, RS_DATA, np.stack([np.frombuffer(o.body, np.uint8) for o in from2[1:]]), 0.2) is None
    for o in m[1].datagrams_to_send(0.0, 1000):
        if o.to == 0:
            core.receive(1, o.type, o.body, 0.3)
    assert core.reduce_scatter_done and core.statistics().drops == {"late": 1}
    core.remove_member(1, 0.4)  # (no all-gather wanted here: the result is ready)
    lo, hi = core.layout.shard(0)
    exact = (ws[0] * xs[0][lo:hi].astype(np.float64) + ws[1] * xs[1][lo:hi]) / (ws[0] + ws[1])
    assert np.abs(core.result()[lo:hi] - exact).max() < 1e-5


def test_inplace_matches_out_of_place():
    xs, ws = inputs(3, 1234, seed=10)
    drop = lambda w: w.seq % 5 == 1  # noqa: E731
    a = make_group(xs, ws, per=16)
    GroupNet(a, drop=drop).run()
    copies = [x.copy() for x in xs]
    b = [GroupAverage(GROUP, 3, i, copies[i], ws[i], 0.0, max_payload=payload_for(16), out=copies[i]) for i in range(3)]
    GroupNet(b, drop=drop).run()
    for i in range(3):
        assert b[i].result() is copies[i]
        np.testing.assert_array_equal(a[i].result(), copies[i])


# ---- edge cases ------------------------------------------------------------------------------------------


def test_single_member_is_its_own_result():
    x = np.arange(10, dtype=np.float32)
    core = GroupAverage(GROUP, 1, 0, x, 3.0, 0.0)
    assert core.result_ready and core.get_timer() is None
    assert core.datagrams_to_send(0.0, 10) == []
    assert core.finished
    np.testing.assert_array_equal(core.result(), x)


@pytest.mark.parametrize("length", [0, 1, 3, 4])
def test_vector_shorter_than_group(length):
    xs, ws = inputs(5, length, seed=11)
    m = make_group(xs, ws, per=2)
    net = GroupNet(m)
    net.run()
    check_results(m, xs, ws, 2, net)


@pytest.mark.parametrize("weight", [0, 0.0, -1.0, float("nan"), float("inf"), 1e39, "x", None])
def test_bad_weight_is_a_value_error(weight):
    with pytest.raises(ValueError, match="weight"):
        GroupAverage(GROUP, 2, 0, np.zeros(4, np.float32), weight, 0.0)


def test_bad_construction():
    v = np.zeros(4, np.float32)
    with pytest.raises(ValueError):
        GroupAverage(GROUP, 2, 2, v, 1.0, 0.0)
    with pytest.raises(ValueError):
        GroupAverage(2**32, 2, 0, v, 1.0, 0.0)
    with pytest.raises(ValueError):
        GroupAverage(GROUP, 2, 0, v, 1.0, 0.0, max_payload=HEADER_SIZE + 3)
    with pytest.raises(ValueError):
        GroupAverage(GROUP, 2, 0, v.reshape(2, 2), 1.0, 0.0)
    with pytest.raises(ValueError):
        GroupAverage(GROUP, 2, 0, v, 1.0, 0.0, out=v[:3].copy())
    assert elements_per_datagram(1163) == 286
    assert elements_per_datagram(10**6) == 65535


def test_float64_input_is_converted():
    xs = [np.arange(7, dtype=np.float64), np.ones(7)]
    m = [GroupAverage(GROUP, 2, i, xs[i], 1.0, 0.0, max_payload=payload_for(3)) for i in range(2)]
    GroupNet(m).run()
    np.testing.assert_allclose(m[0].result(), (xs[0] + xs[1]) / 2)


def test_nan_and_inf_do_not_crash():
    """Non-finite own values stay (the caller's problem); another member's are refused, range by range, in
    both phases: shard 0 is [0, 3) in ranges [0, 2), [2, 3); shard 1 is [3, 6) in [3, 5), [5, 6)."""
    xs = [np.array([np.nan, 1, np.inf, -np.inf, 2, 3], np.float32), np.array([1, np.inf, 1, np.inf, 2, 3], np.float32)]
    m = make_group(xs, [1.0, 1.0], per=2)
    GroupNet(m).run()
    r0, r1 = m[0].result(), m[1].result()
    # member 0 owns [0, 3): member 1's [1, inf] is refused, its [1] at 2 is taken (own inf stays inf)
    assert np.isnan(r0[0]) and r0[1] == 1 and r0[2] == np.inf
    # member 1 owns [3, 6): member 0's [-inf, 2] is refused; its all-gather [inf, 2] is refused at member 0,
    # which keeps its own [-inf, 2]
    np.testing.assert_array_equal(r1[3:], [np.inf, 2, 3])
    np.testing.assert_array_equal(r0[3:], [-np.inf, 2, 3])
    np.testing.assert_array_equal(r1[:3], xs[1][:3])  # owner 0's averages hold NaN and inf: refused at 1
    assert m[0].statistics().refused == {"nonfinite": 2}  # an RS range and an AG range
    assert m[1].statistics().refused == {"nonfinite": 3}  # an RS range and two AG ranges


# ---- drops and malformed bodies --------------------------------------------------------------------------


def two_members(per: int = 4, length: int = 20):
    xs, ws = inputs(2, length, seed=12)
    return make_group(xs, ws, per), xs, ws


def first_body(core: GroupAverage, mtype: int) -> bytes:
    return next(o.body for o in core.datagrams_to_send(0.0, 1000) if o.type == mtype)


def test_other_group_and_unknown_sender_are_counted_not_raised():
    (a, b), _, _ = two_members()
    body = first_body(b, RS_DATA)
    other = struct.pack("<I", GROUP ^ 1) + body[4:]
    assert a.receive(1, RS_DATA, other, 0.0) is Outcome.OTHER_GROUP
    assert a.receive(2, RS_DATA, body, 0.0) is Outcome.UNKNOWN_SENDER
    assert a.receive(0, RS_DATA, body, 0.0) is Outcome.UNKNOWN_SENDER
    assert a.receive(-1, RS_DATA, body, 0.0) is Outcome.UNKNOWN_SENDER
    assert a.receive(1, RS_DATA, body, 0.0) is Outcome.ACCEPTED
    assert a.receive(1, RS_DATA, body, 0.0) is Outcome.DUPLICATE
    assert a.statistics().drops == {"group": 1, "sender": 3, "duplicate": 1}
    assert a.statistics().reduce_scatter.datagrams_received == 1
    assert peek_group(other) == GROUP ^ 1
    with pytest.raises(WireError):
        peek_group(b"\x01\x02")


def mutate(body: bytes, fmt_offset: int, fmt: str, value) -> bytes:
    b = bytearray(body)
    struct.pack_into(fmt, b, fmt_offset, value)
    return bytes(b)


def test_malformed_bodies_raise_wire_error_and_are_counted():
    (a, b), _, _ = two_members(per=4, length=20)  # shard 0 of member 0: [0, 10) in ranges of 4, 4, 2
    outs = b.datagrams_to_send(0.0, 1000)
    good, second = [o.body for o in outs if o.type == RS_DATA][:2]
    end = next(o.body for o in outs if o.type == RS_END)
    assert a.receive(1, RS_DATA, second, 0.0) is Outcome.ACCEPTED  # a's view of member 1's weight is set
    cases = [
        (RS_DATA, good[:10]),  # shorter than the header
        (RS_DATA, good + b"\0\0\0\0"),  # longer than count says
        (RS_DATA, mutate(good, 4, "<B", 5)),  # unknown codec (5..255 reserved)
        (RS_DATA, mutate(good, 5, "<I", 4)),  # wrong stream length
        (RS_DATA, mutate(good, 9, "<I", 1)),  # not a range boundary
        (RS_DATA, mutate(good, 9, "<I", 12)),  # outside the receiver's shard
        (RS_DATA, mutate(mutate(good, 9, "<I", 8), 13, "<H", 4)[:-8]),  # last range claims 4 elements
        (RS_DATA, mutate(good, 15, "<f", 0.0)),  # weight 0
        (RS_DATA, mutate(good, 15, "<f", float("nan"))),
        (RS_DATA, mutate(good, 15, "<f", 99.0)),  # weight differs from the sender's
        (RS_END, mutate(end, 15, "<f", 99.0)),
        (RS_DATA, mutate(good, 13, "<H", 0)[:HEADER_SIZE]),  # data with no values
        (RS_END, mutate(end, 9, "<I", 4)),  # END offset not the shard start
        (RS_END, end + b"\0\0\0\0"),
        (AG_DATA, mutate(good, 9, "<I", 12)),  # AG data must lie in the sender's shard... of the right length
        (AG_END, mutate(end, 15, "<f", -1.0)),
    ]
    for i, (mtype, body) in enumerate(cases):
        with pytest.raises(WireError) as e:
            a.receive(1, mtype, body, 0.0)
        assert e.value.reason == "malformed", (i, e.value)
    with pytest.raises(WireError) as e:
        a.receive(1, 0x45, good, 0.0)
    assert e.value.reason == "type"
    with pytest.raises(WireError) as e:  # a known codec, not this group's (fp16 bytes would even fit the size)
        a.receive(1, RS_DATA, mutate(good, 4, "<B", 1), 0.0)
    assert e.value.reason == "codec"
    assert a.statistics().drops == {"malformed": len(cases), "type": 1, "codec": 1}
    assert a.receive(1, RS_DATA, good, 0.0) is Outcome.ACCEPTED  # still works


def test_late_bodies_are_dropped_and_counted():
    (a, b), _, _ = two_members()
    outs = b.datagrams_to_send(0.0, 1000)
    a.handle_timer(100.0)  # b silent: a's reduce-scatter ends by deadline
    assert a.statistics().reduce_scatter.ended_by == DEADLINE
    data = next(o for o in outs if o.type == RS_DATA)
    end = next(o for o in outs if o.type == RS_END)
    assert a.receive(1, data.type, data.body, 100.1) is Outcome.LATE
    assert a.receive(1, end.type, end.body, 100.1) is Outcome.LATE
    s = a.statistics()
    assert s.drops == {"late": 1} and s.ends_ignored == 1


# ---- golden vectors (protocol/allreduce.md) -------------------------------------------------------------


def golden_from_spec() -> dict[str, bytes]:
    text = PROTOCOL_MD.read_text()
    block = re.search(r"```golden\n(.*?)```", text, re.S)
    assert block, "protocol/allreduce.md has no golden block"
    out = {}
    for line in block.group(1).strip().splitlines():
        name, *hexes = line.split()
        out[name] = bytes.fromhex("".join(hexes))
    return out


def test_golden_vectors_match_the_spec_byte_for_byte():
    golden = golden_from_spec()
    assert golden["RS_DATA"].hex() == "040302010002000000020000000200000040400000404000008040"
    x0 = np.array([1, 2, 3, 4, 5], np.float32)
    x1 = np.array([10, 20, 30, 40, 50], np.float32)
    m0 = GroupAverage(0x01020304, 2, 0, x0, 3.0, 0.0, max_payload=27)
    m1 = GroupAverage(0x01020304, 2, 1, x1, 1.0, 0.0, max_payload=27)
    out0 = m0.datagrams_to_send(0.0, 100)
    assert out0[0].type == RS_DATA and out0[0].to == 1 and out0[0].body == golden["RS_DATA"]
    rs_end = next(o for o in out0 if o.type == RS_END)
    assert rs_end.body == golden["RS_END"] and rs_end.repeat == END_REPEATS == 3
    deliver(out0, m1, 0)
    out1 = m1.datagrams_to_send(0.0, 100)
    ag = [o for o in out1 if o.type == AG_DATA]
    assert ag[0].body == golden["AG_DATA"]
    assert next(o for o in out1 if o.type == AG_END).body == golden["AG_END"]
    assert pack_data(0x01020304, 2, 2, 3.0, x0[2:4]) == golden["RS_DATA"]
    assert pack_end(0x01020304, 2, 2, 3.0) == golden["RS_END"]
    h = parse_header(RS_DATA, golden["RS_DATA"])
    assert (h.group, h.codec, h.total, h.offset, h.count, h.weight) == (0x01020304, 0, 2, 2, 2, 3.0)
    deliver(out1, m0, 1)
    deliver(m0.datagrams_to_send(0.0, 100), m1, 0)
    for core in (m0, m1):
        np.testing.assert_array_equal(core.result(), [3.25, 6.5, 9.75, 13, 16.25])


def test_golden_repair_vectors_match_the_spec_byte_for_byte():
    """Member 0 of the golden group loses member 1's AG range [4, 5): it asks for it (AG_NACK), gets it, and is
    done (AG_DONE); both end on the loss-free result."""
    golden = golden_from_spec()
    x0 = np.array([1, 2, 3, 4, 5], np.float32)
    x1 = np.array([10, 20, 30, 40, 50], np.float32)
    opts = replace(GROUP_OPTIONS, repair_rounds=2)
    m0 = GroupAverage(0x01020304, 2, 0, x0, 3.0, 0.0, max_payload=27, options=opts)
    m1 = GroupAverage(0x01020304, 2, 1, x1, 1.0, 0.0, max_payload=27, options=opts)
    for o in m0.datagrams_to_send(0.0, 100):
        m1.receive(0, o.type, o.body, 0.0)
    for o in m1.datagrams_to_send(0.0, 100):
        if not (o.type == AG_DATA and o.body[9:13] == b"\x04\x00\x00\x00"):
            m0.receive(1, o.type, o.body, 0.0)
    out0 = m0.datagrams_to_send(0.0, 100)
    nacks = [o.body for o in out0 if o.type == 0x44]
    assert nacks == [golden["AG_NACK"]] and pack_nack(0x01020304, 1, 2, 1, b"\x01") == golden["AG_NACK"]
    assert parse_nack(golden["AG_NACK"], 2).missing.tolist() == [1]
    for o in out0:
        m1.receive(0, o.type, o.body, 0.0)
    for o in m1.datagrams_to_send(0.0, 100):
        m0.receive(1, o.type, o.body, 0.0)
    done = [o.body for o in m0.datagrams_to_send(0.0, 100) if o.type == 0x44]
    assert done == [golden["AG_DONE"]] == [pack_nack(0x01020304, 0, 2, 0)]
    for core in (m0, m1):
        np.testing.assert_array_equal(core.result(), [3.25, 6.5, 9.75, 13, 16.25])


# ---- properties ------------------------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 6))
    length = draw(st.integers(0, 5000))
    per = draw(st.integers(max(1, length // 150), 400))
    weights = draw(st.lists(st.floats(0.01, 1e4), min_size=n, max_size=n))
    p = draw(st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    silent = draw(st.sets(st.integers(0, n - 1), max_size=max(0, n - 1)))
    return n, length, per, weights, p, seed, silent


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_loss_result_equals_independent_computation(sc):
    n, length, per, ws, p, seed, silent = sc
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(length) * 10).astype(np.float32) for _ in range(n)]
    drop_rng = np.random.default_rng(seed + 1)
    m = make_group(xs, ws, per, floor_s=0.2)
    net = GroupNet(m, drop=lambda w: w.src in silent or drop_rng.random() < p, jitter=0.002, seed=seed)
    net.run(allow_late=True)  # jitter lets END markers overtake data: that data is then late and lost
    check_results(m, xs, ws, per, net)
    for c in m:
        s = c.statistics()
        assert s.reduce_scatter.datagrams_received <= s.reduce_scatter.datagrams_expected
        assert s.all_gather.datagrams_received <= s.all_gather.datagrams_expected
        assert s.reduce_scatter.ended_by in (COMPLETION, DEADLINE)


@st.composite
def garbage(draw):
    mtype = draw(st.sampled_from([RS_DATA, RS_END, AG_DATA, AG_END, 0x00, 0x44, 0xFF]))
    kind = draw(st.sampled_from(["random", "mutated", "truncated", "header"]))
    return mtype, kind, draw(st.binary(max_size=80)), draw(st.integers(0, 200)), draw(st.integers(-2, 4))


@settings(max_examples=300, deadline=None)
@given(garbage())
def test_garbage_only_ever_raises_wire_error(g):
    mtype, kind, blob, pos, sender = g
    (a, b), _, _ = two_members(per=4, length=20)
    valid = [o.body for o in b.datagrams_to_send(0.0, 100)] + [first_body(a, RS_DATA)]
    base = valid[pos % len(valid)]
    if kind == "random":
        body = blob
    elif kind == "mutated":
        arr = bytearray(base)
        for k, v in enumerate(blob[:8]):
            arr[(pos + 7 * k) % len(arr)] ^= v
        body = bytes(arr)
    elif kind == "truncated":
        body = base[: pos % (len(base) + 1)]
    else:
        body = struct.pack("<I", GROUP) + blob[:15].ljust(15, b"\0") + blob[15:]
    for target in (a, b):
        try:
            outcome = target.receive(sender, mtype, body, 0.0)
        except WireError as e:
            assert e.reason in ("malformed", "type", "codec")  # codec: a mutated codec byte names another one
        else:
            assert isinstance(outcome, Outcome)
        target.handle_timer(50.0)
        target.datagrams_to_send(0.0, 100)
    for target in (a, b):
        target.handle_timer(100.0)
        target.handle_timer(200.0)
        assert target.result_ready
        target.result()


def test_unbiased_under_independent_loss():
    """x_s = g + noise_s; with 10 % independent loss of every copy, the mean error over seeds -> 0.

    Fixed seeds, so it cannot flake; the tolerance is > 5 standard errors of the quantity checked, and the
    same data shows a clear bias for the naive estimator (missing ranges counted as zeros)."""
    n, length, per, seeds = 4, 600, 20, 60
    g = (1.0 + 0.1 * np.random.default_rng(99).standard_normal(length)).astype(np.float64)
    ws = [1.0, 2.0, 3.0, 4.0]
    err_sum = np.zeros(length)
    naive_sum = np.zeros(length)
    for seed in range(seeds):
        rng = np.random.default_rng(1000 + seed)
        xs = [(g + rng.standard_normal(length)).astype(np.float32) for _ in range(n)]
        m = make_group(xs, ws, per, floor_s=0.2)
        net = GroupNet(m, drop=lambda w, r=rng: r.random() < 0.10)
        net.run()
        for j in range(n):  # the owners' averages: the reduce-scatter estimator
            a, b = j * length // n, (j + 1) * length // n
            err_sum[a:b] += m[j].result()[a:b] - g[a:b]
            for off in range(a, b, per):
                e = min(off + per, b)
                arrived = [j] + [s for s in range(n) if s != j and (s, j, RS_DATA, off) in net.delivered]
                naive_sum[off:e] += sum(ws[s] * xs[s][off:e] for s in arrived) / sum(ws) - g[off:e]
        # and every member's full result is an unbiased estimate of g as well
        assert abs(float(np.mean([c.result() for c in m]) - g.mean())) < 0.2
    bias = err_sum / seeds
    # per element: noise of the weighted mean has sd ~ sqrt(sum w^2)/sum w ~ 0.55; over 60 seeds ~ 0.07
    assert abs(bias.mean()) < 0.02  # sd of this mean over 600 elements ~ 0.003
    assert np.sqrt(np.mean(bias**2)) < 0.12  # pure noise gives ~ 0.07-0.08
    assert (naive_sum / seeds).mean() < -0.05  # power: the naive estimator is off by ~ -0.075


def test_each_member_starts_on_the_member_after_it():
    """Member i sends its reduce-scatter blocks to i + 1, i + 2, ... (mod n) in turn, so at every turn each
    member receives one sender's block: in index order every sender began on member 0, and the lab's downlinks
    that two or three senders shared at once queued ~9 ms (peerd bench allreduce --link 100mbit)."""
    n, per = 4, 8
    xs = [np.arange(4000, dtype=np.float32) + i for i in range(n)]
    m = make_group(xs, [1.0] * n, per)
    orders = [[b.to for b in core.blocks_to_send(5, 10**6) if b.type == RS_DATA] for core in m]
    for i, order in enumerate(orders):
        assert order[: 2 * (n - 1)] == [(i + d) % n for d in range(1, n)] * 2
    turns = min(len(o) for o in orders)
    assert turns >= 3 * (n - 1)
    for turn in range(turns):
        assert sorted(o[turn] for o in orders) == list(range(n)), turn


def test_a_members_contributions_go_before_its_average():
    """Member 0's shard is final (member 1's whole contribution arrived) while its own contribution is still to
    go: its contribution goes first, as member 1's shard waits for it and its own average waits for nobody. (The
    average first, a member a little behind the others sent all of it before its last contributions, and the three
    others waited that long: `peerd bench step --link 10mbit`, one round in two 1.7 s instead of 1.2 s.)"""
    n, per = 2, 8
    xs = [np.arange(4000, dtype=np.float32) + i for i in range(n)]
    a, b = make_group(xs, [1.0] * n, per)
    deliver([o for o in b.datagrams_to_send(0.0, 10**6) if o.type in (RS_DATA, RS_END)], a, 1)
    assert a.ag_frontier() > 0  # (its average could go now)
    types = [blk.type for blk in a.blocks_to_send(5, 10**6)]
    assert RS_DATA in types and AG_DATA in types
    assert max(i for i, t in enumerate(types) if t == RS_DATA) < min(i for i, t in enumerate(types) if t == AG_DATA)


def test_large_vector_is_vectorized():
    """1M floats, 2 members, default payload: must be quick (no per-element Python work)."""
    length = 1 << 20
    xs = [np.full(length, 1.0, np.float32), np.full(length, 4.0, np.float32)]
    m = [GroupAverage(GROUP, 2, i, xs[i], [1.0, 2.0][i], 0.0) for i in range(2)]
    first = m[0].datagrams_to_send(0.0, 10)  # lazy: a small batch is a small amount of work
    assert len(first) == 10 and all(len(o.body) == HEADER_SIZE + 4 * 286 for o in first)
    for o in first:
        m[1].receive(0, o.type, o.body, 0.0)
    pending = True
    while pending:
        pending = False
        for i, core in enumerate(m):
            for o in core.datagrams_to_send(0.0, 4096):
                pending = True
                m[o.to].receive(i, o.type, o.body, 0.0)
    for core in m:
        assert core.finished
        np.testing.assert_allclose(core.result(), 3.0, rtol=1e-6)


# ---- the all-gather overlaps the reduce-scatter ----------------------------------------------------------


def _note_first_all_gather(core: GroupAverage, first: dict[int, float]) -> None:
    """Record when ``core`` first hands out all-gather data (``first[core.index]``)."""
    take = core.datagrams_to_send

    def noted(now: float, limit: int):
        out = take(now, limit)
        if any(o.type == AG_DATA for o in out):
            first.setdefault(core.index, now)
        return out

    core.datagrams_to_send = noted  # type: ignore[method-assign]


def test_all_gather_of_final_ranges_goes_before_the_reduce_scatter_ends():
    xs, ws = inputs(4, 4 * 80 * 8, weights=[1.0, 2.0, 3.0, 4.0])
    m = make_group(xs, ws, per=8, overlap=True)
    first: dict[int, float] = {}
    for core in m:
        _note_first_all_gather(core, first)
    net = GroupNet(m, gap=1e-3)
    net.run()
    check_results(m, xs, ws, 8, net)
    for core in m:  # its first ranges were final, and went out, long before its reduce-scatter phase ended
        assert first[core.index] < core.phase_state(0)[1] - 0.1
        assert core.statistics().drops == {}


def test_pipelined_average_under_loss_is_exactly_what_arrived():
    rng = np.random.default_rng(5)
    lost = {(s, d, off) for s in range(4) for d in range(4) for off in range(0, 4 * 80 * 8, 8) if rng.random() < 0.1}
    xs, ws = inputs(4, 4 * 80 * 8, seed=3)
    m = make_group(xs, ws, per=8, overlap=True)
    net = GroupNet(m, gap=1e-3, drop=lambda w: w.mtype in (RS_DATA, AG_DATA) and (w.src, w.dst, w.offset) in lost)
    net.run()
    check_results(m, xs, ws, 8, net)


def _owner_and_bodies(per: int = 2, ranges: int = 40):
    """Member 0 of two (its shard: ``ranges`` ranges of ``per``) and the reduce-scatter bodies member 1 sends it."""
    xs, ws = inputs(2, 2 * ranges * per, seed=7, weights=[3.0, 1.0])
    a, b = make_group(xs, ws, per=per, overlap=True)
    bodies = [o.body for o in b.datagrams_to_send(0.0, 10_000) if o.type == RS_DATA and o.to == 0]
    assert len(bodies) == ranges
    return xs, a, bodies


def test_a_range_missing_below_later_ones_is_waited_for_and_summed_when_it_comes():
    """A datagram missing below later ones of its stream may be only late (a path that reorders): the all-gather
    goes no further than the ranges that arrived, and the late one, once in, is summed like the rest."""
    xs, a, bodies = _owner_and_bodies()
    for body in bodies[1:36]:  # range 0 overtaken by the ones after it
        assert a.receive(1, RS_DATA, body, 0.1) is Outcome.ACCEPTED
    assert not [o for o in a.datagrams_to_send(0.2, 10_000) if o.type == AG_DATA]
    assert a.receive(1, RS_DATA, bodies[0], 0.3) is Outcome.ACCEPTED
    ag = [o for o in a.datagrams_to_send(0.3, 10_000) if o.type == AG_DATA]
    assert ag and not a.reduce_scatter_done
    first = parse_header(AG_DATA, ag[0].body)
    assert first.offset == 0 and first.weight == 4.0  # both members' weights reached range 0
    assert max(parse_header(AG_DATA, o.body).offset for o in ag) == 31 * 2  # a block (AG_MIN_ROWS more: not yet)
    for body in bodies[36:]:
        a.receive(1, RS_DATA, body, 0.4)
    assert a.reduce_scatter_done and a.statistics().reduce_scatter.ended_by == COMPLETION
    assert a.statistics().drops == {}
    a.handle_timer(100.0)  # (nothing of the other shard comes)
    np.testing.assert_allclose(a.result()[:80], (3 * xs[0][:80].astype(np.float64) + xs[1][:80]) / 4, atol=1e-6)


def test_an_early_all_gather_block_is_as_large_as_the_reduce_scatters():
    """Members send a block per destination in turn; blocks of one size keep the turns in step across members, so
    an all-gather block going out while the reduce-scatter runs waits for a whole block of final ranges."""
    xs, a, bodies = _owner_and_bodies(ranges=140)
    for body in bodies[:50]:
        a.receive(1, RS_DATA, body, 0.1)
    first = a.blocks_to_send(64, 10_000)
    assert [len(b.bodies) for b in first if b.type == RS_DATA] == [64, 64, 12]  # its own contribution
    assert not [b for b in first if b.type == AG_DATA]  # 50 ranges final: AG_MIN_ROWS, not a block of 64
    for body in bodies[50:70]:
        a.receive(1, RS_DATA, body, 0.2)
    ag = [b for b in a.blocks_to_send(64, 10_000) if b.type == AG_DATA]
    assert [len(b.bodies) for b in ag] == [64] and not a.reduce_scatter_done
    for body in bodies[70:]:
        a.receive(1, RS_DATA, body, 0.3)
    assert a.reduce_scatter_done
    rest = [len(b.bodies) for b in a.blocks_to_send(64, 10_000) if b.type == AG_DATA]
    assert sum(rest) == 140 - 64 and max(rest) == 64  # once the phase ended, the rest whatever is final


def test_rows_for_final_ranges_in_a_block_are_not_summed_again_hostile():
    xs, a, bodies = _owner_and_bodies()
    for body in bodies[:36]:
        a.receive(1, RS_DATA, body, 0.1)
    before = [o for o in a.datagrams_to_send(0.2, 10_000) if o.type == AG_DATA]
    assert before
    # a member resends final ranges (forged values) inside a block with fresh ones: never summed into them
    forged = [mutate(bodies[k], HEADER_SIZE, "<f", 1e30) for k in (0, 2)] + [bodies[36]]
    block = np.frombuffer(b"".join(forged), np.uint8).reshape(3, -1)
    assert a.receive_block(1, RS_DATA, block, 0.3) is None  # body by body, then
    outcomes = [a.receive(1, RS_DATA, row.tobytes(), 0.3) for row in block]
    assert outcomes == [Outcome.DUPLICATE, Outcome.DUPLICATE, Outcome.ACCEPTED]
    for body in bodies[37:]:
        a.receive(1, RS_DATA, body, 0.4)
    assert a.reduce_scatter_done
    a.handle_timer(100.0)
    res = a.result()
    assert np.isfinite(res).all()
    np.testing.assert_allclose(res[:80], (3 * xs[0][:80].astype(np.float64) + xs[1][:80]) / 4, atol=1e-6)


def test_robust_averages_wait_for_the_whole_reduce_scatter():
    xs, ws = inputs(2, 2 * 40 * 2, seed=7, weights=[3.0, 1.0])
    a, b = make_group(xs, ws, per=2, robust=Robust("clip", 1.0), overlap=True)
    bodies = [o.body for o in b.datagrams_to_send(0.0, 10_000) if o.type == RS_DATA and o.to == 0]
    for body in bodies[1:36]:
        a.receive(1, RS_DATA, body, 0.1)
    assert not [o for o in a.datagrams_to_send(0.2, 10_000) if o.type == AG_DATA]


def test_without_overlap_the_all_gather_waits_for_the_reduce_scatter():
    xs, ws = inputs(2, 2 * 40 * 2, seed=7, weights=[3.0, 1.0])
    a, b = make_group(xs, ws, per=2, overlap=False)
    bodies = [o.body for o in b.datagrams_to_send(0.0, 10_000) if o.type == RS_DATA and o.to == 0]
    for body in bodies[1:36]:
        a.receive(1, RS_DATA, body, 0.1)
    assert not [o for o in a.datagrams_to_send(0.2, 10_000) if o.type == AG_DATA]


def test_a_phase_awaits_its_tail_once_at_most_tail_datagrams_are_left():
    """awaits_tail (the receive loop then reads at once, not letting data queue): true while at most
    TAIL_DATAGRAMS of the current receive phase are still to come, false mid-stream and once both phases ended."""
    from peerd.allreduce.phase import TAIL_DATAGRAMS

    per, stream = 10, TAIL_DATAGRAMS + 50
    xs, ws = inputs(2, 2 * per * stream, seed=3)
    a, b = make_group(xs, ws, per)
    rs = [o for o in b.datagrams_to_send(0.0, 10**6) if o.type == RS_DATA]
    assert len(rs) == stream and not a.awaits_tail
    tail_at = []
    for k, o in enumerate(rs):
        a.receive(1, o.type, o.body, 0.0)
        if a.awaits_tail and not tail_at:
            tail_at.append(k + 1)
    assert tail_at == [stream - TAIL_DATAGRAMS]
    net = GroupNet([a, b])
    net.run()
    assert a.finished and not a.awaits_tail and not b.awaits_tail


@pytest.mark.parametrize(("n", "c", "early"), [(2, 1e6, True), (2, 2.0, True), (2, 1.5, False), (3, 1e6, False)])
def test_of_two_members_robust_clip_that_cannot_bind_lets_the_all_gather_overlap(n, c, early):
    """Of two members a median is their mean: clipping at C >= 2 times it and the weight bound (2x) cannot bind,
    and the direction test needs three, so the owner averages as without robust and sends final ranges while its
    reduce-scatter runs; a C below 2, or a third member, keeps the wait for every contribution."""
    per, stream = 10, 200  # (an owner's all-gather goes a block of ranges at a time: more than one block)
    xs, ws = inputs(n, n * per * stream, seed=4)
    m = make_group(xs, ws, per, robust=Robust("clip", c))
    rs = [o for o in m[1].datagrams_to_send(0.0, 10**6) if o.type == RS_DATA and o.to == 0]
    for o in rs[: 3 * stream // 4]:
        m[0].receive(1, o.type, o.body, 0.0)
    sent = [o.type for o in m[0].datagrams_to_send(0.0, 10**6)]
    assert (AG_DATA in sent) is early
    if not early:
        return
    fresh = make_group(xs, ws, per, robust=Robust("clip", c))  # (the average of both, as without robust)
    GroupNet(fresh).run()
    mean = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)
    for core in fresh:
        np.testing.assert_allclose(core.result(), mean, rtol=0, atol=1e-6 * np.abs(mean).max())


@pytest.mark.parametrize("spread", [True, False])
def test_an_early_all_gather_passes_a_gap_that_later_data_has_outlived_by_the_grace(spread):
    """Overlapping owners send a range's average once every sender's datagram for it arrived or is lost. A datagram
    missing below later ones is taken for lost once the stream's later data has been arriving for the grace its
    END would get (5 ms on a path that keeps order): the ranges after it need not wait for the phase's end. Within
    the grace (everything at one instant) the gap holds them; a contribution for a range already sent is late."""
    per, stream = 10, 200
    xs, ws = inputs(2, 2 * per * stream, seed=6)
    m = make_group(xs, ws, per, end_grace_s=0.05)
    own = m[0].datagrams_to_send(0.0, 10**6)  # member 0's contributions all out: it only waits for final ranges
    assert AG_DATA not in {o.type for o in own}
    rs = [o for o in m[1].datagrams_to_send(0.0, 10**6) if o.type == RS_DATA]
    for k, o in enumerate(rs[:120]):
        if k != 5:
            m[0].receive(1, o.type, o.body, k * 1e-4 if spread else 0.0)
    sent = m[0].datagrams_to_send(0.012, 10**6)
    assert (AG_DATA in {o.type for o in sent}) is spread
    if spread:
        assert m[0].receive(1, RS_DATA, rs[5].body, 0.013) is Outcome.LATE
