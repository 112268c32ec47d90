"""What a datagram socket can do, declared once when the socket is made.

Code above the socket (the endpoint, the averaging host) asks ``caps`` instead of probing the socket object with
``getattr`` wherever it sends: a socket says once what it has (GSO sends, GRO receives, block receive and send,
kernel drop counts, buffer sizes), and a test or simulator socket declares what it lacks the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire.native import native


@dataclass(slots=True)
class SocketCaps:
    """A socket's capabilities. Only ``gso`` ever changes after creation, and only from True to False
    (``lose_gso``): a path that refuses segmentation offload at the first send turns it off for good."""

    gso: bool = False  # UDP_SEGMENT: up to ``gso_segments`` equal datagrams per send syscall
    gro: bool = False  # UDP_GRO: a receive may return a block of equal datagrams
    block_receive: bool = False  # recv_blocks(max) -> [(data, source, segment)]; else recv_batch(max)
    block_send: bool = False  # send_block(rows x bytes array, address) sends each row as one datagram
    kernel_drops: bool = False  # SO_RXQ_OVFL: the socket's ``kernel_drops`` counts receive-queue overflows
    drained_flag: bool = False  # its ``drained`` says whether the last receive emptied the socket
    rcvbuf: int = 0  # usable receive buffer bytes (0: unknown)
    sndbuf: int = 0  # usable send buffer bytes (0: unknown)
    gso_segments: int = 1  # most datagrams one send may carry (1 without GSO)

    def lose_gso(self) -> None:
        """The path refused a segmented send: one datagram per syscall from now on."""
        self.gso = False
        self.gso_segments = 1


def plain_caps() -> SocketCaps:
    """A socket with none of the batching capabilities (an in-memory test socket): recv_batch, send_many."""
    return SocketCaps()


def native_receive() -> Callable[..., Any] | None:
    """The C receive pass (dataplane.c recv_batch), where the extension is loaded and has it on Linux.
    PEERD_DATAPLANE=python (no extension at all) or PEERD_NATIVE_RECV=0 (the receive pass alone, for A/B
    measurements) run the Python loop, the reference."""
    if not sys.platform.startswith("linux") or os.environ.get("PEERD_NATIVE_RECV", "1") == "0":
        return None
    return getattr(native, "recv_batch", None)
