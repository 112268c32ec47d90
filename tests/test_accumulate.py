"""The streaming reconstruction (fp32, no robust aggregation): reduce-scatter rows are added into the owner's float32
sums as they arrive. The native pass (accumulate_rows) against the numpy reference, bit for bit; its bounds; and
whole groups, streaming against the staged reconstruction (the one robust aggregation and codecs use)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.allreduce import HEADER_SIZE, kernels
from peerd.allreduce.group import GroupAverage
from peerd.allreduce.kernels import accumulate_numpy, finalize_f32
from peerd.wire.native import native as _native

from .support.blocks import _average

GROUP = 0x0A0B0C0D
needs_native = pytest.mark.skipif(_native is None, reason="the native data plane is not built (PEERD_DATAPLANE=python)")

SPECIAL = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, 0.0], np.float32)


def _rows(rng: np.random.Generator, rows: int, m: int, specials: float) -> np.ndarray:
    values = rng.standard_normal((rows, m)).astype(np.float32) * np.float32(rng.choice([1.0, 1e3, 1e30]))
    mask = rng.random((rows, m)) < specials
    values[mask] = rng.choice(SPECIAL, int(mask.sum()))
    return values


def _bodies(values: np.ndarray, pad: int) -> np.ndarray:
    """Bodies as the receive path holds them: a header (junk here), then the values at an odd offset when ``pad``
    is odd, rows ``pad`` bytes wider than they need to be (a view into a wider block)."""
    rows, m = values.shape
    block = np.frombuffer(np.random.default_rng(rows).bytes(rows * (HEADER_SIZE + 4 * m + pad) + 3), np.uint8)
    block = block[1 : 1 + rows * (HEADER_SIZE + 4 * m + pad)].reshape(rows, -1).copy()
    block[:, HEADER_SIZE : HEADER_SIZE + 4 * m] = values.view(np.uint8).reshape(rows, -1)
    return block[:, : HEADER_SIZE + 4 * m]


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    per=st.integers(1, 40),
    short=st.booleans(),
    nranges=st.integers(1, 30),
    specials=st.sampled_from([0.0, 0.02, 0.3]),
    factor=st.sampled_from([1.0, 3.0, 2.0**24, 1e30, 0.5]),
    pad=st.integers(0, 5),
)
def test_native_accumulate_is_the_numpy_reference_bit_for_bit(seed, per, short, nranges, specials, factor, pad):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, per + 1)) if short else per
    rows = int(rng.integers(1, nranges + 1))
    ks = rng.permutation(nranges)[:rows].astype(np.int64)
    if short:  # the short last range: one row, past the full ranges
        ks = np.array([nranges - 1], np.int64)
        rows = 1
    length = (nranges - 1) * per + m if short else nranges * per
    values = _rows(rng, rows, m, specials)
    start = _rows(rng, 1, length, specials)[0]
    filled = (rng.random(nranges) < 0.5).astype(np.uint8)
    acc_c, acc_py = start.copy(), start.copy()
    filled_c, filled_py = filled.copy(), filled.copy()
    got = np.frombuffer(_native.accumulate_rows(_bodies(values, pad), HEADER_SIZE, HEADER_SIZE + 4 * m + pad, rows,
                                                4 * m, acc_c, 4 * per, ks, filled_c, factor), np.uint8)
    want = accumulate_numpy(values, acc_py, per, ks, filled_py, factor)
    assert got.tolist() == want.tolist()
    assert acc_c.tobytes() == acc_py.tobytes()
    assert filled_c.tolist() == filled_py.tolist()
    for i in range(rows):  # and what the statuses mean
        finite = bool(np.isfinite(values[i]).all())
        assert (got[i] == 1) == (not finite)
        if got[i] != 0:
            assert filled_c[ks[i]] == filled[ks[i]]
            assert acc_c[ks[i] * per : ks[i] * per + m].tobytes() == start[ks[i] * per : ks[i] * per + m].tobytes()


def test_a_row_whose_sum_would_overflow_is_left_out_and_one_with_nan_refused() -> None:
    acc = np.zeros(8, np.float32)
    filled = np.zeros(2, np.uint8)
    big = np.full((1, 4), 3e38, np.float32)
    assert accumulate_numpy(big, acc, 4, np.array([0]), filled, 1.0).tolist() == [0]
    assert accumulate_numpy(big, acc, 4, np.array([0]), filled, 1.0).tolist() == [2]  # 6e38: left out
    assert acc[:4].tolist() == [np.float32(3e38)] * 4 and filled.tolist() == [1, 0]
    nan = np.array([[1.0, np.nan, 1.0, 1.0]], np.float32)
    assert accumulate_numpy(nan, acc, 4, np.array([1]), filled, 1.0).tolist() == [1]
    assert filled.tolist() == [1, 0]


@needs_native
def test_accumulate_rows_checks_every_bound_before_writing() -> None:
    src = _bodies(np.ones((3, 4), np.float32), 0)
    acc = np.zeros(12, np.float32)
    filled = np.zeros(3, np.uint8)

    def call(ks, acc=acc, filled=filled, length=16, stride=16, src=src, rows=3):
        return _native.accumulate_rows(src, HEADER_SIZE, src.strides[0], rows, length, acc, stride,
                                       np.asarray(ks, np.int64), filled, 2.0)

    for ks in ([0, 1, 3], [0, 1, -1], [0, 1], [0, 1, 2, 2]):  # outside filled and dst; not one index per row
        with pytest.raises(ValueError):
            call(ks)
    with pytest.raises(ValueError):
        call([0, 1, 2], acc=np.zeros(11, np.float32))  # range 2 runs past dst
    with pytest.raises(ValueError):
        call([0, 1, 2], length=15)  # not float32 rows
    with pytest.raises(ValueError):
        call([0, 1, 2], acc=np.zeros(13, np.float32).view(np.uint8)[1:49])  # dst not aligned to float32
    with pytest.raises(ValueError):
        call([0, 1, 2], rows=4)  # more rows than src holds
    with pytest.raises(ValueError):
        call([0, 1, 2], filled=acc.view(np.uint8)[:3])  # filled inside dst
    assert not acc.any() and not filled.any()  # nothing was written by any refused call
    assert call([2, 0, 1]) == b"\0\0\0"
    assert acc.tolist() == [2.0] * 12 and filled.tolist() == [1, 1, 1]


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 12),
    width=st.integers(0, 40),
    specials=st.sampled_from([0.0, 0.0, 0.01, 0.3]),
    weight=st.sampled_from([1.0, 0.5, 3.0, 1e-30, 2.0**24]),
    in_place=st.booleans(),
)
def test_native_finalize_is_the_numpy_reference_bit_for_bit(seed, rows, width, specials, weight, in_place):
    """finalize_rows against finalize_f32: the same bits where every value is finite, and nothing written (False)
    where numpy finds a value that is not (NaN, inf, an overflow of own * weight + sum): it then sums in float64."""
    rng = np.random.default_rng(seed)
    own = _rows(rng, rows, width, specials) if width else np.zeros((rows, 0), np.float32)
    acc = _rows(rng, rows, width, specials) if width else np.zeros((rows, 0), np.float32)
    summed = (rng.random(rows) < 0.7).astype(np.uint8)
    got = np.where(rng.random(rows) < 0.8, rng.choice([0.5, 1.0, 3.0, 1e-40], rows), rng.choice([0.0, -1.0], rows))
    if rows and rng.random() < 0.1:
        got[0] = np.nan
    before = own.copy()
    out = own if in_place else np.full((rows, width), 7.0, np.float32)
    out0 = out.copy()
    want = finalize_f32(before.copy(), acc, summed, got, weight)
    ok = _native.finalize_rows(own, acc, summed, got, weight, out, rows, width)
    assert ok == (want is not None)
    if want is None:
        assert out.tobytes() == out0.tobytes()  # nothing written
    else:
        assert out.tobytes() == want.tobytes()
    if not in_place:
        assert own.tobytes() == before.tobytes()


@needs_native
def test_finalize_rows_checks_every_bound_before_writing() -> None:
    own, acc = np.ones((3, 4), np.float32), np.ones((3, 4), np.float32)
    summed, got = np.ones(3, np.uint8), np.ones(3)
    out = np.zeros((3, 4), np.float32)

    def call(own=own, acc=acc, summed=summed, got=got, out=out, rows=3, width=4):
        return _native.finalize_rows(own, acc, summed, got, 1.0, out, rows, width)

    bad = [dict(rows=4), dict(width=5), dict(rows=-1), dict(own=own[:2]), dict(acc=acc.ravel()[:11]),
           dict(summed=summed[:2]), dict(got=got[:2]), dict(out=np.zeros((2, 4), np.float32)),
           dict(out=np.zeros(13, np.float32).view(np.uint8)[1:49])]  # not aligned to float32
    for kw in bad:
        with pytest.raises(ValueError):
            call(**kw)
    shifted = np.zeros(13, np.float32)
    with pytest.raises(ValueError):  # out overlapping own without being it
        call(own=shifted[:12].reshape(3, 4), out=shifted[1:13].reshape(3, 4))
    with pytest.raises(ValueError):  # out overlapping acc
        call(out=acc)
    assert not out.any()
    assert call() is True and out.tolist() == [[1.0] * 4] * 3  # (1 * 1 + 1) / (1 + 1)
    assert call(out=own) is True and own.tolist() == [[1.0] * 4] * 3  # in place


# ---- whole groups: streaming against the staged reconstruction -------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 5),
    length=st.integers(1, 150),
    per=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**16),
    loss=st.sampled_from([0.0, 0.3]),
    poison=st.sampled_from([None, np.nan, np.inf, 3e38]),
    blocks=st.booleans(),
    native=st.booleans(),
)
def test_streaming_averages_what_the_staged_reconstruction_does(n, length, per, seed, loss, poison, blocks,
                                                                 native) -> None:
    """Same ranges averaged, same contributions refused, the same own values kept where nothing arrived; the
    values agree to float32 rounding (the sums are taken in another order)."""
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(kernels, "native", None)
        _compare(n, length, per, seed, loss, poison, blocks)


def _compare(n: int, length: int, per: int, seed: int, loss: float, poison: float | None, blocks: bool) -> None:
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(length).astype(np.float32) for _ in range(n)]
    if poison is not None:  # one member sends some non-finite or huge values
        hit = rng.random(length) < 0.2
        vectors[n - 1][hit] = np.float32(poison)
    weights = [float(rng.choice([1.0, 3.0, 2.0**24, 2.0**30])) for _ in range(n)]

    def cores(stream: bool) -> list[GroupAverage]:
        out = [GroupAverage(GROUP, n, i, vectors[i].copy(), weights[i], 0.0, max_payload=HEADER_SIZE + 4 * per)
               for i in range(n)]
        for c in out:
            assert c._stream == (kernels.native is not None)  # (the Python data path stages)
            c._stream = stream  # staged: as robust aggregation, codecs and the Python data path run it
        return out

    staged_cores, streaming_cores = cores(False), cores(True)
    staged = _average(staged_cores, loss, seed, blocks)
    streamed = _average(streaming_cores, loss, seed, blocks)
    for a, b, own, sc, tc in zip(staged, streamed, vectors, staged_cores, streaming_cores, strict=True):
        assert np.isfinite(b[np.isfinite(own)]).all()
        assert sc.statistics().refused == tc.statistics().refused
        both = np.isfinite(a) & np.isfinite(b)
        assert (np.isfinite(a) == np.isfinite(b)).all()
        np.testing.assert_allclose(b[both], a[both], rtol=2e-6 * n, atol=1e-6 * n)  # the inputs are ~N(0, 1)


@needs_native
def test_streaming_touches_one_shard_of_the_stage() -> None:
    """The sums are the stage's first shard: the rest of a kept stage is left as it was (never faulted in)."""
    n, length = 4, 400
    stages = [np.full(kernels.stage_elements(length, n), 7.0, np.float32) for _ in range(n)]
    rng = np.random.default_rng(1)
    cores = [GroupAverage(GROUP, n, i, rng.standard_normal(length).astype(np.float32), 1.0, 0.0,
                          max_payload=HEADER_SIZE + 32, stage=stages[i]) for i in range(n)]
    results = _average(cores, 0.0, 1, True)
    mean = np.mean([c._vec for c in cores], axis=0)
    for r in results:
        np.testing.assert_allclose(r, mean, rtol=1e-5, atol=1e-6)
    for i, s in enumerate(stages):
        shard = cores[i]._hi - cores[i]._lo
        assert (s[shard:] == 7.0).all()


def test_overflowing_rows_are_summed_in_float64_not_refused() -> None:
    """Weights times finite values past float32's range: the range is averaged (in float64), not dropped."""
    x = [np.full(8, 3e38, np.float32), np.full(8, 3e38, np.float32), np.full(8, -3e38, np.float32)]
    cores = [GroupAverage(GROUP, 3, i, x[i].copy(), 2.0**20, 0.0, max_payload=HEADER_SIZE + 8) for i in range(3)]
    results = _average(cores, 0.0, 3, True)
    for c, r in zip(cores, results, strict=True):
        assert c.statistics().refused == {}
        np.testing.assert_allclose(r, np.float32(1e38), rtol=1e-6)
