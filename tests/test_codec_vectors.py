"""Golden codec vectors (protocol/vectors/codecs.json) against peerd.compress, and against a small reference
written from protocol/codecs.md alone (struct and plain Python ints; no peerd.compress), so the vectors, the
spec and the code cannot drift apart silently."""

from __future__ import annotations

import importlib.util
import json
import struct
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from peerd.compress import CodecError, RoundingKey, codec
from peerd.compress.rounding import draw_bits, stream_key
from peerd.compress.topk import TopKLayout

ROOT = Path(__file__).resolve().parent.parent
M64 = (1 << 64) - 1
M32 = (1 << 32) - 1


@cache
def vectors() -> dict:
    return json.loads((ROOT / "protocol" / "vectors" / "codecs.json").read_text())


def f32(hexstr: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hexstr), dtype="<f4")


# ---- the reference, from protocol/codecs.md ------------------------------------------------------------------


def ref_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_key(run: int, rnd: int, sender: int, phase: int) -> int:
    k = ref_mix64((run + 0x9E3779B97F4A7C15) & M64)
    for x in (rnd, sender, phase):
        k = ref_mix64(k ^ x)
    return k


def ref_draw(key: int, e: int) -> int:
    z = (((e * 0x9E3779B9) & M32) + (key & M32)) & M32
    z ^= key >> 32
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & M32
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & M32
    z ^= z >> 16
    return z >> 8


def ref_decode(name: str, params: dict, count: int, body: bytes) -> np.ndarray:
    f = np.float32
    if name == "fp32":
        assert len(body) == 4 * count
        vals = [f(v) for v in struct.unpack(f"<{count}f", body)]
    elif name == "fp16":
        assert len(body) == 2 * count
        vals = [f(v) for v in struct.unpack(f"<{count}e", body)]
    elif name == "bf16":
        assert len(body) == 2 * count
        vals = [f(struct.unpack("<f", struct.pack("<I", h << 16))[0]) for h in struct.unpack(f"<{count}H", body)]
    else:
        g = params["group"]
        ng = -(-count // g)
        codes_len = count if name == "int8" else (count + 1) // 2
        assert len(body) == 4 * ng + codes_len
        sm = struct.unpack(f"<{2 * ng}e", body[: 4 * ng])
        codes = body[4 * ng :]
        if name == "int8":
            q = list(codes)
        else:
            q = [c for b in codes for c in (b & 15, b >> 4)]
            assert len(q) == count or q[count] == 0
        vals = []
        for i in range(count):
            s, m = f(sm[2 * (i // g)]), f(sm[2 * (i // g) + 1])
            assert np.isfinite(s) and s > 0 and np.isfinite(m)
            vals.append(f(m + f(f(q[i]) * s)))
    out = np.array(vals, dtype=np.float32)
    assert np.isfinite(out).all()
    return out


# ---- tests ---------------------------------------------------------------------------------------------------


def test_generator_reproduces_the_checked_in_file():
    spec = importlib.util.spec_from_file_location("make_codec_vectors", ROOT / "protocol" / "make_codec_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.dumps(mod.build(), indent=1) + "\n" == (ROOT / "protocol" / "vectors" / "codecs.json").read_text()


@pytest.mark.parametrize("v", vectors()["encodings"], ids=lambda v: f"{v['codec']}-{v['count']}-{v['offset']}")
def test_encodings(v):
    c = codec(v["codec"], **v["params"])
    assert c.wire_id == v["wire_id"]
    key = RoundingKey(**v["key"]) if "key" in v else None
    body = bytes.fromhex(v["body"])
    assert c.encode(f32(v["values"]), key=key, offset=v["offset"]) == body
    assert len(body) == c.body_size(v["count"])
    assert c.decode(body, v["count"]).tobytes().hex() == v["decoded"]
    assert ref_decode(v["codec"], v["params"], v["count"], body).tobytes().hex() == v["decoded"]


@pytest.mark.parametrize("v", vectors()["invalid"], ids=lambda v: v["why"])
def test_invalid_bodies(v):
    with pytest.raises(CodecError):
        codec(v["codec"], **v["params"]).decode(bytes.fromhex(v["body"]), v["count"])
    with pytest.raises(AssertionError):
        ref_decode(v["codec"], v["params"], v["count"], bytes.fromhex(v["body"]))


@pytest.mark.parametrize("v", vectors()["draws"], ids=lambda v: v["stream_key"])
def test_draws(v):
    key = stream_key(v["run"], v["round"], v["sender"], v["phase"])
    assert f"{key:016x}" == v["stream_key"] == f"{ref_key(v['run'], v['round'], v['sender'], v['phase']):016x}"
    assert draw_bits(key, v["start"], 8).tolist() == v["draws24"]
    assert [ref_draw(key, v["start"] + i) for i in range(8)] == v["draws24"]


def test_stochastic_vectors_follow_the_draw_rule():
    """Each stochastic int code is floor((x - min) / scale + u) with u = draw / 2**24, from the spec."""
    for v in vectors()["encodings"]:
        if v["params"].get("rounding") != "stochastic":
            continue
        k = v["key"]
        key = ref_key(k["run"], k["round"], k["sender"], k["phase"])
        body, g, count = bytes.fromhex(v["body"]), v["params"]["group"], v["count"]
        ng = -(-count // g)
        sm = np.frombuffer(body[: 4 * ng], "<f2").reshape(ng, 2).astype(np.float32)
        x = f32(v["values"])
        s = np.repeat(sm[:, 0], g)[:count]
        m = np.repeat(sm[:, 1], g)[:count]
        u = np.array([ref_draw(key, v["offset"] + i) for i in range(count)], np.float32) / np.float32(2**24)
        levels = 255 if v["codec"] == "int8" else 15
        want = np.clip(np.floor((x - m) * (np.float32(1) / s) + u), 0, levels)
        got = ref_decode(v["codec"], v["params"], count, body)
        assert np.array_equal(got, (m + want.astype(np.float32) * s).astype(np.float32))


def test_arc_topk_vector():
    t = vectors()["arc_topk"]
    lay = TopKLayout(tuple(tuple(s) for s in t["shapes"]), t["n"], t["ratio"])
    x = f32(t["values"])
    assert lay.sketch_matrix(t["run"], t["round"], 0).reshape(-1).astype(int).tolist() == t["sketch_v0"]
    key = ref_key(t["run"], t["round"], 0, 2)
    assert t["sketch_v0"] == [-1 if (ref_draw(key, i) >> 23) & 1 else 1 for i in range(len(t["sketch_v0"]))]
    sk = lay.sketch(x, t["run"], t["round"])
    assert np.allclose(sk, f32(t["sketch"]), rtol=1e-5, atol=1e-6)  # a matmul: summation order may differ
    for j, sh in enumerate(t["shards"]):
        assert list(lay.row_shard(j)) == sh["row_shard"]
        sel = lay.decode_selection(j, bytes.fromhex(sh["body"]))
        assert [r.tolist() for r in sel] == sh["selection"]
        assert lay.gather(x, j, sel).tobytes().hex() == sh["dense"]
