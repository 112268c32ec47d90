"""`peerd bench deadlines`: 4 daemons in the link lab average continuously; one member becomes 5x slower mid-run,
then is killed. Do the others wait for it while it lives, and how soon after its death do they average again? Run
once with self-tuned deadlines (``peerd join --deadlines auto``) and once with today's constants (``fixed``).

Every peer sits in its own namespace of the link lab (peerd.tools.lab.links) behind ``--link RATE``. Trainers (seeded
noise gradients, so a step costs no compute) take sync steps of ``--params`` float32 parameters without pause. After
``--before`` seconds member ``SLOW``'s link is cut to a fifth of its rate both ways (its tbfs changed in place);
``--slow`` seconds later its daemon and trainer are SIGKILLed; the others run ``--after`` seconds more. Each trainer
writes every step's record (wall-clock start and end, outcome, group size, received fraction) as it takes it. The
figures per variant (``--json``):

- ``steps_while_slow``: the survivors' steps that started while the slow member was alive and slow;
  ``failed_while_slow``: those that did not average with every member (outcome not ``averaged`` or a smaller
  group): a round that failed for the slow member; ``received_fraction_min_while_slow``: the least part of a
  vector that arrived (datagrams the cut link dropped while the pacer found its new rate);
- ``silence_s``: the RTT-derived deadline (the silence that ends an averaging phase, ``phase_silence``) a
  survivor's ``peerd status --json`` showed just before the kill; ``window_s``: its matchmaking window;
- ``in_flight_round_s``: the round the kill caught, the longest over the survivors; ``in_flight_extra_s``: how much
  longer than a round while slow (``slow_round_s``) it took, the wait for the dead member; against ``silence_s``
  in ``in_flight_extra_over_silence`` (each of an average's two phases ends one silence after its last datagram);
- ``kill_to_round_s``: seconds from the kill to the end of the first average without the dead member, the latest
  over the survivors; ``next_matchmaking_s``: that round's matchmaking (none where the survivors found the member
  dead mid-average and renewed their kept group without it; a group that broke gathers anew);
- ``kill_to_start_s``: seconds from the kill to when that average began to move data (its step's start plus
  the phases before the transfer), the latest over the survivors: when the next round starts;
  ``kill_to_start_over_silence``: that against ``silence_s`` (the caught round's own data included: a kill early in
  a long round waits for the rest of its data however fast the death is found);
- ``death_cost_s``: what the death itself added: the caught round's time over a slow round (none where it was
  quicker) plus the next round's matchmaking; ``death_cost_over_silence``: that against ``silence_s`` (how many
  RTT-derived deadlines the death cost);
- ``round_s`` / ``slow_round_s``: the median survivor step before the slowdown and while slow.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from ...deadlines import DEADLINE_MODES
from ..lab.links import PEER_IF, LinkLab, parse_rate, tbf_params
from ..swarm import LocalSwarm
from .runner import run_bench

SLOW = 3  # the member that slows, then dies (not node 0, which the others bootstrap from)
SLOWDOWN = 5  # its link's rate is divided by this
RUN = "bench-deadlines"
WARMUP = 3  # steps every trainer takes before the timeline starts
WARMUP_TIMEOUT_S = 180.0


@dataclass
class DeadlinesBenchConfig:
    peers: int = 4
    link: str = "100mbit"
    params: int = 1_000_000
    before_s: float = 8.0
    slow_s: float = 12.0
    after_s: float = 10.0
    modes: tuple[str, ...] = DEADLINE_MODES
    timeout_s: float = 30.0  # the trainers' step timeout (the step wait's cap)

    def check(self) -> None:
        if self.peers < 3:
            raise ValueError("--peers must be at least 3 (two must remain after the kill)")
        parse_rate(self.link)
        if not 1 <= self.params <= 1 << 28:
            raise ValueError("--params must be in [1, 2**28]")
        if min(self.before_s, self.slow_s, self.after_s) <= 0:
            raise ValueError("--before, --slow and --after must be positive")
        if not self.modes or any(m not in DEADLINE_MODES for m in self.modes):
            raise ValueError(f"--modes must be among {DEADLINE_MODES}")


def set_link_rate(lab: LinkLab, peer: int, rate_bps: int) -> None:
    """Change peer ``peer``'s tbfs (its upload in its namespace, its download at the bridge) to ``rate_bps``."""
    t = tbf_params(rate_bps, lab.mtu)
    for ns, dev in ((lab.netns(peer), PEER_IF), (lab.bridge_ns, lab.bridge_port(peer))):
        subprocess.run(["tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
                        "burst", str(t.burst_bytes), "limit", str(t.limit_bytes)], check=True, capture_output=True)


def _full(r: dict[str, Any], size: int) -> bool:
    """Averaged with every member (a datagram lost on the way is the link's, not a deadline's: see the fractions)."""
    return r["outcome"] == "averaged" and r["group_size"] >= size


def summarize(records: list[list[dict[str, Any]]], cfg: DeadlinesBenchConfig, mode: str, t_slow: float,
              t_kill: float, silence_s: float | None, window_s: float | None) -> dict[str, Any]:
    """One variant's figures from the survivors' step records (wall-clock times) and the slowdown's and kill's."""
    survivors = [rs for i, rs in enumerate(records) if i != SLOW]
    before = [r["t1"] - r["t0"] for rs in survivors for r in rs if r["t1"] <= t_slow]
    slow = [r for rs in survivors for r in rs if t_slow <= r["t0"] and r["t1"] <= t_kill]
    moved_on: list[float] = []
    in_flight: list[dict[str, Any]] = []
    following: list[dict[str, Any]] = []
    for rs in survivors:
        later = [r for r in rs if r["t1"] > t_kill]
        done = [r for r in later if r["outcome"] == "averaged" and r["group_size"] <= cfg.peers - 1]
        if later:
            in_flight.append(later[0])
        if done:
            moved_on.append(done[0]["t1"] - t_kill)
            following.append(done[0])
    complete = len(moved_on) == len(survivors) and len(in_flight) == len(survivors)
    kill_to_round = max(moved_on) if complete else None
    slow_round = statistics.median([r["t1"] - r["t0"] for r in slow]) if slow else None
    flight = max(r["t1"] - r["t0"] for r in in_flight) if complete else None
    extra = None if flight is None or slow_round is None else flight - slow_round
    start = max(_transfer_start(r) for r in following) - t_kill if complete else None
    mm = max((r["phases"].get("matchmaking", 0.0) for r in following), default=None)
    cost = None if extra is None or mm is None else max(0.0, extra) + mm
    return {
        "mode": mode, "peers": cfg.peers, "link": cfg.link, "params": cfg.params, "slowdown": SLOWDOWN,
        "round_s": round(statistics.median(before), 4) if before else None,
        "slow_round_s": None if slow_round is None else round(slow_round, 4),
        "steps_while_slow": len(slow),
        "failed_while_slow": sum(not _full(r, cfg.peers) for r in slow),
        "received_fraction_min_while_slow": min((r["received_fraction"] for r in slow), default=None),
        "outcomes_while_slow": sorted({r["outcome"] for r in slow}),
        "silence_s": silence_s, "window_s": window_s,
        "in_flight_round_s": _round4(flight), "in_flight_extra_s": _round4(extra),
        "in_flight_extra_over_silence": None if extra is None or not silence_s else round(extra / silence_s, 3),
        "next_matchmaking_s": _round4(mm),
        "kill_to_round_s": _round4(kill_to_round),
        "kill_to_start_s": _round4(start),
        "kill_to_start_over_silence": None if start is None or not silence_s else round(start / silence_s, 3),
        "death_cost_s": _round4(cost),
        "death_cost_over_silence": None if cost is None or not silence_s else round(cost / silence_s, 3),
    }


def _transfer_start(r: dict[str, Any]) -> float:
    """When a step's average began to move data: its start plus what came before the transfer."""
    ph = r["phases"]
    return r["t0"] + sum(ph.get(k, 0.0) for k in ("copy_in", "daemon", "matchmaking", "members"))


def _round4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _read_records(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]
    except OSError:
        return []


def _wait_steps(workdir: str, cfg: DeadlinesBenchConfig, procs: list[subprocess.Popen]) -> None:
    """Until every trainer has taken WARMUP steps (starting torch takes several seconds on a small machine)."""
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while True:
        done = [len(_read_records(os.path.join(workdir, f"steps{i}.jsonl"))) >= WARMUP for i in range(cfg.peers)]
        if all(done):
            return
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            with open(os.path.join(workdir, f"trainer{done.index(False)}.log")) as f:
                raise RuntimeError(f"the trainers did not start averaging:\n{f.read()[-3000:]}")
        time.sleep(0.5)


def run_variant(cfg: DeadlinesBenchConfig, mode: str, say: Any) -> dict[str, Any]:
    """One run of the scenario with every daemon under ``--deadlines mode``."""
    workdir = tempfile.mkdtemp(prefix="peerd-bench-deadlines-")
    lab = LinkLab(cfg.peers, cfg.link)
    lab.start()
    procs: list[subprocess.Popen] = []
    logs: list[Any] = []
    try:
        swarm = LocalSwarm(os.path.join(workdir, "swarm"), lab=lab)
        try:
            for _ in range(cfg.peers):
                swarm.wait_ready(swarm.start(extra=("--deadlines", mode)))
            swarm.wait_settled()  # every daemon's routing table holds the others
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            stop = os.path.join(workdir, "stop")
            for i in range(cfg.peers):
                cmd = [*lab.exec_prefix(i), sys.executable, "-m", "peerd.tools.bench.deadlines", "--worker",
                       "--socket", swarm.nodes[i].socket, "--out", os.path.join(workdir, f"steps{i}.jsonl"),
                       "--stop", stop, "--params", str(cfg.params), "--timeout", str(cfg.timeout_s),
                       "--rank", str(i)]
                logs.append(open(os.path.join(workdir, f"trainer{i}.log"), "w"))  # noqa: SIM115 - closed below
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logs[-1], env=env))
            _wait_steps(workdir, cfg, procs)
            say(f"{mode}: {cfg.peers} trainers averaging; member {SLOW} slows in {cfg.before_s:g} s")
            time.sleep(cfg.before_s)
            t_slow = time.time()
            set_link_rate(lab, SLOW, parse_rate(cfg.link) // SLOWDOWN)
            time.sleep(cfg.slow_s)
            d = swarm.nodes[0].call("status").get("deadlines") or {}
            silence = (d.get("phase_silence") or {}).get("seconds")
            window = (d.get("window") or {}).get("seconds")
            t_kill = time.time()
            for p in (procs[SLOW], swarm.nodes[SLOW].proc):
                p.send_signal(signal.SIGKILL)
            say(f"{mode}: member {SLOW} killed")
            time.sleep(cfg.after_s)
            open(stop, "w").close()  # the trainers end after their current step
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=cfg.timeout_s + 15)
                except subprocess.TimeoutExpired:
                    say(f"trainer {i} did not stop; killed")
            records = [_read_records(os.path.join(workdir, f"steps{i}.jsonl")) for i in range(cfg.peers)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
            swarm.cleanup()
    finally:
        lab.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(records, cfg, mode, t_slow, t_kill, silence, window)


def run_deadlines_bench(cfg: DeadlinesBenchConfig, *, say: Any = print) -> dict[str, Any]:
    cfg.check()
    return {"config": asdict(cfg), **{mode: run_variant(cfg, mode, say) for mode in cfg.modes}}


# -- the trainer process ----------------------------------------------------------------------------------------
def worker(socket: str, out: str, stop: str, params_count: int, timeout_s: float, rank: int) -> None:
    """Sync steps on seeded noise gradients until ``stop`` exists; each step's record appended to ``out``."""
    import torch

    from ...torch import Optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = [params_count // 2, params_count - params_count // 2]
    params = [torch.nn.Parameter(torch.randn(n) * 0.01) for n in sizes if n > 0]
    opt = Optimizer(torch.optim.SGD(params, lr=0.01), average_params_every=0, run=RUN, socket=socket,
                    timeout_s=timeout_s, sync_state=False, state_every=0)
    gen = torch.Generator().manual_seed(1 + rank)  # (each member's own gradients, as with its own data)
    noise = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    with open(out, "w") as f:
        i = 0
        while not os.path.exists(stop):
            for p, g in zip(params, noise[i % 2], strict=True):
                p.grad = g.clone()
            t0 = time.time()
            opt.step(samples=1)
            report = opt.last_step
            if report is not None:
                f.write(json.dumps({"t0": t0, "t1": time.time(), "outcome": report.outcome,
                                    "group_size": report.group_size,
                                    "received_fraction": report.received_fraction, "kept": report.kept,
                                    "phases": report.phases, "error": report.error}) + "\n")
                f.flush()
            i += 1
    opt.close()


# -- the command line -------------------------------------------------------------------------------------------
def add_parser(bench: Any) -> None:
    """The `bench deadlines` sub-parser (cli.py carries one call and one dispatch line)."""
    b = bench.add_parser("deadlines", help="4 daemons in the link lab average continuously; one becomes 5x slower, "
                                           "then is killed: self-tuned deadlines against today's constants (root)")
    b.add_argument("--peers", type=int, default=4, metavar="N", help="daemons and trainers (default 4)")
    b.add_argument("--link", default="100mbit", metavar="RATE", help="every peer's link (default 100mbit)")
    b.add_argument("--params", type=float, default=1_000_000, metavar="P",
                   help="float32 parameters averaged each step (default 1000000)")
    b.add_argument("--before", type=float, default=8.0, metavar="S", help="seconds before the slowdown (default 8)")
    b.add_argument("--slow", type=float, default=12.0, metavar="S", help="seconds slow before the kill (default 12)")
    b.add_argument("--after", type=float, default=10.0, metavar="S", help="seconds after the kill (default 10)")
    b.add_argument("--modes", default=",".join(DEADLINE_MODES), metavar="M[,M]",
                   help="the --deadlines variants to run, in order (default auto,fixed)")
    b.add_argument("--json", action="store_true", help="print JSON only")


def cmd_bench_deadlines(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = DeadlinesBenchConfig(peers=args.peers, link=args.link, params=int(args.params), before_s=args.before,
                               slow_s=args.slow, after_s=args.after, modes=tuple(args.modes.split(",")))
    result = run_bench(cfg, parser, lambda say: run_deadlines_bench(cfg, say=say), print_json=args.json,
                       left="every daemon, namespace and temp dir")
    if isinstance(result, int):
        return result
    print(f"{cfg.peers} peers on {cfg.link} links; member {SLOW} {SLOWDOWN}x slower, then killed")
    for mode in cfg.modes:
        r = result[mode]
        print(f"  {mode:>5}: failed while slow {r['failed_while_slow']}/{r['steps_while_slow']}; the round the kill "
              f"caught {r['in_flight_round_s']} s ({r['in_flight_extra_s']} s over a slow round, "
              f"{r['in_flight_extra_over_silence']} x the phase silence {r['silence_s']} s); kill to the next "
              f"average {r['kill_to_round_s']} s (it began {r['kill_to_start_s']} s after; its matchmaking "
              f"{r['next_matchmaking_s']} s, window {r['window_s']} s; the death cost {r['death_cost_s']} s, "
              f"{r['death_cost_over_silence']} silences); round {r['round_s']} s, slow round {r['slow_round_s']} s")
    return 0


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m peerd.tools.bench.deadlines")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--rank", type=int, default=0)
    args = p.parse_args(argv)
    try:
        worker(args.socket, args.out, args.stop, args.params, args.timeout, args.rank)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
