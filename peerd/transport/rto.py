"""Adaptive retransmission timeouts per destination, in the style of RFC 6298 (sans-I/O).

With a fixed first retransmission timeout (0.5 s, say), every control RPC under datagram loss
(DHT lookups, matchmaking) that loses its request or answer would stall a round for that long, though
peers on the same host or LAN answer in a few milliseconds. The estimator learns the round-trip time
to each address from requests answered on their first transmission (Karn's rule: an answer after a
retransmission is ambiguous and gives no sample) and proposes ``srtt + 4 * rttvar``, clamped to
``[min_rto, cap]`` where ``cap`` is the caller's timeout, so a learned RTO never waits longer than
the caller asked for. Until an address has a sample the caller's timeout is used unchanged.

A timed-out first transmission doubles the address's backoff (RFC 6298 5.5), which later requests
keep until a fresh sample arrives: a peer that has become slow is not flooded with retransmissions.
The same samples also feed one node-wide estimate (``typical_rto``): the retransmission timeout of a
destination this node has not sampled yet, as its recent round trips to any suggest (a DHT lookup's new
contacts). No clock is read here; callers pass the measured round-trip time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

ALPHA = 1 / 8  # RFC 6298 smoothing gains
BETA = 1 / 4
K = 4
# 20 ms: a lost control datagram between peers a few ms apart costs about that, not 50 ms (Moshpit rounds under
# loss: `peerd bench moshpit --peers 4 --rounds 40 --loss 0.1`, round_s). The NAT service hears of a silent peer
# only after NAT_SILENT_S (endpoint.py), not at the first retransmission.
DEFAULT_MIN_RTO = 0.02
DEFAULT_CAPACITY = 4096
MAX_BACKOFF = 64
_INF = float("inf")
_KEEP_VAR = 1 - BETA  # the same floats as computed per sample, once
_KEEP_SRTT = 1 - ALPHA


@dataclass(slots=True)
class _State:
    srtt: float
    rttvar: float
    backoff: int = 1


class RtoEstimator:
    """Smoothed round-trip times per destination; ``timeout(dest, cap)`` is the next first wait."""

    def __init__(self, *, min_rto: float = DEFAULT_MIN_RTO, capacity: int = DEFAULT_CAPACITY) -> None:
        if not min_rto > 0:
            raise ValueError(f"min_rto must be > 0, got {min_rto!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.min_rto = min_rto
        self.capacity = capacity
        self._states: OrderedDict[Hashable, _State] = OrderedDict()
        self._all: _State | None = None  # every destination's samples in one (typical_rto)

    def __len__(self) -> int:
        return len(self._states)

    def srtt(self, dest: Hashable) -> float | None:
        """The smoothed round-trip time to ``dest``, or None before its first sample."""
        state = self._states.get(dest)
        return None if state is None else state.srtt

    def sample(self, dest: Hashable, rtt: float) -> None:
        """Record the round-trip time of a request answered on its first transmission."""
        if not 0 <= rtt < _INF:
            raise ValueError(f"rtt must be a finite number >= 0, got {rtt!r}")
        every = self._all
        if every is None:
            self._all = _State(srtt=rtt, rttvar=rtt / 2)
        else:
            every.rttvar = _KEEP_VAR * every.rttvar + BETA * abs(every.srtt - rtt)
            every.srtt = _KEEP_SRTT * every.srtt + ALPHA * rtt
        state = self._states.get(dest)
        if state is None:
            state = _State(srtt=rtt, rttvar=rtt / 2)
            self._states[dest] = state
            if len(self._states) > self.capacity:
                self._states.popitem(last=False)  # forget the least recently sampled destination
        else:
            state.rttvar = _KEEP_VAR * state.rttvar + BETA * abs(state.srtt - rtt)
            state.srtt = _KEEP_SRTT * state.srtt + ALPHA * rtt
            state.backoff = 1
            self._states.move_to_end(dest)

    def timed_out(self, dest: Hashable) -> None:
        """A first transmission went unanswered: back off until the next sample (no-op before one)."""
        state = self._states.get(dest)
        if state is not None:
            state.backoff = min(state.backoff * 2, MAX_BACKOFF)

    def rto(self, dest: Hashable) -> float | None:
        """``srtt + 4 * rttvar`` to ``dest`` (at least min_rto), without the backoff of its unanswered requests (a
        dead peer's backoff grows, and a wait derived from it would grow back to the caller's cap); None before
        its first sample."""
        state = self._states.get(dest)
        if state is None:
            return None
        return max(self.min_rto, state.srtt + K * state.rttvar)

    def typical_rto(self) -> float | None:
        """``rto`` over every destination's samples together: for a destination not sampled yet. None before any."""
        every = self._all
        return None if every is None else max(self.min_rto, every.srtt + K * every.rttvar)

    def timeout(self, dest: Hashable, cap: float) -> float:
        """How long to wait for an answer to a first transmission to ``dest``; never above ``cap``."""
        if not cap > 0:
            raise ValueError(f"cap must be > 0, got {cap!r}")
        state = self._states.get(dest)
        if state is None:
            return cap
        rto = state.srtt + K * state.rttvar
        rto = (rto if rto > self.min_rto else self.min_rto) * state.backoff  # max(min_rto, ...) without a call
        return rto if rto < cap else cap  # min(cap, rto)
