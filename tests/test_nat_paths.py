"""NAT path choice as a sans-I/O core (peerd/nat/paths.py) in virtual time: the test plays the network, answering
or dropping the PINGs and INTROs the core asks for, and checks what the core does to the endpoint's tables."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest

from peerd.nat.paths import (
    DIRECT_RETRIES,
    ClearRelay,
    Paths,
    SendPing,
    SetAlias,
    SetPunched,
    SetRelay,
)
from peerd.nat.punch import PUNCH_DEADLINE, Intro

ME, RELAY, TARGET = b"m" * 32, b"r" * 32, b"t" * 32
RELAY_AT, TARGET_AT = ("203.0.113.1", 7000), ("198.51.100.9", 7000)

Answer = Callable[[SendPing], bytes | None]


def pump(core: Paths, now: float, answer: Answer, intro: Callable[[bytes], tuple | None] = lambda t: None) -> list:
    """Carry out the core's actions until it has none: each PING answered by ``answer(ping)`` (the node id that
    answered, or None: lost), each INTRO by ``intro(target)``. Returns every action taken."""
    taken = []
    while actions := core.take_actions():
        taken += actions
        for a in actions:
            if isinstance(a, SendPing):
                who = answer(a)
                if who is None:
                    core.ping_failed(a.token, now)
                else:
                    relayed = a.addr in core.relays  # (the endpoint sends through the relay it has for it)
                    core.receive_answer(a.addr, who, [], now)  # (the endpoint's hook comes first)
                    core.receive_pong(a.token, who, relayed, now)
            elif isinstance(a, Intro):
                core.receive_intro(a.target, intro(a.target), now)
    return taken


def network(core: Paths, *, direct: set[bytes], relayed: set[bytes] = frozenset()) -> Answer:
    """Who answers: the peers in ``direct`` when PINGed directly; those in ``relayed`` through a relay only."""

    def answer(ping: SendPing) -> bytes | None:
        ok = ping.node_id in (relayed if ping.addr in core.relays else direct)
        return ping.node_id if ok else None

    return answer


def core_with_relay(now: float = 0.0) -> Paths:
    """A core that reached a relay (which named TARGET to it), and has not reached TARGET."""
    core = Paths(ME, random.Random(1))
    core.receive_answer(RELAY_AT, RELAY, [(TARGET, *TARGET_AT)], now)
    core.take_actions()
    return core


def test_a_peer_nobody_vouches_for_is_punched_but_never_relayed_hostile() -> None:
    """A minted identity the DHT named (no introducer has reached it): its silence starts a punch, whose INTRO
    finds nothing, and no relay is tried: no PING goes through any relay."""
    core = core_with_relay()
    core.request_unanswered(TARGET_AT, TARGET, 1.0)
    taken = pump(core, 1.0, network(core, direct={RELAY}))
    assert any(isinstance(a, Intro) for a in taken)
    assert not any(isinstance(a, SetRelay) for a in taken)
    assert core.statistics().relays_not_tried == {"unintroduced": 1}
    assert TARGET not in core.active


def test_a_vouched_peer_silent_while_others_answer_is_relayed_and_a_direct_answer_ends_it() -> None:
    core = core_with_relay()
    core.request_unanswered(TARGET_AT, TARGET, 1.0)
    taken = pump(core, 1.0, network(core, direct={RELAY}, relayed={TARGET}), intro=lambda t: TARGET_AT)
    assert not core.relays  # the punch is under way (its PINGs lost): nothing relayed yet
    core.handle_timer(1.0 + PUNCH_DEADLINE)  # the punch fails
    taken = pump(core, 1.0 + PUNCH_DEADLINE, network(core, direct={RELAY}, relayed={TARGET}))
    direct_pings = [a for a in taken if isinstance(a, SendPing) and a.attempts == DIRECT_RETRIES]
    assert {a.node_id for a in direct_pings} == {TARGET, RELAY}  # the target, and the control beside it
    assert SetRelay(TARGET_AT, TARGET, RELAY, RELAY_AT) in taken
    assert core.relays == {TARGET_AT: (TARGET, RELAY, RELAY_AT)} and core.kind[TARGET] == "relayed"
    assert core.path_to(TARGET_AT, TARGET, 5.0) == "relayed"
    # it answers directly at another address (its NAT's mapping): the relay goes, and that address is used
    mapped = ("198.51.100.9", 40000)
    core.receive_answer(mapped, TARGET, [], 6.0)
    taken = core.take_actions()
    assert ClearRelay(TARGET_AT) in taken and SetAlias(TARGET_AT, mapped) in taken
    assert not core.relays and TARGET not in core.kind
    assert core.path_to(TARGET_AT, TARGET, 6.0) == "direct"


def test_silence_on_a_lossy_link_is_not_a_nat() -> None:
    """The punch failed and the target is silent, but so is the control peer: this node's own link is lossy or
    flooded, and nothing is relayed."""
    core = core_with_relay()
    core.request_unanswered(TARGET_AT, TARGET, 1.0)
    pump(core, 1.0, network(core, direct=set()), intro=lambda t: TARGET_AT)
    core.handle_timer(1.0 + PUNCH_DEADLINE)
    taken = pump(core, 1.0 + PUNCH_DEADLINE, network(core, direct=set(), relayed={TARGET}))
    assert not any(isinstance(a, SetRelay) for a in taken) and not core.relays
    assert core.statistics().relays_not_tried == {"lossy": 1}
    assert TARGET not in core.active


def test_a_peer_that_answered_before_is_never_punched_or_relayed() -> None:
    """Its requests now go unanswered (a flood at either end): loss, not a NAT."""
    core = core_with_relay()
    core.receive_answer(TARGET_AT, TARGET, [], 0.5)
    core.take_actions()
    core.request_unanswered(TARGET_AT, TARGET, 1.0)
    assert pump(core, 1.0, network(core, direct=set())) == []
    core.punch_failed(TARGET, True, 1.0)  # (even if a punch had been under way)
    assert pump(core, 1.0, network(core, direct=set())) == []
    assert core.statistics().relays_not_tried == {"answered_before": 1}


def punching(core: Paths, now: float) -> list:
    """TARGET's first request went unanswered at ``now``: the punch starts (its INTRO out, no answer yet)."""
    core.request_unanswered(TARGET_AT, TARGET, now)
    taken = core.take_actions()
    assert any(isinstance(a, Intro) for a in taken) and TARGET in core.active
    return taken


def test_a_lost_first_request_answered_where_it_was_asked_leaves_the_path_direct() -> None:
    """A flat link lost the first request: the punch it started is overtaken by the retry's answer at the very
    address asked, with nothing from the peer first. No punched path: the kind stays direct, the endpoint is not
    told ``set_punched``, and a late INTRO_OK starts no PINGs."""
    core = core_with_relay()
    punching(core, 1.0)
    core.receive_answer(TARGET_AT, TARGET, [], 1.02)
    taken = core.take_actions()
    assert not any(isinstance(a, SetPunched) for a in taken)
    assert TARGET not in core.kind and TARGET not in core.active
    assert core.path_to(TARGET_AT, TARGET, 1.02) == "direct"
    core.receive_intro(TARGET, TARGET_AT, 1.03)
    assert core.take_actions() == []
    stats = core.statistics()
    assert stats.paths == {"direct": 2, "punched": 0, "relayed": 0} and stats.punched == 0
    assert core.puncher.statistics().direct == 1


def test_a_punch_ping_answered_before_the_peer_sent_anything_is_a_direct_path() -> None:
    """The retry was lost too, the INTRO_OK came and the punch PINGs went: answered at the address asked, before
    any PING of the peer's own arrived (a NAT in front of it would have passed none of them first)."""
    core = core_with_relay()
    punching(core, 1.0)
    core.receive_intro(TARGET, TARGET_AT, 1.05)
    taken = pump(core, 1.05, network(core, direct={TARGET, RELAY}))
    assert any(isinstance(a, SendPing) and a.node_id == TARGET for a in taken)
    assert not any(isinstance(a, SetPunched) for a in taken)
    assert TARGET not in core.kind and core.path_to(TARGET_AT, TARGET, 1.1) == "direct"


def test_a_peer_whose_own_punch_ping_came_first_is_punched() -> None:
    """The peer's PING (its side of the punch) arrived before any answer: its NAT may have needed it, so the path
    is a punched one, and an answer at the same address afterwards changes nothing."""
    core = core_with_relay()
    punching(core, 1.0)
    core.receive_request(TARGET_AT, TARGET, 1.05)
    taken = core.take_actions()
    assert SetPunched(TARGET_AT) in taken and core.kind[TARGET] == "punched"
    core.receive_answer(TARGET_AT, TARGET, [], 1.1)
    assert core.take_actions() == [] and core.path_to(TARGET_AT, TARGET, 1.1) == "punched"


def test_a_peer_that_wrote_from_the_address_asked_stays_direct_whatever_settles_the_punch() -> None:
    """It sent this node a request from TARGET_AT lately (its flow here is open), then a request to it was lost:
    even its own punch PING arriving first settles a direct path."""
    core = core_with_relay()
    core.receive_request(TARGET_AT, TARGET, 0.5)
    core.take_actions()
    punching(core, 1.0)
    core.receive_request(TARGET_AT, TARGET, 1.05)
    taken = core.take_actions()
    assert not any(isinstance(a, SetPunched) for a in taken)
    assert TARGET not in core.kind and TARGET not in core.active
    assert core.path_to(TARGET_AT, TARGET, 1.05) == "direct"


def test_a_connect_from_a_peer_that_answered_here_pings_for_its_sake_and_stays_direct() -> None:
    """The peer lost a request to this node and punches; its CONNECT names where it answered this node: the PINGs
    go (its NAT, if any, may need them), and whichever of its datagrams arrives first, the path is direct. A
    CONNECT for a peer never reached ends punched."""
    core = core_with_relay()
    core.receive_answer(TARGET_AT, TARGET, [], 0.5)
    core.take_actions()
    core.receive_connect(TARGET, TARGET_AT, 1.0)
    core.handle_timer(1.0)
    taken = core.take_actions()
    assert any(isinstance(a, SendPing) and a.addr == TARGET_AT for a in taken)
    core.receive_request(TARGET_AT, TARGET, 1.01)  # its own PING came first
    assert not any(isinstance(a, SetPunched) for a in core.take_actions()) and TARGET not in core.kind
    other, other_at = b"o" * 32, ("198.51.100.20", 7000)
    core.named_at[other] = other_at  # (the DHT named it there)
    core.receive_connect(other, other_at, 2.0)
    core.handle_timer(2.0)
    core.take_actions()
    core.receive_request(other_at, other, 2.01)
    assert SetPunched(other_at) in core.take_actions() and core.kind[other] == "punched"


def test_another_nodes_answer_at_the_address_asked_settles_nothing_hostile() -> None:
    """A member answering at TARGET's address under its own identity (a NAT that moved the port to it, or an
    attacker sitting there) proves nothing about TARGET's path: the punch runs on, and a PING of TARGET's own
    that comes first still settles it punched."""
    core = core_with_relay()
    punching(core, 1.0)
    core.receive_answer(TARGET_AT, b"x" * 32, [], 1.02)
    core.take_actions()
    assert TARGET in core.active and core.puncher.punching(TARGET)
    core.receive_request(TARGET_AT, TARGET, 1.05)
    assert SetPunched(TARGET_AT) in core.take_actions() and core.kind[TARGET] == "punched"


def test_a_relayed_datagram_gets_a_standin_and_a_confirmed_relay_only_for_a_silent_peer() -> None:
    core = core_with_relay()
    addr, why = core.receive_relayed(RELAY, RELAY_AT, TARGET, 1.0)
    assert why == "" and addr == core.standin(TARGET, RELAY)
    assert core.receive_relayed(RELAY, ("192.0.2.1", 9), TARGET, 1.0) == (None, "unreached")
    assert core.receive_relayed(RELAY, RELAY_AT, ME, 1.0) == (None, "self")
    core.relayed_opened(addr, TARGET, RELAY, RELAY_AT, 1.0)
    assert core.relays[addr] == (TARGET, RELAY, RELAY_AT)  # answers go back through the relay
    pump(core, 1.0, network(core, direct={RELAY}, relayed={TARGET}))
    assert core.kind.get(TARGET) == "relayed" and core.relay_entry(TARGET) == (TARGET, RELAY, RELAY_AT)


def test_timers_and_statistics_follow_the_core_contract() -> None:
    core = core_with_relay()
    assert core.get_timer() is None  # nothing to do before start
    core.start(0.0)
    assert core.get_timer() == 0.0
    core.handle_timer(0.0)
    actions = core.take_actions()
    assert actions and core.get_timer() > 0.0
    stats = core.statistics()
    assert stats.reached == 1 and stats.paths["direct"] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.reached = 2  # type: ignore[misc]


def relayed_core() -> Paths:
    """A core that relays TARGET through RELAY (confirmed by a PING through it)."""
    core = core_with_relay()
    addr, _ = core.receive_relayed(RELAY, RELAY_AT, TARGET, 1.0)
    core.relayed_opened(addr, TARGET, RELAY, RELAY_AT, 1.0)
    pump(core, 1.0, network(core, direct={RELAY}, relayed={TARGET}))
    assert core.kind.get(TARGET) == "relayed"
    return core


def test_a_relayed_peer_heard_directly_is_pinged_there_and_keeps_its_relay_until_it_answers() -> None:
    core = relayed_core()
    standin = core.standin(TARGET, RELAY)
    # a request from it arrives directly, at its own address
    core.receive_request(TARGET_AT, TARGET, 2.0)
    pump(core, 2.0, network(core, direct={RELAY}, relayed={TARGET}))  # the direct PING is lost: the relay stays
    assert core.kind.get(TARGET) == "relayed" and core.relays.get(standin) == (TARGET, RELAY, RELAY_AT)
    core.receive_request(TARGET_AT, TARGET, 5.0)  # within DIRECT_CHECK_S: no second PING
    assert core.take_actions() == []
    core.receive_request(TARGET_AT, TARGET, 13.0)
    pump(core, 13.0, network(core, direct={RELAY, TARGET}))  # answered directly: the relay goes
    assert TARGET not in core.kind and core.relay_entry(TARGET) is None
    assert core.path_to(TARGET_AT, TARGET, 13.0) == "direct"


def test_discovery_tries_a_named_peer_again_soon_then_less_often() -> None:
    """A named peer no path reached is tried again 10 s later, then 20 s, 40 s, ... up to 120 s apart: a first try
    while the swarm forms can fail for what passes in seconds, and a member without a path holds up averages."""
    from peerd.nat.paths import Connect

    core = core_with_relay()
    core.start(0.0)
    tries = []
    for step in range(0, 400):
        now = step * 1.0
        core.handle_timer(now)
        for a in core.take_actions():
            if isinstance(a, Connect) and a.node_id == TARGET:
                tries.append(now)
                core.connect_done(a.addr, now)  # nothing answered
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert tries[0] == 0.0 and gaps[:4] == [10.0, 20.0, 40.0, 80.0] and set(gaps[4:]) == {120.0}, tries


def test_a_punch_ping_answered_through_a_relay_is_no_punch() -> None:
    """The endpoint routes a PING to an address it has a relay for through that relay: an answer that came back
    that way proves no direct path, so a punch (or a direct check) it answers counts as silence; a relay trial's
    PING counts its relayed answer."""
    core = Paths(ME, random.Random(1))
    got: list = []
    core._ping(TARGET, TARGET_AT, lambda who, now, tag: got.append((tag, who)), ("punch",), 1.0, 1)
    core._ping(TARGET, TARGET_AT, lambda who, now, tag: got.append((tag, who)), ("trial",), None, 2, direct=False)
    for a in [a for a in core.take_actions() if isinstance(a, SendPing)]:
        core.receive_pong(a.token, TARGET, True, 1.0)
    assert got == [("punch", None), ("trial", TARGET)]
