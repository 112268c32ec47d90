"""The batched UDP socket on real loopback: GSO sends and GRO receives keep every datagram intact."""

from __future__ import annotations

import socket

import pytest
import trio

from peerd.transport.udp import NATIVE_RECV, UdpSocket

from .support.sockets import merge_prefix

# The receive pass in C (dataplane.c recv_batch) where the extension has it, and the Python loop (the reference):
# every receive test runs on both.
RECEIVE_PATHS = [pytest.param(False, id="python"), pytest.param(True, id="native", marks=pytest.mark.skipif(
    NATIVE_RECV is None, reason="the native extension (recv_batch) is not built"))]


@pytest.fixture(params=RECEIVE_PATHS)
def native_receive(request: pytest.FixtureRequest) -> bool:
    return request.param


def _pair(gso: bool, native_receive: bool | None = None) -> tuple[UdpSocket, UdpSocket]:
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    rx = UdpSocket(b, gso=gso, buffer_bytes=4 << 20, native_receive=native_receive)
    return UdpSocket(a, gso=gso, buffer_bytes=4 << 20), rx


@pytest.mark.parametrize("gso", [True, False])
def test_batches_arrive_whole_and_in_order(gso: bool, native_receive: bool) -> None:
    async def main() -> None:
        tx, rx = _pair(gso, native_receive)
        try:
            sizes = [1200] * 150 + [333] + [900] * 10 + [17]
            datagrams = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
            await tx.send_many(datagrams, rx.getsockname())
            got: list[bytes] = []
            with trio.fail_after(10):
                while len(got) < len(datagrams):
                    batch = await rx.recv_batch(64)
                    assert {src for _, src in batch} == {tx.getsockname()}
                    got += [bytes(d) for d, _ in batch]
            assert got == datagrams
            stats = tx.statistics()
            assert stats.datagrams_sent == len(datagrams)
            if gso and stats.gso:
                assert stats.send_calls < len(datagrams) // 10  # many datagrams per syscall
            else:
                assert stats.send_calls == len(datagrams)
            assert rx.statistics().kernel_drops == 0
        finally:
            tx.close()
            rx.close()

    trio.run(main)


def test_receive_buffer_is_large() -> None:
    tx, rx = _pair(True)
    try:
        assert rx.statistics().rcvbuf >= 1 << 20
    finally:
        tx.close()
        rx.close()


def test_receives_merge_into_blocks_of_one_stream_only(native_receive: bool) -> None:
    """Consecutive receives from one source whose datagrams have one size and start alike become one block;
    a different type, token, size or source starts a new one, and so does a datagram after a short one."""
    async def main() -> None:
        tx, rx = _pair(True, native_receive)
        other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        other.bind(("127.0.0.1", 0))
        try:
            a, b = merge_prefix(0x40, 1), merge_prefix(0x41, 1)
            plan = [a + bytes([i]) * 987 for i in range(100)]  # one stream: 100 x 1000 bytes
            plan += [b + bytes([i]) * 987 for i in range(10)]  # another type
            plan += [merge_prefix(0x41, 2) + bytes(987)] * 3  # another token
            plan += [b + bytes(108)]  # a short datagram of the second stream: a block of its own
            plan += [b + bytes(987)] * 2  # after a short one: a new block
            for d in plan:
                await tx.sendto(d, rx.getsockname())
            other.sendto(a + bytes(987), rx.getsockname())  # same bytes, another source
            got: list[tuple[bytes, tuple, int]] = []
            with trio.fail_after(10):
                while sum(len(d) for d, _, _ in got) < sum(map(len, plan)) + 1000:
                    got += [(bytes(d), src, seg) for d, src, seg in await rx.recv_blocks(4096)]
            me, them = tx.getsockname(), other.getsockname()
            assert [(len(d), src, seg) for d, src, seg in got] == [
                (100_000, me, 1000), (10_000, me, 1000), (3000, me, 1000), (121, me, 0), (2000, me, 1000),
                (1000, them, 0),
            ]
            assert b"".join(d for d, src, _ in got if src == me) == b"".join(plan)
            st = rx.statistics()
            assert st.datagrams_received == len(plan) + 1 and st.receive_passes >= 1
        finally:
            other.close()
            tx.close()
            rx.close()

    trio.run(main)


def test_arena_must_hold_one_receive() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(ValueError, match="arena_bytes"):
            UdpSocket(s, arena_bytes=1000)
    finally:
        s.close()


@pytest.mark.parametrize("gso", [True, False])
def test_capabilities_are_declared_once_at_creation(gso: bool) -> None:
    tx, rx = _pair(gso)
    try:
        caps = rx.caps
        assert caps.block_receive and caps.block_send  # what the endpoint may call on it
        assert caps.rcvbuf == rx.statistics().rcvbuf and caps.sndbuf == rx.statistics().sndbuf
        assert caps.gso == rx.gso and caps.gro == rx.gro
        if not gso:
            assert not caps.gso and not caps.gro and caps.gso_segments == 1
        elif caps.gso:
            assert caps.gso_segments > 1
            caps.lose_gso()  # what a path that refuses GSO does: the socket and its readers see it at once
            assert not rx.gso and rx.caps.gso_segments == 1
    finally:
        tx.close()
        rx.close()


def test_a_receive_pass_counts_calls_and_datagrams(native_receive: bool) -> None:
    """Many single datagrams in one pass (the flood path: one loop, no call per datagram but the syscall)."""
    async def main() -> None:
        tx, rx = _pair(False, native_receive)
        try:
            datagrams = [bytes([i]) * (10 + i) for i in range(200)]  # sizes differ: nothing merges
            for d in datagrams:
                await tx.sendto(d, rx.getsockname())
            got: list[bytes] = []
            with trio.fail_after(10):
                while len(got) < len(datagrams):
                    got += [bytes(d) for d, _, seg in await rx.recv_blocks(1024)]
            assert got == datagrams
            st = rx.statistics()
            assert st.receive_calls == st.datagrams_received == len(datagrams)
            assert st.receive_passes <= 3  # sent before the first pass: taken together
        finally:
            tx.close()
            rx.close()

    trio.run(main)


def test_drained_says_whether_a_pass_emptied_the_socket(native_receive: bool) -> None:
    """The receive loop pauses under a junk flood only after a pass that emptied the socket: a pass that stopped
    at its datagram limit (or its arena) leaves a backlog, taken at once."""
    async def main() -> None:
        tx, rx = _pair(False, native_receive)
        try:
            assert rx.caps.drained_flag
            for i in range(30):
                await tx.sendto(bytes([i]) * (20 + i), rx.getsockname())
            await trio.sleep(0.05)
            first = await rx.recv_blocks(10)
            assert len(first) == 10 and not rx.drained
            rest = await rx.recv_blocks(1024)
            assert len(rest) == 20 and rx.drained
        finally:
            tx.close()
            rx.close()

    trio.run(main)


def test_an_endpoint_is_caught_up_once_a_pass_has_emptied_its_socket() -> None:
    """``Endpoint.caught_up(at)``: what a phase deadline waits for (AllreduceService). Datagrams queued before
    ``at`` and not handled yet: not caught up; once the receive loop has emptied the socket after ``at``, or the
    socket is empty: caught up."""
    from peerd.metrics import Metrics
    from peerd.transport.endpoint import Endpoint
    from peerd.wire.identity import Identity

    async def main() -> None:
        tx, rx = _pair(False)
        ep = Endpoint(rx, Identity.generate(), b"s" * 32, Metrics())
        try:
            await tx.send_many([b"junk" * 10] * 50, rx.getsockname())
            await trio.sleep(0.01)
            at = trio.current_time()
            assert rx.queued() > 0 and not ep.caught_up(at)
            async with trio.open_nursery() as nursery:
                await nursery.start(ep.serve)
                await trio.sleep(0.05)  # the loop handles the junk and empties the socket
                assert ep.caught_up(at)
                assert ep.core.receiving.caught_up_at >= at  # (by a pass, not only by the empty queue)
                nursery.cancel_scope.cancel()
        finally:
            tx.close()
            rx.close()

    trio.run(main)


def test_an_endpoint_holding_a_pass_it_has_not_handled_is_not_caught_up() -> None:
    """A pass reads the socket empty, then awaits (sending its PINGs' answers) before it handles the rest: a phase
    deadline's wait that looked then saw an empty socket and ended the phase, and the data of the pass in hand came
    late (`peerd bench soak`: an honest round inexact, 11 datagrams dropped as ``late`` at one member). Until the
    loop has handled its pass, the endpoint is not caught up to a time before it."""
    from peerd.metrics import Metrics
    from peerd.transport.endpoint import Endpoint
    from peerd.wire.identity import Identity

    async def main() -> None:
        tx, rx = _pair(False)
        ep = Endpoint(rx, Identity.generate(), b"s" * 32, Metrics())
        seen: list[tuple[int, bool]] = []
        rest = ep._receive_rest

        def look_then_handle(batch: list, now: float) -> int:
            seen.append((rx.queued(), ep.caught_up(at)))
            return rest(batch, now)

        ep._receive_rest = look_then_handle  # type: ignore[method-assign]
        try:
            await tx.send_many([b"junk" * 10] * 50, rx.getsockname())
            await trio.sleep(0.01)
            at = trio.current_time()
            async with trio.open_nursery() as nursery:
                await nursery.start(ep.serve)
                await trio.sleep(0.05)
                assert seen and seen[0] == (0, False)  # the socket read empty, the pass not handled yet
                assert ep.caught_up(at)  # once it is
                nursery.cancel_scope.cancel()
        finally:
            tx.close()
            rx.close()

    trio.run(main)
