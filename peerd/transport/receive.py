"""The receive policy, sans-I/O: what a receive pass accepts, refuses, handles first and counts, and how long the
loop waits before the next pass. The trio endpoint (transport/endpoint.py) and the native pass (dataplane.c
recv_batch, which rations in C with the same table) only carry these decisions out.

- **Per datagram**: ``screen`` says whether a datagram's peeked header may be opened (and whether its source is
  charged a key derivation for it) or is refused unopened, and why.
- **Per pass**: ``urgent`` picks the small PINGs and PONGs that go before the rest of a batch; ``ration`` gives the
  per-source rationing of key derivations for datagrams under unknown tokens; ``receive_pass`` ends a pass and
  queues its ``PassDecision`` (pause under a junk flood, a coalescing wait for a trickle of tensor data, or none)
  for ``take_actions``.
- **Counts**: drops and accepted datagrams are counted in plain ints while a pass runs and drained once per pass
  (``take_counts``); ``accepted`` is the one place where an accepted datagram's (type, source, bytes) is known.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ..wire import messages as m
from ..wire.envelope import FLAG_SEALED, HEADER_SIZE, MAGIC, SEQ_OFFSET, VERSION
from ..wire.seal import TAG_SIZE

# Under a flood of junk (datagrams refused before any crypto), every wakeup of the receive loop costs 150-250 us
# of CPU on a VM (the process sleeps and is woken, epoll, trio's loop with cold caches) and brings only a few
# datagrams. While junk arrives faster than JUNK_RATE a second, the loop pauses after a pass that drained the
# socket, long enough for about JUNK_BATCH datagrams of junk to queue (at most JUNK_PAUSE_S), and takes them in one
# wakeup: interrupt moderation. What arrives meanwhile (PINGs included) waits at most JUNK_PAUSE_S; a full pass
# never pauses, and quiet traffic never does.
JUNK_RATE = 1000.0
JUNK_BATCH = 64
JUNK_PAUSE_S = 0.008
# A node whose authenticated traffic is below BUSY_RATE a second (liveness PINGs, the odd DHT request: no
# average running) has nothing that needs the short pause: it takes the flood in batches of about JUNK_IDLE_BATCH,
# at most JUNK_IDLE_PAUSE_S apart, which is what brings the junk's CPU per datagram down (`peerd bench soak`'s
# outsider_cpu_us_per_datagram). A request that comes then waits at most JUNK_IDLE_PAUSE_S; traffic at BUSY_RATE
# brings the short pause back within the window that shows it.
JUNK_IDLE_BATCH = 256
JUNK_IDLE_PAUSE_S = 0.032
BUSY_RATE = 200.0
JUNK_WINDOW_S = 0.1  # the junk rate is measured over windows of this length
# A pass that took a few blocks of tensor data and emptied the socket waits before the next: on a paced, shaped
# link without GRO, data arrives a datagram at a time, and each pass's fixed cost (the event loop, a block's Python
# per source) would be paid for a few dozen datagrams. Waiting cuts the receive passes and the CPU of an average
# several-fold at the same link use (`peerd bench allreduce --peers 4 --size 5000000 --link 100mbit --json`:
# cpu_s_per_peer, link_utilization). The first trickle pass waits COALESCE_FIRST_S, the ones after it in a row (a
# paced stream) COALESCE_S: a small average's few datagrams, which the wait only delays, pay the short one.
COALESCE_FIRST_S = 0.001
COALESCE_S = 0.006
COALESCE_BELOW = 128  # datagrams: a pass that took more is not a trickle
URGENT_BYTES = 512  # a PING or PONG at most this long goes before the rest of its receive batch

_PING, _PONG = int(m.MsgType.PING), int(m.MsgType.PONG)
_HEAD = MAGIC + bytes([VERSION])
_TOKEN = struct.Struct("!Q")  # a header's token, at byte 5 (wire.envelope.HEADER)

# ``screen``'s and ``PassRation.decide``'s verdicts besides a refusal's reason
OPEN = ""  # open it (its token is known, or the endpoint does not seal)
DERIVE = "derive"  # open it, deriving its token's key (the source was charged for that just now)
REFUSE = "auth_limited"  # refused unopened: its source may not derive a key now


@dataclass(frozen=True, slots=True)
class PassDecision:
    """The action a pass ends with: the loop waits ``pause`` seconds (0: goes on at once, after a checkpoint);
    ``why`` is ``"junk"`` (interrupt moderation under a flood), ``"trickle"`` (let tensor data queue) or ``""``."""

    pause: float
    why: str


@dataclass(frozen=True, slots=True)
class ReceiveStatistics:
    """A snapshot of the receive policy: the measured rates, passes and their pauses, the last catch-up."""

    junk_rate: float
    honest_rate: float
    passes: int
    junk_pauses: int
    trickle_pauses: int
    caught_up_at: float


def before_own_data(batch: Sequence[tuple[Any, Hashable, int]], urgent: list[int]) -> list[int]:
    """The indices of ``urgent`` (ascending) whose source sent no tensor data before them in ``batch``."""
    keep: list[int] = []
    sending: set[Hashable] = set()  # sources with tensor data so far
    marks = iter(urgent)
    mark = next(marks)
    for i, (data, source, _) in enumerate(batch):
        if i == mark:
            if source not in sending:
                keep.append(i)
            mark = next(marks, -1)
            if mark < 0:
                break
        elif len(data) > 3 and data[3] > m.CONTROL_MAX and data[:3] == _HEAD:  # (PD, version, a data type)
            sending.add(source)
    return keep


def rows_share_head(data: Any, rows: int, segment: int) -> bool:
    """Whether every row of a GRO block has the first row's header up to its token (SEQ_OFFSET): a merged run
    of one sender's datagrams, which one decision may refuse together."""
    if segment < SEQ_OFFSET:
        return False
    first = data[:SEQ_OFFSET]
    return all(data[k : k + SEQ_OFFSET] == first for k in range(segment, rows * segment, segment))


class PassRation:
    """One pass's rationing of key derivations for datagrams under tokens this node does not know (the native
    pass's ``unknown``). A source gets one derivation a pass, and once refused one it stays refused for the rest of
    the pass (``now`` is the same and the limiter's buckets only empty within a pass), so the rest of a flood from
    it costs a set lookup each. Once a key was derived in the pass, a later datagram whose token is known by then
    is opened. ``rationed``: the native pass rationed in C already and granted the first datagram's derivation."""

    __slots__ = ("_granted", "_may_derive", "_rationed", "_refusing", "_token_known")

    def __init__(self, may_derive: Callable[[Hashable, float], bool], token_known: Callable[[int], bool],
                 rationed: bool) -> None:
        self._may_derive, self._token_known, self._rationed = may_derive, token_known, rationed
        self._refusing: set[Hashable] = set()  # sources refused a derivation in this pass before any was granted
        self._granted: set[Hashable] = set()  # sources granted one

    def decide(self, data: Any, source: Hashable, now: float) -> str:
        """``DERIVE``, ``OPEN`` or ``REFUSE`` for one datagram under a token unknown when the pass began."""
        granted = self._granted
        if self._rationed and not granted:
            granted.add(source)
            return DERIVE
        if source in self._refusing:
            return REFUSE
        if granted and self._token_known(_TOKEN.unpack_from(data, 5)[0]):
            return OPEN
        if source in granted:
            return REFUSE
        if self._may_derive(source, now):
            granted.add(source)
            return DERIVE
        if not granted:  # (after a derivation, a later datagram of its may have a token known by then)
            self._refusing.add(source)
        return REFUSE


class ReceivePolicy:
    """The receive loop's decisions and counts for one node. ``limiter``: the node's AuthLimiter (its ``failed``
    and ``may_derive``); ``sealed``: whether the node opens sealed datagrams only."""

    def __init__(self, limiter: Any, *, sealed: bool = True, junk_pause_s: float = JUNK_PAUSE_S,
                 junk_idle_pause_s: float = JUNK_IDLE_PAUSE_S) -> None:
        self.limiter = limiter
        self.sealed = sealed
        self.junk_pause_s = junk_pause_s
        self.junk_idle_pause_s = junk_idle_pause_s
        self.junk_rate = 0.0  # junk datagrams a second, over the last whole window
        self.honest_rate = 0.0  # the other datagrams (authenticated, or refused after opening) a second, the same
        self._window_at = -math.inf
        self._junk_count = 0
        self._honest_count = 0
        # this pass's counts (plain ints: a Prometheus inc with labels costs about as much as refusing a datagram)
        self.drops: dict[str, int] = {}
        self.received: dict[int, int] = {}  # message type (every data type as 0x40) -> datagrams accepted
        self.junk = 0  # datagrams of the current pass refused unopened or failing to open
        self.answers = 0  # answers to this node's requests in the current pass
        self.data_blocks = 0  # blocks (or single datagrams) of tensor data opened in the current pass
        self.caught_up_at = -math.inf  # when the last pass that emptied the socket began
        self._trickles = 0  # trickle passes in a row
        self._wake_at: float | None = None
        self._actions: list[PassDecision] = []  # one decision per pass, until take_actions
        self._passes = self._junk_pauses = self._trickle_pauses = 0

    # -- per datagram ------------------------------------------------------------------------------------------
    def screen(self, flags: int, token_known: bool, length: int, source: Hashable, now: float) -> str:
        """Whether a datagram whose header peeked well may be opened: ``OPEN``, ``DERIVE`` (its source was charged
        a key derivation), or the reason it is refused unopened (an unsealed datagram under an unknown token
        charges its source an authentication failure)."""
        if not self.sealed or token_known:
            return OPEN
        if not flags & FLAG_SEALED:
            self.limiter.failed(source, 1, now)
            return "auth"
        if length < HEADER_SIZE + TAG_SIZE:
            return "malformed"
        if not self.limiter.may_derive(source, now):
            return REFUSE
        return DERIVE

    def screen_rows(self, flags: int, token_known: bool, segment: int, source: Hashable, now: float) -> str | None:
        """The reason a GRO block whose rows share one header (``rows_share_head``) is refused whole, or None when
        its rows must be handled one by one: only a sealed header under an unknown token, too short or from a
        source out of derivations, is refused together."""
        if not self.sealed or not flags & FLAG_SEALED or token_known:
            return None
        if segment < HEADER_SIZE + TAG_SIZE:
            return "malformed"
        if not self.limiter.may_derive(source, now):
            return REFUSE
        return None

    def ration(self, token_known: Callable[[int], bool], rationed: bool) -> PassRation:
        """The rationing of one pass's datagrams under unknown tokens (see PassRation)."""
        return PassRation(self.limiter.may_derive, token_known, rationed)

    @staticmethod
    def urgent(batch: Sequence[tuple[Any, Hashable, int]]) -> list[int]:
        """The indices of the batch's small PINGs and PONGs to handle before the rest, so that a member's liveness
        check and this node's own requests do not queue behind a batch of junk or tensor data.

        One that came after tensor data from its own source keeps its place: its sealer numbered it after that
        data, and a pass can hold tens of thousands of one member's datagrams (its sequence numbers shared with
        its other destinations), so opening it first would move the replay window past data that then reads as
        replayed (`peerd bench allreduce --peers 4 --size 25000000`: received_fraction). That member's data shows
        it alive."""
        if len(batch) < 2:
            return []
        urgent = [i for i, (data, _, segment) in enumerate(batch)
                  if not segment and 3 < len(data) <= URGENT_BYTES and data[3] in (_PING, _PONG)]
        if urgent and urgent[-1] >= len(urgent):  # something came before one of them: after its source's data?
            urgent = before_own_data(batch, urgent)
        return urgent

    # -- counts --------------------------------------------------------------------------------------------------
    def refused(self, reason: str, n: int = 1) -> None:
        """Datagrams refused before or at opening (junk: what paces the receive loop under a flood)."""
        drops = self.drops
        drops[reason] = drops.get(reason, 0) + n
        self.junk += n

    def dropped(self, reason: str, n: int = 1) -> None:
        """Datagrams dropped after opening (or not junk: an overloaded pass's shedding, an unsendable answer)."""
        drops = self.drops
        drops[reason] = drops.get(reason, 0) + n

    def accepted(self, mtype: int, source: Hashable, nbytes: int, datagrams: int = 1) -> None:
        """``datagrams`` of ``mtype`` (``nbytes`` together) from ``source`` were opened and handed on: the one place
        where an accepted datagram's sender, size and kind are known together."""
        key = mtype if mtype <= m.CONTROL_MAX else 0x40  # every data type is counted as "data"
        self.received[key] = self.received.get(key, 0) + datagrams

    def take_counts(self) -> tuple[dict[str, int], dict[int, int]]:
        """The drops and accepted datagrams counted since the last call (for Prometheus, once per pass)."""
        drops, received = self.drops, self.received
        self.drops, self.received = {}, {}
        return drops, received

    # -- per pass ------------------------------------------------------------------------------------------------
    def start_pass(self) -> None:
        self.junk = self.answers = 0

    def receive_pass(self, datagrams: int, backlog: bool, started: float, now: float) -> None:
        """A pass that began at ``started`` handled ``datagrams`` and ended at ``now``; ``backlog``: it stopped at
        its limit (datagrams or arena), not because the socket was empty, so the next pass starts at once. Queues
        the pass's ``PassDecision``."""
        self._passes += 1
        if not backlog:
            self.caught_up_at = started
        pause = self._junk_pause(now, self.junk, backlog, max(0, datagrams - self.junk))
        trickle = self.data_blocks and not backlog and datagrams < COALESCE_BELOW
        self.data_blocks = 0
        self._trickles = self._trickles + 1 if trickle else 0
        if pause > 0:
            self._junk_pauses += 1
            decision = PassDecision(pause, "junk")
        elif trickle:  # tensor data a few datagrams at a time: let more of it queue
            self._trickle_pauses += 1
            decision = PassDecision(COALESCE_S if self._trickles > 1 else COALESCE_FIRST_S, "trickle")
        else:  # a busy socket always has data: go on (after a checkpoint, so senders and timers are not starved)
            decision = PassDecision(0.0, "")
        self._wake_at = now + decision.pause if decision.pause > 0 else None
        self._actions.append(decision)

    def take_actions(self) -> list[PassDecision]:
        """The decisions of the passes since the last call, in order (drained)."""
        actions, self._actions = self._actions, []
        return actions

    def get_timer(self) -> float | None:
        """When the pause after the last pass ends (None: no pause runs)."""
        return self._wake_at

    def handle_timer(self, now: float) -> None:
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None

    def _junk_pause(self, now: float, junk: int, backlog: bool, honest: int) -> float:
        """How long the loop waits after a pass at ``now`` in which ``junk`` datagrams were refused unopened and
        ``honest`` others handled (see JUNK_RATE): short while the node is busy (BUSY_RATE), long while it is
        idle (JUNK_IDLE_BATCH)."""
        if now - self._window_at >= JUNK_WINDOW_S:
            elapsed = now - self._window_at
            recent = elapsed < 2 * JUNK_WINDOW_S
            self.junk_rate = self._junk_count / elapsed if recent else 0.0
            self.honest_rate = self._honest_count / elapsed if recent else 0.0
            self._window_at, self._junk_count, self._honest_count = now, 0, 0
        self._junk_count += junk
        self._honest_count += honest
        if not junk or backlog or self.junk_rate < JUNK_RATE:
            return 0.0
        if self.honest_rate >= BUSY_RATE or self._honest_count >= BUSY_RATE * JUNK_WINDOW_S:
            return min(self.junk_pause_s, JUNK_BATCH / self.junk_rate)
        return min(self.junk_idle_pause_s, JUNK_IDLE_BATCH / self.junk_rate)

    def statistics(self) -> ReceiveStatistics:
        return ReceiveStatistics(self.junk_rate, self.honest_rate, self._passes, self._junk_pauses,
                                 self._trickle_pauses, self.caught_up_at)
