"""Trainer sessions over the local socket of an in-process daemon."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from peerd.localsock.arena import Arena
from peerd.localsock.client import LocalClient
from peerd.localsock.server import Connection

LAYOUT = [["w", [3, 4], "float32"], ["b", [4], "float32"]]  # 16 elements
SERVICE_LAYOUT = [["w", [40, 50], "float32"], ["b", [50], "float32"]]  # 2,050 elements: Trainer's
ELEMS = 40 * 50 + 50


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


class Trainer:
    """One trainer's session on one daemon: its arena and connection, as the local socket server hands them over."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.arena = Arena.create(4, ELEMS)
        self.conn = Connection()
        self.session = 0
        self.step_no = 0

    async def open(self, **options: object) -> dict:
        self.conn.fds = [os.dup(self.arena.fd)]
        reply = await self.service._op_open({"run": "c", "layout": SERVICE_LAYOUT, "nslots": 4, **options},
                                            self.conn)
        self.session = reply["session"]
        return reply

    async def step(self, vector: np.ndarray, samples: float) -> tuple[dict, np.ndarray]:
        self.step_no += 1
        self.arena.vector(self.step_no)[:] = vector
        self.arena.write_request(self.step_no, samples)
        reply = await self.service._op_step({"session": self.session, "step": self.step_no, "timeout_s": 30.0},
                                            self.conn)
        return reply, self.arena.result(self.step_no).copy()

    def close(self) -> None:
        self.conn._close()
        self.arena.close()
