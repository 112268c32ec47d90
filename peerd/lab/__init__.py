"""Test labs that put peers on real (shaped, lossy) links in network namespaces: see links.py (root only)."""

from .links import (
    LabError,
    LinkCounters,
    LinkLab,
    QdiscStats,
    TbfParams,
    check_environment,
    format_rate,
    lab_unavailable,
    parse_rate,
    sweep_stale,
    tbf_params,
)

__all__ = [
    "LabError",
    "LinkCounters",
    "LinkLab",
    "QdiscStats",
    "TbfParams",
    "check_environment",
    "format_rate",
    "lab_unavailable",
    "parse_rate",
    "sweep_stale",
    "tbf_params",
]
