"""The PING prober of `peerd bench soak`: a member (its own identity, the swarm key) that PINGs the honest
daemons every ``PING_S`` and writes one line per PING, ``<CLOCK_MONOTONIC seconds> <round trip ms> <daemon>``
(-1: no PONG within ``PING_TIMEOUT_S``; daemon: its index in the targets), to the file it is given.

Its own process, so that the bench's threads (checking averages, scraping metrics) never hold a GIL the
timing waits on: the figure is the daemons' latency, not the bench's.
Run as ``python -m peerd.tools.bench.soak_probe CONFIG_JSON``; it stops after ``max_s``, on SIGTERM, or when the
bench that started it is gone.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import socket
import sys
import time

from ...wire import messages as m
from ...wire.identity import Identity, load_swarm_key, node_id_of
from ...wire.seal import Opener, Sealer

PING_S = 0.02
PING_TIMEOUT_S = 1.0
# Protocol version 2 binds the receiver's node id into each datagram's associated data; the soak speaks
# whichever version this checkout's wire code does.
_SEAL_RECEIVER = "receiver" in inspect.signature(Sealer.seal).parameters
_OPEN_RECEIVER = "receiver" in inspect.signature(Opener.__init__).parameters


def seal_for(sealer: Sealer, mtype: int, body: bytes, receiver: bytes | None) -> bytes:
    """Seal for ``receiver`` (a node id) where the wire binds datagrams to their receiver, else as v1 did."""
    if _SEAL_RECEIVER:
        return sealer.seal(mtype, body, receiver)  # type: ignore[call-arg]
    return sealer.seal(mtype, body)


def opener_for(secret: bytes, own_id: bytes) -> Opener:
    """An opener for datagrams sealed for ``own_id``."""
    return Opener(secret, receiver=own_id) if _OPEN_RECEIVER else Opener(secret)  # type: ignore[call-arg]


class Prober:
    def __init__(self, key_file: str, targets: list[tuple[str, int]], ids: list[bytes]) -> None:
        secret = load_swarm_key(key_file)
        self.ident = Identity.generate()
        binding = self.ident.bind_token()
        self.sealer = Sealer(secret, binding.token)
        self.opener = opener_for(secret, self.ident.node_id)
        self.ids = ids
        self.frm = binding.sender()
        self.targets = targets
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))

    def _pong(self, fields: dict, source: tuple[str, int]) -> None:
        """Answer a daemon's PING, as a member does: a daemon checks a new contact (and validates its address)
        with one, and a member that never answers is one it stops reaching directly (it punches, then relays
        through another node), so this prober's own PONGs would no longer come back the way it reads them."""
        body = m.encode(m.MsgType.PONG, {"rid": fields["rid"], "from": self.frm})
        try:
            self.sock.sendto(seal_for(self.sealer, m.MsgType.PONG, body, node_id_of(fields["from"]["pk"])), source)
        except OSError:
            pass

    def ping(self, target: tuple[str, int], receiver: bytes) -> float | None:
        """One PING; the round trip in seconds, or None when no PONG came back in time."""
        rid = random.getrandbits(64)
        body = m.encode(m.MsgType.PING, {"rid": rid, "from": self.frm})
        sent = time.perf_counter()
        try:
            self.sock.sendto(seal_for(self.sealer, m.MsgType.PING, body, receiver), target)
        except OSError:
            return None
        deadline = sent + PING_TIMEOUT_S
        while (left := deadline - time.perf_counter()) > 0:
            self.sock.settimeout(left)
            try:
                data, source = self.sock.recvfrom(65535)
            except OSError:  # timed out
                return None
            try:
                header, plain, _ = self.opener.open(data)
                if header.type == m.MsgType.PONG and m.decode(header.type, plain)["rid"] == rid:
                    return time.perf_counter() - sent
                if header.type == m.MsgType.PING:
                    self._pong(m.decode(header.type, plain), source)
            except Exception:  # noqa: BLE001 - whatever else a daemon sends this member (its requests): ignore
                continue
        return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m peerd.tools.bench.soak_probe CONFIG_JSON", file=sys.stderr)
        return 2
    cfg = json.loads(argv[0])
    targets = [(h, int(p)) for h, p in cfg["targets"]]
    prober = Prober(cfg["key_file"], targets, [bytes.fromhex(h) for h in cfg["ids"]])
    parent = os.getppid()
    end = time.monotonic() + float(cfg.get("max_s", 3600))
    i = 0
    with open(cfg["out"], "w", buffering=1) as out:
        while time.monotonic() < end and os.getppid() == parent:
            start = time.monotonic()
            rtt = prober.ping(targets[i % len(targets)], prober.ids[i % len(targets)])
            i += 1
            out.write(f"{start:.6f} {-1 if rtt is None else rtt * 1000:.3f} {(i - 1) % len(targets)}\n")
            time.sleep(max(0.0, PING_S - (time.monotonic() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
