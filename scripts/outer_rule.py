"""Replay the GPT demo script's DiLoCo in one process with exact (or encoded) averages, to choose its outer rule,
period and codec.

N replicas of peerd/tools/demo_gpt.py's model, seeds, batches and schedule take H inner steps each, then their
progress is averaged exactly and the outer rule (peerd.torch.diloco.nesterov_outer) applied; the whole validation
split is evaluated after every outer step. ``--ddp`` runs the same loop as one model on the N x B sequences (what
DDP computes: its final loss is the demo's target). No daemon, no link: what the rule does to the loss, not the
clock. Prints one JSON object: the curve (step, validation loss) and the first step at or below ``--target``.

    python scripts/outer_rule.py --seed 1 --sync-every 20 --outer-momentum 0.4 --target 2.0801
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from peerd.compress import Codec
from peerd.compress import codec as make_codec
from peerd.compress.rounding import PHASE_AG, PHASE_RS, RoundingKey
from peerd.tools.demo_gpt import VAL_CHARS, build_gpt, cosine_lr, evaluate, get_batch, load_corpus, param_groups
from peerd.torch.diloco import nesterov_outer

RANGE = 4096  # values a range of the all-reduce's layout (a codec's groups never straddle one)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model: torch.nn.Module, vector: torch.Tensor) -> None:
    """Copy ``vector`` into the parameters (a copy: each replica keeps its own storage)."""
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[off: off + p.numel()].view_as(p))
            off += p.numel()


def _average(deltas: list[torch.Tensor], codec: Codec | None, step: int) -> torch.Tensor:
    """The members' mean pseudo-gradient as the all-reduce delivers it: with a codec, each member's contribution is
    encoded (stochastic rounding, its own draw) before the mean, and the mean again for the all-gather."""
    if codec is None:
        return torch.stack(deltas).mean(0)
    per = RANGE

    def through(v: np.ndarray, sender: int, phase: int) -> np.ndarray:
        return codec.roundtrip(v, per, key=RoundingKey(run=1, round=step, sender=sender, phase=phase))

    mean = np.mean([through(d.numpy(), i, PHASE_RS) for i, d in enumerate(deltas)], axis=0, dtype=np.float32)
    return torch.from_numpy(through(mean, len(deltas), PHASE_AG))


def replay(args: argparse.Namespace) -> dict:
    """The curve of one configuration, stopping at the first outer step at or below ``args.target``."""
    torch.set_num_threads(1)
    text = load_corpus()
    train, val = text[:-VAL_CHARS], text[-VAL_CHARS:]
    models = [build_gpt(args.seed) for _ in range(1 if args.ddp else args.peers)]
    opts = [torch.optim.AdamW(param_groups(m, 0.1), lr=args.lr, betas=(0.9, 0.95)) for m in models]
    rngs = [np.random.default_rng(args.seed * 1000 + i) for i in range(args.peers)]
    global_ = flat(models[0]).clone()
    momentum = torch.zeros_like(global_)
    every = 1 if args.ddp else args.sync_every
    codec = None if args.compression == "fp32" else make_codec(args.compression)
    curve: list[tuple[int, float]] = []
    reached = None
    for step in range(args.max_steps or args.steps):
        lr = cosine_lr(step, args.steps, args.lr, args.warmup)
        batches = [get_batch(train, r, args.batch) for r in rngs]
        if args.ddp:
            batches = [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))]
        for m, o, (x, y) in zip(models, opts, batches, strict=True):
            for g in o.param_groups:
                g["lr"] = lr
            o.zero_grad()
            _, loss = m(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), args.clip)
            o.step()
        if (step + 1) % every:
            continue
        if not args.ddp:
            delta = _average([global_ - flat(m) for m in models], codec, step)
            nesterov_outer(global_, momentum, delta, args.outer_lr, args.outer_momentum)
            for m in models:
                load(m, global_)
        if args.ddp and (step + 1) % args.sync_every:
            continue
        curve.append((step + 1, round(evaluate(models[0], val)[0], 4)))
        if reached is None and args.target is not None and curve[-1][1] <= args.target:
            reached = step + 1
            if not args.to_end:
                break
    return {"seed": args.seed, "peers": args.peers, "sync_every": args.sync_every, "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum, "compression": args.compression,
            "ddp": args.ddp, "steps": args.steps, "target": args.target,
            "reached_at": reached, "curve": curve}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/outer_rule.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=600, help="the cosine schedule's length (the demo's --steps)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default --steps)")
    p.add_argument("--sync-every", type=int, default=20, help="inner steps per outer step (--ddp: evaluate every)")
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ddp", action="store_true", help="one model on every replica's batch, as DDP trains")
    p.add_argument("--target", type=float, default=None, help="stop at the first outer step at or below this loss")
    p.add_argument("--compression", choices=("fp32", "int8", "int4"), default="fp32",
                   help="how the pseudo-gradients travel (int8/int4: 128 values a scale, stochastic rounding)")
    p.add_argument("--to-end", action="store_true", help="go on past the target")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    out = replay(args)
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
