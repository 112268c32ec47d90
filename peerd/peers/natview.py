"""The NAT service's view, read defensively in one place: the per-peer path kinds and this node's reachability.

NatService reports through ``statistics()`` (a dataclass) or, in older builds, ``status()`` (a dict); both are
read here so nothing else in peerd.peers depends on the NAT service's shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class NatView:
    reachability: str  # public | cone-nat | symmetric-nat | unknown
    observed_addr: str | None
    paths: dict[bytes, str]  # node id -> direct | punched | relayed (peers NAT traversal set a path up for)


def _as_dict(report: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return dataclasses.asdict(report)
    return report if isinstance(report, dict) else {}


def nat_view(nat: Any) -> NatView:
    """What ``nat`` says now; an unknown view (never an exception) when it says nothing usable."""
    report: Any = None
    for name in ("statistics", "status"):
        method = getattr(nat, name, None)
        if callable(method):
            try:
                report = method()
            except Exception:
                report = None
            if report is not None:
                break
    raw = _as_dict(report)
    paths: dict[bytes, str] = {}
    for node, kind in (raw.get("paths") or {}).items():
        try:
            key = node if isinstance(node, bytes) else bytes.fromhex(str(node))
        except ValueError:
            continue
        paths[key] = str(kind)
    observed = raw.get("observed_addr")
    return NatView(reachability=str(raw.get("reachability") or "unknown"),
                   observed_addr=None if observed is None else str(observed), paths=paths)
