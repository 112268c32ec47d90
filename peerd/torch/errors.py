"""The trainer library's errors, in a module of their own so that every part of it can raise them."""

from __future__ import annotations


class NoGroupError(RuntimeError):
    """No group formed for a step and the optimizer was told to raise (``no_group="raise"``)."""
