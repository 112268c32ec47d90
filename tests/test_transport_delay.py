"""The propagation delay wrapper (peerd.transport.delay): what a socket receives comes back ``delay`` later, in
order, intact, the receives due by then merged into one, and the arrival times REPORTs carry move with them."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from peerd.transport.caps import SocketCaps
from peerd.transport.delay import DelaySocket
from peerd.transport.udp import UdpSocket

A = ("10.0.0.1", 7000)
B = ("10.0.0.2", 7000)


class ScriptedSocket:
    """Receives at set times (virtual), each laid out in one arena that the next receive overwrites (as
    UdpSocket's is), with the kernel's arrival time of each source's data in ``arrivals``."""

    family = 2
    caps = SocketCaps(gro=True, block_receive=True)

    def __init__(self, script: list[tuple[float, list[tuple[bytes, tuple[str, int], int]]]]) -> None:
        self.script = list(script)
        self.arena = bytearray(4096)
        self.arrivals: dict[tuple[str, int], float] = {}

    async def recv_blocks(self, max_datagrams: int = 64) -> list[tuple[memoryview, tuple[str, int], int]]:
        if not self.script:
            await trio.sleep_forever()
        at, blocks = self.script[0]
        await trio.sleep_until(at)
        self.script.pop(0)
        out, used = [], 0
        for data, source, segment in blocks:
            self.arena[used : used + len(data)] = data
            out.append((memoryview(self.arena)[used : used + len(data)], source, segment))
            used += len(data)
            self.arrivals[source] = 1000.0 + at  # (unix seconds in the real one)
        return out

    async def recv_screened(self, max_datagrams: int, screen: tuple, limiter: object = None, *,
                            shedding: bool = False, protected: dict | None = None) -> tuple:
        blocks = await self.recv_blocks(max_datagrams)
        return (blocks, [(b"unknown", B)], 1, 2, 30, 0, False, trio.current_time(), 0)


def run(main, *args):  # noqa: ANN001, ANN202 - a test's trio.run in virtual time
    return trio.run(main, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def test_receives_come_back_a_delay_later_in_order_and_intact() -> None:
    script = [(0.0, [(b"a" * 10, A, 0)]), (0.004, [(b"b" * 20, A, 10), (b"c" * 5, B, 0)]), (0.05, [(b"d" * 7, A, 0)])]
    sock = DelaySocket(ScriptedSocket(script), 0.02)
    assert sock.caps.block_receive and sock.caps.gro  # declares what it wraps

    async def main() -> list[tuple[float, list[tuple[bytes, tuple[str, int], int]]]]:
        got = []
        for _ in range(3):
            blocks = await sock.recv_blocks(64)
            got.append((trio.current_time(), [(bytes(d), s, seg) for d, s, seg in blocks]))
        return got

    got = run(main)
    assert [round(t, 6) for t, _ in got] == [0.02, 0.024, 0.07]
    assert [b for _, b in got] == [[(b"a" * 10, A, 0)], [(b"b" * 20, A, 10), (b"c" * 5, B, 0)], [(b"d" * 7, A, 0)]]


def test_what_fell_due_while_the_endpoint_was_busy_comes_back_as_one_receive() -> None:
    """An endpoint that handles a pass slower than receives come must not fall behind the delay: the receives due
    by its next call come back merged, in order."""
    script = [(0.001 * i, [(bytes([i]) * 4, A, 0)]) for i in range(10)]
    sock = DelaySocket(ScriptedSocket(script), 0.02)

    async def main() -> list[tuple[float, list[bytes]]]:
        got = []
        while sum(len(b) for _, b in got) < 10:
            blocks = await sock.recv_blocks(64)
            got.append((trio.current_time(), [bytes(d) for d, _, _ in blocks]))
            await trio.sleep(0.004)  # the endpoint's work on the pass
        return got

    got = run(main)
    assert [bytes([i]) * 4 for i in range(10)] == [d for _, b in got for d in b]
    assert len(got) < 10 and all(len(b) <= 5 for _, b in got)
    for t, blocks in got:  # nothing before its time: the first of each pass arrived at least the delay before
        first = blocks[0][0]
        assert t >= 0.001 * first + 0.02 - 1e-9


def test_arrival_times_move_with_the_receive_that_brought_them() -> None:
    inner = ScriptedSocket([(0.0, [(b"x", A, 0)]), (0.01, [(b"y", A, 0), (b"z", B, 0)])])
    sock = DelaySocket(inner, 0.05)

    async def main() -> list[dict]:
        seen = []
        for _ in range(2):
            await sock.recv_blocks(64)
            seen.append(dict(sock.arrivals))
            assert inner.arrivals[A] == 1000.01  # the wrapped socket has long seen the second receive
        return seen

    first, second = run(main)
    assert first == {A: pytest.approx(1000.05)}  # the first receive's, not the held second's
    assert second == {A: pytest.approx(1000.06), B: pytest.approx(1000.06)}


def test_a_screened_receive_keeps_its_counts_and_is_dated_when_given_back() -> None:
    sock = DelaySocket(ScriptedSocket([(0.0, [(b"p", A, 0)]), (0.001, [(b"q", A, 0)])]), 0.01)

    async def main() -> tuple:
        await trio.sleep(0.02)  # both are due at the first call: one pass
        return await sock.recv_screened(64, ()), trio.current_time()

    (blocks, unknown, malformed, version, nbytes, limited, rationed, now, shed), t = run(main)
    assert [bytes(d) for d, _, _ in blocks] == [b"p", b"q"]
    assert unknown == [(b"unknown", B)] * 2
    assert (malformed, version, nbytes, limited, rationed, shed) == (2, 4, 60, 0, False, 0)
    assert now == t


def test_delay_out_of_range_is_refused() -> None:
    for bad in (0.0, -0.01, 1.5):
        with pytest.raises(ValueError, match="delay must be in"):
            DelaySocket(ScriptedSocket([]), bad)


def test_a_real_socket_receives_a_delay_later() -> None:
    """On loopback, through UdpSocket's receive pass: every datagram, in order, none before the delay."""
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    tx, rx = UdpSocket(a, gso=False), UdpSocket(b, gso=False)
    delayed = DelaySocket(rx, 0.05)

    async def main() -> None:
        datagrams = [bytes([i]) * 100 for i in range(40)]
        start = trio.current_time()
        await tx.send_many(datagrams, rx.getsockname())
        got: list[bytes] = []
        with trio.fail_after(10):
            while len(got) < len(datagrams):
                for data, _, segment in await delayed.recv_blocks(64):
                    size = segment or len(data)
                    got += [bytes(data[i : i + size]) for i in range(0, len(data), size)]
                assert trio.current_time() - start >= 0.05
        assert got == datagrams

    try:
        trio.run(main)
    finally:
        tx.close()
        rx.close()
