"""The per-peer accounting core (peerd/peers/table.py) and its shell's metrics, in virtual time."""

from __future__ import annotations

import dataclasses

import pytest

from peerd.metrics import OTHER_PEER, TOP_PEERS, Metrics
from peerd.peers import PeerFeed, PeerTable
from peerd.peers.natview import nat_view
from peerd.peers.report import view_json
from peerd.peers.table import KINDS, QUIET_S, kind_of

A, B, R = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32
DATA, PING, FIND_NODE, STATE_CHUNK, RELAYED, REPORT, OBSERVE = 0x41, 0x01, 0x03, 0x19, 0x2A, 0x10, 0x20


def test_kinds_follow_the_message_types() -> None:
    assert [kind_of(t) for t in (DATA, REPORT, 0x11, PING, FIND_NODE, STATE_CHUNK, RELAYED, OBSERVE)] == [
        "averaging", "averaging", "averaging", "dht", "dht", "state_sync", "relay", "other"]
    assert set(KINDS) == {"averaging", "dht", "state_sync", "relay", "other"}


def test_bytes_by_kind_rates_and_goodput_over_the_last_seconds() -> None:
    t = PeerTable()
    now = 0.0
    for _ in range(5):  # 1 MB/s out to A, 0.5 MB/s in, for 5 s
        t.receive_sent(A, "10.0.0.1:7411", DATA, 1_000_000, None, now)
        t.receive_received(A, "10.0.0.1:7411", DATA, 500_000, False, now)
        now += 1.0
        t.handle_timer(now)
    t.receive_sent(A, "10.0.0.1:7411", FIND_NODE, 100, None, now)
    t.receive_report(A, 1000, 900, False, now)  # A got 90 % of this node's data
    t.receive_report(A, 1000, 990, True, now)  # this node got 99 % of A's
    p = t.statistics().peers[0]
    assert p.peer == A.hex() and p.addr == "10.0.0.1:7411" and p.path == "direct"
    assert p.send_bps == pytest.approx(1e6) and p.recv_bps == pytest.approx(5e5)
    assert p.loss_out == pytest.approx(0.1) and p.loss_in == pytest.approx(0.01)
    assert p.goodput_out_bps == pytest.approx(9e5) and p.goodput_in_bps == pytest.approx(5e5)
    assert p.sent_bytes["averaging"] == 5_000_000 and p.sent_bytes["dht"] == 100
    assert p.received_bytes["averaging"] == 2_500_000 and p.verdict == "reachable" and p.last_heard_s == 1.0
    assert t.get_timer() == now + 1.0
    for _ in range(6):  # silence: the rates fall to zero once the window has passed
        now += 1.0
        t.handle_timer(now)
    assert t.statistics().peers[0].send_bps == 0.0


def test_rates_say_the_window_they_cover_and_how_old_it_is() -> None:
    t = PeerTable()
    t.receive_sent(A, "h:1", DATA, 1000, None, 10.0)
    stats = t.statistics()
    assert stats.rates_age_s is None and stats.peers[0].rate_window_s == 0.0  # no sample yet: no window
    for k in range(1, 9):
        t.receive_sent(A, "h:1", DATA, 1000, None, 10.0 + k - 0.5)
        t.handle_timer(10.0 + k)
    t.receive_received(A, "h:1", DATA, 10, False, 18.4)  # an input after the latest tick moves "now"
    stats = t.statistics()
    p = stats.peers[0]
    assert p.rate_window_s == pytest.approx(5.0) and p.send_bps == pytest.approx(1000.0)  # RATE_TICKS samples
    assert stats.rates_age_s == pytest.approx(0.4)
    view = view_json(stats, _swarm())
    assert view["rates_age_s"] == 0.4 and view["peers"][0]["rate_window_s"] == 5.0


def test_rtt_is_smoothed_with_a_p99_and_unanswered_requests_show() -> None:
    t = PeerTable()
    t.receive_sent(B, "h:1", PING, 60, None, 0.0)
    assert t.statistics().peers[0].rtt_s is None and t.statistics().peers[0].verdict == "quiet"
    for i in range(100):
        t.receive_rtt(B, 0.010 if i not in (30, 50) else 0.500, float(i))  # p99 of 100: the 99th
    p = t.statistics().peers[0]
    assert 0.010 <= p.rtt_s < 0.1 and p.rtt_p99_s == 0.5 and p.rtt_samples == 100
    t.receive_unanswered(B, 200.0)
    assert t.statistics().peers[0].verdict == "unanswered" and t.statistics().peers[0].unanswered == 1
    t.receive_rtt(B, 0.01, 201.0)
    assert t.statistics().peers[0].verdict == "reachable"
    t.handle_timer(201.0 + QUIET_S + 1)
    assert t.statistics().peers[0].verdict == "quiet"


def test_relayed_paths_name_the_relay_and_count_toward_the_relayed_fraction() -> None:
    t = PeerTable()
    t.receive_sent(A, "h:1", DATA, 1000, R, 0.0)
    t.receive_sent(B, "h:2", DATA, 3000, None, 0.0)
    t.receive_path(B, "punched", None, 0.0)
    stats = t.statistics()
    by = {p.peer: p for p in stats.peers}
    assert by[A.hex()].path == "relayed" and by[A.hex()].via == R.hex() and by[B.hex()].path == "punched"
    assert stats.relayed_bytes == 1000 and stats.sent_bytes == 4000
    assert view_json(stats, _swarm())["relayed_fraction"] == 0.25
    t.receive_sent(A, "h:1", DATA, 1000, None, 1.0)  # the relay is gone: sent straight to it
    assert {p.peer: p for p in t.statistics().peers}[A.hex()].path == "direct"


def test_memory_is_bounded_and_the_least_recent_peer_goes_first() -> None:
    t = PeerTable(capacity=3)
    for i in range(5):
        t.receive_sent(bytes([i]) * 32, f"h:{i}", DATA, 10, None, float(i))
    t.receive_received(bytes([2]) * 32, "h:2", DATA, 10, False, 5.0)  # 2 is recent again
    t.receive_sent(bytes([9]) * 32, "h:9", DATA, 10, None, 6.0)
    stats = t.statistics()
    assert stats.tracked == 3 and stats.evicted == 3
    assert {p.peer[:2] for p in stats.peers} == {"02", "04", "09"}
    assert stats.sent_by_kind["averaging"] == 60  # the node's totals keep what evicted peers moved
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.tracked = 0  # type: ignore[misc]


def test_reports_and_rtts_that_make_no_sense_are_ignored_hostile() -> None:
    t = PeerTable()
    t.receive_sent(A, "h:1", DATA, 10, None, 0.0)
    t.receive_report(A, 10, 20, False, 0.0)  # more received than expected
    t.receive_report(A, 0, 0, True, 0.0)
    t.receive_report(A, -5, -10, True, 0.0)
    for bad in (float("nan"), float("inf"), -1.0):
        t.receive_rtt(A, bad, 0.0)
    t.receive_report(B, 10, 5, False, 0.0)  # a peer not tracked allocates nothing
    t.receive_rtt(B, 0.01, 0.0)
    p = t.statistics().peers[0]
    assert p.loss_out is None and p.loss_in is None and p.rtt_s is None and t.statistics().tracked == 1
    for _ in range(100):  # a flood of huge counts stays a fraction in [0, 1]
        t.receive_report(A, 4_000_000_000, 1, False, 0.0)
    assert 0.99 < t.statistics().peers[0].loss_out <= 1.0


class _Endpoint:
    def __init__(self) -> None:
        self.ids: dict[tuple[str, int], bytes] = {}

    def node_id_at(self, addr: tuple[str, int]) -> bytes | None:
        return self.ids.get(addr)


def _swarm():
    from peerd.peers import SwarmView

    return SwarmView(None, None)


def _samples(metrics: Metrics, name: str) -> dict[tuple, float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_per_peer_series_are_the_busiest_and_the_rest_summed_as_other() -> None:
    metrics, ep = Metrics(), _Endpoint()
    table = PeerTable()
    feed = PeerFeed(ep, metrics, table=table)
    n = TOP_PEERS + 12
    for i in range(n):
        node = bytes([i + 1]) * 32
        table.receive_sent(node, f"h:{i}", DATA, 1000 * (i + 1), None, 0.0)
        table.receive_rtt(node, 0.001 * (i + 1), 0.0)
    feed.tick(1.0)
    send = _samples(metrics, "peerd_peer_send_bytes_per_second")
    assert len(send) == TOP_PEERS + 1
    others = sum(1000 * (i + 1) for i in range(n - TOP_PEERS))
    assert send[(("peer", OTHER_PEER),)] == pytest.approx(others)
    assert send[(("peer", (bytes([n]) * 32).hex()[:16]),)] == pytest.approx(1000 * n)
    assert len(_samples(metrics, "peerd_peer_rtt_seconds")) == 2 * TOP_PEERS
    assert _samples(metrics, "peerd_traffic_bytes_total")[(("direction", "out"), ("kind", "averaging"))] == sum(
        1000 * (i + 1) for i in range(n))
    assert _samples(metrics, "peerd_peers_tracked")[()] == n
    # a peer that left the top loses its series (no stale series pile up)
    for i in range(TOP_PEERS + 2):
        table.receive_sent(bytes([100 + i]) * 32, "x:1", DATA, 10_000_000, None, 1.5)
    feed.tick(2.0)
    feed.tick(3.0)
    send = _samples(metrics, "peerd_peer_send_bytes_per_second")
    assert len(send) == TOP_PEERS + 1 and (("peer", (bytes([n]) * 32).hex()[:16]),) not in send


def test_the_feed_resolves_addresses_and_reads_reports_both_ways() -> None:
    import trio

    metrics, ep = Metrics(), _Endpoint()
    ep.ids[("127.0.0.1", 5)] = A
    feed = PeerFeed(ep, metrics)

    async def main() -> None:
        feed.sent(("127.0.0.1", 5), DATA, 1200, None)
        feed.sent(("127.0.0.1", 6), PING, 60, None)  # nobody known there: unattributed
        feed.received(("127.0.0.1", 5), None, REPORT, 80, False, 0.0, {"expected": 10, "received": 8})
        feed.control(A, REPORT, {"expected": 10, "received": 10}, True)
        feed.answered(("127.0.0.1", 5), A, 0.004, 0.0)
        feed.unanswered(("127.0.0.1", 7), 0.0)

    trio.run(main)
    stats = feed.statistics()
    p = stats.peers[0]
    assert stats.tracked == 1 and stats.unattributed_bytes == 60
    assert p.loss_out == pytest.approx(0.2) and p.loss_in == 0.0 and p.rtt_s == 0.004 and p.addr == "127.0.0.1:5"
    feed.received(("127.0.0.1", 5), A, 0x41, 1000, False, 2.0)  # summed in the feed until a tick or statistics()
    assert feed.table.statistics().peers[0].received_bytes["averaging"] == 80  # (the REPORT)
    assert feed.statistics().peers[0].received_bytes["averaging"] == 1080


def test_nat_view_reads_either_shape_and_never_raises() -> None:
    @dataclasses.dataclass(frozen=True)
    class Stats:
        reachability: str
        observed_addr: str | None
        paths: dict

    class New:
        def statistics(self) -> Stats:
            return Stats("cone-nat", "1.2.3.4:5", {A.hex(): "punched"})

    class Old:
        def status(self) -> dict:
            return {"reachability": "public", "paths": {B.hex(): "relayed", "zz": "direct"}}

    class Broken:
        def statistics(self) -> dict:
            raise RuntimeError("mid-restart")

    assert nat_view(New()).paths == {A: "punched"} and nat_view(New()).reachability == "cone-nat"
    assert nat_view(Old()).paths == {B: "relayed"} and nat_view(Old()).observed_addr is None
    assert nat_view(Broken()).reachability == "unknown" and nat_view(object()).paths == {}


def test_a_member_with_thousands_of_identities_cannot_grow_the_view_hostile() -> None:
    from peerd.peers.feed import MAX_PENDING

    feed = PeerFeed(_Endpoint(), Metrics(), table=PeerTable(capacity=64))
    for i in range(20_000):
        feed.received(("10.0.0.1", 1000 + i % 50_000), i.to_bytes(32, "big"), DATA, 1200, False, i / 1000)
        assert len(feed._pending_in) <= MAX_PENDING
    stats = feed.statistics()
    assert stats.tracked == 64 and stats.evicted == 20_000 - 64 and stats.received_bytes == 20_000 * 1200
    feed.tick(30.0)
    assert len(_samples(feed.metrics, "peerd_peer_receive_bytes_per_second")) <= TOP_PEERS + 1


def test_the_counts_behind_the_loss_give_the_loss_between_two_reads() -> None:
    t = PeerTable()
    t.receive_sent(A, "10.0.0.1:7411", DATA, 1000, None, 0.0)
    t.receive_report(A, 1000, 700, False, 0.0)  # a bad first average: 30 % of this node's data lost
    t.receive_report(A, 1000, 1000, True, 0.0)
    first = t.statistics().peers[0]
    assert first.loss_out_counts == (1000, 700) and first.loss_in_counts == (1000, 1000)
    t.receive_report(A, 3000, 2850, False, 1.0)  # then 5 %
    t.receive_report(A, 3000, 2940, True, 1.0)
    p = t.statistics().peers[0]
    assert p.loss_out == pytest.approx(450 / 4000)  # the fraction keeps the first average's loss ...
    (e1, a1), (e0, a0) = p.loss_out_counts, first.loss_out_counts
    assert 1 - (a1 - a0) / (e1 - e0) == pytest.approx(0.05)  # ... the counts' difference is the loss since
    (e1, a1), (e0, a0) = p.loss_in_counts, first.loss_in_counts
    assert 1 - (a1 - a0) / (e1 - e0) == pytest.approx(0.02)
