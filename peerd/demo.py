"""`peerd demo`: N daemons and N trainer processes on 127.0.0.1 train one small model together.

Each trainer (`peerd train`, one torch thread) has its own shard of scikit-learn's digits and starts from the
same seeded weights; its daemon averages gradients through Moshpit every step and parameters every K steps.
The demo shows live progress, then a summary: held-out loss and accuracy (mean over peers), and the largest
relative distance between two peers' parameters. With ``link`` (root) every peer, daemon and trainer, runs in its
own network namespace of a link lab (peerd.lab): links shaped at that rate both ways, losing ``link_loss`` of what
arrives at each peer in the kernel, for every protocol. With ``baseline="gloo"`` the same model then trains on the
same data, seeds and links under torch DDP over gloo (peerd.bench.ddp_baseline), and both report the seconds from
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

from .bench.ddp_baseline import DDPConfig, run_ddp_baseline, time_to_accuracy
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
    average_every: int = 10
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
    bucket_mb: float | None = None  # overlap: gradient bucket size (None: `peerd train`'s default)
    sync_every: int = 50  # diloco: H
    fragments: int = 1  # diloco: F (streaming)
    model: str = "mlp"  # mlp (4,810 parameters) | wide (2.24 M: communication matters at 100 Mbit)
    baseline: str | None = None  # gloo: then train the same under torch DDP over gloo, on the same links
    target_accuracy: float = 0.93  # time_to_accuracy_s: until the peers' mean held-out accuracy reaches this
    compression: str | None = None  # every trainer's codec (`peerd train --compression`; None: fp32)
    quant_group: int | None = None  # int8/int4: values per scale and min (None: 128)
    rounding: str | None = None  # int8/int4: stochastic | nearest (None: stochastic)
    topk_ratio: float | None = None  # arc-topk: share of each matrix's rows averaged per shard (None: 0.1)


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


def _reader(index: int, stream, out: queue.Queue) -> None:
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            out.put((index, json.loads(line)))
        except json.JSONDecodeError:
            out.put((index, {"event": "text", "text": line}))
    out.put((index, {"event": "eof"}))


def run_demo(cfg: DemoConfig, *, log=print) -> dict[str, Any]:  # noqa: C901 - one linear script
    """Run the demo; returns the summary (the --json fields and more). Raises RuntimeError on failure."""
    say = (lambda *a, **k: print(*a, file=sys.stderr, flush=True, **k)) if cfg.json else log
    if cfg.link_loss and not cfg.link:
        raise RuntimeError("link_loss needs a link rate (--link RATE)")
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="peerd-demo-")
    lab: LinkLab | None = None
    if cfg.link:
        lab = LinkLab(cfg.peers, cfg.link, cfg.link_loss, queue_ms=cfg.link_queue_ms)
        say(f"building a link lab: {cfg.peers} namespaces on {cfg.link} links, link loss {cfg.link_loss} "
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
    if cfg.baseline not in (None, "gloo"):
        raise RuntimeError(f"baseline {cfg.baseline!r}: expected gloo")
    if cfg.mode not in ("sync", "overlap", "diloco"):
        raise RuntimeError(f"mode {cfg.mode!r}: expected sync, overlap or diloco")
    if cfg.baseline and (cfg.mode == "diloco" or cfg.byzantine or cfg.join_late or cfg.dropcompute != "off"):
        raise RuntimeError("baseline gloo compares plain training: no diloco, byzantine peers, late joiners or "
                           "DropCompute with it")
    try:
        drops = f" (each drops {cfg.loss:.0%} of datagrams)" if cfg.loss else ""
        say(f"starting {cfg.peers} daemon{'s' if cfg.peers != 1 else ''}{drops} ...")
        if byzantine:
            say(f"peers {sorted(byzantine)} run with --fault-byzantine {cfg.byzantine_mode} (they corrupt their "
                f"contributions); trainers ask for robust {cfg.robust}")
        for i in range(cfg.peers):
            extra: tuple[str, ...] = ()
            if cfg.loss:
                extra = ("--loss", str(cfg.loss), "--loss-seed", str(cfg.seed * 1000 + i))
            if i in byzantine:
                extra += ("--fault-byzantine", cfg.byzantine_mode)
            node = swarm.start(extra=extra)
            swarm.wait_ready(node)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

        def spawn(i: int) -> None:
            cmd = [sys.executable, "-m", "peerd", "train", "--run", RUN, "--socket", swarm.nodes[i].socket,
                   "--steps", str(cfg.steps), "--peers", str(cfg.peers), "--index", str(i), "--seed", str(cfg.seed),
                   "--average-every", str(cfg.average_every),
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
            if lab is not None:  # the trainer lives with its daemon (it reaches it over the shared file system)
                cmd = [*lab.exec_prefix(i), *cmd]
            err = open(os.path.join(workdir, f"trainer{i}.log"), "w")  # noqa: SIM115 - lives with the process
            procs[i] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                        text=True, env=env)
            threading.Thread(target=_reader, args=(i, procs[i].stdout, events), daemon=True).start()

        for i in range(cfg.peers):
            if i not in cfg.join_late:
                spawn(i)
        say(f"started {len(procs)} trainers (run {RUN!r}, {cfg.steps} steps, one torch thread each)")
        # with a workdir of its own choosing, the caller gets every step record (all peers) in steps.jsonl
        trace = open(os.path.join(workdir, "steps.jsonl"), "w") if cfg.workdir else None  # noqa: SIM115
        done: dict[int, dict] = {}
        starts: dict[int, dict] = {}
        latest: dict[int, dict] = {}
        evals: dict[int, dict[int, tuple[float, float]]] = {}  # step -> peer -> (held-out accuracy, time)
        last_print = 0.0
        swarm_step = 0
        while len(done) < cfg.peers:
            if time.monotonic() - start > cfg.wall_limit_s:
                raise RuntimeError(f"the demo did not finish within {cfg.wall_limit_s:.0f} s")
            try:
                i, ev = events.get(timeout=1.0)
            except queue.Empty:
                for i, p in procs.items():
                    if p.poll() not in (None, 0) and i not in done:
                        raise RuntimeError(f"trainer {i} exited with {p.returncode}: "
                                           f"{_tail(os.path.join(workdir, f'trainer{i}.log'))}") from None
                continue
            kind = ev.get("event")
            if kind == "start":
                starts[i] = ev
                if ev.get("synced"):
                    say(f"peer {i} joined at step {ev['step']}: downloaded {ev['synced']['size']} bytes of state "
                        f"from {ev['synced']['donors']} donor(s) in {ev['synced']['chunks']} chunks; "
                        f"held-out accuracy {ev['accuracy']:.3f} before its first step")
            elif kind == "step":
                latest[i] = ev
                if ev.get("accuracy") is not None and "t" in ev:
                    evals.setdefault(ev["step"], {})[i] = (ev["accuracy"], ev["t"])
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
            elif kind == "eof" and i not in done:
                code = procs[i].wait(10)
                raise RuntimeError(f"trainer {i} exited with {code} before finishing: "
                                   f"{_tail(os.path.join(workdir, f'trainer{i}.log'))}")
            for j, at in cfg.join_late.items():
                if j not in procs and swarm_step >= at:
                    say(f"peer {j} joins late (the swarm is at step {swarm_step})")
                    spawn(j)
        if trace is not None:
            trace.close()
        for p in procs.values():
            # after "done" a trainer still writes its result with every parameter as JSON: 2.24 M numbers for
            # --model wide, which takes tens of seconds on a busy 2-core machine
            p.wait(300)
        wall = time.monotonic() - start
        results = []
        for i in range(cfg.peers):
            with open(os.path.join(workdir, f"result{i}.json")) as f:
                results.append(json.load(f))
        honest = [r for r in results if r["peer"] not in byzantine]  # all peers without --byzantine
        t_start = min((ev["t"] for ev in starts.values() if "t" in ev), default=None)
        founders = cfg.peers - len(cfg.join_late)
        link_fields = _link_summary(lab) if lab is not None else {}  # peerd's traffic only, before any baseline
        summary = {
            "final_loss": sum(r["held_out_loss"] for r in honest) / len(honest),
            "accuracy": sum(r["accuracy"] for r in honest) / len(honest),
            "max_param_divergence": divergence([r["params"] for r in honest]),
            "steps": cfg.steps,
            "peers": cfg.peers,
            "wall_s": round(wall, 2),
            "loss": cfg.loss,
            "seed": cfg.seed,
            "compute_jitter": cfg.compute_jitter,
            "dropcompute": cfg.dropcompute,
            "micro": micro_batches(cfg) or 4,
            "keep_rounds": results[0].get("keep_rounds"),
            "kept_rounds": sum(r.get("kept_rounds", 0) for r in results),  # rounds that skipped matchmaking
            "samples_per_second": sum(r["samples"] for r in results) / max(r["wall_s"] for r in results),
            "overhead_s": sum(r.get("overhead_s", 0.0) for r in results) / len(results),
            "outcomes": _sum_outcomes(results),
            "byzantine": cfg.byzantine,
            "byzantine_mode": cfg.byzantine_mode if cfg.byzantine else None,
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
                          **{k: r.get(k) for k in ("round_s", "matchmaking_s", "overhead_s", "predicted_speedup")},
                          "start_accuracy": starts.get(r["peer"], {}).get("accuracy"),
                          "byzantine": r["peer"] in byzantine, "nonfinite_rounds": r.get("nonfinite_rounds", 0),
                          "params_finite": r.get("params_finite"), "diverged": r.get("diverged", False)}
                         for r in results],
        }
        say(f"\ndone in {wall:.1f} s: held-out accuracy {summary['accuracy']:.4f}, loss {summary['final_loss']:.4f} "
            f"(mean over {len(honest)} {'honest ' if byzantine else ''}peers); "
            f"largest relative distance between two peers' parameters "
            f"{summary['max_param_divergence']:.2e}; {summary['samples_per_second']:.0f} samples/s across the swarm; "
            f"rounds: {', '.join(f'{n} {k}' for k, n in sorted(summary['outcomes'].items())) or 'none'}")
        if cfg.baseline == "gloo":
            swarm.stop()  # the baseline gets the CPU and the links to itself, as peerd had them
            base = run_ddp_baseline(
                DDPConfig(world=cfg.peers, steps=cfg.steps, seed=cfg.seed, model=cfg.model, micro=micro_batches(cfg)
                          or 4, compute_jitter=cfg.compute_jitter),
                target=cfg.target_accuracy, lab=lab, workdir=workdir, wall_limit_s=cfg.wall_limit_s, say=say)
            summary["baseline"] = base
            tta = summary["time_to_accuracy_s"]
            say(f"baseline (torch DDP over gloo): held-out accuracy {base['accuracy']:.4f}, loss "
                f"{base['final_loss']:.4f}, {base['wall_s']:.1f} s of training; time to {cfg.target_accuracy:.0%}: "
                f"peerd {_secs(tta)}, gloo {_secs(base['time_to_accuracy_s'])}")
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


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
