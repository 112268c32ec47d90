"""What the daemon's log says about a run's rounds: a summary every ``SUMMARY_S``, not a line per round.

Why: a trainer averages several times a second, so a line per round is hundreds of thousands a day in a
journal, and the lines an owner needs (rounds failing, groups shrinking) drown in them. Each round is logged at
DEBUG; at INFO a run's first round, then every SUMMARY_S a line with how many rounds ended how, the groups' sizes
and the median round time. Sans-I/O: the caller passes the time and logs what ``note`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUMMARY_S = 60.0  # a run's summary at most this often


@dataclass
class RoundLog:
    """One run's rounds since its last summary (``since``: None before its first round)."""

    summary_s: float = SUMMARY_S
    since: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def note(self, run_id: str, outcome: str, group_size: int, seconds: float, now: float) -> str | None:
        """A round of ``run_id`` ended: the INFO line to log now, if one is due (None: DEBUG's line only)."""
        if self.since is None:
            self.since = now
            return f"run {run_id}: first round {outcome}, group of {group_size}, {seconds:.3f} s"
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.sizes.append(group_size)
        self.seconds.append(seconds)
        if now - self.since < self.summary_s:
            return None
        line = self.summary(run_id, now)
        self.since, self.outcomes, self.sizes, self.seconds = now, {}, [], []
        return line

    def summary(self, run_id: str, now: float) -> str:
        """The rounds since the last summary: how many by outcome (most first), group sizes, the median time."""
        n = len(self.seconds)
        ends = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items(), key=lambda kv: (-kv[1], kv[0])))
        lo, hi = min(self.sizes), max(self.sizes)
        groups = f"groups of {lo}" if lo == hi else f"groups of {lo}-{hi}"
        median = sorted(self.seconds)[n // 2]
        return (f"run {run_id}: {n} rounds in the last {now - (self.since or now):.0f} s ({ends}), {groups}, "
                f"{median:.3f} s a round (median)")
