"""`peerd demo-trainer`: one collaborative trainer (a small MLP on handwritten digits) beside its daemon.

`peerd demo` runs one of these per daemon; a compose deployment runs one beside each daemon. Progress goes
to stdout as one JSON object per line (``--progress json``) or as text; the final result (held-out loss and
accuracy, the flat parameters) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ..cliargs import bucket_mb, count, period

DIGITS_TEST_FRACTION = 0.2
MAX_SKIPPED = 20  # consecutive steps with non-finite gradients after which a trainer stops as diverged
SPLIT_SEED = 1234  # the train/test split is the same on every peer: the held-out set is shared


def wait_for_go(index: int, emit: Callable[[dict[str, Any]], None]) -> None:
    """A launcher's start barrier: say this trainer is ready, then block until the launcher writes a line (or
    closes stdin), so that founders launched together take their first step together instead of the first one
    averaging alone while another still loads."""
    emit({"event": "ready", "peer": index})
    sys.stdin.readline()


def load_digits_split() -> tuple[Any, Any, Any, Any]:
    """Digits (1797 8x8 images, 10 classes), scaled to [0, 1], split 80/20 the same way on every peer."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(len(x) * DIGITS_TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


MODELS = ("mlp", "wide")
TIMEOUT_S = 30.0  # --timeout's default: peerd.torch.Optimizer's timeout_s (not imported: no torch here)
WIDE_HIDDEN = (2048, 1024)  # the wide model's hidden layers: 2,241,546 parameters (9 MB of float32)


def build_model(hidden: int, seed: int, model: str = "mlp"):
    """``mlp``: 64 -> hidden -> 10 (4,810 parameters at hidden 64), compute-bound even on slow links.
    ``wide``: 64 -> 2048 -> 1024 -> 10 (2.24 M parameters), so a 100 Mbit link, not the CPU, sets the step time."""
    import torch

    torch.manual_seed(seed)
    if model == "wide":
        a, b = WIDE_HIDDEN
        return torch.nn.Sequential(torch.nn.Linear(64, a), torch.nn.ReLU(), torch.nn.Linear(a, b), torch.nn.ReLU(),
                                   torch.nn.Linear(b, 10))
    if model != "mlp":
        raise ValueError(f"model {model!r}: expected one of {', '.join(MODELS)}")
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def sample_batch(shard, rng, batch: int, micro: int) -> list:
    """The step's micro-batches of sample indices, as `peerd demo-trainer` draws them (the DDP baseline too)."""
    size = max(1, batch // micro)
    return [shard[rng.integers(0, len(shard), size)] for _ in range(micro)]


def evaluate(model, x, y) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F  # noqa: N812

    with torch.no_grad():
        out = model(torch.from_numpy(x))
        loss = F.cross_entropy(out, torch.from_numpy(y)).item()
        acc = (out.argmax(1).numpy() == y).mean().item()
    return loss, acc


def robust_option(text: str) -> str:
    """argparse type of --robust: off, clip[:C] or centered[:C] (checked here, applied by the daemons)."""
    from ..allreduce.robust import parse_robust

    try:
        parse_robust(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _max_samples(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--max-samples must be a positive number, not {text!r}")
    return value


def _quant_group(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--quant-group must be 1..65535, not {text!r}")
    return value


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """--compression, --quant-group, --rounding (peerd demo-trainer, peerd demo, peerd bench moshpit): None when not
    given, so a trainer that names nothing leaves the run's codec (fp32) as it is."""
    p.add_argument("--compression", default=None, choices=("fp32", "fp16", "bf16", "int8", "int4", "arc-topk"),
                   help="how averages travel: fp32 exact, fp16/bf16 half the bytes, int8/int4 a quarter/eighth "
                        "with a scale per group, arc-topk only the largest gradient rows (trainers only); every "
                        "member of a run must use the same (default fp32)")
    p.add_argument("--quant-group", type=_quant_group, default=None, metavar="G",
                   help="int8/int4: values per scale and min, 1..65535 (default 128)")
    p.add_argument("--rounding", default=None, choices=("stochastic", "nearest"),
                   help="int8/int4 rounding (default stochastic: unbiased)")
    p.add_argument("--topk-ratio", type=_topk_ratio, default=None, metavar="R",
                   help="arc-topk: share of each matrix's rows averaged per shard, in (0, 1] (default 0.1)")


def _topk_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--topk-ratio must be in (0, 1], not {text!r}")
    return value


def compression_options(args: argparse.Namespace) -> dict[str, Any]:
    """The codec keywords of peerd.torch.Optimizer from parsed arguments: only those given."""
    return {k: getattr(args, k) for k in ("compression", "quant_group", "rounding", "topk_ratio")
            if getattr(args, k, None) is not None}


def averaged_bytes(args: argparse.Namespace, elems: int, reply: dict[str, Any], kind: str = "grads") -> int:
    """Bytes one encoded copy of an averaged vector of ``elems`` float32 values takes in the run's codec: what
    the demo's ``bytes_sent_per_peer`` adds per average (DiLoCo's ``payload_bytes`` counts the same way). Body
    codecs: the codec's body size. arc-topk (gradients only; parameters go in fp32): not a fixed size per
    value, so the daemon's UDP payload bytes for the round scaled to one copy (a member of n sends 2 (n - 1) / n
    of a vector in a reduce-scatter and an all-gather; the envelopes' few percent included)."""
    from ..compress import codec as make_codec

    name = getattr(args, "compression", None) or "fp32"
    if name == "arc-topk":
        n = int(reply.get("group_size", 1))
        if kind != "grads" or n < 2 or not reply.get("bytes_sent"):
            return 4 * elems
        return round(int(reply["bytes_sent"]) * n / (2 * (n - 1)))
    params = {k: v for k, v in (("group", getattr(args, "quant_group", None)),
                                ("rounding", getattr(args, "rounding", None))) if v is not None}
    return make_codec(name, **params if name.startswith("int") else {}).body_size(elems)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run id: trainers with the same run id and model train together")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="the daemon's local socket (default: $PEERD_SOCKET, else $XDG_RUNTIME_DIR/peerd.sock, else "
                        "/tmp/peerd-UID/peerd.sock)")
    p.add_argument("--steps", type=int, default=200, metavar="S", help="train until this step (default 200)")
    p.add_argument("--peers", type=int, default=1, metavar="N", help="how many peers share the data (default 1)")
    p.add_argument("--index", type=int, default=0, metavar="I", help="this peer's data shard, 0..N-1 (default 0)")
    p.add_argument("--seed", type=int, default=0, metavar="K", help="seed of the data order (default 0)")
    p.add_argument("--init-seed", type=int, default=None, metavar="K",
                   help="seed of the model's initial weights (default: --seed; a joiner takes the swarm's)")
    p.add_argument("--batch", type=int, default=32, metavar="B", help="samples per step (default 32)")
    p.add_argument("--micro", type=int, default=4, metavar="M", help="micro-batches per step (default 4)")
    p.add_argument("--model", choices=MODELS, default="mlp",
                   help="mlp: 64-hidden-10 (4,810 parameters); wide: 64-2048-1024-10 (2.24 M parameters, so a "
                        "100 Mbit link matters); default mlp")
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the mlp model (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    p.add_argument("--average-every", type=period, default="auto", metavar="K|auto",
                   help="average parameters every K steps (0: never; default auto: 10, longer once rounds end on "
                        "the group's common result)")
    p.add_argument("--final-average", type=int, default=2, metavar="R",
                   help="after the last step, average parameters R more times so replicas end together (default 2)")
    p.add_argument("--keep-rounds", type=int, default=None, metavar="R",
                   help="keep a Moshpit group that formed complete for R rounds, renewed without the DHT "
                        "(1: a new group every round; default: peerd.torch.Optimizer's, 100)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="S",
                   help=f"seconds an average may take before the step goes on without it (default {TIMEOUT_S:g}, "
                        f"as peerd.torch.Optimizer)")
    p.add_argument("--robust", type=robust_option, default="off", metavar="off|clip[:C]|centered[:C]",
                   help="limit how far one member's contribution can pull an average: clip bounds each member's "
                        "norm, centered bounds its distance from the others' (default off)")
    p.add_argument("--max-samples", type=_max_samples, default=None, metavar="N",
                   help="the largest sample count (averaging weight) a member may claim in this run's rounds")
    add_compression_arguments(p)
    p.add_argument("--compute-jitter", type=float, default=0.0, metavar="X",
                   help="simulate compute: each micro-batch takes 10 ms * (1 + X * Exp(1)) more (default 0: off)")
    p.add_argument("--dropcompute", default="off", metavar="off|auto|SECONDS",
                   help="DropCompute threshold per step: off, auto, or seconds (default off)")
    p.add_argument("--no-sync", action="store_true", help="do not download the swarm's state before starting")
    p.add_argument("--start-at", type=float, default=None, metavar="UNIX_S",
                   help="take the first step at this wall-clock time (unix seconds), once loaded and connected: "
                        "trainers launched one after another then train in step (default: at once)")
    p.add_argument("--wait-go", action="store_true",
                   help="once loaded and connected, print a ready event and wait for a line on stdin before the "
                        "first step: a launcher's start barrier, as DDP's rendezvous is (default: start at once)")
    p.add_argument("--state-every", type=int, default=10, metavar="S",
                   help="publish a snapshot for joiners every S steps (default 10)")
    p.add_argument("--eval-every", type=int, default=10, metavar="S",
                   help="held-out evaluation every S steps (default 10)")
    p.add_argument("--progress", choices=["text", "json", "none"], default="text",
                   help="text: a line per step and a summary; json: one JSON object per line; none: quiet "
                        "(default text)")
    p.add_argument("--json", action="store_true",
                   help="print only the final result, as one JSON object (text progress goes to stderr)")
    p.add_argument("--out", metavar="PATH", help="write the final result (JSON, with the parameters) here")
    p.add_argument("--mode", choices=["sync", "overlap", "diloco"], default="sync",
                   help="sync: average gradients every step (and parameters every K); overlap: the same, each "
                        "bucket's average overlapping backward and the next forward (DeAR); diloco: H local Adam "
                        "steps, then an outer Nesterov step on the swarm's averaged pseudo-gradient (default sync)")
    p.add_argument("--bucket-mb", type=bucket_mb, default="auto", metavar="MB",
                   help="overlap: gradient bucket size in MB of float32, or auto (the default: 25 MB, and half the "
                        "model tried at steps 10-14; the run keeps the faster)")
    p.add_argument("--sync-every", type=_positive_int, default=50, metavar="H",
                   help="diloco: inner steps between a fragment's outer steps (default 50)")
    p.add_argument("--fragments", type=_positive_int, default=1, metavar="F",
                   help="diloco: sync the model in F fragments at staggered steps (streaming DiLoCo; default 1)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="diloco: outer Nesterov momentum (default 0.9)")


def _positive_int(text: str) -> int:
    return count(text, 1)


def _progress_line(record: dict[str, Any]) -> str:
    """One event of ``peerd demo-trainer`` in words; accuracy only where it was measured."""
    event = record.get("event")
    if event == "step":
        acc = f"  acc {record['accuracy']:.3f}" if record.get("accuracy") is not None else ""
        return (f"step {record['step']:>4}  loss {record['loss']:.4f}{acc}  group {record['group_size']}  "
                f"round {record['round_s']:.3f} s  received {record['received_fraction']:.3f}  {record['outcome']}")
    if event == "start":
        synced = f", state synced from {record['synced']}" if record.get("synced") else ""
        return (f"peer {record['peer']}: starting at step {record['step']} with {record['params']} parameters"
                f"{synced}; held-out loss {record['held_out_loss']:.4f}, accuracy {record['accuracy']:.3f}")
    if event == "done":
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted((record.get("outcomes") or {}).items())) or "none"
        return (f"peer {record['peer']}: done after {record['steps']} steps in {record['wall_s']:.1f} s "
                f"({record['samples_per_second']:.0f} samples/s); held-out loss {record['held_out_loss']:.4f}, "
                f"accuracy {record['accuracy']:.3f}; rounds: {outcomes}"
                f"{'; the model DIVERGED' if record.get('diverged') else ''}")
    return " ".join(f"{k} {v}" for k, v in record.items())


def run_train(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.nn.functional as F  # noqa: N812

    from ..localsock.client import DaemonError
    from ..torch import DiLoCo, DiLoCoError, DropCompute, Optimizer
    from ..torch.dropcompute import estimate_overhead

    torch.set_num_threads(1)
    if not 0 <= args.index < args.peers:
        print("peerd: error: --index must be in [0, --peers)", file=sys.stderr)
        return 2
    x_train, y_train, x_test, y_test = load_digits_split()
    shard = np.arange(args.index, len(x_train), args.peers)
    rng = np.random.default_rng(args.seed * 1000 + args.index)
    jitter = np.random.default_rng(args.seed * 1000 + args.index + 7)
    model = build_model(args.hidden, args.seed if args.init_seed is None else args.init_seed,
                        getattr(args, "model", "mlp"))
    budget: float | str | None
    budget = None if args.dropcompute == "off" else ("auto" if args.dropcompute == "auto" else float(args.dropcompute))
    dc = DropCompute(budget, workers=max(2, args.peers))

    def emit(record: dict[str, Any]) -> None:
        """Progress as one format only: JSON lines, or text lines (never JSON mixed into text)."""
        if args.progress == "json" and not args.json:
            print(json.dumps(record), flush=True)
        elif args.progress == "text":
            print(_progress_line(record), file=sys.stderr if args.json else sys.stdout, flush=True)

    diloco = getattr(args, "mode", "sync") == "diloco"
    overlap = getattr(args, "mode", "sync") == "overlap"
    try:
        if diloco:
            # the per-K parameter averages of sync mode are off: the outer steps keep the replicas together
            opt = DiLoCo(model, torch.optim.Adam(model.parameters(), lr=args.lr), run=args.run, socket=args.socket,
                         sync_every=args.sync_every, fragments=args.fragments, outer_lr=args.outer_lr,
                         outer_momentum=args.outer_momentum, timeout_s=max(args.timeout, 30.0),
                         sync_state=not args.no_sync, state_every=1 if args.state_every else 0,
                         max_samples=args.max_samples, robust=args.robust,
                         **{k: v for k, v in compression_options(args).items() if k != "topk_ratio"})
        else:
            opt = Optimizer(torch.optim.Adam(model.parameters(), lr=args.lr), run=args.run, socket=args.socket,
                            timeout_s=args.timeout, average_params_every=args.average_every,
                            sync_state=not args.no_sync, state_every=args.state_every,
                            robust=args.robust, max_samples=args.max_samples, overlap=overlap, model=model,
                            **compression_options(args),
                            bucket_mb=getattr(args, "bucket_mb", "auto"),
                            **({} if args.keep_rounds is None else {"keep_rounds": args.keep_rounds}))
    except (DaemonError, ValueError, NotImplementedError) as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    first_step = opt.step_count
    start_at = getattr(args, "start_at", None)
    if start_at is not None and start_at > time.time():
        time.sleep(start_at - time.time())
    if args.wait_go:
        wait_for_go(args.index, emit)
    loss0, acc0 = evaluate(model, x_test, y_test)
    # "t": this host's monotonic clock (shared by every process and namespace here), for time-to-accuracy
    emit({"event": "start", "peer": args.index, "step": first_step, "synced": opt.synced_from,
          "held_out_loss": loss0, "accuracy": acc0, "params": opt.elems, "layout": opt.layout_hash[:16],
          "t": time.monotonic()})
    start = time.monotonic()
    samples_total = 0
    compute_s = 0.0
    round_s = mm_s = 0.0
    micro = max(1, args.batch // args.micro)
    acc = acc0
    skipped = 0  # consecutive steps skipped for non-finite gradients
    tensor_bytes = 0  # encoded bytes of the vectors this trainer averaged (gradients, parameters, pseudo-gradients)
    step_times: list[float] = []
    outer_log: list[dict[str, Any]] = []
    diverged = False
    try:
        while opt.step_count < args.steps:
            t0 = time.monotonic()
            step_before = opt.step_count
            opt.zero_grad()
            dc.start_step()
            losses = []
            for k in range(args.micro):
                if not dc.keep_going():
                    break
                idx = shard[rng.integers(0, len(shard), micro)]
                if overlap and dc.decide_last(k, args.micro):
                    opt.last_microbatch(dc.samples + len(idx))  # its backward hands the buckets out
                with dc.microbatch(len(idx)):
                    xb, yb = torch.from_numpy(x_train[idx]), torch.from_numpy(y_train[idx])
                    loss = F.cross_entropy(model(xb), yb, reduction="sum")
                    loss.backward()
                    losses.append(loss.item())
                    if args.compute_jitter > 0:
                        time.sleep(0.01 * (1.0 + args.compute_jitter * jitter.exponential()))
            samples = dc.mean_grads(model.parameters())
            t1 = time.monotonic()
            compute_s += t1 - t0
            samples_total += samples
            train_loss = sum(losses) / samples
            reply = opt.step(samples=samples, loss=train_loss)
            if "auto" in reply:  # compression="auto" chose: the bytes below count in its codec
                args.compression = reply["auto"]["compression"]
            if reply["outcome"] == "averaged" and not diloco:
                tensor_bytes += averaged_bytes(args, opt.elems, reply)  # the gradient vector, in the run's codec
            for o in reply.get("outer", []):
                tensor_bytes += o["payload_bytes"]  # the fragment, encoded in the run's codec
                tensor_bytes += o["repaired_bytes"] + o.get("adopted_bytes", 0)
                outer_log.append({k: o[k] for k in ("step", "fragment", "sha", "outcome", "group_size", "rounds",
                                                    "agreed_members", "repaired_bytes", "adopted",
                                                    "received_fraction", "kept")})
            step_times.append(time.monotonic() - t0)
            skipped = skipped + 1 if reply["outcome"] == "nonfinite" and opt.step_count == step_before else 0
            if skipped >= MAX_SKIPPED:
                diverged = True  # the model itself has diverged (e.g. poisoned averages): stop, report it
                print(f"peerd: the model diverged: {skipped} steps in a row had non-finite gradients",
                      file=sys.stderr)
                break
            round_s += reply["seconds"]
            if reply["outcome"] == "averaged":
                dc.workers = reply["group_size"]  # DropCompute's N: the members that wait for each other
            mm_s += reply.get("matchmaking_s", 0.0)
            step = opt.step_count
            record = {"event": "step", "peer": args.index, "step": step, "loss": train_loss, "samples": samples,
                      "outcome": reply["outcome"], "group_size": reply["group_size"], "round_s": reply["seconds"],
                      "received_fraction": reply["received_fraction"], "tau": dc.tau if math.isfinite(dc.tau) else None,
                      "kept": reply.get("kept", False), "mm_s": reply.get("matchmaking_s", 0.0),
                      "micro": len(losses), "t0": t0, "compute_s": t1 - t0}
            if "outer" in reply:
                record["outer"] = [{k: o[k] for k in ("fragment", "sha", "group_size", "agreed_members",
                                                      "repaired_bytes", "adopted")} for o in reply["outer"]]
            if "params" in reply:
                params = reply["params"]
                if params["outcome"] == "averaged":
                    tensor_bytes += averaged_bytes(args, opt.elems, params, "params")
                record["params"] = {"outcome": params["outcome"], "group_size": params["group_size"],
                                    "s": params["seconds"], "kept": params.get("kept", False)}
            if args.eval_every and step % args.eval_every == 0:
                record["held_out_loss"], acc = evaluate(model, x_test, y_test)
                record["accuracy"] = acc
                record["t"] = time.monotonic()
            emit(record)
        opt.flush()  # overlap: the last step's updates
        # Lost datagrams and rounds without a group leave replicas slightly apart: end on a common point.
        final_rounds = []
        for _ in range(0 if diverged or diloco else max(0, args.final_average)):
            reply = opt.finish()  # (one average each: it waits for trainers that end later, not a step's window)
            tensor_bytes += averaged_bytes(args, opt.elems, reply, "params") if reply["outcome"] == "averaged" else 0
            final_rounds.append({"outcome": reply["outcome"], "group_size": reply["group_size"],
                                 "received_fraction": reply["received_fraction"]})
    except (DaemonError, DiLoCoError) as e:
        print(f"peerd: error: {e}", file=sys.stderr)
        return 1
    if diloco:  # the swarm's model: the global parameters, identical on every member
        opt._load_local(0, opt.elems)
    wall = time.monotonic() - start
    final_loss, final_acc = evaluate(model, x_test, y_test)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    result = {
        "event": "done", "peer": args.index, "steps": opt.step_count, "first_step": first_step,
        "held_out_loss": final_loss, "accuracy": final_acc, "samples": samples_total, "wall_s": wall,
        "compute_s": compute_s, "round_s": round_s, "matchmaking_s": mm_s,
        "samples_per_second": samples_total / wall if wall > 0 else 0.0,
        "outcomes": opt.outcomes, "local_steps": opt.local_steps, "synced": opt.synced_from,
        "dropped_microbatches": dc.dropped, "tau": dc.tau if math.isfinite(dc.tau) else None,
        # per-step time outside the slowest member's compute (rounds, the loop), measured in every mode: it
        # bounds what DropCompute can gain, and it rises with the machine's load
        "overhead_s": estimate_overhead(list(dc.computes), list(dc.cycles), dc.workers),
        "predicted_speedup": dc.choice.speedup if dc.choice else None,
        "final_average": final_rounds, "keep_rounds": opt.keep_rounds,
        "kept_rounds": opt.kept_rounds, "nonfinite_rounds": opt.nonfinite_rounds, "robust": args.robust,
        "compression": getattr(args, "compression", None) or "fp32",
        "params_finite": bool(np.isfinite(flat).all()), "diverged": diverged,
        "mode": args.mode if hasattr(args, "mode") else "sync", "tensor_bytes": tensor_bytes,
        "step_s": float(np.median(step_times)) if step_times else 0.0,
        "t_end": time.monotonic(),  # monotonic clock, shared by the host's processes (the start event has "t")
    }
    if diloco:
        result.update(sync_every=args.sync_every, fragments=args.fragments, outer_steps=opt.outer_steps,
                      state_sha=opt.state_sha().hex(), outer=outer_log)
    emit(result)
    if args.json:
        print(json.dumps(result), flush=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**result, "params": flat.tolist()}, f)
        os.replace(tmp, args.out)
    opt.close()
    return 0
