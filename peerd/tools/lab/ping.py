"""ICMP echo from one lab peer to others (root): the path's round trip as the kernels see it, queues included,
with no daemon in the loop (the lab has no ``ping`` binary to lean on, and needs none).

A thread sends an echo request to every target each ``interval_s`` from a raw socket made inside the source's
namespace, and records each reply's round trip with the time it was sent; a lost request or reply (the lab's
random drop takes ICMP too) leaves no sample.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ECHO_REQUEST, ECHO_REPLY = 8, 0
TIMEOUT_S = 2.0  # a request unanswered this long is lost


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int, payload: bytes = b"peerd-lab-ping") -> bytes:
    head = struct.pack("!BBHHH", ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ECHO_REQUEST, 0, checksum(head + payload), ident, seq) + payload


@dataclass(frozen=True)
class PingSample:
    target: str
    sent_at: float  # time.monotonic() when the request left
    rtt_s: float


class Pinger:
    """Pings ``targets`` from lab peer ``source`` every ``interval_s`` until stopped (a context manager)."""

    def __init__(self, lab: Any, source: int, targets: Sequence[str], interval_s: float = 0.1) -> None:
        self.lab, self.source, self.targets, self.interval_s = lab, source, list(targets), interval_s
        self.samples: list[PingSample] = []
        self.sent = 0
        self._ident = os.getpid() & 0xFFFF
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> Pinger:
        with self.lab.entered(self.source):
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def _run(self) -> None:
        pending: dict[int, tuple[str, float]] = {}
        seq = 0
        next_send = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                for target in self.targets:
                    seq = (seq + 1) & 0xFFFF
                    pending[seq] = (target, time.monotonic())
                    self._sock.sendto(echo_request(self._ident, seq), (target, 0))
                    self.sent += 1
                next_send = now + self.interval_s
                for s in [s for s, (_, at) in pending.items() if now - at > TIMEOUT_S]:
                    del pending[s]
            ready, _, _ = select.select([self._sock], [], [], max(0.0, next_send - time.monotonic()))
            if not ready:
                continue
            data, (addr, _) = self._sock.recvfrom(2048)
            got = time.monotonic()
            ihl = (data[0] & 0x0F) * 4 if data else 0
            if len(data) < ihl + 8:
                continue
            kind, _, _, ident, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            hit = pending.get(rseq)
            if kind == ECHO_REPLY and ident == self._ident and hit is not None and hit[0] == addr:
                del pending[rseq]
                with self._lock:
                    self.samples.append(PingSample(addr, hit[1], got - hit[1]))

    def rtts(self, target: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        """Round trips to ``target`` of requests sent in [since, until] (time.monotonic())."""
        with self._lock:
            return [s.rtt_s for s in self.samples if s.target == target and since <= s.sent_at <= until]
