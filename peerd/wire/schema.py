"""Tiny validators for decoded msgpack: every field's type, size and range is checked."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .errors import WireError

Validator = Callable[[Any], Any]


def _bad(detail: str) -> WireError:
    return WireError("malformed", detail)


def uint(bits: int) -> Validator:
    top = 2**bits

    def check(v: Any) -> int:
        if type(v) is not int or not 0 <= v < top:
            raise _bad(f"expected uint{bits}, got {v!r:.40}")
        return v

    return check


def number(lo: float, hi: float) -> Validator:
    def check(v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise _bad(f"expected a number in [{lo}, {hi}], got {v!r:.40}")
        return float(v)

    return check


def binary(lo: int, hi: int) -> Validator:
    def check(v: Any) -> bytes:
        if type(v) is not bytes or not lo <= len(v) <= hi:
            raise _bad(f"expected {lo}..{hi} bytes, got {type(v).__name__} of length {_len(v)}")
        return v

    return check


def text(hi: int) -> Validator:
    def check(v: Any) -> str:
        if type(v) is not str or len(v) > hi:
            raise _bad(f"expected a string of at most {hi} characters")
        return v

    return check


def boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise _bad("expected a boolean")
    return v


def optional(inner: Validator) -> Validator:
    def check(v: Any) -> Any:
        return None if v is None else inner(v)

    return check


def array_of(item: Validator, hi: int) -> Validator:
    def check(v: Any) -> list:
        if type(v) is not list or len(v) > hi:
            raise _bad(f"expected a list of at most {hi} items")
        return [item(x) for x in v]

    return check


def tuple_of(*items: Validator, optional: int = 0) -> Validator:
    """An array of exactly ``items`` (the last ``optional`` of them may be left off: the result is as long as the
    array)."""
    lo = len(items) - optional

    def check(v: Any) -> tuple:
        if type(v) is not list or not lo <= len(v) <= len(items):
            want = f"{len(items)}" if not optional else f"{lo} to {len(items)}"
            raise _bad(f"expected an array of {want} items")
        return tuple(f(x) for f, x in zip(items, v, strict=False))

    return check


def struct(fields: dict[str, Validator]) -> Validator:
    """A map with exactly these keys (unknown or missing keys are malformed)."""

    names = set(fields)

    def check(v: Any) -> dict:
        if type(v) is not dict or v.keys() != names:
            got = sorted(map(str, v)) if isinstance(v, dict) else type(v).__name__
            raise _bad(f"expected a map with keys {sorted(names)}, got {got}")
        return {k: f(v[k]) for k, f in fields.items()}

    return check


def _len(v: Any) -> int | str:
    try:
        return len(v)
    except TypeError:
        return "-"
