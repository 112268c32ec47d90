"""What the kernel's NAT does in the NAT lab (peerd/tools/lab/nat.py), pinned with raw UDP: no peerd involved.

The protocol side (observed addresses, hole punching, relays) relies on exactly these behaviours; if a kernel or
a lab change moves one, these fail first and say which. Small Python scripts run inside the lab's namespaces:
``echo`` (a public STUN-like server that answers each datagram with the source address it saw), ``probe`` (send
to servers, read what they saw, then listen and report every datagram that still arrives) and ``punch`` (send
to a peer's public address every 20 ms and report what came back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from peerd.tools.lab import links as links_mod
from peerd.tools.lab.nat import SYMMETRIC_PORTS, NatLab

from .support.processes import killed_lab

NOT_ROOT = os.geteuid() != 0
pytestmark = pytest.mark.skipif(NOT_ROOT, reason="the NAT lab needs root: network namespaces and nftables")

UDP_TOOL = r'''
import json, socket, sys, time
mode, args = sys.argv[1], sys.argv[2:]
def addr(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)
def sock(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    return s
def arrivals(s, seconds):
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            got = s.recvfrom(2048)
        except socket.timeout:
            break
        yield got
def drain(s, seconds, into):
    for data, src in arrivals(s, seconds):
        into.append([f"{src[0]}:{src[1]}", data.decode()])
if mode == "echo":  # echo PORT SECONDS: answer each datagram with the source address seen
    s = sock(int(args[0]))
    print("ready", flush=True)
    for data, src in arrivals(s, float(args[1])):
        s.sendto(f"{src[0]}:{src[1]}".encode(), src)
elif mode == "probe":  # probe PORT LISTEN_S DEST...: what each DEST saw, then whatever else arrives
    s = sock(int(args[0]))
    seen = {}
    for dest in args[2:]:
        for _ in range(20):
            s.sendto(b"probe", addr(dest))
            s.settimeout(0.25)
            try:
                data, src = s.recvfrom(2048)
            except socket.timeout:
                continue
            seen[f"{src[0]}:{src[1]}"] = data.decode()
            break
    print(json.dumps(seen), flush=True)
    got = []
    drain(s, float(args[1]), got)
    print(json.dumps(got), flush=True)
elif mode == "send":  # send FROM_PORT DEST PAYLOAD COUNT
    s = sock(int(args[0]))
    for _ in range(int(args[3])):
        s.sendto(args[2].encode(), addr(args[1]))
        time.sleep(0.01)
elif mode == "punch":  # punch PORT PEER SECONDS: send to PEER every 20 ms, report what arrived from anywhere
    s = sock(int(args[0]))
    peer, end, got = addr(args[1]), time.monotonic() + float(args[2]), []
    print("ready", flush=True)
    while time.monotonic() < end:
        s.sendto(b"punch", peer)
        drain(s, 0.02, got)
    drain(s, 0.3, got)
    print(json.dumps(got), flush=True)
'''


def tool(lab: NatLab, peer: int, *args: object) -> subprocess.Popen:
    return lab.popen(peer, [sys.executable, "-c", UDP_TOOL, *map(str, args)], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 30) -> list:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip() and line.strip() != "ready"]


# peers: 0-2 public, 3-4 cone homes, 5-6 symmetric homes
KINDS = ["public", "public", "public", "cone", "cone", "symmetric", "symmetric"]
P0, P1, P2, C3, C4, S5, S6 = range(7)


@pytest.fixture(scope="module")
def lab():
    with NatLab(KINDS) as lab:
        yield lab


@pytest.fixture
def servers(lab: NatLab):
    """STUN-like echo servers on P0 and P1, port 7000, for 20 s."""
    procs = [tool(lab, p, "echo", 7000, 20) for p in (P0, P1)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    yield [f"{lab.addr(p)}:7000" for p in (P0, P1)]
    for p in procs:
        p.kill()
        p.wait()


def test_lab_addresses(lab: NatLab) -> None:
    assert [lab.addr(i) for i in (P0, C3, S5)] == ["203.0.113.10", "10.88.3.2", "10.88.5.2"]
    assert [lab.public_addr(i) for i in (P0, C3, S5)] == ["203.0.113.10", "203.0.113.103", "203.0.113.105"]
    # A home is not reachable at its private address from the public segment (no route), only through NAT.
    ping = lab.run(P0, ["python3", "-c", "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                        "s.sendto(b'x', ('10.88.3.2', 9))"], capture_output=True, text=True)
    assert ping.returncode != 0 and "unreachable" in ping.stderr.lower(), ping.stderr


def test_cone_keeps_the_port_for_every_destination_and_filters_by_address_and_port(lab: NatLab, servers) -> None:
    """From a cone home, both public servers see the same mapped address: the router's WAN and the source port.

    Afterwards only the exact address:port the home sent to gets in: the same server from another port, and a
    third public address, are dropped by the router (its unsolicited counter goes up by what they sent)."""
    probe = tool(lab, C3, "probe", 40001, 2.0, *servers)
    seen = json.loads(probe.stdout.readline())
    assert seen == {s: f"{lab.public_addr(C3)}:40001" for s in servers}, seen
    drops0 = lab.unsolicited_drops(C3)
    target = f"{lab.public_addr(C3)}:40001"
    for peer, port, payload in ((P2, 7000, "third address"), (P0, 7001, "same address, other port")):
        lab.run(peer, [sys.executable, "-c", UDP_TOOL, "send", str(port), target, payload, "3"], check=True)
    got = finish(probe)[-1]
    assert got == [], got
    assert lab.unsolicited_drops(C3) - drops0 == 6


def test_cone_mapping_answers_its_destination(lab: NatLab) -> None:
    """The positive control of the filter: a public peer the home sent to can send again (not only reply)."""
    echo = tool(lab, P2, "punch", 7100, f"{lab.public_addr(C3)}:40002", 1.5)  # P2 sends to the home's port
    assert echo.stdout.readline().strip() == "ready"
    probe = tool(lab, C3, "probe", 40002, 1.0, f"{lab.addr(P2)}:7100")
    finish(probe)
    got = finish(echo)[-1]
    assert any(src == f"{lab.public_addr(C3)}:40002" for src, _ in got), got


def test_symmetric_maps_each_destination_to_its_own_port(lab: NatLab, servers) -> None:
    probe = tool(lab, S5, "probe", 40001, 0.1, *servers)
    seen = finish(probe)[0]
    assert set(seen) == set(servers), seen
    hosts = {v.rsplit(":", 1)[0] for v in seen.values()}
    ports = [int(v.rsplit(":", 1)[1]) for v in seen.values()]
    assert hosts == {lab.public_addr(S5)}
    assert len(set(ports)) == 2, seen
    assert all(SYMMETRIC_PORTS[0] <= p <= SYMMETRIC_PORTS[1] for p in ports), seen


def _punch(lab: NatLab, a: int, b: int, port: int, *, stagger: float = 0.0,
           targets: tuple[str, str] | None = None) -> tuple[list, list]:
    """a and b send to each other's public address (or ``targets``) from ``port`` at once (b ``stagger`` s later)."""
    ta, tb = targets or (f"{lab.public_addr(b)}:{port}", f"{lab.public_addr(a)}:{port}")
    pa = tool(lab, a, "punch", port, ta, 3.0)  # long enough to overlap b's on a loaded machine
    assert pa.stdout.readline().strip() == "ready"
    time.sleep(stagger)
    pb = tool(lab, b, "punch", port, tb, 3.0)
    return finish(pa)[-1], finish(pb)[-1]


@pytest.mark.parametrize("stagger", [0.0, 0.5])
def test_simultaneous_open_between_two_cone_homes_gets_through(lab: NatLab, stagger: float) -> None:
    """Both send to the other's WAN address and port; each gets the other's punches. With b half a second late,
    a's first punches hit b's router unsolicited and are dropped there (counted), then the path opens."""
    port = 41000 + int(stagger * 10)
    drops0 = lab.unsolicited_drops(C4)
    got_a, got_b = _punch(lab, C3, C4, port, stagger=stagger)
    assert got_a and {src for src, _ in got_a} == {f"{lab.public_addr(C4)}:{port}"}, got_a
    assert got_b and {src for src, _ in got_b} == {f"{lab.public_addr(C3)}:{port}"}, got_b
    if stagger:
        assert lab.unsolicited_drops(C4) - drops0 >= 5  # ~25 sent in the half second


def test_punch_between_symmetric_homes_fails(lab: NatLab, servers) -> None:
    """Each learns its mapped address from a public server and the other punches there: the mapping toward the
    peer is another random port, so nothing gets through either way (the routers drop every punch)."""
    mapped = {}
    for h in (S5, S6):
        mapped[h] = finish(tool(lab, h, "probe", 42000, 0.1, servers[0]))[0][servers[0]]
    drops0 = lab.unsolicited_drops(S5) + lab.unsolicited_drops(S6)
    got_a, got_b = _punch(lab, S5, S6, 42000, targets=(mapped[S6], mapped[S5]))
    assert got_a == [] and got_b == [], (got_a, got_b)
    assert lab.unsolicited_drops(S5) + lab.unsolicited_drops(S6) - drops0 >= 40  # ~300 sent


def test_punch_between_cone_and_symmetric_homes_fails(lab: NatLab, servers) -> None:
    """A cone home's port is predictable, but the symmetric side reaches it from a new port, which the cone's
    port-restricted filter drops; and the cone side's punches go to the port the server saw, which is not the
    one the symmetric router opened toward it. Such pairs need a relay."""
    sym = finish(tool(lab, S5, "probe", 43000, 0.1, servers[0]))[0][servers[0]]
    got_c, got_s = _punch(lab, C3, S5, 43000, targets=(sym, f"{lab.public_addr(C3)}:43000"))
    assert got_c == [] and got_s == [], (got_c, got_s)


def test_nat_lab_leaves_nothing_behind() -> None:
    """A NAT lab held by a child process, then SIGTERM: its peers, routers and bridge are gone."""
    proc = subprocess.Popen([sys.executable, "-m", "peerd.tools.lab.nat", "hold", "--kinds", "public,cone,symmetric"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        names = {info["bridge"], *info["namespaces"], *info["routers"]}
        assert len(names) == 6 and names <= set(links_mod._list_netns())
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, err
        assert not names & set(links_mod._list_netns())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sweep_removes_what_a_killed_nat_lab_left() -> None:
    """SIGKILL leaves the namespaces (routers included); sweep_stale removes them."""
    info = killed_lab("peerd.tools.lab.nat", "--kinds", "cone,public")
    names = {info["bridge"], *info["namespaces"], *info["routers"]}
    assert names <= set(links_mod._list_netns())
    assert names <= set(links_mod.sweep_stale())
    assert not names & set(links_mod._list_netns())


def test_shaped_nat_lab_has_a_token_bucket_each_way_on_every_peer() -> None:
    """With a rate, each peer's own veth is shaped both ways: a home's toward its router, a public peer's toward
    the bridge; what a home sends crosses its uplink bucket (then the router's NAT)."""
    with NatLab(["public", "cone"], "10mbit") as lab:
        assert lab.describe()["link_rate"] == "10mbit"
        before = {i: lab.qdisc_stats(i) for i in (0, 1)}
        finish(tool(lab, 1, "probe", 40000, 0.1, f"{lab.addr(0)}:9"))  # nothing listens: 20 tries, no answer
        after = {i: lab.qdisc_stats(i) for i in (0, 1)}
        assert after[1]["up"].packets - before[1]["up"].packets >= 20, after  # the home's uplink
        assert after[0]["down"].packets - before[0]["down"].packets >= 20, after  # the public peer's downlink
        # peer 0 answers with ICMP port unreachable (rate-limited by its kernel): back through both buckets
        assert after[0]["up"].packets > before[0]["up"].packets, after
        assert after[1]["down"].packets > before[1]["down"].packets, after
