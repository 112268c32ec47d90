"""The argparse pieces that the daemon's command line (cli.py) and the tooling's (tools/cli_tools.py) share: number
types, the lab option group, the fault injector's modes, the deprecation line. Imports nothing of the daemon."""

from __future__ import annotations

import argparse
import sys

LAB_GROUP = "fault injection and lab (testing only)"
# the fault injector's modes (tools.faults.MODES, spelled here so that parsing imports no numpy)
BYZANTINE_CHOICES = ("scale", "signflip", "nan", "random", "inflate-signflip")


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive(text: str) -> float:
    if (value := number(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def fraction(text: str) -> float:
    if not 0.0 < (value := number(text)) <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def count(text: str, least: int = 0) -> int:
    """An integer argument of at least ``least`` (a step count, a number of fragments)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {text!r}")
    return value


def period(text: str) -> int | str:
    """--average-every's type: a step count >= 0, or ``auto`` (peerd.torch.Optimizer's default)."""
    if text == "auto":
        return text
    if not text.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of steps or auto")
    if int(text) < 0:
        raise argparse.ArgumentTypeError(f"--average-every must be >= 0, not {text}")
    return int(text)


def bucket_mb(text: str) -> float | str:
    """--bucket-mb's type: megabytes of float32 in (0, 1024], or ``auto`` (peerd.torch.Optimizer's default)."""
    if text == "auto":
        return text
    try:
        mb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected megabytes or auto") from None
    if not 0 < mb <= 1024:  # (NaN fails this too)
        raise argparse.ArgumentTypeError(f"--bucket-mb must be in (0, 1024] or auto, not {text}")
    return mb


def lab_group(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The parser's argument group for fault-injection and lab options, made on first use."""
    for group in p._action_groups:
        if group.title == LAB_GROUP:
            return group
    return p.add_argument_group(LAB_GROUP)


def deprecated(old: str, new: str) -> None:
    """One line on stderr for an old name that still works (for one release)."""
    print(f"peerd: warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)
