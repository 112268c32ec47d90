"""End to end: 16 real daemons on 127.0.0.1 discover each other, share records, keep outsiders out,
and keep working after 4 of them are killed."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from peerd.tools.swarm import LocalSwarm
from peerd.wire.identity import write_swarm_key

from .support.processes import metric_value, peerd, peerd_json, scrape, wait_until

pytestmark = pytest.mark.e2e


def test_sixteen_daemons(swarm: LocalSwarm, tmp_path, capsys) -> None:
    nodes = swarm.start_many(16)
    last_ready = time.monotonic()

    def everyone_sees_everyone():
        counts = [n.call("status")["peers"] for n in nodes]
        return counts if min(counts) >= 15 else None

    counts = wait_until(everyone_sees_everyone, timeout=30, what="every daemon to have >= 15 peers")
    took = time.monotonic() - last_ready
    with capsys.disabled():
        print(f"\n[discovery] 16 daemons: every peers >= 15 {took:.1f} s after the last answered; {counts}")

    # The CLI, as a user runs it.
    status = peerd_json("status", "--socket", nodes[3].socket)
    assert status["peers"] >= 15 and len(status["peer_id"]) == 64 and status["listen"].startswith("127.0.0.1:")
    assert status["uptime_s"] > 0
    assert status["dataplane"] in ("native", "python")
    assert status["pacer"]["state"] in ("startup", "cycle") and status["pacer"]["rate"] > 0  # nothing averaged yet
    if os.environ.get("PEERD_REQUIRE_NATIVE") == "1":  # CI builds the extension and asks for it
        assert status["dataplane"] == "native"
    peerd("dht", "put", "run/alpha", "hello swarm", "--ttl", "600", "--socket", nodes[5].socket)
    for reader in nodes:
        got = peerd_json("dht", "get", "run/alpha", "--socket", reader.socket) if reader.index in (0, 9, 15) \
            else {"values": [{"value": v["value"].decode()} for v in reader.call("dht_get", key="run/alpha")["values"]]}
        assert [v["value"] for v in got["values"]] == ["hello swarm"], reader.index
    full = peerd_json("dht", "get", "run/alpha", "--socket", nodes[12].socket)
    assert full["key"] == "run/alpha"
    (value,) = full["values"]
    assert value["subkey"] == nodes[5].status["peer_id"] and value["expires_at"] > time.time() + 500

    # Early reads (dht/reads.py through the local API): the same value from fewer lookup RPCs than a full read,
    # which asks every one of the k closest nodes (all 15 others here).
    def lookup_rpcs(node) -> float:
        text = scrape(node.status["metrics"])
        return sum(metric_value(text, name, type=t) for name in ("peerd_rpc_seconds_count", "peerd_rpc_failures_total")
                   for t in ("find_value", "find_node"))

    # The counters also count the reader's own background lookups (a bucket refresh), which only add: of three
    # tries, one without such a lookup is enough.
    reader, writer_id = nodes[11], nodes[5].status["peer_id"]
    tries = []
    for _ in range(3):
        spent = {}
        for form, args in (("full", ()), ("agreed", ("--agreed", "2")), ("owner", ("--owner", writer_id))):
            before = lookup_rpcs(reader)
            got = peerd_json("dht", "get", "run/alpha", *args, "--socket", reader.socket)
            spent[form] = lookup_rpcs(reader) - before
            assert [v["value"] for v in got["values"]] == ["hello swarm"], form
        tries.append(spent)
        if spent["agreed"] < spent["full"] and spent["owner"] < spent["full"]:
            break
    with capsys.disabled():
        print(f"[early reads] lookup RPCs per get of run/alpha at node 11: {tries}")
    assert spent["agreed"] < spent["full"] and spent["owner"] < spent["full"], tries
    bad = peerd("dht", "get", "run/alpha", "--agreed", "0", "--socket", reader.socket, check=False)
    assert bad.returncode != 0 and "agreed must be" in bad.stderr
    bad = peerd("dht", "get", "run/alpha", "--owner", "xyz", "--socket", reader.socket, check=False)
    assert bad.returncode != 0 and "64 hex digits" in bad.stderr

    # A daemon with another swarm key stays up, learns nobody, and its datagrams are counted as auth drops.
    alien_key = str(tmp_path / "alien.key")
    write_swarm_key(alien_key)
    alien = swarm.start(key_file=alien_key)
    swarm.wait_ready(alien)
    auth_drops = wait_until(
        lambda: metric_value(scrape(nodes[0].status["metrics"]), "peerd_datagrams_dropped_total", reason="auth"),
        timeout=30, what="auth drops at the bootstrap node")
    assert auth_drops >= 1
    assert alien.alive() and alien.call("status")["peers"] == 0
    assert all(alien.status["peer_id"] not in str(n.call("dht_get", key="run/alpha")) for n in nodes[:2])

    # Kill 4 daemons with SIGKILL; puts and gets through the rest still succeed.
    rng = random.Random(4)
    victims = rng.sample(nodes[1:], 4)
    for v in victims:
        v.proc.send_signal(signal.SIGKILL)
        v.proc.wait()
    survivors = [n for n in nodes if n not in victims]
    peerd("dht", "put", "run/beta", "after the crash", "--socket", survivors[-1].socket, timeout=90)
    for reader in survivors[:6]:
        got = peerd_json("dht", "get", "run/beta", "--socket", reader.socket, timeout=90)
        assert [v["value"] for v in got["values"]] == ["after the crash"], reader.index
        old = peerd_json("dht", "get", "run/alpha", "--socket", reader.socket, timeout=90)
        assert [v["value"] for v in old["values"]] == ["hello swarm"], reader.index
    assert all(n.alive() for n in survivors) and alien.alive()


def test_sigterm_leaves_cleanly(swarm: LocalSwarm) -> None:
    a, b = swarm.start_many(2)
    wait_until(lambda: a.call("status")["peers"] == 1, timeout=20, interval=0.2, what="b to join")
    for node in (b, a):
        start = time.monotonic()
        node.proc.send_signal(signal.SIGTERM if node is b else signal.SIGINT)
        assert node.proc.wait(timeout=5) == 0
        assert time.monotonic() - start < 2.0
        assert not os.path.exists(node.socket)
