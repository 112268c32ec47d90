"""The averaging API on the local socket (protocol/LOCAL.md, "Averaging"): open a run, average rounds.

Vectors travel as raw little-endian float32 bytes inside the msgpack frame: one copy each way, fine
for the sizes a bench or a small model sends (the trainer's shared-memory arena is for the rest).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import numpy as np

from ..allreduce.robust import Robust, parse_robust
from ..localsock.server import OpError
from .keys import Grid
from .service import MoshpitError, MoshpitService


class MoshpitOps:
    def __init__(self, service: MoshpitService) -> None:
        self.service = service

    def ops(self) -> dict:
        return {"avg_open": self.open, "avg_round": self.round}

    async def open(self, request: dict[str, Any]) -> dict[str, Any]:
        run_id = request.get("run")
        grid = request.get("grid")
        try:
            st = await self.service.open(
                run_id,  # type: ignore[arg-type]
                grid=Grid.parse(grid) if isinstance(grid, str) else None,
                cell=_opt_int(request, "cell"),
                min_size=_opt_int(request, "min_size") or 2,
                window_s=float(request.get("window_s") or 3.0),
                adapt=request.get("adapt") if isinstance(request.get("adapt"), bool) else None,
                keep_rounds=_opt_int(request, "keep_rounds"),
                **_averaging_options(request),
            )
        except (MoshpitError, ValueError) as e:
            raise OpError(str(e)) from None
        return {"run": st.run_id, **asdict(st.statistics())}

    async def round(self, request: dict[str, Any]) -> dict[str, Any]:
        data = request.get("vector")
        if not isinstance(data, bytes) or len(data) % 4 or not data:
            raise OpError("vector must be non-empty bytes of little-endian float32 (len % 4 == 0)")
        weight = request.get("weight", 1.0)
        timeout_s = request.get("timeout_s", 30.0)
        if not isinstance(weight, int | float) or not isinstance(timeout_s, int | float):
            raise OpError("weight and timeout_s must be numbers")
        vector = np.frombuffer(data, dtype="<f4").astype(np.float32, copy=True)
        if not np.isfinite(vector).all():
            raise OpError("vector holds NaN or infinity: refusing to spread it to the swarm")
        try:
            result = await self.service.average(request.get("run"), vector, float(weight),  # type: ignore[arg-type]
                                                timeout_s=float(timeout_s), round_no=_opt_int(request, "round"),
                                                **_averaging_options(request))
        except MoshpitError as e:
            raise OpError(str(e)) from None
        return {"vector": result.vector.astype("<f4").tobytes(), "stats": asdict(result.statistics())}


def _averaging_options(request: dict[str, Any]) -> dict[str, Any]:
    """``max_samples`` (a positive finite number: owners count no member's weight above it), ``robust``
    (``off``, ``clip[:C]``, ``centered[:C]``) and ``compression`` with ``quant_group`` and ``rounding`` (the run's
    codec, checked by the service), each only when the request has it: the run keeps what it had."""
    out: dict[str, Any] = {}
    cap = request.get("max_samples")
    if cap is not None:
        if type(cap) not in (int, float) or not (math.isfinite(cap) and cap > 0):
            raise OpError(f"max_samples must be a positive finite number (the largest weight one member may "
                          f"have), got {cap!r:.40}")
        out["max_weight"] = float(cap)
    robust = request.get("robust")
    if robust is not None:
        try:
            mode: Robust | None = parse_robust(robust)
        except ValueError as e:
            raise OpError(str(e)) from None
        out["robust"] = mode if mode is not None else "off"
    for name in ("compression", "quant_group", "rounding"):
        if request.get(name) is not None:
            out[name] = request[name]
    return out


def _opt_int(request: dict[str, Any], name: str) -> int | None:
    value = request.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise OpError(f"{name} must be an integer")
    return value
