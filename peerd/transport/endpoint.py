"""One UDP socket per daemon: the trio shell around the transport core (transport/core.py).

The core decides (request ids, retransmission schedule, what an incoming message is, what an unvalidated
address may be sent); this shell seals, opens, sends and waits. Handlers for control requests are plain
functions (they run to completion without awaiting), so a request is answered straight from the receive loop.
Tensor data (types 0x40..0x7F) goes to raw handlers that get the opened body and the sender's token state,
never msgpack.

The receive loop takes a batch off the socket and sorts it without awaiting: junk (a bad header, an unknown
token past its ration) is refused before anything is built for it and counted in plain ints, PINGs and PONGs go
before the rest of a batch, and the answers a batch produced are sent after it; counters reach Prometheus once
per batch.

Sending never raises anything but RpcError: a send the kernel refuses (no route, a broadcast address) or a
body this node must not send (one its peers would drop) is an RpcError the caller handles, like a timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import random
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from ..entropy import default_rng, default_token_rng
from ..metrics import Metrics
from ..wire import messages as m
from ..wire.envelope import (
    FLAG_NO_RECEIVER,
    FLAG_SEALED,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    PING_TYPE,
    SEQ_OFFSET,
    VERSION,
    Header,
    peek,
)
from ..wire.errors import WireError
from ..wire.identity import Identity, node_id_of, verify_token_binding
from ..wire.seal import TAG_SIZE, Opener, Sealer, TokenState
from .caps import SocketCaps, plain_caps
from .core import (
    MAX_HELD_ADDRESSES,
    MAX_HELD_PER_ADDRESS,
    MAX_KNOWN_IDS,
    Answered,
    PendingFull,
    Route,
    Transmit,
    TransportCore,
    WaitUntil,
)
from .faults import LossySocket
from .guard import AmplificationGuard, AuthLimiter
from .pause import Pause
from .rotation import Rotation
from .rto import RtoEstimator
from .traffic import TrafficHooks

log = logging.getLogger("peerd.transport")

Address = tuple[str, int]
DEFAULT_MTU = 1200
RECV_DATAGRAMS = 1024  # per receive pass (the socket's arena caps it near 1 MB: ~1 ms of opening when sealed)
# A pass that took a few blocks of tensor data and emptied the socket waits before the next: on a paced, shaped
# link without GRO, data arrives a datagram at a time, and each pass's fixed cost (the event loop, a block's Python
# per source) would be paid for a few dozen datagrams. Waiting cuts the receive passes and the CPU of an average
# several-fold at the same link use (`peerd bench allreduce --peers 4 --size 5000000 --link 100mbit --json`:
# cpu_s_per_peer, link_utilization). The first trickle pass waits
# COALESCE_FIRST_S, the ones after it in a row (a paced stream) COALESCE_S: a small average's few datagrams, which
# the wait only delays, pay the short one. Arrival times come from the kernel: the pacer's queue samples do not see
# the wait.
COALESCE_FIRST_S = 0.001
COALESCE_S = 0.006
COALESCE_BELOW = 128  # datagrams: a pass that took more is not a trickle
URGENT_BYTES = 512  # a PING or PONG at most this long goes before the rest of its receive batch
# A request unanswered this long after its first transmission (and retransmitted) tells the NAT service its peer
# may sit behind a NAT (punch, or relay). Tied to time, not to the retransmission count: a learned timeout of a few
# ms on a quiet link must not make one lost datagram look like a NAT's filter.
NAT_SILENT_S = 0.05
# A sealer is replaced after this many datagrams (PROTOCOL.md 4.2: AES-GCM's confidentiality bound). The next one
# is drawn at 3/4 of it and seals control messages at once (each carries its signed binding); data to a receiver
# moves to it once a request sealed with it was answered by that receiver (which bound it), and all data moves
# when the two together have sealed ROTATE_AFTER.
ROTATE_AFTER = 2**28
_PING, _PONG = int(m.MsgType.PING), int(m.MsgType.PONG)

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


PATH_KINDS = ("direct", "punched", "relayed")


class RpcError(Exception):
    """A request that failed: no answer, or an ERROR response."""


class RpcTimeout(RpcError):
    pass


@dataclass(frozen=True, slots=True)
class Peer:
    """A remote node as proven by its token binding; ``host``/``port`` is where to reach it."""

    node_id: bytes
    public_key: bytes
    host: str
    port: int


@dataclass(slots=True)
class Incoming:
    mtype: m.MsgType
    body: dict[str, Any]
    peer: Peer
    source: Address
    relayed: bool = False  # it came through a relay: ``source`` stands for the sender and teaches no address


RequestHandler = Callable[[Incoming], dict[str, Any] | None]
RawHandler = Callable[[Header, bytes, TokenState, Address], None]
# (type, token, token state, bodies: (rows, body bytes) uint8, source): a GRO block of tensor data, opened.
BlockHandler = Callable[[int, int, TokenState, np.ndarray, Address], None]


_TOKEN = struct.Struct("!Q")  # a header's token, at byte 5 (wire.envelope.HEADER)


_HEAD = MAGIC + bytes([VERSION])


def _before_own_data(batch: list[tuple[Any, Address, int]], urgent: list[int]) -> list[int]:
    """The indices of ``urgent`` (ascending) whose source sent no tensor data before them in ``batch``."""
    keep: list[int] = []
    sending: set[Address] = set()  # sources with tensor data so far
    marks = iter(urgent)
    mark = next(marks)
    for i, (data, source, _) in enumerate(batch):
        if i == mark:
            if source not in sending:
                keep.append(i)
            mark = next(marks, -1)
            if mark < 0:
                break
        elif len(data) > 3 and data[3] > m.CONTROL_MAX and data[:3] == _HEAD:  # (PD, version, a data type)
            sending.add(source)
    return keep


def _yes() -> bool:
    return True


class Endpoint:
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
        rotate_after: int = ROTATE_AFTER,
        rng: random.Random | None = None,
        core: TransportCore | None = None,
    ) -> None:
        """``rng`` draws sealing tokens, request ids and jitter (default: os entropy; a seeded one only for tests
        and simulations, since two processes that draw the same token under one swarm key reuse AEAD nonces).
        ``loss``/``loss_seed``: fault injection, by a ``LossySocket`` wrapped around ``sock``."""
        self.rng = default_token_rng(rng)
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
        self._token_state = self.opener.token_state  # bound once: the junk path's per-datagram calls
        self._may_derive = self.core.auth_limiter.may_derive
        self._handlers: dict[int, RequestHandler] = {}
        self._raw: dict[int, RawHandler] = {}
        self._raw_block: dict[int, BlockHandler] = {}
        self._events: dict[int, trio.Event] = {}  # rid of an open request -> what its caller waits on
        self._bind_hooks: list[Callable[[int, bytes], None]] = []
        # the tokens an overloaded receive pass never sheds (the averaging host's running groups' members)
        self.protected_tokens: Callable[[], dict[int, None]] | None = None
        # When the last receive pass that emptied the socket began: everything that arrived before then is handled.
        self._caught_up_at = -math.inf
        self._type_names = {t.value: t.name.lower() for t in m.MsgType}
        self._handler_errors = 0
        # Counted in plain ints while a batch is handled, and handed to Prometheus once per batch (an inc with
        # labels costs about a microsecond, as much as refusing the datagram).
        self._drops: dict[str, int] = {}
        self._received: dict[int, int] = {}  # message type -> datagrams accepted
        self._drop_counters: dict[str, Any] = {}
        self._received_counters: dict[int, Any] = {}
        # per control message type: datagrams_sent's and rpc_seconds' children (a ``labels`` lookup costs about a
        # microsecond, twice per request and once per answer)
        self._sent_counters: dict[int, Any] = {}
        self._rpc_timers: dict[int, Any] = {}
        self._outbox: list[tuple[Any, ...]] = []  # answers and validations a batch produced, sent after it
        self._junk = 0  # datagrams of the current pass refused unopened or failing to open (see receive_pause)
        self._answers = 0  # answers to this node's requests in the current pass
        self._data_blocks = 0  # blocks (or single datagrams) of tensor data opened in the current pass
        # NAT traversal (peerd/nat): who hears about sends and answers, and where a peer's datagrams go
        self.nat: NatHooks | None = None
        self.traffic: TrafficHooks | None = None  # per-peer accounting (peerd/peers): told of every datagram moved
        self._relayed: dict[Address, tuple[bytes, bytes, Address]] = {}  # addr -> (peer id, relay id, relay addr)
        self._punched: set[Address] = set()
        self._relayed_src: bytes | None = None  # while a relayed datagram is handled: the sender its relay named
        self._relayed_ok = False
        self._alias: dict[Address, Address] = {}  # an address a peer is known at -> where it answers (NAT mapping)
        self.path_counts: dict[str, list[int]] = {k: [0, 0] for k in PATH_KINDS}  # kind -> [datagrams, bytes]
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
        if self._alias:
            addr = self._alias.get(addr, addr)
        seal = self.data_sealer(receiver).seal
        datagrams = [seal(mtype, b, receiver) for b in bodies]
        if self._relayed and addr in self._relayed:
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
        self._count_path(addr, len(datagrams), nbytes, mtype)

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
        if self._alias:
            addr = self._alias.get(addr, addr)
        if self._relayed and addr in self._relayed:
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
        self._count_path(addr, rows, datagrams.size)
        return datagrams.size

    async def _send_datagram(self, addr: Address, mtype: int, datagram: bytes) -> None:
        if self._alias:
            addr = self._alias.get(addr, addr)
        if self._relayed and addr in self._relayed:
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
        self._count_path(addr, 1, len(datagram), mtype)
        if self.nat is not None:
            self.nat.sent(addr, trio.current_time())

    # -- NAT traversal: paths ---------------------------------------------------------------------
    def _count_path(self, addr: Address, datagrams: int, nbytes: int, mtype: int = 0x40) -> None:
        if self.traffic is not None:
            self.traffic.sent(addr, mtype, nbytes, None)
        kind = "punched" if self._punched and addr in self._punched else "direct"
        counts = self.path_counts[kind]
        counts[0] += datagrams
        counts[1] += nbytes

    def set_relay(self, addr: Address, peer_id: bytes, relay_id: bytes, relay: Address) -> None:
        """From now on, what this node sends to ``addr`` (the node ``peer_id``) goes through ``relay``, wrapped
        in RELAYs, still sealed for ``peer_id`` (PROTOCOL.md 18.4)."""
        if addr == relay:
            raise ValueError("a peer cannot be its own relay")
        self._relayed[addr] = (peer_id, relay_id, relay)
        self._punched.discard(addr)
        self.core.learn(addr, peer_id)

    def clear_relay(self, addr: Address) -> None:
        self._relayed.pop(addr, None)

    def set_alias(self, addr: Address, to: Address) -> None:
        """Send what goes to ``addr`` to ``to`` instead: the same node answers there (a symmetric NAT maps it to
        another port for each peer, so the address it published works only for some). At most 4096."""
        if addr == to:
            self._alias.pop(addr, None)
            return
        if addr not in self._alias and len(self._alias) >= MAX_KNOWN_IDS:
            self._alias.pop(next(iter(self._alias)))
        self._alias[addr] = to

    def alias_of(self, addr: Address) -> Address:
        return self._alias.get(addr, addr) if self._alias else addr

    def relay_of(self, addr: Address) -> tuple[bytes, bytes, Address] | None:
        return self._relayed.get(addr)

    def set_punched(self, addr: Address) -> None:
        """``addr`` was reached by hole punching (counted as such in ``path_counts``)."""
        self._punched.add(addr)
        self._relayed.pop(addr, None)

    async def _send_relayed(self, addr: Address, datagrams: list[bytes]) -> int:
        """Wrap each (sealed) datagram for ``addr`` in a RELAY to its relay. Control messages to a relayed address
        are trimmed so their RELAY fits the MTU; a tensor datagram (cut to the MTU, and to one payload size for
        the whole group) may make a RELAY of up to MTU + RELAY_OVERHEAD bytes (PROTOCOL.md 18.4); past that it is
        not sent (``relay_too_big``)."""
        peer_id, relay_id, relay = self._relayed[addr]
        sent = 0
        for inner in datagrams:
            if len(inner) > self.mtu:
                self._drop("relay_too_big")
                continue
            outer = self._relay_datagram(relay, relay_id, peer_id, inner)
            try:
                await self.sock.sendto(outer, relay)
            except OSError as e:
                self.metrics.datagrams_dropped.labels("send_error").inc()
                raise RpcError(f"cannot send to relay {relay[0]}:{relay[1]}: {e.strerror or e}") from None
            sent += len(outer)
            counts = self.path_counts["relayed"]
            counts[0] += 1
            counts[1] += len(inner)
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
            self._drop("relay_too_big")
            return
        await self._send_datagram(addr, m.MsgType.RELAYED, datagram)

    def receive_relayed(self, data: bytes, source: Address, src: bytes) -> bool:
        """A datagram a relay passed on (RELAYED ``data`` from ``src``), handled as if it came from ``source``: the
        address this node uses for its sender, so answers go back through the relay. It is handled only if it
        opens under a token bound to ``src`` (else dropped, ``identity``): a relay cannot speak for another node.
        Returns whether it was. Called from a handler, so what it produces is sent when the receive loop flushes."""
        self._relayed_src, self._relayed_ok = src, False
        try:
            self._datagram(data, source, trio.current_time())
        finally:
            self._relayed_src = None
        return self._relayed_ok

    async def _send_control(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes | None
    ) -> None:
        """``receiver``: the node id at ``addr``; None only for a PING (sealed for no receiver)."""
        await self._send_datagram(addr, mtype, self._control_datagram(addr, mtype, rid, fields, receiver))

    def _control_datagram(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes | None
    ) -> bytes:
        sealer, frm = self._control_sealer()
        budget = self.max_body - (m.RELAY_OVERHEAD if addr in self._relayed else 0)
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
        (The schedule is the core's: ``TransportCore.step``.)

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
            rid = core.open_request(addr, int(m.REQUESTS[mtype]), start, timeout=timeout, attempts=attempts)
        except PendingFull as e:
            self.metrics.rpc_failures.labels(name).inc()
            raise RpcError(f"not sending {name} to {addr[0]}:{addr[1]}: {e}") from None
        event = self._events[rid] = trio.Event()
        sealed_by: Sealer | None = None
        transmits = 0
        told = False  # the NAT service heard that this peer is silent
        try:
            while True:
                step = core.step(rid, trio.current_time())
                if isinstance(step, Transmit):
                    sealed_by = self.rotation.next
                    transmits += 1
                    now = trio.current_time()
                    if (not told and transmits >= 2 and now - start >= NAT_SILENT_S and self.nat is not None
                            and receiver is not None):
                        told = True
                        self.nat.silent(addr, receiver, now)  # maybe a NAT: punch, or relay
                    await self._send_control(addr, mtype, rid, fields, receiver)
                elif isinstance(step, WaitUntil):
                    with trio.move_on_at(step.at):
                        await event.wait()
                elif isinstance(step, Answered):
                    reply: Incoming = step.reply
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
                    raise RpcTimeout(f"no answer to {name} from {addr[0]}:{addr[1]} within {step.waited:.2f} s")
        finally:
            core.close(rid)
            del self._events[rid]

    # -- receiving ------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        pause = Pause()  # junk moderation's pauses (a timerfd: see transport.pause)
        try:
            await self._serve(pause)
        finally:
            pause.close()

    async def _serve(self, pause_timer: Pause) -> None:
        sock = self.sock
        if self.caps.block_receive:
            receive = sock.recv_blocks  # type: ignore[attr-defined]
            limit = RECV_DATAGRAMS
        else:
            receive, limit = None, 64
        # The native receive pass screens junk before Python sees it (see _receive_screened): sealed endpoints only,
        # with the opener's table of known tokens (re-read every pass: the screen must never use a stale one).
        screening = self._sealed and receive is not None and getattr(sock, "screens", False)
        screen: tuple | None = None
        trickles = 0  # trickle passes in a row (COALESCE_S)
        while True:
            screened = 0
            if screening:
                tokens = getattr(self.opener, "_tokens", None)
                if not isinstance(tokens, dict):
                    screening = False
                    continue
                if screen is None or screen[-1] is not tokens:
                    screen = (MAGIC + bytes([VERSION]), KNOWN_FLAGS, FLAG_NO_RECEIVER, PING_TYPE, FLAG_SEALED,
                              HEADER_SIZE + TAG_SIZE, tokens)
                # the pass's junk under unknown tokens is rationed in C where the limiter is the C table, at the
                # time the pass began (``now``: the rest of the pass is decided at it too)
                # an overloaded pass sheds the excess of the sources that fill the kernel queue, max-min fairly, PINGs
                # and PONGs kept (``shed``: see UdpSocket's OVERLOAD_FRACTION)
                protected = self.protected_tokens() if self.protected_tokens is not None else None
                batch, unknown, malformed, version, nbytes, limited, rationed, now, shed = await sock.recv_screened(
                    limit, screen, self.core.auth_limiter, shedding=True,  # type: ignore[attr-defined]
                    protected=protected)
                if shed:
                    self._drops["overload"] = self._drops.get("overload", 0) + shed
                self._junk = 0
                self._answers = 0
                screened = self._receive_screened(unknown, malformed, version, nbytes, now, limited, rationed)
            else:
                if receive is not None:
                    batch = await receive(limit)
                else:
                    batch = [(data, source, 0) for data, source in await sock.recv_batch(limit)]
                self._junk = 0
                now = trio.current_time()
                self._answers = 0
            batch, datagrams = self._receive_urgent(batch, now)
            datagrams += screened
            if self._outbox or self._answers:  # PONGs go out, and requests that waited on one go on, first
                await self.flush()
                await trio.lowlevel.checkpoint()
            datagrams += self._receive_rest(batch, now)
            await self.flush()
            backlog = not sock.drained if self.caps.drained_flag else datagrams >= limit  # type: ignore[attr-defined]
            if not backlog:
                self._caught_up_at = now
            honest = max(0, datagrams - self._junk)
            pause = self.core.receive_pause(trio.current_time(), self._junk, backlog, honest)
            trickle = self._data_blocks and not backlog and datagrams < COALESCE_BELOW
            self._data_blocks = 0
            trickles = trickles + 1 if trickle else 0
            if pause > 0:
                await pause_timer.wait(pause)
            elif trickle:  # tensor data a few datagrams at a time: let more of it queue
                await pause_timer.wait(COALESCE_S if trickles > 1 else COALESCE_FIRST_S)
            else:  # a busy socket always has data: yield so senders and timers are not starved
                await trio.lowlevel.checkpoint()

    def receive_backlog(self) -> int:
        """Bytes the kernel holds for this endpoint's socket (0 where the socket cannot say): a task that runs long
        without waiting yields once this reaches about one receive pass, before the socket's buffer fills."""
        queued = getattr(self.sock, "queued", None)
        return 0 if queued is None else queued()

    def caught_up(self, at: float) -> bool:
        """Whatever reached this socket before ``at`` has been handled: a receive pass that began at or after it
        emptied the socket, or the socket is empty now. A phase deadline waits for this (AllreduceService): on a
        node starved of CPU by a flood, data that came in time can sit in the queue past the deadline, and ending
        the phase then lost it as ``late`` (an honest round of `bench soak` at 90-97 % received)."""
        if self._caught_up_at >= at:
            return True
        queued = getattr(self.sock, "queued", None)
        return queued is None or queued() == 0

    def receive_batch(self, batch: list[tuple[Any, Address, int]], now: float) -> int:
        """Handle one receive's datagrams and GRO blocks (data, source, segment) without awaiting: what to
        send in answer waits in the outbox for ``flush``. Small PINGs and PONGs go first (``serve`` sends
        their answers before it handles the rest). Returns the datagrams handled."""
        rest, urgent = self._receive_urgent(batch, now)
        return urgent + self._receive_rest(rest, now)

    def _receive_urgent(self, batch: list[tuple[Any, Address, int]], now: float) -> tuple[list, int]:
        """Handle the batch's small PINGs and PONGs, so that a member's liveness check and this node's own
        requests do not queue behind a batch of junk or tensor data; returns the rest of the batch and how
        many were handled.

        One that came after tensor data from its own source keeps its place: its sealer numbered it after that
        data, and a pass can hold tens of thousands of one member's datagrams (its sequence numbers shared with
        its other destinations), so opening it first would move the replay window past data that then reads as
        replayed (`peerd bench allreduce --peers 4 --size 25000000`: received_fraction). That member's data shows
        it alive."""
        if len(batch) < 2:
            return batch, 0
        urgent = [i for i, (data, _, segment) in enumerate(batch)
                  if not segment and 3 < len(data) <= URGENT_BYTES and data[3] in (_PING, _PONG)]
        if not urgent:
            return batch, 0
        if urgent[-1] >= len(urgent):  # something came before one of them: not after its own source's data?
            urgent = _before_own_data(batch, urgent)
            if not urgent:
                return batch, 0
        nbytes = 0
        for i in urgent:
            data, source, _ = batch[i]
            nbytes += len(data)
            self._datagram(data, source, now)
        self.metrics.bytes_received.inc(nbytes)
        skip = set(urgent)
        return [item for i, item in enumerate(batch) if i not in skip], len(urgent)

    def _receive_screened(self, unknown: list[tuple[Any, Address]], malformed: int, version: int, nbytes: int,
                          now: float, limited: int = 0, rationed: bool = False) -> int:
        """What the native receive pass screened out of a pass (UdpSocket.recv_screened): ``malformed`` and
        ``version`` datagrams refused by their header (as ``peek`` would), and sealed single datagrams under tokens
        this node did not know (``unknown``), which go through the rationing of ``_datagram``. A source gets one
        key derivation a pass, and once refused one it stays refused for the rest of the pass (``now`` is the same
        and the limiter's buckets only empty within a pass), so the rest of a flood from it costs a set lookup
        each. Once a key was derived in the pass, a later datagram whose token is known by then is opened.
        Returns the datagrams handled.

        ``rationed``: the native pass did that rationing itself, in C with the limiter's table (dataplane.c
        recv_batch, the same decisions): ``limited`` datagrams were refused there (``auth_limited``), the first of
        ``unknown`` has its derivation granted, and the rest are decided as above."""
        drops = self._drops
        if malformed:
            drops["malformed"] = drops.get("malformed", 0) + malformed
        if version:
            drops["version"] = drops.get("version", 0) + version
        # After a derivation in the pass (granted in C for the first when ``rationed``), a later datagram's token
        # may be known: it is opened. The others under an unknown token are asked may_derive once per source, and
        # a source gets one derivation a pass: the rest of the pass's flood from it costs a set lookup each.
        refusing: set[Address] = set()  # sources refused a derivation in this pass before any was granted
        granted: set[Address] = set()  # sources granted one
        may_derive = self._may_derive
        token_state = self._token_state
        refused = 0
        for data, source in unknown:
            nbytes += len(data)
            if rationed and not granted:
                granted.add(source)
                self._open(data, source, now, data[3], _yes)
            elif source in refusing:
                refused += 1
            elif granted and token_state(_TOKEN.unpack_from(data, 5)[0]) is not None:
                self._open(data, source, now, data[3], None)
            elif source in granted:
                refused += 1
            elif may_derive(source, now):
                granted.add(source)
                self._open(data, source, now, data[3], _yes)
            else:
                if not granted:  # (after a derivation, a later datagram of its may have a token known by then)
                    refusing.add(source)
                refused += 1
        if refused:
            drops["auth_limited"] = drops.get("auth_limited", 0) + refused
        refused += limited if rationed else 0
        if limited and rationed:
            drops["auth_limited"] = drops.get("auth_limited", 0) + limited
        self._junk += malformed + version + refused
        if nbytes:
            self.metrics.bytes_received.inc(nbytes)
        return malformed + version + len(unknown) + (limited if rationed else 0)

    def _receive_rest(self, batch: list[tuple[Any, Address, int]], now: float) -> int:
        nbytes = datagrams = 0
        for data, source, segment in batch:
            nbytes += len(data)
            if segment:
                datagrams += -(-len(data) // segment)
                self._block(data, source, segment, now)
            else:
                datagrams += 1
                self._datagram(data, source, now)
        self.metrics.bytes_received.inc(nbytes)
        return datagrams

    async def flush(self) -> None:
        """Send what the handled datagrams produced (answers, held answers of validated addresses), then hand
        the batch's counts to Prometheus."""
        while self._outbox:
            outbox, self._outbox = self._outbox, []
            for item in outbox:
                try:
                    if item[0] == "answer":
                        await self._answer(*item[1:])
                    else:
                        await self._validated(item[1])
                except RpcError as e:
                    log.debug("response to %s: %s", item[1], e)
        self._flush_counts()

    def _flush_counts(self) -> None:
        if self._drops:
            counters = self._drop_counters
            for reason, n in self._drops.items():
                counter = counters.get(reason)
                if counter is None:
                    counter = counters[reason] = self.metrics.datagrams_dropped.labels(reason)
                counter.inc(n)
            self._drops.clear()
        if self._received:
            counters = self._received_counters
            for mtype, n in self._received.items():
                counter = counters.get(mtype)
                if counter is None:
                    name = self._type_names.get(mtype, "data") if mtype <= m.CONTROL_MAX else "data"
                    counter = counters[mtype] = self.metrics.datagrams_received.labels(name)
                counter.inc(n)
            self._received.clear()

    def _drop(self, reason: str, n: int = 1) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + n

    def _refuse(self, reason: str) -> None:
        """A datagram refused before or at opening (junk: what paces the receive loop under a flood)."""
        drops = self._drops
        drops[reason] = drops.get(reason, 0) + 1
        self._junk += 1

    def _count_received(self, mtype: int, n: int = 1) -> None:
        key = mtype if mtype <= m.CONTROL_MAX else 0x40  # every data type is counted as "data"
        self._received[key] = self._received.get(key, 0) + n

    async def handle_block(self, data: bytes, source: Address, segment: int) -> None:
        """What one GRO receive coalesced (see ``_block``), handled and flushed at once."""
        self.metrics.bytes_received.inc(len(data))
        self._block(data, source, segment, trio.current_time())
        await self.flush()

    def _block(self, data: Any, source: Address, segment: int, now: float) -> None:
        """What one GRO receive coalesced: datagrams of ``segment`` bytes (the last may be shorter). A block
        of one known sender's tensor data is opened and handed over whole; anything else goes datagram
        by datagram."""
        rows = len(data) // segment
        tail = data[rows * segment :]
        if rows > 1 and self._refuse_rows(data, rows, segment, source, now):
            if tail:
                self._datagram(tail, source, now)
            return
        block = np.frombuffer(data, dtype=np.uint8, count=rows * segment).reshape(rows, segment)
        handler = self._raw_block.get(int(block[0, 3])) if len(block) > 1 else None
        # In place: the bodies are opened over their own ciphertext in the receive arena (one pass and one buffer
        # less per block). Every block handler copies what it keeps (the allreduce host: into its stage or result,
        # or bytes per body), and the arena is reused by the next receive anyway.
        opened = self.opener.open_block(block, in_place=True) if handler is not None else None
        if opened is None:
            for row in block:
                self._datagram(row.tobytes(), source, now)
        else:
            if opened.replays:
                self._drop("replay", opened.replays)
            if opened.auth_failures:
                self._drop("auth", opened.auth_failures)
                self.core.auth_limiter.failed(source, now, opened.auth_failures)
            if len(opened.bodies):
                self._data_blocks += 1
                self._count_received(opened.type, len(opened.bodies))
                if self.traffic is not None:
                    self.traffic.received(source, opened.state.peer_id, opened.type, len(opened.bodies) * segment,
                                          self._relayed_src is not None, now)
                try:
                    handler(opened.type, opened.token, opened.state, opened.bodies, source)  # type: ignore[misc]
                except WireError as e:
                    self._drop(e.reason, len(opened.bodies))
                except Exception:
                    self._handler_failed(opened.type, len(opened.bodies))
        if tail:
            self._datagram(tail, source, now)

    def _refuse_rows(self, data: Any, rows: int, segment: int, source: Address, now: float) -> bool:
        """Refuse a block's ``rows`` together where ``_datagram`` would refuse each of them unopened for the same
        reason: every row has the first row's header up to its token (SEQ_OFFSET: a merged run of junk, such as
        one forger's datagrams under a token this node has no key for), and that header is bad, or it is sealed
        under an unknown token and its source may not derive a key now. One decision instead of a round of
        ``_datagram`` (about 5 us) per row; tensor data under a known token costs a peek. Returns whether it did."""
        head = peek(data[:segment])
        if head.__class__ is str:
            reason = head
        else:
            _, flags, token = head  # type: ignore[misc]
            if not self._sealed or not flags & FLAG_SEALED or self._token_state(token) is not None:
                return False
            if segment < HEADER_SIZE + TAG_SIZE:
                reason = "malformed"
            elif not self._may_derive(source, now):
                reason = "auth_limited"
            else:
                return False
        if segment < SEQ_OFFSET:
            return False
        first = data[:SEQ_OFFSET]
        for k in range(segment, rows * segment, segment):
            if data[k : k + SEQ_OFFSET] != first:
                return False
        self._drops[reason] = self._drops.get(reason, 0) + rows  # type: ignore[index]
        self._junk += rows
        return True

    async def handle_datagram(
        self, data: bytes, source: Address, *, counted: bool = False, inject: bool = True
    ) -> None:
        """Handle one datagram and send what it asks for. ``counted``: the caller counted its bytes.
        (``inject`` is kept for callers of the old signature: fault injection is the socket's now.)"""
        if not counted:
            self.metrics.bytes_received.inc(len(data))
        self._datagram(data, source, trio.current_time())
        await self.flush()

    def _datagram(self, data: Any, source: Address, now: float) -> None:
        """One datagram, without awaiting. Junk is sorted out before any object is built for it: a bad header,
        and a datagram under a token this node has no key for once its source or this node is out of
        authentication failures (``auth_limited``: no key derivation, no AEAD)."""
        head = peek(data)
        if head.__class__ is str:
            self._refuse(head)  # type: ignore[arg-type]
            return
        mtype, flags, token = head  # type: ignore[misc]
        may_derive = None
        if self._sealed and self._token_state(token) is None:
            if not flags & FLAG_SEALED:
                self._refuse("auth")
                self.core.auth_limiter.failed(source, now)
                return
            if len(data) < HEADER_SIZE + TAG_SIZE:
                self._refuse("malformed")
                return
            if not self._may_derive(source, now):
                self._refuse("auth_limited")
                return
            may_derive = _yes  # charged just now
        self._open(data, source, now, mtype, may_derive)

    def _open(self, data: Any, source: Address, now: float, mtype: int, may_derive: Callable[[], bool] | None) -> None:
        """Open and handle a datagram whose header ``_datagram`` (or the native screen) passed."""
        try:
            header, body, state = self.opener.open(data, may_derive)
        except WireError as e:
            if e.reason == "auth":
                self.core.auth_limiter.failed(source, now)
            self._refuse(e.reason)
            return
        except Exception:  # a bug the input reached must not end the receive loop (and with it the daemon)
            self._handler_failed(mtype)
            return
        if mtype > m.CONTROL_MAX:
            raw = self._raw.get(mtype)
            if raw is None:
                self._drop("type")
                return
            if self._relayed_src is not None:
                if state.peer_id != self._relayed_src:
                    self._drop("identity")
                    return
                self._relayed_ok = True
            self._count_received(mtype)
            if self.traffic is not None:
                self.traffic.received(source, state.peer_id, mtype, len(data), self._relayed_src is not None, now)
            self._data_blocks += 1
            try:
                raw(header, body, state, source)
            except WireError as e:
                self._drop(e.reason)
            except Exception:  # a handler's bug must not end the receive loop (and with it the daemon)
                self._handler_failed(mtype)
            return
        try:
            incoming = self._incoming(header, body, state, source)
        except WireError as e:
            self._drop(e.reason)
            log.debug("drop from %s: %s", source, e)
            return
        except Exception:
            self._handler_failed(mtype)
            return
        if self._relayed_src is not None:
            if incoming.peer.node_id != self._relayed_src:
                self._drop("identity")
                return
            incoming.relayed = self._relayed_ok = True
        self.core.guard.received(source, len(data))
        self._count_received(mtype)
        if self.traffic is not None:
            self.traffic.received(source, incoming.peer.node_id, mtype, len(data), incoming.relayed, now,
                                  incoming.body)
        rid = incoming.body["rid"]
        route = self.core.route(mtype, rid, source, incoming, now)
        if route is Route.ANSWER:
            self._events[rid].set()
            self._answers += 1
            return
        if route is Route.VALIDATION:
            self._outbox.append(("validated", source))
            return
        if route is Route.DUPLICATE:
            return
        if route is Route.UNEXPECTED:
            self._drop("unexpected")
            return
        response_type = self.core.response_type(mtype)
        handler = self._handlers[mtype]
        if self.nat is not None and not incoming.relayed:
            self.nat.heard(source, incoming.peer.node_id, now)  # a punch's PING from the other side comes here
        try:
            fields = handler(incoming)
            if response_type == mtype:  # one-way message
                return
        except WireError as e:  # semantically bad request: tell the sender why
            self._drop(e.reason)
            fields, response_type = {"code": e.reason, "detail": e.detail[:200]}, int(m.MsgType.ERROR)
        except Exception:
            self._handler_failed(mtype)
            return
        if fields is None:
            return
        self._outbox.append(("answer", source, m.MsgType(response_type), rid, fields, incoming.peer.node_id))

    def _handler_failed(self, mtype: int, count: int = 1) -> None:
        """A handler raised something other than WireError (a bug a peer's input reached): drop the input,
        count it (``datagrams_dropped{reason="handler_error"}``, ``background_errors{task="endpoint_<type>"}``)
        and keep serving. The first few are logged with their traceback."""
        name = self._type_names.get(mtype, f"type_{mtype:#04x}")
        self._drop("handler_error", count)
        self.metrics.background_errors.labels(f"endpoint_{name}").inc()
        self._handler_errors += 1
        if self._handler_errors <= 10:
            log.exception("the handler for %s failed; input dropped", name)

    def _incoming(self, header: Header, body: bytes, state: TokenState, source: Address) -> Incoming:
        mtype = m.msg_type(header.type)
        fields = m.decode(mtype, body)
        sender = fields["from"]
        pk = sender["pk"]
        if state.peer_key is None:
            verify_token_binding(pk, header.token, sender["sig"])
            state.peer_key, state.peer_id = pk, node_id_of(pk)
            for hook in self._bind_hooks:
                hook(header.token, pk)
        elif state.peer_key != pk:
            raise WireError("identity", "token is bound to another public key")
        if pk == self.identity.public_key:
            raise WireError("self", "datagram from this node's own identity")
        if sender["addr"] is not None:
            host, port = sender["addr"]
            why = self.unreachable(host)
            if why:  # (the decoder already refused unusable addresses: this is the other family)
                raise WireError("address", f"the sender announces {host}, which is {why}")
        else:
            host, port = source
        peer = Peer(state.peer_id or node_id_of(pk), pk, host, port)
        if not header.to_anyone:  # sealed for this node by a member: the sender is at ``source``
            self.learn(source, peer.node_id)
        return Incoming(mtype, fields, peer, source)


def retry_delays(first: float, cap: float, rng: random.Random | None = None) -> Callable[[int], float]:
    """Exponential backoff with jitter, for loops that retry whole operations (bootstrap). ``rng``: the jitter's
    source (default: os entropy)."""
    jitter = default_rng(rng)

    def delay(attempt: int) -> float:
        base = min(cap, first * math.pow(2, attempt))
        return base * (0.5 + jitter.randrange(1000) / 2000)

    return delay
