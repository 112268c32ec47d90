"""DeAR-style overlap for ``peerd.torch.Optimizer(..., overlap=True)`` (Zhang et al., "DeAR: Accelerating
Distributed Deep Learning with Fine-Grained All-Reduce Pipelining", ICDCS 2023).

Why: a synchronous step hands the whole gradient to the daemon after backward and waits for the average, so
communication and computation never overlap. DeAR splits the all-reduce in two: the reduce-scatter of a bucket
starts as soon as backward has produced its gradients (while backward goes on with earlier layers), and the
all-gather plus the optimizer update of a layer is only waited for just before that layer's next forward.
peerd's daemon runs the whole average of a bucket (reduce-scatter and all-gather) in one request, so here every
bucket's request goes out when the step is armed (before the last micro-batch's forward: matchmaking runs while
the trainer computes), a gradient hook tells the daemon when backward has written the bucket into the arena, and
the reply is collected, and the layer's update applied, from a forward pre-hook of the next step: the average of
the last layers overlaps the backward of the first ones, and the average of the first buckets overlaps the
forward of the layers before them. Each bucket is its own Moshpit run (one matchmaking per bucket and step).

Buckets are runs of consecutive parameters taken from the last one back (backward produces the last layers'
gradients first), cut once a bucket holds ``bucket_elems`` elements: each bucket is one contiguous range of the
flat vector, so the gradient hook writes it straight into the step's arena slot and the daemon averages the slice
in place (no extra copy). Every bucket carries the step's sample count (the slot header): a member's weight is the
same in every range, as in a synchronous step.

:class:`Schedule` is the sans-I/O core (which bucket is complete, what a layer must wait for, what is applied);
:class:`Overlap` is the torch shell around it (hooks, the arena, the local socket, the wrapped optimizer).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..localsock.phases import PHASES
from .errors import NoGroupError
from .snapcheck import all_finite

log = logging.getLogger("peerd.torch")

# float32 megabytes per bucket: torch DDP's bucket_cap_mb. Each bucket is its own Moshpit run, so each costs a
# matchmaking, and a few large buckets beat many small ones (`peerd demo --model wide --mode overlap --bucket-mb MB`,
# step_s).
DEFAULT_BUCKET_MB = 25.0
MAX_BUCKETS = 1000  # the daemon's bound (peerd.trainer.service.MAX_BUCKETS)


@dataclass(frozen=True)
class Bucket:
    index: int  # 0: the last parameters (first out of backward)
    params: tuple[int, ...]  # parameter indices, ascending
    offset: int  # first element in the flat vector
    length: int  # elements


def plan_buckets(numels: Sequence[int], bucket_elems: int) -> list[Bucket]:
    """Consecutive parameters from the last back, a new bucket once one holds ``bucket_elems`` elements; at most
    MAX_BUCKETS (the size grows to fit)."""
    if bucket_elems < 1:
        raise ValueError(f"bucket_elems must be positive, got {bucket_elems}")
    total = sum(numels)
    bucket_elems = max(bucket_elems, math.ceil(total / MAX_BUCKETS))
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for i in range(len(numels) - 1, -1, -1):
        current.append(i)
        size += numels[i]
        if size >= bucket_elems:
            buckets.append(_bucket(len(buckets), current, offsets))
            current, size = [], 0
    if current:
        buckets.append(_bucket(len(buckets), current, offsets))
    return buckets


def _bucket(index: int, params: list[int], offsets: list[int]) -> Bucket:
    lo, hi = min(params), max(params)
    return Bucket(index, tuple(range(lo, hi + 1)), offsets[lo], offsets[hi + 1] - offsets[lo])


@dataclass
class StepState:
    """One step's buckets, from the first gradient to the last update applied."""
    step: int  # the arena ticket (the daemon's step id)
    samples: float
    missing: dict[int, int]  # bucket -> parameters whose gradient has not arrived yet
    submitted: dict[int, Any] = field(default_factory=dict)  # bucket -> the request's handle
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)  # bucket -> the daemon's reply
    applied: set[int] = field(default_factory=set)  # parameters whose update is applied
    nonfinite: bool = False  # this replica's own gradients held NaN/inf: no update from this step
    requests: dict[int, Any] = field(default_factory=dict)  # bucket -> its deferred request (sent when armed)
    signals: list[Any] = field(default_factory=list)  # "ready" requests to collect


class Schedule:
    """Sans-I/O: which bucket a gradient completes, what a layer waits for, which updates are still due.

    ``events`` records what happened, in order, for tests and replays: ("submit", step, bucket),
    ("collect", step, bucket), ("apply", step, params)."""

    def __init__(self, numels: Sequence[int], bucket_elems: int) -> None:
        self.buckets = plan_buckets(numels, bucket_elems)
        self.bucket_of = [0] * len(numels)
        for b in self.buckets:
            for i in b.params:
                self.bucket_of[i] = b.index
        self.current: StepState | None = None  # armed: gradients go out as they come
        self.pending: StepState | None = None  # submitted, updates not all applied yet
        self.events: list[tuple[Any, ...]] = []

    def arm(self, step: int, samples: float) -> StepState:
        if self.current is not None:
            raise RuntimeError("a step is armed already: call step() after its backward before arming the next")
        self.current = StepState(step, samples, {b.index: len(b.params) for b in self.buckets})
        return self.current

    def grad_ready(self, param: int) -> Bucket | None:
        """A parameter's gradient is final; returns its bucket if that completed it (and it is not out yet)."""
        st = self.current
        if st is None:
            return None
        b = self.bucket_of[param]
        if b in st.submitted or st.missing.get(b, 0) <= 0:
            return None
        st.missing[b] -= 1
        return self.buckets[b] if st.missing[b] == 0 else None

    def submitted(self, bucket: Bucket, handle: Any) -> None:
        assert self.current is not None
        self.current.submitted[bucket.index] = handle
        self.events.append(("submit", self.current.step, bucket.index))

    def unsubmitted(self) -> list[Bucket]:
        """The armed step's buckets not yet out (parameters without gradients, or a step that was not armed)."""
        st = self.current
        return [] if st is None else [b for b in self.buckets if b.index not in st.submitted]

    def close_step(self) -> StepState:
        """Every bucket of the armed step is out: it becomes the pending one (its updates come later)."""
        st = self.current
        assert st is not None and self.pending is None, "the previous step's updates must be applied first"
        self.current, self.pending = None, st
        return st

    def waits_for(self, params: Sequence[int]) -> list[int]:
        """Buckets of the pending step whose replies ``params`` need and that are not collected yet."""
        st = self.pending
        if st is None:
            return []
        out = []
        for i in params:
            b = self.bucket_of[i]
            if i not in st.applied and b not in st.replies and b in st.submitted and b not in out:
                out.append(b)
        return out

    def collected(self, bucket: int, reply: dict[str, Any]) -> None:
        assert self.pending is not None
        self.pending.replies[bucket] = reply
        self.events.append(("collect", self.pending.step, bucket))

    def due(self, params: Sequence[int]) -> list[int]:
        """Parameters among ``params`` whose update is due now (reply here, not applied yet)."""
        st = self.pending
        if st is None:
            return []
        return [i for i in params if i not in st.applied and self.bucket_of[i] in st.replies]

    def applied(self, params: Sequence[int]) -> None:
        assert self.pending is not None
        self.pending.applied.update(params)
        self.events.append(("apply", self.pending.step, tuple(params)))

    def finished(self) -> StepState | None:
        """The pending step, once every parameter's update is applied (it is then dropped), else None."""
        st = self.pending
        if st is not None and len(st.applied) == len(self.bucket_of):
            self.pending = None
            return st
        return None


def plan_hash(buckets: Sequence[Bucket]) -> str:
    """16 hex digits naming the bucket ranges: trainers that cut the model alike share a step's round."""
    text = ";".join(f"{b.offset}+{b.length}" for b in buckets)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summarize(st: StepState) -> dict[str, Any]:
    """One reply for a step from its buckets' replies: averaged only if every bucket averaged (else the worst
    outcome), the smallest group, the mean received fraction, complete only if every bucket's result was, the longest
    bucket's seconds."""
    replies = [st.replies[b] for b in sorted(st.replies)]
    if st.nonfinite:
        outcome = "nonfinite"
    elif all(r.get("outcome") == "averaged" for r in replies):
        outcome = "averaged"
    else:
        outcome = next((r["outcome"] for r in replies if r.get("outcome") == "failed"), None) or next(
            r.get("outcome", "failed") for r in replies if r.get("outcome") != "averaged")
    return {
        "step": st.step, "outcome": outcome, "buckets": len(replies),
        "group_size": min((int(r.get("group_size", 1)) for r in replies), default=1),
        "members": sorted({m for r in replies for m in r.get("members", [])}),
        "received_fraction": sum(float(r.get("received_fraction", 0.0)) for r in replies) / max(1, len(replies)),
        "complete": bool(replies) and all(bool(r.get("complete")) for r in replies),
        "seconds": max((float(r.get("seconds", 0.0)) for r in replies), default=0.0),
        "matchmaking_s": max((float(r.get("matchmaking_s", 0.0)) for r in replies), default=0.0),
        "kept": all(bool(r.get("kept")) for r in replies) and bool(replies),
        "round": min((int(r.get("round", 0)) for r in replies), default=0),
        "error": "; ".join(sorted({r["error"] for r in replies if r.get("error")}))[:500],
        # buckets average concurrently: a phase of the step is as long as its longest bucket's
        "phases": {k: max((float((r.get("phases") or {}).get(k, 0.0)) for r in replies), default=0.0)
                   for k in PHASES},
    }


Hook = Callable[..., Any]


class Overlap:
    """The torch shell of :class:`Schedule` for one ``peerd.torch.Optimizer`` (``owner``): gradient hooks hand
    each complete bucket to the daemon (``trainer_bucket``, collected later on the same connection), forward
    pre-hooks of ``model``'s modules collect their parameters' buckets and apply those parameters' update.

    The update of a parameter is the wrapped optimizer's step on it alone (every other gradient is hidden for
    that call), so an element-wise optimizer (SGD, Adam, AdamW, ...) gives what a synchronous step gives; one
    that couples parameters (a global gradient-norm clip, LAMB's trust ratio over a group) does not."""

    def __init__(self, owner: Any, model: Any, bucket_elems: int, *, deferred: bool = True) -> None:
        import torch

        self.torch = torch
        self.o = owner
        # deferred: every bucket's request goes out when the step is armed, so the daemon matchmakes while
        # backward runs, and the hook only says "ready"; else a bucket's request goes out when it is complete
        self.deferred = deferred
        self.bucket_elems = bucket_elems
        self.schedule = Schedule(owner.numels, bucket_elems)
        self.plan = plan_hash(self.schedule.buckets)  # the daemon runs one round per step for buckets that name it
        self.offsets = [0]
        for n in owner.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.scale = 1.0  # what a gradient is multiplied by on its way out (1 / samples when armed)
        self.last: dict[str, Any] = {"outcome": "pending", "group_size": 1, "members": [], "received_fraction": 0.0,
                                     "seconds": 0.0, "matchmaking_s": 0.0, "kept": False, "error": ""}
        index = {id(p): i for i, p in enumerate(owner.params)}
        self.handles: list[Any] = []
        for i, p in enumerate(owner.params):
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i)))
        self.waited_s = 0.0  # seconds spent waiting for averaged buckets (communication, not compute: auto)
        self.covered: set[int] = set()
        for m in model.modules():
            own = tuple(index[id(p)] for p in m.parameters(recurse=False) if id(p) in index)
            if own:
                self.covered.update(own)
                self.handles.append(m.register_forward_pre_hook(lambda _m, _a, own=own: self.before_forward(own)))
        if not self.covered:
            raise ValueError("overlap: none of the model's modules holds the optimizer's parameters")

    def replan(self, bucket_elems: int) -> None:
        """Cut the next steps' gradients into buckets of ``bucket_elems`` (bucket_mb="auto": every member of the
        run changes at the same step). The buckets still out come back, and their updates are applied, first."""
        if self.schedule.current is not None:
            raise RuntimeError("overlap: the buckets can only change between steps")
        self.flush()
        self.bucket_elems = bucket_elems
        self.schedule = Schedule(self.o.numels, bucket_elems)
        self.plan = plan_hash(self.schedule.buckets)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- the step's gradients go out --------------------------------------------------------------------
    def arm(self, samples: float, scale: float) -> None:
        if not (isinstance(samples, int | float) and math.isfinite(samples) and samples > 0):
            raise ValueError("samples must be a positive number (it is the averaging weight)")
        if self.schedule.current is not None:
            raise RuntimeError("overlap: last_microbatch() was called twice for one step (call step() in between)")
        o = self.o
        if o._client is None or o._client.broken:
            self._lost("the connection to the daemon broke")
            o.connect()
        o.ticket += 1
        o.arena.write_request(o.ticket, float(samples))  # the weight of every bucket; vectors follow
        self.scale = scale
        st = self.schedule.arm(o.ticket, float(samples))
        if self.deferred:
            try:
                for b in self.schedule.buckets:
                    st.requests[b.index] = o._client.submit(
                        "trainer_bucket", session=o.session, step=st.step, bucket=b.index, offset=b.offset,
                        length=b.length, timeout_s=o.timeout_s, deferred=True, buckets=len(self.schedule.buckets),
                        plan=self.plan)
            except Exception as e:
                self._lost(str(e))
                raise _daemon_error(f"starting the averages of step {o.step_count} failed: {e}") from None

    def _on_grad(self, i: int) -> None:
        bucket = self.schedule.grad_ready(i)
        if bucket is not None:
            self._submit(bucket)

    def _submit(self, bucket: Bucket) -> None:
        torch, o, st = self.torch, self.o, self.schedule.current
        assert st is not None
        if self.schedule.pending is not None:
            self.flush()  # the last step's leftovers (parameters no forward used): before this step's results
        slot = o._slots[o.arena.slot_of(st.step)]
        with torch.no_grad():
            for i in bucket.params:
                p, dst = o.params[i], slot[self.offsets[i]: self.offsets[i + 1]]
                if p.grad is None:
                    dst.zero_()  # a parameter this replica did not use still gets the swarm's gradient
                elif self.scale == 1.0:
                    dst.copy_(p.grad.detach().reshape(-1))  # (from a GPU: a copy the grad's stream is ordered before)
                elif p.grad.device == dst.device:
                    torch.mul(p.grad.detach().reshape(-1), self.scale, out=dst)
                else:  # scaled where the gradient is, then copied (the same single rounding as on the CPU)
                    dst.copy_(torch.mul(p.grad.detach().reshape(-1), self.scale))
            finite = all_finite(slot[bucket.offset: bucket.offset + bucket.length])
        if not finite:  # as a synchronous step: skipped, never sent (the daemons would refuse it anyway)
            if not st.nonfinite:
                log.warning("step %d: this replica's gradients hold NaN or infinity; step skipped", o.step_count)
            st.nonfinite = True
        if bucket.index in st.requests:  # deferred: its average waits (in its group) for this
            try:
                st.signals.append(o._client.submit("trainer_bucket_ready", session=o.session, step=st.step,
                                                   bucket=bucket.index, skip=not finite))
            except Exception as e:
                self._lost(str(e))
                raise _daemon_error(f"handing gradient bucket {bucket.index} of step {o.step_count} to the daemon "
                                    f"failed: {e}") from None
            self.schedule.submitted(bucket, st.requests[bucket.index])
            return
        if not finite:
            self.schedule.submitted(bucket, None)
            return
        try:
            rid = o._client.submit("trainer_bucket", session=o.session, step=st.step, bucket=bucket.index,
                                   offset=bucket.offset, length=bucket.length, timeout_s=o.timeout_s)
        except Exception as e:
            self._lost(str(e))
            raise _daemon_error(f"handing gradient bucket {bucket.index} of step {o.step_count} to the daemon "
                                f"failed: {e}") from None
        self.schedule.submitted(bucket, rid)

    def step(self, samples: float, loss: float | None) -> dict[str, Any]:
        """After the step's backward: send what the hooks did not (a step that was not armed sends everything
        now), count the step, and return the last finished step's statistics (this one's come later)."""
        o = self.o
        st = self.schedule.current
        if st is None:
            self.arm(samples, 1.0)  # the loop did not say which backward was last: gradients are means already
        elif float(samples) != st.samples:
            raise ValueError(f"step(samples={samples}) differs from last_microbatch(samples={st.samples}): the "
                             f"averaging weight went out with the gradients")
        for bucket in self.schedule.unsubmitted():
            self._submit(bucket)
        if self.schedule.pending is not None:
            self.flush()
        st = self.schedule.close_step()
        try:
            for rid in st.signals:  # answered at once: the daemon only wakes the bucket's average
                o._client.collect(rid, timeout=o.timeout_s)
        except Exception as e:
            self._lost(str(e))
            raise _daemon_error(f"handing the gradients of step {o.step_count} to the daemon failed: {e}") from None
        st.signals.clear()
        if loss is not None and math.isfinite(loss):
            try:
                o._client.call("trainer_report", session=o.session, loss=float(loss))
            except Exception as e:  # the next collect says what happened to the daemon
                log.info("could not report the loss: %s", e)
        o.step_count += 1
        return dict(self.last)

    # -- the averaged gradients come back ---------------------------------------------------------------
    def before_forward(self, params: Sequence[int]) -> None:
        """A layer is about to run: its parameters' averaged buckets must be here and their update applied."""
        if self.schedule.pending is None:
            return
        for b in self.schedule.waits_for(params):
            self._collect(b)
        due = self.schedule.due(params)
        if due:
            self._apply(due)
        done = self.schedule.finished()
        if done is not None:
            self._finish(done)

    def flush(self) -> None:
        """Collect every outstanding bucket and apply every update still due (before a parameter average, a
        snapshot, an evaluation outside the model's forward, or the end of training)."""
        st = self.schedule.pending
        if st is None:
            return
        for b in sorted(st.submitted):
            if b not in st.replies:
                self._collect(b)
        due = self.schedule.due(range(len(self.o.params)))
        if due:
            self._apply(due)
        done = self.schedule.finished()
        if done is not None:
            self._finish(done)

    def _collect(self, b: int) -> None:
        o, st = self.o, self.schedule.pending
        assert st is not None
        rid = st.submitted[b]
        if rid is None:
            reply: dict[str, Any] = {"outcome": "nonfinite", "group_size": 1, "received_fraction": 0.0,
                                     "error": "this replica's gradients are not finite"}
        else:
            t0 = time.monotonic()
            try:
                reply = o._client.collect(rid, timeout=o.timeout_s + 30.0)
            except Exception as e:
                self._lost(str(e))
                raise _daemon_error(f"averaging gradient bucket {b} of step {o.step_count - 1} failed: {e}") from None
            finally:
                self.waited_s += time.monotonic() - t0
            if reply.get("outcome") == "averaged":
                bucket = self.schedule.buckets[b]
                result = o._slots[o.arena.slot_of(st.step)][bucket.offset: bucket.offset + bucket.length]
                if not o._finite(result, "gradient"):
                    reply = {**reply, "outcome": "nonfinite"}  # never into the model: this bucket is skipped
        self.schedule.collected(b, reply)

    def _apply(self, params: list[int]) -> None:
        o, st = self.o, self.schedule.pending
        assert st is not None
        chosen = []
        for i in params:
            outcome = st.replies[self.schedule.bucket_of[i]].get("outcome")
            if st.nonfinite or outcome == "nonfinite":
                continue  # skipped (own gradients not finite), or the average was not (nothing to apply)
            if outcome != "averaged" and o.no_group == "raise":
                self.schedule.applied(params)
                raise NoGroupError(f"no group averaged a bucket of step {st.step} ({outcome}: "
                                   f"{st.replies[self.schedule.bucket_of[i]].get('error')})")
            if outcome != "averaged" and o.no_group == "skip":
                continue
            chosen.append(i)  # averaged, or "local": this replica's own gradients, handed back unchanged
        if chosen:
            self._step_params(chosen, st.step)
        self.schedule.applied(params)

    def _step_params(self, chosen: list[int], step: int) -> None:
        """The wrapped optimizer's step on ``chosen`` alone, their gradients views of the arena slot."""
        torch, o = self.torch, self.o
        slot = o._slots[o.arena.slot_of(step)]
        saved = [p.grad for p in o.params]
        try:
            for p in o.params:
                p.grad = None
            for i in chosen:
                p = o.params[i]
                g = slot[self.offsets[i]: self.offsets[i + 1]].view(p.shape)
                p.grad = g if g.dtype == p.dtype and g.device == p.device else g.to(p.device, p.dtype)
            with torch.no_grad():
                o.opt.step()
        finally:
            for p, g in zip(o.params, saved, strict=True):
                p.grad = g

    def _finish(self, st: StepState) -> None:
        o = self.o
        reply = summarize(st)
        outcome = reply["outcome"]
        o.outcomes[outcome] = o.outcomes.get(outcome, 0) + 1
        if outcome == "nonfinite":
            o.nonfinite_rounds += 1
        elif outcome != "averaged" and o.no_group == "local":
            o.local_steps += 1
        o.kept_rounds += bool(reply.get("kept"))
        self.last = reply
        o.last = reply

    def _lost(self, why: str) -> None:
        """The connection broke: whatever was out is gone (the daemon dropped the session with it)."""
        if self.schedule.current is not None or self.schedule.pending is not None:
            log.warning("overlap: dropping the buckets in flight (%s)", why)
        self.schedule.current = None
        self.schedule.pending = None


def _daemon_error(message: str) -> Exception:
    from ..localsock.client import DaemonError

    return DaemonError(message)
