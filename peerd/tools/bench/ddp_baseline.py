"""The demo's baseline: the same model, data shards, seeds and steps as `peerd train`, under torch DDP over gloo.

`peerd demo --baseline gloo` starts one rank per peer (in peer i's namespace when the demo runs on a link lab,
with gloo bound to the lab interface and rank 0's store on peer 0's lab address, as the allreduce bench's
GlooBaseline does), so its time-to-accuracy compares like for like with peerd's: same links, same loss, same CPU.
DDP averages each step's gradients exactly (TCP retransmits what the link drops); peerd's trainers average them
through lossy Moshpit groups. Run a rank as: python -m peerd.tools.bench.ddp_baseline CONFIG_JSON RANK
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..lab.links import LinkLab

BASELINES = ("gloo",)


@dataclass
class DDPConfig:
    """What each rank trains: the fields mirror `peerd train`'s arguments of the same names."""

    world: int
    steps: int
    seed: int = 0
    model: str = "mlp"
    hidden: int = 64
    batch: int = 32
    micro: int = 4  # the step's samples are drawn as `peerd train` draws them (micro-batches of batch / micro)
    lr: float = 3e-3
    eval_every: int = 10
    compute_jitter: float = 0.0
    port: int = 29500
    timeout_s: float = 600.0  # gloo's own timeout for one collective (a lossy link must not hang the demo)
    straggler: float = 1.0  # gpt: the last rank's compute takes this many times as long (`peerd demo --straggler`)
    kind: str = "gloo"  # gpt: "hivemind" trains the ranks under hivemind.Optimizer instead (peerd.tools.demo_hivemind)
    sync_every: int = 20  # hivemind: steps of every rank between parameter averages
    rendezvous: str = ""  # hivemind: the folder where rank 0 leaves its addresses
    matchmaking_s: float | None = None  # hivemind: matchmaking_time (None: the quickstart's)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_accuracy(evals: dict[int, dict[int, tuple[float, float]]], start_t: float, target: float,
                     members: int) -> float | None:
    """Seconds from ``start_t`` until the first evaluation step at which the mean held-out accuracy of all
    ``members`` reached ``target``: the time of that step's last evaluation (None if it was never reached).

    ``evals`` maps step -> member -> (accuracy, monotonic time of the evaluation)."""
    for step in sorted(evals):
        row = evals[step]
        if len(row) < members:
            continue
        if sum(acc for acc, _ in row.values()) / len(row) >= target:
            return max(t for _, t in row.values()) - start_t
    return None


def worker(cfg: DDPConfig, rank: int) -> int:
    """One DDP rank: print JSON lines (start, eval, done) on stdout."""
    if cfg.model == "gpt":  # the user's GPT script, under its DDP launcher
        return _gpt_worker(cfg, rank)
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812
    from torch.nn.parallel import DistributedDataParallel

    from ..demo_train import build_model, evaluate, load_digits_split, sample_batch

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(cfg.port)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    x_train, y_train, x_test, y_test = load_digits_split()
    shard = np.arange(rank, len(x_train), cfg.world)  # the same shards, draws and jitter as `peerd train`
    rng = np.random.default_rng(cfg.seed * 1000 + rank)
    jitter = np.random.default_rng(cfg.seed * 1000 + rank + 7)
    model = build_model(cfg.hidden, cfg.seed, cfg.model)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights: the same seeded ones anyway
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr)

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)

    loss0, acc0 = evaluate(model, x_test, y_test)
    start = time.monotonic()
    emit({"event": "start", "rank": rank, "accuracy": acc0, "held_out_loss": loss0, "t": start,
          "params": sum(p.numel() for p in model.parameters())})
    step_times = []
    for step in range(1, cfg.steps + 1):
        t0 = time.monotonic()
        opt.zero_grad()
        idx = np.concatenate(sample_batch(shard, rng, cfg.batch, cfg.micro))
        if cfg.compute_jitter > 0:
            for _ in range(cfg.micro):
                time.sleep(0.01 * (1.0 + cfg.compute_jitter * jitter.exponential()))
        loss = F.cross_entropy(ddp(torch.from_numpy(x_train[idx])), torch.from_numpy(y_train[idx]))
        loss.backward()  # DDP's all-reduce: the mean of every rank's mean gradient, as peerd's equal-weight average
        opt.step()
        step_times.append(time.monotonic() - t0)
        if cfg.eval_every and step % cfg.eval_every == 0:
            held, acc = evaluate(model, x_test, y_test)
            emit({"event": "eval", "rank": rank, "step": step, "accuracy": acc, "held_out_loss": held,
                  "loss": loss.item(), "t": time.monotonic()})
    wall = time.monotonic() - start
    held, acc = evaluate(model, x_test, y_test)
    emit({"event": "done", "rank": rank, "steps": cfg.steps, "accuracy": acc, "held_out_loss": held, "wall_s": wall,
          "t": time.monotonic(),
          "step_s": float(np.median(step_times)) if step_times else 0.0})
    dist.destroy_process_group()
    return 0


def _gpt_worker(cfg: DDPConfig, rank: int) -> int:
    from ..demo_gpt import main

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(cfg.port)
    argv = ["--launcher", "ddp" if cfg.kind == "gloo" else cfg.kind, "--world", str(cfg.world), "--index", str(rank),
            "--peers", str(cfg.world), "--steps", str(cfg.steps), "--seed", str(cfg.seed),
            "--eval-every", str(cfg.eval_every)]
    if cfg.kind == "hivemind":
        argv += ["--sync-every", str(cfg.sync_every), "--rendezvous", cfg.rendezvous]
        if cfg.matchmaking_s is not None:
            argv += ["--matchmaking-s", str(cfg.matchmaking_s)]
    if cfg.batch > 0:
        argv += ["--batch", str(cfg.batch)]
    if cfg.straggler > 1.0 and rank == cfg.world - 1:
        argv += ["--slow", str(cfg.straggler)]
    return main(argv)


def run_ddp_baseline(cfg: DDPConfig, *, target: float, lab: LinkLab | None = None, workdir: str,
                     wall_limit_s: float = 1200.0, say=print) -> dict[str, Any]:
    """Train with DDP over gloo (``cfg.kind`` "hivemind": under hivemind.Optimizer), one rank per peer (in the lab's
    namespaces when given); the demo's baseline fields: accuracy, final_loss (held-out, mean over ranks),
    time_to_accuracy_s, wall_s, step_s, curve."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise RuntimeError(f"--baseline {cfg.kind} needs torch: pip install 'peerd[torch]' (torch==2.13.0)") from None
    if cfg.kind == "hivemind":
        if cfg.model != "gpt":
            raise RuntimeError("--baseline hivemind trains the GPT script: --model gpt")
        from ..demo_hivemind import need_hivemind

        try:
            need_hivemind()
        except SystemExit as e:
            raise RuntimeError(str(e)) from None
        cfg.rendezvous = workdir
    from ..lab.links import PEER_IF

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if lab is not None:  # a fresh namespace: the port is free; gloo's TCP crosses the same shaped, lossy links
        cfg.port = 29500
        env.update(MASTER_ADDR=lab.addr(0), GLOO_SOCKET_IFNAME=PEER_IF)
    else:
        cfg.port = _free_port()
        env["MASTER_ADDR"] = "127.0.0.1"
    config = json.dumps(asdict(cfg))
    events: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    logs = []
    t_launch = time.monotonic()
    try:
        for r in range(cfg.world):
            argv = [sys.executable, "-m", "peerd.tools.bench.ddp_baseline", config, str(r)]
            log = open(os.path.join(workdir, f"ddp{r}.log"), "w")  # noqa: SIM115 - lives with the process
            logs.append(log)
            kw: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": log, "stdin": subprocess.DEVNULL,
                                  "text": True, "env": env}
            procs.append(lab.popen(r, argv, **kw) if lab is not None else subprocess.Popen(argv, **kw))
            threading.Thread(target=read_events, args=(r, procs[-1].stdout, events), daemon=True).start()
        say(f"baseline: {cfg.world} {'torch DDP ranks over gloo' if cfg.kind == 'gloo' else 'hivemind peers'} "
            f"({cfg.model}, {cfg.steps} steps)")
        starts: dict[int, float] = {}
        evals: dict[int, dict[int, tuple[float, float]]] = {}
        losses: dict[int, list[tuple[float, float]]] = {}  # step -> [(held-out loss, time)] of the ranks
        done: dict[int, dict[str, Any]] = {}
        last_say = 0.0
        while len(done) < cfg.world:
            if time.monotonic() - t_launch > wall_limit_s:
                raise RuntimeError(f"the {cfg.kind} baseline did not finish within {wall_limit_s:.0f} s")
            try:
                r, ev = events.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.poll() not in (None, 0) and r not in done:
                        raise RuntimeError(f"{cfg.kind} rank {r} exited with {p.returncode}: "
                                           f"{tail(os.path.join(workdir, f'ddp{r}.log'))}") from None
                continue
            kind = ev.get("event")
            if kind == "start":
                starts[r] = ev["t"]
            elif kind == "eval":
                evals.setdefault(ev["step"], {})[r] = (ev["accuracy"], ev["t"])
                losses.setdefault(ev["step"], []).append((ev["held_out_loss"], ev["t"]))
                now = time.monotonic()
                if r == 0 and now - last_say > 1.0:
                    last_say = now
                    say(f"baseline step {ev['step']:>4}  loss {ev['loss']:.4f}  acc {ev['accuracy']:.3f}")
            elif kind == "done":
                done[r] = ev
            elif kind == "eof" and r not in done:
                code = procs[r].wait(10)
                raise RuntimeError(f"{cfg.kind} rank {r} exited with {code} before finishing: "
                                   f"{tail(os.path.join(workdir, f'ddp{r}.log'))}")
        for p in procs:
            p.wait(30)
        start = min(starts.values())
        results = [done[r] for r in range(cfg.world)]
        losses[cfg.steps + 1] = [(d["held_out_loss"], d["t"]) for d in results]  # the end of training
        curve = [(step, sum(v for v, _ in row) / len(row), max(t for _, t in row) - start)
                 for step, row in sorted(losses.items()) if len(row) == cfg.world]
        return {
            "kind": cfg.kind,
            "accuracy": sum(d["accuracy"] for d in results) / len(results),
            "final_loss": sum(d["held_out_loss"] for d in results) / len(results),
            "time_to_accuracy_s": time_to_accuracy(evals, start, target, cfg.world),
            "wall_s": max(d["t"] for d in results) - start,  # training only: first rank's start to last one's end
            "step_s": sorted(d["step_s"] for d in results)[len(results) // 2],
            "steps": cfg.steps,
            "curve": [[step, v, round(t, 3)] for step, v, t in curve],  # (step, mean held-out loss, seconds)
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def read_events(index: int, stream, out: queue.Queue) -> None:
    """Put each JSON line a child prints on ``out`` as (index, event) (other text as a "text" event), then "eof"."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            out.put((index, json.loads(line)))
        except json.JSONDecodeError:
            out.put((index, {"event": "text", "text": line}))
    out.put((index, {"event": "eof"}))


def tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file (empty when it cannot be read), for an error message."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    raise SystemExit(worker(DDPConfig(**json.loads(sys.argv[1])), int(sys.argv[2])))
