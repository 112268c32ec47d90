"""What arrives at one group's member (a part of ``GroupAverage``): each body or GRO block is checked against the
group's layout and the sender's weight, counted once, and its values land in the stage, the running sums or the
result. O(1) Python per body plus O(datagram) numpy; a block is one native call where the extension is built.
"""

from __future__ import annotations

import enum
import math
import struct

import numpy as np

from ..wire.errors import WireError
from . import kernels
from .frames import F32_DTYPE, HEADER_SIZE, BodyType, check_header, view_block, view_coded
from .phase import COMPLETION, Phase

_GROUP = struct.Struct("<I")
_RS_DATA, _RS_END, _AG_DATA, _AG_END, _AG_NACK = (int(t) for t in BodyType)


class Outcome(enum.Enum):
    """What ``receive`` did with a body that was not malformed."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # a range (or END) this sender already delivered: not counted twice
    LATE = "late"  # the phase it belongs to has ended at this receiver
    OTHER_GROUP = "other_group"  # another group's body (a straggler from an earlier round)
    UNKNOWN_SENDER = "unknown_sender"  # sender index out of range, or this member itself
    REFUSED = "nack"  # an AG_NACK to an owner that does not repair

    @property
    def reason(self) -> str:
        """The drop reason it is counted under (GroupStats.drops, peerd_datagrams_dropped_total{reason})."""
        return _REASONS.get(self, self.value)


_REASONS = {Outcome.OTHER_GROUP: "group", Outcome.UNKNOWN_SENDER: "sender"}



class Intake:
    """GroupAverage's receiving: bodies and GRO blocks into the stage, the running sums or the result."""

    def receive(self, sender: int, mtype: int, body: bytes | memoryview, now: float) -> Outcome:
        """Take one body of envelope type ``mtype`` from member ``sender``.

        Malformed bodies are counted and raise WireError("malformed") (WireError("type") for a type that
        is not 0x40..0x43); everything else that is not used is counted and reported as an Outcome.
        """
        try:
            return self._receive(sender, mtype, body, now)
        except WireError as e:
            self._drops[e.reason] += 1
            raise

    def _receive(self, sender: int, mtype: int, body: bytes | memoryview, now: float) -> Outcome:
        if len(body) >= 4 and _GROUP.unpack_from(body)[0] != self.group_id:
            self._drops[Outcome.OTHER_GROUP.reason] += 1
            return Outcome.OTHER_GROUP
        if mtype == _AG_NACK:
            return self._receive_nack(sender, body, now)
        _, _, total, offset, count, weight = check_header(mtype, body, self.codec)
        if type(sender) is not int or not 0 <= sender < self.n or sender == self.index:
            self._drops[Outcome.UNKNOWN_SENDER.reason] += 1
            return Outcome.UNKNOWN_SENDER
        if not self._live[sender]:  # removed (remove_member): given up on, as a phase deadline gives up
            return self._late(mtype)
        if mtype == _RS_DATA:
            # the hot path: checks inlined rather than Layout.index_of, O(1) Python, two numpy calls
            rel = offset - self._lo
            k, r = divmod(rel, self._per)
            if total != self._nranges or rel < 0 or r or k >= total or count != min(self._per, self._hi - offset):
                self.layout.index_of(self.index, offset, count)  # raises the precise error
                raise WireError("malformed", f"stream of {total} datagrams, this shard takes {self._nranges}")
            self._check_weight(sender, weight)
            seen = self._rs_seen[sender]
            if seen[k]:
                self._drops["duplicate"] += 1
                return Outcome.DUPLICATE
            rs = self._rs
            if rs.ended_at is not None:
                return self._late(mtype)
            if k < self._finalized:
                return self._late_final(sender, k, now)
            if self._coded:  # decoded and validated before anything is marked: CodecError is a malformed drop
                self._stage[sender, rel : rel + count] = self.codec.decode(memoryview(body)[HEADER_SIZE:], count)
            elif self._stream:
                self._add_rows(sender, np.frombuffer(body, np.uint8)[None, :], np.array([k], np.int64), 4 * count)
            else:
                at = 4 * rel
                self._stage_bytes[sender][at : at + 4 * count] = memoryview(body)[HEADER_SIZE:]
            seen[k] = True
            rs.weight_received += weight
            if rs.note_data(sender, k, now):
                self.phase_changes += 1  # the deadline moved earlier (the tail's grace): the driver re-reads it
            if rs.open == 0:
                self._end_rs(now, COMPLETION)
            else:
                self.note_ready(sender)
            return Outcome.ACCEPTED

        if mtype == _RS_END:
            rs = self._rs
            if total != self._nranges or offset != self._lo:
                raise WireError(
                    "malformed",
                    f"END of a {total}-datagram stream at {offset}; shard [{self._lo}, {self._hi})"
                    f" takes {self._nranges}",
                )
            self._check_weight(sender, weight)
            if rs.end_seen[sender]:
                self._ends_ignored += 1
                return Outcome.DUPLICATE
            if rs.ended_at is not None:
                return self._late(mtype)
            rs.note_end(sender, now)
            if rs.ending:
                self.phase_changes += 1  # the deadline moved earlier (an END's grace): the driver re-reads it
            if rs.open == 0:
                self._end_rs(now, COMPLETION)
            else:
                self.note_ready(None)
            return Outcome.ACCEPTED

        ag = self._ag
        expected = ag.expected[sender]
        if total != expected:
            raise WireError("malformed", f"stream of {total} datagrams, shard {sender} takes {expected}")
        if mtype == _AG_DATA:
            k = self.layout.index_of(sender, offset, count)
            seen = self._ag_seen[sender]
            if seen[k]:
                self._drops["duplicate"] += 1
                return Outcome.DUPLICATE
            if ag.ended_at is not None:
                return self._late(mtype)
            if self._coded:  # a valid body decodes to finite values
                self._out[offset : offset + count] = self.codec.decode(memoryview(body)[HEADER_SIZE:], count)
                seen[k] = True
                ag.weight_received += weight
            elif np.isfinite(np.frombuffer(body, F32_DTYPE, count, HEADER_SIZE)).all():
                seen[k] = True
                self._out_bytes[4 * offset : 4 * (offset + count)] = memoryview(body)[HEADER_SIZE:]
                ag.weight_received += weight
            else:  # a broken or hostile owner: this range keeps the own values (counts as arrived)
                seen[k] = True
                self._ag_kept += 1
                self._refused["nonfinite"] += 1
                if not self._inplace:
                    self._out[offset : offset + count] = self._vec[offset : offset + count]
            if ag.note_data(sender, k, now) or ag.settled:
                self.phase_changes += 1  # (a stream that ended: its owner is told, which the driver sends)
        else:
            start = self.layout.shard(sender)[0]
            if offset != start:
                raise WireError("malformed", f"END offset {offset}, shard {sender} starts at {start}")
            if ag.end_seen[sender]:
                self._ends_ignored += 1
                return Outcome.DUPLICATE
            if ag.ended_at is not None:
                return self._late(mtype)
            ag.note_end(sender, now)
            if ag.ending or ag.ask or ag.settled:
                self.phase_changes += 1
        if ag.open == 0 and self._rs.ended_at is not None:
            self._end_ag(now, COMPLETION)
        return Outcome.ACCEPTED

    def receive_block(self, sender: int, mtype: int, bodies: np.ndarray, now: float) -> tuple[int, int, int] | None:
        """Take many full-size DATA bodies of type ``mtype`` from ``sender`` at once (one GRO block):
        vectorized checks, one copy into place, O(1) Python. Returns (accepted, duplicates, late), or None
        when the block is not a clean run of this group's ranges; the caller then feeds it to ``receive``
        body by body, which finds and counts whatever is wrong."""
        if mtype != _RS_DATA and mtype != _AG_DATA:
            return None
        if type(sender) is not int or not 0 <= sender < self.n or sender == self.index or not self._live[sender]:
            return None  # (a removed sender's rows: ``receive`` counts them late one by one)
        if mtype == _RS_DATA and self._finalized and self._rs.ended_at is None and self._under_final(bodies):
            return None  # (rows for ranges already final: ``receive`` counts them late one by one)
        per, coded = self._per, self._coded
        if self._take and bodies.shape[1] == HEADER_SIZE + 4 * per and kernels.native_rows(bodies):
            taken = self._take_native(sender, mtype, bodies, now)
            if taken is not None:
                return taken
        if self._take_bits and bodies.shape[1] == HEADER_SIZE + self._body_per and kernels.native_rows(bodies):
            taken = self._take_native(sender, mtype, bodies, now, coded=True)
            if taken is not None:
                return taken
        if coded:
            rec = view_coded(bodies) if bodies.shape[1] == HEADER_SIZE + self._body_per else None
        else:
            rec = view_block(bodies)
            if rec is not None and rec.dtype["values"].shape != (per,):
                return None
        if rec is None:
            return None
        rows = len(rec)
        first = rec[0]
        w0 = float(first["weight"])
        if mtype == _RS_DATA:
            start, stop, phase, total = self._lo, self._hi, self._rs, self._nranges
            known = self._sender_weight[sender]
            if not (0.0 < w0 < math.inf) or (known is not None and known != w0):
                return None
            same = 19  # group, codec, total, offset (checked below), count and weight: all as in row 0
        else:
            start, stop = self.layout.shard(sender)
            phase, total = self._ag, self._ag.expected[sender]
            same = 15  # the weight is per range in the all-gather
        if (int(first["group"]) != self.group_id or int(first["codec"]) != self._cid or int(first["count"]) != per
                or int(first["total"]) != total):
            return None
        # Every row as row 0 but for the offset (bytes 9..13): natively a memcmp per row where the rows lie, else as
        # bytes (a fifth of numpy's ``==``, after a strided copy of each row's head).
        if rows > 1 and not kernels.same_heads(bodies, 9, same):
            return None
        if mtype == _AG_DATA and not (
            np.isfinite(rec["weight"]).all() and (rec["weight"] >= 0).all()
            and (coded or kernels.values_finite(bodies, 4 * per))
        ):
            return None  # body by body: ``receive`` finds the range that is not finite and keeps own values
        full = (stop - start) // per
        k0, r = divmod(int(first["offset"]) - start, per)
        consecutive = rows == 1 or rec["offset"].tobytes() == np.arange(  # as bytes: a third of numpy's ==
            first["offset"], first["offset"] + rows * per, per, dtype="<u4").tobytes()
        if consecutive:
            if r or k0 < 0 or k0 + rows > full:
                return None
            ks: np.ndarray | slice = slice(k0, k0 + rows)
            k_last = k0 + rows - 1
        else:
            rel = rec["offset"].astype(np.int64) - start
            ks = rel // per
            if (rel - ks * per).any() or ks[0] < 0 or ks.max() >= full or not (np.diff(ks) > 0).all():
                return None
            k_last = int(ks[-1])
        seen = self._rs_seen[sender] if mtype == _RS_DATA else self._ag_seen[sender]
        # Values are copied as bytes: in the packed records they sit at odd offsets, and numpy's
        # unaligned float32 copy is several times slower than a byte copy.
        values, weights = bodies[:, HEADER_SIZE:], rec["weight"]
        was = seen[ks]
        duplicates = int(np.count_nonzero(was))  # (count_nonzero: a tenth of .any()'s reduction machinery)
        accepted = rows - duplicates
        late = phase.ended_at is not None
        if duplicates and accepted and not late:
            fresh = ~was
            idx = np.arange(k0, k0 + rows) if isinstance(ks, slice) else ks
            ks, values, weights = idx[fresh], values[fresh], weights[fresh]
            k_last = int(ks[-1])
        decoded = None
        if coded and accepted and not late:  # decoded before anything changes: a bad row sends the block back
            decoded, ok = self.codec.decode_block(values, per)
            if not ok.all():
                return None  # body by body: ``receive`` counts exactly the malformed rows
        if duplicates:
            self._drops["duplicate"] += duplicates
        if late:  # as in ``receive``: a duplicate is a duplicate, the rest is late
            self._drops["late"] += accepted
            return 0, duplicates, accepted
        if not accepted:
            return 0, duplicates, 0
        seen[ks] = True
        if mtype == _RS_DATA:
            if known is None:
                self._check_weight(sender, w0)
            if decoded is not None:
                self._stage[sender, : full * per].reshape(full, per)[ks] = decoded
            elif self._stream:
                if isinstance(ks, slice):
                    self._add_rows(sender, bodies, np.arange(ks.start, ks.stop, dtype=np.int64), 4 * per)
                else:
                    self._add_rows(sender, bodies if len(ks) == rows else bodies[fresh], ks, 4 * per)
            elif not (isinstance(ks, slice)
                      and kernels.place(bodies, self._stage[sender], 4 * per * ks.start, 4 * per)):
                self._stage[sender, : full * per].view(np.uint8).reshape(full, 4 * per)[ks] = values
            phase.weight_received += w0 * accepted
        else:
            if decoded is not None:
                self._out[start : start + full * per].reshape(full, per)[ks] = decoded
            elif not (isinstance(ks, slice)
                      and kernels.place(bodies, self._out, 4 * (start + per * ks.start), 4 * per)):
                self._out[start : start + full * per].view(np.uint8).reshape(full, 4 * per)[ks] = values
            phase.weight_received += float(weights.sum(dtype=np.float64))
        self._noted_block(phase, sender, mtype, accepted, k_last, now)
        return accepted, duplicates, 0

    def _take_native(self, sender: int, mtype: int, bodies: np.ndarray, now: float,
                     coded: bool = False) -> tuple[int, int, int] | None:
        """receive_block in one native call: a plain fp32 block (take.c take_rows: the values into the sums or the
        result) or, ``coded``, an int8 or int4 block (take_coded: decoded into the sender's stage row or the
        result), with the run's checks and the seen bitmap. None, with nothing changed, for a block it does not
        take (a late phase, a block that is not a clean run, a body that does not decode): receive_block's numpy
        path, the reference, then does, and counts what is wrong."""
        per, rows = self._per, len(bodies)
        status = self._take_status
        if len(status) < rows:
            status = self._take_status = np.empty(max(rows, 1024), dtype=np.uint8)
        if coded:
            take, extra = kernels.native.take_coded, {"bits": self._take_bits, "qgroup": self.codec.group}  # type: ignore[attr-defined]
        else:
            take, extra = kernels.native.take_rows, {"filled": self._acc_set, "wsum": self._wsum_in}
        if mtype == _RS_DATA:
            phase, known = self._rs, self._sender_weight[sender]
            if (not coded and not self._stream) or phase.ended_at is not None:
                return None
            lo = self._lo
            if not coded:
                extra["max_weight"] = self._max_weight
            taken = take(bodies, bodies.strides[0], rows, mode=0, group=self.group_id, codec=self._cid, per=per,
                         total=self._nranges, start=lo, full=(self._hi - lo) // per,
                         known=math.nan if known is None else known, seen=self._rs_seen[sender],
                         dst=self._stage[sender] if coded else self._acc, dst_base=0, status=status, **extra)
        else:
            phase = self._ag
            if phase.ended_at is not None:
                return None
            start, stop = self.layout.shard(sender)
            if not coded:
                extra["max_weight"] = 0.0
            taken = take(bodies, bodies.strides[0], rows, mode=1, group=self.group_id, codec=self._cid, per=per,
                         total=phase.expected[sender], start=start, full=(stop - start) // per, known=math.nan,
                         seen=self._ag_seen[sender], dst=self._out, dst_base=start, status=status, **extra)
        if taken is None:
            return None
        accepted, duplicates, k_last, w0, weights, odd = taken
        if duplicates:
            self._drops["duplicate"] += duplicates
        if not accepted:
            return 0, duplicates, 0
        if mtype == _RS_DATA:
            if known is None:
                self._check_weight(sender, w0)
            if odd:  # (fp32 only: a decoded body is finite and never overflows)
                self._take_odd(sender, bodies, status[:rows])
            phase.weight_received += w0 * accepted
        else:
            phase.weight_received += weights
        self._noted_block(phase, sender, mtype, accepted, k_last, now)
        return accepted, duplicates, 0

    def _noted_block(self, phase: Phase, sender: int, mtype: int, accepted: int, k_last: int, now: float) -> None:
        """A block's ``accepted`` new rows noted in their phase, which ends once every stream is complete."""
        if phase.note_block(sender, accepted, k_last, now) or phase.settled:
            self.phase_changes += 1
        if phase.open == 0:
            if mtype == _RS_DATA:
                self._end_rs(now, COMPLETION)
            elif self._rs.ended_at is not None:
                self._end_ag(now, COMPLETION)
        elif mtype == _RS_DATA:
            self.note_ready(sender)

    def _under_final(self, bodies: np.ndarray) -> bool:
        """Whether a reduce-scatter block holds a row for a range of the own shard that is final already (or an
        offset below the shard: ``receive`` finds it malformed)."""
        offsets = np.frombuffer(np.ascontiguousarray(bodies[:, 9:13]).tobytes(), "<u4")
        return int(offsets.min()) < self._lo + self._finalized * self._per

    def _late_final(self, sender: int, k: int, now: float) -> Outcome:
        """A reduce-scatter datagram for range ``k``, final already (its average may be out): late, not summed, but
        it still counts for its stream (which may complete by it)."""
        self._rs_seen[sender, k] = True
        self._drops["late"] += 1
        rs = self._rs
        if rs.note_data(sender, k, now):
            self.phase_changes += 1
        if rs.open == 0:
            self._end_rs(now, COMPLETION)
        return Outcome.LATE

    def _take_odd(self, sender: int, bodies: np.ndarray, status: np.ndarray) -> None:
        """What take_rows did not add of a reduce-scatter block, as ``_add_rows`` counts it: rows refused for a NaN
        or inf (status 1), and rows whose float32 sum would overflow (2), kept aside for the float64 sum."""
        refused = int(np.count_nonzero(status == 1))
        if refused:
            self._refused["nonfinite"] += refused
        ws = min(self._sender_weight[sender], self._max_weight)  # type: ignore[type-var]
        length = 4 * self._per
        for i in np.flatnonzero(status == 2).tolist():
            k = (int.from_bytes(bodies[i, 9:13].tobytes(), "little") - self._lo) // self._per
            values = np.frombuffer(bytes(bodies[i, HEADER_SIZE : HEADER_SIZE + length]), F32_DTYPE)
            self._aside.setdefault(k, []).append((ws, values))

    def _check_weight(self, sender: int, weight: float) -> None:
        """A sender has one weight; a body that says otherwise is corrupt (it would skew the sums)."""
        known = self._sender_weight[sender]
        if known is None:
            self._sender_weight[sender] = weight
            if weight > self._max_weight:
                self._refused["weight_capped"] += 1
        elif known != weight:
            raise WireError("malformed", f"sender {sender} changed its weight from {known} to {weight}")

    def _add_rows(self, sender: int, bodies: np.ndarray, ks: np.ndarray, length: int) -> None:
        """Streaming: add ``sender``'s reduce-scatter rows for ranges ``ks`` into the sums. A row with NaN or inf is
        refused (as if lost); one whose float32 sum would overflow is kept for the float64 sum at finalizing."""
        ws = min(self._sender_weight[sender], self._max_weight)  # type: ignore[type-var]
        ks = np.ascontiguousarray(ks, dtype=np.int64)
        status = kernels.accumulate(bodies, length, self._acc, self._per, ks, self._acc_set, ws)
        if np.count_nonzero(status):
            refused = int(np.count_nonzero(status == 1))
            if refused:
                self._refused["nonfinite"] += refused
            for i in np.flatnonzero(status == 2):
                values = np.frombuffer(bytes(bodies[i, HEADER_SIZE : HEADER_SIZE + length]), F32_DTYPE)
                self._aside.setdefault(int(ks[i]), []).append((ws, values))
            ks = ks[status != 1]
        self._wsum_in[ks] += ws

    def _late(self, mtype: int) -> Outcome:
        if mtype in (BodyType.RS_END, BodyType.AG_END):
            self._ends_ignored += 1  # the repeats of a stream's END routinely outlive its phase
        else:
            self._drops["late"] += 1
        return Outcome.LATE
