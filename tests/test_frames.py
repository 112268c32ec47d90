"""The local socket's frames: length-prefixed msgpack maps, decoded sans-I/O from arbitrary chunks."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.localsock.frames import LENGTH, MAX_FRAME, FrameDecoder, FrameError, encode_frame

from .support.properties import repeatable

FAST = repeatable(100)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=8), inner, max_size=5),
    ),
    max_leaves=20,
)
messages = st.dictionaries(st.text(max_size=10), values, max_size=6)


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def decode_all(chunks: list[bytes]) -> tuple[list[dict], FrameDecoder]:
    decoder = FrameDecoder()
    out: list[dict] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
    return out, decoder


@settings(FAST, max_examples=50)
@given(st.lists(messages, max_size=4), st.lists(st.integers(0, 10_000), max_size=20))
def test_round_trip_with_arbitrary_chunking(msgs: list[dict], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(msg) for msg in msgs)
    chunks = split(stream, cuts)
    assert b"".join(chunks) == stream
    out, decoder = decode_all(chunks)
    assert out == msgs
    assert decoder.pending == 0


def test_byte_by_byte_and_all_at_once() -> None:
    msgs = [{"op": "hello", "n": 1}, {}, {"ok": True, "data": b"\x00" * 1000, "nested": {"a": [1, 2.5, None]}}]
    stream = b"".join(map(encode_frame, msgs))
    out, decoder = decode_all([stream[i : i + 1] for i in range(len(stream))])
    assert out == msgs and decoder.pending == 0
    assert decode_all([stream])[0] == msgs
    assert decode_all([b"", stream, b""])[0] == msgs


def test_pending_counts_the_bytes_held() -> None:
    data = encode_frame({"op": "step"})
    decoder = FrameDecoder()
    assert decoder.feed(data[:2]) == [] and decoder.pending == 2
    assert decoder.feed(data[2:-1]) == [] and decoder.pending == len(data) - 1
    assert decoder.feed(data[-1:] + data[:3]) == [{"op": "step"}]
    assert decoder.pending == 3


def test_frame_layout() -> None:
    data = encode_frame({"op": "x"})
    assert data[:4] == len(data[4:]).to_bytes(4, "big")
    assert msgpack.unpackb(data[4:]) == {"op": "x"}


def test_oversize_length_prefix() -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameError):
        decoder.feed(LENGTH.pack(MAX_FRAME + 1))  # refused at once, without waiting for 16 MiB
    with pytest.raises(FrameError):
        FrameDecoder().feed(b"\xff\xff\xff\xff")
    with pytest.raises(FrameError):  # the bad prefix after a good frame
        FrameDecoder().feed(encode_frame({"a": 1}) + LENGTH.pack(2**32 - 1))
    at_limit = FrameDecoder()
    assert at_limit.feed(LENGTH.pack(MAX_FRAME)) == []  # exactly the limit is allowed: it waits
    assert at_limit.pending == 4


def test_encode_refuses_oversize_frames() -> None:
    with pytest.raises(FrameError):
        encode_frame({"blob": b"\x00" * MAX_FRAME})
    big = encode_frame({"blob": b"\x00" * (MAX_FRAME - 100)})
    assert FrameDecoder().feed(big)[0]["blob"] == b"\x00" * (MAX_FRAME - 100)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # an array of two with one element
        b"\x81\xa1a",  # a map missing its value
        b"\x80\x80",  # a map, then extra data
        b"\x81\xa1a\xa1\xff",  # a string that is not UTF-8
        b"\x81\x01\x02",  # an integer map key
        b"\x81\x91\x01\x02",  # an array map key
        b"",  # empty frame
        b"\xdd\xff\xff\xff\xff",  # an array of 4 billion items in five bytes
        b"\x91" * 100_000 + b"\xc0",  # nesting far deeper than any decoder's stack
    ],
)
def test_not_msgpack(payload: bytes) -> None:
    with pytest.raises(FrameError):
        FrameDecoder().feed(frame(payload))


@pytest.mark.parametrize("value", [None, 1, -1, 2.5, "op", b"op", [], [{"op": "x"}], True])
def test_not_a_map(value: object) -> None:
    with pytest.raises(FrameError):
        FrameDecoder().feed(frame(msgpack.packb(value, use_bin_type=True)))


def decode_or_frame_error(chunks: list[bytes]) -> None:
    decoder = FrameDecoder()
    try:
        for chunk in chunks:
            for message in decoder.feed(chunk):
                assert isinstance(message, dict)
    except FrameError:
        pass


@FAST
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=8))
def test_random_bytes_raise_only_frame_error(data: bytes, cuts: list[int]) -> None:
    decode_or_frame_error(split(data, cuts))


@FAST
@given(st.lists(st.binary(max_size=60), max_size=5))
def test_random_payloads_in_well_formed_frames_raise_only_frame_error(payloads: list[bytes]) -> None:
    decode_or_frame_error([b"".join(frame(p) for p in payloads)])


@settings(FAST, max_examples=50)
@given(messages, st.data())
def test_corrupted_frames_raise_only_frame_error(msg: dict, data: st.DataObject) -> None:
    raw = bytearray(encode_frame(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(4, len(raw) - 1)) if len(raw) > 4 else 0
        raw[i] = data.draw(st.integers(0, 255))
    decode_or_frame_error([bytes(raw)])
