"""Rates and byte budgets as an operator writes them (``20mbit``, ``5MB/s``, ``200GB/month``), parsed once at startup
with an error that says what was expected."""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_RATE = 8_000.0  # bytes/s (64 kbit/s): below this one datagram of a full MTU waits longer than a request's timeout
MAX_RATE = 12.5e9  # bytes/s (100 Gbit/s)
MIN_BUDGET = 100e6  # bytes per period: less does not carry a day of DHT upkeep
PERIODS = {"day": 86_400.0, "week": 7 * 86_400.0, "month": 30 * 86_400.0}  # nominal: the budget's are UTC calendar

_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_BYTES = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
          "TiB": 1024**4}
_NUMBER = r"(\d+(?:\.\d+)?)\s*"
_RATE = re.compile(rf"^\s*{_NUMBER}([A-Za-z]+)(/s)?\s*$")
_BUDGET = re.compile(rf"^\s*{_NUMBER}([A-Za-z]+)\s*/\s*([a-z]+)\s*$")
RATE_HELP = "a rate like 20mbit, 500kbit, 1gbit (bits/s) or 5MB/s, 2.5MiB/s (bytes/s)"
BUDGET_HELP = "a budget like 200GB/month, 5GB/day or 50GiB/week (UTC calendar periods)"


def parse_rate(text: str) -> float:
    """Bytes per second from ``20mbit`` (also ``20Mbit/s``, ``20mbps``: bits, decimal) or ``5MB/s`` (bytes; the
    byte units are case-sensitive, as ``mb`` could be either). Raises ValueError naming the accepted forms."""
    m = _RATE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r}: expected {RATE_HELP}")
    value, unit, per_s = float(m.group(1)), m.group(2), m.group(3)
    if unit.lower() in _BITS and unit not in _BYTES:
        rate = value * _BITS[unit.lower()] / 8.0
    elif unit in _BYTES and per_s:
        rate = value * _BYTES[unit]
    else:
        raise ValueError(f"{text!r}: unit {unit!r} is not one peerd reads; expected {RATE_HELP}")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"{text!r}: a cap must lie between 64kbit and 100gbit")
    return rate


@dataclass(frozen=True)
class Budget:
    """``nbytes`` in each UTC calendar ``period`` (day, week, month: linkcap.budget), both directions together, as
    a metered plan bills."""

    nbytes: float
    period: str
    text: str

    @property
    def period_s(self) -> float:
        """The period's nominal length (a month: 30 days); the calendar's periods vary (linkcap.budget)."""
        return PERIODS[self.period]


def parse_budget(text: str) -> Budget:
    """``200GB/month`` -> Budget(200e9, "month"). Raises ValueError naming the accepted forms."""
    m = _BUDGET.match(text) if isinstance(text, str) else None
    if m is None or m.group(2) not in _BYTES or m.group(3) not in PERIODS:
        raise ValueError(f"{text!r}: expected {BUDGET_HELP}")
    nbytes = float(m.group(1)) * _BYTES[m.group(2)]
    if nbytes < MIN_BUDGET:
        raise ValueError(f"{text!r}: a budget must be at least 100MB per period")
    return Budget(nbytes, m.group(3), text.strip())


def mbit(rate: float) -> float:
    """Bytes/s as Mbit/s, for people."""
    return rate * 8 / 1e6
