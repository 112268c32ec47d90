"""NAT traversal in the daemon: the trio shell around the path-choice core (PROTOCOL.md section 18).

It answers OBSERVE, REACH_PROBE and INTRO, acts on PROBE_ASK, PROBE, CONNECT, RELAY and RELAYED, and carries out
what ``nat.paths.Paths`` decides: PINGs, INTROs, reachability requests and the endpoint's relay and alias tables.
Every decision is the core's; this module sends and waits. The endpoint tells it what was sent, answered and
left unanswered (``NatHooks``) and carries relayed datagrams (``set_relay``).
"""

from __future__ import annotations

import logging
import math
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from prometheus_client import Counter, Gauge

from ..entropy import default_rng
from ..metrics import Metrics
from ..nurseries import service_nursery
from ..transport.endpoint import PATH_KINDS, Address, Endpoint, Incoming, RpcError
from ..wire import messages as m
from ..wire.errors import WireError
from .paths import ClearRelay, Connect, Paths, SendPing, SetAlias, SetPunched, SetRelay
from .punch import Intro, Puncher
from .reach import PROBER_FRESH_S, UNKNOWN, AskProbe, Observe, ProbeLimiter, Reach, choose_prober
from .relay import RelayServer

log = logging.getLogger("peerd.nat")

RELAY_QUEUE = 4096  # RELAYs waiting to be passed on (more: refused, ``relay_queue``); 5 MB of datagrams


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


@dataclass(frozen=True, slots=True)
class RelayedForOthers:
    datagrams: int
    bytes: int
    refused: dict[str, int]


@dataclass(frozen=True, slots=True)
class NatStatistics:
    """What ``status`` reports of NAT traversal (``dataclasses.asdict`` gives the status fields)."""

    reachability: str
    reachability_basis: str
    observed_addr: str | None
    peers_known: list[str]
    paths: dict[str, str]  # peer id (hex) -> path kind, for peers this node set a path up for
    path_datagrams: dict[str, int]
    path_bytes: dict[str, int]
    relays_not_tried: dict[str, int]  # relays not tried for want of evidence of a NAT, by reason
    relayed_for_others: RelayedForOthers


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
        self.paths = Paths(endpoint.identity.node_id, self.rng, ipv6=endpoint.family == socket.AF_INET6,
                           contact_of=contact_of)
        self.relay = RelayServer(enabled=relay)
        self.uplink: Any = None  # the node's uplink pacer (a transport.pacing.Pacer), when it averages
        # One task passes RELAYs on, in the order they came: a task each would let trio's scheduler reorder a
        # batch (it runs a batch backwards half the time), and the receivers' delivery REPORTs would take the
        # reordering for loss and slow the senders' pacers several-fold (`peerd bench allreduce --nat symmetric`).
        self._relay_in, self._relay_out = trio.open_memory_channel[tuple[Address, bytes, bytes, bytes]](RELAY_QUEUE)
        self.limiter = ProbeLimiter()
        self.on_verdict = on_verdict
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._published: dict[str, tuple[int, int]] = {}
        self._punches_published = (0, 0)
        self._verdict = UNKNOWN
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

    # -- the core's state, as the daemon and tests see it --------------------------------------------------
    @property
    def reach(self) -> Reach:
        return self.paths.reach

    @property
    def puncher(self) -> Puncher:
        return self.paths.puncher

    @property
    def verdict(self) -> str:
        return self.paths.reach.verdict

    @property
    def reached(self) -> dict[bytes, Address]:
        return self.paths.reached

    @property
    def kind(self) -> dict[bytes, str]:
        return self.paths.kind

    @property
    def introducer(self) -> dict[bytes, bytes]:
        return self.paths.introducer

    @property
    def named_at(self) -> dict[bytes, Address]:
        return self.paths.named_at

    @property
    def no_relay(self) -> dict[str, int]:
        return self.paths.no_relay

    @property
    def contact_of(self) -> Callable[[bytes], Address | None] | None:
        return self.paths.contact_of

    @contact_of.setter
    def contact_of(self, fn: Callable[[bytes], Address | None] | None) -> None:
        self.paths.contact_of = fn

    def peers_known(self, now: float | None = None) -> list[bytes]:
        return self.paths.peers_known(trio.current_time() if now is None else now)

    def path_to(self, addr: Address, node_id: bytes) -> str | None:
        return self.paths.path_to(addr, node_id, trio.current_time())

    def relay_entry(self, node_id: bytes) -> tuple[bytes, bytes, Address] | None:
        return self.paths.relay_entry(node_id)

    def statistics(self) -> NatStatistics:
        observed = self.reach.observed_addr
        counts = self.endpoint.path_counts
        return NatStatistics(
            reachability=self.reach.verdict,
            reachability_basis=self.reach.basis,
            observed_addr=f"{observed[0]}:{observed[1]}" if observed else None,
            peers_known=[n.hex() for n in self.peers_known()],
            paths={n.hex(): k for n, k in sorted(self.kind.items())},
            path_datagrams={k: v[0] for k, v in counts.items()},
            path_bytes={k: v[1] for k, v in counts.items()},
            relays_not_tried=dict(self.no_relay),
            relayed_for_others=RelayedForOthers(self.relay.relayed, self.relay.relayed_bytes,
                                                dict(self.relay.refused)),
        )

    def _publish_metrics(self) -> None:
        for kind, (n, b) in self.endpoint.path_counts.items():
            old_n, old_b = self._published.get(kind, (0, 0))
            if n > old_n:
                self.metrics.datagrams.labels(kind).inc(n - old_n)
            if b > old_b:
                self.metrics.bytes.labels(kind).inc(b - old_b)
            self._published[kind] = (n, b)
        stats = self.paths.statistics()
        for kind in PATH_KINDS:
            self.metrics.paths.labels(kind).set(stats.paths.get(kind, 0))
        punched, failed = self._punches_published
        if stats.punched > punched:
            self.metrics.punches.labels("punched").inc(stats.punched - punched)
        if stats.punch_failures > failed:
            self.metrics.punches.labels("failed").inc(stats.punch_failures - failed)
        self._punches_published = (stats.punched, stats.punch_failures)
        for v in ("public", "cone-nat", "symmetric-nat", "unknown"):
            self.metrics.reachability.labels(v).set(1 if v == self.reach.verdict else 0)

    # -- hooks from the endpoint (never await) ----------------------------------------------------------
    def sent(self, addr: Address, now: float) -> None:
        self.paths.datagram_sent(addr, now)

    def answered(self, addr: Address, reply: Incoming, now: float) -> None:
        if self.endpoint.relay_of(addr) is None:
            self.relay.reached(reply.peer.node_id, addr, now)
        self.paths.receive_answer(addr, reply.peer.node_id, reply.body.get("nodes") or [], now)
        self._act()

    def heard(self, source: Address, node_id: bytes, now: float) -> None:
        """A request from ``node_id`` came in from ``source`` (never called for what came through a relay)."""
        self.paths.receive_request(source, node_id, now)
        self._act()

    def silent(self, addr: Address, node_id: bytes, now: float) -> None:
        """A request to ``node_id`` at ``addr`` went unanswered once (the core decides what, if anything, helps)."""
        self.paths.request_unanswered(addr, node_id, now)
        self._act()

    def unreached(self, addr: Address, node_id: bytes) -> None:
        """Tensor data is about to go to ``addr`` with no path known there: set one up in the background (what is
        sent before it works is lost, as on any lossy link)."""
        if self._nursery is not None:
            self.paths.unreached(addr, node_id, trio.current_time())
            self._act()

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
        fresh = self.paths.heard_within(PROBER_FRESH_S, trio.current_time())
        prober = choose_prober(requester, incoming.body["avoid"], reached, self.rng, fresh)
        log.debug("REACH_PROBE from %s at %s (avoid %d): prober %s", requester.hex()[:8], incoming.source,
                  len(incoming.body["avoid"]), prober and (prober[0].hex()[:8], prober[1]))
        if prober is not None:
            host, port = incoming.source
            self._spawn(self._notify, prober[1], m.MsgType.PROBE_ASK,
                        {"target": m.pack_contact(requester, host, port), "nonce": incoming.body["nonce"]}, prober[0])
        return {"ok": prober is not None}

    def _on_probe_ask(self, incoming: Incoming) -> None:
        if incoming.peer.node_id not in self.reached:  # (one-way: refused silently, and counted)
            self.base.datagrams_dropped.labels("unreached").inc()
            log.debug("PROBE_ASK from %s: not a peer this node reached", incoming.peer.node_id.hex()[:8])
            return None
        target_id, host, port = incoming.body["target"]
        if self.endpoint.relay_of((host, port)) is not None:
            log.debug("PROBE_ASK toward %s:%s: relayed there", host, port)
            return None  # a relayed PROBE would pass any NAT and prove nothing
        if self.endpoint.unreachable(host) or not self.limiter.allow(host, trio.current_time()):
            log.debug("PROBE_ASK toward %s:%s: refused (unreachable or over the limit)", host, port)
            return None
        log.debug("PROBE_ASK from %s: PROBE to %s at %s:%s", incoming.peer.node_id.hex()[:8], target_id.hex()[:8],
                  host, port)
        self._spawn(self._notify, (host, port), m.MsgType.PROBE, {"nonce": incoming.body["nonce"]}, target_id)
        return None

    def _on_probe(self, incoming: Incoming) -> None:
        if self._relayed_in(incoming):
            return None  # it came through a relay, not through this node's NAT: proves nothing
        proved = self.reach.receive_probe(incoming.body["nonce"], incoming.source, trio.current_time())
        log.debug("PROBE from %s at %s: %s (%s)", incoming.peer.node_id.hex()[:8], incoming.source,
                  "proves reachability" if proved else "proves nothing", self.reach.statistics())
        if proved:
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
        self.paths.receive_connect(peer_id, (host, port), trio.current_time())
        self._act()
        return None

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
        """A datagram a relay passed on, handled only once it opened under a token bound to ``src`` (the endpoint
        checks), at the address the core chose for it (``Paths.receive_relayed``)."""
        if self._relayed_in(incoming):
            self.base.datagrams_dropped.labels("relay_loop").inc()
            return None
        relay_id, relay = incoming.peer.node_id, incoming.source
        src = incoming.body["src"]
        now = trio.current_time()
        addr, why = self.paths.receive_relayed(relay_id, relay, src, now)
        if addr is None:
            self.base.datagrams_dropped.labels(why).inc()
            return None
        if not self.endpoint.receive_relayed(incoming.body["data"], addr, src):
            return None  # junk, a replay, or another identity than ``src`` (dropped and counted by the endpoint)
        self.paths.relayed_opened(addr, src, relay_id, relay, now)
        self._act()
        return None

    # -- connecting on purpose -------------------------------------------------------------------------------
    async def connect(self, addr: Address, node_id: bytes, *, timeout: float = 15.0) -> str | None:
        """Make sure this node can talk to ``node_id`` at ``addr`` (e.g. a group member before tensor data goes
        out, which has no retries): a PING; unanswered, the punch and then the relay that ``silent`` starts.
        Returns the path kind, or None when nothing worked within ``timeout``."""
        paths = self.paths
        kind = self.path_to(addr, node_id)
        if kind is not None:
            return kind
        if paths.connect_relayed(addr, node_id, trio.current_time()):  # relayed at another address already
            self._act()
            return "relayed"
        elsewhere = paths.elsewhere(node_id, addr, trio.current_time())
        if elsewhere is not None:
            try:  # it may answer at ``addr`` too (a cone NAT, a moved peer): else use where it answers
                await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=node_id, attempts=1)
            except RpcError:
                paths.answers_elsewhere(addr, elsewhere, trio.current_time())
                self._act()
            return self.path_to(addr, node_id)
        idle = 0  # PING rounds in a row that failed with no punch or relay under way
        first = paths.attempts(node_id)
        with trio.move_on_after(timeout):
            while True:
                try:
                    await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=node_id, attempts=2)
                except RpcError:
                    pass
                kind = self.path_to(addr, node_id)
                if kind is not None and not (kind == "relayed" and node_id in paths.active):
                    return kind  # (a relay being tried is set before its PING: not a path until answered)
                idle = 0 if node_id in paths.active else idle + 1
                if idle >= 2 or paths.attempts(node_id) - first >= 2:
                    # nothing could be tried, or a whole attempt (punch, then relays) failed and the next one
                    # began: waiting out ``timeout`` would only hold up the caller (a group's average, where
                    # every member waits for the slowest start)
                    return None
                await trio.sleep(1.0)  # a punch (3 s) or a relay set-up is under way
        kind = self.path_to(addr, node_id)
        return None if kind == "relayed" and node_id in paths.active else kind

    async def connect_all(self, peers: list[tuple[Address, bytes]], timeout: float) -> dict[bytes, str | None]:
        """``connect`` to each of ``peers`` (address, node id) at once; their path kinds (None: none found)."""
        out: dict[bytes, str | None] = {}

        async def one(addr: Address, node_id: bytes) -> None:
            out[node_id] = await self.connect(addr, node_id, timeout=timeout)

        async with trio.open_nursery() as nursery:
            for addr, node_id in peers:
                nursery.start_soon(one, addr, node_id)
        return out

    async def _connect_once(self, addr: Address, node_id: bytes) -> None:
        try:
            await self.connect(addr, node_id)
        finally:
            self.paths.connect_done(addr, trio.current_time())

    # -- the loop -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run reachability now (after joining: the peers it reached are its observers)."""
        self.paths.start(trio.current_time())
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with service_nursery(self) as nursery:
            nursery.start_soon(self._pass_on_all)
            task_status.started()
            while True:
                now = trio.current_time()
                try:
                    self.paths.handle_timer(now)
                    self._act()
                    self._publish_metrics()
                except Exception:  # background work never takes the daemon down
                    log.exception("NAT traversal step failed")
                    self.base.background_errors.labels("nat").inc()
                if self.reach.verdict != self._verdict:
                    self._changed()
                wake = min(self.paths.get_timer() or math.inf, now + 5.0)
                self._wake = trio.Event()
                with trio.move_on_at(max(wake, now + 0.01)):
                    await self._wake.wait()

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

    def _act(self) -> None:
        """Carry out the core's actions: the endpoint's tables at once, the rest in the background."""
        actions = self.paths.take_actions()
        endpoint = self.endpoint
        for a in actions:
            if isinstance(a, SendPing):
                self._spawn(self._ping, a)
            elif isinstance(a, SetRelay):
                endpoint.set_relay(a.addr, a.peer_id, a.relay_id, a.relay)
            elif isinstance(a, ClearRelay):
                endpoint.clear_relay(a.addr)
            elif isinstance(a, SetAlias):
                endpoint.set_alias(a.addr, a.to)
            elif isinstance(a, SetPunched):
                endpoint.set_punched(a.addr)
            elif isinstance(a, Connect):
                if self._nursery is None:
                    self.paths.connect_done(a.addr, trio.current_time())
                else:
                    self._spawn(self._connect_once, a.addr, a.node_id)
            elif isinstance(a, Observe):
                self._spawn(self._observe, a)
            elif isinstance(a, AskProbe):
                self._spawn(self._ask_probe, a)
            elif isinstance(a, Intro):
                self._spawn(self._intro, a)
        if actions:
            self._wake.set()

    # -- actions ------------------------------------------------------------------------------------------
    async def _ping(self, a: SendPing) -> None:
        try:
            if a.timeout is None:
                reply = await self.endpoint.request(a.addr, m.MsgType.PING, {}, node_id=a.node_id,
                                                    attempts=a.attempts)
            else:
                reply = await self.endpoint.request(a.addr, m.MsgType.PING, {}, node_id=a.node_id,
                                                    timeout=a.timeout, attempts=a.attempts)
        except RpcError:
            self.paths.ping_failed(a.token, trio.current_time())
        else:
            self.paths.receive_pong(a.token, reply.peer.node_id, reply.relayed, trio.current_time())
        self._act()

    async def _notify(self, addr: Address, mtype: m.MsgType, fields: dict, node_id: bytes) -> None:
        try:
            await self.endpoint.notify(addr, mtype, fields, node_id=node_id)
        except RpcError as e:
            log.debug("%s to %s: %s", mtype.name, addr, e)

    async def _observe(self, a: Observe) -> None:
        try:
            reply = await self.endpoint.request(a.addr, m.MsgType.OBSERVE, {}, node_id=a.node_id, attempts=2)
        except RpcError:
            self.reach.request_failed(a.node_id, trio.current_time())
        else:
            self._local_toward(a.addr)
            self.reach.receive_observed(a.node_id, tuple(reply.body["seen"]), trio.current_time())
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
            log.debug("REACH_PROBE to %s: no answer", a.node_id.hex()[:8])
            self.reach.request_failed(a.node_id, trio.current_time())
        else:
            log.debug("REACH_PROBE to %s (avoid %s): ok %s", a.node_id.hex()[:8], [n.hex()[:8] for n in a.avoid],
                      reply.body["ok"])
            self.reach.receive_probe_asked(a.node_id, reply.body["ok"], trio.current_time())
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
        self.paths.receive_intro(a.target, addr, trio.current_time())
        self._act()
