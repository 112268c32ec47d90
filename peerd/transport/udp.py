"""The daemon's one UDP socket: batched non-blocking receives, GSO/GRO where Linux has them.

trio's socket wrapper costs a scheduler round trip per call; at tens of thousands of datagrams per
second that dominates, so this drains the socket in batches after one ``wait_readable`` and sends
without awaiting unless the kernel buffer is full.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import trio

from ..wire.envelope import SEQ_OFFSET
from ..wire.native import native
from .caps import SocketCaps, native_receive

log = logging.getLogger("peerd.transport")

# Linux constants (the socket module does not export them on every Python build).
SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
SO_RXQ_OVFL = 40
SO_TIMESTAMPNS = 35  # (and SCM_TIMESTAMPNS): the kernel's receive time of each datagram, as a struct timespec
TIMESPEC = struct.Struct("@qq")
DATA_MIN_TYPE = 0x40  # wire.messages.CONTROL_MAX + 1: tensor data types start here
# Of those, the ones whose kernel receive time a REPORT's ``arrived`` may carry (bit t - DATA_MIN_TYPE): the data
# (0x40 reduce-scatter, 0x42 all-gather), not their END markers. A REPORT's position counts data datagrams only, and
# an END copy sent 8 or 30 ms after a stream's last datagram, paired with that datagram's send time, would read as
# that much queue and end startup far too low (arc-topk's back-to-back group averages end streams often).
ARRIVAL_TYPES = (1 << 0) | (1 << 2)


def _arrival_type(t: int) -> bool:
    return DATA_MIN_TYPE <= t < DATA_MIN_TYPE + 64 and bool((ARRIVAL_TYPES >> (t - DATA_MIN_TYPE)) & 1)
MAX_ARRIVALS = 4096  # sources whose data's latest arrival is kept (past that the table starts over)
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000
WANT_BUFFER = 32 * 1024 * 1024  # ~25k datagrams: a receiver descheduled for tens of ms loses nothing
RECV_BUFFER = 65536  # one receive: a GRO block is at most 64 KB
ARENA_BYTES = 16 * RECV_BUFFER  # receives per recv_blocks call land here, one after another
MERGE_PREFIX = SEQ_OFFSET  # envelope bytes before the sequence number: magic, version, type, flags, token
# An overloaded receive loop (PROTOCOL-free, local policy): when the kernel queue holds more than overload_bytes
# (SO_MEMINFO's receive allocation: about 2 KB a datagram on loopback), the loop is behind by tens of
# ms and a PING waits behind all of it, or is lost when the queue overflows. Such a pass reads up to
# OVERLOAD_DATAGRAMS into an arena of its own and keeps OVERLOAD_KEEP (or its max_datagrams, if fewer), shared
# max-min fairly among the sources (dataplane.c recv_batch's ``shed``): the sources filling the queue lose their
# excess before any Python object is made, PINGs and PONGs are never shed, and the queue drains. OVERLOAD_KEEP is
# a short pass (a quarter of the usual 1024): an overloaded daemon is short of CPU, and a PING that arrives during a
# pass waits for its end. Shedding also cuts honest members' tensor data, so it starts only where the kernel is about
# to drop anyway: at OVERLOAD_FRACTION of the socket's receive limit (SO_RCVBUF as the kernel reports it, twice the
# usable size: 64 MB for the 32 MB asked). Lower thresholds lose honest data with no kernel drop (`peerd bench
# allreduce --peers 4 --size 25000000`, received_fraction); a member attack fills the queue to 55-64 MB.
OVERLOAD_FRACTION = 0.875
# With ``protected`` tokens (the sessions of the members of running groups, from the endpoint), shedding starts
# far lower: those datagrams are never shed, so a low depth costs only the others' (a member attack drains in a pass
# or two instead of seconds). Past OVERLOAD_FRACTION everything is shed as without them (a member inside a running
# group could fill the queue itself). Protected too: the members of recent groups, and tokens holding data for a
# group not started here yet, unless data they held went unused lately (a member's flood of data for groups that
# never start: AveragingHost.protected_tokens). The depth is what a PING waits behind: the kernel charges about
# 2.3 KB for a 1200-byte datagram on loopback, so 1 MiB is about 450 datagrams, some 20 ms of the receive loop's
# Python under a member attack (STOREs' signatures, answers), where 4 MiB kept PINGs of the soak's burst waiting
# hundreds of ms (`peerd bench soak`: ping_p99_ms, averages_failed); an average without attack sheds nothing at it
# (`peerd bench allreduce --peers 4 --size 25000000`: received_fraction). PEERD_PROTECTED_OVERLOAD_BYTES sets it (a
# value >= the receive limit turns it off).
PROTECTED_OVERLOAD_BYTES = int(os.environ.get("PEERD_PROTECTED_OVERLOAD_BYTES", str(1024 * 1024)))
OVERLOAD_AUTO = -1  # overload_bytes: OVERLOAD_FRACTION of this socket's receive limit
OVERLOAD_KEEP = 256
OVERLOAD_DATAGRAMS = 16384
OVERLOAD_ARENA = 24 * 1024 * 1024
URGENT_BYTES = 512  # a PING or PONG at most this long is never shed (the endpoint answers those first)
PING_TYPE, PONG_TYPE = 0x01, 0x02
SO_MEMINFO = 55
SK_MEMINFO = struct.Struct("=9I")  # [0]: SK_MEMINFO_RMEM_ALLOC, bytes queued for receiving
U16 = struct.Struct("=H")
U32 = struct.Struct("=I")
I32 = struct.Struct("=i")

Address = tuple[str, int]
# The C receive pass (dataplane.c recv_batch: recvmmsg, GRO and source parsing and the merging below, the GIL
# released), or None: the Python loop, the reference (see caps.native_receive).
NATIVE_RECV = native_receive()
# The C send of a paced part (send.c send_rows: its GSO messages by sendmmsg, the GIL released); PEERD_NATIVE_SEND=0
# runs the Python loop (send_block's reference: one sendmsg per GSO message), for A/B measurements.
NATIVE_SEND = (getattr(native, "send_rows", None)
               if sys.platform.startswith("linux") and os.environ.get("PEERD_NATIVE_SEND", "1") != "0" else None)
MAX_SOCKADDRS = 1024  # packed destination addresses kept for the native send (a group has a handful)


@dataclass
class SocketStatistics:
    gso: bool
    gro: bool
    rcvbuf: int
    sndbuf: int
    kernel_drops: int  # datagrams the kernel dropped at this socket's receive queue (SO_RXQ_OVFL)
    datagrams_received: int
    datagrams_sent: int
    send_calls: int
    receive_passes: int  # recv_blocks calls that returned data (datagrams_received / this: datagrams per pass)
    receive_calls: int  # recvmsg syscalls that returned a datagram or a GRO block


def _set_buffer(sock: socket.socket, force_opt: int, opt: int, size: int) -> int:
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_opt, size)  # root (CAP_NET_ADMIN): ignores rmem_max
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, opt, size)
    return sock.getsockopt(socket.SOL_SOCKET, opt) // 2  # Linux reports double the usable size


class UdpSocket:
    def __init__(self, sock: socket.socket, *, gso: bool = True, buffer_bytes: int = WANT_BUFFER,
                 arena_bytes: int = ARENA_BYTES, native_receive: bool | None = None,
                 overload_bytes: int | None = OVERLOAD_AUTO, native_send: bool | None = None) -> None:
        """``native_receive``: take receive passes with the C extension's recv_batch (None: where it is loaded;
        True: required, ValueError without it; False: the Python loop); ``native_send`` likewise for send_block's
        parts (send_rows). ``overload_bytes``: the kernel queue
        depth past which a screened pass sheds (OVERLOAD_AUTO: near the kernel's limit, see OVERLOAD_FRACTION;
        None: never)."""
        if native_receive and NATIVE_RECV is None:
            raise ValueError("native_receive: the native extension's recv_batch is not loaded")
        if native_send and NATIVE_SEND is None:
            raise ValueError("native_send: the native extension's send_rows is not loaded")
        if arena_bytes < RECV_BUFFER:
            raise ValueError(f"arena_bytes must be at least {RECV_BUFFER}")
        self.sock = sock
        self.family = sock.family
        sock.setblocking(False)
        linux = sys.platform.startswith("linux")
        self.rcvbuf = _set_buffer(sock, SO_RCVBUFFORCE, socket.SO_RCVBUF, buffer_bytes)
        self.sndbuf = _set_buffer(sock, SO_SNDBUFFORCE, socket.SO_SNDBUF, buffer_bytes)
        if self.rcvbuf < buffer_bytes // 2:
            log.warning(
                "UDP receive buffer is %d KiB (wanted %d KiB): bursts may be dropped by the kernel. As root: "
                "sysctl -w net.core.rmem_max=%d", self.rcvbuf // 1024, buffer_bytes // 1024, buffer_bytes,
            )
        has_gso = gso and linux and self._probe_gso()
        gro = False
        if gso and linux:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                gro = True
            except OSError:
                pass
        self.arrivals: dict[Address, float] = {}  # source -> kernel receive time of its latest data (unix s)
        self.stamps = False  # the kernel timestamps received datagrams (SO_TIMESTAMPNS)
        if linux:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self.stamps = True
            except OSError:
                pass
        ovfl = False
        if linux:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
                ovfl = True
            except OSError:
                pass
        # declared once, here: what the endpoint and the averaging host may use (no probing at each send)
        self.caps = SocketCaps(gso=has_gso, gro=gro, block_receive=True, block_send=True, kernel_drops=ovfl,
                               drained_flag=True,
                               rcvbuf=self.rcvbuf, sndbuf=self.sndbuf,
                               gso_segments=GSO_MAX_SEGMENTS if has_gso else 1)
        self._native_recv = NATIVE_RECV if native_receive is None or native_receive else None
        self._native_send = NATIVE_SEND if native_send is None or native_send else None
        self._sockaddrs: dict[Address, bytes | None] = {}
        self._arena = bytearray(arena_bytes)
        self._view = memoryview(self._arena)
        # Where a native pass lays out a block whose receives are not one run of the arena (one source's GRO
        # receives between another's, or apart by a slot's slack): each such byte is copied once, into here
        # (dataplane.c materialize), where before it moved up to three times within the arena.
        self._out = memoryview(bytearray(arena_bytes)) if self._native_recv is not None else None
        self._used = 0
        if overload_bytes == OVERLOAD_AUTO:
            overload_bytes = int(2 * self.rcvbuf * OVERLOAD_FRACTION)
        self.overload_bytes = overload_bytes
        self._overload_view: memoryview | None = None  # the overloaded passes' arena, made at the first one
        self.shed = 0  # datagrams shed by overloaded passes
        self.overloaded_passes = 0
        self.drained = True  # the last recv_blocks stopped because the socket was empty (not at a limit)
        self.kernel_drops = 0
        self.received = 0
        self.sent = 0
        self.send_calls = 0
        self.receive_passes = 0
        self.receive_calls = 0

    @property
    def gso(self) -> bool:
        return self.caps.gso

    @property
    def gro(self) -> bool:
        return self.caps.gro

    def _probe_gso(self) -> bool:
        try:
            self.sock.getsockopt(SOL_UDP, UDP_SEGMENT)
            return True
        except OSError:
            return False

    def statistics(self) -> SocketStatistics:
        return SocketStatistics(self.gso, self.gro, self.rcvbuf, self.sndbuf, self.kernel_drops,
                                self.received, self.sent, self.send_calls, self.receive_passes,
                                self.receive_calls)

    def getsockname(self) -> Address:
        return self.sock.getsockname()[:2]

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    # -- receiving --------------------------------------------------------------------------------
    async def recv_batch(self, max_datagrams: int = 64) -> list[tuple[bytes, Address]]:
        """Wait for at least one datagram, then take what is queued (up to about ``max_datagrams``)."""
        out: list[tuple[bytes, Address]] = []
        for data, source, segment in await self.recv_blocks(max_datagrams):
            if segment:
                out.extend((bytes(data[i : i + segment]), source) for i in range(0, len(data), segment))
            else:
                out.append((bytes(data), source))
        return out

    async def recv_blocks(self, max_datagrams: int = 64) -> list[tuple[memoryview, Address, int]]:
        """Like ``recv_batch``, but datagrams stay together in blocks: (data, source, segment size), every
        datagram in ``data`` ``segment`` bytes but the last; segment 0: ``data`` is one datagram.

        Receives land one after another in one arena, and consecutive receives from one source whose
        datagrams have the same size and start alike (one sender's stream) merge into one block, so a
        consumer's per-block work (numpy calls) is paid once per many GRO receives. The views are valid
        until the next call: a consumer copies what it keeps.
        """
        if self._native_recv is not None:
            return await self._recv_blocks_native(max_datagrams)
        return await self._recv_blocks_python(max_datagrams)

    async def _recv_blocks_native(self, max_datagrams: int) -> list[tuple[memoryview, Address, int]]:
        """recv_blocks by one C call per pass (recvmmsg with the GIL released; see _recv_blocks_python)."""
        recv = self._native_recv
        fd = self.sock.fileno()
        view = self._view
        limit = max(1, min(max_datagrams, 65536))
        while True:
            blocks, used, count, calls, drained, drops, _ = recv(  # type: ignore[misc]
                fd, view, limit, RECV_BUFFER, arrivals=self._arrivals(), out=self._out)
            if drops >= 0:
                self.kernel_drops = drops
            if blocks:
                self.drained = drained
                self.received += count
                self.receive_calls += calls
                self.receive_passes += 1
                self._used = used
                return blocks
            await trio.lowlevel.wait_readable(self.sock)

    @property
    def screens(self) -> bool:
        """Whether ``recv_screened`` is there (the native receive pass)."""
        return self._native_recv is not None

    async def recv_screened(self, max_datagrams: int, screen: tuple, limiter: object = None, *,
                            shedding: bool = False, protected: dict[int, object] | None = None) -> tuple:
        """recv_blocks, with the junk screen of the native pass (dataplane.c recv_batch's ``screen``: the header
        constants of wire.envelope.peek and the known tokens): (blocks, unknown, malformed, version, screened_bytes,
        limited, rationed, now, shed), whatever the arguments.
        Single datagrams whose header peek refuses are only counted (``malformed``, ``version``, their bytes in
        ``screened_bytes``), as are sealed ones shorter than ``min_sealed`` under an unknown token; the other sealed
        single datagrams under an unknown token come apart in ``unknown`` as (data, source). Only where
        ``screens``.

        ``limiter``: the endpoint's AuthLimiter (None: limited 0, rationed False, shed 0). Where it is a
        NativeAuthLimiter (``rationed`` True) the pass rations the datagrams under unknown tokens in C at ``now``
        (the time the pass began, which the caller's decisions on the rest must use): ``limited`` were refused
        (``auth_limited``, never Python objects, their bytes in screened_bytes), and ``unknown[0]``, where there
        is one, has its key derivation granted already; the rest of ``unknown`` is for the caller to decide.
        ``shedding`` (with a limiter): an overloaded pass sheds (see OVERLOAD_FRACTION); ``shed`` counts the
        datagrams it dropped (their bytes in screened_bytes); without it nothing is shed.
        ``protected`` (with ``shedding``): tokens whose sealed datagrams are never shed; given (even empty: no group
        runs, no tensor data to spare), a pass sheds the others from PROTECTED_OVERLOAD_BYTES of queue, and past
        overload_bytes sheds as without it."""
        recv = self._native_recv
        if recv is None:
            raise RuntimeError("recv_screened needs the native receive pass")
        table = getattr(limiter, "table", None)
        fd = self.sock.fileno()
        limit = max(1, min(max_datagrams, 65536))
        while True:
            now = trio.current_time()
            view, most, shed = self._view, limit, None
            if shedding and limiter is not None and self.overload_bytes is not None:
                queued = self.queued()
                keep: dict[int, object] | None = None
                if queued > self.overload_bytes:
                    over = True
                else:
                    over = protected is not None and queued > min(PROTECTED_OVERLOAD_BYTES, self.overload_bytes)
                    keep = protected
                if over:
                    if self._overload_view is None:
                        self._overload_view = memoryview(bytearray(OVERLOAD_ARENA))
                    view, most = self._overload_view, max(limit, OVERLOAD_DATAGRAMS)
                    shed = (min(limit, OVERLOAD_KEEP), URGENT_BYTES, PING_TYPE, PONG_TYPE, keep)
            # (an overloaded pass has an arena of its own, larger than ``_out``: it lays its blocks out in place)
            blocks, used, count, calls, drained, drops, screened = recv(
                fd, view, most, RECV_BUFFER, screen=screen, ration=table, now=now if table is not None else 0.0,
                shed=shed, arrivals=self._arrivals(), out=self._out if view is self._view else None)
            unknown, malformed, version, nbytes, limited, shed_now = screened
            if shed is not None:
                self.shed += shed_now
                self.overloaded_passes += 1
            if drops >= 0:
                self.kernel_drops = drops
            if count:
                self.drained = drained
                self.received += count
                self.receive_calls += calls
                self.receive_passes += 1
                self._used = used
                return (blocks, unknown, malformed, version, nbytes, limited, table is not None, now,
                        shed_now if shed is not None else 0)
            await trio.lowlevel.wait_readable(self.sock)

    def _arrivals(self) -> tuple[dict[Address, float], int, int] | None:
        """recv_batch's ``arrivals``: this socket's table (emptied once it holds MAX_ARRIVALS sources: only the
        members a group averages with matter, and anyone can send from many addresses)."""
        if not self.stamps:
            return None
        if len(self.arrivals) >= MAX_ARRIVALS:
            self.arrivals.clear()
        return self.arrivals, DATA_MIN_TYPE, ARRIVAL_TYPES

    def queued(self) -> int:
        """Bytes the kernel holds for this socket to receive (SO_MEMINFO; 0 where it cannot say)."""
        try:
            return SK_MEMINFO.unpack(self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, SK_MEMINFO.size))[0]
        except (OSError, struct.error):
            return 0

    async def _recv_blocks_python(self, max_datagrams: int) -> list[tuple[memoryview, Address, int]]:
        """The reference receive pass: one recvmsg_into per datagram or GRO block."""
        out: list[list] = []  # [start, size, source, row size]
        count = calls = 0
        drained = False
        used = 0
        last_start = len(self._arena) - RECV_BUFFER  # a receive needs RECV_BUFFER bytes of room
        view = self._view
        recvmsg_into = self.sock.recvmsg_into
        while True:
            try:
                # One loop, no call per datagram but the syscall: under a flood of junk this loop and the
                # endpoint's triage are the whole per-datagram cost.
                while count < max_datagrams and used <= last_start:
                    size, ancdata, _flags, addr = recvmsg_into([view[used : used + RECV_BUFFER]], 256)
                    calls += 1
                    segment = 0
                    stamp = 0.0
                    for level, kind, data in ancdata:
                        if level == SOL_UDP and kind == UDP_GRO:
                            segment = I32.unpack_from(data)[0] if len(data) >= 4 else U16.unpack_from(data)[0]
                        elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= 4:
                            self.kernel_drops = U32.unpack_from(data)[0]
                        elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
                            sec, nsec = TIMESPEC.unpack_from(data)
                            stamp = sec + nsec * 1e-9
                    row = segment if 0 < segment < size else size
                    count += -(-size // row) if row else 1
                    source = addr if len(addr) == 2 else (addr[0], addr[1])
                    if stamp > 0 and size > 3 and _arrival_type(view[used + 3]):  # (as recv_batch's arrivals)
                        if len(self.arrivals) >= MAX_ARRIVALS and source not in self.arrivals:
                            self.arrivals.clear()
                        self.arrivals[source] = stamp
                    if out and row:
                        last = out[-1]
                        # Append to the previous block: same source, same datagram size, the previous block's
                        # rows all full (its end is where this receive starts), the same first bytes (type,
                        # token; a row shorter than them: its bytes).
                        n = MERGE_PREFIX if row >= MERGE_PREFIX else row
                        if (last[3] == row and last[1] % row == 0 and last[2] == source
                                and view[last[0] : last[0] + n] == view[used : used + n]):
                            last[1] += size
                            used += size
                            continue
                    out.append([used, size, source, row])
                    used += size
            except BlockingIOError:
                drained = True
            except OSError as e:  # ICMP errors surface here on some kernels; they are not fatal
                if e.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    raise
            if out:
                self.drained = drained
                self.received += count
                self.receive_calls += calls
                self.receive_passes += 1
                self._used = used
                return [(view[start : start + size], source, row if size > row else 0)
                        for start, size, source, row in out]
            await trio.lowlevel.wait_readable(self.sock)

    # -- sending ----------------------------------------------------------------------------------
    async def sendto(self, data: bytes, addr: Address) -> None:
        while True:
            try:
                self.sock.sendto(data, addr)
                self.sent += 1
                self.send_calls += 1
                return
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    async def send_many(self, datagrams: list[bytes], addr: Address) -> None:
        """Send to one destination; with GSO, runs of equal-size datagrams go in one syscall."""
        if not self.gso or len(datagrams) < 2:
            for d in datagrams:
                await self.sendto(d, addr)
            return
        i = 0
        while i < len(datagrams):
            size = len(datagrams[i])
            j = i + 1
            limit = min(GSO_MAX_SEGMENTS, max(1, GSO_MAX_BYTES // size))
            while j < len(datagrams) and j - i < limit and len(datagrams[j]) == size:
                j += 1
            if j < len(datagrams) and j - i < limit and len(datagrams[j]) < size:
                j += 1  # the last segment may be shorter
            await self._send_segments(datagrams[i:j], size, addr)
            i = j

    async def send_block(self, datagrams: np.ndarray, addr: Address) -> None:
        """Send each row of a (rows, bytes) uint8 array as one datagram: with GSO, up to 64 rows (64 KB)
        per syscall straight from the array, without joining them first."""
        rows, size = datagrams.shape
        if not self.gso or rows < 2:
            for row in datagrams:
                await self.sendto(row, addr)
            return
        limit = min(GSO_MAX_SEGMENTS, max(1, GSO_MAX_BYTES // size))
        if (self._native_send is not None and datagrams.dtype == np.uint8 and datagrams.strides[1] == 1
                and datagrams.strides[0] >= size):
            sockaddr = self._sockaddr(addr)
            if sockaddr is not None:
                await self._send_rows(datagrams, limit, sockaddr, addr)
                return
        for i in range(0, rows, limit):
            run = datagrams[i : i + limit]
            if len(run) == 1:
                await self.sendto(run[0], addr)
            else:
                await self._send_gso(run, size, run, addr)

    async def _send_rows(self, datagrams: np.ndarray, limit: int, sockaddr: bytes, addr: Address) -> None:
        """send_block's rows by the C send (runs of ``limit`` rows per GSO message, many messages a syscall): the
        same datagrams in the same order as the loop, with the same handling of a full socket and of a path
        without GSO."""
        rows, size = datagrams.shape
        stride = datagrams.strides[0]
        done = 0
        while done < rows:
            n, calls, err = self._native_send(self.sock.fileno(), datagrams, done * stride, stride, rows - done,
                                              size, limit, sockaddr, True)
            self.sent += n
            self.send_calls += calls
            done += n
            if not err:
                return
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                await trio.lowlevel.wait_writable(self.sock)
            elif err in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT):  # no GSO on this path/NIC
                log.warning("UDP GSO failed (%s); using one syscall per datagram", os.strerror(err))
                self.caps.lose_gso()
                for row in datagrams[done:]:
                    await self.sendto(row, addr)
                return
            else:
                raise OSError(err, os.strerror(err))

    def _sockaddr(self, addr: Address) -> bytes | None:
        """``addr`` as the packed struct sockaddr the C send takes, for this socket's family; None where only the
        socket module can send there (a scoped IPv6 address, a name): the Python loop then does."""
        packed = self._sockaddrs.get(addr, b"")
        if packed != b"":
            return packed
        if len(addr) != 2:  # (an IPv6 4-tuple: its flow info and scope are the socket module's to pack)
            return None
        host, port = addr
        try:
            if self.family == socket.AF_INET:
                packed = (U16.pack(socket.AF_INET) + struct.pack("!H", port) + socket.inet_pton(socket.AF_INET, host)
                          + bytes(8))
            elif self.family == socket.AF_INET6 and "%" not in host:
                packed = (U16.pack(socket.AF_INET6) + struct.pack("!HI", port, 0)
                          + socket.inet_pton(socket.AF_INET6, host) + U32.pack(0))
            else:
                packed = None
        except (OSError, ValueError, TypeError, struct.error):
            packed = None
        if len(self._sockaddrs) >= MAX_SOCKADDRS:
            self._sockaddrs.clear()
        self._sockaddrs[addr] = packed
        return packed

    async def _send_segments(self, run: list[bytes], size: int, addr: Address) -> None:
        if len(run) == 1:
            await self.sendto(run[0], addr)
            return
        await self._send_gso(b"".join(run), size, run, addr)

    async def _send_gso(self, payload: bytes | np.ndarray, size: int, run: Sequence, addr: Address) -> None:
        """One GSO send of ``payload`` (the datagrams of ``run``, ``size`` bytes each but the last); where
        the path has no GSO, switch it off for good and send ``run`` one datagram per syscall."""
        cmsg = [(SOL_UDP, UDP_SEGMENT, U16.pack(size))]
        while True:
            try:
                self.sock.sendmsg([payload], cmsg, 0, addr)
                self.sent += len(run)
                self.send_calls += 1
                return
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
            except OSError as e:
                if e.errno in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT):  # no GSO on this path/NIC
                    log.warning("UDP GSO failed (%s); using one syscall per datagram", os.strerror(e.errno))
                    self.caps.lose_gso()
                    for d in run:
                        await self.sendto(d, addr)
                    return
                raise
