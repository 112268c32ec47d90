"""The receive policy (peerd/transport/receive.py) in virtual time: the pause after a pass under a junk flood, the
coalescing wait for a trickle of tensor data, what goes first in a batch, the per-pass rationing of key
derivations, the per-datagram screen, and the counts a pass hands to Prometheus."""

from __future__ import annotations

import dataclasses
import random

import pytest

from peerd.transport.core import TransportCore
from peerd.transport.guard import AuthLimiter
from peerd.transport.receive import (
    COALESCE_BELOW,
    COALESCE_FIRST_S,
    COALESCE_S,
    DERIVE,
    OPEN,
    REFUSE,
    PassDecision,
    ReceivePolicy,
    rows_share_head,
)
from peerd.wire import messages as m
from peerd.wire.envelope import FLAG_SEALED, HEADER, MAGIC, VERSION

SRC, OTHER = ("10.0.0.1", 7000), ("10.0.0.2", 7000)


def pause_after(policy: ReceivePolicy, now: float, junk: int, backlog: bool, honest: int = 0) -> float:
    """One pass at ``now`` that refused ``junk`` datagrams unopened and handled ``honest`` others."""
    policy.start_pass()
    if junk:
        policy.refused("auth_limited", junk)
    return decide(policy, junk + honest, backlog, now, now).pause


def decide(core: ReceivePolicy | TransportCore, datagrams: int, backlog: bool, started: float,
           now: float) -> PassDecision:
    """End a pass and take the one action it queued: its decision."""
    core.receive_pass(datagrams, backlog, started, now)
    actions = core.take_actions()
    assert len(actions) == 1 and isinstance(actions[0], PassDecision)
    return actions[0]


def datagram(mtype: int, size: int = 60, token: int = 1) -> bytes:
    return HEADER.pack(MAGIC, VERSION, mtype, FLAG_SEALED, token, 1) + b"\0" * (size - HEADER.size)


def test_the_pass_pauses_only_under_a_junk_flood_and_never_on_a_full_batch() -> None:
    policy = TransportCore(random.Random(10), junk_pause_s=0.008).receiving
    busy = 5  # authenticated datagrams a pass: 500 a second, a busy node (an average running)
    for i in range(11):  # 20 junk datagrams every 10 ms: 2000 a second (no pause before a window is measured)
        assert pause_after(policy, i / 100, 20, False, busy) == 0.0 or i == 10
    now = 0.1
    stats = policy.statistics()
    assert stats.junk_rate == pytest.approx(2000, rel=0.15)
    assert stats.honest_rate == pytest.approx(500, rel=0.15)
    assert pause_after(policy, now, 20, False, busy) == 0.008  # 64 would take 32 ms to come: the cap
    assert pause_after(policy, now, 0, False, busy) == 0.0  # a pass without junk
    assert pause_after(policy, now, 1000, True, busy) == 0.0  # a backlog (the pass stopped at a limit): at once
    for _ in range(30):  # 300 a second: below the floor
        now += 0.01
        pause_after(policy, now, 3, False, busy)
    assert pause_after(policy, now, 3, False, busy) == 0.0
    for _ in range(30):  # 20,000 a second: the pause shrinks, the batch stays near 64
        now += 0.01
        pause_after(policy, now, 200, False, busy)
    assert pause_after(policy, now, 200, False, busy) == pytest.approx(64 / 20000, rel=0.2)
    now += 5.0  # a long quiet spell forgets the rate
    pause_after(policy, now, 1, False)
    assert policy.statistics().junk_rate == 0.0 and policy.statistics().honest_rate == 0.0


def test_the_pause_is_long_on_an_idle_node_and_short_once_traffic_comes() -> None:
    """An idle node (a PING now and then) takes a flood in batches of about 256, at most 32 ms apart; authenticated
    traffic at 200 a second brings the 8 ms cap back within the window that shows it."""
    policy = TransportCore(random.Random(12), junk_pause_s=0.008, junk_idle_pause_s=0.032).receiving
    now = 0.0
    for i in range(40):  # 5000 junk datagrams a second, one PING every 80 ms
        now = i / 100
        pause_after(policy, now, 50, False, 1 if i % 8 == 0 else 0)
    assert policy.statistics().honest_rate < 200
    assert pause_after(policy, now, 50, False) == pytest.approx(0.032)  # 256 at 5000/s: 51 ms, capped at 32
    for _ in range(30):  # 20,000 a second: batches of about 256
        now += 0.01
        pause_after(policy, now, 200, False)
    assert pause_after(policy, now, 200, False) == pytest.approx(256 / 20000, rel=0.2)
    now += 0.01
    assert pause_after(policy, now, 200, False, 25) == pytest.approx(64 / 20000, rel=0.2)  # 2500/s now: busy


def test_a_trickle_of_tensor_data_waits_short_then_long_and_a_full_pass_never_waits() -> None:
    policy = ReceivePolicy(AuthLimiter())
    decisions = []
    for i in range(3):
        policy.start_pass()
        policy.data_blocks += 1
        decisions.append(decide(policy, 10, False, i * 0.01, i * 0.01))
    assert decisions == [PassDecision(COALESCE_FIRST_S, "trickle"), PassDecision(COALESCE_S, "trickle"),
                         PassDecision(COALESCE_S, "trickle")]
    policy.data_blocks += 1  # a backlog, or a pass of many datagrams, is no trickle and ends the run
    assert decide(policy, 10, True, 0.05, 0.05) == PassDecision(0.0, "")
    policy.data_blocks += 1
    assert decide(policy, COALESCE_BELOW, False, 0.06, 0.06) == PassDecision(0.0, "")
    policy.data_blocks += 1
    assert decide(policy, 10, False, 0.07, 0.07).pause == COALESCE_FIRST_S  # a new run starts short
    assert decide(policy, 10, False, 0.08, 0.08) == PassDecision(0.0, "")  # no tensor data: no wait
    stats = policy.statistics()
    assert (stats.passes, stats.trickle_pauses, stats.junk_pauses) == (7, 4, 0)


def test_the_pause_is_the_core_timer_and_a_caught_up_pass_is_remembered() -> None:
    core = TransportCore(random.Random(1))
    policy = core.receiving
    policy.data_blocks += 1
    decision = decide(core, 3, False, 1.0, 1.002)
    assert core.get_timer() == pytest.approx(1.002 + decision.pause)
    assert policy.statistics().caught_up_at == 1.0  # the pass began at 1.0 and emptied the socket
    core.handle_timer(1.0025)  # early: the pause still runs
    assert core.get_timer() is not None
    core.handle_timer(1.002 + decision.pause)
    assert core.get_timer() is None
    assert decide(core, RECV := 1024, True, 2.0, 2.01) == PassDecision(0.0, "")  # a backlog: not caught up at 2.0
    assert policy.caught_up_at == 1.0 and RECV
    stats = core.statistics()
    assert stats.receiving.passes == 2 and stats.open_requests == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.open_requests = 1  # type: ignore[misc]


def test_small_pings_and_pongs_go_first_unless_their_source_sent_data_before_them() -> None:
    ping, pong, data = datagram(m.MsgType.PING), datagram(m.MsgType.PONG), datagram(0x40, 1200)
    big_ping = datagram(m.MsgType.PING, 600)
    assert ReceivePolicy.urgent([(ping, SRC, 0)]) == []  # alone: nothing to go before
    assert ReceivePolicy.urgent([(ping, SRC, 0), (pong, OTHER, 0)]) == [0, 1]  # all of them first
    batch = [(data, SRC, 0), (ping, OTHER, 0), (big_ping, OTHER, 0), (pong, SRC, 0), (data, OTHER, 1200),
             (ping, ("10.0.0.3", 1), 0)]
    # OTHER's PING goes first; the big one waits; SRC's PONG came after SRC's data: it keeps its place
    assert ReceivePolicy.urgent(batch) == [1, 5]


def test_the_screen_opens_known_tokens_and_charges_a_derivation_for_unknown_ones() -> None:
    limiter = AuthLimiter(failure_rate=1e-6, failure_burst=2, derive_rate=1e-6, derive_burst=2)
    policy = ReceivePolicy(limiter)
    assert policy.screen(FLAG_SEALED, True, 100, SRC, 0.0) is OPEN
    assert policy.screen(FLAG_SEALED, False, 10, SRC, 0.0) == "malformed"  # shorter than a header and a tag
    assert policy.screen(FLAG_SEALED, False, 100, SRC, 0.0) is DERIVE
    assert policy.screen(FLAG_SEALED, False, 100, SRC, 0.0) is DERIVE
    assert policy.screen(FLAG_SEALED, False, 100, SRC, 0.0) is REFUSE  # out of derivations
    assert policy.screen(0, False, 100, OTHER, 0.0) == "auth"  # unsealed under an unknown token: a failure
    unsealed = ReceivePolicy(limiter, sealed=False)
    assert unsealed.screen(0, False, 100, SRC, 0.0) is OPEN
    assert unsealed.screen_rows(FLAG_SEALED, False, 100, SRC, 0.0) is None


def test_a_pass_grants_one_derivation_per_source_hostile() -> None:
    """A flood from one source under unknown tokens costs one derivation a pass; a source refused stays refused
    for the pass; once a key was derived, a datagram whose token is known by then is opened."""
    known: set[int] = set()
    limiter = AuthLimiter(failure_rate=1e-6, failure_burst=1, derive_rate=1e-6, derive_burst=1)
    ration = ReceivePolicy(limiter).ration(lambda token: token in known, rationed=False)
    assert ration.decide(datagram(3, token=7), SRC, 0.0) is DERIVE
    known.add(7)
    assert ration.decide(datagram(3, token=7), SRC, 0.0) is OPEN  # its key was derived in this pass
    assert ration.decide(datagram(3, token=8), SRC, 0.0) is REFUSE  # one derivation a pass
    assert ration.decide(datagram(3, token=9), OTHER, 0.0) is REFUSE  # the node's derivations are spent
    # where the native pass rationed in C, the first datagram's derivation was granted there
    native = ReceivePolicy(AuthLimiter()).ration(lambda token: False, rationed=True)
    assert native.decide(datagram(3, token=5), OTHER, 0.0) is DERIVE


def test_counts_are_drained_once_per_pass() -> None:
    policy = ReceivePolicy(AuthLimiter())
    policy.refused("malformed", 3)
    policy.dropped("unexpected")
    policy.accepted(int(m.MsgType.PING), SRC, 80)
    policy.accepted(0x41, SRC, 2400, 2)  # every data type is counted as data
    assert policy.junk == 3
    assert policy.take_counts() == ({"malformed": 3, "unexpected": 1}, {int(m.MsgType.PING): 1, 0x40: 2})
    assert policy.take_counts() == ({}, {})


def test_a_block_is_refused_whole_only_when_its_rows_share_one_header() -> None:
    row = datagram(3, 100, token=9)
    assert rows_share_head(row * 4, 4, 100)
    other = datagram(3, 100, token=10)
    assert not rows_share_head(row * 3 + other, 4, 100)
    assert not rows_share_head(b"\0" * 20, 4, 5)  # rows shorter than the header up to the token


def test_the_core_and_its_guard_import_no_socket_module() -> None:
    """The sans-I/O core (and the guard it builds its limiter with) never loads the UDP socket module."""
    import subprocess
    import sys

    code = "import sys, peerd.transport.core, peerd.transport.guard; assert 'peerd.transport.udp' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
