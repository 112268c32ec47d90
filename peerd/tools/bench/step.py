"""`peerd bench step`: N real daemons and N trainers take M steps of a model of P parameters; where a step's time goes.

Each trainer is a process of its own (``python -m peerd.tools.bench.step --worker``) with a model of ``--params``
float32 parameters (a few tensors) wrapped in peerd.torch.Optimizer (``--mode sync`` or ``overlap``) or DiLoCo
(``--mode diloco``: the figures describe its outer steps). Its gradients are seeded noise, drawn once and taken in
turn (drawing 0.8M normals costs a trainer ~30 ms a step, CPU the other peers' daemons need on a small machine),
so a step costs no compute and its time is the averaging's. ``--compression auto`` is the trainers' default codec
choice (peerd.torch.auto): each step's bytes are counted in the codec that step averaged in. Every step's
``StepReport`` (seconds and phases) is collected.

With ``--link RATE`` (root) each peer lives in its own namespace of the link lab (peerd.tools.lab.links) behind a
shaped link (``--link-loss P``: random loss on it; ``--link-queue-ms``: its queue); without, the daemons share
127.0.0.1. ``--delay MS`` has each daemon hold what it receives MS milliseconds (peerd.transport.delay; the lab has
no netem), so every round trip costs 2 MS more, as on a WAN. The figures (``--json``):

- ``step_s``: median seconds of a step (``step()`` in the trainer, after ``--warmup`` steps);
- ``step_p90_s``, ``step_mean_s``: the 90th percentile and the mean (what a run of many steps takes per step, the
  rare slow step included);
- ``transfer_s``: the bytes' time at the link rate: a butterfly all-reduce sends and receives
  2 (n - 1) / n of the vector in the run's codec, with each datagram's headers (0 on loopback);
- ``fixed_s``: the median of step minus transfer: what a step costs beyond moving its bytes;
- ``rtt_s``: the median round trip between two peers' daemons (their DHT pings);
- ``bound_s``: the goal: ``transfer_s`` plus max(3 RTT, 30 ms) for a step, 1.3x ``transfer_s`` plus 3 RTT for a
  DiLoCo outer step;
- ``phases``: median seconds by phase (peerd.localsock.phases);
- ``daemon_cpu_s``, ``trainer_cpu_s``: the median daemon's and trainer's CPU seconds per step, over the steps
  after the warm-up (bench.cpuwatch); ``cpu_floor_s``: every daemon's and trainer's CPU seconds per step over
  the machine's cores, the least a step could take here if nothing else ran; ``machine_busy``: the share of
  the cores busy meanwhile, ``others_busy`` the share busy with processes outside the bench. Where
  ``cpu_floor_s`` comes near ``step_s``, the step waits for the cores, not for the link;
- ``within_bound``: ``step_s`` is at most ``bound_s``; ``cores_bind``: ``cpu_floor_s`` is at least CORES_BIND of
  ``bound_s`` (None where the CPU was not measured): the bench's own CPU nearly fills the goal's time on these
  cores, so a step over the bound says more about the machine than about the link (run fewer peers per core);
- ``pacers``: each daemon's pacer at the end (``rate_bps``, ``btl_bps``: the rate it sent at and the bottleneck it
  measured, bits/s; ``state``; ``cuts``, ``raises``): a step far over its bound with one rate far under the link's
  is that member's pacer, one with every rate near it is not (the verdict names a pacer under PACER_LOW of the link);
- ``link_queue_drops`` (with ``--link``): the share of the packets offered to the links' queues that they dropped
  over the whole run, ``up`` and ``down`` apart: the daemons' own overrun, beyond the random loss.
Without ``--delay`` the RTT is the links' queues' and the hosts', not a WAN's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ...allreduce.robust import parse_robust
from ...localsock.client import DaemonError
from ...localsock.phases import PHASES
from ..lab.links import LinkLab, parse_rate
from ..linkargs import add_link_arguments
from ..swarm import LocalSwarm, Node
from .cpuwatch import CpuWatch, CpuWindow
from .runner import run_bench

RUN = "bench-step"
DATAGRAM_PAYLOAD = 1200  # default UDP payload of a data datagram (--mtu)
DATAGRAM_OVERHEAD = 56 + 28 + 14  # peerd's header and tag, IPv4 + UDP, Ethernet (what tbf counts)
CODEC_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 8 / 128, "int4": 0.5 + 8 / 128}
MODES = ("sync", "overlap", "diloco")
NOISE_SETS = 4  # gradient draws a trainer takes in turn
CORES_BIND = 0.8  # cpu_floor_s at this fraction of bound_s or more: the cores, not the link, bind (``cores_bind``)
PACER_LOW = 0.7  # a pacer that ended under this fraction of the link's rate was cut and had not climbed back


@dataclass
class StepBenchConfig:
    peers: int = 4
    steps: int = 30
    params: int = 800_000
    mode: str = "sync"
    link: str | None = None
    link_loss: float = 0.0
    link_queue_ms: float = 20.0
    delay_ms: float = 0.0  # each daemon's --delay: a one-way propagation delay on what it receives
    warmup: int = 3
    keep_rounds: int | None = None  # None: the trainer's default
    compression: str | None = None
    sync_every: int = 5  # diloco: inner steps per outer step
    timeout_s: float = 30.0
    robust: str | None = None  # the trainers' robust= (None: the default)

    def check(self) -> None:
        if self.peers < 2:
            raise ValueError("--peers must be at least 2")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}")
        if not 1 <= self.params <= 1 << 30:
            raise ValueError("--params must be in [1, 2**30]")
        if self.steps < 1 or not 0 <= self.warmup < self.steps:
            raise ValueError("--steps must be at least 1 and --warmup in [0, steps)")
        if self.link_loss and not self.link:
            raise ValueError("--link-loss needs --link RATE")
        if not 0.0 <= self.link_loss < 1.0:
            raise ValueError("--link-loss must be in [0, 1)")
        if not 0.0 < self.link_queue_ms <= 10_000:
            raise ValueError("--link-queue-ms must be in (0, 10000]")
        if self.link_queue_ms != 20.0 and not self.link:
            raise ValueError("--link-queue-ms needs --link RATE")
        if not 0.0 <= self.delay_ms <= 1000.0:
            raise ValueError("--delay must be in [0, 1000] milliseconds")
        if self.compression is not None and self.compression not in (*CODEC_BYTES, "auto"):
            raise ValueError(f"--compression must be one of {sorted(CODEC_BYTES)} or auto")
        if self.robust is not None:
            try:
                parse_robust(self.robust)
            except ValueError as e:
                raise ValueError(f"--robust: {e}") from None


def transfer_seconds(params: int, peers: int, codec: str, rate_bps: int | None) -> float:
    """The bytes' time at the link rate: each member sends (and receives) 2 (n - 1) / n of the vector in the
    codec, in datagrams of DATAGRAM_PAYLOAD bytes, each with DATAGRAM_OVERHEAD bytes of headers."""
    if not rate_bps:
        return 0.0
    payload = 2 * (peers - 1) / peers * params * CODEC_BYTES[codec]
    datagrams = payload / DATAGRAM_PAYLOAD
    return (payload + datagrams * DATAGRAM_OVERHEAD) * 8 / rate_bps


def step_bound(mode: str, transfer_s: float, rtt_s: float) -> float:
    """The goal a step is held to: its bytes' time plus max(3 RTT, 30 ms) for a sync or overlap step; for a DiLoCo
    outer step, whose repair and agreement come after the average, 1.3x the bytes' time plus 3 RTT."""
    if mode == "diloco":
        return 1.3 * transfer_s + 3 * rtt_s
    return transfer_s + max(3 * rtt_s, 0.030)


def summarize(records: list[list[dict[str, Any]]], cfg: StepBenchConfig, transfer_s: float | Callable[[str], float],
              rtt_s: float, cpu: CpuWindow | None = None) -> dict[str, Any]:
    """The figures from every trainer's step records (the warm-up steps of each left out). ``transfer_s``: the
    bytes' time, or a function of the codec a step averaged in (its record's ``codec``; fp32 when it has none).
    ``cpu``: what the daemons (``daemon<i>``) and trainers (``trainer<i>``) spent over those steps (cpu_window)."""
    steps = [r for rs in records for r in rs[cfg.warmup:]]
    if not steps:
        raise RuntimeError("no step was recorded after the warm-up")
    seconds = [r["seconds"] for r in steps]
    codecs = [r.get("codec") or cfg.compression or "fp32" for r in steps]
    transfers = [transfer_s(c) if callable(transfer_s) else transfer_s for c in codecs]
    used = sorted(set(codecs))
    compression = "/".join(used) if cfg.compression != "auto" else "auto:" + "/".join(used)
    outcomes: dict[str, int] = {}
    for r in steps:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    out: dict[str, Any] = {
        "mode": cfg.mode, "peers": cfg.peers, "params": cfg.params, "steps": len(steps),
        "link": cfg.link, "link_loss": cfg.link_loss, "delay_ms": cfg.delay_ms, "compression": compression,
        "robust": cfg.robust,
        "step_s": round(statistics.median(seconds), 6),
        "step_p90_s": round(sorted(seconds)[int(0.9 * (len(seconds) - 1))], 6),
        "step_mean_s": round(statistics.fmean(seconds), 6),
        "transfer_s": round(statistics.median(transfers), 6),
        "fixed_s": round(statistics.median(s - t for s, t in zip(seconds, transfers, strict=True)), 6),
        "rtt_s": round(rtt_s, 6),
        "bound_s": round(step_bound(cfg.mode, statistics.median(transfers), rtt_s), 6),
        "phases": {p: round(statistics.median(r["phases"].get(p, 0.0) for r in steps), 6) for p in PHASES},
        "kept": sum(bool(r.get("kept")) for r in steps), "outcomes": outcomes,
        **cpu_figures(cpu, max(len(rs) - cfg.warmup for rs in records)),
    }
    out["within_bound"] = out["step_s"] <= out["bound_s"]
    out["cores_bind"] = None if out["cpu_floor_s"] is None else out["cpu_floor_s"] >= CORES_BIND * out["bound_s"]
    return out


def verdict(result: dict[str, Any]) -> str:
    """One sentence on ``summarize``'s figures: whether the step met its bound and, if not, whether these cores
    could have told."""
    step, bound = result["step_s"], result["bound_s"]
    if result["within_bound"]:
        return f"within the bound ({step:.4f} s <= {bound:.4f} s)"
    said = f"over the bound by {100 * (step / bound - 1):.0f} % ({step:.4f} s > {bound:.4f} s)"
    if result["cores_bind"]:
        said += (f"; the cores bind: the bench's own CPU a step over the cores (cpu_floor_s {result['cpu_floor_s']:.4f}"
                 f" s) is {result['cpu_floor_s'] / bound:.2f} of the bound, so this says more about the machine than "
                 "the link (run fewer peers per core)")
    for i, bps in low_pacers(result):
        said += (f"; daemon {i}'s pacer ended at {bps / 1e6:.1f} Mbit/s, under {PACER_LOW:.0%} of the link: a cut it "
                 "had not climbed back from, which every round waited for")
    return said


def low_pacers(result: dict[str, Any]) -> list[tuple[int, int]]:
    """(daemon, bits/s) of each pacer that ended the run under PACER_LOW of the link's rate (``--link`` runs)."""
    if not result.get("link"):
        return []
    link = parse_rate(result["link"])
    return [(i, p["rate_bps"]) for i, p in enumerate(result.get("pacers") or [])
            if p and p["rate_bps"] < PACER_LOW * link]


def cpu_window(watch: CpuWatch, records: list[list[dict[str, Any]]], warmup: int) -> CpuWindow | None:
    """What was spent from the first trainer's first step after the warm-up to the last trainer's last step (the
    records' ``t0``/``t1``, time.monotonic()); None where the records do not say."""
    try:
        t0 = min(rs[warmup]["t0"] for rs in records)
        t1 = max(rs[-1]["t1"] for rs in records)
    except (IndexError, KeyError, ValueError):
        return None
    return watch.window(t0, t1)


def cpu_figures(cpu: CpuWindow | None, steps: int) -> dict[str, float | None]:
    """The CPU figures (module docstring) from ``cpu``, over ``steps`` steps a trainer took in it (None each where
    it was not measured)."""
    out: dict[str, float | None] = dict.fromkeys(
        ("daemon_cpu_s", "trainer_cpu_s", "cpu_floor_s", "machine_busy", "others_busy"))
    if cpu is None or steps <= 0:
        return out
    for kind in ("daemon", "trainer"):
        spent = [v for k, v in cpu.procs.items() if k.startswith(kind) and v is not None]
        if spent:
            out[f"{kind}_cpu_s"] = round(statistics.median(spent) / steps, 6)
    ours = sum(v for v in cpu.procs.values() if v is not None)
    cores = cpu.total / cpu.seconds if cpu.total and cpu.seconds > 0 else float(os.cpu_count() or 1)
    out["cpu_floor_s"] = round(ours / steps / cores, 6)
    if cpu.busy is not None and cpu.total:
        out["machine_busy"] = round(min(1.0, cpu.busy / cpu.total), 4)
        out["others_busy"] = round(min(1.0, max(0.0, cpu.busy - ours) / cpu.total), 4)
    return out


def _ping_rtt(swarm: LocalSwarm, lab: LinkLab | None) -> float:
    """The median round trip of DHT pings between the daemons (their peerd_rpc_seconds{type="ping"}), read from
    node 0's metrics; 0 when none was timed."""
    import urllib.request

    node = swarm.nodes[0]
    url = f"http://{node.status['metrics']}/metrics"

    def read() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    try:
        if lab is not None:
            with lab.entered(0):
                text = read()
        else:
            text = read()
    except OSError:
        return 0.0
    total = count = 0.0
    for line in text.splitlines():
        if 'type="ping"' in line and line.startswith("peerd_rpc_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif 'type="ping"' in line and line.startswith("peerd_rpc_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total / count if count else 0.0


def start_workers(procs: list[tuple[subprocess.Popen, str, Any]], swarm: LocalSwarm, workdir: str,
                  cfg: StepBenchConfig, prefix: Callable[[int], list[str]]) -> None:
    """One trainer process per node of ``swarm`` running ``cfg``'s steps (``prefix(i)``: what runs node ``i``'s, a
    lab namespace's ``ip netns exec``), each appended to ``procs`` as it starts (the caller stops them all)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for i in range(cfg.peers):
        out = os.path.join(workdir, f"steps{i}.json")
        cmd = [*prefix(i), sys.executable, "-m", "peerd.tools.bench.step", "--worker", "--socket",
               swarm.nodes[i].socket, "--out", out, "--config", json.dumps(asdict(cfg))]
        err = open(os.path.join(workdir, f"trainer{i}.log"), "w")  # noqa: SIM115 - lives with the process
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env), out, err))


def stop_workers(procs: list[tuple[subprocess.Popen, str, Any]]) -> None:
    """Kill the trainers still running and close their logs."""
    for proc, _, err in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()


def wait_workers(procs: list[tuple[subprocess.Popen, str, Any]], workdir: str, cfg: StepBenchConfig) -> list[Any]:
    """Each trainer's step records, once it has exited (one that failed: RuntimeError with its log's tail)."""
    records = []
    for i, (proc, out, _err) in enumerate(procs):
        rc = proc.wait(timeout=cfg.steps * (cfg.timeout_s + 10) + 120)
        if rc != 0:
            with open(os.path.join(workdir, f"trainer{i}.log")) as f:
                raise RuntimeError(f"trainer {i} exited with {rc}:\n{f.read()[-3000:]}")
        with open(out) as f:
            records.append(json.load(f))
    return records


def run_step_bench(cfg: StepBenchConfig, *, say: Any = print) -> dict[str, Any]:
    cfg.check()
    workdir = tempfile.mkdtemp(prefix="peerd-bench-step-")
    lab: LinkLab | None = None
    try:
        if cfg.link:
            lab = LinkLab(cfg.peers, cfg.link, cfg.link_loss, queue_ms=cfg.link_queue_ms)
            say(f"link lab: {cfg.peers} namespaces, {cfg.link} links, loss {cfg.link_loss}, "
                f"{cfg.link_queue_ms:g} ms of queue (no delay emulation)")
            lab.start()
        delay = ("--delay", f"{cfg.delay_ms:g}") if cfg.delay_ms else ()
        if cfg.delay_ms:
            say(f"each daemon holds what it receives {cfg.delay_ms:g} ms (round trips {2 * cfg.delay_ms:g} ms longer)")
        swarm = LocalSwarm(os.path.join(workdir, "swarm"), lab=lab, extra_args=delay)
        procs: list[tuple[subprocess.Popen, str, Any]] = []
        try:
            say(f"starting {cfg.peers} daemons ...")
            for _ in range(cfg.peers):
                swarm.wait_ready(swarm.start())
            swarm.wait_settled()  # the DHT settles (every daemon bootstrapped from node 0)
            tbf_before = lab.tbf_sides() if lab is not None else {}
            start_workers(procs, swarm, workdir, cfg, lab.exec_prefix if lab is not None else lambda i: [])
            watch = CpuWatch({**{f"daemon{i}": node.proc.pid for i, node in enumerate(swarm.nodes)},
                              **{f"trainer{i}": proc.pid for i, (proc, _, _) in enumerate(procs)}})
            watch.start()
            say(f"{cfg.peers} trainers: {cfg.steps} {cfg.mode} steps of {cfg.params} parameters ...")
            try:
                records = wait_workers(procs, workdir, cfg)
            finally:
                watch.stop()
            queue_drops = lab.queue_drop_fractions(tbf_before, lab.tbf_sides()) if lab is not None else {}
            rtt = _ping_rtt(swarm, lab)
            pacers = [pacer_figures(node) for node in swarm.nodes]
        finally:
            stop_workers(procs)
            swarm.cleanup()
    finally:
        if lab is not None:
            lab.close()
        shutil.rmtree(workdir, ignore_errors=True)
    rate = parse_rate(cfg.link) if cfg.link else None
    result = summarize(records, cfg, lambda codec: transfer_seconds(cfg.params, cfg.peers, codec, rate), rtt,
                       cpu_window(watch, records, cfg.warmup))
    # what the links' token-bucket queues dropped of the packets offered to them over the whole run, uplinks and
    # downlinks apart: the daemons' own overrun (a sender above its uplink, senders converging on one downlink)
    result["link_queue_drops"] = {side: round(f, 6) for side, f in queue_drops.items()}
    result["pacers"] = pacers
    return result


def pacer_figures(node: Node) -> dict[str, Any] | None:
    """A daemon's pacer at the end of the run (``pacers``; None where the daemon did not answer): the rate it sent
    at and the bottleneck it measured, bits/s, its state, and how often it cut and raised them."""
    try:
        p = node.call("status", timeout=5.0).get("pacer")
    except DaemonError:
        return None
    if not isinstance(p, dict):
        return None
    btl = p.get("btl")
    return {"rate_bps": round(8 * p["rate"]), "btl_bps": None if btl is None else round(8 * btl),
            "state": p.get("state"), "cuts": p.get("decreases"), "raises": p.get("increases")}


def step_codec(reply: dict[str, Any], compression: str | None) -> str:
    """The codec a step averaged in: what the trainer's auto choice says it applied (sync mode's, or DiLoCo's outer
    codec), else the one the run asked for, else float32."""
    codec = (reply.get("auto") or {}).get("compression") or compression or "fp32"
    return codec if codec in CODEC_BYTES else compression if compression in CODEC_BYTES else "fp32"


# -- the trainer process ----------------------------------------------------------------------------------------
def worker(socket: str, out: str, cfg: StepBenchConfig) -> None:
    """One trainer: ``cfg.steps`` steps on seeded noise gradients; writes each step's record to ``out``."""
    import torch

    from ...torch import DiLoCo, Optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = [cfg.params // 4] * 3 + [cfg.params - 3 * (cfg.params // 4)]
    params = [torch.nn.Parameter(torch.randn(n) * 0.01) for n in sizes if n > 0]
    model = torch.nn.ParameterList(params)
    inner = torch.optim.SGD(params, lr=0.01)
    common: dict[str, Any] = {"run": RUN, "socket": socket, "timeout_s": cfg.timeout_s, "sync_state": False,
                              "state_every": 0, "compression": cfg.compression, "robust": cfg.robust}
    if cfg.mode == "diloco":
        opt: Any = DiLoCo(model, inner, sync_every=cfg.sync_every, **common)
        steps = cfg.steps * cfg.sync_every  # cfg.steps outer steps
    else:
        if cfg.keep_rounds is not None:
            common["keep_rounds"] = cfg.keep_rounds
        opt = Optimizer(inner, average_params_every=0, overlap=cfg.mode == "overlap",
                        model=model if cfg.mode == "overlap" else None, **common)
        steps = cfg.steps
    gen = torch.Generator().manual_seed(1)
    noise = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(NOISE_SETS)]
    start_together(out, cfg.peers)
    records = []
    for i in range(steps):
        for p, g in zip(params, noise[i % NOISE_SETS], strict=True):
            p.grad = g.clone()  # (the wrapped optimizer writes the average into p.grad)
        t0 = time.monotonic()
        reply = opt.step(samples=1)
        t1 = time.monotonic()
        report = opt.last_step
        if report is None or (cfg.mode == "diloco" and "outer" not in reply):
            continue
        codec = step_codec(reply, cfg.compression)
        records.append({"seconds": report.seconds, "phases": report.phases, "outcome": report.outcome,
                        "group_size": report.group_size, "kept": report.kept, "codec": codec, "t0": t0, "t1": t1,
                        "received_fraction": reply.get("received_fraction")})
    opt.close()
    with open(out, "w") as f:
        json.dump(records, f)


def start_together(out: str, peers: int, *, timeout_s: float = 300.0) -> None:
    """Mark this trainer ready (``out`` + ".ready") and wait until all ``peers`` are: trainers that import torch
    seconds apart on a loaded machine would otherwise take their first steps alone, and a short run's figures
    would measure the start-up skew instead of the averaging."""
    folder = os.path.dirname(os.path.abspath(out))
    with open(out + ".ready", "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while sum(name.endswith(".ready") for name in os.listdir(folder)) < peers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every one of the {peers} trainers was ready within {timeout_s:.0f} s")
        time.sleep(0.05)


# -- the command line -------------------------------------------------------------------------------------------
def add_parser(bench: Any) -> None:
    """The `bench step` sub-parser (registered by name in tools/cli_tools.py's BENCH_MODULES)."""
    b = bench.add_parser("step", help="N daemons and trainers take M steps of a P-parameter model; where a step's "
                                      "time goes (phases, fixed cost beyond the bytes' time)")
    b.add_argument("--peers", type=int, default=4, metavar="N", help="daemons and trainers (default 4)")
    b.add_argument("--steps", type=int, default=30, metavar="M",
                   help="steps per trainer (diloco: outer steps; default 30)")
    b.add_argument("--params", type=float, default=800_000, metavar="P",
                   help="float32 parameters of the model (default 800000; 1e6 works)")
    b.add_argument("--mode", choices=MODES, default="sync", help="sync, overlap or diloco (default sync)")
    add_link_arguments(b.add_argument_group("link lab (root)"), daemon_loss=False)
    b.add_argument("--delay", type=float, default=0.0, metavar="MS",
                   help="each daemon holds what it receives MS milliseconds (peerd join --delay): a one-way "
                        "propagation delay, so round trips cost what they would on a WAN (default 0)")
    b.add_argument("--warmup", type=int, default=3, metavar="W", help="first steps left out (default 3)")
    b.add_argument("--keep-rounds", type=int, metavar="K", help="kept-group rounds (default: the trainer's)")
    b.add_argument("--compression", choices=[*sorted(CODEC_BYTES), "auto"],
                   help="the run's codec (default fp32; auto: the trainers' default choice)")
    b.add_argument("--sync-every", type=int, default=5, metavar="H", help="diloco: inner steps per outer (default 5)")
    b.add_argument("--robust", metavar="R", help="the trainers' robust= (off, clip[:C], centered[:C]; default: the "
                   "weight bound and the direction test)")
    b.add_argument("--json", action="store_true", help="print JSON only")


def cmd_bench_step(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = StepBenchConfig(peers=args.peers, steps=args.steps, params=int(args.params), mode=args.mode,
                          link=args.link, link_loss=args.link_loss, link_queue_ms=args.link_queue_ms,
                          delay_ms=args.delay,
                          warmup=min(args.warmup, args.steps - 1),
                          keep_rounds=args.keep_rounds, compression=args.compression, sync_every=args.sync_every,
                          robust=args.robust)
    result = run_bench(cfg, parser, lambda say: run_step_bench(cfg, say=say), print_json=args.json,
                       left="every daemon, namespace and temp dir")
    if isinstance(result, int):
        return result
    where = result["link"] or "loopback"
    if result["link_loss"]:
        where += f", loss {result['link_loss']}"
    if result["delay_ms"]:
        where += f", {result['delay_ms']:g} ms one-way delay"
    print(f"{result['mode']} steps, {result['peers']} peers, {result['params']} parameters, {where}")
    for name in ("step_s", "step_p90_s", "step_mean_s", "transfer_s", "fixed_s", "rtt_s", "bound_s", "daemon_cpu_s",
                 "trainer_cpu_s", "cpu_floor_s", "machine_busy", "others_busy"):
        if result[name] is not None:
            print(f"  {name:>12}: {result[name]:.4f}")
    for phase, seconds in result["phases"].items():
        print(f"  {phase:>12}: {seconds:.4f} (median)")
    print(f"  outcomes: {result['outcomes']}, kept-group steps: {result['kept']}")
    print(f"  verdict: {verdict(result)}")
    if result["link_queue_drops"]:
        print("  link queues dropped: " + ", ".join(f"{side} {100 * f:.2f} %"
                                                    for side, f in result["link_queue_drops"].items()))
    rates = [f"{p['rate_bps'] / 1e6:.1f}" if p else "-" for p in result["pacers"]]
    print(f"  pacers' rates at the end (Mbit/s, each daemon): {', '.join(rates)}")
    return 0


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m peerd.tools.bench.step")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    worker(args.socket, args.out, StepBenchConfig(**json.loads(args.config)))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
