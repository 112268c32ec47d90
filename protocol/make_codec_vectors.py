#!/usr/bin/env python3
"""Generate the golden codec vectors in protocol/vectors/codecs.json (protocol/codecs.md) from fixed inputs.

    python protocol/make_codec_vectors.py            # (re)write protocol/vectors/codecs.json
    python protocol/make_codec_vectors.py --check    # exit 1 if the checked-in file differs

Deterministic: fixed values, fixed rounding keys. Float32 arrays are written as the hex of their little-endian
bytes, so every bit is pinned.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from peerd.compress import CodecError, RoundingKey, codec  # noqa: E402
from peerd.compress.rounding import PHASE_AG, draw_bits, stream_key  # noqa: E402
from peerd.compress.topk import TopKLayout  # noqa: E402

OUT = ROOT / "protocol" / "vectors" / "codecs.json"


def f32(values: Any) -> str:
    return np.asarray(values, dtype="<f4").tobytes().hex()


def ramp(n: int, seed: int) -> np.ndarray:
    """Fixed pseudo-random float32 values (a numpy PCG64 stream; the vector holds their bits anyway)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * (1 + seed)).astype(np.float32)


def encoding(name: str, values: np.ndarray, params: dict, key: RoundingKey | None, offset: int) -> dict:
    c = codec(name, **params)
    body = c.encode(values, key=key, offset=offset)
    out = c.decode(body, len(values))
    v: dict[str, Any] = {"codec": name, "wire_id": c.wire_id, "params": params, "count": len(values),
                         "offset": offset, "values": f32(values), "body": body.hex(), "decoded": f32(out)}
    if key is not None:
        v["key"] = {"run": key.run, "round": key.round, "sender": key.sender, "phase": key.phase}
    return v


def encodings() -> list[dict]:
    k = RoundingKey(0x0123456789ABCDEF, 42, 3)
    kag = RoundingKey(0x0123456789ABCDEF, 42, 1, PHASE_AG)
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 1e-8, 3.1415927, 1 + 2**-8], np.float32)
    return [
        encoding("fp32", special, {}, None, 0),
        encoding("fp32", ramp(5, 1), {}, None, 286),
        encoding("fp16", special, {}, None, 0),
        encoding("fp16", ramp(7, 2), {}, None, 572),
        encoding("bf16", special, {}, None, 0),
        encoding("bf16", ramp(7, 3), {}, None, 572),
        encoding("int8", ramp(10, 4), {"group": 4, "rounding": "nearest"}, None, 0),
        encoding("int8", ramp(10, 4), {"group": 4, "rounding": "stochastic"}, k, 1000),
        encoding("int8", ramp(130, 5), {"group": 128, "rounding": "stochastic"}, kag, 1108),
        encoding("int8", np.array([0.25] * 5 + [-7.0] * 3, np.float32), {"group": 5, "rounding": "nearest"}, None, 0),
        encoding("int4", ramp(9, 6), {"group": 4, "rounding": "nearest"}, None, 0),
        encoding("int4", ramp(9, 6), {"group": 4, "rounding": "stochastic"}, k, 77),
        encoding("int4", ramp(131, 7), {"group": 128, "rounding": "stochastic"}, kag, 2152),
    ]


def invalid() -> list[dict]:
    """Bodies a decoder must refuse (CodecError / a counted drop), each with why."""
    out = []

    def bad(name: str, params: dict, count: int, body: bytes, why: str) -> None:
        try:
            codec(name, **params).decode(body, count)
        except CodecError:
            out.append({"codec": name, "params": params, "count": count, "body": body.hex(), "why": why})
            return
        raise AssertionError(f"{why}: decoded")

    q = {"group": 4, "rounding": "nearest"}
    good8 = bytearray(codec("int8", **q).encode(ramp(10, 4)))
    good4 = bytearray(codec("int4", **q).encode(ramp(9, 6)))
    bad("int8", q, 10, bytes(good8[:-1]), "one byte short")
    bad("int8", q, 10, bytes(good8) + b"\0", "one byte long")
    for at, val, why in ((0, 0.0, "scale 0"), (4, -1.0, "negative scale"), (8, np.inf, "infinite scale"),
                         (2, np.nan, "NaN min"), (6, -np.inf, "infinite min")):
        b = bytearray(good8)
        b[at : at + 2] = np.float16(val).tobytes()
        bad("int8", q, 10, bytes(b), why)
    b = bytearray(good4)
    b[-1] |= 0x10
    bad("int4", q, 9, bytes(b), "int4 padding nibble not zero")
    bad("int4", q, 9, bytes(good4[:-1]), "int4 one byte short")
    bad("fp16", {}, 2, np.array([1.0, np.inf], "<f2").tobytes(), "fp16 inf")
    bad("fp16", {}, 2, np.array([np.nan, 1.0], "<f2").tobytes(), "fp16 NaN")
    bad("bf16", {}, 2, bytes.fromhex("803f807f"), "bf16 inf")
    bad("bf16", {}, 1, bytes.fromhex("c17f"), "bf16 NaN")
    bad("fp32", {}, 1, np.float32(np.nan).tobytes(), "fp32 NaN")
    bad("fp32", {}, 2, bytes(7), "fp32 size not 4 * count")
    return out


def draws() -> list[dict]:
    out = []
    for run, rnd, sender, phase, start in ((0, 0, 0, 0, 0), (0x0123456789ABCDEF, 42, 3, 0, 1000),
                                            (2**64 - 1, 2**32, 7, 1, 2**32 - 8)):
        key = stream_key(run, rnd, sender, phase)
        out.append({"run": run, "round": rnd, "sender": sender, "phase": phase, "stream_key": f"{key:016x}",
                    "start": start, "draws24": draw_bits(key, start, 8).tolist()})
    return out


def topk() -> dict:
    lay = TopKLayout(((12, 5), (3,), (8, 2, 3), (3, 4)), 2, 0.25)  # (3, 4): a top of one row, sent whole
    x = ramp(lay.length, 8)
    sk = lay.sketch(x, 5, 6)
    shards = []
    for j in range(lay.n):
        sel = lay.select(j, sk[slice(*lay.sketch_shard(j))])
        shards.append({"row_shard": list(lay.row_shard(j)), "selection": [r.tolist() for r in sel],
                       "body": lay.encode_selection(j, sel).hex(), "dense": f32(lay.gather(x, j, sel))})
    return {"shapes": [list(s) for s in lay.shapes], "n": lay.n, "ratio": lay.ratio, "run": 5, "round": 6,
            "values": f32(x), "sketch_v0": lay.sketch_matrix(5, 6, 0).reshape(-1).astype(int).tolist(),
            "sketch": f32(sk), "shards": shards}


def build() -> dict:
    return {
        "description": "peerd codec bodies (protocol/codecs.md). Arrays are hex of little-endian float32; "
                       "bodies are hex. 'decoded' is what every receiver computes from 'body'.",
        "encodings": encodings(),
        "invalid": invalid(),
        "draws": draws(),
        "arc_topk": topk(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    text = json.dumps(build(), indent=1) + "\n"
    if ap.parse_args().check:
        same = OUT.exists() and OUT.read_text() == text
        print("codecs.json up to date" if same else "codecs.json differs")
        return 0 if same else 1
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
