"""peerd.compress body codecs: error bounds, unbiasedness, refusal of bad input, wire sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.allreduce import frames
from peerd.allreduce.shards import Layout
from peerd.compress import NAMES, CodecError, RoundingKey, by_wire_id, codec
from peerd.compress.quant import FLOAT16, IntCodec
from peerd.compress.rounding import PHASE_AG, PHASE_RS, uniforms
from peerd.wire.envelope import HEADER_SIZE as ENVELOPE_SIZE
from peerd.wire.errors import WireError
from peerd.wire.seal import TAG_SIZE

from .support.codecs import BiasedInt, bytes_sent_per_peer  # noqa: E402

INT_CODECS = [("int8", 128), ("int4", 128), ("int8", 7), ("int4", 5), ("int4", 1)]
ALL = [codec(n) for n in NAMES]


def vec(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * scale + rng.standard_normal() * scale).astype(np.float32)


# ---- sizes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", ALL + [IntCodec(8, 5), IntCodec(4, 3)], ids=repr)
def test_max_count_is_the_largest_that_fits(c):
    for payload in (1, 3, 4, 5, 37, 132, 133, 1144, 1163, 9000):
        k = c.max_count(payload)
        assert k == 0 or c.body_size(k) <= payload
        assert c.body_size(k + 1) > payload


@pytest.mark.parametrize("c", ALL + [IntCodec(8, 5), IntCodec(4, 3, "nearest")], ids=repr)
@pytest.mark.parametrize("count", [1, 2, 3, 127, 128, 129, 1108, 2152])
def test_roundtrip_sizes_and_block_equals_single(c, count):
    rows = 3
    x = vec(rows * count, count).reshape(rows, count)
    key = RoundingKey(7, 1, 2)
    block = c.encode_block(x, key=key, offset=10)
    assert block.shape == (rows, c.body_size(count))
    for i in range(rows):
        single = c.encode(x[i], key=key, offset=10 + i * count)
        assert single == block[i].tobytes()
    dec, ok = c.decode_block(block, count)
    assert ok.all() and dec.dtype == np.float32 and dec.shape == (rows, count)
    assert np.array_equal(dec[1], c.decode(block[1].tobytes(), count))


@pytest.mark.parametrize("c", ALL, ids=repr)
def test_roundtrip_is_what_receivers_decode(c):
    x = vec(1000, 3)
    key = RoundingKey(1, 2, 3, PHASE_AG)
    bodies = c.encode_ranges(x, 286, key=key, offset=4000)
    assert len(bodies) == 4
    got = np.concatenate([c.decode(b, min(286, 1000 - 286 * i)) for i, b in enumerate(bodies)])
    assert np.array_equal(got, c.roundtrip(x, 286, key=key, offset=4000))


# ---- float codecs ----------------------------------------------------------------------------------------


def test_fp16_bf16_exact_on_representable_values():
    rng = np.random.default_rng(1)
    h = rng.integers(0, 1 << 16, 20000, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float32)
    assert np.array_equal(codec("fp16").decode(codec("fp16").encode(h), len(h)), h)
    b = rng.integers(0, 1 << 16, 20000, dtype=np.uint32) << np.uint32(16)
    bf = b.view(np.float32)
    bf = bf[np.isfinite(bf)]
    assert np.array_equal(codec("bf16").decode(codec("bf16").encode(bf), len(bf)), bf)


def test_bf16_rounds_to_nearest_even():
    x = vec(50000, 4, 100.0)
    y = codec("bf16").decode(codec("bf16").encode(x), len(x)).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(x.astype(np.float64)))) - 7)
    err = np.abs(y - x)
    assert (err <= ulp / 2).all()
    tie = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)  # halfway: to the even mantissa
    assert codec("bf16").decode(codec("bf16").encode(tie), 2).tolist() == [1.0, 1 + 4 * 2**-8]


@pytest.mark.parametrize("c", ALL + [IntCodec(8, 128, "nearest")], ids=repr)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_refused_at_encode(c, bad):
    x = vec(300, 5)
    x[17] = bad
    with pytest.raises(ValueError):
        c.encode(x, key=RoundingKey(0, 0, 0))


@pytest.mark.parametrize("name,big", [("fp16", 70000.0), ("bf16", 3.4e38), ("int8", -1e5), ("int4", -7e4)])
def test_values_the_codec_cannot_hold_are_refused(name, big):
    x = vec(200, 6)
    x[3] = big
    with pytest.raises(ValueError):
        codec(name).encode(x, key=RoundingKey(0, 0, 0))


def test_stochastic_needs_a_key_and_registry_rejects_junk():
    with pytest.raises(ValueError):
        codec("int8").encode(vec(10))
    with pytest.raises(ValueError):
        codec("fp16", group=3)
    with pytest.raises(ValueError):
        codec("int8", rounding="up")
    with pytest.raises(ValueError):
        codec("arc-topk")
    with pytest.raises(CodecError):
        by_wire_id(9)
    assert [by_wire_id(c.wire_id).name for c in ALL] == list(NAMES)


# ---- integer codecs: error bounds --------------------------------------------------------------------------


@pytest.mark.parametrize("name,group", INT_CODECS)
@pytest.mark.parametrize("scale", [1e-6, 1.0, 300.0])
def test_nearest_within_half_a_step(name, group, scale):
    c = codec(name, group=group, rounding="nearest")
    for count in (1, group, 2 * group + 1, 1000):
        x = vec(count, count + group, scale)
        body = c.encode(x)
        y = c.decode(body, count)
        step = c.step(body, count)
        slack = 4 * np.finfo(np.float32).eps * (np.abs(x) + step * c.levels)  # float32 arithmetic of min + q*s
        assert (np.abs(y - x) <= step / 2 + slack).all()


@pytest.mark.parametrize("name,group", INT_CODECS)
def test_stochastic_within_one_step_and_groups_cover_their_range(name, group):
    c = codec(name, group=group)
    x = vec(999, 8, 3.0)
    body = c.encode(x, key=RoundingKey(1, 1, 1))
    y = c.decode(body, 999)
    step = c.step(body, 999)
    assert (np.abs(y - x) <= step * (1 + 1e-5)).all()
    ng = c.groups(999)
    sm = np.frombuffer(body[: 4 * ng], FLOAT16).reshape(ng, 2).astype(np.float32)
    pad = np.concatenate([x, np.full(ng * group - 999, x[-1], np.float32)]).reshape(ng, group)
    assert (sm[:, 1] <= pad.min(1)).all()
    assert (sm[:, 1] + c.levels * sm[:, 0] >= pad.max(1)).all()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_constant_groups_are_exact(name):
    c = codec(name, group=16)
    x = np.full(40, 0.5, np.float32)
    x[32:] = -3.25
    assert np.array_equal(c.decode(c.encode(x, key=RoundingKey(0, 0, 0)), 40), x)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("group", [[70000.0, 70001.0, 90000.0], [-65504.0, 65504.0, 0.0], [1e-30, 2e-30, -1e-30],
                                   [65504.0, 65504.0, 65504.0], [-1e-3, 9e5, 3.0]])
def test_extreme_groups_stay_within_a_step(name, group):
    """Groups at the edges of what fp16 scales and mins hold: still covered, still within one step (nearest:
    half a step) of every value."""
    x = np.array(group * 3, np.float32)
    for rounding, bound in (("nearest", 0.5), ("stochastic", 1.0)):
        c = codec(name, group=3, rounding=rounding)
        body = c.encode(x, key=RoundingKey(0, 0, 0))
        y = c.decode(body, len(x))
        step = c.step(body, len(x))
        assert (np.abs(y.astype(np.float64) - x) <= step * bound + 4e-7 * (np.abs(x) + step * c.levels)).all()


def test_int4_range_beyond_fp16_scales_is_refused():
    with pytest.raises(ValueError):  # 1e6 / 15 > 65504: no fp16 scale covers it
        codec("int4").encode(np.array([0.0, 1e6], np.float32), key=RoundingKey(0, 0, 0))
    codec("int8").encode(np.array([0.0, 1e6], np.float32), key=RoundingKey(0, 0, 0))  # 1e6 / 255 fits


# ---- stochastic rounding: unbiased, at the rate the variance predicts ----------------------------------------


def z_scores(estimates: np.ndarray, exact: np.ndarray, var: np.ndarray) -> tuple[float, float]:
    """(z of the summed mean error, mean squared standardized error): N(0, 1) and about 1 when unbiased with
    the predicted per-element variance ``var`` of one estimate."""
    k = len(estimates)
    err = estimates.astype(np.float64).mean(axis=0) - exact
    z = err.sum() / np.sqrt(var.sum() / k)
    ms = np.mean(err**2 / np.maximum(var / k, 1e-300))
    return float(z), float(ms)




def stochastic_estimates(c: IntCodec, x: np.ndarray, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    est = np.stack([c.decode(c.encode(x, key=RoundingKey(11, r, 5)), len(x)) for r in range(rounds)])
    body = c.encode(x, key=RoundingKey(11, 0, 5))
    step = c.step(body, len(x)).astype(np.float64)
    ng = c.groups(len(x))
    m = np.repeat(np.frombuffer(body[: 4 * ng], FLOAT16).reshape(ng, 2)[:, 1].astype(np.float64), c.group)[: len(x)]
    f = (x - m) / step - np.floor((x - m) / step)  # params do not depend on the draws
    return est, step**2 * f * (1 - f)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_stochastic_unbiased_and_biased_rounding_fails(name):
    x = vec(4096, 9)
    rounds = 200
    c = codec(name)
    est, var = stochastic_estimates(c, x, rounds)
    z, ms = z_scores(est, x.astype(np.float64), var)
    assert abs(z) < 4.5, z
    assert 0.85 < ms < 1.15, ms  # the spread is what the variance predicts, not just centred
    biased = BiasedInt(c.bits, c.group)
    est_b, _ = stochastic_estimates(biased, x, rounds)
    zb, _ = z_scores(est_b, x.astype(np.float64), var)
    assert abs(zb) > 10, zb


def test_draws_depend_on_run_round_sender_phase_and_element():
    keys = [RoundingKey(1, 2, 3), RoundingKey(2, 2, 3), RoundingKey(1, 3, 3), RoundingKey(1, 2, 4),
            RoundingKey(1, 2, 3, PHASE_AG)]
    draws = [uniforms(k.key, 100, 4096) for k in keys]
    for i in range(len(draws)):
        for j in range(i):
            assert np.corrcoef(draws[i], draws[j])[0, 1] < 0.1
            assert not np.array_equal(draws[i], draws[j])
    assert np.array_equal(uniforms(keys[0].key, 100, 4096)[50:], uniforms(keys[0].key, 150, 4046))
    u = np.concatenate(draws)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.003


def test_two_step_average_is_unbiased():
    """Reduce-scatter quantized per sender, weighted float32 sum at the owner, all-gather quantized again: the
    mean over rounds converges to the exact weighted mean."""
    c = codec("int4")
    members = [vec(512, 20 + i) for i in range(4)]
    weights = np.array([1.0, 2.0, 3.0, 0.5], np.float32)
    exact = sum(w * x.astype(np.float64) for w, x in zip(weights, members, strict=True)) / weights.sum()
    finals = []
    for r in range(300):
        rs = [c.roundtrip(x, 200, key=RoundingKey(3, r, i, PHASE_RS)) for i, x in enumerate(members)]
        avg = sum(w * d for w, d in zip(weights, rs, strict=True)) / weights.sum()
        finals.append(c.roundtrip(avg.astype(np.float32), 200, key=RoundingKey(3, r, 0, PHASE_AG)))
    f = np.stack(finals).astype(np.float64)
    err = f.mean(0) - exact
    sem = f.std(0, ddof=1) / np.sqrt(len(f))
    assert abs(err.sum() / np.sqrt((sem**2).sum())) < 4.5
    assert np.mean((err / sem) ** 2) < 1.3


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
def test_two_step_over_the_layout_with_loss(name):
    """The seam as the averaging core will use it, over the core's own Layout: each member encodes its datagram
    ranges (reduce-scatter draws), 20 % of the bodies are lost, the owner decodes what arrived and keeps per
    range the weighted mean of exactly those decoded contributions (its own always arrives), then encodes its
    shard again (all-gather draws); a receiver that gets an all-gather body holds exactly the owner's own
    result there, one that loses it keeps its own value."""
    c = codec(name)
    n, size = 4, 20_000
    per = c.max_count(1200 - ENVELOPE_SIZE - TAG_SIZE - frames.HEADER_SIZE)
    layout = Layout(size, n, per)
    rng = np.random.default_rng(12)
    xs = [vec(size, 30 + i) for i in range(n)]
    w = np.array([1.0, 3.0, 2.0, 0.5], np.float32)
    results = [x.copy() for x in xs]
    for j in range(n):
        start, stop = layout.shard(j)
        owner = np.empty(stop - start, np.float32)
        for k in range(layout.datagrams(j)):
            off, cnt = layout.range(j, k)
            total, wsum, arrived = np.zeros(cnt, np.float32), np.float32(0), []
            for i in range(n):
                body = c.encode(xs[i][off : off + cnt], key=RoundingKey(1, 77, i, PHASE_RS), offset=off)
                assert len(body) == c.body_size(cnt) <= 1144
                if i != j and rng.random() < 0.2:
                    continue
                arrived.append((i, c.decode(body, cnt)))
                total += w[i] * arrived[-1][1]
                wsum += w[i]
            owner[off - start : off - start + cnt] = total / wsum
            exact = sum(w[i] * d.astype(np.float64) for i, d in arrived) / sum(w[i] for i, _ in arrived)
            assert np.allclose(owner[off - start : off - start + cnt], exact, rtol=1e-5, atol=1e-6)
        key = RoundingKey(1, 77, j, PHASE_AG)
        mine = c.roundtrip(owner, per, key=key, offset=start)
        results[j][start:stop] = mine
        for k, body in enumerate(c.encode_ranges(owner, per, key=key, offset=start)):
            off, cnt = layout.range(j, k)
            for i in range(n):
                if i == j:
                    continue
                if rng.random() < 0.2:
                    assert np.array_equal(results[i][off : off + cnt], xs[i][off : off + cnt])
                    continue
                results[i][off : off + cnt] = c.decode(body, cnt)
                assert np.array_equal(results[i][off : off + cnt], mine[off - start : off - start + cnt])


# ---- malformed bodies --------------------------------------------------------------------------------------


def int_body(c: IntCodec, count: int) -> bytearray:
    return bytearray(c.encode(vec(count, 1), key=RoundingKey(0, 0, 0)))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("field,value", [("scale", 0.0), ("scale", -1.0), ("scale", np.inf), ("scale", np.nan),
                                         ("min", np.inf), ("min", np.nan)])
def test_bad_scales_raise(name, field, value):
    c = codec(name)
    body = int_body(c, 300)
    at = 4 * 2 + (0 if field == "scale" else 2)  # the third group's field
    body[at : at + 2] = np.float16(value).tobytes()
    with pytest.raises(CodecError) as e:
        c.decode(bytes(body), 300)
    assert isinstance(e.value, WireError) and e.value.reason == "malformed"
    rows = np.frombuffer(bytes(int_body(c, 300)) + bytes(body), np.uint8).reshape(2, -1)
    _, ok = c.decode_block(rows, 300)
    assert ok.tolist() == [True, False]


def test_int4_padding_nibble_must_be_zero():
    c = codec("int4")
    body = int_body(c, 301)
    c.decode(bytes(body), 301)
    body[-1] |= 0x10
    with pytest.raises(CodecError):
        c.decode(bytes(body), 301)


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_non_finite_float_bodies_raise(name):
    c = codec(name)
    x = vec(10)
    body = bytearray(c.encode(x))
    w = c.body_size(1)
    body[3 * w : 4 * w] = (np.array([np.inf], np.float32).astype(np.float16).tobytes() if w == 2 and name == "fp16"
                           else b"\x80\x7f" if w == 2 else np.float32(np.nan).tobytes())
    with pytest.raises(CodecError):
        c.decode(bytes(body), 10)


@pytest.mark.parametrize("c", ALL + [IntCodec(4, 5), IntCodec(8, 3)], ids=repr)
def test_truncated_and_extended_bodies_raise(c):
    body = c.encode(vec(257, 2), key=RoundingKey(0, 0, 0))
    for cut in (0, 1, len(body) // 2, len(body) - 1):
        with pytest.raises(CodecError):
            c.decode(body[:cut], 257)
    with pytest.raises(CodecError):
        c.decode(body + b"\0", 257)
    for count in (0, -1, 65536, 256, 258):
        if 0 < count < 65536 and c.body_size(count) == len(body):
            continue  # int4: 257 and 258 codes fill the same bytes; the header's count is checked by the layout
        with pytest.raises(CodecError):
            c.decode(body, count)


@settings(max_examples=300, deadline=None)
@given(wire_id=st.integers(0, 4), group=st.sampled_from([1, 3, 128]), count=st.integers(-2, 70000),
       data=st.binary(max_size=1300))
def test_fuzz_random_bodies_raise_codec_error_or_decode_finite(wire_id, group, count, data):
    c = by_wire_id(wire_id, group=group)
    try:
        v = c.decode(data, count)
    except CodecError:
        return
    assert v.dtype == np.float32 and v.shape == (count,) and np.isfinite(v).all()
    assert len(data) == c.body_size(count)


@settings(max_examples=300, deadline=None)
@given(wire_id=st.integers(0, 4), count=st.integers(1, 300),
       edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6))
def test_fuzz_mutated_valid_bodies(wire_id, count, edits):
    """Bytes of a valid body overwritten at random: a CodecError or finite values, never anything else."""
    c = by_wire_id(wire_id, group=16)
    body = bytearray(c.encode(vec(count, count), key=RoundingKey(0, 0, 0)))
    for at, b in edits:
        body[at % len(body)] = b
    try:
        v = c.decode(bytes(body), count)
    except CodecError:
        return
    assert v.shape == (count,) and np.isfinite(v).all()
    dec, ok = c.decode_block(np.frombuffer(bytes(body), np.uint8).reshape(1, -1), np.int64(count))
    assert ok[0] and np.array_equal(dec[0], v)


# ---- wire sizes -----------------------------------------------------------------------------------------




def test_fp32_figure_matches_todays_layout():
    assert codec("fp32").max_count(1200 - ENVELOPE_SIZE - TAG_SIZE - frames.HEADER_SIZE) == (
        __import__("peerd.allreduce.shards", fromlist=["x"]).elements_per_datagram(1200 - ENVELOPE_SIZE - TAG_SIZE))


@pytest.mark.parametrize("name,bound", [("fp16", 0.51), ("bf16", 0.51), ("int8", 0.27), ("int4", 0.145)])
def test_wire_ratio_25m_in_1200_byte_datagrams(name, bound):
    base = bytes_sent_per_peer(codec("fp32"), 25_000_000, 4, 1200)
    ratio = bytes_sent_per_peer(codec(name, **({"group": 128} if name.startswith("int") else {})),
                                25_000_000, 4, 1200) / base
    assert ratio <= bound, ratio
    assert ratio > {"fp16": 0.49, "bf16": 0.49, "int8": 0.25, "int4": 0.125}[name]  # not a wrong-unit artefact
