"""The C receive pass (peerd._dataplane._native.recv_batch) against the Python loop it replaces: the same traffic
gives the same blocks, sources, segment sizes and counts (GRO blocks, IPv4 and IPv6, tiny and empty datagrams, the
datagram and arena limits), and every bound is checked."""

from __future__ import annotations

import errno
import inspect
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import trio

from peerd.metrics import Metrics
from peerd.transport.core import TransportCore
from peerd.transport.endpoint import Endpoint
from peerd.transport.guard import AuthLimiter
from peerd.transport.udp import NATIVE_RECV, RECV_BUFFER, UdpSocket
from peerd.wire import Identity
from peerd.wire import messages as m
from peerd.wire.envelope import FLAG_NO_RECEIVER, FLAG_SEALED, HEADER, MAGIC, VERSION
from peerd.wire.native import native

from .support.sockets import bind_loopback, loopback_pair, merge_prefix  # noqa: E402
from .support.virtual import counter_value  # noqa: E402

NOTHING_SCREENED = ([], 0, 0, 0, 0, 0)  # recv_batch's ``screened`` of a pass with nothing screened
pytestmark = pytest.mark.skipif(NATIVE_RECV is None, reason="the native extension (recv_batch) is not built")
RATION = getattr(native, "Ration", None)


def _has_ipv6() -> bool:
    try:
        bind_loopback(socket.AF_INET6).close()
        return True
    except OSError:
        return False


FAMILIES = [socket.AF_INET] + ([socket.AF_INET6] if _has_ipv6() else [])


def _traffic(rng: np.random.Generator) -> list[tuple[int, str, bytes | list[bytes]]]:
    """(sender, kind, payload): GSO blocks of several streams (and a short last row), single datagrams of many sizes,
    tiny ones (shorter than the merge prefix) and empty ones, from two senders, interleaved."""
    plan: list[tuple[int, str, bytes | list[bytes]]] = []
    a, b = merge_prefix(0x40, 1), merge_prefix(0x41, 7)
    for step in range(40):
        sender = int(rng.integers(0, 2))
        kind = int(rng.integers(0, 6))
        if kind == 0:  # a GSO block of one stream: rows of one size, sometimes a shorter last one
            size = int(rng.integers(40, 1400))
            rows = [a + rng.bytes(size - len(a)) for _ in range(int(rng.integers(2, 30)))]
            if rng.integers(0, 2):
                rows.append(a + rng.bytes(int(rng.integers(0, size - len(a)))))
            plan.append((sender, "block", rows))
        elif kind == 1:  # several single datagrams of one stream, one size: they merge
            size = int(rng.integers(30, 1200))
            for _ in range(int(rng.integers(1, 6))):
                plan.append((sender, "one", b + rng.bytes(size - len(b))))
        elif kind == 2:  # tiny: shorter than the 13 bytes merges compare
            n = int(rng.integers(1, 13))
            for _ in range(int(rng.integers(1, 4))):
                plan.append((sender, "one", bytes([step % 3]) * n))
        elif kind == 3:
            plan.append((sender, "one", b""))
        else:
            plan.append((sender, "one", rng.bytes(int(rng.integers(1, 1500)))))
    return plan


async def _send(plan: list, senders: list[UdpSocket], dest: tuple) -> int:
    count = 0
    for sender, kind, payload in plan:
        if kind == "block":
            await senders[sender].send_many(payload, dest)  # type: ignore[arg-type]
            count += len(payload)
        else:
            await senders[sender].sendto(payload, dest)  # type: ignore[arg-type]
            count += 1
    return count


async def _passes(rx: UdpSocket, expected: int, limit: int) -> list[list[tuple[bytes, tuple, int]]]:
    passes: list[list[tuple[bytes, tuple, int]]] = []
    with trio.fail_after(10):
        while rx.received < expected:
            passes.append([(bytes(d), src, seg) for d, src, seg in await rx.recv_blocks(limit)])
    return passes


def _flat(passes: list[list[tuple[bytes, tuple, int]]]) -> list[tuple[bytes, tuple]]:
    out = []
    for p in passes:
        for data, src, seg in p:
            if seg:
                out += [(data[i : i + seg], src) for i in range(0, len(data), seg)]
            else:
                out.append((data, src))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("limit", "arena"), [(4096, 16 * RECV_BUFFER), (7, 16 * RECV_BUFFER), (4096, 2 * RECV_BUFFER)])
def test_native_and_python_passes_agree(family: int, limit: int, arena: int) -> None:
    """The same traffic, queued whole, to a socket read by the C pass and one read by the Python loop: the same
    passes (blocks, bytes, sources, segment sizes), the same counts; and the datagrams are the ones sent."""
    async def main() -> None:
        senders = [UdpSocket(bind_loopback(family), buffer_bytes=4 << 20) for _ in range(2)]
        native = UdpSocket(bind_loopback(family), buffer_bytes=8 << 20, arena_bytes=arena, native_receive=True)
        python = UdpSocket(bind_loopback(family), buffer_bytes=8 << 20, arena_bytes=arena, native_receive=False)
        try:
            plan = _traffic(np.random.default_rng(limit + arena + family))
            n = await _send(plan, senders, native.getsockname())
            assert await _send(plan, senders, python.getsockname()) == n
            await trio.sleep(0.05)
            got_native = await _passes(native, n, limit)
            got_python = await _passes(python, n, limit)
            sent: list[tuple[bytes, tuple]] = []
            for sender, kind, payload in plan:
                src = senders[sender].getsockname()
                sent += [(d, src) for d in payload] if kind == "block" else [(payload, src)]  # type: ignore[misc]
            assert _flat(got_native) == sent
            if limit >= 64:  # passes end at the same receive (the arena, or the socket running empty)
                assert got_native == got_python
                assert native.receive_passes == python.receive_passes
            else:  # a recvmmsg of up to ``limit - taken`` receives may pass the limit by its GRO blocks' segments
                assert _flat(got_python) == sent
                assert len(got_native) > 1 and native.receive_passes == len(got_native)
                assert all(sum(-(-len(d) // s) if s else 1 for d, _, s in p) <= 64 * limit for p in got_native)
            assert native.received == python.received == n
            assert native.receive_calls == python.receive_calls
            if family == socket.AF_INET6:
                assert all(len(src) == 2 and ":" in src[0] for _, src in sent)
            if native.gro:
                assert any(seg for p in got_native for _, _, seg in p)  # GRO blocks were received whole
            assert native.kernel_drops == python.kernel_drops == 0
            if limit >= 64:  # (7: whether the last pass ended at its limit or at the empty socket depends on where)
                assert native.drained and python.drained
        finally:
            for s in [*senders, native, python]:
                s.close()

    trio.run(main)


def test_a_pass_stops_at_its_limit_and_says_it_was_not_drained() -> None:
    with loopback_pair() as (a, b):
        for i in range(30):
            a.sendto(bytes([i]) * (20 + i), b.getsockname())
        arena = memoryview(bytearray(4 * RECV_BUFFER))
        blocks, used, datagrams, receives, drained, drops, _ = NATIVE_RECV(b.fileno(), arena, 10, RECV_BUFFER)
        assert (len(blocks), datagrams, receives, drained) == (10, 10, 10, False)
        assert used == sum(20 + i for i in range(10))
        assert [bytes(d) for d, _, _ in blocks] == [bytes([i]) * (20 + i) for i in range(10)]
        assert {src for _, src, _ in blocks} == {a.getsockname()}
        blocks, used, datagrams, receives, drained, drops, _ = NATIVE_RECV(b.fileno(), arena, 1024, RECV_BUFFER)
        assert (len(blocks), datagrams, drained) == (20, 20, True)
        assert NATIVE_RECV(b.fileno(), arena, 1024, RECV_BUFFER) == ([], 0, 0, 0, True, -1, NOTHING_SCREENED)


def test_slots_are_bounded_by_the_arena() -> None:
    """With room for only two slots, a pass takes two receives (even of tiny datagrams) and stops, not drained."""
    with loopback_pair() as (a, b):
        for i in range(5):
            a.sendto(bytes([i]) * 100, b.getsockname())
        arena = memoryview(bytearray(2 * 1000 + 999))
        blocks, used, datagrams, receives, drained, _, _ = NATIVE_RECV(b.fileno(), arena, 1024, 1000)
        # slots of 1000 bytes: 2 fit at first; after 200 bytes of data, (2999 - 200) // 1000 = 2 more; then 1 more
        assert receives == 5 and used == 500 and drained
        arena = memoryview(bytearray(1000))
        for i in range(3):
            a.sendto(bytes([i]) * 600, b.getsockname())
        blocks, used, datagrams, receives, drained, _, _ = NATIVE_RECV(b.fileno(), arena, 1024, 1000)
        assert receives == 1 and used == 600 and not drained  # 400 bytes left: no room for another slot
        assert bytes(blocks[0][0]) == bytes([0]) * 600


def test_a_datagram_longer_than_its_slot_is_cut_as_recvmsg_cuts_it() -> None:
    with loopback_pair() as (a, b):
        a.sendto(b"x" * 3000, b.getsockname())
        a.sendto(b"y" * 10, b.getsockname())
        arena = memoryview(bytearray(8192))
        blocks, used, *_ = NATIVE_RECV(b.fileno(), arena, 16, 1024)
        assert [bytes(d) for d, _, _ in blocks] == [b"x" * 1024, b"y" * 10] and used == 1034


def test_icmp_errors_end_a_pass_without_raising() -> None:
    """A connected socket learns of an unreachable port from ICMP: the pass ends, not drained, nothing raised
    (the Python loop ignores ECONNREFUSED the same way)."""
    closed = bind_loopback(socket.AF_INET)
    port = closed.getsockname()
    closed.close()
    s = bind_loopback(socket.AF_INET)
    s.setblocking(False)
    try:
        s.connect(port)
        s.send(b"ping")
        arena = memoryview(bytearray(RECV_BUFFER))
        for _ in range(100):  # the ICMP error arrives asynchronously (loopback: at once)
            got = NATIVE_RECV(s.fileno(), arena, 16, RECV_BUFFER)
            if not got[4]:
                break
        assert got == ([], 0, 0, 0, False, -1, NOTHING_SCREENED)
        assert NATIVE_RECV(s.fileno(), arena, 16, RECV_BUFFER) == ([], 0, 0, 0, True, -1, NOTHING_SCREENED)  # consumed
    finally:
        s.close()


def test_arguments_are_checked() -> None:
    s = bind_loopback(socket.AF_INET)
    s.setblocking(False)
    arena = memoryview(bytearray(RECV_BUFFER))
    try:
        with pytest.raises(ValueError, match="fd"):
            NATIVE_RECV(-1, arena, 16, RECV_BUFFER)
        for bad in (0, -5, 65537):
            with pytest.raises(ValueError, match="max_datagrams"):
                NATIVE_RECV(s.fileno(), arena, bad, RECV_BUFFER)
        for bad in (0, -1, (1 << 20) + 1):
            with pytest.raises(ValueError, match="slot"):
                NATIVE_RECV(s.fileno(), arena, 16, bad)
        with pytest.raises(ValueError, match="holds no slot"):
            NATIVE_RECV(s.fileno(), memoryview(bytearray(100)), 16, RECV_BUFFER)
        with pytest.raises((TypeError, BufferError)):
            NATIVE_RECV(s.fileno(), b"\0" * RECV_BUFFER, 16, RECV_BUFFER)  # read-only
        whole = memoryview(bytearray(3 * RECV_BUFFER))
        for bad_out in (memoryview(bytearray(RECV_BUFFER - 1)), whole[RECV_BUFFER // 2 :]):  # short; overlapping
            with pytest.raises(ValueError, match="out"):
                NATIVE_RECV(s.fileno(), whole[: 2 * RECV_BUFFER], 16, RECV_BUFFER, out=bad_out)
        with pytest.raises((TypeError, BufferError)):
            NATIVE_RECV(s.fileno(), arena, 16, RECV_BUFFER, out=b"\0" * RECV_BUFFER)
        r, w = os.pipe()
        try:
            with pytest.raises(OSError) as e:
                NATIVE_RECV(r, arena, 16, RECV_BUFFER)
            assert e.value.errno == errno.ENOTSOCK
        finally:
            os.close(r)
            os.close(w)
    finally:
        s.close()


def test_kernel_drops_are_read_from_the_ancillary_data() -> None:
    """A small receive buffer overflows; both paths report SO_RXQ_OVFL's count (carried by the next datagram
    queued), and what was received plus what the kernel dropped is what was sent."""
    async def main() -> None:
        for native_receive in (True, False):
            tx = UdpSocket(bind_loopback(socket.AF_INET), gso=False, buffer_bytes=4 << 20)
            rx = UdpSocket(bind_loopback(socket.AF_INET), gso=False, buffer_bytes=16384, native_receive=native_receive)
            try:
                if not rx.caps.kernel_drops:
                    pytest.skip("no SO_RXQ_OVFL")
                for i in range(300):
                    await tx.sendto(bytes([i % 256]) * 1000, rx.getsockname())
                await trio.sleep(0.05)
                while True:
                    await rx.recv_blocks(1024)
                    if rx.drained:
                        break
                # the count rides on datagrams queued after the drops: one more, once there is room
                await tx.sendto(b"late", rx.getsockname())
                with trio.fail_after(5):
                    while not any(bytes(d) == b"late" for d, _, _ in await rx.recv_blocks(1024)):
                        pass
                assert rx.kernel_drops > 0
                assert rx.received + rx.kernel_drops == 301
            finally:
                tx.close()
                rx.close()

    trio.run(main)


def test_the_native_pass_is_the_default_and_the_python_loop_can_be_forced() -> None:
    s = bind_loopback(socket.AF_INET)
    try:
        assert UdpSocket(s)._native_recv is NATIVE_RECV
        assert UdpSocket(s, native_receive=False)._native_recv is None
    finally:
        s.close()
    for env in ({"PEERD_NATIVE_RECV": "0"}, {"PEERD_DATAPLANE": "python"}):
        code = "import peerd.transport.udp as u; assert u.NATIVE_RECV is None, u.NATIVE_RECV"
        assert subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}).returncode == 0


# -- the endpoint's junk screen (the native pass's ``screen``) against the Python triage ---------------------------
SECRET = bytes(range(32))


def _dropped(ep) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {s.labels["reason"]: s.value for mm in ep.metrics.datagrams_dropped.collect() for s in mm.samples
            if s.name.endswith("_total")}


def _junk(rng: random.Random) -> list[bytes]:
    """Every kind the screen sorts: bad magic, bad version, unknown flags, FLAG_NO_RECEIVER on a non-PING, too
    short for a header, empty; sealed under unknown tokens (long: rationed; short: malformed); unsealed under an
    unknown token (refused as auth, counted against the source); a known member's token with a forged tag."""
    out: list[bytes] = []
    for i in range(300):
        kind = i % 9
        token, seq = rng.getrandbits(64), rng.getrandbits(64)
        if kind == 0:
            out.append(b"XX" + rng.randbytes(rng.randrange(0, 200)))
        elif kind == 1:
            out.append(HEADER.pack(MAGIC, VERSION + 1, 1, FLAG_SEALED, token, seq) + rng.randbytes(40))
        elif kind == 2:
            out.append(HEADER.pack(MAGIC, VERSION, 1, 0x80 | FLAG_SEALED, token, seq) + rng.randbytes(40))
        elif kind == 3:
            out.append(HEADER.pack(MAGIC, VERSION, 3, FLAG_SEALED | FLAG_NO_RECEIVER, token, seq) + rng.randbytes(40))
        elif kind == 4:
            out.append(rng.randbytes(rng.randrange(0, 21)))
        elif kind == 5:
            out.append(HEADER.pack(MAGIC, VERSION, 1, FLAG_SEALED, token, seq) + rng.randbytes(rng.randrange(0, 16)))
        elif kind == 6:
            out.append(HEADER.pack(MAGIC, VERSION, 0x40, 0, token, seq) + rng.randbytes(40))
        else:
            out.append(HEADER.pack(MAGIC, VERSION, rng.choice([1, 3, 5]), FLAG_SEALED, token, seq)
                       + rng.randbytes(rng.randrange(16, 1100)))
    return out


@pytest.mark.parametrize("in_c", [False, True], ids=["python-limiter", "c-table"])
def test_the_screen_refuses_what_the_python_triage_refuses_and_answers_members(in_c: bool) -> None:
    """The same junk (all kinds) and a member's PINGs (its token unknown until its first one opens) to an endpoint
    on the native pass with the screen and to one on the Python loop: the same refusals, counted the same, and the
    member is answered by both. The rationing is made deterministic (a source gets 2 failures, then none).
    ``in_c``: the screening endpoint's limiter is the C table, so the pass rations in C (dataplane.c recv_batch's
    ``ration``); the Python loop keeps the reference AuthLimiter."""
    from peerd.transport.guard import NativeAuthLimiter

    if in_c and RATION is None:
        pytest.skip("the native extension has no Ration")

    async def main() -> None:
        eps = []
        for native_receive in (True, False):
            sock = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=4 << 20, native_receive=native_receive)
            kind = NativeAuthLimiter if in_c and native_receive else AuthLimiter
            core = TransportCore(random.Random(1), auth_limiter=kind(failure_rate=1e-6, failure_burst=2))
            eps.append(Endpoint(sock, Identity.generate(), SECRET, Metrics(), core=core))
        limited: list[int] = []  # what the C pass refused itself, pass by pass
        recv_screened = eps[0].sock.recv_screened

        async def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = await recv_screened(*args, **kwargs)
            if len(result) > 5 and result[6]:
                limited.append(result[5])
            return result

        eps[0].sock.recv_screened = spy  # type: ignore[method-assign]
        member = Endpoint(UdpSocket(bind_loopback(socket.AF_INET)), Identity.generate(), SECRET, Metrics())
        # other: the unsealed ones (kind 6)
        attacker, other = bind_loopback(socket.AF_INET), bind_loopback(socket.AF_INET)
        junk = _junk(random.Random(3))
        waves = 2  # the second in passes of its own: a source rationed in the first is refused in C in the second
        async with trio.open_nursery() as nursery:
            for ep in (*eps, member):
                nursery.start_soon(ep.serve)
            assert getattr(eps[0].sock, "screens", False) and not eps[1].sock.screens
            for ep in eps:
                addr = ep.sock.getsockname()
                for wave in range(waves):
                    for i, d in enumerate(junk):
                        (other if i % 9 == 6 else attacker).sendto(d, addr)
                    with trio.fail_after(10):
                        if not wave:
                            await member.request(addr, m.MsgType.PING, {})  # first contact: its token is unknown
                            await member.request(addr, m.MsgType.PING, {})
                        while ep.sock.received < (wave + 1) * len(junk) + 2:
                            await trio.sleep(0.01)
                await trio.sleep(0.05)
                ep._flush_counts()
            nursery.cancel_scope.cancel()
        attacker.close()
        other.close()
        native, python = (_dropped(ep) for ep in eps)
        assert native == python
        assert {"malformed", "version", "auth", "auth_limited"} <= set(native)
        # the attacker's source: two derivations that failed, then rationed; the other's: 33 unsealed, each auth
        sealed_long = sum(1 for i in range(300) if i % 9 >= 7)  # kinds 7 and 8
        assert native["auth"] == 2 + 33 * waves and native["auth_limited"] == waves * sealed_long - 2
        if in_c and "rationed" in inspect.signature(Endpoint._receive_screened).parameters:
            assert sum(limited) >= sealed_long  # the second wave's, at least, never left C
        for ep in eps:
            assert counter_value(ep.metrics.datagrams_received, type="ping") == 2
            ep.sock.close()
        assert counter_value(eps[0].metrics.bytes_received) == counter_value(eps[1].metrics.bytes_received)
        assert counter_value(eps[0].metrics.bytes_received) > waves * sum(map(len, junk))
        member.sock.close()

    trio.run(main)


# -- rationing in C (dataplane.c Ration, recv_batch's ``ration``) against guard.AuthLimiter and the Python loop -----
needs_ration = pytest.mark.skipif(RATION is None, reason="the native extension has no Ration")


def _state(limiter, source) -> tuple[float, float] | None:  # type: ignore[no-untyped-def]
    """A source's bucket (tokens, at) in either limiter; None: it has none."""
    from peerd.transport.guard import NativeAuthLimiter

    if isinstance(limiter, NativeAuthLimiter):
        found = limiter.table.bucket(source)
        if found is None and source in limiter._other._sources:
            b = limiter._other._sources[source]
            return (b.tokens, b.at)
        return found
    b = limiter._sources.get(source)
    return None if b is None else (b.tokens, b.at)


def _derive_state(limiter) -> tuple[float, float] | None:  # type: ignore[no-untyped-def]
    from peerd.transport.guard import NativeAuthLimiter

    if isinstance(limiter, NativeAuthLimiter):
        return limiter.table.bucket(None)
    b = limiter._derive
    return None if b is None else (b.tokens, b.at)


@needs_ration
@pytest.mark.parametrize("seed", range(6))
def test_the_c_table_makes_the_decisions_of_auth_limiter(seed: int) -> None:
    """The same random calls (IPv4, IPv6; a table small enough to evict; time that stands still and jumps) give the
    same answers and the same buckets, down to the bit, and the same eviction order. Sources that are no IP
    (host, port) (a test socket's name, a scoped IPv6 host, a 4-tuple) keep their buckets in Python beside the table
    (their own bound), with the table's derivations: alone, they too are decided as the reference does."""
    from peerd.transport.guard import NativeAuthLimiter

    rng = random.Random(seed)
    kw = {"failure_rate": rng.choice([0.5, 10.0]), "failure_burst": rng.choice([1.0, 3.0, 32.0]),
          "derive_rate": rng.choice([2.0, 1000.0]), "derive_burst": rng.choice([1.0, 5.0, 1000.0]),
          "max_sources": rng.choice([1, 4, 16])}
    ref, c = AuthLimiter(**kw), NativeAuthLimiter(**kw, seed=rng.getrandbits(64))
    ip = [("127.0.0.1", p) for p in range(1, 9)] + [("::1", 7), ("::1", 8), ("10.1.2.3", 65535)]
    other = [("peer", 1), ("fe80::1%lo", 7), ("127.0.0.1", 99, 0, 0)]
    sources = rng.choice([ip, other])
    now = 100.0
    for _ in range(3000):
        if rng.random() < 0.05:
            now += rng.choice([0.0, 0.01, 0.3, 5.0])
        s = rng.choice(sources)
        if rng.random() < 0.5:
            assert ref.may_derive(s, now) == c.may_derive(s, now)
        else:
            n = rng.choice([1, 1, 2, 40])
            ref.failed(s, n, now)
            c.failed(s, n, now)
        assert _state(ref, s) == _state(c, s), (s, now)
        assert _derive_state(ref) == _derive_state(c)
    assert list(ref._sources) == (c.table.sources() if sources is ip else list(c._other._sources))
    assert len(c.table) <= kw["max_sources"]


@needs_ration
def test_the_c_table_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RATION(max_sources=0)
    with pytest.raises(ValueError):
        RATION(max_sources=(1 << 20) + 1)
    with pytest.raises(ValueError):
        RATION(failure_rate=float("nan"))
    with pytest.raises(TypeError):
        RATION(10.0)  # keyword-only
    r = RATION()
    with pytest.raises(RuntimeError):
        r.__init__()
    assert r.may_derive(("not an address", 1), 0.0) is None and r.failed(("::1", 70000), 0.0) is False
    assert r.may_derive(("x\0y", 1), 0.0) is None and r.may_derive((b"127.0.0.1", 1), 0.0) is None
    s = bind_loopback(socket.AF_INET)
    try:
        arena = memoryview(bytearray(4 * RECV_BUFFER))
        screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {})
        with pytest.raises(TypeError):
            NATIVE_RECV(s.fileno(), arena, 8, RECV_BUFFER, ration=r)  # a ration needs a screen
        with pytest.raises(TypeError):
            NATIVE_RECV(s.fileno(), arena, 8, RECV_BUFFER, screen=screen, ration=object())
        with pytest.raises(ValueError):
            NATIVE_RECV(s.fileno(), arena, 8, RECV_BUFFER, screen=screen, ration=r, now=float("inf"))
    finally:
        s.close()


def decide(unknown, limiter, known: set[int], open_, counts: dict[str, int], now: float, *,  # type: ignore[no-untyped-def]
           granted: bool) -> None:
    """Endpoint._receive_screened's decisions over a pass's datagrams under unknown tokens (``granted``: the first
    has its derivation granted in C): a source refused a derivation before any was granted is refused for the rest
    of the pass; once a key was derived, a datagram whose token is known by then opens; a source gets one
    derivation a pass."""
    refusing: set = set()
    derived_from: set = set()
    for i, (data, source) in enumerate(unknown):
        if granted and i == 0:
            derived_from.add(source)
            open_(bytes(data), source)
        elif source in refusing:
            counts["auth_limited"] += 1
        elif derived_from and int.from_bytes(data[5:13], "big") in known:
            open_(bytes(data), source)
        elif source in derived_from:
            counts["auth_limited"] += 1
        elif limiter.may_derive(source, now):
            derived_from.add(source)
            open_(bytes(data), source)
        else:
            if not derived_from:
                refusing.add(source)
            counts["auth_limited"] += 1


def _pass_decisions(seed: int) -> None:
    """One receive pass of sealed datagrams under unknown tokens from several sources (some already rationed,
    some tokens a member's: a derivation opens them and makes them known) through the C rationing, and the same
    datagrams through the reference (the Python loop of Endpoint._receive_screened with guard.AuthLimiter), each
    opened by a stand-in opener: the same datagrams opened in the same order, the same refusals, the same buckets."""
    from peerd.transport.guard import NativeAuthLimiter

    rng = random.Random(seed)
    kw = {"failure_rate": 10.0, "failure_burst": rng.choice([2.0, 4.0, 32.0]),
          "derive_rate": 1000.0, "derive_burst": rng.choice([1.0, 3.0, 1000.0]), "max_sources": rng.choice([2, 64])}
    ref, c = AuthLimiter(**kw), NativeAuthLimiter(**kw)
    senders = [bind_loopback(socket.AF_INET) for _ in range(5)]
    rx = [bind_loopback(socket.AF_INET) for _ in range(2)]
    try:
        now = 50.0
        addrs = [s.getsockname() for s in senders]
        for a in addrs[:2]:  # rationed before the pass: no failures left
            ref.failed(a, 100, now - 0.01)
            c.failed(a, 100, now - 0.01)
        good = {rng.getrandbits(64) for _ in range(3)}  # a member's tokens: they open
        known_token = rng.getrandbits(64)
        plan = []
        for _ in range(rng.randrange(20, 200)):
            token = rng.choice([*good, *([known_token] * 2), *(rng.getrandbits(64) for _ in range(3))])
            data = HEADER.pack(MAGIC, VERSION, rng.choice([1, 3, 0x40]), FLAG_SEALED, token,
                               rng.getrandbits(64)) + rng.randbytes(rng.randrange(16, 300))
            plan.append((rng.randrange(len(senders)), data))
        for i, data in plan:
            for r in rx:
                senders[i].sendto(data, r.getsockname())
        screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {known_token: None})
        arena = memoryview(bytearray(64 * RECV_BUFFER))

        def opener(limiter, known: set[int], opened: list[bytes]):  # type: ignore[no-untyped-def]
            counts = {"auth": 0, "auth_limited": 0}

            def open_(data: bytes, source) -> None:  # type: ignore[no-untyped-def]
                token = int.from_bytes(data[5:13], "big")
                if token in good:
                    known.add(token)
                    opened.append(data)
                else:
                    counts["auth"] += 1
                    limiter.failed(source, 1, now)

            return open_, counts

        # the reference: every unknown datagram back from C, rationed by the Python loop
        blocks, _, n, _, _, _, (unknown, *_) = NATIVE_RECV(rx[1].fileno(), arena, 4096, RECV_BUFFER, screen=screen)
        assert n == len(plan) and len(unknown) == sum(1 for _, d in plan if d[5:13] != known_token.to_bytes(8, "big"))
        ref_opened: list[bytes] = []
        ref_known = {known_token}
        open_, ref_counts = opener(ref, ref_known, ref_opened)
        decide(unknown, ref, ref_known, open_, ref_counts, now, granted=False)
        # C: rationed in the pass; the first handed back is granted, the rest decided as above
        blocks, _, n, _, _, _, screened = NATIVE_RECV(rx[0].fileno(), arena, 4096, RECV_BUFFER, screen=screen,
                                                      ration=c.table, now=now)
        unknown_c, malformed, version, nbytes, limited, _ = screened
        assert malformed == version == 0 and n == len(plan)
        c_opened: list[bytes] = []
        c_known = {known_token}
        open_, c_counts = opener(c, c_known, c_opened)
        c_counts["auth_limited"] += limited
        decide(unknown_c, c, c_known, open_, c_counts, now, granted=True)
        assert c_opened == ref_opened
        assert c_counts == ref_counts
        assert nbytes == sum(len(d) for _, d in plan if d[5:13] != known_token.to_bytes(8, "big")) - sum(
            len(d) for d, _ in unknown_c)
        for a in addrs:
            assert _state(ref, a) == _state(c, a), a
        assert _derive_state(ref) == _derive_state(c)
        return limited
    finally:
        for s in senders + rx:
            s.close()


@needs_ration
def test_rationing_in_the_pass_makes_the_python_loops_decisions() -> None:
    limited = [_pass_decisions(seed) for seed in range(24)]
    assert sum(limited) > 0 and min(limited) >= 0  # C did refuse, and only what the reference refused


# -- an overloaded pass sheds max-min fairly (recv_batch's ``shed``, UdpSocket's overload_bytes) -------------------
def _flood(rx: socket.socket, plan: list[tuple[socket.socket, int, int, int]]) -> None:
    """(sender, type, count, body size) in turn, one datagram of each at a time, under the known token 5."""
    for k in range(max(n for _, _, n, _ in plan)):
        for tx, mtype, n, size in plan:
            if k < n:
                tx.sendto(HEADER.pack(MAGIC, VERSION, mtype, FLAG_SEALED, 5, k) + b"x" * size, rx.getsockname())


def _kept(blocks) -> dict[int, int]:  # type: ignore[no-untyped-def]
    got: dict[int, int] = {}
    for data, source, segment in blocks:
        got[source[1]] = got.get(source[1], 0) + (-(-len(data) // segment) if segment else 1)
    return got


def test_an_overloaded_pass_keeps_fair_shares_and_every_ping() -> None:
    """A heavy source (900 datagrams, merged into blocks), a light one (30) and a prober's PINGs (30): with room for
    100, the light source keeps all it sent, the heavy one the rest of the 100, every PING is kept, and what was
    shed is counted with its bytes. With room for everything nothing is shed."""
    rx = bind_loopback(socket.AF_INET)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    rx.setblocking(False)
    heavy, light, prober = (bind_loopback(socket.AF_INET) for _ in range(3))
    screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {5: None})
    arena = memoryview(bytearray(8 << 20))
    try:
        for keep, shed_expected in ((100, 830), (4096, 0)):
            _flood(rx, [(heavy, 0x40, 900, 200), (light, 0x40, 30, 300), (prober, 0x01, 30, 50)])
            blocks, _, n, _, drained, _, screened = NATIVE_RECV(rx.fileno(), arena, 4096, RECV_BUFFER, screen=screen,
                                                                shed=(keep, 512, 1, 2))
            assert n == 960 and drained
            _, malformed, version, nbytes, limited, shed = screened[0], *screened[1:]
            got = _kept(blocks)
            assert shed == shed_expected and limited == malformed == version == 0
            assert got[light.getsockname()[1]] == 30 and got[prober.getsockname()[1]] == 30
            assert got[heavy.getsockname()[1]] == 900 - shed_expected
            assert nbytes == shed_expected * (HEADER.size + 200)
    finally:
        for s in (rx, heavy, light, prober):
            s.close()


def test_a_socket_sheds_only_past_its_overload_depth() -> None:
    """UdpSocket.recv_screened sheds when the kernel queue is deeper than ``overload_bytes`` (SO_MEMINFO), and
    returns the count; a shallow queue is taken whole."""
    async def main() -> None:
        from peerd.transport.guard import AuthLimiter

        for overload, expect_shed in ((64 * 1024, True), (None, False)):
            sock = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=8 << 20, native_receive=True,
                             overload_bytes=overload)
            heavy, prober = bind_loopback(socket.AF_INET), bind_loopback(socket.AF_INET)
            _flood(sock.sock, [(heavy, 0x40, 3000, 200), (prober, 0x01, 20, 50)])
            assert sock.queued() > 64 * 1024
            screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {5: None})
            got: dict[int, int] = {}
            shed = 0
            while sum(got.values()) + shed < 3020:
                blocks, *_, rationed, now, shed_now = await sock.recv_screened(256, screen, AuthLimiter(),
                                                                               shedding=True)
                assert rationed is False and isinstance(now, float)
                shed += shed_now
                for port, n in _kept(blocks).items():
                    got[port] = got.get(port, 0) + n
            assert got[prober.getsockname()[1]] == 20
            assert (shed > 0) == expect_shed and sock.shed == shed
            assert got[heavy.getsockname()[1]] == 3000 - shed
            for s in (sock.sock, heavy, prober):
                s.close()

    trio.run(main)


# -- protected tokens: never shed, not counted in the others' fair shares (issue 11) ----------------------------
def _shed_reference(plan: list[tuple[int, int, bool]], keep: int) -> list[int]:
    """What a shedding pass keeps of each source's (count, token, protected) sent: the protected all, the others
    max-min fairly in ``keep`` (water-filling, the level at least 1; a source keeps up to the level, rounded up)."""
    counts = sorted(n for n, _, p in plan if not p)
    level = float("inf")
    if sum(counts) > keep:
        left = float(keep)
        for i, n in enumerate(counts):
            share = left / (len(counts) - i)
            if n > share:
                level = max(1.0, share)
                break
            left -= n
    return [n if p or level == float("inf") else min(n, int(np.ceil(level))) for n, _, p in plan]


@pytest.mark.parametrize("seed", range(8))
def test_protected_tokens_are_never_shed_and_the_rest_is_shed_as_the_reference_says(seed: int) -> None:
    """Random floods from 2-5 sources, each under its own token, some protected: the C pass keeps every datagram
    under a protected token and every PING, and of the rest what the Python reference's water level keeps."""
    rng = random.Random(seed)
    rx = bind_loopback(socket.AF_INET)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    rx.setblocking(False)
    senders = [bind_loopback(socket.AF_INET) for _ in range(rng.randint(2, 5))]
    prober = bind_loopback(socket.AF_INET)
    plan = [(rng.randint(1, 400), 100 + i, rng.random() < 0.4) for i in range(len(senders))]
    sizes = [rng.randint(50, 300) for _ in senders]
    keep = rng.randint(10, 300)
    tokens: dict[int, None] = {t: None for _, t, _ in plan}
    protected = {t: None for _, t, p in plan if p}
    screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, tokens)
    arena = memoryview(bytearray(8 << 20))
    try:
        for k in range(max(n for n, _, _ in plan)):
            for tx, (n, token, _), size in zip(senders, plan, sizes, strict=True):
                if k < n:
                    tx.sendto(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, token, k) + b"x" * size,
                              rx.getsockname())
            if k < 20:
                prober.sendto(HEADER.pack(MAGIC, VERSION, 0x01, FLAG_SEALED, 100, k) + b"p" * 30, rx.getsockname())
        total = sum(n for n, _, _ in plan) + min(20, max(n for n, _, _ in plan))
        blocks, _, n, _, drained, _, screened = NATIVE_RECV(rx.fileno(), arena, 4096, RECV_BUFFER, screen=screen,
                                                            shed=(keep, 512, 1, 2, protected))
        assert n == total and drained
        got = _kept(blocks)
        expected = _shed_reference(plan, keep)
        assert [got.get(tx.getsockname()[1], 0) for tx in senders] == expected
        assert got[prober.getsockname()[1]] == total - sum(n for n, _, _ in plan)
        assert screened[-1] == sum(n for n, _, _ in plan) - sum(expected)
        assert screened[-1] == 0 or not all(p for _, _, p in plan)
    finally:
        for s in (rx, prober, *senders):
            s.close()


def test_the_protected_argument_is_checked() -> None:
    rx = bind_loopback(socket.AF_INET)
    rx.setblocking(False)
    screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {})
    arena = memoryview(bytearray(1 << 20))
    try:
        with pytest.raises(TypeError, match="protected"):
            NATIVE_RECV(rx.fileno(), arena, 64, RECV_BUFFER, screen=screen, shed=(10, 512, 1, 2, [5]))
        out = NATIVE_RECV(rx.fileno(), arena, 64, RECV_BUFFER, screen=screen, shed=(10, 512, 1, 2, None))
        assert out[2] == 0
    finally:
        rx.close()


def test_a_socket_with_protected_tokens_sheds_the_others_from_a_low_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below overload_bytes, UdpSocket.recv_screened sheds only with ``protected`` (a dict, even empty) and past
    PROTECTED_OVERLOAD_BYTES: the protected member's datagrams all arrive, the flooder's are cut."""
    from peerd.transport import udp

    monkeypatch.setattr(udp, "PROTECTED_OVERLOAD_BYTES", 64 * 1024)

    async def main() -> None:
        for protected, expect_shed in (({7: None}, True), (None, False), ({}, True)):
            sock = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=8 << 20, native_receive=True)
            flooder, member = bind_loopback(socket.AF_INET), bind_loopback(socket.AF_INET)
            for k in range(3000):
                flooder.sendto(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 5, k) + b"x" * 200,
                               sock.sock.getsockname())
                if k < 600:
                    member.sendto(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 7, k) + b"y" * 200,
                                  sock.sock.getsockname())
            assert 64 * 1024 < sock.queued() < sock.overload_bytes
            screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {5: None, 7: None})
            got: dict[int, int] = {}
            shed = 0
            while sum(got.values()) + shed < 3600:
                blocks, *_, shed_now = await sock.recv_screened(256, screen, AuthLimiter(), shedding=True,
                                                                protected=protected)
                shed += shed_now
                for port, n in _kept(blocks).items():
                    got[port] = got.get(port, 0) + n
            assert (shed > 0) == expect_shed and sum(got.values()) == 3600 - shed
            if protected:
                assert got[member.getsockname()[1]] == 600 and got[flooder.getsockname()[1]] == 3000 - shed
            for s in (sock.sock, flooder, member):
                s.close()

    trio.run(main)


def test_a_flood_of_a_thousand_datagrams_is_shed_at_the_default_protected_depth() -> None:
    """Under a member attack each datagram the loop keeps costs tens of microseconds of Python, and a PING waits
    behind all of them: a queue of 1,000 MTU-sized datagrams from a flooder (about 2.3 MB of kernel memory, under
    the full shedding depth) is shed at the default protected depth, while a protected member's datagrams all
    arrive. A depth of 4 MiB sheds none of it (`peerd bench soak`: PINGs in the burst wait hundreds of ms)."""

    async def main() -> None:
        sock = UdpSocket(bind_loopback(socket.AF_INET), buffer_bytes=32 << 20, native_receive=True)
        flooder, member = bind_loopback(socket.AF_INET), bind_loopback(socket.AF_INET)
        for k in range(1000):
            flooder.sendto(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 5, k) + b"x" * 1100, sock.sock.getsockname())
            if k < 100:
                member.sendto(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 7, k) + b"y" * 1100,
                              sock.sock.getsockname())
        assert sock.queued() < sock.overload_bytes
        screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {5: None, 7: None})
        got: dict[int, int] = {}
        shed = 0
        while sum(got.values()) + shed < 1100:
            blocks, *_, shed_now = await sock.recv_screened(1024, screen, AuthLimiter(), shedding=True,
                                                            protected={7: None})
            shed += shed_now
            for port, n in _kept(blocks).items():
                got[port] = got.get(port, 0) + n
        assert shed > 500 and got[member.getsockname()[1]] == 100
        for s in (sock.sock, flooder, member):
            s.close()

    trio.run(main)


@needs_ration
def test_a_source_gets_one_key_derivation_a_receive_pass() -> None:
    """A burst under 100 unknown tokens from one source, queued before a pass: one key derivation (it fails:
    ``auth``), the rest refused unopened (``auth_limited``), though the source's bucket allows 32 failures."""

    async def main() -> None:
        rx = bind_loopback(socket.AF_INET)
        ep = Endpoint(UdpSocket(rx), Identity.generate(), SECRET, Metrics())
        assert ep.core.auth_limiter.failure_burst == 32
        tx = bind_loopback(socket.AF_INET)
        rng = random.Random(3)
        try:
            for _ in range(100):
                tx.sendto(HEADER.pack(MAGIC, VERSION, 3, FLAG_SEALED, rng.getrandbits(64), rng.getrandbits(64))
                          + rng.randbytes(200), rx.getsockname())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ep.serve)
                await trio.sleep(0.3)
                nursery.cancel_scope.cancel()
        finally:
            tx.close()
            rx.close()
        assert counter_value(ep.metrics.datagrams_dropped, reason="auth") == 1
        assert counter_value(ep.metrics.datagrams_dropped, reason="auth_limited") == 99

    trio.run(main)


def _rows(blocks) -> dict[int, list[bytes]]:  # type: ignore[no-untyped-def]
    """Every source's datagrams, in the order the pass hands them over (blocks cut back into rows)."""
    out: dict[int, list[bytes]] = {}
    for data, source, segment in blocks:
        data = bytes(data)
        row = segment or len(data)
        out.setdefault(source[1], []).extend(data[i:i + row] for i in range(0, len(data), row))
    return out


def test_interleaved_sessions_merge_per_source_in_the_order_they_came() -> None:
    """Three members' paced datagrams arrive interleaved (A B C A B C ..., as on a shaped link, where nothing is
    consecutive): with a screen, each source's rows under a known token merge into one block, its datagrams in the
    order they came, where the consecutive merge alone leaves 60 blocks. A datagram of another size or under an
    unknown token between two of a source's closes its run; the Python loop gives the same rows per source."""
    rx = bind_loopback(socket.AF_INET)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    rx.setblocking(False)
    txs = [bind_loopback(socket.AF_INET) for _ in range(3)]
    screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {5: None, 6: None})
    arena = memoryview(bytearray(4 << 20))
    sent: dict[int, list[bytes]] = {tx.getsockname()[1]: [] for tx in txs}

    def burst() -> None:
        for k in range(20):
            for i, tx in enumerate(txs):
                if i == 1 and k == 10:  # another size, same token: source 1's run closes and starts again
                    d = HEADER.pack(MAGIC, VERSION, 0x41, FLAG_SEALED, 5, k) + b"e" * 40
                elif i == 2 and k == 10:  # an unknown token: handed back apart; source 2's run closes
                    d = HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 99, k) + b"u" * 200
                else:
                    d = HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 5 + (i == 2), k) + bytes([i]) * 200
                tx.sendto(d, rx.getsockname())
                if not (i == 2 and k == 10):
                    sent[tx.getsockname()[1]].append(d)

    try:
        burst()
        blocks, _, n, _, drained, _, screened = NATIVE_RECV(rx.fileno(), arena, 4096, RECV_BUFFER, screen=screen)
        assert n == 60 and drained and len(screened[0]) == 1  # the unknown token's, apart
        assert _rows(blocks) == sent
        sizes = sorted(len(bytes(d)) // (segment or len(bytes(d))) for d, _, segment in blocks)
        assert sizes == [1, 9, 9, 10, 10, 20], sizes  # source 0: 20 rows at once; 1: 10, the other size, 9; 2: 10, 9
        # without a screen (nothing known): the consecutive merge alone, every datagram its own block
        for v in sent.values():
            v.clear()
        burst()
        blocks, _, n, _, _, _, _ = NATIVE_RECV(rx.fileno(), arena, 4096, RECV_BUFFER)
        assert n == 60 and len(blocks) == 60
        # the Python loop: the same rows per source
        for v in sent.values():
            v.clear()
        burst()
        ref = trio.run(UdpSocket(rx)._recv_blocks_python, 4096)
        ref_rows = _rows([(d, s, seg) for d, s, seg in ref])
        ref_rows[txs[2].getsockname()[1]].remove(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 99, 10) + b"u" * 200)
        assert ref_rows == sent
    finally:
        for s in (rx, *txs):
            s.close()


@pytest.mark.parametrize("native_receive", [True, False])
def test_arrivals_hold_the_kernels_receive_time_of_each_sources_latest_data(native_receive: bool) -> None:
    """SO_TIMESTAMPNS: the native pass and the Python loop alike keep, per source, the kernel's receive time of its
    latest tensor data (0x40 and 0x42): what a REPORT's ``arrived`` says. Control datagrams and END markers (0x41,
    0x43) leave it alone: a REPORT's position counts data datagrams only, and an END copy 8 ms after a stream's last
    datagram, paired with that datagram's send time, read as 8 ms of queue."""
    async def main() -> None:
        tx1 = UdpSocket(bind_loopback(socket.AF_INET), gso=False)
        tx2 = UdpSocket(bind_loopback(socket.AF_INET), gso=False)
        rx = UdpSocket(bind_loopback(socket.AF_INET), gso=False, native_receive=native_receive)
        try:
            if not rx.stamps:
                pytest.skip("no SO_TIMESTAMPNS")
            import time
            before = time.time()
            await tx1.sendto(merge_prefix(0x40, 1) + bytes(100), rx.getsockname())  # data
            await tx2.sendto(merge_prefix(m.MsgType.PING, 2) + bytes(100), rx.getsockname())  # control
            await trio.sleep(0.05)
            after = time.time()
            with trio.fail_after(5):
                got = 0
                while got < 2:
                    got += sum(1 for _ in await rx.recv_blocks(64))
            assert set(rx.arrivals) == {tx1.getsockname()}
            stamp = rx.arrivals[tx1.getsockname()]
            assert before - 0.01 <= stamp <= after + 0.01
            await trio.sleep(0.02)
            await tx1.sendto(merge_prefix(0x41, 1) + bytes(100), rx.getsockname())  # an END marker
            with trio.fail_after(5):
                await rx.recv_blocks(64)
            assert rx.arrivals[tx1.getsockname()] == stamp
            await tx1.sendto(merge_prefix(0x42, 1) + bytes(100), rx.getsockname())  # all-gather data
            with trio.fail_after(5):
                await rx.recv_blocks(64)
            assert rx.arrivals[tx1.getsockname()] >= stamp + 0.015  # the latest data's
        finally:
            for s in (tx1, tx2, rx):
                s.close()

    trio.run(main)


def test_arrivals_are_bounded_and_checked() -> None:
    """The table starts over once it holds MAX_ARRIVALS sources (anyone may send from many addresses), and the C
    pass refuses an arrivals argument that is not (dict, type)."""
    from peerd.transport import udp

    s = bind_loopback(socket.AF_INET)
    try:
        sock = UdpSocket(s)
        if not sock.stamps:
            pytest.skip("no SO_TIMESTAMPNS")
        sock.arrivals.update({("10.0.0.1", p): 1.0 for p in range(1, udp.MAX_ARRIVALS + 1)})
        table, data_min, mask = sock._arrivals()
        assert table == {} and data_min == 0x40 and mask == 0b101
        view = memoryview(bytearray(RECV_BUFFER))
        for bad in ([], ({}, 256), ({}, -1), ([], 0x40)):
            with pytest.raises((TypeError, ValueError)):
                NATIVE_RECV(s.fileno(), view, 1, RECV_BUFFER, arrivals=bad)
    finally:
        s.close()


@pytest.mark.parametrize("screened", [True, False])
def test_blocks_laid_out_in_out_are_those_laid_out_in_the_arena(screened: bool) -> None:
    """GRO receives of three members interleaved (A B C A B C ..., each most of a 64 KB slot, as on loopback), read
    once with ``out`` and once without: the same blocks, rows, sources and segments. With ``out`` a receive of more
    than half a slot stays where it landed and a block that is not one run is copied once into ``out``; without, the
    pass moves every receive down and regroups through a buffer. Blocks that are one run stay in the arena."""
    rx = bind_loopback(socket.AF_INET)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    rx.setblocking(False)
    udp = UdpSocket(rx)  # (sets UDP_GRO where the kernel has it)
    txs = [UdpSocket(bind_loopback(socket.AF_INET)) for _ in range(3)]
    screen = (MAGIC + bytes([VERSION]), 3, 2, 1, 1, 37, {5: None, 6: None, 7: None}) if screened else None
    arena = memoryview(bytearray(16 * RECV_BUFFER))
    out = memoryview(bytearray(16 * RECV_BUFFER))

    async def burst() -> None:
        seq = 0
        for k in range(4):
            for i, tx in enumerate(txs):
                rows = []
                for _ in range(54 if k != 2 else 20):  # (a shorter receive now and then: not all of a slot)
                    seq += 1
                    rows.append(HEADER.pack(MAGIC, VERSION, 0x40, FLAG_SEALED, 5 + i, seq) + bytes([i, k]) * 589)
                await tx.send_many(rows, rx.getsockname())

    def read(with_out: bool) -> tuple[list, int]:
        trio.run(burst)
        got = NATIVE_RECV(rx.fileno(), arena, 4096, RECV_BUFFER, screen=screen, out=out if with_out else None)
        blocks = [(bytes(d), src, seg) for d, src, seg in got[0]]
        in_out = sum(1 for d, _, _ in got[0] if d.obj is out.obj)
        return blocks, in_out

    try:
        plain, plain_out = read(False)
        laid, laid_out = read(True)
        assert plain_out == 0
        assert _rows(plain) == _rows(laid) and sum(len(d) for d, _, _ in plain) == 3 * (3 * 54 + 20) * 1199
        assert [(len(d), seg) for d, _, seg in plain] == [(len(d), seg) for d, _, seg in laid]
        if udp.gro:
            if screened:  # each member's receives regrouped: three blocks, each laid out once in ``out``
                assert len(laid) == 3 and laid_out == 3
            else:  # nothing consecutive from one source: every receive a block of its own, none copied
                assert len(laid) == 12 and laid_out == 0
    finally:
        for u in (udp, *txs):
            u.close()
