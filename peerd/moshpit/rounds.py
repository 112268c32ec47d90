"""The Moshpit round machine (sans-I/O): one run's rounds on one node, from start to the next round number.

It composes the grid keys (keys.py), the matchmaker (matchmaking.py) and kept groups (sticky.py) with the
run's DHT records (records.py), and decides everything a round decides: renew a kept group or matchmake,
what to announce and read, whom to JOIN, BEGIN or DISBAND, when to give up, which group to average with,
how the key moves on and which round comes next. Time comes in as ``now`` (wall-clock seconds: expiries
are compared across peers), randomness from the injected rng. The driver (service.py's trio shell, or
the simulator in sim/moshpit.py) executes the actions it takes from ``take_actions`` and feeds back:

- ``on_records(token, records, now)``: the answer to a ``Get`` (records under the key, any order);
- ``on_reply(token, sender, ok, reason, now)`` / ``on_failed(token, now)``: the answer to a ``Request``,
  or none after its retries;
- ``on_join``, ``on_begin``, ``on_disband``: the MM_* messages peers send (the driver answers a request
  with what these return);
- ``handle_timer(now)`` once ``get_timer()`` has passed;
- ``on_averaged(...)`` once the ``Average`` it asked for is over.

A round is over when ``done`` is true; ``outcome`` then says whether this node averaged.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable

from ..dht.reads import Agreed
from ..linkcap.advert import CapAdvert, PeerCaps
from ..wire import messages as m
from .actions import Action, Average, Count, Get, Note, Notify, Put, Request
from .expect import expected_peers
from .keys import Grid, KeyManager
from .liveness import DoubtfulMembers, LateMembers, Overstays
from .matchmaking import (
    BUSY_RETRY_S,
    FOLLOW_SLACK_S,
    SETTLE_S,
    Begin,
    Candidate,
    Disband,
    Group,
    Join,
    Matchmaker,
    Probe,
)
from .records import (
    PROGRESS_TTL_S,
    RecordLike,
    decode_announce,
    decode_progress,
    encode_announce,
    encode_progress,
    group_dht_key,
    plausible_progress,
    progress_key,
)
from .sticky import RENEW_KEY, Ask, Kept, StickyGroups, Watch

# Reads that are polled (matchmaking, the kept group's watch) stop once three of the key's holders agree
# on its records: a write racing the read shows up at the next poll. Every FULL_READ_EVERY-th poll reads
# all k holders, so members that minted ids nearest a key can hide a record for a few polls at most.
POLL_READ = Agreed(3)
FULL_READ_EVERY = 4
POLL_S = (0.05, 0.1, 0.2, 0.3)  # DHT reads of the key: fast at first, then every 0.3 s
DEFAULT_WINDOW_S = 3.0
EXPECT_POLL_S = 0.5  # a lone matchmaker on a run's one key re-reads the run's progress this often (catching up)
MAX_GONE = 256  # members found dead, remembered (bounded)
OUTSIDER_S = 15.0  # a peer outside a kept group that published progress this recently is still training
SYNC_S = 5.0  # a read of the run's progress (to catch up with the swarm) waits this long at most
MATCH_SLACK_S = 10.0  # matchmaking gives up this long past the window (the matchmaker's own waits end first)
KNOWN_PEERS = 256  # the last peers this node averaged with, per run
JOIN_TIMEOUT_S, JOIN_ATTEMPTS = 0.25, 3
BEGIN_TIMEOUT_S, BEGIN_ATTEMPTS = 0.25, 4


def poll_read(i: int) -> Agreed | None:
    return None if i % FULL_READ_EVERY == FULL_READ_EVERY - 1 else POLL_READ


class RoundMachine:
    """One run on one node: its place on the grid, its round number, and the round under way."""

    def __init__(self, run_id: str, grid: Grid, keys: KeyManager, me: Candidate, *, min_size: int = 2,
                 window_s: float = DEFAULT_WINDOW_S, keep_rounds: int = 1, rng: random.Random,
                 resolve: Callable[[bytes, str], str | None] = lambda node_id, host: host) -> None:
        """``me``: this node (its expiry is ignored); ``resolve(node_id, host)``: the host to reach a peer
        that announced ``host`` at, or None when it cannot be reached from here (the driver knows its
        sockets; it counts what it refuses)."""
        self.run_id = run_id
        self.cap_ad: CapAdvert | None = None  # this node's bandwidth caps, in its announcements (the driver sets it)
        self.peer_caps = PeerCaps()  # the caps its peers' announcements carried
        self.grid = grid
        self.keys = keys
        self.me = me
        self.min_size = min_size
        self.window_s = window_s
        self.window_cap_s: float | None = None  # the bound the driver tuned window_s within (None: window_s itself)
        self.rtt: Callable[[tuple[str, int]], float | None] = lambda addr: None  # the driver's smoothed RTT to addr
        self.doubt_s = math.inf  # matchmaking's wait for a last-group member that did not finish (inf: the window)
        self.sticky = StickyGroups(me.node_id, keep_rounds)
        self.rng = rng
        self.resolve = resolve
        self.round = 0  # the round under way, or the next one
        self.synced = False  # round number taken from the swarm's progress records
        self.known: dict[bytes, int] = {}  # node id -> last round averaged with it (bounded)
        self.phase = "idle"  # idle | renew | match | average | sync | done
        self.outcome = ""  # "averaged" | "alone" (set when the round is over)
        self.group: Group | None = None
        self.kept_round = False
        self.seen = 1
        self.key = ""
        self._actions: list[Action] = []
        self._token = 0
        self._gets: dict[int, tuple[str, int]] = {}  # token -> (purpose, round)
        self._requests: dict[int, tuple] = {}  # token -> (purpose, context...)
        self._numbered = False
        self._chain_from: float | None = None
        self.window_end = 0.0  # the wall-clock end of this round's matchmaking window (0: it did not matchmake)
        self._last_round: int | None = None  # the last round this node finished here (numbered runs skip rounds)
        self._started = 0.0
        self._timeout_s = 30.0
        self._mm: Matchmaker | None = None
        self._mm_key = b""
        self._mm_deadline = math.inf
        self._poll_i = 0
        self._poll_at = math.inf  # next poll of the key (inf while one is in flight)
        self._full_out = False  # a full read of the key in flight
        self._renew_kept: Kept | None = None
        self._late: LateMembers | None = None  # a kept round's probes of the members it waits for
        self._last_group: dict[bytes, Candidate] = {}  # the members of the group this node last averaged with
        self._doubt: DoubtfulMembers | None = None  # this matchmaking's probes of its doubtful members
        self._dead: frozenset[bytes] = frozenset()  # members this round's renewal found dead (not waited for long)
        self._overstays = Overstays()  # members a renewal waited for to half its budget in vain
        # members found dead (a renewal's or an average's PINGs unanswered) -> when: a progress record stored before
        # then is the dead member's last, so it is neither expected by matchmaking nor an outsider (bounded)
        self.gone: OrderedDict[bytes, float] = OrderedDict()
        self._watch: dict[int, Watch] = {}  # the leader's watch reads outstanding, by token (they outlive a round)
        self._expect_at = math.inf  # next re-read of the run's progress while matchmaking alone
        self._ask: Ask | None = None
        self._sync_deadline = math.inf

    # -- what the driver reads ------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase == "done"

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def get_timer(self) -> float | None:
        """When ``handle_timer`` is due next (absolute), or None when nothing waits on time."""
        t = math.inf
        if self._ask is not None:
            t = min(t, self._ask.retry_at, self._ask.deadline)
        if self.phase == "renew" and self._late is not None and self._renew_kept is not None:
            t = min(t, self._late.get_timer(self._renewal_waits(self._renew_kept)))
        elif self.phase == "match":
            assert self._mm is not None
            t = min(t, self._mm.get_timer() or math.inf, self._poll_at, self._mm_deadline, self._expect_at)
            if self._doubt is not None:
                t = min(t, self._doubt.probes.next_probe(self._doubt.waits(f.node_id for f in self._mm.followers)))
        elif self.phase == "sync":
            t = min(t, self._sync_deadline)
        return None if t == math.inf else t

    def note_members(self, members: list[bytes], round_no: int) -> None:
        """Remember whom this node averaged with: their progress records are believed further than strangers'."""
        for node_id in members:
            self.known.pop(node_id, None)
            self.known[node_id] = round_no
        while len(self.known) > KNOWN_PEERS:
            del self.known[next(iter(self.known))]

    def abandon(self) -> None:
        """The driver stopped the round under way (its caller was cancelled): the round number stays, so
        the next round is this one again; what was pending is forgotten."""
        if self.phase not in ("idle", "done"):
            self.phase = "idle"
        self._mm, self._ask, self._late = None, None, None
        self._forget_gets()

    def set_keep_rounds(self, keep_rounds: int) -> None:
        if self.sticky.keep_rounds != keep_rounds:
            self.sticky = StickyGroups(self.me.node_id, keep_rounds)

    # -- a round --------------------------------------------------------------------------------
    def start_round(self, *, timeout_s: float = 30.0, numbered: bool = False, chain_from: float | None = None,
                    now: float) -> None:
        """Begin round ``self.round``: renew the kept group if it may be, else matchmake through the DHT.
        ``numbered``: the caller numbers the rounds (no catching up with the swarm's progress afterwards).
        ``chain_from``: the end of the matchmaking window of the round just before this one in the same
        step (``window_end``; a DiLoCo outer step runs one round per grid axis): this window ends one window
        after it, not one window after ``now`` (at most two windows from now). A member that spent that round
        alone comes one whole window after the members that averaged at once; with windows counted from
        ``now`` theirs ended as it arrived, it was alone again, and one window behind at every round after."""
        if self.phase not in ("idle", "done"):
            raise RuntimeError(f"round {self.round} is still {self.phase}")
        self.outcome, self.group, self.kept_round, self.seen = "", None, False, 1
        self._chain_from, self.window_end, self._dead = chain_from, 0.0, frozenset()
        self.key = self.keys.group_key(self.round)
        self._numbered = self.sticky.numbered = numbered
        self._started = now
        self._timeout_s = timeout_s
        self._forget_gets()
        for token in [t for t, req in self._requests.items() if req[0] in ("join", "probe", "late", "doubt")]:
            del self._requests[token]  # JOINs of an earlier round: their answers no longer matter
        sticky = self.sticky
        if sticky.kept is not None and sticky.broken:
            self._disband_kept(sticky.kept)  # the others need not wait for a renewal that will not come
        kept = sticky.usable(self.round)
        if kept is None:
            self._start_match(now)
            return
        self.phase = "renew"
        self._renew_kept = kept
        slack = 0.0 if sticky.leads(kept) else FOLLOW_SLACK_S  # (a follower's wait also covers its asks' retries)
        waits = self._renewal_waits(kept)
        live = self._overstays.bound(waits, self.round, timeout_s / 2, (self.window_cap_s or self.window_s) + slack)
        self._late = LateMembers([c for c in kept.members if c.node_id in waits], started=now, rtt=self.rtt,
                                 base=now + max(0.0, min(self.window_s + slack, timeout_s / 2)), long=now + live)
        if sticky.leads(kept):
            if not self._watch:  # one watch in flight at a time: a slow DHT must not pile reads up
                enough = poll_read(self.round)
                for purpose, key in (("progress", progress_key(self.run_id)),
                                     ("key", group_dht_key(self.run_id, self.round, self.key)),
                                     ("key", group_dht_key(self.run_id, self.round + 1, self.key))):
                    token = self._get(key, "watch", enough, detached=True)
                    self._watch[token] = Watch(kept, now, purpose, self.round)
        else:
            self._ask = Ask(kept, self.round, round(now + self.window_s, 3), now + self.window_s + FOLLOW_SLACK_S)
            self._send_ask(now)
        self._check_renewal(now)

    def on_averaged(self, *, averaged: bool, silent: bool = False, members: list[bytes] | None = None,
                    dead: frozenset[bytes] = frozenset(), now: float) -> None:
        """The ``Average`` is over. ``averaged``: this node got the group's mean (False: it kept its own
        vector: the average failed or was refused); ``silent``: some member was never heard from;
        ``members``: the node ids averaged with (they are believed further in progress records); ``dead``:
        members given up on mid-average, their daemons silent to PINGs (not expected by later matchmakings)."""
        self.after_average(averaged=averaged, silent=silent, members=members, dead=dead, now=now)
        if self.phase != "average":
            return
        group = self.group
        assert group is not None
        self._last_group = {c.node_id: c for c in group.members if c.node_id != self.me.node_id}
        if averaged:
            self.outcome = "averaged"
        else:
            self.outcome = "failed"
        if self.kept_round:
            self.sticky.renewed += 1
        else:  # a kept round skips the key rotation: the group is the one this key formed
            self.keys.after_group(group.index, len(group.members), self.seen)
        self._finish(now)

    def after_average(self, *, averaged: bool, silent: bool = False, members: list[bytes] | None = None,
                      dead: frozenset[bytes] = frozenset(), now: float = 0.0) -> None:
        """What an average teaches about the group, also outside a round: a group with a silent member
        (or one whose average failed, or a member found dead) is not kept; peers averaged with are believed
        further ahead, members found dead are not expected until they store a newer progress record."""
        self.sticky.after_round(silent or not averaged, dead)
        self._note_gone(dead, now)
        if averaged and members:
            self.note_members([n for n in members if n != self.me.node_id and n not in dead], self.round)

    def handle_timer(self, now: float) -> None:
        ask = self._ask
        if ask is not None:
            if now >= ask.deadline:
                self._ask = None
            elif now >= ask.retry_at:
                ask.retry_at = math.inf
                self._send_ask(now)
        if self.phase == "renew":
            self._check_renewal(now)
        elif self.phase == "match":
            mm = self._mm
            assert mm is not None
            if now >= self._mm_deadline:
                self._end_match(now, timed_out=True)
                return
            if now >= self._expect_at:
                self._expect_at = math.inf
                self._get(progress_key(self.run_id), "expect", None)
            if now >= self._poll_at:
                self._poll(now)
            self._check_doubtful(now)
            if self._mm is not mm:  # (a doubtful member found dead: the group closed)
                return
            mm.handle_timer(now)
            self._pump(now)
        elif self.phase == "sync" and now >= self._sync_deadline:
            self.synced = True
            self.phase = "done"

    def on_records(self, token: int, records: list[RecordLike], now: float) -> None:
        got = self._gets.pop(token, None)
        if got is None:
            return  # a read this round no longer waits for
        purpose, round_no = got
        if purpose in ("poll", "full") and self.phase == "match" and round_no == self.round:
            mm = self._mm
            assert mm is not None
            mm.on_entries(self._candidates(records), now)
            if purpose == "full":
                self._full_out = False
            else:
                self._poll_at = now + POLL_S[min(self._poll_i - 1, len(POLL_S) - 1)]
            self._pump(now)
        elif purpose == "expect" and self.phase == "match" and round_no == self.round:
            self._expect(records, now)
        elif purpose == "watch":
            self._watched(token, records)
            self._check_renewal(now)  # (in the renew phase: a group broken before its BEGIN matchmakes now)
        elif purpose == "sync" and self.phase == "sync":
            self.apply_sync(records, now)
            self.phase = "done"

    def on_reply(self, token: int, sender: bytes, ok: bool, reason: str, now: float) -> None:
        """The answer to a ``Request`` (``sender``: the node id that answered; ``reason``: JOIN's)."""
        req = self._requests.pop(token, None)
        if req is None:
            return
        purpose = req[0]
        if purpose == "join":
            _, mm, leader = req
            if mm is self._mm and self.phase == "match":
                if sender != leader:
                    mm.on_join_failed(leader, now)  # someone else lives at that address
                else:
                    mm.on_join_response(leader, ok, reason, now)
                self._pump(now)
        elif purpose == "probe":
            _, mm, leader = req
            if mm is self._mm and self.phase == "match":
                if sender == leader:
                    mm.on_probe_answered(leader, "ok" if ok else reason, now)
                else:
                    mm.on_probe_failed(leader, now)  # someone else lives at that address
                self._pump(now)
        elif purpose == "ask":
            self._asked(req[1], sender, ok, reason, now)
        elif purpose in ("late", "doubt"):  # (a PING's answer: from the member itself, or someone else at its address)
            req[1].receive_answer(req[2], token, sender, now)
            self._check_renewal(now) if purpose == "late" else self._check_doubtful(now)
        elif purpose == "renewal" and not ok:
            self.sticky.break_("refused", req[1])

    def on_failed(self, token: int, now: float) -> None:
        """A ``Request`` got no answer after its retries."""
        req = self._requests.pop(token, None)
        if req is None:
            return
        purpose = req[0]
        if purpose == "join":
            _, mm, leader = req
            if mm is self._mm and self.phase == "match":
                mm.on_join_failed(leader, now)
                self._pump(now)
        elif purpose == "probe":
            _, mm, leader = req
            if mm is self._mm and self.phase == "match":
                mm.on_probe_failed(leader, now)
                self._pump(now)
        elif purpose == "ask":
            self._asked(req[1], None, False, "unreachable", now)
        elif purpose in ("late", "doubt"):
            req[1].receive_answer(req[2], token, None, now)
            self._check_renewal(now) if purpose == "late" else self._check_doubtful(now)
        elif purpose == "renewal":
            self.sticky.break_("unacknowledged", req[1])
            self._actions.append(Note(f"run {self.run_id}: a kept group's member did not acknowledge its renewal"))

    # -- messages from peers --------------------------------------------------------------------
    def on_join(self, peer: Candidate, round_no: int, key: str, now: float) -> tuple[bool, str]:
        """An MM_JOIN: a peer asks this node to lead it (or, with RENEW_KEY, to renew the kept group)."""
        if self.phase == "match" and round_no == self.round:
            if key != self.key:
                return False, "key"
            assert self._mm is not None
            ok, reason = self._mm.on_join_request(peer, now)
            self._pump(now)
            return ok, reason
        if key == RENEW_KEY:  # a follower of my kept group is ready for this round
            ok = self.sticky.offer_join(peer.node_id, round_no, self.round)
            if ok:
                self._check_renewal(now)
            return ok, "ok" if ok else "closed"
        if round_no == self.round and self.phase == "average":  # matchmaking over: BEGIN went to the members
            member = self.group is not None and any(c.node_id == peer.node_id for c in self.group.members)
            return False, "closed" if member else "disbanded"
        return False, "not_ready" if self.round <= round_no else "disbanded"

    def on_begin(self, sender: bytes, round_no: int, group_id: int, members: list[Candidate], now: float) -> bool:
        """An MM_BEGIN (members already checked for addresses this node can reach)."""
        if self.phase == "match" and round_no == self.round:
            assert self._mm is not None
            ok = self._mm.on_begin(sender, group_id, members)
            self._pump(now)
            return ok
        ok = self.sticky.offer_begin(sender, round_no, self.round, group_id, members)
        if ok:
            self._check_renewal(now)
        return ok

    def on_disband(self, sender: bytes, round_no: int, now: float) -> None:
        if self.phase == "match" and round_no == self.round:
            assert self._mm is not None
            self._mm.on_disband(sender, now)
            self._pump(now)
        sticky = self.sticky
        kept = sticky.kept
        if kept is None or sender not in kept.node_ids():
            return
        if round_no > kept.formed or (round_no == kept.formed and kept.leader == self.me.node_id):
            # a member of my kept group will not renew it (for the formation round: it never kept it)
            sticky.break_("disbanded" if round_no > kept.formed else "not_kept", kept)
            self._check_renewal(now)

    # -- kept groups ----------------------------------------------------------------------------
    def _check_renewal(self, now: float) -> None:
        """In the renew phase: begin the renewal once it is ready, or matchmake once it cannot be."""
        if self.phase != "renew":
            return
        sticky, kept = self.sticky, self._renew_kept
        assert kept is not None
        group = None
        if not sticky.broken and sticky.kept is kept:
            if sticky.leads(kept):
                if not sticky.missing(self.round):
                    group = self._renewal(kept)
            else:
                group = sticky.take_begin(self.round)
            if group is not None:
                self._start_average(group, kept=True)
                return
            late, waits = self._late, self._renewal_waits(kept)
            assert late is not None
            self._dead = late.dead(waits)
            self._note_gone(self._dead, now)
            if self._dead and sticky.leads(kept) and sticky.without(self._dead):
                self._renew_kept = sticky.kept  # the others go on: begin once each of them asked
                return self._check_renewal(now)
            if self._dead:  # its daemon is gone too: no use waiting out the window
                self._actions.append(Note(f"run {self.run_id} round {self.round}: a kept member is dead; re-forming"))
                sticky.break_("dead", kept)
            elif now < late.deadline(waits):
                for c, timeout in late.to_probe(waits, now):
                    late.sent(c.node_id, self._request(c, m.MsgType.PING, {}, ("late", late, c.node_id), timeout, 1))
                return
            elif late.deadline(waits) == late.long > late.base:  # live members waited for to the end in vain
                self._overstays.note(late.alive(waits), self.round)
        # the wait ran out (a member is gone or slow) or the group broke: everyone looks through the DHT
        reason = sticky.broken or ("not_ready" if sticky.leads(kept) else "no_begin")
        if sticky.kept is kept:
            self._disband_kept(kept)
        sticky.drop(reason)
        self._start_match(now)

    def _renewal_waits(self, kept: Kept) -> frozenset[bytes]:
        """Whom the renewal waits for: the followers that have not asked (the leader), or the leader."""
        return self.sticky.missing(self.round) if self.sticky.leads(kept) else frozenset([kept.leader])

    def _renewal(self, kept: Kept) -> Group:
        """As the leader, every follower having asked: the kept group under a fresh id, BEGIN to each."""
        group = self.sticky.renewal(self.rng.randrange(1, 2**32), self.round)
        fields = {"run": self.run_id, "round": self.round, "group": group.group_id, "members": list(kept.members)}
        for c in kept.members:
            if c.node_id != self.me.node_id:
                self._request(c, m.MsgType.MM_BEGIN, fields, ("renewal", kept), BEGIN_TIMEOUT_S, BEGIN_ATTEMPTS,
                              detached=True)
        return group

    def _send_ask(self, now: float) -> None:
        ask = self._ask
        assert ask is not None
        fields = {"run": self.run_id, "round": ask.round_no, "key": RENEW_KEY, "expiry": ask.expiry}
        ask.token = self._request(ask.kept.leader_candidate, m.MsgType.MM_JOIN, fields, ("ask", ask),
                                  BEGIN_TIMEOUT_S, BEGIN_ATTEMPTS, detached=True)

    def _asked(self, ask: Ask, sender: bytes | None, ok: bool, reason: str, now: float) -> None:
        """The leader's answer to a renewal request (None: no answer). A refusal (it does not keep the
        group, or matchmakes this round) or no answer breaks the group at once."""
        sticky = self.sticky
        if self._ask is not ask:
            return
        if sender == ask.kept.leader and self._late is not None:
            self._late.receive_heard(sender, now)  # its daemon lives (an answer to a renewal request of this round)
        self._ask = None
        if sticky.kept is not ask.kept or sticky.broken:
            return
        if ok or sticky.begun >= ask.round_no:
            return  # (a late answer to a retry after the renewal already began: not a refusal)
        if sender is None:
            self._actions.append(Note(f"run {self.run_id} round {ask.round_no}: the kept group's leader did "
                                      f"not answer"))
            why = "unreachable"
        elif sender != ask.kept.leader:
            why = "unreachable"
        elif reason in ("busy", "not_ready"):
            if now + BUSY_RETRY_S < ask.deadline:
                ask.retry_at = now + BUSY_RETRY_S
                self._ask = ask
            return
        else:
            why = "refused"
        sticky.break_(why, ask.kept)
        self._check_renewal(now)

    def _watched(self, token: int, records: list[RecordLike]) -> None:
        """The leader's read for outsiders: a peer outside the group looking for one, or still training,
        means the group must re-form through the DHT to take it in (else the run would split into groups
        that never meet). The renewal does not wait for it: an outsider breaks the group for the round after
        the one it was read in (or this one, if its renewal has not begun), where the newcomer, catching up
        with the run's progress, looks for a group too."""
        watch = self._watch.pop(token, None)
        if watch is None:
            return
        ids, t0 = watch.kept.node_ids(), watch.started
        if watch.purpose == "progress":
            # A record stored before the group formed was accounted for then (a group that formed without a
            # peer whose record is recent is not complete, so not kept), and one a member the group went on
            # without stored before it died is its last: only a record stored since is an outsider training.
            since, gone = max(t0 - OUTSIDER_S, watch.kept.formed_at), self.gone
            for owner, _, stored in decode_progress(records)[0]:
                if owner not in ids and stored > max(since, gone.get(owner, -math.inf)):
                    self._actions.append(Note(f"run {self.run_id} round {watch.round_no}: a peer outside the kept "
                                              f"group trains; re-forming"))
                    self.sticky.break_("outsider", watch.kept)
                    return
        else:
            for c in self._candidates(records):
                if c.node_id not in ids and c.expiry > t0:
                    self._actions.append(Note(f"run {self.run_id} round {watch.round_no}: a newcomer looks for a "
                                              f"group; re-forming"))
                    self.sticky.break_("newcomer", watch.kept)
                    return

    def _note_gone(self, dead: frozenset[bytes], now: float) -> None:
        for node_id in dead:
            self.gone[node_id] = now
            self.gone.move_to_end(node_id)
        while len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)

    def _disband_kept(self, kept: Kept) -> None:
        """Tell the kept group's other members that this node will not renew it (twice: it is one-way)."""
        for c in kept.members:
            if c.node_id != self.me.node_id:
                for _ in range(2):
                    self._actions.append(Notify(c, m.MsgType.MM_DISBAND, {"run": self.run_id, "round": self.round}))

    # -- matchmaking ----------------------------------------------------------------------------
    def _start_match(self, now: float) -> None:
        self.phase = "match"
        window_s = self.window_s
        if self._chain_from is not None and math.isfinite(self._chain_from):
            window_s = min(max(window_s, self._chain_from + self.window_s - now), 2 * self.window_s)
        me = Candidate(round(now + window_s, 3), self.me.node_id, self.me.public_key, self.me.addr,
                       self.me.reach, self.cap_ad is not None and self.cap_ad.capped)
        self.window_end = me.expiry
        # min_size == M is Moshpit's exact grid: groups close at exactly M, never early
        settle = None if self.min_size >= self.grid.size else SETTLE_S
        self._mm = Matchmaker(me, target=self.grid.size, min_size=self.min_size, now=now, rng=self.rng,
                              settle_s=settle, capped_of=lambda n: self.peer_caps.get(n) is not None)
        self._mm_key = group_dht_key(self.run_id, self.round, self.key)
        self._mm_deadline = now + max(0.0, min(self._timeout_s - (now - self._started),
                                               window_s + MATCH_SLACK_S))
        self._poll_i = 0
        self._full_out = False
        self._expect_at = math.inf
        self._doubt = None
        self._actions.append(Put(self._mm_key, encode_announce(me.expiry, me.addr[0], me.addr[1], me.reach,
                                                                 self.cap_ad),
                                 window_s + 10.0))
        self._poll(now)
        if self._one_key():  # one key: the whole run looks under it
            if self._last_round is None and self.round > 0 and not self._numbered:
                # a joiner (its round taken from the swarm's progress): say so at once, as the progress the
                # swarm had, so a kept group's leader sees an outsider and re-forms to take it in
                self._actions.append(Put(progress_key(self.run_id), encode_progress(self.round - 1),
                                         PROGRESS_TTL_S))
            self._get(progress_key(self.run_id), "expect", None)
        self._pump(now)

    def _poll(self, now: float) -> None:
        """Read the key: a quick read now, and at every FULL_READ_EVERY-th one a read of all its holders beside it
        (one at a time). The full read waits out a dead holder's query; the quick ones go on meanwhile, so the
        survivors of a death see each other's announcements within a short window."""
        self._poll_at = math.inf  # (until the quick read answers)
        if poll_read(self._poll_i) is None and not self._full_out:
            self._full_out = True
            self._get(self._mm_key, "full", None)
        self._get(self._mm_key, "poll", POLL_READ)
        self._poll_i += 1

    def _one_key(self) -> bool:
        return self.grid.dims == 1 and self.keys.extra_bits == 0

    def _pump(self, now: float) -> None:
        """Turn the matchmaker's decisions into messages; end matchmaking once it is done."""
        mm = self._mm
        if mm is None or self.phase != "match":
            return
        for action in mm.take_actions():
            if isinstance(action, Join | Probe):
                fields = {"run": self.run_id, "round": self.round, "key": self.key, "expiry": mm.me.expiry}
                purpose = "join" if isinstance(action, Join) else "probe"
                self._request(action.leader, m.MsgType.MM_JOIN, fields, (purpose, mm, action.leader.node_id),
                              JOIN_TIMEOUT_S, JOIN_ATTEMPTS)
            elif isinstance(action, Begin):
                fields = {"run": self.run_id, "round": self.round, "group": action.group.group_id,
                          "members": list(action.group.members)}
                for c in action.to:
                    self._request(c, m.MsgType.MM_BEGIN, fields, ("begin",), BEGIN_TIMEOUT_S, BEGIN_ATTEMPTS,
                                  detached=True)
            elif isinstance(action, Disband):
                for c in action.to:
                    self._actions.append(Notify(c, m.MsgType.MM_DISBAND, {"run": self.run_id, "round": self.round}))
        if mm.done:
            self._end_match(now)

    def _end_match(self, now: float, timed_out: bool = False) -> None:
        mm = self._mm
        assert mm is not None
        group, seen, rank = (None, 1, 0) if timed_out else (mm.group, mm.seen, mm.seen_rank())
        self._mm = None
        self._poll_at = math.inf
        self.seen = seen
        sticky = self.sticky
        sticky.after_matchmaking(group, self.round, seen, mm.expected, mm.started)
        if group is not None and sticky.keep_rounds > 1 and sticky.kept is None and group.leader != self.me.node_id:
            # the leader may think the group complete: tell it now, or it would wait out a window next
            # round for this node's renewal request
            leader = next(c for c in group.members if c.node_id == group.leader)
            for _ in range(2):
                self._actions.append(Notify(leader, m.MsgType.MM_DISBAND, {"run": self.run_id, "round": self.round}))
        if group is None:
            self.keys.after_alone(seen, rank)
            self.outcome = "alone"
            self.synced = False  # perhaps the swarm is in another round: look at its progress next time
            self._finish(now)
            return
        self._start_average(group, kept=False)

    def _expect(self, records: list[RecordLike], now: float) -> None:
        """Tell the matchmaker who finished one of the last rounds: a leader waits a little longer for them.

        A peer that already finished this round or a later one is ahead: this peer re-reads the run's
        progress after the round and jumps to it, else two halves of a run that fell out of step (a stall)
        would wait for each other at different round numbers, every round, forever."""
        mm = self._mm
        assert mm is not None
        # With kept groups, a peer whose progress lags (a joiner chasing a kept group: the group's rounds
        # take milliseconds, so the joiner's jump ahead always lands on a round the group already left) is
        # still expected while it keeps trying: its record was refreshed within two windows. The group,
        # broken by this outsider, then waits for it in this round, where the joiner's next jump lands.
        lagging_s = 2 * self.window_s if self.sticky.keep_rounds > 1 else None
        progress = self._progress(records, now)
        seen = expected_peers(progress, me=self.me.node_id, round_no=self.round,
                              last_round=self._last_round, lagging_s=lagging_s, known=self.known, now=now)
        recent, latest = seen.recent, seen.latest
        if latest >= 0:
            self.synced = False
        if latest >= 0 and not self._numbered and mm.alone:
            # the run is past this round (a joiner, or a node that fell behind a kept group's fast rounds):
            # nobody will look under this round's key, so look under the run's next round's now instead of
            # waiting out the window alone and landing behind again
            self._actions.append(Note(f"run {self.run_id}: round {self.round} is over elsewhere; moving to "
                                      f"round {latest + 1}"))
            self.round = latest + 1
            self.key = self.keys.group_key(self.round)
            self._start_match(now)
            return
        if not self._numbered and mm.alone:
            self._expect_at = now + EXPECT_POLL_S  # still alone: look at the run's progress again soon
        if not recent:
            # nobody finished a recent round (a run's first round): whom to expect is unknown, so the
            # leader waits for a pause without newcomers (1.5 s), not 0.3 s: peers whose first step took a
            # moment longer would otherwise find the others' round over and start out of step
            return
        stored: dict[bytes, float] = {}
        for owner, _, at in progress:
            stored[owner] = max(stored.get(owner, -math.inf), at)
        dead = frozenset(p for p in recent if p in self.gone and stored.get(p, -math.inf) <= self.gone[p])
        recent -= dead  # (found dead since its last record: a record it writes later makes it expected again)
        mm.set_expected(recent, now)
        doubtful = seen.doubtful - dead  # (a moment behind, or dead: waited for only doubt_s, and PINGed)
        if doubtful:
            if self._doubt is None:
                self._doubt = DoubtfulMembers([self._last_group[n] for n in doubtful if n in self._last_group],
                                              started=now, rtt=self.rtt)
            self._doubt.doubtful = doubtful
            mm.receive_doubtful(doubtful, mm.started + self.doubt_s, now)
            self._check_doubtful(now)
        self._pump(now)

    def _check_doubtful(self, now: float) -> None:
        """Matchmaking's doubtful members (``DoubtfulMembers``): one whose daemon answers is waited for as any expected
        peer; one found dead is not waited for at all and is remembered (``gone``)."""
        doubt, mm = self._doubt, self._mm
        if doubt is None or mm is None or self.phase != "match":
            return
        dead, alive = doubt.settle()
        if dead or alive:
            self._note_gone(dead, now)
            if mm.expected is not None and dead:
                mm.set_expected(mm.expected - dead, now)
            mm.receive_doubtful(doubt.doubtful, mm.started + self.doubt_s, now)
        for c, timeout in doubt.probes.to_probe(doubt.waits(f.node_id for f in mm.followers), now):
            doubt.probes.sent(c.node_id, self._request(c, m.MsgType.PING, {}, ("doubt", doubt.probes, c.node_id),
                                                       timeout, 1))
        self._pump(now)

    def _candidates(self, records: list[RecordLike]) -> list[Candidate]:
        out = []
        for r in records:
            a = decode_announce(r)
            if a is None:
                self._actions.append(Count("datagrams_dropped", ("mm_record",)))
                continue
            self.peer_caps.note(a.node_id, a.cap)
            host = self.resolve(a.node_id, a.host)
            if host is not None:
                out.append(Candidate(a.expiry, a.node_id, a.public_key, (host, a.port), a.reach, a.cap is not None))
        return out

    # -- the end of a round ---------------------------------------------------------------------
    def _start_average(self, group: Group, *, kept: bool) -> None:
        self.phase = "average"
        self.group = group
        self.kept_round = kept
        self._actions.append(Average(group, kept))

    def _finish(self, now: float) -> None:
        round_no = self.round
        self.round = round_no + 1
        self._last_round = round_no
        self._actions.append(Put(progress_key(self.run_id), encode_progress(round_no), PROGRESS_TTL_S))
        if not self.synced and not self._numbered:  # the caller numbers this run's rounds: nothing to catch up
            self.sync(now)
        else:
            self.phase = "done"

    def sync(self, now: float) -> None:
        """Read the run's progress and move to the round after the latest one any peer finished (joiners)."""
        self.phase = "sync"
        self._sync_deadline = now + SYNC_S
        self._get(progress_key(self.run_id), "sync", None)

    def apply_sync(self, records: list[RecordLike], now: float) -> None:
        """Start at the round after the latest one any (believable) peer of the run finished."""
        latest = -1
        for _, value, _ in self._progress(records, now):
            latest = max(latest, value)
        self.round = max(self.round, latest + 1)
        self.synced = True

    def _progress(self, records: list[RecordLike], now: float) -> list[tuple[bytes, int, float]]:
        """Progress records to believe (``plausible_progress``); the others are counted."""
        out, skipped = decode_progress(records)
        for reason, n in skipped.items():
            if n:
                self._actions.append(Count("ignored_records", ("progress", reason), n))
        out, ahead = plausible_progress(out, self.round, now, self.known)
        if ahead:
            self._actions.append(Count("ignored_records", ("progress", "ahead"), ahead))
            self._actions.append(Note(f"run {self.run_id}: ignored {ahead} progress record(s) too far ahead"))
        return out

    # -- plumbing -------------------------------------------------------------------------------
    def _get(self, key: bytes, purpose: str, enough: Agreed | None, *, detached: bool = False) -> int:
        self._token += 1
        self._gets[self._token] = (purpose, self.round)
        self._actions.append(Get(key, self._token, enough, detached))
        return self._token

    def _forget_gets(self) -> None:
        """Reads of an earlier round no longer matter, except the kept group's watch (it outlives its round)."""
        self._gets = {t: g for t, g in self._gets.items() if t in self._watch}
        self._watch = {t: w for t, w in self._watch.items() if t in self._gets}

    def _request(self, to: Candidate, mtype: m.MsgType, fields: dict, context: tuple, timeout: float,
                 attempts: int, *, detached: bool = False) -> int:
        self._token += 1
        self._requests[self._token] = context
        if len(self._requests) > 4096:  # answers that never came (a driver that dropped them): forget the oldest
            del self._requests[next(iter(self._requests))]
        self._actions.append(Request(to, mtype, fields, self._token, timeout, attempts, detached))
        return self._token
