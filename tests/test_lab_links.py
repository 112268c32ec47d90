"""The link lab (peerd/tools/lab/links.py): shaped, lossy links between network namespaces, and nothing left behind.

The root-only tests build real labs (namespaces, veths, a bridge, tc tbf, nftables) and skip with the reason when
this process cannot (not root, a tool missing). Blasts use peerd.tools.lab.blast: a paced UDP sender and a receiver
that timestamps arrivals in the kernel, so a loaded machine does not distort the measured rate.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from peerd.tools.lab import LabError, LinkLab, format_rate, parse_rate, tbf_params
from peerd.tools.lab import links as links_mod
from peerd.tools.swarm import LocalSwarm

from .support.processes import killed_lab, peerd, peerd_json, wait_until

# Skipped only where this is not root. As root a missing tool (ip, tc, nft, ethtool) fails them, with the
# lab's error saying what to install: CI runs as root and must install them.
NOT_ROOT = os.geteuid() != 0
needs_lab = pytest.mark.skipif(NOT_ROOT, reason="the link lab needs root: network namespaces, tc and nftables")
HEADERS = 14 + 20 + 8  # Ethernet + IPv4 + UDP: on the shaped link, not in the payload


# ---- no root needed ------------------------------------------------------------------------------------------

def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate("2.5Mbit") == 2_500_000
    assert parse_rate("1000000") == 1_000_000
    assert parse_rate(64_000) == 64_000
    for bad in ("fast", "100mbps", "100 MB", "-5mbit", "", "1e6", "100mbit/s", "10bit"):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(bad)
    assert format_rate(parse_rate("100mbit")) == "100mbit" and format_rate(1_500_000) == "1500kbit"


def test_tbf_parameters() -> None:
    slow = tbf_params(parse_rate("10mbit"))
    assert slow.burst_bytes == 2 * 1514  # 1 ms of 10 Mbit/s is below two frames
    assert slow.limit_bytes == 2 * 1514 + 25_000  # 20 ms of queue
    fast = tbf_params(parse_rate("1gbit"), queue_ms=10)
    assert fast.burst_bytes == 125_000 and fast.limit_bytes == 125_000 + 1_250_000
    with pytest.raises(ValueError):
        tbf_params(10**6, queue_ms=0)


def test_bad_lab_arguments() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        LinkLab(2, "10mbit", 1.0)
    with pytest.raises(ValueError, match="2 loss values for 3 peers"):
        LinkLab(3, "10mbit", [0.1, 0.2])
    with pytest.raises(ValueError, match="private IPv4"):
        LinkLab(2, "10mbit", subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="room for 2 peers"):
        LinkLab(3, "10mbit", subnet="10.77.0.0/30")
    with pytest.raises(ValueError, match="link rate"):
        LinkLab(2, "lots")


def test_not_root_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(links_mod.os, "geteuid", lambda: 1000)
    lab = LinkLab(2, "10mbit")
    with pytest.raises(LabError, match=r"^the link lab needs root: network namespaces, tc and nftables$"):
        lab.start()
    with pytest.raises(LabError, match="not up"):
        lab.counters(0)


def test_missing_ethtool_says_how_to_install(monkeypatch) -> None:
    real = links_mod.shutil.which
    monkeypatch.setattr(links_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(links_mod.shutil, "which", lambda name: None if name == "ethtool" else real(name))
    with pytest.raises(LabError, match="needs ethtool .*apt-get install -y ethtool"):
        LinkLab(2, "10mbit").start()


# ---- root: real labs ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lab2():
    """One 2-peer lab at 10 Mbit/s for the tests that measure; each sets the loss it needs."""
    if NOT_ROOT:
        pytest.skip("the link lab needs root: network namespaces, tc and nftables")
    with LinkLab(2, "10mbit") as lab:
        yield lab


def _blast(lab: LinkLab, src: int, dst: int, *, rate: str, seconds: float = 30.0, size: int = 1472,
           count: int | None = None, port: int = 9000) -> tuple[dict, dict]:
    """Receiver in ``dst``, paced sender in ``src``; returns (sender's JSON, receiver's JSON)."""
    recv = lab.popen(dst, [sys.executable, "-m", "peerd.tools.lab.blast", "recv", "--port", str(port), "--idle", "0",
                           "--max-seconds", str(seconds + 60)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        argv = [sys.executable, "-m", "peerd.tools.lab.blast", "send", f"{lab.addr(dst)}:{port}", "--rate", rate,
                "--seconds", str(seconds), "--size", str(size)]
        if count is not None:
            argv += ["--count", str(count)]
        sent = lab.run(src, argv, capture_output=True, text=True, timeout=seconds + 60, check=True)
        time.sleep(0.2)  # the tbf queues (20 ms) drain; then the receiver counts what its socket holds and reports
        recv.send_signal(signal.SIGINT)
        got, _ = recv.communicate(timeout=30)
        return json.loads(sent.stdout), json.loads(got)
    finally:
        if recv.poll() is None:
            recv.kill()


@needs_lab
def test_udp_blast_is_shaped_to_the_link_rate(lab2: LinkLab) -> None:
    """Offered at twice the link rate for 2 s, the receiver gets the link's rate (less the headers), not more.

    Bounds: a token bucket passes at most rate x T + burst bytes in any interval T, so over 2 s at 10 Mbit/s
    (3028-byte burst) the goodput cannot exceed the ceiling by more than 0.2 %; 2 % above allows for the
    kernel's timestamps. Below, 12 %: the sender runs 2x ahead with a 20 ms queue, so the link idles only if the
    sender is descheduled for over 20 ms at a time, which a loaded 2-core machine does now and then."""
    lab2.set_loss(0.0)
    up0, down1 = lab2.qdisc_stats(0)["up"], lab2.qdisc_stats(1)["down"]
    sent, got = _blast(lab2, 0, 1, rate="20mbit", seconds=2.0)
    ceiling = lab2.rate_bps * 1472 / (1472 + HEADERS)
    assert 0.88 * ceiling <= got["goodput_bps"] <= 1.02 * ceiling, (got, ceiling)
    assert sent["offered_bps"] > 1.5 * lab2.rate_bps, sent  # the link, not the sender, was the limit
    # Every datagram is accounted for: what the uplink's tbf did not drop crossed the bridge, arrived and
    # was counted by nftables, and reached the socket (a stray ARP may sit in the tbf counts: +-2).
    c = lab2.counters(1)
    stats0, stats1 = lab2.qdisc_stats(0), lab2.qdisc_stats(1)
    tbf_drops = (stats0["up"].drops - up0.drops) + (stats1["down"].drops - down1.drops)
    assert got["socket_drops"] == 0 and c.dropped == 0, (got, c)
    assert got["packets"] == c.seen, (got, c)
    assert abs(sent["packets"] - tbf_drops - c.seen) <= 2, (sent, tbf_drops, c)
    assert tbf_drops > 0.3 * sent["packets"], (tbf_drops, sent)  # half the offer was over the rate


@needs_lab
def test_random_loss_matches_the_counters(lab2: LinkLab) -> None:
    """At loss 0.1 the nftables counters drop a binomial 10 % and the receiver gets exactly the rest.

    6000 small datagrams below the link rate (no tbf drops): the drop fraction's standard deviation is
    sqrt(0.1 x 0.9 / 6000) = 0.0039; the bounds are 5 of them."""
    lab2.set_loss(0.1)
    assert lab2.counters(1).seen == 0  # set_loss resets the counters
    sent, got = _blast(lab2, 0, 1, rate="6mbit", size=200, count=6000)
    c = lab2.counters(1)
    assert sent["packets"] == 6000, sent
    assert abs(c.seen - 6000) <= 2, c  # nothing lost on the way but what nftables dropped
    sd = math.sqrt(0.1 * 0.9 / c.seen)
    assert abs(c.drop_fraction - 0.1) <= 5 * sd, c
    assert got["socket_drops"] == 0, got
    assert got["packets"] == c.delivered, (got, c)
    # The loss is on arrival at peer 1; peer 0 received (almost) nothing.
    assert lab2.counters(0).seen < 10, lab2.counters(0)
    lab2.set_loss([0.0, 0.0])
    assert lab2.loss == [0.0, 0.0]


@needs_lab
def test_daemons_find_each_other_across_the_bridge(lab2: LinkLab, tmp_path) -> None:
    """Two real `peerd join` in the lab: node 1 bootstraps from node 0's lab address; the DHT works across."""
    lab2.set_loss(0.0)
    with LocalSwarm(str(tmp_path / "s"), lab=lab2, extra_args=("--log-level", "warning")) as swarm:
        nodes = swarm.start_many(2)
        assert [n.status["listen"].rsplit(":", 1)[0] for n in nodes] == [lab2.addr(0), lab2.addr(1)]
        assert nodes[0].netns == lab2.netns(0) and "--bootstrap" in swarm.command(1, bootstrap=nodes[0].listen)
        wait_until(lambda: all(n.call("status")["peers"] >= 1 for n in nodes), timeout=30, interval=0.5,
                   what="both daemons to see each other")
        peerd("dht", "put", "lab/hello", "across the bridge", "--ttl", "600", "--socket", nodes[0].socket)
        got = peerd_json("dht", "get", "lab/hello", "--socket", nodes[1].socket)
        assert [v["value"] for v in got["values"]] == ["across the bridge"]
        assert lab2.counters(0).seen > 0 and lab2.counters(1).seen > 0  # it went over the links
        # Metrics listen on the namespace's loopback: reachable from inside it, as entered() allows; the
        # thread is back in the host's namespace afterwards.
        home = os.readlink("/proc/thread-self/ns/net")
        with lab2.entered(0), urllib.request.urlopen(f"http://{nodes[0].status['metrics']}/metrics",
                                                     timeout=10) as r:
            assert os.readlink("/proc/thread-self/ns/net") != home
            assert b"peerd_dht_peers" in r.read()
        assert os.readlink("/proc/thread-self/ns/net") == home
        with pytest.raises(ValueError, match="only 2 peers"):
            swarm.command(2, bootstrap=None)


def _host_view() -> dict[str, set[str]]:
    """What the host's namespace holds: namespaces, links, nftables tables."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return {"netns": set(links_mod._list_netns()),
            "links": {line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line},
            "tables": {line.strip() for line in tables.splitlines() if line.strip()}}


def _ours(view: dict[str, set[str]], prefix: str) -> list[str]:
    """Anything in the host's view that a lab with ``prefix`` made (or could have made)."""
    own_link = re.compile(r"^(lab0|br0|v\d+|peerdlab.*)$")
    return ([ns for ns in view["netns"] if ns.startswith(prefix)]
            + [ln for ln in view["links"] if own_link.match(ln)]
            + [t for t in view["tables"] if links_mod.NFT_TABLE in t])


@needs_lab
def test_teardown_leaves_nothing_after_exit_and_exception() -> None:
    """Before/after the host's namespaces, links and tables: the lab adds none to the host's namespace, and
    after a normal exit or an exception in the block none of its namespaces (and their veths, bridge,
    qdiscs and tables) remain; processes started in it, tracked or not, are ended."""
    before = _host_view()
    with LinkLab(3, "50mbit", 0.05) as lab:
        during = _host_view()
        assert {lab.netns(i) for i in range(3)} | {lab.bridge_ns} <= during["netns"]
        # Nothing of the lab's in the host's own namespace: no link, no table.
        assert not _ours({"netns": set(), "links": during["links"] - before["links"],
                          "tables": during["tables"] - before["tables"]}, lab.prefix)
        tracked = lab.popen(0, ["sleep", "60"])
        untracked = subprocess.Popen([*lab.exec_prefix(1), "sleep", "60"])
        prefix = lab.prefix
    assert tracked.poll() is not None
    assert untracked.wait(5) is not None
    assert not _ours(_host_view(), prefix)

    with pytest.raises(RuntimeError, match="boom"), LinkLab(2, "10mbit") as lab:
        prefix = lab.prefix
        raise RuntimeError("boom")
    assert not _ours(_host_view(), prefix)
    after = _host_view()
    assert not _ours({k: after[k] - before[k] for k in after}, "peerdlab-")


@needs_lab
@pytest.mark.parametrize(("how", "rc"), [("sigterm", 128 + signal.SIGTERM), ("sigint", 130), ("error", 1)])
def test_teardown_in_a_child_on_signals_and_errors(how: str, rc: int) -> None:
    """A child process holding a lab (python -m peerd.tools.lab.links hold) is sent SIGTERM or Ctrl-C (SIGINT), or
    fails: it exits with the signal's code and its namespaces are gone."""
    argv = [sys.executable, "-m", "peerd.tools.lab.links", "hold", "--peers", "2", "--rate", "10mbit", "--loss", "0.1"]
    if how == "error":
        argv += ["--fail-after", "0.5"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert set(info["namespaces"]) | {info["bridge"]} <= set(links_mod._list_netns())
        if how != "error":
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == rc, err
        if how == "error":
            assert "failing on purpose" in err
        assert not _ours(_host_view(), info["prefix"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_lab
def test_sweep_removes_what_a_killed_run_left() -> None:
    """SIGKILL cannot be handled: the namespaces stay, and sweep_stale (only names of dead pids) removes them."""
    info = killed_lab("peerd.tools.lab.links", "--peers", "1")
    assert info["bridge"] in links_mod._list_netns()
    with LinkLab(1, "10mbit") as alive:  # a live run's namespaces are never swept
        swept = links_mod.sweep_stale()
        assert alive.netns(0) in links_mod._list_netns()
    assert {info["bridge"], *info["namespaces"]} <= set(swept)
    assert not _ours(_host_view(), info["prefix"])
