"""The options of one group average, as one frozen object checked once where it is made, and the checks
themselves (GroupAverage runs the same ones on its own arguments): what the host, the service and Moshpit pass
down instead of a dozen keyword arguments each."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..compress import Codec
from .kernels import F32_MAX
from .robust import MODES as ROBUST_MODES
from .robust import Robust

DEFAULT_MAX_WEIGHT = float(2**24)  # samples: the cap on any member's weight unless the caller gives one
MAX_REPAIR_ROUNDS = 6  # the most repair rounds a member asks for, and an owner serves, per all-gather stream
_U64 = (1 << 64) - 1


def check_max_weight(max_weight: float | None) -> float:
    """The weight cap in samples (None: DEFAULT_MAX_WEIGHT); ValueError unless finite, > 0 and a float32."""
    if max_weight is None:
        return DEFAULT_MAX_WEIGHT
    try:
        cap = float(max_weight)
    except (TypeError, ValueError):
        raise ValueError(f"max_weight must be a number (samples), got {max_weight!r}") from None
    if not (math.isfinite(cap) and 0 < cap <= F32_MAX and np.float32(cap) > 0):
        raise ValueError(f"max_weight must be finite and > 0 (the most samples a member may claim), got {cap!r}")
    return cap


def check_robust(robust: Robust | None) -> None:
    if robust is not None and (not isinstance(robust, Robust) or robust.mode not in ROBUST_MODES
                               or not (math.isfinite(robust.c) and robust.c > 0)):
        raise ValueError(f"robust must be None or a Robust (parse_robust: clip[:C], centered[:C]), got {robust!r}")


def check_timing(floor_s: float, max_phase_s: float | None, end_grace_s: float = 0.0) -> None:
    if not (math.isfinite(floor_s) and floor_s >= 0):
        raise ValueError(f"floor_s must be finite and >= 0, got {floor_s!r}")
    if max_phase_s is not None and not max_phase_s > 0:
        raise ValueError(f"max_phase_s must be > 0 or None, got {max_phase_s!r}")
    if not (math.isfinite(end_grace_s) and end_grace_s >= 0):
        raise ValueError(f"end_grace_s must be finite and >= 0, got {end_grace_s!r}")


def check_codec(codec: Codec | None, run: int) -> None:
    if codec is not None and not isinstance(codec, Codec):
        raise ValueError(f"codec must be a peerd.compress body codec (compress.codec(name)), got {codec!r}")
    if type(run) is not int or not 0 <= run <= _U64:
        raise ValueError(f"run must be a u64 (the run's rounding key), got {run!r}")


@dataclass(frozen=True, slots=True)
class AverageOptions:
    """How one group average runs (the per-call arrays, ``out`` and ``center``, travel beside it).

    ``floor_s``, ``max_phase_s``, ``end_grace_s``: the phase deadline's floor, cap (None: none) and the grace
    after an END that overtook data. ``max_weight``: the most samples any member's weight counts for (None:
    2**24). ``robust``: norm clipping at the shard owner (robust.py). ``codec``: the run's body codec
    (peerd.compress; None: fp32), the same for every member; ``run``: the u64 key of its rounding draws.
    ``absent``: members (indices) not waited for and sent nothing. ``exclude``: members (indices) whose
    contributions this owner leaves out of its shard as it leaves out an opposed one (waited for and sent to as
    usual; arc-topk's suspects). ``solo``: each owner's result for its shard
    is its own values alone (a broadcast per owner: arc-topk's selections). ``overlap``: each owner sends the
    averages of its shard's ranges as they become final, while the reduce-scatter still runs (protocol/allreduce.md,
    "Final ranges"), instead of after it (the default: the same time on a lossy link, less on a fast one); with
    ``robust``, which needs every contribution of what it decides, only where ``segments`` lets it decide a large
    shard's head early (robust.segment_ends: the default gradient robust), the head as soon as it is final.
    ``repair_rounds``: how many times a member asks an owner again for the all-gather ranges it lacks, and how many
    rounds this node serves as an owner (protocol/allreduce.md, "Repair"; 0: none, as before). ``owner_lag_s``: the
    all-gather's extra wait for an owner that ends its reduce-scatter after this member did (None: ``floor_s``); a
    tuned, short ``floor_s`` is the network's silence, while a loaded owner's lag is its CPU's, not its link's.
    ``probe_silent``: a member whose stream a phase waits for and that went silent is asked, with PINGs to its daemon,
    whether it lives; dead, the phases stop waiting for it at once (liveness.py; off: it is waited for until the
    deadline, as before). ``shares``: one int per member, the sizes of their shards relative to each other (None:
    equal; shards.Layout, capped_shares): every member of the group must pass the same. ``prior``: (member index,
    its earlier direction tests' cosines times their elements summed, those elements) that this owner's test pools
    with this one's (robust clip only; arc-topk's dense phase: robust.Suspects.prior). ``segments``: robust may
    decide a large shard's head early (off where the caller needs one test per shard: arc-topk's suspects)."""

    floor_s: float = 1.0
    max_phase_s: float | None = 60.0
    end_grace_s: float = 0.05
    max_weight: float | None = None
    robust: Robust | None = None
    codec: Codec | None = None
    run: int = 0
    absent: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    solo: bool = False
    overlap: bool = True
    # A range a member still lacks after r rounds at loss p: about p^(r + 1) (each resend lost again; a request goes
    # three times). At 5 % loss and ~500 ranges a member's all-gather, 3 rounds left about 1 member-round in 300
    # incomplete (the GPT demo saw 2 to 10 of its 1,440): a replica on its own values there, and its optimizer state
    # (Adam's moments) apart from the others' for hundreds of steps, so no later parameter check finds the replicas
    # identical (trainer/paramcheck.py). 6 rounds: about 1 in 10^6.
    repair_rounds: int = MAX_REPAIR_ROUNDS
    owner_lag_s: float | None = None
    probe_silent: bool = False
    shares: tuple[int, ...] | None = None
    prior: tuple[tuple[int, float, int], ...] = ()
    segments: bool = True

    def __post_init__(self) -> None:
        check_timing(self.floor_s, self.max_phase_s, self.end_grace_s)
        if self.owner_lag_s is not None:
            check_timing(self.owner_lag_s, self.max_phase_s)
        if self.max_weight is not None:
            check_max_weight(self.max_weight)
        check_robust(self.robust)
        check_codec(self.codec, self.run)
        absent = tuple(self.absent)
        if any(type(a) is not int or a < 0 for a in absent):
            raise ValueError(f"absent must be member indices (ints >= 0), got {self.absent!r}")
        object.__setattr__(self, "absent", absent)
        exclude = tuple(self.exclude)
        if any(type(a) is not int or a < 0 for a in exclude):
            raise ValueError(f"exclude must be member indices (ints >= 0), got {self.exclude!r}")
        object.__setattr__(self, "exclude", exclude)
        prior = tuple(tuple(p) for p in self.prior)
        if any(len(p) != 3 or type(p[0]) is not int or p[0] < 0 or type(p[2]) is not int or p[2] < 0
               or not isinstance(p[1], int | float) or not math.isfinite(p[1]) for p in prior):
            raise ValueError("prior must be (member index, finite float, elements >= 0) triples")
        object.__setattr__(self, "prior", prior)
        if type(self.solo) is not bool:
            raise ValueError(f"solo must be a bool, got {self.solo!r}")
        if type(self.probe_silent) is not bool:
            raise ValueError(f"probe_silent must be a bool, got {self.probe_silent!r}")
        if type(self.overlap) is not bool:
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        if type(self.segments) is not bool:
            raise ValueError(f"segments must be a bool, got {self.segments!r}")
        if type(self.repair_rounds) is not int or not 0 <= self.repair_rounds <= MAX_REPAIR_ROUNDS:
            raise ValueError(f"repair_rounds must be an int in 0..{MAX_REPAIR_ROUNDS}, got {self.repair_rounds!r}")
        if self.shares is not None:
            shares = tuple(self.shares)
            if any(type(x) is not int or x < 0 for x in shares) or not 0 < sum(shares) < 2**32:
                raise ValueError(f"shares must be non-negative ints, not all 0 (shards.capped_shares), got {shares!r}")
            object.__setattr__(self, "shares", shares)


DEFAULT_OPTIONS = AverageOptions()
