"""State sync: a joining peer downloads the swarm's training state from peers that advertise it.

Donors: a daemon whose trainer publishes a snapshot (parameters, optimizer state and step number, an
opaque blob to the daemon) keeps the last few snapshots in memory and advertises the newest in the DHT
under ``peerd/state/<run id>`` (subkey: its node id). The value names the snapshot exactly: run key
(run id and layout hash), step, size and SHA-256.

Joiners: read every advertisement, keep those of the same run key (same model), pick the snapshot that
the most donors hold among the newest steps, and download it in chunks spread over all donors that hold
it, over the endpoint's request/response (STATE_GET -> STATE_CHUNK, PROTOCOL.md section 15). Why reuse
the endpoint's request/response rather than a new reliable stream: it already retries with backoff,
matches responses by request id, and authenticates every datagram with the swarm key; a chunk is one
datagram, so there is nothing to reassemble but the blob itself. A chunk that fails at one donor is asked
of the next; the whole blob is verified against the advertised hash before anyone uses it, and a blob that
does not verify is thrown away and the next candidate snapshot is tried.

Several donors can hold byte-identical snapshots because replicas that averaged in the same group apply
the same averaged gradients; when donors disagree, the most widely held newest snapshot wins and the
others are not mixed in (mixing chunks of different snapshots would fail the hash).

The advertisement also carries the layout hash, so a daemon can refuse a trainer whose model differs
from the one the run is training (see peerd.trainer).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from collections import OrderedDict
from dataclasses import dataclass

import msgpack
import trio

from ..dht import DhtService
from ..metrics import Metrics
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..wire import messages as m
from ..wire.errors import WireError
from ..wire.identity import node_id_of

log = logging.getLogger("peerd.statesync")

KEEP = 4  # snapshots kept per run: a joiner mid-download keeps its snapshot while donors move on
AD_TTL_S = 120.0  # an advertisement lives this long unless refreshed (every publish refreshes it)
PARALLEL = 16  # chunk requests in flight
CHUNK_OVERHEAD = 320  # bytes of a STATE_CHUNK body that are not data (rid, from, sha, offsets, keys)


class StateSyncError(Exception):
    """No usable snapshot could be downloaded; the message says why."""


@dataclass(frozen=True)
class Advert:
    """One donor's advertisement, as read from the DHT."""

    node_id: bytes
    run_key: str
    layout: str
    step: int
    size: int
    sha: bytes
    addr: Address | None

    def encode(self) -> bytes:
        return msgpack.packb(
            {"run_key": self.run_key, "layout": self.layout, "step": self.step, "size": self.size,
             "sha": self.sha, "addr": list(self.addr) if self.addr else None},
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, node_id: bytes, value: bytes) -> Advert | None:
        """None for a value that is not a well-formed advertisement (a record is untrusted input)."""
        try:
            v = msgpack.unpackb(value, raw=False)
            addr = v["addr"]
            if addr is not None:
                host, port = addr
                ipaddress.ip_address(host)
                if type(port) is not int or not 1 <= port <= 65535:
                    return None
                addr = (host, port)
            ad = cls(node_id, v["run_key"], v["layout"], v["step"], v["size"], v["sha"], addr)
        except Exception:
            return None
        ok = (isinstance(ad.run_key, str) and isinstance(ad.layout, str) and type(ad.step) is int
              and type(ad.size) is int and ad.size >= 0 and isinstance(ad.sha, bytes) and len(ad.sha) == 32)
        return ad if ok else None


def ad_key(run: str) -> bytes:
    return f"peerd/state/{run}".encode()


@dataclass
class Fetched:
    step: int
    blob: bytes
    sha: bytes
    donors: int
    chunks: int
    retries: int


class StateSync:
    def __init__(self, endpoint: Endpoint, dht: DhtService | None, metrics: Metrics, *,
                 advertise: Address | None = None) -> None:
        self.endpoint = endpoint
        self.dht = dht
        self.metrics = metrics
        self.advertise = advertise
        self._snapshots: dict[str, OrderedDict[bytes, bytes]] = {}  # run key -> sha -> blob
        endpoint.on_request(m.MsgType.STATE_GET, self._on_get)

    @property
    def node_id(self) -> bytes:
        return self.endpoint.identity.node_id

    # -- donor side -----------------------------------------------------------------------------
    def keep(self, run_key: str, blob: bytes) -> bytes:
        """Hold ``blob`` for joiners (the newest KEEP per run); returns its SHA-256."""
        sha = hashlib.sha256(blob).digest()
        held = self._snapshots.setdefault(run_key, OrderedDict())
        held[sha] = blob
        held.move_to_end(sha)
        while len(held) > KEEP:
            held.popitem(last=False)
        return sha

    def forget(self, run_key: str) -> None:
        self._snapshots.pop(run_key, None)

    async def advertise_state(self, run: str, run_key: str, layout: str, *, step: int = -1, size: int = 0,
                              sha: bytes = bytes(32), timeout: float = 5.0) -> bool:
        """Put (or refresh) this node's advertisement for ``run``; step -1 says "training, no snapshot yet"."""
        if self.dht is None:
            return False
        ad = Advert(self.node_id, run_key, layout, step, size, sha, self.advertise)
        with trio.move_on_after(timeout):
            result = await self.dht.put(ad_key(run), self.node_id.hex().encode(), ad.encode(), AD_TTL_S)
            return result.stored > 0
        log.warning("advertising the state of run %s took over %.0f s; joiners may not see it yet", run, timeout)
        return False

    async def adverts(self, run: str, *, timeout: float = 10.0) -> list[Advert]:
        """Every live advertisement under ``run`` (this node's included)."""
        if self.dht is None:
            return []
        with trio.move_on_after(timeout):
            records = await self.dht.get(ad_key(run))
            out = []
            for r in records:
                owner = node_id_of(r.owner)
                if r.subkey != owner.hex().encode():
                    continue  # an advertisement is only valid under its owner's own subkey
                ad = Advert.decode(owner, r.value)
                if ad is not None:
                    out.append(ad)
            return out
        raise StateSyncError(f"reading the advertisements of run {run!r} from the DHT took over {timeout:.0f} s")

    def _on_get(self, incoming: Incoming) -> dict:
        body = incoming.body
        run_key = body["run"].decode("utf-8", "replace")
        blob = self._snapshots.get(run_key, {}).get(body["sha"])
        if blob is None:
            raise WireError("gone", "this node no longer holds that snapshot")
        offset = body["offset"]
        if offset > len(blob):
            raise WireError("range", f"offset {offset} is past the snapshot's {len(blob)} bytes")
        room = max(1, min(m.MAX_CHUNK, self.endpoint.max_body - CHUNK_OVERHEAD))
        data = blob[offset: offset + min(body["length"], room)]
        self.metrics.trainer_state_bytes_served.inc(len(data))
        return {"sha": body["sha"], "offset": offset, "total": len(blob), "data": data}

    # -- joiner side ----------------------------------------------------------------------------
    async def fetch(self, run: str, run_key: str, *, timeout: float = 60.0, min_step: int = 0) -> Fetched | None:
        """Download the best snapshot of ``run_key`` that others advertise; None if nobody has one.

        Raises StateSyncError if snapshots are advertised but none could be downloaded and verified.
        """
        with trio.move_on_after(timeout) as scope:
            ads = [a for a in await self.adverts(run, timeout=timeout / 3)
                   if a.run_key == run_key and a.step >= min_step and a.size > 0 and a.node_id != self.node_id]
            if not ads:
                self.metrics.trainer_state_fetches.labels("none").inc()
                return None
            errors = []
            for sha, step, donors in _candidates(ads):
                # All donors at once; if the result does not verify (a donor served bad bytes), each
                # donor alone, so one bad donor cannot keep a joiner from a snapshot others hold.
                attempts = [donors] + ([[d] for d in donors] if len(donors) > 1 else [])
                for group in attempts:
                    try:
                        fetched = await self._download(run_key, sha, step, group)
                    except StateSyncError as e:
                        errors.append(str(e))
                        log.info("state sync: snapshot %s (step %d) from %d donor(s) failed: %s", sha.hex()[:12],
                                 step, len(group), e)
                        if group is donors and "does not match" not in str(e):
                            break  # no donor has some bytes: the next snapshot, if any
                        continue  # a bad or forgetful donor: try the others, one at a time
                    self.metrics.trainer_state_fetches.labels("ok").inc()
                    return fetched
        self.metrics.trainer_state_fetches.labels("failed").inc()
        if scope.cancelled_caught:
            raise StateSyncError(f"state download did not finish within {timeout:.0f} s")
        raise StateSyncError("no advertised snapshot could be downloaded: " + "; ".join(errors[:3]))

    async def _resolve(self, ad: Advert) -> Address | None:
        if ad.addr is not None and not ipaddress.ip_address(ad.addr[0]).is_unspecified:
            return ad.addr
        if self.dht is None:
            return None
        for contact in self.dht.core.table.contacts():
            if contact.node_id == ad.node_id:
                return contact.addr
        for contact in await self.dht.find_nodes(ad.node_id):
            if contact.node_id == ad.node_id:
                return contact.addr
        return None

    async def _download(self, run_key: str, sha: bytes, step: int, donors: list[Advert]) -> Fetched:
        size = donors[0].size
        addrs = [a for a in [await self._resolve(d) for d in donors] if a is not None]
        if not addrs:
            raise StateSyncError("no donor address could be found")
        chunk = max(1, min(m.MAX_CHUNK, self.endpoint.max_body - CHUNK_OVERHEAD))
        offsets = list(range(0, size, chunk))
        buf = bytearray(size)
        dead: set[Address] = set()
        retries = 0
        used: set[Address] = set()
        limit = trio.CapacityLimiter(PARALLEL)

        async def get(i: int, offset: int) -> None:
            nonlocal retries
            want = min(chunk, size - offset)
            got = 0
            # Start at donor i mod d, so chunks spread over all donors; move on when one fails.
            order = [addrs[(i + k) % len(addrs)] for k in range(len(addrs))]
            for attempt, addr in enumerate(o for o in order * 2 if o not in dead):
                if attempt:
                    retries += 1
                try:
                    async with limit:
                        while got < want:
                            reply = await self.endpoint.request(
                                addr, m.MsgType.STATE_GET,
                                {"run": run_key.encode(), "sha": sha, "offset": offset + got, "length": want - got},
                                timeout=0.3, attempts=4,
                            )
                            body = reply.body
                            data = body["data"]
                            if body["sha"] != sha or body["total"] != size or body["offset"] != offset + got \
                                    or not data or len(data) > want - got:
                                raise StateSyncError(f"{addr[0]}:{addr[1]} answered for another range or snapshot")
                            buf[offset + got: offset + got + len(data)] = data
                            got += len(data)
                    used.add(addr)
                    return
                except (RpcError, StateSyncError) as e:
                    if "refused" in str(e):
                        dead.add(addr)  # it no longer holds the snapshot: ask it nothing more
                    log.debug("state chunk at %d from %s: %s", offset, addr, e)
            failed.append(offset)
            nursery.cancel_scope.cancel()  # the snapshot cannot be completed: stop asking for the rest

        failed: list[int] = []
        async with trio.open_nursery() as nursery:
            for i, offset in enumerate(offsets):
                nursery.start_soon(get, i, offset)
        if failed:
            raise StateSyncError(f"no donor delivered the bytes at offset {failed[0]} (of {size})")
        blob = bytes(buf)
        if hashlib.sha256(blob).digest() != sha:
            raise StateSyncError("the downloaded snapshot does not match its advertised SHA-256")
        return Fetched(step, blob, sha, len(used), len(offsets), retries)


def _candidates(ads: list[Advert]) -> list[tuple[bytes, int, list[Advert]]]:
    """Snapshots to try, best first: newest step, then held by the most donors (more to download from)."""
    by_sha: dict[bytes, list[Advert]] = {}
    for a in ads:
        by_sha.setdefault(a.sha, []).append(a)
    ranked = [(sha, max(a.step for a in group), [a for a in group if a.size == group[0].size])
              for sha, group in by_sha.items()]
    ranked.sort(key=lambda c: (-c[1], -len(c[2]), c[0]))
    return ranked
