"""A UDP blast across lab links: a paced sender and a counting receiver, run inside the peers' namespaces.

It measures what a link delivers without peerd in the way: the receiver timestamps arrivals in the kernel
(SO_TIMESTAMPNS), so a receiver that the scheduler runs late on a loaded machine does not distort the rate, and
it reports the socket's own overflow drops (SO_RXQ_OVFL), so what the nftables counters say can be matched
packet for packet.

    python -m peerd.tools.lab.blast recv --port 9000 [--idle 1.0] [--max-seconds 30]
    python -m peerd.tools.lab.blast send 10.77.0.2:9000 --rate 20mbit --seconds 2 [--size 1472]
    python -m peerd.tools.lab.blast ring --peers 4 --rate 100mbit --losses 0,0.01,0.05,0.1 [--json]   (root)

``recv`` prints ``ready`` once bound, then one JSON line when it stops (SIGINT/SIGTERM, idle or max); ``send``
prints one JSON line. ``ring`` builds a lab and blasts every peer to the next one at once (each link carries one
flow up and one down) at each loss.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import Any

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SOL_UDP = 17
UDP_SEGMENT = 103
MAX_PAYLOAD = 65507


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


class _Stop(Exception):
    """SIGINT/SIGTERM to a receiver: stop waiting, count what the socket already holds, report."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop


def receive(port: int, *, idle_s: float | None = 1.0, max_s: float = 30.0, host: str = "0.0.0.0",
            ready: Any = None) -> dict[str, Any]:
    """Count datagrams until told to stop (SIGINT/SIGTERM), ``idle_s`` passes without one after the first
    (None: never), or ``max_s`` in all; on a signal, what already sits in the socket is counted too.

    A signal is the exact way to end a measurement: a sender that the scheduler starves for longer than
    ``idle_s`` on a loaded machine would end an idle-based one early. goodput_bps is payload bits between the
    first and the last arrival (kernel timestamps), not counting the first datagram's bytes, which arrive at the
    interval's start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
    sock.bind((host, port))
    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    counts = {"packets": 0, "bytes": 0, "first_len": 0, "first_ns": 0, "last_ns": 0, "socket_drops": 0,
              "max_seq": -1}
    cmsg_space = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(4)
    try:
        if ready is not None:
            ready()
        started = time.monotonic()
        while True:
            remaining = max_s - (time.monotonic() - started)
            if remaining <= 0:
                break
            sock.settimeout(min(remaining, idle_s) if counts["packets"] and idle_s is not None else remaining)
            try:
                _count(counts, *sock.recvmsg(MAX_PAYLOAD, cmsg_space)[:2])
            except TimeoutError:
                if counts["packets"] and idle_s is not None:
                    break
    except _Stop:
        pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    sock.setblocking(False)
    while True:  # what arrived before the stop is still in the socket
        try:
            _count(counts, *sock.recvmsg(MAX_PAYLOAD, cmsg_space)[:2])
        except BlockingIOError:
            break
    sock.close()
    span = (counts["last_ns"] - counts["first_ns"]) / 1e9
    return {"packets": counts["packets"], "bytes": counts["bytes"], "span_s": span,
            "socket_drops": counts["socket_drops"], "max_seq": counts["max_seq"],
            "goodput_bps": (counts["bytes"] - counts["first_len"]) * 8 / span if span > 0 else 0.0}


def _count(counts: dict[str, int], data: bytes, ancdata: list[tuple[int, int, bytes]]) -> None:
    stamp = 0
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
            sec, nsec = struct.unpack("qq", payload[:16])
            stamp = sec * 1_000_000_000 + nsec
        elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(payload) >= 4:
            counts["socket_drops"] = struct.unpack("I", payload[:4])[0]
    if not stamp:
        stamp = time.time_ns()
    if not counts["packets"]:
        counts["first_ns"], counts["first_len"] = stamp, len(data)
    counts["last_ns"] = stamp
    counts["packets"] += 1
    counts["bytes"] += len(data)
    if len(data) >= 8:
        counts["max_seq"] = max(counts["max_seq"], struct.unpack_from("!Q", data)[0])


def send(host: str, port: int, *, rate_bps: float, seconds: float, size: int = 1472,
         count: int | None = None, gso: int = 1) -> dict[str, Any]:
    """Send ``size``-byte datagrams paced at ``rate_bps`` (payload bits) for ``seconds`` or ``count`` datagrams.

    Each carries its sequence number first. A sender that falls more than 5 ms behind its schedule skips ahead
    instead of catching up in one burst, so the offered rate never exceeds ``rate_bps`` by more than that.
    ``gso`` > 1 hands the kernel that many datagrams per send (UDP_SEGMENT): the lab's veths have segmentation
    offload off, so they still leave as separate datagrams (the tbf splits them), but one Python sender can then
    offer 100 Mbit/s and more on a loaded 2-core machine, which it cannot one sendmsg per datagram."""
    if not 8 <= size <= MAX_PAYLOAD:
        raise ValueError(f"size {size}: expected 8-{MAX_PAYLOAD} bytes")
    if not 1 <= gso <= 64 or gso * size > MAX_PAYLOAD:
        raise ValueError(f"gso {gso}: expected 1-64 datagrams of {size} bytes within {MAX_PAYLOAD} bytes")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((host, port))
    if gso > 1:
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, size)
    payload = bytearray(size * gso)
    interval = size * 8 / rate_bps
    sent = errors = 0
    t0 = time.perf_counter()
    base = t0
    while count is None or sent < count:
        now = time.perf_counter()
        if now - t0 >= seconds:
            break
        due = base + sent * interval
        if due > now:
            if due - now > 0.0002:
                time.sleep(min(due - now, 0.002))
            continue
        if now - due > 0.005:
            base = now - sent * interval  # behind schedule: skip ahead, never burst to catch up
        batch = gso if count is None else min(gso, count - sent)
        for k in range(batch):
            struct.pack_into("!Q", payload, k * size, sent + k)
        try:
            sock.send(memoryview(payload)[:batch * size])
        except OSError:  # ENOBUFS, or ECONNREFUSED from an earlier ICMP: count it, keep the pace
            errors += 1
        sent += batch
    elapsed = time.perf_counter() - t0
    sock.close()
    return {"packets": sent, "bytes": sent * size, "seconds": elapsed, "errors": errors,
            "offered_bps": sent * size * 8 / elapsed if elapsed > 0 else 0.0}


def ring(peers: int, rate: str, losses: list[float], *, seconds: float = 3.0, overdrive: float = 1.3,
         size: int = 1472, port: int = 9000, gso: int = 16) -> list[dict[str, Any]]:
    """Every peer blasts the next at ``overdrive`` x the link rate, all at once, once per loss in ``losses``.

    Returns one row per loss: each link's receiver goodput and its nftables drop fraction, and the tbf drops
    (the overdrive that the shaper refused). Payload goodput cannot exceed rate x size / (size + 42): the
    Ethernet, IPv4 and UDP headers are on the link too."""
    from .links import LinkLab

    rows = []
    with LinkLab(peers, rate, losses[0]) as lab:
        for loss in losses:
            lab.set_loss(loss)
            before = [lab.qdisc_stats(i) for i in range(peers)]
            recvs = [lab.popen(i, [sys.executable, "-m", "peerd.tools.lab.blast", "recv", "--port", str(port),
                                   "--idle", "0", "--max-seconds", str(seconds + 60)], stdout=subprocess.PIPE,
                               text=True) for i in range(peers)]
            for r in recvs:
                if r.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                    raise RuntimeError("a blast receiver failed to start")
            sends = [lab.popen(i, [sys.executable, "-m", "peerd.tools.lab.blast", "send",
                                   f"{lab.addr((i + 1) % peers)}:{port}", "--rate", str(int(lab.rate_bps * overdrive)),
                                   "--seconds", str(seconds), "--size", str(size), "--gso", str(gso)],
                               stdout=subprocess.PIPE, text=True) for i in range(peers)]
            sent = [json.loads(s.communicate(timeout=seconds + 60)[0]) for s in sends]
            time.sleep(0.2)  # the tbf queues (20 ms) drain
            for r in recvs:
                r.send_signal(signal.SIGINT)
            got = [json.loads(r.communicate(timeout=30)[0]) for r in recvs]
            counters = [lab.counters(i) for i in range(peers)]
            after = [lab.qdisc_stats(i) for i in range(peers)]
            links = []
            for i in range(peers):
                sender = (i - 1) % peers
                links.append({
                    "link": f"{sender}->{i}", "offered_bps": round(sent[sender]["offered_bps"]),
                    "goodput_bps": round(got[i]["goodput_bps"]), "received": got[i]["packets"],
                    "nft_seen": counters[i].seen, "nft_dropped": counters[i].dropped,
                    "drop_fraction": round(counters[i].drop_fraction, 5),
                    "tbf_drops_up": after[sender]["up"].drops - before[sender]["up"].drops,
                    "tbf_drops_down": after[i]["down"].drops - before[i]["down"].drops,
                    "socket_drops": got[i]["socket_drops"]})
            seen = sum(c.seen for c in counters)
            dropped = sum(c.dropped for c in counters)
            rows.append({"rate": rate, "loss": loss, "peers": peers, "seconds": seconds, "size": size,
                         "offered_bps_mean": round(statistics.mean(lk["offered_bps"] for lk in links)),
                         "goodput_bps_min": min(lk["goodput_bps"] for lk in links),
                         "goodput_bps_mean": round(statistics.mean(lk["goodput_bps"] for lk in links)),
                         "goodput_ceiling_bps": round(lab.rate_bps * size / (size + 42)),
                         "drop_fraction": round(dropped / seen, 5) if seen else 0.0, "nft_seen": seen,
                         "links": links})
    return rows


def main(argv: list[str] | None = None) -> int:
    from .links import parse_rate

    p = argparse.ArgumentParser(prog="python -m peerd.tools.lab.blast", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--idle", type=float, default=1.0, help="stop this long after the last datagram (0: only on "
                   "SIGINT/SIGTERM or --max-seconds)")
    r.add_argument("--max-seconds", type=float, default=30.0)
    s = sub.add_parser("send")
    s.add_argument("target", type=_hostport)
    s.add_argument("--rate", required=True, help="payload rate: 20mbit, 500kbit or bits/s")
    s.add_argument("--seconds", type=float, default=2.0)
    s.add_argument("--count", type=int, default=None)
    s.add_argument("--size", type=int, default=1472)
    s.add_argument("--gso", type=int, default=1, help="datagrams per send (UDP_SEGMENT); 1: one sendmsg each")
    g = sub.add_parser("ring")
    g.add_argument("--peers", type=int, default=4)
    g.add_argument("--rate", default="100mbit")
    g.add_argument("--losses", default="0,0.01,0.05,0.1")
    g.add_argument("--seconds", type=float, default=3.0)
    g.add_argument("--overdrive", type=float, default=1.3)
    g.add_argument("--gso", type=int, default=16)
    g.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "recv":
        print(json.dumps(receive(args.port, idle_s=args.idle or None, max_s=args.max_seconds,
                                 ready=lambda: print("ready", flush=True))), flush=True)
    elif args.cmd == "send":
        print(json.dumps(send(*args.target, rate_bps=parse_rate(args.rate), seconds=args.seconds, size=args.size,
                              count=args.count, gso=args.gso)), flush=True)
    else:
        rows = ring(args.peers, args.rate, [float(x) for x in args.losses.split(",")], seconds=args.seconds,
                    overdrive=args.overdrive, gso=args.gso)
        if args.json:
            print(json.dumps(rows))
        else:
            print(f"{'loss':>6} {'offered mean':>13} {'goodput min':>12} {'goodput mean':>13} {'ceiling':>9} "
                  f"{'nft drop':>9} {'seen':>8}")
            for row in rows:
                print(f"{row['loss']:>6} {row['offered_bps_mean'] / 1e6:>10.2f} Mb"
                      f" {row['goodput_bps_min'] / 1e6:>9.2f} Mb"
                      f" {row['goodput_bps_mean'] / 1e6:>10.2f} Mb {row['goodput_ceiling_bps'] / 1e6:>6.2f} Mb"
                      f" {row['drop_fraction']:>9.4f} {row['nft_seen']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
