"""The ``peerd`` command line, its commands grouped by task: run a node, try it, measure."""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import logging
import os
import sys
from typing import Any

from . import __version__
from .addresses import parse_hostport
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


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _positive(text: str) -> float:
    if (value := _number(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _fraction(text: str) -> float:
    if not 0.0 < (value := _number(text)) <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def _layout(text: str) -> tuple[int, int]:
    rows, sep, cols = text.lower().partition("x")
    if not (sep and rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
        raise argparse.ArgumentTypeError(f"--layout takes ROWSxCOLS (e.g. 6250x1000), not {text!r}")
    return int(rows), int(cols)


def _size(text: str) -> int:
    from .tools.bench.allreduce import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _robust(text: str) -> str:
    from .tools.demo_train import robust_option

    return robust_option(text)


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
LAB_GROUP = "fault injection and lab (testing only)"
# the fault injector's modes (tools.faults.MODES, spelled here so that parsing imports no numpy)
BYZANTINE_CHOICES = ("scale", "signflip", "nan", "random", "inflate-signflip")


def _lab(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The parser's argument group for fault-injection and lab options, made on first use."""
    for group in p._action_groups:
        if group.title == LAB_GROUP:
            return group
    return p.add_argument_group(LAB_GROUP)


def _deprecated(old: str, new: str) -> None:
    """One line on stderr for an old name that still works (for one release)."""
    print(f"peerd: warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


def _group_commands(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """Show the subcommands under COMMAND_GROUPS' titles in ``peerd --help`` (help entries only; parsing is
    the subparsers action's)."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for title, names in COMMAND_GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            group._group_actions.append(argparse.Action([], dest=name, metavar=name, help=helps[name]))


def build_parser() -> argparse.ArgumentParser:
    from .tools.linkargs import add_link_arguments  # (the lab's options; peerd/tools is reached lazily)

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
    p.add_argument("--bootstrap-timeout", type=_positive, default=300.0, metavar="S",
                   help="give up and exit non-zero if no bootstrap node answers for this long (default 300)")
    p.add_argument("--deadlines", choices=DEADLINE_MODES, default="auto",
                   help="auto: matchmaking, averaging, step and state-sync deadlines tune themselves from what the "
                        "node measured, the flags and constants as upper bounds; fixed: those constants (default auto)")
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
    lab = _lab(p)
    lab.add_argument("--loss", type=float, default=0.0, metavar="P",
                     help="drop received datagrams with probability P, to see how training copes (default 0)")
    lab.add_argument("--loss-seed", type=int, default=None, metavar="K",
                     help="seed of --loss's drops, to repeat a run exactly (default: random)")
    # hidden: this daemon corrupts its own contributions, to test robust averaging
    lab.add_argument("--fault-byzantine", default=None, choices=BYZANTINE_CHOICES,
                     help=argparse.SUPPRESS)

    p = sub.add_parser("status", help="show a running daemon's identity and swarm view")
    _socket_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON (peer_view: the per-peer table)")

    p = sub.add_parser("top", help="show a running daemon's per-peer table, refreshed like top (q quits)")
    _socket_arg(p)
    p.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS", help="refresh period (default 1)")

    p = sub.add_parser("dht", help="put and get records in the swarm's DHT, through the local daemon")
    dht = p.add_subparsers(dest="dht_command", required=True, metavar="ACTION")
    put = dht.add_parser("put", help="store VALUE under KEY (under this node's subkey)")
    put.add_argument("key", metavar="KEY")
    put.add_argument("value", metavar="VALUE")
    put.add_argument("--ttl", type=_positive, default=3600.0, metavar="SECONDS", help="lifetime (default 3600)")
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

    p = sub.add_parser("bench", help="benchmarks with real daemons on 127.0.0.1")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    b = bench.add_parser("allreduce", help="N daemons average seeded vectors as one group over UDP")
    b.add_argument("--peers", type=int, default=4, metavar="N", help="daemons in the group (default 4)")
    b.add_argument("--size", type=_size, default=1_000_000, metavar="S",
                   help="float32 elements (1000, 250K, 25M) or bytes with a B suffix (100MB); default 1M")
    b.add_argument("--repeat", type=int, default=5, metavar="R",
                   help="averages to time (default 5; median); peerd_p99_s and gloo_p99_s mean something only "
                        "with R >= 20 (below that they are close to the slowest run)")
    b.add_argument("--loss", type=float, default=0.0, metavar="P",
                   help="each daemon drops received datagrams with probability P (default 0)")
    b.add_argument("--mtu", type=int, default=1200, metavar="B", help="UDP payload bytes (default 1200)")
    b.add_argument("--insecure", action="store_true", help="no AEAD sealing")
    b.add_argument("--no-gso", action="store_true", help="one syscall per datagram")
    b.add_argument("--baseline", choices=["gloo"], default=None,
                   help="also time torch.distributed's gloo all-reduce on the same vectors, alternating with peerd, "
                        "and report the ratio (needs torch; default: peerd alone)")
    b.add_argument("--compare-gloo", action="store_true", help=argparse.SUPPRESS)  # deprecated: --baseline gloo
    b.add_argument("--seed", type=int, default=0, help="seed of vectors, weights and loss (default 0)")
    b.add_argument("--robust", default="off", type=_robust, metavar="off|clip[:C]|centered[:C]",
                   help="norm clipping at each shard owner, to time what it costs (default off)")
    b.add_argument("--profile", action="store_true",
                   help="add CPU seconds per daemon by stage (seal, open, receive, syscalls, ...) to the JSON")
    b.add_argument("--compression", default="fp32", choices=("fp32", "fp16", "bf16", "int8", "int4", "arc-topk"),
                   help="how tensors travel: fp32 exact, fp16/bf16 half the bytes, int8/int4 a quarter/eighth "
                        "with a scale per group, or arc-topk (only the largest rows; needs --layout) (default fp32)")
    b.add_argument("--layout", type=_layout, default=None, metavar="RxC",
                   help="arc-topk: the vector as a stack of R x C matrices, any rest a 1-D tail (default: none)")
    b.add_argument("--topk-ratio", type=float, default=0.1, metavar="R",
                   help="arc-topk: share of each (matrix, shard) piece's rows averaged, in (0, 1] (default 0.1)")
    b.add_argument("--quant-group", type=int, default=128, metavar="G",
                   help="int8/int4: values per scale and min, 1..65535 (default 128)")
    b.add_argument("--rounding", default="stochastic", choices=("stochastic", "nearest"),
                   help="int8/int4 rounding (default stochastic: unbiased)")
    add_link_arguments(_lab(b))
    b.add_argument("--nat", default="none", choices=("none", "cone", "symmetric"),
                   help="root: the first peer public, every other behind its own NAT router of this kind in "
                        "network namespaces (cone: port-preserving masquerade; symmetric: a new random port per "
                        "destination, plus a public relay daemon outside the group); JSON adds relayed_fraction "
                        "and direct_pairs (default none)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bench.add_parser("moshpit", help="N daemons average random vectors by Moshpit rounds; deviation per round")
    b.add_argument("--peers", type=int, default=16, metavar="N", help="daemons in the swarm (default 16)")
    b.add_argument("--grid", metavar="MxM", help="exact grid conditions: N = M^d peers, one per cell, groups of M")
    b.add_argument("--rounds", type=int, default=3, metavar="R", help="Moshpit rounds (default 3)")
    b.add_argument("--size", type=_size, default=10_000, metavar="S", help="float32 elements (default 10000)")
    b.add_argument("--kill", type=int, default=0, metavar="K",
                   help="SIGKILL K random peers while round 1's group averaging is under way (default 0)")
    b.add_argument("--loss", type=float, default=0.0, metavar="P",
                   help="each daemon drops received datagrams with probability P (default 0)")
    b.add_argument("--window", type=float, default=3.0, metavar="SECONDS",
                   help="matchmaking window: a group that cannot fill closes after this (default 3)")
    b.add_argument("--seed", type=int, default=0, help="seed of vectors, cells and victims (default 0)")
    from .tools.demo_train import add_compression_arguments

    add_compression_arguments(b)
    add_link_arguments(_lab(b))
    b.add_argument("--json", action="store_true", help="print JSON")
    from .tools.bench.dht import add_parser as add_dht_parser
    add_dht_parser(bench)
    from .tools.bench.step import add_parser as add_step_parser
    add_step_parser(bench)
    from .tools.bench.caps import add_parser as add_caps_parser
    add_caps_parser(bench)
    from .tools.bench.deadlines import add_parser as add_deadlines_parser
    add_deadlines_parser(bench)
    from .tools.bench.peerview import add_parser as add_peerview_parser
    add_peerview_parser(bench)  # (sets bench_func: newer benches dispatch through it)
    b = bench.add_parser("soak", help="4 sealed daemons average while a member attacker and an outsider flood them")
    b.add_argument("--datagrams", type=int, default=1_000_000, metavar="N", help="attack datagrams (default 1M)")
    b.add_argument("--size", type=_size, default=1_000_000, metavar="S", help="float32 elements averaged (default 1M)")
    b.add_argument("--rate", type=float, default=6000.0, metavar="R",
                   help="attack datagrams/s outside the burst (default 6000)")
    b.add_argument("--burst-share", type=float, default=0.3, metavar="F",
                   help="share sent as fast as possible (default 0.3)")
    b.add_argument("--calm", type=float, default=8.0, metavar="SECONDS", help="no-attack phase first (default 8)")
    b.add_argument("--outsider-seconds", type=float, default=3.0, metavar="SECONDS",
                   help="the outsider-only phase measuring daemon CPU per junk datagram, and its idle baseline "
                        "before it, each this long (default 3; longer: less noise; 0 skips it)")
    b.add_argument("--seed", type=int, default=0, help="seed of inputs and attacks (default 0)")
    b.add_argument("--identities", type=int, default=64, metavar="K", help="attacker identities (default 64)")
    b.add_argument("--classes", metavar="A,B", help="only these attack classes (default: all)")
    b.add_argument("--json", action="store_true", help="print JSON only (no progress lines)")

    p = sub.add_parser("swarm", help="run N local daemons in one fresh swarm on 127.0.0.1 (Ctrl-C stops them)")
    p.add_argument("--peers", type=int, default=4, metavar="N", help="how many daemons (default 4)")
    p.add_argument("--base-port", type=int, default=0, metavar="PORT",
                   help="UDP port of the first daemon; others follow (default: free ports)")
    p.add_argument("--dir", metavar="PATH", help="where to keep keys and sockets (default: a new temp dir)")
    p.add_argument("--json", action="store_true",
                   help="once every daemon answers, print them as one JSON line (then run until Ctrl-C)")

    p = sub.add_parser("demo", help="N daemons and N trainers on 127.0.0.1 train a small model together (needs torch)")
    p.add_argument("--peers", type=int, default=4, metavar="N", help="daemons and trainers (default 4)")
    p.add_argument("--steps", type=int, default=200, metavar="S", help="training steps (default 200)")
    _lab(p).add_argument("--loss", type=float, default=0.0, metavar="P",
                         help="every daemon drops received datagrams with probability P (default 0)")
    _lab(p).add_argument("--compute-jitter", type=float, default=0.0, metavar="X",
                   help="trainers' micro-batches take 10 ms * (1 + X * Exp(1)) more (for DropCompute; default 0)")
    p.add_argument("--dropcompute", default="off", metavar="off|auto|SECONDS",
                   help="DropCompute threshold per step (default off)")
    p.add_argument("--average-every", type=int, default=10, metavar="K",
                   help="average parameters every K steps (default 10)")
    p.add_argument("--keep-rounds", type=int, default=None, metavar="R",
                   help="keep a complete Moshpit group R rounds (1: a new group every round; default 10)")
    p.add_argument("--micro", type=int, default=None, metavar="M",
                   help="micro-batches per step of 32 samples (default 8 with --compute-jitter, else 4)")
    p.add_argument("--seed", type=int, default=0, metavar="K", help="seed of weights, data order and loss (default 0)")
    _lab(p).add_argument("--byzantine", type=int, default=0, metavar="K",
                   help="K of the peers' daemons corrupt their contributions (a test; default 0); the summary's "
                        "accuracy and loss are the honest peers'")
    _lab(p).add_argument("--byzantine-mode", default="nan", choices=BYZANTINE_CHOICES,
                   help="how the --byzantine daemons corrupt their contributions: scale (x1000), signflip, nan, "
                        "random, inflate-signflip (negated, claiming 2**24 samples) (default nan)")
    p.add_argument("--robust", default="off", type=_robust, metavar="off|clip[:C]|centered[:C]",
                   help="robust aggregation every trainer asks for (default off)")
    add_compression_arguments(p)
    add_link_arguments(_lab(p))
    p.add_argument("--mode", choices=["sync", "overlap", "diloco"], default="sync",
                   help="sync: average gradients every step; overlap: the same, each bucket's average overlapping "
                        "backward and the next forward (DeAR); diloco: H local steps, then an outer step "
                        "(default sync)")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                   help="overlap: gradient bucket size in MB of float32 (default: demo-trainer's, 25)")
    p.add_argument("--sync-every", type=int, default=50, metavar="H",
                   help="diloco: inner steps per outer step (default 50)")
    p.add_argument("--fragments", type=int, default=1, metavar="F", help="diloco: streaming fragments (default 1)")
    p.add_argument("--model", choices=["mlp", "wide", "gpt"], default="mlp",
                   help="mlp: 4,810 parameters; wide: 64-2048-1024-10, 2.24 M parameters, so a 100 Mbit link "
                        "matters; gpt: a character-level transformer (0.84 M) on Python's own source, AdamW, "
                        "clipping, a cosine schedule (default mlp)")
    from .tools.demo import add_gpt_arguments

    add_gpt_arguments(p)
    p.add_argument("--baseline", choices=["gloo", "ddp"], default=None,
                   help="then train the same model on the same data, seeds and links with torch DDP over gloo "
                        "(in the same namespaces with --link) and report both times to --target-accuracy")
    p.add_argument("--target-accuracy", type=_fraction, default=0.93, metavar="A",
                   help="time_to_accuracy_s: until the peers' mean held-out accuracy (every 10 steps) reaches A "
                        "(default 0.93)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (progress goes to stderr)")

    p = sub.add_parser("demo-trainer", aliases=["train"],
                       help="the demo's trainer (a small model on handwritten digits) beside a running daemon "
                            "(needs torch)")
    from .tools.demo_train import add_train_arguments

    add_train_arguments(p)

    p = sub.add_parser("sim", help="virtual-time swarm of many peers' real protocol cores in one process")
    sim = p.add_subparsers(dest="sim_command", required=True, metavar="{dht,moshpit}")
    for name in ("dht", "moshpit"):
        importlib.import_module(f".tools.sim.{name}", __package__).add_arguments(sim)
    _group_commands(parser, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "train":
        _deprecated("'peerd train'", "'peerd demo-trainer'")
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
        _deprecated("'peerd keygen PATH'", "'peerd keygen --identity PATH'")
        args.identity = args.old_path
    if args.old_swarm_key:
        if args.swarm_key_file:
            parser.error("give the swarm key's path once: --swarm-key-file PATH")
        _deprecated("'peerd keygen --swarm-key PATH'", "'peerd keygen --swarm-key-file PATH'")
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
    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
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


def cmd_swarm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .tools.swarm import run_swarm

    if args.peers < 1:
        parser.error("--peers must be at least 1")
    return run_swarm(args.peers, base_port=args.base_port, workdir=args.dir, as_json=args.json)


def _check_link_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .tools.linkargs import check_link_arguments

    check_link_arguments(args, parser)


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if getattr(args, "bench_func", None) is not None:
        return args.bench_func(args, parser)
    if args.bench_command == "moshpit":
        return cmd_bench_moshpit(args, parser)
    if args.bench_command == "dht":
        from .tools.bench.dht import cmd_bench_dht
        return cmd_bench_dht(args, parser)
    if args.bench_command == "step":
        from .tools.bench.step import cmd_bench_step
        return cmd_bench_step(args, parser)
    if args.bench_command == "caps":
        from .tools.bench.caps import cmd_bench_caps
        return cmd_bench_caps(args, parser)
    if args.bench_command == "deadlines":
        from .tools.bench.deadlines import cmd_bench_deadlines
        return cmd_bench_deadlines(args, parser)
    if args.bench_command == "soak":
        from .tools.bench.soak import cmd_bench_soak
        return cmd_bench_soak(args, parser)
    from .tools.bench.allreduce import AllreduceBenchConfig, run_allreduce_bench

    if args.peers < 2:
        parser.error("--peers must be at least 2")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if not 576 <= args.mtu <= 65507:
        parser.error("--mtu must be between 576 and 65507 bytes")
    _check_link_args(args, parser)
    if args.compare_gloo:
        _deprecated("'peerd bench allreduce --compare-gloo'", "'--baseline gloo'")
        args.baseline = "gloo"
    if args.nat != "none":
        if args.baseline:
            parser.error("--baseline gloo cannot run with --nat (gloo's TCP does not traverse NATs)")
        if args.mtu > 1472:
            parser.error("--mtu above 1472 is refused with --nat: nothing may rely on IP fragmentation")
        from .tools.lab.links import LabError
        from .tools.lab.nat import NatLab

        lab = NatLab(["public", args.nat], args.link)
        try:
            lab.check_environment()
        except LabError as e:
            parser.error(f"--nat: {e}")
    if not 1 <= args.quant_group <= 65535:
        parser.error("--quant-group must be 1..65535")
    if args.compression == "arc-topk" and args.layout is None:
        parser.error("--compression arc-topk needs --layout RxC")
    if not 0.0 < args.topk_ratio <= 1.0:
        parser.error("--topk-ratio must be in (0, 1]")
    cfg = AllreduceBenchConfig(
        peers=args.peers, size=args.size, repeat=args.repeat, loss=args.loss, mtu=args.mtu,
        insecure=args.insecure, no_gso=args.no_gso, compare_gloo=args.baseline == "gloo", seed=args.seed,
        robust=args.robust, link=args.link, link_loss=args.link_loss, link_queue_ms=args.link_queue_ms,
        profile=args.profile,
        compression=args.compression, quant_group=args.quant_group, rounding=args.rounding, nat=args.nat,
        layout=args.layout, topk_ratio=args.topk_ratio,
    )
    result = run_allreduce_bench(cfg, quiet=False)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"peerd: {result['peerd_s']:.3f} s median over {cfg.repeat} averages of {cfg.size} float32 "
              f"among {cfg.peers} daemons (mtu {cfg.mtu}, loss {cfg.loss})")
        if "link_rate" in result:
            print(f"links: {result['link_rate']}, link loss {cfg.link_loss} (nftables dropped "
                  f"{result['link_drop_fraction']:.4f}), utilization {result['link_utilization']:.3f}")
        if "nat" in result:
            print(f"nat: {result['nat']} ({', '.join(result['reachability'])}), direct pairs "
                  f"{result['direct_pairs']}/{result['member_pairs']}, relayed fraction "
                  f"{result['relayed_fraction']:.3f}")
        if "gloo_s" in result:
            print(f"gloo:  {result['gloo_s']:.3f} s   ratio peerd/gloo = {result['ratio']:.2f}")
        print(f"received fraction {result['received_fraction']:.4f}, kernel drops {result['kernel_drops']}, "
              f"{result['bytes_sent_per_peer'] / 1e6:.1f} MB sent per peer per average")
        if "max_abs_err" in result:
            print(f"max abs error vs exact weighted mean: {result['max_abs_err']:.3g}")
        else:
            print(f"bias {result['bias']:.3g}, rmse {result['rmse']:.3g}")
    return 0


def cmd_bench_moshpit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .moshpit.keys import Grid
    from .tools.bench.moshpit import MoshpitBenchConfig, run_moshpit_bench

    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if not 0.2 <= args.window <= 600:
        parser.error("--window must be in [0.2, 600] seconds")
    _check_link_args(args, parser)
    try:
        grid = Grid.parse(args.grid) if args.grid else None
        cfg = MoshpitBenchConfig(peers=args.peers, grid=grid, rounds=args.rounds, size=args.size, kill=args.kill,
                                 loss=args.loss, seed=args.seed, window_s=args.window, link=args.link,
                                 link_loss=args.link_loss, link_queue_ms=args.link_queue_ms,
                                 compression=args.compression,
                                 quant_group=args.quant_group, rounding=args.rounding)
        cfg.check()
    except ValueError as e:
        parser.error(str(e))
    result = run_moshpit_bench(cfg, quiet=False)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r, (dev, sizes, secs) in enumerate(zip(result["deviation"], result["group_sizes"], result["round_s"],
                                                   strict=True)):
            groups = ", ".join(str(n) for n in sizes) or "none"
            print(f"round {r + 1}: deviation {dev:.3g}, {len(sizes)} group(s) of {groups} peers, {secs:.3f} s")
    return 0


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .tools.demo import DemoConfig, gpt_options, run_demo

    if args.peers < 1 or args.steps < 1:
        parser.error("--peers and --steps must be at least 1")
    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if args.keep_rounds is not None and not 1 <= args.keep_rounds <= 1000:
        parser.error("--keep-rounds must be in [1, 1000]")
    if args.micro is not None and not 1 <= args.micro <= 32:
        parser.error("--micro must be in [1, 32]")
    if not 0 <= args.byzantine < args.peers:
        parser.error("--byzantine must be in [0, --peers): at least one peer must be honest")
    _check_link_args(args, parser)
    if args.sync_every < 1 or not 1 <= args.fragments <= args.sync_every:
        parser.error("--sync-every must be at least 1 and --fragments in [1, --sync-every]")
    if args.bucket_mb is not None and not 0 < args.bucket_mb <= 1024:
        parser.error("--bucket-mb must be in (0, 1024]")
    if args.baseline and args.model != "gpt" and (args.mode == "diloco" or args.byzantine
                                                  or args.dropcompute != "off"):
        parser.error("--baseline gloo compares plain training: not with --mode diloco, --byzantine or --dropcompute")
    if args.mode == "diloco" and args.compression == "arc-topk":
        parser.error("--mode diloco takes --compression fp16, bf16, int8 or int4 (arc-topk's row selection and "
                     "error feedback are built for gradient vectors, not pseudo-gradients)")
    if (args.quant_group is not None or args.rounding is not None) and args.compression not in ("int8", "int4"):
        parser.error("--quant-group and --rounding go with --compression int8 or int4")
    if args.topk_ratio is not None and args.compression != "arc-topk":
        parser.error("--topk-ratio goes with --compression arc-topk")
    cfg = DemoConfig(peers=args.peers, steps=args.steps, loss=args.loss, compute_jitter=args.compute_jitter,
                     dropcompute=args.dropcompute, seed=args.seed, average_every=args.average_every, json=args.json,
                     keep_rounds=args.keep_rounds, micro=args.micro, byzantine=args.byzantine,
                     byzantine_mode=args.byzantine_mode, robust=args.robust, link=args.link,
                     link_loss=args.link_loss, link_queue_ms=args.link_queue_ms, mode=args.mode,
                     sync_every=args.sync_every, fragments=args.fragments,
                     model=args.model, baseline=args.baseline, target_accuracy=args.target_accuracy,
                     compression=args.compression, quant_group=args.quant_group, rounding=args.rounding,
                     bucket_mb=args.bucket_mb, topk_ratio=args.topk_ratio, **gpt_options(args, parser))
    try:
        summary = run_demo(cfg, log=lambda *a, **k: print(*a, **k, flush=True))  # progress as it happens, even piped
    except RuntimeError as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .tools.demo_train import run_train

    return run_train(args)


def cmd_sim(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return importlib.import_module(f".tools.sim.{args.sim_command}", __package__).run(args, parser)


_COMMANDS = {
    "sim": cmd_sim,
    "demo": cmd_demo,
    "demo-trainer": cmd_train,
    "train": cmd_train,
    "keygen": cmd_keygen,
    "join": cmd_join,
    "status": cmd_status,
    "top": cmd_top,
    "dht": cmd_dht,
    "swarm": cmd_swarm,
    "bench": cmd_bench,
}

if __name__ == "__main__":
    sys.exit(main(os.sys.argv[1:]))
