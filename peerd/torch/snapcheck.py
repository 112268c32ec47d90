"""What a trainer checks in a snapshot from another machine before it loads any of it: a snapshot is a donor's
claim (any member can advertise one), so non-finite tensors and implausible steps are refused, never applied."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# No run takes 2**40 (about 10**12) optimizer steps; a larger step is a forgery, and would overflow schedulers.
MAX_STEP = 2**40
MAX_DEPTH = 16  # nesting of an optimizer's state dict walked for tensors (torch's own are 3 deep)


class SnapshotError(ValueError):
    """A snapshot this trainer refuses to load; the message says why. Nothing of it was applied."""


def checked_step(step: Any, expected: int | None = None) -> int:
    """The snapshot's step, if it is an integer in [0, MAX_STEP] and (when given) the step its donors advertised."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise SnapshotError(f"the snapshot's step {step!r:.40} is not a plausible step (an integer in [0, 2**40])")
    if expected is not None and step != expected:
        raise SnapshotError(f"the snapshot's step {step} is not the step {expected} its donors advertised")
    return step


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or infinity. A finite sum proves it (any NaN or infinity makes the sum NaN or
    infinite) at a twentieth of ``isfinite(t).all()``'s cost, which allocates a mask the tensor's size; only a
    sum that is not finite (a non-finite element, or finite values whose sum overflows) is checked element-wise."""
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def all_finite_each(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether no tensor in ``tensors`` (None entries skipped) holds NaN or infinity: one finite sum of every
    tensor's sum proves it for all of them, where a check per tensor costs a sync each (a model's ~50 gradients:
    0.4 ms against 4-5 ms a step); a sum that is not finite, or tensors of several dtypes, are checked tensor by
    tensor, as ``all_finite``."""
    ts = [t for t in tensors if t is not None and t.numel()]
    if not ts:
        return True
    if len({t.dtype for t in ts}) == 1 and bool(torch.isfinite(torch.stack([t.sum() for t in ts]).sum())):
        return True
    return all(all_finite(t) for t in ts)


def check_finite(value: Any, what: str, depth: int = 0) -> None:
    """Raise SnapshotError if any floating-point tensor (or float) in ``value`` (tensors, numbers, and dicts, lists
    and tuples of them) holds NaN or infinity."""
    if depth > MAX_DEPTH:
        raise SnapshotError(f"the snapshot's {what} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            raise SnapshotError(f"the snapshot's {what} holds NaN or infinity")
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise SnapshotError(f"the snapshot's {what} holds NaN or infinity")
    elif isinstance(value, dict):
        for v in value.values():
            check_finite(v, what, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            check_finite(v, what, depth + 1)
