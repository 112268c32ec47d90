"""``StepReport``: what one trainer step did and where its time went, as ``Optimizer.last_step`` holds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..localsock.phases import PHASES


@dataclass(frozen=True)
class StepReport:
    """One step of a peerd.torch optimizer (sync, overlap or DiLoCo).

    ``phases``: seconds by phase (peerd.localsock.phases.PHASES: copy_in, daemon, matchmaking, members,
    transfer, agree, copy_out), the daemon's and the trainer's summed, a parameter average due after the
    step included; ``seconds``: the whole ``step()`` call, the wrapped optimizer's own step and anything not
    in a phase included."""

    step: int  # the replica's step count after the step
    outcome: str  # averaged | alone | failed | local | nonfinite | pending (overlap: the step's buckets still out)
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    group_size: int = 1
    kept: bool = False  # the group was kept from an earlier round (no matchmaking)
    received_fraction: float = 0.0
    complete: bool = False  # every all-gather range arrived: this replica holds the group's common result
    error: str = ""
    warning: str = ""  # e.g. every member contributed the same numbers (peerd.torch.founders.SameData)

    @classmethod
    def of(cls, reply: dict[str, Any], *, seconds: float, phases: dict[str, float], step: int) -> StepReport:
        return cls(step=step, outcome=str(reply.get("outcome", "")), seconds=round(seconds, 6),
                   phases={k: round(float(phases.get(k, 0.0)), 6) for k in PHASES},
                   group_size=int(reply.get("group_size", 1) or 1), kept=bool(reply.get("kept", False)),
                   received_fraction=float(reply.get("received_fraction", 0.0) or 0.0),
                   complete=reply.get("complete") is True, error=str(reply.get("error", "") or ""),
                   warning=str(reply.get("warning", "") or ""))
