"""``peerd top``: the status table, refreshed in the terminal like top (ANSI; q or Ctrl-C leaves)."""

from __future__ import annotations

import os
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Callable
from typing import Any, TextIO

from .text import render

CLEAR = "\x1b[H\x1b[2J"
HIDE, SHOW = "\x1b[?25l", "\x1b[?25h"


def _screen(reply: dict[str, Any], interval: float) -> str:
    width, height = shutil.get_terminal_size((120, 40))
    head = f"peerd top: every {interval:g} s, q to quit    {time.strftime('%H:%M:%S')}"
    lines = [head, *render(reply, brief=True).splitlines()]
    return "\n".join(line[:width] for line in lines[:height - 1])


def _key(fd: int | None, timeout: float) -> bytes | None:
    """Wait up to ``timeout`` for a key on ``fd`` (a terminal or a pipe); b"" at its end, None for none."""
    if fd is None:
        time.sleep(timeout)
        return None
    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1) if ready else None


def run_top(fetch: Callable[[], dict[str, Any]], interval: float = 1.0, *, out: TextIO = sys.stdout,
            keys: TextIO | None = sys.stdin) -> int:
    """Show ``fetch()``'s status every ``interval`` seconds until q (read from ``keys``) or Ctrl-C."""
    fd = keys.fileno() if keys is not None else None
    term = fd if fd is not None and os.isatty(fd) else None
    saved = termios.tcgetattr(term) if term is not None else None
    try:
        if term is not None:
            tty.setcbreak(term)
        out.write(HIDE)
        while True:
            reply = fetch()
            reply.pop("ok", None)
            out.write(CLEAR + _screen(reply, interval) + "\n")
            out.flush()
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                key = _key(fd, left)
                if key in (b"q", b"Q"):
                    return 0
                if key == b"":  # the end of a pipe: no more keys, only Ctrl-C
                    fd = None
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(SHOW)
        out.flush()
        if term is not None:
            termios.tcsetattr(term, termios.TCSADRAIN, saved)
