"""The ``peerd`` command line, its commands grouped by task: run a node, try it, measure."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
from typing import Any

from . import __version__
from .addresses import parse_hostport
from .blas import one_blas_thread
from .cliargs import BYZANTINE_CHOICES, deprecated, lab_group, positive
from .deadlines import DEADLINE_MODES
from .linkcap.args import add_cap_arguments, cap_config
from .localsock.client import DaemonError, LocalClient, default_socket_path
from .status.text import render
from .status.top import run_top

DEFAULT_PORT = 7411


def _address(text: str, what: str, **kwargs: str) -> tuple[str, int]:
    if "://" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: give {what}, not a URL")
    try:
        return parse_hostport(text, **kwargs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _hostport(text: str) -> tuple[str, int]:
    return _address(text, "HOST:PORT (a UDP address)")


def _metrics_addr(text: str) -> tuple[str, int]:
    return _address(text, "HOST:PORT or a bare PORT", bare_port_host="127.0.0.1")


def _socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="the daemon's local socket (default: $PEERD_SOCKET, else $XDG_RUNTIME_DIR/peerd.sock, else "
             "/tmp/peerd-UID/peerd.sock)",
    )


# The top-level help lists the commands by task; every command is in exactly one group (tests/test_cli_groups.py).
COMMAND_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("run a node", ("keygen", "join", "status", "top", "dht")),
    ("try it", ("demo", "swarm", "demo-trainer")),
    ("measure", ("bench", "sim")),
)


def _group_commands(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """Show the subcommands under COMMAND_GROUPS' titles in ``peerd --help`` (help entries only; parsing is
    the subparsers action's)."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for title, names in COMMAND_GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            group._group_actions.append(argparse.Action([], dest=name, metavar=name, help=helps[name]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peerd",
        usage="%(prog)s [-h] [--version] COMMAND ...",
        description="Decentralized training daemon: joins a swarm, finds peers through a DHT, averages tensors.",
        epilog="'peerd COMMAND --help' shows a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"peerd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS, prog="peerd")

    p = sub.add_parser("keygen", help="write a new node identity and/or a new swarm secret (mode 0600)")
    p.add_argument("--identity", metavar="PATH", help="write a new node identity here (what join --identity reads)")
    p.add_argument("--swarm-key-file", metavar="PATH",
                   help="write a new swarm secret here (what join --swarm-key-file reads; give it to every member)")
    p.add_argument("old_path", metavar="PATH", nargs="?", help=argparse.SUPPRESS)  # deprecated: --identity
    p.add_argument("--swarm-key", dest="old_swarm_key", metavar="PATH", help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--json", action="store_true", help="print what was written as JSON, one object per file")

    p = sub.add_parser("join", help="run a daemon that joins (or, without --bootstrap, starts) a swarm")
    p.add_argument("--listen", type=_hostport, default=("0.0.0.0", DEFAULT_PORT), metavar="HOST:PORT",
                   help=f"UDP address to listen on (default 0.0.0.0:{DEFAULT_PORT}; port 0 picks a free one)")
    p.add_argument("--announce", type=_hostport, metavar="HOST:PORT",
                   help="address peers should use to reach this node, behind NAT or in containers (default: the "
                        "address packets come from)")
    p.add_argument("--bootstrap", type=_hostport, action="append", default=[], metavar="HOST:PORT",
                   help="a member of the swarm to join through (repeatable; default: none, which starts a new swarm)")
    p.add_argument("--bootstrap-timeout", type=positive, default=300.0, metavar="S",
                   help="give up and exit non-zero if no bootstrap node answers for this long (default 300)")
    p.add_argument("--deadlines", choices=DEADLINE_MODES, default="auto",
                   help="auto: matchmaking, averaging, step and state-sync deadlines tune themselves from what the "
                        "node measured, the flags and constants as upper bounds, and an average stops waiting for a "
                        "member whose daemon stops answering PINGs; fixed: those constants (default auto)")
    p.add_argument("--identity", metavar="PATH",
                   help="node identity from 'peerd keygen --identity' (default: a fresh one at every start)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--swarm-key-file", metavar="PATH",
                     help="the swarm's secret, from 'peerd keygen --swarm-key-file'")
    key.add_argument("--insecure", action="store_true",
                     help="do not authenticate datagrams: anyone who can reach the port can join (benchmarks only)")
    _socket_arg(p)
    p.add_argument("--socket-group", metavar="GROUP",
                   help="let members of this system group use the local socket too (status, trainers), besides "
                        "the daemon's own user (default: none, the daemon's user alone)")
    p.add_argument("--metrics", type=_metrics_addr, metavar="HOST:PORT",
                   help="serve Prometheus metrics here (a bare port binds 127.0.0.1; 0 picks a free port; "
                        "default: off)")
    p.add_argument("--mtu", type=int, default=1200, metavar="BYTES",
                   help="largest UDP payload to send (default 1200, which fits any Internet path; raise it only "
                        "on a LAN whose every hop carries larger frames)")
    p.add_argument("--no-gso", action="store_true",
                   help="send and receive one datagram per system call (for kernels or NICs where UDP batching "
                        "misbehaves)")
    p.add_argument("--no-relay", action="store_true",
                   help="never relay datagrams for NATed peers (default: relay, budgeted, when this node is public)")
    p.add_argument("--max-group", type=int, default=16, metavar="N",
                   help="average in groups of at most N members (2..64; default 16): a larger swarm averages "
                        "over a grid of such groups in several rounds")
    p.add_argument("--dht-replicas", type=int, default=None, metavar="R",
                   help="copies of each DHT record this node writes, on the R nodes closest to its key (1..20; "
                        "default 5): more survive heavier churn, each costs one more message per write and read")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="how much the daemon logs to stderr (default info)")
    add_cap_arguments(p)
    lab = lab_group(p)
    lab.add_argument("--loss", type=float, default=0.0, metavar="P",
                     help="drop received datagrams with probability P, to see how training copes (default 0)")
    lab.add_argument("--loss-seed", type=int, default=None, metavar="K",
                     help="seed of --loss's drops, to repeat a run exactly (default: random)")
    lab.add_argument("--delay", type=float, default=0.0, metavar="MS",
                     help="hold what this daemon receives MS milliseconds before handling it: a one-way propagation "
                          "delay (each round trip between two such daemons grows by twice it; default 0)")
    # hidden: this daemon corrupts its own contributions, to test robust averaging
    lab.add_argument("--fault-byzantine", default=None, choices=BYZANTINE_CHOICES,
                     help=argparse.SUPPRESS)

    p = sub.add_parser("status", help="show a running daemon's identity and swarm view")
    _socket_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON (peer_view: the per-peer table)")

    p = sub.add_parser("top", help="show a running daemon's per-peer table, refreshed like top (q quits)")
    _socket_arg(p)
    p.add_argument("--interval", type=positive, default=1.0, metavar="SECONDS", help="refresh period (default 1)")

    p = sub.add_parser("dht", help="put and get records in the swarm's DHT, through the local daemon")
    dht = p.add_subparsers(dest="dht_command", required=True, metavar="ACTION")
    put = dht.add_parser("put", help="store VALUE under KEY (under this node's subkey)")
    put.add_argument("key", metavar="KEY")
    put.add_argument("value", metavar="VALUE")
    put.add_argument("--ttl", type=positive, default=3600.0, metavar="SECONDS", help="lifetime (default 3600)")
    put.add_argument("--subkey", help="subkey to write (default: this node's peer id)")
    _socket_arg(put)
    put.add_argument("--json", action="store_true", help="print JSON")
    get = dht.add_parser("get", help="read every value under KEY")
    get.add_argument("key", metavar="KEY")
    get.add_argument("--agreed", type=int, metavar="N",
                     help="end the read once N responders hold the same newest records (faster; default: read "
                          "all r = 5 nodes that hold the key)")
    get.add_argument("--owner", action="append", metavar="PEER_ID",
                     help="end the read once a record of this peer id is found (repeatable)")
    _socket_arg(get)
    get.add_argument("--json", action="store_true", help="print JSON")

    from .tools.cli_tools import add_tool_commands  # (peerd/tools is reached lazily)

    add_tool_commands(sub)
    _group_commands(parser, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "train":
        deprecated("'peerd train'", "'peerd demo-trainer'")
    try:
        return _COMMANDS[args.command](args, parser)
    except DaemonError as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def cmd_keygen(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .wire.identity import write_identity, write_swarm_key

    if args.old_path:
        if args.identity:
            parser.error("give the identity's path once: --identity PATH")
        deprecated("'peerd keygen PATH'", "'peerd keygen --identity PATH'")
        args.identity = args.old_path
    if args.old_swarm_key:
        if args.swarm_key_file:
            parser.error("give the swarm key's path once: --swarm-key-file PATH")
        deprecated("'peerd keygen --swarm-key PATH'", "'peerd keygen --swarm-key-file PATH'")
        args.swarm_key_file = args.old_swarm_key
    if not args.identity and not args.swarm_key_file:
        parser.error("keygen needs --identity PATH (a node identity) and/or --swarm-key-file PATH (a new swarm "
                     "secret)")
    for kind, target in (("identity", args.identity), ("swarm_key", args.swarm_key_file)):
        if not target:
            continue
        try:
            if kind == "swarm_key":
                write_swarm_key(target)
                out: dict[str, Any] = {"kind": kind, "path": target}
                text = f"wrote a new swarm key to {target}; give it (securely) to every member of the swarm"
            else:
                ident = write_identity(target)
                out = {"kind": kind, "path": target, "peer_id": ident.node_id.hex()}
                text = f"wrote identity {ident.node_id.hex()} to {target}"
            print(json.dumps(out) if args.json else text)
        except FileExistsError:
            print(f"peerd: error: {target} exists; refusing to overwrite a key (remove it first)", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"peerd: error: cannot write {target}: {e.strerror}", file=sys.stderr)
            return 1
    return 0


def _fault_factory(mode: str | None) -> Any:
    """The averaging cores of a ``--fault-byzantine`` daemon (a lab's fault injector), or None for honest ones."""
    if mode is None:
        return None
    from .tools.faults import byzantine

    return byzantine(mode)


def cmd_join(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import trio

    from .daemon import Daemon, DaemonConfig, StartupError

    if not args.insecure and not args.swarm_key_file:
        parser.error(
            "join needs --swarm-key-file PATH (create one with 'peerd keygen --swarm-key-file PATH'), "
            "or --insecure for a throwaway swarm"
        )
    if not 576 <= args.mtu <= 65507:
        parser.error("--mtu must be between 576 and 65507 bytes")
    if not 2 <= args.max_group <= 64:
        parser.error("--max-group must be between 2 and 64 members")
    if args.dht_replicas is not None and not 1 <= args.dht_replicas <= 20:
        parser.error("--dht-replicas must be between 1 and 20 (the DHT's bucket size k)")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    _log_format(args.listen[1] or "?")  # port 0: the bound port, once known
    one_blas_thread()  # the daemon's products are small; the trainer keeps the other cores
    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if not 0.0 <= args.delay <= 1000.0:
        parser.error("--delay must be in [0, 1000] milliseconds")
    config = DaemonConfig(
        listen=args.listen,
        announce=args.announce,
        bootstrap=args.bootstrap,
        bootstrap_timeout=args.bootstrap_timeout,
        identity_path=args.identity,
        swarm_key_file=args.swarm_key_file,
        insecure=args.insecure,
        socket_path=args.socket or default_socket_path(),
        socket_group=args.socket_group,
        metrics=args.metrics,
        mtu=args.mtu,
        no_gso=args.no_gso,
        max_group=args.max_group,
        **({} if args.dht_replicas is None else {"dht_replicas": args.dht_replicas}),
        loss=args.loss,
        loss_seed=args.loss_seed,
        delay_s=args.delay / 1000.0,
        relay=not args.no_relay,
        group_factory=_fault_factory(args.fault_byzantine),
        caps=cap_config(args, args.identity),
        deadlines=args.deadlines,
    )
    try:
        daemon = Daemon(config)
    except StartupError as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    _log_format(daemon.listen[1])
    from .tools.bench.ops import install_bench_ops
    from .wire.native import announce

    install_bench_ops(daemon)  # what `peerd bench allreduce` drives (tooling, added from outside the daemon)

    announce(now=True)  # which data plane runs, and why: once the log lines carry the port
    if args.insecure:
        logging.getLogger("peerd").warning(
            "--insecure: datagrams are NOT authenticated; anyone who reaches this port can join and inject data"
        )
    if args.fault_byzantine:
        logging.getLogger("peerd").warning(
            "--fault-byzantine %s: FAULT INJECTION, this daemon CORRUPTS its own averaging contributions "
            "(a test of robust averaging); never run it in a real swarm", args.fault_byzantine
        )
    try:
        profile_path = os.environ.get("PEERD_PROFILE")  # developers: write cProfile stats here on exit
        if profile_path:
            import cProfile

            cProfile.runctx("trio.run(daemon.run)", globals(), {"trio": trio, "daemon": daemon}, profile_path)
        else:
            trio.run(daemon.run)
    except StartupError as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    return 0


def _log_format(port: int | str) -> None:
    """The daemon's log lines carry its UDP port (several daemons on one host share a terminal)."""
    fmt = logging.Formatter(f"%(asctime)s peerd[{port}] %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(fmt)


def cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with LocalClient(args.socket, timeout=10) as client:
        reply = client.call("status")
    reply.pop("ok", None)
    print(json.dumps(reply, indent=2) if args.json else render(reply))
    return 0


def cmd_top(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with LocalClient(args.socket, timeout=10) as client:
        return run_top(lambda: client.call("status"), args.interval)


def _text(data: bytes) -> dict[str, Any]:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode()}


def cmd_dht(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with LocalClient(args.socket, timeout=60) as client:
        if args.dht_command == "put":
            reply = client.call("dht_put", key=args.key, value=args.value, ttl=args.ttl, subkey=args.subkey)
            if args.json:
                print(json.dumps({"key": args.key, "subkey": reply["subkey"], "stored": reply["stored"],
                                  "refused": reply.get("refused") or {}, "ttl": args.ttl}, indent=2))
            else:
                print(f"stored {args.key} on {reply['stored']} node(s) under subkey {reply['subkey']}")
            return 0
        early: dict[str, Any] = {}
        if args.agreed is not None:
            early["agreed"] = args.agreed
        if args.owner:
            early["owners"] = args.owner
        reply = client.call("dht_get", key=args.key, **early)
    values = []
    for v in reply["values"]:
        item: dict[str, Any] = {}
        for name in ("subkey", "value"):
            decoded = _text(v[name])
            item[name] = decoded.get("text", decoded.get("base64"))
            if "base64" in decoded:
                item[f"{name}_encoding"] = "base64"
        item["expires_at"] = v["expires_at"]
        item["owner"] = v["owner"]
        values.append(item)
    if args.json:
        print(json.dumps({"key": args.key, "values": values}, indent=2))
    if not values:  # exit 1 with and without --json: a script can test the exit code alone
        print(f"no values under {args.key}", file=sys.stderr)
        return 1
    if args.json:
        return 0
    import time

    for item in values:
        print(f"{item['subkey']}\t{item['value']}\t(expires in {item['expires_at'] - time.time():.0f} s)")
    return 0


def cmd_tool(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A tooling command (bench, swarm, demo, demo-trainer, sim): peerd/tools/cli_tools.py runs it."""
    from .tools.cli_tools import TOOL_COMMANDS

    return TOOL_COMMANDS[args.command](args, parser)


_COMMANDS = {
    "keygen": cmd_keygen,
    "join": cmd_join,
    "status": cmd_status,
    "top": cmd_top,
    "dht": cmd_dht,
    **dict.fromkeys(("bench", "swarm", "demo", "demo-trainer", "train", "sim"), cmd_tool),
}

if __name__ == "__main__":
    sys.exit(main(os.sys.argv[1:]))
