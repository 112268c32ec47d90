"""The one place protocol code falls back to ambient randomness, when its caller injected none.

The sans-I/O cores and trio shells take an ``rng``; tests and ``peerd sim`` pass seeded ones so a run repeats
exactly. A daemon that passes none gets an OS-seeded generator here, so that every such fallback is visible in
one module (tests/test_no_ambient_clock.py allows it here and nowhere else in the protocol packages).
"""

from __future__ import annotations

import random


def default_rng(rng: random.Random | None) -> random.Random:
    """``rng`` itself, or a fresh OS-seeded generator where none was injected."""
    return rng if rng is not None else random.Random()


def default_token_rng(rng: random.Random | None) -> random.Random:
    """``rng`` itself, or the OS's generator where none was injected: sealing tokens must differ between
    processes even across a fork (a forked Mersenne state would repeat the parent's tokens, and a token drawn
    twice under one swarm key reuses AES-GCM nonces)."""
    return rng if rng is not None else random.SystemRandom()
