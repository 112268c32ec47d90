"""Per-peer network view: what this node exchanges with each peer (peerd status, peerd top, the status page)."""

from .feed import PeerFeed, SwarmView, swarm_view
from .table import KINDS, PeerStatistics, PeerTable, TableStatistics

__all__ = ["KINDS", "PeerFeed", "PeerStatistics", "PeerTable", "SwarmView", "TableStatistics", "swarm_view"]
