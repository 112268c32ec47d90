"""The native data plane (peerd._dataplane._native) against the Python reference path, byte for byte.

Random blocks (hypothesis) go through a Python sealer or opener and a native one fed the same operations: same
datagrams out, same bodies, same per-row results (replays, authentication failures), same replay window after.
The blocks are hostile where the network's are: tampered tags and headers, truncated and oversized rows, wrong
keys, tokens and receivers, replays. The C entry points are also called directly with odd strides and offsets
(misaligned rows), and with every bound wrong: they must raise, never read or write outside their buffers
(tests/fuzz/ runs them under AddressSanitizer).

Everything but ``test_native_is_built_where_required`` skips, saying why, when the extension is not built.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.wire import native as native_loader
from peerd.wire.envelope import HEADER_SIZE, SEQ_OFFSET
from peerd.wire.seal import TAG_SIZE, Opener, Sealer, derive_key, nonce_for

try:
    from peerd._dataplane import _native
except ImportError as e:  # not built: a source install without a compiler or OpenSSL's headers
    _native = None
    WHY_NOT = f"the native extension is not built ({e})"
else:
    WHY_NOT = ""

LOADED_PLANE = native_loader.dataplane()  # what this process runs, before any test swaps the loader's module
needs_native = pytest.mark.skipif(_native is None, reason=WHY_NOT or "built")
VECTORS = Path(__file__).resolve().parent.parent / "protocol" / "vectors"
RS_DATA = 0x40
PREFIX_SIZE = 13
FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# what a datagram is sealed under: sealed or not, a token, and a first sequence number (also near the end of the
# sequence space)
SEALING = {
    "sealed": st.booleans(),
    "token": st.integers(1, 2**64 - 1),
    "seq": st.one_of(st.integers(0, 2**20), st.integers(2**64 - 200, 2**64 - 101)),
}


def test_native_is_built_where_required() -> None:
    """CI (PEERD_REQUIRE_NATIVE=1) has a compiler and OpenSSL's headers: there the extension must be built, and
    it is the default path unless PEERD_DATAPLANE=python forces the reference."""
    if os.environ.get("PEERD_REQUIRE_NATIVE") != "1":
        pytest.skip("PEERD_REQUIRE_NATIVE is not 1")
    assert _native is not None, WHY_NOT
    forced = os.environ.get("PEERD_DATAPLANE", "").strip().lower() == "python"
    expected = "python" if forced else "native"
    assert expected == LOADED_PLANE, native_loader.reason
    # and on CI's OpenSSL (Debian's 3.0) AES-GCM runs by its provider's own functions, not EVP's slower layer
    assert _native.AEAD_DIRECT == 1


@pytest.fixture(autouse=True)
def _native_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PEERD_DATAPLANE=python the loader hands out no extension; these tests still compare both paths."""
    if _native is not None:
        monkeypatch.setattr(native_loader, "native", _native)


def _pair_sealers(secret: bytes | None, token: int, seq: int) -> tuple[Sealer, Sealer]:
    py, c = Sealer(secret, token, native=False), Sealer(secret, token, native=True)
    py._seq = c._seq = seq  # continue a stream from ``seq`` (the sequence space's end included)
    return py, c


def _snapshot(opener: Opener, token: int) -> tuple[int, bytes] | None:
    state = opener.token_state(token)
    return None if state is None else (state.window.highest, state.window._seen.tobytes())


def _opened(result: object) -> object:
    if result is None:
        return None
    return (result.type, result.token, result.bodies.tobytes(), result.bodies.shape, result.replays,
            result.auth_failures)


# ---- the Python wrappers: Sealer.seal_block and Opener.open_block on both paths -------------------------


@needs_native
def test_dataplane_names() -> None:
    assert Sealer(os.urandom(32), native=True).dataplane == "native"
    assert Sealer(os.urandom(32), native=False).dataplane == "python"
    assert native_loader.dataplane() in ("native", "python")


@needs_native
@FAST
@given(
    **SEALING,
    rows=st.integers(0, 24),
    size=st.integers(0, 300),
    pad=st.integers(0, 7),
    mtype=st.integers(0, 255),
    seed=st.integers(0, 2**32 - 1),
)
def test_seal_block_identical(sealed: bool, token: int, seq: int, rows: int, size: int, pad: int, mtype: int,
                              seed: int) -> None:
    """Same datagrams from both paths, also from bodies that are not contiguous (a column slice) and for the
    sequence space's last numbers."""
    rng = np.random.default_rng(seed)
    secret = rng.bytes(32) if sealed else None
    receiver = rng.bytes(32)
    wide = rng.integers(0, 256, (rows, size + pad), dtype=np.uint8)
    bodies = wide[:, pad:]  # not contiguous when pad > 0
    py, c = _pair_sealers(secret, token, seq)
    a, b = py.seal_block(mtype, bodies, receiver), c.seal_block(mtype, bodies, receiver)
    assert a.shape == b.shape == (rows, HEADER_SIZE + size + (TAG_SIZE if sealed else 0))
    assert a.tobytes() == b.tobytes()
    assert py.sent == c.sent == seq + rows
    if rows and sealed:  # and the bytes are what PROTOCOL.md says, row by row
        row = b[-1].tobytes()
        plain = AESGCM(derive_key(secret, token)).decrypt(nonce_for(seq + rows), row[HEADER_SIZE:],
                                                          row[:HEADER_SIZE] + receiver)
        assert plain == bodies[-1].tobytes()


@needs_native
def test_seal_block_sequence_exhausted() -> None:
    for native in (False, True):
        s = Sealer(os.urandom(32), native=native)
        s._seq = 2**64 - 3
        with pytest.raises(RuntimeError, match="sequence space exhausted"):
            s.seal_block(RS_DATA, np.zeros((3, 10), np.uint8), bytes(32))
        assert s.seal_block(RS_DATA, np.zeros((2, 10), np.uint8), bytes(32)).shape == (2, 47)
        assert s.sent == 2**64 - 1


@needs_native
def test_seal_block_refuses_what_is_not_a_block() -> None:
    for native in (False, True):
        s = Sealer(os.urandom(32), native=native)
        for bad in (np.zeros((2, 3), np.float32), np.zeros(6, np.uint8), [[1, 2]]):
            with pytest.raises(ValueError, match="uint8"):
                s.seal_block(RS_DATA, bad, bytes(32))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="u8"):
            s.seal_block(256, np.zeros((2, 3), np.uint8), bytes(32))
        with pytest.raises(ValueError):
            s.seal_block(RS_DATA, np.zeros((2, 3), np.uint8), bytes(31))
        assert s.sent == 0


TAMPER = st.sampled_from(["none", "tag", "body", "header_seq", "truncate", "extend", "receiver", "key", "token",
                          "replay", "partial_replay", "reorder", "insecure", "lead", "insecure_replay",
                          "insecure_partial_replay", "insecure_reorder"])


@needs_native
@FAST
@given(
    tamper=TAMPER,
    rows=st.integers(1, 20),
    size=st.integers(0, 200),
    seed=st.integers(0, 2**32 - 1),
    hits=st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
)
def test_open_block_identical(tamper: str, rows: int, size: int, seed: int, hits: list[int]) -> None:
    """A block sealed by one sender, broken as ``tamper`` says, opened by a Python and a native opener that
    have seen the same datagrams: the same result (or None), row for row, and the same replay window."""
    rng = np.random.default_rng(seed)
    secret, receiver = rng.bytes(32), rng.bytes(32)
    token = int(rng.integers(1, 2**63))
    insecure = tamper.startswith("insecure")  # unsealed, and then broken as the rest of its name says
    tamper = tamper.removeprefix("insecure_")
    sender = Sealer(None if insecure else secret, token, native=False)
    opener_secret = rng.bytes(32) if tamper == "key" else (None if insecure else secret)
    opener_receiver = rng.bytes(32) if tamper == "receiver" else receiver
    # python, native, and native opening in place (each of its blocks a fresh copy: it turns them into plaintext)
    modes = [(False, False), (True, False), (True, True)]
    openers = [Opener(opener_secret, opener_receiver, native=native) for native, _ in modes]
    # The token's first datagram goes the row-by-row way and makes the token known: sealed as the opener
    # expects (its key, its node id), so that the block, sealed otherwise, still reaches the AEAD.
    first = Sealer(opener_secret, token, native=False).seal(RS_DATA, b"hello", opener_receiver)
    sender._seq = 1
    for o in openers:
        o.open(first)
    bodies = rng.integers(0, 256, (rows, size), dtype=np.uint8)
    block = sender.seal_block(RS_DATA, bodies, receiver).copy()
    width = block.shape[1]
    if tamper == "tag":
        for h in hits:
            block[h % rows, width - 1 - (h // rows) % TAG_SIZE] ^= 1 << (h % 8)
    elif tamper == "body" and size:
        for h in hits:
            block[h % rows, HEADER_SIZE + (h // rows) % size] ^= 0x80
    elif tamper == "header_seq":
        for h in hits:
            block[h % rows, HEADER_SIZE - 1] ^= 1 + h % 255  # another nonce: the tag no longer verifies
    elif tamper == "truncate":
        block = np.ascontiguousarray(block[:, : max(0, width - 1 - hits[0] % (size + TAG_SIZE))])
    elif tamper == "extend":
        block = np.concatenate([block, rng.integers(0, 256, (rows, 1 + hits[0] % 40), dtype=np.uint8)], axis=1)
    elif tamper == "token":
        block[:, 5:SEQ_OFFSET] = np.frombuffer((token ^ 1).to_bytes(8, "big"), np.uint8)
    elif tamper == "reorder":
        block = block[rng.permutation(rows)]
    elif tamper == "lead":  # one row's magic, version, type, flags or token differs: not one stream
        block[hits[0] % rows, (hits[0] // rows) % SEQ_OFFSET] ^= 1 + hits[0] % 255
    results = []
    for o, (_, in_place) in zip(openers, modes, strict=True):
        got = [_opened(o.open_block(block.copy() if in_place else block, in_place=in_place))]
        if tamper in ("replay", "partial_replay"):
            again = block if tamper == "replay" else block[hits[0] % rows :]
            got.append(_opened(o.open_block(np.array(again), in_place=in_place)))
        got.append(_snapshot(o, token))
        results.append(got)
    assert results[0] == results[1] == results[2]
    first_result = results[1][0]
    if tamper in ("none", "replay", "partial_replay", "reorder", "insecure"):
        assert first_result is not None and first_result[4:] == (0, 0)
    if tamper in ("replay", "partial_replay"):
        assert results[1][1] is not None and results[1][1][4] == rows - (0 if tamper == "replay" else hits[0] % rows)
    if tamper == "lead" and rows > 1:
        assert first_result is None
    if tamper in ("key", "receiver", "truncate", "extend") and first_result is not None:
        assert first_result[5] == rows and first_result[3][0] == 0  # every row failed, none delivered


@needs_native
@FAST
@given(rows=st.integers(1, 16), size=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_open_block_from_a_view(rows: int, size: int, seed: int) -> None:
    """Datagrams handed over as a view that is not contiguous (rows cut out of a wider receive arena)."""
    rng = np.random.default_rng(seed)
    secret, receiver, token = rng.bytes(32), rng.bytes(32), int(rng.integers(1, 2**63))
    sender = Sealer(secret, token, native=False)
    first = sender.seal(RS_DATA, b"x", receiver)
    block = sender.seal_block(RS_DATA, rng.integers(0, 256, (rows, size), dtype=np.uint8), receiver)
    arena = np.zeros((rows, block.shape[1] + 5), np.uint8)
    arena[:, 3 : 3 + block.shape[1]] = block
    view = arena[:, 3 : 3 + block.shape[1]]
    out = []
    for native in (False, True):
        o = Opener(secret, receiver, native=native)
        o.open(first)
        out.append(_opened(o.open_block(view)))
    assert out[0] == out[1] and out[0] is not None and out[0][4:] == (0, 0)


# ---- the golden vectors (protocol/vectors) through seal_block and open_block --------------------------------


def _vectors(name: str) -> dict:
    return json.loads((VECTORS / name).read_text(encoding="utf-8"))


@needs_native
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_golden_vectors_as_blocks(native: bool) -> None:
    """Each golden datagram is what a one-row seal_block makes, and opens as a one-row block."""
    d = _vectors("messages.json")
    secret, token, receiver = bytes.fromhex(d["swarm_secret"]), int(d["token"], 16), bytes.fromhex(d["receiver"])
    opener = Opener(secret, receiver, native=native)
    for i, v in enumerate(d["messages"]):
        seq, mtype, body = int(v["seq"]), int(v["type"]), bytes.fromhex(v["body"])
        sealer = Sealer(secret, token, native=native)
        sealer._seq = seq - 1
        block = sealer.seal_block(mtype, np.frombuffer(body, np.uint8).reshape(1, -1), receiver)
        assert block.tobytes().hex() == v["datagram"]
        if i == 0:
            opener.open(block[0].tobytes())  # the token's first datagram: the row-by-row path
            continue
        opened = opener.open_block(block)
        assert opened is not None and opened.bodies.tobytes() == body and (opened.replays, opened.auth_failures) == (
            0, 0)
    ins = _vectors("insecure.json")
    for v in ins["datagrams"]:
        sealer = Sealer(None, int(ins["token"], 16), native=native)
        sealer._seq = int(v["seq"]) - 1
        body = bytes.fromhex(v["body"])
        block = sealer.seal_block(int(v["type"]), np.frombuffer(body, np.uint8).reshape(1, -1), receiver)
        assert block.tobytes().hex() == v["datagram"]


# ---- the C entry points themselves: strides, offsets, bounds --------------------------------------------


def _ref_seal(key: bytes, prefix: bytes, seq: int, body: bytes, receiver: bytes) -> bytes:
    header = prefix + seq.to_bytes(8, "big")
    return header + AESGCM(key).encrypt(nonce_for(seq), body, header + receiver)


@needs_native
@FAST
@given(
    rows=st.integers(0, 12),
    body_len=st.integers(0, 100),
    src_offset=st.integers(0, 9),
    src_gap=st.integers(0, 9),
    out_offset=st.integers(0, 9),
    out_gap=st.integers(0, 9),
    first=st.integers(1, 2**64 - 13),
    no_receiver=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    direct=st.booleans(),
)
def test_native_rows_at_odd_strides(rows: int, body_len: int, src_offset: int, src_gap: int, out_offset: int,
                                    out_gap: int, first: int, no_receiver: bool, seed: int, direct: bool) -> None:
    """seal_block, open_block and frame_block over rows at any byte offset and stride (unaligned for AES and for
    the CPU), against AESGCM row by row; bytes between and around the rows stay untouched. Both ways of calling
    OpenSSL (the provider's own functions, ``direct``, and EVP) give the same bytes and the same refusals."""
    rng = np.random.default_rng(seed)
    key, receiver = rng.bytes(32), b"" if no_receiver else rng.bytes(32)
    prefix = b"PD\x02" + bytes([int(rng.integers(0, 256)), 1]) + rng.bytes(8)
    src_stride, width = body_len + src_gap, HEADER_SIZE + body_len + TAG_SIZE
    out_stride = width + out_gap
    src = bytearray(rng.bytes(src_offset + rows * src_stride + 3))
    out = bytearray(b"\xa5" * (out_offset + rows * out_stride + 3))
    aead = _native.Aead(key, direct=direct)
    assert aead.direct is (direct and bool(_native.AEAD_DIRECT))
    aead.seal_block(prefix, first, rows, src, src_offset, src_stride, body_len, receiver, out, out_offset, out_stride)
    expect = bytearray(b"\xa5" * len(out))
    for i in range(rows):
        body = bytes(src[src_offset + i * src_stride : src_offset + i * src_stride + body_len])
        o = out_offset + i * out_stride
        expect[o : o + width] = _ref_seal(key, prefix, first + i, body, receiver)
    assert out == expect
    # open them back from there into another odd layout, one row tampered, one row masked out
    dst_offset, dst_stride = out_gap, body_len + src_gap
    dst = bytearray(b"\x5a" * (dst_offset + rows * dst_stride + 2))
    mask = bytearray([1] * rows)
    if rows >= 2:
        out[out_offset + out_stride + width - 1] ^= 1  # row 1's tag
        mask[0] = 0
    failures = aead.open_block(out, out_offset, out_stride, width, rows, receiver, dst, dst_offset, dst_stride, mask)
    assert failures == (1 if rows >= 2 else 0)
    for i in range(rows):
        got = bytes(dst[dst_offset + i * dst_stride : dst_offset + i * dst_stride + body_len])
        body = bytes(src[src_offset + i * src_stride : src_offset + i * src_stride + body_len])
        if rows >= 2 and i == 0:
            assert mask[i] == 0 and got == b"\x5a" * body_len  # masked out: not written
        elif rows >= 2 and i == 1:
            assert mask[i] == 0 and got == bytes(body_len)  # failed: zeroed, no unauthenticated plaintext
        else:
            assert mask[i] == 1 and got == body
    # frame_block: the unsealed layout, header then body
    framed = bytearray(b"\xa5" * (out_offset + rows * out_stride + 3))
    _native.frame_block(prefix, first, rows, src, src_offset, src_stride, body_len, framed, out_offset, out_stride)
    for i in range(rows):
        o = out_offset + i * out_stride
        body = bytes(src[src_offset + i * src_stride : src_offset + i * src_stride + body_len])
        assert framed[o : o + HEADER_SIZE + body_len] == prefix + (first + i).to_bytes(8, "big") + body
        assert framed[o + HEADER_SIZE + body_len : o + out_stride] == b"\xa5" * (out_stride - HEADER_SIZE - body_len)


@needs_native
@needs_native
def test_same_lead_compares_each_rows_start_within_bounds() -> None:
    rows = np.zeros((4, 30), np.uint8)
    rows[:, :13] = 7
    assert _native.same_lead(rows, 0, 30, 4, 13) is True
    rows[3, 12] = 8
    assert _native.same_lead(rows, 0, 30, 4, 13) is False
    assert _native.same_lead(rows, 0, 30, 4, 12) is True
    assert _native.same_lead(rows[:, 1:20], 0, 30, 4, 11) is True  # a view: rows 30 apart, from its first byte
    assert _native.same_lead(rows[:, 1:20], 0, 30, 4, 12) is False
    for args in ((0, 30, 5, 13), (1, 30, 4, 30), (0, 12, 4, 13), (-1, 30, 4, 13), (0, 30, 4, -1)):
        with pytest.raises(ValueError):
            _native.same_lead(rows, *args)


def test_a_wild_count_of_empty_rows_is_refused_not_looped_over() -> None:
    """Rows of 0 bytes at stride 0 fit any buffer, so only a row limit bounds the loop: the fuzzer found
    first_nonfinite(src, 0, 0, 2**62, 0) spinning for good (a timeout under ASan)."""
    src = np.zeros(16, np.uint8)
    for rows in (2**62, (1 << 24) + 1):
        with pytest.raises(ValueError, match="over the limit"):
            _native.first_nonfinite(src, 0, 0, rows, 0)
        with pytest.raises(ValueError, match="over the limit"):
            _native.place_rows(src, 0, 0, rows, 0, np.zeros(4, np.float32), 0, 0)
    assert _native.first_nonfinite(src, 0, 0, 1 << 24, 0) == -1


@needs_native
def test_native_bounds_are_checked() -> None:
    """Every length, stride, count and size is checked in C as well: a wrong one raises and touches nothing."""
    aead = _native.Aead(bytes(32))
    prefix, rx = b"PD\x02\x40\x01" + bytes(8), bytes(32)
    src, out = bytearray(100), bytearray(4 * 137)
    ok = (prefix, 1, 4, src, 0, 25, 25, rx, out, 0, 62)
    aead.seal_block(*ok)
    bad_seal = {
        "prefix": (b"PD", 1, 4, src, 0, 25, 25, rx, out, 0, 62),
        "seq 0": (prefix, 0, 4, src, 0, 25, 25, rx, out, 0, 62),
        "seq wraps": (prefix, 2**64 - 3, 4, src, 0, 25, 25, rx, out, 0, 62),
        "rows": (prefix, 1, 5, src, 0, 25, 25, rx, out, 0, 62),
        "negative rows": (prefix, 1, -1, src, 0, 25, 25, rx, out, 0, 62),
        "src offset": (prefix, 1, 4, src, 1, 25, 25, rx, out, 0, 62),
        "src stride": (prefix, 1, 4, src, 0, 24, 25, rx, out, 0, 62),
        "out small": (prefix, 1, 4, src, 0, 25, 25, rx, bytearray(4 * 62 - 1), 0, 62),
        "out stride": (prefix, 1, 4, src, 0, 25, 25, rx, out, 0, 61),
        "out offset": (prefix, 1, 4, src, 0, 25, 25, rx, out, 10**12, 62),
        "huge stride": (prefix, 1, 4, src, 0, 2**62, 25, rx, out, 0, 62),
        "body_len": (prefix, 1, 1, bytearray(70000), 0, 70000, 70000, rx, bytearray(70100), 0, 70100),
        "receiver": (prefix, 1, 4, src, 0, 25, 25, bytes(31), out, 0, 62),
        "overlap": (prefix, 1, 4, out, 0, 25, 25, rx, out, 0, 62),
    }
    for name, args in bad_seal.items():
        before = bytes(out)
        with pytest.raises((ValueError, OverflowError)):
            aead.seal_block(*args)
            pytest.fail(name)
        assert bytes(out) == before, name
    with pytest.raises(TypeError):
        aead.seal_block(prefix, 1, 4, src, 0, 25, 25, rx, bytes(4 * 62), 0, 62)  # read-only out
    dst, mask = bytearray(4 * 25), bytearray(b"\x01" * 4)
    bad_open = {
        "row_len short": (out, 0, 62, 36, 4, rx, dst, 0, 25, mask),
        "rows": (out, 0, 62, 62, 5, rx, dst, 0, 25, bytearray(5)),
        "mask": (out, 0, 62, 62, 4, rx, dst, 0, 25, bytearray(3)),
        "dst small": (out, 0, 62, 62, 4, rx, bytearray(99), 0, 25, mask),
        "dst stride": (out, 0, 62, 62, 4, rx, dst, 0, 24, mask),
        "src stride": (out, 0, 61, 62, 4, rx, dst, 0, 25, mask),
        "receiver": (out, 0, 62, 62, 4, b"x", dst, 0, 25, mask),
        "overlap": (out, 0, 62, 62, 2, rx, out, 100, 25, mask),
        "negative": (out, -1, 62, 62, 4, rx, dst, 0, 25, mask),
    }
    for name, args in bad_open.items():
        with pytest.raises((ValueError, OverflowError)):
            aead.open_block(*args)
            pytest.fail(name)
    assert aead.open_block(out, 0, 62, 62, 4, rx, dst, 0, 25, mask) == 0 and bytes(mask) == b"\x01" * 4
    for key in (b"", bytes(16), bytes(33)):
        with pytest.raises(ValueError):
            _native.Aead(key)
    # Sources of rows: contiguous, or 2-D of contiguous rows (bounds from its first byte to its last row's end).
    wide = np.arange(5 * 12, dtype=np.uint8).reshape(5, 12)
    dst = bytearray(40)
    _native.place_rows(wide[:, 2:10], 2, 12, 5, 6, dst, 0, 8)
    assert bytes(dst) == b"".join(bytes(wide[i, 4:10]) + bytes(2) for i in range(5))
    for bad_rows in (wide.T, wide[:, ::2], wide[::-1]):  # rows not contiguous, or backwards
        with pytest.raises(ValueError, match="contiguous rows"):
            _native.place_rows(bad_rows, 0, 1, 1, 1, dst, 0, 1)
        with pytest.raises(ValueError, match="contiguous rows"):
            _native.first_nonfinite(bad_rows, 0, 4, 1, 4)
    with pytest.raises(ValueError):  # the view spans 56 bytes (4 strides of 12, then 8): a row to byte 57 is out
        _native.place_rows(wide[:, 2:10], 2, 12, 5, 7, bytearray(100), 0, 7)


@needs_native
@FAST
@given(
    **SEALING,
    rows=st.integers(0, 16),
    head_len=st.sampled_from([0, 1, 19, 31, 64, 65]),
    count=st.integers(0, 80),
    big=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_seal_split_is_seal_block_of_the_joined_bodies(sealed: bool, token: int, seq: int, rows: int, head_len: int,
                                                       count: int, big: bool, seed: int) -> None:
    """Sealing headers and float32 values apart (straight from a vector) puts the same datagrams on the wire as
    sealing the packed bodies, on both paths; ``big`` rows are past the C code's stack buffer (its other branch)."""
    rng = np.random.default_rng(seed)
    if big:
        count += 2400  # 9,600+ value bytes: over SPLIT_ROW_MAX
    secret = rng.bytes(32) if sealed else None
    receiver = rng.bytes(32)
    heads = rng.integers(0, 256, (rows, head_len), dtype=np.uint8)
    vector = rng.standard_normal(rows * count + 3).astype(np.float32)
    values = vector[3:].reshape(rows, count)  # a view at an odd float offset, as a shard's ranges are
    joined = np.concatenate((heads, values.view(np.uint8)), axis=1)
    py, c = _pair_sealers(secret, token, seq)
    ref = Sealer(secret, token, native=True)
    ref._seq = seq
    want = ref.seal_block(RS_DATA, joined, receiver)
    for s in (py, c):
        got = s.seal_split(RS_DATA, heads, values, receiver)
        assert got.tobytes() == want.tobytes() and got.shape == want.shape
        assert s.sent == seq + rows


@needs_native
def test_seal_split_bounds_are_checked() -> None:
    """The C entry point refuses every layout that does not fit, before it touches memory."""
    aead = _native.Aead(bytes(32))
    rx, prefix = bytes(32), bytes(PREFIX_SIZE)
    head, src = bytearray(4 * 19), bytearray(4 * 40)
    width = HEADER_SIZE + 19 + 40 + TAG_SIZE
    out = bytearray(4 * width)
    good = (prefix, 1, 4, head, 0, 19, 19, src, 0, 40, 40, rx, out, 0, width)
    aead.seal_split(*good)
    bad = {
        "prefix": (bytes(12),) + good[1:],
        "seq 0": good[:1] + (0,) + good[2:],
        "seq wraps": good[:1] + (2**64 - 2,) + good[2:],
        "rows": good[:2] + (5,) + good[3:],
        "negative rows": good[:2] + (-1,) + good[3:],
        "head short": good[:3] + (bytearray(4 * 19 - 1),) + good[4:],
        "head stride": good[:5] + (18,) + good[6:],
        "head offset": good[:4] + (1,) + good[5:],
        "src short": good[:7] + (bytearray(159),) + good[8:],
        "src stride": good[:9] + (39,) + good[10:],
        "body_len": good[:10] + (41,) + good[11:],
        "too long": good[:6] + (65535,) + good[7:10] + (1,) + good[11:],
        "negative len": good[:6] + (-1,) + good[7:],
        "receiver": good[:11] + (b"x",) + good[12:],
        "out short": good[:12] + (bytearray(4 * width - 1),) + good[13:],
        "out stride": good[:14] + (width - 1,),
        "out over src": good[:7] + (out,) + good[8:12] + (out,) + good[13:],
        "out over head": good[:3] + (out,) + good[4:12] + (out,) + good[13:],
    }
    for name, args in bad.items():
        with pytest.raises((ValueError, OverflowError)):
            aead.seal_split(*args)
            pytest.fail(name)
    with pytest.raises(TypeError):  # out must be writable
        aead.seal_split(*good[:12], bytes(4 * width), *good[13:])
    # frame_split (insecure): the same layouts less the receiver, rows without a tag
    fgood = good[:11] + (bytearray(4 * (width - TAG_SIZE)), 0, width - TAG_SIZE)
    _native.frame_split(*fgood)
    assert bytes(fgood[11][HEADER_SIZE : HEADER_SIZE + 19]) == bytes(head[:19])
    for name, args in bad.items():
        if name in ("receiver", "out short", "out stride", "out over src", "out over head"):
            continue
        with pytest.raises((ValueError, OverflowError)):
            _native.frame_split(*args[:11], *fgood[11:])
            pytest.fail(name)
    for fbad in (fgood[:11] + (bytearray(4 * (width - TAG_SIZE) - 1), 0, width - TAG_SIZE),
                 fgood[:13] + (width - TAG_SIZE - 1,), fgood[:7] + (fgood[11],) + fgood[8:]):
        with pytest.raises(ValueError):
            _native.frame_split(*fbad)


@needs_native
def test_native_releases_the_gil() -> None:
    """Two threads seal at once with their own contexts; both blocks come out right (the GIL is released over a
    block, so this is where a shared buffer or context would show)."""
    key = os.urandom(32)
    rows, size = 2000, 1163
    src = np.frombuffer(os.urandom(rows * size), np.uint8)
    outs = [np.zeros(rows * (size + 37), np.uint8) for _ in range(2)]
    prefix = b"PD\x02\x40\x01" + bytes(8)

    def work(out: np.ndarray) -> None:
        _native.Aead(key).seal_block(prefix, 1, rows, src, 0, size, size, bytes(32), out, 0, size + 37)

    threads = [threading.Thread(target=work, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs[0].tobytes() == outs[1].tobytes()
    last = outs[0][-(size + 37) :].tobytes()
    assert last == _ref_seal(key, prefix, rows, src[-size:].tobytes(), bytes(32))


# ---- placing opened rows (allreduce.intake's receive_block) --------------------------------------------------


@needs_native
@FAST
@given(
    rows=st.integers(1, 20),
    per=st.integers(1, 40),
    gap=st.integers(0, 21),
    special=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([np.inf, -np.inf, np.nan, 3e38, -0.0])),
                     max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_values_native_matches_numpy(monkeypatch: pytest.MonkeyPatch, rows: int, per: int, gap: int,
                                           special: list, seed: int) -> None:
    """kernels.values_finite and kernels.place, native and numpy, over bodies cut out of a wider arena (rows
    ``gap`` bytes apart, values at odd offsets): the same verdict and the same bytes placed."""
    from peerd.allreduce import kernels
    from peerd.allreduce.frames import HEADER_SIZE as BODY_HEADER

    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, per)).astype("<f4")
    for where, v in special:
        values.flat[where % values.size] = v
    width = BODY_HEADER + 4 * per
    arena = rng.integers(0, 256, (rows, width + gap), dtype=np.uint8)
    arena[:, gap + BODY_HEADER : gap + width] = values.view(np.uint8)
    bodies = arena[:, gap : gap + width]
    outs, verdicts = [], []
    for mod in (None, _native):
        monkeypatch.setattr(kernels, "native", mod)
        verdicts.append(kernels.values_finite(bodies, 4 * per))
        dst = np.zeros(rows * per + 7, np.float32)
        if not kernels.place(bodies, dst, 4 * 3, 4 * per):
            assert mod is None
            dst[3 : 3 + rows * per].view(np.uint8).reshape(rows, 4 * per)[:] = bodies[:, BODY_HEADER:]
        outs.append(dst.tobytes())
    assert verdicts[0] == verdicts[1] == bool(np.isfinite(values).all())
    assert outs[0] == outs[1]
    assert outs[1][12 : 12 + values.nbytes] == values.tobytes()


# ---- the loader ---------------------------------------------------------------------------------------------

_WITHOUT_EXTENSION = """
import importlib.abc, json, logging, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "peerd._dataplane._native":
            raise ImportError("hidden by the test: as if it were not built")
sys.meta_path.insert(0, Hide())
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from peerd.wire import native
from peerd.wire.seal import Sealer, dataplane
try:
    Sealer(bytes(32))
    Sealer(bytes(32))
    made = True
except RuntimeError as e:
    made = str(e)
print(json.dumps({"plane": dataplane(), "reason": native.reason, "made": made}))
"""


@pytest.mark.parametrize("asked", ["", "auto", "python", "native", "fast"])
def test_loader_without_the_extension(asked: str) -> None:
    """Without the extension (a source install with no compiler): the Python path runs and says why once, at the
    first sealer, as a warning; PEERD_DATAPLANE=native refuses to run slower than asked, and so does a value
    that means nothing."""
    import subprocess
    import sys

    env = {**os.environ, "PEERD_DATAPLANE": asked}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_EXTENSION], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    got = json.loads(done.stdout)
    assert got["plane"] == "python"
    if asked in ("", "auto"):
        assert got["made"] is True and "not built" in got["reason"] and "libssl-dev" in got["reason"]
        assert done.stderr.count("data plane: python") == 1 and done.stderr.startswith("WARNING")
    elif asked == "python":
        assert got["made"] is True and done.stderr.count("data plane: python (PEERD_DATAPLANE=python)") == 1
    else:
        assert "PEERD_DATAPLANE" in got["made"] and "data plane" not in done.stderr
