"""The transport core (peerd/transport/core.py) in virtual time: exact retransmission schedules under
deterministic loss patterns, duplicate and late answers, request-id collisions, the bounded pending map,
address validation; and the socket-side pieces that left the endpoint (fault injection, capabilities)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from peerd.metrics import Metrics
from peerd.transport.caps import SocketCaps, plain_caps
from peerd.transport.core import (
    ERROR,
    PING,
    PONG,
    AddressValidated,
    Answered,
    Deliver,
    Expired,
    PendingFull,
    Transmit,
    TransportCore,
)
from peerd.transport.endpoint import Endpoint
from peerd.transport.faults import LossySocket
from peerd.transport.rpc import RpcTimeout
from peerd.transport.rto import DEFAULT_MIN_RTO
from peerd.wire import messages as m
from peerd.wire.envelope import FLAG_SEALED, HEADER, MAGIC, VERSION
from peerd.wire.identity import Identity
from peerd.wire.seal import Sealer

from .support.memnet import MemNet, run_on_memnet
from .support.virtual import counter_value

A = ("10.0.0.1", 7000)
B = ("10.0.0.2", 7000)
FIND_NODE, NODES = 0x03, 0x04


def receive(core: TransportCore, mtype: int, rid: int, source: tuple[str, int], message: object, now: float) -> list:
    """Hand the core one control message; what it asks of the shell."""
    core.receive_message(mtype, rid, source, message, now)
    return core.take_actions()


def drive(core: TransportCore, addr: tuple[str, int], *, timeout: float, attempts: int, rtt: float,
          lost: set[int], start: float = 0.0) -> tuple[list[float], object]:
    """Run one request in virtual time as a shell does (carry out ``take_actions``, sleep until ``get_timer``,
    ``handle_timer``): transmission ``i`` (0-based) is lost when ``i in lost``, otherwise its answer arrives
    ``rtt`` later. Returns the transmission times and the request's last action (``Answered`` or ``Expired``)."""
    now = start
    rid = core.open_request(addr, PONG, timeout=timeout, attempts=attempts, now=now)
    sent: list[float] = []
    arrivals: list[float] = []
    while True:
        for action in core.take_actions():
            assert action.rid == rid
            if isinstance(action, Transmit):
                assert action.attempt == len(sent)
                if len(sent) not in lost:
                    arrivals.append(now + rtt)
                sent.append(now)
                continue
            if isinstance(action, Answered):
                core.close(rid)
            return sent, action
        timer = core.get_timer()
        assert timer is not None and timer > now  # an open, unanswered request always has a wait that runs
        now = min([t for t in arrivals if t > now] + [timer])
        if now in arrivals:
            core.receive_message(PONG, rid, addr, ("reply", now), now)
        if now >= timer:
            core.handle_timer(now)


def test_retransmission_schedule_is_exact_and_doubles() -> None:
    core = TransportCore(random.Random(1))
    sent, last = drive(core, A, timeout=0.5, attempts=3, rtt=0.01, lost={0, 1, 2, 3})
    assert sent == pytest.approx([0.0, 0.5, 1.5])  # waits 0.5, 1.0, then the last 2.0 runs to the deadline
    assert isinstance(last, Expired) and last.waited == pytest.approx(3.5) and last.attempts == 3
    assert core.open_requests() == 0


def test_answer_after_a_loss_is_not_a_round_trip_sample() -> None:
    core = TransportCore(random.Random(2))
    sent, last = drive(core, A, timeout=0.5, attempts=3, rtt=0.02, lost={0})
    assert sent == pytest.approx([0.0, 0.5])
    assert isinstance(last, Answered) and last.rtt is None and last.attempts == 2  # Karn: ambiguous
    assert core.rto.srtt(A) is None
    sent, last = drive(core, A, timeout=0.5, attempts=3, rtt=0.02, lost=set(), start=10.0)
    assert isinstance(last, Answered) and last.rtt == pytest.approx(0.02) and sent == [10.0]
    assert core.rto.srtt(A) == pytest.approx(0.02)


def test_learned_timeout_shortens_the_first_wait_and_a_timeout_backs_off() -> None:
    core = TransportCore(random.Random(3))
    for i in range(8):
        drive(core, A, timeout=0.5, attempts=3, rtt=0.004, lost=set(), start=float(i))
    first = core.rto.timeout(A, 0.5)
    assert first == pytest.approx(DEFAULT_MIN_RTO)  # srtt + 4 rttvar is below the floor
    sent, last = drive(core, A, timeout=0.5, attempts=3, rtt=0.004, lost={0}, start=100.0)
    assert sent == pytest.approx([100.0, 100.0 + first])  # the first wait was the learned one
    assert isinstance(last, Answered)
    assert core.rto.timeout(A, 0.5) == pytest.approx(2 * first)  # backed off until a fresh sample
    # the schedule's end is the caller's, whatever the first wait: 0.5 * (2**3 - 1) after the start
    sent, last = drive(core, A, timeout=0.5, attempts=3, rtt=0.004, lost=set(range(10)), start=200.0)
    assert isinstance(last, Expired) and last.waited == pytest.approx(3.5)
    assert sent == pytest.approx([200.0 + 2 * first * (2**i - 1) for i in range(len(sent))])
    assert sent[-1] < 203.5


@pytest.mark.parametrize("seed", range(20))
def test_random_loss_patterns_follow_the_schedule(seed: int) -> None:
    """For any pattern of lost transmissions: sends at the doubling schedule until the first that is not lost,
    answered exactly rtt later; or expiry at the deadline when all are lost."""
    rng = random.Random(seed)
    lost = {i for i in range(6) if rng.random() < 0.5}
    core = TransportCore(random.Random(seed))
    sent, last = drive(core, B, timeout=0.1, attempts=4, rtt=0.03, lost=lost)
    expected = [0.1 * (2**i - 1) for i in range(4)]
    got_through = [i for i in range(4) if i not in lost]
    if not got_through:
        assert isinstance(last, Expired) and sent == pytest.approx(expected)
        return
    k = got_through[0]
    # the answer lands 0.03 after transmission k; a later transmission may go out before it only if due sooner
    assert isinstance(last, Answered)
    assert sent[: k + 1] == pytest.approx(expected[: k + 1])
    assert last.rtt == (pytest.approx(0.03) if k == 0 else None)


def answered(rid: int, reply: object, rtt: object) -> list:
    """What the core queues for the answer to a request sent once."""
    return [Answered(rid, reply, rtt, 1)]


def test_duplicate_and_late_answers() -> None:
    core = TransportCore(random.Random(4))
    rid = core.open_request(A, PONG, timeout=0.5, attempts=2, now=0.0)
    assert core.take_actions() == [Transmit(rid, 0)]
    assert receive(core, PONG, rid, A, "first", 0.01) == answered(rid, "first", pytest.approx(0.01))
    assert receive(core, PONG, rid, A, "second", 0.02) == []  # before the caller closed it: dropped
    assert core.receiving.drops == {} and core.receiving.answers == 1
    core.handle_timer(1.0)  # an answered request's wait runs no more
    assert core.take_actions() == [] and core.open_requests() == 1
    core.close(rid)
    assert receive(core, PONG, rid, A, "late", 0.04) == []  # closed: nothing waits for it
    assert core.receiving.drops == {"unexpected": 1}
    # an answer of the wrong type never matches; an ERROR does
    rid = core.open_request(A, NODES, timeout=0.5, attempts=2, now=1.0)
    core.take_actions()
    assert receive(core, PONG, rid, A, "wrong type", 1.01) == []
    assert receive(core, ERROR, rid, A, "refused", 1.02) == answered(rid, "refused", pytest.approx(0.02))
    assert core.receiving.drops == {"unexpected": 2} and core.receiving.answers == 2


def test_an_answer_from_another_address_matches_but_does_not_validate() -> None:
    core = TransportCore(random.Random(5))
    rid = core.open_request(A, PONG, timeout=0.5, attempts=2, now=0.0)
    core.take_actions()
    assert receive(core, PONG, rid, B, "via B", 0.01) == answered(rid, "via B", pytest.approx(0.01))
    assert not core.guard.is_validated(A) and not core.guard.is_validated(B)
    rid = core.open_request(A, PONG, timeout=0.5, attempts=2, now=1.0)
    core.take_actions()
    receive(core, PONG, rid, A, "from A", 1.01)
    assert core.guard.is_validated(A)


class CollidingRandom(random.Random):
    """Gives the same 64-bit value ``repeat`` times before moving on."""

    def __init__(self, values: list[int]) -> None:
        super().__init__(0)
        self.values = values

    def getrandbits(self, k: int) -> int:
        return self.values.pop(0)


def test_request_ids_never_collide_with_a_pending_one() -> None:
    core = TransportCore(CollidingRandom([7, 7, 7, 9, 7, 11]))
    first = core.open_request(A, PONG, timeout=1, attempts=1, now=0.0)
    second = core.open_request(A, PONG, timeout=1, attempts=1, now=0.0)
    assert (first, second) == (7, 9)  # the two draws of 7 while 7 was pending were thrown away
    core.close(first)
    assert core.open_request(A, PONG, timeout=1, attempts=1, now=0.0) == 7  # free again


def test_a_broken_rng_is_refused_not_looped_on() -> None:
    core = TransportCore(CollidingRandom([5] * 200))
    core.open_request(A, PONG, timeout=1, attempts=1, now=0.0)
    with pytest.raises(PendingFull):
        core.open_request(A, PONG, timeout=1, attempts=1, now=0.0)


def test_pending_map_is_bounded() -> None:
    core = TransportCore(random.Random(6), max_pending=8)
    rids = [core.open_request(A, PONG, timeout=1, attempts=1, now=0.0) for _ in range(8)]
    with pytest.raises(PendingFull):
        core.open_request(A, PONG, timeout=1, attempts=1, now=0.0)
    core.handle_timer(5.0)
    expired = [a for a in core.take_actions() if isinstance(a, Expired)]
    assert sorted(a.rid for a in expired) == sorted(rids)  # an expired request frees its slot
    core.open_request(A, PONG, timeout=1, attempts=1, now=5.0)
    assert core.open_requests() == 1


def test_same_seed_same_ids() -> None:
    a, b = TransportCore(random.Random(42)), TransportCore(random.Random(42))
    ids_a = [a.open_request(A, PONG, timeout=1, attempts=1, now=0.0) for _ in range(5)] + [a.new_id()]
    ids_b = [b.open_request(A, PONG, timeout=1, attempts=1, now=0.0) for _ in range(5)] + [b.new_id()]
    assert ids_a == ids_b and len(set(ids_a)) == 6


def test_get_timer_is_the_earliest_wait() -> None:
    core = TransportCore(random.Random(7))
    assert core.get_timer() is None
    r1 = core.open_request(A, PONG, timeout=0.5, attempts=2, now=0.0)
    r2 = core.open_request(B, PONG, timeout=0.2, attempts=2, now=0.1)
    assert core.take_actions() == [Transmit(r1, 0), Transmit(r2, 0)]  # each goes out as it opens
    at = core.get_timer()
    assert at == pytest.approx(0.3)
    core.handle_timer(0.29)
    assert core.take_actions() == []  # nothing due yet
    core.handle_timer(at)
    assert core.take_actions() == [Transmit(r2, 1)] and core.get_timer() == pytest.approx(0.5)
    receive(core, PONG, r1, A, "answer", 0.4)
    assert core.get_timer() == pytest.approx(0.7)  # an answered request's wait is gone


def test_demultiplexing_of_requests_and_one_way_messages() -> None:
    core = TransportCore(random.Random(8))
    core.register(FIND_NODE, NODES)
    core.register(0x13, 0x13)  # one-way
    assert receive(core, FIND_NODE, 123, A, "find", 0.0) == [Deliver(FIND_NODE, 123, A, "find")]
    assert core.response_type(FIND_NODE) == NODES and core.response_type(0x13) == 0x13
    assert receive(core, NODES, 123, A, None, 0.0) == []  # an unsolicited response
    assert core.receiving.drops == {"unexpected": 1}
    assert core.response_type(0x14) is None


def test_validation_challenge_releases_held_answers_in_order_and_bounded() -> None:
    core = TransportCore(random.Random(9), max_held_addresses=2, max_held_per_address=2)
    for i in range(3):
        core.hold(A, i)
    rid = core.challenge(A)
    core.challenge_sent(rid, A)
    assert receive(core, PONG, rid, B, None, 0.0) == []  # the PONG must come from A
    assert not core.guard.is_validated(A)
    assert receive(core, PONG, rid, A, None, 0.0) == [AddressValidated(A)]
    assert core.guard.is_validated(A)
    assert core.release(A) == [0, 1]  # at most 2 held per address
    assert receive(core, PONG, rid, A, None, 0.0) == []  # a challenge answers once
    for addr in (("10.0.0.3", 1), ("10.0.0.4", 1), ("10.0.0.5", 1)):
        core.hold(addr, addr)
    assert core.release(("10.0.0.3", 1)) == []  # the oldest address was forgotten
    assert core.release(("10.0.0.5", 1)) == [("10.0.0.5", 1)]


def test_known_ids_are_an_lru() -> None:
    core = TransportCore(random.Random(11), max_known_ids=2)
    core.learn(A, b"a" * 32)
    core.learn(B, b"b" * 32)
    core.learn(A, b"A" * 32)  # refreshed
    core.learn(("10.0.0.3", 1), b"c" * 32)
    assert core.node_id_at(A) == b"A" * 32 and core.node_id_at(B) is None


def test_ping_constant_matches_the_wire() -> None:
    assert (int(m.MsgType.PING), int(m.MsgType.PONG), int(m.MsgType.ERROR)) == (PING, PONG, ERROR)


# -- fault injection and capabilities ------------------------------------------------------------------------
class BlockSocket:
    """Hands out prepared receives (GRO blocks and single datagrams)."""

    family = 2
    caps = SocketCaps(gro=True, block_receive=True)

    def __init__(self, receives: list[list[tuple[bytes, tuple[str, int], int]]]) -> None:
        self.receives = receives

    async def recv_blocks(self, max_datagrams: int = 64) -> list[tuple[memoryview, tuple[str, int], int]]:
        await trio.lowlevel.checkpoint()
        if not self.receives:
            await trio.sleep_forever()
        return [(memoryview(d), s, seg) for d, s, seg in self.receives.pop(0)]

    async def recv_batch(self, max_datagrams: int = 64) -> list[tuple[bytes, tuple[str, int]]]:
        await trio.lowlevel.checkpoint()
        return [(d, s) for d, s, _ in self.receives.pop(0)]


def test_lossy_socket_cuts_blocks_into_the_runs_that_survive() -> None:
    rows = [bytes([i]) * 10 for i in range(40)]
    block = b"".join(rows) + b"\xff" * 4  # 40 full rows and a short last one
    receives = [[(block, A, 10), (b"single", B, 0)] for _ in range(30)]
    dropped: list[int] = []
    lossy = LossySocket(BlockSocket(receives), 0.3, np.random.default_rng(5), on_drop=dropped.append)
    assert lossy.caps.block_receive and lossy.caps.gro  # declares what it wraps

    async def main() -> tuple[int, int]:
        kept = total = 0
        for _ in range(30):
            for data, source, segment in await lossy.recv_blocks(64):
                data = bytes(data)
                if source == B:
                    assert data == b"single" and segment == 0
                    kept += 1
                    continue
                size = segment or len(data)
                got = [data[i : i + size] for i in range(0, len(data), size)]
                assert all(row in rows or row == b"\xff" * 4 for row in got)  # whole rows only, never a cut one
                order = [rows.index(row) if row in rows else 40 for row in got]
                assert order == sorted(order) and len(set(order)) == len(order)  # in order, none twice
                kept += len(got)
            total += 42
        return kept, total

    kept, total = trio.run(main)
    assert kept + sum(dropped) == total and lossy.dropped == sum(dropped)
    assert 0.2 < sum(dropped) / total < 0.4


def test_lossy_socket_thins_a_writable_block_in_place_to_exactly_the_rows_kept() -> None:
    """The receive arena is writable: the kept rows move forward in it, in order, and a short last row stays last;
    which rows go is the generator's draws in order (so a seed fixes the pattern however the pool fetches)."""
    rows = [bytes([i]) * 10 for i in range(40)]
    for seed in range(20):
        arena = bytearray(b"".join(rows) + b"\xff" * 4)
        keep = np.random.default_rng(seed).random(41) >= 0.3
        lossy = LossySocket(BlockSocket([[(memoryview(arena), A, 10)]]), 0.3, np.random.default_rng(seed))
        out = lossy._thin(memoryview(arena), A, 10)
        want = b"".join(r for r, k in zip(rows, keep[:40], strict=True) if k) + (b"\xff" * 4 if keep[40] else b"")
        if not want:
            assert out == []
            continue
        (data, _, segment), = out
        assert bytes(data) == want and segment == (10 if keep.sum() > 1 else 0)
        assert data.obj is arena or bytes(arena[: len(want)]) == want  # moved in place
        assert lossy.dropped == 41 - int(keep.sum())


def test_lossy_socket_is_deterministic_for_a_seed() -> None:
    def pattern(seed: int) -> list[bytes]:
        receives = [[(bytes([i, j]), A, 0) for j in range(8)] for i in range(20)]
        lossy = LossySocket(BlockSocket(receives), 0.5, np.random.default_rng(seed))

        async def main() -> list[bytes]:
            out: list[bytes] = []
            while lossy.inner.receives:
                out += [d for d, _ in await lossy.recv_batch(64)]
            return out

        return trio.run(main)

    assert pattern(1) == pattern(1) != pattern(2)


def test_lossy_socket_refuses_certain_loss() -> None:
    with pytest.raises(ValueError):
        LossySocket(BlockSocket([]), 1.0, np.random.default_rng(0))


def test_caps_declare_once_and_only_lose_gso() -> None:
    caps = SocketCaps(gso=True, gso_segments=64)
    caps.lose_gso()
    assert not caps.gso and caps.gso_segments == 1
    assert plain_caps() == SocketCaps() and not plain_caps().block_receive


# -- the trio endpoint over the core ------------------------------------------------------------------------
SECRET = bytes(range(32))


def _endpoint(rng: random.Random | None = None, **kw) -> Endpoint:
    class NullSocket:
        family = 2

        def __init__(self) -> None:
            self.sent: list[tuple[bytes, tuple[str, int]]] = []
            self.inbox: list[list[tuple[bytes, tuple[str, int]]]] = []  # receives to hand out, then none

        async def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
            self.sent.append((bytes(data), addr))

        async def send_many(self, datagrams: list[bytes], addr: tuple[str, int]) -> None:
            self.sent += [(bytes(d), addr) for d in datagrams]

        async def recv_batch(self, max_datagrams: int = 64) -> list:
            if self.inbox:
                await trio.lowlevel.checkpoint()
                return self.inbox.pop(0)
            await trio.sleep_forever()
            return []

        def close(self) -> None:
            pass

    ident = kw.pop("identity", None) or Identity.generate()
    return Endpoint(NullSocket(), ident, SECRET, Metrics(), rng=rng, **kw)  # type: ignore[arg-type]


def test_a_seeded_endpoint_draws_the_same_tokens_and_ids() -> None:
    ident = Identity.generate()
    a, b = _endpoint(random.Random(3), identity=ident), _endpoint(random.Random(3), identity=ident)
    assert a.sealer.token == b.sealer.token  # (a token is its identity's: derived from the key and a drawn nonce)
    assert [a.core.new_id() for _ in range(3)] == [b.core.new_id() for _ in range(3)]
    assert _endpoint().sealer.token != _endpoint().sealer.token  # default: os entropy


def test_junk_is_refused_before_the_opener_and_counted_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = _endpoint(random.Random(4))
    rng = random.Random(5)
    forged = [HEADER.pack(MAGIC, VERSION, 0x03, FLAG_SEALED, rng.getrandbits(64), 1) + rng.randbytes(100)
              for _ in range(200)]
    short = [b"PD", b"\x00" * 10]
    bad_version = [HEADER.pack(MAGIC, VERSION + 1, 0x03, FLAG_SEALED, 1, 1) + b"\0" * 40]
    opened = []
    real_open = ep.opener.open
    monkeypatch.setattr(ep.opener, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    batch = [(d, ("10.9.9.9", 1), 0) for d in forged + short + bad_version]
    assert ep.receive_batch(batch, 0.0) == len(batch)
    # the source's ration: 32 failures at once, and each tried datagram cost one opening
    assert len(opened) == ep.auth_limiter.failure_burst
    assert ep.core.receiving.drops == {"auth": 32, "auth_limited": 168, "malformed": 2, "version": 1}
    assert ep.core.receiving.junk == len(batch)
    trio.run(ep.flush)
    assert ep.core.receiving.drops == {}
    assert counter_value(ep.metrics.datagrams_dropped, reason="auth_limited") == 168


def _member_sealer() -> tuple[Identity, Sealer, Any]:
    """A fresh member, a sealer under its first token, and the ``from`` field its control messages carry."""
    member = Identity.generate()
    binding = member.bind_token()
    return member, Sealer(SECRET, binding.token), binding.sender()


def test_pings_go_before_the_rest_of_their_batch() -> None:
    ep = _endpoint(random.Random(6))
    member, sealer, frm = _member_sealer()
    order: list[str] = []
    ep.on_request(m.MsgType.FIND_NODE, lambda inc: order.append("find_node") or {"nodes": []})
    ep.on_request(m.MsgType.PING, lambda inc: order.append("ping") or {})
    me = ep.identity.node_id
    find = sealer.seal(m.MsgType.FIND_NODE, m.encode(m.MsgType.FIND_NODE, {"rid": 1, "from": frm,
                                                                            "target": bytes(32)}), me)
    ping = sealer.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {"rid": 2, "from": frm}), me)
    src = ("10.1.1.1", 5)
    ep.receive_batch([(find, src, 0), (b"junk", src, 0), (ping, src, 0)], 0.0)
    assert order == ["ping", "find_node"]
    trio.run(ep.flush)
    answered = [d[3] for d, _ in ep.sock.sent]  # type: ignore[attr-defined]
    assert answered == [int(m.MsgType.PONG), int(m.MsgType.NODES)]  # answers in the order handled


def test_a_ping_after_its_senders_data_keeps_its_place() -> None:
    """A member's PING sealed after its data (and after thousands of datagrams to its other destinations) is not
    opened before that data in the same pass: the replay window would move past the data, lost as replayed."""
    ep = _endpoint(random.Random(8))
    member, sealer, frm = _member_sealer()
    me = ep.identity.node_id
    got: list[int] = []
    ep.on_raw(0x40, lambda *a: got.append(1))
    ep.on_raw_block(0x40, lambda mtype, token, state, bodies, source: got.extend([1] * len(bodies)))

    def ping(rid: int) -> bytes:
        return sealer.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {"rid": rid, "from": frm}), me)

    src, other = ("10.1.1.2", 5), ("10.1.1.3", 5)
    ep.receive_batch([(ping(1), src, 0)], 0.0)  # the token is bound
    data = sealer.seal_block(0x40, np.zeros((60, 40), np.uint8), me)
    sealer.seal_block(0x40, np.zeros((9000, 8), np.uint8), bytes(32))  # to its other destinations meanwhile
    late = ping(2)
    binding2 = member.bind_token()
    another = Sealer(SECRET, binding2.token)
    frm2 = binding2.sender()
    first = another.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {"rid": 3, "from": frm2}), me)  # goes first
    ep.receive_batch([(memoryview(data.tobytes()), src, data.shape[1]), (late, src, 0), (first, other, 0)], 0.0)
    assert "replay" not in ep.core.receiving.drops, ep.core.receiving.drops
    assert len(got) == 60
    trio.run(ep.flush)
    assert [addr for _, addr in ep.sock.sent[1:]] == [other, src]  # type: ignore[attr-defined]


def test_peek_agrees_with_parse_header_on_any_bytes() -> None:
    """The receive path's junk sorter gives the reason the full header parser would, or its fields."""
    from peerd.wire.envelope import Header, parse_header, peek
    from peerd.wire.errors import WireError

    rng = random.Random(12)
    good = Header(0x03, FLAG_SEALED, 0x1122334455667788, 9).pack() + b"x" * 30
    samples = [good, good[:20], good[:21], b"", Header(0x01, 0x02 | FLAG_SEALED, 1, 1).pack(),
               Header(0x03, 0x02, 1, 1).pack(), Header(0x03, 0x80, 1, 1).pack()]
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 3)):
            data[rng.randrange(13)] = rng.randrange(256)  # the checked bytes: magic, version, type, flags, token
        samples.append(bytes(data[: rng.choice([len(data), rng.randrange(len(data))])]))
    reasons = set()
    for data in samples:
        try:
            h = parse_header(data)
            expected: object = (h.type, h.flags, h.token)
        except WireError as e:
            expected = e.reason
        assert peek(data) == expected == peek(memoryview(data)), data.hex()
        reasons.add(expected if isinstance(expected, str) else "ok")
    assert reasons == {"ok", "malformed", "version"}


def test_serve_answers_a_ping_before_it_handles_the_rest_of_its_batch() -> None:
    ep = _endpoint(random.Random(7))
    member, sealer, frm = _member_sealer()
    sent_when_handled: list[int] = []
    ep.on_request(m.MsgType.FIND_NODE, lambda inc: sent_when_handled.append(len(ep.sock.sent)) or {"nodes": []})
    me = ep.identity.node_id
    finds = [sealer.seal(m.MsgType.FIND_NODE, m.encode(m.MsgType.FIND_NODE, {"rid": 10 + i, "from": frm,
                                                                              "target": bytes(32)}), me)
             for i in range(3)]
    ping = sealer.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {"rid": 2, "from": frm}), me)
    src = ("10.1.1.1", 5)
    ep.sock.inbox.append([(finds[0], src), (finds[1], src), (ping, src), (finds[2], src)])  # type: ignore[attr-defined]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ep.serve)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sent_when_handled == [1, 1, 1]  # the PONG was out before any FIND_NODE ran
    assert [d[3] for d, _ in ep.sock.sent] == [int(m.MsgType.PONG)] + [int(m.MsgType.NODES)] * 3  # type: ignore


# -- token rotation's decisions -----------------------------------------------------------------------------
class Counter:
    def __init__(self, name: str) -> None:
        self.name, self.sent = name, 0


def test_rotation_schedule_and_binding() -> None:
    from peerd.transport.rotation import Rotation

    made: list[Counter] = []

    def make() -> Counter:
        made.append(Counter(f"s{len(made) + 1}"))
        return made[-1]

    rot = Rotation(make(), 100, make)
    old = rot.current
    old.sent = 74
    assert not rot.step() and rot.next is None  # below 3/4
    old.sent = 75
    assert not rot.step() and rot.next is made[1]  # started: control moves at once, data waits for a binding
    new = rot.next
    assert rot.for_control() is new and rot.for_data(b"B") is old
    rot.answered(old, b"B")  # an answer to a request sealed by the old one binds nothing new
    assert rot.for_data(b"B") is old
    rot.answered(new, b"B")
    assert rot.for_data(b"B") is new and rot.for_data(b"C") is old
    new.sent = 24
    assert not rot.step()  # 99 together
    new.sent = 25
    assert rot.step() and rot.current is new and rot.next is None and rot.rotations == 1
    assert rot.for_data(b"C") is new and rot.for_control() is new
    with pytest.raises(ValueError):
        Rotation(Counter("x"), 3, make)


def test_endpoint_loss_is_the_socket_wrappers_and_counted() -> None:
    receives = [[(b"XX" + bytes(40), ("10.0.0.9", 1), 0) for _ in range(50)] for _ in range(4)]
    ep = Endpoint(BlockSocket(receives), Identity.generate(), SECRET, Metrics(), loss=0.5, loss_seed=3)  # type: ignore
    assert isinstance(ep.sock, LossySocket) and ep.caps.block_receive  # the wrapped socket's capabilities

    async def main() -> None:
        with trio.move_on_after(1):
            await ep.serve()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    injected = counter_value(ep.metrics.datagrams_dropped, reason="injected")
    assert injected == ep.sock.dropped and 60 < injected < 140  # type: ignore[attr-defined]
    assert injected + counter_value(ep.metrics.datagrams_dropped, reason="malformed") == 200


def test_lossy_socket_loses_after_the_native_screen() -> None:
    """The native screen reads the socket below the wrapper, so the loss runs on what the screen passed (it once
    turned the screen off, and `--loss` then took the slow receive path: 13x the receive calls). Survivors keep
    one block per block, rows in order."""
    rows = [bytes([i]) * 10 for i in range(64)]

    class Screening(BlockSocket):
        screens = True

        async def recv_screened(self, limit: int, screen: tuple, limiter: object = None, *,
                                shedding: bool = False) -> tuple:
            await trio.lowlevel.checkpoint()
            block = memoryview(bytearray(b"".join(rows) + b"\xff" * 3))  # writable, as the receive arena
            unknown = [(b"u%d" % i, B) for i in range(10)]
            return ([(block, A, 10)], unknown, 1, 0, 7, 0, True, 0.0, 0)

    dropped: list[int] = []
    lossy = LossySocket(Screening([]), 0.3, np.random.default_rng(0), on_drop=dropped.append)
    assert lossy.screens is True
    blocks, unknown, *rest = trio.run(lossy.recv_screened, 64, (), None)
    assert rest == [1, 0, 7, 0, True, 0.0, 0]  # the screen's own counts pass through
    assert len(blocks) == 1
    data, source, segment = blocks[0]
    data = bytes(data)
    got = [data[i : i + 10] for i in range(0, len(data), 10)]
    indices = [rows.index(r) for r in got if r in rows]
    assert indices == sorted(indices) and all(r in rows or r == b"\xff" * 3 for r in got)
    assert len(got) + len(unknown) + sum(dropped) == 65 + 10 and 5 < sum(dropped) < 40


def test_a_member_cannot_squat_another_members_token_hostile() -> None:
    """Mallory reads Victor's token off any of his headers, seals a PING under it (she holds the swarm secret) with
    her own key and a signature of hers over the token, and gets it to the receiver before Victor does. The first
    binding used to win, so Victor's control messages were refused there until he rotated. A token is derived from
    its owner's key now: Mallory's binding is refused, and Victor's PING is answered."""
    ep = _endpoint(random.Random(11))
    victor, mallory = Identity.generate(), Identity.generate()
    me = ep.identity.node_id
    vb = victor.bind_token()
    victor_sealer = Sealer(SECRET, vb.token)
    victor_sealer.seal_block(0x40, np.zeros((3, 8), np.uint8), bytes(32))  # sequences 1..3 went elsewhere
    squatter = Sealer(SECRET, vb.token)  # sequence 1, under Victor's token
    squat = {"pk": mallory.public_key, "sig": vb.nonce + mallory.sign_token(vb.token), "addr": None}
    ep.receive_batch([(squatter.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {"rid": 1, "from": squat}), me),
                       ("10.6.6.6", 5), 0)], 0.0)
    assert ep.core.receiving.drops.get("identity") == 1
    ping = victor_sealer.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {"rid": 2, "from": vb.sender()}), me)
    ep.receive_batch([(ping, ("10.1.1.9", 5), 0)], 0.0)
    assert ep.core.receiving.drops.get("identity") == 1, ep.core.receiving.drops
    assert ep.opener.token_state(vb.token).peer_key == victor.public_key  # type: ignore[union-attr]
    trio.run(ep.flush)
    assert [(d[3], addr) for d, addr in ep.sock.sent] == [(int(m.MsgType.PONG), ("10.1.1.9", 5))]  # type: ignore[attr-defined]


@pytest.mark.parametrize("serving", [True, False], ids=["tended-by-serve", "tended-by-the-caller"])
def test_an_unanswered_request_follows_the_cores_schedule_through_the_endpoint(serving: bool) -> None:
    """The endpoint carries out the core's actions: each Transmit at the schedule's times, then RpcTimeout at the
    deadline, whether ``serve`` tends the core's timer or (no receive loop) the caller does."""
    sent: list[float] = []
    nobody = ("10.9.9.9", 9)

    async def body(net: MemNet, nursery: trio.Nursery) -> None:
        ep = Endpoint(net.socket("10.0.0.1", 1), Identity.generate(), SECRET, Metrics())
        deliver = net.deliver
        net.deliver = lambda src, dst, data: (sent.append(trio.current_time()), deliver(src, dst, data))[1]
        if serving:
            await nursery.start(ep.serve)
        start = trio.current_time()
        with pytest.raises(RpcTimeout, match="within 3.50 s"):
            await ep.request(nobody, m.MsgType.PING, {}, timeout=0.5, attempts=3)
        assert trio.current_time() - start == pytest.approx(3.5)
        assert [t - start for t in sent] == pytest.approx([0.0, 0.5, 1.5])
        assert ep.core.open_requests() == 0 and ep.core.get_timer() is None

    run_on_memnet(body)
