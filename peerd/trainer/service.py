"""Daemon side of the trainer API: sessions over the local socket, steps through a shared-memory arena.

A trainer opens a session by declaring its flat parameter layout and passing its arena (a memfd) with
the request. The daemon hashes the layout itself; the run key it averages under is ``<run>/<hash>``,
so models that differ never average together, and a trainer whose model differs from the one its run
is already training on this daemon is refused with an error that says so. The swarm's adverts are claims
of members (anyone with the swarm key): one of another layout is ignored and counted, never a reason to
refuse a trainer (the reply warns when the swarm advertises only other layouts).

Each step the trainer writes its vector and sample count into the step's slot and sends ``trainer_step``;
the daemon copies the vector out, averages it (Moshpit in the daemon; any async callable with the same
signature in tests), and writes the result back into the slot only if that step is still the session's
newest (see peerd.localsock.arena) and finite: a result holding NaN or infinity is never written (the
trainer's own vector is, and the step is reported failed). A session belongs to its connection: when the
trainer disconnects, even mid-step, the session's mapping is released and its result dropped; the daemon
carries on.

``trainer_outer`` is DiLoCo's outer average (peerd.torch.DiLoCo): a Moshpit round numbered by the trainers'
step, then an agreement (outer.py) after which every member holds the same bytes, or an error that says why
(outer_step.py). The options a trainer declares are checked in options.py; a session's state is session.py's.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import trio

from ..allreduce.robust import DEFAULT_C, MAX_C, Robust, parse_robust
from ..deadlines import DeadlineTuner
from ..localsock.arena import Arena, ArenaError, fill_blob, read_blob
from ..localsock.phases import parse_phases
from ..localsock.server import Connection, OpError
from ..metrics import Metrics
from ..moshpit.service import Part, RoundResult, all_finite
from .adverts import LaterAdverts, PendingAdvert
from .inbox import OuterInbox
from .options import (
    MAX_AUTO_REASON,
    MAX_BLOB,
    MAX_RUN_ID,
    layout_hash,
    parse_compression,
    parse_layout,
    parse_max_samples,
    small_value,
    snapshot_bound,
)
from .outer_step import OuterSteps
from .paramcheck import CHECK_SHARE, GROUP, check_vector, close, identical, rounding_noise
from .session import Average, Session, StepRound, codec_keywords, round_phases, round_reply, take_slot

log = logging.getLogger("peerd.trainer")

KINDS = ("grad", "params")
PARAMS_WEIGHT = 1.0  # the weight of a parameter average (equal replicas): also the most any member counts for there
MAX_DEFERRED_STEPS = 2  # steps whose deferred buckets a session may hold at once (the one averaging, the next)
MAX_BUCKETS = 1000  # gradient buckets of one step (overlap); '<run>.<hash8>.b999' fits Moshpit's 64-byte run ids
ADVERT_CHECK_S = 5.0  # how long trainer_open reads the swarm's adverts for its warning


@dataclass(frozen=True)
class SessionStatistics:
    """One open session as ``peerd status`` shows it: its run, codec, steps, the compression="auto" choice with
    its reason (empty: none), and its latest step's outcome, seconds and phases."""

    session: int
    run: str
    layout: str
    steps: int
    compression: str
    outcome: str
    seconds: float
    kept: bool
    phases: dict[str, float]
    auto: dict[str, Any]


@dataclass(frozen=True)
class TrainerStatistics:
    sessions: tuple[SessionStatistics, ...]


class TrainerService:
    """The trainer_* and state_* ops. ``average`` is Moshpit's ``average(run_id, vector, weight, *, timeout_s)``
    (called with ``keep_rounds`` too when a session asked for kept groups, ``round_no`` when the trainer
    numbers the round, ``max_weight`` and ``robust`` when the session set ``max_samples`` and ``robust``,
    ``compression`` (and ``quant_group``, ``rounding``) when it named a codec)."""

    def __init__(self, metrics: Metrics, average: Average, *, statesync: Any = None, peer_id: str = "",
                 ready: bool | None = None, average_parts: Callable[..., Awaitable[list[Any]]] | None = None
                 ) -> None:
        """``ready``: ``average`` takes ``ready=`` (an async callable it awaits once the group is known, before
        it reads the vector), so a deferred bucket's matchmaking overlaps backward; None: ask the averager
        (its ``accepts_ready`` attribute). Without it a deferred bucket waits for its gradients, then averages.
        ``average_parts``: Moshpit's ``average_parts`` (several vectors, one matchmaking): a step's deferred
        buckets that name their plan share one round; None: each bucket is its own round."""
        self.metrics = metrics
        self.average = average
        self.average_parts = average_parts
        self.ready = bool(getattr(average, "accepts_ready", False)) if ready is None else ready  # (a marker)
        self.statesync = statesync
        self.peer_id = peer_id
        self.deadlines: DeadlineTuner | None = None  # a step's wait tunes itself within the trainer's timeout_s
        self._replied: dict[int, float] = {}  # session -> when its last step's reply went (its compute since)
        self.sessions: dict[int, Session] = {}
        self._next = 1
        # outer records the group's members push to this daemon (OUTER_RECORD), for run keys it trains
        self.inbox = OuterInbox(lambda run_key: any(s.run_key == run_key for s in self.sessions.values()))
        endpoint = getattr(statesync, "endpoint", None)  # (an in-memory state sync in tests has none)
        if endpoint is not None:
            self.inbox.register(endpoint)
        self.outer = OuterSteps(metrics, average, statesync, self.inbox, peer_id, self._report)
        put = getattr(statesync, "advertise_state", None)
        self.adverts = LaterAdverts(put) if put is not None else None
        self._background: trio.Nursery | None = None  # where periodic snapshots are kept after their answer (run)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The service's background work (outer steps' last record puts, state advertisements a trainer did not
        wait for); a daemon starts it in its nursery."""
        async with trio.open_nursery() as nursery:
            if self.adverts is not None:
                nursery.start_soon(self.adverts.run)
            await nursery.start(self.outer.run)
            self._background = nursery
            task_status.started()

    def ops(self) -> dict[str, Callable[[dict[str, Any], Connection], Awaitable[dict[str, Any]]]]:
        return {
            "trainer_open": self._op_open,
            "trainer_step": self._op_step,
            "trainer_bucket": self._op_bucket,
            "trainer_bucket_ready": self._op_bucket_ready,
            "trainer_outer": self._op_outer,
            "trainer_report": self._op_report,
            "trainer_close": self._op_close,
            "state_publish": self._op_state_publish,
            "state_fetch": self._op_state_fetch,
        }

    def register(self, server: Any) -> None:
        for op, handler in self.ops().items():
            server.register(op, handler, connection=True)

    # -- sessions -------------------------------------------------------------------------------
    async def _op_open(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        run = req.get("run")
        if not isinstance(run, str) or not 1 <= len(run.encode()) <= MAX_RUN_ID or "/" in run:
            raise OpError(f"run must be a string of 1..{MAX_RUN_ID} bytes without '/'")
        layout, elems = parse_layout(req.get("layout"))
        nslots = req.get("nslots")
        keep_rounds = req.get("keep_rounds")
        if keep_rounds is not None and (type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000):
            raise OpError(f"keep_rounds must be an integer in [1, 1000] (1: a new group every round), "
                          f"got {keep_rounds!r}")
        max_samples = parse_max_samples(req.get("max_samples"))
        try:
            robust = parse_robust(req.get("robust"))
        except ValueError as e:
            raise OpError(f"{e} (robust is optional: off, clip, clip:C, centered or centered:C with 0 < C <= 1e6)") \
                from None
        compression = parse_compression(req)
        if robust is not None and robust.mode == "centered" and compression.get("compression") == "arc-topk":
            raise OpError(f"robust {robust} does not go with arc-topk: its sketches and rows are clipped around zero "
                          f"(robust clip:{robust.c:g}); the selection phase is each owner's alone")
        digest = layout_hash(layout)
        run_key = f"{run}/{digest[:16]}"
        self._check_model(run, digest)
        self._check_codec(run, compression)
        warning = await self._swarm_warning(run, digest)
        fd = conn.take_fd()
        try:
            arena = Arena.attach(fd, nslots, elems)
        except (ArenaError, OSError, ValueError) as e:
            os.close(fd)
            raise OpError(f"cannot map the trainer's arena: {e}") from None
        sid = self._next
        self._next += 1
        session = Session(sid, run, run_key, digest, elems, arena, conn, keep_rounds=keep_rounds,
                          max_samples=max_samples, robust=robust, robust_off=req.get("robust") == "off",
                          snapshot_max=snapshot_bound(layout),
                          compression=compression, shapes=[list(shape) for _, shape, _ in layout])
        session.outer_at = self.outer.clock()  # a first outer step gathers the run's members as the later ones do
        self.sessions[sid] = session
        conn.on_close(lambda: self._close(session))
        self.metrics.trainer_sessions.set(len(self.sessions))
        if self.statesync is not None:
            await self.statesync.advertise_state(run, run_key, digest)
        log.info("trainer session %d: run %s, %d tensors, %d elements, layout %s, %s", sid, run, len(layout), elems,
                 digest[:16], compression.get("compression", "the run's codec"))
        reply = {"session": sid, "run_key": run_key, "layout_hash": digest, "elems": elems, "peer_id": self.peer_id,
                 **compression}
        if warning:
            reply["warning"] = warning
        return reply

    def _check_model(self, run: str, digest: str) -> None:
        """Refuse a model that differs from the one ``run`` is training on this daemon (a local fact; what
        the swarm advertises is a claim of members and only ever warns, see _swarm_warning)."""
        for s in self.sessions.values():
            if s.run == run and s.layout != digest:
                raise OpError(
                    f"run {run!r} is training a different model on this daemon (layout {s.layout[:16]}, "
                    f"this trainer's is {digest[:16]}): models that differ never average together; "
                    f"use the same model or another --run"
                )

    def _check_codec(self, run: str, compression: dict[str, Any]) -> None:
        """Refuse a codec that differs from the one ``run``'s other sessions on this daemon declared: the daemon
        averages a run in one codec (its members' bodies in another are drops)."""
        for s in self.sessions.values():
            if s.run == run and s.compression != compression:
                raise OpError(
                    f"run {run!r} averages with {s.compression or 'the default codec (fp32)'} on this daemon, this "
                    f"trainer asks for {compression or 'the default codec (fp32)'}: every member of a run must "
                    f"declare the same compression"
                )

    async def _swarm_warning(self, run: str, digest: str) -> str:
        """A warning (or "") when the swarm advertises ``run`` only with other layouts: likely a wrong model
        or --run, but an advert is anyone's claim, so it never refuses a trainer. Other layouts are counted."""
        if self.statesync is None:
            return ""
        try:
            ads = await self.statesync.adverts(run, timeout=ADVERT_CHECK_S)
        except Exception as e:  # the DHT being slow must not stop training: the run key still separates models
            log.info("could not read run %s's adverts in the DHT: %s", run, e)
            return ""
        others = [a for a in ads if a.layout != digest]
        for _ in others:
            self.metrics.ignored_records.labels("state_advert", "layout").inc()
        if not others or any(a.layout == digest for a in ads):
            return ""
        warning = (f"run {run!r} is advertised in the swarm only with other models ({len(others)} peer(s), e.g. "
                   f"layout {sorted(a.layout for a in others)[0][:16]}; this trainer's is {digest[:16]}): this "
                   f"trainer averages only with peers of the same model; check the model and --run")
        log.warning("%s", warning)
        return warning

    def _session(self, req: dict[str, Any], conn: Connection) -> Session:
        session = self.sessions.get(req.get("session"))  # type: ignore[arg-type]
        if session is None or session.conn is not conn:
            raise OpError("no such session on this connection: call trainer_open first")
        return session

    def _close(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        self.sessions.pop(session.id, None)
        self._replied.pop(session.id, None)
        for event, skipped in session.deferred.values():  # deferred buckets waiting on a trainer that left
            skipped.append(True)
            event.set()
        session.deferred.clear()
        for sr in session.rounds.values():  # parts waiting for a bucket request that will not come
            for arrived in sr.arrived:
                arrived.set()
        session.rounds.clear()
        session.arena.close()
        self.metrics.trainer_sessions.set(len(self.sessions))
        log.info("trainer session %d (run %s) closed after %d steps", session.id, session.run, session.steps)

    async def _op_close(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        self._close(self._session(req, conn))
        return {}

    # -- steps ----------------------------------------------------------------------------------
    async def _op_step(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        session = self._session(req, conn)
        step, kind, timeout = req.get("step"), req.get("kind", "grad"), req.get("timeout_s", 30.0)
        if type(step) is not int or step < 0:
            raise OpError("step must be a non-negative integer")
        if step <= session.latest:
            raise OpError(f"step {step} is not after the session's latest step {session.latest}")
        if kind not in KINDS:
            raise OpError(f"kind must be one of {KINDS}")
        if not isinstance(timeout, int | float) or not 1 <= timeout <= 3600:
            raise OpError("timeout_s must be in [1, 3600]")
        round_no, wait = req.get("round"), req.get("wait_s")
        if round_no is not None and (type(round_no) is not int or not 0 <= round_no < 2**32 - 1):
            raise OpError("round must be an integer in [0, 2**32 - 1) (e.g. the step // K of a parameter average)")
        if wait is not None and (not isinstance(wait, int | float) or isinstance(wait, bool)
                                 or not 0.2 <= wait <= timeout / 2):
            raise OpError(f"wait_s must be in [0.2, timeout_s / 2 = {timeout / 2}] seconds")
        session.latest = step
        self._report(req, session)
        try:
            weight = session.arena.check_request(step)
        except ArenaError as e:
            raise OpError(str(e)) from None
        entered = time.monotonic()
        if self.deadlines is not None and wait is None:  # (a round told to wait keeps the timeout that holds it)
            timeout = self.deadlines.step_wait(float(timeout)).seconds
        vector, finite = await take_slot(session.arena.vector(step))  # averaging must not see the slot change
        if not finite:  # a NaN would poison every peer's average
            raise OpError(f"step {step}: the vector holds NaN or infinity; not averaging it with the swarm")
        start = time.monotonic()
        checked, verdict, left = None, None, timeout
        check = kind == "params" and round_no is not None and wait is None
        if check:
            checked, verdict = await self._check_params(session, vector, float(timeout), round_no)
            left = max(1.0, float(timeout) - (time.monotonic() - start))
        if checked is not None:  # the average would change nothing, or less than its rounding would
            result, out, outcome, error = checked, vector, "averaged", ""
        else:
            result, out, outcome, error = await self._average_vector(
                session, session.average_id(kind), kind, vector, float(weight), left, round_no, step,
                **({} if wait is None else {"wait_s": float(wait)}))
        seconds = time.monotonic() - start
        self.metrics.trainer_steps.labels(outcome).inc()
        self.metrics.trainer_step_seconds.observe(seconds)
        self._measured(session, entered, seconds if outcome == "averaged" else None)
        if session.closed or conn.closed:
            return {}  # the trainer went away mid-step; nobody to answer
        if session.latest != step:
            session.late_results += 1  # a later step was requested meanwhile: never write into it
            raise OpError(f"step {step}'s result came after step {session.latest} was requested; dropped")
        written = time.monotonic()
        session.arena.write_result(step, out)
        session.steps += 1
        reply = round_reply(step, outcome, result, seconds, error)
        reply["phases"] = round_phases(result, copy_in=start - entered, round_s=seconds,
                                       copy_out=time.monotonic() - written)
        if check:
            reply["identical"] = verdict == "identical"  # the check round found every member's parameters the same
            reply["close"] = verdict == "close"  # ... or this member's nearer their average than the codec's rounding
        if outcome == "averaged" and kind == "grad" and result is not None:
            session.grad_group = int(result.group_size)
        if outcome == "averaged":
            self.metrics.trainer_group_size.set(reply["group_size"])
            self.metrics.trainer_received_fraction.set(reply["received_fraction"])
        session.last = reply
        return reply

    def _measured(self, session: Session, entered: float, round_s: float | None) -> None:
        """Tell the deadline tuner a step's round time and the compute before it (since the session's last reply)."""
        if self.deadlines is None:
            return
        replied = self._replied.get(session.id)
        self.deadlines.receive_step(round_s=round_s, compute_s=None if replied is None else entered - replied,
                                    now=time.time())
        self._replied[session.id] = time.monotonic()

    @staticmethod
    def _options(session: Session, kind: str, vector: np.ndarray, round_no: int | None) -> dict[str, Any]:
        """The keywords a session's average passes (only those it set: averagers without them still work)."""
        extra: dict[str, Any] = {} if session.keep_rounds is None else {"keep_rounds": session.keep_rounds}
        extra.update(codec_keywords(session, kind, vector.size))  # only when declared
        if round_no is not None:
            extra["round_no"] = round_no
        if kind == "params":
            # every replica's parameters weigh PARAMS_WEIGHT (peerd.torch): a member claiming more counts as one
            extra["max_weight"] = PARAMS_WEIGHT
        elif session.max_samples is not None:
            extra["max_weight"] = session.max_samples
        if kind == "params":
            # Honest replicas' parameters stay close to each other, so each owner clips around its own
            # (centered): plain clipping around zero lets a scaled member still add C times a whole
            # parameter vector, and a sign-flipped one shrink every model. On by default (C = DEFAULT_C):
            # without it one sign-flipped member of 8 left the demo's honest peers at 0.68 accuracy (0.97
            # clean), and these averages are rare (every K steps), so their clipping pass costs little.
            extra["robust"] = Robust("centered", DEFAULT_C if session.robust is None else session.robust.c)
            extra["center"] = vector
        else:
            # without the session's robust, the weight bound and the direction test alone (clipping only past
            # MAX_C times the median), as on outer steps: a sign-flipped member claiming a large weight is left
            # out, and honest averages keep their members' norms; "off" (a swarm whose members the owner trusts):
            # none of it, the owner streams the contributions as they come
            if not session.robust_off:
                extra["robust"] = session.robust if session.robust is not None else Robust("clip", MAX_C)
        return extra

    async def _check_params(self, session: Session, vector: np.ndarray, timeout: float,
                            round_no: int) -> tuple[RoundResult | None, str | None]:
        """The check round before a parameter average (paramcheck.py): its result with this member's own
        ``vector`` and the verdict, "identical" (every member of the group holds these parameters) or "close" (they
        lie nearer the group's average than the session's codec would round them), else (None, None): average as
        before. A check that fails costs at most CHECK_SHARE of the step's timeout."""
        codec = codec_keywords(session, "params", vector.size)
        noise = rounding_noise(vector, codec.get("compression"), int(codec.get("quant_group") or GROUP))
        probe = check_vector(vector, noise)
        budget = max(1.0, CHECK_SHARE * timeout)
        try:
            with trio.fail_after(budget + 10.0):  # (the averaging API's own deadline is ``budget``)
                got = await self.average(session.average_id("check"), probe, PARAMS_WEIGHT, timeout_s=budget,
                                         keep_rounds=session.keep_rounds, round_no=round_no,
                                         max_weight=PARAMS_WEIGHT, compression="fp32")
        except Exception as e:  # a failed check is no verdict: the parameter average runs as before
            log.debug("session %d: parameter check of round %d failed: %s", session.id, round_no, e)
            return None, None
        if identical(got, probe, session.grad_group):
            self.metrics.trainer_params_identical.inc()
            return replace(got, vector=vector), "identical"
        if close(got, probe, session.grad_group):
            self.metrics.trainer_params_close.inc()
            return replace(got, vector=vector), "close"
        return None, None

    async def _average_vector(self, session: Session, run_id: str, kind: str, vector: np.ndarray, weight: float,
                              timeout: float, round_no: int | None, step: int,
                              **more: Any) -> tuple[RoundResult | None, np.ndarray, str, str]:
        """Average ``vector`` under ``run_id``: (result, the vector to hand back, outcome, error). A failed or
        non-finite average hands back the trainer's own vector (outcome "failed")."""
        try:
            # The averaging API has its own deadline; this outer one makes sure no bug can hang a trainer.
            with trio.fail_after(timeout + 10.0):
                extra = {**self._options(session, kind, vector, round_no), **more}  # more: a deferred bucket's ready=
                result: Any = await self.average(run_id, vector, weight, timeout_s=timeout, **extra)
        except Exception as e:  # the round failed: the trainer decides what to do with its own vector
            result = e
        return self._settle(session, kind, vector, result, step)

    def _settle(self, session: Session, kind: str, vector: np.ndarray, result: RoundResult | BaseException,
                step: int) -> tuple[RoundResult | None, np.ndarray, str, str]:
        """An average's result (or the exception it ended with) as (result, the vector to hand back, outcome,
        error). A failed or non-finite average hands back the trainer's own ``vector`` (outcome "failed")."""
        error = ""
        got: RoundResult | None = None
        try:
            if isinstance(result, BaseException):
                raise result
            out = np.asarray(result.vector, dtype=np.float32)
            if out.shape != vector.shape:
                raise ValueError(f"averaging returned {out.shape}, expected {vector.shape}")
            got, outcome = result, result.outcome
        except Exception as e:  # the round failed: the trainer decides what to do with its own vector
            log.warning("session %d step %d: averaging failed: %s: %s", session.id, step, type(e).__name__, e,
                        exc_info=e if isinstance(e, BaseExceptionGroup) else None)  # (a task's error: say where)
            out, outcome, error = vector, "failed", f"{type(e).__name__}: {e}"
        if outcome != "failed" and not all_finite(out):  # non-finite numbers never reach a model
            self.metrics.contributions_refused.labels("nonfinite_result").inc()
            log.warning("session %d step %d: the %s average holds NaN or infinity; the trainer keeps its own "
                        "vector", session.id, step, kind)
            out, outcome = vector, "failed"
            error = (f"the averaged {kind} vector of round {got.round if got else '?'} holds NaN or infinity "
                     f"(a group member sent non-finite data); not applied: this trainer's own vector is in the slot")
        elif outcome == "averaged" and got is not None and hasattr(self.statesync, "note_peers"):
            self.statesync.note_peers(got.members)  # donors to trust first in state sync
        return got, out, outcome, error


    async def _op_bucket(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """One bucket of a step's gradients (overlap, peerd.torch.overlap): elements [offset, offset + length)
        of the step's slot, averaged while the trainer goes on; every bucket of a step shares the step id (and
        the slot's sample count: one weight per member for every range).

        ``deferred``: sent at the start of the step, before backward produced the bucket: matchmaking starts at
        once, and the average waits for ``trainer_bucket_ready`` (the gradients are in the slot, or skipped).
        With ``buckets`` (the step's bucket count) and ``plan`` (the trainer's hash of its bucket ranges), every
        bucket of the step averages in one Moshpit round (``Session.step_id``: one matchmaking, each bucket under
        its own group id, concurrently); without, bucket b is its own Moshpit run (``Session.bucket_id``).
        A result is written while the slot still belongs to the step (fewer than nslots later steps asked)."""
        session = self._session(req, conn)
        step, bucket, offset, length = req.get("step"), req.get("bucket"), req.get("offset"), req.get("length")
        timeout, deferred = req.get("timeout_s", 30.0), req.get("deferred", False)
        if type(step) is not int or step < 0:
            raise OpError("step must be a non-negative integer")
        if step < session.latest:
            raise OpError(f"step {step} is before the session's latest step {session.latest}")
        if type(bucket) is not int or not 0 <= bucket < MAX_BUCKETS:
            raise OpError(f"bucket must be an integer in [0, {MAX_BUCKETS})")
        if type(offset) is not int or type(length) is not int or not 0 <= offset < offset + length <= session.elems:
            raise OpError(f"offset and length must pick a non-empty range of the {session.elems} elements")
        if not isinstance(timeout, int | float) or not 1 <= timeout <= 3600:
            raise OpError("timeout_s must be in [1, 3600]")
        timeout = timeout if self.deadlines is None else self.deadlines.bucket_wait(float(timeout)).seconds
        if type(deferred) is not bool:
            raise OpError("deferred must be true or false")
        buckets, plan = req.get("buckets"), req.get("plan")
        shared = deferred and buckets is not None and self.average_parts is not None
        if buckets is not None and (type(buckets) is not int or not bucket < buckets <= MAX_BUCKETS
                                    or not isinstance(plan, str) or len(plan) != 16
                                    or any(c not in "0123456789abcdef" for c in plan)):
            raise OpError(f"buckets must be the step's bucket count (more than bucket {bucket}, at most "
                          f"{MAX_BUCKETS}) and plan 16 lowercase hex digits (the trainer's hash of its buckets)")
        try:
            weight = session.arena.check_request(step)
        except ArenaError as e:
            raise OpError(str(e)) from None
        if deferred:
            steps = {s for s, _ in session.deferred}
            if (step, bucket) in session.deferred or (step not in steps and len(steps) >= MAX_DEFERRED_STEPS):
                raise OpError(f"step {step} bucket {bucket}: already deferred, or {MAX_DEFERRED_STEPS} steps hold "
                              f"deferred buckets already")
        shared_round = self._step_round(session, step, buckets, plan) if shared else None
        session.latest = step
        for key in [k for k in session.early_ready if k[0] < step]:  # readies of steps no request will name now
            del session.early_ready[key]
        self._report(req, session)
        start = entered = time.monotonic()
        extra: dict[str, Any] = {}
        if deferred:
            event, skipped = session.deferred[(step, bucket)] = (trio.Event(), [])
            if (step, bucket) in session.early_ready:  # its trainer_bucket_ready ran first
                if session.early_ready.pop((step, bucket)):
                    skipped.append(True)
                event.set()
            vector = np.empty(length, dtype=np.float32)

            async def ready() -> None:
                """The group is known: wait for the trainer's gradients, then read them (the average's input)."""
                await event.wait()
                session.deferred.pop((step, bucket), None)
                if skipped or session.closed:
                    raise OpError(f"step {step} bucket {bucket}: the trainer skipped it (non-finite gradients) or left")
                vector[:] = session.arena.vector(step)[offset: offset + length]
                if not all_finite(vector):
                    raise OpError(f"step {step} bucket {bucket}: the vector holds NaN or infinity; not averaging it")

            if shared_round is None and self.ready:
                extra["ready"] = ready
            elif shared_round is None:
                try:
                    with trio.fail_after(timeout):
                        await ready()
                except (OpError, trio.TooSlowError) as e:
                    session.deferred.pop((step, bucket), None)
                    raise OpError(f"step {step} bucket {bucket}: {e or 'its gradients did not come in time'}") from None
        else:
            vector, finite = await take_slot(session.arena.vector(step)[offset: offset + length])
            if not finite:
                raise OpError(f"step {step} bucket {bucket}: the vector holds NaN or infinity; not averaging it")
            start = time.monotonic()
        try:
            if shared_round is not None:

                async def fetch() -> np.ndarray:
                    await ready()
                    return vector

                result, out, outcome, error = await self._share_round(session, step, bucket, shared_round, fetch,
                                                                      vector, float(weight), timeout)
            else:
                result, out, outcome, error = await self._average_vector(session, session.bucket_id(bucket), "grad",
                                                                         vector, float(weight), timeout, None, step,
                                                                         **extra)
        finally:
            session.deferred.pop((step, bucket), None)
        seconds = time.monotonic() - start
        self.metrics.trainer_steps.labels(outcome).inc()
        self.metrics.trainer_step_seconds.observe(seconds)
        if self.deadlines is not None and outcome == "averaged":
            self.deadlines.receive_bucket(seconds, time.time())
        if session.closed or conn.closed:
            return {}
        if session.latest - step >= session.arena.nslots:
            session.late_results += 1  # the slot belongs to a later step now: never write into it
            raise OpError(f"step {step}'s bucket {bucket} came after step {session.latest} was requested; dropped")
        written = time.monotonic()
        try:
            if not (deferred and outcome == "failed"):  # deferred and failed: the slot holds the trainer's own vector
                session.arena.write_range(step, offset, out)
        except ArenaError as e:
            raise OpError(f"step {step} bucket {bucket}: {e}") from None
        reply = {**round_reply(step, outcome, result, seconds, error), "bucket": bucket}
        reply["phases"] = round_phases(result, copy_in=start - entered, round_s=seconds,
                                       copy_out=time.monotonic() - written)
        if outcome == "averaged":
            self.metrics.trainer_group_size.set(reply["group_size"])
            self.metrics.trainer_received_fraction.set(reply["received_fraction"])
        return reply

    def _step_round(self, session: Session, step: int, buckets: int, plan: str) -> tuple[StepRound, bool]:
        """The round step ``step``'s buckets share, and whether this request opened it (then it runs it)."""
        sr = session.rounds.get(step)
        if sr is not None:
            if (sr.count, sr.plan) != (buckets, plan):
                raise OpError(f"step {step}: buckets={buckets} plan={plan} differ from the step's first bucket "
                              f"(buckets={sr.count} plan={sr.plan})")
            return sr, False
        older = sorted(s for s in session.rounds if s < step)
        after = session.rounds[older[-1]] if older else None
        for s in older:  # their buckets are refused now (step < latest)
            del session.rounds[s]
        sr = session.rounds[step] = StepRound.new(buckets, plan, after if after and not after.ended.is_set() else None)
        return sr, True

    async def _share_round(self, session: Session, step: int, bucket: int, opened: tuple[StepRound, bool],
                           fetch: Callable[[], Awaitable[np.ndarray]], vector: np.ndarray, weight: float,
                           timeout: float) -> tuple[RoundResult | None, np.ndarray, str, str]:
        """Bucket ``bucket``'s part of its step's shared round: the request that opened the round runs it
        (and answers when the whole round ends), the others answer when their own part ends."""
        sr, first = opened
        if sr.fetches[bucket] is not None:
            raise OpError(f"step {step} bucket {bucket}: already in the step's round")
        sr.fetches[bucket] = fetch
        sr.arrived[bucket].set()
        if first:
            await self._run_step_round(session, step, sr, vector, weight, timeout)
        with trio.fail_after(timeout + 20.0):  # (the round settles every bucket: no bug may hang a trainer)
            await sr.done[bucket].wait()
        return self._settle(session, "grad", vector, sr.results[bucket], step)

    async def _run_step_round(self, session: Session, step: int, sr: StepRound, vector: np.ndarray, weight: float,
                              timeout: float) -> None:
        """One Moshpit round for every bucket of the step; bucket b's part waits for b's request (at most
        ``timeout``), then for its gradients. Every bucket is settled when this returns."""
        assert self.average_parts is not None

        def part(b: int) -> Part:
            async def fetch() -> np.ndarray:
                with trio.fail_after(timeout):
                    await sr.arrived[b].wait()
                f = sr.fetches[b]
                if f is None:
                    raise OpError(f"step {step} bucket {b}: the trainer left before asking for it")
                return await f()

            return Part(fetch, lambda result: sr.settle(b, result))

        try:
            if sr.after is not None:  # the previous step's round first (it ends within its own limit)
                with trio.move_on_after(timeout + 20.0):
                    await sr.after.ended.wait()
                sr.after = None
            with trio.fail_after(timeout + 10.0):
                results = await self.average_parts(session.step_id(sr.plan), [part(b) for b in range(sr.count)],
                                                   weight, timeout_s=timeout,
                                                   **self._options(session, "grad", vector, None))
            for b, result in enumerate(results):
                sr.settle(b, result)
        except Exception as e:
            log.warning("session %d step %d: the step's round failed: %s: %s", session.id, step, type(e).__name__, e)
            for b in range(sr.count):
                sr.settle(b, e)
        finally:
            sr.ended.set()

    async def _op_bucket_ready(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """A deferred bucket's gradients are in the slot (``skip``: they are not finite; the bucket drops out)."""
        session = self._session(req, conn)
        step, bucket, skip = req.get("step"), req.get("bucket"), req.get("skip", False)
        if type(step) is not int or type(bucket) is not int or not 0 <= bucket < MAX_BUCKETS or type(skip) is not bool:
            raise OpError(f"trainer_bucket_ready needs step (int), bucket (int in [0, {MAX_BUCKETS})) and skip (bool)")
        entry = session.deferred.get((step, bucket))
        if entry is None:
            # requests run concurrently: the bucket's own request may not have run yet (then it takes this), or
            # its average ended already (failed before the group formed: nothing waits)
            if (session.latest <= step <= session.latest + MAX_DEFERRED_STEPS
                    and len(session.early_ready) < MAX_BUCKETS * (MAX_DEFERRED_STEPS + 1)):
                session.early_ready[(step, bucket)] = skip
            return {"waiting": False}
        if skip:
            entry[1].append(True)
        entry[0].set()
        return {"waiting": True}

    async def _op_outer(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """A DiLoCo outer average (peerd.trainer.outer_step)."""
        return await self.outer.step(self._session(req, conn), req, conn)

    def _report(self, req: dict[str, Any], session: Session | None = None) -> None:
        """What a trainer reports with a request: its loss, throughput, and its previous step's phases."""
        phases = parse_phases(req.get("phases")) if "phases" in req else None
        if phases is not None and session is not None:
            session.phases = phases
            for name, seconds in phases.items():
                self.metrics.step_phase_seconds.labels(name).observe(seconds)
        loss, sps = req.get("loss"), req.get("samples_per_second")
        if isinstance(loss, int | float) and math.isfinite(loss):
            self.metrics.trainer_loss.set(loss)
        if isinstance(sps, int | float) and math.isfinite(sps) and sps >= 0:
            self.metrics.trainer_samples_per_second.set(sps)

    async def _op_report(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        session = self._session(req, conn)
        self._report(req, session)
        auto = req.get("auto")
        if auto is not None:  # what compression="auto" chose, for `peerd status`: bounded, strings and numbers
            if not isinstance(auto, dict) or len(auto) > 8 or not all(
                    isinstance(k, str) and len(k) <= 32 and small_value(v) for k, v in auto.items()):
                raise OpError(f"auto must be a small object of strings (<= {MAX_AUTO_REASON} chars) and numbers")
            session.auto = dict(auto)
        return {}

    def statistics(self) -> TrainerStatistics:
        """Every open session (``peerd status``)."""
        return TrainerStatistics(tuple(
            SessionStatistics(s.id, s.run, s.layout[:16], s.steps, s.compression.get("compression", "fp32"),
                              s.last.get("outcome", ""), s.last.get("seconds", 0.0), bool(s.last.get("kept", False)),
                              dict(s.phases), dict(s.auto))
            for s in self.sessions.values() if not s.closed))

    # -- state sync -----------------------------------------------------------------------------
    async def _op_state_publish(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """The trainer hands over a snapshot (a memfd): keep it for joiners and advertise it (``wait`` false: in
        the background, the reply's ``advertised`` None)."""
        session = self._session(req, conn)
        step, size, wait = req.get("step"), req.get("size"), req.get("wait", True)
        if type(step) is not int or step < 0 or type(size) is not int or not 0 < size <= MAX_BLOB:
            raise OpError("state_publish needs step (int >= 0) and size (bytes > 0)")
        if type(wait) is not bool:
            raise OpError(f"wait must be true or false (false: advertise in the background), got {wait!r:.40}")
        fd = conn.take_fd()
        if session.keeping is not None:  # one snapshot kept at a time per session (its memory stays bounded)
            await session.keeping.wait()
        if not wait and self.statesync is not None and self._background is not None and self.adverts is not None \
                and self.adverts.running:  # periodic: answered now, read, hashed and kept beside the training
            session.keeping = trio.Event()
            self._background.start_soon(self._keep_later, session, fd, size, step, session.keeping)
            return {"advertised": None, "sha": None}
        try:
            blob = read_blob(fd, size)
        except (ArenaError, OSError) as e:
            raise OpError(f"cannot read the snapshot: {e}") from None
        finally:
            os.close(fd)
        if self.statesync is None:
            return {"advertised": False, "sha": hashlib.sha256(blob).hexdigest()}
        sha = self.statesync.keep(session.run_key, blob)
        if not wait and self.adverts is not None and self.adverts.running:
            self.adverts.submit(PendingAdvert(session.run, session.run_key, session.layout, step, size, sha))
            return {"advertised": None, "sha": sha.hex()}
        ok = await self.statesync.advertise_state(session.run, session.run_key, session.layout, step=step,
                                                  size=size, sha=sha)
        return {"advertised": ok, "sha": sha.hex()}

    async def _keep_later(self, session: Session, fd: int, size: int, step: int, done: trio.Event) -> None:
        """A periodic snapshot, after its publish was answered: read and hash it off the event loop, keep it for
        joiners and advertise it. A failure is logged (the next period publishes again), never raised."""
        try:
            blob = await trio.to_thread.run_sync(read_blob, fd, size)
            sha = await trio.to_thread.run_sync(lambda: hashlib.sha256(blob).digest())
            if not session.closed and self.statesync is not None and self.adverts is not None:
                self.statesync.keep(session.run_key, blob, sha=sha)
                self.adverts.submit(PendingAdvert(session.run, session.run_key, session.layout, step, size, sha))
        except Exception as e:  # a snapshot that cannot be read, or no memory: this one is not offered
            log.warning("session %d: keeping the snapshot of step %d failed: %s: %s", session.id, step,
                        type(e).__name__, e)
        finally:
            os.close(fd)
            done.set()
            if session.keeping is done:
                session.keeping = None

    async def _op_state_fetch(self, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """Download the run's newest snapshot from donors into the memfd the trainer sent."""
        session = self._session(req, conn)
        timeout = req.get("timeout_s", 60.0)
        if not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
            raise OpError("timeout_s must be in (0, 3600]")
        max_size = req.get("max_size", session.snapshot_max)
        if type(max_size) is not int or max_size <= 0:
            raise OpError(f"max_size must be a positive integer of bytes (the largest snapshot this trainer "
                          f"accepts), got {max_size!r:.40}")
        max_size = min(max_size, session.snapshot_max)  # never more than this model's snapshots can hold
        below = req.get("below")
        if below is not None and not (isinstance(below, bytes) and len(below) == 32):
            raise OpError("below must be the 32-byte SHA-256 of the founder's own snapshot")
        exclude = req.get("exclude", [])  # snapshots the trainer refused to load (hex SHA-256s): take the next
        if (not isinstance(exclude, list) or len(exclude) > 16
                or not all(isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)
                           for x in exclude)):
            raise OpError("exclude must be a list of at most 16 snapshot SHA-256s (64 lowercase hex digits each)")
        fd = conn.take_fd()
        try:
            if self.statesync is None:
                return {"found": False, "reason": "this daemon has no state sync"}
            from ..statesync import StateSyncError

            try:
                fetched = await self.statesync.fetch(session.run, session.run_key, timeout=timeout,
                                                     max_size=max_size, layout=session.layout,
                                                     exclude=[bytes.fromhex(x) for x in exclude],
                                                     **({} if below is None else {"below": below}))
            except StateSyncError as e:
                raise OpError(f"state sync failed: {e}") from None
            if fetched is None:
                return {"found": False, "reason": "no peer advertises a snapshot of this run and model"}
            fill_blob(fd, fetched.blob)
            log.info("session %d: downloaded step %d (%d bytes, %d chunks from %d donors, %d retries)",
                     session.id, fetched.step, len(fetched.blob), fetched.chunks, fetched.donors, fetched.retries)
            return {"found": True, "step": fetched.step, "size": len(fetched.blob), "sha": fetched.sha.hex(),
                    "donors": fetched.donors, "chunks": fetched.chunks, "retries": fetched.retries}
        finally:
            os.close(fd)

