"""``peerd join``'s cap flags, here so the command line carries one call to add them and one to read them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from .core import CapConfig
from .rates import parse_budget, parse_rate


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # (argparse shows an ArgumentTypeError's message; a ValueError's it hides)
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def add_cap_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bandwidth caps (metered links; docs/deploy.md)")
    g.add_argument("--max-upload", type=_arg(parse_rate), metavar="RATE",
                   help="upload at most RATE on the wire, all traffic together (20mbit, 5MB/s)")
    g.add_argument("--max-download", type=_arg(parse_rate), metavar="RATE",
                   help="ask peers to send at most RATE (20mbit, 5MB/s); published in this node's matchmaking records")
    g.add_argument("--budget", type=_arg(parse_budget), metavar="BYTES/PERIOD",
                   help="a byte budget both ways per UTC calendar day, week or month (200GB/month): the node paces "
                        "itself to it")
    g.add_argument("--budget-state", metavar="FILE",
                   help=f"where the budget's count is kept across restarts (default: {BUDGET_FILE} beside --identity; "
                        "without either it starts again with the daemon)")


BUDGET_FILE = "budget.json"


def cap_config(args: argparse.Namespace, identity: str | None = None) -> CapConfig:
    """The caps from the flags; a budget's state file is --budget-state, else beside the node's ``identity`` file
    (its data directory), else none."""
    state = None
    if args.budget is not None:
        state = args.budget_state
        if state is None and identity:
            state = os.path.join(os.path.dirname(os.path.abspath(identity)), BUDGET_FILE)
    return CapConfig(args.max_upload, args.max_download, args.budget, state)
