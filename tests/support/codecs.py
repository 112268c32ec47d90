"""Codec fixtures: a deliberately biased int8 codec, and the bytes a group's members send."""

from __future__ import annotations

import numpy as np

from peerd.allreduce import frames
from peerd.allreduce.shards import Layout
from peerd.compress.quant import IntCodec
from peerd.wire.envelope import HEADER_SIZE as ENVELOPE_SIZE
from peerd.wire.seal import TAG_SIZE


class BiasedInt(IntCodec):
    """A deliberately biased rounding: draws shrunk by 2 % (rounds down a little too often), on the numpy path
    (the native one makes the same bytes: tests/test_quant_native.py)."""

    def _encode_rows(self, values, key, offset):
        import peerd.compress.quant as q

        real = q.uniforms
        q.uniforms = lambda *a: real(*a) * np.float32(0.98)
        try:
            return super()._encode_rows_numpy(values, key, offset)
        finally:
            q.uniforms = real


def bytes_sent_per_peer(c, size: int, n: int, datagram: int) -> int:
    """Bytes member 0 sends in one average of a ``size``-element vector in a group of ``n``: its reduce-scatter
    streams of every other shard and its all-gather of its own shard to n-1 members, data datagrams plus END
    repeats, each datagram = envelope + AEAD tag + tensor header + body (the real header sizes)."""
    overhead = ENVELOPE_SIZE + TAG_SIZE + frames.HEADER_SIZE
    per = c.max_count(datagram - overhead)
    layout = Layout(size, n, per)

    def stream(j: int) -> int:
        start, stop = layout.shard(j)
        full, tail = divmod(stop - start, per)
        return full * (overhead + c.body_size(per)) + (overhead + c.body_size(tail) if tail else 0) + (
            frames.END_REPEATS * overhead)

    return sum(stream(j) for j in range(1, n)) + (n - 1) * stream(0)
