"""`peerd demo --model gpt`: a user's own character-level GPT training script, wrapped for peerd, DDP or hivemind.

The model (4 layers, 128 wide, 4 heads, 128 characters of context: 0.82 M parameters) learns Python's own
standard library source (ASCII, the first ``TEXT_BYTES`` of the sorted ``*.py`` files under the running
interpreter's stdlib directory: no download, the same bytes for the same Python build). The script is what a user
writes: AdamW with weight-decay groups, a cosine schedule with warmup, gradient clipping; peerd's wrap is the one
README shows (``peerd.torch.Optimizer(opt, run=...)``, the parameter-averaging period left "auto"), DiLoCo's and
overlap's likewise,
``--launcher ddp`` runs the same loop under ``torch.distributed`` DDP over gloo (the demo's baseline), and
``--launcher hivemind`` under ``hivemind.Optimizer`` (peerd.tools.demo_hivemind: the second baseline).

Every trainer prints JSON lines in `peerd train`'s shape (start, step, done), so ``peerd demo`` drives it as it
drives the digits trainer. Held-out figures are on the whole validation split; ``accuracy`` is next-character
accuracy. The ``t`` of every record is a training clock: this process's monotonic time less the seconds it spent
evaluating, so time-to-target counts training, not the demo's own evaluations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cliargs import bucket_mb, period
from .demo_train import wait_for_go

TEXT_BYTES = 2_000_000  # the corpus: this much of the stdlib's source
VAL_CHARS = 32_768  # the validation split: the corpus's last 32 KiB (255 windows of BLOCK)
VOCAB = 128  # ASCII; any other byte reads as "?"
BLOCK = 128
EVAL_BATCH = 64  # validation windows per forward


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape: 4 x (attention + MLP) at width 128, 0.82 M parameters."""

    vocab: int = VOCAB
    block: int = BLOCK
    layers: int = 4
    heads: int = 4
    width: int = 128


def load_corpus(limit: int = TEXT_BYTES) -> Any:
    """The stdlib's ``*.py`` files in name order, concatenated up to ``limit`` bytes, as uint8 codes below VOCAB."""
    import numpy as np

    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    text = np.frombuffer(b"\n".join(parts)[:limit], dtype=np.uint8).copy()
    if len(text) < 4 * VAL_CHARS:
        raise RuntimeError(f"the stdlib under {root} holds only {len(text)} bytes of *.py: too little to train on")
    text[text >= VOCAB] = ord("?")
    return text


def evaluates(step: int, args: Any, landed: bool = False) -> bool:
    """Whether the whole validation split is evaluated after ``step``: every ``eval_every`` steps, and five times
    as often past ``steps`` (the extra steps are where a run close to its target crosses it: a coarse curve would
    report the crossing up to ``eval_every`` steps late). DiLoCo's replicas hold the swarm's model only where an
    outer average has just landed (``landed``): there, and only there, after every outer step."""
    if not args.eval_every:
        return False
    if getattr(args, "mode", "sync") == "diloco" and getattr(args, "launcher", "peerd") == "peerd":
        return landed
    every = args.eval_every if step <= args.steps else max(1, args.eval_every // 5)
    return step % every == 0


def build_gpt(seed: int, cfg: GPTConfig = GPTConfig()):
    """A GPT-2-style decoder (pre-norm blocks, learned positions, causal attention), seeded."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(cfg.width)
            self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
            self.proj = nn.Linear(cfg.width, cfg.width)
            self.ln2 = nn.LayerNorm(cfg.width)
            self.fc = nn.Linear(cfg.width, 4 * cfg.width)
            self.out = nn.Linear(4 * cfg.width, cfg.width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, cfg.heads, c // cfg.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab, cfg.width)
            self.pos = nn.Embedding(cfg.block, cfg.width)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln = nn.LayerNorm(cfg.width)
            self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

        def forward(self, idx, targets=None):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            if targets is None:
                return logits
            return logits, F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))

    torch.manual_seed(seed)
    model = GPT()
    for name, p in model.named_parameters():  # GPT-2's init
        if p.dim() >= 2:
            torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight",
                                                                                                  "out.weight"))
                                  else 0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    return model


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups, as users write them: matrices decay, biases, norms and embeddings' 1-D params do not."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def cosine_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine down to a tenth of ``lr`` at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def get_batch(train, rng, batch: int):
    """``batch`` random windows of the training split and their next characters."""
    import numpy as np
    import torch

    starts = rng.integers(0, len(train) - BLOCK - 1, batch)
    x = np.stack([train[s: s + BLOCK] for s in starts]).astype(np.int64)
    y = np.stack([train[s + 1: s + 1 + BLOCK] for s in starts]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def evaluate(model, val) -> tuple[float, float]:
    """Mean cross-entropy and next-character accuracy over the whole validation split (non-overlapping windows)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    n = (len(val) - 1) // BLOCK
    x = torch.from_numpy(val[: n * BLOCK].astype("int64")).view(n, BLOCK)
    y = torch.from_numpy(val[1: n * BLOCK + 1].astype("int64")).view(n, BLOCK)
    was = model.training
    model.eval()
    total = correct = 0.0
    with torch.no_grad():
        for i in range(0, n, EVAL_BATCH):
            logits = model(x[i: i + EVAL_BATCH])
            total += F.cross_entropy(logits.reshape(-1, VOCAB), y[i: i + EVAL_BATCH].reshape(-1),
                                     reduction="sum").item()
            correct += (logits.argmax(-1) == y[i: i + EVAL_BATCH]).sum().item()
    model.train(was)
    return total / (n * BLOCK), correct / (n * BLOCK)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launcher", choices=("peerd", "ddp", "hivemind"), default="peerd")
    p.add_argument("--run", default="gpt")
    p.add_argument("--socket", default=None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--peers", type=int, default=1)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=None)
    p.add_argument("--batch", type=int, default=8, help="sequences of 128 characters per step and peer")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--mode", choices=("sync", "overlap", "diloco"), default="sync")
    p.add_argument("--average-every", type=period, default="auto")
    # diloco for a run of a few hundred inner steps: an outer step every 20, and plain averaging of the members'
    # progress as the outer rule. Measured in process on this model (4 members, exact averages, the cosine over
    # 600 steps; DDP's 300 steps of 4 x 8 sequences reach validation loss 1.831): H=20 with outer lr 1.0 and no
    # momentum 1.797 at 600 steps (1.847 at 500), H=20 with DiLoCo's own 0.7 and Nesterov 0.9 (made for
    # thousands of steps) 1.832; with H=50 the link-lab demo ends at 1.884. The outer momentum needs many more
    # outer steps than such a run has to pay off.
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--outer-lr", type=float, default=1.0, help="diloco: outer learning rate (default 1.0)")
    p.add_argument("--outer-momentum", type=float, default=0.4,
                   help="diloco: outer Nesterov momentum (default 0.4: on this model's 30 outer steps 0.4-0.5 reach a "
                        "loss 40-60 inner steps sooner than plain averaging; 0.6 and more, the paper's 0.9, later)")
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--compression", default=None)
    p.add_argument("--overlap-outer", action="store_true", help="diloco: outer averages overlap the next inner steps")
    p.add_argument("--no-keep-pace", action="store_true", help="diloco: DiLoCo(keep_pace=False)")
    p.add_argument("--keep-rounds", type=int, default=None)
    p.add_argument("--bucket-mb", type=bucket_mb, default=None)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--wait-go", action="store_true", help="a start barrier: print ready, wait for a line on stdin")
    p.add_argument("--slow", type=float, default=1.0, help="compute takes this many times as long (a straggler)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--extra-steps", type=int, default=0, help="steps past --steps at the schedule's final rate")
    p.add_argument("--final-average", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--world", type=int, default=1, help="ddp, hivemind: ranks")
    p.add_argument("--matchmaking-s", type=float, default=None,
                   help="hivemind: matchmaking_time (default: the quickstart's 3.0)")
    p.add_argument("--rendezvous", default=None, help="hivemind: a folder where the first peer leaves its addresses")


def wrap_peerd(model, opt, args: argparse.Namespace):
    """The README's wrap: one line around the user's optimizer (DiLoCo's and overlap's likewise)."""
    import peerd.torch

    extra: dict[str, Any] = {k: v for k, v in (("compression", args.compression),
                                               ("keep_rounds", args.keep_rounds)) if v is not None}
    if args.mode == "diloco":
        extra.pop("keep_rounds", None)
        # the outer step's deadline is DiLoCo's own default (60 s), as a user leaves it
        return peerd.torch.DiLoCo(model, opt, run=args.run, socket=args.socket, sync_every=args.sync_every,
                                  outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                                  sync_state=not args.no_sync, overlap_outer=args.overlap_outer,
                                  keep_pace=not args.no_keep_pace, **extra)
    if args.mode == "overlap":
        if args.bucket_mb is not None:
            extra["bucket_mb"] = args.bucket_mb
        extra.update(overlap=True, model=model)
    elif args.clip > 0:
        extra["clip_grad_norm"] = args.clip  # the average's norm is clipped, as under DDP (not each replica's)
    return peerd.torch.Optimizer(opt, run=args.run, socket=args.socket, average_params_every=args.average_every,
                                 timeout_s=args.timeout, sync_state=not args.no_sync, **extra)


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - the user's script, one loop
    p = argparse.ArgumentParser(prog="python -m peerd.tools.demo_gpt")
    add_arguments(p)
    args = p.parse_args(argv)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    text = load_corpus()
    train, val = text[:-VAL_CHARS], text[-VAL_CHARS:]
    model = build_gpt(args.seed if args.init_seed is None else args.init_seed)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    ddp = args.launcher == "ddp"
    hm = args.launcher == "hivemind"
    base = ddp or hm  # a baseline: no peerd optimizer in the loop
    net = model
    if hm:
        from . import demo_hivemind

        opt = demo_hivemind.wrap_hivemind(opt, args)
    elif ddp:
        import datetime

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=args.index, world_size=args.world,
                                timeout=datetime.timedelta(seconds=600))
        net = DistributedDataParallel(model)  # broadcasts rank 0's weights
    else:
        opt = wrap_peerd(model, opt, args)
    rng = np.random.default_rng(args.seed * 1000 + args.index)
    eval_s = 0.0  # seconds spent evaluating: the training clock leaves them out

    def clock() -> float:
        return time.monotonic() - eval_s

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)

    if args.wait_go:
        wait_for_go(args.index, emit)
    first = 0 if base else opt.step_count
    t_eval = time.monotonic()
    loss0, acc0 = evaluate(model, val)
    eval_s += time.monotonic() - t_eval
    synced = None if base else opt.synced_from
    emit({"event": "start", "peer": args.index, "rank": args.index, "step": first, "synced": synced,
          "held_out_loss": loss0, "accuracy": acc0, "params": sum(q.numel() for q in model.parameters()),
          "t": clock()})
    start = clock()
    compute_s = round_s = 0.0
    samples_total = 0
    step_times: list[float] = []
    waits: list[float] = []  # seconds each step waited in the optimizer's step() (the deadline's part)
    outcomes: dict[str, int] = {}
    complete = 0  # steps whose round ended on the group's common result (the reply's ``complete``)
    step = first
    while step < args.steps + args.extra_steps:
        t0 = time.monotonic()
        for group in (demo_hivemind.inner_groups(opt) if hm else opt.param_groups):
            group["lr"] = cosine_lr(step, args.steps, args.lr, args.warmup)
        x, y = get_batch(train, rng, args.batch)
        opt.zero_grad()
        if args.mode == "overlap":
            opt.last_microbatch(1)  # the step's one micro-batch: its backward hands the buckets out
        _, loss = net(x, y)
        loss.backward()
        if args.clip > 0 and (base or args.mode == "diloco"):
            # DDP: the gradients are averaged by now; DiLoCo's and hivemind's are each peer's own (hivemind has no
            # hook between its average and the step). peerd's sync wrap clips the average itself (clip_grad_norm);
            # overlap applies updates layer by layer: no global clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        t1 = time.monotonic()
        if args.slow > 1.0:
            time.sleep((args.slow - 1.0) * (t1 - t0))  # a straggler: its compute takes ``slow`` times as long
            t1 = time.monotonic()
        if base:
            opt.step()
            reply: dict[str, Any] = {"outcome": "averaged", "group_size": args.world, "seconds": 0.0,
                                     "received_fraction": 1.0}
            step += 1
        else:
            reply = opt.step(samples=1, loss=loss.item())
            step = opt.step_count
        t2 = time.monotonic()
        compute_s += t1 - t0
        round_s += reply.get("seconds", 0.0)
        samples_total += args.batch
        step_times.append(t2 - t0)
        waits.append(t2 - t1)
        outcomes[reply["outcome"]] = outcomes.get(reply["outcome"], 0) + 1
        complete += bool(reply.get("complete"))
        record = {"event": "step", "peer": args.index, "step": step, "loss": loss.item(), "samples": args.batch,
                  "outcome": reply["outcome"], "group_size": reply.get("group_size", 1),
                  "round_s": reply.get("seconds", 0.0), "received_fraction": reply.get("received_fraction", 0.0),
                  "complete": bool(reply.get("complete")),
                  "step_s": t2 - t0, "wait_s": t2 - t1, "compute_s": t1 - t0, "kept": reply.get("kept", False),
                  "mm_s": reply.get("matchmaking_s", 0.0)}
        for key in ("auto", "phases"):
            if key in reply:
                record[key] = reply[key]
        if evaluates(step, args, landed="outer" in reply):
            t_eval = time.monotonic()
            record["held_out_loss"], record["accuracy"] = evaluate(model, val)
            eval_s += time.monotonic() - t_eval
            record["t"] = clock()
        if base:
            if "t" in record:
                emit({"event": "eval", "rank": args.index, "step": step, "accuracy": record["accuracy"],
                      "held_out_loss": record["held_out_loss"], "loss": record["loss"], "t": record["t"]})
        else:
            emit(record)
    wall = clock() - start
    final_rounds = []
    if not base:
        opt.flush()
        if args.mode != "diloco":
            for _ in range(max(0, args.final_average)):
                r = opt.finish()  # (one average each: it waits for trainers that end later, not a step's window)
                final_rounds.append({"outcome": r["outcome"], "group_size": r["group_size"]})
        else:
            opt._load_local(0, opt.elems)  # the swarm's model: the global parameters, identical on every member
    t_end = clock()
    held, acc = evaluate(model, val)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy()
    result: dict[str, Any] = {
        "event": "done", "peer": args.index, "rank": args.index, "steps": step, "first_step": first,
        "held_out_loss": held, "accuracy": acc, "samples": samples_total, "wall_s": wall, "compute_s": compute_s,
        "round_s": round_s, "samples_per_second": samples_total / wall if wall > 0 else 0.0, "outcomes": outcomes,
        "local_steps": 0 if base else opt.local_steps, "synced": synced, "dropped_microbatches": 0, "tau": None,
        "final_average": final_rounds, "t_end": t_end, "t": t_end, "eval_s": eval_s, "mode": args.mode,
        "step_s": float(np.median(step_times)) if step_times else 0.0,
        "max_step_s": max(step_times, default=0.0), "max_wait_s": max(waits, default=0.0),
        "caught_up": 0 if base else getattr(opt, "caught_up", 0),
        "paced_steps": 0 if base else getattr(opt, "paced_steps", 0),
        "params_averages": 0 if base else getattr(opt, "params_averages", 0),
        "params_identical": 0 if base else getattr(opt, "params_identical", 0),
        "params_close": 0 if base else getattr(opt, "params_close", 0),
        "params_finite": bool(np.isfinite(flat).all()),
        "keep_rounds": None if base else getattr(opt, "keep_rounds", None),
        "kept_rounds": 0 if base else getattr(opt, "kept_rounds", 0), "tensor_bytes": 0, "complete_rounds": complete,
    }
    if not base and args.mode == "diloco":
        result.update(sync_every=args.sync_every, fragments=1, outer_steps=opt.outer_steps,
                      state_sha=opt.state_sha().hex())
    if not base and "auto" in getattr(opt, "last", {}):
        result["auto"] = opt.last["auto"]
    emit(result)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**result, "params": flat.tolist()}, f)
        os.replace(tmp, args.out)
    if ddp:
        dist.destroy_process_group()
    elif hm:
        demo_hivemind.close(opt)
    else:
        opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
