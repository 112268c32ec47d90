"""Codec throughput on one core: ``python -m peerd.tools.bench.codecs [--size N] [--payload B] [codec ...]``.

Encodes a flat float32 vector as the datagram ranges a 1200-byte sealed datagram holds (block path), decodes it
back, and prints MB/s of float32 input per direction, with the body bytes over the fp32 bytes. One JSON line per
codec, so figures can be quoted with their command.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ...compress import NAMES, RoundingKey, codec

DEFAULT_PAYLOAD = 1200 - 21 - 16 - 19  # datagram - envelope - AEAD tag - tensor header


def measure(name: str, size: int, payload: int, rounding: str | None = None, repeat: int = 3) -> dict:
    c = codec(name, rounding=rounding) if rounding else codec(name)
    per = c.max_count(payload)
    rows = size // per
    x = np.random.default_rng(0).standard_normal(rows * per).astype(np.float32).reshape(rows, per)
    key = RoundingKey(1, 2, 3)
    enc, dec = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        bodies = c.encode_block(x, key=key, offset=0)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, ok = c.decode_block(bodies, per)
        dec.append(time.perf_counter() - t)
        assert ok.all()
    mb = x.nbytes / 1e6
    return {"codec": repr(c), "elements": x.size, "per_body": per, "encode_MBps": round(mb / min(enc)),
            "decode_MBps": round(mb / min(dec)), "body_bytes_over_fp32": round(bodies.size / x.nbytes, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("codecs", nargs="*", default=list(NAMES))
    ap.add_argument("--size", type=int, default=25_000_000)
    ap.add_argument("--payload", type=int, default=DEFAULT_PAYLOAD)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    for name in a.codecs:
        for r in (("stochastic", "nearest") if name.startswith("int") else (None,)):
            print(json.dumps(measure(name, a.size, a.payload, r, a.repeat)), flush=True)


if __name__ == "__main__":
    main()
