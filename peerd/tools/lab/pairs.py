"""The link lab's per-pair counters: what each peer's stack sent to every other peer, and what of it arrived.

A per-peer view (``peerd status``) is checked against these: the lab counts in the kernel, apart from the daemons.
Each peer's nftables table (links.py) gets, for every other peer ``j``, three named counters of UDP only:

- ``tx_j``: what this peer's stack sent to ``j`` (output hook: before its upload queue, so a datagram its own tbf
  later drops for a full queue counts as sent and not delivered, as it does for the sender);
- ``rx_j``: what arrived from ``j`` on this peer's link (input hook, before the lab's random drop);
- ``ok_j``: what of that the random drop let through to this peer's stack.

So what peer ``a`` delivered to ``b`` is ``b``'s ``ok_a`` out of ``a``'s ``tx_b``, whatever dropped it on the way
(either tbf queue, or the random drop). Bytes are the IP packet's; a datagram's UDP payload is 28 bytes less. A GSO
send (one sendmsg of many datagrams) is still one packet at the output hook (it is cut into datagrams further down),
so ``tx`` packets undercount datagrams while its payload bytes stay exact: compare in bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

UDP_IP_OVERHEAD = 28  # IPv4 + UDP headers: an IP packet's bytes beyond its datagram's payload
KINDS = ("tx", "rx", "ok")


@dataclass(frozen=True)
class Count:
    """Packets and their IP bytes."""

    packets: int
    bytes: int

    @property
    def payload(self) -> int:
        """The UDP payload bytes (what a daemon counts as a datagram's size)."""
        return self.bytes - UDP_IP_OVERHEAD * self.packets

    def __sub__(self, other: Count) -> Count:
        return Count(self.packets - other.packets, self.bytes - other.bytes)


@dataclass(frozen=True)
class PairCounters:
    """One peer's counters about one other peer (see the module's docstring)."""

    sent: Count  # tx: its stack sent to the other
    arrived: Count  # rx: from the other, on its link, before the random drop
    delivered: Count  # ok: from the other, after it

    def __sub__(self, other: PairCounters) -> PairCounters:
        return PairCounters(self.sent - other.sent, self.arrived - other.arrived, self.delivered - other.delivered)


def pair_rules(me: int, addrs: Sequence[str], iface: str) -> tuple[str, str, str, str]:
    """nftables text for peer ``me`` of peers at ``addrs``: (counter declarations, input rules before the random
    drop, input rules after it, an output chain)."""
    others = [(j, a) for j, a in enumerate(addrs) if j != me]
    decls = "".join(f"  counter {kind}_{j} {{ }}\n" for j, _ in others for kind in KINDS)
    before = "".join(f'    iifname "{iface}" ip saddr {a} meta l4proto udp counter name "rx_{j}"\n' for j, a in others)
    after = "".join(f'    iifname "{iface}" ip saddr {a} meta l4proto udp counter name "ok_{j}"\n' for j, a in others)
    output = ("  chain output {\n    type filter hook output priority 0; policy accept;\n"
              + "".join(f'    oifname "{iface}" ip daddr {a} meta l4proto udp counter name "tx_{j}"\n'
                        for j, a in others)
              + "  }\n") if others else ""
    return decls, before, after, output


def parse_pairs(nft_json: str, table: str) -> dict[int, PairCounters]:
    """The per-pair counters in ``nft -j list counters`` output, by the other peer's index."""
    found: dict[tuple[str, int], Count] = {}
    for item in json.loads(nft_json).get("nftables", []):
        c = item.get("counter")
        if not c or c.get("table") != table:
            continue
        kind, _, index = str(c.get("name", "")).partition("_")
        if kind in KINDS and index.isdigit():
            found[(kind, int(index))] = Count(int(c["packets"]), int(c["bytes"]))
    others = sorted({j for _, j in found})
    return {j: PairCounters(found[("tx", j)], found[("rx", j)], found[("ok", j)]) for j in others
            if all((k, j) in found for k in KINDS)}


__all__ = ["Count", "PairCounters", "pair_rules", "parse_pairs"]
