"""The native int8/int4 pass (peerd/_dataplane/quant.c) against quant.py's numpy path: the same bodies byte for
byte (values, groups, counts, roundings, keys and offsets from hypothesis, fp16's edges included), the same
decoded values and validity over arbitrary bodies, strided rows, and every bound refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.compress.quant import MIN_UNHELD, SCALE_UNHELD, IntCodec
from peerd.compress.rounding import RoundingKey

try:
    from peerd._dataplane import _native
except ImportError:  # pragma: no cover - a source install without a compiler
    _native = None

pytestmark = pytest.mark.skipif(_native is None, reason="the native extension is not built (no compiler or headers)")

FLOAT32 = np.dtype("<f4")


def native_encode(c: IntCodec, values: np.ndarray, key: RoundingKey | None, offset: int) -> np.ndarray:
    rows, count = values.shape
    out = np.empty((rows, c.body_size(count)), dtype=np.uint8)
    why = _native.quant_encode(np.ascontiguousarray(values, FLOAT32), rows, count, out, c.bits, c.group,
                               c.stochastic, key.key if key is not None else 0, offset)
    if why:
        raise ValueError(MIN_UNHELD if why == 1 else SCALE_UNHELD)
    return out


def native_decode(c: IntCodec, bodies: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    values = np.empty((len(bodies), count), FLOAT32)
    ok = np.empty(len(bodies), np.uint8)
    _native.quant_decode(bodies, 0, bodies.strides[0], len(bodies), count, c.bits, c.group, values, ok)
    return values, ok.view(bool)


def outcome(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except ValueError as e:
        return str(e)


scales = st.sampled_from([1e-30, 1e-8, 6e-5, 1e-3, 1.0, 300.0, 3e4, 6.6e4, 1e6])


@st.composite
def rows_of_values(draw):  # type: ignore[no-untyped-def]
    rows = draw(st.integers(1, 4))
    count = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "shifted", "constant", "mixed", "edge"]))
    scale = draw(scales)
    x = rng.standard_normal((rows, count)) * scale
    if kind == "shifted":
        x += draw(st.sampled_from([-7e4, -65504.0, -1.0, 0.5, 65500.0, 65519.0, 7e4]))
    elif kind == "constant":
        x[:] = x[0, 0]
    elif kind == "mixed":
        x *= rng.choice([0.0, 1e-6, 1.0, 1e3], size=x.shape)
    elif kind == "edge":
        x = rng.choice(np.array([0.0, -0.0, 2**-24, 2**-14, 65504.0, -65504.0, 65519.9, 1.0, 1 / 3]), size=x.shape)
    return x.astype(FLOAT32)


@settings(max_examples=400, deadline=None)
@given(rows_of_values(), st.sampled_from([8, 4]), st.integers(1, 200), st.sampled_from(["stochastic", "nearest"]),
       st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))
def test_native_bodies_are_the_numpy_bodies(x, bits, group, rounding, stream, offset):
    c = IntCodec(bits, group, rounding)
    offset = min(offset, 2**32 - x.size)
    key = RoundingKey(stream, 3, 5)
    want = outcome(c._encode_rows_numpy, x, key, offset)
    got = outcome(native_encode, c, x, key, offset)
    if isinstance(want, str):
        assert got == want
        return
    assert isinstance(got, np.ndarray) and np.array_equal(got, want)
    values, ok = native_decode(c, got, x.shape[1])
    ref_values, ref_ok = c._decode_rows_numpy(got, x.shape[1])
    assert ok.all() and ref_ok.all()
    assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))


# fp16 words that probe the checks: zero, -0, subnormals, max, inf, NaN, negative scales
SPECIAL16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0xBC00, 0xFBFF]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([8, 4]), st.integers(1, 64), st.integers(1, 200), st.integers(1, 5), st.integers(0, 2**32 - 1),
       st.integers(0, 7), st.booleans())
def test_native_decode_is_the_numpy_decode_over_any_bytes(bits, group, count, rows, seed, slack, specials):
    c = IntCodec(bits, group)
    rng = np.random.default_rng(seed)
    size = c.body_size(count)
    raw = rng.integers(0, 256, (rows, size + slack), dtype=np.uint8)
    if specials:  # scale and min words from the probes, so that valid and invalid rows both occur
        words = rng.choice(SPECIAL16 + [0x2000, 0x3800, 0x1400], size=(rows, 2 * c.groups(count))).astype("<u2")
        raw[:, : 4 * c.groups(count)] = words.view(np.uint8)
    bodies = raw[:, :size]  # rows ``size + slack`` bytes apart: a strided view, as bodies past envelopes are
    values, ok = native_decode(c, bodies, count)
    ref_values, ref_ok = c._decode_rows_numpy(bodies, count)
    assert np.array_equal(ok, ref_ok)
    assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))


def test_the_codec_runs_native_and_the_golden_bodies_hold():
    """IntCodec takes the native pass where it is built; a stochastic int4 body of a known vector is the same."""
    c = IntCodec(4, 128)
    x = np.linspace(-3, 5, 1000, dtype=FLOAT32).reshape(2, 500)
    key = RoundingKey(1, 2, 3)
    assert np.array_equal(c._encode_rows(x, key, 40), c._encode_rows_numpy(x, key, 40))
    body = c.encode(x[0], key=key)
    assert np.array_equal(c.decode(body, 500), c._decode_rows_numpy(np.frombuffer(body, np.uint8)[None], 500)[0][0])


@pytest.mark.parametrize("bad", [
    lambda out, v: _native.quant_encode(v, 2, 100, out, 8, 128, True, 1, 0) if out.size < 2 * 104 else None,
    lambda out, v: _native.quant_encode(v[:150], 2, 100, out, 8, 128, True, 1, 0),
    lambda out, v: _native.quant_encode(v, 2, 100, out, 6, 128, True, 1, 0),
    lambda out, v: _native.quant_encode(v, 2, 100, out, 8, 0, True, 1, 0),
    lambda out, v: _native.quant_encode(v, 2, 100, out, 8, 128, True, 1, 2**32 - 100),
    lambda out, v: _native.quant_encode(v, -1, 100, out, 8, 128, True, 1, 0),
    lambda out, v: _native.quant_encode(out.view(FLOAT32), 2, 52, out, 8, 128, True, 1, 0),
])
def test_encode_refuses_every_bound(bad):
    out = np.empty(2 * 104 - 1, np.uint8)
    v = np.zeros(200, FLOAT32)
    with pytest.raises(ValueError):
        bad(out, v)
        raise ValueError("accepted")  # a call that did not raise fails here instead


def test_decode_refuses_every_bound():
    c = IntCodec(8, 128)
    bodies = np.zeros((3, c.body_size(100)), np.uint8)
    values, ok = np.empty((3, 100), FLOAT32), np.empty(3, np.uint8)
    for args in [
        (bodies, 0, bodies.strides[0], 4, 100, 8, 128, values, ok),  # more rows than the bodies hold
        (bodies, 1, bodies.strides[0], 3, 100, 8, 128, values, ok),  # past the end by the offset
        (bodies, 0, 10, 3, 100, 8, 128, values, ok),  # rows overlapping
        (bodies, 0, bodies.strides[0], 3, 100, 8, 128, values[:2], ok),  # values too short
        (bodies, 0, bodies.strides[0], 3, 100, 8, 128, values, ok[:2]),  # ok too short
        (bodies, 0, bodies.strides[0], 3, 100, 5, 128, values, ok),  # bits
        (bodies, 0, bodies.strides[0], 3, 0, 8, 128, values, ok),  # count
        (bodies, 0, bodies.strides[0], 3, 100, 8, 128, bodies, ok),  # values over the bodies
    ]:
        with pytest.raises(ValueError):
            _native.quant_decode(*args)
    _native.quant_decode(bodies, 0, bodies.strides[0], 3, 100, 8, 128, values, ok)
    assert not ok.any() and not values.any()  # zero scales: every row invalid, zeros


# ---- fp16 ---------------------------------------------------------------------------------------------------

F16_EDGES = np.array([0.0, -0.0, 2**-25, 2**-24, 1.5 * 2**-24, 2**-14 - 2**-25, 2**-14, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
                      65504.0, 65519.99, 65520.0, -65520.0, 1e-40, 3.3e38], dtype=FLOAT32)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 300), st.integers(0, 2**32 - 1), scales, st.booleans())
def test_native_fp16_is_numpys(rows, count, seed, scale, edges):
    """Round to nearest even from float32, subnormals and ties included (F16C where the CPU has it, else the
    scalar rounding); a value beyond 65504 is refused; decoding any bytes gives numpy's values and validity."""
    from peerd.compress.floats import Float16Codec

    c = Float16Codec()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, count)) * scale).astype(FLOAT32)
    if edges:
        x = rng.choice(F16_EDGES, size=x.shape) * rng.choice(np.array([1, -1], FLOAT32), size=x.shape)
    want = outcome(c._encode_rows_numpy, x, None, 0)
    got = outcome(c._encode_rows, x, None, 0)
    if isinstance(want, str):
        assert got == want
    else:
        assert np.array_equal(got, want)
    raw = rng.integers(0, 256, (rows, 2 * count + 3), dtype=np.uint8)
    if edges:  # mostly finite words, some inf and NaN
        raw[:, : 2 * count] = rng.choice(np.array([0x3C00, 0x7BFF, 0x0001, 0x8000, 0x7C00, 0xFE00], "<u2"),
                                         p=[0.4, 0.3, 0.2, 0.08, 0.01, 0.01], size=(rows, count)).view(np.uint8)
    if not isinstance(want, str):  # the scalar rounding, as on a CPU without F16C
        out = np.empty_like(want)
        assert _native.half_encode(x, x.size, out, False, True) == 0 and np.array_equal(out, want)
    bodies = raw[:, : 2 * count]
    values, ok = c._decode_rows(bodies, count)
    ref_values, ref_ok = c._decode_rows_numpy(bodies, count)
    assert np.array_equal(ok, ref_ok) and np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))
    scalar, scalar_ok = np.empty_like(values), np.empty(rows, np.uint8)
    _native.half_decode(bodies, 0, bodies.strides[0], rows, count, scalar, scalar_ok, False, True)
    assert np.array_equal(scalar_ok.view(bool), ref_ok)
    assert np.array_equal(scalar.view(np.uint32), values.view(np.uint32))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 300), st.integers(0, 2**32 - 1), scales, st.booleans())
def test_native_bf16_is_numpys(rows, count, seed, scale, big):
    """bfloat16 from float32, nearest even (ties included: values with exactly half an ulp of bf16 below them), a
    value that rounds to inf refused; decoding any bytes gives numpy's values and validity."""
    from peerd.compress.floats import BFloat16Codec

    c = BFloat16Codec()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, count)) * scale).astype(FLOAT32)
    x.view(np.uint32)[:, ::3] &= np.uint32(0xFFFF8000)  # ties to even
    x.view(np.uint32)[:, ::3] |= np.uint32(0x00008000)
    if big:
        x[0, 0] = np.float32(3.3961e38)  # rounds to inf in bf16
    want = outcome(c._encode_rows_numpy, x, None, 0)
    got = outcome(c._encode_rows, x, None, 0)
    assert got == want if isinstance(want, str) else np.array_equal(got, want)
    raw = rng.integers(0, 256, (rows, 2 * count + 5), dtype=np.uint8)
    raw[:, 1 : 2 * count : 2] &= np.uint8(0xBF if big else 0xFF)  # mostly finite when ``big``
    bodies = raw[:, : 2 * count]
    values, ok = c._decode_rows(bodies, count)
    ref_values, ref_ok = c._decode_rows_numpy(bodies, count)
    assert np.array_equal(ok, ref_ok) and np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))


def test_native_fp16_refuses_every_bound():
    v, out = np.zeros(10, FLOAT32), np.empty(19, np.uint8)
    with pytest.raises(ValueError):
        _native.half_encode(v, 10, out)  # out one byte short
    with pytest.raises(ValueError):
        _native.half_encode(v, -1, np.empty(20, np.uint8))
    bodies, values, ok = np.zeros((2, 20), np.uint8), np.empty((2, 10), FLOAT32), np.empty(2, np.uint8)
    for args in [(bodies, 0, 20, 3, 10, values, ok), (bodies, 1, 20, 2, 10, values, ok),
                 (bodies, 0, 20, 2, 10, values[:1], ok), (bodies, 0, 20, 2, 0, values, ok),
                 (bodies, 0, 20, 2, 10, values, bodies)]:
        with pytest.raises(ValueError):
            _native.half_decode(*args)
