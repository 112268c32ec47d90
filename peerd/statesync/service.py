"""State sync: a joining peer downloads the swarm's training state from peers that advertise it.

Donors: a daemon whose trainer publishes a snapshot (parameters, optimizer state and step number, an
opaque blob to the daemon) keeps the last few snapshots in memory and advertises the newest in the DHT
under ``peerd/state/<run id>`` (subkey: its node id). The value names the snapshot exactly: run key
(run id and layout hash), step, size and SHA-256.

Joiners: read every advertisement, keep those of the same run key and layout (same model) whose size is
within what the local model can produce (a bound from its layout), rank the snapshots (donors this node
has averaged with first, then a step that is not far ahead of the swarm's median, then snapshots that two or
more donors hold over those only one holds (when two or more donors advertise at all), then the newest step,
then the most donors agreeing on the same bytes), and download the best in chunks spread over all donors
that hold it, with a fixed pool of workers, over the endpoint's request/response (STATE_GET -> STATE_CHUNK,
PROTOCOL.md section 15). Why reuse the endpoint's request/response rather than a new reliable stream: it
already retries with backoff, matches responses by request id, and authenticates every datagram with the
swarm key; a chunk is one datagram, so there is nothing to reassemble but the blob itself. A chunk that
fails at one donor is asked of the next; the whole blob is verified against the advertised hash before
anyone uses it, and a blob that does not verify is thrown away and the next candidate snapshot is tried.
Every failure (no donor has some bytes, a donor sends other bytes, the hash does not match, no memory for
the blob) moves on to the next candidate; only the overall deadline ends the search.

Members are not trusted: an advertisement is a claim by someone who holds the swarm key, and ids are free
to mint. So the advertised size must fit the local model (no allocation from a stranger's number), the
advertised step cannot lift a stranger above donors this node averaged with, a step more than AHEAD_STEPS
past the swarm's median advertised step only counts after every step that is not, and one donor alone cannot
outrank a snapshot that several hold by claiming a newer step: a fresh joiner (no known donors) takes a lone
donor's snapshot only when no two donors agree on one. What this leaves: a member with two minted ids that
advertise the same bytes counts as agreement, and in a swarm whose donors never hold identical bytes the newest
step within the margin wins. The trainer checks what it loads (finite tensors, a plausible step, the step the
adverts claimed) and asks for the next candidate when a snapshot fails (``exclude``).

Several donors can hold byte-identical snapshots because replicas that averaged in the same group apply
the same averaged gradients; when donors disagree, the best ranked snapshot wins and the others are not
mixed in (mixing chunks of different snapshots would fail the hash).

DiLoCo outer steps (peerd.trainer.outer) reuse the donor side and the chunked download for their averaged
vectors: ``fetch_range`` reads one shard of a member's vector (checked by the caller against the shard's
published hash), ``download`` the whole vector that won the agreement (checked against its hash).

The advertisement also carries the layout hash; an advertisement of another layout is ignored (counted
as ``ignored_records{kind="state_advert",reason="layout"}``), never a reason to refuse a local trainer.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..deadlines import DeadlineTuner
from ..dht import DhtService
from ..metrics import Metrics
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..wire import messages as m
from ..wire.errors import WireError
from ..wire.identity import node_id_of
from .advert import Advert, ad_key
from .choice import MAX_SNAPSHOT, Download, Finished, SnapshotChoice

if TYPE_CHECKING:
    from ..linkcap.shell import CapGate

log = logging.getLogger("peerd.statesync")

KEEP = 4  # snapshots kept per run: a joiner mid-download keeps its snapshot while donors move on
AD_TTL_S = 120.0  # an advertisement lives this long unless refreshed (every publish refreshes it)
WORKERS = 16  # chunk workers per download, each with one request in flight (a queue of chunks, not a task each)
CHUNK_OVERHEAD = 320  # bytes of a STATE_CHUNK body that are not data (rid, from, sha, offsets, keys)
MIN_PIECE = 256  # a STATE_CHUNK with fewer data bytes than this (short of the range's end) is a donor's fault
MAX_NOTED = 1024  # peers remembered from this node's own averaging rounds


class StateSyncError(Exception):
    """No usable snapshot could be downloaded; the message says why."""


class _Mismatch(StateSyncError):
    """The bytes downloaded do not hash to the advertised SHA-256 (some donor served other bytes)."""


@dataclass
class Fetched:
    step: int
    blob: bytes | bytearray
    sha: bytes
    donors: int
    chunks: int
    retries: int


class StateSync:
    """Donor and joiner sides of state sync. ``known_peers`` (a set of hex node ids, or a callable returning
    them, e.g. the members of the Moshpit rounds this node averaged in) ranks those donors' snapshots above
    strangers'; peers seen through ``note_peers`` count too."""

    def __init__(self, endpoint: Endpoint, dht: DhtService | None, metrics: Metrics, *,
                 advertise: Address | None = None,
                 known_peers: Callable[[], Iterable[str]] | Iterable[str] | None = None) -> None:
        self.endpoint = endpoint
        self.dht = dht
        self.metrics = metrics
        self.advertise = advertise
        self.deadlines: DeadlineTuner | None = None  # a download's deadline tunes itself within the caller's timeout
        self.clock: Callable[[], float] = time.time  # (the tuner's clock: wall-clock seconds, as the daemon's)
        self._snapshots: dict[str, OrderedDict[bytes, bytes]] = {}  # run key -> sha -> blob
        self._known_source: Callable[[], Iterable[str]] | Iterable[str] | None = None
        self._noted: OrderedDict[str, None] = OrderedDict()  # hex ids of peers averaged with, newest last
        self.set_known_peers(known_peers)
        self.gate: CapGate | None = None  # a node with bandwidth caps: what it serves and asks for keeps to them
        endpoint.on_request(m.MsgType.STATE_GET, self._on_get)

    def set_known_peers(self, source: Callable[[], Iterable[str]] | Iterable[str] | None) -> None:
        """Where the ids of peers this node has averaged with come from (hex strings); None: only noted ones."""
        self._known_source = source

    def note_peers(self, members: Iterable[object]) -> None:
        """Remember the members of a round this node averaged in (hex node ids; anything else is skipped)."""
        for i, member in enumerate(members):
            if i >= 256:
                break
            if isinstance(member, str) and len(member) == 64:
                self._noted[member.lower()] = None
                self._noted.move_to_end(member.lower())
        while len(self._noted) > MAX_NOTED:
            self._noted.popitem(last=False)

    def known_peers(self) -> set[str]:
        """Hex ids of the peers this node has averaged with (noted, plus the injected source)."""
        known = set(self._noted)
        source = self._known_source
        try:
            extra = source() if callable(source) else source
            if extra is not None:
                known.update(str(k).lower() for k in extra)
        except Exception as e:  # a ranking hint: never a reason to fail a download
            log.warning("state sync: reading the known peers failed: %s", e)
        return known

    @property
    def node_id(self) -> bytes:
        return self.endpoint.identity.node_id

    # -- donor side -----------------------------------------------------------------------------
    def keep(self, run_key: str, blob: bytes, *, sha: bytes | None = None) -> bytes:
        """Hold ``blob`` for joiners (the newest KEEP per run); returns its SHA-256. ``sha``: that hash where this
        daemon's own code computed it already (an outer step's vectors: megabytes not hashed twice); a fetcher
        checks what it gets against the hash it asked for either way."""
        if sha is None:
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
        """Every live advertisement under ``run`` (this node's included).

        A full read, not one that ends when a few holders agree: adverts are read when a trainer opens
        or joins, and the members nearest the key could otherwise show a joiner only their own (the
        donor ranking counts on seeing the honest majority)."""
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

    def _on_get(self, incoming: Incoming) -> dict | None:
        if self.gate is not None and not self.gate.admit_serving(self.endpoint.max_body):
            return None  # over the caps' share for serving: silent, and the joiner's retransmission waits
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
    async def fetch(self, run: str, run_key: str, *, timeout: float = 60.0, min_step: int = 0,
                    max_size: int | None = None, layout: str | None = None,
                    below: bytes | None = None, exclude: Iterable[bytes] = ()) -> Fetched | None:
        """Download the best snapshot of ``run_key`` that others advertise; None if nobody has one.

        ``max_size``: the most bytes a snapshot of the local model can hold (adverts of larger ones are
        ignored and counted; default MAX_SNAPSHOT); ``layout``: the local model's layout hash (adverts of
        another layout are ignored and counted); ``below``: a founder's own initial snapshot's hash: only
        snapshots of a later step, or initial ones (step 0) with a lower hash, the initial ones ranked by hash
        (every founder then takes the same initial state: the lowest hash advertised); ``exclude``: SHA-256s of
        snapshots not to take (ones the trainer refused to load: the next candidate is tried instead). Raises
        StateSyncError if snapshots are advertised but none could be downloaded and verified within ``timeout``.
        The choice (which snapshot, from whom, what next) is SnapshotChoice's; this only reads and downloads.
        """
        fetched: Fetched | None = None
        timeout = timeout if self.deadlines is None else self.deadlines.state_sync(timeout).seconds
        choice = SnapshotChoice(self.node_id, run_key, layout=layout, min_step=min_step, max_size=max_size,
                                below=below, exclude=tuple(exclude), deadline=trio.current_time() + timeout)
        with trio.move_on_at(choice.deadline):
            ads = await self.adverts(run, timeout=timeout / 3)
            choice.receive_adverts(ads, self.known_peers(), trio.current_time())
        try:
            while True:
                if not choice.done and trio.current_time() >= choice.deadline:
                    choice.handle_timer(trio.current_time())
                for action in choice.take_actions():
                    if isinstance(action, Finished):
                        return self._finished(action, fetched, timeout)
                    fetched, why, mismatch = await self._attempt(run_key, action, choice.deadline)
                    choice.receive_download(fetched is not None, why, mismatch, trio.current_time())
        finally:
            stats = choice.statistics()
            self.metrics.ignored_records.labels("state_advert", "layout").inc(stats.ignored_layout)
            self.metrics.ignored_records.labels("state_advert", "size").inc(stats.ignored_size)

    async def _attempt(self, run_key: str, action: Download, deadline: float) -> tuple[Fetched | None, str, bool]:
        """One download the choice asked for: (what it fetched or None, why not, whether the bytes did not verify)."""
        cand = action.candidate
        with trio.move_on_at(deadline):
            try:
                t0 = trio.current_time()
                got = await self._download(run_key, cand.sha, cand.size, cand.step, list(action.donors))
                if self.deadlines is not None:  # its pace tunes the next download's deadline
                    self.deadlines.receive_transfer(cand.size, trio.current_time() - t0, self.clock())
                return got, "", False
            except (StateSyncError, RpcError, MemoryError, OSError) as e:
                why = "no memory for the snapshot" if isinstance(e, MemoryError) else str(e)
                log.info("state sync: snapshot %s (step %d, %d bytes) from %d donor(s) failed: %s",
                         cand.sha.hex()[:12], cand.step, cand.size, len(action.donors), why)
                return None, why, isinstance(e, _Mismatch)
        return None, "the deadline passed", False

    def _finished(self, done: Finished, fetched: Fetched | None, timeout: float) -> Fetched | None:
        if done.found:
            self.metrics.trainer_state_fetches.labels("ok").inc()
            return fetched
        if done.none:
            self.metrics.trainer_state_fetches.labels("none").inc()
            return None
        self.metrics.trainer_state_fetches.labels("failed").inc()
        raise StateSyncError(done.error.replace("within the deadline", f"within {timeout:.0f} s"))

    async def _resolve(self, ad: Advert) -> Address | None:
        return await self.resolve(ad.node_id, ad.addr)

    async def resolve(self, node_id: bytes, addr: Address | None) -> Address | None:
        """Where to reach ``node_id``: the address it announced, else where the DHT knows it; None if nowhere."""
        if addr is not None and not ipaddress.ip_address(addr[0]).is_unspecified:
            return addr
        if self.dht is None:
            return None
        for contact in self.dht.core.table.contacts():
            if contact.node_id == node_id:
                return contact.addr
        for contact in await self.dht.find_nodes(node_id):
            if contact.node_id == node_id:
                return contact.addr
        return None

    async def fetch_range(self, addr: Address, run_key: str, sha: bytes, offset: int, length: int, *,
                          timeout: float = 0.3, attempts: int = 6) -> bytes:
        """``length`` bytes at ``offset`` of the blob ``sha`` that ``addr`` holds under ``run_key`` (e.g. one
        shard of a DiLoCo outer average, repaired from its owner). The caller verifies what it gets (a range
        cannot be checked against the whole blob's hash). ``timeout``/``attempts``: each request's
        retransmission schedule (Endpoint.request; a read is idempotent, so a caller that knows the round trip
        may retransmit much sooner than the default). Raises StateSyncError or RpcError."""
        if not 0 <= length <= MAX_SNAPSHOT:
            raise StateSyncError(f"a range of {length} bytes is out of bounds")
        chunk = max(1, min(m.MAX_CHUNK, self.endpoint.max_body - CHUNK_OVERHEAD))
        out = bytearray()
        while len(out) < length:
            want = min(chunk, length - len(out))
            if self.gate is not None:
                await self.gate.wait_fetch(want + CHUNK_OVERHEAD)
            reply = await self.endpoint.request(
                addr, m.MsgType.STATE_GET,
                {"run": run_key.encode(), "sha": sha, "offset": offset + len(out), "length": want},
                timeout=timeout, attempts=attempts,
            )
            body = reply.body
            data = body["data"]
            if body["sha"] != sha or body["offset"] != offset + len(out) or len(data) > want \
                    or len(data) < min(want, MIN_PIECE):
                raise StateSyncError(f"{addr[0]}:{addr[1]} answered for another range or blob")
            out += data
        return bytes(out)

    async def download(self, run_key: str, sha: bytes, size: int, addrs: list[Address]) -> bytes | bytearray:
        """The whole blob ``sha`` of ``size`` bytes held under ``run_key`` by the nodes at ``addrs``, in chunks
        spread over them and verified against ``sha``. Raises StateSyncError (or RpcError)."""
        return (await self._download_from(run_key, sha, size, 0, list(dict.fromkeys(addrs)))).blob

    async def _download(self, run_key: str, sha: bytes, size: int, step: int, donors: list[Advert]) -> Fetched:
        addrs = list(dict.fromkeys(a for a in [await self._resolve(d) for d in donors] if a is not None))
        return await self._download_from(run_key, sha, size, step, addrs)

    async def _download_from(self, run_key: str, sha: bytes, size: int, step: int, addrs: list[Address]) -> Fetched:
        """``size`` bytes named by ``sha`` from the donors at ``addrs``: WORKERS tasks take chunks off one queue;
        a chunk that fails at one donor is asked of the next; one that fails at all of them ends the download."""
        if not addrs:
            raise StateSyncError("no donor address could be found")
        chunk = max(1, min(m.MAX_CHUNK, self.endpoint.max_body - CHUNK_OVERHEAD))
        count = -(-size // chunk)
        buf = bytearray(size)  # size is within the caller's bound (MemoryError: the caller moves on)
        dead: set[Address] = set()
        used: set[Address] = set()
        retries = 0
        queue = iter(range(count))
        failed: list[int] = []

        async def get(i: int) -> bool:
            nonlocal retries
            offset = i * chunk
            want = min(chunk, size - offset)
            got = 0
            # Start at donor i mod d, so chunks spread over all donors; move on when one fails.
            order = [addrs[(i + k) % len(addrs)] for k in range(len(addrs))]
            for attempt, addr in enumerate(o for o in order * 2 if o not in dead):
                if attempt:
                    retries += 1
                try:
                    while got < want:
                        if self.gate is not None:
                            await self.gate.wait_fetch(want - got + CHUNK_OVERHEAD)
                        reply = await self.endpoint.request(
                            addr, m.MsgType.STATE_GET,
                            {"run": run_key.encode(), "sha": sha, "offset": offset + got, "length": want - got},
                            timeout=0.3, attempts=4,
                        )
                        body = reply.body
                        data = body["data"]
                        if body["sha"] != sha or body["total"] != size or body["offset"] != offset + got \
                                or len(data) > want - got:
                            dead.add(addr)  # it lies about what it holds: ask it nothing more
                            raise StateSyncError(f"{addr[0]}:{addr[1]} answered for another range or snapshot")
                        if len(data) < min(want - got, MIN_PIECE):
                            dead.add(addr)  # a trickle would keep a joiner busy for ever
                            raise StateSyncError(f"{addr[0]}:{addr[1]} sent {len(data)} bytes of {want - got}")
                        buf[offset + got: offset + got + len(data)] = data
                        got += len(data)
                    used.add(addr)
                    return True
                except (RpcError, StateSyncError) as e:
                    if "refused" in str(e):
                        dead.add(addr)  # it no longer holds the snapshot: ask it nothing more
                    log.debug("state chunk at %d from %s: %s", offset, addr, e)
            return False

        async def worker(nursery: trio.Nursery) -> None:
            for i in queue:  # shared by all workers: each chunk is taken once
                if not await get(i):
                    failed.append(i * chunk)
                    nursery.cancel_scope.cancel()  # the snapshot cannot be completed: stop asking for the rest
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(min(WORKERS, count)):
                nursery.start_soon(worker, nursery)
        if failed:
            raise StateSyncError(f"no donor delivered the bytes at offset {failed[0]} (of {size})")
        if hashlib.sha256(buf).digest() != sha:
            raise _Mismatch("the downloaded snapshot does not match its advertised SHA-256")
        return Fetched(step, buf, sha, len(used), count, retries)  # no copy: a snapshot can be GBs
