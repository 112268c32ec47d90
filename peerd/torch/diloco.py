"""``peerd.torch.DiLoCo``: H local steps with any inner optimizer, then an outer step averaged with the swarm.

::

    opt = peerd.torch.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), run="my-run",
                             sync_every=50, fragments=1)
    ...
    loss.backward()
    opt.step(samples=len(x))   # an inner step; every H steps (per fragment) also an outer step

The outer step (DiLoCo, Douillard et al. 2023): the pseudo-gradient ``global - local`` is averaged through
the daemon, weighted by the samples each member took since its last outer step, and Nesterov SGD
(``outer_lr``, ``outer_momentum``) moves the global parameters by it; the model restarts from the new
global parameters. The daemon makes every member hold the same averaged bytes (shards repaired from their
owners, one hash across the swarm: peerd.trainer.outer), so every member applies the same update to the
same state and the global parameters and momentum stay identical: ``state_sha`` (SHA-256 of global
parameters and momentum) is published with every outer step, and a member whose state differs from the
swarm's raises DiLoCoError instead of drifting apart.

The defaults (``sync_every=500``, ``outer_lr=0.7``, ``outer_momentum=0.9``) are the paper's, for runs of many
outer steps. A run of a few hundred inner steps has few of them, and there plain averaging of the members'
progress does better: ``sync_every`` 10-20 with ``outer_lr=1.0, outer_momentum=0.0`` (what the GPT demo
passes; docs/benchmarks.md has the losses each reaches).

Streaming (``fragments=F``): the parameters are cut into F fragments of whole tensors of about equal size,
and fragment f has its outer step at the steps where ``step % H == f * H // F``, so only 1/F of the model
travels at a time. A late joiner takes global parameters, outer momentum, the step and the inner
optimizer's state from a member by state sync (``sync_state=True``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..compress import NAMES, codec
from ..localsock.client import DaemonError
from ..localsock.phases import add_phases, empty_phases
from .auto import outer_codec
from .founders import FOUNDER_WINDOW_S
from .optimizer import Optimizer
from .snapcheck import SnapshotError, all_finite, all_finite_each, check_finite, checked_step

log = logging.getLogger("peerd.torch.diloco")

DILOCO_FORMAT = "peerd-diloco-v1"
HISTORY = 10_000  # outer steps remembered in DiLoCo.history
MAX_CATCH_UP_OUTER = 16  # outer steps a replica found behind takes from the swarm at once (DiLoCo._catch_up)
# state_every=None: a snapshot for joiners after fragment 0's outer step, at most once in this many seconds (each
# member its own draw up to 1.5x, so the members' snapshots fall on different outer steps)
STATE_MIN_S = 10.0
INNER_TIMES = 32  # inner steps whose wall time (the caller's compute and the inner optimizer's) the median is of
MIN_INNER_TIMES = 3  # a replica that timed fewer inner steps does not count forward (DiLoCo._count_forward)


@dataclass
class _Outer:
    """An outer step handed to the daemon: its fragment, arena ticket, request id, the inner step it was taken
    at, the state hash before it, where the replica stood when it went out (overlapped; None: it restarts from
    the global parameters), the trainer's copy-in seconds and when the request went out."""

    fragment: int
    ticket: int
    rid: int
    step: int
    before: bytes
    sent: torch.Tensor | None
    copy_in: float
    t0: float


class DiLoCoError(RuntimeError):
    """An outer step could not be applied in agreement with the swarm (the message says why)."""


def fragment_bounds(numels: list[int], fragments: int) -> list[tuple[int, int]]:
    """Cut tensors (sizes ``numels``, in order) into ``fragments`` contiguous runs of whole tensors of about
    equal elements; returns each fragment's [start, stop) in the flat vector. Every fragment holds at least
    one tensor, so there can be no more fragments than tensors."""
    if type(fragments) is not int or not 1 <= fragments <= len(numels):
        raise ValueError(f"fragments must be an integer in [1, {len(numels)}] (the model's tensors), got {fragments!r}")
    total = sum(numels)
    bounds, start, off, cut = [], 0, 0, 1
    for i, n in enumerate(numels):
        off += n
        left_tensors = len(numels) - i - 1
        left_frags = fragments - cut
        if cut < fragments and (off >= total * cut / fragments or left_tensors == left_frags):
            bounds.append((start, off))
            start, cut = off, cut + 1
    bounds.append((start, total))
    return bounds


def due_fragments(step: int, sync_every: int, fragments: int) -> list[int]:
    """The fragments whose outer step comes after inner step ``step`` (1-based): f where step % H == f*H//F
    (fragment 0 at multiples of H)."""
    if step <= 0:
        return []
    phase = step % sync_every
    return [f for f in range(fragments) if phase == f * sync_every // fragments]


def pace_skip(skip: int, late_s: float, prev_late_s: float | None, inner_s: float, period: int) -> int:
    """``keep_pace``: the inner steps a replica counts forward at the start of each outer period of ``period`` inner
    steps, from how far behind its group it came at its last outer step (``late_s``: the median of the other
    members' waits for the group minus its own; negative: it waited for them) and at the one before
    (``prev_late_s``; None: not known). It counts more only where it came behind at both (a slower replica comes
    behind every period; an evaluation or a busy moment that ran long, once), by the lesser lateness in its own inner
    steps (``inner_s``), at most half a period more at a time; it counts fewer as soon as it waits itself. Always at
    least one real inner step a period (``period`` - 1 at most)."""
    if not (math.isfinite(late_s) and math.isfinite(inner_s) and inner_s > 0):
        return skip
    if late_s > 0:
        if prev_late_s is None or not math.isfinite(prev_late_s) or prev_late_s <= 0:
            return skip
        change = min(period // 2, math.trunc(min(late_s, prev_late_s) / inner_s))
    else:
        change = max(-period, math.trunc(late_s / inner_s))
    return max(0, min(period - 1, skip + change))


def nesterov_outer(global_: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float,
                   mu: float) -> None:
    """The outer rule in place (torch.optim.SGD with nesterov=True, dampening 0): m = mu*m + d;
    global -= lr * (d + mu*m). Plain float32 ops in a fixed order, so equal inputs give equal bits."""
    momentum.mul_(mu).add_(delta)
    global_.sub_(delta.add(momentum, alpha=mu), alpha=lr)


def outer_phases(reply: dict[str, Any]) -> dict[str, float]:
    """The daemon's phases of an outer step in peerd.localsock.phases' names: its averaging rounds are the
    transfer (matchmaking included, where the daemon does not tell it apart), the repair and the agreement
    are ``agree``; a daemon that reports no phases spent its ``seconds`` on the transfer."""
    raw = reply.get("phases")
    if not isinstance(raw, dict):
        return {"transfer": float(reply.get("seconds", 0.0) or 0.0)}
    num = {k: float(v) for k, v in raw.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    out = {k: v for k, v in num.items() if k in empty_phases()}
    out["transfer"] = out.get("transfer", 0.0) + num.get("average", 0.0)
    out["agree"] = out.get("agree", 0.0) + num.get("repair", 0.0)
    return out


class DiLoCo(Optimizer):
    """DiLoCo around ``inner_optimizer`` (over ``model``'s parameters). Options as peerd.torch.Optimizer's
    (``run``, ``socket``, ``timeout_s``, ``sync_state``, ``state_every``: publish the outer state every this
    many outer steps of fragment 0; None, the default: after fragment 0's outer step, at most once every
    STATE_MIN_S-1.5 x STATE_MIN_S seconds, so that outer steps a few seconds apart do not each serialize, hand
    over and hash a snapshot that a joiner rarely needs (a joiner takes the outer steps since from the swarm); 0:
    never, ...) plus ``outer_lr``, ``outer_momentum``, ``sync_every`` (H),
    ``fragments`` (F), ``compression`` (the codec of the pseudo-gradient averages: "fp32", "fp16", "bf16",
    "int8" or "int4", with ``quant_group`` and ``rounding`` for the int codecs; None: fp32; "auto", the default:
    int8 for fragments of at least peerd.torch.auto.MIN_INT8_PARAMS values, else fp32, with the choice and its
    reason in every outer step's result under "auto" and in ``peerd status``; every member of the run must pass
    the same). A compressed average still ends identical on every member: each shard owner's
    own result is the dequantized value the others receive, and repairs and adoption copy those bytes, so the
    outer rule applies to the same (dequantized) average everywhere. ``robust`` ("clip[:C]" or "centered[:C]")
    makes shard owners clip every member's pseudo-gradient as they clip gradients: around zero, with the same
    C (a pseudo-gradient has no center of its own); "off" turns off the weight bound and the direction test
    that outer steps otherwise run (members you trust). "arc-topk" is refused: its row selection
    and error feedback are built for gradient vectors of the layout's matrices, not for pseudo-gradient
    fragments (the daemon would average these in fp32).

    ``overlap_outer=True`` (Streaming DiLoCo's overlap of communication with computation, one step deep): an outer
    step's average travels while the next inner step runs, and is applied at the end of that step (``flush()``,
    ``finish()`` and a snapshot also wait for it). The global parameters and momentum take exactly the step they
    would have taken; the replica keeps the inner step it took meanwhile, moved by the same correction (global
    parameters after the step minus where the replica stood when it sent its pseudo-gradient). One step, not
    more: waiting for the average there keeps the members meeting at every outer step, where a deeper overlap
    lets a member that fell behind (an evaluation, a slower CPU) fall further behind at every outer step until it
    misses its group.

    ``keep_pace=True`` (the default): a replica the others wait for at its outer steps (a slower
    CPU, a straggler) counts forward some of its inner steps at the start of each outer period, as many as the
    others waited for it at two outer steps in a row (its group's members tell their waits in their outer records;
    pace_skip), so that it reaches the next
    outer step with them and the swarm's outer steps go at its faster members' pace. Its pseudo-gradient then holds
    fewer inner steps, weighted by the samples it took; its step (and a schedule read from ``step_count``) stays
    the swarm's. With fragments, a period is the inner steps between two fragments' outer steps (H // F, at least 2
    for any pacing). ``paced_steps`` counts the steps counted forward so.

    Gradients are never averaged (each inner step is local); sync mode's per-K parameter averages are off."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, run: str,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, sync_every: int = 500, fragments: int = 1,
                 compression: str | None = "auto", quant_group: int | None = None, rounding: str | None = None,
                 socket: str | None = None, timeout_s: float = 60.0,
                 sync_state: bool = True, state_every: int | None = None, state_timeout_s: float = 60.0,
                 max_samples: float | None = None, robust: str | None = None, nslots: int = 4,
                 founder_window_s: float = FOUNDER_WINDOW_S, reseed: bool = True,
                 overlap_outer: bool = False, keep_pace: bool = True) -> None:
        self.overlap_outer = bool(overlap_outer)
        self.keep_pace = bool(keep_pace)
        self._skip = 0  # keep_pace: inner steps counted forward at the start of each outer period (pace_skip)
        self._pace_due = 0  # ... and those due at the next inner step (the outer step's own step stays its round's)
        self._late_prev: float | None = None  # how far behind its group it came at its last outer step (pace_skip)
        self.pace_report: dict[str, Any] = {}  # what keep_pace does now, and why (`peerd status`, outer results)
        self.paced_steps = 0
        self._pending: _Outer | None = None  # the overlapped outer step in flight (at most one)
        if compression == "arc-topk":
            raise ValueError("DiLoCo does not take compression='arc-topk': its top-k row selection and EF21M error "
                             "feedback are built for whole gradient vectors, not pseudo-gradient fragments; use "
                             "fp16, bf16, int8 or int4")
        if compression is not None and compression != "auto" and compression not in NAMES:
            raise ValueError(f"compression must be one of {NAMES}, 'auto' or None, got {compression!r}")
        if type(sync_every) is not int or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer (H inner steps), got {sync_every!r}")
        if not (math.isfinite(outer_lr) and outer_lr > 0 and math.isfinite(outer_momentum)
                and 0 <= outer_momentum < 1):
            raise ValueError("outer_lr must be positive and outer_momentum in [0, 1)")
        model_params = {id(p) for p in model.parameters()}
        inner = [p for g in inner_optimizer.param_groups for p in g["params"]]
        if not inner or any(id(p) not in model_params for p in inner):
            raise ValueError("the inner optimizer must optimize the model's parameters")
        self.auto_outer: dict[str, Any] = {}  # compression="auto": what it chose and why (reported, in results)
        if compression == "auto":
            if quant_group is not None or rounding is not None:
                raise ValueError("quant_group and rounding name a codec: not with compression='auto'")
            total = sum(p.numel() for p in inner)
            compression, why = outer_codec(total // fragments if type(fragments) is int and fragments > 0 else total)
            self.auto_outer = {"compression": compression, "reason": why, "applied": "compression"}
        self.model = model
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.sync_every = sync_every
        if state_every is not None and (type(state_every) is not int or state_every < 0):
            raise ValueError(f"state_every must be a whole number of outer steps or None, got {state_every!r}")
        self.outer_state_every = state_every
        self._state_next = -math.inf  # state_every=None: the earliest time.monotonic() of the next snapshot
        super().__init__(inner_optimizer, run=run, socket=socket, timeout_s=timeout_s, average_params_every=0,
                         sync_state=False, state_every=0, state_timeout_s=state_timeout_s, nslots=nslots,
                         max_samples=max_samples, robust=robust, compression=compression,
                         quant_group=quant_group, rounding=rounding, founder_window_s=founder_window_s,
                         reseed=reseed)
        params = {k: v for k, v in (("group", quant_group), ("rounding", rounding)) if v is not None}
        self.outer_codec = codec(compression or "fp32", **(params if (compression or "").startswith("int") else {}))
        if fragments > sync_every:
            raise ValueError(f"fragments ({fragments}) cannot exceed sync_every ({sync_every}): each needs a step")
        self.bounds = fragment_bounds(self.numels, fragments)
        self.fragments = fragments
        with torch.no_grad():
            self.global_params = torch.empty(self.elems, dtype=torch.float32)
            self._gather_cpu(self.global_params)
        self.momentum = torch.zeros(self.elems, dtype=torch.float32)
        self.samples_since = [0.0] * fragments  # averaging weight of each fragment's next outer step
        self.outer_steps = 0
        self.history: list[dict[str, Any]] = []  # the last HISTORY outer steps: step, fragment, state sha after it
        self.outer_steps_of0 = 0
        self._after: dict[int, bytes] = {}  # each fragment's state_sha after its last outer step: the next one's
        # "before" without hashing the state again (cleared when a snapshot replaces the state)
        self.outer_bytes = 0  # encoded bytes of the pseudo-gradients this trainer averaged (in the run's codec)
        self._inner_times: deque[float] = deque(maxlen=INNER_TIMES)  # wall seconds of recent inner steps
        if self.auto_outer:
            log.info("auto: %s", self.auto_outer["reason"])
        if sync_state:
            self.sync_state()

    def _auto_report(self) -> dict[str, Any] | None:
        return getattr(self, "auto_outer", None) or None

    # -- the outer state ----------------------------------------------------------------------------------
    def state_sha(self, fragment: int | None = None) -> bytes:
        """SHA-256 of the global parameters and outer momentum (of one fragment, or all): equal on every member
        after every outer step."""
        a, b = (0, self.elems) if fragment is None else self.bounds[fragment]
        h = hashlib.sha256()
        h.update(self.global_params[a:b].numpy())  # (the buffer itself: no copy)
        h.update(self.momentum[a:b].numpy())
        return h.digest()

    def _local_flat(self) -> torch.Tensor:
        flat = torch.empty(self.elems, dtype=torch.float32)
        self._gather_cpu(flat)
        return flat

    def _load_local(self, a: int, b: int, src: torch.Tensor | None = None) -> None:
        """Restart the model's parameters in [a, b) from the global parameters (or from ``src``, [a, b)'s values)."""
        off = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.numels, strict=True):
                lo, hi = max(a, off), min(b, off + n)
                if lo < hi:
                    p.view(-1)[lo - off: hi - off].copy_(self.global_params[lo:hi] if src is None
                                                         else src[lo - a: hi - a])
                off += n

    # -- stepping -------------------------------------------------------------------------------------
    def step(self, closure: Any = None, *, samples: int | float = 1, loss: float | None = None) -> dict[str, Any]:
        """An inner step on this replica's own gradients, then the outer steps that are due.

        Returns the step's statistics (outcome "local", or the last outer step's outcome, with "outer": a
        list of the outer steps taken). Raises DaemonError if the daemon went away, DiLoCoError if an outer
        step could not agree with the swarm."""
        if closure is not None:
            raise ValueError("peerd.torch.DiLoCo does not take a closure: compute the loss before step()")
        if samples <= 0:
            raise ValueError("samples must be positive (it is the averaging weight)")
        t0 = time.monotonic()
        prev_end = self._last_end
        grads = [p.grad for p in self.params]
        if not all_finite_each(grads):
            self.nonfinite_rounds += 1
            self.outcomes["nonfinite"] = self.outcomes.get("nonfinite", 0) + 1
            log.warning("step %d: this replica's gradients hold NaN or infinity; step skipped", self.step_count)
            reply = {"outcome": "nonfinite", "group_size": 1, "members": [], "received_fraction": 0.0,
                     "seconds": 0.0, "error": "this replica's gradients are not finite"}
            return self._finish_step(reply, t0, None)
        self.opt.step()
        if self._pace_due:  # keep_pace: this outer period's first inner step counts forward (_keep_pace)
            self.step_count += self._pace_due
            self.paced_steps += self._pace_due
            self._pace_due = 0
        self.step_count += 1
        for f in range(self.fragments):
            self.samples_since[f] += float(samples)
        reply: dict[str, Any] = {"outcome": "local", "group_size": 1, "members": [], "received_fraction": 1.0,
                                 "seconds": 0.0, "matchmaking_s": 0.0, "error": ""}
        outer: list[dict[str, Any]] = []
        if self._pending is not None:  # the step after an overlapped outer step: its average lands here, so the
            outer.append(self._complete(self._pending))  # members meet again at every outer step (no lag builds up)
        for f in due_fragments(self.step_count, self.sync_every, self.fragments):
            if self.overlap_outer:
                if self._pending is not None:  # one outer step in flight at a time: the last one lands first
                    outer.append(self._complete(self._pending))
                self._pending = self._start(f)
            else:
                outer.append(self.outer_step(f))
        if any(o["outcome"] == "alone" and o.get("adopted") for o in outer):
            outer.extend(self._catch_up())
        elif outer:
            self._keep_pace(outer[-1])
        elif prev_end is not None:
            self._inner_times.append(time.monotonic() - prev_end)
        phases = empty_phases()
        if outer:
            reply = {**outer[-1], "outer": outer}
            for o in outer:
                add_phases(phases, o["phases"])
        self.outcomes[reply["outcome"]] = self.outcomes.get(reply["outcome"], 0) + 1
        reply["seconds"] = time.monotonic() - t0
        if any(o["fragment"] == 0 for o in outer) and self._state_due():
            self.publish_state(wait=False)  # after fragment 0's step: a joiner starts a new cycle with the swarm
        return self._finish_step(reply, t0, phases)

    def _state_due(self) -> bool:
        """Whether fragment 0's outer step just taken publishes a snapshot (``state_every``)."""
        if self.outer_state_every is not None:
            return bool(self.outer_state_every) and self.outer_steps_of0 % self.outer_state_every == 0
        now = time.monotonic()
        if now < self._state_next:
            return False
        self._state_next = now + STATE_MIN_S * (1.0 + 0.5 * random.random())
        return True

    def outer_step(self, fragment: int, *, behind: bool = False) -> dict[str, Any]:
        """Average fragment ``fragment``'s pseudo-gradient with the swarm and apply the outer rule to it (any
        overlapped outer step still in flight lands first). ``behind``: the daemon takes the swarm's agreed average
        of a round the swarm finished, and answers outcome "current" (nothing applied) for one it has not."""
        if self._pending is not None:
            self._complete(self._pending)
        return self._complete(self._start(fragment, overlapped=False, behind=behind))

    def _catch_up(self) -> list[dict[str, Any]]:
        """After an outer step that found the swarm past its round (this replica averaged alone and adopted the
        swarm's average: a joiner whose snapshot was an outer step old, a trainer that stalled), take the outer steps
        the swarm finished since, one agreed average each, without inner steps between (they contribute nothing,
        at a negligible weight), until the daemon says the next round is still to come; this replica then holds the
        swarm's outer state and step, and a joiner does not fall further behind with every outer step."""
        done: list[dict[str, Any]] = []
        lag = None
        for _ in range(MAX_CATCH_UP_OUTER):
            start, nxt, samples = self.step_count, self.step_count + 1, list(self.samples_since)
            while not due_fragments(nxt, self.sync_every, self.fragments):
                nxt += 1
            self.step_count = nxt
            results = [self.outer_step(f, behind=True) for f in due_fragments(nxt, self.sync_every, self.fragments)]
            current = [r["fragment"] for r in results if r["outcome"] == "current"]
            if current:  # nothing was applied there: the fragment's inner steps since its last outer step still count
                for f in current:
                    self.samples_since[f] = samples[f]
                self.step_count = start
                lags = [r["swarm_lag_s"] for r in results if r["outcome"] == "current" and "swarm_lag_s" in r]
                lag = max(lags) if lags else None
                break
            done.extend(results)
            self.caught_up += nxt - start
        if done:
            log.info("caught up with the swarm: %d outer steps taken from it, at step %d", len(done), self.step_count)
        if lag is not None:
            self._count_forward(lag)
        return done

    def _keep_pace(self, last: dict[str, Any]) -> int:
        """After an outer step that averaged with a group: the inner steps this period counts forward, as
        ``pace_skip`` says (``keep_pace``), short of the next outer step; its first inner step counts them (the
        outer step itself stays at its round's step, where every member evaluates alike). Returns them."""
        wait, group = last.get("wait_s"), last.get("group_wait_s")
        period = self.sync_every // self.fragments  # inner steps between outer steps (of successive fragments)
        if (not self.keep_pace or period < 2 or last.get("outcome") != "averaged"
                or len(self._inner_times) < MIN_INNER_TIMES or not isinstance(wait, float)
                or not isinstance(group, float)):
            self._late_prev = None  # (lateness counts over outer steps in a row with a group)
            return 0
        late = group - wait
        skip = pace_skip(self._skip, late, self._late_prev, statistics.median(self._inner_times), period)
        self._late_prev = late
        if skip != self._skip:
            self._skip = skip
            self._report_pace(wait, group, period)
        nxt = self.step_count + 1
        while not due_fragments(nxt, self.sync_every, self.fragments):
            nxt += 1
        k = max(0, min(self._skip, nxt - 1 - self.step_count))
        self._pace_due = k
        if k > 0:
            log.debug("keep_pace: the group waited %.2f s against this replica's %.2f s: %d inner steps to count "
                      "forward after step %d", group, wait, k, self.step_count)
        return k

    def _report_pace(self, wait: float, group: float, period: int) -> None:
        """``peerd status`` shows the pace this replica keeps, and why (beside the codec's auto choice)."""
        why = (f"{self._skip} of each outer period's {period} inner steps counted forward: its group waited "
               f"{group:.2f} s for it at its last outer step, against its own {wait:.2f} s" if self._skip else
               f"no inner steps counted forward: its group waited {group:.2f} s at its last outer step, against its "
               f"own {wait:.2f} s")
        self.pace_report = {"pace": why, "pace_skip": self._skip}
        try:
            self._call("trainer_report", auto={**self.auto_outer, **self.pace_report})
        except DaemonError as e:
            log.info("reporting the pace failed: %s", e)

    def _count_forward(self, lag_s: float) -> int:
        """This replica starts its inner steps ``lag_s`` seconds after the swarm did (it adopted the swarm's average
        after the swarm had moved on): count forward as many steps as the swarm takes in that time (the median of
        this replica's recent inner steps), short of the next outer step, so that it reaches that outer step with
        the swarm and its inner steps go into the average instead of being replaced by it. Its weight is the samples
        it took. Returns the steps counted."""
        if len(self._inner_times) < MIN_INNER_TIMES or not (math.isfinite(lag_s) and lag_s > 0):
            return 0
        inner = statistics.median(self._inner_times)
        nxt = self.step_count + 1
        while not due_fragments(nxt, self.sync_every, self.fragments):
            nxt += 1
        k = min(nxt - 1 - self.step_count, math.ceil(lag_s / inner)) if inner > 0 else 0
        if k > 0:
            self.step_count += k
            self.caught_up += k
            log.info("%.2f s behind the swarm: counted %d inner steps forward to step %d (outer step at %d)",
                     lag_s, k, self.step_count, nxt)
        return max(k, 0)

    def _start(self, fragment: int, *, overlapped: bool = True, behind: bool = False) -> _Outer:
        """Hand fragment ``fragment``'s pseudo-gradient to the daemon; its average is collected by _complete."""
        a, b = self.bounds[fragment]
        local = self._local_flat()[a:b]
        t1 = time.monotonic()
        delta = self.global_params[a:b] - local
        weight = self.samples_since[fragment]
        if not all_finite(delta):
            # a diverged replica contributes nothing (a zero delta at a negligible weight) but still takes
            # the swarm's step, so it stays in agreement
            log.warning("outer step at %d: this replica's parameters are not finite; contributing nothing",
                        self.step_count)
            delta = torch.zeros_like(delta)
            weight = 1e-6
            local = None  # it restarts from the global parameters
        else:
            # no max_samples given: a few of this first outer step's samples, so that no member's claimed
            # weight outweighs a few honest pseudo-gradients on this trainer's shards
            self._default_max_samples(weight)
        self.ticket += 1
        t = self.ticket
        slot = self._slots[self.arena.slot_of(t)]
        slot[: b - a].copy_(delta)
        self.arena.write_request(t, max(weight, 1e-6))
        self.samples_since[fragment] = 0.0
        before = self._after.pop(fragment, None) or self.state_sha(fragment)
        t0 = time.monotonic()
        report: dict[str, Any] = {}
        if self._unreported is not None:
            report["phases"], self._unreported = self._unreported, None
        if self._client is None or self._client.broken:
            log.warning("reconnecting to the daemon (the previous connection broke)")
            self.connect()
        assert self._client is not None
        try:
            rid = self._client.submit("trainer_outer", session=self.session, step=t, round=self.step_count,
                                      length=b - a, state=before, timeout_s=self.timeout_s,
                                      **({"behind": True} if behind else {}), **report)
        except DaemonError as e:
            raise DaemonError(f"outer step of fragment {fragment} at step {self.step_count} failed: {e}") from None
        return _Outer(fragment, t, rid, self.step_count, before, local if overlapped else None, t0 - t1, t0)

    def _complete(self, p: _Outer) -> dict[str, Any]:
        """Wait for outer step ``p``'s agreed average and apply the outer rule with it. An overlapped step (one
        that went on with inner steps while it averaged) keeps the progress made since: the replica moves by the
        same correction the global parameters did, relative to where it stood when it sent its pseudo-gradient."""
        self._pending = None if self._pending is p else self._pending
        a, b = self.bounds[p.fragment]
        assert self._client is not None
        try:
            reply = self._client.collect(p.rid, timeout=3 * self.timeout_s + 30)
        except DaemonError as e:
            raise DaemonError(f"outer step of fragment {p.fragment} at step {p.step} failed: {e}") from None
        if reply.get("outcome") == "current":  # (behind=True) the swarm has not finished this round: nothing applied
            lag = reply.get("swarm_lag_s")
            return {"outcome": "current", "fragment": p.fragment, "step": p.step,
                    **({"swarm_lag_s": float(lag)} if isinstance(lag, int | float) and not isinstance(lag, bool)
                       else {})}
        phases = self._trainer_phases(outer_phases(reply), copy_in=p.copy_in, call_s=time.monotonic() - p.t0)
        t2 = time.monotonic()
        payload = self.outer_codec.body_size(b - a)  # one encoded copy of the fragment (fp32: 4 bytes a value)
        self.outer_bytes += payload
        if reply.get("state_winner") and reply["state_winner"] != p.before:
            raise DiLoCoError(
                f"outer step at step {p.step}: this replica's outer state (sha {p.before.hex()[:12]}) "
                f"differs from the swarm's ({reply['state_winner'].hex()[:12]}); resync the state (sync_state)")
        avg = torch.from_numpy(self.arena.result(p.ticket)[: b - a].copy())
        if hashlib.sha256(avg.numpy()).digest() != reply["sha"]:
            raise DiLoCoError(f"outer step at step {p.step}: the daemon's result does not match the agreed hash")
        applied = all_finite(avg)  # the daemon refuses non-finite results; never into the model
        if applied:
            nesterov_outer(self.global_params[a:b], self.momentum[a:b], avg, self.outer_lr, self.outer_momentum)
        else:
            self.nonfinite_rounds += 1
        if p.sent is None or self.step_count == p.step:
            self._load_local(a, b)
        else:  # the inner steps taken since the pseudo-gradient went out stay: moved by the global step's correction
            now = self._local_flat()[a:b]
            self._load_local(a, b, now + (self.global_params[a:b] - p.sent))
        self._after[p.fragment] = after = self.state_sha(p.fragment)
        phases["copy_out"] += time.monotonic() - t2
        self.outer_steps += 1
        self.kept_rounds += bool(reply.get("kept"))
        out = {"outcome": reply["outcome"], "fragment": p.fragment, "step": p.step,
               "group_size": reply.get("group_size", 1), "rounds": reply.get("rounds", 1),
               "received_fraction": reply.get("received_fraction", 0.0), "sha": after.hex(),
               "repaired_bytes": reply.get("repaired_bytes", 0),
               "adopted": reply.get("adopted", False), "adopted_bytes": reply.get("adopted_bytes", 0),
               "agreed_members": reply.get("agreed_members", 1), "pushed_records": reply.get("pushed_records", 0),
               "record_reads": reply.get("record_reads", 0), "payload_bytes": payload,
               "applied": applied, "seconds": reply.get("seconds", 0.0), "matchmaking_s": phases["matchmaking"],
               "kept": bool(reply.get("kept", False)),
               "phases": phases, "applied_at": self.step_count,
               **{k: float(reply[k]) for k in ("wait_s", "group_wait_s")
                  if isinstance(reply.get(k), int | float) and not isinstance(reply.get(k), bool)},
               **({"auto": self.auto_outer} if self.auto_outer else {}),
               **({"pace": self.pace_report} if self.pace_report else {})}
        self.history.append(out)
        del self.history[:-HISTORY]
        self.outer_steps_of0 += p.fragment == 0
        return out

    def flush(self) -> None:
        """Wait for an overlapped outer step still in flight and apply it."""
        if self._pending is not None:
            self._complete(self._pending)
        super().flush()

    # -- state sync -------------------------------------------------------------------------------------
    def save_snapshot(self, f: BinaryIO) -> None:
        """The outer state (global parameters, outer momentum), the step, each fragment's samples and the
        inner optimizer's state, serialized as tensors (loadable weights_only) into ``f``; an outer step in flight
        lands first, so the state is one every member reaches. (The tensors are whole storages of their own, so
        they are saved as they are, without copies.)"""
        self.flush()
        torch.save({"format": DILOCO_FORMAT, "layout": self.layout_hash, "step": self.step_count,
                    "optimizer_class": type(self.opt).__name__, "global": self.global_params,
                    "momentum": self.momentum, "samples": torch.tensor(self.samples_since, dtype=torch.float64),
                    "fragments": self.fragments, "sync_every": self.sync_every, "optimizer": self.opt.state_dict()},
                   f)

    def load_snapshot(self, blob: bytes, *, expected_step: int | None = None) -> int:
        """Take over a member's outer state; the model restarts from its global parameters. Returns the step.

        Raises SnapshotError (a ValueError), having applied nothing, for a snapshot of another model or schedule,
        with NaN or infinity in any tensor, negative sample counts, or an implausible step (or not
        ``expected_step``, the step its donors advertised)."""
        try:
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:
            raise SnapshotError(f"not a loadable snapshot ({type(e).__name__})") from None
        if not isinstance(state, dict) or state.get("format") != DILOCO_FORMAT:
            raise SnapshotError("not a peerd DiLoCo state snapshot")
        if state.get("layout") != self.layout_hash:
            raise SnapshotError("the snapshot is of a different model")
        if (state.get("fragments"), state.get("sync_every")) != (self.fragments, self.sync_every):
            raise SnapshotError(f"the snapshot's schedule (fragments {state.get('fragments')}, sync_every "
                                f"{state.get('sync_every')}) differs from this trainer's")
        g, mom, samples = state.get("global"), state.get("momentum"), state.get("samples")
        if (not all(isinstance(t, torch.Tensor) for t in (g, mom, samples)) or g.numel() != self.elems
                or mom.numel() != self.elems or g.dtype != torch.float32 or mom.dtype != torch.float32
                or samples.numel() < self.fragments or not samples.is_floating_point()):
            raise SnapshotError("the snapshot's outer state does not match this model")
        check_finite(g, "global parameters")
        check_finite(mom, "outer momentum")
        check_finite(samples, "sample counts")
        if bool((samples < 0).any()):
            raise SnapshotError("the snapshot's sample counts are negative")
        same_opt = state.get("optimizer_class") == type(self.opt).__name__
        if same_opt:
            check_finite(state.get("optimizer"), "optimizer state")
        step = checked_step(state.get("step"), expected_step)
        self.flush()  # (an outer step in flight would apply to the state this one replaces)
        self.global_params.copy_(g)
        self.momentum.copy_(mom)
        self._after.clear()
        self._load_local(0, self.elems)
        if same_opt:
            self.opt.load_state_dict(state["optimizer"])
        self.samples_since = [float(x) for x in samples.tolist()][: self.fragments]
        self.step_count = step
        return self.step_count
