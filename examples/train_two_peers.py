"""Two peers train one model together through peerd: a complete, runnable example.

On one machine (starts `peerd swarm --peers 2`, runs two trainers against it, stops the swarm):

    python examples/train_two_peers.py

Across machines (each machine runs its own daemon with `peerd join`, then one trainer beside it):

    python examples/train_two_peers.py --peer 0                      # on machine A
    python examples/train_two_peers.py --peer 1                      # on machine B
    python examples/train_two_peers.py --peer 1 --socket /run/x.sock # a daemon with a non-default socket

The one rule of a collaborative script: every peer builds the same model from the same weights, and every peer draws
its own batches. Here the model is seeded with one shared seed and the batches with a seed per peer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

RUN = "two-peers-example"  # trainers with the same run name (and the same model) average together
MODEL_SEED = 0  # the same on every peer: every replica starts from the same weights


def make_data(n: int = 2048, dim: int = 16, classes: int = 4):
    """A fixed synthetic classification set (the same on every peer): points around one centre per class."""
    import torch

    g = torch.Generator().manual_seed(1234)
    centres = torch.randn(classes, dim, generator=g) * 2.0
    y = torch.randint(0, classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, dim, generator=g)
    return x, y


def train(peer: int, socket: str | None, steps: int, batch: int) -> dict:
    """One trainer: a plain PyTorch loop whose optimizer is wrapped by peerd.torch.Optimizer."""
    import torch

    import peerd.torch

    torch.set_num_threads(1)
    x, y = make_data()
    x_train, y_train, x_test, y_test = x[:1536], y[:1536], x[1536:], y[1536:]

    torch.manual_seed(MODEL_SEED)  # 1. the same initial weights on every peer
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = peerd.torch.Optimizer(torch.optim.Adam(model.parameters(), lr=3e-3), run=RUN, socket=socket)  # 2. wrap
    batches = torch.Generator().manual_seed(1000 + peer)  # 3. each peer draws its own batches

    for _ in range(steps):
        idx = torch.randint(0, len(x_train), (batch,), generator=batches)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        reply = opt.step(samples=batch, loss=loss.item())  # averaged with the other peer, then a local step
        if opt.step_count % 20 == 0:
            print(f"peer {peer}  step {opt.step_count:3d}  loss {loss.item():.3f}  "
                  f"group {reply['group_size']}  {reply['outcome']}", flush=True)
    opt.finish()  # end on a common point: one last average of the parameters, waiting for a peer that ends later
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        checksum = sum(p.double().sum().item() for p in model.parameters())
    result = {"peer": peer, "steps": opt.step_count, "accuracy": round(accuracy, 4),
              "param_checksum": round(checksum, 6), "outcomes": opt.outcomes}
    print(json.dumps(result), flush=True)
    return result


def on_one_machine(steps: int, batch: int) -> int:
    """Start two local daemons, run one trainer process per daemon, check that they agree, stop the daemons."""
    swarm = subprocess.Popen([sys.executable, "-m", "peerd", "swarm", "--peers", "2", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = swarm.stdout.readline()  # one JSON line once both daemons answer
        if not line:
            print("peerd swarm exited before it was ready", file=sys.stderr)
            return 1
        sockets = [p["socket"] for p in json.loads(line)["peers"]]
        print(f"swarm ready: daemons at {sockets[0]} and {sockets[1]}", flush=True)
        trainers = [subprocess.Popen([sys.executable, __file__, "--peer", str(i), "--socket", s,
                                      "--steps", str(steps), "--batch", str(batch)], stdout=subprocess.PIPE, text=True)
                    for i, s in enumerate(sockets)]
        results = []
        for t in trainers:
            out, _ = t.communicate()
            sys.stdout.write(out)
            if t.returncode != 0:
                print(f"a trainer exited with {t.returncode}", file=sys.stderr)
                return 1
            results.append(json.loads(out.strip().splitlines()[-1]))
        same = abs(results[0]["param_checksum"] - results[1]["param_checksum"]) < 1e-3
        print(f"both peers: accuracy {results[0]['accuracy']:.3f} / {results[1]['accuracy']:.3f}, "
              f"parameters {'identical' if same else 'DIFFERENT'}", flush=True)
        return 0 if same else 1
    finally:
        swarm.send_signal(signal.SIGINT)  # `peerd swarm` stops its daemons on Ctrl-C
        try:
            swarm.wait(timeout=15)
        except subprocess.TimeoutExpired:
            swarm.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer", type=int, help="run one trainer with this peer number (its batch seed) against "
                   "a running daemon; without it, start two local daemons and two trainers")
    p.add_argument("--socket", help="the daemon's local socket (default: $PEERD_SOCKET or the per-user default)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    args = p.parse_args()
    if args.peer is None:
        start = time.monotonic()
        rc = on_one_machine(args.steps, args.batch)
        print(f"done in {time.monotonic() - start:.1f} s", flush=True)
        return rc
    train(args.peer, args.socket or os.environ.get("PEERD_SOCKET"), args.steps, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
