"""NAT traversal in the daemon: the trio shell around the reach, punch and relay cores (PROTOCOL.md section 18).

It answers OBSERVE, REACH_PROBE and INTRO, acts on PROBE_ASK, PROBE, CONNECT, RELAY and RELAYED, runs this
node's reachability, and, when a request to a peer goes unanswered (``silent``, from the endpoint), punches a
hole through an introducer and falls back to a relay. Every decision is a core's; this module sends and waits.
The endpoint tells it what was sent and answered (``NatHooks``) and carries relayed datagrams (``set_relay``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import random
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import trio
from prometheus_client import Counter, Gauge

from ..entropy import default_rng
from ..metrics import Metrics
from ..transport.endpoint import PATH_KINDS, Address, Endpoint, Incoming, RpcError
from ..wire import messages as m
from ..wire.errors import WireError
from .punch import KEEPALIVE_S, Failed, Intro, Ping, Punched, Puncher
from .reach import UNKNOWN, AskProbe, Observe, ProbeLimiter, Reach, choose_prober
from .relay import RelayServer

log = logging.getLogger("peerd.nat")

MAX_REACHED = 4096  # peers remembered as reached (LRU)
HEARD_S = 60.0  # a request's source counts as a path to its sender this long (a NAT keeps a flow 30-120 s)
KNOWN_S = 180.0  # a peer that answered this long ago is no longer counted in peers_known
MAX_INTRODUCERS = 4096  # contacts remembered with the peer that named them
MAX_ACTIVE = 32  # punches/relay set-ups running at once
DISCOVER_S = 5.0  # how often _discover looks for peers the DHT named that this node cannot talk to yet
DISCOVER_PER_PASS = 4
RETRY_DISCOVER_S = 120.0  # (under KNOWN_S: a named peer drops out of peers_known only while it does not answer)
RELAY_QUEUE = 4096  # RELAYs waiting to be passed on (more: refused, ``relay_queue``); 5 MB of datagrams
DIRECT_RETRIES = 3  # direct PINGs before a failed punch relays (see _answers_directly)
DIRECT_RETRY_S = 0.25  # ... each this long unanswered (a NATed peer costs 0.75 s more before its relay)
RELAY_TRIES = 3  # relays asked for one peer before giving up (each costs a PING's timeout when it refuses)
MAX_STANDINS = 256  # reply paths through relays not (yet) confirmed as a peer's path (LRU)
DIRECT_CHECK_S = 10.0  # a relayed peer heard directly is PINGed there at most this often (answered: relay dropped)


class NatMetrics:
    """The NAT traversal metrics, in the daemon's registry (peerd/metrics.py keeps the others)."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.paths = Gauge("peerd_nat_paths", "Peers this node talks to, by path kind (direct, punched, relayed)",
                           ["kind"], registry=r)
        self.datagrams = Counter("peerd_nat_datagrams_total", "Datagrams sent, by path kind", ["kind"], registry=r)
        self.bytes = Counter("peerd_nat_bytes_total", "Bytes sent (inner datagrams for relayed), by path kind",
                             ["kind"], registry=r)
        self.relay_bytes = Counter("peerd_relay_bytes_total", "Bytes this node relayed for other peers", registry=r)
        self.relay_refused = Counter("peerd_relay_refused_total", "RELAYs this node refused, by reason", ["reason"],
                                     registry=r)
        self.punches = Counter("peerd_nat_punches_total", "Hole punches, by outcome", ["outcome"], registry=r)
        self.reachability = Gauge("peerd_nat_reachability", "1 for this node's reachability verdict",
                                  ["verdict"], registry=r)


class NatService:
    def __init__(self, endpoint: Endpoint, metrics: Metrics, *, rng: random.Random | None = None,
                 relay: bool = True, contact_of: Callable[[bytes], Address | None] | None = None,
                 on_verdict: Callable[[str, Address | None], None] | None = None) -> None:
        """``relay``: agree to relay for others (a relay still refuses unless its verdict is ``public``);
        ``contact_of``: the address the DHT knows a node at (used for peers first heard through a relay);
        ``on_verdict(verdict, observed_addr)``: runs when the verdict changes (the daemon republishes)."""
        self.endpoint = endpoint
        self.metrics = NatMetrics(metrics)
        self.base = metrics
        self.rng = default_rng(rng)
        self.reach = Reach(self.rng)
        self.puncher = Puncher()
        self.relay = RelayServer(enabled=relay)
        self.uplink: Any = None  # the node's uplink pacer (a transport.pacing.Pacer), when it averages
        # One task passes RELAYs on, in the order they came: a task each would let trio's scheduler reorder a
        # batch (it runs a batch backwards half the time), and the receivers' delivery REPORTs would take the
        # reordering for loss and slow the senders' pacers several-fold (`peerd bench allreduce --nat symmetric`).
        self._relay_in, self._relay_out = trio.open_memory_channel[tuple[Address, bytes, bytes, bytes]](RELAY_QUEUE)
        self.limiter = ProbeLimiter()
        self.contact_of = contact_of
        self.on_verdict = on_verdict
        self.reached: OrderedDict[bytes, Address] = OrderedDict()  # node id -> where it answered this node
        self._answered_at: dict[bytes, float] = {}  # node id -> when it last answered (same keys as reached)
        self._heard_at: OrderedDict[bytes, tuple[Address, float]] = OrderedDict()  # requests' sources, not relayed
        self.introducer: OrderedDict[bytes, bytes] = OrderedDict()  # node id -> the peer that named it
        self.named_at: dict[bytes, Address] = {}  # node id -> the address it was named at (same keys)
        self._tried: dict[bytes, float] = {}  # node id -> when ``_discover`` last tried to connect to it
        self._next_discover = 0.0
        self.kind: dict[bytes, str] = {}  # peer -> path kind, for peers this node set a path up for
        self._active: set[bytes] = set()
        self._attempts: OrderedDict[bytes, int] = OrderedDict()  # punch-then-relay attempts started, per peer
        self._connecting: set[Address] = set()
        self._target_addr: OrderedDict[bytes, Address] = OrderedDict()  # punch/relay target -> its address
        # Confirmed relayed paths: peer -> (relay id, relay address, the address this node uses for the peer). A
        # path is confirmed only by a PING through the relay that the peer answered (identity-checked), and only
        # for a peer that did not answer directly; a direct answer drops it.
        self._via: OrderedDict[bytes, tuple[bytes, Address, Address]] = OrderedDict()
        self._standins: OrderedDict[Address, bytes] = OrderedDict()  # reply-only addresses through a relay
        self._confirming: set[bytes] = set()
        self._direct_tried: OrderedDict[bytes, float] = OrderedDict()
        self.no_relay: dict[str, int] = {}  # relays not tried for want of evidence of a NAT, by reason
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._published: dict[str, tuple[int, int]] = {}
        self._verdict = UNKNOWN
        self._started = False
        self._next_keepalive = 0.0
        endpoint.nat = self
        local = endpoint.sock
        try:
            host, port = local.getsockname()[:2]  # type: ignore[attr-defined]
            self.reach.local = {(host, port)}
        except (AttributeError, OSError):
            pass
        endpoint.on_request(m.MsgType.OBSERVE, self._on_observe)
        endpoint.on_request(m.MsgType.REACH_PROBE, self._on_reach_probe)
        endpoint.on_request(m.MsgType.INTRO, self._on_intro)
        endpoint.on_message(m.MsgType.PROBE_ASK, self._on_probe_ask)
        endpoint.on_message(m.MsgType.PROBE, self._on_probe)
        endpoint.on_message(m.MsgType.CONNECT, self._on_connect)
        endpoint.on_message(m.MsgType.RELAY, self._on_relay)
        endpoint.on_message(m.MsgType.RELAYED, self._on_relayed)

    # -- status -----------------------------------------------------------------------------------------
    @property
    def verdict(self) -> str:
        return self.reach.verdict

    def peers_known(self, now: float | None = None) -> list[bytes]:
        """Peers this node can talk to: answered it directly within ``KNOWN_S`` (a NAT forgets a mapping after
        120 s), or reached through a relay."""
        now = trio.current_time() if now is None else now
        out = {n for n, t in self._answered_at.items() if now - t <= KNOWN_S and n in self.reached}
        out.update(n for n, k in self.kind.items() if k == "relayed")
        return sorted(out)

    def status(self) -> dict[str, Any]:
        observed = self.reach.observed_addr
        kinds = {kind: 0 for kind in PATH_KINDS}
        for k in self.kind.values():
            kinds[k] += 1
        return {
            "reachability": self.reach.verdict,
            "reachability_basis": self.reach.basis,
            "observed_addr": f"{observed[0]}:{observed[1]}" if observed else None,
            "peers_known": [n.hex() for n in self.peers_known()],
            "paths": {n.hex(): k for n, k in sorted(self.kind.items())},
            "path_datagrams": {k: v[0] for k, v in self.endpoint.path_counts.items()},
            "path_bytes": {k: v[1] for k, v in self.endpoint.path_counts.items()},
            "relays_not_tried": dict(self.no_relay),
            "relayed_for_others": {"datagrams": self.relay.relayed, "bytes": self.relay.relayed_bytes,
                                   "refused": dict(self.relay.refused)},
        }

    def _publish_metrics(self) -> None:
        for kind, (n, b) in self.endpoint.path_counts.items():
            old_n, old_b = self._published.get(kind, (0, 0))
            if n > old_n:
                self.metrics.datagrams.labels(kind).inc(n - old_n)
            if b > old_b:
                self.metrics.bytes.labels(kind).inc(b - old_b)
            self._published[kind] = (n, b)
        counts = {kind: 0 for kind in PATH_KINDS}
        for k in self.kind.values():
            counts[k] += 1
        counts["direct"] += sum(1 for n in self.reached if n not in self.kind)
        for kind, n in counts.items():
            self.metrics.paths.labels(kind).set(n)
        for v in ("public", "cone-nat", "symmetric-nat", "unknown"):
            self.metrics.reachability.labels(v).set(1 if v == self.reach.verdict else 0)

    # -- hooks from the endpoint (never await) ----------------------------------------------------------
    def sent(self, addr: Address, now: float) -> None:
        self.reach.sent(addr, now)

    def answered(self, addr: Address, reply: Incoming, now: float) -> None:
        node_id = reply.peer.node_id
        if self.endpoint.relay_of(addr) is None:
            self._reached(node_id, addr, now)
        nodes = reply.body.get("nodes")
        if nodes:
            intro = self.introducer
            me = self.endpoint.identity.node_id
            for contact in nodes:
                if contact[0] == me:
                    continue
                intro[contact[0]] = node_id
                intro.move_to_end(contact[0])
                self.named_at[contact[0]] = (contact[1], contact[2])
            while len(intro) > MAX_INTRODUCERS:
                gone, _ = intro.popitem(last=False)
                self.named_at.pop(gone, None)

    def _reached(self, node_id: bytes, addr: Address, now: float) -> None:
        self.reached[node_id] = addr
        self._answered_at[node_id] = now
        self.reached.move_to_end(node_id)
        while len(self.reached) > MAX_REACHED:
            gone, _ = self.reached.popitem(last=False)
            self._answered_at.pop(gone, None)
            self.reach.remove_peer(gone)
        self.reach.add_peer(node_id, addr)
        self.relay.reached(node_id, addr, now)
        if node_id in self._via:
            self._drop_relay(node_id, addr)
        self._act(self.puncher.pong(node_id, addr, now))
        if self._started and self.reach.verdict == UNKNOWN:
            self.reach.soon(now, 2.0)  # undecided for want of peers: a new one may be enough

    def heard(self, source: Address, node_id: bytes, now: float) -> None:
        """A request from ``node_id`` came in from ``source`` (not through a relay). When this node is punching
        towards it, that settles the punch: its NAT chose ``source`` for this node (a symmetric NAT's new port).
        (The endpoint never calls it for what came through a relay.)"""
        heard = self._heard_at
        heard[node_id] = (source, now)
        heard.move_to_end(node_id)
        if len(heard) > MAX_REACHED:
            heard.popitem(last=False)
        if node_id in self._via and now - self._direct_tried.get(node_id, -math.inf) >= DIRECT_CHECK_S:
            # a relayed peer speaks to this node directly: if it answers there too, the relay goes
            self._direct_tried[node_id] = now
            self._direct_tried.move_to_end(node_id)
            if len(self._direct_tried) > MAX_REACHED:
                self._direct_tried.popitem(last=False)
            self._spawn(self._check_direct, node_id, source)
        if self.puncher.punching(node_id):
            self._act(self.puncher.pong(node_id, source, now))

    def _elsewhere(self, node_id: bytes, addr: Address, now: float) -> Address | None:
        """Another address ``node_id`` can be sent to: where it answered this node, else where an authenticated
        request from it came from within ``HEARD_S`` (its NAT maps it toward this node there: a symmetric NAT's
        port for this node, which its published address is not)."""
        for candidate in (self.reached.get(node_id), self._recent_source(node_id, now)):
            if candidate is not None and candidate != addr and self.endpoint.relay_of(candidate) is None:
                return candidate
        return None

    def _recent_source(self, node_id: bytes, now: float) -> Address | None:
        entry = self._heard_at.get(node_id)
        return entry[0] if entry is not None and now - entry[1] <= HEARD_S else None

    def silent(self, addr: Address, node_id: bytes, now: float) -> None:
        """A request to ``node_id`` at ``addr`` went unanswered once: if it may sit behind a NAT and some peer
        named it to this node, punch through that peer, and relay through it if the punch fails."""
        if self.endpoint.relay_of(addr) is not None or node_id in self._active:
            return
        other = self.relay_entry(node_id)
        if other is not None:  # relayed at another address already: the same relay serves this one
            self.endpoint.set_relay(addr, node_id, other[1], other[2])
            return
        elsewhere = self._elsewhere(node_id, addr, now)
        if elsewhere is not None:  # it answers (or sends) from another address (its NAT's mapping): send there
            self.endpoint.set_alias(addr, elsewhere)
            return
        if node_id in self.kind or node_id in self.reached or len(self._active) >= MAX_ACTIVE:
            return
        intro_id = self.introducer.get(node_id)
        if intro_id is None or intro_id not in self.reached or intro_id == node_id:
            # the peer that named it is out of reach: ask the peer that answered this node last (alive, and
            # likely to have reached the target: public peers answer everyone)
            intro_id = next((n for n in reversed(self.reached) if n != node_id), None)
        intro_addr = self.reached.get(intro_id) if intro_id is not None else None
        if intro_id is None or intro_addr is None:
            return
        self._active.add(node_id)
        self._attempts[node_id] = self._attempts.pop(node_id, 0) + 1
        while len(self._attempts) > MAX_INTRODUCERS:
            self._attempts.popitem(last=False)
        self._target_addr[node_id] = addr
        while len(self._target_addr) > MAX_INTRODUCERS:
            self._target_addr.popitem(last=False)
        self._act(self.puncher.want(node_id, intro_id, intro_addr, now, named=self._dht_named(node_id) | {addr}))

    # -- handlers (synchronous: the endpoint sends what they return) -------------------------------------
    def _relayed_in(self, incoming: Incoming) -> bool:
        """Whether ``incoming`` came through a relay (its source stands for the sender; no NAT saw it there)."""
        return self.endpoint.relay_of(incoming.source) is not None

    def _on_observe(self, incoming: Incoming) -> dict | None:
        if self._relayed_in(incoming):
            return None  # the relay's address is all a relayed OBSERVE could report
        return {"seen": m.pack_addr(*incoming.source)}

    def _on_reach_probe(self, incoming: Incoming) -> dict:
        if self._relayed_in(incoming):
            return {"ok": False}
        requester = incoming.peer.node_id
        reached = {n: a for n, a in self.reached.items() if self.endpoint.relay_of(a) is None}
        prober = choose_prober(requester, incoming.body["avoid"], reached, self.rng)
        if prober is not None:
            host, port = incoming.source
            self._spawn(self._notify, prober[1], m.MsgType.PROBE_ASK,
                        {"target": m.pack_contact(requester, host, port), "nonce": incoming.body["nonce"]}, prober[0])
        return {"ok": prober is not None}

    def _on_probe_ask(self, incoming: Incoming) -> None:
        if incoming.peer.node_id not in self.reached:  # (one-way: refused silently, and counted)
            self.base.datagrams_dropped.labels("unreached").inc()
            return None
        target_id, host, port = incoming.body["target"]
        if self.endpoint.relay_of((host, port)) is not None:
            return None  # a relayed PROBE would pass any NAT and prove nothing
        if self.endpoint.unreachable(host) or not self.limiter.allow(host, trio.current_time()):
            return None
        self._spawn(self._notify, (host, port), m.MsgType.PROBE, {"nonce": incoming.body["nonce"]}, target_id)
        return None

    def _on_probe(self, incoming: Incoming) -> None:
        if self._relayed_in(incoming):
            return None  # it came through a relay, not through this node's NAT: proves nothing
        if self.reach.probe_received(incoming.body["nonce"], incoming.source, trio.current_time()):
            self._changed()
        return None

    def _on_intro(self, incoming: Incoming) -> dict:
        target = incoming.body["target"]
        addr = self.reached.get(target)
        if (addr is None or target == incoming.peer.node_id or self.endpoint.relay_of(addr) is not None
                or self._relayed_in(incoming)):
            return {"peer": None}
        host, port = incoming.source
        self._spawn(self._notify, addr, m.MsgType.CONNECT,
                    {"peer": m.pack_contact(incoming.peer.node_id, host, port)}, target)
        return {"peer": m.pack_contact(target, *addr)}

    def _on_connect(self, incoming: Incoming) -> None:
        if incoming.peer.node_id not in self.reached or self._relayed_in(incoming):
            self.base.datagrams_dropped.labels("unreached").inc()
            return None
        peer_id, host, port = incoming.body["peer"]
        if peer_id == self.endpoint.identity.node_id or self.endpoint.unreachable(host):
            return None
        self._act(self.puncher.connect(peer_id, (host, port), trio.current_time(), named=self._dht_named(peer_id)))
        return None

    def _dht_named(self, node_id: bytes) -> set[Address]:
        """The addresses the DHT named ``node_id`` at: in a NODES answer (``named_at``), in the routing table."""
        out = set()
        named = self.named_at.get(node_id)
        if named is not None:
            out.add(named)
        contact = self.contact_of(node_id) if self.contact_of is not None else None
        if contact is not None:
            out.add(contact)
        return out

    def _on_relay(self, incoming: Incoming) -> None:
        if self._relayed_in(incoming):  # no relaying of relayed datagrams (no loops, no chains)
            self.relay.refused["relay_loop"] = self.relay.refused.get("relay_loop", 0) + 1
            return None
        body = incoming.body
        data = body["data"]
        if self.reach.verdict != "public":
            where: Address | str = "relay_off"
            self.relay.refused["relay_off"] = self.relay.refused.get("relay_off", 0) + 1
        else:
            where = self.relay.forward(incoming.peer.node_id, body["to"], len(data), trio.current_time())
        if isinstance(where, str):
            self.metrics.relay_refused.labels(where).inc()
            return None
        try:
            self._relay_in.send_nowait((where, body["to"], incoming.peer.node_id, data))
        except trio.WouldBlock:
            self.relay.refused["relay_queue"] = self.relay.refused.get("relay_queue", 0) + 1
            self.relay.relayed -= 1  # (counted as passed on by the core)
            self.relay.relayed_bytes -= len(data)
            self.metrics.relay_refused.labels("relay_queue").inc()
            return None
        self.metrics.relay_bytes.inc(len(data))
        return None

    async def _pass_on_all(self) -> None:
        """Pass RELAYs on in the order they came (the channel's order; one sender at a time). A relay that
        averages too shares its uplink's pacer (``uplink``): unpaced, its RELAYEDs on top of its own tensor
        data overflowed its link (2.5k tail drops an average in the lab, all of it relayed members' data)."""
        async for addr, node_id, src, data in self._relay_out:
            if self.uplink is not None:
                wait = self.uplink.reserve_cross(len(data) + m.RELAY_OVERHEAD, trio.current_time())
                if wait > 0.001:
                    await trio.sleep(wait)
            try:
                await self.endpoint.pass_on(addr, node_id, src, data)
            except (RpcError, WireError) as e:
                log.debug("RELAYED to %s: %s", addr, e)

    def _on_relayed(self, incoming: Incoming) -> None:
        """A datagram a relay passed on. It is handled only once it opened under a token bound to ``src`` (the
        endpoint checks), at the address this node uses for ``src`` through that relay, or else at a reply-only
        stand-in through it (answers go back the way it came). Nothing here makes the relay ``src``'s path: that
        takes a PING through it that ``src`` answers (``_confirm``), and only for a peer not answering directly."""
        if self._relayed_in(incoming):
            self.base.datagrams_dropped.labels("relay_loop").inc()
            return None
        relay_id, relay = incoming.peer.node_id, incoming.source
        src = incoming.body["src"]
        why = ""
        if self.reached.get(relay_id) != relay:
            why = "unreached"  # only a relay this node reached, at that address
        elif src == self.endpoint.identity.node_id:
            why = "self"
        elif src == relay_id:
            why = "relay_loop"
        if why:
            self.base.datagrams_dropped.labels(why).inc()
            return None
        addr = self._relayed_addr(src, relay_id, relay)
        standin = addr is None
        if addr is None:
            addr = self._standin(src, relay_id)
        if not self.endpoint.receive_relayed(incoming.body["data"], addr, src):
            return None  # junk, a replay, or another identity than ``src`` (dropped and counted by the endpoint)
        if standin:
            self._use_standin(addr, src, relay_id, relay)
        now = trio.current_time()
        if (src not in self._via and src not in self._confirming and src not in self._active
                and not self._answers_recently(src, now) and len(self._confirming) < MAX_ACTIVE
                and self._nursery is not None):
            self._confirming.add(src)
            self._nursery.start_soon(self._confirm, src, relay_id, relay, addr)
        return None

    def _relayed_addr(self, src: bytes, relay_id: bytes, relay: Address) -> Address | None:
        """The address this node uses for ``src`` through ``relay``: its confirmed relayed path, or the one this
        node's own relay attempt (``_relay_to``) set up there; None if neither."""
        via = self._via.get(src)
        if via is not None and via[0] == relay_id and via[1] == relay:
            return via[2]
        target = self._target_addr.get(src)
        if target is not None and self.endpoint.relay_of(target) == (src, relay_id, relay):
            return target
        return None

    def _standin(self, node_id: bytes, relay_id: bytes) -> Address:
        """A reply-only address for ``node_id`` through ``relay_id`` (from 240.0.0.0/4 or 100::/64, never routed):
        only this node's relay table knows it, so nothing but answers to what came through that relay goes
        there."""
        digest = hashlib.sha256(b"peerd relayed " + node_id + relay_id).digest()
        if self.endpoint.family == socket.AF_INET6:
            host = str(ipaddress.IPv6Address(b"\x01\x00" + bytes(6) + digest[:8]))
        else:
            host = str(ipaddress.IPv4Address(bytes([240 | (digest[0] & 0x0F)]) + digest[1:4]))
        return (host, 1 + int.from_bytes(digest[4:6], "big") % 65535)

    def _use_standin(self, addr: Address, src: bytes, relay_id: bytes, relay: Address) -> None:
        self.endpoint.set_relay(addr, src, relay_id, relay)
        standins = self._standins
        standins[addr] = src
        standins.move_to_end(addr)
        while len(standins) > MAX_STANDINS:
            gone, node_id = standins.popitem(last=False)
            via = self._via.get(node_id)
            if via is None or via[2] != gone:
                self.endpoint.clear_relay(gone)

    def _answers_recently(self, node_id: bytes, now: float) -> bool:
        """Whether ``node_id`` answered this node directly within ``KNOWN_S`` (then it needs no relay)."""
        return node_id in self.reached and now - self._answered_at.get(node_id, -math.inf) <= KNOWN_S

    async def _confirm(self, src: bytes, relay_id: bytes, relay: Address, standin: Address) -> None:
        """``src`` spoke through a relay and has no path to this node: make that relay its path if it does not
        answer directly (at the address the DHT or a punch named it at) and does answer a PING through it."""
        try:
            real = self._target_addr.get(src)
            if real is None and self.contact_of is not None:
                real = self.contact_of(src)
            if real is not None and (real == relay or self.endpoint.relay_of(real) is not None):
                real = None
            if src in self.reached:  # it answered this node directly: no relay for it
                self._no_relay("answered_before")
                return
            if real is not None and await self._direct_evidence(real, src, relay_id) != "silent":
                return
            try:
                reply = await self.endpoint.request(standin, m.MsgType.PING, {}, node_id=src, attempts=2)
            except RpcError:
                return
            if (reply.peer.node_id != src or src in self._via or src in self._active
                    or self._answers_recently(src, trio.current_time())):
                return
            self._use_relay(src, relay_id, relay, real if real is not None else standin)
        finally:
            self._confirming.discard(src)

    def _use_relay(self, node_id: bytes, relay_id: bytes, relay: Address, addr: Address) -> None:
        """``node_id`` answered a PING through ``relay``: from now on what goes to ``addr`` goes through it."""
        self.endpoint.set_relay(addr, node_id, relay_id, relay)
        self._standins.pop(addr, None)
        via = self._via
        via[node_id] = (relay_id, relay, addr)
        via.move_to_end(node_id)
        self.kind[node_id] = "relayed"
        while len(via) > MAX_REACHED:
            self._drop_relay(next(iter(via)), None)

    def _drop_relay(self, node_id: bytes, direct: Address | None) -> None:
        """``node_id`` answered directly (at ``direct``), or is forgotten (None): its relayed path goes, and what
        was sent to it through the relay goes to where it answered."""
        if self._via.pop(node_id, None) is None:
            return
        if self.kind.get(node_id) == "relayed":
            del self.kind[node_id]
        for addr, entry in list(self.endpoint._relayed.items()):
            if entry[0] == node_id and addr not in self._standins:
                self.endpoint.clear_relay(addr)
                if direct is not None and addr != direct:
                    self.endpoint.set_alias(addr, direct)

    def relay_entry(self, node_id: bytes) -> tuple[bytes, bytes, Address] | None:
        """(peer, relay id, relay address) of ``node_id``'s confirmed relayed path, if it has one."""
        via = self._via.get(node_id)
        return (node_id, via[0], via[1]) if via is not None else None

    # -- connecting on purpose -------------------------------------------------------------------------------
    def path_to(self, addr: Address, node_id: bytes) -> str | None:
        """How this node talks to ``node_id`` at ``addr`` now: "direct", "punched", "relayed", or None (no path
        known: it has not answered this node there)."""
        addr = self.endpoint.alias_of(addr)
        if self.endpoint.relay_of(addr) is not None:
            return "relayed"
        if self.reached.get(node_id) == addr or self._recent_source(node_id, trio.current_time()) == addr:
            return "punched" if self.kind.get(node_id) == "punched" else "direct"
        return None

    async def connect(self, addr: Address, node_id: bytes, *, timeout: float = 15.0) -> str | None:
        """Make sure this node can talk to ``node_id`` at ``addr`` (e.g. a group member before tensor data goes
        out, which has no retries): a PING; unanswered, the punch and then the relay that ``silent`` starts.
        Returns the path kind, or None when nothing worked within ``timeout``."""
        kind = self.path_to(addr, node_id)
        if kind is not None:
            return kind
        other = self.relay_entry(node_id)
        if other is not None and self.kind.get(node_id) == "relayed":  # relayed at another address already
            self.endpoint.set_relay(addr, node_id, other[1], other[2])
            return "relayed"
        elsewhere = self._elsewhere(node_id, addr, trio.current_time())
        if elsewhere is not None:
            try:  # it may answer at ``addr`` too (a cone NAT, a moved peer): else use where it answers
                await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=node_id, attempts=1)
            except RpcError:
                self.endpoint.set_alias(addr, elsewhere)
            return self.path_to(addr, node_id)
        idle = 0  # PING rounds in a row that failed with no punch or relay under way
        first = self._attempts.get(node_id, 0)
        with trio.move_on_after(timeout):
            while True:
                try:
                    await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=node_id, attempts=2)
                except RpcError:
                    pass
                kind = self.path_to(addr, node_id)
                if kind is not None and not (kind == "relayed" and node_id in self._active):
                    return kind  # (a relay being tried is set before its PING: not a path until answered)
                idle = 0 if node_id in self._active else idle + 1
                if idle >= 2 or self._attempts.get(node_id, 0) - first >= 2:
                    # nothing could be tried, or a whole attempt (punch, then relays) failed and the next one
                    # began: waiting out ``timeout`` would only hold up the caller (a group's average, where
                    # every member waits for the slowest start)
                    return None
                await trio.sleep(1.0)  # a punch (3 s) or a relay set-up is under way
        kind = self.path_to(addr, node_id)
        return None if kind == "relayed" and node_id in self._active else kind

    async def connect_all(self, peers: list[tuple[Address, bytes]], timeout: float) -> dict[bytes, str | None]:
        """``connect`` to each of ``peers`` (address, node id) at once; their path kinds (None: none found)."""
        out: dict[bytes, str | None] = {}

        async def one(addr: Address, node_id: bytes) -> None:
            out[node_id] = await self.connect(addr, node_id, timeout=timeout)

        async with trio.open_nursery() as nursery:
            for addr, node_id in peers:
                nursery.start_soon(one, addr, node_id)
        return out

    def unreached(self, addr: Address, node_id: bytes) -> None:
        """Tensor data is about to go to ``addr`` with no path known there: set one up in the background (what is
        sent before it works is lost, as on any lossy link)."""
        if (self._nursery is None or addr in self._connecting or len(self._connecting) >= MAX_ACTIVE
                or self.path_to(addr, node_id) is not None):
            return
        self._connecting.add(addr)
        self._nursery.start_soon(self._connect_once, addr, node_id)

    async def _connect_once(self, addr: Address, node_id: bytes) -> None:
        try:
            await self.connect(addr, node_id)
        finally:
            self._connecting.discard(addr)

    # -- the loop -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run reachability now (after joining: the peers it reached are its observers)."""
        self._started = True
        self.reach.start(trio.current_time())
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._pass_on_all)
            task_status.started()
            while True:
                now = trio.current_time()
                try:
                    self._act(self.reach.poll(now))
                    self._act(self.puncher.poll(now))
                    if now >= self._next_discover:
                        self._next_discover = now + DISCOVER_S
                        self._discover(now)
                    if now >= self._next_keepalive:
                        self._next_keepalive = now + KEEPALIVE_S
                        self._keepalives()
                    self._publish_metrics()
                except Exception:  # background work never takes the daemon down
                    log.exception("NAT traversal step failed")
                    self.base.background_errors.labels("nat").inc()
                if self.reach.verdict != self._verdict:
                    self._changed()
                wake = min(self.reach.wake_at(), self.puncher.wake_at() or math.inf, now + 5.0)
                self._wake = trio.Event()
                with trio.move_on_at(max(wake, now + 0.01)):
                    await self._wake.wait()

    def _discover(self, now: float) -> None:
        """Set paths up to peers the DHT named (NODES) that this node cannot talk to yet, a few per pass, each at
        most once per ``RETRY_DISCOVER_S``: so ``peers_known`` fills, and a group's members have their paths
        before tensor data (which has no retries) goes out."""
        if not self._started or self._nursery is None:
            return
        known = set(self.peers_known())
        started = 0
        for node_id in reversed(self.introducer):
            if started >= DISCOVER_PER_PASS or len(self._connecting) >= MAX_ACTIVE:
                break
            addr = self.named_at.get(node_id)
            if node_id in known or addr is None or now - self._tried.get(node_id, -math.inf) < RETRY_DISCOVER_S:
                continue
            self._tried[node_id] = now
            started += 1
            self.unreached(addr, node_id)
        if len(self._tried) > MAX_INTRODUCERS:
            self._tried = {n: t for n, t in self._tried.items() if now - t < RETRY_DISCOVER_S}

    def _keepalives(self) -> None:
        """Hold open the NAT mappings this node depends on (a NAT forgets an idle UDP flow after 30 s): toward
        every relay it uses, and, when it is behind a NAT, toward the 2 peers that answered it last (so that
        an introducer's CONNECT and a relay's RELAYED can still come in)."""
        targets: dict[Address, bytes] = {}
        for relay_id, relay, _addr in list(self._via.values())[:64]:
            targets[relay] = relay_id
        if self.reach.verdict in ("cone-nat", "symmetric-nat"):
            for node_id in list(reversed(self.reached))[:2]:
                targets.setdefault(self.reached[node_id], node_id)
        for addr, node_id in targets.items():
            self._spawn(self._ping, Ping(node_id, addr, keepalive=True))

    def _changed(self) -> None:
        verdict, observed = self.reach.verdict, self.reach.observed_addr
        if verdict == self._verdict:
            return
        self._verdict = verdict
        log.info("reachability: %s (observed %s, basis %s)", verdict, observed, self.reach.basis)
        if self.on_verdict is not None:
            try:
                self.on_verdict(verdict, observed)
            except Exception:
                log.exception("acting on the reachability verdict failed")
                self.base.background_errors.labels("nat").inc()

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    def _act(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Observe):
                self._spawn(self._observe, a)
            elif isinstance(a, AskProbe):
                self._spawn(self._ask_probe, a)
            elif isinstance(a, Intro):
                self._spawn(self._intro, a)
            elif isinstance(a, Ping):
                self._spawn(self._ping, a)
            elif isinstance(a, Punched):
                self.metrics.punches.labels("punched").inc()
                self.kind[a.node_id] = "punched"
                self.endpoint.set_punched(a.addr)
                target = self._target_addr.get(a.node_id)
                if target is not None and target != a.addr:  # it answers elsewhere than where it was asked for
                    self.endpoint.set_alias(target, a.addr)
                self._active.discard(a.node_id)
            elif isinstance(a, Failed):
                self.metrics.punches.labels("failed").inc()
                if a.introduced:
                    self._spawn(self._relay_to, a.node_id)
                else:  # no introducer has reached it: nothing says it exists, let alone behind a NAT
                    self._no_relay("unintroduced")
                    self._active.discard(a.node_id)
        if actions:
            self._wake.set()

    # -- actions ------------------------------------------------------------------------------------------
    async def _notify(self, addr: Address, mtype: m.MsgType, fields: dict, node_id: bytes) -> None:
        try:
            await self.endpoint.notify(addr, mtype, fields, node_id=node_id)
        except RpcError as e:
            log.debug("%s to %s: %s", mtype.name, addr, e)

    async def _observe(self, a: Observe) -> None:
        try:
            reply = await self.endpoint.request(a.addr, m.MsgType.OBSERVE, {}, node_id=a.node_id, attempts=2)
        except RpcError:
            self.reach.failed(a.node_id, trio.current_time())
        else:
            self._local_toward(a.addr)
            self.reach.observed(a.node_id, tuple(reply.body["seen"]), trio.current_time())
        self._wake.set()

    def _local_toward(self, addr: Address) -> None:
        """This node's own address on the path to ``addr`` (the kernel's source choice: a connected UDP socket
        sends nothing), for the "no translation" test of a wildcard-bound socket."""
        try:
            port = self.endpoint.sock.getsockname()[1]  # type: ignore[attr-defined]
            with socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                host = s.getsockname()[0]
        except (AttributeError, OSError, TypeError, IndexError):
            return
        if len(self.reach.local) < 64:
            self.reach.local.add((host, port))

    async def _ask_probe(self, a: AskProbe) -> None:
        try:
            reply = await self.endpoint.request(a.addr, m.MsgType.REACH_PROBE,
                                                {"nonce": a.nonce, "avoid": list(a.avoid)}, node_id=a.node_id,
                                                attempts=2)
        except RpcError:
            self.reach.failed(a.node_id, trio.current_time())
        else:
            self.reach.probe_asked(a.node_id, reply.body["ok"], trio.current_time())
        self._wake.set()

    async def _intro(self, a: Intro) -> None:
        addr: Address | None = None
        try:
            reply = await self.endpoint.request(a.introducer, m.MsgType.INTRO, {"target": a.target},
                                                node_id=a.introducer_id, attempts=2)
            peer = reply.body["peer"]
            if peer is not None and peer[0] == a.target:
                addr = (peer[1], peer[2])
        except RpcError:
            pass
        self._act(self.puncher.intro_answered(a.target, addr, trio.current_time()))

    async def _ping(self, a: Ping) -> None:
        try:
            reply = await self.endpoint.request(a.addr, m.MsgType.PING, {}, node_id=a.node_id, timeout=0.25,
                                                attempts=1)
        except RpcError:
            return
        if reply.peer.node_id == a.node_id:
            self._act(self.puncher.pong(a.node_id, a.addr, trio.current_time()))

    async def _check_direct(self, node_id: bytes, addr: Address) -> None:
        """A relayed peer sent a request from ``addr`` directly: PING it there, directly (the relay at ``addr``, if
        any, is set aside meanwhile). Answered, ``answered`` drops the relay; else the relay stays."""
        entry = self.endpoint.relay_of(addr)
        if entry is not None:
            self.endpoint.clear_relay(addr)
        try:
            await self._answers_directly(addr, node_id)
        finally:
            if entry is not None and node_id in self._via and self.endpoint.relay_of(addr) is None:
                self.endpoint.set_relay(addr, *entry)

    def _relay_candidate(self, relay_id: bytes, node_id: bytes, addr: Address) -> bool:
        """Whether ``relay_id`` could relay to ``node_id`` at ``addr``: reached directly, and neither the target."""
        relay = self.reached.get(relay_id)
        return (relay is not None and relay_id != node_id and relay != addr
                and self.endpoint.relay_of(relay) is None)

    def _no_relay(self, why: str) -> None:
        self.no_relay[why] = self.no_relay.get(why, 0) + 1

    async def _direct_evidence(self, addr: Address, node_id: bytes, control_id: bytes) -> str:
        """Direct PINGs to ``node_id`` at ``addr``, and at the same time to ``control_id`` (a peer this node reached,
        typically the relay it would use): "direct" when the target answers, "lossy" when neither does (this
        node's own link is flooded or lossy: a relay would not help and would be kept for good), "silent" when
        only the target stays silent, the evidence of a NAT in the way."""
        control = self.reached.get(control_id)
        answers: dict[str, bool] = {}

        async def ping(key: str, to: Address, nid: bytes) -> None:
            answers[key] = await self._answers_directly(to, nid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping, "target", addr, node_id)
            if control is not None:
                nursery.start_soon(ping, "control", control, control_id)
        if answers.get("target"):
            return "direct"
        if not answers.get("control"):
            self._no_relay("lossy")
            return "lossy"
        return "silent"

    async def _answers_directly(self, addr: Address, node_id: bytes) -> bool:
        """One more direct PING before relaying: a punch also fails on a lossy path the peer answers on (two
        PINGs lost of a handshake's six at 10 % loss), and a relay is kept for good, takes the relay's loss on
        top and its grant as the pace (``bench allreduce --loss 0.1`` on loopback would now and then relay a
        pair and take several times as long). Answered, ``answered`` records the path."""
        try:
            reply = await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=node_id, timeout=DIRECT_RETRY_S,
                                                attempts=DIRECT_RETRIES)
        except RpcError:
            return False
        return reply.peer.node_id == node_id and self.endpoint.relay_of(addr) is None

    async def _relay_to(self, node_id: bytes) -> None:
        """The punch failed: talk to ``node_id`` through a relay. Candidates: the peer that introduced it (it
        reached both), then the peers that answered this node most recently, at most ``RELAY_TRIES``; a relayed
        PING answered settles it (a relay that is not public, or has not reached the target, refuses)."""
        try:
            addr = self._target_addr.get(node_id)
            if addr is None:
                return
            if node_id in self.reached:  # it answered this node directly: its silence is loss, not a NAT
                self._no_relay("answered_before")
                return
            intro_id = self.introducer.get(node_id)
            candidates = [intro_id] if intro_id is not None else []
            candidates += [n for n in reversed(self.reached) if n != intro_id]
            candidates = [n for n in candidates if n is not None and self._relay_candidate(n, node_id, addr)]
            if not candidates:
                return
            if await self._direct_evidence(addr, node_id, candidates[0]) != "silent":
                return
            tried = 0
            for relay_id in candidates:
                relay = self.reached.get(relay_id)
                if relay is None or not self._relay_candidate(relay_id, node_id, addr):
                    continue
                if tried >= RELAY_TRIES:
                    return
                tried += 1
                self.endpoint.set_relay(addr, node_id, relay_id, relay)
                try:
                    reply = await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=node_id, attempts=2)
                except RpcError:
                    self.endpoint.clear_relay(addr)
                    continue
                if reply.peer.node_id != node_id:
                    self.endpoint.clear_relay(addr)
                    return
                self._use_relay(node_id, relay_id, relay, addr)
                return
        finally:
            self._active.discard(node_id)
