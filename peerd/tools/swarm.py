"""Run several real daemons as processes on 127.0.0.1: for `peerd swarm`, the benches and the tests.

With a lab (peerd.tools.lab.LinkLab or NatLab, root) daemon i runs in peer i's network namespace instead and listens on
its lab address, so the daemons talk over shaped, lossy links or through NAT routers; their local sockets stay on
the shared file system.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..localsock.client import DaemonError, LocalClient
from ..wire.identity import write_swarm_key

if TYPE_CHECKING:
    from .lab.links import NetnsLab


@dataclass
class Node:
    index: int
    proc: subprocess.Popen
    socket: str
    log_path: str
    status: dict[str, Any] = field(default_factory=dict)
    netns: str | None = None  # the lab namespace it runs in (its metrics listen on that namespace's loopback)

    @property
    def listen(self) -> str:
        return self.status["listen"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, op: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        with LocalClient(self.socket, timeout=timeout) as client:
            return client.call(op, **args)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class LocalSwarm:
    """Daemons in one swarm on 127.0.0.1; node 0 starts it and every other node bootstraps from it.

    With ``lab``, daemon i runs inside the lab's peer i (``ip netns exec``) on ``lab.addr(i)``, so the bootstrap
    address is node 0's lab address; a daemon's metrics (``--metrics``) then listen on its namespace's loopback:
    scrape them inside ``lab.entered(i)``. The swarm must be stopped before the lab closes."""

    def __init__(
        self,
        workdir: str | None = None,
        *,
        insecure: bool = False,
        metrics: bool = True,
        extra_args: tuple[str, ...] = (),
        lab: NetnsLab | None = None,
    ) -> None:
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="peerd-swarm-")
        os.makedirs(self.dir, exist_ok=True)
        self.insecure = insecure
        self.metrics = metrics
        self.extra_args = extra_args
        self.key_file = os.path.join(self.dir, "swarm.key")
        if not insecure and not os.path.exists(self.key_file):
            write_swarm_key(self.key_file)
        self.nodes: list[Node] = []
        self.lab = lab

    def command(self, index: int, *, bootstrap: str | None, key_file: str | None = None,
                extra: tuple[str, ...] = ()) -> list[str]:
        if self.lab is not None and index >= self.lab.peers:
            raise ValueError(f"daemon {index}: the link lab has only {self.lab.peers} peers")
        host = self.lab.addr(index) if self.lab is not None else "127.0.0.1"
        prefix = self.lab.exec_prefix(index) if self.lab is not None else []
        cmd = [*prefix, sys.executable, "-m", "peerd", "join", "--listen", f"{host}:0",
               "--socket", os.path.join(self.dir, f"peer{index}.sock")]
        cmd += ["--insecure"] if self.insecure else ["--swarm-key-file", key_file or self.key_file]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        if self.metrics:
            cmd += ["--metrics", "127.0.0.1:0"]
        return cmd + list(self.extra_args) + list(extra)

    def start(self, *, bootstrap: str | None = None, key_file: str | None = None,
              extra: tuple[str, ...] = ()) -> Node:
        """Start one more daemon (bootstrapping from node 0 unless told otherwise); does not wait."""
        index = len(self.nodes)
        if bootstrap is None and self.nodes:
            bootstrap = self.nodes[0].listen
        log_path = os.path.join(self.dir, f"peer{index}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                self.command(index, bootstrap=bootstrap, key_file=key_file, extra=extra),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        node = Node(index, proc, os.path.join(self.dir, f"peer{index}.sock"), log_path,
                    netns=self.lab.netns(index) if self.lab is not None else None)
        self.nodes.append(node)
        return node

    def wait_ready(self, node: Node, timeout: float = 60.0) -> dict[str, Any]:
        """Poll (gently) until the daemon answers on its socket; returns its status."""
        deadline = time.monotonic() + timeout
        while True:
            if not node.alive():
                raise DaemonError(f"peer {node.index} exited with {node.proc.returncode}:\n{node.log_tail()}")
            try:
                node.status = node.call("status", timeout=5.0)
                return node.status
            except DaemonError:
                if time.monotonic() > deadline:
                    raise DaemonError(f"peer {node.index} did not answer within {timeout:.0f} s") from None
                time.sleep(0.1)

    def wait_settled(self, timeout: float = 10.0) -> bool:
        """Poll (gently) until every daemon's routing table holds all the others (a swarm that bootstrapped from
        node 0 learns of each other within a few lookups), at most ``timeout`` s; whether they all did."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                counts = [node.call("status", timeout=5.0).get("peers", 0) for node in self.nodes]
            except DaemonError:
                counts = []
            if counts and min(counts) >= len(self.nodes) - 1:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def start_lossy(self, count: int, extra: tuple[str, ...], loss: float, seed: int) -> list[Node]:
        """``count`` daemons, each ready before the next starts; with ``loss``, each drops that share of what it
        receives (``--loss``, its own seed)."""
        nodes: list[Node] = []
        for i in range(count):
            lossy = ("--loss", str(loss), "--loss-seed", str(seed * 100 + i)) if loss else ()
            nodes.append(self.start(extra=(*extra, *lossy)))
            self.wait_ready(nodes[-1])
        return nodes

    def start_many(self, count: int, timeout: float = 120.0) -> list[Node]:
        first = not self.nodes
        started = []
        if first:
            started.append(self.start())
            self.wait_ready(started[0], timeout)
            count -= 1
        started += [self.start() for _ in range(count)]
        for node in started:
            self.wait_ready(node, timeout)
        return started

    def stop(self, timeout: float = 5.0) -> None:
        for node in self.nodes:
            if node.alive():
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def run_swarm(peers: int, *, base_port: int = 0, workdir: str | None = None, as_json: bool = False) -> int:
    """`peerd swarm`: start the daemons, say how to reach them, stop them all on Ctrl-C.

    With ``as_json`` the table is one JSON line on stdout (for scripts) and the words go to stderr."""
    swarm = LocalSwarm(workdir)
    out = sys.stderr if as_json else sys.stdout
    try:
        print(f"starting {peers} daemon{'s' if peers != 1 else ''} in {swarm.dir} ...", file=out, flush=True)
        for i in range(peers):
            extra = ("--listen", f"127.0.0.1:{base_port + i}") if base_port else ()
            node = swarm.start(extra=extra)
            swarm.wait_ready(node)
        if as_json:
            print(json.dumps({"dir": swarm.dir, "swarm_key": swarm.key_file, "peers": [
                {"index": n.index, "peer_id": n.status["peer_id"], "listen": n.status["listen"],
                 "metrics": n.status.get("metrics"), "socket": n.socket} for n in swarm.nodes]}), flush=True)
        print(f"\nswarm key: {swarm.key_file}\n", file=out)
        print(f"{'peer':>4}  {'udp':<21} {'metrics':<21} socket", file=out)
        for node in swarm.nodes:
            s = node.status
            print(f"{node.index:>4}  {s['listen']:<21} {s.get('metrics') or '-':<21} {node.socket}", file=out)
        first = swarm.nodes[0]
        print(
            f"\ntry:   peerd status --socket {first.socket}\n"
            f"       peerd dht put hello world --socket {first.socket}\n"
            f"       peerd dht get hello --socket {swarm.nodes[-1].socket}\n"
            f"join:  peerd join --listen 127.0.0.1:0 --bootstrap {first.listen} "
            f"--swarm-key-file {swarm.key_file} --socket /tmp/mine.sock\n"
            f"\nCtrl-C stops them all.",
            file=out,
            flush=True,
        )
        while True:
            for node in swarm.nodes:
                if not node.alive():
                    print(f"peer {node.index} exited with {node.proc.returncode}:\n{node.log_tail()}",
                          file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping ...", file=sys.stderr)
        return 0
    except DaemonError as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    finally:
        swarm.stop()
        if workdir is None:
            shutil.rmtree(swarm.dir, ignore_errors=True)
