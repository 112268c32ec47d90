"""Wires the services of one node into one trio nursery, and leaves cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import signal
import socket as stdsocket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from . import __version__
from ._dataplane.heap import keep_freed_memory
from .addresses import family_of, format_hostport, peer_address, resolve_ip
from .allreduce.group import GroupAverage
from .allreduce.service import AllreduceService
from .deadlines import DeadlineMode, DeadlineTuner
from .dht import BootstrapError, DhtService
from .dht.core import REPLICAS
from .dht.reads import Agreed, AnyOf, Enough, Owners
from .linkcap import CapConfig, LinkCap
from .linkcap.shell import CapGate, CappedSocket, CapTicker, clamp_pacer, limit_senders
from .localsock.access import AccessError, resolve_group
from .localsock.server import LocalServer, OpError, SocketInUse
from .metrics import Metrics
from .moshpit.averager import PathsFirst
from .moshpit.matchmaking import REACH_RANK, REACH_UNKNOWN
from .moshpit.ops import MoshpitOps
from .moshpit.service import MAX_GROUP_DEFAULT, MoshpitService
from .nat.relay import DEFAULT_TOTAL_RATE
from .nat.service import NatService
from .peers import PeerFeed, swarm_view
from .peers.feed import NETWORK_PHASES
from .peers.natview import nat_view
from .peers.report import view_json
from .statesync import StateSync
from .status.deadlines import deadlines_json, feed_deadlines, publish_deadlines
from .status.page import StatusPage
from .status.page import serve as serve_http
from .trainer import TrainerService
from .transport import Endpoint
from .transport.udp import UdpSocket
from .wire.identity import Identity, KeyFileError, load_identity, load_swarm_key, node_id_of
from .wire.messages import MAX_CONTACTS, MAX_TTL_S
from .wire.native import check as check_dataplane
from .wire.native import dataplane
from .wire.native import hold as hold_dataplane_announcement

log = logging.getLogger("peerd")


class StartupError(Exception):
    """Startup failed in a way the operator can fix; the message says how (one line)."""


@dataclass
class DaemonConfig:
    listen: tuple[str, int] = ("0.0.0.0", 7411)
    announce: tuple[str, int] | None = None
    bootstrap: list[tuple[str, int]] = field(default_factory=list)
    bootstrap_timeout: float = 300.0
    identity_path: str | None = None
    swarm_key_file: str | None = None
    insecure: bool = False
    socket_path: str = ""
    socket_group: str | None = None  # a group (name or gid) whose members may use the local socket too
    metrics: tuple[str, int] | None = None
    mtu: int = 1200
    no_gso: bool = False
    loss: float = 0.0
    loss_seed: int | None = None
    delay_s: float = 0.0  # a propagation delay on what this node receives (benchmarks: the link lab has none)
    relay: bool = True  # relay for NATed peers when this node is public (PROTOCOL.md 18.4)
    max_group: int = MAX_GROUP_DEFAULT  # Moshpit groups of at most this many (a run's grid: Grid.for_swarm)
    dht_replicas: int = REPLICAS  # nodes closest to a key that this node's puts store on and full reads ask
    # lab only: what builds this node's averaging cores instead of GroupAverage (a fault injector: peerd.tools.faults)
    group_factory: Callable[..., GroupAverage] | None = None
    caps: CapConfig = field(default_factory=CapConfig)  # --max-upload, --max-download, --budget
    deadlines: DeadlineMode = "auto"  # --deadlines: tuned from measurements, or "fixed" (today's constants)




def _allreduce_kwargs(config: DaemonConfig) -> dict[str, Any]:
    """AllreduceService's optional arguments; a lab's group factory only when given, and only if this build's
    AllreduceService takes one (never silently an honest node that the test believes corrupt)."""
    if config.group_factory is None:
        return {}
    if "group_factory" not in inspect.signature(AllreduceService).parameters:
        raise StartupError("a fault injector was asked for, but this build's AllreduceService has no group_factory="
                           " to take it; update peerd (or drop the flag)")
    return {"group_factory": config.group_factory}


def _bind_udp(host: str, port: int) -> stdsocket.socket:
    ip = resolve_ip(host)
    sock = stdsocket.socket(family_of(ip), stdsocket.SOCK_DGRAM)
    try:
        sock.bind((ip, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(
                f"UDP port {format_hostport(ip, port)} is in use (another peerd on this host?): stop it, or give "
                f"this node its own --listen HOST:PORT (port 0 picks a free one) and --socket PATH"
            ) from None
        raise StartupError(f"cannot listen on {format_hostport(ip, port)}: {e.strerror}") from None
    return sock


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.started = time.monotonic()
        try:
            self.identity = load_identity(config.identity_path) if config.identity_path else Identity.generate()
            secret = None if config.insecure else load_swarm_key(config.swarm_key_file or "")
        except KeyFileError as e:
            raise StartupError(str(e)) from None
        try:  # after the keys: a startup that fails on them says only that
            check_dataplane()  # a PEERD_DATAPLANE that cannot be honoured is a startup error
            hold_dataplane_announcement()  # said by cmd_join once the log lines carry the port
        except RuntimeError as e:
            raise StartupError(str(e)) from None
        self.metrics = Metrics()
        allreduce_kwargs = _allreduce_kwargs(config)
        try:
            announce = peer_address(*config.announce) if config.announce else None
        except ValueError as e:
            raise StartupError(f"--announce: {e}") from None
        try:
            self.udp = _bind_udp(*config.listen)
        except ValueError as e:
            raise StartupError(f"--listen: {e}") from None
        self.listen = self.udp.getsockname()[:2]
        self.local: LocalServer | None = None
        self.http = None
        self.page = StatusPage()
        try:
            self._start(config, secret, announce, allreduce_kwargs)
        except BaseException:
            self.close()  # a failed startup leaves no socket file and no bound port behind
            raise

    def _start(self, config: DaemonConfig, secret: Any, announce: Any, allreduce_kwargs: dict[str, Any]) -> None:
        """Everything after the UDP bind; the caller closes what was opened if this raises."""
        try:
            group = resolve_group(config.socket_group) if config.socket_group else None
            self.local = local = LocalServer(config.socket_path, self.metrics, group)
        except (SocketInUse, AccessError) as e:
            raise StartupError(str(e)) from None
        if config.metrics is not None:
            try:
                self.http = serve_http(config.metrics[0], config.metrics[1], self.metrics.registry, self.page)
            except OSError as e:
                busy = " (another peerd on this host?)" if e.errno == errno.EADDRINUSE else ""
                raise StartupError(
                    f"cannot serve metrics on {format_hostport(*config.metrics)}: {e.strerror}{busy}; give this "
                    f"node its own --metrics PORT (0 picks a free one), or leave --metrics out"
                ) from None
        self.socket = UdpSocket(self.udp, gso=not config.no_gso)
        self.linkcap = LinkCap(config.caps, 0.0, datagram=config.mtu) if config.caps.active else None
        try:
            self.endpoint = Endpoint(
                self.socket if self.linkcap is None else CappedSocket(self.socket, self.linkcap),
                self.identity,
                secret,
                self.metrics,
                announce=announce,
                mtu=config.mtu,
                loss=config.loss,
                loss_seed=config.loss_seed,
                delay_s=config.delay_s,
            )
        except ValueError as e:
            raise StartupError(f"--announce: {e}") from None
        self.dht = DhtService(self.endpoint, self.metrics, replicas=config.dht_replicas)
        # NAT traversal (PROTOCOL.md section 18): reachability, punching through introducers, relaying
        self.nat = NatService(self.endpoint, self.metrics, relay=config.relay, contact_of=self._dht_contact,
                              on_verdict=self._on_reachability)
        # per-peer network view (peerd status, peerd top, the status page): fed by the endpoint's traffic hooks
        self.peers = PeerFeed(self.endpoint, self.metrics, self.nat, on_tick=self._on_view_tick)
        # matchmaking, phase, step and state-sync deadlines from what it measures (--deadlines fixed: the constants)
        self.deadlines = DeadlineTuner(config.deadlines)
        self.endpoint.traffic = self.peers
        self.allreduce = AllreduceService(self.endpoint, self.metrics, **allreduce_kwargs)
        paths = PathsFirst(self.allreduce, self.nat)
        self.moshpit = MoshpitService(
            self.endpoint, self.dht, paths, self.metrics,
            address=announce or self.listen, max_group=config.max_group, deadlines=self.deadlines,
        )  # (a path to every group member before tensor data: peerd/moshpit/averager.py)
        # a group's senders stay under its download-capped members' caps (whether or not this node has caps)
        paths.plan = lambda members: limit_senders(self.allreduce.pacer, members, self.moshpit.peer_caps, config.mtu)
        self.metrics.info.info({"version": __version__, "peer_id": self.identity.node_id.hex()})
        for op, handler in {
            "status": self._op_status,
            "dht_put": self._op_dht_put,
            "dht_get": self._op_dht_get,
            **MoshpitOps(self.moshpit).ops(),
        }.items():
            local.register(op, handler)
        # Trainers (peerd.torch) over the local socket: sessions average through Moshpit; snapshots for
        # joining peers are advertised in the DHT and served over STATE_GET/STATE_CHUNK.
        self.statesync = StateSync(self.endpoint, self.dht, self.metrics, advertise=announce or self.listen)
        if self.linkcap is not None:  # snapshots served and downloaded keep to the caps (linkcap.core)
            self.statesync.gate = CapGate(self.linkcap)
        self.trainer = TrainerService(self.metrics, self.moshpit.average, statesync=self.statesync,
                                      peer_id=self.identity.node_id.hex(), average_parts=self.moshpit.average_parts)
        self.statesync.deadlines = self.trainer.deadlines = self.trainer.outer.deadlines = self.deadlines
        self.trainer.register(local)

    def add_ops(self, ops: dict[str, Any]) -> None:
        """Serve more local-socket ops (name -> async handler): how tooling (``peerd.tools``) extends a daemon
        from outside, so the daemon itself imports none of it."""
        assert self.local is not None  # set by _start, which __init__ runs before returning
        for op, handler in ops.items():
            self.local.register(op, handler)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        self.udp.close()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT; raises StartupError if bootstrapping gives up."""
        keep_freed_memory()  # block buffers are reused, not faulted in afresh per block (peerd/_dataplane/heap.py)
        failed: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._watch_signals, nursery.cancel_scope)
                await nursery.start(self.endpoint.serve)
                await nursery.start(self.dht.run)
                await nursery.start(self.nat.run)
                await nursery.start(self.peers.run)
                await nursery.start(self.moshpit.run)
                if self.linkcap is not None:
                    await nursery.start(CapTicker(self.linkcap, self._received, self._on_caps).run)
                await nursery.start(self.trainer.run)
                await nursery.start(self.local.serve)
                log.info(
                    "peer %s listening on %s, local socket %s%s",
                    self.identity.node_id.hex()[:16],
                    format_hostport(*self.listen),
                    self.config.socket_path,
                    " (INSECURE: datagrams are not authenticated)" if self.config.insecure else "",
                )
                if self.config.bootstrap:
                    try:
                        await self.dht.bootstrap(self.config.bootstrap, timeout=self.config.bootstrap_timeout)
                    except BootstrapError as e:
                        # raised after the nursery closes: inside it, trio would wrap it in an ExceptionGroup
                        failed.append(f"{e} {self._bootstrap_hint()}")
                        nursery.cancel_scope.cancel()
                    else:
                        self.nat.start()  # the peers it reached while joining are its first observers
                else:
                    self.nat.start()  # (undecided until peers join: it tries again every 30 s)
                    self.dht.bootstrapped.set()
                    log.info("started a new swarm (no --bootstrap); others join with --bootstrap %s",
                             self._bootstrap_address())
        finally:
            self.close()
        if failed:
            raise StartupError(failed[0])

    def _bootstrap_address(self) -> str:
        """What another host should pass to --bootstrap: never 0.0.0.0 or ::, which only mean "every address"."""
        host, port = self.config.announce or self.listen
        if host in ("0.0.0.0", "::"):
            guess = _primary_ip(family_of(host))
            return (f"{format_hostport(guess, port)} (this host's address on its default route; on this host "
                    f"{format_hostport('127.0.0.1' if host == '0.0.0.0' else '::1', port)} also works)"
                    if guess else f"THIS_HOST_IP:{port}")
        return format_hostport(host, port)

    def _bootstrap_hint(self) -> str:
        """Why a bootstrap node can be up and still never answer: it drops what it cannot accept, silently."""
        reuse = f" (--identity {self.config.identity_path})" if self.config.identity_path else ""
        return (f"Likely causes: a different swarm key from the swarm's; another node already running with this "
                f"identity{reuse}; a firewall or a wrong address/port. 'peerd status' on the bootstrap node shows "
                f"its dropped datagrams by reason (auth: wrong swarm key; self: identity in use twice).")

    def _received(self) -> tuple[int, int]:
        """What arrived so far: payload bytes and (estimated from them) datagrams, for the download accounting."""
        nbytes = int(self.metrics.bytes_received._value.get())
        return nbytes, nbytes // self.config.mtu

    def _on_caps(self, core: LinkCap) -> None:
        """The caps in force changed: the averaging pacer's ceiling and the matchmaking records follow."""
        clamp_pacer(self.allreduce.pacer, core.pacer_ceiling())
        self.nat.relay.total_rate = core.relay_rate(DEFAULT_TOTAL_RATE)  # relaying for others: a share of the caps
        self.moshpit.cap_ad = core.advert()
        for st in self.moshpit.runs.values():
            st.core.cap_ad = self.moshpit.cap_ad

    def _dht_contact(self, node_id: bytes) -> tuple[str, int] | None:
        """Where the DHT knows ``node_id`` (for a peer first heard of through a relay)."""
        return next((c.addr for c in self.dht.core.table.contacts() if c.node_id == node_id), None)

    def _on_reachability(self, verdict: str, observed: tuple[str, int] | None) -> None:
        """A NATed node publishes its mapped address: Moshpit's records carry it instead of the listen address
        (which peers cannot reach), unless --announce names one. Every verdict goes into its announcements:
        matchmaking lets the most reachable members lead."""
        self.moshpit.reach = REACH_RANK.get(verdict, REACH_UNKNOWN)
        for st in self.moshpit.runs.values():  # (runs joined before the verdict: their next round has it)
            st.core.me = dataclasses.replace(st.core.me, reach=self.moshpit.reach)
        if self.config.announce or observed is None or verdict not in ("cone-nat", "symmetric-nat"):
            return
        self.moshpit.address = observed
        log.info("behind a NAT (%s): publishing the mapped address %s", verdict, format_hostport(*observed))

    async def _watch_signals(self, scope: trio.CancelScope, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                log.info("%s: leaving", signal.Signals(signum).name)
                scope.cancel()
                return

    def _on_view_tick(self) -> None:
        """Once a second, after the per-peer view's tick: the deadline tuner hears its RTTs, the metrics its
        deadlines; then the status page's snapshot."""
        feed_deadlines(self.deadlines, self.peers.table.statistics(), time.time())
        publish_deadlines(self.deadlines.statistics(), self.metrics)
        self._publish_page()

    def _publish_page(self) -> None:
        """The status page's snapshot (peerd/status/page.py), once a second while someone reads it; otherwise only
        each run's new last round, which the page lists among its recent rounds."""
        if self.http is None:
            return
        if not self.page.watched(time.monotonic()):
            for run, state in self.moshpit.runs.items():
                if state.last is not None and not self.page.seen(run, state.last.round):
                    self.page.note_round(run, dataclasses.asdict(state.last.statistics()))
            return
        trainers = []
        for session in self.trainer.statistics().sessions:
            t = dataclasses.asdict(session)
            phases = t.get("phases") or {}
            step = sum(phases.values())
            network = sum(phases.get(p, 0.0) for p in NETWORK_PHASES)
            trainers.append({**t, "network_share": network / step if step > 0 else None})
        node = {"peer_id": self.identity.node_id.hex(), "listen": format_hostport(*self.listen),
                "peers": self.dht.peer_count(), "uptime_s": round(time.monotonic() - self.started, 1),
                "reachability": nat_view(self.nat).reachability, "version": __version__}
        self.page.update({"node": node, "peer_view": view_json(self.peers.statistics(), swarm_view(self.metrics)),
                          "link": self._link_view(), "trainers": trainers,
                          "pacer": dataclasses.asdict(self.allreduce.pacer.statistics())},
                         dataclasses.asdict(self.moshpit.statistics())["runs"])

    def _link_view(self) -> dict[str, Any]:
        """The status page's link section: this node's caps (bits/s; None: no cap) and its use of them."""
        if self.linkcap is None:
            return {"cap_upload_bps": None, "cap_download_bps": None}
        st = self.linkcap.statistics()
        bits = (lambda v: None if v is None else round(8 * v))  # noqa: E731 - bytes/s to bits/s, None kept
        return {"cap_upload_bps": bits(st.upload_limit), "cap_download_bps": bits(st.download_limit),
                "upload_bps": bits(st.upload_rate), "download_bps": bits(st.download_rate),
                "budget": None if st.budget is None else dataclasses.asdict(st.budget)}

    # -- local socket ops -------------------------------------------------------------------------
    async def _op_status(self, request: dict[str, Any]) -> dict[str, Any]:
        dropped = {}
        for metric in self.metrics.datagrams_dropped.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    dropped[sample.labels["reason"]] = int(sample.value)
        return {
            "peer_id": self.identity.node_id.hex(),
            "listen": format_hostport(*self.listen),
            "peers": self.dht.peer_count(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "joined": self.dht.bootstrapped.is_set(),
            "records": len(self.dht.core.store),
            "insecure": self.config.insecure,
            "version": __version__,
            "gso": self.socket.gso,
            "dataplane": dataplane(),
            "metrics": format_hostport(*self.http.server_address[:2]) if self.http is not None else None,
            "datagrams_dropped": dropped,
            "moshpit": dataclasses.asdict(self.moshpit.statistics())["runs"],
            # each session's latest step by phase, codec and auto choice
            "trainers": [{k: v for k, v in dataclasses.asdict(s).items() if k != "auto" or v}
                         for s in self.trainer.statistics().sessions],
            "peer_view": view_json(self.peers.statistics(), swarm_view(self.metrics)),  # peerd/peers/report.py
            "caps": None if self.linkcap is None else dataclasses.asdict(self.linkcap.statistics()),
            "pacer": dataclasses.asdict(self.allreduce.pacer.statistics()),  # the uplink's rate, as it judges it
            "deadline_mode": self.deadlines.mode,
            "deadlines": deadlines_json(self.deadlines.statistics()),  # each with the measurement behind it
            **dataclasses.asdict(self.nat.statistics()),  # reachability, observed_addr, peers_known, paths, ...
        }

    async def _op_dht_put(self, request: dict[str, Any]) -> dict[str, Any]:
        key, value = _arg_bytes(request, "key"), _arg_bytes(request, "value")
        subkey = _arg_bytes(request, "subkey") if request.get("subkey") is not None else None
        if subkey is None:
            subkey = self.identity.node_id.hex().encode()
        ttl = request.get("ttl", 3600)
        if not isinstance(ttl, int | float) or not 0 < ttl <= MAX_TTL_S:
            raise OpError(f"ttl must be a number of seconds in (0, {MAX_TTL_S:.0f}]")
        try:
            result = await self.dht.put(key, subkey, value, float(ttl))
        except ValueError as e:
            raise OpError(str(e)) from None
        if result.stored == 0:
            raise OpError(f"no node stored the record (refused: {result.refused or 'no reachable nodes'})")
        return {"stored": result.stored, "refused": result.refused, "subkey": subkey.decode("utf-8", "replace")}

    async def _op_dht_get(self, request: dict[str, Any]) -> dict[str, Any]:
        key = _arg_bytes(request, "key")
        records = await self.dht.get(key, _enough(request))
        now, wall = trio.current_time(), time.time()
        return {
            "values": [
                {
                    "subkey": r.subkey,
                    "value": r.value,
                    "expires_at": round(wall + r.ttl(now), 3),
                    "owner": node_id_of(r.owner).hex(),
                }
                for r in records
            ]
        }


def _primary_ip(family: int) -> str | None:
    """The source address of this host's default route (no packet is sent), or None without one."""
    probe = stdsocket.socket(family, stdsocket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9) if family == stdsocket.AF_INET else ("2001:db8::1", 9))
        return str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()


MAX_OWNERS = 64  # node ids one early read may wait for


def _enough(request: dict[str, Any]) -> Enough | None:
    """The early-read form a dht_get asks for (dht/reads.py): ``agreed`` (n responders that hold the same
    newest records) and/or ``owners`` (node ids, hex: a record of each); either satisfied ends the read.
    Neither: the full read."""
    forms: list[Enough] = []
    agreed = request.get("agreed")
    if agreed is not None:
        if not isinstance(agreed, int) or isinstance(agreed, bool) or not 1 <= agreed <= MAX_CONTACTS:
            raise OpError(f"agreed must be a whole number of responders from 1 to {MAX_CONTACTS} (k)")
        forms.append(Agreed(agreed))
    owners = request.get("owners")
    if owners is not None:
        if not isinstance(owners, list) or not 1 <= len(owners) <= MAX_OWNERS:
            raise OpError(f"owners must be a list of 1 to {MAX_OWNERS} node ids (64 hex digits each)")
        try:
            ids = [bytes.fromhex(o) for o in owners if isinstance(o, str) and len(o) == 64]
        except ValueError:
            ids = []
        if len(ids) != len(owners):
            raise OpError("owners must be node ids: 64 hex digits each (see 'peerd status')")
        forms.append(Owners(ids))
    if not forms:
        return None
    return forms[0] if len(forms) == 1 else AnyOf(*forms)


def _arg_bytes(request: dict[str, Any], name: str) -> bytes:
    value = request.get(name)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes):
        return value
    raise OpError(f"{name} must be a string or bytes")
