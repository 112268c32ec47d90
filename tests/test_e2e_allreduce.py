"""End to end: `peerd bench allreduce` runs real daemons; exact without loss, unbiased with it; and real
kernel packet loss (nftables in a network namespace) when root."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .support.processes import peerd

pytestmark = pytest.mark.e2e


def bench(*args: str, timeout: float = 300) -> dict:
    return json.loads(peerd("bench", "allreduce", *args, "--json", timeout=timeout).stdout)


def test_exact_without_loss() -> None:
    out = bench("--peers", "3", "--size", "60K", "--repeat", "2")
    assert out["max_abs_err"] < 1e-5
    assert out["received_fraction"] == 1.0
    assert out["peers"] == 3 and out["size"] == 60_000 and out["mtu"] == 1200 and out["loss"] == 0.0
    assert out["peerd_s"] > 0 and len(out["peerd_s_all"]) == 2
    assert out["kernel_drops"] >= 0
    # Each peer sends (n-1)/n of the vector out and its shard to n-1 peers: ~2 (n-1)/n * 240 KB + headers.
    assert 300_000 < out["bytes_sent_per_peer"] < 400_000


def test_plain_path_insecure_and_odd_mtu() -> None:
    out = bench("--peers", "2", "--size", "10001", "--repeat", "1", "--insecure", "--no-gso", "--mtu", "700")
    assert out["max_abs_err"] < 1e-5 and out["received_fraction"] == 1.0 and out["gso"] is False


def test_injected_loss_is_unbiased() -> None:
    out = bench("--peers", "3", "--size", "200K", "--repeat", "2", "--loss", "0.1")
    assert 0.85 < out["received_fraction"] < 0.95
    # the injector's drops are counted by name, and no pair of loopback members was relayed (a lost punch did
    # that: its data lost at the relay too, with nothing counted at the receiver)
    assert out["endpoint_drops"].get("injected", 0) > 0 and out["datagrams_relayed"] == 0
    # Ranges that did not arrive keep own values (rmse ~ sqrt(p) * spread), but nothing is biased.
    assert abs(out["bias"]) < 0.01
    assert 0.05 < out["rmse"] < 0.6


def test_bad_bench_arguments() -> None:
    for args, needle in ((["--peers", "1"], "at least 2"), (["--size", "lots"], "expected a count"),
                         (["--loss", "1.5"], "[0, 1)"), (["--delay", "2000"], "[0, 1000]"),
                         (["--delay", "10", "--baseline", "gloo"], "would not see it")):
        proc = peerd("bench", "allreduce", *args, check=False)
        assert proc.returncode == 2 and needle in proc.stderr


def _cannot(what: str, tools: tuple[str, ...], packages: str) -> str | None:
    """Why this machine cannot run a namespace test that uses ``tools`` (None: it can)."""
    if os.geteuid() != 0:
        return f"needs root ({what})"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (apt-get install {packages})"
    return None


@contextlib.contextmanager
def _namespace() -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """A fresh network namespace with its loopback up, removed afterwards (also on failure): yields what runs a
    command inside it."""
    ns = f"peerd-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        def inside(*cmd: str, **kw: Any) -> subprocess.CompletedProcess:
            return subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, **kw)

        inside("ip", "link", "set", "lo", "up")
        yield inside
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _can_netns() -> str | None:
    return _cannot("network namespaces and nftables", ("ip", "nft"), "iproute2 nftables")


@pytest.mark.skipif(_can_netns() is not None, reason=_can_netns() or "")
def test_real_kernel_packet_loss_in_a_namespace() -> None:
    """10 % of UDP datagrams dropped by the kernel (nftables), plain send path as DESIGN.md says."""
    with _namespace() as inside:
        inside("nft", "add table inet lab")
        inside("nft", "add chain inet lab in { type filter hook input priority 0 ; }")
        inside("nft", "add rule inet lab in meta l4proto udp numgen random mod 100 < 10 drop")
        proc = inside(sys.executable, "-m", "peerd", "bench", "allreduce", "--peers", "3", "--size", "200K",
                      "--repeat", "2", "--no-gso", "--json", capture_output=True, text=True, timeout=300)
        out = json.loads(proc.stdout)
        # The bench's no-loss fields: no injected loss, so the loss is the kernel's. Datagrams that came after their
        # phase ended (at its deadline, on a loaded machine) are dropped as ``late``, counted apart: twice in CI,
        # under a full suite, 0.826-0.827 received with 415 late (7 % of those sent), 0.90 together. The kernel's
        # 10 % is what was neither received nor late.
        why = {k: out.get(k) for k in ("received_fraction", "drops", "endpoint_drops", "kernel_drops",
                                       "deadline_phases", "datagrams_sent", "peerd_s_all", "pacer_rate_mb_s")}
        late = out["drops"].get("late", 0) / out["datagrams_sent"]
        assert 0.85 < out["received_fraction"] + late < 0.95, why
        assert late < 0.1, why
        assert out["max_abs_err"] > 0  # real loss: ranges kept own values
        counters = inside("nft", "list ruleset", capture_output=True, text=True).stdout
        assert "drop" in counters


def _can_tc() -> str | None:
    return _cannot("network namespaces and tc", ("ip", "tc"), "iproute2")


@pytest.mark.skipif(_can_tc() is not None, reason=_can_tc() or "")
def test_rate_limited_link_in_a_namespace() -> None:
    """A 200 Mbit/s token bucket on the namespace's loopback (`tc qdisc tbf`): senders starting far above it
    must find it from the receivers' REPORTs, so little is lost and the averages are close to exact."""
    with _namespace() as inside:
        inside("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "200mbit", "burst", "64kb",
               "latency", "20ms")
        proc = inside(sys.executable, "-m", "peerd", "bench", "allreduce", "--peers", "3", "--size", "2000000",
                      "--repeat", "4", "--no-gso", "--json", capture_output=True, text=True, timeout=400)
        out = json.loads(proc.stdout)
        # Measured 0.91-0.99 on a quiet 2-core machine, 0.88-0.92 with another benchmark running beside it,
        # once 0.82 with a whole test suite beside it (the old pacer: 0.82 and 3-20 s per average; without
        # pacing a sender 8x above the bucket loses most of what it sends). Most of what is lost goes in the
        # first ~0.3 s, before the senders' first decrease takes effect. This asserts what holds reliably.
        assert out["received_fraction"] >= 0.8, out
        # A range that was lost keeps the member's own value (max_abs_err is then the vectors' spread, ~5);
        # with few ranges lost the error over the whole vector stays small (10 % loss: rmse ~0.3; 20 %: ~0.35).
        assert out["rmse"] < 0.35 and abs(out["bias"]) < 0.01, out
        stats = inside("tc", "-s", "qdisc", "show", "dev", "lo", capture_output=True, text=True).stdout
        assert "tbf" in stats


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_torch(), reason="needs torch (pip install 'peerd[torch]')")
def test_compare_gloo_alternates_in_one_run() -> None:
    out = bench("--peers", "2", "--size", "50K", "--repeat", "2", "--compare-gloo")
    assert len(out["gloo_s_all"]) == len(out["peerd_s_all"]) == 2
    assert out["gloo_s"] > 0 and out["ratio"] == pytest.approx(out["peerd_s"] / out["gloo_s"])
    assert out["max_abs_err"] < 1e-5
    # p99 of two runs: interpolated near the slower one (meaningful only with --repeat >= 20)
    assert out["gloo_s"] <= out["gloo_p99_s"] <= max(out["gloo_s_all"]) + 1e-6, out
    assert out["peerd_s"] <= out["peerd_p99_s"] <= max(out["peerd_s_all"]) + 1e-6, out
    assert out["excess_loss"] == 0.0 and "bus_fraction" not in out, out  # no loss, no lab: no link bound
    # CPU per peer and average on both sides, and the kernel's part of each (the same bytes cross the kernel)
    assert 0 <= out["sys_s_per_peer"] <= out["cpu_s_per_peer"] and out["cpu_s_per_peer"] > 0, out
    # ... and per average, in order: their mean is the mean over every average
    assert len(out["cpu_s_per_peer_all"]) == 2 and min(out["cpu_s_per_peer_all"]) > 0, out
    assert sum(out["cpu_s_per_peer_all"]) / 2 == pytest.approx(out["cpu_s_per_peer"], rel=1e-3), out
    assert 0 <= out["gloo_sys_s_per_peer"] <= out["gloo_cpu_s_per_peer"] and out["gloo_cpu_s_per_peer"] > 0, out


def test_dht_keeps_answering_during_a_100mb_average(swarm, capsys) -> None:
    """The event loop is never blocked for long: control traffic flows while a 100 MB average runs."""
    import threading
    import time

    nodes = swarm.start_many(3)
    members = [[n.status["peer_id"], *n.status["listen"].rsplit(":", 1)] for n in nodes]
    members = [[pid, host, int(port)] for pid, host, port in members]
    size = 25_000_000
    for i, n in enumerate(nodes):
        n.call("bench_prepare", timeout=120, group_id=77, members=members, index=i, seed=i, size=size, weight=1.0)
    replies: dict[int, dict] = {}

    def run(i: int) -> None:
        replies[i] = nodes[i].call("bench_run", timeout=300, group_id=77)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    latencies = []
    while any(t.is_alive() for t in threads):
        start = time.monotonic()
        nodes[0].call("dht_put", timeout=30, key="during", value=str(len(latencies)), ttl=60)
        assert nodes[1].call("dht_get", timeout=30, key="during")["values"]
        latencies.append(time.monotonic() - start)
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert len(replies) == 3 and all(r["datagrams_received"] == r["datagrams_expected"] for r in replies.values())
    assert latencies, "the average finished before a single DHT round trip"
    with capsys.disabled():
        print(f"\n[responsiveness] {len(latencies)} put+get during the average: "
              f"median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


@pytest.mark.skipif(os.geteuid() != 0, reason="the link lab needs root (network namespaces, tc, nftables)")
def test_bench_on_lab_links_reports_the_link() -> None:
    """`--link`/`--link-loss`: every daemon in its own namespace on a shaped link whose input drops 10 %; the JSON
    carries the lab's parameters and what its nftables counters saw, and peerd receives about what the link let
    through (the pacer's own overrun is issue 16's to remove: bounded loosely here)."""
    out = bench("--peers", "3", "--size", "200K", "--repeat", "2", "--link", "100mbit", "--link-loss", "0.1")
    assert out["link_rate"] == "100mbit" and out["link_loss"] == 0.1, out
    assert 0.07 < out["link_drop_fraction"] < 0.13 and out["link_packets_seen"] > 1000, out
    assert 0.6 < out["received_fraction"] < 0.95, out
    assert 0 < out["link_utilization"] <= 1.0, out
    # bus_fraction: 2 (N-1)/N x 4S bytes over the median time and the link's 12.5 MB/s
    assert out["bus_fraction"] == pytest.approx(2 * 2 / 3 * 4 * 200_000 / out["peerd_s"] / 12.5e6), out
    assert 0 < out["bus_fraction"] <= 1.0, out
    assert out["excess_loss"] == pytest.approx(max(0.0, 1 - out["received_fraction"] - 0.1)), out
    assert out["peerd_p99_s"] >= out["peerd_s"], out
    bad = peerd("bench", "allreduce", "--mtu", "1500", "--link", "100mbit", check=False)
    assert bad.returncode == 2 and "fragmentation" in bad.stderr


def test_compressed_averages_send_their_share_of_fp32s_bytes() -> None:
    """`--compression`: real daemons average in each codec; the bytes on the wire against fp32's for the same size
    (issue 17's ratios at 25M elements: fp16/bf16 <= 0.51, int8 <= 0.27, int4 <= 0.145) and the error each
    codec's two roundings allow (the vectors are N(0, 1)-like; int4 has 16 levels per group of 128)."""
    limits = {"fp16": (0.51, 0.002), "int8": (0.27, 0.02), "int4": (0.145, 0.25)}
    for codec, (ratio, rmse) in limits.items():
        out = bench("--peers", "3", "--size", "300K", "--repeat", "1", "--compression", codec)
        assert out["compression"] == codec and out["received_fraction"] == 1.0, out
        assert out["wire_ratio"] <= ratio and out["rmse"] < rmse, out
    bad = peerd("bench", "allreduce", "--compression", "int8", "--quant-group", "0", check=False)
    assert bad.returncode == 2 and "--quant-group" in bad.stderr
