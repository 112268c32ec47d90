"""`peerd sim dht` (being built: issue 14)."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(sim: Any) -> None:
    """Add the `sim dht` sub-parser to `sim`'s subparsers."""
    sim.add_parser("dht", help="(not built yet)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    parser.error("peerd sim dht is not built yet (issue 14)")
    return 2
