"""The one in-memory network (peerd/tools/sim/net.py): every fault it models, and exact determinism for a seed."""

from __future__ import annotations

import math
import random

import pytest

from peerd.tools.sim.net import Link, Network


class Inbox:
    """A node that records what reaches it: (time, source, payload)."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.got: list[tuple[float, object, object]] = []

    def __call__(self, src: object, payload: object) -> None:
        self.got.append((self.net.now, src, payload))


def pair(link: Link, seed: int = 0, **kw) -> tuple[Network, Inbox]:
    net = Network(random.Random(seed), default=link, **kw)
    inbox = Inbox(net)
    net.attach("a", Inbox(net))
    net.attach("b", inbox)
    return net, inbox


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("loss", [0.05, 0.3])
def test_loss_rate_within_binomial_bounds(seed: int, loss: float) -> None:
    n = 20_000
    net, inbox = pair(Link(loss=loss), seed)
    for i in range(n):
        net.send("a", "b", i)
    net.run()
    lost = n - len(inbox.got)
    sd = math.sqrt(n * loss * (1 - loss))
    assert abs(lost - n * loss) < 4.5 * sd, (lost, n * loss, sd)  # fails about once in 150,000 seeds
    assert net.lost == lost and net.delivered == len(inbox.got)


def test_no_loss_delivers_everything_in_order_after_latency() -> None:
    net, inbox = pair(Link(latency=0.010))
    for i in range(100):
        net.send("a", "b", i)
    net.run()
    assert [p for _, _, p in inbox.got] == list(range(100))
    assert all(t == pytest.approx(0.010) for t, _, _ in inbox.got)
    assert all(src == "a" for _, src, _ in inbox.got)


def test_duplication_rate_and_copies() -> None:
    n = 10_000
    net, inbox = pair(Link(duplicate=0.2), 4)
    for i in range(n):
        net.send("a", "b", i)
    net.run()
    assert len(inbox.got) == n + net.duplicated
    sd = math.sqrt(n * 0.2 * 0.8)
    assert abs(net.duplicated - 0.2 * n) < 4.5 * sd
    payloads = [p for _, _, p in inbox.got]
    assert set(payloads) == set(range(n))  # every datagram arrives, some twice


def test_jitter_reorders_and_bounds_delay() -> None:
    net, inbox = pair(Link(latency=0.005, jitter=0.020), 5)
    for i in range(500):
        net.send("a", "b", i)
    net.run()
    payloads = [p for _, _, p in inbox.got]
    assert sorted(payloads) == list(range(500))
    assert payloads != list(range(500))  # reordered
    assert all(0.005 <= t < 0.025 for t, _, _ in inbox.got)


def test_bandwidth_serialises_a_burst() -> None:
    net, inbox = pair(Link(latency=0.001, bandwidth=1000.0))  # 1000 bytes per second
    for i in range(5):
        net.send("a", "b", i, size=100)  # each takes 0.1 s on the link
    net.send("b", "a", "back", size=100)  # the other direction is another link: not queued behind
    net.run()
    times = [t for t, _, _ in inbox.got]
    assert times == pytest.approx([0.101, 0.201, 0.301, 0.401, 0.501])
    # an idle link starts afresh: the next datagram waits only for itself
    net.run(until=10.0)
    net.send("a", "b", "late", size=100)
    net.run()
    assert inbox.got[-1][0] == pytest.approx(10.101)


def test_per_link_settings_override_the_default() -> None:
    net = Network(random.Random(0), default=Link(latency=0.001))
    inboxes = {name: Inbox(net) for name in "abc"}
    for name, inbox in inboxes.items():
        net.attach(name, inbox)
    net.set_link("a", "b", Link(loss=1.0))
    net.send("a", "b", 1)
    net.send("a", "c", 2)
    net.send("b", "a", 3)
    net.run()
    assert inboxes["b"].got == []
    assert [p for _, _, p in inboxes["c"].got] == [2]
    assert [p for _, _, p in inboxes["a"].got] == [3]


def test_partitions_cut_and_heal() -> None:
    net = Network(random.Random(0), default=Link(latency=0.010))
    inboxes = {name: Inbox(net) for name in "abcd"}
    for name, inbox in inboxes.items():
        net.attach(name, inbox)
    net.send("a", "c", "in flight across the cut")
    net.partition({"a", "b"}, {"c"})  # d is in neither group: a group of its own
    net.send("a", "b", "same side")
    net.send("a", "c", "across")
    net.send("c", "d", "across too")
    net.run()
    assert [p for _, _, p in inboxes["b"].got] == ["same side"]
    assert inboxes["c"].got == [] and inboxes["d"].got == []
    net.heal()
    net.send("a", "c", "healed")
    net.send("c", "d", "healed")
    net.run()
    assert [p for _, _, p in inboxes["c"].got] == ["healed"]
    assert [p for _, _, p in inboxes["d"].got] == ["healed"]
    with pytest.raises(ValueError, match="two groups"):
        net.partition({"a"}, {"a", "b"})


def test_crash_drops_in_flight_and_timers_and_restart_has_new_state() -> None:
    net = Network(random.Random(0), default=Link(latency=0.010))
    old, new, a = Inbox(net), Inbox(net), Inbox(net)
    net.attach("a", a)
    net.attach("b", old)
    fired: list[str] = []
    net.call_later(0.5, fired.append, "b's timer", owner="b")
    net.call_later(0.5, fired.append, "a's timer", owner="a")
    net.send("a", "b", "in flight")
    net.run(until=0.005)
    net.crash("b")
    assert not net.alive("b")
    net.send("a", "b", "to nobody")  # arrives at 0.015, while b is down
    net.send("a", "b", "while down", size=1)
    net.run(until=0.012)
    net.attach("b", new)  # restarted with new state before the first datagram would have arrived
    net.run(until=0.020)
    net.send("a", "b", "after restart")
    net.run()
    assert old.got == []
    # what was in flight to the old b is lost; what was sent to the address while it was down arrives
    # if the new b is there by then (as on a real host): here both were sent before 0.012, arriving
    # at 0.015 after the restart at 0.012
    assert [p for _, _, p in new.got] == ["to nobody", "while down", "after restart"]
    assert fired == ["a's timer"]
    assert net.dropped == 1  # the one in flight when b crashed
    with pytest.raises(ValueError, match="already attached"):
        net.attach("b", new)
    with pytest.raises(ValueError, match="not attached"):
        net.crash("zz")


def test_crash_loses_what_the_sender_had_queued_but_not_sent() -> None:
    net = Network(random.Random(0), default=Link(bandwidth=100.0))
    b = Inbox(net)
    net.attach("a", Inbox(net))
    net.attach("b", b)
    for i in range(3):
        net.send("a", "b", i, size=100)  # leave at 1, 2, 3 s
    net.run(until=1.5)
    net.crash("a")
    net.run()
    assert [p for _, _, p in b.got] == [0]


def test_timers_run_in_time_order_and_cancel() -> None:
    net = Network(random.Random(0))
    out: list[int] = []
    net.call_at(3.0, out.append, 3)
    net.call_at(1.0, out.append, 1)
    t = net.call_at(2.0, out.append, 2)
    net.call_at(1.0, out.append, 11)  # same time: in the order they were set
    t.cancel()
    assert net.next_time() == 1.0
    assert net.run(until=2.5) == 2
    assert out == [1, 11] and net.now == 2.5
    net.run()
    assert out == [1, 11, 3] and net.now == 3.0
    assert net.next_time() is None


def test_run_max_events() -> None:
    net = Network(random.Random(0))
    out: list[int] = []
    for i in range(10):
        net.call_at(float(i), out.append, i)
    assert net.run(max_events=4) == 4
    assert out == [0, 1, 2, 3]


def test_link_rejects_bad_values() -> None:
    for bad in ({"loss": -0.1}, {"loss": 1.5}, {"duplicate": 2}, {"latency": -1}, {"jitter": math.inf},
                {"bandwidth": 0}, {"bandwidth": math.nan}):
        with pytest.raises(ValueError):
            Link(**bad)


def ping_pong_trace(seed: int) -> list:
    """A small lossy, jittery, duplicating, bandwidth-limited exchange with a crash and a partition."""
    trace: list = []
    net = Network(random.Random(seed), default=Link(loss=0.1, duplicate=0.05, latency=0.002, jitter=0.01,
                                                      bandwidth=1e5), trace=trace)
    names = [f"n{i}" for i in range(6)]

    def node(me: str):
        def handle(src, payload):
            if payload < 60:
                net.send(me, src, payload + 1, size=200 + payload)
                if payload % 10 == 0:  # a few branches: at most 2**6 chains of 60
                    net.send(me, names[payload % len(names)], payload + 1, size=100)
        return handle

    for name in names:
        net.attach(name, node(name))
    for i, name in enumerate(names):
        for j in range(1, len(names)):
            net.send(name, names[(i + j) % len(names)], 0, size=300)
    net.call_at(0.05, net.crash, "n3")
    net.call_at(0.08, lambda: net.attach("n3", node("n3")))
    net.call_at(0.1, net.partition, {"n0", "n1"})
    net.call_at(0.2, net.heal)
    net.run()
    return trace


def test_same_seed_same_event_trace() -> None:
    first = ping_pong_trace(7)
    assert len(first) > 1000
    assert ping_pong_trace(7) == first
    assert ping_pong_trace(8) != first
    kinds = {what for _, what, *_ in first}
    assert kinds == {"send", "lost", "recv", "drop"}
