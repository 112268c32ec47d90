"""One UDP socket per daemon: seal/open every datagram, match responses to requests, demultiplex.

Handlers for control requests are plain functions (they run to completion without awaiting), so a
request is answered straight from the receive loop. Tensor data (types 0x40..0x7F) goes to raw
handlers that get the opened body and the sender's token state, never msgpack.

Sending never raises anything but RpcError: a send the kernel refuses (no route, a broadcast address) or a
body this node must not send (one its peers would drop) is an RpcError the caller handles, like a timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import random
import secrets
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from ..metrics import Metrics
from ..wire import messages as m
from ..wire.envelope import Header
from ..wire.errors import WireError
from ..wire.identity import Identity, node_id_of, verify_token_binding
from ..wire.seal import Opener, Sealer, TokenState
from .guard import AmplificationGuard, AuthLimiter
from .rto import RtoEstimator

log = logging.getLogger("peerd.transport")

Address = tuple[str, int]
DEFAULT_MTU = 1200
RECV_DATAGRAMS = 1024  # per receive pass (the socket's arena caps it near 1 MB: ~1 ms of opening when sealed)
MAX_KNOWN_IDS = 4096  # addresses whose node id this endpoint remembers (LRU), to seal for their receiver
MAX_HELD_ADDRESSES = 256  # unvalidated addresses with answers held until their address validation completes
MAX_HELD_PER_ADDRESS = 4
# A sealer is replaced after this many datagrams (PROTOCOL.md 4.2: AES-GCM's confidentiality bound). The next one
# is drawn at 3/4 of it and seals control messages at once (each carries its signed binding); data to a receiver
# moves to it once a request sealed with it was answered by that receiver (which bound it), and all data moves
# when the two together have sealed ROTATE_AFTER.
ROTATE_AFTER = 2**28


class DatagramSocket(Protocol):
    """What the endpoint needs of a socket: transport.udp.UdpSocket, or an in-memory one in tests."""

    family: int

    async def sendto(self, data: bytes, address: Address, /) -> None: ...
    async def send_many(self, datagrams: list[bytes], address: Address, /) -> None: ...
    async def recv_batch(self, max_datagrams: int = 64, /) -> list[tuple[bytes, Address]]: ...
    def close(self) -> None: ...


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


RequestHandler = Callable[[Incoming], dict[str, Any] | None]
RawHandler = Callable[[Header, bytes, TokenState, Address], None]
# (type, token, token state, bodies: (rows, body bytes) uint8, source): a GRO block of tensor data, opened.
BlockHandler = Callable[[int, int, TokenState, np.ndarray, Address], None]


class _Pending:
    __slots__ = ("expect", "event", "reply")

    def __init__(self, expect: m.MsgType) -> None:
        self.expect = expect
        self.event = trio.Event()
        self.reply: Incoming | None = None


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
    ) -> None:
        self.sock = sock
        self.family = getattr(sock, "family", None)
        if announce is not None:
            why = self.unreachable(announce[0])
            if why or not 1 <= announce[1] <= 65535:
                raise ValueError(f"cannot announce {announce[0]}:{announce[1]}: {why or 'port 0'}; announce the "
                                 f"address and port peers reach this node at")
        self.identity = identity
        self.metrics = metrics
        self.mtu = mtu
        if rotate_after < 4:
            raise ValueError(f"rotate_after must be >= 4 datagrams, got {rotate_after}")
        self._secret = swarm_secret
        self.sealer = Sealer(swarm_secret)  # seals data (and control while no rotation is under way)
        self.rotate_after = rotate_after
        self.rotations = 0
        self._next: Sealer | None = None  # the sealer being rotated in: control now, data once bound
        self._next_from: dict[str, Any] = {}
        self._next_bound: set[bytes] = set()  # receivers that answered a request sealed by ``_next``
        self.opener = Opener(swarm_secret, identity.node_id)
        # address -> node id of the node there, learned from datagrams sealed for this node (an outsider cannot
        # make one) and from callers that know it (DHT contacts): every datagram is sealed for its receiver.
        self._ids: OrderedDict[Address, bytes] = OrderedDict()
        self._from = {
            "pk": identity.public_key,
            "sig": identity.sign_token(self.sealer.token),
            "addr": m.pack_addr(*announce) if announce else None,
        }
        self._handlers: dict[m.MsgType, tuple[m.MsgType, RequestHandler]] = {}
        self._raw: dict[int, RawHandler] = {}
        self._raw_block: dict[int, BlockHandler] = {}
        self._pending: dict[int, _Pending] = {}
        self._bind_hooks: list[Callable[[int, bytes], None]] = []
        self._type_names = {t.value: t.name.lower() for t in m.MsgType}
        self._data_received = metrics.datagrams_received.labels("data")  # bound once: hot path
        self._data_count = 0  # data datagrams in the receive batch being handled
        # Fault injection for benchmarks and tests: drop received datagrams with probability ``loss``.
        self._loss = loss
        self._loss_rng = random.Random(loss_seed)
        self._loss_np = np.random.default_rng(loss_seed)
        self.rto = RtoEstimator()  # learned retransmission timeouts per destination, for request()
        self._handler_errors = 0
        # Outsiders: forged datagrams under unknown tokens are rationed before any crypto (auth_limited), and an
        # address that has not proven it receives what this node sends gets at most 3x its bytes in answers.
        self.auth_limiter = AuthLimiter()
        self.guard = AmplificationGuard()
        # answers over budget, sealed only when sent (a held datagram could fall behind receivers' replay windows)
        self._held: OrderedDict[Address, list[tuple[m.MsgType, int, dict[str, Any], bytes]]] = OrderedDict()
        self._challenges: OrderedDict[int, Address] = OrderedDict()  # rid of a validating PING -> its address
        self.on_request(m.MsgType.PING, lambda incoming: {})  # the DHT replaces it; a PING is always answered

    # -- registration -------------------------------------------------------------------------
    def on_request(self, mtype: m.MsgType, handler: RequestHandler) -> None:
        """``handler`` returns the response fields (without rid/from), or None to stay silent."""
        self._handlers[mtype] = (m.REQUESTS[mtype], handler)

    def on_message(self, mtype: m.MsgType, handler: RequestHandler) -> None:
        """A one-way control message: ``handler`` runs, nothing is sent back."""
        self._handlers[mtype] = (mtype, handler)

    async def notify(
        self, addr: Address, mtype: m.MsgType, fields: dict[str, Any], *, node_id: bytes | None = None
    ) -> None:
        """Send a one-way control message (no response, no retry) to the node ``node_id`` (default: the one
        this endpoint knows at ``addr``; RpcError if none)."""
        await self._send_control(addr, mtype, secrets.randbits(64), fields, node_id or self.node_id_at(addr))

    # -- receivers' node ids ----------------------------------------------------------------------
    def learn(self, addr: Address, node_id: bytes) -> None:
        """Remember that the node ``node_id`` is at ``addr`` (what this endpoint seals datagrams to it for)."""
        ids = self._ids
        ids[addr] = node_id
        ids.move_to_end(addr)
        while len(ids) > MAX_KNOWN_IDS:
            ids.popitem(last=False)

    def node_id_at(self, addr: Address) -> bytes | None:
        return self._ids.get(addr)

    def _receiver(self, addr: Address, node_id: bytes | None) -> bytes:
        receiver = node_id or self._ids.get(addr)
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

    # -- token rotation -------------------------------------------------------------------------
    def _rotate(self) -> None:
        """Start a rotation at 3/4 of ``rotate_after`` datagrams, finish it at ``rotate_after``."""
        old = self.sealer
        if self._next is None:
            if old.sent >= self.rotate_after * 3 // 4:
                self._next = Sealer(self._secret)
                self._next_from = {**self._from, "sig": self.identity.sign_token(self._next.token)}
                self._next_bound = set()
        elif old.sent + self._next.sent >= self.rotate_after:
            self.sealer, self._from = self._next, self._next_from
            self._next, self._next_bound = None, set()
            self.rotations += 1
            log.info("sealing token rotated (%d datagrams): %016x", self.rotate_after, self.sealer.token)

    def data_sealer(self, receiver: bytes) -> Sealer:
        """The sealer for tensor data to ``receiver``: the next one only once the receiver has bound it."""
        self._rotate()
        if self._next is not None and receiver in self._next_bound:
            return self._next
        return self.sealer

    def _control_sealer(self) -> tuple[Sealer, dict[str, Any]]:
        """Control messages carry their token's binding, so they use the next sealer as soon as there is one."""
        self._rotate()
        if self._next is not None:
            return self._next, self._next_from
        return self.sealer, self._from

    async def send_raw(
        self, addr: Address, mtype: int, bodies: list[bytes], *, node_id: bytes | None = None
    ) -> None:
        """Seal and send tensor-data bodies to one destination (batched: GSO where available)."""
        receiver = self._receiver(addr, node_id)
        seal = self.data_sealer(receiver).seal
        datagrams = [seal(mtype, b, receiver) for b in bodies]
        try:
            await self.sock.send_many(datagrams, addr)
        except OSError as e:
            self.metrics.datagrams_dropped.labels("send_error").inc(len(datagrams))
            raise RpcError(f"cannot send to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
        self.metrics.datagrams_sent.labels("data").inc(len(datagrams))
        self.metrics.bytes_sent.inc(sum(map(len, datagrams)))

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
        try:
            send_block = getattr(self.sock, "send_block", None)
            if send_block is not None:
                await send_block(datagrams, addr)
            else:
                await self.sock.send_many([row.tobytes() for row in datagrams], addr)
        except OSError as e:
            self.metrics.datagrams_dropped.labels("send_error").inc(rows)
            raise RpcError(f"cannot send to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
        self.metrics.datagrams_sent.labels("data").inc(rows)
        self.metrics.bytes_sent.inc(datagrams.size)
        return datagrams.size

    async def _send_datagram(self, addr: Address, mtype: int, datagram: bytes) -> None:
        try:
            await self.sock.sendto(datagram, addr)
        except OSError as e:
            self.metrics.datagrams_dropped.labels("send_error").inc()
            raise RpcError(f"cannot send to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
        self.metrics.datagrams_sent.labels(self._type_names.get(mtype, "data")).inc()
        self.metrics.bytes_sent.inc(len(datagram))

    async def _send_control(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes | None
    ) -> None:
        """``receiver``: the node id at ``addr``; None only for a PING (sealed for no receiver)."""
        await self._send_datagram(addr, mtype, self._control_datagram(addr, mtype, rid, fields, receiver))

    def _control_datagram(
        self, addr: Address, mtype: m.MsgType, rid: int, fields: dict[str, Any], receiver: bytes | None
    ) -> bytes:
        sealer, frm = self._control_sealer()
        try:
            body = m.encode_fitting(mtype, {"rid": rid, "from": frm, **fields}, self.max_body)
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
        if self.guard.is_validated(addr):
            await self._send_control(addr, mtype, rid, fields, receiver)
            return
        datagram = self._control_datagram(addr, mtype, rid, fields, receiver)
        if self.guard.may_send(addr, len(datagram)):
            await self._send_datagram(addr, mtype, datagram)
            return
        self.metrics.datagrams_dropped.labels("unvalidated").inc()
        held = self._held.get(addr)
        if held is None:
            held = self._held[addr] = []
            while len(self._held) > MAX_HELD_ADDRESSES:
                self._held.popitem(last=False)
        if len(held) < MAX_HELD_PER_ADDRESS:
            held.append((mtype, rid, fields, receiver))
        challenge = secrets.randbits(64)
        ping = self._control_datagram(addr, m.MsgType.PING, challenge, {}, receiver)
        if not self.guard.may_send(addr, len(ping)):
            return
        self._challenges[challenge] = addr
        while len(self._challenges) > MAX_HELD_ADDRESSES:
            self._challenges.popitem(last=False)
        await self._send_datagram(addr, m.MsgType.PING, ping)

    async def _validated(self, addr: Address) -> None:
        """``addr`` answered this node's PING: no budget any more; send what was held for it."""
        self.guard.validate(addr)
        for mtype, rid, fields, receiver in self._held.pop(addr, ()):
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

        The request is sealed for ``node_id`` (default: the node this endpoint knows at ``addr``). A PING to
        an address whose node is unknown is sealed for no receiver; any other request first PINGs such an
        address to learn who is there (one more round trip, once).
        """
        if not timeout > 0 or attempts < 1:
            raise ValueError(f"request needs timeout > 0 and attempts >= 1, got {timeout!r}, {attempts!r}")
        receiver = node_id or self._ids.get(addr)
        if receiver is None and mtype is not m.MsgType.PING:
            receiver = (await self.request(addr, m.MsgType.PING, {}, timeout=timeout, attempts=attempts)).peer.node_id
        rid = secrets.randbits(64)
        pending = self._pending[rid] = _Pending(m.REQUESTS[mtype])
        start = trio.current_time()
        deadline = start + timeout * (2**attempts - 1)
        name = mtype.name.lower()
        try:
            wait = self.rto.timeout(addr, timeout)
            first = True
            while True:
                sent_at = trio.current_time()
                sealed_by = self._next
                await self._send_control(addr, mtype, rid, fields, receiver)
                with trio.move_on_at(min(deadline, sent_at + wait)):
                    await pending.event.wait()
                if pending.reply is not None:
                    reply = pending.reply
                    if reply.source == addr:  # it read this request's rid: it receives at this address
                        self.guard.validate(addr)
                    if sealed_by is not None and sealed_by is self._next:  # it opened, so bound, the next token
                        self._next_bound.add(reply.peer.node_id)
                    if first:  # Karn's rule: only an unambiguous round trip is a sample
                        self.rto.sample(addr, trio.current_time() - sent_at)
                    if reply.mtype is m.MsgType.ERROR:
                        raise RpcError(f"{addr[0]}:{addr[1]} refused {name}: {reply.body['detail']}")
                    self.metrics.rpc_seconds.labels(name).observe(trio.current_time() - start)
                    return reply
                if first:
                    self.rto.timed_out(addr)
                    first = False
                if trio.current_time() >= deadline:
                    break
                wait *= 2
            self.metrics.rpc_failures.labels(name).inc()
            raise RpcTimeout(f"no answer to {name} from {addr[0]}:{addr[1]} within {deadline - start:.2f} s")
        finally:
            del self._pending[rid]

    # -- receiving ------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        bytes_received = self.metrics.bytes_received
        recv_blocks = getattr(self.sock, "recv_blocks", None)
        while True:
            if recv_blocks is not None:
                batch = await recv_blocks(RECV_DATAGRAMS)
            else:
                batch = [(data, source, 0) for data, source in await self.sock.recv_batch(64)]
            self._data_count = 0
            nbytes = 0
            for data, source, segment in batch:
                nbytes += len(data)
                if segment:
                    await self.handle_block(data, source, segment)
                else:
                    await self.handle_datagram(data, source, counted=True)
            # Counters once per batch, not per datagram (a Prometheus inc costs about a microsecond).
            bytes_received.inc(nbytes)
            if self._data_count:
                self._data_received.inc(self._data_count)
            # A busy socket always has data: yield so senders and timers are not starved.
            await trio.lowlevel.checkpoint()

    async def handle_block(self, data: bytes, source: Address, segment: int) -> None:
        """What one GRO receive coalesced: datagrams of ``segment`` bytes (the last may be shorter). A block
        of one known sender's tensor data is opened and handed over whole; anything else goes datagram
        by datagram. Received bytes are the caller's to count (``serve``)."""
        rows = len(data) // segment
        tail = data[rows * segment :]
        block = np.frombuffer(data, dtype=np.uint8, count=rows * segment).reshape(rows, segment)
        if self._loss:
            keep = self._loss_np.random(rows) >= self._loss
            dropped = rows - int(np.count_nonzero(keep))
            if dropped:
                self.metrics.datagrams_dropped.labels("injected").inc(dropped)
                block = block[keep]
        handler = self._raw_block.get(int(block[0, 3])) if len(block) > 1 else None
        opened = self.opener.open_block(block) if handler is not None else None
        if opened is None:
            for row in block:
                await self.handle_datagram(row.tobytes(), source, counted=True, inject=False)
        else:
            if opened.replays:
                self.metrics.datagrams_dropped.labels("replay").inc(opened.replays)
            if opened.auth_failures:
                self.metrics.datagrams_dropped.labels("auth").inc(opened.auth_failures)
                self.auth_limiter.failed(source, trio.current_time(), opened.auth_failures)
            if len(opened.bodies):
                self._data_count += len(opened.bodies)
                try:
                    handler(opened.type, opened.token, opened.state, opened.bodies, source)  # type: ignore[misc]
                except WireError as e:
                    self.metrics.datagrams_dropped.labels(e.reason).inc(len(opened.bodies))
                except Exception:
                    self._handler_failed(opened.type, len(opened.bodies))
        if tail:
            await self.handle_datagram(tail, source, counted=True)

    async def handle_datagram(
        self, data: bytes, source: Address, *, counted: bool = False, inject: bool = True
    ) -> None:
        """``counted``: the caller (``serve``) counts received bytes and data datagrams for a whole batch.
        ``inject=False``: the fault injector already decided about this datagram (``handle_block``)."""
        if not counted:
            self.metrics.bytes_received.inc(len(data))
        if inject and self._loss and self._loss_rng.random() < self._loss:
            self.metrics.datagrams_dropped.labels("injected").inc()
            return
        try:
            header, body, state = self.opener.open(
                data, lambda: self.auth_limiter.may_derive(source, trio.current_time())
            )
            if header.type > m.CONTROL_MAX:
                raw = self._raw.get(header.type)
                if raw is None:
                    raise WireError("type", f"no handler for data type {header.type:#04x}")
                if counted:
                    self._data_count += 1
                else:
                    self._data_received.inc()
                raw(header, body, state, source)
                return
            incoming = self._incoming(header, body, state, source)
            self.guard.received(source, len(data))
        except WireError as e:
            if e.reason == "auth":
                self.auth_limiter.failed(source, trio.current_time())
            self.metrics.datagrams_dropped.labels(e.reason).inc()
            log.debug("drop from %s: %s", source, e)
            return
        except Exception:  # a handler's bug must not end the receive loop (and with it the daemon)
            self._handler_failed(data[3] if len(data) > 3 else 0)
            return
        self.metrics.datagrams_received.labels(incoming.mtype.name.lower()).inc()
        rid = incoming.body["rid"]
        if incoming.mtype is m.MsgType.PONG and self._challenges.get(rid) == source:
            for challenge in [c for c, a in self._challenges.items() if a == source]:
                del self._challenges[challenge]
            await self._validated(source)
            return
        pending = self._pending.get(rid)
        if pending is not None and incoming.mtype in (pending.expect, m.MsgType.ERROR):
            if pending.reply is None:
                pending.reply = incoming
                pending.event.set()
            return
        entry = self._handlers.get(incoming.mtype)
        if entry is None:
            self.metrics.datagrams_dropped.labels("unexpected").inc()
            return
        response_type, handler = entry
        try:
            fields = handler(incoming)
            if response_type is incoming.mtype:  # one-way message
                return
        except WireError as e:  # semantically bad request: tell the sender why
            self.metrics.datagrams_dropped.labels(e.reason).inc()
            fields, response_type = {"code": e.reason, "detail": e.detail[:200]}, m.MsgType.ERROR
        except Exception:
            self._handler_failed(int(incoming.mtype))
            return
        if fields is None:
            return
        try:
            await self._answer(source, response_type, rid, fields, incoming.peer.node_id)
        except RpcError as e:
            log.debug("response to %s: %s", source, e)

    def _handler_failed(self, mtype: int, count: int = 1) -> None:
        """A handler raised something other than WireError (a bug a peer's input reached): drop the input,
        count it (``datagrams_dropped{reason="handler_error"}``, ``background_errors{task="endpoint_<type>"}``)
        and keep serving. The first few are logged with their traceback."""
        name = self._type_names.get(mtype, f"type_{mtype:#04x}")
        self.metrics.datagrams_dropped.labels("handler_error").inc(count)
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
            state.peer_key = pk
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
        peer = Peer(node_id_of(pk), pk, host, port)
        if not header.to_anyone:  # sealed for this node by a member: the sender is at ``source``
            self.learn(source, peer.node_id)
        return Incoming(mtype, fields, peer, source)


def retry_delays(first: float, cap: float) -> Callable[[int], float]:
    """Exponential backoff with jitter, for loops that retry whole operations (bootstrap)."""

    def delay(attempt: int) -> float:
        base = min(cap, first * math.pow(2, attempt))
        return base * (0.5 + secrets.randbelow(1000) / 2000)

    return delay
