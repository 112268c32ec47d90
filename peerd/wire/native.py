"""Which data plane this process runs: the C extension (``peerd._dataplane._native``) or the Python reference.

Decided once, at import: ``PEERD_DATAPLANE=python`` forces the Python path; ``native`` requires the extension
(a process that cannot load it refuses to start sealing, rather than running slower than asked); unset or
``auto`` takes the extension when it is built. Both paths put the same bytes on the wire (the golden vectors hold
for both, and tests/test_dataplane.py compares them row by row).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

ENV = "PEERD_DATAPLANE"
CHOICES = ("auto", "native", "python")

log = logging.getLogger("peerd.dataplane")


def _load() -> tuple[ModuleType | None, str, str]:
    """(the extension or None, what was asked for, why this path runs)."""
    asked = os.environ.get(ENV, "").strip().lower() or "auto"
    if asked not in CHOICES:
        return None, asked, f"{ENV}={asked!r} is not one of {', '.join(CHOICES)}"
    if asked == "python":
        return None, asked, f"{ENV}=python"
    try:
        from .._dataplane import _native
    except ImportError as e:
        return None, asked, (f"the native extension is not built ({e}); a source install needs a C compiler and "
                             "OpenSSL's headers (Debian: gcc libssl-dev), then pip install again")
    aead = "its provider's functions" if getattr(_native, "AEAD_DIRECT", 0) else "EVP"
    return _native, asked, f"the native extension is built ({_native.OPENSSL_VERSION}; AES-GCM by {aead})"


native, _asked, reason = _load()
_announced = False
_held = False


def dataplane() -> str:
    """"native" or "python": the data path this process seals and opens blocks with (status and bench JSON)."""
    return "native" if native is not None else "python"


def check() -> None:
    """Raise RuntimeError where ``PEERD_DATAPLANE`` asks for what cannot run: ``native`` without the extension,
    or an unknown value (every sealer and opener checks; the daemon checks first, for a one-line error)."""
    if _asked not in CHOICES:
        raise RuntimeError(f"{reason}; unset it for the default")
    if _asked == "native" and native is None:
        raise RuntimeError(f"{ENV}=native, but {reason}")


def hold() -> None:
    """Sealers and openers do not announce: the process (the daemon) says it itself with ``announce(now=True)``,
    once its log lines carry its port."""
    global _held
    _held = True


def announce(*, now: bool = False) -> None:
    """Say once per process which data path runs and why: at the first sealer or opener, or, after ``hold``, when
    asked ``now``. Raises as ``check`` does."""
    global _announced
    check()
    if _announced or (_held and not now):
        return
    _announced = True
    if native is None and _asked == "auto":
        log.warning("data plane: python (%s); sealed averaging costs several times the CPU", reason)
    else:
        log.info("data plane: %s (%s)", dataplane(), reason)
