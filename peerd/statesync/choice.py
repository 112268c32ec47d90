"""State sync's snapshot choice as a sans-I/O core: which advertised snapshot a joiner downloads, from whom, and
what it tries next when a download fails.

The shell (peerd.statesync.service.StateSync.fetch) reads the adverts and downloads; this core filters the adverts
(same run key and layout, a size the local model can hold, not this node's), ranks the snapshots (``candidates``:
donors this node averaged with first, then not far ahead of the swarm's median step, then held by two or more
donors, then the newest, then the most donors), and answers each download's outcome with the next attempt: all
donors of the best snapshot at once; if the bytes did not verify, each donor alone (known ones first), so that
one bad donor cannot keep a joiner from a snapshot others hold; otherwise the next snapshot. Time is injected:
the overall deadline is its timer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .advert import Advert

AHEAD_STEPS = 1_000  # a snapshot this many steps past the median advertised step ranks after all others
MAX_EXCLUDE = 16  # snapshots a trainer may ask a fetch to skip (ones it refused to load)
MAX_SOLO = 8  # after a hash mismatch, the donors (known ones first) tried one at a time
MAX_SNAPSHOT = 1 << 34  # the largest snapshot a joiner downloads when the caller gives no bound of its own


@dataclass
class Candidate:
    """One snapshot (named by its hash and size) and the donors that advertise it, ranked by ``rank``."""

    sha: bytes
    size: int
    step: int
    donors: list[Advert]
    known: bool
    far_ahead: bool
    agreed: bool = True  # held by two or more donors, or only one donor advertises at all

    def rank(self) -> tuple:
        return (not self.known, self.far_ahead, not self.agreed, -self.step, -len(self.donors), self.sha)


def founder_candidates(ads: list[Advert], below: bytes, known: set[str] | frozenset[str] = frozenset()
                       ) -> list[Candidate]:
    """A founder's choice (``below``: the hash of its own initial snapshot): snapshots of a later step first (a
    run under way), as candidates ranks them; then initial ones (step 0) with a lower hash than its own, lowest
    first, so every founder that sees the same adverts takes the same one, and the lowest keeps its own."""
    cands = candidates([a for a in ads if a.step > 0 or a.sha < below], known)
    return [c for c in cands if c.step > 0] + sorted((c for c in cands if c.step <= 0), key=lambda c: c.sha)


def candidates(ads: list[Advert], known: set[str] | frozenset[str] = frozenset(), *,
                ahead: int = AHEAD_STEPS) -> list[Candidate]:
    """Snapshots to try, best first: held by a donor this node averaged with; then not far ahead of the median
    advertised step (a stranger's far-ahead claim cannot outrank the swarm); then held by two or more donors,
    where two or more donors advertise (one donor's claim of a newer step cannot outrank what others agree on);
    then newest; then the most donors holding the same bytes. A snapshot's step is the one most of its donors
    claim (ties: the higher), so a donor that claims a higher step for bytes others hold does not move it."""
    by_snapshot: dict[tuple[bytes, int], list[Advert]] = {}
    for a in ads:
        by_snapshot.setdefault((a.sha, a.size), []).append(a)
    median = statistics.median_low([a.step for a in ads]) if ads else 0
    several = len({a.node_id for a in ads}) >= 2
    out = []
    for (sha, size), group in by_snapshot.items():
        counts: dict[int, int] = {}
        for a in group:
            counts[a.step] = counts.get(a.step, 0) + 1
        step = max(counts, key=lambda s: (counts[s], s))
        donors = sorted(group, key=lambda a: a.node_id.hex() not in known)  # known donors first (stable)
        out.append(Candidate(sha, size, step, donors, any(a.node_id.hex() in known for a in group),
                             step > median + ahead, len({a.node_id for a in group}) >= 2 or not several))
    out.sort(key=Candidate.rank)
    return out


@dataclass(frozen=True)
class Download:
    """Download ``candidate``'s snapshot from ``donors`` (answer with ``receive_download``)."""

    candidate: Candidate
    donors: tuple[Advert, ...]


@dataclass(frozen=True)
class Finished:
    """The choice is over: ``found`` (the last Download succeeded), nothing advertised (``none``), or ``error``."""

    found: bool
    none: bool = False
    error: str = ""


Action = Download | Finished


@dataclass(frozen=True)
class ChoiceStatistics:
    candidates: int  # snapshots ranked
    attempts: int  # downloads asked for
    ignored_layout: int  # adverts of another run key or layout
    ignored_size: int  # adverts of a snapshot larger than the local model can hold
    errors: tuple[str, ...]  # why downloads failed, in order (the first few)


class SnapshotChoice:
    """One joiner's choice among advertised snapshots. ``node_id``: this node (its own advert is skipped);
    ``below``: a founder's own initial snapshot's hash (``founder_candidates``); ``exclude``: snapshot hashes
    not to take; ``deadline``: when the whole fetch gives up (absolute, in the caller's clock)."""

    def __init__(self, node_id: bytes, run_key: str, *, layout: str | None = None, min_step: int = 0,
                 max_size: int | None = None, below: bytes | None = None, exclude: tuple[bytes, ...] = (),
                 deadline: float) -> None:
        self.node_id, self.run_key, self.layout = node_id, run_key, layout
        self.min_step = min_step
        self.max_size = MAX_SNAPSHOT if max_size is None else max(0, min(max_size, MAX_SNAPSHOT))
        self.below = below
        self.exclude = frozenset(list(exclude)[:MAX_EXCLUDE])
        self.deadline = deadline
        self.done = False
        self._actions: list[Action] = []
        self._queue: list[tuple[Candidate, tuple[Advert, ...]]] = []
        self._current: tuple[Candidate, tuple[Advert, ...]] | None = None
        self._candidates = 0
        self._attempts = 0
        self._ignored_layout = 0
        self._ignored_size = 0
        self._errors: list[str] = []

    # -- output -------------------------------------------------------------------------------------------
    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def get_timer(self) -> float | None:
        return None if self.done else self.deadline

    def statistics(self) -> ChoiceStatistics:
        return ChoiceStatistics(self._candidates, self._attempts, self._ignored_layout, self._ignored_size,
                                tuple(self._errors[:3]))

    # -- inputs -------------------------------------------------------------------------------------------
    def receive_adverts(self, ads: list[Advert], known: set[str] | frozenset[str], now: float) -> None:
        """The run's adverts as read (untrusted), and the hex ids of donors this node has averaged with."""
        if self.done:
            return
        usable = self.usable(ads)
        cands = candidates(usable, known) if self.below is None else founder_candidates(usable, self.below, known)
        self._candidates = len(cands)
        if not cands:
            return self._finish(Finished(False, none=True))
        for cand in cands:
            if cand.sha in self.exclude:
                continue
            donors = tuple(cand.donors)
            self._queue.append((cand, donors))
            if len(donors) > 1:
                self._queue.extend((cand, (d,)) for d in donors[:MAX_SOLO])
        self._next(now)

    def receive_download(self, ok: bool, error: str, mismatch: bool, now: float) -> None:
        """The current download ended: ``ok``, or why not (``mismatch``: the bytes did not hash to the advert's;
        then each donor alone is tried, otherwise nobody had some bytes, or no memory: the next snapshot)."""
        if self.done or self._current is None:
            return
        cand, donors = self._current
        self._current = None
        if ok:
            return self._finish(Finished(True))
        self._errors.append(error)
        if donors == tuple(cand.donors) and not mismatch:
            self._queue = [q for q in self._queue if q[0] is not cand]  # no solo tries: the next snapshot
        self._next(now)

    def handle_timer(self, now: float) -> None:
        if not self.done and now >= self.deadline:
            why = f" ({'; '.join(self._errors[:3])})" if self._errors else ""
            self._finish(Finished(False, error=f"state download did not finish within the deadline{why}"))

    # -- decisions ----------------------------------------------------------------------------------------
    def usable(self, ads: list[Advert]) -> list[Advert]:
        """The adverts a joiner may download from: same run key and layout, a snapshot (step >= min_step,
        size > 0) of at most ``max_size`` bytes, not this node's. Others' layouts and sizes are counted."""
        out = []
        for a in ads:
            if a.node_id == self.node_id:
                continue
            if a.run_key != self.run_key or (self.layout is not None and a.layout != self.layout):
                self._ignored_layout += 1
                continue
            if a.step < self.min_step or a.size == 0:
                continue  # "training, no snapshot yet", or older than asked for
            if a.size > self.max_size:
                self._ignored_size += 1
                continue
            out.append(a)
        return out

    def _next(self, now: float) -> None:
        if now >= self.deadline:
            return self.handle_timer(now)
        if not self._queue:
            return self._finish(Finished(False, error="no advertised snapshot could be downloaded: "
                                         + "; ".join(self._errors[:3])))
        self._current = self._queue.pop(0)
        self._attempts += 1
        self._actions.append(Download(*self._current))

    def _finish(self, finished: Finished) -> None:
        self.done = True
        self._current = None
        self._queue.clear()
        self._actions.append(finished)
