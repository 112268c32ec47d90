"""One group's averaging over lossy datagrams: reduce-scatter, all-gather, unbiased reconstruction.

Sans-I/O: ``GroupAverage`` takes bodies and an injected ``now`` and hands out bodies to send and the next
deadline; a trio driver (or the simulator) does the I/O. protocol/allreduce.md is the normative text.
"""

from .frames import (
    END_REPEATS,
    HEADER,
    HEADER_SIZE,
    BodyHeader,
    BodyType,
    pack_data,
    pack_end,
    parse_header,
    peek_group,
)
from .group import (
    COMPLETION,
    DEADLINE,
    DEFAULT_FLOOR_S,
    DEFAULT_MAX_PAYLOAD,
    DEFAULT_SAFETY,
    GroupAverage,
    GroupStats,
    Outcome,
    Outgoing,
    PhaseStats,
)
from .options import AverageOptions
from .shards import Layout, elements_per_datagram

__all__ = [
    "COMPLETION",
    "DEADLINE",
    "DEFAULT_FLOOR_S",
    "DEFAULT_MAX_PAYLOAD",
    "DEFAULT_SAFETY",
    "END_REPEATS",
    "AverageOptions",
    "HEADER",
    "HEADER_SIZE",
    "BodyHeader",
    "BodyType",
    "GroupAverage",
    "GroupStats",
    "Layout",
    "Outcome",
    "Outgoing",
    "PhaseStats",
    "elements_per_datagram",
    "pack_data",
    "pack_end",
    "parse_header",
    "peek_group",
]
