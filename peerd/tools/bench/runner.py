"""What every ``peerd bench`` command does around its run: check the options, turn Ctrl-C and a daemon's failure
into an exit status, and keep progress lines off stdout when it prints JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, Protocol

from ...localsock.client import DaemonError


class Checked(Protocol):
    def check(self) -> None: ...


def stderr_say(*args: Any) -> None:
    """Progress lines where stdout carries JSON only."""
    print(*args, file=sys.stderr, flush=True)


def run_bench(cfg: Checked, parser: Any, run: Callable[[Callable[..., None]], dict[str, Any]], *,
              print_json: bool = False, indent: int | None = None, left: str = "every daemon and temp dir",
              errors: tuple[type[BaseException], ...] = (DaemonError, RuntimeError)) -> dict[str, Any] | int:
    """``run(say)``'s result, or the exit status to return: a bad option is the parser's error (it exits), Ctrl-C
    is 130 once ``left`` is removed, one of ``errors`` is 1 with its message. ``print_json``: progress goes to
    stderr, the result to stdout as JSON, and the status is 0."""
    try:
        cfg.check()
    except ValueError as e:
        parser.error(str(e))
    try:
        result = run(stderr_say if print_json else print)
    except KeyboardInterrupt:
        status, message = 130, f"\nstopped ({left} removed)"
    except errors as e:
        status, message = 1, f"peerd: error: {e}"
    else:
        if not print_json:
            return result
        print(json.dumps(result, indent=indent))
        return 0
    print(message, file=sys.stderr)
    return status
