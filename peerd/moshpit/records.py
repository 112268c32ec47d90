"""The Moshpit DHT records, their formats and validation (sans-I/O, injected time).

Three keys per run, each written by every peer under its own node id (a shared subkey would belong to
whoever wrote it first):

- ``run/round/key``: "looking for a group under this key" (``[expiry, ip, port, reach?, cap?]``, msgpack);
- ``run/progress``: the last round the writer finished (a msgpack uint);
- ``run/config``: the run's grid (``"4x4"``, text).

Every record comes from a member that is not trusted: whatever does not parse, names another node or
lies outside the ranges below is counted and skipped, never raised (PROTOCOL.md section 17).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import msgpack

from ..linkcap.advert import CapAdvert
from ..wire import messages as m
from ..wire.identity import node_id_of
from .keys import Grid
from .matchmaking import REACH_PUBLIC, REACH_SYMMETRIC, REACH_UNKNOWN, Candidate

PROGRESS_TTL_S = 600.0
CONFIG_TTL_S = 3600.0
# Rounds travel as uint32; 2**32 - 1 is never used, so the last round a run can average is MAX_ROUND. A run
# that reaches it stops with a MoshpitError (use a new run id): nothing wraps, so no round number repeats.
MAX_ROUND = 2**32 - 2
# A progress record more than MAX_AHEAD rounds ahead of both this node's round and the median of the fresh
# records is ignored (counted): one member's record could otherwise move the whole run to its last round.
MAX_AHEAD = 1000
# A node that has averaged in a run follows peers it averaged with up to MAX_AHEAD rounds ahead, strangers (ids are
# free to mint, so any number of them may agree) at most STRANGER_AHEAD: an honest swarm's rounds move together.
STRANGER_AHEAD = 16
PROGRESS_FRESH_S = 60.0  # records stored this recently make the median (stale ones only when none is fresh)


class MoshpitError(Exception):
    """A request the scheduler refuses (bad run id, vector, grid); the message says what to fix."""


class RecordLike(Protocol):
    """What the Moshpit reads of a DHT record (dht.records.Record has it; the simulator's records too)."""

    subkey: bytes
    value: bytes
    expires: float
    owner: bytes


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not 1 <= len(run_id.encode()) <= m.MAX_RUN or "/" in run_id:
        raise MoshpitError(f"run id must be 1..{m.MAX_RUN} bytes of text without '/', got {run_id!r:.80}")
    return run_id


def group_dht_key(run_id: str, round_no: int, key: str) -> bytes:
    return f"{run_id}/{round_no}/{key}".encode()


def progress_key(run_id: str) -> bytes:
    return f"{run_id}/progress".encode()


def config_key(run_id: str) -> bytes:
    return f"{run_id}/config".encode()


# -- run/round/key ------------------------------------------------------------------------------------
def encode_announce(expiry: float, host: str, port: int, reach: int = REACH_UNKNOWN,
                    cap: CapAdvert | None = None) -> bytes:
    """``reach``: the announcer's reachability rank (matchmaking's REACH_*), a 4th element only when known or a cap
    follows; ``cap``: its bandwidth caps (PROTOCOL.md 16.1), a 5th element only when it has one."""
    fields = [expiry, ipaddress.ip_address(host).packed, port]
    if cap is not None and cap.capped:
        return msgpack.packb([*fields, reach, cap.encode()])
    return msgpack.packb(fields if reach == REACH_UNKNOWN else [*fields, reach])


@dataclass(frozen=True, slots=True)
class Announce:
    expiry: float
    node_id: bytes
    public_key: bytes
    host: str
    port: int
    reach: int = REACH_UNKNOWN
    cap: CapAdvert | None = None


def decode_announce(record: RecordLike) -> Announce | None:
    """A matchmaking record, or None for one that is not well-formed (the caller counts it)."""
    return _decode_announce(record.owner, record.subkey, record.value)


@functools.lru_cache(maxsize=8192)  # every poll of a key re-reads the same records (bounded: LRU)
def _decode_announce(owner: bytes, subkey: bytes, value: bytes) -> Announce | None:
    try:
        expiry, ip, port, *rest = msgpack.unpackb(value)
        node_id = node_id_of(owner)
        if subkey != node_id or not isinstance(expiry, float) or type(port) is not int or not 0 < port < 65536:
            raise ValueError("fields")
        reach = rest[0] if 1 <= len(rest) <= 2 else REACH_UNKNOWN if not rest else -1
        if type(reach) is not int or not REACH_PUBLIC <= reach <= REACH_SYMMETRIC:
            raise ValueError("reach")
        cap = CapAdvert.decode(rest[1]) if len(rest) == 2 else None
        cap = cap if cap is not None and cap.capped else None  # (all zero: no cap)
        host = str(ipaddress.ip_address(ip))
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return Announce(expiry, node_id, owner, host, port, reach, cap)


def pack_members(members: Iterable[Candidate], me: bytes, loopback: str) -> list[list]:
    """MM_BEGIN's member list: ``[pk, ip, port]``, and ``true`` after them for a capped member. This node's own
    entry (``me``) may hold the wildcard it listens on (no --announce), which no decoder accepts: it travels as
    ``loopback``, and receivers reach the sender of a BEGIN where the BEGIN came from anyway."""
    out = []
    for c in members:
        host = c.addr[0]
        if c.node_id == me and ipaddress.ip_address(host).is_unspecified:
            host = loopback
        out.append([c.public_key, ipaddress.ip_address(host).packed, c.addr[1], *([True] if c.capped else [])])
    return out


# -- run/progress -------------------------------------------------------------------------------------
def encode_progress(round_no: int) -> bytes:
    return msgpack.packb(round_no)


def finished_since(records: Iterable[RecordLike], round_no: int) -> frozenset[bytes]:
    """The node ids whose progress says they finished round ``round_no`` or a later one (a DiLoCo outer
    step's members: each finished one of the step's rounds, averaged or alone)."""
    return frozenset(owner for owner, value, _ in decode_progress(records)[0] if value >= round_no)


def decode_progress(records: Iterable[RecordLike]) -> tuple[list[tuple[bytes, int, float]], dict[str, int]]:
    """(owner node id, last finished round, when stored) of each well-formed record, and what was skipped
    ({"malformed": n, "range": n})."""
    out: list[tuple[bytes, int, float]] = []
    skipped = {"malformed": 0, "range": 0}
    for r in records:
        try:
            value = msgpack.unpackb(r.value)
        except (ValueError, msgpack.UnpackException):
            skipped["malformed"] += 1
            continue
        if type(value) is int and 0 <= value <= MAX_ROUND:
            out.append((node_id_of(r.owner), value, r.expires - PROGRESS_TTL_S))
        else:
            skipped["range"] += 1
    return out, skipped


def plausible_progress(records: list[tuple[bytes, int, float]], own_round: int, now: float,
                       known: frozenset[bytes] | set[bytes] | dict = frozenset(),
                       ) -> tuple[list[tuple[bytes, int, float]], int]:
    """The progress records (owner, round, stored) to believe, and how many were ignored as too far ahead.

    Node ids are free to mint, so agreement among owners proves nothing. A node that has averaged in the run
    (``known``: whom with) believes those peers up to MAX_AHEAD rounds past its own round and strangers up to
    STRANGER_AHEAD, however many of them agree. A joiner knows nobody: it ignores records more than MAX_AHEAD
    rounds past both its round and the (lower) median of the fresh records, which one member alone cannot move
    (a member with many ids can: a joiner trusts the swarm it first sees)."""
    if not records:
        return [], 0
    if known:
        kept = [r for r in records
                if r[1] <= own_round + (MAX_AHEAD if r[0] in known else STRANGER_AHEAD)]
        return kept, len(records) - len(kept)
    values = sorted(v for _, v, stored in records if stored > now - PROGRESS_FRESH_S) or sorted(
        v for _, v, _ in records)
    limit = max(own_round, values[(len(values) - 1) // 2]) + MAX_AHEAD
    kept = [r for r in records if r[1] <= limit]
    return kept, len(records) - len(kept)


# -- run/config ---------------------------------------------------------------------------------------
def encode_grid(grid: Grid) -> bytes:
    return str(grid).encode()


def published_grid(records: Iterable[RecordLike], fits: Callable[[Grid], bool] = lambda g: True) -> Grid | None:
    """The grid a run's publishers name most often (ties: the smaller grid), among grids that parse and fit.

    Each publisher writes under its own node id, so no member can hide another's record; ids are free to mint,
    though, so a Sybil member can still outvote: runs that must not be steered pass their grid explicitly."""
    votes: dict[Grid, int] = {}
    for r in records:
        try:
            grid = Grid.parse(r.value.decode())
        except (ValueError, UnicodeDecodeError):
            continue
        if not fits(grid):
            continue
        votes[grid] = votes.get(grid, 0) + 1
    if not votes:
        return None
    return min(votes, key=lambda g: (-votes[g], g.size, g.dims))
