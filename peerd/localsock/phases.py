"""Where a trainer step's time goes: the phase names both sides of the local socket use, and their check.

The daemon times its part of a step (copying the slot in, matchmaking, waiting for group members, the
transfer, the agreement of an outer step, writing the result out) and returns it as ``phases`` in the step's
reply; the trainer adds its own (its copies, and ``daemon``: the wait on the socket beyond what the daemon
accounts for) and reports the sum with its next step, so the daemon's metrics and ``peerd status`` see the
whole step. A trainer's report is a claim of a local process: it is bounded and checked like any input.
"""

from __future__ import annotations

import math
from typing import Any

# The order is the order of a step: the trainer's copy into the arena, the socket, the daemon's copy, the
# round, the agreement (DiLoCo's outer step), the result's way back.
PHASES = ("copy_in", "daemon", "matchmaking", "members", "transfer", "agree", "copy_out")
MAX_PHASE_S = 86_400.0  # a reported phase longer than a day is not a phase of a step


def empty_phases() -> dict[str, float]:
    """Every phase at zero (a step that did not reach the daemon, or spent nothing in a phase)."""
    return dict.fromkeys(PHASES, 0.0)


def add_phases(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Add ``more``'s seconds into ``into`` phase by phase (unknown names are ignored); returns ``into``."""
    for name, seconds in more.items():
        if name in into:
            into[name] += seconds
    return into


def parse_phases(raw: Any) -> dict[str, float] | None:
    """A reported ``phases`` map, checked: known names only, finite seconds in [0, MAX_PHASE_S]; None if it is
    not one (the caller ignores it: a report is informative, never a reason to fail a step)."""
    if not isinstance(raw, dict) or len(raw) > len(PHASES):
        return None
    out: dict[str, float] = {}
    for name, seconds in raw.items():
        if name not in PHASES or isinstance(seconds, bool) or not isinstance(seconds, int | float):
            return None
        if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_PHASE_S):
            return None
        out[name] = float(seconds)
    return out
