"""Bandwidth caps (peerd.linkcap): the rates an operator writes, the upload bucket and budget pacer in virtual time,
the cap a node announces and what a group plans from it, and the socket wrapper every send passes."""

from __future__ import annotations

import argparse
import math

import msgpack
import pytest
import trio
import trio.testing

from peerd.linkcap import CapAdvert, CapConfig, LinkCap, PeerCaps, parse_budget, parse_rate, share_seconds
from peerd.linkcap.advert import WIRE_OVERHEAD, sender_rate
from peerd.linkcap.args import add_cap_arguments, cap_config
from peerd.linkcap.core import BURST_S, PACER_SHARE, TICK_S
from peerd.linkcap.shell import CappedSocket, clamp_pacer, limit_senders
from peerd.moshpit.matchmaking import REACH_PUBLIC, REACH_UNKNOWN
from peerd.moshpit.records import decode_announce, encode_announce
from peerd.transport.pacing import Pacer
from peerd.wire.identity import node_id_of

MBIT = 1e6 / 8


def test_rates_in_bits_and_bytes() -> None:
    assert parse_rate("20mbit") == 20 * MBIT
    assert parse_rate("20Mbit/s") == parse_rate("20mbps") == 20 * MBIT
    assert parse_rate("500kbit") == 500e3 / 8
    assert parse_rate("5MB/s") == 5e6
    assert parse_rate("2.5MiB/s") == 2.5 * 1024**2
    assert parse_rate("1gbit") == 125e6


@pytest.mark.parametrize("text", ["20", "20mb", "20mb/s", "5MB", "fast", "-3mbit", "10kbit", "200gbit", ""])
def test_rates_refused_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match=r"20mbit|64kbit"):
        parse_rate(text)


def test_budgets() -> None:
    b = parse_budget("200GB/month")
    assert b.nbytes == 200e9 and b.period_s == 30 * 86400
    assert parse_budget("5GB/day").period_s == 86400
    assert parse_budget("50GiB/week").nbytes == 50 * 1024**3
    for bad in ("200GB", "200gb/month", "200GB/year", "10MB/day", "lots"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_join_flags_are_validated_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_cap_arguments(p)
    cfg = cap_config(p.parse_args(["--max-upload", "20mbit", "--max-download", "5MB/s", "--budget", "1TB/month"]))
    assert cfg == CapConfig(20 * MBIT, 5e6, parse_budget("1TB/month")) and cfg.active
    assert not cap_config(p.parse_args([])).active
    with pytest.raises(SystemExit):
        p.parse_args(["--max-upload", "20mb"])
    assert "unit 'mb' is not one peerd reads" in capsys.readouterr().err


def wire_per_window(cap: LinkCap, offered: float, seconds: float, datagram: int = 1200, burst: int = 8
                    ) -> list[float]:
    """Send bursts of ``burst`` datagrams as fast as ``offered`` bytes/s asks, each when the core lets it; returns
    the wire bytes that left in each 1 s window (virtual time)."""
    t, out = 0.0, [0.0] * int(seconds)
    while t < seconds:
        at = t + cap.send(datagram * burst, burst, t)
        if int(at) < len(out):
            out[int(at)] += (datagram + WIRE_OVERHEAD) * burst
        t = max(at, t + datagram * burst / offered)
    return out


def test_the_upload_bucket_holds_any_offered_rate_to_the_cap_on_the_wire() -> None:
    cap = LinkCap(CapConfig(max_upload=20 * MBIT), 0.0)
    windows = wire_per_window(cap, offered=100 * MBIT, seconds=10)
    one = 8 * (1200 + WIRE_OVERHEAD)  # a send of 8 datagrams lands in one window whole
    assert windows[0] <= 20 * MBIT * (1 + BURST_S) + one, windows  # (the first: BURST_S ahead of the rate, at most)
    assert all(w <= 20 * MBIT + one for w in windows[1:]), windows
    assert min(windows[1:]) >= 20 * MBIT * 0.98, windows  # and it is used
    assert cap.held_sends > 0 and cap.uploaded == pytest.approx(sum(windows), rel=0.01)


def test_no_cap_no_wait_and_a_slow_sender_never_waits() -> None:
    free = LinkCap(CapConfig(), 0.0)
    assert all(free.send(1200, 1, t / 10) == 0.0 for t in range(100))
    capped = LinkCap(CapConfig(max_upload=20 * MBIT), 0.0)
    wire_per_window(capped, offered=10 * MBIT, seconds=5)
    assert capped.held_sends == 0


def test_the_pacer_ceiling_sits_under_the_cap_in_payload_bytes() -> None:
    cap = LinkCap(CapConfig(max_upload=20 * MBIT), 0.0, datagram=1200)
    assert cap.pacer_ceiling() == pytest.approx(PACER_SHARE * 20 * MBIT * 1200 / 1242)
    assert LinkCap(CapConfig(max_download=5e6), 0.0).pacer_ceiling() is None
    pacer = Pacer(datagram=1200)
    clamp_pacer(pacer, cap.pacer_ceiling())
    # whatever the pacer's judgement does later, its rate never passes the ceiling
    pacer.btl = 1e9
    pacer._open(0.0)
    assert pacer.rate <= cap.pacer_ceiling()


def test_rates_are_measured_each_tick_and_statistics_are_a_snapshot() -> None:
    cap = LinkCap(CapConfig(max_upload=20 * MBIT, max_download=10 * MBIT), 100.0)
    cap.start(100.0)
    assert cap.get_timer() == 100.0 + TICK_S
    cap.send(1_000_000, 1000, 100.2)
    cap.receive_total(500_000, 500, 100.5)
    cap.handle_timer(101.0)
    st = cap.statistics()
    assert st.upload_rate == pytest.approx(1_000_000 + 1000 * WIRE_OVERHEAD)
    assert st.download_rate == pytest.approx(500_000 + 500 * WIRE_OVERHEAD)
    assert st.upload_limit == 20 * MBIT and st.download_limit == 10 * MBIT and st.budget is None
    with pytest.raises(AttributeError):
        st.upload_rate = 0  # type: ignore[misc]  # frozen


def test_a_budget_spreads_what_is_left_and_says_when_it_would_run_out() -> None:
    day = 86_400.0
    cap = LinkCap(CapConfig(budget=parse_budget("8640MB/day")), 0.0)  # 100 kB/s over the day
    cap.start(0.0)
    assert cap.upload_limit == pytest.approx(50e3) and cap.download_limit == pytest.approx(50e3)  # half each way
    # half the day's bytes spent in the first hour: the rest is spread over the 23 hours left
    cap.send(4320e6 - 1000 * WIRE_OVERHEAD, 1000, 10.0)
    cap.handle_timer(3600.0)
    st = cap.statistics().budget
    assert st is not None and st.used_bytes == pytest.approx(4320e6)
    assert st.allowance == pytest.approx(4320e6 / (day - 3600.0))
    assert cap.upload_limit == pytest.approx(0.5 * st.allowance)
    assert not st.on_track and st.runs_out_in_s == pytest.approx(3600.0, rel=0.01)  # at the first hour's pace
    # a new day: the whole budget again
    cap.handle_timer(day + 10.0)
    st = cap.statistics().budget
    assert st is not None and st.used_bytes == 0 and st.remaining_bytes == 8640e6


def test_a_spent_budget_still_lets_a_datagram_through() -> None:
    cap = LinkCap(CapConfig(max_upload=20 * MBIT, budget=parse_budget("100MB/day")), 0.0)
    cap.start(0.0)
    cap.send(100_000_000, 1, 0.5)
    cap.handle_timer(1.0)
    assert 0 < cap.upload_limit < 10_000 and math.isfinite(cap.send(1200, 1, 2.0))


class Rec:
    def __init__(self, value: bytes) -> None:
        self.owner = bytes(range(32))
        self.subkey = node_id_of(self.owner)
        self.value = value


def test_the_cap_travels_in_the_matchmaking_record() -> None:
    ad = CapAdvert(up=2_500_000, down=0)
    got = decode_announce(Rec(encode_announce(12.5, "203.0.113.7", 4000, REACH_UNKNOWN, ad)))
    assert got is not None and got.cap == ad and got.reach == REACH_UNKNOWN
    got = decode_announce(Rec(encode_announce(12.5, "203.0.113.7", 4000, REACH_PUBLIC, ad)))
    assert got is not None and got.cap == ad and got.reach == REACH_PUBLIC
    # uncapped: the record is the one nodes without caps always wrote
    assert encode_announce(12.5, "203.0.113.7", 4000, REACH_UNKNOWN, CapAdvert()) == encode_announce(
        12.5, "203.0.113.7", 4000)
    assert decode_announce(Rec(encode_announce(12.5, "203.0.113.7", 4000))).cap is None


@pytest.mark.parametrize("cap", [[1], [1, 2, 3], [-1, 0], [0, 2**41], [1.5, 0], ["1", 0], {"up": 1}, None, 0])
def test_a_malformed_cap_makes_the_record_malformed_hostile(cap: object) -> None:
    ip = bytes([203, 0, 113, 7])
    assert decode_announce(Rec(msgpack.packb([12.5, ip, 4000, REACH_UNKNOWN, cap]))) is None
    assert decode_announce(Rec(msgpack.packb([12.5, ip, 4000, REACH_UNKNOWN, [1, 2], 0]))) is None


def test_peer_caps_are_bounded_and_tell_unknown_from_uncapped_hostile() -> None:
    table = PeerCaps(max_peers=3)
    for i in range(10):
        table.note(bytes([i]) * 32, CapAdvert(1000 + i, 0))
    assert len(table) == 3 and table.get(bytes([9]) * 32) == CapAdvert(1009, 0) and table.get(bytes(32)) is None
    table.note(b"u" * 32, None)
    assert table.known(b"u" * 32) and table.get(b"u" * 32) is None and not table.known(b"x" * 32)


def test_the_plan_gives_a_capped_member_its_shares_time_and_splits_a_download_cap() -> None:
    v = 8_000_000  # bytes averaged
    ad = CapAdvert(up=int(20 * MBIT), down=0)
    share = v * 3 / 4 * (1 + WIRE_OVERHEAD / 1200)
    assert share_seconds(v, [None, ad, None, None]) == pytest.approx(share / (20 * MBIT))
    assert share_seconds(v, [None, None, None, None]) == 0.0 and share_seconds(v, [ad]) == 0.0
    down = CapAdvert(up=0, down=int(20 * MBIT))
    per = sender_rate(down, 4)
    assert per is not None and 3 * per * (1242 / 1200) <= 20 * MBIT and 3 * per * (1242 / 1200) >= 0.95 * 20 * MBIT
    assert sender_rate(ad, 4) is None and sender_rate(None, 4) is None

    class Mb:
        def __init__(self, node_id: bytes) -> None:
            self.node_id = node_id

    pacer = Pacer(datagram=1200)
    table = PeerCaps()
    table.note(b"c" * 32, down)
    limit_senders(pacer, [Mb(b"a" * 32), Mb(b"c" * 32), Mb(b"d" * 32), Mb(b"e" * 32)], table, 1200)
    assert set(pacer._limits) == {b"c" * 32}
    # sending to the capped member as fast as the pacer lets: its share, not the uplink's rate
    t, sent = 0.0, 0
    while t < 2.0:
        t += pacer.reserve(1200, b"c" * 32, t) + 1e-5
        sent += 1200
    assert sent / t <= per * 1.05


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[tuple[float, int]] = []
        self.family = 2

    async def sendto(self, data: bytes, address: tuple[str, int], /) -> None:
        self.sent.append((trio.current_time(), len(data)))

    async def send_many(self, datagrams: list[bytes], address: tuple[str, int], /) -> None:
        for d in datagrams:
            self.sent.append((trio.current_time(), len(d)))

    def kernel_drops(self) -> int:
        return 7


def test_every_send_through_the_capped_socket_waits_for_the_bucket() -> None:
    async def main() -> None:
        inner = FakeSocket()
        core = LinkCap(CapConfig(max_upload=1 * MBIT), 0.0)
        core.start(trio.current_time())
        sock = CappedSocket(inner, core)
        t0 = trio.current_time()
        for _ in range(100):
            await sock.sendto(b"x" * 1158, ("10.0.0.1", 1))  # 1200 bytes on the wire each
        await sock.send_many([b"y" * 1158] * 25, ("10.0.0.1", 1))
        # a send goes once the bytes before it have had their time at the cap (less the bucket's BURST_S)
        assert trio.current_time() - t0 == pytest.approx(100 * 1200 / MBIT - BURST_S, abs=0.005)
        await sock.sendto(b"z" * 1158, ("10.0.0.1", 1))
        assert trio.current_time() - t0 == pytest.approx(125 * 1200 / MBIT - BURST_S, abs=0.005)
        assert len(inner.sent) == 126
        assert sock.kernel_drops() == 7 and sock.family == 2  # the rest is the wrapped socket's

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_matchmaking_record_vectors_decode_as_the_protocol_says() -> None:
    import json
    from pathlib import Path

    v = json.loads((Path(__file__).parent.parent / "protocol" / "vectors" / "announce.json").read_text())
    for case in v["good"]:
        got = decode_announce(Rec(bytes.fromhex(case["value"])))
        assert got is not None, case["name"]
        assert got.reach == case["reach"] and got.port == 7400, case["name"]
        assert (None if got.cap is None else list(got.cap.encode())) == case["cap"], case["name"]
        if got.cap is not None:  # peerd writes the same bytes
            assert encode_announce(got.expiry, got.host, got.port, got.reach, got.cap).hex() == case["value"]
    for case in v["malformed"]:
        assert decode_announce(Rec(bytes.fromhex(case["value"]))) is None, case["name"]


def test_a_capped_daemon_shows_its_caps_use_and_budget_in_status(tmp_path) -> None:
    import time

    from peerd.tools.swarm import LocalSwarm

    with LocalSwarm(str(tmp_path), insecure=True, metrics=False) as swarm:
        node = swarm.start(extra=("--max-upload", "20mbit", "--max-download", "5MB/s", "--budget", "200GB/month"))
        swarm.wait_ready(node)
        time.sleep(1.2)  # a tick of the caps' timer
        caps = node.call("status")["caps"]
        plain = swarm.start()
        assert swarm.wait_ready(plain)["caps"] is None
    assert caps["max_upload"] == 2.5e6 and caps["max_download"] == 5e6
    # 200 GB over what is left of the calendar month (about 77 kB/s both ways together): the budget binds under both
    # flags, half of it each way
    budget = caps["budget"]
    assert caps["upload_limit"] == caps["download_limit"] == pytest.approx(
        0.5 * budget["remaining_bytes"] / budget["period_left_s"], rel=0.01)
    assert budget["budget_bytes"] == 200e9 and budget["period"] == "month" and budget["on_track"]
    assert 28 * 86400 <= budget["period_s"] <= 31 * 86400 and 0 < budget["period_left_s"] <= budget["period_s"]
    assert 0 < budget["remaining_bytes"] <= 200e9 and budget["runs_out_in_s"] is None
    assert caps["uploaded"] >= 0 and caps["held_s"] >= 0
