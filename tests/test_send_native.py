"""The C send of a paced part (send.c send_rows) against UdpSocket.send_block's Python loop, the reference: the
same datagrams in the same order on real loopback, a full socket and a path without GSO handled the same way, and
every bound checked. (What it saves shows in ``peerd bench allreduce --profile``: ``send_calls_per_peer`` and
``send_syscall``; PEERD_NATIVE_SEND=0 runs the Python loop for an A/B.)"""

from __future__ import annotations

import errno
import socket
import struct

import numpy as np
import pytest
import trio

from peerd.transport.udp import NATIVE_SEND, UdpSocket
from peerd.wire.native import native

from .support.sockets import bind_loopback  # noqa: E402

pytestmark = pytest.mark.skipif(NATIVE_SEND is None, reason="the native extension (send_rows) is not built")

FAMILIES = [pytest.param(socket.AF_INET, id="ipv4"), pytest.param(socket.AF_INET6, id="ipv6")]


def _receiver(family: int) -> socket.socket:
    """A plain receiver (no GRO: one datagram a recv), big enough to hold a whole test's traffic."""
    rx = bind_loopback(family)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    rx.setblocking(False)
    return rx


def _drain(rx: socket.socket) -> list[bytes]:
    out = []
    try:
        while True:
            out.append(rx.recv(1 << 16))
    except BlockingIOError:
        return out


def _block(rng: np.random.Generator, rows: int, size: int, pad: int) -> np.ndarray:
    """``rows`` datagrams of ``size`` bytes, each row cut out of a wider one when ``pad`` (strides != size)."""
    wide = rng.integers(0, 256, (rows, size + pad), dtype=np.uint8)
    return wide[:, pad // 2 : pad // 2 + size]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("rows", "size", "pad"), [(1, 1200, 0), (2, 1200, 0), (54, 1200, 0), (55, 1200, 0),
                                                   (583, 1200, 0), (300, 1200, 7), (40, 8192, 0), (9, 8192, 3),
                                                   (130, 333, 0), (3000, 21, 5)])
def test_native_and_python_sends_deliver_the_same_datagrams(family: int, rows: int, size: int, pad: int) -> None:
    async def main() -> None:
        rng = np.random.default_rng(rows * size + pad)
        block = _block(rng, rows, size, pad)
        native_tx = UdpSocket(bind_loopback(family), buffer_bytes=8 << 20, native_send=True)
        python_tx = UdpSocket(bind_loopback(family), buffer_bytes=8 << 20, native_send=False)
        rx = _receiver(family)
        try:
            await native_tx.send_block(block, rx.getsockname()[:2])
            assert _drain(rx) == [bytes(r) for r in block]
            assert native_tx.sent == rows
            if not pad:  # (the Python loop sends C-contiguous blocks only, as the sealers make them)
                await python_tx.send_block(block, rx.getsockname()[:2])
                assert _drain(rx) == [bytes(r) for r in block]
                assert python_tx.sent == rows
            if native_tx.gso and rows > 1:  # the GSO messages of a part, many a syscall
                messages = -(-rows // min(64, 65000 // size))
                assert native_tx.send_calls == -(-messages // 32)  # 32 messages a sendmmsg
                if not pad:
                    assert python_tx.send_calls == messages
        finally:
            native_tx.close()
            python_tx.close()
            rx.close()

    trio.run(main)


def test_a_full_socket_sends_the_rest_once_writable(monkeypatch: pytest.MonkeyPatch) -> None:
    """send_rows stops at EAGAIN with what it sent; send_block waits until the socket is writable and sends the
    rest from there, in order (the C call is made to stop part way through, as a full socket would)."""
    async def main() -> None:
        tx = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=8 << 20, native_send=True)
        rx = _receiver(socket.AF_INET)
        real = tx._native_send
        calls: list[int] = []

        def stalling(fd, rows, offset, stride, count, *rest):  # type: ignore[no-untyped-def]
            calls.append(count)
            if len(calls) < 3:  # the first two calls send 70 rows each, then find the socket full
                sent, syscalls, err = real(fd, rows, offset, stride, min(count, 70), *rest)
                return sent, syscalls, err or errno.EAGAIN
            return real(fd, rows, offset, stride, count, *rest)

        monkeypatch.setattr(tx, "_native_send", stalling)
        block = _block(np.random.default_rng(1), 200, 1200, 0)
        try:
            with trio.fail_after(5):
                await tx.send_block(block, rx.getsockname())
            assert calls == [200, 130, 60]
            assert _drain(rx) == [bytes(r) for r in block]
            assert tx.sent == 200
        finally:
            tx.close()
            rx.close()

    trio.run(main)


def test_a_path_without_gso_falls_back_to_one_datagram_a_syscall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GSO send the path refuses (EIO: a NIC without checksum offload) switches GSO off for good and sends the
    part's remaining rows one at a time, as the Python loop does."""
    async def main() -> None:
        tx = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=8 << 20, native_send=True)
        rx = _receiver(socket.AF_INET)
        monkeypatch.setattr(tx, "_native_send", lambda *a: (0, 1, errno.EIO))
        block = _block(np.random.default_rng(2), 60, 1200, 0)
        try:
            await tx.send_block(block, rx.getsockname())
            assert _drain(rx) == [bytes(r) for r in block]
            assert not tx.gso
        finally:
            tx.close()
            rx.close()

    trio.run(main)


def test_an_error_the_send_cannot_handle_raises() -> None:
    async def main() -> None:
        tx = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=1 << 20, native_send=True)
        try:
            with pytest.raises(OSError):  # (EACCES: broadcast without SO_BROADCAST)
                await tx.send_block(np.zeros((4, 100), np.uint8), ("255.255.255.255", 9))
        finally:
            tx.close()

    trio.run(main)


def test_addresses_only_the_socket_module_can_send_to_take_the_python_loop() -> None:
    s = UdpSocket(bind_loopback(socket.AF_INET6), native_send=True)
    v4 = UdpSocket(bind_loopback(socket.AF_INET), native_send=True)
    try:
        assert s._sockaddr(("fe80::1%lo", 9)) is None
        assert s._sockaddr(("fe80::1", 9, 0, 1)) is None  # a 4-tuple: its scope is not dropped
        assert s._sockaddr(("::1", 70000)) is None
        assert v4._sockaddr(("localhost", 9)) is None
        packed = v4._sockaddr(("127.0.0.1", 9))
        assert packed is not None and len(packed) == 16 and packed[2:4] == struct.pack("!H", 9)
        assert len(s._sockaddr(("::1", 9)) or b"") == 28
    finally:
        s.close()
        v4.close()


def test_send_rows_checks_every_bound_before_it_sends() -> None:
    tx, rx = bind_loopback(socket.AF_INET), _receiver(socket.AF_INET)
    host, port = rx.getsockname()
    addr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(host) + bytes(8)
    rows = np.zeros((10, 100), np.uint8)
    fd = tx.fileno()
    try:
        assert native.send_rows(fd, rows, 0, 100, 10, 100, 10, addr, True) == (10, 1, 0)
        bad = [
            (fd, rows, 0, 100, 11, 100, 10, addr, True),  # one row past the buffer
            (fd, rows, 1, 100, 10, 100, 10, addr, True),  # offset: the last row runs out
            (fd, rows, 0, 99, 10, 100, 10, addr, True),  # rows overlap
            (fd, rows, 0, 100, 10, 0, 10, addr, True),  # an empty datagram
            (fd, rows, 0, 100, 10, 100, 65, addr, True),  # over 64 segments a message
            (fd, np.zeros((2, 40000), np.uint8), 0, 40000, 2, 40000, 2, addr, True),  # a message over 64 KB
            (fd, rows, 0, 100, 10, 100, 10, addr[:15], True),  # not a sockaddr_in
            (fd, rows, 0, 100, 10, 100, 10, struct.pack("=H", socket.AF_INET6) + bytes(14), True),
            (-1, rows, 0, 100, 10, 100, 10, addr, True),
            (fd, rows, -1, 100, 10, 100, 10, addr, True),
        ]
        for args in bad:
            with pytest.raises(ValueError):
                native.send_rows(*args)
        assert len(_drain(rx)) == 10  # only the good call's rows went out
        closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dead = closed.fileno()
        closed.close()
        sent, _, err = native.send_rows(dead, rows, 0, 100, 10, 100, 10, addr, True)
        assert sent == 0 and err == errno.EBADF
    finally:
        tx.close()
        rx.close()
