"""Local-socket ops that `peerd bench allreduce` drives: seeded vectors made in the daemon, so the
timed part is the average alone and no 100 MB vector crosses the local socket."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import trio

from ..bench.vectors import seeded_vector
from ..localsock.server import OpError
from ..transport.udp import UdpSocket
from .robust import Robust, parse_robust
from .service import AllreduceService, AverageResult, Member

MAX_BENCH_ELEMENTS = 1 << 28  # 1 GiB of float32


class BenchOps:
    def __init__(self, service: AllreduceService, sock: UdpSocket) -> None:
        self.service = service
        self.sock = sock
        self._prepared: dict[int, tuple[list[Member], int, np.ndarray, float, Robust | None]] = {}
        self._results: dict[int, AverageResult] = {}

    def ops(self) -> dict[str, Any]:
        return {"bench_prepare": self.prepare, "bench_run": self.run, "bench_result": self.result}

    async def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            group = int(req["group_id"])
            members = [Member(None, bytes.fromhex(pid), (host, int(port))) for pid, host, port in req["members"]]
            index, seed, size, weight = int(req["index"]), int(req["seed"]), int(req["size"]), float(req["weight"])
            robust = parse_robust(req.get("robust"))
        except (KeyError, ValueError, TypeError) as e:
            raise OpError(f"bench_prepare: bad arguments ({e})") from None
        if not 0 <= size <= MAX_BENCH_ELEMENTS or not 0 <= index < len(members):
            raise OpError("bench_prepare: size or index out of range")
        vector = await trio.to_thread.run_sync(seeded_vector, seed, size)
        self._prepared[group] = (members, index, vector, weight, robust)
        return {}

    async def run(self, req: dict[str, Any]) -> dict[str, Any]:
        group = int(req.get("group_id", -1))
        if group not in self._prepared:
            raise OpError(f"bench_run: group {group} was not prepared")
        members, index, vector, weight, robust = self._prepared.pop(group)
        drops0 = self.sock.kernel_drops
        cpu0 = time.process_time()
        sock0 = self.sock.statistics()
        try:
            result = await self.service.average(group, members, index, vector, weight, out=vector, robust=robust)
        except ValueError as e:
            raise OpError(str(e)) from None
        done = time.time()
        cpu = time.process_time() - cpu0  # the whole daemon: in a bench it does nothing else
        self._results[group] = result
        st = result.stats
        return {
            "done_at": done,
            "seconds": result.seconds,
            "cpu_s": cpu,
            "handshake_s": result.handshake_s,
            "bytes_sent": result.bytes_sent,
            "datagrams_sent": st.reduce_scatter.datagrams_sent + st.all_gather.datagrams_sent,
            "datagrams_received": st.reduce_scatter.datagrams_received + st.all_gather.datagrams_received,
            "datagrams_expected": st.reduce_scatter.datagrams_expected + st.all_gather.datagrams_expected,
            "rs_ended_by": st.reduce_scatter.ended_by,
            "ag_ended_by": st.all_gather.ended_by,
            "kernel_drops": self.sock.kernel_drops - drops0,
            "drops": dict(st.drops),
            "refused": dict(st.refused),
            "pacer_rate": self.service.pacer.rate,
            "receive_passes": self.sock.receive_passes - sock0.receive_passes,
            "receive_calls": self.sock.receive_calls - sock0.receive_calls,
            "send_calls": self.sock.send_calls - sock0.send_calls,
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
