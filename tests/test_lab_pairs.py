"""The link lab's per-pair counters and ICMP pinger, the parts that need no root: the nftables text, the parse of
`nft -j list counters`, and the echo request's checksum."""

from __future__ import annotations

import json
import struct

from peerd.tools.lab.links import NFT_TABLE, LinkLab
from peerd.tools.lab.pairs import Count, PairCounters, pair_rules, parse_pairs
from peerd.tools.lab.ping import checksum, echo_request

ADDRS = ["10.77.0.1", "10.77.0.2", "10.77.0.3"]


def test_each_peer_counts_what_it_sends_to_and_receives_from_every_other_peer() -> None:
    decls, before, after, output = pair_rules(1, ADDRS, "lab0")
    for j in (0, 2):
        assert all(f"counter {kind}_{j} {{ }}" in decls for kind in ("tx", "rx", "ok"))
        assert f'ip saddr {ADDRS[j]} meta l4proto udp counter name "rx_{j}"' in before
        assert f'ip saddr {ADDRS[j]} meta l4proto udp counter name "ok_{j}"' in after
        assert f'oifname "lab0" ip daddr {ADDRS[j]} meta l4proto udp counter name "tx_{j}"' in output
    assert "_1 " not in decls and ADDRS[1] not in before + after + output  # never about itself
    assert pair_rules(0, ADDRS[:1], "lab0") == ("", "", "", "")


def test_a_lab_with_pair_counters_counts_on_both_sides_of_its_random_drop() -> None:
    lab = LinkLab(3, "100mbit", 0.05, pair_counters=True)
    script = lab._nft_script(0, replace=False)
    assert script.index('counter name "rx_1"') < script.index("numgen random") < script.index('counter name "ok_1"')
    assert "hook output" in script and 'counter name "tx_2"' in script
    plain = LinkLab(3, "100mbit", 0.05)._nft_script(0, replace=False)
    assert "rx_1" not in plain and "hook output" not in plain


def _counter(name: str, packets: int, nbytes: int, table: str = NFT_TABLE) -> dict:
    return {"counter": {"family": "inet", "name": name, "table": table, "handle": 1, "packets": packets,
                        "bytes": nbytes}}


def test_the_counters_parse_by_the_other_peer_and_payload_leaves_out_the_headers() -> None:
    items = [{"metainfo": {"version": "1.1.1"}}, _counter("seen", 9, 9), _counter("dropped", 1, 1),
             _counter("tx_2", 10, 10 * 1228), _counter("rx_2", 20, 20 * 1228), _counter("ok_2", 19, 19 * 1228),
             _counter("tx_0", 1, 100), _counter("rx_0", 2, 200),  # ok_0 missing: peer 0 left out
             _counter("tx_5", 1, 1, table="another")]
    pairs = parse_pairs(json.dumps({"nftables": items}), NFT_TABLE)
    assert list(pairs) == [2]
    p = pairs[2]
    assert p == PairCounters(Count(10, 12280), Count(20, 24560), Count(19, 23332))
    assert p.sent.payload == 12000 and (p - p).delivered == Count(0, 0)


def test_an_echo_request_carries_a_valid_checksum() -> None:
    packet = echo_request(0x1234, 7)
    assert checksum(packet) == 0  # the checksum over a packet that carries it is zero
    kind, code, _, ident, seq = struct.unpack("!BBHHH", packet[:8])
    assert (kind, code, ident, seq) == (8, 0, 0x1234, 7)
    assert checksum(b"\x00\x01\xf2\x03\xf4\xf5\xf6\xf7") == 0x220D  # RFC 1071's example, complemented
