"""`peerd sim dht`: the DHT's real cores for many nodes over the in-memory network, at small N (seconds)."""

from __future__ import annotations

import json

import pytest

from peerd.cli import main
from peerd.tools.sim.dht import Config, DhtSim, simulate


def small(**kw) -> Config:
    base = dict(peers=150, churn=0.2, loss=0.05, lookups=120, seed=3, keys=20, duration=150.0, ttl=90.0)
    base.update(kw)
    return Config(**base)


def test_lossy_churning_swarm_finds_its_records() -> None:
    sim = DhtSim(small())
    r = sim.run()
    assert r["replaced"] == 30  # churn 0.2 of 150, each a kill and a join
    assert r["alive"] == 150
    assert sum(not n.alive for n in sim.nodes) == 30 and len(sim.nodes) == 180
    assert r["lookup_success"] >= 0.99, r
    assert 1 <= r["hops_p50"] <= 5 and r["hops_p50"] <= r["hops_p99"], r
    assert r["routing_table_fill"] >= 0.95, r
    assert 5 <= r["rpcs_per_lookup"] <= 80, r
    assert r["virtual_s"] >= 150 * 0.05 + 150.0  # build-up, then the churn phase
    assert r["datagrams_lost"] > 0 and r["retransmits"] > 0
    # the writers refreshed (every ttl/3): each key was put several times
    assert sim.puts >= 3 * r["keys"]


def dead_share(sim: DhtSim) -> float:
    dead = {n.core.node_id for n in sim.nodes if not n.alive}
    held = sum(c.node_id in dead for n in sim.alive for c in n.core.table.contacts())
    return held / sum(len(n.core.table) for n in sim.alive)


def test_bucket_refresh_clears_dead_nodes_from_the_tables() -> None:
    # without refresh a dead contact stays until somebody asks it something; with the daemon's refresh
    # (every stale bucket looked up every refresh * U(0.25, 0.5) s) the tables are nearly clean (over seeds 0-5,
    # 3 to 5.2 % of contacts dead with refresh, 14 to 15.5 % without)
    lazy, busy = (DhtSim(small(loss=0.0, peers=80, lookups=30, duration=100.0, refresh=refresh))
                  for refresh in (0.0, 30.0))
    assert lazy.run()["lookup_success"] == 1.0 and busy.run()["lookup_success"] == 1.0
    assert dead_share(busy) < 0.06 < 0.1 < dead_share(lazy), (dead_share(busy), dead_share(lazy))


def test_without_churn_or_loss_every_read_succeeds_and_nothing_is_retransmitted() -> None:
    r = simulate(small(churn=0.0, loss=0.0, lookups=60, peers=100))
    assert r["replaced"] == 0 and r["lookup_success"] == 1.0
    assert r["retransmits"] == 0 and r["datagrams_lost"] == 0
    assert r["routing_table_fill"] == 1.0


def test_early_reads_stop_sooner_than_full_reads() -> None:
    full = simulate(small(read="full", peers=100, lookups=50, duration=80.0))
    early = simulate(small(read="early", peers=100, lookups=50, duration=80.0))
    assert full["lookup_success"] >= 0.99 and early["lookup_success"] >= 0.99
    assert early["rpcs_per_lookup"] < full["rpcs_per_lookup"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["sim", "dht", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_same_seed_gives_byte_identical_json(capsys) -> None:
    args = ["--peers", "80", "--lookups", "40", "--keys", "10", "--duration", "60", "--ttl", "30", "--json"]
    code, first, err = run_cli(capsys, *args, "--seed", "5")
    assert code == 0 and "wall time" in err and "wall" not in first
    assert run_cli(capsys, *args, "--seed", "5")[1] == first
    assert run_cli(capsys, *args, "--seed", "6")[1] != first
    r = json.loads(first)
    for field in ("lookup_success", "hops_p50", "hops_p99", "rpcs_per_lookup", "routing_table_fill", "virtual_s"):
        assert field in r
    assert "null" in r["simulated"]["sealing"]


def test_text_output(capsys) -> None:
    code, out, err = run_cli(capsys, "--peers", "40", "--lookups", "10", "--keys", "5", "--duration", "20",
                             "--ttl", "9")
    assert code == 0
    assert "lookup success" in out and "hops p50" in out and "not simulated" in out and "null" in out
    assert "wall time" in err


@pytest.mark.parametrize(("args", "needle"), [
    (["--peers", "1"], "--peers: must be at least 2"),
    (["--peers", "ten"], "is not an integer"),
    (["--churn", "1.5"], "--churn: must be in [0, 1]"),
    (["--loss", "1"], "--loss: must be in [0, 1)"),
    (["--loss", "x"], "not a number"),
    (["--lookups", "0"], "--lookups: must be at least 1"),
    (["--seed", "-1"], "--seed: must be at least 0"),
    (["--duration", "inf"], "--duration: must be a finite number"),
    (["--ttl", "1"], "--ttl: must be a finite number of seconds >= 3"),
    (["--read", "some"], "invalid choice"),
])
def test_bad_values_are_parser_errors(capsys, args: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["sim", "dht", *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_every_option_has_help(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "dht", "--help"])
    out = capsys.readouterr().out
    for option in ("--peers", "--churn", "--loss", "--lookups", "--seed", "--keys", "--duration", "--ttl",
                   "--latency", "--jitter", "--read", "--refresh", "--join-refresh", "--json"):
        assert option in out
    assert "null sealer" in out
