"""The averaging core over compressed codecs (fp16, bf16, int8, int4; protocol/codecs.md), in virtual time with
exact loss patterns.

Expectations are computed from the inputs with peerd.compress directly and the network's log of which bodies
arrived, not from the core: each range's owner holds the weighted mean of exactly the decoded contributions
that arrived (its own exact, unquantized: it never travels), quantized again for the all-gather, and every
member that received a range holds the owner's bits.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.allreduce import HEADER_SIZE, GroupAverage, Layout, Outcome
from peerd.allreduce.group import GROUP_OPTIONS
from peerd.compress import PHASE_RS, Codec, RoundingKey, codec
from peerd.compress.quant import IntCodec
from peerd.wire.errors import WireError

from .support.codecs import BiasedInt
from .support.groups import AG_DATA, AG_END, RS_DATA, RS_END, GroupNet, deliver  # noqa: E402

GROUP = 0xC0DEC001
RUN = 0x5EED
CODECS = ["fp16", "bf16", "int8", "int4"]
REL = {"fp16": 2.0**-11, "bf16": 2.0**-8}  # half an ulp, relative: round to nearest even


def make(name: str, **params) -> Codec:
    return codec(name, **params) if name.startswith("int") else codec(name)


def group(xs: list[np.ndarray], ws: list[float], c: Codec, payload: int, run: int = RUN, gid: int = GROUP,
          **kw) -> list[GroupAverage]:
    return [GroupAverage(gid, len(xs), i, xs[i], ws[i], 0.0, options=replace(GROUP_OPTIONS, codec=c, run=run, **kw),
                         max_payload=payload)
            for i in range(len(xs))]


def inputs(n: int, length: int, seed: int) -> tuple[list[np.ndarray], list[float]]:
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(length) * (i + 1) + i).astype(np.float32) for i in range(n)]
    return xs, [float(w) for w in rng.integers(1, 50, n)]


def bodies_of(net: GroupNet, mtype: int) -> dict[tuple[int, int, int], bytes]:
    """(src, dst, offset) -> body of every DATA body of ``mtype`` sent (the first copy)."""
    return {(w.src, w.dst, w.offset): w.body for w in net.sent_bodies if w.mtype == mtype}


def error_bound(c: Codec, body: bytes, count: int, values: np.ndarray, nearest: bool) -> np.ndarray:
    """Per element: how far a decoded body may lie from what was encoded (half a step for nearest, a step for
    stochastic; the float codecs round to nearest even)."""
    if isinstance(c, IntCodec):
        step = c.step(body[HEADER_SIZE:], count).astype(np.float64)
        return step * (0.5 if nearest else 1.0) + 1e-6 * np.abs(values)
    return np.abs(values) * REL[c.name] + 2.0**-24


def check_group(members: list[GroupAverage], xs, ws, c: Codec, net: GroupNet, *, nearest: bool) -> int:
    """Every owner's ranges hold the weighted mean of exactly the decoded contributions that arrived (own
    exact), within the all-gather's rounding; every member that got a range holds the owner's bits, one that
    lost it its own values. Returns how many reduce-scatter contributions were lost (for the test's power)."""
    n, length = len(xs), len(xs[0])
    per = members[0].layout.per
    layout = Layout(length, n, per)
    rs, ag = bodies_of(net, RS_DATA), bodies_of(net, AG_DATA)
    w32 = [float(np.float32(w)) for w in ws]
    lost = 0
    for j in range(n):
        owner = members[j].result()
        for k in range(layout.datagrams(j)):
            off, cnt = layout.range(j, k)
            num = w32[j] * xs[j][off : off + cnt].astype(np.float64)
            den = w32[j]
            for s in range(n):
                if s == j:
                    continue
                if (s, j, RS_DATA, off) not in net.delivered:
                    lost += 1
                    continue
                num += w32[s] * c.decode(rs[(s, j, off)][HEADER_SIZE:], cnt).astype(np.float64)
                den += w32[s]
            exact = num / den
            got = owner[off : off + cnt]
            body = ag.get((j, (j + 1) % n, off)) if n > 1 else None
            if body is None:  # nothing sent (n = 1): the own values
                np.testing.assert_array_equal(got, xs[j][off : off + cnt])
                continue
            assert np.array_equal(got, c.decode(body[HEADER_SIZE:], cnt)), "owner keeps what its bodies decode to"
            bound = error_bound(c, body, cnt, exact, nearest) + 1e-6 * np.abs(exact).max()
            assert (np.abs(got - exact) <= bound).all(), float(np.max(np.abs(got - exact) - bound))
            for i in range(n):
                if i == j:
                    continue
                mine = members[i].result()[off : off + cnt]
                if (j, i, AG_DATA, off) in net.delivered:
                    assert np.array_equal(mine, got), "replicas agree bit for bit"
                else:
                    assert np.array_equal(mine, xs[i][off : off + cnt]), "a lost range keeps the own values"
    return lost


# ---- no loss: one result, within the codec's error of the exact weighted mean -------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_no_loss_every_member_holds_the_same_result(name):
    c = make(name)
    xs, ws = inputs(4, 20_011, seed=1)
    m = group(xs, ws, c, 1163)
    net = GroupNet(m)
    net.run()
    results = [core.result() for core in m]
    for r in results[1:]:
        assert np.array_equal(r, results[0])
    check_group(m, xs, ws, c, net, nearest=not c.stochastic)
    # the two steps together: the reduce-scatter rounding of each sender, then the all-gather's
    exact = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)
    if isinstance(c, IntCodec):
        spread = max(float(x.max() - x.min()) for x in xs)
        step = spread / c.levels  # a group's step is at most its range / L (then rounded up to fp16)
        assert np.abs(results[0] - exact).max() <= 2.05 * step
        assert 0 < np.sqrt(np.mean((results[0] - exact) ** 2)) < 0.6 * step
    else:
        scale = max(float(np.abs(x).max()) for x in xs)
        assert np.allclose(results[0], exact, rtol=0, atol=3 * REL[name] * scale)
    for core in m:
        s = core.statistics()
        assert s.drops == {} and s.refused == {}
        assert s.reduce_scatter.datagrams_received == s.reduce_scatter.datagrams_expected
        assert s.all_gather.datagrams_received == s.all_gather.datagrams_expected
    per = m[0].layout.per
    assert per == c.max_count(1163 - HEADER_SIZE)
    assert net.max_body == HEADER_SIZE + c.body_size(per) <= 1163


@pytest.mark.parametrize("name", CODECS)
def test_fewer_datagrams_than_fp32(name):
    c = make(name)
    xs, ws = inputs(3, 30_000, seed=2)
    coded, plain = group(xs, ws, c, 1163), group(xs, ws, codec("fp32"), 1163)
    sizes = []
    for m in (coded, plain):
        net = GroupNet(m)
        net.run()
        sizes.append(sum(len(w.body) for w in net.sent_bodies))
    assert sizes[0] / sizes[1] < {"fp16": 0.51, "bf16": 0.51, "int8": 0.27, "int4": 0.145}[name], sizes


# ---- loss: exactly what arrived -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,rounding", [("fp16", None), ("bf16", None), ("int8", "nearest"),
                                           ("int8", "stochastic"), ("int4", "nearest"), ("int4", "stochastic")])
def test_with_loss_each_range_is_the_mean_of_the_decoded_contributions_that_arrived(name, rounding):
    c = make(name, rounding=rounding) if rounding else make(name)
    xs, ws = inputs(4, 12_000, seed=3)
    rng = np.random.default_rng(4)
    m = group(xs, ws, c, 200, floor_s=0.3)
    net = GroupNet(m, drop=lambda w: w.mtype in (RS_DATA, AG_DATA) and rng.random() < 0.25)
    net.run()
    lost = check_group(m, xs, ws, c, net, nearest=rounding != "stochastic")
    assert lost > 20


def test_a_range_only_the_owner_reached_is_its_own_value_quantized_once():
    c = make("int8", rounding="nearest")
    xs, ws = inputs(3, 3000, seed=5)
    m = group(xs, ws, c, 300)
    s0, _ = m[0].layout.shard(0)
    net = GroupNet(m, drop=lambda w: w.mtype == RS_DATA and w.dst == 0 and w.offset == s0)
    net.run()
    cnt = m[0].layout.range(0, 0)[1]
    body = c.encode(xs[0][s0 : s0 + cnt], key=RoundingKey(RUN, GROUP, 0, 1), offset=s0)
    want = c.decode(body, cnt)
    for core in m:
        assert np.array_equal(core.result()[s0 : s0 + cnt], want)


def test_nearest_check_has_power():
    """The loss check above would fail if the owner averaged in a contribution that did not arrive: here the
    expectation is recomputed as if every contribution had arrived, and most lost ranges break the bound."""
    c = make("int8", rounding="nearest")
    xs, ws = inputs(4, 8000, seed=6)
    m = group(xs, ws, c, 400)
    net = GroupNet(m, drop=lambda w: w.mtype == RS_DATA and w.src == 1)
    net.run()
    everyone = set(net.delivered) | {(w.src, w.dst, RS_DATA, w.offset) for w in net.sent_bodies
                                     if w.mtype == RS_DATA}
    real = net.delivered
    net.delivered = everyone
    with pytest.raises(AssertionError):
        check_group(m, xs, ws, c, net, nearest=True)
    net.delivered = real
    check_group(m, xs, ws, c, net, nearest=True)


@pytest.mark.parametrize("name", CODECS)
def test_rounding_draws_are_keyed_by_run_group_member_and_phase(name):
    c = make(name)
    xs, ws = inputs(3, 4000, seed=7)
    runs = {}
    for run, gid in ((1, GROUP), (1, GROUP), (2, GROUP), (1, GROUP + 1)):
        m = group(xs, ws, c, 500, run=run, gid=gid)
        GroupNet(m).run()
        runs.setdefault((run, gid), []).append(m[0].result().copy())
    first = runs[(1, GROUP)]
    assert np.array_equal(first[0], first[1])  # the same key replays exactly
    if c.stochastic:
        assert not np.array_equal(first[0], runs[(2, GROUP)][0])
        assert not np.array_equal(first[0], runs[(1, GROUP + 1)][0])
    # a sender's reduce-scatter body is the codec's encode under (run, group, sender, phase 0)
    m = group(xs, ws, c, 500)
    out = [o for o in m[1].datagrams_to_send(0.0, 10) if o.type == RS_DATA]
    off, cnt = m[0].layout.range(out[0].to, 0)  # (its first destination: member 2, the next after it)
    assert out[0].body[HEADER_SIZE:] == c.encode(xs[1][off : off + cnt], key=RoundingKey(RUN, GROUP, 1, PHASE_RS),
                                                 offset=off)


# ---- stochastic rounding: the group average is unbiased across seeds --------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_stochastic_group_average_is_unbiased_and_biased_rounding_is_not(name):
    """The mean of many group averages (fresh run keys) converges to the exact weighted mean at the rate the
    spread of the averages predicts; the same test on nearest rounding (deterministic error) fails."""
    xs, ws = inputs(3, 1500, seed=8)
    exact = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)

    def estimates(c: Codec, rounds: int) -> np.ndarray:
        out = []
        for r in range(rounds):
            m = group(xs, ws, c, 600, run=1000 + r)
            GroupNet(m).run()
            out.append(m[r % 3].result().astype(np.float64))
        return np.stack(out)

    def z_score(est: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        err = est.mean(0) - exact
        sem = est.std(0, ddof=1) / np.sqrt(len(est))
        return float(err.sum() / np.sqrt((sem**2).sum())), err, sem

    z, err, sem = z_score(estimates(make(name), 120))
    assert abs(z) < 4.5, z
    # squared error over the variance the spread predicts, pooled over elements (an element at its group's
    # min may round the same way in every round: its own spread can be 0)
    assert np.mean(err**2) / np.mean(sem**2) < 1.4
    # the same test catches a rounding whose draws are 2 % short (measured: z = -17)
    zb, _, _ = z_score(estimates(BiasedInt(make(name).bits, 128), 120))  # type: ignore[attr-defined]
    assert zb < -8, zb
    # nearest rounding is deterministic: its error does not shrink with more rounds
    near = estimates(make(name, rounding="nearest"), 2)
    assert np.array_equal(near[0], near[1])
    assert np.abs(near[0] - exact).mean() > 3 * np.abs(err).mean()


# ---- what a member must refuse ---------------------------------------------------------------------------------


def two(name: str, length: int = 600, payload: int = 200) -> tuple[list[GroupAverage], list[np.ndarray]]:
    xs, ws = inputs(2, length, seed=9)
    return group(xs, ws, make(name), payload), xs


def corrupt(name: str, body: bytes) -> bytes:
    b = bytearray(body)
    if name == "int8" or name == "int4":
        b[HEADER_SIZE : HEADER_SIZE + 2] = np.float16(0.0).tobytes()  # the first group's scale
    elif name == "fp16":
        b[HEADER_SIZE : HEADER_SIZE + 2] = np.float16(np.inf).tobytes()
    else:
        b[HEADER_SIZE : HEADER_SIZE + 2] = (0x7FC0).to_bytes(2, "little")  # a bf16 NaN
    return bytes(b)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("mtype", [RS_DATA, AG_DATA])
def test_a_malformed_compressed_body_is_a_counted_drop(name, mtype):
    (a, b), _ = two(name)
    if mtype == AG_DATA:  # b's all-gather: b ends its reduce-scatter (a silent) and sends its shard
        b.handle_timer(100.0)
        a.handle_timer(100.0)
    body = next(o.body for o in b.datagrams_to_send(0.0, 1000) if o.type == mtype)
    with pytest.raises(WireError) as e:
        a.receive(1, mtype, corrupt(name, body), 100.0)
    assert e.value.reason == "malformed"
    assert a.statistics().drops == {"malformed": 1}
    assert a.receive(1, mtype, body, 100.0) is Outcome.ACCEPTED  # the range was not marked: the good one counts
    with pytest.raises(WireError):
        a.receive(1, mtype, body[:-1], 100.0)  # a body one byte short of its count
    assert a.statistics().drops == {"malformed": 2}


@pytest.mark.parametrize("name", CODECS)
def test_a_block_with_a_malformed_row_is_declined_and_counted_row_by_row(name):
    (a, b), _ = two(name, length=4000, payload=120)
    block = next(o.bodies for o in b.blocks_to_send(8, 100) if o.type == RS_DATA)
    bad = block.copy()
    bad[3] = np.frombuffer(corrupt(name, bytes(block[3])), np.uint8)
    assert a.receive_block(1, RS_DATA, bad, 0.0) is None  # nothing taken
    assert a.statistics().reduce_scatter.datagrams_received == 0
    for row in bad:
        try:
            a.receive(1, RS_DATA, bytes(row), 0.0)
        except WireError as e:
            assert e.reason == "malformed"
    assert a.statistics().drops == {"malformed": 1}
    assert a.statistics().reduce_scatter.datagrams_received == len(block) - 1
    (c, _d), _ = two(name, length=4000, payload=120)
    assert c.receive_block(1, RS_DATA, block, 0.0) == (len(block), 0, 0)


@pytest.mark.parametrize("mine,theirs", [("fp16", "int8"), ("int8", "int4"), ("fp32", "fp16"), ("int4", "fp32"),
                                         ("bf16", "fp16")])
def test_a_body_in_another_codec_is_a_counted_drop(mine, theirs):
    xs, ws = inputs(2, 2000, seed=10)
    a = group(xs, ws, make(mine), 300)[0]
    b = group(xs, ws, make(theirs), 300)[1]
    outs = b.datagrams_to_send(0.0, 1000)
    data = next(o.body for o in outs if o.type == RS_DATA)
    end = next(o.body for o in outs if o.type == RS_END)
    for body, mtype in ((data, RS_DATA), (end, RS_END)):
        with pytest.raises(WireError) as e:
            a.receive(1, mtype, body, 0.0)
        assert e.value.reason == "codec"
    b = group(xs, ws, make(theirs), 300)[1]
    block = next(o.bodies for o in b.blocks_to_send(4, 100) if o.type == RS_DATA)
    assert a.receive_block(1, RS_DATA, block, 0.0) is None
    assert a.statistics().drops == {"codec": 2}
    assert a.statistics().reduce_scatter.datagrams_received == 0


def test_values_the_codec_cannot_hold_are_not_sent_and_counted():
    """A member's vector with a value beyond fp16 (or NaN): those ranges are left out (to the owner, lost),
    counted ``unencodable``; nothing raises and everyone else's result stays finite."""
    xs, ws = inputs(3, 3000, seed=11)
    xs[1][10] = 1e6  # in shard 0: member 1's reduce-scatter range to member 0
    xs[2][2500] = np.nan  # in shard 2: member 2's own shard; its all-gather range cannot be encoded
    c = make("fp16")
    m = group(xs, ws, c, 500, floor_s=0.3)
    net = GroupNet(m)
    net.run()
    assert m[1].statistics().refused == {"unencodable": 1}
    assert m[2].statistics().refused == {"unencodable": 1}  # its all-gather range: the own NaN is in the average
    assert [x.statistics().complete for x in m] == [False, False, True]  # the range never sent keeps own values
    r0 = m[0].result()
    assert np.isfinite(r0[:2000]).all()
    per = m[0].layout.per
    lo = 10 // per * per
    assert not any(d[0] == 1 and d[1] == 0 and d[3] == lo for d in net.delivered)
    assert np.array_equal(r0[2000 + (500 // per) * per : 2000 + (500 // per + 1) * per],
                          xs[0][2000 + (500 // per) * per : 2000 + (500 // per + 1) * per])


def test_bad_codec_arguments():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError):
        GroupAverage(1, 2, 0, x, 1.0, 0.0, options=replace(GROUP_OPTIONS, codec="int8"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        GroupAverage(1, 2, 0, x, 1.0, 0.0, options=replace(GROUP_OPTIONS, codec=codec("int8"), run=-1))
    with pytest.raises(ValueError):
        GroupAverage(1, 2, 0, x, 1.0, 0.0, options=replace(GROUP_OPTIONS, codec=codec("int8")),
                     max_payload=HEADER_SIZE + 4)  # not one element


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(CODECS), mtype=st.sampled_from([RS_DATA, RS_END, AG_DATA, AG_END]),
       pos=st.integers(0, 10_000), edits=st.binary(min_size=1, max_size=8), cut=st.integers(0, 3))
def test_mutated_compressed_bodies_only_raise_wire_error(name, mtype, pos, edits, cut):
    """Valid bodies of every type with bytes overwritten or cut: the member raises WireError (malformed, codec,
    ...) or takes them, and still finishes with a finite result where its inputs are finite."""
    (a, b), xs = two(name, length=900, payload=150)
    b.handle_timer(100.0)  # b's reduce-scatter ends (a silent): its all-gather comes out too
    valid = ([o.body for o in b.datagrams_to_send(0.0, 1000) if o.type == mtype]
             or [o.body for o in b.datagrams_to_send(0.0, 1)])
    body = bytearray(valid[pos % len(valid)])
    for k, v in enumerate(edits):
        body[(pos + 13 * k) % len(body)] = v
    body = body[: len(body) - cut]
    try:
        outcome = a.receive(1, mtype, bytes(body), 1.0)
    except WireError as e:
        assert e.reason in ("malformed", "codec")
    else:
        assert isinstance(outcome, Outcome)
    a.datagrams_to_send(0.0, 1000)  # (its own contributions out: its all-gather's deadline counts from here)
    a.handle_timer(200.0)
    a.handle_timer(300.0)
    a.datagrams_to_send(0.0, 1000)
    assert a.result_ready and np.isfinite(a.result()).all()


def test_fp16_golden_vectors_match_the_spec_byte_for_byte():
    text = (Path(__file__).resolve().parents[1] / "protocol" / "allreduce.md").read_text()
    block = re.search(r"```golden-fp16\n(.*?)```", text, re.S)
    assert block is not None
    golden = {line.split()[0]: bytes.fromhex("".join(line.split()[1:])) for line in block.group(1).splitlines()}
    x0 = np.array([1, 2, 3, 4, 5], np.float32)
    x1 = np.array([10, 20, 30, 40, 50], np.float32)
    m0 = GroupAverage(0x01020304, 2, 0, x0, 3.0, 0.0, options=replace(GROUP_OPTIONS, codec=codec("fp16")),
                      max_payload=23)
    m1 = GroupAverage(0x01020304, 2, 1, x1, 1.0, 0.0, options=replace(GROUP_OPTIONS, codec=codec("fp16")),
                      max_payload=23)
    out0 = m0.datagrams_to_send(0.0, 100)
    assert out0[0].type == RS_DATA and out0[0].body == golden["RS_DATA"]
    assert next(o for o in out0 if o.type == RS_END).body == golden["RS_END"]
    deliver(out0, m1, 0)
    out1 = m1.datagrams_to_send(0.0, 100)
    assert next(o for o in out1 if o.type == AG_DATA).body == golden["AG_DATA"]
    assert next(o for o in out1 if o.type == AG_END).body == golden["AG_END"]
    deliver(out1, m0, 1)
    deliver(m0.datagrams_to_send(0.0, 100), m1, 0)
    for core in (m0, m1):
        np.testing.assert_array_equal(core.result(), [3.25, 6.5, 9.75, 13, 16.25])


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_coded_members_slices_hold_a_block_per_destination(n):
    """A compressed group's blocks are smaller than the driver's (CODED_BLOCK_ELEMENTS), so the driver's slice is cut
    to whole turns of a block per destination: a slice that held one more block for one destination left it alone
    on the uplink for a third of the slice at full rate, and senders alone toward one receiver at once overflowed
    its downlink (`peerd bench step --link 10mbit`: 1.2 % of the downlinks' packets dropped, the step 1.9-2.7 s)."""
    xs, ws = inputs(n, 200_000 * n, seed=3)
    a = group(xs, ws, make("int8"), 1200)[0]
    rows = 864  # the driver's (1 MB blocks at mtu 1200) and its window: a block per destination
    slices = []
    while True:
        got = [b for b in a.blocks_to_send(rows, rows * (n - 1)) if b.type == RS_DATA]
        if not got:
            break
        per_dest: dict[int, int] = {}
        for b in got:
            per_dest[b.to] = per_dest.get(b.to, 0) + len(b.bodies)
        slices.append(per_dest)
    assert len(slices) >= 2
    for per_dest in slices[:-1]:  # (the last holds each shard's rest)
        assert len(per_dest) == n - 1 and len(set(per_dest.values())) == 1, per_dest
