"""Local-socket ops that `peerd bench allreduce` drives: seeded vectors made in the daemon, so the
timed part is the average alone and no 100 MB vector crosses the local socket.

``peerd join`` installs them on its daemon from outside (``install_bench_ops``); ``--profile`` wraps the data path's
methods in place, so the daemon's modules hold no bench code."""

from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ...allreduce import group as _group
from ...allreduce.arctopk import ArcTopKPlan, matrix_shapes, phase_totals, service_arc_topk
from ...allreduce.options import AverageOptions
from ...allreduce.robust import Robust, parse_robust
from ...allreduce.service import AllreduceService, AverageResult, Member
from ...compress import NAMES as CODEC_NAMES
from ...compress import Codec
from ...compress import codec as make_codec
from ...localsock.server import OpError
from ...nat.averager import PathsFirst
from ...transport.udp import UdpSocket
from ...wire import seal as _seal
from .vectors import seeded_vector

if TYPE_CHECKING:
    from ...daemon import Daemon

MAX_BENCH_ELEMENTS = 1 << 28  # 1 GiB of float32

# What ``--profile`` times, stage -> (class, method): each a synchronous call over a block (or one datagram),
# so a wrapper's microsecond is small beside it. Nested stages are exclusive: the all-gather's finalize runs
# inside ``blocks_to_send`` and counts as finalize only.
STAGES: dict[str, tuple[type, str]] = {
    "seal": (_seal.Sealer, "seal_block"),
    "seal_one": (_seal.Sealer, "seal"),
    "seal_split": (_seal.Sealer, "seal_split"),
    "open": (_seal.Opener, "open_block"),
    "open_one": (_seal.Opener, "open"),
    "pack": (_group.GroupAverage, "blocks_to_send"),
    "finalize": (_group.GroupAverage, "_finalize_through"),
    "receive_block": (_group.GroupAverage, "receive_block"),
    "receive_one": (_group.GroupAverage, "receive"),
}
SYSCALLS = {"recv_syscall": "recvmsg_into", "send_syscall": "sendmsg", "sendto_syscall": "sendto"}


class StageClock:
    """CPU seconds (this thread's) by stage, exclusive of nested stages: a bench-only instrument that wraps
    methods in place, so nothing in the data path pays for it unless a bench asks for ``profile``."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []  # per open stage: CPU time its nested stages took

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time
        totals, calls, stack = self.totals, self.calls, self._stack

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                totals[name] = totals.get(name, 0.0) + spent - stack.pop()
                calls[name] = calls.get(name, 0) + 1
                if stack:
                    stack[-1] += spent

        timed.__peerd_stage__ = True  # type: ignore[attr-defined]
        return timed

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


class _TimedSocket:
    """A socket whose receive and send syscalls are timed by a StageClock; everything else passes through
    (trio waits on it through ``fileno``)."""

    def __init__(self, sock: Any, clock: StageClock) -> None:
        self._sock = sock
        for stage, method in SYSCALLS.items():
            setattr(self, method, clock.wrap(stage, getattr(sock, method)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


_CLOCK: StageClock | None = None


def install_profiler(sock: UdpSocket) -> StageClock:
    """Wrap the data path's stages (once per process) and ``sock``'s syscalls; returns the clock."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = StageClock()
        for name, (cls, method) in STAGES.items():
            fn = getattr(cls, method)
            if not getattr(fn, "__peerd_stage__", False):
                setattr(cls, method, _CLOCK.wrap(name, fn))
    if not isinstance(sock.sock, _TimedSocket):
        sock.sock = _TimedSocket(sock.sock, _CLOCK)  # type: ignore[assignment]
        if sock._native_send is not None:  # the C send of a part: its syscalls, as the Python loop's sendmsg
            sock._native_send = _CLOCK.wrap("send_syscall", sock._native_send)
    return _CLOCK


def bench_arc_topk(req: dict[str, Any], size: int) -> tuple[list[tuple[int, ...]], float] | None:
    """arc-topk's (shapes, ratio) when a bench_prepare request names ``compression`` arc-topk: ``layout``
    [rows, cols] (the vector as a stack of rows x cols matrices, any rest a 1-D tail) and ``topk_ratio``
    (default 0.1). None for the body codecs. ValueError on anything else."""
    if req.get("compression") != "arc-topk":
        return None
    layout = req.get("layout")
    if not isinstance(layout, list | tuple) or len(layout) != 2:
        raise ValueError("arc-topk needs layout [rows, cols]")
    ratio = float(req.get("topk_ratio", 0.1))
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"topk_ratio must be in (0, 1], got {ratio}")
    return matrix_shapes(size, int(layout[0]), int(layout[1])), ratio


def bench_codec(req: dict[str, Any]) -> Codec:
    """The codec a bench_prepare request names: ``compression`` (fp32 when absent), and for int8/int4
    ``quant_group`` (default 128) and ``rounding`` (default stochastic). ValueError on anything else."""
    name = req.get("compression") or "fp32"
    if name not in CODEC_NAMES:
        raise ValueError(f"compression must be one of {', '.join(CODEC_NAMES)}, got {name!r}")
    if not str(name).startswith("int"):
        return make_codec(name)
    group = req.get("quant_group")
    rounding = req.get("rounding") or "stochastic"
    return make_codec(name, group=128 if group is None else int(group), rounding=str(rounding))


class BenchOps:
    def __init__(self, service: AllreduceService, sock: UdpSocket) -> None:
        self.service = service
        self.sock = sock
        self._prepared: dict[int, tuple[list[Member], int, np.ndarray, float, Robust | None, Codec, int]] = {}
        self._arc: dict[int, tuple[list[tuple[int, ...]], float]] = {}  # arc-topk groups: (shapes, ratio)
        self._results: dict[int, AverageResult] = {}
        self._clock: StageClock | None = None

    def ops(self) -> dict[str, Any]:
        return {"bench_prepare": self.prepare, "bench_run": self.run, "bench_result": self.result}

    async def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            group = int(req["group_id"])
            members = [Member(None, bytes.fromhex(pid), (host, int(port))) for pid, host, port in req["members"]]
            index, seed, size, weight = int(req["index"]), int(req["seed"]), int(req["size"]), float(req["weight"])
            robust = parse_robust(req.get("robust"))
            profile = bool(req.get("profile", False))
            arc = bench_arc_topk(req, size)
            codec = bench_codec(req) if arc is None else make_codec("fp32")  # arc-topk: fp32 dense rows
            run = int(req.get("run", 0))
            if not 0 <= run < 1 << 64:
                raise ValueError(f"run {run} is not a u64")
        except (KeyError, ValueError, TypeError) as e:
            raise OpError(f"bench_prepare: bad arguments ({e})") from None
        if not 0 <= size <= MAX_BENCH_ELEMENTS or not 0 <= index < len(members):
            raise OpError("bench_prepare: size or index out of range")
        if profile and self._clock is None:
            self._clock = install_profiler(self.sock)
        vector = await trio.to_thread.run_sync(seeded_vector, seed, size)
        self._prepared[group] = (members, index, vector, weight, robust, codec, run)
        if arc is not None:
            self._arc[group] = arc
        return {}

    async def run(self, req: dict[str, Any]) -> dict[str, Any]:
        group = int(req.get("group_id", -1))
        if group not in self._prepared:
            raise OpError(f"bench_run: group {group} was not prepared")
        members, index, vector, weight, robust, codec, run = self._prepared.pop(group)
        if group in self._arc:
            return await self._run_arc(group, members, index, vector, weight, run, *self._arc.pop(group),
                                       robust=robust)
        # fp32 goes the way it always went (a service without the codec arguments runs it unchanged)
        coded: dict[str, Any] = {} if codec.wire_id == 0 else {"codec": codec, "run": run}
        drops0 = self.sock.kernel_drops
        if self._clock is not None:
            self._clock.reset()
        cpu0 = time.process_time()
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        sock0 = self.sock.statistics()
        dropped0 = self._endpoint_drops()
        relayed0 = self._relayed()
        try:
            result = await self.service.average(group, members, index, vector, weight,
                                                AverageOptions(robust=robust, **coded), out=vector)
        except ValueError as e:
            raise OpError(str(e)) from None
        except TypeError as e:  # a daemon whose AllreduceService does not pass a codec through yet
            raise OpError(f"bench_run: this daemon cannot average in {codec.name} ({e})") from None
        done = time.time()
        cpu = time.process_time() - cpu0  # the whole daemon: in a bench it does nothing else
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._results[group] = result
        st = result.stats
        reply: dict[str, Any] = {}
        if self._clock is not None:
            stages = {k: round(v, 6) for k, v in sorted(self._clock.totals.items())}
            stages["other"] = round(cpu - sum(stages.values()), 6)  # trio, handlers, metrics, reports
            reply["stages"] = stages
            reply["stage_calls"] = dict(sorted(self._clock.calls.items()))
        return reply | {
            "compression": codec.name,
            "dataplane": _seal.dataplane(),
            "done_at": done,
            "seconds": result.seconds,
            "cpu_s": cpu,
            "sys_s": usage.ru_stime - usage0.ru_stime,  # the kernel's part of it
            # On a loaded machine every page fault (fresh memory: a group's stage) is a point where the daemon
            # is preempted: these two tell a wall time lost to the scheduler from one spent computing.
            "page_faults": usage.ru_minflt - usage0.ru_minflt,
            "preempted": usage.ru_nivcsw - usage0.ru_nivcsw,
            "handshake_s": result.handshake_s,
            "rs_s": st.reduce_scatter.duration_s,
            "ag_s": st.all_gather.duration_s,
            "bytes_sent": result.bytes_sent,
            "datagrams_sent": st.reduce_scatter.datagrams_sent + st.all_gather.datagrams_sent,
            "datagrams_received": st.reduce_scatter.datagrams_received + st.all_gather.datagrams_received,
            "datagrams_expected": st.reduce_scatter.datagrams_expected + st.all_gather.datagrams_expected,
            "rs_ended_by": st.reduce_scatter.ended_by,
            "ag_ended_by": st.all_gather.ended_by,
            # a phase its deadline ended: what it had when it gave up (a failing lab test shows this first)
            "deadline_phases": [_phase_detail(name, ph) for name, ph in (("rs", st.reduce_scatter),
                                                                               ("ag", st.all_gather))
                                if ph.ended_by == "deadline"],
            "kernel_drops": self.sock.kernel_drops - drops0,
            "drops": dict(st.drops),
            # every datagram the endpoint dropped, by reason (counted after the lossy socket: ``injected``), and
            # what this node sent through a relay: a relayed path's data is lost at the relay too (its own
            # ``injected``, ``relay_queue``), which no receiver's group counts
            "endpoint_drops": _delta(self._endpoint_drops(), dropped0),
            "datagrams_relayed": self._relayed() - relayed0,
            "refused": dict(st.refused),
            "pacer_rate": self.service.pacer.rate,
            "pacer_decreases": self.service.pacer.decreases,
            "receive_passes": self.sock.receive_passes - sock0.receive_passes,
            "receive_calls": self.sock.receive_calls - sock0.receive_calls,
            "send_calls": self.sock.send_calls - sock0.send_calls,
        }

    def _endpoint_drops(self) -> dict[str, float]:
        """The endpoint's datagrams_dropped counters by reason (injected loss, replay, auth, overload, ...): what
        never reached the group, so a bench can tell every datagram that went missing from silent loss."""
        metrics = getattr(getattr(self.service, "inner", self.service), "metrics", None)  # (PathsFirst wraps it)
        counter = getattr(metrics, "datagrams_dropped", None)
        if counter is None:
            return {}
        out: dict[str, float] = {}
        for family in counter.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels.get("reason", "")] = sample.value
        return out

    def _relayed(self) -> int:
        counts = getattr(getattr(getattr(self.service, "inner", self.service), "endpoint", None), "path_counts", None)
        return int(counts["relayed"][0]) if counts else 0

    async def _run_arc(self, group: int, members: list[Member], index: int, vector: np.ndarray, weight: float,
                       run: int, shapes: list[tuple[int, ...]], ratio: float, *,
                       robust: Robust | None = None) -> dict[str, Any]:
        """One arc-topk average (peerd.allreduce.arctopk: three group averages), timed like ``run``; ``robust``
        clips its sketch and dense phases."""
        drops0 = self.sock.kernel_drops
        cpu0 = time.process_time()
        try:
            plan = ArcTopKPlan.build(shapes, len(members), ratio, self.service.max_body)
            res = await service_arc_topk(self.service, group, members, index, vector, weight, plan, run=run,
                                         round=group, options=AverageOptions(robust=robust))
        except ValueError as e:
            raise OpError(str(e)) from None
        done = time.time()
        totals = phase_totals(res.phases)
        last = res.phases[-1]
        self._results[group] = AverageResult(res.vector, last.stats, totals["seconds"], totals["handshake_s"],
                                             totals["bytes_sent"], totals["datagrams_sent"])
        return totals | {
            "compression": "arc-topk",
            "topk_ratio": ratio,
            "known_selections": res.known,
            "got_fraction": res.got_fraction,
            # each phase (sketch, selection, dense): its seconds, the handshake's part, how its two halves ended
            "arc_phases": [{"s": round(r.seconds, 4), "handshake_s": round(r.handshake_s, 4),
                            "ended_by": [r.stats.reduce_scatter.ended_by, r.stats.all_gather.ended_by]}
                           for r in res.phases],
            "dataplane": _seal.dataplane(),
            "done_at": done,
            "cpu_s": time.process_time() - cpu0,
            "kernel_drops": self.sock.kernel_drops - drops0,
            "pacer_rate": self.service.pacer.rate,
        }

    async def result(self, req: dict[str, Any]) -> dict[str, Any]:
        group = int(req.get("group_id", -1))
        result = self._results.pop(group, None)
        if result is None:
            raise OpError(f"bench_result: no result for group {group}")
        path = req.get("path")
        if isinstance(path, str):
            await trio.to_thread.run_sync(np.save, path, result.vector)
        return {}


def install_bench_ops(daemon: Daemon) -> BenchOps:
    """Serve the bench ops on ``daemon``'s local socket (its averages take the NAT path first, as Moshpit's do)."""
    bench = BenchOps(PathsFirst(daemon.allreduce, daemon.nat), daemon.socket)
    daemon.add_ops(bench.ops())
    return bench


def _phase_detail(name: str, ph: Any) -> dict[str, Any]:
    """One phase's stats, for a phase that ended by its deadline: which streams were silent, how many ENDs came."""
    return {"phase": name, "ends_received": ph.ends_received, "silent": list(ph.silent),
            "datagrams_expected": ph.datagrams_expected, "datagrams_received": ph.datagrams_received,
            "length_s": None if ph.started_at is None or ph.ended_at is None else round(ph.ended_at - ph.started_at, 4)}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """Counters that moved between two readings."""
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v != before.get(k, 0)}
