"""A group of GroupAverage cores pumped through an in-memory wire, and the payloads and results it expects."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from peerd.allreduce import (
    HEADER_SIZE,
    BodyType,
    GroupAverage,
    Outcome,
)
from peerd.tools.sim.net import Link, Network

RS_DATA, RS_END, AG_DATA, AG_END, AG_NACK = (int(t) for t in BodyType)
GROUP = 0xC0FFEE01


def inputs(n: int, length: int, seed: int = 1,
           weights: list[float] | None = None) -> tuple[list[np.ndarray], list[float]]:
    """``n`` members' float32 vectors of different scales and their integer weights, from ``seed``."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(length).astype(np.float32) * (i + 1) for i in range(n)]
    ws = weights or [float(rng.integers(1, 100)) for _ in range(n)]
    return xs, ws


def payload_for(per: int) -> int:
    return HEADER_SIZE + 4 * per


@dataclass(frozen=True)
class Wire:
    """One copy of one body on the wire."""

    src: int
    dst: int
    mtype: int
    body: bytes
    offset: int  # element offset from the header
    copy: int  # 0..repeat-1 (END markers are sent END_REPEATS times)
    seq: int  # per (src, dst) link, counting every copy


class GroupNet:
    """Delivers bodies between cores over the one in-memory network (peerd/tools/sim/net.py) in virtual time:
    each sender sends one copy every ``gap`` seconds (all its links together), each copy arrives
    ``latency`` (+ optional jitter, which reorders; + ``end_delay`` for END markers) later unless ``drop``
    says otherwise; ``dup`` delivers a copy twice. The network's heap holds the sends and arrivals; time
    jumps to the next of them or the next core deadline."""

    def __init__(
        self,
        members: list[GroupAverage],
        *,
        drop: Callable[[Wire], bool] = lambda w: False,
        dup: Callable[[Wire], bool] = lambda w: False,
        latency: float = 0.01,
        gap: float = 1e-4,
        jitter: float = 0.0,
        end_delay: float = 0.0,
        seed: int = 0,
        batch: int = 64,
    ) -> None:
        self.m = members
        self.n = len(members)
        self.drop, self.dup = drop, dup
        self.gap, self.end_delay = gap, end_delay
        self.net = Network(random.Random(seed), default=Link(latency=latency, jitter=jitter))
        for i in range(self.n):
            self.net.attach(i, self._arrive)
        self.batch = batch
        self.link_free = [0.0] * self.n
        self.link_seq: dict[tuple[int, int], int] = {}
        self.delivered: set[tuple[int, int, int, int]] = set()  # (src, dst, type, offset) of DATA bodies
        self.sent_bodies: list[Wire] = []
        self.max_body = 0

    @property
    def now(self) -> float:
        return self.net.now

    def _arrive(self, src: object, w: Wire) -> None:
        outcome = self.m[w.dst].receive(w.src, w.mtype, w.body, self.net.now)
        if w.mtype in (RS_DATA, AG_DATA) and outcome is Outcome.ACCEPTED:
            self.delivered.add((w.src, w.dst, w.mtype, w.offset))

    def _pump(self) -> None:
        net = self.net
        for i, core in enumerate(self.m):
            while core.wants_to_send:
                out = core.datagrams_to_send(net.now, self.batch)
                assert len(out) <= self.batch
                for o in out:
                    self.max_body = max(self.max_body, len(o.body))
                    offset = struct.unpack_from("<I", o.body, 9)[0]
                    for c in range(o.repeat):
                        key = (i, o.to)
                        seq = self.link_seq.get(key, 0)
                        self.link_seq[key] = seq + 1
                        w = Wire(i, o.to, o.type, o.body, offset, c, seq)
                        self.sent_bodies.append(w)
                        t_send = max(net.now, self.link_free[i])
                        self.link_free[i] = t_send + self.gap
                        if self.drop(w):
                            continue
                        if o.type in (RS_END, AG_END):
                            t_send += self.end_delay
                        for _ in range(2 if self.dup(w) else 1):
                            net.call_at(t_send, net.send, i, o.to, w, len(o.body))

    def run(self, limit_s: float = 1e4, allow_late: bool = False) -> None:
        net = self.net
        self._pump()
        while True:
            deadlines = [d for d in (c.get_timer() for c in self.m) if d is not None]
            pending = net.next_time()
            t_next = min(([pending] if pending is not None else []) + deadlines, default=None)
            if t_next is None:
                break
            assert math.isfinite(t_next) and t_next < limit_s, "a deadline must be finite"
            net.run(until=max(net.now, t_next))  # sends and arrivals up to then
            for c in self.m:
                d = c.get_timer()
                if d is not None and d <= net.now:
                    c.handle_timer(net.now)
            self._pump()
        for c in self.m:
            assert c.finished
            # the delivery log holds accepted bodies only, so late ones cannot skew the expectation; but
            # with sane deadlines none of the deterministic scenarios should give up on data in flight
            assert allow_late or c.statistics().drops.get("late", 0) == 0


def expected_results(
    xs: list[np.ndarray], ws: list[float], per: int, delivered: set[tuple[int, int, int, int]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per member: the expected result (float64) and a mask of the elements it must match exactly: ranges
    holding a single member's value (kept own values, or an owner's range nobody else reached)."""
    n, length = len(xs), len(xs[0])
    w32 = [float(np.float32(w)) for w in ws]
    res = [x.astype(np.float64) for x in xs]
    exact = [np.ones(length, dtype=bool) for _ in xs]
    for j in range(n):
        a, b = j * length // n, (j + 1) * length // n
        for off in range(a, b, per):
            e = min(off + per, b)
            contrib = [j] + [s for s in range(n) if s != j and (s, j, RS_DATA, off) in delivered]
            avg = sum(w32[s] * xs[s][off:e].astype(np.float64) for s in contrib) / sum(w32[s] for s in contrib)
            for i in range(n):
                if i == j or (j, i, AG_DATA, off) in delivered:
                    res[i][off:e] = avg
                    exact[i][off:e] = len(contrib) == 1
    return res, exact


def deliver(datagrams: list, core: GroupAverage, sender: int, now: float = 0.0) -> None:
    """Hand ``core`` what member ``sender`` sent it, every datagram, in order (two members, no wire)."""
    for o in datagrams:
        core.receive(sender, o.type, o.body, now)
