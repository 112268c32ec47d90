"""`peerd sim dht`: N nodes' real DHT cores over the one in-memory network, in virtual time, with churn.

Each node is the daemon's DHT with its trio shell replaced by callbacks on the network's event heap: the
routing table (k-buckets, ping-before-add for request senders, least-recently-seen eviction, contacts that miss
queries in a row evicted), the lookup state machine (alpha at a time, widening, slow queries passed over after a
few RTOs: lookup.slow_after), request handling and the record store with its limits (DhtCore), reads that
check every record (reads.read_page) and
stop early where asked, writes that store on the r closest (``--replicas``), and the endpoint's request retransmission
(first wait from the learned RTO, never above 0.5 s, doubling, given up after 3.5 s). Records are signed
and checked with Ed25519 as in the daemon. What is not simulated, and says so in the output: datagrams
are Python objects, not encoded or sealed (no AEAD, no msgpack; sizes play no part, links have no
bandwidth limit), node ids are drawn from the seed rather than from keys (no transport identity proofs),
and a record store expires records when it is read or written, not on a one-second tick.

The run: node 0 is the bootstrap node; the other N-1 join one every JOIN_GAP_S: a PING to node 0, then a
lookup of their own id, as the daemon's join does. That fills only the buckets near the node, so each
farther bucket then gets a lookup that stops once the bucket holds a contact (DhtCore.fill_targets; without
it half the tables at 10,000 nodes held nothing in the other half of the id space, and 9 % of reads failed).
The daemon's join instead runs a full lookup in every bucket (``refresh(0)``): about nine times the RPCs per
join of this way; ``--join-refresh`` simulates exactly that.
Then ``--keys`` writers each put one record, and refresh it every ttl/3. Over ``--duration`` virtual
seconds, ``churn * N`` nodes are killed (crashed: no goodbye), each replaced at once by a new node that
joins through node 0, and ``--lookups`` reads of a random key by a random joined node run; kills and reads
are spread uniformly. A read succeeds when it returns the writer's record. Node 0, the writers and nodes
with a read in flight are not picked to die.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ...cliargs import count
from ...dht.core import FILL_ALPHA, REPLICAS, DhtCore
from ...dht.lookup import SLOW_QUERY_S, Lookup, slow_after
from ...dht.reads import Enough, Owners, near_holders, read_page, signed_part
from ...dht.records import Record, location, merge_newest
from ...dht.routing import Contact
from ...transport.rto import RtoEstimator
from ...wire import messages as m
from ...wire.identity import Identity
from .net import Link, Network

K = 20
ALPHA = 3
RPC_TIMEOUT_S = 0.5  # the endpoint's request defaults: first wait at most this, doubled, 3 waits in all
RPC_ATTEMPTS = 3
JOIN_GAP_S = 0.05  # one node joins every 50 ms during the build-up
BOOTSTRAP_RETRY_S = 1.0
WALL0 = 1_700_000_000.0  # writers' wall clock at virtual time 0 (records' signed expiry)
PORT = 4000

FIND_NODE = m.MsgType.FIND_NODE
FIND_VALUE = m.MsgType.FIND_VALUE
STORE = m.MsgType.STORE
PING = m.MsgType.PING

# done(rpc, reply body, the contact that answered), or done(rpc, None, None): the request's _Rpc comes first, so
# a caller reads what it passed (contact, arg) from it instead of binding a closure per request
Done = Callable[["_Rpc", Any, "Contact | None"], None]


@dataclass(frozen=True)
class Config:
    peers: int
    churn: float
    loss: float
    lookups: int
    seed: int
    keys: int = 100
    duration: float = 600.0
    ttl: float = 300.0
    latency: float = 0.02
    jitter: float = 0.02
    read: str = "full"
    refresh: float = 0.0
    join_refresh: bool = False
    replicas: int = REPLICAS


DEADLINE_S = RPC_TIMEOUT_S * (2**RPC_ATTEMPTS - 1)
# Node.request schedules a lookup's slow-query timer when the first wait ends, or at once when it comes first
assert RPC_TIMEOUT_S < SLOW_QUERY_S


class _Rpc:
    """One request in flight. ``table``: the answer or its absence updates the routing table (DhtService._rpc);
    ``arg`` is the caller's (a lookup's hop, a put's contact)."""

    __slots__ = ("contact", "mtype", "body", "done", "arg", "table", "sent_at", "wait", "first", "deadline", "slow")

    def __init__(self, contact: Contact, mtype: m.MsgType, body: Any, done: Done, arg: Any, table: bool,
                 now: float, wait: float) -> None:
        self.contact = contact
        self.mtype = mtype
        self.body = body
        self.done = done
        self.arg = arg
        self.table = table
        self.sent_at = now
        self.wait = wait
        self.first = True
        self.deadline = now + DEADLINE_S
        self.slow: tuple | None = None  # a lookup's slow-query call: (at, reserved seq, fn, args), see Walk.pump


class Node:
    """One daemon's DHT: the real cores, with the trio shell's waiting done by the network's event heap."""

    __slots__ = ("sim", "net", "core", "contact", "addr", "rto", "pending", "joined", "alive", "index")

    def __init__(self, sim: DhtSim, index: int, node_id: bytes) -> None:
        self.sim = sim
        self.net = sim.net
        self.index = index
        host = f"10.{(index >> 16) & 255}.{(index >> 8) & 255}.{index & 255}"
        self.contact = Contact(node_id, host, PORT)
        self.addr = (host, PORT)
        self.core = DhtCore(node_id, k=K, replicas=sim.cfg.replicas)
        self.rto = RtoEstimator()
        self.pending: dict[int, _Rpc] = {}
        self.joined = False
        self.alive = True

    # -- the endpoint: requests, retransmission, answers ---------------------------------------------
    def request(self, contact: Contact, mtype: m.MsgType, body: Any, done: Done, arg: Any = None,
                table: bool = False, slow: tuple | None = None) -> None:
        """Endpoint.request: retransmit with doubling waits until an answer or the deadline.

        ``slow``: (at, seq, fn, args), a call reserved in the network's order (Walk.pump's slow-query timer)
        that is scheduled only if this request is still unanswered when its first wait ends (at most 0.5 s):
        answered earlier, the call would do nothing, and most are. One due before that is scheduled now."""
        sim = self.sim
        sim.rid += 1
        rid = sim.rid
        addr = contact.addr
        net = self.net
        now = net.now
        rpc = _Rpc(contact, mtype, body, done, arg, table, now, self.rto.timeout(addr, RPC_TIMEOUT_S))
        if slow is not None and slow[0] <= now + rpc.wait:
            at, seq, fn, args = slow
            net.schedule(at, fn, args, self.addr, seq)
        else:
            rpc.slow = slow
        self.pending[rid] = rpc
        sim.rpcs += 1
        net.send(self.addr, addr, (True, rid, mtype, body, self.contact))
        # the first wait (at most RPC_TIMEOUT_S) ends before the deadline; an answered request's wait is skipped
        net.schedule_while(now + rpc.wait, self._waited, rid, self.pending, self.addr)

    def _waited(self, rid: int) -> None:
        rpc = self.pending.get(rid)
        if rpc is None:
            return
        now = self.net.now
        addr = rpc.contact.addr
        if rpc.first:
            self.rto.timed_out(addr)
            rpc.first = False
            slow = rpc.slow
            if slow is not None:
                at, seq, fn, args = slow
                self.net.schedule(at, fn, args, self.addr, seq)
        if now >= rpc.deadline:
            del self.pending[rid]
            if rpc.table:
                self.core.failed(rpc.contact)
            rpc.done(rpc, None, None)
            return
        rpc.wait *= 2
        rpc.sent_at = now
        self.sim.retransmits += 1
        self.net.send(self.addr, addr, (True, rid, rpc.mtype, rpc.body, self.contact))
        self.net.schedule_while(min(rpc.deadline, now + rpc.wait), self._waited, rid, self.pending, self.addr)

    def receive(self, src: Any, payload: tuple) -> None:
        if payload[0]:
            _, rid, mtype, body, sender = payload
            self.core.request_from(sender, self.net.now)
            self.act()
            now = self.net.now
            if mtype is FIND_NODE:
                reply: Any = self.core.find_node(body, ordered=False)  # Walk and Lookup rank them: no sort
            elif mtype is FIND_VALUE:
                reply = self.core.find_value(body, 0, (), now, ordered=False)
            elif mtype is STORE:
                reply = self.core.store_records(body, now)
            else:
                reply = None
            self.net.send(self.addr, src, (False, rid, reply, self.contact))
            return
        _, rid, reply, sender = payload
        rpc = self.pending.pop(rid, None)
        if rpc is None:
            return  # a duplicate, or an answer after the request gave up
        if rpc.first:  # Karn's rule: only an unambiguous round trip is a sample
            self.rto.sample(src, self.net.now - rpc.sent_at)
        if rpc.table:
            self.core.heard(sender, self.net.now)
            self.act()
        rpc.done(rpc, reply, sender)

    # -- the DHT shell (DhtService's, without trio) -------------------------------------------------
    def act(self) -> None:
        """Carry out the core's PINGs: a newcomer to verify, or a full bucket's oldest contact to check."""
        for ping in self.core.take_actions():
            if ping.why == "verify":
                self.request(ping.contact, PING, None, self._verified, ping)
            else:
                self.request(ping.contact, PING, None, self._checked, ping, table=True)

    def _verified(self, rpc: _Rpc, reply: Any, sender: Contact | None) -> None:
        ping = rpc.arg
        ok = sender is not None and sender.node_id == ping.contact.node_id
        self.core.pinged(ping, sender if ok else None, self.net.now)
        self.act()

    def _checked(self, rpc: _Rpc, reply: Any, sender: Contact | None) -> None:
        self.core.pinged(rpc.arg, sender, self.net.now)
        self.act()

    def slow_after(self, contact: Contact) -> float:
        """DhtService._slow_after: a lookup's wait for ``contact`` from the RTO of its address, or the typical one."""
        measured = self.rto.rto(contact.addr)
        return slow_after(measured if measured is not None else self.rto.typical_rto())

    def rpc(self, contact: Contact, mtype: m.MsgType, body: Any, done: Done, arg: Any = None) -> None:
        """DhtService._rpc: an answer is heard (it may enter the table); no answer removes the contact."""
        self.request(contact, mtype, body, done, arg, table=True)

    def find_nodes(self, target: bytes, done: Callable[[Walk, list[Contact]], None], *, settle: bool = False,
                   record: bool = False) -> Walk:
        walk = Walk(self, target, FIND_NODE, target, done, settle=settle, record=record)
        walk.start()
        return walk

    def get(self, key: bytes, done: Callable[[Walk, list[Record]], None], enough: Enough | None = None) -> Walk:
        """DhtService.get: the records under ``key`` that the replicas closest hold (each page checked)."""
        walk = Walk(self, location(key), FIND_VALUE, key, done, enough=enough, record=True)
        walk.start()
        return walk

    def put(self, identity: Identity, key: bytes, subkey: bytes, value: bytes, ttl: float,
            done: Callable[[int], None]) -> None:
        """DhtService.put: sign, find the replicas closest (settled, or a recent lookup's), STORE on each."""
        now = self.net.now
        record = Record.create(identity, key, subkey, value, ttl, wall=WALL0 + now, now=now)
        target = location(key)

        def store(closest: list[Contact]) -> None:
            closest = closest[: self.core.replicas]
            now = self.net.now
            stored = 0
            if self.core.stores_here(target, closest):  # one of the replicas itself: r - 1 others
                closest = closest[: self.core.replicas - 1]
                stored += self.core.store.store(record, now) is None
            if not closest:
                done(stored)
                return
            left = [len(closest), stored]
            answered: list[Contact] = []
            wire = [record.to_wire(now)]

            def stored_on(rpc: _Rpc, reply: Any, sender: Contact | None) -> None:
                if sender is not None:
                    answered.append(rpc.contact)
                    left[1] += bool(reply and reply[0])
                left[0] -= 1
                if not left[0]:
                    if len(answered) == len(closest):
                        self.core.stored_on(target, answered, self.net.now)
                    done(left[1])

            for contact in closest:
                self.rpc(contact, STORE, wire, stored_on)

        recent = self.core.recent.get(target, now, self.core.table, self.core.record_width(target))
        if recent:
            store(recent)
        else:
            self.find_nodes(target, lambda walk, closest: store(closest), settle=True, record=True)

    def join(self, bootstrap: Contact, done: Callable[[], None]) -> None:
        """DhtService.bootstrap: PING the bootstrap node until it answers, then look up our own id (and, with
        --join-refresh, refresh every bucket as the daemon does)."""
        def pinged(rpc: _Rpc, reply: Any, sender: Contact | None) -> None:
            if sender is None:
                self.net.call_later(BOOTSTRAP_RETRY_S, self.join, bootstrap, done, owner=self.addr)
                return
            self.core.heard(sender, self.net.now)
            self.act()
            self.find_nodes(self.core.node_id, lambda walk, found: looked_up())

        def looked_up() -> None:
            if self.sim.cfg.join_refresh:
                self.refresh(0.0, done)
            else:
                self.fill(done)

        self.request(bootstrap, PING, None, pinged)

    def fill(self, done: Callable[[], None]) -> None:
        """After the lookup of its own id, a lookup of a random id in each farther bucket, one after another,
        each asking one contact at a time and ending once that bucket holds FILL contacts (DhtCore)."""
        todo = self.core.fill_targets(self.sim.rng)
        todo.reverse()

        def step(*_: Any) -> None:
            if not todo:
                done()
                return
            index, target = todo.pop()
            while self.core.filled(index):  # filled already (by the lookups before): no lookup to run
                self.core.table.touch(target, self.net.now)  # as the lookup would have (start_lookup)
                if not todo:
                    done()
                    return
                index, target = todo.pop()
            walk = Walk(self, target, FIND_NODE, target, step, enough=_Filled(self.core, index), alpha=FILL_ALPHA)
            walk.start()

        step()

    def refresh(self, interval: float, done: Callable[[], None]) -> None:
        """DhtService.refresh: a lookup of a random id in every bucket no lookup touched for ``interval``, one
        after another."""
        table = self.core.table
        todo = table.buckets_to_refresh(self.net.now, interval)
        todo.reverse()

        def step(*_: Any) -> None:
            if not todo:
                done()
                return
            self.find_nodes(table.random_id_in_bucket(todo.pop(), self.sim.rng), step)

        step()

    def maintain(self) -> None:
        """DhtService._maintain's bucket refresh, every refresh * U(0.25, 0.5) seconds."""
        interval = self.sim.cfg.refresh

        def again() -> None:
            self.net.call_later(interval * self.sim.rng.uniform(0.25, 0.5), self.refresh, interval, again,
                                owner=self.addr)

        again()


class Walk:
    """DhtService._iterate: one lookup driven by answers, failures and slow-query timers.

    ``hops`` is the longest chain of queries each asked of a contact that the previous one's answer brought
    (seeds are hop 1); ``queries`` counts requests sent, retransmissions not counted."""

    __slots__ = ("node", "lookup", "mtype", "body", "done", "settle", "enough", "slow", "depth", "hops",
                 "queries", "over", "found", "verified", "holders", "started")

    def __init__(self, node: Node, target: bytes, mtype: m.MsgType, body: bytes, done: Callable[..., None], *,
                 settle: bool = False, enough: Enough | None = None, alpha: int = ALPHA, record: bool = False) -> None:
        self.node = node
        self.mtype = mtype
        self.body = body
        self.done = done
        self.settle = settle
        self.enough = enough
        now = node.net.now
        self.lookup: Lookup = node.core.start_lookup(
            target, now, alpha=alpha, early=enough is not None, settle=settle, record=record
        )
        self.slow: set[bytes] = set()
        self.depth: dict[bytes, int] = {}
        self.hops = 0
        self.queries = 0
        self.over = False
        self.started = now
        self.found: list[Record] = []
        self.verified: set[tuple] = set()
        self.holders: list[tuple[bytes, frozenset[bytes]]] = []
        if mtype is FIND_VALUE:
            self.found = list(node.core.store.get(body, now))
            self.verified = {signed_part(r) for r in self.found}

    def start(self) -> None:
        if self.enough is not None and self.enough.done(self.found, self._near_holders()):
            self.finish()
            return
        self.pump()

    def pump(self) -> None:
        if self.over:
            return
        lookup = self.lookup
        node = self.node
        for contact in lookup.next_queries():
            node_id = contact.node_id
            hop = self.depth.get(node_id, 1)
            if hop > self.hops:
                self.hops = hop
            self.queries += 1
            self.slow.add(node_id)
            # the slow-query timer keeps its place in the order (reserved now) but is scheduled only if the
            # request is unanswered after its first wait (Node.request): an answered one would do nothing here
            slow = (node.net.now + node.slow_after(contact), node.net.reserve(), self.on_slow, (contact,))
            node.request(contact, self.mtype, self.body, self.on_answer, hop, True, slow)
        if lookup.finished or (self.settle and lookup.settled):
            self.finish()

    def on_slow(self, contact: Contact) -> None:
        node_id = contact.node_id
        if self.over or node_id not in self.slow:
            return
        self.slow.discard(node_id)
        self.lookup.on_slow(node_id)
        self.node.core.missed(contact)
        self.pump()

    def on_answer(self, rpc: _Rpc, reply: Any, sender: Contact | None) -> None:
        if self.over:
            return  # a slow answer after the lookup ended: nobody reads it
        node_id = rpc.contact.node_id
        hop = rpc.arg
        self.slow.discard(node_id)
        if sender is None:
            self.lookup.on_failure(node_id)
            self.pump()
            return
        if self.mtype is FIND_VALUE:
            records, total, nodes = reply
            page = read_page(self.body, records, self.node.net.now, None, self.verified, self.node.core.verified)
            self.found.extend(page.records)
            if page.ok and len(records) >= total:  # read in full: a holder (keys here hold one record)
                self.holders.append((node_id, frozenset(r.signature for r in page.records)))
        else:
            nodes = reply
        depth = self.depth
        for c in nodes:
            if c.node_id not in depth:
                depth[c.node_id] = hop + 1
        self.lookup.on_reply(node_id, nodes)
        if self.enough is not None and self.enough.done(self.found, self._near_holders()):
            self.finish()
            return
        self.pump()

    def _near_holders(self) -> list[frozenset[bytes]]:
        return near_holders(self.holders, self.lookup.closest_ids())

    def finish(self) -> None:
        self.over = True
        result = self.node.core.end_lookup(self.lookup, self.node.net.now, settle=self.settle)
        if self.mtype is FIND_VALUE:
            self.done(self, merge_newest(self.found))
        else:
            self.done(self, result)


class _Filled(Enough):
    """A fill lookup's stopping rule: its bucket holds FILL contacts (DhtCore.filled)."""

    def __init__(self, core: DhtCore, index: int) -> None:
        self.core, self.index = core, index

    def done(self, records: Any, holders: Any) -> bool:
        return self.core.filled(self.index)


@dataclass
class _Key:
    key: bytes
    value: bytes
    writer: Node
    identity: Identity


class DhtSim:
    """The whole run; ``run()`` returns the figures (deterministic for the config's seed)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.net = Network(self.rng, default=Link(loss=cfg.loss, latency=cfg.latency, jitter=cfg.jitter))
        self.rid = 0
        self.rpcs = 0
        self.retransmits = 0
        self.nodes: list[Node] = []
        self.alive: list[Node] = []  # joined and alive, for picking readers and victims
        self._slot: dict[int, int] = {}  # node index -> position in self.alive
        self.keys: list[_Key] = []
        self.protected: set[int] = {0}
        self.busy: dict[int, int] = {}  # node index -> reads in flight
        self.results: list[tuple[bool, int, int, float]] = []  # (success, hops, queries, virtual seconds)
        self.replaced = 0
        self.puts = 0
        self.joins_done = 0

    # -- nodes ----------------------------------------------------------------------------------
    def spawn(self) -> Node:
        node = Node(self, len(self.nodes), self.rng.getrandbits(256).to_bytes(32, "big"))
        self.nodes.append(node)
        self.net.attach(node.addr, node.receive)
        return node

    def _joined(self, node: Node) -> None:
        if not node.alive:
            return
        node.joined = True
        self.joins_done += 1
        self._slot[node.index] = len(self.alive)
        self.alive.append(node)
        if self.cfg.refresh > 0:
            node.maintain()

    def join_one(self) -> None:
        node = self.spawn()
        node.join(self.nodes[0].contact, lambda: self._joined(node))

    def kill_one(self) -> None:
        for _ in range(100):
            victim = self.alive[self.rng.randrange(len(self.alive))]
            if victim.index not in self.protected and not self.busy.get(victim.index):
                break
        else:
            return  # nobody may die now (a tiny swarm): skipped, and not counted as replaced
        self.net.crash(victim.addr)
        victim.alive = False
        last = self.alive.pop()
        if last is not victim:
            pos = self._slot[victim.index]
            self.alive[pos] = last
            self._slot[last.index] = pos
        del self._slot[victim.index]
        self.replaced += 1
        self.join_one()

    # -- records --------------------------------------------------------------------------------
    def write(self, entry: _Key) -> None:
        def stored(count: int) -> None:
            self.puts += 1

        entry.writer.put(entry.identity, entry.key, b"v", entry.value, self.cfg.ttl, stored)
        self.net.call_later(self.cfg.ttl / 3, self.write, entry, owner=entry.writer.addr)

    def read(self) -> None:
        reader = self.alive[self.rng.randrange(len(self.alive))]
        entry = self.keys[self.rng.randrange(len(self.keys))]
        self.busy[reader.index] = self.busy.get(reader.index, 0) + 1
        enough = Owners([entry.identity.node_id]) if self.cfg.read == "early" else None

        def done(walk: Walk, records: list[Record]) -> None:
            self.busy[reader.index] -= 1
            ok = any(r.owner == entry.identity.public_key and r.value == entry.value for r in records)
            self.results.append((ok, walk.hops, walk.queries, self.net.now - walk.started))

        reader.get(entry.key, done, enough)

    # -- the run --------------------------------------------------------------------------------
    def _run_while(self, busy: Callable[[], bool], cap: float, what: str) -> None:
        """Run the network in steps of 5 virtual seconds while ``busy()``; past ``cap`` the run fails."""
        while busy():
            if self.net.now >= cap:
                raise RuntimeError(f"{what} not done by virtual second {cap:.0f}")
            self.net.run(until=self.net.now + 5.0)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        net = self.net
        first = self.spawn()
        self._joined(first)
        for i in range(1, cfg.peers):
            net.call_at(i * JOIN_GAP_S, self.join_one)
        build_up = cfg.peers * JOIN_GAP_S
        self._run_while(lambda: self.joins_done < cfg.peers, build_up + 600.0, "the build-up")
        joined_at = net.now

        # writers: protected from churn, each writes one key and refreshes it every ttl/3
        candidates = [n for n in self.alive if n.index != 0]
        writers = self.rng.sample(candidates, min(cfg.keys, len(candidates)))
        for i, writer in enumerate(writers):
            entry = _Key(f"sim/key/{i}".encode(), f"value {i}".encode(), writer,
                         Identity.from_seed(self.rng.randbytes(32)))
            self.keys.append(entry)
            self.protected.add(writer.index)
            net.call_at(net.now + i * 0.01, self.write, entry)
        self._run_while(lambda: self.puts < len(self.keys), net.now + 600.0, "the first writes")

        start = net.now
        kills = round(cfg.churn * cfg.peers)
        for i in range(kills):
            net.call_at(start + (i + 0.5) * cfg.duration / kills, self.kill_one)
        for i in range(cfg.lookups):
            net.call_at(start + (i + 0.5) * cfg.duration / cfg.lookups, self.read)
        net.run(until=start + cfg.duration)
        self._run_while(lambda: len(self.results) < cfg.lookups, net.now + 600.0, "the reads")
        self._run_while(lambda: self.joins_done < cfg.peers + self.replaced, net.now + 600.0, "the last joins")

        n = len(self.alive)
        want = min(n - 1, K)
        hops = [h for _, h, _, _ in self.results]
        return {
            "peers": cfg.peers,
            "churn": cfg.churn,
            "loss": cfg.loss,
            "lookups": cfg.lookups,
            "seed": cfg.seed,
            "lookup_success": round(sum(ok for ok, *_ in self.results) / len(self.results), 6)
            if self.results else 0.0,
            "hops_p50": _percentile(hops, 0.50),
            "hops_p99": _percentile(hops, 0.99),
            "rpcs_per_lookup": round(sum(q for _, _, q, _ in self.results) / len(self.results), 3)
            if self.results else 0.0,
            "lookup_s_p50": round(_percentile_f([t for *_, t in self.results], 0.50), 6),
            "routing_table_fill": round(sum(len(n.core.table) >= want for n in self.alive) / n, 6),
            "virtual_s": round(net.now, 3),
            "build_up_virtual_s": round(joined_at, 3),
            "replaced": self.replaced,
            "alive": n,
            "keys": len(self.keys),
            "read": cfg.read,
            "rpcs": self.rpcs,
            "retransmits": self.retransmits,
            "datagrams": net.sent,
            "datagrams_lost": net.lost,
            "config": asdict(cfg),
            "simulated": {
                "cores": "real: routing table, lookup, request handling, record store and limits, read checks, "
                         "RTO estimator",
                "signatures": "Ed25519 on records, as in the daemon",
                "sealing": "null: datagrams are not encoded or sealed (no AEAD, no msgpack); no bandwidth limit",
                "identities": "node ids drawn from the seed (no transport identity proofs)",
                "join": "as the daemon's: PING node 0, look up its own id, then a full lookup in every bucket"
                        if cfg.join_refresh else
                        "PING node 0, look up its own id, then fill each farther bucket with one contact (the "
                        "daemon instead runs a full lookup in every bucket: --join-refresh)",
            },
        }


def simulate(cfg: Config, *, exiting: bool = False) -> dict[str, Any]:
    """Run one simulation. The cyclic garbage collector runs rarely meanwhile: it walks millions of long-lived
    table entries and RPC objects (about a tenth of the CPU time at 2,000 nodes).

    ``exiting``: the process ends right after (the command line). The finished swarm is then frozen out of
    the collector's sight instead of collected: freeing it would cost the next full collection seconds at
    thousands of nodes (inside the ``json.dumps`` of the result)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(200_000, 50, 1000)
    try:
        return DhtSim(cfg).run()
    finally:
        if exiting:
            gc.freeze()
        gc.set_threshold(*thresholds)


def _percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile (an observed value, so identical across platforms)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0


def _percentile_f(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


# -- the command line ------------------------------------------------------------------------------
def _int_at_least(low: int) -> Callable[[str], int]:
    return lambda text: count(text, low)


def _fraction(text: str, *, below_one: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0.0 <= value < 1.0 if below_one else 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be in [0, {'1)' if below_one else '1]'}, got {text}")
    return value


def _loss(text: str) -> float:
    return _fraction(text, below_one=True)


def _seconds(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= {low:g}, got {text}")
        return value
    return parse


def add_arguments(sim: Any) -> None:
    """Add the `sim dht` sub-parser to `sim`'s subparsers."""
    p = sim.add_parser(
        "dht", help="N nodes' real DHT cores over a lossy in-memory network in virtual time, with churn",
        description="Runs the DHT's real cores for --peers nodes in one process, in virtual time: a build-up "
                    "where every node joins through node 0, then --duration seconds in which --churn of them are "
                    "replaced and --lookups reads of keys stored before the churn run. Datagrams are not sealed "
                    "(a null sealer); records are signed with Ed25519. Wall time goes to stderr.",
    )
    p.add_argument("--peers", type=_int_at_least(2), default=1000, help="nodes in the swarm (default: 1000)")
    p.add_argument("--churn", type=_fraction, default=0.2,
                   help="fraction of the nodes replaced over the run: killed, and as many new ones joined, spread "
                        "uniformly (default: 0.2)")
    p.add_argument("--loss", type=_loss, default=0.05, help="chance each datagram is lost, in [0, 1) (default: 0.05)")
    p.add_argument("--lookups", type=_int_at_least(1), default=1000,
                   help="reads of a random key by a random node, spread over the run (default: 1000)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="seed of the one random generator (default: 0)")
    p.add_argument("--keys", type=_int_at_least(1), default=100,
                   help="keys written before the churn, each by its own writer that refreshes it (default: 100)")
    p.add_argument("--duration", type=_seconds(1.0), default=600.0,
                   help="virtual seconds over which churn and reads are spread (default: 600)")
    p.add_argument("--ttl", type=_seconds(3.0), default=300.0,
                   help="records' time to live; writers refresh every ttl/3 (default: 300)")
    p.add_argument("--latency", type=_seconds(0.0), default=0.02, help="one-way latency of every link (default: 0.02)")
    p.add_argument("--jitter", type=_seconds(0.0), default=0.02,
                   help="extra delay drawn uniformly in [0, jitter) per datagram, which reorders (default: 0.02)")
    p.add_argument("--read", choices=("full", "early"), default="full",
                   help="full: a read asks every one of the replicas closest (DhtService.get); early: it stops at the "
                        "writer's record (get with reads.Owners) (default: full)")
    p.add_argument("--refresh", type=_seconds(0.0), default=0.0,
                   help="bucket refresh interval of every node, as the daemon's (60 s there); 0: no refresh "
                        "(default: 0)")
    p.add_argument("--join-refresh", action="store_true",
                   help="a joining node also looks up a random id in every bucket, as the daemon's join does "
                        "(costly at 10,000 nodes; default: only the lookup of its own id)")
    p.add_argument("--replicas", type=_int_at_least(1), default=REPLICAS,
                   help=f"nodes closest to a key that store its records and that a full read asks, at most k = {K} "
                        f"(default: {REPLICAS}, the daemon's)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = Config(
        peers=args.peers, churn=args.churn, loss=args.loss, lookups=args.lookups, seed=args.seed, keys=args.keys,
        duration=args.duration, ttl=args.ttl, latency=args.latency, jitter=args.jitter, read=args.read,
        refresh=args.refresh, join_refresh=args.join_refresh, replicas=args.replicas,
    )
    started = time.perf_counter()
    result = simulate(cfg, exiting=True)
    wall = time.perf_counter() - started
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(format_text(result))
    print(f"wall time: {wall:.1f} s", file=sys.stderr)
    return 0


def format_text(r: dict[str, Any]) -> str:
    sim = r["simulated"]
    return "\n".join([
        f"peerd sim dht: {r['peers']} peers, churn {r['churn']:g} ({r['replaced']} replaced), loss {r['loss']:g}, "
        f"{r['lookups']} {r['read']} reads of {r['keys']} keys, seed {r['seed']}",
        f"  lookup success      {r['lookup_success']:.4f}",
        f"  hops p50 / p99      {r['hops_p50']} / {r['hops_p99']}",
        f"  RPCs per lookup     {r['rpcs_per_lookup']:.1f}",
        f"  lookup time p50     {r['lookup_s_p50']:.3f} s (virtual)",
        f"  routing table fill  {r['routing_table_fill']:.4f} (tables holding min(N-1, k) contacts)",
        f"  virtual time        {r['virtual_s']:.1f} s ({r['build_up_virtual_s']:.1f} s of build-up)",
        f"  datagrams           {r['datagrams']} ({r['datagrams_lost']} lost), {r['retransmits']} retransmissions",
        f"  simulated           {sim['cores']}",
        f"  join                {sim['join']}",
        f"  not simulated       {sim['sealing']}; {sim['identities']}",
        f"  signatures          {sim['signatures']}",
    ])
