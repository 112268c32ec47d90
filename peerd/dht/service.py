"""The trio driver around DhtCore: lookups, put/get, bootstrap with backoff, bucket refresh."""

from __future__ import annotations

import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ..entropy import default_rng
from ..metrics import Metrics
from ..nurseries import service_nursery
from ..transport.endpoint import Address, Endpoint, Incoming, Peer, RpcError, retry_delays
from ..wire import messages as m
from .core import (
    HELD_ON_WIRE,
    HELD_PREFIX,
    RECENT_LOOKUPS,
    RECENT_S,
    REPLICAS,
    VERIFY_MAX,
    DhtCore,
    Ping,
    had,
    held_prefixes,
)
from .lookup import SLOW_QUERY_S, Lookup, slow_after
from .reads import Enough, near_holders, read_page, signed_part
from .records import MAX_SUBKEYS, Record, location, merge_newest, slot_allows
from .routing import Contact

log = logging.getLogger("peerd.dht")


# Records read from one responder for one get, whatever ``total`` it claims: what an honest node can hold
# under one key. Each costs at most one signature check, and each VALUE page must bring at least one, so
# this bounds the pages too (a page holds 1 to MAX_RECORDS records: ~5 progress records at MTU 1200).
MAX_READ = MAX_SUBKEYS
__all__ = ["MAX_READ", "RECENT_LOOKUPS", "RECENT_S", "SLOW_QUERY_S", "VERIFY_MAX", "BootstrapError", "DhtService",
           "PutResult"]


class BootstrapError(Exception):
    """No bootstrap node answered in time; the message says what to check."""


# A put returns once this share of its replicas accepted the record (a majority: any later full read, and
# any read that hears from more than half of them, finds it); the other STOREs were sent at the same time and
# are awaited in the background (retransmitted like any request), so none is dropped. Waiting for the last
# acknowledgement cost a put the slowest of its round trips (20 of them when every record had k = 20 replicas).
PUT_QUORUM = 0.5
# While its table holds fewer than k contacts, a node looks up its own id this often (jittered by half): nodes
# that join at once find each other in seconds, not at the first refresh (DhtService._maintain). Once the
# table gained no contact over SETTLE_QUIET such periods in a row they stop until it gains one: a swarm of at most
# k nodes never fills the table, and its members must not keep asking all the others every few seconds.
SETTLE_S = 5.0
SETTLE_QUIET = 3
# A table that emptied (every contact failed at once: this node's own link went down, or a queue it overran dropped
# every request for a while) is filled again from the bootstrap nodes and the contacts it last held: first after
# REJOIN_S, then backing off to REJOIN_MAX_S. Nobody else would: the others forgot this node as it forgot them.
REJOIN_S = 1.0
REJOIN_MAX_S = 30.0
REMEMBERED = 32  # contacts' addresses remembered for that (the most recently held)


@dataclass
class PutResult:
    """What a put achieved. ``stored`` and ``refused`` keep counting while STOREs still run in the background
    after the put returned (``pending`` of them at return); ``await finished()`` waits for them all."""

    stored: int  # replicas that accepted the record, this node included
    refused: dict[str, int] = field(default_factory=dict)
    pending: int = 0  # STOREs still unanswered when the put returned
    _done: trio.Event | None = field(default=None, repr=False, compare=False)

    async def finished(self) -> None:
        """Wait until every STORE of the put has been answered or has failed."""
        if self._done is not None:
            await self._done.wait()


# A lookup's query of a contact: the (node id, host, port) of the contacts its answer names (the lookup makes Contacts
# of only those it has not seen). A query that reads on after the contact's first answer (a read's pages) calls the
# function it is given when that answer comes: from then on the lookup waits for it as for a live contact.
Query = Callable[[Contact, Callable[[], None]], Awaitable[list[tuple[bytes, str, int]]]]


class DhtService:
    def __init__(
        self,
        endpoint: Endpoint,
        metrics: Metrics,
        *,
        k: int = 20,
        replicas: int = REPLICAS,
        alpha: int = 3,
        refresh_interval: float = 60.0,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.core = DhtCore(endpoint.identity.node_id, k=k, replicas=replicas, on_refused=self._count_refused)
        self.k = k
        self.replicas = self.core.replicas
        self.alpha = alpha
        self.refresh_interval = refresh_interval
        self.bootstrapped = trio.Event()
        self._wall = wall
        self._rng = default_rng(rng)
        self._nursery: trio.Nursery | None = None
        self._verifying = self.core.verifying  # request senders being PINGed before they may enter the table
        self.lookups = 0  # lookups run (statistics; the bench reads RPC counts from the metrics)
        self._seeds: list[Address] = []  # the bootstrap addresses this node joined through
        self._remembered: OrderedDict[bytes, Address] = OrderedDict()  # contacts lately held: node id -> address
        self.rejoins = 0  # times an emptied table was filled again
        for t in (m.MsgType.PING, m.MsgType.FIND_NODE, m.MsgType.FIND_VALUE, m.MsgType.STORE):
            endpoint.on_request(t, self._on_request)

    def _count_refused(self, reason: str) -> None:
        self.metrics.dht_store_refused.labels(reason).inc()

    @property
    def node_id(self) -> bytes:
        return self.core.node_id

    def peer_count(self) -> int:
        return len(self.core.table)

    # -- background work ------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with service_nursery(self):
            task_status.started()
            await self._maintain()

    async def _maintain(self) -> None:
        next_refresh = next_settle = math.inf
        quiet, known = 0, frozenset[bytes]()  # settle checks in a row that found the table as it was
        rejoin_wait, next_rejoin = REJOIN_S, -math.inf
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            self.core.store.expire(now)
            self.metrics.dht_records.set(len(self.core.store))
            self._remember()
            if self.bootstrapped.is_set() and not len(self.core.table) and now >= next_rejoin:
                ok = await self._rejoin()
                rejoin_wait = REJOIN_S if ok else min(REJOIN_MAX_S, 2 * rejoin_wait)
                next_rejoin = trio.current_time() + rejoin_wait
            if self.bootstrapped.is_set() and next_refresh == math.inf:
                next_refresh = now + self.refresh_interval * self._rng.uniform(0.25, 0.5)
                next_settle = now + SETTLE_S * self._rng.uniform(0.5, 1.5)
            if now >= next_refresh:
                await self.refresh(self.refresh_interval)
                next_refresh = now + self.refresh_interval * self._rng.uniform(0.25, 0.5)
            if now >= next_settle:
                # A table of fewer than k contacts (a swarm of at most k + 1 nodes, or a young one) may miss nodes
                # that joined with this one: the node they all bootstrapped from answered their lookups before it
                # had verified the others, and the join's lookups touched every bucket, so no refresh looks again
                # for refresh_interval. A lookup of this node's own id asks the closest nodes, which in such a swarm
                # is all of them: a few RPCs. A table that stopped growing ends them; a newcomer restarts them.
                ids = frozenset(c.node_id for c in self.core.table.contacts())
                quiet = quiet + 1 if ids <= known else 0
                known = ids
                if len(ids) < self.k and quiet < SETTLE_QUIET:
                    await self.find_nodes(self.node_id)
                next_settle = now + SETTLE_S * self._rng.uniform(0.5, 1.5)

    def _remember(self) -> None:
        """Keep the addresses of the contacts held now (the most recent REMEMBERED) for ``_rejoin``."""
        for c in self.core.table.contacts():
            self._remembered.pop(c.node_id, None)
            self._remembered[c.node_id] = (c.host, c.port)
        while len(self._remembered) > REMEMBERED:
            self._remembered.popitem(last=False)

    async def _rejoin(self) -> bool:
        """The table is empty: PING the bootstrap nodes and the contacts last held until one answers, then look up
        this node's own id through it. Whether the table holds anyone again."""
        addrs = list(dict.fromkeys([*self._seeds, *reversed(self._remembered.values())]))
        for addr in addrs:
            for resolved in await _resolve(addr, self.endpoint):
                try:
                    reply = await self.endpoint.request(resolved, m.MsgType.PING, {})
                except RpcError:
                    continue
                self._heard(reply.peer, resolved)
                await self.find_nodes(self.node_id)
                self.rejoins += 1
                log.info("the routing table had emptied: %d peers again, through %s:%d", self.peer_count(),
                         resolved[0], resolved[1])
                return True
        return bool(len(self.core.table))

    async def refresh(self, interval: float) -> None:
        """Look up a random id in every bucket that no lookup touched for ``interval`` seconds."""
        table = self.core.table
        for index in table.buckets_to_refresh(trio.current_time(), interval):
            await self.find_nodes(table.random_id_in_bucket(index, self._rng))

    # -- the routing table ----------------------------------------------------------------------
    def _on_request(self, incoming: Incoming) -> dict:
        peer = incoming.peer
        if incoming.relayed:  # it came through a relay: its source stands for the sender, no address to learn
            return self.core.handle(incoming.mtype, incoming.body, trio.current_time())
        if self._nursery is None:  # not running yet: nobody to PING with
            self._heard(peer)
        else:
            self.core.request_from(_contact(peer), trio.current_time())
            self._act()
        return self.core.handle(incoming.mtype, incoming.body, trio.current_time())

    def _act(self) -> None:
        """Carry out the core's PINGs (a newcomer to verify, a full bucket's oldest contact to check)."""
        while pings := self.core.take_actions():
            for ping in pings:
                if self._nursery is not None:
                    self._nursery.start_soon(self._ping, ping)
                else:  # not running yet: keep the old contact rather than leave the bucket's ping pending
                    self.core.pinged(ping, ping.contact)
        self.metrics.dht_peers.set(len(self.core.table))

    async def _ping(self, ping: Ping) -> None:
        contact = ping.contact
        answer: Contact | None = None
        try:
            if ping.why == "verify":
                reply = await self.endpoint.request(contact.addr, m.MsgType.PING, {}, node_id=contact.node_id)
                if reply.peer.node_id == contact.node_id:  # (through a relay: the address asked, no other)
                    answer = contact if reply.relayed else _contact(reply.peer)
            else:
                await self._rpc(contact, m.MsgType.PING, {})
                answer = contact
        except RpcError:
            if ping.why == "verify":
                self.metrics.ignored_records.labels("dht_contact", "unanswered").inc()
        except Exception as e:  # background work never takes the daemon down
            log.warning("checking DHT contact %s failed: %s", contact.node_id.hex()[:12], e)
            self.metrics.background_errors.labels("dht_verify").inc()
        self.core.pinged(ping, answer, trio.current_time())
        self._act()
        self.metrics.dht_peers.set(len(self.core.table))

    def _heard(self, peer: Peer, reached: Address | None = None) -> None:
        """``peer`` answered (or sent a request while known). ``reached``: the address this node sent the request
        to and got the answer from: that is the address the table keeps, never one the peer merely announces
        (PROTOCOL.md 18: no node puts an address it has not reached into a routing table)."""
        contact = _contact(peer) if reached is None else Contact(peer.node_id, reached[0], reached[1])
        self.core.heard(contact, trio.current_time())
        self._act()
        self.metrics.dht_peers.set(len(self.core.table))

    def _forget(self, contact: Contact) -> None:
        self.core.failed(contact)
        self.metrics.dht_peers.set(len(self.core.table))

    def _slow_after(self, contact: Contact) -> float:
        """How long a lookup waits for ``contact``'s answer before passing over it (lookup.slow_after): from the
        endpoint's retransmission timeout for its address, else the node's typical one."""
        rto = self.endpoint.rto
        measured = rto.rto(contact.addr)
        return slow_after(measured if measured is not None else rto.typical_rto())

    def _missed(self, contact: Contact) -> None:
        """A lookup passed over its query to ``contact``: the table counts it (DhtCore.missed)."""
        if self.core.missed(contact):
            self.metrics.dht_peers.set(len(self.core.table))

    async def _rpc(self, contact: Contact, mtype: m.MsgType, fields: dict) -> Incoming:
        try:
            reply = await self.endpoint.request(contact.addr, mtype, fields, node_id=contact.node_id)
        except RpcError:
            self._forget(contact)
            raise
        if reply.peer.node_id != contact.node_id:
            self._forget(contact)
            if not reply.relayed:  # a relayed answer shows nothing about who is at ``contact.addr``
                self._heard(reply.peer, contact.addr)
            raise RpcError(f"{contact.host}:{contact.port} is now another node")
        self._heard(reply.peer, contact.addr)
        return reply

    # -- lookups --------------------------------------------------------------------------------
    def _recent_replicas(self, target: bytes) -> list[Contact] | None:
        """The replicas (``DhtCore.record_width``) a lookup for ``target`` found within RECENT_S, less those that
        failed since."""
        return self.core.recent.get(target, trio.current_time(), self.core.table, self.core.record_width(target))

    async def _iterate(
        self, target: bytes, query: Query, enough: Callable[[Lookup], bool] | None = None, *, settle: bool = False,
        record: bool = False,
    ) -> list[Contact]:
        """Run a lookup; with ``enough``, stop as soon as it says so (the result is then partial). With
        ``settle``, stop once the lookup is settled and return the closest seen, not all confirmed. It finds
        the k closest, or with ``record`` the ``replicas`` closest (where a record lives)."""
        self.lookups += 1
        lookup = self.core.start_lookup(
            target, trio.current_time(), alpha=self.alpha, early=enough is not None, settle=settle, record=record
        )
        if enough is not None and enough(lookup):
            return []
        # Each query's task takes its own answer into the lookup and sends the queries that answer makes due, so
        # this task wakes only when the lookup ends or a query turns slow, not once per answer (a channel, a
        # cancel scope and a task switch per RPC). Queries run in the service's nursery: a dead node's retries
        # (3.5 s) finish in the background and remove it from the table, while this lookup moves on once the
        # query counts as slow (after ``_slow_after``: a few of the contact's round trips); a contact passed over by
        # routing.MISSES queries in a row leaves the table sooner. A query whose contact answered and that reads on
        # (pages) counts as slow only SLOW_QUERY_S after it began, and is no miss. The slow deadlines are kept here
        # (node id -> when, the contact, whether it is still unanswered), not as a timer task per query.
        slow_at: dict[bytes, tuple[float, Contact, bool]] = {}
        ended = trio.Event()
        failed: list[Exception] = []  # the lookup's own error in a query's task: raised here, to the caller

        def launch() -> None:
            now = trio.current_time()
            for contact in lookup.next_queries():
                spawn(ask, contact, now)
                slow_at[contact.node_id] = (now + self._slow_after(contact), contact, True)
            if lookup.finished or (settle and lookup.settled):
                ended.set()

        async def ask(contact: Contact, sent: float) -> None:
            def answered() -> None:
                if contact.node_id in slow_at:
                    slow_at[contact.node_id] = (sent + SLOW_QUERY_S, contact, False)

            try:
                found: list[tuple[bytes, str, int]] | None = await query(contact, answered)
            except RpcError:
                found = None
            if ended.is_set():
                return  # a late answer: the lookup has ended
            slow_at.pop(contact.node_id, None)
            try:
                if found is None:
                    lookup.on_failure(contact.node_id)
                else:
                    lookup.on_reply(contact.node_id, lookup.unseen(found))
                    if enough is not None and enough(lookup):
                        ended.set()
                        return
                launch()
            except Exception as e:
                failed.append(e)
                ended.set()

        try:
            async with trio.open_nursery() as fallback:
                spawn = self._nursery.start_soon if self._nursery is not None else fallback.start_soon
                launch()
                while not ended.is_set():
                    with trio.move_on_at(min((q[0] for q in slow_at.values()), default=math.inf)):
                        await ended.wait()
                    if ended.is_set():
                        break
                    now = trio.current_time()
                    for node_id, (_, contact, unanswered) in [(n, q) for n, q in slow_at.items() if q[0] <= now]:
                        del slow_at[node_id]
                        lookup.on_slow(node_id)
                        if unanswered:
                            self._missed(contact)
                    launch()
                fallback.cancel_scope.cancel()
        finally:
            ended.set()  # (a lookup its caller cancelled: answers still coming in launch no more queries)
        if failed:
            raise failed[0]
        return self.core.end_lookup(lookup, trio.current_time(), settle=settle)

    async def find_nodes(self, target: bytes, *, settle: bool = False, record: bool = False) -> list[Contact]:
        """The k closest live nodes to ``target``; with ``record``, the ``replicas`` closest (a writer's)."""
        async def query(contact: Contact, answered: Callable[[], None]) -> list[tuple[bytes, str, int]]:
            reply = await self._rpc(contact, m.MsgType.FIND_NODE, {"target": target})
            return reply.body["nodes"]

        return await self._iterate(target, query, settle=settle, record=record)

    async def get(self, key: bytes, enough: Enough | None = None) -> list[Record]:
        """Every live record under ``key`` that its ``replicas`` closest nodes hold (newest per subkey and owner).

        With ``enough`` (see reads.py), the lookup ends as soon as the records read so far satisfy it;
        without, every one of the ``replicas`` closest is read. A responder is read for at most MAX_READ records,
        and no longer than the lookup runs: page fetches still going when it ends are cancelled. A
        responder that sends one record an honest node would not hold (a bad signature, another key,
        a slot taken from its node) is read no further."""
        found: list[Record] = list(self.core.store.get(key, trio.current_time()))
        verified = {signed_part(r) for r in found}  # records seen verified: a copy needs no second check
        holders: list[tuple[bytes, frozenset[bytes]]] = []  # per responder read in full: its id, what it sent
        if self.core.holds_key(key):
            # this node is one of the replicas closest it knows: its own copies are a holder's, read in full already
            # (in a swarm of a few peers an Agreed(3) read then waits for 2 answers of 3, not for the slowest:
            # under 10 % loss half of such reads waited a retransmission)
            holders.append((self.node_id, frozenset(r.signature for r in found)))
        paging: list[trio.CancelScope] = []
        over = False

        async def query(contact: Contact, answered: Callable[[], None]) -> list[tuple[bytes, str, int]]:
            # what this read holds so far is not sent again (``held``, kept for every page of this responder);
            # the answer's ``have`` says which of it the responder holds
            fields: dict = {"key": key, "offset": 0}
            held: list[bytes] = []
            sigs: dict[bytes, bytes] = {}
            if HELD_ON_WIRE:
                held = held_prefixes(found)
                for r in found:
                    sigs.setdefault(r.signature[:HELD_PREFIX], r.signature)
                fields["held"] = held
            reply = await self._rpc(contact, m.MsgType.FIND_VALUE, fields)
            answered()
            body = reply.body
            nodes = body["nodes"]
            if over:
                return nodes  # a slow answer after the lookup ended: nobody reads it
            mine: list[Record] = []  # this responder's records (also in found, as they come)
            also = [sigs[held[i]] for i in had(held, body.get("have", b""))]  # held, and held by it too
            ok, last = self._collect(key, body["records"], found, verified, None, mine)
            offset = len(body["records"])
            total = min(body["total"], MAX_READ)
            with trio.CancelScope() as scope:
                paging.append(scope)
                while ok and offset and offset < total:
                    try:
                        reply = await self._rpc(contact, m.MsgType.FIND_VALUE, {**fields, "offset": offset})
                    except RpcError:
                        break  # it answered the lookup's query; a lost page only loses its records
                    records = reply.body["records"]
                    if not records:
                        break
                    ok, last = self._collect(key, records, found, verified, last, mine)
                    offset += len(records)
                    # a record written since the first page shifts the rest by one: read to the latest total
                    total = max(total, min(reply.body["total"], MAX_READ))
            if ok and offset >= body["total"] and not scope.cancelled_caught:  # read in full: a holder
                holders.append((contact.node_id, frozenset([*(r.signature for r in mine), *also])))
            return nodes

        def satisfied(lookup: Lookup) -> bool:
            if enough is None:
                return False
            near = lookup.closest_ids()
            near.add(self.node_id)
            return enough.done(found, near_holders(holders, near))

        try:
            await self._iterate(location(key), query, satisfied if enough is not None else None, record=True)
        finally:
            over = True
            for scope in paging:
                scope.cancel()
        return merge_newest(found)

    def _collect(
        self, key: bytes, raw: list[tuple], into: list[Record], verified: set[tuple], after: bytes | None,
        mine: list[Record],
    ) -> tuple[bool, bytes | None]:
        """Check one VALUE page (``read_page``) and add its records. Returns (ok, the last subkey so far): not
        ok when the page holds a record no honest node sends (the caller then stops reading that responder)."""
        page = read_page(key, raw, trio.current_time(), after, verified, self.core.verified)
        into.extend(page.records)
        mine.extend(page.records)
        if page.dropped is not None:
            self.metrics.datagrams_dropped.labels(page.dropped).inc()
        elif page.ignored is not None:
            self.metrics.ignored_records.labels("dht", page.ignored).inc()
        return page.ok, page.last

    async def put(self, key: bytes, subkey: bytes, value: bytes, ttl: float) -> PutResult:
        """Sign a record and store it on the ``replicas`` closest nodes (this one too, if it is among them)."""
        if not slot_allows(subkey, self.endpoint.identity.public_key):
            raise ValueError(
                "this subkey names another node (a subkey of 32 bytes, or of 64 lowercase hex digits, is a node "
                "id): only that node may write it; leave the subkey out to write under this node's own id"
            )
        now = trio.current_time()
        record = Record.create(self.endpoint.identity, key, subkey, value, ttl, wall=self._wall(), now=now)
        target = location(key)
        # the replicas closest: from a recent lookup, or a lookup that stops once settled (STORE shows who is
        # alive)
        closest = self._recent_replicas(target) or await self.find_nodes(target, settle=True, record=True)
        closest = closest[: self.replicas]
        result = PutResult(0)
        if self.core.stores_here(target, closest):  # this node is one of the replicas: r - 1 others
            closest = closest[: self.replicas - 1]
            why = self.core.store.store(record, now)
            self._tally(result, why)

        answered: list[Contact] = []
        # the put returns once a majority of the remote closest accepted it, or every STORE ended (so refusals
        # and failures are all counted when no majority can accept it)
        need = int(len(closest) * PUT_QUORUM) + 1 if closest else 0
        ended = 0
        accepted = 0
        done = result._done = trio.Event()
        enough = trio.Event()
        if need == 0:
            done.set()
            enough.set()

        async def store_on(contact: Contact) -> None:
            nonlocal ended, accepted
            try:
                reply = await self._rpc(contact, m.MsgType.STORE, {"records": [record.to_wire(now)]})
                answered.append(contact)
                ok = reply.body["ok"]
                accepted += bool(ok and ok[0])
                self._tally(result, None if ok and ok[0] else "refused")
            except RpcError as e:
                self._tally(result, "owner" if "owner" in str(e) else "unreachable")
            except Exception as e:  # it may run in the background, after the put returned: never crash the daemon
                log.warning("storing on DHT node %s failed: %s", contact.node_id.hex()[:12], e)
                self.metrics.background_errors.labels("dht_store").inc()
                self._tally(result, "unreachable")
            finally:
                ended += 1
                if accepted >= need or ended == len(closest):
                    enough.set()
                if ended == len(closest):
                    if len(answered) == len(closest):
                        self.core.stored_on(target, answered, trio.current_time())
                    done.set()

        if self._nursery is not None:
            for contact in closest:
                self._nursery.start_soon(store_on, contact)
            await enough.wait()
        else:  # not running: no nursery to leave STOREs in, so wait for them all
            async with trio.open_nursery() as nursery:
                for contact in closest:
                    nursery.start_soon(store_on, contact)
        result.pending = len(closest) - ended
        return result

    @staticmethod
    def _tally(result: PutResult, why: str | None) -> None:
        if why is None:
            result.stored += 1
        else:
            result.refused[why] = result.refused.get(why, 0) + 1

    # -- joining --------------------------------------------------------------------------------
    async def bootstrap(self, addrs: list[Address], *, timeout: float) -> None:
        """Ping bootstrap nodes with backoff until one answers, then fill the routing table."""
        self._seeds = list(addrs)
        deadline = trio.current_time() + timeout
        delay = retry_delays(1.0, 30.0, self._rng)
        attempt = 0
        while True:
            answered = 0
            for addr in addrs:
                for resolved in await _resolve(addr, self.endpoint):
                    try:
                        reply = await self.endpoint.request(resolved, m.MsgType.PING, {})
                    except RpcError as e:
                        log.info("bootstrap %s:%d: %s", addr[0], addr[1], e)
                        continue
                    self._heard(reply.peer, resolved)
                    answered += 1
            if answered:
                break
            left = deadline - trio.current_time()
            if left <= 0:
                names = ", ".join(f"{h}:{p}" for h, p in addrs)
                raise BootstrapError(
                    f"no bootstrap node answered within {timeout:.0f} s ({names}). Check that the address "
                    f"and port are right and reachable over UDP, and that this node uses the swarm's key "
                    f"(--swarm-key-file) or --insecure exactly as the swarm does."
                )
            wait = min(delay(attempt), left)
            attempt += 1
            log.warning("no bootstrap node answered yet; retrying in %.1f s (gives up in %.0f s)", wait, left)
            await trio.sleep(wait)
        await self.find_nodes(self.node_id)
        await self.refresh(0.0)
        self.bootstrapped.set()
        log.info("joined the swarm: %d peers in the routing table", self.peer_count())


def _contact(peer: Peer) -> Contact:
    return Contact(peer.node_id, peer.host, peer.port)


async def _resolve(addr: Address, endpoint: Endpoint) -> list[Address]:
    """Resolve a bootstrap name on every attempt (in compose, DNS may come up after us)."""
    host, port = addr
    family = endpoint.sock.family
    try:
        infos = await trio.socket.getaddrinfo(host, port, family=family, type=trio.socket.SOCK_DGRAM)
    except OSError as e:
        log.info("bootstrap %s:%d: cannot resolve: %s", host, port, e)
        return []
    seen: list[Address] = []
    for *_, sockaddr in infos:
        resolved = (sockaddr[0], sockaddr[1])
        if resolved not in seen:
            seen.append(resolved)
    return seen
