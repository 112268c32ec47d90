"""`peerd demo`: N daemons and N trainer processes on 127.0.0.1 train one small model together.

Each trainer (`peerd train`, one torch thread) has its own shard of scikit-learn's digits and starts from the
same seeded weights; its daemon averages gradients through Moshpit every step and parameters every K steps.
The demo shows live progress, then a summary: held-out loss and accuracy (mean over peers), and the largest
relative distance between two peers' parameters. With ``link`` (root) every peer, daemon and trainer, runs in its
own network namespace of a link lab (peerd.tools.lab): links shaped at that rate both ways, losing ``link_loss`` of what
arrives at each peer in the kernel, for every protocol. With ``baseline="gloo"`` the same model then trains on the
same data, seeds and links under torch DDP over gloo (peerd.tools.bench.ddp_baseline), and both report the seconds from
the first trainer's start until the peers' mean held-out accuracy reached ``target_accuracy``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .bench.ddp_baseline import DDPConfig, read_events, run_ddp_baseline, tail, time_to_accuracy
from .lab.links import LinkLab
from .swarm import LocalSwarm

RUN = "demo"
# With --compute-jitter, each step takes this many micro-batches (of batch / micro samples): DropCompute can
# only drop whole micro-batches, and with 4 of them a threshold cuts a step in quarters.
JITTER_MICRO = 8


@dataclass
class DemoConfig:
    peers: int = 4
    steps: int = 200
    loss: float = 0.0
    compute_jitter: float = 0.0
    dropcompute: str = "off"
    seed: int = 0
    average_every: int | str | None = None  # K, "auto", or None: the model's default (averaging_period)
    final_average: int = 2  # parameter averages after the last step (replicas end together)
    keep_rounds: int | None = None  # Moshpit kept-group rounds (None: `peerd train`'s default)
    micro: int | None = None  # micro-batches per step (None: JITTER_MICRO with compute jitter, else the trainer's 4)
    timeout_s: float = 15.0
    json: bool = False
    join_late: dict[int, int] = field(default_factory=dict)  # peer index -> start when the swarm reaches step
    workdir: str | None = None
    wall_limit_s: float = 1200.0
    byzantine: int = 0  # the last K peers' daemons corrupt their own contributions (--fault-byzantine)
    byzantine_mode: str = "nan"
    robust: str = "off"  # every trainer's robust aggregation option
    link: str | None = None  # a link lab (root): every peer in its own namespace on a link shaped at this rate
    link_loss: float = 0.0  # ... dropping this fraction of each peer's incoming packets (nftables, all protocols)
    link_queue_ms: float = 20.0  # ... each tbf queueing this many ms of the rate before it drops
    mode: str = "sync"  # sync | overlap | diloco (`peerd train --mode`)
    bucket_mb: float | str | None = None  # overlap: gradient bucket size, or "auto" (None: the trainers' default)
    sync_every: int = 20  # diloco: H
    fragments: int = 1  # diloco: F (streaming)
    overlap_outer: bool = False  # diloco: outer averages travel while the next inner steps run (gpt)
    keep_pace: bool = True  # diloco (gpt): a replica the others wait for counts inner steps forward (DiLoCo's)
    model: str = "mlp"  # mlp (4,810 parameters) | wide (2.24 M: communication matters at 100 Mbit) | gpt (0.84 M)
    baseline: str | None = None  # gloo (ddp): then train the same under torch DDP over gloo, on the same links;
    # hivemind (gpt): under hivemind.Optimizer (peerd.tools.demo_hivemind)
    hivemind_matchmaking_s: float | None = None  # hivemind: its matchmaking_time (None: the quickstart's 3.0)
    target_accuracy: float = 0.93  # time_to_accuracy_s: until the peers' mean held-out accuracy reaches this
    compression: str | None = None  # every trainer's codec (`peerd train --compression`; None: fp32)
    quant_group: int | None = None  # int8/int4: values per scale and min (None: 128)
    rounding: str | None = None  # int8/int4: stochastic | nearest (None: stochastic)
    topk_ratio: float | None = None  # arc-topk: share of each matrix's rows averaged per shard (None: 0.1)
    kill: int = 0  # gpt: SIGKILL this many founders (trainer and daemon; the last ones) a third into the run
    join: int = 0  # gpt: start this many new peers (daemon and trainer) two thirds into the run; they sync state
    straggler: float = 1.0  # gpt: the last founder's compute takes this many times as long (DDP's too)
    batch: int | None = None  # gpt: sequences of 128 characters per step and peer (None: peerd.tools.demo_gpt's 8)
    eval_every: int = 25  # gpt: validation (the whole split) every this many steps
    target_loss: float | None = None  # gpt: time_to_target_s's target without a baseline
    target_seconds: float | None = None  # gpt: with target_loss, a baseline's time to it measured in another run
    # gpt: steps the peers train past ``steps`` at the schedule's final rate, so that a run ending just short of the
    # target still shows when it gets there (None: a fifth of ``steps`` with a baseline or a target, else 0)
    extra_steps: int | None = None


def _straggler(text: str) -> float:
    """--straggler's type: a slowdown factor, ``2x`` or ``2``, in [1, 100]."""
    import argparse

    try:
        value = float(text.lower().removesuffix("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a factor like 2x") from None
    if not 1.0 <= value <= 100.0:
        raise argparse.ArgumentTypeError(f"--straggler must be in [1x, 100x], not {text!r}")
    return value


def add_gpt_arguments(p: Any) -> None:
    """`peerd demo`'s options for --model gpt (churn, stragglers, batch, evaluation, target)."""
    p.add_argument("--kill", type=int, default=0, metavar="K",
                   help="gpt: SIGKILL K founders (trainer and daemon) a third into the run (default 0)")
    p.add_argument("--join", type=int, default=0, metavar="J",
                   help="gpt: start J new peers two thirds into the run; they download the swarm's state (default 0)")
    p.add_argument("--straggler", type=_straggler, default=1.0, metavar="Fx",
                   help="gpt: one peer's compute takes F times as long, in peerd and in the DDP baseline (default 1x)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="gpt: sequences of 128 characters per step and peer (default 8)")
    p.add_argument("--eval-every", type=int, default=25, metavar="S",
                   help="gpt: validation loss on the whole split every S steps (default 25; --mode diloco: "
                        "where each outer average lands instead; 0: never)")
    p.add_argument("--target-loss", type=float, default=None, metavar="L",
                   help="gpt: time_to_target_s's target without --baseline (with --baseline ddp: the baseline's "
                        "final loss; with --baseline hivemind: L where given, e.g. DDP's final loss from another run)")
    p.add_argument("--target-seconds", type=float, default=None, metavar="S",
                   help="gpt: with --target-loss, the baseline's time to that loss from another run (its "
                        "baseline_time_to_target_s): speedup and val_loss_at_baseline_third are then given against it")
    p.add_argument("--extra-steps", type=int, default=None, metavar="E",
                   help="gpt: peerd's peers train E steps past --steps at the schedule's final learning rate, so "
                        "time_to_target_s can show a run that ends just short of the target, evaluated five times as "
                        "often there (default: a fifth of "
                        "--steps with --baseline or --target-loss, else 0)")


def gpt_options(args: Any, parser: Any) -> dict[str, Any]:
    """DemoConfig's gpt fields from parsed arguments, checked."""
    if args.model != "gpt" and (args.kill or args.join or args.straggler != 1.0):
        parser.error("--kill, --join and --straggler go with --model gpt")
    if not 0 <= args.kill < args.peers or not 0 <= args.join <= 16:
        parser.error("--kill must be in [0, --peers) and --join in [0, 16]")
    if args.batch is not None and not 1 <= args.batch <= 1024 or not 1 <= args.eval_every <= 10_000:
        parser.error("--batch must be in [1, 1024] and --eval-every in [1, 10000]")
    if args.extra_steps is not None and not 0 <= args.extra_steps <= 1_000_000:
        parser.error("--extra-steps must be in [0, 1000000]")
    if args.target_seconds is not None and (args.target_loss is None or args.baseline or args.model != "gpt"
                                            or not 0.0 < args.target_seconds < 1e7):
        parser.error("--target-seconds goes with --model gpt and --target-loss, without --baseline, and is a "
                     "positive number of seconds (a baseline's baseline_time_to_target_s)")
    return {"kill": args.kill, "join": args.join, "straggler": args.straggler, "batch": args.batch,
            "eval_every": args.eval_every, "target_loss": args.target_loss, "target_seconds": args.target_seconds,
            "extra_steps": args.extra_steps}


def extra_steps(cfg: DemoConfig) -> int:
    """The steps peerd's gpt peers train past ``cfg.steps`` (DemoConfig.extra_steps)."""
    if cfg.extra_steps is not None:
        return cfg.extra_steps
    return cfg.steps // 5 if cfg.model == "gpt" and (cfg.baseline or cfg.target_loss is not None) else 0


def averaging_period(cfg: DemoConfig) -> int | str:
    """The trainers' --average-every: the one asked for, else "auto" for the GPT (the README's wrap leaves
    peerd.torch's default) and 10 for the small models."""
    if cfg.average_every is not None:
        return cfg.average_every
    return "auto" if cfg.model == "gpt" else 10


def gpt_total(cfg: DemoConfig) -> int:
    """Peers the demo starts over the run: the founders and the joiners."""
    return cfg.peers + cfg.join


def gpt_command(cfg: DemoConfig, i: int, socket: str, out: str) -> list[str]:
    """`python -m peerd.tools.demo_gpt` for peer ``i``: the user's GPT script wrapped for peerd."""
    cmd = [sys.executable, "-m", "peerd.tools.demo_gpt", "--run", RUN, "--socket", socket, "--steps", str(cfg.steps),
           "--peers", str(cfg.peers), "--index", str(i), "--seed", str(cfg.seed), "--mode", cfg.mode,
           "--average-every", str(averaging_period(cfg)), "--sync-every", str(cfg.sync_every),
           "--timeout", str(cfg.timeout_s), "--eval-every", str(cfg.eval_every),
           "--final-average", str(cfg.final_average), "--out", out, "--extra-steps", str(extra_steps(cfg))]
    for flag, value in (("--compression", cfg.compression), ("--keep-rounds", cfg.keep_rounds),
                        ("--bucket-mb", cfg.bucket_mb), ("--batch", cfg.batch)):
        if value is not None:
            cmd += [flag, str(value)]
    if cfg.overlap_outer:
        cmd += ["--overlap-outer"]
    if not cfg.keep_pace:
        cmd += ["--no-keep-pace"]
    if i >= cfg.peers:
        cmd += ["--init-seed", str(cfg.seed + 1000 + i)]  # different weights: it must take the swarm's
    else:
        cmd += ["--no-sync"]  # the founders start together from the same seeded weights
    if cfg.straggler > 1.0 and i == cfg.peers - 1:
        cmd += ["--slow", str(cfg.straggler)]
    return cmd


def go(proc: subprocess.Popen) -> None:
    """Release a trainer waiting at the start barrier (``--wait-go``); one that already exited is left be."""
    try:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass


def loss_curve(evals: dict[int, dict[int, tuple[float, float]]], start_t: float,
               members: int) -> list[tuple[int, float, float]]:
    """(step, mean held-out loss, seconds from ``start_t``) of every evaluation step that at least ``members``
    peers reported; the time is that step's last report."""
    rows = []
    for step in sorted(evals):
        row = evals[step]
        if len(row) >= members:
            rows.append((step, sum(v for v, _ in row.values()) / len(row), max(t for _, t in row.values()) - start_t))
    return rows


def time_to_target(curve: list[tuple[int, float, float]], target: float | None) -> float | None:
    """Seconds until the curve's mean held-out loss first reached ``target`` (None: never, or no target)."""
    if target is None:
        return None
    for _, loss, t in curve:
        if loss <= target:
            return t
    return None


def loss_by(curve: list[tuple[int, float, float]], seconds: float | None) -> float | None:
    """The held-out loss the curve had reached ``seconds`` after the trainers' start (its last evaluation by
    then; None: none by then, or no time): what a run that is not N times faster reaches in 1/N of the time."""
    if seconds is None:
        return None
    reached = [loss for _, loss, t in curve if t <= seconds]
    return min(reached) if reached else None


def target_fields(curve: list[tuple[int, float, float]], target: float | None, *,
                  baseline_curve: list | None = None, baseline_seconds: float | None = None) -> dict[str, Any]:
    """The gpt summary's target fields: ``time_to_target_s``, and against a baseline (its curve from this run, else
    its time to the target from another run, ``--target-seconds``) ``baseline_time_to_target_s``, ``speedup`` (0:
    never reached; None where only the baseline never reached it, with ``speedup_at_least``: its training time over
    the run's time to the target) and ``val_loss_at_baseline_third`` (where the run stood at a third of the
    baseline's time: the loss it reaches where it is not 3x sooner)."""
    tt = time_to_target(curve, target)
    out: dict[str, Any] = {"target_loss": target, "time_to_target_s": tt}
    btt = time_to_target(baseline_curve, target) if baseline_curve is not None else baseline_seconds
    if baseline_curve is not None or btt is not None:
        out["baseline_time_to_target_s"] = btt
        out["speedup"] = round(btt / tt, 3) if tt and btt else 0.0
        if tt and btt is None and baseline_curve:  # the baseline never got there in all its training
            out["speedup"] = None
            out["speedup_at_least"] = round(max(t for _, _, t in baseline_curve) / tt, 3)
        third = loss_by(curve, btt / 3 if btt else None)
        out["val_loss_at_baseline_third"] = None if third is None else round(third, 4)
    return out


def byzantine_peers(cfg: DemoConfig) -> set[int]:
    """The peers whose daemons run with --fault-byzantine: the last K (peer 0, the bootstrap node, stays honest)."""
    return set(range(cfg.peers - cfg.byzantine, cfg.peers)) if cfg.byzantine > 0 else set()


def micro_batches(cfg: DemoConfig) -> int | None:
    """The trainers' --micro: the configured one, else JITTER_MICRO when compute is jittered (else theirs)."""
    if cfg.micro is not None:
        return cfg.micro
    return JITTER_MICRO if cfg.compute_jitter > 0 else None


def divergence(vectors: list[list[float]]) -> float:
    """Largest ||a - b|| / mean(||a||, ||b||) over all pairs of peers."""
    import numpy as np

    arrays = [np.asarray(v, dtype=np.float64) for v in vectors]
    worst = 0.0
    for i in range(len(arrays)):
        for j in range(i + 1, len(arrays)):
            a, b = arrays[i], arrays[j]
            scale = (np.linalg.norm(a) + np.linalg.norm(b)) / 2
            if scale > 0:
                worst = max(worst, float(np.linalg.norm(a - b) / scale))
    return worst


def direction_bans(statuses: list[dict[str, Any]], byzantine_ids: set[str]) -> dict[str, int]:
    """The arc-topk direction test's verdicts summed over the honest daemons' ``peerd status`` (``moshpit.<run>
    .suspects``): dense-phase tests and bans of honest members and of the byzantine ones (hex node ids). Honest
    bans against honest tests is the rule's false-ban rate; byzantine bans against their tests, how often it
    catches them."""
    out = {"honest_tests": 0, "honest_bans": 0, "byzantine_tests": 0, "byzantine_bans": 0}
    for status in statuses:
        for run in (status.get("moshpit") or {}).values():
            verdicts = run.get("suspects") or {}
            for kind, key in (("tests", "tests"), ("bans", "bans")):
                for member, n in (verdicts.get(key) or {}).items():
                    out[f"{'byzantine' if member in byzantine_ids else 'honest'}_{kind}"] += int(n)
    return out


def run_demo(cfg: DemoConfig, *, log=print) -> dict[str, Any]:  # noqa: C901 - one linear script
    """Run the demo; returns the summary (the --json fields and more). Raises RuntimeError on failure."""
    say = (lambda *a, **k: print(*a, file=sys.stderr, flush=True, **k)) if cfg.json else log
    if cfg.link_loss and not cfg.link:
        raise RuntimeError("link_loss needs a link rate (--link RATE)")
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="peerd-demo-")
    gpt = cfg.model == "gpt"
    if not gpt and (cfg.kill or cfg.join or cfg.straggler != 1.0):
        raise RuntimeError("kill, join and straggler go with model gpt")
    if not 0 <= cfg.kill < cfg.peers or cfg.join < 0 or not 1.0 <= cfg.straggler <= 100.0:
        raise RuntimeError("kill must leave a founder alive, join must be >= 0, straggler in [1, 100]")
    join_late = dict(cfg.join_late)
    if gpt:
        join_late.update({i: max(1, 2 * cfg.steps // 3) for i in range(cfg.peers, gpt_total(cfg))})
    total = cfg.peers + len([i for i in join_late if i >= cfg.peers])
    victims = set(range(cfg.peers - cfg.kill, cfg.peers))  # gpt --kill: the last founders
    kill_at = max(1, cfg.steps // 3)
    killed: dict[int, int] = {}  # peer -> the swarm's step when it was SIGKILLed
    lab: LinkLab | None = None
    if cfg.link:
        lab = LinkLab(total, cfg.link, cfg.link_loss, queue_ms=cfg.link_queue_ms)
        say(f"building a link lab: {total} namespaces on {cfg.link} links, link loss {cfg.link_loss} "
            f"(no delay: no netem here) ...")
        try:
            lab.start()  # raises LabError (not root, a tool missing); tears down what it built
        except BaseException:
            if cfg.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
    swarm = LocalSwarm(os.path.join(workdir, "swarm"), lab=lab)
    procs: dict[int, subprocess.Popen] = {}
    events: queue.Queue = queue.Queue()
    start = time.monotonic()
    byzantine = byzantine_peers(cfg)
    if not 0 <= cfg.byzantine < cfg.peers:
        raise RuntimeError(f"byzantine must be in [0, {cfg.peers}): at least one peer must be honest")
    if cfg.baseline not in (None, "gloo", "ddp", "hivemind"):
        raise RuntimeError(f"baseline {cfg.baseline!r}: expected gloo (or its name ddp) or hivemind")
    if cfg.baseline == "hivemind" and not gpt:
        raise RuntimeError("baseline hivemind trains the GPT script: model gpt")
    if cfg.mode not in ("sync", "overlap", "diloco"):
        raise RuntimeError(f"mode {cfg.mode!r}: expected sync, overlap or diloco")
    if cfg.baseline and not gpt and (cfg.mode == "diloco" or cfg.byzantine or cfg.join_late
                                     or cfg.dropcompute != "off"):
        raise RuntimeError("baseline gloo compares plain training: no diloco, byzantine peers, late joiners or "
                           "DropCompute with it")
    try:
        drops = f" (each drops {cfg.loss:.0%} of datagrams)" if cfg.loss else ""
        say(f"starting {cfg.peers} daemon{'s' if cfg.peers != 1 else ''}{drops} ...")
        if byzantine:
            say(f"peers {sorted(byzantine)} run with --fault-byzantine {cfg.byzantine_mode} (they corrupt their "
                f"contributions); trainers ask for robust {cfg.robust}")
        def start_daemon(i: int) -> None:
            extra: tuple[str, ...] = ()
            if cfg.loss:
                extra = ("--loss", str(cfg.loss), "--loss-seed", str(cfg.seed * 1000 + i))
            if i in byzantine:
                extra += ("--fault-byzantine", cfg.byzantine_mode)
            node = swarm.start(extra=extra)
            swarm.wait_ready(node)

        for i in range(cfg.peers if gpt else total):  # a gpt joiner's daemon starts when it joins
            start_daemon(i)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

        def spawn(i: int) -> None:
            if gpt:
                cmd = gpt_command(cfg, i, swarm.nodes[i].socket, os.path.join(workdir, f"result{i}.json"))
            else:
                cmd = trainer_command(i)
            founder = i not in join_late
            if founder:  # founders start together, as DDP's ranks do after their rendezvous (see "ready" below)
                cmd += ["--wait-go"]
            if lab is not None:  # the trainer lives with its daemon (it reaches it over the shared file system)
                cmd = [*lab.exec_prefix(i), *cmd]
            err = open(os.path.join(workdir, f"trainer{i}.log"), "w")  # noqa: SIM115 - lives with the process
            procs[i] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                        stdin=subprocess.PIPE if founder else subprocess.DEVNULL, text=True, env=env)
            threading.Thread(target=read_events, args=(i, procs[i].stdout, events), daemon=True).start()

        def trainer_command(i: int) -> list[str]:
            cmd = [sys.executable, "-m", "peerd", "demo-trainer", "--run", RUN, "--socket", swarm.nodes[i].socket,
                   "--steps", str(cfg.steps), "--peers", str(cfg.peers), "--index", str(i), "--seed", str(cfg.seed),
                   "--average-every", str(averaging_period(cfg)),
                   "--final-average", str(cfg.final_average), "--timeout", str(cfg.timeout_s),
                   "--compute-jitter", str(cfg.compute_jitter), "--dropcompute", cfg.dropcompute,
                   "--progress", "json", "--out", os.path.join(workdir, f"result{i}.json"), "--model", cfg.model]
            if cfg.keep_rounds is not None:
                cmd += ["--keep-rounds", str(cfg.keep_rounds)]
            if cfg.mode == "diloco":
                cmd += ["--mode", cfg.mode, "--sync-every", str(cfg.sync_every), "--fragments", str(cfg.fragments)]
            elif cfg.mode != "sync":
                cmd += ["--mode", cfg.mode]
            if cfg.mode == "overlap" and cfg.bucket_mb is not None:
                cmd += ["--bucket-mb", str(cfg.bucket_mb)]
            if micro_batches(cfg) is not None:
                cmd += ["--micro", str(micro_batches(cfg))]
            if cfg.robust != "off":
                cmd += ["--robust", cfg.robust]
            for flag, value in (("--compression", cfg.compression), ("--quant-group", cfg.quant_group),
                                ("--rounding", cfg.rounding), ("--topk-ratio", cfg.topk_ratio)):
                if value is not None:
                    cmd += [flag, str(value)]
            if i in cfg.join_late:
                cmd += ["--init-seed", str(cfg.seed + 1000 + i)]  # different weights: it must take the swarm's
            else:
                cmd += ["--no-sync"]  # the founders start together from the same seeded weights
            return cmd

        for i in range(total):
            if i not in join_late:
                spawn(i)
        say(f"started {len(procs)} trainers (run {RUN!r}, {cfg.steps} steps, one torch thread each)")
        # with a workdir of its own choosing, the caller gets every step record (all peers) in steps.jsonl
        trace = open(os.path.join(workdir, "steps.jsonl"), "w") if cfg.workdir else None  # noqa: SIM115
        founders = {i for i in range(total) if i not in join_late}
        ready: set[int] = set()
        received: list[float] = []
        done: dict[int, dict] = {}
        starts: dict[int, dict] = {}
        latest: dict[int, dict] = {}
        evals: dict[int, dict[int, tuple[float, float]]] = {}  # step -> peer -> (held-out accuracy, time)
        loss_evals: dict[int, dict[int, tuple[float, float]]] = {}  # step -> peer -> (held-out loss, time)
        last_print = 0.0
        swarm_step = 0
        while len(done) < total - len(killed):
            if time.monotonic() - start > cfg.wall_limit_s:
                raise RuntimeError(f"the demo did not finish within {cfg.wall_limit_s:.0f} s")
            try:
                i, ev = events.get(timeout=1.0)
            except queue.Empty:
                for i, p in procs.items():
                    if p.poll() not in (None, 0) and i not in done and i not in killed:
                        raise RuntimeError(f"trainer {i} exited with {p.returncode}: "
                                           f"{tail(os.path.join(workdir, f'trainer{i}.log'))}") from None
                continue
            kind = ev.get("event")
            if kind == "ready":
                ready.add(i)
                if ready >= founders:  # every founder loaded and connected: go, all at once
                    for j in sorted(founders):
                        go(procs[j])
            elif kind == "start":
                starts[i] = ev
                if ev.get("synced"):
                    say(f"peer {i} joined at step {ev['step']}: downloaded {ev['synced']['size']} bytes of state "
                        f"from {ev['synced']['donors']} donor(s) in {ev['synced']['chunks']} chunks; "
                        f"held-out accuracy {ev['accuracy']:.3f} before its first step")
            elif kind == "step":
                latest[i] = ev
                if ev.get("received_fraction") is not None:
                    received.append(ev["received_fraction"])
                if ev.get("accuracy") is not None and "t" in ev:
                    evals.setdefault(ev["step"], {})[i] = (ev["accuracy"], ev["t"])
                    loss_evals.setdefault(ev["step"], {})[i] = (ev["held_out_loss"], ev["t"])
                if trace is not None:
                    trace.write(json.dumps(ev) + "\n")
                swarm_step = max(swarm_step, ev["step"])
                now = time.monotonic()
                if i == min(latest) and (now - last_print > 1.0 or ev["step"] == cfg.steps):
                    last_print = now
                    loss = sum(e["loss"] for e in latest.values()) / len(latest)
                    acc = ev.get("accuracy")
                    say(f"step {ev['step']:>4}  loss {loss:.4f}  "
                        f"{'acc ' + format(acc, '.3f') if acc is not None else '         '}  "
                        f"group {ev['group_size']}  round {ev['round_s']:.3f} s  "
                        f"received {ev['received_fraction']:.3f}  ({ev['outcome']})")
            elif kind == "done":
                done[i] = ev
            elif kind == "eof" and i not in done and i not in killed:
                code = procs[i].wait(10)
                raise RuntimeError(f"trainer {i} exited with {code} before finishing: "
                                   f"{tail(os.path.join(workdir, f'trainer{i}.log'))}")
            if victims and not killed and swarm_step >= kill_at:
                for j in sorted(victims):  # a peer dies at once: its trainer and its daemon, SIGKILL
                    procs[j].kill()
                    swarm.nodes[j].proc.kill()
                    killed[j] = swarm_step
                say(f"SIGKILLed peer(s) {sorted(victims)} (trainer and daemon) at the swarm's step {swarm_step}")
            for j, at in join_late.items():
                if j not in procs and swarm_step >= at:
                    say(f"peer {j} joins late (the swarm is at step {swarm_step})")
                    if len(swarm.nodes) <= j:
                        start_daemon(j)
                    spawn(j)
        if trace is not None:
            trace.close()
        for j in killed:
            procs[j].wait(30)
        for p in procs.values():
            # after "done" a trainer still writes its result with every parameter as JSON: 2.24 M numbers for
            # --model wide, which takes tens of seconds on a busy 2-core machine
            p.wait(300)
        verdicts = None
        if byzantine and cfg.compression == "arc-topk":  # the direction test's record, read before the daemons go
            honest_nodes = [n for n in swarm.nodes if n.index not in byzantine and n.index not in killed]
            verdicts = direction_bans([n.call("status") for n in honest_nodes if n.alive()],
                                      {swarm.nodes[j].status.get("peer_id", "") for j in byzantine})
        wall = time.monotonic() - start
        results = []
        for i in range(total):
            if i in killed:
                continue
            with open(os.path.join(workdir, f"result{i}.json")) as f:
                results.append(json.load(f))
        honest = [r for r in results if r["peer"] not in byzantine]  # all peers without --byzantine
        t_start = min((ev["t"] for ev in starts.values() if "t" in ev), default=None)
        founders = total - len(join_late) - len(killed)
        link_fields = _link_summary(lab) if lab is not None else {}  # peerd's traffic only, before any baseline
        summary = {
            "final_loss": sum(r["held_out_loss"] for r in honest) / len(honest),
            "accuracy": sum(r["accuracy"] for r in honest) / len(honest),
            "max_param_divergence": divergence([r["params"] for r in honest]),
            "steps": cfg.steps,
            "peers": cfg.peers,
            **({"killed": {str(k): v for k, v in killed.items()}, "joined": sorted(j for j in join_late
                                                                                   if j >= cfg.peers),
                "straggler": cfg.straggler} if gpt else {}),
            "wall_s": round(wall, 2),
            "loss": cfg.loss,
            "seed": cfg.seed,
            "compute_jitter": cfg.compute_jitter,
            "dropcompute": cfg.dropcompute,
            "micro": micro_batches(cfg) or 4,
            "keep_rounds": results[0].get("keep_rounds"),
            "kept_rounds": sum(r.get("kept_rounds", 0) for r in results),  # rounds that skipped matchmaking
            # steps whose round left the peer on its group's common result (every all-gather range arrived)
            **({"complete_rounds": sum(r.get("complete_rounds", 0) for r in results)} if gpt else {}),
            "samples_per_second": sum(r["samples"] for r in results) / max(r["wall_s"] for r in results),
            "overhead_s": sum(r.get("overhead_s", 0.0) for r in results) / len(results),
            "outcomes": _sum_outcomes(results),
            # the smallest share of its round's data any peer received in a step (under 1: that step's replicas
            # may hold different averages; None: no step reported one)
            "min_received_fraction": min(received, default=None),
            "byzantine": cfg.byzantine,
            "byzantine_mode": cfg.byzantine_mode if cfg.byzantine else None,
            **({"direction_test": verdicts} if verdicts is not None else {}),
            "robust": cfg.robust,
            "compression": cfg.compression or "fp32",
            **({"quant_group": cfg.quant_group or 128, "rounding": cfg.rounding or "stochastic"}
               if (cfg.compression or "").startswith("int") else {}),
            **({"topk_ratio": cfg.topk_ratio or 0.1} if cfg.compression == "arc-topk" else {}),
            "mode": cfg.mode,
            "model": cfg.model,
            "target_accuracy": cfg.target_accuracy,
            # from the first trainer's start to the first evaluation (every 10 steps) at which the peers' mean
            # held-out accuracy reached the target; None: never during training
            "time_to_accuracy_s": (time_to_accuracy(evals, t_start, cfg.target_accuracy, founders)
                                   if t_start is not None else None),
            # training only (first trainer's start to last one's end), as the baseline's wall_s
            "train_wall_s": (max(r["t_end"] for r in results) - t_start
                             if t_start is not None and all("t_end" in r for r in results)
                             else max(r["wall_s"] for r in results)),
            **({"sync_every": cfg.sync_every, "fragments": cfg.fragments,
                "state_sha_agree": len({r.get("state_sha") for r in honest}) == 1} if cfg.mode == "diloco" else {}),
            # float32 bytes of the vectors each trainer averaged (gradients, parameters, pseudo-gradients, repairs)
            "bytes_sent_per_peer": sum(r.get("tensor_bytes", 0) for r in results) / len(results),
            "step_s": statistics.median(r.get("step_s", 0.0) for r in results),
            **link_fields,
            "per_peer": [{**{k: r[k] for k in ("peer", "first_step", "steps", "held_out_loss", "accuracy", "samples",
                                                "samples_per_second", "local_steps", "synced", "dropped_microbatches",
                                                "tau", "wall_s", "compute_s")},
                          **{k: r.get(k) for k in ("round_s", "matchmaking_s", "overhead_s", "predicted_speedup",
                                                   "final_average")},
                          "start_accuracy": starts.get(r["peer"], {}).get("accuracy"),
                          "byzantine": r["peer"] in byzantine, "nonfinite_rounds": r.get("nonfinite_rounds", 0),
                          "params_finite": r.get("params_finite"), "diverged": r.get("diverged", False),
                          "caught_up": r.get("caught_up", 0),
                          "paced_steps": r.get("paced_steps", 0),  # DiLoCo's keep_pace: counted forward
                          # parameter averages, and those a check round found would change nothing (skipped)
                          "params_averages": r.get("params_averages", 0),
                          "params_identical": r.get("params_identical", 0),
                          "params_close": r.get("params_close", 0)}
                         for r in results],
        }
        say(f"\ndone in {wall:.1f} s: held-out accuracy {summary['accuracy']:.4f}, loss {summary['final_loss']:.4f} "
            f"(mean over {len(honest)} {'honest ' if byzantine else ''}peers); "
            f"largest relative distance between two peers' parameters "
            f"{summary['max_param_divergence']:.2e}; {summary['samples_per_second']:.0f} samples/s across the swarm; "
            f"rounds: {', '.join(f'{n} {k}' for k, n in sorted(summary['outcomes'].items())) or 'none'}")
        if gpt:
            for r in results:  # the end of training (after the final averages) is the curve's last point
                loss_evals.setdefault(cfg.steps + extra_steps(cfg) + 1, {})[r["peer"]] = (r["held_out_loss"],
                                                                                       r["t_end"])
            curve = loss_curve(loss_evals, t_start, founders) if t_start is not None else []
            at_steps = [v for s, v, _ in curve if s == cfg.steps]
            if not at_steps and not extra_steps(cfg) and curve:  # (no reading at --steps itself: DiLoCo's
                at_steps = [curve[-1][1]]  # land after outer steps) the end of training is the model at --steps
            summary.update(extra_steps=extra_steps(cfg), val_loss_at_steps=at_steps[0] if at_steps else None)
            summary.update(val_loss=summary["final_loss"], val_accuracy=summary["accuracy"],
                           max_step_s=max(r.get("max_step_s", 0.0) for r in results),
                           # the longest a step waited in step() (for its averages): the deadline bounds it
                           max_wait_s=max(r.get("max_wait_s", 0.0) for r in results),
                           deadline_s=cfg.timeout_s, curve=[[s, round(v, 4), round(t, 2)] for s, v, t in curve])
            if cfg.mode == "diloco":
                summary["state_sha_agree"] = len({r.get("state_sha") for r in results}) == 1
            auto = [r["auto"] for r in results if r.get("auto")]
            if auto:
                summary["auto"] = auto[0]
            if cfg.mode != "diloco":  # the parameter-averaging period applied: auto's agreed choice, else the given
                summary["average_every"] = auto[0]["average_every"] if auto else averaging_period(cfg)
            if cfg.compression is None and cfg.mode != "diloco":
                summary["compression"] = "auto"  # the Optimizer's default; what it chose is under "auto"
        if cfg.baseline:
            swarm.stop()  # the baseline gets the CPU and the links to itself, as peerd had them
            kind = "hivemind" if cfg.baseline == "hivemind" else "gloo"
            ddp = (DDPConfig(world=cfg.peers, steps=cfg.steps, seed=cfg.seed, model="gpt", batch=cfg.batch or 0,
                             eval_every=cfg.eval_every, straggler=cfg.straggler, kind=kind,
                             sync_every=cfg.sync_every, matchmaking_s=cfg.hivemind_matchmaking_s) if gpt else
                   DDPConfig(world=cfg.peers, steps=cfg.steps, seed=cfg.seed, model=cfg.model,
                             micro=micro_batches(cfg) or 4, compute_jitter=cfg.compute_jitter))
            base = run_ddp_baseline(ddp,
                target=cfg.target_accuracy, lab=lab, workdir=workdir, wall_limit_s=cfg.wall_limit_s, say=say)
            summary["baseline"] = base
            if gpt:
                summary["baseline_val_loss"] = base["final_loss"]
            tta = summary["time_to_accuracy_s"]
            say(f"baseline ({'torch DDP over gloo' if kind == 'gloo' else 'hivemind'}): held-out accuracy "
                f"{base['accuracy']:.4f}, loss {base['final_loss']:.4f}, {base['wall_s']:.1f} s of training; time to "
                f"{cfg.target_accuracy:.0%}: peerd {_secs(tta)}, {kind} {_secs(base['time_to_accuracy_s'])}")
        if gpt:
            # the target: DDP's final loss; against hivemind, --target-loss (DDP's from another run) where given
            target = (cfg.target_loss if cfg.baseline == "hivemind" and cfg.target_loss is not None
                      else summary.get("baseline_val_loss", cfg.target_loss))
            summary.update(target_fields(curve, target, baseline_curve=summary.get("baseline", {}).get("curve"),
                                         baseline_seconds=cfg.target_seconds))
            tt = summary["time_to_target_s"]
            say(f"validation loss {summary['val_loss']:.4f}"
                + (f", the baseline's {summary['baseline_val_loss']:.4f}" if "baseline" in summary else "")
                + (f"; time to {target:.4f}: peerd {_secs(tt)}" if target is not None else "")
                + (f", baseline {_secs(summary['baseline_time_to_target_s'])} (speedup "
                   + (f"at least {summary['speedup_at_least']}: the baseline never got there)"
                      if "speedup_at_least" in summary else f"{summary['speedup']})")
                   if "speedup" in summary else ""))
        return summary
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        swarm.cleanup()
        if lab is not None:
            lab.close()
        if cfg.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _link_summary(lab: LinkLab) -> dict[str, Any]:
    """The lab's fields in the summary: its rate and loss, and the drop fraction its counters measured."""
    counters = [lab.counters(i) for i in range(lab.peers)]
    seen = sum(c.seen for c in counters)
    dropped = sum(c.dropped for c in counters)
    info = lab.describe()
    return {"link_rate": info["link_rate"], "link_loss": info["link_loss"],
            "link_drop_fraction": dropped / seen if seen else 0.0, "link_packets_seen": seen}


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _sum_outcomes(results: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in results:
        for k, v in r["outcomes"].items():
            total[k] = total.get(k, 0) + v
    return total
