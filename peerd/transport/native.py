"""Which of the extension's socket passes this process runs, chosen once at import: the receive pass (for the
socket and for the transport core's choice of auth limiter, which must match it) and the paced send.

Its own module so that a core can ask without importing the socket shell (``udp.py``)."""

from __future__ import annotations

import os
import sys

from ..wire.native import native

# The C receive pass (dataplane.c recv_batch: recvmmsg, GRO and source parsing and the merging below, the GIL
# released), where the extension is loaded and has it. PEERD_DATAPLANE=python (no extension at all) or
# PEERD_NATIVE_RECV=0 (the receive pass alone, for A/B measurements) run the Python loop, the reference.
NATIVE_RECV = (getattr(native, "recv_batch", None)
               if sys.platform.startswith("linux") and os.environ.get("PEERD_NATIVE_RECV", "1") != "0" else None)
# The C send of a paced part (send.c send_rows: its GSO messages by sendmmsg, the GIL released); PEERD_NATIVE_SEND=0
# runs the Python loop (send_block's reference: one sendmsg per GSO message), for A/B measurements.
NATIVE_SEND = (getattr(native, "send_rows", None)
               if sys.platform.startswith("linux") and os.environ.get("PEERD_NATIVE_SEND", "1") != "0" else None)
