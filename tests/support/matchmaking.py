"""Matchmakers over an in-memory broadcast board, and candidates to feed them."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from peerd.moshpit.matchmaking import Begin, Candidate, Disband, Join, Matchmaker, Probe


def cand(i: int, expiry: float) -> Candidate:
    return Candidate(expiry, bytes([i]) * 32, bytes([i]) * 32, ("127.0.0.1", 1000 + i))


class BoardNet:
    def __init__(self, peers: list[Candidate], *, target: int, min_size: int = 2, latency: float = 0.01,
                 dead: set[int] = frozenset(), view: Callable[[int, float], list[Candidate]] | None = None,
                 start: dict[int, float] | None = None, seed: int = 0, settle: float | None = 0.3) -> None:
        self.cands = {c.node_id: c for c in peers}
        self.latency = latency
        self.dead = {peers[i].node_id for i in dead}
        self.start = {peers[i].node_id: t for i, t in (start or {}).items()}
        self.mm = {
            c.node_id: Matchmaker(c, target=target, min_size=min_size, now=self.start.get(c.node_id, 0.0),
                                  rng=random.Random(seed * 1000 + i), settle_s=settle)
            for i, c in enumerate(peers) if c.node_id not in self.dead
        }
        self.view = view or (lambda i, now: list(peers))
        self.index = {c.node_id: i for i, c in enumerate(peers)}
        self.queue: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.messages = 0
        self.probes = 0

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), fn))

    def run(self, until: float = 60.0, poll: float = 0.2) -> None:
        for nid in self.mm:
            self.at(self.start.get(nid, 0.0), lambda nid=nid: self.poll(nid, poll))
        while self.queue and not all(mm.done for mm in self.mm.values()):
            t, _, fn = heapq.heappop(self.queue)
            assert t <= until, "matchmaking did not finish"
            self.now = t
            fn()
            for nid, mm in self.mm.items():
                if not mm.done:
                    mm.handle_timer(self.now)
                self.flush(nid)

    def poll(self, nid: bytes, every: float) -> None:
        mm = self.mm.get(nid)
        if mm is None or mm.done:
            return
        mm.on_entries(self.view(self.index[nid], self.now), self.now)
        self.flush(nid)
        self.at(self.now + every, lambda: self.poll(nid, every))
        self.at(mm.get_timer(), lambda: None)  # wake for its timer

    def flush(self, nid: bytes) -> None:
        me = self.mm[nid].me
        for action in self.mm[nid].take_actions():
            self.messages += 1
            if isinstance(action, Join):
                self.at(self.now + self.latency, lambda a=action: self.deliver_join(me, a.leader))
            elif isinstance(action, Begin):
                for f in action.to:
                    self.at(self.now + self.latency, lambda f=f, g=action.group: self.deliver_begin(f, g))
            elif isinstance(action, Disband):
                for f in action.to:
                    self.at(self.now + self.latency, lambda f=f: self.deliver_disband(f, me))
            elif isinstance(action, Probe):
                self.probes += 1
                self.at(self.now + self.latency, lambda a=action: self.deliver_probe(me, a.leader))

    def kill(self, i: int) -> None:
        nid = list(self.cands)[i]
        self.dead.add(nid)
        self.mm.pop(nid, None)

    def deliver_join(self, follower: Candidate, leader: Candidate) -> None:
        mm = self.mm.get(leader.node_id)
        if mm is None:  # dead: the JOIN's retries run out 3.5 s later
            self.at(self.now + 3.5, lambda: self.fail(follower, leader))
            return
        ok, reason = mm.on_join_request(follower, self.now)
        self.flush(leader.node_id)
        self.at(self.now + self.latency, lambda: self.answer(follower, leader, ok, reason))

    def deliver_probe(self, follower: Candidate, leader: Candidate) -> None:
        """A probe is the same MM_JOIN: a live leader answers it (whatever it says), a dead one never does."""
        mm = self.mm.get(leader.node_id)
        if mm is None:  # the JOIN's retries (3 x 0.25 s) run out
            self.at(self.now + 0.75, lambda: self.mm[follower.node_id].on_probe_failed(leader.node_id, self.now)
                    if follower.node_id in self.mm else None)
            return
        ok, reason = mm.on_join_request(follower, self.now)
        self.flush(leader.node_id)
        self.at(self.now + self.latency, lambda: self.mm[follower.node_id].on_probe_answered(
            leader.node_id, "ok" if ok else reason, self.now) if follower.node_id in self.mm else None)

    def answer(self, follower: Candidate, leader: Candidate, ok: bool, reason: str) -> None:
        mm = self.mm.get(follower.node_id)
        if mm is not None:
            mm.on_join_response(leader.node_id, ok, reason, self.now)

    def fail(self, follower: Candidate, leader: Candidate) -> None:
        mm = self.mm.get(follower.node_id)
        if mm is not None:
            mm.on_join_failed(leader.node_id, self.now)

    def deliver_begin(self, follower: Candidate, group) -> None:
        mm = self.mm.get(follower.node_id)
        if mm is not None:
            mm.on_begin(group.leader, group.group_id, list(group.members))

    def deliver_disband(self, follower: Candidate, leader: Candidate) -> None:
        mm = self.mm.get(follower.node_id)
        if mm is not None:
            mm.on_disband(leader.node_id, self.now)

    def groups(self) -> dict[int, tuple]:
        """group id -> member list, checking every member agrees on it."""
        out: dict[int, tuple] = {}
        for nid, mm in self.mm.items():
            assert mm.done
            if mm.group is None:
                continue
            g = mm.group
            assert g.members[g.index].node_id == nid
            assert out.setdefault(g.group_id, g.members) == g.members, "members disagree on the list"
        for gid, members in out.items():
            for c in members:
                if c.node_id in self.dead:
                    continue
                got = self.mm[c.node_id].group
                assert got is not None and got.group_id == gid, "a listed member is not in the group"
        return out
