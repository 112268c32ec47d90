"""What ``bucket_mb="auto"`` picks for overlap: DDP's bucket size or half the model, by timing both in the run.

Why a trial and not a rule of sizes: smaller buckets let the average of the last layers overlap the backward of
the first ones, but every bucket is a part of the step's round with fixed costs of its own (its group's messages,
its repairs, the daemon's work on it), and which side wins depends on the model, the link and the machine; a
rule of link rate and round trips got it wrong on the lab's 2-core machines, where a 3.4 MB model in 1 MB buckets
stepped slower than in one bucket. So every member times both plans in its own run and the run keeps the split
only if it paid for every member.

The trial is numbered by step count, so that every member cuts the same step alike (a step's buckets are parts of
one round, and members whose plans differ never meet): steps before ``SPLIT_AT`` and from ``DECIDE_AT`` on use
the large plan (buckets of ``LARGE_MB``: one bucket for a model under 25 MB), steps in [SPLIT_AT, DECIDE_AT) the
small one (half of that). A step's time is the trainer's wall time from one ``step()`` to the next: its compute
plus whatever wait for the averages overlap did not hide. The steps next to a change of plan (the change flushes
every bucket) are not timed. At DECIDE_AT each member proposes the small plan only if its median step under it
was at least ``SPLIT_GAIN`` faster, and announces its proposal; at ``AGREE_AT`` every member applies the largest
bucket announced (the small plan only if nobody asked for the large one). No clock and no I/O here: the
optimizer times and announces (peerd.torch.autostep), this module decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .auto import announced_numbers

LARGE_MB = 25.0  # the large plan: torch DDP's bucket_cap_mb (peerd.torch.overlap.DEFAULT_BUCKET_MB)
MIN_BUCKET_MB = 1.0  # the small plan's buckets are at least this large (else there is nothing to try)
SPLIT_AT = 10  # the first step cut by the small plan (after the codec's choice at step 5 settled)
DECIDE_AT = 15  # the first step back on the large plan: each member proposes and announces here
AGREE_AT = 20  # the first step cut by the agreed plan (the announcements had five steps to spread)
TIMED_LARGE = range(6, 10)  # the steps timed under the large plan (step 5 follows the codec's switch)
TIMED_SMALL = range(SPLIT_AT + 1, DECIDE_AT)  # ... under the small one (step 10 follows the flush at the change)
SPLIT_GAIN = 0.05  # the small plan must make a step at least this much faster


def elems_of(mb: float) -> int:
    """Float32 elements in ``mb`` megabytes (MiB)."""
    return max(1, int(mb * 2**20 / 4))


def mb_of(elems: int) -> float:
    return round(elems * 4 / 2**20, 2)


def candidates(total_elems: int) -> tuple[int, int]:
    """The large and the small plan's bucket size in elements for a model of ``total_elems``: DDP's 25 MB, and
    half of what one such bucket holds (at least MIN_BUCKET_MB). Equal: the model is too small to split."""
    if total_elems < 1:
        raise ValueError(f"total_elems must be positive, got {total_elems}")
    large = elems_of(LARGE_MB)
    small = max(elems_of(MIN_BUCKET_MB), math.ceil(min(large, total_elems) / 2))
    return large, min(small, large)


def announced_sizes(values: list[object], allowed: tuple[int, int]) -> list[int]:
    """The bucket sizes in a run's announcements (DHT values): only a decimal of one of this model's two
    candidates counts (a member of the run trains the same model); anything else is ignored."""
    return announced_numbers(values, allowed, 12)


def proposal_key(run_key: str) -> str:
    """The DHT key under which the members of ``run_key`` announce the bucket size each proposes."""
    return f"peerd-auto-buckets/{run_key}"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


@dataclass
class BucketTrial:
    """One member's trial (sans-I/O): ``plan_at`` says how to cut a step, ``record`` takes a step's wall time,
    ``propose`` and ``agree`` decide. ``reason`` says why the current plan is what it is."""

    total_elems: int
    large: int = 0
    small: int = 0
    walls: dict[int, float] = field(default_factory=dict)
    decided: bool = False  # this member proposed (or abstained) at DECIDE_AT
    proposed: int | None = None  # this member's proposal (None: it abstained)
    measured: str = ""  # what this member's trial measured, in words
    agreed: int | None = None  # the run's plan, from AGREE_AT (or a donor's, taken over with its state)
    reason: str = ""

    def __post_init__(self) -> None:
        self.large, self.small = candidates(self.total_elems)
        if self.total_elems < 2 * elems_of(MIN_BUCKET_MB):
            self.agreed = self.large
            self.reason = (f"buckets of {LARGE_MB:g} MB: the model's {mb_of(self.total_elems)} MB is too small to "
                           f"split into buckets of at least {MIN_BUCKET_MB:g} MB")
        else:
            self.reason = (f"buckets of {LARGE_MB:g} MB until step {SPLIT_AT}, then {mb_of(self.small)} MB until "
                           f"step {DECIDE_AT}: both timed, the faster applied from step {AGREE_AT}")

    def plan_at(self, step: int) -> int:
        """The bucket size (elements) that cuts step ``step`` (0-based), the same on every member."""
        if self.agreed is not None:
            return self.agreed
        return self.small if SPLIT_AT <= step < DECIDE_AT else self.large

    def record(self, step: int, wall_s: float) -> None:
        """Step ``step`` took ``wall_s`` seconds from the previous ``step()`` to its own."""
        if (step in TIMED_LARGE or step in TIMED_SMALL) and math.isfinite(wall_s) and wall_s > 0:
            self.walls[step] = wall_s

    def propose(self) -> int | None:
        """This member's proposal from its timed steps (None: too few timed, it abstains)."""
        self.decided = True
        large = [self.walls[s] for s in TIMED_LARGE if s in self.walls]
        small = [self.walls[s] for s in TIMED_SMALL if s in self.walls]
        if len(large) < 2 or len(small) < 2:
            self.reason = (f"buckets of {LARGE_MB:g} MB until the run agrees at step {AGREE_AT}: this member timed "
                           f"too few steps of the trial to propose")
            return None
        a, b = _median(large), _median(small)
        self.proposed = self.small if b <= a * (1 - SPLIT_GAIN) else self.large
        verdict = "faster" if self.proposed == self.small else f"not {SPLIT_GAIN:.0%} faster"
        self.measured = (f"a step took {b * 1e3:.0f} ms in {mb_of(self.small)} MB buckets against {a * 1e3:.0f} ms "
                         f"in {LARGE_MB:g} MB ({verdict})")
        self.reason = f"buckets of {mb_of(self.proposed)} MB proposed, until agreed at step {AGREE_AT}: {self.measured}"
        return self.proposed

    def agree(self, announced: list[int]) -> int:
        """The run's plan: the largest of this member's proposal and the ones announced (the split only where it
        paid for every member that measured); the large plan if nobody proposed."""
        sizes = [*announced, *([] if self.proposed is None else [self.proposed])]
        self.agreed = max(sizes, default=self.large)
        mine = "" if self.proposed is None else f"this member proposed {mb_of(self.proposed)} MB, "
        trial = f"; this member's trial: {self.measured}" if self.measured else ""
        self.reason = (f"buckets of {mb_of(self.agreed)} MB: agreed, the largest of {len(sizes)} proposals "
                       f"({mine}{len(announced)} from the others){trial}")
        return self.agreed

    def take(self, elems: int) -> bool:
        """A donor's agreed plan, taken over with its state (False: not one of this model's candidates)."""
        if elems not in (self.large, self.small):
            return False
        self.agreed = elems
        self.reason = f"buckets of {mb_of(elems)} MB: the swarm's choice, taken over with its state"
        return True
