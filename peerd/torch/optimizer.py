"""``peerd.torch.Optimizer``: wraps any torch optimizer so that ``step()`` averages through the local daemon.

::

    opt = peerd.torch.Optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), run="my-run")
    ...
    loss.backward()
    opt.step(samples=len(x), loss=loss.item())   # averaged gradients (weighted by samples), then a local step

Every step the gradients (the mean over the trainer's samples) go into the step's slot of a shared-memory
arena, the daemon averages them with a Moshpit group and writes the result back, and the wrapped
optimizer steps. Every ``average_params_every`` steps the parameters themselves are averaged too, which
pulls replicas back together after lost datagrams or rounds without a group. A new trainer first
downloads parameters, optimizer state and step number from peers that have them (state sync), and
publishes its own snapshot every ``state_every`` steps for those who join later.
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
from collections import OrderedDict
from typing import Any, BinaryIO

import torch

from ..allreduce.robust import parse_robust
from ..compress import COMPRESSIONS as CODECS
from ..localsock.arena import Arena, read_blob, write_blob, write_blob_from
from ..localsock.client import DaemonError, LocalClient
from ..localsock.phases import add_phases, empty_phases
from .auto import AVERAGE_EVERY, PERIOD_LADDER, Choice
from .autobucket import BucketTrial, elems_of
from .autostep import AutoSteps
from .errors import NoGroupError
from .founders import FOUNDER_WINDOW_S, SameData, reseed_peer
from .overlap import Overlap
from .report import StepReport
from .snapcheck import SnapshotError, all_finite, all_finite_each, check_finite, checked_step

log = logging.getLogger("peerd.torch")

NO_GROUP = ("local", "skip", "raise")
# A group that formed complete is kept 100 rounds: matchmaking through the DHT is most of a small model's step,
# and a newcomer still gets in (the leader's watch sees it, and it breaks the group for the next round, which it
# joins). Each re-formation costs a matchmaking through the DHT (70-110 ms at 100 Mbit/s under 5 % loss): once in
# 100 rounds that is under a millisecond a step.
DEFAULT_KEEP_ROUNDS = 100
STATE_FORMAT = "peerd-state-v1"
# max_samples not given: this many times the samples of the trainer's first step, so a member claiming a huge
# weight counts for at most two honest batches here (DropCompute's honest weights stay below one batch; equal
# honest weights are never capped). The same bound as robust's WEIGHT_BOUND, against this trainer's batch instead
# of the median, so it needs no staging: in the 8-peer demo a sign-flipped member capped at 4 batches still cost
# the honest peers 32 points of accuracy at step 40.
MAX_SAMPLES_FACTOR = 2.0
# A joiner counts forward to the swarm's step at most this many steps (its first round's number is the group's
# claim: a forged one moves this replica's count, and the schedule keyed on it, by no more).
MAX_CATCH_UP = 100_000
FINISH_WAIT_S = 10.0  # finish()'s averages wait this long for trainers that end training later (capped by timeout_s)
MIN_ROUND_S = 1.0  # the least deadline a round is given (the daemon's floor): a parameter average needs it left
SNAPSHOT_TRIES = 4  # snapshots a joiner refuses (non-finite, implausible step) before it gives up


class Optimizer(AutoSteps, torch.optim.Optimizer):
    """A collaborative wrapper around ``optimizer`` (any ``torch.optim.Optimizer``).

    It is a ``torch.optim.Optimizer`` itself and shares ``param_groups``, ``state`` and ``defaults`` with the
    wrapped one, so LR schedulers, ``torch.amp.GradScaler.step`` and step hooks take it as they take any
    optimizer (docs/trainer-api.md). Founders (trainers that start a run together) end up on one initial
    state: with ``sync_state`` (the default) each publishes its initial state and all take the same one
    (``founder_window_s``: how long a founder waits for the others' before choosing; 0: no agreement).
    ``reseed`` (default True): after that, torch's, numpy's and Python's global random generators are seeded
    per peer (``seed``: from the daemon's node id, the session and the run), so a script seeded alike on every
    peer (the single-process habit) still draws different batches and dropout masks on each.

    Options: ``run`` (the run id: trainers with the same run id and model average together),
    ``socket`` (the daemon's local socket; default $PEERD_SOCKET, ...), ``timeout_s`` (a round's
    deadline), ``average_params_every`` (K; 0 turns parameter averaging off; "auto", the default: 10 until
    AUTO_STEP, then what peerd.torch.auto.applied_period picks: longer, up to 40, only where every measured
    round averaged and left this replica on the group's common result (every all-gather range arrived, repairs
    included; lost reduce-scatter data only lowers a range's weight alike for all), so replicas stay identical
    without the averages; each member announces its
    pick and from step AGREE_STEP all apply the least announced),
    ``no_group`` (what to do when no group forms or a round fails: "local" takes a local step and counts it,
    "skip" skips the step, "raise" raises NoGroupError), ``sync_state`` (download the swarm's state before the
    first step), ``state_every`` (publish a snapshot for joiners every this many steps; 0: never), ``nslots``,
    ``keep_rounds`` (keep a Moshpit group that formed complete for this many rounds, renewed without the
    DHT, so matchmaking does not dominate a step; 1: a new group every round; None: the daemon's default;
    default DEFAULT_KEEP_ROUNDS), ``robust`` (how shard owners limit each member's contribution: "off",
    "clip[:C]" or "centered[:C]"; None: the daemon's default), ``max_samples`` (the largest sample count a
    member may claim as its averaging weight in this run; None: MAX_SAMPLES_FACTOR times the samples of this
    trainer's first step, declared to the daemon before that step averages), ``compression`` (the
    codec of every average of the run: "fp32", "fp16", "bf16", "int8" or "int4"; every trainer of the run must
    pass the same; None: the run's, fp32 unless set; "auto", the default: float32 for the first AUTO_STEP steps,
    then what peerd.torch.auto picks from the link rate and compute time measured, int8 where float32's transfer
    would take over a quarter of the compute, with the choice and its reason in every step's reply under "auto"
    and in `peerd status`; a joiner takes the swarm's choice with its state),
    ``quant_group`` and ``rounding`` (int8/int4: values per scale and min, default 128; "stochastic", the
    default, or "nearest"), ``clip_grad_norm`` (clip the averaged gradient to this norm after averaging, just
    before the wrapped optimizer steps: what ``clip_grad_norm_`` after ``backward()`` does under DDP, whose
    gradients are averaged by then; a ``clip_grad_norm_`` call before ``step()`` clips this replica's own
    gradients, which are longer than their average, so it shrinks every step more than under DDP).
    ``compression="arc-topk"`` averages the top ``topk_ratio`` (default 0.1) of each matrix's rows per shard
    with EF21M error feedback in the daemon (peerd.allreduce.arctopk): the gradients the step applies are
    EF21M's update direction; parameter averages stay fp32; not with ``overlap``.

    ``overlap=True`` (with ``model``; CPU or CUDA parameters): DeAR-style overlap (peerd.torch.overlap). Gradients go to
    the daemon in buckets of about ``bucket_mb`` MB as backward produces them ("auto", the default: 25 MB, and half
    the model tried at steps 10-14; the run keeps the faster, peerd.torch.autobucket), and each layer's update is
    applied just before its next forward, so averaging overlaps computation. Call ``last_microbatch(samples)`` before
    the forward of the step's last micro-batch (without it, ``step()`` sends every bucket after backward); ``step()``
    then returns the statistics of the last step whose updates are all applied, and ``flush()`` applies what is still
    due (``average_parameters``, ``snapshot`` and ``state_dict`` call it). The update of a step is applied at the next
    forward, so a learning-rate scheduler stepped after ``step()`` is one step early.

    A round whose result holds a non-finite number is never applied: the step goes on with this replica's
    own gradients (counted in ``nonfinite_rounds``), a parameter average is dropped. A step whose own
    gradients are not finite is skipped without averaging (outcome "nonfinite", step_count unchanged).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, run: str, socket: str | None = None,
                 timeout_s: float = 30.0, average_params_every: int | str = "auto", no_group: str = "local",
                 sync_state: bool = True, state_every: int = 10, state_timeout_s: float = 60.0,
                 nslots: int = 4, keep_rounds: int | None = DEFAULT_KEEP_ROUNDS, robust: str | None = None,
                 max_samples: float | None = None, overlap: bool = False, model: torch.nn.Module | None = None,
                 bucket_mb: float | str = "auto", compression: str | None = "auto",
                 quant_group: int | None = None, rounding: str | None = None, topk_ratio: float | None = None,
                 founder_window_s: float = FOUNDER_WINDOW_S, reseed: bool = True,
                 clip_grad_norm: float | None = None) -> None:
        self._torch_surface(optimizer)
        if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(
                clip_grad_norm, int | float) or not (math.isfinite(clip_grad_norm) and clip_grad_norm > 0)):
            raise ValueError(f"clip_grad_norm must be a positive finite number or None, got {clip_grad_norm!r}")
        if clip_grad_norm is not None and overlap:
            raise ValueError("clip_grad_norm clips the whole averaged gradient: not with overlap (its buckets "
                             "are applied layer by layer)")
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        if not (isinstance(founder_window_s, int | float) and 0 <= founder_window_s <= 600):
            raise ValueError(f"founder_window_s must be in [0, 600] seconds, got {founder_window_s!r}")
        self.founder_window_s = float(founder_window_s)
        if no_group not in NO_GROUP:
            raise ValueError(f"no_group must be one of {NO_GROUP}")
        # compression="auto": float32 until step AUTO_STEP, then what peerd.torch.auto picks from the steps measured
        self.auto: Choice | None = None
        self._auto_probe: list[tuple[float, float, int, int]] | None = None  # compute s, round s, bytes, group
        self._auto_clean = True  # every step measured so far ended on the group's common result (applied_period)
        self.auto_proposed: int | None = None  # the period this member proposed, until it is agreed at AGREE_STEP
        self._auto_codec = compression == "auto"
        self._auto_every = average_params_every == "auto"
        if self._auto_every:
            average_params_every = AVERAGE_EVERY[0]
        elif type(average_params_every) is not int or average_params_every < 0:
            raise ValueError(f"average_params_every must be a non-negative integer or 'auto', got "
                             f"{average_params_every!r}")
        if compression == "auto":
            if quant_group is not None or rounding is not None or topk_ratio is not None:
                raise ValueError("quant_group, rounding and topk_ratio name a codec: not with compression='auto'")
            compression = None
        if self._auto_codec or self._auto_every:
            self._auto_probe = []
        if compression is not None and compression not in CODECS:
            raise ValueError(f"compression must be one of {CODECS} or None, got {compression!r}")
        if (quant_group is not None or rounding is not None) and compression not in ("int8", "int4"):
            raise ValueError("quant_group and rounding go with compression int8 or int4")
        if topk_ratio is not None and (compression != "arc-topk" or not 0.0 < topk_ratio <= 1.0):
            raise ValueError(f"topk_ratio goes with compression arc-topk and must be in (0, 1], got {topk_ratio!r}")
        if compression == "arc-topk" and overlap:
            raise ValueError("arc-topk averages whole gradient vectors: not with overlap (its buckets)")
        self.compression = compression
        self.codec_options = {k: v for k, v in (("compression", compression), ("quant_group", quant_group),
                                                ("rounding", rounding), ("topk_ratio", topk_ratio)) if v is not None}
        parse_robust(robust)  # raises ValueError that says what is accepted
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int | float)
                                        or not (math.isfinite(max_samples) and max_samples > 0)):
            raise ValueError(f"max_samples must be a positive finite number or None, got {max_samples!r}")
        self.robust = robust
        self.max_samples = None if max_samples is None else float(max_samples)
        self._max_samples_due = max_samples is None  # set from the first step's samples (_default_max_samples)
        if keep_rounds is not None and (type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000):
            raise ValueError(f"keep_rounds must be an integer in [1, 1000] or None, got {keep_rounds!r}")
        self.keep_rounds = keep_rounds
        self.opt = optimizer
        self.run = run
        self.socket = socket
        self.timeout_s = timeout_s
        self.average_params_every = average_params_every
        self.no_group = no_group
        self.state_every = state_every
        self.state_timeout_s = state_timeout_s
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        self.layout = [[f"p{i}", list(p.shape), str(p.dtype).removeprefix("torch.")] for i, p in enumerate(self.params)]
        self.numels = [p.numel() for p in self.params]
        self.elems = sum(self.numels)
        self.arena = Arena.create(nslots, self.elems)
        self._slots = [torch.from_numpy(self.arena.vector(i)) for i in range(nslots)]
        self._cuda = any(p.is_cuda for p in self.params)
        # CUDA: device -> pinned host staging -> arena. A pinned buffer makes the copies true DMA and lets
        # them run without blocking the host; the arena itself is an mmap that CUDA cannot pin cheaply.
        self._staging = torch.empty(self.elems, dtype=torch.float32, pin_memory=True) if self._cuda else None
        self.ticket = 0  # slot/step id of averaging requests (one per request: grads or params)
        self.step_count = 0  # optimizer steps taken by this replica (taken over from donors on sync)
        self._round: int | None = None  # the gradient round of the latest step (None: it had none)
        self._joined: tuple[int, int] | None = None  # a joiner's snapshot: (its step, the round that step was)
        self.caught_up = 0  # steps a joiner counted forward to the swarm's (the rounds its download took)
        self.outcomes: dict[str, int] = {}
        self.local_steps = 0  # steps taken on own gradients because no group formed
        self.kept_rounds = 0  # rounds (gradients or parameters) averaged in a kept group, without matchmaking
        self.nonfinite_rounds = 0  # averaged results refused because they held NaN or infinity
        self.params_averages = 0  # parameter averages asked for (finish()'s included) ...
        self.params_identical = 0  # ... and those the check round skipped: every member held these parameters
        self.params_close = 0  # ... and those it skipped as nearer the group's average than the codec's rounding
        self.last: dict[str, Any] = {}
        self.last_step: StepReport | None = None  # the latest step's report: outcome, seconds, phases
        self._unreported: dict[str, float] | None = None  # the latest step's phases, sent with the next request
        self.same_data = SameData(compression)  # warns when the group's members contribute the same numbers
        self.founder: dict[str, Any] | None = None  # how this founder agreed on the initial state (sync_state)
        self.synced_from: dict[str, Any] | None = None
        self._last_end: float | None = None
        self._waited_mark = 0.0  # overlap: its waits for buckets as of the last step's end
        self._last_call: float | None = None
        self._client: LocalClient | None = None
        self.session = 0
        self.layout_hash = ""
        self._overlap: Overlap | None = None
        self._bucket_trial: BucketTrial | None = None  # bucket_mb="auto" (overlap): peerd.torch.autobucket
        self._bucket_t0: float | None = None
        if overlap:
            if model is None:
                raise ValueError("overlap=True needs model= (its forward pre-hooks apply each layer's update)")
            if bucket_mb == "auto":
                self._bucket_trial = BucketTrial(self.elems)
                bucket_elems = self._bucket_trial.plan_at(0)
            elif isinstance(bucket_mb, int | float) and not isinstance(bucket_mb, bool) and 0 < bucket_mb <= 1024:
                bucket_elems = elems_of(bucket_mb)
            else:
                raise ValueError(f"bucket_mb must be 'auto' or in (0, 1024], got {bucket_mb!r}")
            self._overlap = Overlap(self, model, bucket_elems)
        self.connect()
        if sync_state:
            self.sync_state()
        self.seed: int | None = reseed_peer(self.peer_id, self.session, run) if reseed else None

    # -- connection -------------------------------------------------------------------------------
    def connect(self) -> None:
        """(Re)connect to the daemon and declare this trainer's layout; refused if the model differs."""
        if self._client is not None:
            self._client.close()
            self._client = None
        client = LocalClient(self.socket, timeout=self.timeout_s + 30.0)
        try:
            extra: dict[str, Any] = {} if self.keep_rounds is None else {"keep_rounds": self.keep_rounds}
            if self.robust is not None:
                extra["robust"] = self.robust
            if self.max_samples is not None:
                extra["max_samples"] = self.max_samples
            extra.update(self.codec_options)  # the daemon checks them (an older one ignores what it does not know)
            reply = client.call("trainer_open", fds=[self.arena.fd], run=self.run, layout=self.layout,
                                nslots=self.arena.nslots, **extra)
        except BaseException:
            client.close()
            raise
        self._client = client
        self.session = reply["session"]
        self.layout_hash = reply["layout_hash"]
        self.run_key = reply["run_key"]
        self.peer_id = str(reply.get("peer_id", ""))
        auto = self._auto_report()
        if auto:  # a new session shows the choice made so far in `peerd status` too
            try:
                client.call("trainer_report", session=self.session, auto=auto)
            except DaemonError as e:
                log.info("reporting the auto choice failed: %s", e)

    def _auto_report(self) -> dict[str, Any] | None:
        """What compression="auto" chose so far, as `peerd status` shows it (None: nothing yet)."""
        on = getattr(self, "auto", None) is not None or getattr(self, "_bucket_trial", None) is not None
        return self._auto_fields() if on else None

    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        if self._client is None or self._client.broken:
            log.warning("reconnecting to the daemon (the previous connection broke)")
            self.connect()
        assert self._client is not None
        return self._client.call(op, session=self.session, **args)

    def close(self) -> None:
        if self._overlap is not None:
            self._overlap.remove()
        if self._client is not None:
            self._client.close()
            self._client = None
        self.arena.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the torch.optim.Optimizer surface --------------------------------------------------------
    def _torch_surface(self, optimizer: torch.optim.Optimizer) -> None:
        """What torch.optim.Optimizer.__init__ sets up (step hooks, the profiler's step wrapper), without its
        own param_groups and state: those are the wrapped optimizer's (the properties below), so a scheduler
        that sets ``lr`` in a group sets it for the optimizer that steps."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"peerd.torch.Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, Optimizer):
            raise TypeError("the optimizer is a peerd.torch.Optimizer already: wrap the torch optimizer once")
        self.opt = optimizer
        self.defaults = optimizer.defaults
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.opt.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("peerd.torch.Optimizer averages the parameters it was built with (their layout "
                                  "is declared to the daemon): add the group to the torch optimizer before "
                                  "wrapping it")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        self.opt.load_state_dict(state)

    def __repr__(self) -> str:
        return f"peerd.torch.{type(self).__name__}({self.opt!r}, run={self.run!r})"

    # -- flat vectors <-> tensors ---------------------------------------------------------------------
    def _gather(self, slot: torch.Tensor, tensors: list[torch.Tensor | None]) -> None:
        dst = self._staging if self._cuda else slot
        off = 0
        with torch.no_grad():
            for t, n in zip(tensors, self.numels, strict=True):
                if t is None:
                    dst[off: off + n].zero_()
                else:
                    dst[off: off + n].copy_(t.detach().reshape(-1), non_blocking=self._cuda)
                off += n
            if self._cuda:
                torch.cuda.synchronize()
                slot.copy_(dst)

    def _scatter(self, slot: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        src = slot
        if self._cuda:
            assert self._staging is not None
            self._staging.copy_(slot)
            src = self._staging
        off = 0
        with torch.no_grad():
            for t, n in zip(tensors, self.numels, strict=True):
                t.copy_(src[off: off + n].view_as(t), non_blocking=self._cuda)
                off += n
            if self._cuda:
                torch.cuda.synchronize()  # the staging buffer is reused by the next gather

    def _average(self, kind: str, tensors: list[torch.Tensor | None], weight: float,
                 report: dict[str, Any], round_no: int | None = None,
                 timeout_s: float | None = None) -> tuple[dict[str, Any], torch.Tensor]:
        """One average through the daemon; the reply's ``phases`` hold the trainer's copy in, the daemon's
        phases and ``daemon`` (the socket's round trip beyond what the daemon accounts for)."""
        self.ticket += 1
        t = self.ticket
        slot = self._slots[self.arena.slot_of(t)]
        t0 = time.monotonic()
        self._gather(slot, tensors)
        self.arena.write_request(t, weight)
        if round_no is not None:
            report = {**report, "round": round_no}
        if self._unreported is not None:
            report = {**report, "phases": self._unreported}
            self._unreported = None
        t1 = time.monotonic()
        try:
            reply = self._call("trainer_step", step=t, kind=kind,
                               timeout_s=self.timeout_s if timeout_s is None else timeout_s, **report)
        except DaemonError as e:
            raise DaemonError(f"averaging {kind} (step {self.step_count}) failed: {e}") from None
        reply["phases"] = self._trainer_phases(reply.get("phases"), copy_in=t1 - t0, call_s=time.monotonic() - t1)
        self.kept_rounds += bool(reply.get("kept"))
        return reply, torch.from_numpy(self.arena.result(t))

    @staticmethod
    def _trainer_phases(daemon: Any, *, copy_in: float, call_s: float) -> dict[str, float]:
        """The daemon's phases of one call plus the trainer's: its copy in, and ``daemon`` for the rest of the
        call's round trip (the socket, the daemon's queue)."""
        phases = empty_phases()
        if isinstance(daemon, dict):
            add_phases(phases, {k: float(v) for k, v in daemon.items() if isinstance(v, int | float)})
        phases["copy_in"] += copy_in
        phases["daemon"] += max(0.0, call_s - sum(v for k, v in phases.items() if k not in ("copy_in", "daemon")))
        return phases

    def _finish_step(self, reply: dict[str, Any], t0: float, phases: dict[str, float] | None) -> dict[str, Any]:
        """Record a step's report (``last``, ``last_step``; its phases go to the daemon with the next request)."""
        now = time.monotonic()
        phases = empty_phases() if phases is None else phases
        report = StepReport.of(reply, seconds=now - t0, phases=phases, step=self.step_count)
        reply["phases"] = report.phases
        self.last = reply
        self.last_step = report
        self._unreported = dict(report.phases)
        self._last_end = now
        return reply

    # -- stepping ---------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        return self._overlap is not None

    def last_microbatch(self, samples: int | float) -> None:
        """Overlap: the next backward is this step's last, over ``samples`` samples in all (the averaging weight;
        gradients are summed over them, as DropCompute accumulates them): its gradients go to the daemon bucket
        by bucket as backward produces them. Without overlap: nothing to do."""
        if self._overlap is not None:
            self._default_max_samples(samples)
            self._overlap.arm(samples, 1.0 / float(samples))

    def _default_max_samples(self, samples: int | float) -> None:
        """No ``max_samples`` given: MAX_SAMPLES_FACTOR times the first step's samples, declared in a new session
        (trainer_open takes it) before anything is averaged, so another member's claimed weight is bounded here."""
        if not self._max_samples_due or not samples > 0:
            return
        self._max_samples_due = False
        self.max_samples = MAX_SAMPLES_FACTOR * float(samples)
        self.connect()

    def flush(self) -> None:
        """Overlap: wait for every bucket still out and apply every update still due. Without overlap: nothing."""
        if self._overlap is not None:
            self._overlap.flush()

    def step(self, closure: Any = None, *, samples: int | float = 1, loss: float | None = None) -> dict[str, Any]:
        """Average gradients with the swarm (weight: ``samples``), step, and every K steps average parameters.

        Returns the round's statistics (outcome, group_size, received_fraction, seconds, ...).
        Raises DaemonError if the daemon went away (the next call reconnects), NoGroupError per ``no_group``.
        """
        if closure is not None:
            raise ValueError("peerd.torch.Optimizer does not take a closure: compute the loss before step()")
        if samples <= 0:
            raise ValueError("samples must be positive (it is the averaging weight)")
        self._default_max_samples(samples)
        if self._overlap is not None:
            return self._step_overlap(samples, loss)
        now = t0 = time.monotonic()
        compute_s = now - self._last_end if self._last_end is not None else None  # the caller's time since
        report: dict[str, Any] = {}
        if loss is not None:
            report["loss"] = float(loss)
        if self._last_call is not None and now > self._last_call:  # throughput over the whole step cycle
            report["samples_per_second"] = float(samples) / (now - self._last_call)
        self._last_call = now
        grads = [p.grad for p in self.params]
        if not all_finite_each(grads):
            # as torch.amp.GradScaler does: skip the step (the daemons would refuse the vector anyway)
            self.nonfinite_rounds += 1
            self.outcomes["nonfinite"] = self.outcomes.get("nonfinite", 0) + 1
            log.warning("step %d: this replica's gradients hold NaN or infinity; step skipped", self.step_count)
            reply = {"outcome": "nonfinite", "group_size": 1, "members": [], "received_fraction": 0.0,
                     "seconds": 0.0, "error": "this replica's gradients are not finite (diverged, or a bug)"}
            if self.no_group == "raise":
                raise NoGroupError(f"step {self.step_count}: {reply['error']}")
            return self._finish_step(reply, t0, None)
        reply, result = self._average("grad", grads, float(samples), report)
        phases = reply["phases"]
        if reply["outcome"] == "averaged" and not self._finite(result, "gradient"):
            # never into the model: go on as if no group had formed (own gradients are still in p.grad)
            reply = {**reply, "outcome": "nonfinite"}
        outcome = reply["outcome"]
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome != "averaged":
            if self.no_group == "raise":
                raise NoGroupError(f"no group averaged step {self.step_count} ({outcome}: {reply.get('error')})")
            if self.no_group == "skip":
                return self._finish_step(reply, t0, phases)
            self.local_steps += 1  # "local": own gradients, which the daemon handed back unchanged
        with torch.no_grad():
            if (outcome == "averaged" and int(reply.get("group_size", 1)) > 1
                    and self.same_data.check(result, grads, self.numels, reply, self.step_count)):
                reply["warning"] = self.same_data.warned
            t2 = time.monotonic()
            for p in self.params:
                if p.grad is None:  # a parameter this replica did not use still gets the swarm's gradient
                    p.grad = torch.zeros_like(p)
            if outcome != "nonfinite":  # else the slot holds the refused result; p.grad is still our own
                self._scatter(result, [p.grad for p in self.params])
            elif not all_finite_each(p.grad for p in self.params):
                return self._finish_step(reply, t0, phases)  # our own gradients are no better: skip the step
            if self.clip_grad_norm is not None:  # the average's norm, as DDP's clip after backward sees it
                torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        phases["copy_out"] += time.monotonic() - t2
        self.opt.step()
        self._follow_swarm(reply)
        self.step_count += 1
        self._auto_step(reply, compute_s)
        due = self._params_due(reply)
        left = self.timeout_s - (time.monotonic() - t0)  # the step's deadline covers both of its averages
        if due is not None and left >= MIN_ROUND_S:
            reply["params"] = self.average_parameters(round_no=due, timeout_s=left)
            add_phases(phases, reply["params"].get("phases", {}))
        elif due is not None:
            reply["params_skipped"] = f"the step's {self.timeout_s:g} s deadline is spent"
        if self.state_every and self.step_count % self.state_every == 0:
            self.publish_state(wait=False)
        return self._finish_step(reply, t0, phases)

    def _step_overlap(self, samples: int | float, loss: float | None) -> dict[str, Any]:
        overlap = self._overlap
        assert overlap is not None
        t0 = time.monotonic()
        # the caller's compute since the last step, without the waits for averaged buckets in its forward
        compute_s = None if self._last_end is None else t0 - self._last_end - (overlap.waited_s - self._waited_mark)
        self._bucket_time(t0)
        reply = overlap.step(samples, loss)  # (the statistics of the last step whose buckets all came back)
        self._follow_swarm(reply, lag=2)  # (the reply is of the step before this one, and the count moved on)
        phases = empty_phases()
        add_phases(phases, reply.get("phases") or {})
        self._auto_step(reply, compute_s)  # at AUTO_STEP: the codec, the period (a codec switch flushes first)
        self._bucket_step(reply)  # bucket_mb="auto": the trial's plan for the next step
        k = self.average_params_every
        if k and self.step_count % k == 0:  # numbered by step count: replicas in step name the same round
            base = PERIOD_LADDER[0] if self._auto_every else k  # (members on other rungs meet at the longer one's)
            reply["params"] = self.average_parameters(round_no=self.step_count // base)
            add_phases(phases, reply["params"].get("phases", {}))
        if self.state_every and self.step_count % self.state_every == 0:
            self.publish_state(wait=False)
        out = self._finish_step(reply, t0, phases)
        self._waited_mark = overlap.waited_s
        return out

    def _follow_swarm(self, reply: dict[str, Any], lag: int = 0) -> None:
        """Note the round of this step; a joiner's first averaged round also tells it how many rounds the swarm
        took while it downloaded its snapshot: it counts its steps as its donor does from then on, so it ends
        training with the swarm (its last rounds and final averages are the others', not alone; with overlap, its
        parameter averages, numbered by step count, the others' too). ``lag``: steps this replica counted since the
        step ``reply`` is of (overlap's replies come a step late, after the count moved on)."""
        r = reply.get("round")
        has_round = reply.get("outcome") in ("averaged", "alone") and type(r) is int and r >= 0
        self._round = r if has_round else None
        if self._joined is None or not has_round or reply["outcome"] != "averaged" or reply.get("group_size", 1) < 2:
            return
        step, at = self._joined
        self._joined = None
        target = step + r - at - 1 + lag  # the donor's step count before this round's step, plus what came since
        if self.step_count < target <= self.step_count + MAX_CATCH_UP:
            self.caught_up = target - self.step_count
            log.info("joined: counted %d steps forward to the swarm's step %d", self.caught_up, target + 1 - lag)
            self.step_count = target

    def _params_due(self, reply: dict[str, Any]) -> int | None:
        """The Moshpit round to average parameters in after this step, or None (not due).

        Due after every K-th gradient round of the swarm, numbered by it: gradient rounds are numbered
        alike by every replica that averaged in them, so all replicas average parameters in the same round
        even when their step counts differ (a joiner that took a snapshot a few steps old). Without a round
        number (the gradient round failed), by this replica's step count. With the auto period, rounds are
        numbered by the ladder's first rung, so members on different rungs meet at the longer one's multiples."""
        k = self.average_params_every
        if not k:
            return None
        base = PERIOD_LADDER[0] if self._auto_every else k  # rounds numbered alike whichever rung a member took
        r = reply.get("round")
        n = r + 1 if reply.get("outcome") in ("averaged", "alone") and type(r) is int and r >= 0 else self.step_count
        return n // base if n % k == 0 else None

    def average_parameters(self, round_no: int | None = None, *, timeout_s: float | None = None,
                           wait_s: float | None = None) -> dict[str, Any]:
        """Average the parameters themselves with a group (equal weights); returns the round's statistics.

        ``round_no``: the Moshpit round to average in (every replica must name the same one); None: the
        run's next round (e.g. the extra averages after the last step, which every replica makes).
        ``timeout_s``: the round's deadline (None: the optimizer's ``timeout_s``). ``wait_s``: how long the
        round waits for its members at least (None: as long as a step's round, tuned to the swarm's pace);
        at most half the deadline."""
        self.flush()
        report = {} if wait_s is None else {"wait_s": wait_s}
        reply, result = self._average("params", list(self.params), 1.0, report, round_no, timeout_s)
        self.params_averages += 1
        self.params_identical += bool(reply.get("identical"))
        self.params_close += bool(reply.get("close"))
        if reply["outcome"] == "averaged" and not (reply.get("identical") or reply.get("close")):  # (else: ours)
            t0 = time.monotonic()
            if self._finite(result, "parameter"):
                self._scatter(result, [p.data for p in self.params])
            else:
                reply = {**reply, "outcome": "nonfinite"}
            reply["phases"]["copy_out"] += time.monotonic() - t0
        return reply

    def finish(self, rounds: int = 1, *, wait_s: float = FINISH_WAIT_S) -> dict[str, Any]:
        """The end of training: apply every update still due, then average the parameters with the swarm
        ``rounds`` times (on a grid of d dimensions, d rounds reach every member: the swarm's exact mean),
        so every replica leaves with the swarm's model. Returns the last average's statistics. Every trainer
        of the run calls it after its last step; the wrapper stays usable (e.g. to save the model).

        Each of these averages waits up to ``wait_s`` (at most half the optimizer's ``timeout_s``) for the
        swarm's other trainers, not a step's tuned window: trainers end training seconds apart (a last
        evaluation, a slower machine), and one that came after the others' window would keep its own model."""
        if type(rounds) is not int or not 1 <= rounds <= 16:
            raise ValueError(f"rounds must be an integer in [1, 16], got {rounds!r}")
        if not (isinstance(wait_s, int | float) and wait_s >= 0.2):
            raise ValueError(f"wait_s must be a number of seconds >= 0.2, got {wait_s!r}")
        self.flush()
        reply: dict[str, Any] = {}
        for _ in range(rounds):
            reply = self.average_parameters(wait_s=min(float(wait_s), self.timeout_s / 2))
        return reply

    def _finite(self, result: torch.Tensor, what: str) -> bool:
        """False (logged, counted) if the daemon's result holds NaN or infinity: a member sent garbage and
        the daemons let it through; it must not reach the model."""
        if all_finite(result):
            return True
        self.nonfinite_rounds += 1
        log.warning("the averaged %s of step %d holds non-finite numbers: not applied (%d so far)", what,
                    self.step_count, self.nonfinite_rounds)
        return False

    # -- state sync -------------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """Parameters, optimizer state and step number, serialized (tensors only: loadable weights_only)."""
        buf = io.BytesIO()
        self.save_snapshot(buf)
        return buf.getvalue()

    def save_snapshot(self, f: BinaryIO) -> None:
        """``snapshot()``, written into ``f`` (publish_state: straight into the memfd the daemon reads)."""
        self.flush()
        flat = torch.empty(self.elems, dtype=torch.float32)
        self._gather_cpu(flat)
        rnd = self._round
        if self._overlap is not None:  # the flush settled the last step: its round, not the one before
            last = self._overlap.last
            r = last.get("round")
            rnd = r if last.get("outcome") in ("averaged", "alone") and type(r) is int and r >= 0 else None
        torch.save({"format": STATE_FORMAT, "layout": self.layout_hash, "step": self.step_count,
                    "round": -1 if rnd is None else rnd,
                    "optimizer_class": type(self.opt).__name__, "params": flat,
                    "optimizer": self.opt.state_dict(),
                    **({"auto_codec": self.auto.compression, "auto_every": self.auto.average_every}
                       if self.auto is not None else {}),
                    **({"auto_buckets": self._bucket_trial.agreed}
                       if self._bucket_trial is not None and self._bucket_trial.agreed is not None else {})}, f)

    def _gather_cpu(self, flat: torch.Tensor) -> None:
        off = 0
        for p, n in zip(self.params, self.numels, strict=True):
            flat[off: off + n].copy_(p.detach().reshape(-1))
            off += n

    def load_snapshot(self, blob: bytes, *, expected_step: int | None = None) -> int:
        """Take over a snapshot (from a donor): parameters, optimizer state, step number. Returns the step.

        Raises SnapshotError (a ValueError), having applied nothing, for a snapshot of another model, with NaN or
        infinity in any tensor, or with an implausible step (or not ``expected_step``, the step its donors
        advertised)."""
        # weights_only: a snapshot comes from another machine, and a full unpickle would run its code.
        try:
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:
            raise SnapshotError(f"not a loadable snapshot ({type(e).__name__})") from None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise SnapshotError("not a peerd state snapshot")
        if state.get("layout") != self.layout_hash:
            raise SnapshotError("the snapshot is of a different model")
        if state.get("optimizer_class") != type(self.opt).__name__:
            raise SnapshotError(f"the snapshot's optimizer is {state.get('optimizer_class')}, "
                                f"this trainer's is {type(self.opt).__name__}")
        flat = state.get("params")
        if not isinstance(flat, torch.Tensor) or flat.numel() != self.elems or not flat.is_floating_point():
            raise SnapshotError("the snapshot's parameters do not match this model")
        check_finite(flat, "parameters")
        check_finite(state.get("optimizer"), "optimizer state")
        step = checked_step(state.get("step"), expected_step)
        off = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.numels, strict=True):
                p.copy_(flat[off: off + n].view_as(p))
                off += n
        self.opt.load_state_dict(state["optimizer"])
        self.step_count = step
        at = state.get("round")  # the donor's round of that step: how far the swarm went since (_follow_swarm)
        self._joined = (step, at) if type(at) is int and 0 <= at < 2**32 else None
        if self._auto_probe is not None and state.get("auto_codec") in ("fp32", "int8"):
            every = state.get("auto_every")  # the swarm chose before this trainer came: average as it does
            self._auto_choose(state["auto_codec"], every if every in PERIOD_LADDER else None)
        buckets = state.get("auto_buckets")  # the swarm agreed on its buckets before this trainer came
        if self._bucket_trial is not None and type(buckets) is int and self._bucket_trial.take(buckets):
            self._overlap.replan(buckets)
        return self.step_count

    def publish_state(self, *, wait: bool = True) -> dict[str, Any]:
        """Hand this trainer's snapshot to the daemon for joiners. ``wait`` False (the periodic publishes): the
        daemon advertises it in the background, so the step does not wait for a DHT store (``advertised`` None)."""
        fd, size = write_blob_from(self.save_snapshot, name="peerd-state")
        try:
            return self._call("state_publish", fds=[fd], step=self.step_count, size=size, wait=wait)
        finally:
            os.close(fd)

    def sync_state(self) -> bool:
        """Download the swarm's state before the first step; True if this trainer took over another's.

        Nobody has any (a new run): this trainer is a founder, and founders agree on one initial state
        (peerd.torch.founders): it publishes its own, waits ``founder_window_s`` for the others', and takes the
        one with the lowest hash (False if that is its own, or there is no swarm to ask)."""
        if self._fetch_state():
            return True
        if not self.founder_window_s:
            return False
        return self._agree_founders()

    def _agree_founders(self) -> bool:
        published = self.publish_state()
        if not published.get("advertised"):
            self.founder = {"agreed": False, "reason": "the daemon has no swarm to advertise the state in"}
            return False
        own = bytes.fromhex(published["sha"])
        time.sleep(self.founder_window_s)
        took = self._fetch_state(below=own)
        self.founder = {"agreed": True, "own_sha": own.hex(), "took_other": took,
                        "sha": self.synced_from["sha"] if took and self.synced_from else own.hex()}
        log.info("founders: %s", "took another founder's initial state" if took else "kept this initial state")
        return took

    def _fetch_state(self, below: bytes | None = None) -> bool:
        """Fetch and load the swarm's best snapshot (``below``: a founder's own snapshot's hash: only one of a
        later step or, at step 0, a lower hash); False if there is none. A snapshot that ``load_snapshot``
        refuses is skipped for the next candidate, up to SNAPSHOT_TRIES of them; then SnapshotError."""
        refused: list[str] = []
        while True:
            fd = write_blob(b"", name="peerd-state-in")
            try:
                args: dict[str, Any] = {"exclude": refused} if refused else {}
                if below is not None:
                    args["below"] = below
                try:
                    reply = self._call("state_fetch", fds=[fd], timeout_s=self.state_timeout_s,
                                       reply_timeout=self.state_timeout_s + 30, **args)
                except DaemonError as e:
                    if refused:
                        raise SnapshotError(f"state sync: no snapshot this trainer can load ({len(refused)} refused; "
                                            f"then: {e})") from None
                    raise
                if not reply.get("found"):
                    if refused:
                        raise SnapshotError(f"state sync: no snapshot this trainer can load ({len(refused)} refused)")
                    return False
                blob = read_blob(fd, reply["size"])
            finally:
                os.close(fd)
            try:
                self.load_snapshot(blob, expected_step=reply["step"])
                break
            except SnapshotError as e:
                log.warning("state sync: refused the snapshot %s of step %d from %d donor(s): %s", reply["sha"][:12],
                            reply["step"], reply["donors"], e)
                refused.append(reply["sha"])
                if len(refused) >= SNAPSHOT_TRIES:
                    raise SnapshotError(f"state sync: refused {len(refused)} snapshots, the last: {e}") from None
        self.synced_from = {k: reply[k] for k in ("step", "size", "sha", "donors", "chunks", "retries")}
        log.info("state sync: took over step %d from %d donor(s)", reply["step"], reply["donors"])
        return True
