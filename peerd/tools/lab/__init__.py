"""Test labs that put peers on real (shaped, lossy) links in network namespaces (links.py) and behind the kernel's
NAT (nat.py): root only."""

from .links import (
    LabError,
    LinkCounters,
    LinkLab,
    NetnsLab,
    QdiscStats,
    TbfParams,
    check_environment,
    format_rate,
    lab_unavailable,
    parse_rate,
    sweep_stale,
    tbf_params,
)
from .nat import NatLab

__all__ = [
    "LabError",
    "LinkCounters",
    "LinkLab",
    "NatLab",
    "NetnsLab",
    "QdiscStats",
    "TbfParams",
    "check_environment",
    "format_rate",
    "lab_unavailable",
    "parse_rate",
    "sweep_stale",
    "tbf_params",
]
