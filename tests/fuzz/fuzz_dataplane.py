"""Fuzz every entry point of the native data plane (peerd._dataplane._native) under AddressSanitizer.

Run by tests/fuzz/run.sh, which builds an ASan copy of the extension into a temp dir and preloads gcc's libasan
(``PEERD_ASAN_NATIVE`` is that copy's path). Each input picks an entry point (Aead(), seal_block, open_block,
frame_block, seal_split, frame_split, place_rows, first_nonfinite, accumulate_rows, recv_batch over a loopback socket,
send_rows to it, finalize_rows, same_lead, take_rows,
with its junk screen and a Ration table; Ration's methods) and arguments: buffers of exact
sizes (ctypes arrays, malloc'd apart under PYTHONMALLOC=malloc, so a byte read or written past one is an ASan
report), offsets, strides, counts and lengths that are right, nearly
right or wild. A call may raise ValueError, OverflowError or TypeError (the bounds it checks); anything else, or
a sealed block that does not open back to its bodies, is a crash.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import socket
import struct
import sys

import atheris
import numpy as np

from peerd.allreduce.kernels import finalize_f32
from peerd.wire.replay import ReplayWindow

HEADER, TAG, KEY = 21, 16, 32
ALLOWED = (ValueError, OverflowError, TypeError)
ENTRIES = ("Aead", "seal_block", "open_block", "frame_block", "place_rows", "first_nonfinite", "recv_batch", "Ration",
           "seal_split", "recv_batch interleaved", "quant_encode", "quant_decode",
           "half_encode", "half_decode", "replay_check", "replay_accept", "accumulate_rows", "send_rows",
           "finalize_rows", "same_lead", "take_rows", "take_coded")
# gcc's ASan runtime provides the coverage hooks in place of atheris's libFuzzer, so there is no coverage
# feedback and libFuzzer keeps mutating one tiny input: each input is therefore stretched into 4 KB of
# pseudo-random bytes (SHAKE-256 of it), steered only by the layouts below. What the inputs reached is counted
# and printed now and then, so a run shows it called every entry point with good and bad arguments.
seen: collections.Counter[str] = collections.Counter()


def report() -> None:
    print("fuzz: outcomes", dict(sorted(seen.items())), file=sys.stderr, flush=True)


atexit.register(report)


def _load_native():  # type: ignore[no-untyped-def]
    path = os.environ.get("PEERD_ASAN_NATIVE")
    if not path:
        sys.exit("PEERD_ASAN_NATIVE: the path of an ASan build of peerd._dataplane._native (tests/fuzz/run.sh)")
    loader = importlib.machinery.ExtensionFileLoader("peerd._dataplane._native", path)
    spec = importlib.util.spec_from_file_location("peerd._dataplane._native", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


native = _load_native()


def buffer(fdp: atheris.FuzzedDataProvider, size: int) -> ctypes.Array:
    """A writable buffer of exactly ``size`` bytes (no slack after it for an overflow to hide in)."""
    buf = (ctypes.c_char * size)()
    # At most 64 bytes of the input, repeated: a big buffer must not use up the choices that come after it.
    data = fdp.ConsumeBytes(min(size, 64))
    if data:
        fill = (data * (size // len(data) + 1))[:size]
        ctypes.memmove(buf, fill, size)
    return buf


def number(fdp: atheris.FuzzedDataProvider, right: int) -> int:
    """``right``, or a value next to it, or a wild one: where bound checks go wrong."""
    kind = fdp.ConsumeIntInRange(0, 15)
    if kind <= 12:
        return right
    if kind <= 14:
        return right + fdp.ConsumeIntInRange(-3, 3)
    return fdp.ConsumeIntInRange(-(2**63), 2**63 - 1)


def layout(fdp: atheris.FuzzedDataProvider, rows: int, length: int) -> tuple[int, int, int]:
    """(offset, stride, buffer size) for ``rows`` rows of ``length`` bytes: usually exact, sometimes off."""
    offset = fdp.ConsumeIntInRange(0, 16)
    stride = length + fdp.ConsumeIntInRange(0, 16)
    need = offset + (rows - 1) * stride + length if rows else offset
    size = max(0, need + fdp.ConsumeIntInRange(-2, 2) if fdp.ConsumeBool() else need)
    return number(fdp, offset), number(fdp, stride), min(size, 1 << 20)


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(hashlib.shake_256(data).digest(4096))
    which = fdp.ConsumeIntInRange(0, len(ENTRIES) - 1)
    seen["inputs"] += 1
    if seen["inputs"] & 0x1FFF == 0:
        report()
    try:
        call(fdp, which)
        seen[f"{ENTRIES[which]} ok"] += 1
    except ALLOWED:
        seen[f"{ENTRIES[which]} refused"] += 1


def call(fdp: atheris.FuzzedDataProvider, which: int) -> None:
    """One call of entry point ``which`` with arguments read from ``fdp``."""
    key = fdp.ConsumeBytes(KEY if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 40))
    if which == 0:
        native.Aead(key, direct=fdp.ConsumeBool())
        return
    if which == 6:
        receive(fdp)
        return
    if which == 7:
        ration(fdp)
        return
    if which == 8:
        seal_split(fdp, key)
        return
    if which == 9:
        receive_interleaved(fdp)
        return
    if which in (10, 11):
        quant(fdp, which == 10)
        return
    if which in (12, 13):
        half(fdp, which == 12)
        return
    if which in (14, 15):
        replay(fdp, which == 14)
        return
    if which == 16:
        accumulate(fdp)
        return
    if which == 17:
        send_rows(fdp)
        return
    if which == 18:
        finalize(fdp)
        return
    if which == 19:
        lead(fdp)
        return
    if which in (20, 21):
        take(fdp, coded=which == 21)
        return
    if which >= 4:
        rows_only(fdp, which)
        return
    rows = fdp.ConsumeIntInRange(0, 40)
    body_len = fdp.ConsumeIntInRange(0, 300) if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 70000)
    receiver = fdp.ConsumeBytes(32 if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 40))
    prefix = fdp.ConsumeBytes(13 if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 20))
    first = number(fdp, fdp.ConsumeIntInRange(1, 2**64 - 1))
    s_off, s_stride, s_size = layout(fdp, rows, body_len)
    width = HEADER + body_len + (TAG if which != 3 else 0)
    o_off, o_stride, o_size = layout(fdp, rows, width)
    src, out = buffer(fdp, s_size), buffer(fdp, o_size)
    n_rows = number(fdp, rows)
    n_len = number(fdp, body_len)
    if which == 3:
        native.frame_block(prefix, first, n_rows, src, s_off, s_stride, n_len, out, o_off, o_stride)
        return
    aead = native.Aead(key, direct=fdp.ConsumeBool())  # the provider's own functions, or EVP
    if which == 1:
        aead.seal_block(prefix, first, n_rows, src, s_off, s_stride, n_len, receiver, out, o_off, o_stride)
        sealed_ok = (n_rows, n_len, s_off, s_stride, o_off, o_stride) == (
            rows, body_len, s_off, s_stride, o_off, o_stride)
        if not sealed_ok or rows == 0:
            return
        # Round trip: what was sealed opens back to the bodies (a few rows tampered first fail alone).
        d_off, d_stride, d_size = layout(fdp, rows, body_len)
        dst, mask = buffer(fdp, d_size), (ctypes.c_char * rows)(*([b"\x01"] * rows))
        flips: collections.Counter[tuple[int, int, int]] = collections.Counter()
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            r = fdp.ConsumeIntInRange(0, rows - 1)
            at, bit = o_off + r * o_stride + fdp.ConsumeIntInRange(0, width - 1), fdp.ConsumeIntInRange(0, 7)
            out[at] = bytes([out[at][0] ^ (1 << bit)])
            flips[r, at, bit] += 1
        bad = {r for (r, _, _), count in flips.items() if count % 2}  # a bit flipped twice is back
        if fdp.ConsumeBool():  # in place: each body over its own ciphertext
            dst, d_off, d_stride = out, o_off + HEADER, o_stride
        try:
            failures = aead.open_block(out, o_off, o_stride, width, rows, receiver, dst, d_off, d_stride, mask)
        except ALLOWED:
            return
        seen["round trip in place" if dst is out else "round trip"] += 1
        if failures != len(bad) or [mask[i] == b"\x01" for i in range(rows)] != [i not in bad for i in range(rows)]:
            raise AssertionError(f"{failures} rows failed, {len(bad)} were tampered")
        for i in range(rows):
            if i not in bad and bytes(dst[d_off + i * d_stride : d_off + i * d_stride + body_len]) != bytes(
                    src[s_off + i * s_stride : s_off + i * s_stride + body_len]):
                raise AssertionError(f"row {i} opened to other bytes than were sealed")
        return
    # open_block over arbitrary bytes as datagrams
    row_len = number(fdp, width)
    d_off, d_stride, d_size = layout(fdp, rows, max(0, body_len))
    dst = buffer(fdp, d_size)
    mask = buffer(fdp, max(0, number(fdp, rows)) % 64)
    aead.open_block(out, o_off, o_stride, row_len, n_rows, receiver, dst, d_off, d_stride, mask)


def rows_only(fdp: atheris.FuzzedDataProvider, which: int) -> None:
    """place_rows and first_nonfinite: rows of float32 values (some NaN or inf) copied and checked; a copy that
    is accepted must land exactly, and the first non-finite row must be the one planted."""
    rows = fdp.ConsumeIntInRange(0, 40)
    length = 4 * fdp.ConsumeIntInRange(0, 80) + (0 if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(1, 3))
    s_off, s_stride, s_size = layout(fdp, rows, length)
    src = buffer(fdp, s_size)
    n_rows, n_len = number(fdp, rows), number(fdp, length)
    rows_of = src  # what the call takes: the buffer, or a 2-D view of contiguous rows cut out of it
    if fdp.ConsumeBool() and rows and length and s_stride >= length and rows * s_stride <= s_size:
        rows_of = np.frombuffer(src, np.uint8)[: rows * s_stride].reshape(rows, s_stride)[:, :length]
        s_off = 0  # offsets count from the view's first byte
    if which == 5:
        fits = s_off >= 0 and s_stride >= length and s_off + max(0, rows - 1) * s_stride + length <= s_size
        exact = (n_rows, n_len) == (rows, length) and length % 4 == 0 and fits
        planted = fdp.ConsumeIntInRange(0, rows) if exact and length and rows else rows
        if exact:  # every value finite (exponent < 255), then one inf or NaN in row ``planted``
            for i in range(rows):
                for j in range(0, length, 4):
                    at = s_off + i * s_stride + j + 3
                    if 0 <= at < s_size:
                        src[at] = bytes([src[at][0] & 0xBF])
        if exact and planted < rows:
            at = s_off + planted * s_stride + 4 * fdp.ConsumeIntInRange(0, length // 4 - 1)
            src[at + 2], src[at + 3] = bytes([src[at + 2][0] | 0x80]), bytes([src[at + 3][0] | 0x7F])
        got = native.first_nonfinite(rows_of, s_off, s_stride, n_rows, n_len)
        if exact and got != (planted if planted < rows else -1):
            raise AssertionError(f"first_nonfinite said {got}, row {planted} of {rows} holds the inf/NaN")
        return
    d_off, d_stride, d_size = layout(fdp, rows, length)
    dst = buffer(fdp, d_size)
    native.place_rows(rows_of, s_off, s_stride, n_rows, n_len, dst, d_off, d_stride)
    for i in range(n_rows):
        a, b = s_off + i * s_stride, d_off + i * d_stride
        if bytes(dst[b : b + n_len]) != bytes(src[a : a + n_len]):
            raise AssertionError(f"row {i} was not placed")


def replay(fdp: atheris.FuzzedDataProvider, check: bool) -> None:
    """replay_check and replay_accept over fuzzed windows, highests and rows (strides, offsets and counts right or
    wild). Where the layout is right, each must do what the Python window (the reference) does."""
    size = fdp.ConsumeIntInRange(0, 70)
    rows = fdp.ConsumeIntInRange(0, 90)
    row = fdp.ConsumeIntInRange(0, 40)
    s_off, s_stride, s_size = layout(fdp, rows, row)
    src = buffer(fdp, s_size)
    ring = buffer(fdp, size)
    for i in range(size):
        ring[i] = bytes([ring[i][0] & 1])
    highest = (-1 if fdp.ConsumeIntInRange(0, 3) == 0 else fdp.ConsumeIntInRange(0, 200)
               if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-3, 2**64 + 2))
    mask = buffer(fdp, max(0, rows + (0 if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(-2, 2))))
    n_rows = number(fdp, rows)
    right = (size >= 1 and row >= 21 and n_rows == rows and len(mask) >= rows and s_off >= 0 and s_stride >= row
             and s_off + max(0, rows - 1) * s_stride + row <= s_size and -1 <= highest < 2**64 and rows > 0)
    window = ReplayWindow(max(1, size))
    if right:  # the reference, in the same state
        window.highest = highest
        window.ring[:] = np.frombuffer(ring, np.uint8).astype(bool)
        seqs = np.array([int.from_bytes(bytes(src[s_off + i * s_stride + 13 : s_off + i * s_stride + 21]), "big")
                         for i in range(rows)], dtype=np.uint64)
    if check:
        native.replay_check(ring, highest, src, s_off, s_stride, n_rows, mask)
        if right and list(bytes(mask[:rows])) != window.would_accept_block(seqs).astype(np.uint8).tolist():
            raise AssertionError("replay_check disagrees with ReplayWindow.would_accept_block")
    else:
        got = native.replay_accept(ring, highest, src, s_off, s_stride, n_rows, mask)
        if right:
            window.accept_block(seqs[np.frombuffer(mask, np.uint8)[:rows] != 0])
            if got != window.highest or bytes(ring) != window.ring.astype(np.uint8).tobytes():
                raise AssertionError("replay_accept left another window than ReplayWindow.accept_block")
    seen["replay compared" if right else "replay called"] += 1


_pair: tuple[socket.socket, socket.socket] | None = None


def _out(fdp: atheris.FuzzedDataProvider, arena: int) -> memoryview | None:
    """recv_batch's ``out``: none, or a buffer as large as the arena, now and then a few bytes short (refused)."""
    if fdp.ConsumeBool():
        return None
    size = arena if fdp.ConsumeIntInRange(0, 7) else max(0, arena - fdp.ConsumeIntInRange(1, 3))
    seen["recv_batch out"] += 1
    return memoryview(buffer(fdp, size)).cast("B")


def _sockets() -> tuple[socket.socket, socket.socket]:
    """One sender and one non-blocking receiver (UDP_GRO on, SO_RXQ_OVFL on) on loopback, made once."""
    global _pair
    if _pair is None:
        tx, rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.bind(("127.0.0.1", 0))
        rx.bind(("127.0.0.1", 0))
        # Connected: the kernel delivers only tx's datagrams. A stray sender on the machine (a leftover process
        # blasting a port that rx's ephemeral port reused) would otherwise keep the drain loop below busy for good.
        rx.connect(tx.getsockname())
        rx.setblocking(False)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        for level, opt in ((17, 104), (socket.SOL_SOCKET, 40), (socket.SOL_SOCKET, 35)):  # GRO, RXQ_OVFL, TIMESTAMPNS
            try:
                rx.setsockopt(level, opt, 1)
            except OSError:
                pass
        _pair = tx, rx
    return _pair


# Tables that live across inputs (so that eviction, refills and passes build up), and the sources they are fed.
RATIONS: list = []
HOSTS = ("127.0.0.1", "10.0.0.1", "::1", "fe80::1", "::ffff:1.2.3.4", "255.255.255.255", "0.0.0.0")


def _source(fdp: atheris.FuzzedDataProvider) -> object:
    kind = fdp.ConsumeIntInRange(0, 15)
    if kind < 11:
        return (HOSTS[kind % len(HOSTS)], fdp.ConsumeIntInRange(0, 70000) if kind > 8 else fdp.ConsumeIntInRange(0, 9))
    if kind == 11:
        return (fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 60)), fdp.ConsumeIntInRange(-5, 5))
    if kind == 12:
        return ("::1%lo", 1)
    if kind == 13:
        return ("127.0.0.1", 1, 0, 0)
    if kind == 14:
        return (b"127.0.0.1", 1)
    return None


def _table(fdp: atheris.FuzzedDataProvider):  # type: ignore[no-untyped-def]
    if RATIONS and fdp.ConsumeIntInRange(0, 7):
        return RATIONS[fdp.ConsumeIntInRange(0, len(RATIONS) - 1)]
    kw = {"failure_rate": fdp.ConsumeRegularFloat(), "failure_burst": float(fdp.ConsumeIntInRange(0, 40)),
          "derive_rate": float(fdp.ConsumeIntInRange(0, 2000)), "derive_burst": fdp.ConsumeFloat(),
          "max_sources": number(fdp, fdp.ConsumeIntInRange(1, 64)), "seed": fdp.ConsumeIntInRange(0, 2**64 - 1)}
    for name in list(kw):
        if fdp.ConsumeIntInRange(0, 7) == 0:
            del kw[name]
    table = native.Ration(**kw)
    RATIONS.append(table)
    del RATIONS[:-8]
    return table


def ration(fdp: atheris.FuzzedDataProvider) -> None:
    """Ration's methods with fuzzed sources (IP and not, wrong types), times and counts (sometimes not finite):
    the table never holds more than its bound, and sources() lists exactly its entries."""
    table = _table(fdp)
    now = float(fdp.ConsumeIntInRange(0, 1000)) / 10
    for _ in range(fdp.ConsumeIntInRange(0, 64)):
        op = fdp.ConsumeIntInRange(0, 5)
        if fdp.ConsumeIntInRange(0, 7) == 0:
            now += fdp.ConsumeFloat() if fdp.ConsumeIntInRange(0, 3) == 0 else fdp.ConsumeIntInRange(0, 100) / 100
        src = _source(fdp)
        try:
            if op == 0:
                table.may_derive(src, now)
            elif op == 1:
                table.failed(src, now, fdp.ConsumeIntInRange(0, 50) if fdp.ConsumeIntInRange(0, 7) else
                             fdp.ConsumeFloat())
            elif op == 2:
                table.derive(now)
            elif op == 3:
                table.bucket(src)
            elif op == 4:
                table.bucket(None)
            else:
                table.failed(src, now)
        except ALLOWED:
            seen["Ration op refused"] += 1
    listed = table.sources()
    if len(listed) != len(table) or len(set(listed)) != len(listed):
        raise AssertionError(f"Ration lists {len(listed)} sources, holds {len(table)}")


def receive(fdp: atheris.FuzzedDataProvider) -> None:
    """recv_batch over datagrams of fuzzed sizes (empty, tiny, MTU-sized; GSO sends that arrive as GRO blocks)
    into an arena of a fuzzed size, with a fuzzed slot and datagram limit. Every block must lie in the arena and,
    where the slot holds every receive, the datagrams must be the ones sent, in order."""
    tx, rx = _sockets()
    dest = rx.getsockname()
    sent: list[bytes] = []
    biggest = 0
    for i in range(fdp.ConsumeIntInRange(0, 12)):
        if fdp.ConsumeIntInRange(0, 3) == 0:  # one GSO send: rows of one size, maybe a shorter last one
            size = fdp.ConsumeIntInRange(1, 1400)
            rows = [bytes([i, r % 256]) * (size // 2) + b"z" * (size % 2) for r in range(fdp.ConsumeIntInRange(2, 40))]
            if fdp.ConsumeBool():
                rows.append(b"t" * fdp.ConsumeIntInRange(1, size))
            try:
                tx.sendmsg([b"".join(rows)], [(17, 103, struct.pack("=H", size))], 0, dest)  # UDP_SEGMENT
            except OSError:
                continue
            sent += rows
            biggest = max(biggest, sum(map(len, rows)))
        elif fdp.ConsumeIntInRange(0, 2) == 0:  # a sealed header under a token of a few (screened, rationed)
            d = struct.pack("!3sBBQQ", b"PD\x02", 1, 1, fdp.ConsumeIntInRange(0, 3), fdp.ConsumeIntInRange(0, 9))
            d = (d + b"s" * fdp.ConsumeIntInRange(0, 1500))[: fdp.ConsumeIntInRange(0, 1521)]
            tx.sendto(d, dest)
            sent.append(d)
            biggest = max(biggest, len(d))
        else:
            d = bytes([i]) * fdp.ConsumeIntInRange(0, 1500)
            tx.sendto(d, dest)
            sent.append(d)
            biggest = max(biggest, len(d))
    arena_size = fdp.ConsumeIntInRange(0, 1 << 18) if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 4096)
    slot = number(fdp, 65536 if fdp.ConsumeBool() else fdp.ConsumeIntInRange(1, 4096))
    limit = number(fdp, fdp.ConsumeIntInRange(1, 2048))
    arena = buffer(fdp, arena_size)
    view = memoryview(arena).cast("B")
    screen = None
    if fdp.ConsumeIntInRange(0, 2) == 0:  # the junk screen: peek's constants (sometimes off), a few known tokens
        lead = b"PD\x02" if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 5))
        tokens = {fdp.ConsumeIntInRange(0, 2**64 - 1): None for _ in range(fdp.ConsumeIntInRange(0, 3))}
        screen = (lead, 3, 2, 1, 1, number(fdp, 37), tokens)
        if fdp.ConsumeIntInRange(0, 15) == 0:
            screen = screen[: fdp.ConsumeIntInRange(0, 6)]
    table = None
    shed = None
    limited = shed_count = 0
    try:  # (a Ration refused at construction leaves the socket empty too)
        if fdp.ConsumeIntInRange(0, 1):  # rationed in C: a Ration (or sometimes something else), at a fuzzed time
            table = _table(fdp) if fdp.ConsumeIntInRange(0, 15) else object()
            now = fdp.ConsumeIntInRange(0, 10000) / 100 if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeFloat()
        if fdp.ConsumeIntInRange(0, 2) == 0:  # an overloaded pass: keep a fuzzed number, fair shares
            shed = (number(fdp, fdp.ConsumeIntInRange(1, 64)), number(fdp, 512), 1, 2)
            if fdp.ConsumeBool():  # with protected tokens (never shed), a few of those sent; sometimes not a dict
                protected = ({fdp.ConsumeIntInRange(0, 3): None for _ in range(fdp.ConsumeIntInRange(0, 3))}
                             if fdp.ConsumeIntInRange(0, 15) else [0])
                shed = (*shed, protected)
            if table is None:
                table, now = None, 0.0
        arrivals = None
        if fdp.ConsumeIntInRange(0, 3) == 0:  # the kernel's receive times per source (sometimes malformed)
            arrivals = ({}, fdp.ConsumeIntInRange(0, 255)) if fdp.ConsumeIntInRange(0, 7) else ([], 300)
            if fdp.ConsumeBool() and isinstance(arrivals[0], dict):  # with a mask of the types that count
                arrivals = (*arrivals, fdp.ConsumeIntInRange(0, 2**64 - 1))
        out = _out(fdp, len(view))
        if screen is None and table is None and shed is None and arrivals is None and out is None:
            result = native.recv_batch(rx.fileno(), view, limit, slot)
        else:
            result = native.recv_batch(rx.fileno(), view, limit, slot, screen=screen, ration=table,
                                    now=now if table is not None else 0.0, shed=shed, arrivals=arrivals, out=out)
        blocks, used, datagrams, receives, drained, drops, screened = result  # (one shape, whatever the options)
        if screen is None and screened != ([], 0, 0, 0, 0, 0):
            raise AssertionError(f"screened {screened!r} without a screen")
        if arrivals is not None:
            seen["recv_batch arrivals"] += 1
            for source, when in arrivals[0].items():
                if not (isinstance(source, tuple) and isinstance(when, float) and when > 0):
                    raise AssertionError(f"arrivals: {source!r} -> {when!r}")
        if screen is not None:
            unknown, malformed, version, screened_bytes, limited, shed_count = screened
            if shed is not None:
                seen["recv_batch shed"] += 1
                seen["recv_batch shed protected"] += len(shed) > 4
                if shed_count > receives * 64 or shed_count < 0:
                    raise AssertionError(f"shed {shed_count} of {receives} receives")
            elif table is not None:
                seen["recv_batch rationed"] += 1
            if shed is None and shed_count != 0 or table is None and limited != 0:
                raise AssertionError(f"limited {limited}, shed {shed_count} without a ration or a shed")
            seen["recv_batch screened"] += 1
            for data, source in unknown:
                if source != tx.getsockname() or len(data) > used or data[4] & 1 == 0:
                    raise AssertionError(f"an unknown-token datagram of {len(data)} bytes from {source}")
            if min(malformed, version, screened_bytes, limited) < 0 or (
                    malformed + version + len(unknown) + limited > receives):
                raise AssertionError(f"screened {malformed}, {version}, {len(unknown)}, {limited} of {receives} "
                                     "receives")
    finally:
        for _ in range(100_000):  # leave the socket empty for the next input (bounded all the same)
            try:
                rx.recv(1 << 16)
            except BlockingIOError:
                break
    if not 0 <= used <= arena_size or receives > limit or datagrams < receives:
        raise AssertionError(f"used {used} of {arena_size}, {receives} receives, {datagrams} datagrams")
    got: list[bytes] = []
    end = 0
    for data, source, segment in blocks:
        if source != tx.getsockname() or len(data) > used or not 0 <= segment <= len(data):
            raise AssertionError(f"block of {len(data)} from {source}, segment {segment}, {used} used")
        end += len(data)
        got += [bytes(data[j : j + segment]) for j in range(0, len(data), segment)] if segment else [bytes(data)]
    if screen is not None:
        return  # blocks and unknown datagrams are interleaved in the arena: checked above
    if end != used if out is None else end > used:  # (with ``out`` a receive of over half a slot leaves a gap)
        raise AssertionError(f"blocks cover {end} bytes, {used} used")
    if slot >= biggest:
        seen["recv_batch exact"] += 1
        if got != sent[: len(got)] or (drained and len(got) != len(sent)):
            raise AssertionError(f"received {len(got)} datagrams other than the {len(sent)} sent")


_trio: tuple[list[socket.socket], socket.socket] | None = None


def _senders() -> tuple[list[socket.socket], socket.socket]:
    """Three senders and a non-blocking receiver on a loopback address of its own (127.0.0.2: unconnected, so
    all three reach it; no stray sender aims there), made once."""
    global _trio
    if _trio is None:
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind(("127.0.0.2", 0))
        rx.setblocking(False)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        txs = []
        for _ in range(3):
            tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tx.bind(("127.0.0.1", 0))
            txs.append(tx)
        _trio = txs, rx
    return _trio


def receive_interleaved(fdp: atheris.FuzzedDataProvider) -> None:
    """recv_batch with a screen over datagrams of three senders in a fuzzed interleaving: sealed under known or
    unknown tokens, of a few sizes, some truncated or junk, so that sessions' runs regroup (regroup_sessions) and
    are cut by other blocks of their source. Every block lies in the arena (or ``out``), and each source's rows come
    in the order that source sent them."""
    txs, rx = _senders()
    dest = rx.getsockname()
    sent: dict[int, list[bytes]] = {tx.getsockname()[1]: [] for tx in txs}
    known = {fdp.ConsumeIntInRange(0, 3): None for _ in range(fdp.ConsumeIntInRange(0, 3))}
    for i in range(fdp.ConsumeIntInRange(0, 60)):
        tx = txs[fdp.ConsumeIntInRange(0, 2)]
        kind = fdp.ConsumeIntInRange(0, 7)
        if kind == 0:  # junk of a fuzzed size
            d = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        else:
            size = (21, 60, 200, 1200)[fdp.ConsumeIntInRange(0, 3)]
            d = struct.pack("!3sBBQQ", b"PD\x02", 1, fdp.ConsumeIntInRange(0, 1), fdp.ConsumeIntInRange(0, 3), i)
            d = (d + bytes([i % 256]) * size)[:size]
        tx.sendto(d, dest)
        sent[tx.getsockname()[1]].append(d)
    arena = buffer(fdp, fdp.ConsumeIntInRange(0, 1 << 17))
    view = memoryview(arena).cast("B")
    slot = number(fdp, 2048 if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(1, 4096))
    limit = number(fdp, fdp.ConsumeIntInRange(1, 128))
    screen = (b"PD\x02", 3, 2, 1, 1, number(fdp, 37), known)
    out = _out(fdp, len(view))
    try:
        blocks, used, datagrams, receives, drained, drops, screened = native.recv_batch(
            rx.fileno(), view, limit, slot, screen=screen, out=out)
    finally:
        for _ in range(100_000):
            try:
                rx.recv(1 << 16)
            except BlockingIOError:
                break
    seen["recv_batch interleaved screened"] += 1
    if not 0 <= used <= len(arena) or receives > limit:
        raise AssertionError(f"used {used} of {len(arena)}, {receives} receives")
    rows: dict[int, list[bytes]] = {port: [] for port in sent}
    for data, source, segment in blocks:
        if source[1] not in rows or len(data) > used or not 0 <= segment <= len(data):
            raise AssertionError(f"block of {len(data)} from {source}, segment {segment}, {used} used")
        row = segment or len(data)
        rows[source[1]] += [bytes(data[j : j + row]) for j in range(0, len(data), row)] if row else [b""]
        seen["recv_batch interleaved merged"] += len(data) > row > 0
    if slot < 1300:
        return  # (cut datagrams: rows are not the ones sent)
    for port, got in rows.items():  # in the order sent: a subsequence of what the source sent
        it = iter(sent[port])
        if not all(any(g == d for d in it) for g in got):
            raise AssertionError(f"source {port}: rows out of the order they were sent")


def seal_split(fdp: atheris.FuzzedDataProvider, key: bytes) -> None:
    """Aead.seal_split (or frame_split): headers and bodies from two buffers, each layout right, nearly right or
    wild; a call accepted with the right layout must open back (open_block) to head || body, row by row."""
    rows = fdp.ConsumeIntInRange(0, 40)
    head_len = fdp.ConsumeIntInRange(0, 70) if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 70000)
    body_len = fdp.ConsumeIntInRange(0, 300) if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 12000)
    receiver = fdp.ConsumeBytes(32 if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 40))
    prefix = fdp.ConsumeBytes(13 if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 20))
    first = number(fdp, fdp.ConsumeIntInRange(1, 2**64 - 1))
    h_off, h_stride, h_size = layout(fdp, rows, head_len)
    s_off, s_stride, s_size = layout(fdp, rows, body_len)
    framed = fdp.ConsumeIntInRange(0, 3) == 0  # frame_split, the insecure twin
    width = HEADER + head_len + body_len + (0 if framed else TAG)
    o_off, o_stride, o_size = layout(fdp, rows, width)
    head, src, out = buffer(fdp, h_size), buffer(fdp, s_size), buffer(fdp, o_size)
    n_rows, n_head, n_body = number(fdp, rows), number(fdp, head_len), number(fdp, body_len)
    if framed:
        native.frame_split(prefix, first, n_rows, head, h_off, h_stride, n_head, src, s_off, s_stride, n_body, out,
                           o_off, o_stride)
        seen["frame_split ok"] += 1
        if (n_rows, n_head, n_body) == (rows, head_len, body_len):
            for i in range(rows):
                a, b, o = h_off + i * h_stride, s_off + i * s_stride, o_off + i * o_stride + HEADER
                if bytes(out[o : o + head_len + body_len]) != bytes(head[a : a + head_len]) + bytes(
                        src[b : b + body_len]):
                    raise AssertionError(f"frame_split row {i} holds other bytes than head || body")
        return
    aead = native.Aead(key, direct=fdp.ConsumeBool())  # the provider's own functions, or EVP
    aead.seal_split(prefix, first, n_rows, head, h_off, h_stride, n_head, src, s_off, s_stride, n_body, receiver, out,
                    o_off, o_stride)
    if (n_rows, n_head, n_body) != (rows, head_len, body_len) or rows == 0:
        return
    plain = head_len + body_len
    dst, mask = (ctypes.c_char * (rows * plain + 1))(), (ctypes.c_char * rows)(*([b"\x01"] * rows))
    failures = aead.open_block(out, o_off, o_stride, width, rows, receiver, dst, 0, plain, mask)
    seen["seal_split round trip"] += 1
    for i in range(rows):
        a, b = h_off + i * h_stride, s_off + i * s_stride
        want = bytes(head[a : a + head_len]) + bytes(src[b : b + body_len])
        if failures or bytes(dst[i * plain : (i + 1) * plain]) != want:
            raise AssertionError(f"seal_split row {i} opened to other bytes than head || body ({failures} failed)")


def _body_size(bits: int, group: int, count: int) -> int:
    return 4 * -(-count // group) + (count if bits == 8 else (count + 1) // 2)


def _decoded(values: ctypes.Array, ok: ctypes.Array, rows: int, count: int) -> None:
    """Every row decode_row marked valid holds finite values; every other row holds zeros."""
    v = np.frombuffer(values, np.float32, rows * count).reshape(rows, count)
    for i in range(rows):
        if ok[i] == b"\x01":
            if not np.isfinite(v[i]).all():
                raise AssertionError(f"row {i}: a valid body decoded to a non-finite value")
        elif ok[i] != b"\x00" or v[i].any():
            raise AssertionError(f"row {i}: an invalid body is not zeros (ok {ok[i]!r})")


def quant(fdp: atheris.FuzzedDataProvider, encode: bool) -> None:
    """int8/int4 bodies: quant_encode over float32 rows (any bits: NaN and inf give 1 or 2, huge values fp16's
    edges), and quant_decode over arbitrary bodies, strided or a 2-D view; what an exact call encodes decodes
    valid, and quant_decode's rows are finite where valid, zero where not."""
    bits = 8 if fdp.ConsumeBool() else 4
    group = fdp.ConsumeIntInRange(1, 300)
    count = fdp.ConsumeIntInRange(1, 700)
    rows = fdp.ConsumeIntInRange(0, 12)
    body = _body_size(bits, group, count)
    n_rows, n_count, n_group = number(fdp, rows), number(fdp, count), number(fdp, group)
    if encode:
        values = buffer(fdp, max(0, min(number(fdp, 4 * rows * count), 1 << 20)))
        if fdp.ConsumeBool():  # moderate finite values: exponents below 0x47 (|x| < 65536)
            raw = np.frombuffer(values, np.uint8)
            raw[3::4] &= 0x43
        out = buffer(fdp, max(0, min(number(fdp, rows * body), 1 << 20)))
        offset = number(fdp, fdp.ConsumeIntInRange(0, 2**32))
        why = native.quant_encode(values, n_rows, n_count, out, bits, n_group, fdp.ConsumeBool(),
                                  fdp.ConsumeIntInRange(0, 2**64 - 1), offset)
        if why not in (0, 1, 2):
            raise AssertionError(f"quant_encode returned {why}")
        if why or (n_rows, n_count, n_group) != (rows, count, group) or len(out) != rows * body or not rows:
            return
        dec, ok = buffer(fdp, 4 * rows * count), (ctypes.c_char * rows)()
        native.quant_decode(out, 0, body, rows, count, bits, group, dec, ok)
        _decoded(dec, ok, rows, count)
        if any(ok[i] != b"\x01" for i in range(rows)):
            raise AssertionError("a body quant_encode made does not decode as valid")
        seen["quant round trip"] += 1
        return
    off, stride, size = layout(fdp, rows, body)
    src = buffer(fdp, size)
    rows_of = src
    if fdp.ConsumeBool() and rows and stride >= body and off >= 0 and off + rows * stride <= size:
        rows_of = np.frombuffer(src, np.uint8)[off : off + rows * stride].reshape(rows, stride)[:, :body]
        off = 0
    values = buffer(fdp, max(0, min(number(fdp, 4 * rows * count), 1 << 20)))
    ok = buffer(fdp, max(0, min(number(fdp, rows), 1 << 20)))
    native.quant_decode(rows_of, off, stride, n_rows, n_count, bits, n_group, values, ok)
    if (n_rows, n_count, n_group) == (rows, count, group):
        _decoded(values, ok, rows, count)


def half(fdp: atheris.FuzzedDataProvider, encode: bool) -> None:
    """fp16 (F16C or scalar) and bf16 bodies: half_encode over any float32 bits (1 exactly where a value rounds to
    inf), half_decode over any bodies; what an exact call encodes decodes back valid."""
    rows, count = fdp.ConsumeIntInRange(0, 8), fdp.ConsumeIntInRange(1, 400)
    bf16, scalar = fdp.ConsumeBool(), fdp.ConsumeBool()
    n_rows, n_count = number(fdp, rows), number(fdp, count)
    if encode:
        values = buffer(fdp, max(0, min(number(fdp, 4 * rows * count), 1 << 20)))
        if fdp.ConsumeBool():  # values fp16 holds (|x| < 2048, and ones that round to zero or subnormals)
            np.frombuffer(values, np.uint8)[3::4] &= 0xC4
        out = buffer(fdp, max(0, min(number(fdp, 2 * rows * count), 1 << 20)))
        n = number(fdp, rows * count)
        over = native.half_encode(values, n, out, bf16, scalar)
        if (n, len(values), len(out)) != (rows * count, 4 * rows * count, 2 * rows * count) or not rows:
            return
        x = np.frombuffer(values, np.float32)
        if bf16:  # the top half after rounding to nearest even has an all-ones exponent
            u = x.view(np.uint32).astype(np.uint64)
            beyond = bool(((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0x7F80) == 0x7F80).any())
        else:
            beyond = bool((~np.isfinite(x) | (np.abs(x) >= 65520)).any())
        if over != beyond:
            raise AssertionError(f"half_encode said {over}, a value beyond fp16: {beyond}")
        if over:
            return
        dec, ok = buffer(fdp, 4 * rows * count), (ctypes.c_char * rows)()
        native.half_decode(out, 0, 2 * count, rows, count, dec, ok, bf16, scalar)
        _decoded(dec, ok, rows, count)
        if any(ok[i] != b"\x01" for i in range(rows)):
            raise AssertionError("a body half_encode made does not decode as valid")
        seen["half round trip"] += 1
        return
    off, stride, size = layout(fdp, rows, 2 * count)
    src = buffer(fdp, size)
    values = buffer(fdp, max(0, min(number(fdp, 4 * rows * count), 1 << 20)))
    ok = buffer(fdp, max(0, min(number(fdp, rows), 1 << 20)))
    native.half_decode(src, off, stride, n_rows, n_count, values, ok, bf16, scalar)
    if (n_rows, n_count) == (rows, count):
        _decoded(values, ok, rows, count)


def accumulate(fdp: atheris.FuzzedDataProvider) -> None:
    """accumulate_rows: float32 rows (any bits) added into a float32 buffer at fuzzed range indices (in bounds,
    next to them or wild), with a ``filled`` byte per range; a row reported added must have set its range's byte."""
    rows = fdp.ConsumeIntInRange(0, 40)
    length = 4 * fdp.ConsumeIntInRange(0, 40) + (0 if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(1, 3))
    s_off, s_stride, s_size = layout(fdp, rows, length)
    src = buffer(fdp, s_size)
    nranges = fdp.ConsumeIntInRange(0, 50)
    d_stride = number(fdp, length + 4 * fdp.ConsumeIntInRange(0, 3))
    dst = buffer(fdp, max(0, min(number(fdp, nranges * max(0, d_stride)), 1 << 20)))
    dst_of = memoryview(dst).cast("B")[1:] if fdp.ConsumeIntInRange(0, 15) == 0 else dst  # misaligned now and then
    filled = buffer(fdp, max(0, min(number(fdp, nranges), 1 << 20)))
    wild = fdp.ConsumeIntInRange(0, 7) == 0  # now and then an index next to the bounds or far out
    ks = [fdp.ConsumeIntInRange(0, max(0, nranges - 1)) for _ in range(number(fdp, rows) % 64)]
    ks = [number(fdp, k) for k in ks] if wild else ks
    packed = struct.pack(f"<{len(ks)}q", *ks) if all(-(2**63) <= k < 2**63 for k in ks) else b""
    factor = struct.unpack("<f", fdp.ConsumeBytes(4).ljust(4, b"\0"))[0]
    status = native.accumulate_rows(src, s_off, s_stride, number(fdp, rows), number(fdp, length), dst_of, d_stride,
                                    packed, filled, factor)
    for k, st in zip(ks, status, strict=True):
        if st not in (0, 1, 2) or (st == 0 and filled[k] != b"\x01"):
            raise AssertionError(f"accumulate_rows: status {st} for range {k}, filled {filled[k]!r}")


def send_rows(fdp: atheris.FuzzedDataProvider) -> None:
    """send_rows from the loopback pair's sender to its receiver: rows, counts, sizes, GSO runs and the packed
    address right or wild. Where all is right, the receiver gets exactly the rows, in order; the receiver is
    drained either way (the receive entries expect only their own traffic)."""
    tx, rx = _sockets()
    rows = fdp.ConsumeIntInRange(0, 80)
    size = fdp.ConsumeIntInRange(1, 1300) if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 70000)
    s_off, s_stride, s_size = layout(fdp, rows, size)
    src = buffer(fdp, min(s_size, 4 << 20))
    segment = number(fdp, fdp.ConsumeIntInRange(1, max(1, min(64, 65000 // max(1, size)))))
    host, port = rx.getsockname()
    right_addr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(host) + bytes(8)
    kind = fdp.ConsumeIntInRange(0, 15)
    addr = (right_addr if kind < 12 else right_addr[: fdp.ConsumeIntInRange(0, 15)] if kind == 12
            else struct.pack("=H", socket.AF_INET6) + bytes(26) if kind == 13 else fdp.ConsumeBytes(28))
    gso = fdp.ConsumeIntInRange(0, 3) != 0
    n_rows = number(fdp, rows)
    fd = tx.fileno() if fdp.ConsumeIntInRange(0, 15) else number(fdp, -1)
    right = (addr == right_addr and n_rows == rows and fd == tx.fileno() and s_off >= 0 and s_stride >= size
             and s_off + max(0, rows - 1) * s_stride + size <= len(src) and 1 <= segment <= 64
             and segment * size <= 65507 and size <= 65507)
    try:
        sent, calls, err = native.send_rows(fd, src, s_off, s_stride, n_rows, size, segment, addr, gso)
        if not (0 <= sent <= max(0, n_rows) and calls >= 0 and err >= 0):
            raise AssertionError(f"send_rows returned {(sent, calls, err)} for {n_rows} rows")
        if right and (sent, err) != (rows, 0):
            raise AssertionError(f"send_rows sent {sent} of {rows} rows (errno {err}) on an idle loopback socket")
    finally:
        got = bytearray()
        try:
            while True:
                got += rx.recv(1 << 16)
        except BlockingIOError:
            pass
    if right:
        want = b"".join(bytes(src[s_off + i * s_stride : s_off + i * s_stride + size]) for i in range(rows))
        if bytes(got) != want:
            raise AssertionError("send_rows: the receiver did not get the rows sent, in order")
        seen["send_rows compared"] += 1


def finalize(fdp: atheris.FuzzedDataProvider) -> None:
    """finalize_rows over fuzzed buffers (lengths right, short or wild; out in place, apart, or overlapping): where
    the layout is right it must write what finalize_f32 (the reference) computes, or nothing when that is None."""
    rows, width = fdp.ConsumeIntInRange(0, 12), fdp.ConsumeIntInRange(0, 40)
    n = rows * width

    def floats(count: int) -> ctypes.Array:
        count = min(max(0, count), 4096)  # (a wild count: a short buffer, not a wild allocation)
        buf = buffer(fdp, 4 * count)
        if fdp.ConsumeIntInRange(0, 3) == 0:  # mostly plain numbers; now and then the raw bytes (NaN, inf, huge)
            values = np.frombuffer(fdp.ConsumeBytes(4 * count).ljust(4 * count, b"\0"), np.uint8)
            ctypes.memmove(buf, values.tobytes(), len(values))
        else:
            vals = np.array([fdp.ConsumeIntInRange(-1000, 1000) / 8 for _ in range(count)], np.float32)
            ctypes.memmove(buf, vals.tobytes(), vals.nbytes)
        return buf

    own = floats(number(fdp, n))
    acc = floats(number(fdp, n))
    summed = buffer(fdp, min(max(0, number(fdp, rows)), 4096))
    got = buffer(fdp, 8 * min(max(0, number(fdp, rows)), 4096))
    weight = fdp.ConsumeRegularFloat() if fdp.ConsumeIntInRange(0, 7) == 0 else fdp.ConsumeIntInRange(1, 8) / 2
    where = fdp.ConsumeIntInRange(0, 7)
    out = own if where == 0 else floats(number(fdp, n))
    n_rows, n_width = number(fdp, rows), number(fdp, width)
    right = (n_rows == rows and n_width == width and len(own) >= 4 * n and len(acc) >= 4 * n and len(out) >= 4 * n
             and len(summed) >= rows and len(got) >= 8 * rows)
    if right:
        own_a = np.frombuffer(bytes(own), np.float32)[:n].reshape(rows, width)
        acc_a = np.frombuffer(bytes(acc), np.float32)[:n].reshape(rows, width)
        want = finalize_f32(own_a.copy(), acc_a, np.frombuffer(bytes(summed), np.uint8)[:rows],
                             np.frombuffer(bytes(got), np.float64)[:rows], weight)
        before = bytes(out)
    with np.errstate(all="ignore"):
        ok = native.finalize_rows(own, acc, summed, got, weight, out, n_rows, n_width)
    if right:
        written = np.frombuffer(bytes(out), np.float32)[:n].reshape(rows, width)
        if ok != (want is not None) or (want is None and bytes(out) != before) or (
                want is not None and written.tobytes() != want.tobytes()):
            raise AssertionError("finalize_rows disagrees with finalize_f32")
        seen["finalize compared"] += 1


def lead(fdp: atheris.FuzzedDataProvider) -> None:
    """same_lead over fuzzed rows (layouts right or wild; rows alike or one differing): where the layout is right it
    must say what comparing the bytes in Python says."""
    rows, length = fdp.ConsumeIntInRange(0, 40), fdp.ConsumeIntInRange(0, 30)
    s_off, s_stride, s_size = layout(fdp, rows, length)
    src = buffer(fdp, s_size)
    if fdp.ConsumeBool() and rows and s_stride > 0 and s_off >= 0:  # alike, but for a byte now and then
        for i in range(1, rows):
            at = s_off + i * s_stride
            if at >= 0 and at + length <= s_size and s_off + length <= s_size:
                ctypes.memmove(ctypes.addressof(src) + at, ctypes.addressof(src) + s_off, length)
        if fdp.ConsumeBool() and s_off + (rows - 1) * s_stride + length <= s_size and length:
            src[s_off + (rows - 1) * s_stride + fdp.ConsumeIntInRange(0, length - 1)] = b"\x01"
    n_rows, n_length = number(fdp, rows), number(fdp, length)
    got = native.same_lead(src, s_off, s_stride, n_rows, n_length)
    if (n_rows == rows and n_length == length and s_off >= 0 and s_stride >= length
            and s_off + max(0, rows - 1) * s_stride + length <= s_size):
        raw = bytes(src)
        want = all(raw[s_off + i * s_stride : s_off + i * s_stride + length] == raw[s_off : s_off + length]
                   for i in range(rows))
        if got != want:
            raise AssertionError("same_lead disagrees with comparing the bytes")
        seen["same_lead compared"] += 1


def take(fdp: atheris.FuzzedDataProvider, coded: bool = False) -> None:
    """take_rows (fp32) or take_coded (int8, int4: ``coded``) over a block of DATA bodies that is mostly a clean run
    (so the writing half runs), with a header byte, a weight, a value, a scale or an offset now and then wrong, and
    the buffers it writes (seen, sums or result, filled, wsum, status) of exact, short or wild sizes. Where it takes
    the block: every row is counted once, as new or a duplicate, and every status is one it may give."""
    rows, per = fdp.ConsumeIntInRange(0, 30), fdp.ConsumeIntInRange(0, 40)
    full, mode = fdp.ConsumeIntInRange(0, 80), fdp.ConsumeIntInRange(0, 2) % 2 if fdp.ConsumeIntInRange(0, 15) else 5
    start = fdp.ConsumeIntInRange(0, 100)
    bits = (8, 4)[fdp.ConsumeIntInRange(0, 1)] if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 9)
    qgroup = fdp.ConsumeIntInRange(1, 40) if fdp.ConsumeIntInRange(0, 15) else number(fdp, 1 << 16)
    body = _body_size(bits, max(1, qgroup), per) if coded and bits in (8, 4) and per else 4 * per
    width = 19 + body
    exact = fdp.ConsumeIntInRange(0, 3) != 0  # (else each count and size below may be off: where bounds go wrong)

    def num(right: int) -> int:
        return right if exact else number(fdp, right)

    if exact:
        s_off, s_stride = fdp.ConsumeIntInRange(0, 16), width + fdp.ConsumeIntInRange(0, 16)
        s_size = s_off + max(0, rows - 1) * s_stride + width
    else:
        s_off, s_stride, s_size = layout(fdp, rows, width)
    src = buffer(fdp, s_size)
    ks = [fdp.ConsumeIntInRange(0, 3)]  # rising, with gaps now and then (a lossy path's block)
    for _ in range(rows - 1):
        ks.append(ks[-1] + (1 if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 3)))
    weight = 1.0 if fdp.ConsumeIntInRange(0, 7) else [2.5, 0.0, -1.0, float("nan")][fdp.ConsumeIntInRange(0, 3)]
    for i, k in enumerate(ks):  # a run: the same header but for the offset
        at = s_off + i * s_stride
        if at >= 0 and at + 19 <= s_size:
            head = struct.pack("<IBIIHf", 7, 0, full, (start + k * per) & 0xFFFFFFFF, per & 0xFFFF, weight)
            ctypes.memmove(ctypes.addressof(src) + at, head, 19)
            if coded and qgroup > 0 and at + width <= s_size:  # every group's scale 1.0 and min 0: a body that decodes
                for g in range(-(-per // qgroup)):
                    ctypes.memmove(ctypes.addressof(src) + at + 19 + 4 * g, b"\x00\x3c\x00\x00", 4)
    if rows and fdp.ConsumeIntInRange(0, 3) == 0 and s_size:  # one byte wrong somewhere
        src[fdp.ConsumeIntInRange(0, s_size - 1)] = bytes([fdp.ConsumeIntInRange(0, 255)])
    rows_of = src
    if fdp.ConsumeBool() and rows and s_stride >= width and s_off >= 0 and s_off + rows * s_stride <= s_size:
        rows_of = np.frombuffer(src, np.uint8)[s_off : s_off + rows * s_stride].reshape(rows, s_stride)[:, :width]
    elif s_off:
        rows_of = memoryview(src).cast("B")[min(s_off, s_size):]
    seen_buf = buffer(fdp, max(0, min(num(full), 1 << 16)))
    base = fdp.ConsumeIntInRange(0, 20) if mode == 1 else 0
    dst = buffer(fdp, max(0, min(num(4 * (base + full * per)), 1 << 20)))
    filled = buffer(fdp, max(0, min(num(full), 1 << 16)))
    wsum = (ctypes.c_double * max(0, min(num(full), 1 << 16)))()
    status = buffer(fdp, max(0, min(num(rows), 1 << 16)))
    known = float("nan") if fdp.ConsumeBool() else [1.0, 2.5][fdp.ConsumeIntInRange(0, 1)]
    n_rows = num(rows)
    if coded:
        got = native.take_coded(rows_of, num(s_stride), n_rows, mode=mode, group=7, codec=0, per=num(per), total=full,
                                start=start, full=num(full), known=known, bits=bits, qgroup=qgroup, seen=seen_buf,
                                dst=dst, dst_base=num(base), status=status)
        if got is None:
            seen["take_coded declined"] += 1
            return
        accepted, duplicates, k_last, _, _, odd = got
        if accepted + duplicates != n_rows or not -1 <= k_last < full or odd:
            raise AssertionError(f"take_coded: {got} for {n_rows} rows, {full} ranges")
        if any(status[i][0] not in (0, 3) for i in range(n_rows)):
            raise AssertionError("take_coded: a status it may not give")
        seen["take_coded took"] += 1
        return
    got = native.take_rows(rows_of, num(s_stride), n_rows, mode=mode, group=7, codec=0, per=num(per), total=full,
                           start=start, full=num(full), known=known, max_weight=1e9, seen=seen_buf, dst=dst,
                           dst_base=num(base), filled=filled, wsum=wsum, status=status)
    if got is None:
        seen["take_rows declined"] += 1
        return
    accepted, duplicates, k_last, _, _, odd = got
    if accepted + duplicates != n_rows or not -1 <= k_last < full or odd > accepted:
        raise AssertionError(f"take_rows: {got} for {n_rows} rows, {full} ranges")
    if any(status[i][0] > 3 for i in range(n_rows)):
        raise AssertionError("take_rows: a status it may not give")
    seen["take_rows took"] += 1


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
