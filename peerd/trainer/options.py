"""What a trainer declares when it opens a session, checked: its layout, codec, sample cap and snapshot bound.

Every value comes from a local process over the socket: each parser bounds and validates it and raises OpError
with a message that says what is allowed.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from ..localsock.server import OpError
from ..moshpit.service import MoshpitError, check_compression

MAX_RUN_ID = 48  # so that '<run>.<layout hash>.<g|p>' fits Moshpit's 64-byte run ids
MAX_TENSORS = 100_000
MAX_BLOB = 1 << 34
DTYPES = {"float32", "float16", "bfloat16", "float64"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
MAX_SAMPLES = float(2**53)  # the largest max_samples a trainer may ask for (exact in a float)
# A snapshot (peerd.torch: torch.save of the flat float32 parameters, the optimizer's state dict and a few
# numbers) is bounded by its layout: the parameters, SNAPSHOT_STATE_COPIES optimizer tensors per parameter
# (Adam with amsgrad holds 3) at no less than 4 bytes an element, container bytes per tensor, a fixed slack.
SNAPSHOT_STATE_COPIES = 4
SNAPSHOT_TENSOR_OVERHEAD = 4096
SNAPSHOT_SLACK = 1 << 20


def layout_hash(layout: list[tuple[str, tuple[int, ...], str]]) -> str:
    """Hash of shapes and dtypes in order (names are informative only: two copies of a model may name
    parameters differently, but a different shape or order means a different model)."""
    canon = [[list(shape), dtype] for _, shape, dtype in layout]
    return hashlib.sha256(msgpack.packb(["peerd-layout-v1", canon])).hexdigest()


def parse_layout(raw: Any) -> tuple[list[tuple[str, tuple[int, ...], str]], int]:
    """Validate a declared layout; returns it and its total element count. Raises OpError."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_TENSORS:
        raise OpError(f"layout must be a list of 1..{MAX_TENSORS} [name, shape, dtype] entries")
    out, total = [], 0
    for i, entry in enumerate(raw):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise OpError(f"layout entry {i} must be [name, shape, dtype]")
        name, shape, dtype = entry
        if not isinstance(name, str) or not isinstance(shape, list) or dtype not in DTYPES:
            raise OpError(f"layout entry {i}: name must be a string, shape a list, dtype one of {sorted(DTYPES)}")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise OpError(f"layout entry {i} ({name}): shape must hold non-negative integers")
        out.append((name, tuple(shape), dtype))
        total += math.prod(shape)
    if total == 0:
        raise OpError("the layout holds no elements")
    return out, total


def parse_compression(req: dict[str, Any]) -> dict[str, Any]:
    """trainer_open's ``compression`` (fp32, fp16, bf16, int8, int4), ``quant_group`` and ``rounding`` (int8/int4):
    the keywords every average of the session passes to Moshpit (empty when the trainer names none: the run's
    codec, fp32 unless set). All members of a run must declare the same: a body in another codec is a counted drop.
    Raises OpError."""
    name, group, rounding = req.get("compression"), req.get("quant_group"), req.get("rounding")
    if name is None and group is None and rounding is None:
        return {}
    if name == "arc-topk":
        return _parse_topk(req)
    try:
        codec = check_compression("fp32" if name is None else name, group, rounding)
    except MoshpitError as e:
        raise OpError(f"{e} (compression is optional: fp32, fp16, bf16, int8 or int4; quant_group and rounding "
                      f"go with int8 and int4)") from None
    if codec is None:
        return {"compression": "fp32"}
    out: dict[str, Any] = {"compression": codec.name}
    if codec.name.startswith("int"):
        out.update(quant_group=codec.group, rounding=codec.rounding)  # type: ignore[attr-defined]
    return out


def _parse_topk(req: dict[str, Any]) -> dict[str, Any]:
    """arc-topk's keywords: ``topk_ratio`` (default 0.1) and ``ef_eta`` (EF21M's eta, default 1.0: EF21, as the
    trainer's optimizer keeps its own momentum; 0.1 stacked on Adam cost 6 points in the demo even at ratio 1.0;
    None: no error feedback). The layout's shapes are added by trainer_open (``topk_layout``)."""
    if req.get("quant_group") is not None or req.get("rounding") is not None:
        raise OpError("quant_group and rounding go with int8 and int4, not with arc-topk")
    ratio, eta = req.get("topk_ratio", 0.1), req.get("ef_eta", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        raise OpError(f"topk_ratio must be in (0, 1], got {ratio!r:.40}")
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, int | float) or not 0.0 < eta <= 1.0):
        raise OpError(f"ef_eta must be in (0, 1] or None (no error feedback), got {eta!r:.40}")
    return {"compression": "arc-topk", "topk_ratio": float(ratio), "ef_eta": None if eta is None else float(eta)}



def snapshot_bound(layout: list[tuple[str, tuple[int, ...], str]]) -> int:
    """The most bytes a snapshot of a model with ``layout`` can hold (see SNAPSHOT_STATE_COPIES): a joiner
    allocates no more than this for a download, whatever a donor advertises."""
    elems = sum(math.prod(shape) for _, shape, _ in layout)
    state = sum(math.prod(shape) * max(4, ITEMSIZE[dtype]) for _, shape, dtype in layout)
    bound = (4 * elems + SNAPSHOT_STATE_COPIES * state
             + (SNAPSHOT_STATE_COPIES + 1) * len(layout) * SNAPSHOT_TENSOR_OVERHEAD + SNAPSHOT_SLACK)
    return min(bound, MAX_BLOB)


def parse_max_samples(raw: Any) -> float | None:
    """trainer_open's ``max_samples``: None, or a positive finite number up to MAX_SAMPLES. Raises OpError."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not (math.isfinite(raw) and 0 < raw <= MAX_SAMPLES):
        raise OpError(f"max_samples must be a positive finite number of samples (at most 2**53), got {raw!r:.40}; "
                      f"leave it out for the averaging layer's cap of 2**24")
    return float(raw)


MAX_AUTO_REASON = 1000  # characters of a trainer's auto choice reason kept for `peerd status`


def small_value(v: Any) -> bool:
    """A number, or a string of at most MAX_AUTO_REASON characters."""
    if isinstance(v, str):
        return len(v) <= MAX_AUTO_REASON
    return isinstance(v, int | float) and not isinstance(v, bool)

