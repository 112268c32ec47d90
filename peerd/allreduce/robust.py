"""Robust aggregation options: how a shard owner limits each member's contribution.

``clip[:C]``: each member's contribution to a range is scaled down to at most C times the median norm of the
contributions that arrived for it. ``centered[:C]``: the same, measured as the distance from a center (the
previous round's average), and the result is the center plus the mean of the clipped differences. Norm
clipping bounds what one member can move the average by; it does not stop a sign-flipped gradient of normal
size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("clip", "centered")
DEFAULT_C = 2.0
MAX_C = 1e6


@dataclass(frozen=True)
class Robust:
    mode: str  # "clip" or "centered"
    c: float = DEFAULT_C

    def __str__(self) -> str:
        return f"{self.mode}:{self.c:g}"


def parse_robust(text: object) -> Robust | None:
    """``off`` (or None or ""): None; ``clip``, ``clip:C``, ``centered``, ``centered:C``: a Robust.
    Raises ValueError with a message that says what is accepted."""
    if text is None or text == "" or text == "off":
        return None
    if not isinstance(text, str):
        raise ValueError(f"robust must be a string (off, clip[:C], centered[:C]), got {text!r:.80}")
    mode, sep, c_text = text.partition(":")
    if mode not in MODES:
        raise ValueError(f"robust must be off, clip[:C] or centered[:C], got {text!r:.80}")
    c = DEFAULT_C
    if sep:
        try:
            c = float(c_text)
        except ValueError:
            raise ValueError(f"robust {mode}:C needs a number C, got {c_text!r:.40}") from None
        if not (math.isfinite(c) and 0 < c <= MAX_C):
            raise ValueError(f"robust {mode}:C needs 0 < C <= {MAX_C:g}, got {c_text!r:.40}")
    return Robust(mode, c)
