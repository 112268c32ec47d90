"""Hostile members and faults at the Moshpit layer (issue 11): what a member holding the swarm key can send
must not crash a daemon, stall a run, or put NaN into a model. Virtual time over the in-memory network."""

from __future__ import annotations

import errno
import math
import random
import socket
import time
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import trio

from peerd.addresses import peer_address
from peerd.allreduce.options import DEFAULT_OPTIONS
from peerd.allreduce.robust import Robust
from peerd.localsock.server import OpError
from peerd.metrics import Metrics
from peerd.moshpit import service as svc_mod
from peerd.moshpit.keys import Grid
from peerd.moshpit.matchmaking import Candidate, Group
from peerd.moshpit.ops import MoshpitOps, _averaging_options
from peerd.moshpit.records import pack_members
from peerd.moshpit.service import (
    MAX_AHEAD,
    MAX_ROUND,
    MoshpitError,
    MoshpitService,
    RoundResult,
    plausible_progress,
)
from peerd.transport.endpoint import Endpoint, RpcError, RpcTimeout
from peerd.wire import messages as m
from peerd.wire.errors import WireError
from peerd.wire.identity import Identity

from .support.dht_swarm import SECRET, DhtNode
from .support.memnet import MemNet, MemSocket, run_on_memnet
from .support.moshpit_groups import (  # noqa: E402
    _group,
    asked_options,  # noqa: E402
    node,
)
from .support.virtual import counter_value, run_virtual

BAD_IPS = ["0.0.0.0", "0.1.2.3", "::", "255.255.255.255", "224.0.0.1", "239.255.255.250", "ff02::1",
           "::ffff:255.255.255.255", "::ffff:0.0.0.0", "::ffff:224.0.0.5"]
GOOD_IPS = ["127.0.0.1", "10.0.0.1", "192.0.2.255", "::1", "fe80::1", "2001:db8::1"]


class VirtualWall:
    """The service reads wall time (matchmaking deadlines, record expiries): under trio's MockClock, make it
    follow virtual time, or a deadline would spin the loop until real seconds pass."""

    def __init__(self) -> None:
        self.base = time.time()

    def time(self) -> float:
        return self.base + trio.current_time()

    def perf_counter(self) -> float:
        return trio.current_time()


@pytest.fixture(autouse=True)
def virtual_wall(monkeypatch: pytest.MonkeyPatch) -> VirtualWall:
    wall = VirtualWall()
    monkeypatch.setattr(svc_mod, "time", wall)
    return wall


class FlakySocket(MemSocket):
    """A MemSocket whose kernel refuses some destinations, as a real one does: no route, a broadcast
    address without SO_BROADCAST, an address of the other family."""

    def __init__(self, net: MemNet, addr: tuple[str, int], refuse: dict[tuple[str, int], int]) -> None:
        super().__init__(net, addr)
        self.refuse = refuse

    async def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        if ":" in addr[0]:
            raise socket.gaierror(socket.EAI_ADDRFAMILY, "Address family for hostname not supported")
        code = self.refuse.get((addr[0], addr[1]))
        if code is not None:
            raise OSError(code, "refused by the test's kernel")
        await super().sendto(data, addr)


class V6Socket(MemSocket):
    family = socket.AF_INET6




async def start(nursery: trio.Nursery, n) -> None:
    await nursery.start(n.run)
    await nursery.start(n.moshpit.run)
    n.dht.bootstrapped.set()


# ---- addresses: refused at decode, never encoded ----------------------------------------------------------


def _bodies(packed: bytes, frm: dict) -> list[tuple[m.MsgType, dict]]:
    pk = Identity.generate().public_key
    return [
        (m.MsgType.PING, {"rid": 1, "from": {**frm, "addr": [packed, 7411]}}),
        (m.MsgType.NODES, {"rid": 1, "from": frm, "nodes": [[bytes(32), packed, 7411]]}),
        (m.MsgType.MM_BEGIN, {"rid": 1, "from": frm, "run": "r", "round": 0, "group": 1,
                              "members": [[pk, packed, 7411]]}),
    ]


@pytest.mark.parametrize("ip", BAD_IPS + GOOD_IPS)
def test_unusable_addresses_are_refused_by_decoder_and_encoder(ip: str) -> None:
    import ipaddress

    ident = Identity.generate()
    frm = ident.bind_token().sender()
    for mtype, body in _bodies(ipaddress.ip_address(ip).packed, frm):
        raw = m.encode(mtype, body, check=False)
        if ip in GOOD_IPS:
            m.decode(mtype, raw)
            assert m.encode(mtype, body) == raw
        else:
            with pytest.raises(WireError, match="must not be") as e:
                m.decode(mtype, raw)
            assert e.value.reason == "malformed"
            with pytest.raises(WireError, match="refusing to send"):
                m.encode(mtype, body)


def test_encoder_refuses_a_round_past_uint32_and_the_endpoint_turns_it_into_rpc_error() -> None:
    ident = Identity.generate()
    frm = ident.bind_token().sender()
    m.encode(m.MsgType.MM_DISBAND, {"rid": 1, "from": frm, "run": "r", "round": 2**32 - 1})
    for bad in (2**32, 2**64, -1, "r", 1.5):
        with pytest.raises(WireError):
            m.encode(m.MsgType.MM_DISBAND, {"rid": 1, "from": frm, "run": "r", "round": bad})

    async def main() -> None:
        net = MemNet()
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            ep = Endpoint(net.socket("127.0.0.1", 1), ident, SECRET, Metrics())
            with pytest.raises(RpcError, match="not sending mm_disband"):
                await ep.notify(("127.0.0.1", 2), m.MsgType.MM_DISBAND, {"run": "r", "round": 2**32})
            assert counter_value(ep.metrics.datagrams_dropped, reason="unsendable") == 1
            assert net.sent == 0

    run_virtual(main)


def test_announcing_an_unusable_address_is_refused_at_startup() -> None:
    for addr, words in [(("0.0.0.0", 7411), "unspecified"), (("255.255.255.255", 1), "broadcast"),
                        (("ff02::1", 1), "multicast"), (("127.0.0.1", 0), "port")]:
        with pytest.raises(ValueError, match=words):  # the daemon's --announce: a one-line StartupError
            peer_address(*addr)
    assert peer_address("127.0.0.1", 7411) == ("127.0.0.1", 7411)
    net = MemNet()
    for addr, words in [(("0.0.0.0", 7411), "unspecified"), (("255.255.255.255", 7411), "broadcast"),
                        (("::1", 7411), "IPv6"), (("10.0.0.1", 0), "port 0")]:
        with pytest.raises(ValueError, match=words):
            Endpoint(net.socket("127.0.0.1", 1), Identity.generate(), SECRET, Metrics(), announce=addr)


# ---- finding 1: a member cannot crash a daemon ------------------------------------------------------------


def test_a_background_send_that_fails_is_counted_not_fatal() -> None:
    """A lost route (ENETUNREACH) or a broadcast address (EACCES) under a DISBAND: the send's RpcError used to
    escape the service's nursery and end the daemon."""

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        sock = FlakySocket(net, ("127.0.0.1", 20000), {("10.9.9.9", 7): errno.ENETUNREACH,
                                                        ("10.9.9.10", 7): errno.EACCES})
        a = node(net, 0, sock=sock)
        await start(nursery, a)
        for host in ("10.9.9.9", "10.9.9.10", "2001:db8::5"):
            a.endpoint.learn((host, 7), bytes(32))  # a node id to seal for (wire v2 binds the receiver)
            a.moshpit._spawn(a.endpoint.notify, (host, 7), m.MsgType.MM_DISBAND, {"run": "r", "round": 0})
        await trio.sleep(1.0)
        assert counter_value(a.metrics.background_errors, task="moshpit_notify") == 3
        assert counter_value(a.metrics.datagrams_dropped, reason="send_error") == 3
        # the service still serves
        assert await a.dht.put(b"k", b"s", b"v", ttl=10.0) is not None

    run_on_memnet(main)


def test_join_from_the_other_family_is_dropped_and_the_leader_survives() -> None:
    """A member announces an IPv6 address to an IPv4 node and joins its group: the old leader took it in,
    then its DISBAND to that address raised out of the nursery. Now the JOIN is dropped (counted) and the
    round ends alone, the daemon alive."""

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        victim = node(net, 0, sock=FlakySocket(net, ("127.0.0.1", 20000), {}))
        await start(nursery, victim)
        ident = Identity.generate()
        attacker = Endpoint(V6Socket(net, ("127.0.0.1", 20001)), ident, SECRET, Metrics(),
                            announce=("2001:db8::66", 7411))
        net.sockets[("127.0.0.1", 20001)] = attacker.sock
        nursery.start_soon(attacker.serve)
        await victim.moshpit.open("run", grid=Grid(1, 4), min_size=3, window_s=1.0)
        key = victim.moshpit.runs["run"].keys.group_key(0)

        async def attack() -> None:
            await trio.sleep(0.2)
            with pytest.raises(RpcTimeout):
                await attacker.request(victim.addr, m.MsgType.MM_JOIN,
                                       {"run": "run", "round": 0, "key": key, "expiry": 1e9}, timeout=0.1)

        nursery.start_soon(attack)
        result = await victim.moshpit.average("run", np.ones(8, np.float32), 1.0, timeout_s=10.0)
        assert result.outcome == "alone"
        assert counter_value(victim.metrics.datagrams_dropped, reason="address") >= 1

    run_on_memnet(main)


def test_begin_members_other_family_refused_and_the_leader_is_reached_where_it_sent_from() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        a = node(net, 0)
        me, leader, other = a.identity, Identity.generate(), Identity.generate()
        peer = SimpleNamespace(node_id=leader.node_id, public_key=leader.public_key, host="127.0.0.7", port=9)
        members = [(leader.public_key, "127.0.0.1", 7411), (me.public_key, "127.0.0.1", 20000)]
        st = await a.moshpit.open("r", grid=Grid(1, 4), window_s=1.0)
        st.sticky.offer_begin = lambda *args: (seen.append(args[-1]), True)[1]
        seen: list = []
        incoming = SimpleNamespace(body={"run": "r", "round": 0, "group": 5, "members": members}, peer=peer)
        assert a.moshpit._on_begin(incoming) == {"ok": True}
        assert seen[0][0].addr == ("127.0.0.7", 9)  # the leader's listed wildcard/loopback is not used
        incoming.body["members"] = members + [(other.public_key, "2001:db8::1", 7411)]
        assert a.moshpit._on_begin(incoming) == {"ok": False}
        assert counter_value(a.metrics.datagrams_dropped, reason="address") == 1
        # a leader listening on a wildcard lists itself as loopback, never as 0.0.0.0
        a.moshpit.address = ("0.0.0.0", 20000)
        cands = [Candidate(1.0, me.node_id, me.public_key, ("0.0.0.0", 20000)),
                 Candidate(1.0, other.node_id, other.public_key, ("10.0.0.2", 7411))]
        packed = pack_members(cands, me.node_id, a.moshpit._loopback())
        assert [p[1] for p in packed] == [bytes([127, 0, 0, 1]), bytes([10, 0, 0, 2])]
        m.encode(m.MsgType.MM_BEGIN, {"rid": 1, "from": a.endpoint._from, "run": "r", "round": 0, "group": 1,
                                      "members": packed})

    run_on_memnet(main)


# ---- finding 2: one progress record cannot stall a run ----------------------------------------------------


def test_plausible_progress_follows_the_median_not_the_max() -> None:
    now = 1000.0
    honest = [(bytes([i]) * 32, 40 + i, now - 1) for i in range(3)]
    evil = (b"e" * 32, MAX_ROUND, now - 1)
    kept, ignored = plausible_progress([*honest, evil], 42, now)
    assert kept == honest and ignored == 1
    # a joiner (no round of its own) follows the median, and one hostile record among two does not move it
    kept, ignored = plausible_progress([honest[0], evil], 0, now)
    assert kept == [honest[0]] and ignored == 1
    # a node far behind a real majority still catches up with it
    ahead = [(bytes([i]) * 32, 5000 + i, now - 1) for i in range(3)]
    assert plausible_progress(ahead, 3, now) == (ahead, 0)
    # up to MAX_AHEAD past this node's round is believed
    near = (b"n" * 32, 42 + MAX_AHEAD, now - 1)
    assert plausible_progress([*honest, near], 42, now) == ([*honest, near], 0)
    # stale records (left peers) do not hold back the median while fresh ones exist
    stale = [(bytes([9, i]) * 16, 1, now - 500) for i in range(5)]
    assert plausible_progress([*stale, *ahead], 0, now) == ([*stale, *ahead], 0)
    assert plausible_progress([], 7, now) == ([], 0)


def test_a_node_that_averaged_believes_its_peers_not_a_crowd_of_strangers() -> None:
    """Ids are free to mint: 64 strangers agreeing on a far round outvote any median (bench soak moved four
    honest daemons to round 2**31 that way). A node that has averaged follows strangers only a few rounds."""
    from peerd.moshpit.keys import KeyManager
    from peerd.moshpit.rounds import RoundMachine
    from peerd.moshpit.service import STRANGER_AHEAD
    now = 1000.0
    peers = [bytes([i]) * 32 for i in range(3)]
    sybils = [(bytes([100, i]) * 16, 2**31, now - 1) for i in range(64)]
    honest = [(p, 41, now - 1) for p in peers]
    kept, ignored = plausible_progress([*honest, *sybils], 42, now, set(peers))
    assert kept == honest and ignored == 64
    # a stranger slightly ahead (a peer that averaged elsewhere in the swarm) is followed; a known peer further
    near = (b"s" * 32, 42 + STRANGER_AHEAD, now - 1)
    far_known = (peers[0], 42 + MAX_AHEAD, now - 1)
    assert plausible_progress([near, far_known], 42, now, set(peers)) == ([near, far_known], 0)
    assert plausible_progress([(b"s" * 32, 43 + STRANGER_AHEAD, now - 1)], 42, now, set(peers))[1] == 1
    # without known peers (a joiner), the crowd wins: documented, a joiner trusts the swarm it first sees
    assert plausible_progress([*honest, *sybils], 0, now)[1] == 0
    me = Candidate(0.0, b"m" * 32, b"m" * 32, ("127.0.0.1", 1))
    st = RoundMachine("r", Grid(1, 4), KeyManager(Grid(1, 4), me.node_id), me, rng=random.Random(0))
    for r in range(300):
        st.note_members([r.to_bytes(32, "big")], r)
    assert len(st.known) == svc_mod.KNOWN_PEERS and (299).to_bytes(32, "big") in st.known


def test_a_record_at_the_last_round_does_not_move_a_joiner_or_the_run() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        a = node(net, 0)
        await start(nursery, a)
        def rec(value, owner: Identity) -> SimpleNamespace:
            return SimpleNamespace(value=msgpack.packb(value), owner=owner.public_key,
                                   expires=svc_mod.time.time() + svc_mod.PROGRESS_TTL_S)

        records = [rec(6, Identity.generate()), rec(7, Identity.generate()), rec(MAX_ROUND, Identity.generate()),
                   rec(2**40, Identity.generate()), rec("x", Identity.generate())]

        async def get(key: bytes):
            return records if key.endswith(b"/progress") else []

        a.dht.get = get
        st = await a.moshpit.open("run", grid=Grid(1, 4), window_s=1.0)
        assert st.round == 8  # the round after the latest believable one, not 2**32 - 1
        assert counter_value(a.metrics.ignored_records, kind="progress", reason="ahead") == 1
        assert counter_value(a.metrics.ignored_records, kind="progress", reason="range") == 2

    run_on_memnet(main)


def test_rounds_stop_at_the_last_one_with_a_clear_error() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        a = node(net, 0)
        await start(nursery, a)
        await a.moshpit.open("run", grid=Grid(1, 4), window_s=0.5)
        vec = np.arange(4, dtype=np.float32)
        result = await a.moshpit.average("run", vec, 1.0, timeout_s=5.0, round_no=MAX_ROUND)
        assert result.outcome == "alone" and result.round == MAX_ROUND
        assert a.moshpit.runs["run"].round == MAX_ROUND + 1
        with pytest.raises(MoshpitError, match="last round"):
            await a.moshpit.average("run", vec, 1.0, timeout_s=5.0)
        with pytest.raises(MoshpitError, match="round must be"):
            await a.moshpit.average("run", vec, 1.0, round_no=MAX_ROUND + 1)
        await trio.sleep(1.0)  # the progress record for MAX_ROUND was published, nothing failed
        assert counter_value(a.metrics.background_errors) == 0

    run_on_memnet(main)


# ---- finding 8 and the robust-aggregation plumbing -------------------------------------------------------


class FakeAllreduce:
    """Returns a chosen vector; records the keyword arguments the service passed."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.next: np.ndarray | None = None

    async def average(self, group_id, members, index, vector, weight, options=DEFAULT_OPTIONS, *, out=None,
                      center=None):
        self.calls.append(asked_options(options, center))
        phase = SimpleNamespace(silent=(), datagrams_expected=4, datagrams_received=4)
        out = self.next if self.next is not None else vector * 2
        return SimpleNamespace(vector=out, stats=SimpleNamespace(reduce_scatter=phase, all_gather=phase))




def test_a_non_finite_average_never_replaces_the_vector_and_options_reach_the_owner() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        fake = FakeAllreduce()
        a = node(net, 0, allreduce=fake)
        st = await a.moshpit.open("run", grid=Grid(1, 4), window_s=1.0, max_weight=64, robust="centered:3")
        assert st.max_weight == 64.0 and st.robust == Robust("centered", 3.0)
        vec = np.ones(6, np.float32)

        async def avg(v):
            return await a.moshpit._average_group(st, _group(a), v, 1.0, 10.0, 0, "k", 2)

        res = await avg(vec)
        assert res.outcome == "averaged" and fake.calls[-1] == {
            "floor_s": 1.0, "owner_lag_s": 1.0, "max_phase_s": 5.0, "max_weight": 64.0,
            "robust": Robust("centered", 3.0)}
        res = await avg(vec)  # the previous averaged vector is the center
        assert np.array_equal(fake.calls[-1]["center"], np.full(6, 2, np.float32))
        own = np.full(6, 7, np.float32)  # a center the caller gives (its own parameters) wins for that round
        await a.moshpit._average_group(st, _group(a), vec, 1.0, 10.0, 0, "k", 2, own)
        assert fake.calls[-1]["center"] is own
        with pytest.raises(MoshpitError, match="center"):
            await a.moshpit.average("run", vec, 1.0, center=np.ones(5, np.float32))
        for bad in (np.nan, np.inf, -np.inf):
            fake.next = np.full(6, 2, np.float32)
            fake.next[3] = bad
            res = await avg(vec)
            assert res.outcome == "failed" and "NaN or infinity" in res.error
            assert np.array_equal(res.vector, vec) and res.vector is not vec
        assert counter_value(a.metrics.contributions_refused, reason="nonfinite_average") == 3
        assert np.array_equal(st.center, np.full(6, 2, np.float32))  # a failed round is never a center
        fake.next = None
        await avg(np.ones(5, np.float32))  # another length: no center
        assert "center" not in fake.calls[-1]
        # average() sets them per run too; None leaves them; off/inf clear them
        await a.moshpit.open("run", robust="clip")
        assert st.robust == Robust("clip", 1.0) and st.center is None and st.max_weight == 64.0
        await a.moshpit.open("run", robust="off", max_weight=math.inf)
        assert st.robust is None and st.max_weight is None
        await avg(vec)
        assert fake.calls[-1] == {"floor_s": 1.0, "owner_lag_s": 1.0, "max_phase_s": 5.0}
        for kwargs, words in [({"max_weight": 0}, "max_weight"), ({"max_weight": float("nan")}, "max_weight"),
                              ({"robust": "median"}, "clip"), ({"robust": "clip:-1"}, "C")]:
            with pytest.raises(MoshpitError, match=words):
                await a.moshpit.average("run", vec, 1.0, **kwargs)

    run_on_memnet(main)


def test_ops_accept_max_samples_and_robust() -> None:
    assert _averaging_options({}) == {}
    assert _averaging_options({"max_samples": 32, "robust": "clip:4"}) == {
        "max_weight": 32.0, "robust": Robust("clip", 4.0)}
    assert _averaging_options({"robust": "off"}) == {"robust": "off"}
    for bad in (0, -1, float("inf"), float("nan"), "8", True):
        with pytest.raises(OpError, match="max_samples must be a positive finite number"):
            _averaging_options({"max_samples": bad})
    for bad in ("median", 3, "clip:x"):
        with pytest.raises(OpError, match="clip"):
            _averaging_options({"robust": bad})

    got: dict = {}

    class Service:
        async def average(self, run, vector, weight, **kwargs):
            got.update(kwargs)
            return RoundResult(vector, "alone", "", 1, [], 1.0, 0, 0.0)

    ops = MoshpitOps(Service())  # type: ignore[arg-type]
    trio.run(ops.round, {"run": "r", "vector": np.ones(2, "<f4").tobytes(), "max_samples": 8.5,
                         "robust": "centered"})
    assert got["max_weight"] == 8.5 and got["robust"] == Robust("centered", 1.0)


def test_weight_cap_reaches_the_real_owners_through_a_round() -> None:
    """Both members set max_samples 10 on the run: a member claiming 100 samples counts as 10."""
    from peerd.allreduce.service import AllreduceService

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = []
        for i in range(2):
            n = DhtNode(net, i)
            n.moshpit = MoshpitService(n.endpoint, n.dht, AllreduceService(n.endpoint, n.metrics), n.metrics,
                                       address=n.addr, rng=random.Random(i))
            await start(nursery, n)
            nodes.append(n)
        cands = tuple(sorted((Candidate(1.0, n.identity.node_id, n.identity.public_key, n.addr) for n in nodes),
                             key=lambda c: c.node_id))
        vecs = [np.zeros(300, np.float32), np.ones(300, np.float32)]
        weights = [1.0, 100.0]
        out: list = [None, None]

        async def one(i: int) -> None:
            n = nodes[i]
            st = await n.moshpit.open("cap", grid=Grid(1, 2), window_s=1.0, max_weight=10, robust="clip:1e6")
            index = next(j for j, c in enumerate(cands) if c.node_id == n.identity.node_id)
            group = Group(99, cands, index, cands[0].node_id)
            out[i] = await n.moshpit._average_group(st, group, vecs[i], weights[i], 20.0, 0, "k", 2)

        async with trio.open_nursery() as inner:
            for i in range(2):
                inner.start_soon(one, i)
        for res in out:
            assert res.outcome == "averaged", res.error
            assert np.allclose(res.vector, 10 / 11, atol=1e-5)  # not 100 / 101

    run_on_memnet(main, seed=3)


def test_a_handler_that_raises_does_not_end_the_receive_loop() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        a, b = (Endpoint(net.socket("127.0.0.1", 1 + i), Identity.generate(), SECRET, Metrics()) for i in range(2))
        for ep in (a, b):
            nursery.start_soon(ep.serve)
        b.on_request(m.MsgType.PING, lambda incoming: {}["missing"])  # a bug that a peer's input reaches
        with pytest.raises(RpcTimeout):
            await a.request(("127.0.0.1", 2), m.MsgType.PING, {}, timeout=0.1, attempts=2)
        assert counter_value(b.metrics.datagrams_dropped, reason="handler_error") == 2
        assert counter_value(b.metrics.background_errors, task="endpoint_ping") == 2
        b.on_request(m.MsgType.PING, lambda incoming: {})
        assert (await a.request(("127.0.0.1", 2), m.MsgType.PING, {})).mtype is m.MsgType.PONG

    run_on_memnet(main)


def test_peers_listening_on_a_wildcard_average_through_matchmaking() -> None:
    """No --announce, listening on 0.0.0.0: the leader's BEGIN lists itself as loopback (decoders refuse
    0.0.0.0) and followers reach it where the BEGIN came from. A whole round through the DHT, real averaging."""
    from peerd.allreduce.service import AllreduceService

    from .support.dht_swarm import start_swarm

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 3)
        for i, n in enumerate(nodes):
            n.moshpit = MoshpitService(n.endpoint, n.dht, AllreduceService(n.endpoint, n.metrics), n.metrics,
                                       address=("0.0.0.0", n.addr[1]), rng=random.Random(i))
            await nursery.start(n.moshpit.run)
        out: list = [None] * 3

        async def one(i: int) -> None:
            await nodes[i].moshpit.open("wild", grid=Grid(1, 3), min_size=3, window_s=2.0)
            out[i] = await nodes[i].moshpit.average("wild", np.full(50, float(i), np.float32), 1.0, timeout_s=20)

        async with trio.open_nursery() as inner:
            for i in range(3):
                inner.start_soon(one, i)
        for res in out:
            assert res.outcome == "averaged" and res.group_size == 3, res.statistics()
            assert np.allclose(res.vector, 1.0)
        for n in nodes:
            assert counter_value(n.metrics.datagrams_dropped, reason="malformed") == 0
            assert counter_value(n.metrics.background_errors) == 0

    run_on_memnet(main, seed=5)


def test_the_run_grid_is_what_most_publishers_name_and_a_squatter_cannot_hide_it() -> None:
    """A shared ``grid`` subkey belonged to its first writer; now each publisher writes under its own id and a
    joiner takes the grid named most often, among grids that parse and fit."""
    from peerd.moshpit.service import published_grid

    def rec(owner: int, value: bytes) -> SimpleNamespace:
        return SimpleNamespace(owner=bytes([owner]) * 32, value=value)

    honest = [rec(i, b"4x4") for i in range(3)]
    squatter = [rec(9, b"2x2x2x2x2x2x2x2"), rec(8, b"junk"), rec(7, b"\xff")]
    assert published_grid(honest + squatter) == Grid(2, 4)
    assert published_grid([rec(1, b"8x8"), rec(2, b"4x4")]) == Grid(2, 4)  # a tie: the smaller grid
    assert published_grid([rec(1, b"64x64")], lambda g: g.size <= 24) is None  # does not fit this node's MTU
    assert published_grid(squatter[1:]) is None
