"""Robust aggregation options: how a shard owner limits each member's contribution (GroupAverage(robust=)).

``clip[:C]``: once its reduce-scatter has ended (it needs every contribution before any range is final;
under the default gradient robust, a large shard's head earlier: ``segment_ends``), the owner measures
each member's contribution to its shard (its own included) as the RMS per element over the ranges that member
delivered (so a member that lost datagrams is neither favoured nor penalized),
takes the median over the members that delivered anything, and scales every contribution whose RMS
exceeds C times that median down to it. Then it averages by weight as without ``robust``: a range that
lost a sender is averaged over the senders that arrived (with their factors), and a range only the owner
reached keeps the owner's value exactly.

With ``clip``, the same pass also sums every pair of members' dot products over the shard (a Gram matrix),
and with 3 or more members heard the owner leaves out every other member whose contribution, as it would
count (clipped, with its bounded weight), has a cosine below -opposed_cos(elements) with the sum of the
others' (-OPPOSED_COS, or -OPPOSED_Z / sqrt(elements) over few elements): a sign-flipped gradient of normal
size, which clipping lets through, points against the honest members' sum. Honest gradients share a signal,
so they rarely point against the others' sum (on the 8-member demo's MLP, 600 values a shard, about one
(owner, member) pair in 50 still does, and is left out). Members are left out one at a time, the most opposed
first (``opposed_members``); they are counted as ``opposed`` in the statistics; the owner never leaves itself out.

arc-topk's sketch shards hold too few values for that test; there an owner leaves out the members its own recent
dense phases found opposed (``Suspects``, carried by identity from one average of a run to the next ones), and a
member they found opposed again is left out of its dense phases too for a few averages: one dense phase alone
misses a flipped member now and then. An owner's dense test also pools each member's cosine with its last
PRIOR_TESTS tests at this owner (``Suspects.prior``: elements-weighted, the threshold that of all their elements),
so a member that points against the others round after round is found in nearly every round, while one round's
chance dip of an honest member is outweighed by its earlier agreement.

``centered[:C]``: the same, measured as the distance from a center (the previous round's average, passed
by the caller), and the result is the center plus the weighted mean of the clipped differences. Without a
center it is clip around zero.

Weights: a contribution counts by its weight, which the member claims in its datagrams; so with either mode
the owner also bounds every weight (its own too) at WEIGHT_BOUND times the median of the weights of the
members that delivered anything, on top of ``max_weight``. Without that bound one member clipped to the
median norm but claiming 2**24 samples would still be the whole average. Equal honest weights are never
bounded (their average stays exact); honest weights within WEIGHT_BOUND of the median are not either.

Limits, by design: norm clipping bounds how far one member moves the average (a member at x1000 counts
as at most C times a typical one, times its weight share, itself at most WEIGHT_BOUND times a typical one);
the direction test stops a member pointing against the others' sum, not one that points slightly off it,
and colluding members that outnumber the honest ones can shift the median and the others' sum. ``centered``
has no direction test: differences from a center are not expected to agree in direction. Ranges holding
NaN or inf are refused before any norm is taken.
Cost: one more read of the shard's contributions, plus with ``clip`` one small matrix product per block
(docs/security.md gives the measured figures).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

MODES = ("clip", "centered")
DEFAULT_C = 1.0  # 8-peer demo: a random member at C=2 raised final_loss 15 %, at C=1 5 %; honest runs unchanged
MAX_C = 1e6
# the most a member's weight counts for, in multiples of the median weight of the members that delivered
# (robust only): DropCompute's honest weights vary well within 2x, a member's claim beyond it is not believed
WEIGHT_BOUND = 2.0
# clip: a member whose contribution has a cosine below -OPPOSED_COS with the sum of the others' is left out.
# Not 0: unrelated honest vectors (noise, no shared signal) have cosines near 0 of either sign, and left out
# they would change an honest average; a sign-flipped gradient sits at minus the honest members' agreement.
OPPOSED_COS = 0.05
# ... and, over few elements, below -OPPOSED_Z / sqrt(elements): the cosines of honest vectors scatter by about
# 1 / sqrt(elements) around their agreement, so over arc-topk's sketches and rows (tens to hundreds of values a
# shard) a fixed -0.05 left an honest member out of nearly every owner's average
OPPOSED_Z = 2.0
# arc-topk: a member this member's dense phase left out as opposed is left out of its sketch phases for the next
# SUSPECT_ROUNDS averages of the run (a sketch shard holds tens of values, too few for its own direction test to
# tell a sign flip from noise; the dense phase's verdict is fresh every round)
SUSPECT_ROUNDS = 2
# ... and a member found opposed in STRIKES of the last STRIKE_WINDOW dense phases that tested it is banned: left
# out of both phases for the next BAN_ROUNDS averages (and of the sketch phase of the one after, where it is tested
# again). A dense shard holds a few hundred values: there a flipped member is found in most rounds, not in all (on
# the 8-member demo's MLP about 4 in 5), and each round it is missed its rows get in and stay in EF21M's estimate
# until they are selected again. An honest member is found opposed there about 1 round in 8; three in four of its
# tests are rare (about 1 in 200), and its ban only costs this owner its rows for a few averages.
STRIKES = 3
STRIKE_WINDOW = 4
BAN_ROUNDS = 8
# A member banned again (opposed in STRIKES of its last STRIKE_WINDOW tests once more) is banned twice as long as the
# time before, up to MAX_BAN_ROUNDS: a flipper pays a fixed ban's leak (the rounds its retests miss it) ever less
# often, while an honest member's rare ban stays short. A window of clean tests forgives its earlier bans.
MAX_BAN_ROUNDS = 128
MAX_SUSPECTS = 1024  # identities remembered at most (a group names at most a few hundred members)
# arc-topk: an owner's direction test pools a member's cosine with its last PRIOR_TESTS tests at this owner (each
# weighted by its elements, the threshold by all of them): a dense shard of ~150 values lets honest cosines scatter
# by ~0.08, as far as a flipped member's sits below zero, so one round alone missed it about 1 in 5; four rounds'
# evidence halves the scatter
PRIOR_TESTS = 3
# The default gradient robust decides a large shard's head early and its tail with the whole shard
# (``segment_ends``): the tail is this share of the shard, and at least this many values. The head is final before
# the owner's own contributions are out (a sender's ranges arrive in order): its average fills the uplink while the
# tail's last contributions arrive.
TAIL_SHARE = 1 / 8
TAIL_ELEMENTS = 1 << 15


def opposed_cos(elements: int) -> float:
    """The cosine with the others' sum below minus which a member is left out, over ``elements`` values."""
    return max(OPPOSED_COS, OPPOSED_Z / math.sqrt(max(1, elements)))


def _cosines(gram: np.ndarray, inside: list[int], own: int) -> dict[int, float]:
    """Each member of ``inside`` but ``own``: its cosine with the sum of the others inside. Member s's dot product
    with the others is its row sum less its own square; the others' squared norm the whole sum less twice the row
    sum plus the square."""
    g = gram[np.ix_(inside, inside)]
    row = g.sum(axis=1)
    total = float(row.sum())
    out = {}
    for k, s in enumerate(inside):
        own_sq = float(g[k, k])
        others = total - 2 * float(row[k]) + own_sq
        if s != own and own_sq > 0 and others > 0:
            out[s] = (float(row[k]) - own_sq) / math.sqrt(own_sq * others)
    return out


def member_cosines(gram: np.ndarray, heard: list[int], own: int) -> dict[int, float]:
    """Each heard member's cosine with the sum of all the other heard members' (never ``own``'s): what an owner's
    test of it records for the next ones (``Suspects.observe``)."""
    return _cosines(gram, list(heard), own) if len(heard) >= 3 else {}


def opposed_members(gram: np.ndarray, heard: list[int], own: int, elements: list[int],
                    prior: Mapping[int, tuple[float, int]] | None = None) -> frozenset[int]:
    """The members (never ``own``) to leave out for pointing against the others, from ``gram`` (every pair's dot
    product, as the contributions count) over the ``heard`` members: one at a time, the one with the lowest
    cosine with the sum of those still in, while that is below -opposed_cos of its ``elements`` and 3 or more are
    in. One at a time, because a sign-flipped member in the others' sum pulls honest members' cosines down with
    it. ``prior``: member -> (its earlier tests' cosines times their elements, summed; those elements): pooled with
    this one, the cosine is their elements-weighted mean and the threshold that of all their elements."""
    inside = list(heard)
    out: set[int] = set()
    while len(inside) >= 3:
        worst, worst_score = -1, 0.0
        for s, c in _cosines(gram, inside, own).items():
            n, score = elements[s], c
            if prior and s in prior:
                weighted, seen = prior[s]
                score, n = (c * elements[s] + weighted) / (elements[s] + seen), elements[s] + seen
            if score < -opposed_cos(n) and score < worst_score:
                worst, worst_score = s, score
        if worst < 0:
            break
        out.add(worst)
        inside.remove(worst)
    return frozenset(out)


@dataclass(frozen=True)
class SuspectStatistics:
    """An owner's direction-test verdicts on an arc-topk run, by member (hex node id): ``tests``, the dense phases
    that tested it; ``bans``, the times it was banned; ``banned_now``, those left out of this owner's shards now.
    An honest member's bans against its tests is the rule's false-ban rate (what it costs honest members)."""

    tests: dict[str, int]
    bans: dict[str, int]
    banned_now: list[str]


@dataclass
class Suspects:
    """Members (by identity) that this member, as an owner, recently left out of an arc-topk dense phase for
    pointing against the others: a verdict carried from one average to the next ones of the same run, where one
    phase alone holds too few values for it, or misses a flipped member now and then. A member found opposed once
    is left out of the sketch phase for SUSPECT_ROUNDS averages; one found opposed in STRIKES of its last
    STRIKE_WINDOW tests is banned: left out of both phases for BAN_ROUNDS averages (twice as long at each ban
    again, up to MAX_BAN_ROUNDS, until a window of clean tests), untested meanwhile, and tested again after (its
    sketches still left out). Local: it changes only what this owner sums into its own
    shards."""

    left: dict[bytes, int] = field(default_factory=dict)  # identity -> averages its sketches are still left out of
    banned: dict[bytes, int] = field(default_factory=dict)  # identity -> averages it is still left out of entirely
    strikes: dict[bytes, int] = field(default_factory=dict)  # identity -> its last verdicts, newest in bit 0
    bans: dict[bytes, int] = field(default_factory=dict)  # identity -> bans since its last clean window of tests
    tested: dict[bytes, int] = field(default_factory=dict)  # identity -> dense phases that tested it (ever)
    banned_total: dict[bytes, int] = field(default_factory=dict)  # identity -> times it was banned (ever)
    # identity -> its last PRIOR_TESTS tests here: (cosine with the others, elements), oldest first
    cosines: dict[bytes, tuple[tuple[float, int], ...]] = field(default_factory=dict)

    def statistics(self) -> SuspectStatistics:
        """What an owner can read of its verdicts (``peerd status``): whom it tested, banned, and leaves out now."""
        return SuspectStatistics(tests={i.hex(): n for i, n in self.tested.items()},
                                 bans={i.hex(): n for i, n in self.banned_total.items()},
                                 banned_now=sorted(i.hex() for i in self.banned))

    def among(self, ids: list[bytes], own: int) -> tuple[int, ...]:
        """The indices in ``ids`` (a group's members, in order) that the sketch phase leaves out (suspects and
        banned members), never ``own``."""
        return tuple(k for k, i in enumerate(ids) if k != own and (i in self.left or i in self.banned))

    def banned_among(self, ids: list[bytes], own: int) -> tuple[int, ...]:
        """The indices in ``ids`` that the dense phase leaves out too (banned members), never ``own``."""
        return tuple(k for k, i in enumerate(ids) if k != own and i in self.banned)

    def prior(self, ids: list[bytes], own: int) -> tuple[tuple[int, float, int], ...]:
        """For the dense phase's test (``AverageOptions.prior``): (index in ``ids``, its last tests' cosines times
        their elements summed, those elements) for each member with tests here, never ``own``."""
        out = []
        for k, i in enumerate(ids):
            past = self.cosines.get(i)
            if k != own and past:
                out.append((k, sum(c * n for c, n in past), sum(n for _, n in past)))
        return tuple(out)

    def observe(self, ids: list[bytes], opposed: tuple[int, ...] | list[int],
                cosines: tuple[tuple[int, float, int], ...] = ()) -> None:
        """One more average done, with ``opposed`` (indices in ``ids``) the members its dense phase left out for
        pointing against the others: every suspicion and ban ages by one; each member the dense phase tested
        (every one not banned during it) adds a verdict; the opposed are suspects for the next SUSPECT_ROUNDS,
        and banned for the next BAN_ROUNDS if that makes STRIKES of their last STRIKE_WINDOW verdicts. ``cosines``:
        (index, cosine with the others, elements) of each member the test measured, kept for the next tests."""
        untested = {i for i in ids if i in self.banned}
        for k, c, n in cosines:
            if 0 <= k < len(ids) and math.isfinite(c) and n > 0:
                i = ids[k]
                self.cosines[i] = (*self.cosines.pop(i, ())[-(PRIOR_TESTS - 1):], (float(c), int(n)))
        self.left = {i: r - 1 for i, r in self.left.items() if r > 1}
        self.banned = {i: r - 1 for i, r in self.banned.items() if r > 1}
        against = {ids[k] for k in opposed if 0 <= k < len(ids)}
        window = (1 << STRIKE_WINDOW) - 1
        for i in ids:
            if i in untested:
                continue
            self.tested[i] = self.tested.pop(i, 0) + 1  # (re-inserted: the least recently tested go first)
            bits = ((self.strikes.get(i, 0) << 1) | (i in against)) & window
            self.strikes.pop(i, None)
            if bits:
                self.strikes[i] = bits  # (re-inserted: the dict keeps the most recently opposed last)
            else:
                self.bans.pop(i, None)  # a clean window forgives
            if i in against:
                self.left[i] = SUSPECT_ROUNDS
                if bits.bit_count() >= STRIKES:
                    n = self.bans.pop(i, 0) + 1
                    self.bans[i] = n
                    self.banned_total[i] = self.banned_total.pop(i, 0) + 1
                    rounds = min(BAN_ROUNDS << min(n - 1, 16), MAX_BAN_ROUNDS)
                    self.banned[i] = rounds
                    self.left[i] = rounds + 1  # its sketches stay out of the round that tests it again
        for record in (self.left, self.banned, self.strikes, self.bans, self.tested, self.banned_total,
                       self.cosines):
            while len(record) > MAX_SUSPECTS:
                record.pop(next(iter(record)))


def segment_ends(nranges: int, elements: int, robust: Robust | None) -> list[int]:
    """Where an owner's robust decisions end, in ranges of its shard: one decision for the whole shard, except
    under the default gradient robust (``clip`` at MAX_C: the weight bound and the direction test, clipping only
    far past the median), where a shard of 2 * TAIL_ELEMENTS or more is decided twice: its head (all but a tail of
    TAIL_SHARE, at least TAIL_ELEMENTS) once the head's ranges are final, over the head alone, and its tail at the
    end, over the whole shard, as one decision would. The owner averages and sends the head while the tail's last
    contributions still arrive (the all-gather overlaps the reduce-scatter as without robust), and the tail holds
    the values a whole-shard decision would give. Tests over small parts of a real gradient find honest members
    against the others far more often than 1 / sqrt(elements) suggests (a few directions carry most of a segment's
    norm): the head is most of the shard, so its test sees almost what the whole-shard test sees."""
    if robust is None or robust.mode != "clip" or robust.c < MAX_C or elements < 2 * TAIL_ELEMENTS or nranges < 2:
        return [nranges]
    per = elements / nranges
    tail = max(1, math.ceil(max(TAIL_ELEMENTS, elements * TAIL_SHARE) / per))
    if tail >= nranges - tail + 1:
        return [nranges]
    return [nranges - tail, nranges]


@dataclass(frozen=True)
class Robust:
    mode: str  # "clip" or "centered"
    c: float = DEFAULT_C

    def __str__(self) -> str:
        return f"{self.mode}:{self.c:g}"


def parse_robust(text: object) -> Robust | None:
    """``off`` (or None or ""): None; ``clip``, ``clip:C``, ``centered``, ``centered:C``: a Robust.
    Raises ValueError with a message that says what is accepted."""
    if text is None or text == "" or text == "off":
        return None
    if not isinstance(text, str):
        raise ValueError(f"robust must be a string (off, clip[:C], centered[:C]), got {text!r:.80}")
    mode, sep, c_text = text.partition(":")
    if mode not in MODES:
        raise ValueError(f"robust must be off, clip[:C] or centered[:C], got {text!r:.80}")
    c = DEFAULT_C
    if sep:
        try:
            c = float(c_text)
        except ValueError:
            raise ValueError(f"robust {mode}:C needs a number C, got {c_text!r:.40}") from None
        if not (math.isfinite(c) and 0 < c <= MAX_C):
            raise ValueError(f"robust {mode}:C needs 0 < C <= {MAX_C:g}, got {c_text!r:.40}")
    return Robust(mode, c)
