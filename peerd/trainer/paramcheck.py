"""Parameter averages that would change nothing are skipped: a cheap check round first.

A parameter average pulls replicas back together after rounds that left one on its own values for a range. When
every gradient round since the last one ended on the group's common result, the replicas are bit-identical and
the average (the whole model in float32, the slowest round of a run: 0.8-0.9 s of a 0.55 s step in the GPT demo on
100 Mbit/s links) hands every member back what it had. So before it, the group averages a check vector: the bits
of a hash of each member's parameters as 0.0 and 1.0, repeated so that every owner's shard holds every bit
(``check_vector``). Averaged exactly (float32, no codec, no robust step, equal weights), a bit comes out 0.0 or
1.0 only where every contribution to that range agreed on it, and every owner's own contribution always counts in
its own shard. So a member whose complete result (every owner's shard arrived) equals its own check vector
holds the parameters of every owner in the group, and keeps them: the average is skipped (``identical``).

Members decide alone, and a skip only ever keeps a member's own parameters: a member that lies in the check
(values that make an owner's shard echo another member's bits) can at most make an honest member keep its own
parameters for one period, or send the others into the full average without it. A check group smaller than the
session's last gradient group (a member missed it) is never taken for agreement: everyone averages as before.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..moshpit.service import RoundResult
from .records import MAX_GROUP

DIGEST_BYTES = 8  # 64 bits of blake2b over the parameters: a chance collision is 2^-64
BITS = 8 * DIGEST_BYTES
# Shard j of L elements among n members is [j L / n, (j + 1) L / n): with L = BITS (MAX_GROUP + 1), every
# shard of a group of up to MAX_GROUP has at least BITS consecutive elements, i.e. every bit position once.
CHECK_ELEMENTS = BITS * (MAX_GROUP + 1)
CHECK_SHARE = 0.25  # of the step's timeout: the most the check round may take (it normally takes a round trip)


def check_vector(params: np.ndarray) -> np.ndarray:
    """The check round's vector for these parameters: their hash's bits, 0.0 or 1.0, repeated to CHECK_ELEMENTS."""
    flat = np.ascontiguousarray(params, dtype=np.float32).reshape(-1)
    digest = hashlib.blake2b(flat.view(np.uint8).data, digest_size=DIGEST_BYTES).digest()
    bits = np.unpackbits(np.frombuffer(digest, dtype=np.uint8)).astype(np.float32)
    return np.tile(bits, MAX_GROUP + 1)


def identical(result: RoundResult, probe: np.ndarray, last_group: int) -> bool:
    """Whether the check round shows every member of its group holding this member's parameters: averaged with
    at least one other member and at least as many as the session's last gradient group (``last_group``; 0:
    none yet), complete, and equal to ``probe`` in every element."""
    return (result.outcome == "averaged" and result.complete and result.group_size >= max(2, last_group)
            and result.vector.shape == probe.shape and bool(np.array_equal(result.vector, probe)))
