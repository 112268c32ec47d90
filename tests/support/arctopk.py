"""ARC-Top-K groups run in-process: a plan for given shapes, a group of cores averaging through it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import trio

from peerd.allreduce import GroupAverage
from peerd.allreduce.arctopk import (
    ArcTopKPlan,
    arc_topk_average,
    phase_group_id,
    phase_options,
)
from peerd.allreduce.frames import peek_group
from peerd.allreduce.group import GROUP_OPTIONS
from peerd.compress.topk import EF21M

from .groups import GroupNet, Wire

SHAPES = [(48, 10), (30,), (20, 6), (9, 2, 3)]


PAYLOAD = 4 * 40 + 20  # 40 fp32 values a datagram (the tensor header is 20 bytes)


RUN, ROUND = 0xFEED, 7
GROUP = 0x00A7C0DE


def plan_for(n: int, ratio: float = 0.25, shapes=SHAPES, payload: int = PAYLOAD, dense=None) -> ArcTopKPlan:
    return ArcTopKPlan.build(shapes, n, ratio, payload, dense)


def run_group(plan: ArcTopKPlan, xs: list[np.ndarray], ws: list[float], drop=lambda phase, w: False,
              efs: list[EF21M] | None = None, rnd: int = ROUND, dense=None, offload=None, robust=None,
              tamper=None, sketch_exclude=None, dense_exclude=None, factory=None) -> tuple[list, list]:
    """Every member's arc_topk_average, phase by phase: a phase's GroupAverages run over one GroupNet once every
    member has handed in its vector, with the options the daemon gives each phase (``phase_options``).
    ``tamper(i, phase, vector)``: what member i sends instead (a hostile member). ``sketch_exclude[i]``: the
    members member i's sketch shard leaves out (its suspects), ``dense_exclude[i]`` those its dense shard leaves
    out. ``factory(i)``: the core class of member i (None: GroupAverage; peerd.tools.faults.byzantine for a member
    that corrupts what its core sends, as a daemon run with --fault-byzantine does). Returns (results, per phase:
    the GroupNet that carried it)."""
    n = len(xs)
    nets: list = []
    results: list = [None] * n

    async def main() -> None:
        pending: dict[int, dict[int, np.ndarray]] = {0: {}, 1: {}, 2: {}}
        done = {p: trio.Event() for p in range(3)}
        out: dict[int, list] = {}

        def phase_of(w: Wire) -> int:
            return [phase_group_id(GROUP, p) for p in range(3)].index(peek_group(w.body))

        async def average(i: int, phase: int, gid: int, vector: np.ndarray):
            pending[phase][i] = vector if tamper is None else tamper(i, phase, vector.copy())
            if len(pending[phase]) == n:
                c = dense if phase == 2 else None
                options = phase_options(replace(GROUP_OPTIONS, codec=c, run=RUN, robust=robust), phase)
                each = [options] * n
                leave_out = {0: sketch_exclude, 2: dense_exclude}.get(phase)
                if leave_out is not None:
                    each = [replace(options, exclude=tuple(leave_out[k])) for k in range(n)]
                make = factory or (lambda k: GroupAverage)
                cores = [make(k)(gid, n, k, pending[phase][k], ws[k], 0.0, options=each[k], max_payload=PAYLOAD)
                         for k in range(n)]
                net = GroupNet(cores, drop=lambda w: drop(phase_of(w), w))
                net.run(allow_late=True)
                nets.append(net)
                out[phase] = [c.result().copy() for c in cores]
                done[phase].set()
            await done[phase].wait()
            return out[phase][i], None, 0

        async def member(i: int) -> None:
            extra = {} if offload is None else {"offload": offload}
            results[i] = await arc_topk_average(lambda p, g, v: average(i, p, g, v), plan, GROUP, i, xs[i],
                                                run=RUN, round=rnd, ef=efs[i] if efs else None, **extra)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(member, i)

    trio.run(main)
    return results, nets


def wmean(vs: list[np.ndarray], ws: list[float], who) -> np.ndarray:
    who = list(who)
    return sum(ws[k] * vs[k].astype(np.float64) for k in who) / sum(ws[k] for k in who)
