"""One UDP socket per daemon: the trio shell around the transport core (transport/core.py).

The core decides (request ids, retransmission schedule, what an incoming message is, what an unvalidated
address may be sent); this shell seals, opens, sends and waits. Handlers for control requests are plain
functions (they run to completion without awaiting), so a request is answered straight from the receive loop.
Tensor data (types 0x40..0x7F) goes to raw handlers that get the opened body and the sender's token state,
never msgpack.

The receive loop is the base class ``Inbound`` (transport/inbound.py); what a pass accepts, refuses and counts,
and the pause after it, is the core's receive policy (transport/receive.py). NAT paths (direct, aliased,
relayed) are looked up in ``Paths`` (transport/paths.py).

Sending never raises anything but RpcError: a send the kernel refuses (no route, a broadcast address) or a
body this node must not send (one its peers would drop) is an RpcError the caller handles, like a timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import random
import socket
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import trio

from ..entropy import default_rng, default_token_rng
from ..metrics import Metrics
from ..wire import messages as m
from ..wire.envelope import Header
from ..wire.identity import Identity
from ..wire.seal import Opener, Sealer, TokenState
from .caps import SocketCaps, plain_caps
from .core import (
    MAX_HELD_ADDRESSES,
    MAX_HELD_PER_ADDRESS,
    MAX_KNOWN_IDS,
    Answered,
    PendingFull,
    Transmit,
    TransportCore,
)
from .delay import DelaySocket
from .faults import LossySocket
from .guard import AmplificationGuard, AuthLimiter
from .inbound import Inbound, RequestWaiter
from .paths import PATH_KINDS
from .rotation import Rotation
from .rpc import Address, Incoming, Peer, RpcError, RpcTimeout
from .rto import RtoEstimator
from .traffic import TrafficHooks

log = logging.getLogger("peerd.transport")

DEFAULT_MTU = 1200
# A request unanswered this long after its first transmission (and retransmitted) tells the NAT service its peer
# may sit behind a NAT (punch, or relay). Tied to time, not to the retransmission count: a learned timeout of a few
# ms on a quiet link must not make one lost datagram look like a NAT's filter.
NAT_SILENT_S = 0.05
# A sealer is replaced after this many datagrams (PROTOCOL.md 4.2: AES-GCM's confidentiality bound). The next one
# is drawn at 3/4 of it and seals control messages at once (each carries its signed binding); data to a receiver
# moves to it once a request sealed with it was answered by that receiver (which bound it), and all data moves
# when the two together have sealed ROTATE_AFTER.
ROTATE_AFTER = 2**28

__all__ = ["Address", "DEFAULT_MTU", "Endpoint", "Incoming", "MAX_HELD_ADDRESSES", "MAX_HELD_PER_ADDRESS",
           "MAX_KNOWN_IDS", "NatHooks", "PATH_KINDS", "Peer", "RpcError", "RpcTimeout", "retry_delays"]


class DatagramSocket(Protocol):
    """What the endpoint needs of a socket: transport.udp.UdpSocket, or an in-memory one in tests. A socket
    declares what more it can do in ``caps`` (transport/caps.py); one without ``caps`` has none of it."""

    family: int

    async def sendto(self, data: bytes, address: Address, /) -> None: ...
    async def send_many(self, datagrams: list[bytes], address: Address, /) -> None: ...
    async def recv_batch(self, max_datagrams: int = 64, /) -> list[tuple[bytes, Address]]: ...
    def close(self) -> None: ...


class NatHooks(Protocol):
    """What NAT traversal (peerd/nat/service.py) hears from the endpoint: the shell calls these, never awaits."""

    def sent(self, addr: Address, now: float) -> None: ...
    def answered(self, addr: Address, reply: Incoming, now: float) -> None: ...
    def silent(self, addr: Address, node_id: bytes, now: float) -> None: ...
    def unreached(self, addr: Address, node_id: bytes) -> None: ...
    def heard(self, source: Address, node_id: bytes, now: float) -> None: ...


RequestHandler = Callable[[Incoming], dict[str, Any] | None]
RawHandler = Callable[[Header, bytes, TokenState, Address], None]
# (type, token, token state, bodies: (rows, body bytes) uint8, source): a GRO block of tensor data, opened.
BlockHandler = Callable[[int, int, TokenState, np.ndarray, Address], None]


class Endpoint(Inbound):
    """One node's UDP endpoint: registration, sealing and sending, requests; the receive loop is ``Inbound``'s."""

    def __init__(
        self,
        sock: DatagramSocket,
        identity: Identity,
        swarm_secret: bytes | None,
        metrics: Metrics,
        *,
        announce: Address | None = None,
        mtu: int = DEFAULT_MTU,
        loss: float = 0.0,
        loss_seed: int | None = None,
        delay_s: float = 0.0,
        rotate_after: int = ROTATE_AFTER,
        rng: random.Random | None = None,
        core: TransportCore | None = None,
    ) -> None:
        """``rng`` draws sealing tokens, request ids and jitter (default: os entropy; a seeded one only for tests
        and simulations, since two processes that draw the same token under one swarm key reuse AEAD nonces).
        ``loss``/``loss_seed``: fault injection, by a ``LossySocket`` wrapped around ``sock``; ``delay_s``: a
        propagation delay, by a ``DelaySocket`` (what arrives is held that long, then lost as ``loss`` says)."""
        self.rng = default_token_rng(rng)
        if delay_s:
            sock = DelaySocket(sock, delay_s)  # type: ignore[assignment]
        if loss:
            injected = metrics.datagrams_dropped.labels("injected")  # (a label lookup per block is not free)
            sock = LossySocket(sock, loss, np.random.default_rng(loss_seed),  # type: ignore[assignment]
                               on_drop=injected.inc)
        self.sock = sock
        self.caps: SocketCaps = getattr(sock, "caps", None) or plain_caps()  # declared by the socket, read once
        self.family = getattr(sock, "family", None)
        if announce is not None:
            why = self.unreachable(announce[0])
            if why or not 1 <= announce[1] <= 65535:
                raise ValueError(f"cannot announce {announce[0]}:{announce[1]}: {why or 'port 0'}; announce the "
                                 f"address and port peers reach this node at")
        self.identity = identity
        self.metrics = metrics
        self.mtu = mtu
        self.core = core if core is not None else TransportCore(self.rng)
        self._secret = swarm_secret
        self._announce = m.pack_addr(*announce) if announce else None
        self._bindings: dict[int, dict[str, Any]] = {}  # token -> the ``from`` its control messages carry
        # seals data (and control while no rotation runs); the next sealer's token is drawn when one starts
        self.rotation = Rotation(self._new_sealer(), rotate_after, self._new_sealer)
        self.opener = Opener(swarm_secret, identity.node_id)
        self._sealed = swarm_secret is not None
        self.core.receiving.sealed = self._sealed
        self._token_state = self.opener.token_state  # bound once: the junk path's per-datagram calls
        self._screen = self.core.receiving.screen
        self._handlers: dict[int, RequestHandler] = {}
        self._raw: dict[int, RawHandler] = {}
        self._raw_block: dict[int, BlockHandler] = {}
        self._requests: dict[int, RequestWaiter] = {}  # rid of an open request -> what its caller waits on
        # the core's timer, tended by ``serve`` (transport/inbound.py): when the tender wakes, and what wakes it early
        self._tending = False
        self._timer_at = math.inf
        self._timer_moved = trio.Event()
        self._pause_s = 0.0  # the last receive pass's decision: how long the loop waits before the next
        self._in_hand = False  # the receive loop holds a pass it has read off the socket and not handled yet
        self._pass_ended = trio.Event()  # set (and replaced) as each receive pass ends: ``caught_up``'s waiters wake
        self._bind_hooks: list[Callable[[int, bytes], None]] = []
        # the tokens an overloaded receive pass never sheds, asked at the pass's time (the averaging host's groups'
        # members)
        self.protected_tokens: Callable[[float], dict[int, None]] | None = None
        # whether a reader waits on what arrives next (the averaging host's groups at a phase's tail): the receive
        # loop then skips a pass's trickle pause, which would hold that data queued for up to COALESCE_S
        self.reads_now: Callable[[], bool] | None = None
        self._pause_why = ""  # the last receive pass's decision: why it pauses (PassDecision.why)
        self._type_names = {t.value: t.name.lower() for t in m.MsgType}
        self._handler_errors = 0
        # Prometheus children of the receive policy's counts, looked up once (a ``labels`` lookup costs about a
        # microsecond, as much as refusing a datagram)
        self._drop_counters: dict[str, Any] = {}
        self._received_counters: dict[int, Any] = {}
        # per control message type: datagrams_sent's and rpc_seconds' children (a ``labels`` lookup costs about a
        # microsecond, twice per request and once per answer)
        self._sent_counters: dict[int, Any] = {}
        self._rpc_timers: dict[int, Any] = {}
        self._outbox: list[tuple[Any, ...]] = []  # answers and validations a batch produced, sent after it
        # NAT traversal (peerd/nat): who hears about sends and answers, and where a peer's datagrams go
        self.nat: NatHooks | None = None
        self.paths = self.core.paths
        self.traffic: TrafficHooks | None = None  # per-peer accounting (peerd/peers): told of every datagram moved
        self._relayed_src: bytes | None = None  # while a relayed datagram is handled: the sender its relay named
        self._relayed_ok = False
        self.on_request(m.MsgType.PING, lambda incoming: {})  # the DHT replaces it; a PING is always answered

    def _new_sealer(self) -> Sealer:
        """A sealer under a new token of this node's identity (derived from its key, so no other key binds it)."""
        binding = self.identity.bind_token(self.rng)
        sealer = Sealer(self._secret, binding.token)
        self._bindings[sealer.token] = binding.sender(self._announce)
        return sealer

    @property
    def sealer(self) -> Sealer:
        """The current sealer (data to receivers that have not bound the next one yet)."""
        return self.rotation.current

    @property
    def rotate_after(self) -> int:
        return self.rotation.rotate_after

    @property
    def rotations(self) -> int:
        return self.rotation.rotations

    @property
    def _from(self) -> dict[str, Any]:
        """The ``from`` field (identity, token binding, announced address) of the current sealer's messages."""
        return self._bindings[self.rotation.current.token]

    # -- the core's state, under the names callers and tests use ---------------------------------------------
    @property
    def rto(self) -> RtoEstimator:
        """Learned retransmission timeouts per destination, for request()."""
        return self.core.rto

    @property
    def guard(self) -> AmplificationGuard:
        return self.core.guard

    @property
    def auth_limiter(self) -> AuthLimiter:
        return self.core.auth_limiter

    @property
    def kernel_drops(self) -> int:
        """Datagrams the kernel dropped at this socket's receive queue (0 where the socket cannot tell)."""
        return int(getattr(self.sock, "kernel_drops", 0)) if self.caps.kernel_drops else 0

    # -- registration -------------------------------------------------------------------------
    def on_request(self, mtype: m.MsgType, handler: RequestHandler) -> None:
        """``handler`` returns the response fields (without rid/from), or None to stay silent."""
        self._handlers[int(mtype)] = handler
        self.core.register(int(mtype), int(m.REQUESTS[mtype]))

    def on_message(self, mtype: m.MsgType, handler: RequestHandler) -> None:
        """A one-way control message: ``handler`` runs, nothing is sent back."""
        self._handlers[int(mtype)] = handler
        self.core.register(int(mtype), int(mtype))

    async def notify(
        self, addr: Address, mtype: m.MsgType, fields: dict[str, Any], *, node_id: bytes | None = None
    ) -> None:
        """Send a one-way control message (no response, no retry) to the node ``node_id`` (default: the one
        this endpoint knows at ``addr``; RpcError if none)."""
        receiver = node_id or self.node_id_at(addr)
        if self.traffic is not None and receiver is not None:
            self.traffic.control(receiver, mtype, fields, True)
        await self._send_control(addr, mtype, self.core.new_id(), fields, receiver)

    # -- receivers' node ids ----------------------------------------------------------------------
    def learn(self, addr: Address, node_id: bytes) -> None:
        """Remember that the node ``node_id`` is at ``addr`` (what this endpoint seals datagrams to it for)."""
        self.core.learn(addr, node_id)

    def node_id_at(self, addr: Address) -> bytes | None:
        return self.core.node_id_at(addr)

    def addr_of(self, node_id: bytes) -> Address | None:
        """The address this endpoint last learned ``node_id`` at (e.g. a group member it averaged with)."""
        return self.core.addr_of(node_id)  # type: ignore[return-value]

    def _receiver(self, addr: Address, node_id: bytes | None) -> bytes:
        receiver = node_id or self.core.node_id_at(addr)
        if receiver is None:
            self.metrics.datagrams_dropped.labels("unknown_receiver").inc()
            raise RpcError(f"no node id known at {addr[0]}:{addr[1]}: PING it first")
        return receiver

    def on_bind(self, hook: Callable[[int, bytes], None]) -> None:
        """``hook(token, public_key)`` runs when a remote token is first bound to an identity."""
        self._bind_hooks.append(hook)

    def on_raw(self, mtype: int, handler: RawHandler) -> None:
        if mtype <= m.CONTROL_MAX:
            raise ValueError("raw handlers are for tensor data types (0x40..0x7F)")
        self._raw[mtype] = handler

    def on_raw_block(self, mtype: int, handler: BlockHandler) -> None:
        """Where GRO blocks of tensor data of ``mtype`` go once opened (the raw handler gets the rest)."""
        if mtype not in self._raw:
            raise ValueError("register the per-datagram raw handler first: blocks fall back to it")
        self._raw_block[mtype] = handler

    def unreachable(self, host: str) -> str:
        """Why this node must not send to ``host`` (an IP literal), or "" when it may: an address its peers'
        decoders refuse (unspecified, broadcast, multicast), or one of the other family than this node's
        socket (the send would fail)."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return "not an IP address"
        why = m.unusable_ip(ip.packed)
        if why:
            return why
        if self.family is not None and (ip.version == 6) != (self.family == socket.AF_INET6):
            return f"IPv{ip.version}, but this node's socket is IPv{6 if self.family == socket.AF_INET6 else 4}"
        return ""

    # -- sending --------------------------------------------------------------------------------
    @property
    def max_body(self) -> int:
        return self.mtu - self.sealer.overhead

    # -- token rotation (the decisions are transport/rotation.py's) -----------------------------
    def _rotate(self) -> None:
        if self.rotation.step():
            self._bindings = {t: b for t, b in self._bindings.items() if t == self.sealer.token}
            log.info("sealing token rotated (%d datagrams): %016x", self.rotate_after, self.sealer.token)

    def data_sealer(self, receiver: bytes) -> Sealer:
        """The sealer for tensor data to ``receiver``: the next one only once the receiver has bound it."""
        self._rotate()
        return self.rotation.for_data(receiver)

    def _control_sealer(self) -> tuple[Sealer, dict[str, Any]]:
        """Control messages carry their token's binding, so they use the next sealer as soon as there is one."""
        self._rotate()
        sealer = self.rotation.for_control()
        return sealer, self._bindings[sealer.token]

    async def send_raw(
        self, addr: Address, mtype: int, bodies: list[bytes], *, node_id: bytes | None = None
    ) -> None:
        """Seal and send tensor-data bodies to one destination (batched: GSO where available)."""
        receiver = self._receiver(addr, node_id)
        if self.nat is not None:
            self.nat.unreached(addr, receiver)
        addr = self.paths.alias_of(addr)  # type: ignore[assignment]
        seal = self.data_sealer(receiver).seal
        datagrams = [seal(mtype, b, receiver) for b in bodies]
        if self.paths.is_relayed(addr):
            await self._send_relayed(addr, datagrams)
            return
        try:
            await self.sock.send_many(datagrams, addr)
        except OSError as e:
            self.metrics.datagrams_dropped.labels("send_error").inc(len(datagrams))
            raise RpcError(f"cannot send to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
        self.metrics.datagrams_sent.labels("data").inc(len(datagrams))
        nbytes = sum(map(len, datagrams))
        self.metrics.bytes_sent.inc(nbytes)
        self._count_sent(addr, len(datagrams), nbytes, mtype)

    async def send_block(
        self, addr: Address, mtype: int, bodies: np.ndarray, *, node_id: bytes | None = None
    ) -> int:
        """Seal and send each row of ``bodies`` (rows, body bytes) to one destination: vectorized headers,
        GSO straight from the sealed array. Returns the bytes sent."""
        receiver = self._receiver(addr, node_id)
        return await self.send_sealed(addr, self.data_sealer(receiver).seal_block(mtype, bodies, receiver))

    async def send_sealed(self, addr: Address, datagrams: np.ndarray) -> int:
        """Send rows that ``sealer.seal_block`` made (a caller that paces a big block sends it in parts).
        Returns the bytes sent."""
        rows = len(datagrams)
        if self.nat is not None:
            receiver = self.core.node_id_at(addr)
            if receiver is not None:
                self.nat.unreached(addr, receiver)  # no path known there yet: NAT traversal sets one up
        addr = self.paths.alias_of(addr)  # type: ignore[assignment]
        if self.paths.is_relayed(addr):
            return await self._send_relayed(addr, [row.tobytes() for row in datagrams])
        try:
            if self.caps.block_send:
                await self.sock.send_block(datagrams, addr)  # type: ignore[attr-defined]
            else:
                await self.sock.send_many([row.tobytes() for row in datagrams], addr)
        except OSError as e:
            self.metrics.datagrams_dropped.labels("send_error").inc(rows)
            raise RpcError(f"cannot send to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
        counter = self._sent_counters.get(-1)  # (data blocks: one child, looked up once)
        if counter is None:
            counter = self._sent_counters[-1] = self.metrics.datagrams_sent.labels("data")
        counter.inc(rows)
        self.metrics.bytes_sent.inc(datagrams.size)
        self._count_sent(addr, rows, datagrams.size)
        return datagrams.size

    async def _send_datagram(self, addr: Address, mtype: int, datagram: bytes) -> None:
        addr = self.paths.alias_of(addr)  # type: ignore[assignment]
        if self.paths.is_relayed(addr):
            await self._send_relayed(addr, [datagram])
            return
        try:
            await self.sock.sendto(datagram, addr)
        except OSError as e:
            self.metrics.datagrams_dropped.labels("send_error").inc()
            raise RpcError(f"cannot send to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
        counter = self._sent_counters.get(mtype)
        if counter is None:
            counter = self._sent_counters[mtype] = self.metrics.datagrams_sent.labels(
                self._type_names.get(mtype, "data"))
        counter.inc()
        self.metrics.bytes_sent.inc(len(datagram))
        self._count_sent(addr, 1, len(datagram), mtype)
        if self.nat is not None:
            self.nat.sent(addr, trio.current_time())

    # -- NAT traversal: paths ---------------------------------------------------------------------
    @property
    def path_counts(self) -> dict[str, list[int]]:
        """Datagrams and bytes sent per path kind (direct, punched, relayed)."""
        return self.paths.counts

    @property
    def _relayed(self) -> dict[Any, tuple[bytes, bytes, Any]]:
        return self.paths.relayed

    def _count_sent(self, addr: Address, datagrams: int, nbytes: int, mtype: int = 0x40) -> None:
        """A direct send's datagrams and bytes, by path kind and (with ``traffic``) by peer."""
        if self.traffic is not None:
            self.traffic.sent(addr, mtype, nbytes, None)
        self.paths.sent(addr, datagrams, nbytes)

    def set_relay(self, addr: Address, peer_id: bytes, relay_id: bytes, relay: Address) -> None:
        """From now on, what this node sends to ``addr`` (the node ``peer_id``) goes through ``relay``, wrapped
        in RELAYs, still sealed for ``peer_id`` (PROTOCOL.md 18.4)."""
        self.paths.set_relay(addr, peer_id, relay_id, relay)
        self.core.learn(addr, peer_id)

    def clear_relay(self, addr: Address) -> None:
        self.paths.clear_relay(addr)

    def set_alias(self, addr: Address, to: Address) -> None:
        """Send what goes to ``addr`` to ``to`` instead: the same node answers there (a symmetric NAT maps it to
        another port for each peer, so the address it published works only for some). At most 4096."""
        self.paths.set_alias(addr, to)

    def alias_of(self, addr: Address) -> Address:
        return self.paths.alias_of(addr)  # type: ignore[return-value]

    def relay_of(self, addr: Address) -> tuple[bytes, bytes, Address] | None:
        return self.paths.relay_of(addr)  # type: ignore[return-value]

    def set_punched(self, addr: Address) -> None:
        """``addr`` was reached by hole punching (counted as such in ``path_counts``)."""
        self.paths.set_punched(addr)

    async def _send_relayed(self, addr: Address, datagrams: list[bytes]) -> int:
        """Wrap each (sealed) datagram for ``addr`` in a RELAY to its relay. Control messages to a relayed address
        are trimmed so their RELAY fits the MTU; a tensor datagram (cut to the MTU, and to one payload size for
        the whole group) may make a RELAY of up to MTU + RELAY_OVERHEAD bytes (PROTOCOL.md 18.4); past that it is
        not sent (``relay_too_big``)."""
        peer_id, relay_id, relay = self.paths.relayed[addr]
        sent = 0
        for inner in datagrams:
            if len(inner) > self.mtu:
                self.core.receiving.dropped("relay_too_big")
                continue
            outer = self._relay_datagram(relay, relay_id, peer_id, inner)
            try:
                await self.sock.sendto(outer, relay)
            except OSError as e:
                self.metrics.datagrams_dropped.labels("send_error").inc()
                raise RpcError(f"cannot send to relay {relay[0]}:{relay[1]}: {e.strerror or e}") from None
            sent += len(outer)
            self.paths.sent(addr, 1, len(inner), relayed=True)
        self.metrics.datagrams_sent.labels("relay").inc(len(datagrams))
        self.metrics.bytes_sent.inc(sent)
        if self.traffic is not None and datagrams:
            self.traffic.sent(addr, datagrams[0][3], sum(map(len, datagrams)), relay_id)
        if self.nat is not None:
            self.nat.sent(relay, trio.current_time())
        return sent

    def _relay_datagram(self, relay: Address, relay_id: bytes, peer_id: bytes, inner: bytes) -> bytes:
        sealer, frm = self._control_sealer()
        body = m.encode(m.MsgType.RELAY, {"rid": self.core.new_id(), "from": frm, "to": peer_id, "data": inner})
        return sealer.seal(m.MsgType.RELAY, body, relay_id)

    async def pass_on(self, addr: Address, node_id: bytes, src: bytes, data: bytes) -> None:
        """As a relay: send ``node_id`` at ``addr`` a RELAYED of ``data`` from ``src`` (one RELAYED per RELAY; it
        may exceed the MTU by what the RELAY did, PROTOCOL.md 18.4)."""
        sealer, frm = self._control_sealer()
        body = m.encode(m.MsgType.RELAYED, {"rid": self.core.new_id(), "from": frm, "src": src, "data": data})
        datagram = sealer.seal(m.MsgType.RELAYED, body, node_id)
        if len(datagram) > self.mtu + m.RELAY_OVERHEAD:
            self.core.receiving.dropped("relay_too_big")
            return
        await self._send_datagram(addr, m.MsgType.RELAYED, datagram)

    async def _send_control(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes | None
    ) -> None:
        """``receiver``: the node id at ``addr``; None only for a PING (sealed for no receiver)."""
        await self._send_datagram(addr, mtype, self._control_datagram(addr, mtype, rid, fields, receiver))

    def _control_datagram(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes | None
    ) -> bytes:
        sealer, frm = self._control_sealer()
        budget = self.max_body - (m.RELAY_OVERHEAD if self.paths.is_relayed(addr) else 0)
        try:
            body = m.encode_fitting(mtype, {"rid": rid, "from": frm, **fields}, budget)
        except ValueError as e:  # WireError included: fields a peer would refuse are never sent
            self.metrics.datagrams_dropped.labels("unsendable").inc()
            raise RpcError(f"not sending {mtype.name.lower()} to {addr[0]}:{addr[1]}: {e}") from None
        if receiver is None and mtype is not m.MsgType.PING:
            receiver = self._receiver(addr, None)
        return sealer.seal(mtype, body, receiver)

    async def _answer(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes
    ) -> None:
        """Answer a request from ``addr``, within 3x the bytes received from it while it is not validated. An
        answer over that budget is held, and ``addr`` is sent a PING (sealed for ``receiver``, within the budget;
        a retransmitted request brings budget for another): its PONG validates the address and releases the
        held answers. A spoofed source gets the PINGs, nothing more."""
        core = self.core
        if core.guard.is_validated(addr):
            await self._send_control(addr, mtype, rid, fields, receiver)
            return
        datagram = self._control_datagram(addr, mtype, rid, fields, receiver)
        if core.may_answer(addr, len(datagram)):
            await self._send_datagram(addr, mtype, datagram)
            return
        self.metrics.datagrams_dropped.labels("unvalidated").inc()
        core.hold(addr, (mtype, rid, fields, receiver))
        challenge = core.challenge(addr)
        ping = self._control_datagram(addr, m.MsgType.PING, challenge, {}, receiver)
        if not core.may_answer(addr, len(ping)):
            return
        core.challenge_sent(challenge, addr)
        await self._send_datagram(addr, m.MsgType.PING, ping)

    async def _validated(self, addr: Address) -> None:
        """``addr`` answered this node's PING (the core validated it): send what was held for it."""
        for mtype, rid, fields, receiver in self.core.release(addr):
            try:
                await self._send_control(addr, mtype, rid, fields, receiver)
            except RpcError as e:
                log.debug("held answer to %s: %s", addr, e)

    async def request(
        self,
        addr: Address,
        mtype: m.MsgType,
        fields: dict[str, Any],
        *,
        timeout: float = 0.5,
        attempts: int = 3,
        node_id: bytes | None = None,
    ) -> Incoming:
        """Send a request and wait for its response, retransmitting with doubling waits. Raises RpcError.

        It gives up when the fixed schedule ``timeout, 2*timeout, ...`` (``attempts`` waits) would have
        ended, but the first wait is the destination's learned retransmission timeout (``self.rto``,
        never above ``timeout``), so under loss a lost datagram costs a few round trips, not 0.5 s.
        (The schedule is the core's: it queues each ``Transmit``, then ``Answered`` or ``Expired``.)

        The request is sealed for ``node_id`` (default: the node this endpoint knows at ``addr``). A PING to
        an address whose node is unknown is sealed for no receiver; any other request first PINGs such an
        address to learn who is there (one more round trip, once).
        """
        if not timeout > 0 or attempts < 1:
            raise ValueError(f"request needs timeout > 0 and attempts >= 1, got {timeout!r}, {attempts!r}")
        receiver = node_id or self.core.node_id_at(addr)
        if receiver is None and mtype is not m.MsgType.PING:
            receiver = (await self.request(addr, m.MsgType.PING, {}, timeout=timeout, attempts=attempts)).peer.node_id
        name = mtype.name.lower()
        core = self.core
        start = trio.current_time()
        try:
            rid = core.open_request(addr, int(m.REQUESTS[mtype]), timeout=timeout, attempts=attempts, now=start)
        except PendingFull as e:
            self.metrics.rpc_failures.labels(name).inc()
            raise RpcError(f"not sending {name} to {addr[0]}:{addr[1]}: {e}") from None
        waiter = self._requests[rid] = RequestWaiter()
        self.carry_out(core.take_actions(), start)
        self._timer_changed()
        sealed_by: Sealer | None = None
        transmits = 0
        told = False  # the NAT service heard that this peer is silent
        try:
            while True:
                while not waiter.actions:
                    await self._wait_for(waiter)
                action = waiter.actions.pop(0)
                if isinstance(action, Transmit):
                    sealed_by = self.rotation.next
                    transmits += 1
                    now = trio.current_time()
                    if (not told and transmits >= 2 and now - start >= NAT_SILENT_S and self.nat is not None
                            and receiver is not None):
                        told = True
                        self.nat.silent(addr, receiver, now)  # maybe a NAT: punch, or relay
                    await self._send_control(addr, mtype, rid, fields, receiver)
                elif isinstance(action, Answered):
                    reply: Incoming = action.reply
                    self.rotation.answered(sealed_by, reply.peer.node_id)  # it opened, so bound, that token
                    if self.nat is not None:
                        self.nat.answered(addr, reply, trio.current_time())
                    if reply.mtype is m.MsgType.ERROR:
                        raise RpcError(f"{addr[0]}:{addr[1]} refused {name}: {reply.body['detail']}")
                    timer = self._rpc_timers.get(mtype)
                    if timer is None:
                        timer = self._rpc_timers[mtype] = self.metrics.rpc_seconds.labels(name)
                    timer.observe(trio.current_time() - start)
                    if self.traffic is not None:
                        self.traffic.answered(addr, reply.peer.node_id, trio.current_time() - start
                                              if transmits == 1 else None, trio.current_time())
                    return reply
                else:
                    self.metrics.rpc_failures.labels(name).inc()
                    if self.traffic is not None:
                        self.traffic.unanswered(addr, trio.current_time())
                    raise RpcTimeout(f"no answer to {name} from {addr[0]}:{addr[1]} within {action.waited:.2f} s")
        finally:
            core.close(rid)
            del self._requests[rid]


def retry_delays(first: float, cap: float, rng: random.Random | None = None) -> Callable[[int], float]:
    """Exponential backoff with jitter, for loops that retry whole operations (bootstrap). ``rng``: the jitter's
    source (default: os entropy)."""
    jitter = default_rng(rng)

    def delay(attempt: int) -> float:
        base = min(cap, first * math.pow(2, attempt))
        return base * (0.5 + jitter.randrange(1000) / 2000)

    return delay
