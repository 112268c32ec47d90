"""What ``compression="auto"`` picks: a pure function of what the node measured, with the reason in words.

Inputs are measurements (the link rate, the trainer's compute per step) and the model's size; the output is the
codec and the parameter-averaging period, each with why. No clock, no I/O: the optimizer measures, this module
decides, and tests pin the rule.

The codec rule: for a vector of at least ``MIN_INT8_PARAMS`` values, if moving the gradient in float32
(2 (n - 1) / n of 4 bytes a parameter through the link, as an all-reduce must) would take more than
``INT8_SHARE`` of the step's compute, averages go in int8: a quarter of the bytes, with stochastic rounding
(unbiased) and an error per value of at most one quantization step, the group's (max - min) / 255
(protocol/codecs.md). Else float32, which costs nothing in accuracy. The threshold sits far from where a step is
balanced, so that members who measure slightly differently still choose alike (every member of a run must
average in the same codec).

The period is chosen by the same measurements. peerd.torch.Optimizer applies the codec, and the
period through ``applied_period``: parameter averages pull replicas back together after rounds that found no group
or left a member on its own values for a range, so a period longer than the default is applied only when every
measured round averaged and ended on the group's common result (``complete``: every all-gather range arrived,
repairs included; a lost reduce-scatter contribution only lowers a range's weight, alike for every member). Replicas
then stay identical and the longer period costs no accuracy. It is applied only on the ladder PERIOD_LADDER, whose
steps divide each other. Members measure differently, so the period is agreed: each announces its own
(``proposal_key``), and at ``AGREE_STEP`` every member applies the least announced (``agreed_period``): the same on
every member that saw the same announcements, and never longer than any member's own choice. Members that still
disagree (an announcement that did not arrive) average their parameters together at every multiple of the longer
period, numbered alike (peerd.torch.Optimizer numbers them by the ladder's first rung). The overlap bucket size is
not a rule of these measurements: peerd.torch.autobucket times a split in the run itself."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

INT8_SHARE = 0.25  # int8 when the fp32 transfer would take more than this share of the step's compute ...
MIN_INT8_PARAMS = 262_144  # ... and the vector holds at least this many values (1 MiB of float32): below, a
# round's fixed costs (matchmaking, round trips) dominate its time, and a quarter of the bytes saves nothing
PARAM_COST_SHARE = 0.1  # parameter averages (float32) may take at most this share of the training time ...
AVERAGE_EVERY = (10, 50)  # ... with the period in this range (10: the library's default)
PERIOD_LADDER = (10, 20, 40)  # the periods applied (each divides the next)
AGREE_STEP = 10  # the step at which members apply the agreed period (the ladder's first rung: every member
# averages its parameters there whatever it proposed, and the proposals were announced at AUTO_STEP, 5 steps before)
MAX_ANNOUNCED = 64  # announcements of a run's period read at most (each is a member's claim: bounded, validated)
RUNG_SLACK = 0.1  # a rung within this share above the asked-for period is taken (see applied_period)
BUCKET_MB = 25.0  # overlap buckets until bucket_mb="auto"'s trial decides (peerd.torch.autobucket)


@dataclass(frozen=True)
class Measured:
    """What the node measured: ``link_bps`` (bits/s the averages move at; None: not measured yet), ``compute_s``
    (the trainer's seconds per step outside ``step()``), ``params`` (float32 values a step averages) and ``peers``
    (the group's size)."""

    link_bps: float | None
    compute_s: float | None
    params: int
    peers: int


@dataclass(frozen=True)
class Choice:
    """The pick: ``compression`` ("fp32" or "int8"), ``average_every`` (steps between parameter averages),
    ``bucket_mb`` (overlap), ``reason`` (one sentence per choice, for the step result and `peerd status`)."""

    compression: str
    average_every: int
    bucket_mb: float
    reason: str
    fp32_transfer_s: float | None  # the estimate the codec was chosen on
    reasons: tuple[str, ...] = ()  # the reason's parts: the codec's, the period's, the bucket size's


def fp32_transfer_s(link_bps: float, params: int, peers: int) -> float:
    """Seconds to all-reduce ``params`` float32 values among ``peers`` at ``link_bps``: each member sends and
    receives 2 (n - 1) / n of the vector (reduce-scatter, then all-gather)."""
    share = 2 * (peers - 1) / peers if peers > 1 else 0.0
    return share * 4 * params * 8 / link_bps


def _positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def choose(m: Measured) -> Choice:
    """The auto choice for ``m`` (see the module's docstring for the rules)."""
    if m.params < 1 or m.peers < 1:
        raise ValueError(f"params and peers must be positive, got {m.params} and {m.peers}")
    reasons = []
    transfer = fp32_transfer_s(m.link_bps, m.params, m.peers) if _positive(m.link_bps) else None
    if transfer is None or not _positive(m.compute_s):
        codec = "fp32"
        reasons.append("fp32: link rate or compute time not measured yet")
    elif m.params < MIN_INT8_PARAMS:
        codec = "fp32"
        reasons.append(f"fp32: {m.params} values ({4 * m.params / 2**10:.0f} KiB) are too few for their bytes to "
                       f"set a round's time")
    elif transfer > INT8_SHARE * m.compute_s:  # type: ignore[operator]
        codec = "int8"
        reasons.append(f"int8: fp32 would take {transfer * 1e3:.0f} ms a step at {m.link_bps / 1e6:.0f} Mbit/s "
                       f"against {m.compute_s * 1e3:.0f} ms of compute (> {INT8_SHARE:.0%}); int8 sends a quarter, "  # type: ignore[operator]
                       f"unbiased, error <= (max - min) / 255 per group")
    else:
        codec = "fp32"
        reasons.append(f"fp32: its transfer ({transfer * 1e3:.0f} ms a step) is within {INT8_SHARE:.0%} of "
                       f"compute ({m.compute_s * 1e3:.0f} ms)")  # type: ignore[operator]
    lo, hi = AVERAGE_EVERY
    every = lo
    if transfer is not None and _positive(m.compute_s):
        step = m.compute_s + (transfer / 4 if codec == "int8" else transfer)  # type: ignore[operator]
        every = min(hi, max(lo, math.ceil(transfer / (PARAM_COST_SHARE * step))))
        reasons.append(f"parameters every {every} steps: a float32 average costs {transfer / step:.1f} steps, "
                       f"kept under {PARAM_COST_SHARE:.0%} of training")
    else:
        reasons.append(f"parameters every {every} steps (the default until measured)")
    bucket = BUCKET_MB
    reasons.append(f"buckets of {bucket:g} MB (overlap: the library's default; bucket_mb='auto' times a split)")
    return Choice(codec, every, bucket, "; ".join(reasons), transfer, tuple(reasons))


def applied_period(choice: Choice, *, clean: bool) -> tuple[int, str]:
    """The parameter-averaging period to apply for ``choice`` and why: ``choice.average_every`` rounded down onto
    PERIOD_LADDER when ``clean`` (every measured round averaged and ended on the group's common result), else the
    default. A rung at most
    RUNG_SLACK above the asked-for period counts as reached: the rule's own ceiling (int8 steps of almost no compute
    ask for 39-40) sits on a rung, and replicas measuring a hair apart there would pick different periods."""
    lo = PERIOD_LADDER[0]
    if not clean:
        return lo, (f"parameters every {lo} steps: measured rounds found no group or missed all-gather ranges, so "
                    f"replicas drift and the default period pulls them back")
    k = max(p for p in PERIOD_LADDER if p <= max(lo, choice.average_every) * (1 + RUNG_SLACK))
    if k == lo:
        return k, f"parameters every {k} steps"
    return k, (f"parameters every {k} steps: every measured round ended on the group's common result (replicas "
               f"stay identical), so a longer period costs no accuracy ({choice.average_every} rounded down onto "
               f"{PERIOD_LADDER})")


def proposal_key(run_key: str) -> str:
    """The DHT key under which the members of ``run_key`` announce the period each proposes."""
    return f"peerd-auto-period/{run_key}"


def proposal_subkey(peer_id: str, session: int) -> str:
    """The DHT subkey under which one trainer session announces its period: its daemon's node id (64 hex digits)
    shortened to 40, so that the subkey stays within the wire's 64 bytes (a longer one is refused, and the
    announcement with it), and the session, so that trainers sharing a daemon announce apart."""
    return f"{peer_id[:40]}/{session}"


def announced_periods(values: list[object]) -> list[int]:
    """The periods in a run's announcements (DHT values: bytes): a member's claim, so only a rung of PERIOD_LADDER
    written as a short decimal counts; anything else is ignored. At most MAX_ANNOUNCED are read."""
    return announced_numbers(values, PERIOD_LADDER, 4)


def announced_numbers(values: list[object], allowed: Collection[int], max_chars: int) -> list[int]:
    """The numbers among announced DHT values (members' claims): a decimal of at most ``max_chars`` digits that
    is one of ``allowed``; anything else is ignored. At most MAX_ANNOUNCED values are read."""
    out = []
    for v in values[:MAX_ANNOUNCED]:
        if isinstance(v, bytes | str) and 0 < len(v) <= max_chars:
            text = v.decode("ascii", "replace") if isinstance(v, bytes) else v
            if text.isdigit() and int(text) in allowed:
                out.append(int(text))
    return out


def agreed_period(own: int, announced: list[int]) -> tuple[int, str]:
    """The period to apply and why: the least of this member's own proposal and the ones announced. The least is
    what every member can accept (a longer period costs a member that measured drift its accuracy), and a member
    announcing a short one only asks for the default's averages."""
    k = min([own, *announced])
    others = len(announced)
    if k == own:
        return k, f"parameters every {k} steps: agreed, the least of this member's and {others} announced"
    return k, (f"parameters every {k} steps: agreed, the least of {others} announced (this member proposed "
               f"{own})")


def outer_codec(fragment_elems: int) -> tuple[str, str]:
    """DiLoCo's ``compression="auto"``: the codec of its outer averages, with why. A rule of size alone, so that
    every member picks alike before anything is measured (an outer step comes once every H steps: there is no
    probe to measure): int8 for a fragment of at least MIN_INT8_PARAMS values (a quarter of the bytes; its
    stochastic rounding is unbiased and its error per value at most one quantization step, and quantized
    pseudo-gradients are what deployed DiLoCo runs average: 8 bits in INTELLECT-1, 4 in Streaming DiLoCo),
    float32 below (a round's fixed costs dominate there)."""
    if fragment_elems >= MIN_INT8_PARAMS:
        return "int8", (f"int8: a fragment of {fragment_elems:,} values (at least {MIN_INT8_PARAMS:,}) moves in a "
                        f"quarter of float32's bytes; pseudo-gradients are averaged unbiased (stochastic rounding)")
    return "fp32", (f"fp32: a fragment of {fragment_elems:,} values (under {MIN_INT8_PARAMS:,}): an outer round's "
                    f"fixed costs dominate its time")

