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
from typing import Any

import torch

from ..allreduce.robust import parse_robust
from ..compress import COMPRESSIONS as CODECS
from ..localsock.arena import Arena, read_blob, write_blob
from ..localsock.client import DaemonError, LocalClient
from .overlap import DEFAULT_BUCKET_MB, Overlap

log = logging.getLogger("peerd.torch")

NO_GROUP = ("local", "skip", "raise")
# Kept groups save a matchmaking a round (`peerd demo --keep-rounds 10`: faster steps, the same accuracy) but are
# opt-in: a late joiner can fail to get into the founders' kept group, so 1 until that is fixed.
DEFAULT_KEEP_ROUNDS = 1
STATE_FORMAT = "peerd-state-v1"


class NoGroupError(RuntimeError):
    """No group formed for a step and the optimizer was told to raise (``no_group="raise"``)."""


class Optimizer:
    """A collaborative wrapper around ``optimizer`` (any ``torch.optim.Optimizer``).

    Options: ``run`` (the run id: trainers with the same run id and model average together),
    ``socket`` (the daemon's local socket; default $PEERD_SOCKET, ...), ``timeout_s`` (a round's
    deadline), ``average_params_every`` (K; 0 turns parameter averaging off), ``no_group`` (what to do
    when no group forms or a round fails: "local" takes a local step and counts it, "skip" skips the
    step, "raise" raises NoGroupError), ``sync_state`` (download the swarm's state before the first step),
    ``state_every`` (publish a snapshot for joiners every this many steps; 0: never), ``nslots``,
    ``keep_rounds`` (keep a Moshpit group that formed complete for this many rounds, renewed without the
    DHT, so matchmaking does not dominate a step; 1: a new group every round; None: the daemon's default;
    default DEFAULT_KEEP_ROUNDS), ``robust`` (how shard owners limit each member's contribution: "off",
    "clip[:C]" or "centered[:C]"; None: the daemon's default), ``max_samples`` (the largest sample count a
    member may claim as its averaging weight in this run; None: the daemon's default), ``compression`` (the
    codec of every average of the run: "fp32", "fp16", "bf16", "int8" or "int4"; every trainer of the run must
    pass the same; None: the run's, fp32 unless set), ``quant_group`` and ``rounding`` (int8/int4: values per
    scale and min, default 128; "stochastic", the default, or "nearest"). ``compression="arc-topk"`` averages the
    top ``topk_ratio`` (default 0.1) of each matrix's rows per shard with EF21M error feedback in the daemon
    (peerd.allreduce.arctopk): the gradients the step applies are EF21M's update direction; parameter averages
    stay fp32; not with ``overlap``.

    ``overlap=True`` (with ``model``; CPU or CUDA parameters): DeAR-style overlap (peerd.torch.overlap). Gradients go to
    the daemon in buckets of about ``bucket_mb`` MB as backward produces them, and each layer's update is applied just
    before its next forward, so averaging overlaps computation. Call ``last_microbatch(samples)`` before the forward of
    the step's last micro-batch (without it, ``step()`` sends every bucket after backward); ``step()`` then returns the
    statistics of the last step whose updates are all applied, and ``flush()`` applies what is still due
    (``average_parameters``, ``snapshot`` and ``state_dict`` call it). The update of a step is applied at the next
    forward, so a learning-rate scheduler stepped after ``step()`` is one step early.

    A round whose result holds a non-finite number is never applied: the step goes on with this replica's
    own gradients (counted in ``nonfinite_rounds``), a parameter average is dropped. A step whose own
    gradients are not finite is skipped without averaging (outcome "nonfinite", step_count unchanged).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, run: str, socket: str | None = None,
                 timeout_s: float = 30.0, average_params_every: int = 10, no_group: str = "local",
                 sync_state: bool = True, state_every: int = 10, state_timeout_s: float = 60.0,
                 nslots: int = 4, keep_rounds: int | None = DEFAULT_KEEP_ROUNDS, robust: str | None = None,
                 max_samples: float | None = None, overlap: bool = False, model: torch.nn.Module | None = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, compression: str | None = None,
                 quant_group: int | None = None, rounding: str | None = None, topk_ratio: float | None = None) -> None:
        if no_group not in NO_GROUP:
            raise ValueError(f"no_group must be one of {NO_GROUP}")
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
        self.outcomes: dict[str, int] = {}
        self.local_steps = 0  # steps taken on own gradients because no group formed
        self.kept_rounds = 0  # rounds (gradients or parameters) averaged in a kept group, without matchmaking
        self.nonfinite_rounds = 0  # averaged results refused because they held NaN or infinity
        self.last: dict[str, Any] = {}
        self.synced_from: dict[str, Any] | None = None
        self._last_end: float | None = None
        self._last_call: float | None = None
        self._client: LocalClient | None = None
        self.session = 0
        self.layout_hash = ""
        self._overlap: Overlap | None = None
        if overlap:
            if model is None:
                raise ValueError("overlap=True needs model= (its forward pre-hooks apply each layer's update)")
            if not (isinstance(bucket_mb, int | float) and 0 < bucket_mb <= 1024):
                raise ValueError(f"bucket_mb must be in (0, 1024], got {bucket_mb!r}")
            self._overlap = Overlap(self, model, max(1, int(bucket_mb * 2**20 / 4)))
        self.connect()
        if sync_state:
            self.sync_state()

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
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    @property
    def state(self) -> Any:
        return self.opt.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)

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
                 report: dict[str, Any], round_no: int | None = None) -> tuple[dict[str, Any], torch.Tensor]:
        self.ticket += 1
        t = self.ticket
        slot = self._slots[self.arena.slot_of(t)]
        self._gather(slot, tensors)
        self.arena.write_request(t, weight)
        if round_no is not None:
            report = {**report, "round": round_no}
        try:
            reply = self._call("trainer_step", step=t, kind=kind, timeout_s=self.timeout_s, **report)
        except DaemonError as e:
            raise DaemonError(f"averaging {kind} (step {self.step_count}) failed: {e}") from None
        self.kept_rounds += bool(reply.get("kept"))
        return reply, torch.from_numpy(self.arena.result(t))

    # -- stepping ---------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        return self._overlap is not None

    def last_microbatch(self, samples: int | float) -> None:
        """Overlap: the next backward is this step's last, over ``samples`` samples in all (the averaging weight;
        gradients are summed over them, as DropCompute accumulates them): its gradients go to the daemon bucket
        by bucket as backward produces them. Without overlap: nothing to do."""
        if self._overlap is not None:
            self._overlap.arm(samples, 1.0 / float(samples))

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
        if self._overlap is not None:
            return self._step_overlap(samples, loss)
        now = time.monotonic()
        report: dict[str, Any] = {}
        if loss is not None:
            report["loss"] = float(loss)
        if self._last_call is not None and now > self._last_call:  # throughput over the whole step cycle
            report["samples_per_second"] = float(samples) / (now - self._last_call)
        self._last_call = now
        grads = [p.grad for p in self.params]
        if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
            # as torch.amp.GradScaler does: skip the step (the daemons would refuse the vector anyway)
            self.nonfinite_rounds += 1
            self.outcomes["nonfinite"] = self.outcomes.get("nonfinite", 0) + 1
            log.warning("step %d: this replica's gradients hold NaN or infinity; step skipped", self.step_count)
            reply = {"outcome": "nonfinite", "group_size": 1, "members": [], "received_fraction": 0.0,
                     "seconds": 0.0, "error": "this replica's gradients are not finite (diverged, or a bug)"}
            if self.no_group == "raise":
                raise NoGroupError(f"step {self.step_count}: {reply['error']}")
            self.last = reply
            self._last_end = time.monotonic()
            return reply
        reply, result = self._average("grad", grads, float(samples), report)
        if reply["outcome"] == "averaged" and not self._finite(result, "gradient"):
            # never into the model: go on as if no group had formed (own gradients are still in p.grad)
            reply = {**reply, "outcome": "nonfinite"}
        outcome = reply["outcome"]
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome != "averaged":
            if self.no_group == "raise":
                raise NoGroupError(f"no group averaged step {self.step_count} ({outcome}: {reply.get('error')})")
            if self.no_group == "skip":
                self.last = reply
                self._last_end = time.monotonic()
                return reply
            self.local_steps += 1  # "local": own gradients, which the daemon handed back unchanged
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:  # a parameter this replica did not use still gets the swarm's gradient
                    p.grad = torch.zeros_like(p)
            if outcome != "nonfinite":  # else the slot holds the refused result; p.grad is still our own
                self._scatter(result, [p.grad for p in self.params])
            elif not all(bool(torch.isfinite(p.grad).all()) for p in self.params):
                self.last = reply  # our own gradients are no better: skip the step
                self._last_end = time.monotonic()
                return reply
        self.opt.step()
        self.step_count += 1
        due = self._params_due(reply)
        if due is not None:
            reply["params"] = self.average_parameters(round_no=due)
        if self.state_every and self.step_count % self.state_every == 0:
            self.publish_state()
        self.last = reply
        self._last_end = time.monotonic()
        return reply

    def _step_overlap(self, samples: int | float, loss: float | None) -> dict[str, Any]:
        reply = self._overlap.step(samples, loss)  # type: ignore[union-attr]
        k = self.average_params_every
        if k and self.step_count % k == 0:  # numbered by step count: replicas in step name the same round
            reply["params"] = self.average_parameters(round_no=self.step_count // k)
        if self.state_every and self.step_count % self.state_every == 0:
            self.publish_state()
        self._last_end = time.monotonic()
        return reply

    def _params_due(self, reply: dict[str, Any]) -> int | None:
        """The Moshpit round to average parameters in after this step, or None (not due).

        Due after every K-th gradient round of the swarm, numbered by it: gradient rounds are numbered
        alike by every replica that averaged in them, so all replicas average parameters in the same round
        even when their step counts differ (a joiner that took a snapshot a few steps old). Without a round
        number (the gradient round failed), by this replica's step count."""
        k = self.average_params_every
        if not k:
            return None
        r = reply.get("round")
        if reply.get("outcome") in ("averaged", "alone") and type(r) is int and r >= 0:
            return (r + 1) // k if (r + 1) % k == 0 else None
        return self.step_count // k if self.step_count % k == 0 else None

    def average_parameters(self, round_no: int | None = None) -> dict[str, Any]:
        """Average the parameters themselves with a group (equal weights); returns the round's statistics.

        ``round_no``: the Moshpit round to average in (every replica must name the same one); None: the
        run's next round (e.g. the extra averages after the last step, which every replica makes)."""
        self.flush()
        reply, result = self._average("params", list(self.params), 1.0, {}, round_no)
        if reply["outcome"] == "averaged":
            if self._finite(result, "parameter"):
                self._scatter(result, [p.data for p in self.params])
            else:
                reply = {**reply, "outcome": "nonfinite"}
        return reply

    def _finite(self, result: torch.Tensor, what: str) -> bool:
        """False (logged, counted) if the daemon's result holds NaN or infinity: a member sent garbage and
        the daemons let it through; it must not reach the model."""
        if bool(torch.isfinite(result).all()):
            return True
        self.nonfinite_rounds += 1
        log.warning("the averaged %s of step %d holds non-finite numbers: not applied (%d so far)", what,
                    self.step_count, self.nonfinite_rounds)
        return False

    # -- state sync -------------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """Parameters, optimizer state and step number, serialized (tensors only: loadable weights_only)."""
        self.flush()
        flat = torch.empty(self.elems, dtype=torch.float32)
        self._gather_cpu(flat)
        buf = io.BytesIO()
        torch.save({"format": STATE_FORMAT, "layout": self.layout_hash, "step": self.step_count,
                    "optimizer_class": type(self.opt).__name__, "params": flat,
                    "optimizer": self.opt.state_dict()}, buf)
        return buf.getvalue()

    def _gather_cpu(self, flat: torch.Tensor) -> None:
        off = 0
        for p, n in zip(self.params, self.numels, strict=True):
            flat[off: off + n].copy_(p.detach().reshape(-1))
            off += n

    def load_snapshot(self, blob: bytes) -> int:
        """Take over a snapshot (from a donor): parameters, optimizer state, step number. Returns the step."""
        # weights_only: a snapshot comes from another machine, and a full unpickle would run its code.
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not a peerd state snapshot")
        if state.get("layout") != self.layout_hash:
            raise ValueError("the snapshot is of a different model")
        if state.get("optimizer_class") != type(self.opt).__name__:
            raise ValueError(f"the snapshot's optimizer is {state.get('optimizer_class')}, "
                             f"this trainer's is {type(self.opt).__name__}")
        flat = state["params"]
        if flat.numel() != self.elems:
            raise ValueError("the snapshot's parameters do not match this model")
        off = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.numels, strict=True):
                p.copy_(flat[off: off + n].view_as(p))
                off += n
        self.opt.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        return self.step_count

    def publish_state(self) -> dict[str, Any]:
        blob = self.snapshot()
        fd = write_blob(blob, name="peerd-state")
        try:
            return self._call("state_publish", fds=[fd], step=self.step_count, size=len(blob))
        finally:
            os.close(fd)

    def sync_state(self) -> bool:
        """Download the swarm's state before the first step; False if nobody has any (a new run)."""
        fd = write_blob(b"", name="peerd-state-in")
        try:
            reply = self._call("state_fetch", fds=[fd], timeout_s=self.state_timeout_s,
                               reply_timeout=self.state_timeout_s + 30)
            if not reply.get("found"):
                return False
            blob = read_blob(fd, reply["size"])
        finally:
            os.close(fd)
        self.load_snapshot(blob)
        self.synced_from = {k: reply[k] for k in ("step", "size", "sha", "donors", "chunks", "retries")}
        log.info("state sync: took over step %d from %d donor(s)", reply["step"], reply["donors"])
        return True
