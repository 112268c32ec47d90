"""Trainer sessions over the local socket of an in-process daemon."""

from __future__ import annotations

import numpy as np

from peerd.localsock.arena import Arena
from peerd.localsock.client import LocalClient

LAYOUT = [["w", [3, 4], "float32"], ["b", [4], "float32"]]  # 16 elements


def open_session(path: str, layout=LAYOUT, run="r1", nslots=4):
    elems = sum(int(np.prod(s)) for _, s, _ in layout)
    arena = Arena.create(nslots, elems)
    client = LocalClient(path, timeout=30)
    reply = client.call("trainer_open", fds=[arena.fd], run=run, layout=layout, nslots=nslots)
    return client, arena, reply


def step(client, arena, reply, t, vec, samples, **extra):
    arena.vector(t)[:] = vec
    arena.write_request(t, samples)
    r = client.call("trainer_step", session=reply["session"], step=t, timeout_s=5.0, **extra)
    return r, arena.result(t).copy()
