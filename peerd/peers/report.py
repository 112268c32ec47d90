"""The per-peer view as JSON (``peerd status --json``'s ``peer_view``; the status page's ``peers``).

Fields of each peer (docs/status.md lists them too): ``peer`` (node id, hex), ``addr``, ``path`` (direct, punched,
relayed), ``via`` (the relay's node id when relayed), ``rtt_ms`` and ``rtt_p99_ms`` (requests answered on their
first transmission; null before one), ``rtt_samples``, ``loss_out`` and ``loss_in`` (fraction of averaging datagrams
lost to it and from it, from the REPORTs both ways; null before one), ``loss_out_counts`` and ``loss_in_counts``
(the datagrams behind them: ``expected`` and ``arrived``; the difference of two reads gives the loss between
them), ``send_bps``, ``recv_bps``,
``goodput_out_bps`` and ``goodput_in_bps`` (bytes per second over the last few seconds), ``sent_bytes`` and
``received_bytes`` (by kind: averaging, dht, state_sync, relay, other), ``verdict`` (reachable, unanswered, quiet),
``last_heard_s`` and ``unanswered``.
"""

from __future__ import annotations

from typing import Any

from .feed import SwarmView
from .table import PeerStatistics, TableStatistics


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def peer_json(p: PeerStatistics) -> dict[str, Any]:
    return {
        "peer": p.peer, "addr": p.addr, "path": p.path, "via": p.via,
        "rtt_ms": _r(None if p.rtt_s is None else p.rtt_s * 1e3),
        "rtt_p99_ms": _r(None if p.rtt_p99_s is None else p.rtt_p99_s * 1e3), "rtt_samples": p.rtt_samples,
        "loss_out": _r(p.loss_out, 4), "loss_in": _r(p.loss_in, 4),
        "loss_out_counts": {"expected": p.loss_out_counts[0], "arrived": p.loss_out_counts[1]},
        "loss_in_counts": {"expected": p.loss_in_counts[0], "arrived": p.loss_in_counts[1]},
        "send_bps": round(p.send_bps), "recv_bps": round(p.recv_bps), "rate_window_s": _r(p.rate_window_s, 2),
        "goodput_out_bps": round(p.goodput_out_bps), "goodput_in_bps": round(p.goodput_in_bps),
        "sent_bytes": p.sent_bytes, "received_bytes": p.received_bytes,
        "verdict": p.verdict, "last_heard_s": _r(p.last_heard_s, 1), "unanswered": p.unanswered,
    }


def view_json(stats: TableStatistics, swarm: SwarmView, limit: int = 64) -> dict[str, Any]:
    """The busiest ``limit`` peers and this node's totals."""
    total = stats.sent_bytes + stats.received_bytes
    return {
        "peers": [peer_json(p) for p in stats.peers[:limit]],
        "tracked": stats.tracked, "capacity": stats.capacity, "evicted": stats.evicted,
        "send_bps": round(stats.send_bps), "recv_bps": round(stats.recv_bps),
        "rates_age_s": _r(stats.rates_age_s, 3), "sent_bytes": stats.sent_bytes, "received_bytes": stats.received_bytes,
        "sent_by_kind": stats.sent_by_kind, "received_by_kind": stats.received_by_kind,
        "relayed_fraction": round(stats.relayed_bytes / total, 4) if total else 0.0,
        "averages_received_fraction": _r(swarm.averages_received_fraction, 4),
        "step_network_share": _r(swarm.step_network_share, 4),
        "unattributed_bytes": stats.unattributed_bytes,
    }
