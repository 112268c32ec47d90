"""Sender pacing (sans-I/O): a token bucket whose rate follows what receivers report.

Receivers report, at the end of each phase, how many datagrams they expected and got, and how many
the kernel dropped at their socket. Random loss (a lossy link) must not throttle the sender, so loss
only counts as congestion when the receiver's kernel dropped datagrams or the received fraction falls
clearly below the best recently seen on this path (the path's random-loss floor).
"""

from __future__ import annotations

from collections import deque

DEFAULT_RATE = 1e9  # bytes/s: start fast, back off on evidence
MIN_RATE = 0.5e6
MAX_RATE = 20e9
BURST_S = 0.002  # a burst may run this far ahead of the average rate


class Pacer:
    def __init__(self, rate: float = DEFAULT_RATE, *, min_rate: float = MIN_RATE, max_rate: float = MAX_RATE):
        self.rate = rate
        self.min_rate = min_rate
        self.max_rate = max_rate
        self._next = 0.0  # when the bucket is empty again
        self._recent: deque[float] = deque(maxlen=8)  # received fractions of recent reports
        self.decreases = 0
        self.increases = 0

    def reserve(self, nbytes: int, now: float) -> float:
        """Account for sending ``nbytes`` now; returns how long to wait before sending them."""
        start = max(self._next, now - BURST_S)
        self._next = start + nbytes / self.rate
        return max(0.0, start - now)

    def on_report(self, expected: int, received: int, seconds: float, kernel_drops: int, datagram_bytes: int) -> None:
        if expected <= 0:
            return
        fraction = min(1.0, received / expected)
        floor = max(self._recent, default=fraction)
        self._recent.append(fraction)
        congested = kernel_drops > 0 or fraction < floor - 0.03
        if congested:
            delivered = received * datagram_bytes / seconds if seconds > 0 else self.rate
            self.rate = max(self.min_rate, min(self.rate, delivered) * 0.8)
            self.decreases += 1
        else:
            self.rate = min(self.max_rate, self.rate * 1.25)
            self.increases += 1
