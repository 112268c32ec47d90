"""Compression codecs for the average: pure array functions, no I/O (protocol/codecs.md).

``codec(name, **params)`` builds the body codec a run agreed on; ``peerd.compress.topk`` holds arc-topk's
sketch, row selection and EF21M state.
"""

from __future__ import annotations

from .base import MAX_COUNT, Codec, CodecError
from .floats import BFloat16Codec, Float16Codec, Float32Codec
from .quant import IntCodec
from .rounding import PHASE_AG, PHASE_RS, PHASE_SKETCH, RoundingKey

NAMES = ("fp32", "fp16", "bf16", "int8", "int4")
COMPRESSIONS = (*NAMES, "arc-topk")


def codec(name: str, **params: object) -> Codec:
    """The body codec ``name``: int8/int4 take ``group`` (default 128) and ``rounding`` ("stochastic" or
    "nearest"); the float codecs take nothing. arc-topk is not a body codec: see ``topk.ArcTopK``."""
    if name in ("fp32", "fp16", "bf16"):
        if params:
            raise ValueError(f"{name} takes no parameters, got {sorted(params)}")
        return {"fp32": Float32Codec, "fp16": Float16Codec, "bf16": BFloat16Codec}[name]()
    if name in ("int8", "int4"):
        unknown = set(params) - {"group", "rounding"}
        if unknown:
            raise ValueError(f"{name} takes group and rounding, got {sorted(unknown)}")
        return IntCodec(8 if name == "int8" else 4, **params)  # type: ignore[arg-type]
    if name == "arc-topk":
        raise ValueError("arc-topk is not a body codec: build peerd.compress.topk.ArcTopK, whose value codec "
                         "encodes the dense rows")
    raise ValueError(f"unknown codec {name!r}; one of {COMPRESSIONS}")


def by_wire_id(wire_id: int, **params: object) -> Codec:
    """The codec a tensor header's codec byte names (params as the run configured them)."""
    if not 0 <= wire_id < len(NAMES):
        raise CodecError(f"unknown codec byte {wire_id}")
    name = NAMES[wire_id]
    return codec(name, **(params if name.startswith("int") else {}))


__all__ = [
    "COMPRESSIONS", "MAX_COUNT", "NAMES", "PHASE_AG", "PHASE_RS", "PHASE_SKETCH", "Codec", "CodecError",
    "RoundingKey", "by_wire_id", "codec",
]
