"""What one group's member sends next (a part of ``GroupAverage``): its reduce-scatter contributions round-robin
over the owners, and its own shard's average to every other member as its ranges become final (all of it once the
own shard's reduce-scatter has ended).
Blocks are built lazily, about ``limit`` datagrams of work a call, so a driver can pace and interleave them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from ..compress import RoundingKey
from . import kernels
from .frames import END_REPEATS, F32_DTYPE, BodyType, pack_block, pack_coded, pack_end
from .kernels import F32_MAX, FINALIZE_BLOCK_ELEMENTS
from .phase import SEND_TRANSITIONS, SendEvent, Sending, State, advance

DEFAULT_BLOCK_ROWS = 32  # bodies per OutBlock unless the driver asks for another size (GSO: up to 64)
# A compressed codec encodes as it packs (int4 stochastic: ~30 ms for a block of 432 full datagrams): its blocks
# hold at most this many elements, and a ``blocks_to_send`` batch stops after about four of them, so one call stays
# a few milliseconds of work however many datagrams the driver asks for (fp32 packs by copying: no cap)
CODED_BLOCK_ELEMENTS = 1 << 16
CODED_BATCH_ELEMENTS = 1 << 18
_DONE = object()  # a send generator that is exhausted
_WAIT = object()  # the all-gather's next ranges are not final yet
# The all-gather hands out ranges that became final while the reduce-scatter runs in blocks of the driver's size
# (``rows``), at least this many (or the shard's rest): every block costs a pass through the driver per destination.
AG_MIN_ROWS = 32
_RS_DATA, _RS_END, _AG_DATA, _AG_END, _AG_NACK = (int(t) for t in BodyType)


class OutBlock(NamedTuple):
    """Bodies of equal size for member ``to``, envelope type ``type``, each sent ``repeat`` times (3 for
    END markers): ``bodies`` is (rows, body bytes) uint8, one body per row, ready for one GSO send."""

    to: int
    type: int
    bodies: np.ndarray
    repeat: int
    # With ``GroupAverage.split_values``: ``bodies`` holds only each body's tensor header and ``values`` the float32
    # values (rows, count) that follow it, a view of the vector or result: sealed straight from there, no packed copy.
    values: np.ndarray | None = None

    def whole(self) -> np.ndarray:
        """The complete bodies (rows, body bytes) uint8: ``bodies`` itself, or headers and values joined."""
        if self.values is None:
            return self.bodies
        return np.concatenate((self.bodies, np.ascontiguousarray(self.values, dtype=F32_DTYPE).view(np.uint8)), axis=1)


class Outgoing(NamedTuple):
    """A body to send: to member ``to`` with envelope type ``type``, ``repeat`` times (3 for END markers)."""

    to: int
    type: int
    body: bytes
    repeat: int



class Outbox:
    """GroupAverage's sending: its reduce-scatter contributions, and its averaged shard as its ranges become final,
    a block at a time."""

    def blocks_to_send(self, rows: int, limit: int, now: float | None = None) -> list[OutBlock]:
        """Blocks of at most ``rows`` bodies each, about ``limit`` bodies in all: the reduce-scatter's contributions
        first, then the all-gather of ranges of the own shard that are final (``ag_frontier``; once the own
        reduce-scatter phase has ended, all of it). An empty list means nothing to send until something changes. ``now``
        (the time they go): the call that hands out the last contribution starts the all-gather's silence there
        (``note_sent``)."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if self._coded:
            rows = min(rows, max(1, CODED_BLOCK_ELEMENTS // self._per))
            # (in whole turns of a block per destination: a slice that held one more block for one of them left
            # that destination alone on the uplink for a third of the slice, and several senders alone toward one
            # receiver at a time overflowed its downlink: `peerd bench step --link 10mbit`)
            turn = rows * max(1, self.n - 1)
            limit = min(limit, max(turn, CODED_BATCH_ELEMENTS // self._per // turn * turn))
        self._block_rows = rows
        batch: list[OutBlock] = self._repair_blocks() if self._rounds else []
        count = sum(len(b.bodies) for b in batch)
        while count < limit:
            # The own contributions first: every other owner's shard waits for them, the own average for nobody.
            # (The all-gather first, a member whose shard was final before its last contributions were out sent
            # its whole average, 0.6 s at 10 Mbit/s, while the three others waited for those: `peerd bench step
            # --link 10mbit`, one round in two 1.7 s instead of 1.2 s.)
            if self._rs_gen is not None:
                block = next(self._rs_gen, _DONE)
                if block is _DONE:
                    self._rs_gen = None
                    self.sending = advance(SEND_TRANSITIONS, self.sending, SendEvent.EXHAUSTED)
                    if now is not None:
                        self._contributions_out(now)
                    if self._ag_gen is _DONE:
                        self.sending = advance(SEND_TRANSITIONS, self.sending, SendEvent.EXHAUSTED)
                    continue
            else:
                block = self._next_ag()
                if block is None:  # a slice of work with nothing to send (robust norms): the driver's turn
                    break
                if block is _WAIT or block is _DONE:
                    break
            batch.append(block)  # type: ignore[arg-type]
            count += len(block.bodies)  # type: ignore[union-attr]
        return batch

    def _next_ag(self) -> OutBlock | object | None:
        """The all-gather's next block; _WAIT while its next ranges are not final, _DONE once it is all out, None
        for a slice of robust work."""
        gen = self._ag_gen
        if gen is _DONE:
            return _DONE
        if self.sending is Sending.HOLDING and self.reduce_scatter_done:
            self.sending = advance(SEND_TRANSITIONS, self.sending, SendEvent.SHARD_FINAL)
        if gen is None:
            if not (self._early or self.reduce_scatter_done):
                return _WAIT
            gen = self._ag_gen = self._ag_blocks()
        block = next(gen, _DONE)  # type: ignore[call-overload]
        if block is _DONE:
            self._ag_gen = _DONE
            if self.sending is not Sending.REDUCE_SCATTER:
                self.sending = advance(SEND_TRANSITIONS, self.sending, SendEvent.EXHAUSTED)
        elif block is not _WAIT and block is not None:
            self._ag_woken = False
        return block

    def _ag_need(self) -> int:
        """How far the own shard must be final for the all-gather's next block: a whole block more (the driver's
        ``rows``, at least AG_MIN_ROWS; fewer at the shard's end). Blocks then stay cheap, and as large as the
        reduce-scatter's: every member sends one block per destination in turn, i + 1, i + 2, ... (``_dest_order``),
        and only blocks of one size keep those turns in step across members, so that each receives one sender's
        block at a time. Smaller all-gather blocks between the reduce-scatter's (32 rows among GSO's 64) shifted
        the senders' turns against one another: two or three met at one downlink, overflowed its queue and cut
        their pacers (`peerd bench allreduce --peers 4 --size 5000000 --link 100mbit`: 0.62 of the link, 18
        pacer cuts a sender, against 0.93 and 6)."""
        k, total = self._ag_next, self._nranges
        full = (self._hi - self._lo) // self._per
        return min(k + max(AG_MIN_ROWS, self._block_rows), full) if k < full else total

    def sender_frontier(self, s: int) -> int:
        """How many leading ranges of the own shard sender ``s`` has settled: all of them once its stream is closed
        (its END and grace, or the phase's deadline: what is missing then is lost); else the ranges below the first
        one that has not arrived and is not lost. A datagram missing below the stream's top may be lost or only
        late (a path that reorders, jitter): it is taken for lost once the stream's later data has been arriving
        for the grace its END would get (``Phase.grace_s``: short on a path that keeps order, longer by how late
        its data came where it reorders), else waited for until the stream closes. Under loss, waiting for the
        close held every range after a stream's first lost datagram (one in twenty at 5 %) to the phase's end."""
        rs, total = self._rs, self._nranges
        if rs.done[s]:
            return total
        top = rs.top[s]
        if rs.received[s] >= top:  # every datagram below the top arrived (the usual case: no scan)
            return top
        c = max(self._contig[s], self._finalized)
        if c < total and self._rs_seen[s, c]:  # the first gap filled since: find the next one
            c = self._next_gap(s, c)
        while c < top and rs.grace > 0:  # a gap the stream's later data passed its grace ago is lost
            at = self._gap_at[s]
            if at is None or at[0] != c:
                self._gap_at[s] = (c, rs.t_last)  # (the latest arrival: no earlier than the one above the gap)
                break
            if rs.t_last - at[1] < rs.grace_s(s):
                break
            c = self._next_gap(s, c + 1)
        self._contig[s] = c
        return c

    def _next_gap(self, s: int, c: int) -> int:
        """The first range from ``c`` on that sender ``s``'s datagram has not reached (the shard's end: none)."""
        rest = self._rs_seen[s, c:]
        if not len(rest):
            return self._nranges
        gap = int(np.argmin(rest))
        return self._nranges if rest[gap] else c + gap

    def ag_frontier(self) -> int:
        """How many leading ranges of the own shard are final, or may be made final now: every other member's
        datagram for each arrived or is known lost (``sender_frontier``), or the reduce-scatter ended."""
        total = self._nranges
        if self.state is not State.REDUCE_SCATTER:
            return total
        if not self._early:
            return 0
        f = total
        done = self._rs.done
        for s in range(self.n):
            if not done[s]:
                f = min(f, self.sender_frontier(s))
        if self._robust is not None:  # a segment is decided, and its ranges averaged, once all of it is final
            f = self._seg_ends[bisect.bisect_right(self._seg_ends, f) - 1] if f >= self._seg_ends[0] else 0
        return f

    def ag_ready(self) -> bool:
        """Whether the all-gather's next block may go now (while the reduce-scatter phase runs)."""
        return self._early and self._ag_gen is not _DONE and self.ag_frontier() >= self._ag_need()

    def note_ready(self, sender: int | None) -> None:
        """After new reduce-scatter data from ``sender`` (None: a stream closed): when this member has nothing
        else to send and the all-gather's next block has become final, count a phase change, so the driver wakes
        up and sends it. Only a sender that reached the block can complete it: the others are not looked at.
        With ``robust`` deciding the shard's head early, the contributions' norms are measured meanwhile over the
        ranges already final, so that the decision waits for nothing but its last ranges."""
        if self._robust is not None and self._early and self.state is State.REDUCE_SCATTER:
            self._measure_ahead(sender)
        if (self.sending is not Sending.HOLDING or self._ag_woken or not self._early
                or self.state is not State.REDUCE_SCATTER):
            return
        need = self._ag_need()
        if sender is not None and self.sender_frontier(sender) < need:
            return
        if self._ag_gen is not _DONE and self.ag_frontier() >= need:
            self._ag_woken = True
            self.phase_changes += 1

    def _measure_ahead(self, sender: int | None) -> None:
        """Robust, while the reduce-scatter runs: measure the next whole slice of the undecided segment's ranges
        once every sender has settled it (a slice at a time, as ``_robust_step`` would at the decision)."""
        if self._scale is not None:
            return
        step = max(1, FINALIZE_BLOCK_ELEMENTS // self._per)
        end = min(self._seg_ends[self._seg], self._norm_pos + step)
        if end >= self._nranges or (sender is not None and self.sender_frontier(sender) < end):
            return  # (the last slice waits for the decision: the shard's end may be a short range)
        if all(self._rs.done[s] or self.sender_frontier(s) >= end for s in range(self.n) if s != self.index):
            self._robust_step()

    def datagrams_to_send(self, now: float, limit: int) -> list[Outgoing]:
        """``blocks_to_send`` one body at a time, for drivers (and tests) that send datagram by datagram (``now``:
        the contract's; what goes out depends only on what arrived, the pacing is the driver's)."""
        batch: list[Outgoing] = []
        while len(batch) < limit:
            if not self._left:
                blocks = self.blocks_to_send(self._block_rows, 1, now)
                if not blocks:
                    break
                for b in blocks:
                    self._left.extend(Outgoing(b.to, b.type, bytes(row), b.repeat) for row in b.whole())
            take = min(limit - len(batch), len(self._left))
            batch.extend(self._left[:take])
            del self._left[:take]
        return batch

    def _dest_order(self) -> list[int]:
        """The other members, starting after this one (i + 1, i + 2, ... mod n). The driver sends one part per
        destination in turn, so member i's k-th part goes to i + k: at any moment every member receives one
        sender's part, not several (in index order all senders began with member 0, then all but one moved
        to 2, and the lab's 4 peers met queues of ~9 ms at the downlinks that two or three senders shared)."""
        n, i = self.n, self.index
        return [(i + d) % n for d in range(1, n)]

    def _rs_blocks(self) -> Iterator[OutBlock]:
        """Round-robin over destinations a block at a time, so every owner sees a steady stream."""
        layout, per, group, w = self.layout, self.layout.per, self.group_id, self.weight
        vec = self._vec
        dests = self._dest_order()
        plan = {j: (*layout.shard(j), layout.datagrams(j)) for j in dests}
        rs, live, cid = self._rs, self._live, self._cid
        top = max((p[2] for p in plan.values()), default=-1)
        k = 0
        while k <= top:
            rows = self._block_rows
            for j in dests:
                start, stop, total = plan[j]
                if k > total or not live[j]:
                    continue
                full = (stop - start) // per
                k1 = min(k + rows, full)
                pieces = []
                if k < k1:
                    off = start + k * per
                    pieces.append((off, vec[off : start + k1 * per].reshape(k1 - k, per)))
                if full < total and k <= full < k + rows:  # the shard's short last range
                    off = start + full * per
                    pieces.append((off, vec[off:stop].reshape(1, -1)))
                for off, values in pieces:
                    if self._coded:
                        bodies = self._pack_coded(total, off, w, values, self._rs_key)
                    elif self.split_values:
                        rs.sent += len(values)
                        yield OutBlock(j, _RS_DATA, kernels.heads(group, total, off, w, values.shape), 1, values)
                        continue
                    else:
                        bodies = pack_block(group, total, off, w, values)
                    if len(bodies):
                        rs.sent += len(bodies)
                        yield OutBlock(j, _RS_DATA, bodies, 1)
                if k <= total < k + rows:
                    yield OutBlock(j, _RS_END, kernels.one_row(pack_end(group, total, start, w, cid)), END_REPEATS)
            k += rows

    def _encode(self, values: np.ndarray, key: RoundingKey, offset: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Codec bodies of ``values`` (rows of equal ranges from element ``offset``), and None, or when some row
        cannot be encoded (a value beyond the codec's range, or not finite: a local ValueError, never the
        network's), a mask of the rows that could; the others are zero and counted ``unencodable``."""
        codec = self.codec
        try:
            return codec.encode_block(values, key=key, offset=offset), None
        except ValueError:
            pass
        rows, count = values.shape
        out = np.zeros((rows, codec.body_size(count)), dtype=np.uint8)
        ok = np.ones(rows, dtype=bool)
        for i in range(rows):
            try:
                out[i] = codec.encode_block(values[i : i + 1], key=key, offset=offset + i * count)[0]
            except ValueError:
                ok[i] = False
        self._refused["unencodable"] += int(np.count_nonzero(~ok))
        return out, ok

    def _pack_coded(self, total: int, offset: int, weight: float | np.ndarray, values: np.ndarray,
                    key: RoundingKey) -> np.ndarray:
        """Reduce-scatter DATA bodies of a compressed codec; rows that cannot be encoded are left out."""
        count = values.shape[1]
        bodies, ok = self._encode(values, key, offset)
        block = pack_coded(self.group_id, self._cid, total, offset, count, weight, bodies)
        return block if ok is None else block[ok]

    def _ag_blocks(self) -> Iterator[OutBlock | None | object]:
        """The averaged own shard to every other member, its ranges as they become final (_WAIT: the next ones are
        not yet); each block is built once and sent to all. With ``robust``, once a segment (robust.segment_ends: the
        whole shard, or a part of a large one) is final, its contributions' norms are measured first, a slice per
        step (None: no block yet)."""
        per, group, total = self.layout.per, self.group_id, self._nranges
        lo, hi = self._lo, self._hi
        full = (hi - lo) // per
        out = self._out
        dests = self._dest_order()
        ahead = max(1, FINALIZE_BLOCK_ELEMENTS // per)
        ag, live = self._ag, self._live
        k = 0
        while k < total:
            self._ag_next = k
            ready = self.ag_frontier()
            if ready < total and ready < self._ag_need():
                yield _WAIT
                continue
            k1 = min(k + self._block_rows, full, ready) if k < full else total
            if self._finalized < k1:
                if self._robust is not None and not self._robust_ready():
                    yield None
                    continue
                self._finalize_through(min(ready, max(k1, k + ahead)))
            weights = np.minimum(self._wsum[k:k1], F32_MAX)
            off = lo + k * per
            if self._coded:  # the bodies encoded when these ranges were finalized
                coded = self._ag_full[k:k1] if k < full else self._ag_tail
                assert coded is not None
                bodies = pack_coded(group, self._cid, total, off, per if k < full else hi - off, weights, coded)
                sendable = self._ag_sendable[k:k1]
                if not sendable.all():
                    bodies = bodies[sendable]
            else:
                values = out[off : min(hi, lo + k1 * per)].reshape(k1 - k, -1)
                if self.split_values:
                    heads = kernels.heads(group, total, off, weights, values.shape)
                    for j in dests:
                        if live[j]:
                            ag.sent += len(heads)
                            yield OutBlock(j, _AG_DATA, heads, 1, values)
                    k = self._ag_out = k1
                    continue
                bodies = pack_block(group, total, off, weights, values)
            if len(bodies):
                for j in dests:
                    if live[j]:
                        ag.sent += len(bodies)
                        yield OutBlock(j, _AG_DATA, bodies, 1)
            k = self._ag_out = k1
        end = kernels.one_row(pack_end(group, total, lo, 0.0, self._cid))
        for j in dests:
            if live[j]:
                yield OutBlock(j, _AG_END, end, END_REPEATS)

