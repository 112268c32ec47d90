"""The data path's CPU cost without sockets, trio or other daemons: ``python -m peerd.tools.bench.dataplane``.

N members average one vector in one process: each member's blocks are sealed for their receiver, opened there
and handed to its group (``receive_block``), as the daemon does, but with no syscalls, pacing or event loop
between them. CPU seconds per member per average, by stage, on the Python path and on the native one, each in
the same process and on the same vectors, so that on a shared, loaded machine the two are compared fairly
(``peerd bench allreduce`` measures the whole daemon, where the load of other processes moves every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np

from ..._dataplane.heap import keep_freed_memory
from ...allreduce import BodyType, GroupAverage
from ...allreduce.group import DEFAULT_MAX_PAYLOAD
from ...wire import native as loader
from ...wire.envelope import HEADER_SIZE
from ...wire.seal import TAG_SIZE, Opener, Sealer

_DATA = frozenset({int(BodyType.RS_DATA), int(BodyType.AG_DATA)})


def run(members: int, size: int, mtu: int, native: bool, sealed: bool, in_place: bool, rows: int,
        seed: int = 0, stages: list[np.ndarray] | None = None) -> dict[str, Any]:
    """One average of ``size`` float32 among ``members``; CPU seconds per member by stage. ``stages``: each member's
    stage buffer from an earlier average (as AveragingHost keeps one), replaced by this average's."""
    rng = np.random.default_rng(seed)
    secret = os.urandom(32) if sealed else None
    ids = [os.urandom(32) for _ in range(members)]
    vectors = [rng.standard_normal(size).astype(np.float32) for _ in range(members)]
    payload = mtu - HEADER_SIZE - (TAG_SIZE if sealed else 0)
    reused = bool(stages)
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cores = [GroupAverage(1, members, i, vectors[i], 1.0 + i, 0.0, max_payload=payload, out=vectors[i],
                          stage=stages[i] if stages else None)
             for i in range(members)]
    sealers = [Sealer(secret, native=native) for _ in range(members)]
    openers = [Opener(secret, ids[i], native=native) for i in range(members)]
    for s in sealers:  # each token's first datagram goes the row-by-row way: make every token known
        for j, o in enumerate(openers):
            o.open(s.seal(int(BodyType.RS_END), b"\0" * 19, ids[j]))
    cpu = {"pack": 0.0, "seal": 0.0, "open": 0.0, "receive": 0.0}
    clock = time.process_time
    while not all(c.finished for c in cores):
        for i, core in enumerate(cores):
            t0 = clock()
            blocks = core.blocks_to_send(rows, 1 << 30)
            cpu["pack"] += clock() - t0
            for b in blocks:
                t0 = clock()
                datagrams = sealers[i].seal_block(b.type, b.bodies, ids[b.to])
                t1 = clock()
                cpu["seal"] += t1 - t0
                if b.type not in _DATA:
                    for row in datagrams:
                        _, body, _ = openers[b.to].open(row.tobytes())
                        for _ in range(b.repeat):
                            cores[b.to].receive(i, b.type, body, 1.0)
                    continue
                opened = openers[b.to].open_block(datagrams, in_place=in_place)
                t2 = clock()
                cpu["open"] += t2 - t1
                assert opened is not None and not opened.auth_failures
                if cores[b.to].receive_block(i, b.type, opened.bodies, 1.0) is None:
                    for body in opened.bodies:
                        cores[b.to].receive(i, b.type, body.tobytes(), 1.0)
                cpu["receive"] += clock() - t2
        for c in cores:
            c.handle_timer(1.0)
    t0 = clock()
    for c in cores:
        c.result()
    cpu["result"] = clock() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    if stages is not None:
        stages[:] = [c.stage_buffer for c in cores]
    per = {k: round(v / members, 4) for k, v in cpu.items()}
    return {"dataplane": "native" if native else "python", "sealed": sealed, "in_place": in_place,
            "reused_stage": reused, "cpu_s_per_member": round(sum(cpu.values()) / members, 4),
            "page_faults_per_member": faults // members, "by_stage": per}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peerd.tools.bench.dataplane", description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=4, help="members of the group (default 4)")
    p.add_argument("--size", type=int, default=25_000_000, help="float32 elements (default 25M: 100 MB)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MAX_PAYLOAD + HEADER_SIZE + TAG_SIZE,
                   help="datagram bytes (default 1200)")
    p.add_argument("--rows", type=int, default=448,
                   help="bodies per block (default 448: 512 KB blocks; a daemon's are up to 1 MB)")
    p.add_argument("--insecure", action="store_true", help="no AEAD")
    p.add_argument("--repeat", type=int, default=2, help="averages per path (default 2; the lower CPU counts)")
    p.add_argument("--keep-heap", action="store_true",
                   help="keep freed block buffers in the heap (heap.keep_freed_memory), as a daemon does")
    p.add_argument("--fresh-stage", action="store_true",
                   help="a fresh stage buffer for every average (default: reuse the last one's, as a daemon does)")
    args = p.parse_args(argv)
    if args.keep_heap and not keep_freed_memory():
        print("--keep-heap: not glibc, nothing changed", file=sys.stderr)
    paths = [False] + ([True] if loader.native is not None else [])
    if loader.native is None:
        print(f"native path not measured: {loader.reason}", file=sys.stderr)
    results = []
    for native in paths:
        for in_place in ([False, True] if native and not args.insecure else [False]):
            # Like a daemon's host, later averages reuse the stage buffers of the one before (the first pays
            # for fresh pages; --fresh-stage makes every one do so, as before the host kept them).
            stages: list[np.ndarray] | None = None if args.fresh_stage else []
            best = min((run(args.members, args.size, args.mtu, native, not args.insecure, in_place, args.rows,
                            stages=stages) for _ in range(args.repeat)), key=lambda r: r["cpu_s_per_member"])
            results.append(best)
    print(json.dumps({"members": args.members, "size": args.size, "mtu": args.mtu, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
