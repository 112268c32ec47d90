"""DiLoCo's outer step on the daemon (``trainer_outer``): the pseudo-gradient's Moshpit rounds, then the agreement.

peerd.torch.DiLoCo writes its pseudo-gradient into the session's slot; the daemon averages it through as many
Moshpit rounds as the run's grid has dimensions, then runs the outer agreement (peerd.trainer.outer) so that
every member of the swarm holds the same bytes, or answers an error that says why: the trainer must not apply
an average that did not agree.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from ..allreduce.robust import MAX_C, Robust
from ..deadlines import DEFAULT_WINDOW_S, DeadlineTuner
from ..localsock.arena import ArenaError
from ..localsock.server import Connection, OpError
from ..metrics import Metrics
from ..moshpit.records import MAX_ROUND, decode_progress, progress_key
from ..moshpit.service import RoundResult, all_finite
from .inbox import OuterInbox
from .outer import DhtBoard, OuterError, agree
from .records import MAX_GROUP, store_key
from .session import Average, Session, codec_keywords, node_ids, round_phases, take_slot

log = logging.getLogger("peerd.trainer")

OUTER_ROUNDS = 4  # Moshpit rounds an outer step may take (grid dimensions: 16**4 peers in groups of 16)
OUTER_ROUND_LIMIT = (MAX_ROUND + 1) // OUTER_ROUNDS  # outer rounds numbered below this fit Moshpit's rounds
OUTER_KEPT_ROUNDS = 3  # outer rounds whose blobs a daemon keeps (up to 3 vectors each) for members still repairing
STEP_PEERS_READ_S = 2.0  # the read of who took part in an outer step waits this long at most
# An outer step's matchmaking waits for the run's members up to this share of the time between outer steps: trainers
# that took H local steps each arrive seconds apart (an evaluation, a shared CPU), and a window shorter than that
# splits the swarm into groups that each average a part of the pseudo-gradients and, offset by the same lag at the
# next outer step, stay split. A group closes as soon as every expected member is in, so the wait costs nothing then.
OUTER_WAIT_SHARE = 0.25
RUN_WINDOW_S = DEFAULT_WINDOW_S  # below this the run's own (tuned) window stands


def outer_wait_s(period_s: float | None, timeout_s: float) -> float | None:
    """How long an outer step's matchmaking waits at least for the run's members, given the seconds since this
    session's last outer step (None: its first) and the trainer's timeout: OUTER_WAIT_SHARE of the period, at most
    half the timeout (Moshpit's bound); None where that is no longer than the run's own window."""
    if period_s is None or not math.isfinite(period_s) or period_s <= 0:
        return None
    wait = min(OUTER_WAIT_SHARE * period_s, timeout_s / 2)
    return wait if wait > RUN_WINDOW_S else None


def _node_id(peer_id: str) -> bytes:
    """This daemon's node id from its hex form (b"" where it is not hex: an in-process daemon in tests)."""
    try:
        return bytes.fromhex(peer_id)
    except ValueError:
        return b""


def finished_by(progress: list[tuple[bytes, int, float]], first_round: int) -> frozenset[bytes]:
    """The node ids whose progress says they finished Moshpit round ``first_round`` or a later one."""
    return frozenset(node for node, value, _ in progress if value >= first_round)


MAX_LAG_S = 3600.0  # a lag claimed beyond this is taken as this (a record's time is its writer's claim)


def swarm_lag_s(progress: list[tuple[bytes, int, float]], me: bytes, below: int, wall: float) -> float | None:
    """Seconds since the others finished their latest outer round before Moshpit round ``below`` (the last of them
    to store its progress there, by the wall clock ``wall``): how far behind them a member that adopted their
    average starts its next inner steps. None where no other member's progress is known."""
    others = [(value // OUTER_ROUNDS, at) for node, value, at in progress if node != me and value < below]
    if not others:
        return None
    top = max(r for r, _ in others)
    latest = max(at for r, at in others if r == top)
    return min(MAX_LAG_S, max(0.0, wall - latest)) if math.isfinite(latest) else None


def waits_for_participants(result: RoundResult | None) -> bool:
    """Whether the agreement waits for its first read of who took part (the run's progress) before it ends. That
    read finds the groups of this step that finished before this member's. A kept group's renewal does not wait: it
    holds every member the run expected and skips matchmaking, so a group of newcomers (still matchmaking through
    the DHT) finishes after it, where the read could not see it anyway."""
    return not (result is not None and result.outcome == "averaged" and result.kept)


class OuterSteps:
    """The ``trainer_outer`` op for the sessions of a TrainerService: ``average`` is Moshpit's, ``statesync``
    and ``inbox`` carry the agreement's blobs and pushed records, ``report`` takes what a request reports."""

    def __init__(self, metrics: Metrics, average: Average, statesync: Any, inbox: OuterInbox, peer_id: str,
                 report: Callable[[dict[str, Any], Session], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.metrics = metrics
        self.average = average
        self.statesync = statesync
        self.inbox = inbox
        self.peer_id = peer_id
        self.report = report
        self.background: trio.Nursery | None = None  # where records are still put after a step answered (run)
        self.deadlines: DeadlineTuner | None = None  # the average's wait tunes itself within the trainer's timeout_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery that outer steps leave their last DHT put in (a trainer need not wait for it)."""
        async with trio.open_nursery() as nursery:
            self.background = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.background = None

    async def step(self, session: Session, req: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """A DiLoCo outer average (peerd.torch.DiLoCo): average the pseudo-gradient in the slot's first
        ``length`` elements through Moshpit round ``round`` (every member numbers it alike: its step), then
        make every member hold the same bytes (outer.py: shards repaired from their owners, one final hash
        across the swarm) and write that into the slot. ``state``: the SHA-256 of the trainer's outer state
        before the step, published beside the average so members see whether they started alike.
        An average that cannot agree is an OpError that says so: the trainer must not apply it."""
        step, timeout, length = req.get("step"), req.get("timeout_s", 60.0), req.get("length")
        round_no, state = req.get("round"), req.get("state", b"")
        if type(step) is not int or step < 0 or step <= session.latest:
            raise OpError(f"step must be an integer after the session's latest step {session.latest}")
        if type(round_no) is not int or not 0 <= round_no < OUTER_ROUND_LIMIT:
            raise OpError(f"round must be an integer in [0, {OUTER_ROUND_LIMIT}) (the trainer's step of the outer "
                          f"sync)")
        if type(length) is not int or not 1 <= length <= session.elems:
            raise OpError(f"length must be an integer in [1, {session.elems}] (elements of the fragment)")
        if not isinstance(timeout, int | float) or not 1 <= timeout <= 3600:
            raise OpError("timeout_s must be in [1, 3600]")
        if not isinstance(state, bytes) or len(state) not in (0, 32):
            raise OpError("state must be the 32-byte SHA-256 of the trainer's outer state (or empty)")
        behind = req.get("behind", False)
        if type(behind) is not bool:
            raise OpError("behind must be true or false (a member catching up with outer rounds the swarm finished)")
        session.latest = step
        self.report(req, session)
        try:
            weight = session.arena.check_request(step)
        except ArenaError as e:
            raise OpError(str(e)) from None
        vector, finite = await take_slot(session.arena.vector(step)[:length])
        if not finite:
            raise OpError(f"step {step}: the pseudo-gradient holds NaN or infinity; not averaging it with the swarm")
        start = self.clock()
        wait = timeout if self.deadlines is None else self.deadlines.outer_wait(float(timeout)).seconds
        gather = outer_wait_s(None if session.outer_at is None else start - session.outer_at, wait)
        if behind:  # a member behind the swarm: a round the swarm finished has no group left, only its average
            progress = await self._progress(session.average_id("outer"))
            me_id = _node_id(self.peer_id)
            if not finished_by(progress, round_no * OUTER_ROUNDS) - {me_id}:  # not finished: average it as usual
                lag = swarm_lag_s(progress, me_id, round_no * OUTER_ROUNDS, time.time())
                return {"step": step, "outcome": "current", "round": round_no,
                        **({} if lag is None else {"swarm_lag_s": round(lag, 3)})}
            log.info("session %d outer round %d: the swarm finished it; taking its agreed average", session.id,
                     round_no)
            result, out, outcome, rounds, seen = None, vector, "alone", 0, frozenset()
        else:
            session.outer_at = start
            result, out, outcome, rounds, seen = await self._outer_rounds(session, vector, float(weight), round_no,
                                                                          wait, gather)
        average_s = self.clock() - start
        if self.deadlines is not None and outcome == "averaged":
            self.deadlines.receive_outer(average_s, time.time())
        phases = {k: v for k, v in round_phases(result, copy_in=0.0, round_s=average_s, copy_out=0.0).items()
                  if k in ("matchmaking", "members", "transfer")}  # the rounds' own split (the last round's)
        log.info("session %d outer round %d: averaged in %.3f s (matchmaking %.3f, transfer %.3f)", session.id,
                 round_no, average_s, phases["matchmaking"], phases["transfer"])
        group = result.group_id if outcome == "averaged" else ""
        members = list(result.members) if group and result is not None else []
        me = self.peer_id
        index = members.index(me) if me in members else 0
        if group and me not in members:
            group = ""  # (an averager that names members otherwise, e.g. in tests): treat as alone
        reply: dict[str, Any] = {"step": step, "outcome": outcome, "group_size": len(members) or 1,
                                 "round": round_no, "rounds": rounds, "kept": bool(result is not None and result.kept),
                                 "received_fraction": float(result.received_fraction) if result else 0.0}
        # how long this member waited for its group to start (its matchmaking and the wait for the last member),
        # told the group in its record: a member the others waited for learns how far behind them it came
        waited = round(phases.get("matchmaking", 0.0) + phases.get("members", 0.0), 4)
        if group:
            reply["wait_s"] = waited
        if self.statesync is not None and getattr(self.statesync, "dht", None) is not None:  # a swarm to agree with
            board = DhtBoard(self.statesync, session.run_key, round_no, inbox=self.inbox, peers=seen)
            run_id, first = session.average_id("outer"), round_no * OUTER_ROUNDS

            async def refresh() -> frozenset[bytes]:
                return await self._step_peers(run_id, first)

            try:
                expect = min(MAX_GROUP, max(1, int(result.seen) if result is not None else 1))
                if not group:  # alone: the swarm it agreed with last time may average this round after it
                    expect = max(expect, min(MAX_GROUP, session.outer_swarm))
                agreement = await agree(board, board.node, out, group=group, size=len(members) or 1, index=index,
                                        state=state, repair_s=min(timeout / 2, 30.0), deadline_s=timeout,
                                        addr=board.addr, members=[bytes.fromhex(h) for h in members] if group else None,
                                        expect=expect, participants=seen, refresh=refresh,
                                        refresh_first=waits_for_participants(result),
                                        complete=bool(group and result is not None and result.complete),
                                        background=self.background, wait_s=waited if group else None)
            except OuterError as e:
                raise OpError(f"outer round {round_no}: {e}") from None
            finally:
                self._forget_outer(session, round_no)
            out = agreement.vector
            session.outer_swarm = agreement.members
            if group and agreement.group_wait_s is not None:
                reply["group_wait_s"] = round(agreement.group_wait_s, 4)
            reply.update(sha=agreement.final, repaired_bytes=agreement.repaired_bytes,
                         adopted_bytes=agreement.adopted_bytes, adopted=agreement.adopted,
                         agreed_members=agreement.members, dissent=agreement.dissent, state_agreed=agreement.states,
                         state_winner=agreement.state_winner, ignored_records=agreement.ignored,
                         pushed_records=agreement.pushed, record_reads=agreement.reads)
            phases.update({k: round(v, 6) for k, v in agreement.phases.items()})
        else:  # no swarm to agree with (an in-process daemon in tests): the average is what it is
            reply.update(sha=hashlib.sha256(out.tobytes()).digest(), repaired_bytes=0, adopted_bytes=0,
                         adopted=False, agreed_members=1, state_agreed=1, state_winner=state)
        if not all_finite(out):
            raise OpError(f"outer round {round_no}: the agreed average holds NaN or infinity; not applied")
        reply["seconds"] = round(self.clock() - start, 6)
        reply["phases"] = phases
        self.metrics.trainer_steps.labels("outer_" + outcome).inc()
        if session.closed or conn.closed:
            return {}
        if session.latest != step:
            raise OpError(f"step {step}'s result came after step {session.latest} was requested; dropped")
        slot = session.arena.vector(step)  # a view of the slot: the fragment's result goes in place
        slot[:length] = out
        session.arena.write_result(step, slot)
        session.steps += 1
        session.last = reply
        return reply

    async def _outer_rounds(self, session: Session, vector: np.ndarray, weight: float, round_no: int,
                            timeout: float, gather_s: float | None = None
                            ) -> tuple[RoundResult | None, np.ndarray, str, int, frozenset[bytes]]:
        """The outer step's Moshpit rounds: as many as the run's grid has dimensions (the first round says),
        so that on a full grid every member's pseudo-gradient reaches every other's (more than one group:
        a swarm larger than the largest group). Round d of outer round r is Moshpit round
        r * OUTER_ROUNDS + d; each averages the last one's result, weighted by the weight it stands for, and
        its matchmaking window is chained to the last one's (``chain_from``: a member alone in round d, which
        waited out its whole window, still meets the members that averaged at once in round d + 1).
        Returns (the last round's result or None, the vector, its outcome, rounds run, the node ids of every
        group this member averaged with: the agreement's known participants). A round that fails leaves the
        vector as it was; the agreement gives this member the swarm's. The session's ``robust`` applies to every
        round as ``clip`` around zero (a pseudo-gradient, like a gradient, has no center of its own). ``gather_s``:
        the first round's matchmaking waits at least this long for the run's members (outer_wait_s)."""
        codec = codec_keywords(session, "outer", vector.size)
        # without the session's robust, the weight bound alone (clipping only past MAX_C times the median): a
        # member's claimed weight counts for at most WEIGHT_BOUND typical ones, and equal honest weights are
        # never bounded; outer steps are rare (every H inner steps), so the owner's staging costs little here
        robust = None if session.robust_off else Robust("clip", MAX_C if session.robust is None else session.robust.c)
        seen: set[bytes] = set()
        cap = session.max_samples
        out, outcome, result, dims, rounds = vector, "failed", None, 1, 0
        window_end = 0.0  # the last round's matchmaking window: the next one ends a window after it
        while rounds < dims:
            extra: dict[str, Any] = {"round_no": round_no * OUTER_ROUNDS + rounds, **codec}
            if cap is not None:
                extra["max_weight"] = cap
            if robust is not None:
                extra["robust"] = robust
            extra["shares"] = "equal"  # (the agreement's repairs cut shards as equal ones: records.shard_bounds)
            if session.keep_rounds is not None:  # a group that formed complete renews for the next outer steps
                extra["keep_rounds"] = session.keep_rounds
            if window_end > 0:
                extra["chain_from"] = window_end
            elif gather_s is not None:
                extra["wait_s"] = gather_s
            try:
                with trio.fail_after(timeout + 10.0):
                    got = await self.average(session.average_id("outer"), out, weight, timeout_s=timeout, **extra)
                averaged = np.asarray(got.vector, dtype=np.float32)
                if averaged.shape != vector.shape or (got.outcome != "failed" and not all_finite(averaged)):
                    self.metrics.contributions_refused.labels("nonfinite_result").inc()
                    raise ValueError("the average is not a finite vector of the pseudo-gradient's shape")
            except Exception as e:  # this member keeps what it holds; the agreement gives it the swarm's
                log.warning("session %d outer round %d.%d: averaging failed: %s: %s", session.id, round_no, rounds,
                            type(e).__name__, e)
                result, outcome = None, "failed"
            else:
                result, outcome, out = got, got.outcome, averaged
                if outcome == "averaged":
                    seen.update(node_ids(got.members))
                window_end = float(got.window_end or 0.0)
                if rounds == 0:
                    dims = min(OUTER_ROUNDS, max(1, int(got.dims)))
                total = float(got.weight_total)
                if outcome == "averaged" and math.isfinite(total) and total > 0:
                    weight = total  # the next axis averages group averages: each weighs what it stands for
                    cap = None if cap is None else cap * int(got.group_size)
            rounds += 1
        return result, out, outcome, rounds, frozenset(seen)

    async def _step_peers(self, run_id: str, first_round: int) -> frozenset[bytes]:
        """The members that took part in this outer step: the run's progress records that finished one of
        its rounds (``first_round`` on). Only their records (and those of this member's groups) count in the
        agreement, and it waits for that many finals (until half its deadline):
        with only the last group's size, a group that finished first agreed within itself and left, and the
        other group, tied two finals to two, waited out its deadline for a majority that could not come."""
        return finished_by(await self._progress(run_id), first_round)

    async def _progress(self, run_id: str) -> list[tuple[bytes, int, float]]:
        """The run's progress records as (node id, last finished Moshpit round, when stored); [] where the
        read fails or takes longer than STEP_PEERS_READ_S (the caller goes on with what it knows)."""
        dht = getattr(self.statesync, "dht", None)
        if dht is None:
            return []
        records: list = []
        try:
            with trio.move_on_after(STEP_PEERS_READ_S):
                records = await dht.get(progress_key(run_id))
        except Exception as e:  # the agreement still runs on what it reads
            log.info("outer step: reading the run's progress failed: %s", e)
        return decode_progress(records)[0]

    def _forget_outer(self, session: Session, round_no: int) -> None:
        """Keep the blobs of the last OUTER_KEPT_ROUNDS outer rounds (others may still repair from them)."""
        if round_no not in session.outer_rounds:
            session.outer_rounds.append(round_no)
        while len(session.outer_rounds) > OUTER_KEPT_ROUNDS:
            old = session.outer_rounds.pop(0)
            self.inbox.forget(session.run_key, old)
            if self.statesync is not None:
                self.statesync.forget(store_key(session.run_key, old))
