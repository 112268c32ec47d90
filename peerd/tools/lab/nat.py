"""The NAT lab: public peers on a TEST-NET segment, home peers each behind a router namespace that masquerades.

Volunteers sit behind home routers; the lab gives the kernel's own NAT to test against, so the protocol side
(observed addresses, hole punching, relays) is proven on what Linux really does, not on a model of it.

- the public segment: a bridge namespace (``br0``) on 203.0.113.0/24 (TEST-NET-3, never routed anywhere).
  Public peer i is on it directly at 203.0.113.(10+i); home peer i's router has its WAN there at
  203.0.113.(100+i).
- home peer i: its own namespace with ``lab0`` at 10.88.i.2/24 and a default route to its router's LAN end
  (10.88.i.1). The router namespace forwards (``net.ipv4.ip_forward=1``) and masquerades on its WAN veth:

  - ``cone``: ``masquerade``. Linux keeps the source port when it is free, so one socket has one mapped port for
    every destination; replies are let in only from the exact address and port a mapping was made toward
    (conntrack matches the whole 5-tuple): a port-restricted cone.
  - ``symmetric``: ``meta l4proto udp masquerade to :20000-60000 random``: every new destination gets a new
    random port, so the port a third party saw predicts nothing (other protocols: plain masquerade).

- each router also drops what arrives on its WAN unsolicited (``ct state new``, input and forward), as a home
  router's firewall does, and counts it (:meth:`NatLab.unsolicited_drops`). This matters for hole punching:
  without it a punch that arrives before the local side has sent reaches the router's own input and leaves a
  conntrack entry there, and the local side's outgoing punch then collides with that entry and loses its port
  (masquerade picks another), and the router answers with ICMP port unreachable. Without it, two cone homes
  punching each other get nothing through, simultaneous or half a second apart.
- ``rate`` (optional): each peer's ``lab0`` is shaped at RATE both ways as in the link lab (a home's access link is
  the veth to its router); ``loss`` drops on arrival at the peer, counted as there.

Root only; names share the link lab's ``peerdlab-<pid>-<random>`` prefix, so teardown (exit, exception, SIGINT,
SIGTERM) and :func:`peerd.tools.lab.links.sweep_stale` cover it. No delay: there is no netem here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .links import BRIDGE_IF, LabError, NetnsLab, _run, format_rate, hold

KINDS = ("public", "cone", "symmetric")
PUBLIC_NET = "203.0.113.0/24"  # TEST-NET-3 (RFC 5737)
PUBLIC_PREFIXLEN = 24
MAX_PEERS = 80  # public peers at .10-.89, routers at .100-.179
ROUTER_LAN_IF = "lan0"  # the router's end of its home peer's veth
ROUTER_WAN_IF = "wan0"  # the router's veth to the public bridge
NAT_TABLE = "peerd_nat"  # ip family, in each router
FW_TABLE = "peerd_fw"  # inet family, in each router
SYMMETRIC_PORTS = (20000, 60000)
ROOT_ERROR = "the NAT lab needs root: network namespaces and nftables (and tc with a link rate)"


def public_addr_of(index: int, kind: str) -> str:
    """Where the public segment sees peer ``index``: its own address if public, else its router's WAN."""
    return f"203.0.113.{(10 if kind == 'public' else 100) + index}"


def nat_rules(kind: str) -> str:
    """The router's nftables script for ``kind`` (cone or symmetric): NAT and the firewall, with counters."""
    if kind == "cone":
        post = f'    oifname "{ROUTER_WAN_IF}" masquerade\n'
    elif kind == "symmetric":
        lo, hi = SYMMETRIC_PORTS
        post = (f'    oifname "{ROUTER_WAN_IF}" meta l4proto udp masquerade to :{lo}-{hi} random\n'
                f'    oifname "{ROUTER_WAN_IF}" masquerade\n')
    else:
        raise ValueError(f"{kind!r}: a router is cone or symmetric")
    return (
        f"table ip {NAT_TABLE} {{\n"
        "  chain post {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f"{post}"
        "  }\n"
        "}\n"
        f"table inet {FW_TABLE} {{\n"
        "  counter unsolicited { }\n"
        "  chain input {\n"
        "    type filter hook input priority 0; policy accept;\n"
        f'    iifname "{ROUTER_WAN_IF}" ct state new counter name "unsolicited" drop\n'
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority 0; policy accept;\n"
        f'    iifname "{ROUTER_WAN_IF}" ct state new counter name "unsolicited" drop\n'
        "  }\n"
        "}\n")


class NatLab(NetnsLab):
    """One peer per entry of ``kinds`` (``public``, ``cone``, ``symmetric``); homes each behind their own router.

    ``addr(i)`` is the address peer i binds (private for a home), ``public_addr(i)`` where the public segment
    sees it. Use as a context manager; processes, counters and teardown as in :class:`peerd.tools.lab.LinkLab`."""

    what = "NAT lab"
    root_error = ROOT_ERROR

    def __init__(self, kinds: Sequence[str], rate: str | int | None = None, loss: float | Sequence[float] = 0.0,
                 *, mtu: int = 1500, queue_ms: float = 20.0) -> None:
        kinds = list(kinds)
        for k in kinds:
            if k not in KINDS:
                raise ValueError(f"{k!r}: a NAT lab peer is one of {', '.join(KINDS)}")
        if len(kinds) > MAX_PEERS:
            raise ValueError(f"a NAT lab has room for {MAX_PEERS} peers, not {len(kinds)}")
        super().__init__(len(kinds), rate, loss, mtu=mtu, queue_ms=queue_ms)
        self.kinds = kinds
        self.bridge_ns = f"{self.prefix}-br"
        self._router_ns = {i: f"{self.prefix}-r{i}" for i, k in enumerate(kinds) if k != "public"}

    # ---- names and addresses -------------------------------------------------------------------------------

    def kind(self, peer: int) -> str:
        return self.kinds[self._peer(peer)]

    def addr(self, peer: int) -> str:
        """The address peer ``peer`` binds: on the public segment, or 10.88.<peer>.2 in its home."""
        if self.kind(peer) == "public":
            return public_addr_of(peer, "public")
        return f"10.88.{peer}.2"

    def public_addr(self, peer: int) -> str:
        """Where the public segment sees peer ``peer``: its own address, or its router's WAN address."""
        return public_addr_of(self._peer(peer), self.kind(peer))

    def router_ns(self, peer: int) -> str:
        """Home peer ``peer``'s router namespace."""
        if self.kind(peer) == "public":
            raise LabError(f"peer {peer} is public: it has no router")
        return self._router_ns[peer]

    def router_prefix(self, peer: int) -> list[str]:
        """argv prefix that runs a command inside home peer ``peer``'s router (e.g. ``nft list ruleset``)."""
        return ["ip", "netns", "exec", self.router_ns(peer)]

    def _far_end(self, peer: int) -> tuple[str, str]:
        if self.kind(peer) == "public":
            return self.bridge_ns, f"v{peer}"
        return self.router_ns(peer), ROUTER_LAN_IF

    def describe(self) -> dict[str, Any]:
        """The lab's parameters, for a benchmark's JSON."""
        out: dict[str, Any] = {
            "nat": {"kinds": list(self.kinds), "public_net": PUBLIC_NET,
                    "cone": "masquerade (port-preserving; replies filtered by address and port)",
                    "symmetric": f"udp masquerade to :{SYMMETRIC_PORTS[0]}-{SYMMETRIC_PORTS[1]} random",
                    "firewall": "ct state new from the WAN dropped (input and forward)"},
            "peers": self.peers, "addresses": [self.addr(i) for i in range(self.peers)],
            "public_addresses": [self.public_addr(i) for i in range(self.peers)], "mtu": self.mtu,
            "delay": "none (no netem)"}
        if self.rate_bps is not None and self.tbf is not None:
            out.update(link_rate=format_rate(self.rate_bps), link_rate_bps=self.rate_bps,
                       link_loss=self.loss[0] if len(set(self.loss)) == 1 else self.loss,
                       tbf_burst_bytes=self.tbf.burst_bytes, tbf_limit_bytes=self.tbf.limit_bytes,
                       tbf_queue_ms=self.tbf.queue_ms)
        return out

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def __enter__(self) -> NatLab:
        self.start()
        return self

    def _build(self) -> None:
        self._add_bridge()
        for i, kind in enumerate(self.kinds):
            if kind == "public":
                self._add_netns(self.netns(i))
                self._peer_link(i, f"{self.addr(i)}/{PUBLIC_PREFIXLEN}", master=BRIDGE_IF)
            else:
                self._build_home(i, kind)

    def _build_home(self, i: int, kind: str) -> None:
        r = self.router_ns(i)
        self._add_netns(r)
        _run(["ip", "netns", "exec", r, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        _run(["ip", "-n", r, "link", "add", ROUTER_WAN_IF, "mtu", str(self.mtu), "type", "veth",
              "peer", "name", f"w{i}", "mtu", str(self.mtu), "netns", self.bridge_ns])
        _run(["ip", "-n", r, "addr", "add", f"{self.public_addr(i)}/{PUBLIC_PREFIXLEN}", "dev", ROUTER_WAN_IF])
        _run(["ip", "-n", self.bridge_ns, "link", "set", f"w{i}", "master", BRIDGE_IF])
        _run(["ip", "netns", "exec", r, "nft", "-f", "-"], input=nat_rules(kind))
        _run(["ip", "-n", self.bridge_ns, "link", "set", f"w{i}", "up"])
        _run(["ip", "-n", r, "link", "set", ROUTER_WAN_IF, "up"])
        self._add_netns(self.netns(i))
        self._peer_link(i, f"{self.addr(i)}/24", far_cidr=f"10.88.{i}.1/24")
        _run(["ip", "-n", self.netns(i), "route", "add", "default", "via", f"10.88.{i}.1"])

    # ---- the routers' counters ------------------------------------------------------------------------------

    def unsolicited_drops(self, peer: int) -> int:
        """Packets home peer ``peer``'s router dropped as unsolicited from the WAN (no mapping let them in)."""
        self._require_open()
        out = _run([*self.router_prefix(peer), "nft", "-j", "list", "counter", "inet", FW_TABLE, "unsolicited"])
        for item in json.loads(out).get("nftables", []):
            c = item.get("counter")
            if c and c.get("name") == "unsolicited":
                return int(c["packets"])
        raise LabError(f"peer {peer}: the router's unsolicited counter is missing: {out[:200]}")


__all__ = ["KINDS", "PUBLIC_NET", "NatLab", "nat_rules", "public_addr_of"]


def _main(argv: list[str] | None = None) -> int:
    """`python -m peerd.tools.lab.nat hold --kinds public,cone,symmetric`: hold a NAT lab up until Ctrl-C/SIGTERM."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m peerd.tools.lab.nat", description=_main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hold", help="build a NAT lab, print it as JSON, keep it up until SIGINT/SIGTERM")
    h.add_argument("--kinds", default="public,cone,symmetric", help="comma-separated: public, cone, symmetric")
    h.add_argument("--rate", default=None)
    h.add_argument("--fail-after", type=float, default=None, help="raise an error after this many seconds (tests)")
    args = p.parse_args(argv)
    return hold(lambda: NatLab(args.kinds.split(","), args.rate),
                lambda lab: {"routers": [lab.router_ns(i) for i in range(lab.peers) if lab.kind(i) != "public"]},
                args.fail_after)


if __name__ == "__main__":
    raise SystemExit(_main())
