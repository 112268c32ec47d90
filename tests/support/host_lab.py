"""The averaging host's test lab: several nodes' AveragingHosts over the one in-memory network (peerd/tools/sim/net.py)
in virtual time, the harness playing the trio shell's part and the transport's (test_allreduce_host explains)."""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from peerd.allreduce import HEADER_SIZE, parse_header
from peerd.allreduce.held import HeldData
from peerd.allreduce.host import (
    AveragingHost,
    Bind,
    Completed,
    Dropped,
    HeldTimer,
    PacerVerdict,
    SendBlock,
    SendReport,
    Wake,
)
from peerd.allreduce.options import AverageOptions
from peerd.tools.sim.net import Link, Network

from .groups import AG_DATA, RS_DATA, expected_results

DATA = (RS_DATA, AG_DATA)
PER = 16  # float32 elements per datagram
MAX_BODY = HEADER_SIZE + 4 * PER
MTU = MAX_BODY + 37
INF = float("inf")


@dataclass
class HostNode:
    i: int
    peer: bytes
    token: int
    host: AveragingHost
    drops: Counter[str] = field(default_factory=Counter)
    done: dict[int, Completed] = field(default_factory=dict)
    binds: list[Bind] = field(default_factory=list)
    verdicts: list[PacerVerdict] = field(default_factory=list)


@dataclass(frozen=True)
class Datagram:
    """One datagram on the wire: ``k`` counts the datagrams of its link (src, dst) so far."""

    src: int
    dst: int
    mtype: int
    body: bytes
    k: int


class Lab:
    """Nodes on the one in-memory network (peerd/tools/sim/net.py), in virtual time. ``link``: every link's loss,
    duplication, latency and jitter, drawn from the network's seeded rng; on top of it, ``drop(d)`` loses a
    datagram and ``dup(d)`` sends it again ``dup_delay`` later (exact patterns). ``bind_at[(src, dst)]``: when
    src's token is bound at dst (default 0: before anything arrives; INF: never). Datagrams of one sender
    that arrive at the same instant reach the host as one block (as GRO hands them over); anything else one
    by one."""

    def __init__(self, n: int, *, drop: Callable[[Datagram], bool] = lambda d: False,
                 dup: Callable[[Datagram], bool] = lambda d: False, dup_delay: float = 0.005,
                 link: Link | None = None, seed: int = 0, bind_at: dict[tuple[int, int], float] | None = None,
                 held: Callable[[], HeldData] | None = None, end_spacing_s: tuple[float, ...] | None = None) -> None:
        self.net = Network(random.Random(seed), default=link or Link(latency=0.01))
        self.nodes = [HostNode(i, bytes([i + 1]) * 32, 0x1000 + i,
                           AveragingHost(max_body=MAX_BODY, mtu=MTU, held=held() if held else None,
                                         end_spacing_s=end_spacing_s))
                      for i in range(n)]
        for i in range(n):
            self.net.attach(i, functools.partial(self._receive, i))
        self.by_peer = {nd.peer: nd for nd in self.nodes}
        self.drop, self.dup, self.dup_delay = drop, dup, dup_delay
        self.bind_at = bind_at or {}
        self._link: Counter[tuple[int, int]] = Counter()
        self._timer: dict[int, float] = {}  # node -> when its host's timer is set for
        self._inbox: dict[int, list[Datagram]] = {}  # arrived at this instant, not handed over yet
        self.arrived: list[Datagram] = []  # every data datagram that reached its receiver's host
        self.members: dict[int, list[int]] = {}  # group id -> node indices in the group's order
        for (src, dst), t in self.bind_at.items():
            if t < INF:
                self.at(t, self._bind, src, dst)

    @property
    def now(self) -> float:
        return self.net.now

    def at(self, t: float, fn: Callable[..., None], *args: Any, owner: int | None = None) -> None:
        """Call ``fn(*args)`` at ``t``; with ``owner``, not if that node has crashed by then."""
        self.net.call_at(t, fn, *args, owner=owner)

    def start(self, t: float | dict[int, float | None], group: int, members: list[int], xs: list[np.ndarray],
              ws: list[float], **kw: Any) -> None:
        """Members start ``group`` at ``t`` (a dict ``t`` gives start times per member; None: never)."""
        self.members[group] = members
        for gi, node in enumerate(members):
            when = t.get(node, 0.0) if isinstance(t, dict) else t
            if when is not None:
                self.at(when, self._start, node, group, gi, xs[gi], ws[gi], kw, owner=node)

    def run(self, until: float | None = None) -> None:
        self.net.run(until)

    # -- the shell's part: what the trio driver does ---------------------------------------------------
    def _start(self, i: int, group: int, gi: int, x: np.ndarray, w: float, kw: dict) -> None:
        node = self.nodes[i]
        peers = [self.nodes[j].peer for j in self.members[group]]
        node.host.start(group, peers, gi, x, w, self.now, options=AverageOptions(**kw))
        self.apply(node)
        self.at(node.host.next_report(group), self._report_timer, i, group, owner=i)
        self._step(i, group)

    def _step(self, i: int, group: int) -> None:
        """What the shell's loop does when it wakes: everything to send, finish or sleep (until a Wake)."""
        host = self.nodes[i].host
        if not host.running(group):
            return
        while host.wants_to_send(group):
            for block in host.datagrams_to_send(self.now, group_id=group):
                self.send(i, block)
        for block in host.due_copies(group, self.now):
            self.send(i, block)
        if host.finished(group):
            for block in host.due_copies(group, INF):
                self.send(i, block)
            host.finish(group, 0, self.now)
            self.apply(self.nodes[i])
            return
        self._arm(i)

    def _arm(self, i: int) -> None:
        """Set the node's one timer for its host's ``get_timer()`` (a later arming replaces an earlier one)."""
        at = self.nodes[i].host.get_timer()
        if at is not None and self._timer.get(i) != at:
            self._timer[i] = at
            self.at(at, self._fire, i, at, owner=i)

    def _report_timer(self, i: int, group: int) -> None:
        host = self.nodes[i].host
        if host.running(group):
            self.apply(self.nodes[i], host.reports(group, 0, self.now))
            self.at(host.next_report(group), self._report_timer, i, group, owner=i)

    def _fire(self, i: int, at: float) -> None:
        if self._timer.get(i) != at:  # a later arming set another
            return
        del self._timer[i]
        self.nodes[i].host.handle_timer(self.now)
        self.apply(self.nodes[i])
        self._arm(i)

    def send(self, i: int, block: SendBlock) -> None:
        """Each part of ``block`` leaves when the host's pacing says."""
        dst = self.members[block.group_id][block.to]
        assert self.nodes[dst].peer == block.peer
        host = self.nodes[i].host
        a = 0
        while a < len(block.bodies):  # (in parts as the daemon's driver sends them)
            rows = block.bodies[a : a + host.part_rows(block)]
            a += len(rows)
            sent_at = host.pace(block, len(rows), rows.size, self.now)
            assert sent_at >= self.now
            kept, copies = [], []
            for row in rows:
                d = Datagram(i, dst, block.type, row.tobytes(), self._link[(i, dst)])
                self._link[(i, dst)] += 1
                if not self.drop(d):
                    kept.append(d)
                    if self.dup(d):
                        copies.append(d)
            self.at(sent_at, self._send, kept, owner=i)
            if copies:
                self.at(sent_at + self.dup_delay, self._send, copies, owner=i)

    def _send(self, datagrams: list[Datagram]) -> None:
        for d in datagrams:
            self.net.send(d.src, d.dst, d, len(d.body))

    def apply(self, node: HostNode, actions: Any = None) -> None:
        """Carry out ``actions`` (None: what the node's host has queued)."""
        for a in node.host.take_actions() if actions is None else actions:
            if isinstance(a, Dropped):
                node.drops[a.reason] += a.count
            elif isinstance(a, Wake):
                self.at(self.now, self._step, node.i, a.group_id, owner=node.i)
            elif isinstance(a, HeldTimer):
                self._arm(node.i)
            elif isinstance(a, Bind):
                node.binds.append(a)
            elif isinstance(a, SendReport):
                self.net.send(node.i, self.by_peer[a.peer].i, a.fields, 100)
            elif isinstance(a, PacerVerdict):
                node.verdicts.append(a)
            elif isinstance(a, Completed):
                node.done[a.group_id] = a
            else:
                raise AssertionError(f"unknown action {a!r}")

    # -- the transport's part: tokens, blocks ----------------------------------------------------------
    def _receive(self, dst: int, src: int, payload: Datagram | dict) -> None:
        node = self.nodes[dst]
        if isinstance(payload, dict):  # a REPORT
            node.host.receive_report(self.nodes[src].peer, payload, self.now)
            self.apply(node)
            return
        inbox = self._inbox.setdefault(dst, [])
        if not inbox:
            self.at(self.now, self._hand_over, dst, owner=dst)
        inbox.append(payload)

    def _hand_over(self, dst: int) -> None:
        """What arrived at this instant: one sender's run of equal-size data bodies of one type as a block."""
        node, inbox = self.nodes[dst], self._inbox.pop(dst, [])
        k = 0
        while k < len(inbox):
            first = inbox[k]
            run = [first]
            while (k + len(run) < len(inbox) and inbox[k + len(run)].src == first.src
                   and inbox[k + len(run)].mtype == first.mtype and len(inbox[k + len(run)].body) == len(first.body)):
                run.append(inbox[k + len(run)])
            k += len(run)
            sender = self.nodes[first.src]
            peer = sender.peer if self.bind_at.get((first.src, dst), 0.0) <= self.now else None
            if first.mtype in DATA:
                self.arrived.extend(run)
            if first.mtype in DATA and len(run) > 1:
                bodies = np.frombuffer(b"".join(d.body for d in run), np.uint8).reshape(len(run), -1)
                node.host.receive_block(peer, sender.token, first.mtype, bodies, self.now)
                self.apply(node)
            else:
                for d in run:
                    node.host.receive_data(peer, sender.token, d.mtype, d.body, self.now)
                    self.apply(node)

    def _bind(self, src: int, dst: int) -> None:
        node = self.nodes[dst]
        node.host.receive_bind(self.nodes[src].token, self.nodes[src].peer, self.now)
        self.apply(node)

    # -- checking ----------------------------------------------------------------------------------
    def delivered(self, group: int) -> set[tuple[int, int, int, int]]:
        """(sender, receiver, type, offset) in the group's member indices, of data that arrived."""
        pos = {node: gi for gi, node in enumerate(self.members[group])}
        out = set()
        for d in self.arrived:
            h = parse_header(d.mtype, d.body)
            if h.group == group:
                out.add((pos[d.src], pos[d.dst], d.mtype, h.offset))
        return out

    def check(self, group: int, xs: list[np.ndarray], ws: list[float], skip: tuple[int, ...] = ()) -> None:
        """Every member's result (but ``skip``'s) is what the arrived data gives, exactly where a range is
        one member's."""
        exp, exact = expected_results(xs, ws, PER, self.delivered(group))
        for gi, node in enumerate(self.members[group]):
            if node in skip:
                continue
            got = self.nodes[node].done[group].vector
            np.testing.assert_allclose(got, exp[gi], rtol=0, atol=1e-5)
            np.testing.assert_array_equal(got[exact[gi]], exp[gi][exact[gi]].astype(np.float32))
