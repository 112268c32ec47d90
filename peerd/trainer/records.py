"""An outer round's records and the pure decisions made from them (PROTOCOL.md section 15.1, peerd.trainer.outer).

A record is one member's claim (its group, the hash of the shard it owns and of its vectors, where to fetch
them); every function here is a deterministic function of the records a member holds, so that every member
that holds the same records decides alike. Records are untrusted input: bounded on decode.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass

import msgpack

MAX_GROUP = 64  # members of one group (Moshpit's MAX_GROUP)
MAX_LENGTH = 2**32 - 1  # elements (allreduce offsets are u32)
SHA = 32
MAX_HOST = 45  # characters of an IP literal (IPv6 with an embedded IPv4 address)
PIECE = 512  # bytes of a shard one piece hash covers (a lost datagram's range spans 3 or 4: little else is fetched)
Address = tuple[str, int]  # a member's fetch address (an IP literal and a port)
PIECE_HASH = 8  # bytes kept of each piece's SHA-256 (it only picks what to fetch; the shard hash checks)
MAX_WAIT_S = 3600.0  # a record's ``wait`` past this (or not a finite number) is not read


@dataclass(frozen=True)
class OuterRecord:
    """One member's claim about an outer round: its group, the hash of the shard it owns and of its averaged
    vector (``avg``), the hash of its repaired vector once it has one (``final``; empty before), the hash
    of its outer state before the step (``state``), the vector's length in elements, where to fetch. The blob
    ``avg`` names holds the averaged vector followed by the piece index of the member's shard (piece_hashes)."""

    node: bytes
    group: str
    size: int
    index: int
    shard: bytes
    avg: bytes
    final: bytes
    state: bytes
    length: int
    addr: Address | None = None
    wait: float | None = None

    def encode(self) -> bytes:
        fields = {"g": self.group, "n": self.size, "i": self.index, "s": self.shard, "a": self.avg,
                  "f": self.final, "t": self.state, "l": self.length, "d": list(self.addr) if self.addr else None}
        if self.wait is not None:
            fields["w"] = round(float(self.wait), 4)
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def decode(cls, node: bytes, value: bytes) -> OuterRecord | None:
        """None for anything that is not a well-formed record (DHT values are untrusted input)."""
        try:
            v = msgpack.unpackb(value, raw=False, max_bin_len=64, max_str_len=64, max_array_len=4, max_map_len=16)
            addr = v["d"]
            if addr is not None:
                host, port = addr
                if not valid_addr(host, port):
                    return None
                addr = (host, port)
            wait = v.get("w")
            if not (type(wait) in (int, float) and 0.0 <= wait <= MAX_WAIT_S):  # (NaN fails the comparison)
                wait = None  # an optional field: a bad one is not read, the record still counts
            rec = cls(node, v["g"], v["n"], v["i"], v["s"], v["a"], v["f"], v["t"], v["l"], addr,
                      None if wait is None else float(wait))
        except Exception:
            return None
        ok = (isinstance(rec.group, str) and len(rec.group) <= 16 and type(rec.size) is int
              and 1 <= rec.size <= MAX_GROUP and type(rec.index) is int and 0 <= rec.index < rec.size
              and all(isinstance(h, bytes) and len(h) == SHA for h in (rec.shard, rec.avg))
              and isinstance(rec.final, bytes) and len(rec.final) in (0, SHA)
              and isinstance(rec.state, bytes) and len(rec.state) in (0, SHA)
              and type(rec.length) is int and 1 <= rec.length <= MAX_LENGTH)
        return rec if ok else None


def valid_addr(host: object, port: object) -> bool:
    """Whether a record's fetch address is one: an IP literal (no name to resolve) and a port in 1..65535."""
    if not isinstance(host, str) or not 1 <= len(host) <= MAX_HOST or type(port) is not int or not 1 <= port <= 65535:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not (ip.is_unspecified or ip.is_multicast)


def shard_bounds(length: int, n: int, j: int) -> tuple[int, int]:
    """Member j's shard of a group of n (peerd.allreduce.shards.Layout.shard: boundaries every member derives)."""
    return (j * length) // n, ((j + 1) * length) // n


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def piece_hashes(shard: bytes | bytearray | memoryview) -> bytes:
    """The owner's index of its shard: a PIECE_HASH-byte prefix of the SHA-256 of every PIECE bytes, so that a
    member fetches only the pieces it holds other bytes of (the whole shard's hash still checks the result)."""
    view = memoryview(shard)
    return b"".join(sha256(view[i: i + PIECE])[:PIECE_HASH] for i in range(0, len(view), PIECE))


def differing_runs(mine: bytes | bytearray | memoryview, index: bytes) -> list[tuple[int, int]]:
    """(offset, length) in bytes of the runs of pieces of ``mine`` whose hash is not the one in ``index``."""
    view = memoryview(mine)
    runs: list[tuple[int, int]] = []
    for n, i in enumerate(range(0, len(view), PIECE)):
        if sha256(view[i: i + PIECE])[:PIECE_HASH] == index[n * PIECE_HASH: (n + 1) * PIECE_HASH]:
            continue
        stop = min(len(view), i + PIECE)
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], stop - runs[-1][0])
        else:
            runs.append((i, stop - i))
    return runs


def owner_record(me: OuterRecord, k: int, records: list[OuterRecord],
                 members: list[bytes] | None) -> OuterRecord | None:
    """The record of shard k's owner in my group: the one published by ``members[k]`` (the group's k-th member
    as the averaging round knows it) that names my group, size, length and index k; None when there is none
    (a record that only claims index k owns nothing)."""
    if not me.group or not members or len(members) != me.size or not 0 <= k < me.size:
        return None
    for r in records:
        if r.node == members[k] and r.node != me.node and r.group == me.group and r.size == me.size \
                and r.length == me.length and r.index == k:
            return r
    return None


def repairs(data: bytes | bytearray, me: OuterRecord, records: list[OuterRecord],
            members: list[bytes] | None) -> list[OuterRecord]:
    """The owners in my group whose shard I hold other bytes of (so I must fetch it from them)."""
    out = []
    for k in range(me.size):
        r = owner_record(me, k, records, members)
        if r is None:
            continue
        start, stop = shard_bounds(me.length, me.size, k)
        if stop > start and sha256(memoryview(data)[4 * start: 4 * stop]) != r.shard:
            out.append(r)
    return out


def winner(records: list[OuterRecord]) -> bytes | None:
    """The final hash the swarm converges on: held by the most members, then from the largest group, then
    the lowest hash (any total order that every member computes alike from the same records)."""
    holders: dict[bytes, list[OuterRecord]] = {}
    for r in records:
        if r.final:
            holders.setdefault(r.final, []).append(r)
    if not holders:
        return None
    return min(holders, key=lambda h: (-len(holders[h]), -max(r.size for r in holders[h]), h))


def agreed(me: OuterRecord, records: list[OuterRecord], *, patient: bool = True, expect: int = 1) -> bool:
    """Whether this member may end the step: it holds the winning final, and either a strict majority of the
    round's members (``expect``, this one included, or the members read if more) hold it, so no other final
    can ever win and the rest adopt it, or (``patient``: until half the deadline) every member it has read has
    published the same final. After that, a member that never publishes a final (dead) is no longer waited
    for, but this member's final must be held by a strict majority of the members read, pending ones counted
    against it: a member that left its group (or found none) must not leave with its own vector while the
    group is still repairing. ``records``: the round's known participants' only."""
    others = [r for r in records if r.node != me.node]
    if winner([*others, me]) != me.final:
        return False
    same = 1 + sum(r.final == me.final for r in others)
    if 2 * same > max(expect, 1 + len(others)):
        return True
    if patient:
        return 1 + len(others) >= expect and same == 1 + len(others)
    return 2 * same > 1 + len(others)


def merged(read: list[OuterRecord], pushed: list[OuterRecord]) -> list[OuterRecord]:
    """One record per node from what was read and what was pushed: the pushed one (it is usually the newer)
    unless only the read one holds a final."""
    out = {r.node: r for r in read}
    for r in pushed:
        old = out.get(r.node)
        if old is None or r.final or not old.final:
            out[r.node] = r
    return list(out.values())


def record_key(run_key: str, round_no: int) -> bytes:
    """The DHT key of an outer round's records (subkeys: the members' node ids)."""
    return f"peerd/outer/{run_key}/{round_no}".encode()


def store_key(run_key: str, round_no: int) -> str:
    """The state-sync key an outer round's blobs are kept under (STATE_GET names it)."""
    return f"{run_key}/o{round_no}"

