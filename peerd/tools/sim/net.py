"""One in-memory datagram network in virtual time, for the simulator and the tests.

Nodes are handlers by address. Every datagram's fate (lost, duplicated, delayed, reordered by jitter,
queued behind earlier ones on a link of limited bandwidth) is drawn from one injected ``random.Random``,
and everything that happens is an event on one heap ordered by (time, sequence): the same seed and the
same calls give the same events, in the same order, with no wall clock anywhere. Partitions cut links
between groups of nodes until healed; a crashed node loses what was in flight to it and its timers, and
may restart at the same address with new state.

NATs (``add_nat``): nodes behind a NAT box send from a public address the box maps them to, and only what the
box's filter lets in reaches them (a port-restricted cone, or a symmetric NAT with a new port per destination);
mappings expire when unused, in virtual time. Addresses behind or of a box are ``(host, port)`` tuples.

``Link.fate`` is the per-datagram decision on its own, for a network whose clock is another's (the trio
tests' ``MemNet`` runs it under trio's MockClock).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Any

Address = Hashable
Handler = Callable[[Address, Any], None]  # handler(source, payload), called at delivery with net.now set


@dataclass(frozen=True, slots=True)
class Link:
    """How a directed link treats each datagram.

    ``loss`` and ``duplicate`` are probabilities per datagram; a copy arrives ``latency`` plus a uniform
    draw in [0, ``jitter``) seconds after it leaves (jitter reorders); ``bandwidth`` (bytes per second,
    None: unlimited) serialises datagrams on the link, so a burst leaves one after another."""

    loss: float = 0.0
    duplicate: float = 0.0
    latency: float = 0.0
    jitter: float = 0.0
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name in ("loss", "duplicate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        for name in ("latency", "jitter"):
            value = getattr(self, name)
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.bandwidth is not None and not 0.0 < self.bandwidth < float("inf"):
            raise ValueError(f"bandwidth must be a finite number of bytes per second > 0, got {self.bandwidth!r}")

    def fate(self, rng: random.Random) -> list[float]:
        """Delays of the copies that arrive (empty: lost). Draws: loss; if it arrives, duplication and one
        per copy (the order tests/memnet.py always drew in, so their seeds keep their loss patterns)."""
        if rng.random() < self.loss:
            return []
        copies = 2 if rng.random() < self.duplicate else 1
        return [self.latency + rng.random() * self.jitter for _ in range(copies)]


NAT_UNREPLIED_S = 30.0  # Linux conntrack: a UDP flow that never saw a reply (nf_conntrack_udp_timeout)
NAT_REPLIED_S = 120.0  # ... and one that did (nf_conntrack_udp_timeout_stream)


class NatBox:
    """One NAT router with one public IP, in front of some internal addresses.

    ``cone``: one mapping per internal socket, port-preserving where the port is free (Linux ``masquerade``);
    replies are filtered by remote address *and* port (port-restricted cone). ``symmetric``: a new public port
    per (internal socket, destination) (``masquerade random``), filtered the same way. A permission for one
    remote lives ``NAT_UNREPLIED_S`` after its last outbound datagram until something comes back from that
    remote, ``NAT_REPLIED_S`` after the last datagram either way from then on."""

    KINDS = ("cone", "symmetric")

    def __init__(self, host: str, kind: str, *, first_port: int = 20000) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"NAT kind must be one of {self.KINDS}, got {kind!r}")
        self.host = host
        self.kind = kind
        self._next_port = first_port
        self._map: dict[tuple, int] = {}  # (internal,) or (internal, remote) -> public port
        self._back: dict[int, Address] = {}  # public port -> internal address
        self._perm: dict[int, dict[Address, tuple[float, bool]]] = {}  # port -> remote -> (last, replied)
        self.filtered = 0  # inbound datagrams dropped by the filter

    @staticmethod
    def _alive(entry: tuple[float, bool] | None, now: float) -> bool:
        if entry is None:
            return False
        last, replied = entry
        return now - last <= (NAT_REPLIED_S if replied else NAT_UNREPLIED_S)

    def outbound(self, internal: Address, remote: Address, now: float) -> Address:
        """The public source address of a datagram ``internal`` sends to ``remote`` now (mapping it)."""
        key = (internal, remote) if self.kind == "symmetric" else (internal,)
        port = self._map.get(key)
        if port is not None and not any(self._alive(e, now) for e in self._perm[port].values()):
            del self._map[key], self._back[port], self._perm[port]  # expired: every permission timed out
            port = None
        if port is None:
            want = internal[1] if self.kind == "cone" and isinstance(internal, tuple) else None
            if want is None or want in self._back:
                while self._next_port in self._back:
                    self._next_port += 1
                want = self._next_port
                self._next_port += 1
            port = want
            self._map[key] = port
            self._back[port] = internal
            self._perm[port] = {}
        perms = self._perm[port]
        old = perms.get(remote)
        perms[remote] = (now, old is not None and old[1] and self._alive(old, now))
        return (self.host, port)

    def inbound(self, port: int, remote: Address, now: float) -> Address | None:
        """Where a datagram from ``remote`` to this box's ``port`` goes, or None (filtered)."""
        internal = self._back.get(port)
        perms = self._perm.get(port)
        if internal is None or perms is None or not self._alive(perms.get(remote), now):
            self.filtered += 1
            return None
        perms[remote] = (now, True)
        return internal

    def mappings(self) -> int:
        return len(self._map)


class Timer:
    """A callback at a virtual time; ``cancel`` stops it (it stays on the heap, skipped when it comes up)."""

    __slots__ = ("at", "fn", "args", "cancelled", "owner", "epoch")

    def __init__(self, at: float, fn: Callable[..., None], args: tuple, owner: Address | None, epoch: int) -> None:
        self.at = at
        self.fn = fn
        self.args = args
        self.cancelled = False
        self.owner = owner
        self.epoch = epoch

    def cancel(self) -> None:
        self.cancelled = True


class Network:
    """Virtual-time datagram network. ``run`` pops events until a time, a count, or none is left.

    ``trace``: when a list, every datagram sent, lost, delivered or dropped is appended to it as
    ``(time, what, source, destination, size)``, for tests that compare runs."""

    def __init__(self, rng: random.Random, *, default: Link | None = None, trace: list | None = None) -> None:
        self.rng = rng
        self.now = 0.0
        self.default = default if default is not None else Link()
        self.links: dict[tuple[Address, Address], Link] = {}
        self.trace = trace
        # (time, sequence, ...): a Timer (call_at), fn, args, owner, epoch (schedule; and live, schedule_while's),
        # or an arrival's source,
        # destination, payload, size, source and destination incarnations and departure time (send)
        self._heap: list[tuple] = []
        self._seq = 0
        self._handlers: dict[Address, Handler] = {}
        self._epoch: dict[Address, int] = {}  # incarnation per address: bumped by crash
        self._crashed_at: dict[tuple[Address, int], float] = {}  # (address, incarnation) -> when it crashed
        self._side: dict[Address, int] = {}  # partition group per address (0: not named in any group)
        self._busy: dict[tuple[Address, Address], float] = {}  # when a link with bandwidth is free again
        self._nat_of: dict[Address, NatBox] = {}  # internal address -> its NAT box
        self._nat_at: dict[str, NatBox] = {}  # a box's public host -> the box
        self.sent = self.lost = self.duplicated = self.delivered = self.dropped = 0
        self.events = 0  # events run (timers and arrivals), for profiling

    # -- nodes ----------------------------------------------------------------------------------
    def attach(self, addr: Address, handler: Handler) -> None:
        """Put a node at ``addr`` (a restart after ``crash`` is an attach with the new state's handler)."""
        if addr in self._handlers:
            raise ValueError(f"{addr!r} is already attached")
        self._handlers[addr] = handler
        self._epoch.setdefault(addr, 0)

    def crash(self, addr: Address) -> None:
        """The node at ``addr`` dies: what is in flight to it is lost, its timers never fire, and what it
        queued on a link but had not sent yet by now never leaves."""
        if self._handlers.pop(addr, None) is None:
            raise ValueError(f"{addr!r} is not attached")
        epoch = self._epoch[addr]
        self._crashed_at[(addr, epoch)] = self.now
        self._epoch[addr] = epoch + 1
        for key in [key for key in self._busy if key[0] == addr]:
            del self._busy[key]  # its queues died with it

    def alive(self, addr: Address) -> bool:
        return addr in self._handlers

    def set_link(self, src: Address, dst: Address, link: Link) -> None:
        """The link from ``src`` to ``dst`` (one direction) behaves as ``link``; others keep the default."""
        self.links[(src, dst)] = link

    def partition(self, *groups: set | frozenset | list | tuple) -> None:
        """Cut the network: nodes reach only nodes of their own group (every address named in no group
        forms one more group). Datagrams in flight across a cut are lost when they arrive."""
        self._side = {}
        for i, group in enumerate(groups, start=1):
            for addr in group:
                if addr in self._side:
                    raise ValueError(f"{addr!r} is named in two groups")
                self._side[addr] = i

    def heal(self) -> None:
        """Undo ``partition``: every node reaches every other again."""
        self._side = {}

    def reachable(self, src: Address, dst: Address) -> bool:
        side = self._side
        return not side or side.get(src, 0) == side.get(dst, 0)

    def add_nat(self, host: str, kind: str, internals: list | tuple = (), *, first_port: int = 20000) -> NatBox:
        """Put a NAT box with public IP ``host`` in front of the ``internals`` (``(host, port)`` addresses,
        attached as usual). Datagrams they send leave from the box's mapped address; datagrams to the box's
        address reach them only through its filter."""
        if host in self._nat_at:
            raise ValueError(f"a NAT box already has {host!r}")
        box = NatBox(host, kind, first_port=first_port)
        self._nat_at[host] = box
        for addr in internals:
            self.behind(addr, box)
        return box

    def behind(self, addr: Address, box: NatBox) -> None:
        if not isinstance(addr, tuple) or len(addr) != 2:
            raise ValueError(f"a node behind a NAT needs a (host, port) address, got {addr!r}")
        self._nat_of[addr] = box

    def nat_of(self, addr: Address) -> NatBox | None:
        return self._nat_of.get(addr)

    def _nat_in(self, dst: Address, src: Address) -> Address | None:
        """A datagram arriving at ``dst``, a box's public address: the internal node it goes to, or None."""
        if isinstance(dst, tuple) and len(dst) == 2:
            box = self._nat_at.get(dst[0])
            if box is not None:
                return box.inbound(dst[1], src, self.now)
        return None

    # -- datagrams ------------------------------------------------------------------------------
    def send(self, src: Address, dst: Address, payload: Any, size: int = 1) -> None:
        """``src`` sends ``payload`` (``size`` bytes on the wire) to ``dst``. A test may send from any
        ``src`` (a spoofed source); a crashed sender's datagrams never leave.

        ``Link.fate`` is inlined here (the same draws in the same order, so seeds keep their runs): this
        runs for every datagram of a simulation, millions at 10,000 nodes."""
        self.sent += 1
        if self._nat_of:
            box = self._nat_of.get(src)
            if box is not None and self.alive(src):
                src = box.outbound(src, dst, self.now)
        trace = self.trace
        if trace is not None:
            trace.append((self.now, "send", src, dst, size))
        link = self.links.get((src, dst), self.default) if self.links else self.default
        rng = self.rng
        if rng.random() < link.loss:
            lost = True
        else:
            duplicate = rng.random() < link.duplicate
            delay = link.latency + rng.random() * link.jitter
            if duplicate:
                delay2 = link.latency + rng.random() * link.jitter
            lost = bool(self._side) and not self.reachable(src, dst)
        if lost:
            self.lost += 1
            if trace is not None:
                trace.append((self.now, "lost", src, dst, size))
            return
        depart = self.now
        if link.bandwidth is not None:
            key = (src, dst)
            start = max(self.now, self._busy.get(key, 0.0))
            depart = start + size / link.bandwidth
            self._busy[key] = depart
        epochs = self._epoch
        src_epoch = epochs.get(src, 0)
        dst_epoch = epochs.get(dst, 0)
        heap = self._heap
        seq = self._seq = self._seq + 1
        heappush(heap, (depart + delay, seq, src, dst, payload, size, src_epoch, dst_epoch, depart))
        if duplicate:
            self.duplicated += 1
            seq = self._seq = seq + 1
            heappush(heap, (depart + delay2, seq, src, dst, payload, size, src_epoch, dst_epoch, depart))

    def _arrive(self, src: Address, dst: Address, payload: Any, size: int, src_epoch: int, dst_epoch: int,
                depart: float) -> None:
        handler = self._handlers.get(dst)
        if handler is None and self._nat_at:
            inner = self._nat_in(dst, src)
            if inner is not None:
                dst, handler, dst_epoch = inner, self._handlers.get(inner), self._epoch.get(inner, 0)
        died = self._crashed_at.get((src, src_epoch)) if self._crashed_at else None
        if (
            handler is None
            or self._epoch.get(dst, 0) != dst_epoch
            or (died is not None and depart > died)  # queued on the link when its sender crashed
            or (self._side and not self.reachable(src, dst))
        ):
            self.dropped += 1
            if self.trace is not None:
                self.trace.append((self.now, "drop", src, dst, size))
            return
        self.delivered += 1
        if self.trace is not None:
            self.trace.append((self.now, "recv", src, dst, size))
        handler(src, payload)

    # -- timers ---------------------------------------------------------------------------------
    def call_at(self, at: float, fn: Callable[..., None], *args: Any, owner: Address | None = None) -> Timer:
        """Call ``fn(*args)`` at virtual time ``at`` (never earlier than now). With ``owner``, the call is
        dropped if that node has crashed since."""
        epoch = self._epoch.get(owner, 0) if owner is not None else 0
        if at < self.now:
            at = self.now
        timer = Timer(at, fn, args, owner, epoch)
        self._seq += 1
        heappush(self._heap, (at, self._seq, timer))
        return timer

    def schedule(self, at: float, fn: Callable[..., None], args: tuple, owner: Address | None = None,
                 seq: int | None = None) -> None:
        """``call_at`` without a Timer to cancel: the heap entry is a plain tuple (the simulator's per-request
        timers, most of which find their request answered and do nothing).

        ``seq``: one ``reserve`` gave earlier. The call then runs exactly where one scheduled at that moment
        would have, among calls due at the same time, as long as it is scheduled before ``at`` (and the owner
        has not crashed in between: the owner's incarnation is read now)."""
        if at < self.now:
            at = self.now
        if seq is None:
            seq = self._seq = self._seq + 1
        heappush(self._heap, (at, seq, fn, args, owner, self._epoch.get(owner, 0) if owner is not None else 0))

    def schedule_while(self, at: float, fn: Callable[..., None], key: Hashable, live: Any, owner: Address) -> None:
        """``schedule(at, fn, (key,), owner)``, skipped without a call when ``key`` is no longer in ``live`` by
        then (a dict or set the caller keeps: a request's retransmission timer, ``live`` its requests in flight).
        A skipped call counts in no ``events``, as a cancelled Timer."""
        if at < self.now:
            at = self.now
        seq = self._seq = self._seq + 1
        heappush(self._heap, (at, seq, fn, key, owner, self._epoch.get(owner, 0), live))

    def reserve(self) -> int:
        """A place in the order of events, for a call that ``schedule(..., seq=)`` may add later (or never:
        one that would find nothing to do need not cost a heap entry)."""
        seq = self._seq = self._seq + 1
        return seq

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any, owner: Address | None = None) -> Timer:
        return self.call_at(self.now + delay, fn, *args, owner=owner)

    # -- running --------------------------------------------------------------------------------
    def next_time(self) -> float | None:
        """When the next event is due, or None when nothing is left."""
        return self._heap[0][0] if self._heap else None

    def run(self, until: float | None = None, *, max_events: int | None = None) -> int:
        """Run events in order until the next is after ``until`` (then now = ``until``), ``max_events``
        have run, or none is left. Returns the number run.

        Arrivals are handled inline (``_arrive``'s checks, without a call and an argument tuple per
        datagram): this loop runs every event of a simulation."""
        heap = self._heap
        epochs = self._epoch
        handlers = self._handlers
        crashed = self._crashed_at
        limit = math.inf if until is None else until
        budget = math.inf if max_events is None else max_events
        count = 0
        while heap:
            entry = heap[0]
            at = entry[0]
            if at > limit:
                break
            if count >= budget:
                self.events += count
                return count
            heappop(heap)
            self.now = at
            size = len(entry)
            if size == 7:  # schedule_while's: (at, seq, fn, key, owner, epoch, live)
                _, _, fn, key, owner, epoch, live = entry
                if key not in live or epochs.get(owner, 0) != epoch:
                    continue
                count += 1
                fn(key)
                continue
            if size == 6:  # schedule's: (at, seq, fn, args, owner, epoch)
                _, _, fn, args, owner, epoch = entry
                if owner is not None and epochs.get(owner, 0) != epoch:
                    continue
                count += 1
                fn(*args)
                continue
            if size == 3:  # call_at's: (at, seq, Timer)
                item = entry[2]
                if item.cancelled or (item.owner is not None and epochs.get(item.owner, 0) != item.epoch):
                    continue
                count += 1
                item.fn(*item.args)
                continue
            count += 1
            _, _, src, dst, payload, size, src_epoch, dst_epoch, depart = entry
            handler = handlers.get(dst)
            if handler is None and self._nat_at:
                inner = self._nat_in(dst, src)
                if inner is not None:
                    dst, handler = inner, handlers.get(inner)
                    dst_epoch = epochs.get(inner, 0)
            if (
                handler is None
                or epochs.get(dst, 0) != dst_epoch
                # a sender still in the incarnation it sent from has not crashed since (no tuple key to look up)
                or (crashed and epochs.get(src, 0) != src_epoch and (died := crashed.get((src, src_epoch))) is not None
                    and depart > died)
                or (self._side and not self.reachable(src, dst))
            ):
                self.dropped += 1
                if self.trace is not None:
                    self.trace.append((at, "drop", src, dst, size))
                continue
            self.delivered += 1
            if self.trace is not None:
                self.trace.append((at, "recv", src, dst, size))
            handler(src, payload)
        if until is not None and until > self.now:
            self.now = until
        self.events += count
        return count
