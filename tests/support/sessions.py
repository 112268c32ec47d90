"""Trainer sessions over the local socket of an in-process daemon."""

from __future__ import annotations

import threading

import numpy as np

from peerd.localsock.arena import Arena
from peerd.localsock.client import LocalClient

LAYOUT = [["w", [3, 4], "float32"], ["b", [4], "float32"]]  # 16 elements


def open_session(path: str, layout=LAYOUT, run="r1", nslots=4, **extra):
    """``extra``: trainer_open's other fields (compression, ...)."""
    elems = sum(int(np.prod(s)) for _, s, _ in layout)
    arena = Arena.create(nslots, elems)
    client = LocalClient(path, timeout=30)
    reply = client.call("trainer_open", fds=[arena.fd], run=run, layout=layout, nslots=nslots, **extra)
    return client, arena, reply


def step(client, arena, reply, t, vec, samples, **extra):
    arena.vector(t)[:] = vec
    arena.write_request(t, samples)
    r = client.call("trainer_step", session=reply["session"], step=t, timeout_s=5.0, **extra)
    return r, arena.result(t).copy()


def run_sessions(d, vectors, *, opened: dict | None = None, may_go=None, **extra):
    """Each vector as one new session's step 1 on daemon ``d``, all at once (threads): [(reply, result), ...].
    ``opened``: trainer_open's other fields; ``may_go(i)``: session i starts once it says so (None: at once);
    ``extra``: the step request's (kind, round, ...)."""
    sessions = [open_session(d.path, **(opened or {})) for _ in vectors]
    out: dict[int, tuple] = {}

    def go(i: int) -> None:
        while may_go is not None and not may_go(i):
            threading.Event().wait(0.01)
        out[i] = step(*sessions[i], 1, vectors[i], 1, **extra)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(vectors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c, a, _ in sessions:
        c.close()
        a.close()
    return [out[i] for i in range(len(vectors))]
