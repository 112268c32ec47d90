"""The NAT traversal cores (reach, punch, relay) glued to the in-memory network (peerd/tools/sim/net.py), for tests and
simulations: messages are dicts named like the wire's (PROTOCOL.md section 18), not sealed datagrams, and time is
the network's virtual time, so a run is exact for a seed. The daemon's glue (peerd/nat/service.py) makes the same
decisions over the real endpoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ...nat.punch import Failed, Intro, Ping, Punched, Puncher
from ...nat.reach import AskProbe, Observe, ProbeLimiter, Reach, choose_prober
from ...nat.relay import RelayClient, RelayServer
from .net import Network, Timer

Address = tuple[str, int]
SIZE = 150  # bytes of a control message (a sealed PING with an IPv4 ``from.addr`` is 179)
RESPONSES = {"PING": "PONG", "OBSERVE": "OBSERVED", "REACH_PROBE": "REACH_PROBED", "INTRO": "INTRO_OK"}
DIRECT, PUNCHED, RELAYED = "direct", "punched", "relayed"


class SimNatNode:
    """One node: answers and forwards NAT traversal messages, runs its reachability, and connects to peers
    direct, by punching, or through a relay (``connect``), counting what it sends by path kind."""

    def __init__(self, net: Network, addr: Address, node_id: bytes, rng: random.Random, *,
                 relays: bool = True, timeout: float = 1.0) -> None:
        self.net, self.addr, self.node_id, self.rng = net, addr, node_id, rng
        self.timeout = timeout
        self.reach = Reach(rng)
        self.reach.local = {addr}
        self.puncher = Puncher()
        self.relay = RelayServer(enabled=relays)
        self.client = RelayClient()
        self.limiter = ProbeLimiter()
        self.reached: dict[bytes, Address] = {}  # answered a request of this node, at that address
        self.kind: dict[bytes, str] = {}  # how this node talks to a peer
        self.named: dict[bytes, Address] = {}  # where the DHT named a peer (a test fills it; punches go only there)
        self.sent_by_kind = {DIRECT: 0, PUNCHED: 0, RELAYED: 0}
        self.app: list[tuple[bytes, Any]] = []  # application payloads received (sender, payload)
        self._pending: dict[int, tuple[Callable[[dict, Address], None], Callable[[], None], Timer]] = {}
        self._rid = 0
        self._timer: Timer | None = None
        self._connecting: dict[bytes, tuple[bytes, Address, list[tuple[bytes, Address]]]] = {}
        net.attach(addr, self._receive)

    # -- sending ----------------------------------------------------------------------------------------
    def _send(self, addr: Address, msg: dict, size: int = SIZE) -> None:
        self.reach.datagram_sent(addr, self.net.now)
        self.net.send(self.addr, addr, msg, size)

    def request(self, addr: Address, t: str, fields: dict, on_reply: Callable[[dict, Address], None],
                on_timeout: Callable[[], None] = lambda: None, *, via: tuple[bytes, Address] | None = None,
                to: bytes | None = None) -> None:
        self._rid += 1
        rid = self._rid
        timer = self.net.call_later(self.timeout, self._timed_out, rid, owner=self.addr)
        self._pending[rid] = (on_reply, on_timeout, timer)
        msg = {"t": t, "rid": rid, "from": self.node_id, **fields}
        if via is not None:
            assert to is not None
            self._relay_out(via, to, msg)
        else:
            self._send(addr, msg)

    def _relay_out(self, via: tuple[bytes, Address], to: bytes, inner: dict) -> None:
        self._send(via[1], {"t": "RELAY", "rid": 0, "from": self.node_id, "to": to, "data": inner}, 2 * SIZE)

    def _timed_out(self, rid: int) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[1]()
            self._kick()

    def _reply(self, src: Address, msg: dict, fields: dict, via: tuple[bytes, Address] | None) -> None:
        out = {"t": RESPONSES[msg["t"]], "rid": msg["rid"], "from": self.node_id, **fields}
        if via is not None:
            self._relay_out(via, msg["from"], out)
        else:
            self._send(src, out)

    # -- receiving --------------------------------------------------------------------------------------
    def _receive(self, src: Address, msg: dict) -> None:
        self._handle(src, msg, None)
        self._kick()

    def _handle(self, src: Address, msg: dict, via: tuple[bytes, Address] | None) -> None:
        t, sender, now = msg["t"], msg["from"], self.net.now
        if t in RESPONSES.values():
            entry = self._pending.pop(msg["rid"], None)
            if entry is None:
                return
            entry[2].cancel()
            if via is None:
                self.reached[sender] = src
                self.reach.add_peer(sender, src)
                self.relay.reached(sender, src, now)
                self._do(self.puncher.receive_pong(sender, src, now))
            entry[0](msg, src)
            return
        if via is None and t in RESPONSES:  # a request, answered at its source (the daemon's ``heard``)
            self.reach.receive_request(sender, src, now)
        if t == "PING":
            if via is None and self.puncher.punching(sender):  # its punch got through: the path works
                self._do(self.puncher.receive_pong(sender, src, now))
            self._reply(src, msg, {}, via)
        elif t == "OBSERVE":
            self._reply(src, msg, {"seen": src}, via)
        elif t == "REACH_PROBE":
            prober = choose_prober(sender, msg["avoid"], self.reached, self.rng)
            if prober is not None:
                self._send(prober[1], {"t": "PROBE_ASK", "rid": 0, "from": self.node_id, "target": (sender, src),
                                       "nonce": msg["nonce"]})
            self._reply(src, msg, {"ok": prober is not None}, via)
        elif t == "PROBE_ASK":
            if sender in self.reached and self.limiter.allow(msg["target"][1][0], now):
                self._send(msg["target"][1], {"t": "PROBE", "rid": 0, "from": self.node_id, "nonce": msg["nonce"]})
        elif t == "PROBE":
            self.reach.receive_probe(msg["nonce"], src, now)
        elif t == "INTRO":
            target = self.reached.get(msg["target"])
            if target is not None and msg["target"] != sender:
                self._send(target, {"t": "CONNECT", "rid": 0, "from": self.node_id, "peer": (sender, src)})
            self._reply(src, msg, {"peer": (msg["target"], target) if target is not None else None}, via)
        elif t == "CONNECT":
            if sender in self.reached:  # only an introducer this node reached itself
                peer_id, peer_addr = msg["peer"]
                named = [self.named[peer_id]] if peer_id in self.named else []
                self._do(self.puncher.receive_connect(peer_id, peer_addr, named, now))
        elif t == "RELAY":
            where = self.relay.forward(sender, msg["to"], 2 * SIZE, now)
            if not isinstance(where, str):
                self._send(where, {"t": "RELAYED", "rid": 0, "from": self.node_id, "src": sender,
                                   "data": msg["data"]}, 2 * SIZE)
        elif t == "RELAYED":
            if sender in self.reached:  # a relay this node reached (so agreed to use)
                inner = msg["data"]
                if inner["from"] == msg["src"]:  # (the daemon: the inner datagram opened under src's token)
                    self._handle(src, inner, (sender, src))  # answers go back the way it came
                    if msg["src"] not in self.kind:  # a path only once src answers a PING through this relay
                        self._confirm(msg["src"], (sender, src))
        elif t == "APP":
            self.app.append((sender, msg["payload"]))

    # -- the cores' timers and actions ------------------------------------------------------------------
    def _kick(self) -> None:
        now = self.net.now
        self.reach.handle_timer(now)
        self.puncher.handle_timer(now)
        self._do()
        wake = [w for w in (self.reach.get_timer(), self.puncher.get_timer()) if w is not None]
        if self._timer is not None:
            self._timer.cancel()
        if wake:
            self._timer = self.net.call_at(max(min(wake), now + 1e-3), self._kick, owner=self.addr)

    def start(self) -> None:
        self.reach.start(self.net.now)
        self._kick()

    def _do(self, _: None = None) -> None:
        """Carry out what the cores queued (the argument: the input call that queued it, for reading)."""
        now = self.net.now
        for a in [*self.reach.take_actions(), *self.puncher.take_actions()]:
            if isinstance(a, Observe):
                nid = a.node_id
                self.request(a.addr, "OBSERVE", {},
                             lambda msg, src, nid=nid: self.reach.receive_observed(nid, tuple(msg["seen"]),
                                                                                   self.net.now),
                             lambda nid=nid: self.reach.request_failed(nid, self.net.now))
            elif isinstance(a, AskProbe):
                nid = a.node_id
                self.request(a.addr, "REACH_PROBE", {"nonce": a.nonce, "avoid": a.avoid},
                             lambda msg, src, nid=nid: self.reach.receive_probe_asked(nid, msg["ok"], self.net.now),
                             lambda nid=nid: self.reach.request_failed(nid, self.net.now))
            elif isinstance(a, Intro):
                target = a.target
                self.request(a.introducer, "INTRO", {"target": target},
                             lambda msg, src, target=target: self._do(self.puncher.receive_intro(
                                 target, tuple(msg["peer"][1]) if msg["peer"] else None, self.net.now)),
                             lambda target=target: self._do(self.puncher.receive_intro(target, None, self.net.now)))
            elif isinstance(a, Ping):
                self.request(a.addr, "PING", {}, lambda msg, src: None)
            elif isinstance(a, Punched):
                self.kind[a.node_id] = DIRECT if self.kind.get(a.node_id) == DIRECT else PUNCHED
                self.client.drop(a.node_id)
                self._connecting.pop(a.node_id, None)
            elif isinstance(a, Failed):
                self._fall_back(a.node_id, now)

    # -- connecting to a peer ---------------------------------------------------------------------------
    def ping(self, addr: Address, on_reply: Callable[[dict, Address], None] = lambda m, s: None) -> None:
        self.request(addr, "PING", {}, on_reply)

    def connect(self, peer: bytes, addr: Address, introducer: tuple[bytes, Address],
                relays: list[tuple[bytes, Address]]) -> None:
        """Reach ``peer`` (published at ``addr``): a direct PING, then a punch through ``introducer``, then the
        first of ``relays`` that relays a PING to it and back."""
        if peer in self.kind:
            return
        self.named[peer] = addr
        self._connecting[peer] = (introducer[0], introducer[1], list(relays))

        def direct(msg: dict, src: Address) -> None:
            self.kind[peer] = DIRECT
            self._connecting.pop(peer, None)

        def punch() -> None:
            if peer not in self.kind:
                self._do(self.puncher.punch(peer, introducer[0], introducer[1], [addr], self.net.now))

        self.request(addr, "PING", {}, direct, punch)
        self._kick()

    def _fall_back(self, peer: bytes, now: float) -> None:
        entry = self._connecting.get(peer)
        if entry is None or peer in self.kind:
            return
        relays = entry[2]
        if not relays:
            self._connecting.pop(peer, None)
            return
        relay = relays.pop(0)

        def ok(msg: dict, src: Address) -> None:
            self.kind[peer] = RELAYED
            self.client.use(peer, *relay)
            self._connecting.pop(peer, None)

        self.request(relay[1], "PING", {}, ok, lambda: self._fall_back(peer, self.net.now), via=relay, to=peer)

    def _confirm(self, peer: bytes, relay: tuple[bytes, Address]) -> None:
        def ok(msg: dict, src: Address) -> None:
            if peer not in self.kind:
                self.kind[peer] = RELAYED
                self.client.use(peer, *relay)

        self.request(relay[1], "PING", {}, ok, via=relay, to=peer)

    def send_app(self, peer: bytes, addr: Address, payload: Any) -> str:
        """Send ``payload`` to ``peer`` the way this node reaches it; returns the path kind."""
        msg = {"t": "APP", "rid": 0, "from": self.node_id, "payload": payload}
        kind = self.kind.get(peer)
        if kind == RELAYED:
            via = self.client.relay_for(peer)
            assert via is not None
            self._relay_out(via, peer, msg)
        elif kind == PUNCHED:
            path = self.puncher.path(peer)
            self._send(path or addr, msg)
            self.puncher.used(peer, self.net.now)
        elif kind == DIRECT:
            self._send(addr, msg)
        else:
            raise ValueError("not connected to that peer: connect first")
        self.sent_by_kind[kind] += 1
        return kind
