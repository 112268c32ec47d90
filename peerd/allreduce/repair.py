"""Repair of lost all-gather ranges (a part of ``GroupAverage``; protocol/allreduce.md, "Repair").

A member whose all-gather stream from an owner ended with ranges missing asks that owner for exactly those (AG_NACK),
a bounded number of rounds, and tells every owner once it needs nothing more of its stream (a done AG_NACK). An owner
resends the ranges asked for as ordinary AG_DATA while its group runs, and keeps its group running until every member
it serves is done or SERVE_S has passed since its own phases ended (or since the latest request); its driver hands the
result on before that (``keep_shard``: resends then read a copy of the shard), so a member's step waits only for its
own missing ranges. A lost all-gather
range otherwise leaves a member on its own value for it (unbiased, but a replica that drifts); a lost reduce-scatter
contribution only lowers the weight that reached its range, and is not repaired.

Members are not trusted: an owner resends each range at most once per requester and round, for at most its
``repair_rounds`` rounds, and only ranges it has already sent; so a member's requests never make it send more than
its shard per round, however many it sends.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..wire.errors import WireError
from .frames import (
    END_REPEATS,
    F32_DTYPE,
    NACK_DONE,
    BodyType,
    nack_bodies,
    pack_block,
    pack_coded,
    pack_nack,
    parse_nack,
)
from .intake import Outcome
from .kernels import F32_MAX, one_row
from .outbox import OutBlock

# An owner serves requests this long after its own phases ended, or after the latest request, for members it has not
# heard are done: a member's rounds wait REPAIR_FLOOR_S and more each, and start once its stream's END arrived.
SERVE_S = 0.25
NACK_REPEATS = END_REPEATS  # AG_NACK bodies go as END markers do: three copies, spaced (a copy asks for nothing new)
_AG_DATA, _AG_NACK = int(BodyType.AG_DATA), int(BodyType.AG_NACK)


class Repair:
    """GroupAverage's repair: the member's requests and done messages, the owner's resends and serving."""

    def _init_repair(self, rounds: int, max_payload: int) -> None:
        n = self.n
        self._rounds = rounds
        self._max_payload = max_payload
        self._ag.rounds = rounds
        self._ag.safety = self.safety
        self._told = [False] * n  # owners told this member is done with their stream
        self._asked_first = [0] * n  # per owner: the ranges the first round asked for
        # owner: the members not yet done with this shard's stream (their done AG_NACK), the round each asks in and
        # the ranges resent to it in that round, resends waiting to be built, until when requests are served
        self._awaiting = {s for s in range(n) if s != self.index} if rounds and self._nranges else set()
        self._served_round = [0] * n
        self._served: list[np.ndarray | None] = [None] * n
        self._resend: dict[int, list[np.ndarray]] = {}
        self._resent = 0
        self._serve_until: float | None = None
        self._serving_over = False
        self._ag_out = 0  # leading ranges of the own shard the all-gather has handed out
        self._kept: np.ndarray | None = None  # the own shard's final values, once the result is handed on (keep_shard)
        self._kept_base: np.ndarray | None = None  # the host's spare buffer that _kept is a view of

    # ---- member -------------------------------------------------------------------------------------

    @property
    def _repair_pending(self) -> bool:
        ag = self._ag
        return bool(ag.ask or ag.settled or self._resend)

    def _repair_blocks(self) -> list[OutBlock]:
        """What repair has to send now: requests for the ranges of streams that ended short, done messages to owners
        whose stream has ended here, and the ranges members asked this owner for."""
        ag, live, out = self._ag, self._live, []
        for s in ag.ask:
            if not live[s] or ag.done[s]:
                continue
            missing = np.flatnonzero(~self._ag_seen[s])
            if not len(missing):
                continue
            ag.want_last[s] = int(missing[-1])
            if ag.round[s] == 1:
                self._asked_first[s] = len(missing)
            for body in nack_bodies(self.group_id, ag.round[s], missing, ag.expected[s], self._max_payload):
                out.append(OutBlock(s, _AG_NACK, one_row(body), NACK_REPEATS))
        ag.ask.clear()
        for s in ag.settled:
            if live[s] and not self._told[s]:
                self._told[s] = True
                done = pack_nack(self.group_id, NACK_DONE, ag.expected[s], 0)
                out.append(OutBlock(s, _AG_NACK, one_row(done), NACK_REPEATS))
        ag.settled.clear()
        for s, asked in self._resend.items():
            if live[s]:
                out.extend(self._resend_blocks(s, np.unique(np.concatenate(asked))))
        self._resend.clear()
        return out

    def _tell_all(self) -> None:
        """The all-gather ended: every owner not told yet hears that this member needs nothing more."""
        ag = self._ag
        if self._rounds:
            ag.settled.extend(s for s in range(self.n) if s != self.index and ag.expected[s] and not self._told[s])

    def _repaired(self) -> int:
        ag = self._ag
        return sum(max(0, first - (ag.expected[s] - ag.received[s])) for s, first in enumerate(self._asked_first)
                   if first)

    # ---- owner --------------------------------------------------------------------------------------

    def keep_shard(self, spare: Callable[[int], np.ndarray | None] | None = None) -> None:
        """The driver hands the result on while this owner still serves: from now on resends read a copy of the own
        shard, since the caller may reuse ``out`` at once (a member's step does not wait for others' repairs).
        ``spare(elements)``: a float32 buffer the host kept from a finished group, or None; a fresh one costs its
        page faults on every release, most of the copy's time for a shard of megabytes (``kept_buffer``: hand it
        back once the group is done)."""
        if self._kept is None and not self._coded:
            own = self._out[self._lo : self._hi]
            buf = spare(own.size) if spare is not None and own.dtype == F32_DTYPE else None
            if buf is None:  # (the fresh copy goes to the host's spares afterwards too: the next group's)
                self._kept = self._kept_base = own.copy()
            else:
                self._kept, self._kept_base = buf[: own.size], buf
                np.copyto(self._kept, own)

    @property
    def kept_buffer(self) -> np.ndarray | None:
        """The buffer ``keep_shard`` copied into (a spare, or its fresh copy), for the host to keep once the group is
        done."""
        return self._kept_base

    def _receive_nack(self, sender: int, body: bytes | memoryview, now: float) -> Outcome:
        """An AG_NACK from member ``sender``: a done message, or ranges of the own shard to resend it."""
        if type(sender) is not int or not 0 <= sender < self.n or sender == self.index:
            self._drops[Outcome.UNKNOWN_SENDER.reason] += 1
            return Outcome.UNKNOWN_SENDER
        if not self._rounds:
            self._drops[Outcome.REFUSED.reason] += 1
            return Outcome.REFUSED
        nack = parse_nack(body, self._rounds)
        if nack.total != self._nranges:
            raise WireError("malformed", f"nack for a stream of {nack.total} datagrams; this shard takes"
                            f" {self._nranges}")
        if not self._live[sender]:
            self._drops["late"] += 1
            return Outcome.LATE
        if nack.round == NACK_DONE:
            if sender not in self._awaiting:
                self._ends_ignored += 1
                return Outcome.DUPLICATE
            self._awaiting.discard(sender)
            if not self._serving:
                self.phase_changes += 1  # the driver may finish now
            return Outcome.ACCEPTED
        if self._serving_over or sender not in self._awaiting:  # (a member that said it is done asks no more: what
            self._ends_ignored += 1  # comes is a copy that outlived its request)
            return Outcome.DUPLICATE
        r = nack.round
        if r < self._served_round[sender]:  # a copy of an earlier round's request
            self._ends_ignored += 1
            return Outcome.DUPLICATE
        served = self._served[sender]
        if served is None:
            served = self._served[sender] = np.zeros(self._nranges, dtype=bool)
        if r > self._served_round[sender]:
            self._served_round[sender] = r
            served[:] = False
        ks = nack.missing[nack.missing < self._ag_out]
        if self._coded and len(ks):
            ks = ks[self._ag_sendable[ks]]
        fresh = ks[~served[ks]]
        if not len(fresh):
            self._ends_ignored += 1
            return Outcome.DUPLICATE
        served[fresh] = True
        self._resend.setdefault(sender, []).append(fresh)
        if self._serve_until is not None:
            self._serve_until = max(self._serve_until, now + SERVE_S)
        self.phase_changes += 1  # the driver sends them
        return Outcome.ACCEPTED

    def _resend_blocks(self, to: int, ks: np.ndarray) -> list[OutBlock]:
        """AG_DATA bodies of the own shard's ranges ``ks`` (ascending), as the all-gather sent them, for member
        ``to``: blocks of up to a block's rows."""
        per, lo, hi, total, group = self._per, self._lo, self._hi, self._nranges, self.group_id
        full = (hi - lo) // per
        weights = np.minimum(self._wsum, F32_MAX)
        out = []
        shard = self._out[lo:hi] if self._kept is None else self._kept
        kf = ks[ks < full]
        step = max(1, self._block_rows)
        for i in range(0, len(kf), step):
            kc = kf[i : i + step]
            if self._coded:
                bodies = pack_coded(group, self._cid, total, lo, per, weights[kc], self._ag_full[kc])
            else:
                rows = shard[: full * per].reshape(full, per)[kc]
                bodies = pack_block(group, total, lo, weights[kc], rows)
            bodies[:, 9:13] = (lo + kc * per).astype("<u4").view(np.uint8).reshape(-1, 4)
            out.append(OutBlock(to, _AG_DATA, bodies, 1))
        if len(ks) and int(ks[-1]) == full < total:  # the shard's short last range
            off = lo + full * per
            if self._coded:
                assert self._ag_tail is not None
                bodies = pack_coded(group, self._cid, total, off, hi - off, weights[full:], self._ag_tail)
            else:
                bodies = pack_block(group, total, off, weights[full:], shard[off - lo :].reshape(1, -1))
            out.append(OutBlock(to, _AG_DATA, bodies, 1))
        sent = sum(len(b.bodies) for b in out)
        self._ag.sent += sent
        self._resent += sent
        return out

    @property
    def _serving(self) -> bool:
        """This owner still serves requests: its phases have ended, members it heard from in this group are not
        all done with its stream, and SERVE_S has not passed since its phases ended or the latest request."""
        if not self._awaiting or self._serving_over:
            return False
        rs, ag, live = self._rs, self._ag, self._live
        return any(live[s] and (rs.received[s] or rs.end_seen[s] or ag.received[s] or ag.end_seen[s])
                   for s in self._awaiting)

    def _serve_timer(self, now: float) -> None:
        if self._serve_until is not None and now >= self._serve_until:
            self._serving_over = True
            self.phase_changes += 1
