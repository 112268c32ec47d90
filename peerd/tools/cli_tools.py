"""The tooling's commands: `peerd bench`, `swarm`, `demo`, `demo-trainer` (`train`) and `sim`, their options and
what runs them. ``peerd.cli`` adds them to its parser and hands them their arguments; this module imports the
tooling each one needs when it runs, so that parsing stays cheap."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from types import ModuleType

from ..cliargs import BYZANTINE_CHOICES, bucket_mb, deprecated, fraction, lab_group, period
from .linkargs import add_link_arguments, check_link_arguments

# The benches whose module under tools/bench/ adds its own sub-parser (``add_parser(bench)``) and runs it
# (``cmd_bench_<name>(args, parser)``), in the order `peerd bench --help` lists them, between moshpit and soak.
# A new bench is one more name here.
BENCH_MODULES: tuple[str, ...] = ("dht", "step", "caps", "deadlines", "peerview")


def _layout(text: str) -> tuple[int, int]:
    rows, sep, cols = text.lower().partition("x")
    if not (sep and rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
        raise argparse.ArgumentTypeError(f"--layout takes ROWSxCOLS (e.g. 6250x1000), not {text!r}")
    return int(rows), int(cols)


def _size(text: str) -> int:
    from .bench.allreduce import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _robust(text: str) -> str:
    from .demo_train import robust_option

    return robust_option(text)


def _bench_module(name: str) -> ModuleType:
    return importlib.import_module(f".bench.{name}", __package__)


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """bench, swarm, demo, demo-trainer and sim under the command line's subparsers, in that order."""
    p = sub.add_parser("bench", help="benchmarks with real daemons on 127.0.0.1")
    add_bench_commands(p.add_subparsers(dest="bench_command", required=True, metavar="BENCH"))
    _add_swarm(sub)
    _add_demo(sub)
    _add_demo_trainer(sub)
    _add_sim(sub)


def add_bench_commands(bench: argparse._SubParsersAction) -> None:
    """Every `peerd bench` sub-parser: allreduce, moshpit, then BENCH_MODULES', then soak."""
    _add_bench_allreduce(bench)
    _add_bench_moshpit(bench)
    for name in BENCH_MODULES:
        _bench_module(name).add_parser(bench)
    _add_bench_soak(bench)


def _add_bench_allreduce(bench: argparse._SubParsersAction) -> None:
    """`peerd bench allreduce`'s options."""
    b = bench.add_parser("allreduce", help="N daemons average seeded vectors as one group over UDP")
    b.add_argument("--peers", type=int, default=4, metavar="N", help="daemons in the group (default 4)")
    b.add_argument("--size", type=_size, default=1_000_000, metavar="S",
                   help="float32 elements (1000, 250K, 25M) or bytes with a B suffix (100MB); default 1M")
    b.add_argument("--repeat", type=int, default=5, metavar="R",
                   help="averages to time (default 5; median); peerd_p99_s and gloo_p99_s mean something only "
                        "with R >= 20 (below that they are close to the slowest run)")
    b.add_argument("--loss", type=float, default=0.0, metavar="P",
                   help="each daemon drops received datagrams with probability P (default 0)")
    b.add_argument("--delay", type=float, default=0.0, metavar="MS",
                   help="each daemon holds what it receives MS milliseconds (peerd join --delay): round trips 2 MS "
                        "longer, as on a WAN (default 0; not with --baseline, whose TCP would not see it)")
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
    add_link_arguments(lab_group(b))
    b.add_argument("--nat", default="none", choices=("none", "cone", "symmetric"),
                   help="root: the first peer public, every other behind its own NAT router of this kind in "
                        "network namespaces (cone: port-preserving masquerade; symmetric: a new random port per "
                        "destination, plus a public relay daemon outside the group); JSON adds relayed_fraction "
                        "and direct_pairs (default none)")
    b.add_argument("--json", action="store_true", help="print JSON")


def _add_bench_moshpit(bench: argparse._SubParsersAction) -> None:
    """`peerd bench moshpit`'s options."""
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
    from .demo_train import add_compression_arguments

    add_compression_arguments(b)
    add_link_arguments(lab_group(b))
    b.add_argument("--json", action="store_true", help="print JSON")


def _add_bench_soak(bench: argparse._SubParsersAction) -> None:
    """`peerd bench soak`'s options."""
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


def _add_swarm(sub: argparse._SubParsersAction) -> None:
    """`peerd swarm`'s options."""
    p = sub.add_parser("swarm", help="run N local daemons in one fresh swarm on 127.0.0.1 (Ctrl-C stops them)")
    p.add_argument("--peers", type=int, default=4, metavar="N", help="how many daemons (default 4)")
    p.add_argument("--base-port", type=int, default=0, metavar="PORT",
                   help="UDP port of the first daemon; others follow (default: free ports)")
    p.add_argument("--dir", metavar="PATH", help="where to keep keys and sockets (default: a new temp dir)")
    p.add_argument("--json", action="store_true",
                   help="once every daemon answers, print them as one JSON line (then run until Ctrl-C)")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """`peerd demo`'s options."""
    from .demo_train import add_compression_arguments

    p = sub.add_parser("demo", help="N daemons and N trainers on 127.0.0.1 train a small model together (needs torch)")
    p.add_argument("--peers", type=int, default=4, metavar="N", help="daemons and trainers (default 4)")
    p.add_argument("--steps", type=int, default=200, metavar="S", help="training steps (default 200)")
    lab_group(p).add_argument("--loss", type=float, default=0.0, metavar="P",
                         help="every daemon drops received datagrams with probability P (default 0)")
    lab_group(p).add_argument("--compute-jitter", type=float, default=0.0, metavar="X",
                   help="trainers' micro-batches take 10 ms * (1 + X * Exp(1)) more (for DropCompute; default 0)")
    p.add_argument("--dropcompute", default="off", metavar="off|auto|SECONDS",
                   help="DropCompute threshold per step (default off)")
    p.add_argument("--average-every", type=period, default=None, metavar="K|auto",
                   help="average parameters every K steps (0: never; auto: peerd.torch's choice, 10 or longer once "
                        "rounds end on the group's common result; default auto with --model gpt, else 10)")
    p.add_argument("--keep-rounds", type=int, default=None, metavar="R",
                   help="keep a complete Moshpit group R rounds (1: a new group every round; default 100)")
    p.add_argument("--micro", type=int, default=None, metavar="M",
                   help="micro-batches per step of 32 samples (default 8 with --compute-jitter, else 4)")
    p.add_argument("--seed", type=int, default=0, metavar="K", help="seed of weights, data order and loss (default 0)")
    lab_group(p).add_argument("--byzantine", type=int, default=0, metavar="K",
                   help="K of the peers' daemons corrupt their contributions (a test; default 0); the summary's "
                        "accuracy and loss are the honest peers'")
    lab_group(p).add_argument("--byzantine-mode", default="nan", choices=BYZANTINE_CHOICES,
                   help="how the --byzantine daemons corrupt their contributions: scale (x1000), signflip, nan, "
                        "random, inflate-signflip (negated, claiming 2**24 samples) (default nan)")
    p.add_argument("--robust", default="off", type=_robust, metavar="off|clip[:C]|centered[:C]",
                   help="robust aggregation every trainer asks for (default off)")
    add_compression_arguments(p)
    add_link_arguments(lab_group(p))
    p.add_argument("--mode", choices=["sync", "overlap", "diloco"], default="sync",
                   help="sync: average gradients every step; overlap: the same, each bucket's average overlapping "
                        "backward and the next forward (DeAR); diloco: H local steps, then an outer step "
                        "(default sync)")
    p.add_argument("--bucket-mb", type=bucket_mb, default=None, metavar="MB",
                   help="overlap: gradient bucket size in MB of float32, or auto (the default: 25 MB, and half the "
                        "model tried at steps 10-14; the run keeps the faster)")
    p.add_argument("--sync-every", type=int, default=20, metavar="H",
                   help="diloco: inner steps per outer step (default 20: enough outer steps for a run of a few "
                        "hundred steps)")
    p.add_argument("--fragments", type=int, default=1, metavar="F", help="diloco: streaming fragments (default 1)")
    p.add_argument("--overlap-outer", action="store_true",
                   help="diloco (--model gpt): each outer step's average travels while the next inner step runs "
                        "(DiLoCo(overlap_outer=True))")
    p.add_argument("--no-keep-pace", action="store_true",
                   help="diloco (--model gpt): a replica the others wait for at outer steps does not count inner "
                        "steps forward to keep their pace (DiLoCo(keep_pace=False))")
    p.add_argument("--model", choices=["mlp", "wide", "gpt"], default="mlp",
                   help="mlp: 4,810 parameters; wide: 64-2048-1024-10, 2.24 M parameters, so a 100 Mbit link "
                        "matters; gpt: a character-level transformer (0.84 M) on Python's own source, AdamW, "
                        "clipping, a cosine schedule (default mlp)")
    from .demo import add_gpt_arguments

    add_gpt_arguments(p)
    p.add_argument("--baseline", choices=["gloo", "ddp", "hivemind"], default=None,
                   help="then train the same model on the same data, seeds and links with torch DDP over gloo "
                        "(in the same namespaces with --link) and report both times to --target-accuracy; "
                        "hivemind (--model gpt): under hivemind.Optimizer as its quickstart wraps an optimizer, "
                        "local updates averaged every --sync-every steps (needs pip install hivemind==1.1.12), "
                        "timed to --target-loss where given")
    p.add_argument("--hivemind-matchmaking", type=float, default=None, metavar="S",
                   help="with --baseline hivemind: hivemind.Optimizer's matchmaking_time (default: its quickstart's "
                        "3.0 s)")
    p.add_argument("--target-accuracy", type=fraction, default=0.93, metavar="A",
                   help="time_to_accuracy_s: until the peers' mean held-out accuracy (every 10 steps) reaches A "
                        "(default 0.93)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (progress goes to stderr)")


def _add_demo_trainer(sub: argparse._SubParsersAction) -> None:
    """`peerd demo-trainer`'s options (and its old name, `peerd train`)."""
    p = sub.add_parser("demo-trainer", aliases=["train"],
                       help="the demo's trainer (a small model on handwritten digits) beside a running daemon "
                            "(needs torch)")
    from .demo_train import add_train_arguments

    add_train_arguments(p)


def _add_sim(sub: argparse._SubParsersAction) -> None:
    """`peerd sim`'s simulations, each module's own options."""
    p = sub.add_parser("sim", help="virtual-time swarm of many peers' real protocol cores in one process")
    sim = p.add_subparsers(dest="sim_command", required=True, metavar="{dht,moshpit}")
    for name in ("dht", "moshpit"):
        importlib.import_module(f".sim.{name}", __package__).add_arguments(sim)


def cmd_swarm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .swarm import run_swarm

    if args.peers < 1:
        parser.error("--peers must be at least 1")
    return run_swarm(args.peers, base_port=args.base_port, workdir=args.dir, as_json=args.json)


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    name = args.bench_command
    if name in BENCH_MODULES or name == "soak":
        return getattr(_bench_module(name), f"cmd_bench_{name}")(args, parser)
    if name == "moshpit":
        return cmd_bench_moshpit(args, parser)
    return cmd_bench_allreduce(args, parser)


def cmd_bench_allreduce(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench.allreduce import AllreduceBenchConfig, run_allreduce_bench

    if args.peers < 2:
        parser.error("--peers must be at least 2")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if not 576 <= args.mtu <= 65507:
        parser.error("--mtu must be between 576 and 65507 bytes")
    check_link_arguments(args, parser)
    if args.compare_gloo:
        deprecated("'peerd bench allreduce --compare-gloo'", "'--baseline gloo'")
        args.baseline = "gloo"
    if args.nat != "none":
        if args.baseline:
            parser.error("--baseline gloo cannot run with --nat (gloo's TCP does not traverse NATs)")
        if args.mtu > 1472:
            parser.error("--mtu above 1472 is refused with --nat: nothing may rely on IP fragmentation")
        from .lab.links import LabError
        from .lab.nat import NatLab

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
    if not 0.0 <= args.delay <= 1000.0:
        parser.error("--delay must be in [0, 1000] milliseconds")
    if args.delay and args.baseline:
        parser.error("--delay holds what peerd's daemons receive; the baseline's TCP would not see it: drop one")
    cfg = AllreduceBenchConfig(
        peers=args.peers, size=args.size, repeat=args.repeat, loss=args.loss, mtu=args.mtu, delay_ms=args.delay,
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
    from ..moshpit.keys import Grid
    from .bench.moshpit import MoshpitBenchConfig, run_moshpit_bench

    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if not 0.2 <= args.window <= 600:
        parser.error("--window must be in [0.2, 600] seconds")
    check_link_arguments(args, parser)
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
    from .demo import DemoConfig, gpt_options, run_demo

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
    check_link_arguments(args, parser)
    if args.sync_every < 1 or not 1 <= args.fragments <= args.sync_every:
        parser.error("--sync-every must be at least 1 and --fragments in [1, --sync-every]")
    if args.baseline == "hivemind" and args.model != "gpt":
        parser.error("--baseline hivemind trains the GPT script: --model gpt")
    if args.hivemind_matchmaking is not None and (args.baseline != "hivemind"
                                                  or not 0.1 <= args.hivemind_matchmaking <= 60):
        parser.error("--hivemind-matchmaking goes with --baseline hivemind and is in [0.1, 60] seconds")
    if args.baseline == "hivemind" and importlib.util.find_spec("hivemind") is None:  # before peerd's run, not after
        parser.error("--baseline hivemind needs hivemind in this environment: pip install hivemind==1.1.12")
    if args.baseline and args.model != "gpt" and (args.mode == "diloco" or args.byzantine
                                                  or args.dropcompute != "off"):
        parser.error("--baseline gloo compares plain training: not with --mode diloco, --byzantine or --dropcompute")
    if args.overlap_outer and (args.mode != "diloco" or args.model != "gpt"):
        parser.error("--overlap-outer is DiLoCo's (--mode diloco --model gpt)")
    if args.no_keep_pace and (args.mode != "diloco" or args.model != "gpt"):
        parser.error("--no-keep-pace is DiLoCo's (--mode diloco --model gpt)")
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
                     sync_every=args.sync_every, fragments=args.fragments, overlap_outer=args.overlap_outer,
                     keep_pace=not args.no_keep_pace, model=args.model, baseline=args.baseline,
                     target_accuracy=args.target_accuracy,
                     hivemind_matchmaking_s=args.hivemind_matchmaking,
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
    from .demo_train import run_train

    return run_train(args)


def cmd_sim(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return importlib.import_module(f".sim.{args.sim_command}", __package__).run(args, parser)


# What runs each tooling command (peerd.cli dispatches here, by the command's name).
TOOL_COMMANDS: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], int]] = {
    "bench": cmd_bench,
    "swarm": cmd_swarm,
    "demo": cmd_demo,
    "demo-trainer": cmd_train,
    "train": cmd_train,
    "sim": cmd_sim,
}
