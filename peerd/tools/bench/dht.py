"""`peerd bench dht`: N real daemons (one process each, bootstrapped from node 0) put and get K keys.

Each key is written by one daemon and read by another through the local API, the way a trainer or
`peerd dht` would: the times include the local socket. ``rpcs_per_get`` is read from the reader's
Prometheus counters (FIND_VALUE and FIND_NODE requests answered or failed, paging included).

``get_p50_ms`` is the local API's default read, the full one (every one of the r = 5 holders: what `peerd dht get`
does unless asked for less). The reads Moshpit and state sync use stop once 3 holders agree (``Agreed(3)``): the
same reader reads each key that way too, through the API (`peerd dht get --agreed 3`), reported apart as
``api_agreed`` (in a second pass, after every put and full read, so the full reads are timed as before). The
bench then joins the swarm itself as one more member (a DHT node in this process, over UDP like the daemons) and
reads every key both ways: ``member_full`` and ``member_agreed``.

A put returns once a majority of its r holders accepted the record (its other STOREs finish in the background):
``put_stored_min`` is the fewest replicas a put reported when it returned.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import trio

from ...dht import DhtService
from ...dht.reads import Agreed
from ...localsock.client import DaemonError, LocalClient
from ...metrics import Metrics
from ...transport.endpoint import Endpoint
from ...transport.udp import UdpSocket
from ...wire.identity import Identity, load_swarm_key
from ..swarm import LocalSwarm, Node
from .runner import run_bench


@dataclass
class DhtBenchConfig:
    peers: int = 32
    keys: int = 200
    seed: int = 0
    insecure: bool = False

    def check(self) -> None:
        if self.peers < 2:
            raise ValueError("--peers must be at least 2")
        if self.keys < 1:
            raise ValueError("--keys must be at least 1")


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _lookup_rpcs(node: Node) -> float:
    """FIND_VALUE + FIND_NODE requests this daemon sent so far (answered or failed)."""
    with urllib.request.urlopen(f"http://{node.status['metrics']}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("peerd_rpc_seconds_count", "peerd_rpc_failures_total")) and (
            'type="find_value"' in line or 'type="find_node"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _rss_mib(node: Node) -> float:
    try:
        with open(f"/proc/{node.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_ms(nodes: list[Node]) -> float:
    """CPU time (user + system) the daemons used so far: what an operation costs the whole swarm."""
    ticks = 0
    for node in nodes:
        try:
            with open(f"/proc/{node.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def _wait_tables(nodes: list[Node], want: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            counts = [n.call("status")["peers"] for n in nodes]
        except DaemonError:  # a busy socket refused a connection: ask again (a dead daemon fails below)
            counts = [0]
            if not all(n.alive() for n in nodes):
                raise
        if min(counts) >= want:
            return
        if time.monotonic() > deadline:
            raise DaemonError(f"routing tables not full after {timeout:.0f} s (want {want}): {sorted(counts)[:8]}...")
        time.sleep(0.05)


def _rpcs(metrics: Metrics) -> float:
    total = 0.0
    for metric in (metrics.rpc_seconds, metrics.rpc_failures):
        for family in metric.collect():
            for s in family.samples:
                if s.labels.get("type") in ("find_value", "find_node") and s.name.endswith(("_count", "_total")):
                    total += s.value
    return total


def _member_reads(cfg: DhtBenchConfig, bootstrap: str, secret: bytes | None, keys: list[tuple[str, str]]) -> dict:
    """Join the swarm as one more DHT node and read every key fully and with Agreed(3)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    metrics = Metrics()
    endpoint = Endpoint(UdpSocket(sock), Identity.generate(), secret, metrics)
    dht = DhtService(endpoint, metrics)
    host, port = bootstrap.rsplit(":", 1)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(endpoint.serve)
            await nursery.start(dht.run)
            await dht.bootstrap([(host, int(port))], timeout=30)
            await trio.sleep(1.0)
            forms = {"member_full": None, "member_agreed": Agreed(3)}
            times: dict[str, list[float]] = {name: [] for name in forms}
            rpcs: dict[str, list[float]] = {name: [] for name in forms}
            missing = dict.fromkeys(forms, 0)
            for i, (key, value) in enumerate(keys):
                for name in sorted(forms, reverse=i % 2 == 1):  # each form goes first on every other key
                    before = _rpcs(metrics)
                    t = time.perf_counter()
                    records = await dht.get(key.encode(), enough=forms[name])
                    times[name].append((time.perf_counter() - t) * 1000)
                    await trio.sleep(0.05)  # late answers to a read that ended early land before counting
                    rpcs[name].append(_rpcs(metrics) - before)
                    missing[name] += [r.value for r in records] != [value.encode()]
            for name in forms:
                out[name] = {"get_p50_ms": round(statistics.median(times[name]), 3),
                             "get_p99_ms": round(_pct(times[name], 0.99), 3),
                             "rpcs_per_get": round(statistics.mean(rpcs[name]), 2),
                             "gets_missing_value": missing[name]}
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        sock.close()
    return out


def run_dht_bench(cfg: DhtBenchConfig, *, quiet: bool = False) -> dict[str, Any]:
    cfg.check()
    rng = random.Random(cfg.seed)
    workdir = tempfile.mkdtemp(prefix="peerd-bench-dht-")
    swarm = LocalSwarm(os.path.join(workdir, "swarm"), insecure=cfg.insecure, metrics=True,
                       extra_args=("--log-level", "warning"))
    clients: list[LocalClient] = []
    try:
        _progress(f"starting {cfg.peers} daemons ...", quiet)
        nodes = swarm.start_many(cfg.peers)
        t0 = time.monotonic()  # every socket answers
        want = min(cfg.peers - 1, 20)
        _wait_tables(nodes, want)
        tables_full_s = time.monotonic() - t0
        _progress(f"every routing table holds {want}+ contacts after {tables_full_s:.2f} s", quiet)
        clients = [LocalClient(n.socket, timeout=30.0) for n in nodes]
        put_ms: list[float] = []
        get_ms: list[float] = []
        rpcs: list[float] = []
        agreed_ms: list[float] = []
        agreed_rpcs: list[float] = []
        agreed_missing = 0
        stored: list[int] = []
        readers: list[int] = []
        missing = 0
        written: list[tuple[str, str]] = []
        put_cpu = get_cpu = 0.0
        for i in range(cfg.keys):
            writer, reader = rng.sample(range(cfg.peers), 2)
            key, value = f"bench-dht/{cfg.seed}/{i}", f"v{i}-{rng.getrandbits(64):x}"
            cpu = _cpu_ms(nodes)
            t = time.perf_counter()
            put = clients[writer].call("dht_put", key=key, value=value, ttl=600)
            put_ms.append((time.perf_counter() - t) * 1000)
            put_cpu += _cpu_ms(nodes) - cpu
            stored.append(put["stored"])
            written.append((key, value))
            readers.append(reader)
            before = _lookup_rpcs(nodes[reader])
            cpu = _cpu_ms(nodes)
            t = time.perf_counter()
            reply = clients[reader].call("dht_get", key=key)
            get_ms.append((time.perf_counter() - t) * 1000)
            get_cpu += _cpu_ms(nodes) - cpu
            rpcs.append(_lookup_rpcs(nodes[reader]) - before)
            values = [v["value"] for v in reply["values"]]
            if values != [value.encode()] and values != [value]:
                missing += 1
        # the same readers again, each key read with agreed=3, after every full read (so neither warms the other)
        for reader, (key, value) in zip(readers, written, strict=True):
            before = _lookup_rpcs(nodes[reader])
            t = time.perf_counter()
            reply = clients[reader].call("dht_get", key=key, agreed=3)
            agreed_ms.append((time.perf_counter() - t) * 1000)
            time.sleep(0.05)  # late answers to a read that ended early land before counting
            agreed_rpcs.append(_lookup_rpcs(nodes[reader]) - before)
            values = [v["value"] for v in reply["values"]]
            if values != [value.encode()] and values != [value]:
                agreed_missing += 1
        rss = [_rss_mib(n) for n in nodes]
        _progress("reading every key again as a member of the swarm (full, then Agreed(3)) ...", quiet)
        secret = None if cfg.insecure else load_swarm_key(swarm.key_file)
        member = _member_reads(cfg, nodes[0].listen, secret, written)
        return {
            "peers": cfg.peers,
            "keys": cfg.keys,
            "sealed": not cfg.insecure,
            "put_p50_ms": round(statistics.median(put_ms), 3),
            "put_p99_ms": round(_pct(put_ms, 0.99), 3),
            "get_p50_ms": round(statistics.median(get_ms), 3),
            "get_p99_ms": round(_pct(get_ms, 0.99), 3),
            "rpcs_per_get": round(statistics.mean(rpcs), 2),
            "gets_missing_value": missing,
            "put_stored_min": min(stored),
            "api_agreed": {"get_p50_ms": round(statistics.median(agreed_ms), 3),
                           "get_p99_ms": round(_pct(agreed_ms, 0.99), 3),
                           "rpcs_per_get": round(statistics.mean(agreed_rpcs), 2),
                           "gets_missing_value": agreed_missing},
            "swarm_cpu_ms_per_put": round(put_cpu / cfg.keys, 2),  # every daemon's CPU, at clock-tick grain
            "swarm_cpu_ms_per_get": round(get_cpu / cfg.keys, 2),
            "tables_full_s": round(tables_full_s, 3),
            "rss_mib": {"median": round(statistics.median(rss), 1), "max": round(max(rss), 1)},
            **member,
            "load": os.getloadavg()[0],
        }
    finally:
        for c in clients:
            c.close()
        swarm.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def add_parser(bench: Any) -> None:
    """The `bench dht` sub-parser (registered by name in tools/cli_tools.py's BENCH_MODULES)."""
    b = bench.add_parser("dht", help="N daemons put and get K keys through the local API; latency and RPCs per get")
    b.add_argument("--peers", type=int, default=32, metavar="N", help="daemons (default 32)")
    b.add_argument("--keys", type=int, default=200, metavar="K", help="keys written and read (default 200)")
    b.add_argument("--seed", type=int, default=0, help="seed of writers, readers and values (default 0)")
    b.add_argument("--insecure", action="store_true", help="unsealed datagrams (default: a sealed swarm)")
    b.add_argument("--json", action="store_true", help="print JSON only (no progress lines)")


def cmd_bench_dht(args: Any, parser: Any) -> int:
    cfg = DhtBenchConfig(peers=args.peers, keys=args.keys, seed=args.seed, insecure=args.insecure)
    result = run_bench(cfg, parser, lambda say: run_dht_bench(cfg, quiet=args.json), errors=(DaemonError,))
    if isinstance(result, int):
        return result
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:>20}: {value}")
    missing = result["gets_missing_value"]
    missing += sum(result[f]["gets_missing_value"] for f in ("api_agreed", "member_full", "member_agreed"))
    return 0 if missing == 0 else 1
