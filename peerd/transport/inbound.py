"""The receive half of the endpoint shell: takes passes off the socket and carries out the receive policy's
decisions (transport/receive.py: what to refuse unopened, what goes first, the pause after a pass), and tends
the core's timer (a request sent again or expired) beside it.

A pass is sorted without awaiting: junk (a bad header, an unknown token past its ration) is refused before
anything is built for it and counted in plain ints, PINGs and PONGs go before the rest of a batch, and the answers
a batch produced are sent after it; counters reach Prometheus once per pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from ..wire import messages as m
from ..wire.envelope import (
    FLAG_NO_RECEIVER,
    FLAG_SEALED,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    PING_TYPE,
    VERSION,
    Header,
    peek,
)
from ..wire.errors import WireError
from ..wire.identity import node_id_of, verify_token_binding
from ..wire.seal import TAG_SIZE, TokenState
from .core import Action, AddressValidated, Deliver, RequestAction
from .pause import Pause
from .receive import DERIVE, OPEN, REFUSE, PassDecision, rows_share_head
from .rpc import Address, Incoming, Peer, RpcError

log = logging.getLogger("peerd.transport")

RECV_DATAGRAMS = 1024  # per receive pass (the socket's arena caps it near 1 MB: ~1 ms of opening when sealed)
CATCH_UP_CHECK_S = 0.02  # wait_caught_up looks again this often even when no receive pass ends


def _yes() -> bool:
    return True


@dataclass(slots=True)
class RequestWaiter:
    """What one open request's caller waits on: the core's actions for it, in order, and the event that wakes it."""

    event: trio.Event = field(default_factory=trio.Event)
    actions: list[RequestAction] = field(default_factory=list)


class Inbound:
    """The Endpoint's receiving methods (a base class of Endpoint, which holds the state they use)."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The receive loop, and beside it the core's timer (``_tend_timer``), until cancelled."""
        pause = Pause()  # the pauses between passes (a timerfd: see transport.pause)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._tend_timer)
                self._tending = True
                task_status.started()
                await self._serve(pause)
        finally:
            self._tending = False
            self._in_hand = False
            pause.close()

    async def _tend_timer(self) -> None:
        """Sleep until the core's ``get_timer()``, call ``handle_timer`` and carry out what it queued (requests
        sent again or expired). A request opened with an earlier wait than the one slept on wakes it
        (``_timer_moved``)."""
        core = self.core
        while True:
            at = core.get_timer()
            self._timer_at = math.inf if at is None else at
            self._timer_moved = trio.Event()
            with trio.move_on_at(self._timer_at):
                await self._timer_moved.wait()
            now = trio.current_time()
            core.handle_timer(now)
            self.carry_out(core.take_actions(), now)

    def _timer_changed(self) -> None:
        """The core may need its timer sooner than the tender sleeps: wake it to read ``get_timer`` again."""
        at = self.core.get_timer()
        if at is not None and at < self._timer_at:
            self._timer_moved.set()

    async def _wait_for(self, waiter: RequestWaiter) -> None:
        """Wait for the core's next action for one request. With no ``serve`` loop tending the timer, the caller
        tends it itself until then."""
        waiter.event = trio.Event()
        if self._tending:
            await waiter.event.wait()
            return
        at = self.core.get_timer()
        with trio.move_on_at(math.inf if at is None else at):
            await waiter.event.wait()
        now = trio.current_time()
        self.core.handle_timer(now)
        self.carry_out(self.core.take_actions(), now)

    def carry_out(self, actions: list[Action], now: float) -> None:
        """What the core asked for, without awaiting: a request's action goes to its caller (who sends, or
        returns the answer, or raises), a validated address's held answers and a handler's answer to the outbox,
        a pass's decision to the receive loop (``_pause_s``)."""
        for action in actions:
            if isinstance(action, Deliver):
                self._deliver(action.message, action.mtype, action.rid, action.source, now)
            elif isinstance(action, PassDecision):  # the receive loop waits this long before its next pass
                self._pause_s, self._pause_why = action.pause, action.why
            elif isinstance(action, AddressValidated):
                self._outbox.append(("validated", action.addr))
            else:
                waiter = self._requests.get(action.rid)
                if waiter is not None:  # (None: its caller left; the core forgets it at close)
                    waiter.actions.append(action)
                    waiter.event.set()

    async def _serve(self, pause_timer: Pause) -> None:
        sock, policy = self.sock, self.core.receiving
        if self.caps.block_receive:
            receive, limit = sock.recv_blocks, RECV_DATAGRAMS
        else:
            receive, limit = None, 64
        # The native receive pass screens junk before Python sees it (see _receive_screened): sealed endpoints only,
        # with the opener's table of known tokens (re-read every pass: the screen must never use a stale one).
        screening = self._sealed and receive is not None and getattr(sock, "screens", False)
        screen: tuple | None = None
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
                # time the pass began (``now``: the rest of the pass is decided at it too); an overloaded pass sheds
                # the excess of the sources that fill the kernel queue, max-min fairly, PINGs and PONGs kept
                protected = (self.protected_tokens(trio.current_time()) if self.protected_tokens is not None
                             else None)
                batch, unknown, malformed, version, nbytes, limited, rationed, now, shed = await sock.recv_screened(
                    limit, screen, self.core.auth_limiter, shedding=True, protected=protected)
                self._in_hand = True
                if shed:
                    policy.dropped("overload", shed)
                policy.start_pass()
                screened = self._receive_screened(unknown, malformed, version, nbytes, now, limited, rationed)
            else:
                if receive is not None:
                    batch = await receive(limit)
                else:
                    batch = [(data, source, 0) for data, source in await sock.recv_batch(limit)]
                self._in_hand = True
                policy.start_pass()
                now = trio.current_time()
            batch, datagrams = self._receive_urgent(batch, now)
            datagrams += screened
            if self._outbox or policy.answers:  # PONGs go out, and requests that waited on one go on, first
                await self.flush()
                await trio.lowlevel.checkpoint()
            datagrams += self._receive_rest(batch, now)
            await self.flush()
            backlog = not sock.drained if self.caps.drained_flag else datagrams >= limit
            end = trio.current_time()
            self.core.receive_pass(datagrams, backlog, now, end)
            self._in_hand = False
            self._pass_ended.set()
            self._pass_ended = trio.Event()
            self.carry_out(self.core.take_actions(), end)  # the pass's PassDecision sets _pause_s
            pause, self._pause_s = self._pause_s, 0.0
            if pause > 0 and self._pause_why == "trickle" and self.reads_now is not None and self.reads_now():
                pause = 0.0
            if pause > 0:
                await pause_timer.wait(pause)
                end = trio.current_time()
                self.core.handle_timer(end)
                self.carry_out(self.core.take_actions(), end)
            else:
                await trio.lowlevel.checkpoint()

    def receive_backlog(self) -> int:
        """Bytes the kernel holds for this endpoint's socket (0 where the socket cannot say): a task that runs long
        without waiting yields once this reaches about one receive pass, before the socket's buffer fills."""
        queued = getattr(self.sock, "queued", None)
        return 0 if queued is None else queued()

    def caught_up(self, at: float) -> bool:
        """Whatever reached this socket before ``at`` has been handled: a receive pass that began at or after it
        emptied the socket, or the socket is empty now and the receive loop holds no pass it has read and not
        handled yet (it awaits between a pass's PINGs and the rest: a pass that emptied the socket may still hold
        data that came in time). A phase deadline waits for this (AllreduceService): on a node starved of CPU by a
        flood, data that came in time can sit in the queue past the deadline, and ending the phase then lost it as
        ``late``."""
        if self.core.receiving.caught_up_at >= at:
            return True
        if self._in_hand:
            return False
        queued = getattr(self.sock, "queued", None)
        return queued is None or queued() == 0

    async def wait_caught_up(self, at: float, give_up: float) -> None:
        """Until ``caught_up(at)``, or ``give_up`` (trio time): it is checked as each receive pass ends, and every
        CATCH_UP_CHECK_S besides (a socket emptied by another reader)."""
        while not self.caught_up(at) and (now := trio.current_time()) < give_up:
            with trio.move_on_at(min(give_up, now + CATCH_UP_CHECK_S)):
                await self._pass_ended.wait()

    def receive_batch(self, batch: list[tuple[Any, Address, int]], now: float) -> int:
        """Handle one receive's datagrams and GRO blocks (data, source, segment) without awaiting: what to
        send in answer waits in the outbox for ``flush``. Small PINGs and PONGs go first (``serve`` sends
        their answers before it handles the rest). Returns the datagrams handled."""
        rest, urgent = self._receive_urgent(batch, now)
        return urgent + self._receive_rest(rest, now)

    def _receive_urgent(self, batch: list[tuple[Any, Address, int]], now: float) -> tuple[list, int]:
        """Handle what the policy puts first (ReceivePolicy.urgent); returns the rest of the batch and how many
        were handled."""
        urgent = self.core.receiving.urgent(batch)
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
        this node did not know (``unknown``), decided by the pass's ration (ReceivePolicy.ration). ``rationed``:
        the native pass rationed in C with the limiter's table (the same decisions): ``limited`` datagrams were
        refused there (``auth_limited``), and the first of ``unknown`` has its derivation granted.
        Returns the datagrams handled."""
        policy = self.core.receiving
        if malformed:
            policy.refused("malformed", malformed)
        if version:
            policy.refused("version", version)
        token_state = self._token_state
        ration = policy.ration(lambda token: token_state(token) is not None, rationed)
        refused = 0
        for data, source in unknown:
            nbytes += len(data)
            verdict = ration.decide(data, source, now)
            if verdict is REFUSE:
                refused += 1
            else:
                self._open(data, source, now, data[3], _yes if verdict is DERIVE else None)
        if refused:
            policy.refused("auth_limited", refused)
        if limited and rationed:
            policy.refused("auth_limited", limited)
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
        the pass's counts to Prometheus."""
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
        drops, received = self.core.receiving.take_counts()
        counters = self._drop_counters
        for reason, n in drops.items():
            counter = counters.get(reason)
            if counter is None:
                counter = counters[reason] = self.metrics.datagrams_dropped.labels(reason)
            counter.inc(n)
        counters = self._received_counters
        for mtype, n in received.items():
            counter = counters.get(mtype)
            if counter is None:
                name = self._type_names.get(mtype, "data") if mtype <= m.CONTROL_MAX else "data"
                counter = counters[mtype] = self.metrics.datagrams_received.labels(name)
            counter.inc(n)

    def _drop(self, reason: str, n: int = 1) -> None:
        self.core.receiving.dropped(reason, n)

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
            policy = self.core.receiving
            if opened.replays:
                policy.dropped("replay", opened.replays)
            if opened.auth_failures:
                policy.dropped("auth", opened.auth_failures)
                self.core.auth_limiter.failed(source, opened.auth_failures, now)
            if len(opened.bodies):
                policy.data_blocks += 1
                policy.accepted(opened.type, source, len(opened.bodies) * segment, len(opened.bodies))
                if self.traffic is not None:
                    self.traffic.received(source, opened.state.peer_id, opened.type, len(opened.bodies) * segment,
                                          self._relayed_src is not None, now)
                try:
                    handler(opened.type, opened.token, opened.state, opened.bodies, source)  # type: ignore[misc]
                except WireError as e:
                    policy.dropped(e.reason, len(opened.bodies))
                except Exception:
                    self._handler_failed(opened.type, len(opened.bodies))
        if tail:
            self._datagram(tail, source, now)

    def _refuse_rows(self, data: Any, rows: int, segment: int, source: Address, now: float) -> bool:
        """Refuse a block's ``rows`` together where ``_datagram`` would refuse each of them unopened for the same
        reason (ReceivePolicy.screen_rows: one decision instead of a round of ``_datagram``, about 5 us, per row;
        tensor data under a known token costs a peek). Returns whether it did."""
        head = peek(data[:segment])
        if head.__class__ is str:
            reason = head
        else:
            _, flags, token = head  # type: ignore[misc]
            reason = self.core.receiving.screen_rows(flags, self._token_state(token) is not None, segment, source,
                                                     now)
            if reason is None:
                return False
        if not rows_share_head(data, rows, segment):
            return False
        self.core.receiving.refused(reason, rows)  # type: ignore[arg-type]
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
        """One datagram, without awaiting. Junk is sorted out before any object is built for it (see
        ReceivePolicy.screen)."""
        head = peek(data)
        if head.__class__ is str:
            self.core.receiving.refused(head)  # type: ignore[arg-type]
            return
        mtype, flags, token = head  # type: ignore[misc]
        known = not self._sealed or self._token_state(token) is not None
        verdict = self._screen(flags, known, len(data), source, now)
        if verdict is OPEN:
            self._open(data, source, now, mtype, None)
        elif verdict is DERIVE:
            self._open(data, source, now, mtype, _yes)  # charged just now
        else:
            self.core.receiving.refused(verdict)

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

    def _open(self, data: Any, source: Address, now: float, mtype: int, may_derive: Callable[[], bool] | None) -> None:
        """Open and handle a datagram whose header ``_datagram`` (or the native screen) passed."""
        policy = self.core.receiving
        try:
            header, body, state = self.opener.open(data, may_derive)
        except WireError as e:
            if e.reason == "auth":
                self.core.auth_limiter.failed(source, 1, now)
            policy.refused(e.reason)
            return
        except Exception:  # a bug the input reached must not end the receive loop (and with it the daemon)
            self._handler_failed(mtype)
            return
        if mtype > m.CONTROL_MAX:
            self._open_data(data, source, mtype, header, body, state, now)
            return
        try:
            incoming = self._incoming(header, body, state, source)
        except WireError as e:
            policy.dropped(e.reason)
            log.debug("drop from %s: %s", source, e)
            return
        except Exception:
            self._handler_failed(mtype)
            return
        if self._relayed_src is not None:
            if incoming.peer.node_id != self._relayed_src:
                policy.dropped("identity")
                return
            incoming.relayed = self._relayed_ok = True
        self.core.guard.received(source, len(data))
        policy.accepted(mtype, source, len(data))
        if self.traffic is not None:
            self.traffic.received(source, incoming.peer.node_id, mtype, len(data), incoming.relayed, now,
                                  incoming.body)
        self._route(incoming, mtype, source, now)

    def _open_data(self, data: Any, source: Address, mtype: int, header: Header, body: bytes,
                   state: TokenState, now: float) -> None:
        """An opened datagram of tensor data: to its raw handler."""
        policy = self.core.receiving
        raw = self._raw.get(mtype)
        if raw is None:
            policy.dropped("type")
            return
        if self._relayed_src is not None:
            if state.peer_id != self._relayed_src:
                policy.dropped("identity")
                return
            self._relayed_ok = True
        policy.accepted(mtype, source, len(data))
        if self.traffic is not None:
            self.traffic.received(source, state.peer_id, mtype, len(data), self._relayed_src is not None, now)
        policy.data_blocks += 1
        try:
            raw(header, body, state, source)
        except WireError as e:
            policy.dropped(e.reason)
        except Exception:  # a handler's bug must not end the receive loop (and with it the daemon)
            self._handler_failed(mtype)

    def _route(self, incoming: Incoming, mtype: int, source: Address, now: float) -> None:
        """An authenticated control message: what the core asks for it (wake a request, send what was held for a
        validated address, run a handler)."""
        core = self.core
        core.receive_message(mtype, incoming.body["rid"], source, incoming, now)
        self.carry_out(core.take_actions(), now)

    def _deliver(self, incoming: Incoming, mtype: int, rid: int, source: Address, now: float) -> None:
        """A message for its registered handler; the handler's answer (or the ERROR it raised) goes to the outbox."""
        policy = self.core.receiving
        response_type = self.core.response_type(mtype)
        handler = self._handlers[mtype]
        if self.nat is not None and not incoming.relayed:
            self.nat.heard(source, incoming.peer.node_id, now)  # a punch's PING from the other side comes here
        try:
            fields = handler(incoming)
            if response_type == mtype:  # one-way message
                return
        except WireError as e:  # semantically bad request: tell the sender why
            policy.dropped(e.reason)
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
        self.core.receiving.dropped("handler_error", count)
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
