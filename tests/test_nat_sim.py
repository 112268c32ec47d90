"""NAT traversal cores over the in-memory network's NAT model: reachability verdicts, punching, relaying."""

from __future__ import annotations

import hashlib
import random

import pytest

from peerd.nat.reach import CONE, PUBLIC, SYMMETRIC, UNKNOWN, Reach
from peerd.tools.sim.natnode import DIRECT, PUNCHED, RELAYED, SimNatNode
from peerd.tools.sim.net import NAT_UNREPLIED_S, Network

KINDS = {"p1": None, "p2": None, "c1": "cone", "c2": "cone", "s1": "symmetric", "s2": "symmetric"}
EXPECT = {"p1": PUBLIC, "p2": PUBLIC, "c1": CONE, "c2": CONE, "s1": SYMMETRIC, "s2": SYMMETRIC}


def nid(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def lab(seed: int) -> tuple[Network, dict[str, SimNatNode], dict[str, tuple[str, int]]]:
    """2 public nodes, 2 behind their own port-restricted cone NAT, 2 behind their own symmetric NAT; each node
    PINGs both public ones, and they PING back (as the DHT does before admitting a sender)."""
    net = Network(random.Random(seed))
    nodes: dict[str, SimNatNode] = {}
    public: dict[str, tuple[str, int]] = {}
    for i, (name, kind) in enumerate(KINDS.items()):
        if kind is None:
            addr = (f"203.0.113.{i + 1}", 7000)
            public[name] = addr
        else:
            addr = (f"10.0.{i}.2", 7000)
            net.add_nat(f"203.0.113.{100 + i}", kind, [addr])
        nodes[name] = SimNatNode(net, addr, nid(name), random.Random(seed * 100 + i))
    for name, node in nodes.items():
        for p, paddr in public.items():
            if p != name:
                node.ping(paddr, lambda msg, src, p=p: None)
    net.run(until=1.0)
    for p, paddr in public.items():  # the public nodes ping back whoever pinged them, at its mapped address
        pub = nodes[p]
        for name, node in nodes.items():
            if name != p:
                seen = [a for n, a in nodes[p].reached.items() if n == node.node_id] or [_mapped(net, node, paddr)]
                pub.ping(seen[0])
    net.run(until=2.0)
    return net, nodes, public


def publish(nodes: dict[str, SimNatNode]) -> None:
    """What the DHT would carry: every node's published address (its observed one behind a NAT), known to all."""
    for node in nodes.values():
        for name, other in nodes.items():
            if other is not node:
                node.named[other.node_id] = other.reach.observed_addr if KINDS[name] else other.addr


def _mapped(net: Network, node: SimNatNode, toward: tuple[str, int]) -> tuple[str, int]:
    box = net.nat_of(node.addr)
    if box is None:
        return node.addr
    return box.outbound(node.addr, toward, net.now)


def settled_lab(seed: int) -> tuple[Network, dict[str, SimNatNode], dict[str, tuple[str, int]]]:
    """``lab(seed)`` 30 s after every node started, with every node's address published to all."""
    net, nodes, public = lab(seed)
    for node in nodes.values():
        node.start()
    net.run(until=30.0)
    publish(nodes)
    return net, nodes, public


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reachability_verdicts_by_verification(seed: int) -> None:
    net, nodes, public = lab(seed)
    for node in nodes.values():
        assert node.reach.verdict == UNKNOWN
        node.start()
    net.run(until=30.0)
    got = {name: node.reach.verdict for name, node in nodes.items()}
    assert got == EXPECT
    # the observed address is the mapped one: the box's public IP for NATed nodes, its own for public ones
    for name, node in nodes.items():
        host = node.reach.observed_addr[0]
        assert host.startswith("203.0.113.") and (host == node.addr[0]) == (KINDS[name] is None)
    assert nodes["c1"].reach.basis == "no-probe" and nodes["s1"].reach.basis == "mappings"
    assert nodes["p2"].reach.basis in ("probe", "no-translation")


def step(core, now: float) -> list:
    """Run a core's timer at ``now`` and take what it queued."""
    core.handle_timer(now)
    return core.take_actions()


def asking_for_a_probe() -> tuple[Reach, list]:
    """A Reach whose two observers saw one mapping, at 0.2 once it asks for a probe: the core, and what it queued."""
    c = Reach(random.Random(3), observers=2, probes=1, probe_timeout=4.0)
    for i in range(2):
        c.add_peer(nid(f"o{i}"), (f"198.51.100.{i}", 7000))
    c.start(0.0)
    for a in step(c, 0.0):
        c.receive_observed(a.node_id, ("203.0.113.9", 4000), 0.1)
    return c, step(c, 0.2)


def test_a_probe_from_a_peer_this_node_sent_to_proves_nothing() -> None:
    from peerd.nat.reach import AskProbe, Observe, Reach

    r = Reach(random.Random(1), observers=2)
    peers = {nid(f"o{i}"): (f"198.51.100.{i}", 7000) for i in range(3)}
    for n, a in peers.items():
        r.add_peer(n, a)
    assert step(r, 0.0) == []  # not before start
    r.start(0.0)
    obs = step(r, 0.0)
    assert len(obs) == 2 and all(isinstance(a, Observe) for a in obs)
    for a in obs:
        r.datagram_sent(a.addr, 0.0)
        r.receive_observed(a.node_id, ("203.0.113.9", 4000), 0.1)
    ask = step(r, 0.2)
    assert len(ask) == 1 and isinstance(ask[0], AskProbe)
    assert set(ask[0].avoid) == {a.node_id for a in obs}  # the peers it sent to: their probe proves nothing
    nonce = ask[0].nonce
    assert not r.receive_probe(nonce, obs[0].addr, 0.5)  # from an address it sent to: its NAT let it in
    assert not r.receive_probe(b"x" * 16, ("192.0.2.77", 7000), 0.5)  # another nonce
    assert r.verdict == UNKNOWN
    assert r.receive_probe(nonce, ("192.0.2.77", 7000), 0.6)
    assert (r.verdict, r.basis, r.observed_addr) == (PUBLIC, "probe", ("203.0.113.9", 4000))


def test_different_mappings_mean_symmetric_and_no_probe_means_cone() -> None:
    from peerd.nat.reach import AskProbe, Reach

    r = Reach(random.Random(2), observers=2, probes=1, probe_timeout=4.0)
    for i in range(2):
        r.add_peer(nid(f"o{i}"), (f"198.51.100.{i}", 7000))
    r.start(0.0)
    obs = step(r, 0.0)
    r.receive_observed(obs[0].node_id, ("203.0.113.9", 4000), 0.1)
    r.receive_observed(obs[1].node_id, ("203.0.113.9", 4001), 0.1)
    assert step(r, 0.2) == [] and (r.verdict, r.basis) == (SYMMETRIC, "mappings")
    c, ask = asking_for_a_probe()
    assert isinstance(ask[0], AskProbe)
    c.receive_probe_asked(ask[0].node_id, True, 0.3)
    assert step(c, 1.0) == [] and c.verdict == UNKNOWN  # still waiting for the probe
    assert c.get_timer() == pytest.approx(4.2)
    step(c, 4.2)
    assert (c.verdict, c.basis) == (CONE, "no-probe")
    assert c.get_timer() == pytest.approx(4.2 + c.recheck)


def test_symmetric_nat_maps_per_destination_and_mappings_expire() -> None:
    net = Network(random.Random(0))
    box = net.add_nat("203.0.113.50", "symmetric", [("10.0.0.2", 7000)])
    a = box.outbound(("10.0.0.2", 7000), ("203.0.113.1", 7000), 0.0)
    b = box.outbound(("10.0.0.2", 7000), ("203.0.113.2", 7000), 0.0)
    assert a != b and a[0] == b[0] == "203.0.113.50"
    cone = net.add_nat("203.0.113.51", "cone", [("10.0.1.2", 7000)])
    c = cone.outbound(("10.0.1.2", 7000), ("203.0.113.1", 7000), 0.0)
    assert c == cone.outbound(("10.0.1.2", 7000), ("203.0.113.2", 7000), 0.0) == ("203.0.113.51", 7000)
    # filtered by remote address and port; open to the remote it sent to, until 30 s unreplied
    assert cone.inbound(7000, ("203.0.113.1", 7001), 1.0) is None
    assert cone.inbound(7000, ("203.0.113.1", 7000), 1.0) == ("10.0.1.2", 7000)
    d = cone.outbound(("10.0.1.2", 7000), ("203.0.113.3", 7000), 1.0)
    assert cone.inbound(d[1], ("203.0.113.3", 7000), 1.0 + NAT_UNREPLIED_S + 0.1) is None


def test_punch_cone_to_cone_and_relay_for_symmetric() -> None:
    net, nodes, public = settled_lab(4)
    p1 = nodes["p1"]
    relays = [(p1.node_id, public["p1"])]
    introducer = (p1.node_id, public["p1"])
    names = list(nodes)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    for a, b in pairs:
        addr_b = nodes[b].reach.observed_addr if KINDS[b] else nodes[b].addr
        nodes[a].connect(nodes[b].node_id, addr_b, introducer, relays)
        net.run(until=net.now + 10.0)
    kinds = {(a, b): nodes[a].kind.get(nodes[b].node_id) for a, b in pairs}
    for (a, b), kind in kinds.items():
        ka, kb = KINDS[a], KINDS[b]
        # public with anyone, cone with cone: direct, or punched where the NATed side had to open its mapping
        # first (direct where a reachability PROBE between them opened the way already)
        if ka is None or kb is None or ka == kb == "cone":
            assert kind in (DIRECT, PUNCHED), (a, b, kind)
        else:
            assert kind == RELAYED, (a, b, kind)
    assert sum(k == RELAYED for k in kinds.values()) == 5
    # application data flows both ways on every path; the relay counted what it carried
    for a, b in pairs:
        addr_b = nodes[b].reach.observed_addr if KINDS[b] else nodes[b].addr
        nodes[a].send_app(nodes[b].node_id, addr_b, (a, b))
    net.run(until=net.now + 2.0)
    for a, b in pairs:
        assert (nodes[a].node_id, (a, b)) in nodes[b].app, (a, b, kinds[(a, b)])
    assert p1.relay.relayed > 0 and not p1.relay.refused.get("relay_budget")


def test_punched_path_stays_open_with_keepalives() -> None:
    net, nodes, public = settled_lab(5)
    c1, c2 = nodes["c1"], nodes["c2"]
    intro = (nodes["p1"].node_id, public["p1"])
    c1.connect(c2.node_id, c2.reach.observed_addr, intro, [])
    net.run(until=net.now + 10.0)
    assert c1.kind[c2.node_id] == PUNCHED
    for _ in range(6):  # 90 s of use, in bursts 15 s apart: well past the 30 s an idle mapping lives
        c1.send_app(c2.node_id, c2.reach.observed_addr, "x")
        net.run(until=net.now + 15.0)
    before = len(c2.app)
    c1.send_app(c2.node_id, c2.reach.observed_addr, "late")
    net.run(until=net.now + 1.0)
    assert len(c2.app) == before + 1


def test_relay_refuses_unreached_destinations_and_over_budget() -> None:
    from peerd.nat.relay import RelayServer

    r = RelayServer(rate=1000.0, burst=2000.0)
    a, t = nid("a"), nid("t")
    assert r.forward(a, t, 100, 0.0) == "relay_unreached"
    r.reached(t, ("203.0.113.9", 1), 0.0)
    assert r.forward(a, t, 100, 0.0) == "relay_unreached"  # the sender must be reached too
    r.reached(a, ("203.0.113.8", 1), 0.0)
    assert r.forward(a, t, 1500, 0.0) == ("203.0.113.9", 1)
    assert r.forward(a, t, 1500, 0.0) == "relay_budget"
    assert r.forward(a, t, 1000, 1.0) == ("203.0.113.9", 1)  # refilled at 1000 B/s
    assert r.forward(a, a, 10, 1.0) == "relay_loop"
    assert r.forward(a, t, 10, 1000.0) == "relay_unreached"  # routes expire
    assert RelayServer(enabled=False).forward(a, t, 1, 0.0) == "relay_off"


def test_probe_limiter_bounds_unsolicited_probes() -> None:
    from peerd.nat.reach import ProbeLimiter

    lim = ProbeLimiter(per_target=2, total=3, window=10.0)
    assert [lim.allow("h", 0.0) for _ in range(3)] == [True, True, False]
    assert lim.allow("g", 0.0) and not lim.allow("f", 0.0)
    assert lim.allow("h", 10.5)


def test_a_late_probe_still_proves_reachability() -> None:
    """Under load a PROBE can arrive after its helper's time ran out: it proves reachability as well as a prompt
    one, even after the node settled on ``cone-nat``."""

    c, ask = asking_for_a_probe()
    c.receive_probe_asked(ask[0].node_id, True, 0.3)
    step(c, 4.2)
    assert (c.verdict, c.basis) == (CONE, "no-probe")
    assert c.receive_probe(ask[0].nonce, ("192.0.2.77", 7000), 6.0)
    assert (c.verdict, c.basis) == (PUBLIC, "probe")



ME = ("203.0.113.9", 4000)  # where the observers see the node in the tests below: one of its own addresses


def public_looking(seed: int, **kw) -> tuple:
    """A Reach whose 2 observers see it at its own address (no translation), up to its first REACH_PROBE."""
    from peerd.nat.reach import Reach

    r = Reach(random.Random(seed), observers=2, probe_timeout=4.0, **kw)
    r.local = {ME}
    for i in range(3):
        r.add_peer(nid(f"o{i}"), (f"198.51.100.{i}", 7000))
    r.start(0.0)
    return r, observe(r, 0.0)


def observe(r, now: float) -> list:
    """Answer the run's OBSERVEs (seen at ``ME``) and return what it queues next: its REACH_PROBE."""
    for a in step(r, now):
        r.datagram_sent(a.addr, now)
        r.receive_observed(a.node_id, ME, now + 0.1)
    return step(r, now + 0.2)


def test_a_probe_from_an_address_it_sent_to_does_not_count_towards_cone() -> None:
    """A prober this node had answered (not one it reached itself, so not in its avoid list): its PROBE passes
    any NAT and proves nothing either way. The next helper is asked at once, and with no probe arranged that
    could have proved anything, a node that sees no translation is ``public``, never ``cone-nat``."""
    from peerd.nat.reach import AskProbe

    r, ask = public_looking(4, probes=1)
    r.receive_probe_asked(ask[0].node_id, True, 0.3)
    r.datagram_sent(("192.0.2.77", 7000), 0.3)  # an answer to the prober's request
    assert not r.receive_probe(ask[0].nonce, ("192.0.2.77", 7000), 0.5)
    assert r.statistics().probes_solicited == 1
    again = step(r, 0.5)
    assert len(again) == 1 and isinstance(again[0], AskProbe) and again[0].node_id != ask[0].node_id
    r.receive_probe_asked(again[0].node_id, False, 0.6)  # that helper has no third node
    step(r, 0.6)
    assert (r.verdict, r.basis) == (PUBLIC, "no-translation")


def test_a_peer_that_sent_requests_is_avoided_as_a_prober() -> None:
    """Peers this node answered (their requests came in) are in the avoid list like those it reached."""
    from peerd.nat.reach import Reach

    r = Reach(random.Random(5), observers=2)
    r.local = {ME}
    for i in range(2):
        r.add_peer(nid(f"o{i}"), (f"198.51.100.{i}", 7000))
    r.receive_request(nid("asker"), ("192.0.2.80", 7000), 0.0)
    r.datagram_sent(("192.0.2.80", 7000), 0.0)
    r.receive_request(nid("quiet"), ("192.0.2.81", 7000), 0.0)  # never answered: not avoided
    r.start(0.0)
    ask = observe(r, 0.0)
    assert nid("asker") in ask[0].avoid and nid("quiet") not in ask[0].avoid


def test_a_public_looking_node_runs_again_before_settling_on_cone() -> None:
    """Probes arranged, none came, and the observers see the node at its own address: it runs again
    ``reruns_public`` times (``rerun_s`` apart) before ``cone-nat``, and a PROBE of an earlier run's nonce
    arriving meanwhile still proves ``public``."""
    r, ask = public_looking(6, probes=1, reruns_public=2, rerun_s=5.0)
    nonces = []
    now = 0.0
    for run in range(3):
        nonces.append(ask[0].nonce)
        r.receive_probe_asked(ask[0].node_id, True, now + 0.3)
        now += 0.2 + 4.0
        step(r, now)
        if run < 2:
            assert r.verdict == UNKNOWN and r.statistics().reruns == run + 1
            assert r.get_timer() == pytest.approx(now + 5.0)
            now += 5.0
            ask = observe(r, now)
    assert (r.verdict, r.basis) == (CONE, "no-probe")
    # a late PROBE of the first run's nonce (kept through the runs it repeated) proves reachability
    assert r.receive_probe(nonces[0], ("192.0.2.77", 7000), now + 1.0)
    assert (r.verdict, r.basis) == (PUBLIC, "probe") and r.statistics().probes_late == 1


def test_the_helper_prefers_a_prober_heard_from_recently() -> None:
    from peerd.nat.reach import choose_prober

    reached = {nid(n): (f"192.0.2.{i}", 7000) for i, n in enumerate("abcd")}
    for seed in range(20):
        got = choose_prober(nid("a"), [nid("b")], reached, random.Random(seed), {nid("d"), nid("b")})
        assert got == (nid("d"), reached[nid("d")])
    assert {choose_prober(nid("a"), [], reached, random.Random(s))[0] for s in range(20)} == {nid(n) for n in "bcd"}
