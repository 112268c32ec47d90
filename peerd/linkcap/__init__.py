"""Bandwidth caps for metered links: what a node may upload and download, and a byte budget it paces itself to.

``rates`` parses ``--max-upload``/``--max-download``/``--budget``; ``core`` is the sans-I/O token bucket and budget
pacer every outgoing datagram passes; ``advert`` is the cap a node publishes in its matchmaking record and the group
plan built from its members' caps; ``shell`` is the socket wrapper and the timer task around the core.
"""

from .advert import CapAdvert, PeerCaps, share_seconds
from .core import CapConfig, CapStatistics, LinkCap
from .rates import Budget, parse_budget, parse_rate

__all__ = ["Budget", "CapAdvert", "CapConfig", "CapStatistics", "LinkCap", "PeerCaps", "parse_budget", "parse_rate",
           "share_seconds"]
