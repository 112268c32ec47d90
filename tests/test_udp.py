"""The batched UDP socket on real loopback: GSO sends and GRO receives keep every datagram intact."""

from __future__ import annotations

import socket

import pytest
import trio

from peerd.transport.udp import UdpSocket


def _pair(gso: bool) -> tuple[UdpSocket, UdpSocket]:
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    return UdpSocket(a, gso=gso, buffer_bytes=4 << 20), UdpSocket(b, gso=gso, buffer_bytes=4 << 20)


@pytest.mark.parametrize("gso", [True, False])
def test_batches_arrive_whole_and_in_order(gso: bool) -> None:
    async def main() -> None:
        tx, rx = _pair(gso)
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
