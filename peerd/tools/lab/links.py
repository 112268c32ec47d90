"""The link lab: one network namespace per peer, shaped and lossy links to a shared bridge (root only).

Every figure taken on loopback has the CPU as its bottleneck and loses nothing unless told to. The lab gives each
peer a real link instead: its own network namespace with one veth (``lab0``) to a bridge that lives in a
namespace of its own, so the lab never creates, moves or touches an interface of the host's namespace.

- rate: ``tc tbf`` at RATE on both ends of each peer's veth: egress of ``lab0`` (inside the peer) is its upload,
  egress of the bridge-side end is its download. The burst is one millisecond of the rate, at least two full
  frames (a tbf whose burst is below one frame never sends it); the queue holds ``queue_ms`` (20 ms by default)
  of the rate. See :func:`tbf_params` for why.
- offloads off on both ends (gso, tso, tx-udp-segmentation, gro), so every packet on the link is one datagram
  or one TCP segment: the shaper and the dropper see what a real link would carry, never a 64 KB super-packet.
- loss: nftables drops P of the packets that arrive on each peer's ``lab0`` at random, on the input hook inside
  the peer's namespace, for every protocol (so a TCP baseline loses the same as peerd). Two named counters
  (``seen`` and ``dropped``) confirm the rate; :meth:`LinkLab.counters` reads them. The kernel's random
  numbers cannot be seeded: a drop pattern is not reproducible, only its rate is.
- no delay: there is no netem on these machines, so links have no propagation delay (RTT is microseconds plus
  whatever the tbf queue holds). Say so wherever a figure depends on RTT.
- IPv6 is off in every lab namespace, so router solicitations and MLD reports never reach the links; ARP is not
  seen by the ``inet`` input hook. On a quiet lab the counters count only what its processes send.

Names carry a per-run prefix ``peerdlab-<pid>-<random>``, so parallel runs never collide; teardown (normal exit,
exception, SIGINT, SIGTERM) ends what runs in the lab's namespaces and deletes them, which deletes their veths,
qdiscs, bridge and nftables tables with them. :func:`sweep_stale` removes what a SIGKILLed run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .pairs import PairCounters, pair_rules, parse_pairs

log = logging.getLogger("peerd.tools.lab")

NAME_PREFIX = "peerdlab"
PEER_IF = "lab0"  # the peer's end of its veth, inside the peer's namespace
BRIDGE_IF = "br0"  # the bridge, inside the bridge namespace
NFT_TABLE = "peerd_lab"  # inside each peer's namespace (family inet)
ETH_OVERHEAD = 14  # what tbf counts beyond the IP packet on a veth: the Ethernet header
UDP_IP_OVERHEAD = 28  # IPv4 + UDP headers
ROOT_ERROR = "the link lab needs root: network namespaces, tc and nftables"
TOOLS = {
    "ip": "apt-get install -y iproute2",
    "tc": "apt-get install -y iproute2",
    "nft": "apt-get install -y nftables",
    "ethtool": "apt-get install -y ethtool",
}
CLONE_NEWNET = 0x40000000

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_RATE_UNITS = {None: 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class LabError(RuntimeError):
    """The lab could not be set up, used or torn down; the message says what and how to fix it."""


def parse_rate(text: str | int) -> int:
    """Bits per second from ``100mbit``, ``1gbit``, ``500kbit``, ``2.5mbit`` or plain bits/s (``1000000``).

    Units are decimal, as in tc (kbit = 1000 bit/s). tc's ``mbps`` (megabytes) is refused as too easy to misread."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r}: expected a link rate like 100mbit, 1gbit, 500kbit or bits/s")
    if isinstance(text, int):
        value = float(text)
    else:
        m = _RATE.match(text)
        if not m:
            raise ValueError(f"{text!r}: expected a link rate like 100mbit, 1gbit, 500kbit or bits/s")
        unit = m.group(2).lower() if m.group(2) else None
        value = float(m.group(1)) * _RATE_UNITS[unit]
    bps = int(value)
    if bps < 8000:
        raise ValueError(f"{text!r}: a link rate must be at least 8kbit (one frame per 1.5 s)")
    if bps > 100 * 10**9:
        raise ValueError(f"{text!r}: a link rate above 100gbit is not a link this machine can shape")
    return bps


def format_rate(bps: int) -> str:
    """The shortest exact tc spelling of a rate: 100000000 -> '100mbit'."""
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True)
class TbfParams:
    """One direction's token bucket: rate (bit/s), burst (bytes) and queue limit (bytes)."""

    rate_bps: int
    burst_bytes: int
    limit_bytes: int
    queue_ms: float


def tbf_params(rate_bps: int, mtu: int = 1500, queue_ms: float = 20.0) -> TbfParams:
    """Burst: 1 ms of the rate, at least two full frames. Queue: ``queue_ms`` of the rate on top of the burst.

    Why: tbf lets a burst leave at the veth's (unlimited) speed, so the burst is how far the link may run ahead of
    RATE over any interval; 1 ms keeps that to what a real link serializes in a millisecond (12.5 KB at
    100 Mbit/s), yet it is above the lateness of the qdisc's hrtimer on a loaded 2-core machine, so tokens are not
    lost while the timer is late (a burst below one frame would never send it; two frames keep one in flight while
    the next is due). The queue, 20 ms by default (250 KB at 100 Mbit/s), is a modest access-link buffer: enough to
    absorb a paced sender's bursts, small enough that overrunning the link shows up as loss within ~20 ms instead
    of hiding in a queue. Links have no propagation delay (no netem), so that queue is the only RTT there is."""
    if queue_ms <= 0:
        raise ValueError("queue_ms must be positive")
    frame = mtu + ETH_OVERHEAD
    burst = max(2 * frame, rate_bps // 8 // 1000)
    limit = burst + int(rate_bps / 8 * queue_ms / 1000)
    return TbfParams(rate_bps, burst, limit, queue_ms)


@dataclass(frozen=True)
class LinkCounters:
    """What one peer's nftables rules saw arrive on its link and what they dropped (since the last reset)."""

    seen: int
    dropped: int
    seen_bytes: int
    dropped_bytes: int

    @property
    def delivered(self) -> int:
        return self.seen - self.dropped

    @property
    def drop_fraction(self) -> float:
        return self.dropped / self.seen if self.seen else 0.0

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.seen - other.seen, self.dropped - other.dropped,
                            self.seen_bytes - other.seen_bytes, self.dropped_bytes - other.dropped_bytes)


@dataclass(frozen=True)
class QdiscStats:
    """One tbf's counters (tc -s): what it sent, what it dropped because its queue was full, and its backlog."""

    bytes: int
    packets: int
    drops: int
    overlimits: int
    backlog_bytes: int


def _missing_tools(tools: Sequence[str] = tuple(TOOLS)) -> list[str]:
    return [tool for tool in tools if shutil.which(tool) is None]


def check_environment(what: str = "link lab", root_error: str = ROOT_ERROR,
                      tools: Sequence[str] = tuple(TOOLS)) -> None:
    """Raise LabError unless this process can build a lab: root and every tool (with how to install it)."""
    if os.geteuid() != 0:
        raise LabError(root_error)
    missing = _missing_tools(tools)
    if missing:
        hints = "; ".join(f"{tool}: {TOOLS[tool]}" for tool in missing)
        raise LabError(f"the {what} needs {', '.join(missing)} (install with {hints})")


def lab_unavailable() -> str | None:
    """Why a lab cannot be built here (for a test's skip reason), or None when it can."""
    try:
        check_environment()
    except LabError as e:
        return str(e)
    return None


def _run(argv: list[str], *, input: str | None = None, timeout: float = 30.0) -> str:
    """Run one setup command; a failure is a LabError that names the command and quotes its stderr."""
    try:
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    except FileNotFoundError:
        raise LabError(f"`{argv[0]}` is not installed ({TOOLS.get(argv[0], 'install it')})") from None
    if proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    try:
        out = _run(["ip", "netns", "pids", ns])
    except LabError:
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _end_pids(pids: list[int], grace_s: float) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace_s`` (pids inside the lab's own namespaces)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _pid_alive(pid)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie holds no namespace)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _delete_netns(names: Sequence[str], grace_s: float = 3.0) -> list[str]:
    """End every process inside ``names``, then delete them; returns error messages (empty when all went)."""
    for ns in names:
        pids = _netns_pids(ns)
        if pids:
            log.info("lab: ending %d leftover process(es) in %s", len(pids), ns)
            _end_pids(pids, grace_s)
    errors = []
    for ns in names:
        try:
            _run(["ip", "netns", "del", ns])
        except LabError as e:
            errors.append(str(e))
    return errors


def sweep_stale() -> list[str]:
    """Delete the namespaces of lab runs whose process is gone (a SIGKILLed run cannot clean up); returns them.

    Only names of the form ``peerdlab-<pid>-<hex>-...`` whose pid no longer exists are touched."""
    check_environment()
    pattern = re.compile(rf"^{NAME_PREFIX}-(\d+)-[0-9a-f]+-")
    stale = [ns for ns in _list_netns() if (m := pattern.match(ns)) and not _pid_alive(int(m.group(1)))]
    errors = _delete_netns(stale)
    if errors:
        raise LabError("; ".join(errors))
    return stale


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NetnsLab:
    """What every lab shares: named namespaces, one veth ``lab0`` per peer (optionally shaped and lossy), processes
    inside a peer's namespace, and teardown on exit, failure, SIGINT and SIGTERM.

    A subclass builds its topology in ``_build`` (with ``_add_netns`` and ``_peer_link``) and says where the far
    end of each peer's veth is (``_far_end``). ``rate`` None: no tbf (links at veth speed), offloads left on."""

    what = "lab"  # for error messages: "link lab", "NAT lab"
    root_error = ROOT_ERROR
    tools: tuple[str, ...] = tuple(TOOLS)

    def __init__(self, peers: int, rate: str | int | None, loss: float | Sequence[float] = 0.0, *,
                 mtu: int = 1500, queue_ms: float = 20.0) -> None:
        if peers < 1:
            raise ValueError(f"a {self.what} needs at least one peer")
        self.rate_bps = parse_rate(rate) if rate is not None else None
        if not 576 <= mtu <= 9000:
            raise ValueError(f"mtu {mtu}: expected 576-9000")
        self.mtu = mtu
        self.tbf = tbf_params(self.rate_bps, mtu, queue_ms) if self.rate_bps is not None else None
        self.peers = peers
        self.loss = self._check_loss(loss)
        self.prefix = f"{NAME_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self._peer_ns = [f"{self.prefix}-p{i}" for i in range(peers)]
        self._created: list[str] = []  # namespaces that exist, in creation order
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, Any] = {}
        self._open = False

    def _check_loss(self, loss: float | Sequence[float]) -> list[float]:
        values = [float(loss)] * self.peers if isinstance(loss, int | float) else [float(x) for x in loss]
        if len(values) != self.peers:
            raise ValueError(f"{len(values)} loss values for {self.peers} peers")
        for p in values:
            if not 0.0 <= p < 1.0:
                raise ValueError(f"link loss {p}: expected a fraction in [0, 1)")
        return values

    # ---- names and addresses -------------------------------------------------------------------------------

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < self.peers:
            raise IndexError(f"peer {peer}: this lab has peers 0-{self.peers - 1}")
        return peer

    def netns(self, peer: int) -> str:
        """The name of peer ``peer``'s namespace (for `ip netns exec`)."""
        return self._peer_ns[self._peer(peer)]

    def addr(self, peer: int) -> str:
        """The address peer ``peer`` binds (its ``lab0``'s)."""
        raise NotImplementedError

    def exec_prefix(self, peer: int) -> list[str]:
        """argv prefix that runs a command inside peer ``peer``'s namespace."""
        return ["ip", "netns", "exec", self.netns(peer)]

    def _far_end(self, peer: int) -> tuple[str, str]:
        """(namespace, interface) of the other end of peer ``peer``'s veth."""
        raise NotImplementedError

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def __enter__(self) -> NetnsLab:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(raise_errors=exc_type is None)

    def check_environment(self) -> None:
        """Raise LabError unless this process can build this lab (root, its tools)."""
        tools = self.tools if self.rate_bps is not None else tuple(t for t in self.tools if t != "ethtool")
        check_environment(self.what, self.root_error, tools)

    def start(self) -> None:
        """Build the lab; on any failure (or a signal) tear down what was built and raise."""
        if self._open:
            raise LabError("this lab is already up")
        self.check_environment()
        self._install_signal_handlers()
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close(raise_errors=False)
            raise

    def _build(self) -> None:
        raise NotImplementedError

    def _add_netns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        # Before any veth exists here, so none gets an IPv6 address that would chatter onto the link (a kernel
        # without IPv6 has nothing to turn off). /proc/sys/net is the opener's namespace's.
        _run(["ip", "netns", "exec", ns, "sh", "-c", "[ ! -d /proc/sys/net/ipv6 ] || { "
              "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
              "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; }"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _add_bridge(self) -> None:
        """The bridge namespace with its bridge up: the shared segment every peer's veth joins."""
        self._add_netns(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE_IF, "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE_IF, "up"])

    def _tbf(self, ns: str, dev: str) -> None:
        t = self.tbf
        assert t is not None
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{t.rate_bps}bit",
              "burst", str(t.burst_bytes), "limit", str(t.limit_bytes)])

    def _offloads_off(self, ns: str, dev: str) -> None:
        _run(["ip", "netns", "exec", ns, "ethtool", "-K", dev, "gso", "off", "tso", "off",
              "tx-udp-segmentation", "off", "gro", "off"])

    def _peer_link(self, peer: int, cidr: str, *, master: str | None = None, far_cidr: str | None = None) -> None:
        """Peer ``peer``'s veth: ``lab0`` at ``cidr`` in its namespace (created with ``_add_netns`` first), the far
        end (``_far_end``) in a namespace that exists, enslaved to ``master`` or addressed ``far_cidr``; shaped
        both ways when the lab has a rate; the peer's loss table; both ends up."""
        ns = self.netns(peer)
        far_ns, far_if = self._far_end(peer)
        # Created inside the peer's namespace with its other end placed straight into the far namespace:
        # neither end ever exists in the host's namespace.
        _run(["ip", "-n", ns, "link", "add", PEER_IF, "mtu", str(self.mtu), "type", "veth",
              "peer", "name", far_if, "mtu", str(self.mtu), "netns", far_ns])
        _run(["ip", "-n", ns, "addr", "add", cidr, "dev", PEER_IF])
        if master is not None:
            _run(["ip", "-n", far_ns, "link", "set", far_if, "master", master])
        if far_cidr is not None:
            _run(["ip", "-n", far_ns, "addr", "add", far_cidr, "dev", far_if])
        if self.tbf is not None:
            self._offloads_off(ns, PEER_IF)
            self._offloads_off(far_ns, far_if)
            self._tbf(ns, PEER_IF)  # upload
            self._tbf(far_ns, far_if)  # download
        self._write_nft(peer)
        _run(["ip", "-n", far_ns, "link", "set", far_if, "up"])
        _run(["ip", "-n", ns, "link", "set", PEER_IF, "up"])

    def _pair_addrs(self) -> list[str]:
        """Every peer's address when the lab keeps per-pair counters (pairs.py), else none."""
        return []

    def _nft_script(self, peer: int, *, replace: bool) -> str:
        threshold = round(self.loss[peer] * 1_000_000)
        head = f"table inet {NFT_TABLE} {{ }}\ndelete table inet {NFT_TABLE}\n" if replace else ""
        decls, before, after, output = pair_rules(peer, self._pair_addrs(), PEER_IF)
        return head + (
            f"table inet {NFT_TABLE} {{\n"
            "  counter seen { }\n"
            "  counter dropped { }\n"
            f"{decls}"
            "  chain input {\n"
            "    type filter hook input priority 0; policy accept;\n"
            f'    iifname "{PEER_IF}" counter name "seen"\n'
            f"{before}"
            f'    iifname "{PEER_IF}" numgen random mod 1000000 < {threshold} counter name "dropped" drop\n'
            f"{after}"
            "  }\n"
            f"{output}"
            "}\n")

    def _write_nft(self, peer: int, replace: bool = False) -> None:
        _run(["ip", "netns", "exec", self.netns(peer), "nft", "-f", "-"],
             input=self._nft_script(peer, replace=replace))

    def set_loss(self, loss: float | Sequence[float]) -> None:
        """Change every peer's loss in place (links and processes stay up); resets the counters."""
        self._require_open()
        self.loss = self._check_loss(loss)
        for i in range(self.peers):
            self._write_nft(i, replace=True)

    def _teardown_order(self) -> list[str]:
        """Leaves first: deleting a hub first would also work, but this order never leaves a namespace holding a
        veth whose other end is already gone."""
        return list(reversed(self._created))

    def close(self, raise_errors: bool = True) -> None:
        """End the lab's processes and delete its namespaces (and with them every veth, qdisc, bridge, table).

        SIGINT and SIGTERM are held off while this runs, so a second Ctrl-C cannot leave half a lab behind."""
        if not self._open:
            return
        held = self._hold_signals()
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + 3.0
            for proc in self._procs:
                try:
                    proc.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            errors = _delete_netns(self._teardown_order())
            left = set(self._created) & set(_list_netns())
            if left:
                errors.append(f"namespaces still present after teardown: {sorted(left)}")
            self._created = [ns for ns in self._created if ns in left]
            self._procs = []
            self._open = False
        finally:
            self._restore_signals(held)
        if errors:
            msg = f"{self.what} teardown: " + "; ".join(errors)
            if raise_errors:
                raise LabError(msg)
            log.error("%s", msg)

    # ---- signals: SIGTERM unwinds like Ctrl-C, so `with LinkLab(...)` tears down on both ----------------------

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)

    def _hold_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        held: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            held[sig] = signal.signal(sig, signal.SIG_IGN)
        return held

    def _restore_signals(self, held: dict[int, Any]) -> None:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._old_handlers.items():
                if signal.getsignal(sig) == _raise_exit:
                    signal.signal(sig, handler)
        self._old_handlers = {}

    def _require_open(self) -> None:
        if not self._open:
            raise LabError(f"the {self.what} is not up (use it inside `with {type(self).__name__}(...)`)")

    # ---- processes in a peer's namespace --------------------------------------------------------------------

    def popen(self, peer: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside peer ``peer``'s namespace (`ip netns exec` execs it: the pid is the command's).

        The lab ends it on teardown if it is still running; the file system is shared, so Unix sockets and
        paths work as they do outside."""
        self._require_open()
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([*self.exec_prefix(peer), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, peer: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside peer ``peer``'s namespace (subprocess.run's keywords)."""
        self._require_open()
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run([*self.exec_prefix(peer), *argv], **kwargs)

    @contextlib.contextmanager
    def entered(self, peer: int) -> Iterator[None]:
        """Move the calling thread into peer ``peer``'s namespace for the block (sockets made there stay there).

        For in-process clients that must reach a peer's loopback, e.g. a daemon's metrics endpoint."""
        self._require_open()
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{self.netns(peer)}") as there:
            _setns(there.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    # ---- counters -------------------------------------------------------------------------------------------

    def counters(self, peer: int) -> LinkCounters:
        """Peer ``peer``'s nftables counters: packets (and bytes) that arrived on its link, and those dropped."""
        self._require_open()
        out = _run([*self.exec_prefix(peer), "nft", "-j", "list", "counters", "table", "inet", NFT_TABLE])
        found: dict[str, tuple[int, int]] = {}
        for item in json.loads(out).get("nftables", []):
            c = item.get("counter")
            if c and c.get("table") == NFT_TABLE:
                found[c["name"]] = (int(c["packets"]), int(c["bytes"]))
        try:
            (seen, seen_b), (dropped, dropped_b) = found["seen"], found["dropped"]
        except KeyError:
            raise LabError(f"peer {peer}: nftables counters missing from table {NFT_TABLE}: {out[:200]}") from None
        return LinkCounters(seen, dropped, seen_b, dropped_b)

    def reset_counters(self) -> None:
        """Zero every peer's nftables counters."""
        self._require_open()
        for i in range(self.peers):
            _run([*self.exec_prefix(i), "nft", "reset", "counters", "table", "inet", NFT_TABLE])

    def qdisc_stats(self, peer: int) -> dict[str, QdiscStats]:
        """Peer ``peer``'s two token buckets: ``up`` (its lab0) and ``down`` (the far end's, toward it)."""
        return {side: self.tbf_side(peer, side) for side in ("up", "down")}

    def tbf_side(self, peer: int, side: str) -> QdiscStats:
        """One of peer ``peer``'s token buckets (``up`` or ``down``, as qdisc_stats): one ``tc`` read, so a caller
        timing a counter can bracket just that read."""
        self._require_open()
        if self.tbf is None:
            raise LabError(f"this {self.what} has no shaped links (no rate): no token buckets to read")
        if side == "up":
            return _tbf_stats(self.netns(peer), PEER_IF)
        if side != "down":
            raise ValueError(f"side must be 'up' or 'down', not {side!r}")
        far_ns, far_if = self._far_end(peer)
        return _tbf_stats(far_ns, far_if)

    def tbf_sides(self) -> dict[str, list[QdiscStats]]:
        """Every peer's two token buckets by side (``up``, ``down``, as qdisc_stats); {} without shaped links."""
        if self.tbf is None:
            return {}
        stats = [self.qdisc_stats(i) for i in range(self.peers)]
        return {side: [s[side] for s in stats] for side in ("up", "down")}

    @staticmethod
    def queue_drop_shares(before: dict[str, list[QdiscStats]], after: dict[str, list[QdiscStats]]
                          ) -> dict[str, tuple[int, int]]:
        """Per side, (packets the queues dropped, packets offered) between two ``tbf_sides`` readings: loss the
        senders caused themselves, apart from the random loss the lab injects."""
        out = {}
        for side, old in before.items():
            drops = sum(a.drops - b.drops for a, b in zip(after[side], old, strict=True))
            out[side] = (drops, sum(a.packets - b.packets for a, b in zip(after[side], old, strict=True)) + drops)
        return out

    @staticmethod
    def queue_drop_fractions(before: dict[str, list[QdiscStats]], after: dict[str, list[QdiscStats]]
                             ) -> dict[str, float]:
        """Per side, the share of the packets offered to the queues between two readings that they dropped."""
        return {side: d / offered if offered else 0.0
                for side, (d, offered) in NetnsLab.queue_drop_shares(before, after).items()}


class LinkLab(NetnsLab):
    """``peers`` namespaces on one bridge, each link shaped at ``rate`` both ways and losing ``loss`` on arrival.

    Use as a context manager; ``addr(i)`` is peer i's address, ``popen(i, argv)`` / ``run(i, argv)`` start a
    process inside peer i's namespace, ``counters(i)`` reads its nftables counters. ``loss`` is one fraction for
    every peer or one per peer (what peer i loses of what arrives at it). ``pair_counters``: each peer also counts
    the UDP it sends to and receives from every other peer (``pairs(i)``; pairs.py)."""

    what = "link lab"

    def __init__(self, peers: int, rate: str | int, loss: float | Sequence[float] = 0.0, *,
                 mtu: int = 1500, queue_ms: float = 20.0, subnet: str = "10.77.0.0/24",
                 pair_counters: bool = False) -> None:
        if peers < 1:
            raise ValueError("a link lab needs at least one peer")
        super().__init__(peers, rate, loss, mtu=mtu, queue_ms=queue_ms)
        self.pair_counters = pair_counters
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or not net.is_private:
            raise ValueError(f"{subnet}: the lab needs a private IPv4 subnet")
        room = max(0, net.num_addresses - 2)  # no network or broadcast address
        if peers > room:
            raise ValueError(f"{subnet} has room for {room} peers, not {peers}")
        self.prefixlen = net.prefixlen
        self._addrs = [str(h) for h in itertools.islice(net.hosts(), peers)]
        self.bridge_ns = f"{self.prefix}-br"

    def addr(self, peer: int) -> str:
        """Peer ``peer``'s IPv4 address on the lab's bridge."""
        return self._addrs[self._peer(peer)]

    def _pair_addrs(self) -> list[str]:
        return list(self._addrs) if self.pair_counters else []

    def pairs(self, peer: int) -> dict[int, PairCounters]:
        """Peer ``peer``'s per-pair counters (``pair_counters=True``), by the other peer: see pairs.py."""
        self._require_open()
        pairs = parse_pairs(_run([*self.exec_prefix(peer), "nft", "-j", "list", "counters", "table", "inet",
                                  NFT_TABLE]), NFT_TABLE)
        if len(pairs) != self.peers - 1:
            raise LabError(f"peer {peer}: per-pair counters missing (build the lab with pair_counters=True)")
        return pairs

    def bridge_port(self, peer: int) -> str:
        """The bridge-side end of peer ``peer``'s veth (inside the bridge namespace)."""
        return f"v{self._peer(peer)}"

    def _far_end(self, peer: int) -> tuple[str, str]:
        return self.bridge_ns, self.bridge_port(peer)

    def describe(self) -> dict[str, Any]:
        """The lab's parameters, for a benchmark's JSON."""
        assert self.rate_bps is not None and self.tbf is not None
        return {"link_rate": format_rate(self.rate_bps), "link_rate_bps": self.rate_bps,
                "link_loss": self.loss[0] if len(set(self.loss)) == 1 else self.loss,
                "tbf_burst_bytes": self.tbf.burst_bytes, "tbf_limit_bytes": self.tbf.limit_bytes,
                "tbf_queue_ms": self.tbf.queue_ms, "mtu": self.mtu, "peers": self.peers,
                "addresses": list(self._addrs), "delay": "none (no netem)"}

    def __enter__(self) -> LinkLab:
        self.start()
        return self

    def _build(self) -> None:
        self._add_bridge()
        for i in range(self.peers):
            self._add_netns(self.netns(i))
            self._peer_link(i, f"{self._addrs[i]}/{self.prefixlen}", master=BRIDGE_IF)


def _tbf_stats(ns: str, dev: str) -> QdiscStats:
    out = _run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev])
    for q in json.loads(out):
        if q.get("kind") == "tbf":
            return QdiscStats(int(q.get("bytes", 0)), int(q.get("packets", 0)), int(q.get("drops", 0)),
                              int(q.get("overlimits", 0)), int(q.get("backlog", 0)))
    raise LabError(f"no tbf qdisc on {dev} in {ns}: {out[:200]}")


def _raise_exit(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP while a lab is up: unwind like an exception, so every `with` block tears down."""
    raise SystemExit(128 + signum)


def _main(argv: list[str] | None = None) -> int:
    """`python -m peerd.tools.lab.links hold|sweep`: hold a lab up until Ctrl-C/SIGTERM, or delete stale ones."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m peerd.tools.lab.links", description=_main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hold", help="build a lab, print it as JSON, keep it up until SIGINT/SIGTERM")
    h.add_argument("--peers", type=int, default=2)
    h.add_argument("--rate", default="100mbit")
    h.add_argument("--loss", type=float, default=0.0)
    h.add_argument("--fail-after", type=float, default=None, help="raise an error after this many seconds (tests)")
    sub.add_parser("sweep", help="delete the namespaces of lab runs whose process has gone")
    args = p.parse_args(argv)
    try:
        if args.cmd == "sweep":
            for ns in sweep_stale():
                print(f"deleted {ns}")
            return 0
        return hold(lambda: LinkLab(args.peers, args.rate, args.loss), lambda lab: {}, args.fail_after)
    except LabError as e:
        print(f"peerd lab: error: {e}", file=sys.stderr)
        return 1


def hold(make: Callable[[], NetnsLab], extra: Callable[[Any], dict[str, Any]], fail_after: float | None) -> int:
    """`... hold`: build the lab ``make`` returns, print it as one JSON line (plus ``extra(lab)``), keep it up until
    SIGINT/SIGTERM, or raise after ``fail_after`` seconds (tests); an exit code for the command line."""
    try:
        with make() as lab:
            print(json.dumps({"prefix": lab.prefix, "bridge": lab.bridge_ns,
                              "namespaces": [lab.netns(i) for i in range(lab.peers)], **extra(lab),
                              **lab.describe()}), flush=True)
            started = time.monotonic()
            while fail_after is None or time.monotonic() - started < fail_after:
                time.sleep(0.2)
            raise LabError("failing on purpose (--fail-after)")
    except KeyboardInterrupt:
        return 130
    except (LabError, ValueError) as e:
        print(f"peerd lab: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(_main())
