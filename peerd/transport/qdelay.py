"""Queueing delay from one-way delay samples (sans-I/O: every call takes ``now``).

A receiver's REPORT says when (its clock) the datagram at the top of the interval arrived; the sender knows
when (its clock) it sent it. Their difference is the path's one-way delay plus the offset between the two
clocks, which is unknown but constant (a drift of tens of ppm is a fraction of a millisecond over the window).
So, as LEDBAT does (RFC 6817), the least sample of the last ``BASE_BUCKETS`` x ``BASE_BUCKET_S`` seconds is the
path's base delay, and a sample above it is time spent in queues: the bottleneck's, which is what a pacer that
fills a link without overrunning it must keep small. Random loss leaves it alone; an overrun raises it long
before the queue overflows.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable

BASE_BUCKET_S = 1.0  # the base delay is the least sample of each second ...
BASE_BUCKETS = 10  # ... over the last this many seconds (a route change is forgotten that fast)
MAX_QUEUE_S = 2.0  # a sample this far above the base is a clock step, not a queue: the path starts over
MAX_PATHS = 1024


class QueueDelay:
    """Per path: the queueing delay of each one-way delay sample, above the path's base delay."""

    __slots__ = ("_paths", "max_paths")

    def __init__(self, max_paths: int = MAX_PATHS) -> None:
        self._paths: OrderedDict[Hashable, deque[list[float]]] = OrderedDict()  # path -> [bucket, least sample]
        self.max_paths = max_paths

    def sample(self, path: Hashable, owd: float, now: float, *, base: bool = True) -> float | None:
        """The queueing delay of one sample (seconds; 0 for the least one), or None for a sample that is not a
        number or a path with no base yet. ``owd``: arrival time (receiver's clock) minus send time (this
        sender's clock). ``base`` False: a sample whose send time is a model's (a datagram deep in a burst,
        placed at a guess of the link's rate), which may err either way: it is measured, but never lowers the
        base (one placed too late would make every later sample look queued)."""
        if not math.isfinite(owd) or not math.isfinite(now):
            return None
        history = self._paths.get(path)
        if history is None:
            if not base:
                return None
            history = self._paths[path] = deque()
            while len(self._paths) > self.max_paths:
                self._paths.popitem(last=False)
        else:
            self._paths.move_to_end(path)
        bucket = math.floor(now / BASE_BUCKET_S)
        if base:
            if history and history[-1][0] >= bucket:
                history[-1][1] = min(history[-1][1], owd)
            else:
                history.append([bucket, owd])
        while history and history[0][0] <= bucket - BASE_BUCKETS:
            history.popleft()
        if not history:
            return None
        base_delay = min(least for _, least in history)
        queued = owd - base_delay
        if queued > MAX_QUEUE_S:  # one of the clocks stepped: what was learnt no longer applies
            history.clear()
            history.append([bucket, owd])
            return 0.0
        return queued

    def rebase(self, path: Hashable, by: float, now: float) -> None:
        """Raise the path's base by ``by`` seconds from ``now`` on: a level every sample has stood at, whatever was
        sent, is an offset in the base (one sample that read low), not a queue. A lower sample later lowers it."""
        history = self._paths.get(path)
        if not history or not math.isfinite(by) or by <= 0.0 or not math.isfinite(now):
            return
        raised = min(least for _, least in history) + by
        history.clear()
        history.append([math.floor(now / BASE_BUCKET_S), raised])

    def base(self, path: Hashable) -> float | None:
        history = self._paths.get(path)
        return None if not history else min(least for _, least in history)
