"""A relayed member's share of an average is paced for its relay (issue 19): the pacer's stated limit,
shared by every member behind one relay, keeps an honest sender inside the relay's token bucket."""

from __future__ import annotations

from types import SimpleNamespace

from peerd.moshpit.averager import RELAY_SHARE, PathsFirst
from peerd.nat.relay import DEFAULT_RATE, RelayServer
from peerd.transport.pacing import Pacer


def send(pacer: Pacer, dests: list[object], seconds: float, size: int = 1232) -> dict[object, list[float]]:
    """A backlogged sender taking its destinations in turn, each send when the pacer allows: send times."""
    now, out = 0.0, {d: [] for d in dests}
    i = 0
    while now < seconds:
        d = dests[i % len(dests)]
        now += max(0.0, pacer.reserve(size, d, now))
        out[d].append(now)
        i += 1
    return out


def test_members_behind_one_relay_share_its_grant_and_the_relay_refuses_nothing() -> None:
    pacer = Pacer(rate=50e6, max_rate=50e6)
    for dest in ("b", "c"):
        pacer.limit(dest, ("relay", b"r"), RELAY_SHARE * DEFAULT_RATE, 256_000.0)
    times = send(pacer, ["a", "b", "c"], 2.0)
    relayed = sorted(times["b"] + times["c"])
    rate = 1232 * len(relayed) / 2.0
    assert 0.8 * RELAY_SHARE * DEFAULT_RATE < rate <= RELAY_SHARE * DEFAULT_RATE * 1.02
    relay = RelayServer()
    for node in (b"s", b"b"):
        relay.reached(node, ("203.0.113.9", 1), 0.0)
    refused = [t for t in relayed if not isinstance(relay.forward(b"s", b"b", 1232, t), tuple)]
    assert refused == []
    # lifted: the uplink's rate alone again
    pacer.limit("b")
    assert pacer.reserve(1232, "b", 10.0) <= 0.01


def test_an_unpaced_sender_overruns_the_relay() -> None:
    """What the limit prevents: at the uplink's rate, the relay's bucket refuses most of it (data lost)."""
    relay = RelayServer()
    for node in (b"s", b"b"):
        relay.reached(node, ("203.0.113.9", 1), 0.0)
    times = [i * 1232 / 12.5e6 for i in range(10_000)]
    refused = sum(not isinstance(relay.forward(b"s", b"b", 1232, t), tuple) for t in times)
    assert refused > 5_000


def test_paths_first_limits_relayed_members_only() -> None:
    pacer = Pacer()
    entries = {b"b": (b"b", b"relay1", ("203.0.113.9", 1)), b"c": (b"c", b"relay1", ("203.0.113.9", 1))}
    nat = SimpleNamespace(relay_entry=entries.get)
    pf = PathsFirst(SimpleNamespace(pacer=pacer), nat)  # type: ignore[arg-type]
    pacer.limit(b"a", ("relay", b"old"), 1e6, 1e5)
    pf.pace_relayed({b"a": "direct", b"b": "relayed", b"c": "relayed", b"d": None})
    assert set(pacer._limits) == {b"b", b"c"}
    assert pacer._limits[b"b"][0] is pacer._limits[b"c"][0]  # one bucket: the relay's grant is per sender


def test_a_relay_passes_datagrams_on_in_the_order_they_came() -> None:
    """One forwarder, not a task per RELAY: trio runs a batch of tasks backwards half the time, and receivers
    took the reordering for loss (their REPORTs cut the senders' pacers to 0.25-2 MB/s)."""
    import trio
    import trio.testing

    from .support.nat_nodes import NatMemNet, NatNode

    async def main() -> None:
        node = NatNode(NatMemNet(), "p1", 0)
        out: list[bytes] = []

        async def pass_on(addr, node_id, src, data) -> None:  # noqa: ANN001
            out.append(data)
            await trio.sleep(0)

        node.endpoint.pass_on = pass_on  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.nat._pass_on_all)
            sent = [i.to_bytes(2, "big") for i in range(500)]
            for data in sent:
                node.nat._relay_in.send_nowait((("203.0.113.9", 1), b"t" * 32, b"s" * 32, data))
            await trio.sleep(1)
            assert out == sent
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_what_a_relay_passes_on_shares_its_uplink_while_it_averages() -> None:
    pacer = Pacer(rate=10e6, max_rate=10e6)
    assert pacer.reserve_cross(1_000_000, 0.0) == 0.0  # idle (a relay that averages nothing): never held
    pacer.reserve(1232, "a", 1.0)  # it averages now
    assert pacer.reserve_cross(1_000_000, 1.0) < 0.01  # taken from the uplink's bucket ...
    assert pacer.reserve(1232, "a", 1.0) > 0.09  # ... so its own data waits for it: 1 MB at 10 MB/s
    assert pacer.reserve_cross(1232, 1.0) > 0.09  # and so does more relayed data


def test_a_sender_back_from_idle_keeps_its_grant_when_another_sender_started_first() -> None:
    """Two members behind symmetric NATs average through one relay: each relayed a PING or two while its path was
    set up, then nothing for seconds, then both start their share of an average within a millisecond. The first
    one's datagram recomputes the shares while the other is still idle (no share); the other's paced data,
    inside its grant, must all go through (it lost everything past 8 KB until the next recompute: an average
    with a part missing)."""
    relay = RelayServer()
    for i, node in enumerate((b"s1", b"s2")):
        relay.reached(node, (f"203.0.113.{101 + i}", 40000), 0.0)
    for t, sender, to in ((0.0, b"s1", b"s2"), (0.1, b"s2", b"s1")):  # the path's PINGs
        assert isinstance(relay.forward(sender, to, 200, t), tuple)
    sends = []
    for sender, to, start in ((b"s2", b"s1", 5.0), (b"s1", b"s2", 5.001)):
        pacer = Pacer(rate=50e6, max_rate=50e6)
        pacer.limit(to, ("relay", b"r"), RELAY_SHARE * DEFAULT_RATE, 256_000.0)
        now = start
        for _ in range(40):  # 49 KB: a third of a 20,000-element fp32 vector each way, its two phases
            now += max(0.0, pacer.reserve(1232, to, now))
            sends.append((now, sender, to))
    refused = [(t, sender) for t, sender, to in sorted(sends)
               if not isinstance(relay.forward(sender, to, 1232, t), tuple)]
    assert refused == []
