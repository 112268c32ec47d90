"""The GPT script under hivemind (``python -m peerd.tools.demo_gpt --launcher hivemind``): the demo's second baseline.

It wraps the script's AdamW as hivemind's quickstart wraps an optimizer: ``hivemind.Optimizer`` over a ``hivemind.DHT``
whose first peer every other one bootstraps from, with the quickstart's ``matchmaking_time=3.0`` and
``averaging_timeout=10.0`` and local updates (``use_local_updates=True``): every peer steps on its own gradients and
the peers average their parameters in the background once they have processed ``target_batch_size`` samples
together, here the samples of ``sync_every`` steps of every peer (DiLoCo's period in the demo). (hivemind's other
way, gradients accumulated to a global batch and averaged before each step, pays a matchmaking of seconds at every
step of this script's global batch of 32 sequences: on the link lab it did not finish 30 steps in ten minutes.)

hivemind is not a dependency of peerd: ``pip install hivemind==1.1.12`` into the environment that runs the demo.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

MATCHMAKING_S = 3.0  # hivemind's quickstart
AVERAGING_TIMEOUT_S = 10.0  # hivemind's quickstart
RENDEZVOUS_TIMEOUT_S = 120.0  # how long a peer waits for the first one's addresses
PEERS_FILE = "hivemind-peers"


def need_hivemind() -> Any:
    """The hivemind module, or a clear error that says how to get it."""
    try:
        import hivemind
    except ImportError:
        raise SystemExit("--launcher hivemind (peerd demo --baseline hivemind) needs hivemind in the environment "
                         "that runs the demo: pip install hivemind==1.1.12") from None
    return hivemind


def _publish(path: str, addrs: list[str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(addrs) + "\n")
    os.replace(tmp, path)


def _await_peers(path: str, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> list[str]:
    """The first peer's multiaddrs, once it has written them (an error after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                addrs = [line.strip() for line in f if line.strip()]
            if addrs:
                return addrs
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"hivemind: the first peer did not publish its addresses in {path} within {timeout_s:.0f} s")


def wrap_hivemind(opt: Any, args: argparse.Namespace) -> Any:
    """The user's optimizer wrapped as hivemind's quickstart does (see the module docstring)."""
    hivemind = need_hivemind()
    if not args.rendezvous:
        raise SystemExit("--launcher hivemind needs --rendezvous DIR (a folder every peer can read)")
    path = os.path.join(args.rendezvous, PEERS_FILE)
    listen = ["/ip4/0.0.0.0/tcp/0"]
    if args.index == 0:
        dht = hivemind.DHT(start=True, host_maddrs=listen)
        addrs = [str(a) for a in dht.get_visible_maddrs()]
        _publish(path, [a for a in addrs if "/127.0.0.1/" not in a] or addrs)
    else:
        dht = hivemind.DHT(start=True, host_maddrs=listen, initial_peers=_await_peers(path))
    per_epoch = args.batch * args.world * args.sync_every
    matchmaking = getattr(args, "matchmaking_s", None) or MATCHMAKING_S
    return hivemind.Optimizer(dht=dht, run_id=args.run, optimizer=opt, batch_size_per_step=args.batch,
                              target_batch_size=per_epoch, use_local_updates=True, matchmaking_time=matchmaking,
                              averaging_timeout=AVERAGING_TIMEOUT_S, verbose=False)


def inner_groups(hm: Any) -> list[dict[str, Any]]:
    """The wrapped optimizer's own parameter groups: hivemind's ``param_groups`` are copies, where a learning rate
    set would not reach the optimizer."""
    return hm.opt.param_groups


def close(hm: Any) -> None:
    """Leave the run: hivemind's optimizer, then its DHT."""
    dht = hm.dht
    hm.shutdown()
    dht.shutdown()
