"""The first-lines rule, enforced: founders start from one state, and a group that averages the same numbers
from every member hears why.

Peers of a run must start from the same weights and draw different batches. Founders (trainers that start a
run together, when nobody has a snapshot to give them) each publish their initial state and, after
``FOUNDER_WINDOW_S``, all take the one with the lowest SHA-256 among those advertised (the founder that holds
it keeps its own): the same choice on every founder, as DDP broadcasts rank 0's. Whether the script seeded
every peer alike or each its own, they start alike. The opposite mistake (every peer drawing the same batches)
shows as averages equal to each member's own contribution: ``SameData`` warns once after a few such steps.
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("peerd.torch")

FOUNDER_WINDOW_S = 1.5  # a founder waits this long after publishing its initial state for the others' adverts
SAME_STEPS = 3  # consecutive averaged steps equal to this member's own contribution before the warning
SAME_CHECKED = 50  # averaged steps checked at most (the mistake shows from the first steps)
# How close (relative L2) an average may be to this member's own vector and still count as "the same": the
# codec's own rounding (two quantizations for int8/int4, one cast for fp16/bf16) keeps equal inputs that close;
# members that drew different batches are tens of percent apart.
SAME_TOLERANCE = {None: 1e-5, "fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2, "int8": 3e-2, "int4": 0.2}

SAME_DATA_WARNING = (
    "the last {n} averages in groups of {size} equal this replica's own {what} (relative difference {rel:.1e}): "
    "every member is computing the same numbers, most likely from the same data in the same order (the same "
    "seed for data shuffling and sampling on every peer). The swarm then does one peer's work. Draw different "
    "batches on each peer: e.g. seed the data loader with the peer's rank or a random seed, or shard the "
    "dataset by peer; keep the model's initial weights alike (peerd makes founders agree on them)."
)


class SameData:
    """Counts averaged steps whose result equals this member's own contribution; warns once (``warned``)."""

    def __init__(self, compression: str | None) -> None:
        self.tolerance = SAME_TOLERANCE.get(compression)  # None (arc-topk): not checked (a sparse average)
        self.run = 0  # consecutive "same" steps
        self.checked = 0
        self.warned = ""

    def check(self, result: torch.Tensor, own: list[torch.Tensor | None], numels: list[int],
              reply: dict[str, Any], step: int, what: str = "gradients") -> bool:
        """Compare the averaged flat ``result`` with this member's own tensors; True when it warned now."""
        if self.tolerance is None or self.warned or self.checked >= SAME_CHECKED:
            return False
        self.checked += 1
        diff = norm = 0.0
        off = 0
        for t, n in zip(own, numels, strict=True):
            r = result[off: off + n]
            if t is None:
                diff += float(torch.linalg.vector_norm(r)) ** 2
            else:
                o = t.detach().reshape(-1).float()
                diff += float(torch.linalg.vector_norm(r.to(o.device) - o)) ** 2
                norm += float(torch.linalg.vector_norm(o)) ** 2
            off += n
        rel = (diff / norm) ** 0.5 if norm > 0 else (0.0 if diff == 0 else 1.0)
        self.run = self.run + 1 if rel <= self.tolerance else 0
        if self.run < SAME_STEPS:
            return False
        self.warned = SAME_DATA_WARNING.format(n=self.run, size=reply.get("group_size", "?"), what=what, rel=rel)
        log.warning("step %d: %s", step, self.warned)
        return True


def reseed_peer(peer_id: str, session: int, run: str) -> int:
    """Seed torch's, numpy's and Python's global generators with a seed of this peer's own (its daemon's node
    id, its session there, the run): scripts seeded alike on every peer then draw different batches (a
    DataLoader's shuffle, torch.randint/randperm sampling, dropout) from here on. Returns the seed."""
    digest = hashlib.sha256(f"peerd-reseed-v1/{peer_id}/{session}/{run}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1  # < 2**63: what torch.manual_seed takes
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (the legacy global generator is what scripts seed and draw from)
    random.seed(seed)
    return seed
