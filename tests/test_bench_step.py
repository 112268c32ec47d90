"""`peerd bench step`'s arithmetic (the bytes' time, the figures from step records) and its command line."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from peerd.localsock.client import DaemonError
from peerd.localsock.phases import PHASES
from peerd.tools.bench.cpuwatch import CpuWatch, CpuWindow, Sample
from peerd.tools.bench.step import (
    CORES_BIND,
    StepBenchConfig,
    add_parser,
    cpu_figures,
    cpu_window,
    pacer_figures,
    step_bound,
    summarize,
    transfer_seconds,
    verdict,
)
from peerd.tools.lab.links import LinkLab, QdiscStats


def test_transfer_is_the_butterflys_bytes_with_their_headers_at_the_link_rate() -> None:
    assert transfer_seconds(800_000, 4, "fp32", None) == 0.0  # loopback: no link rate
    payload = 2 * 3 / 4 * 800_000 * 4  # bytes each member sends (and receives) for 4 peers, fp32
    expected = (payload + payload / 1200 * (56 + 28 + 14)) * 8 / 100e6
    assert transfer_seconds(800_000, 4, "fp32", 100_000_000) == pytest.approx(expected)
    assert transfer_seconds(800_000, 4, "int8", 100_000_000) < expected / 3


def test_summary_leaves_out_the_warmup_and_takes_medians() -> None:
    cfg = StepBenchConfig(peers=2, steps=4, warmup=1)

    def rec(seconds: float, transfer: float) -> dict:
        return {"seconds": seconds, "outcome": "averaged", "kept": False,
                "phases": {**dict.fromkeys(PHASES, 0.0), "transfer": transfer}}

    records = [[rec(9.0, 9.0), rec(0.5, 0.4), rec(0.6, 0.5), rec(0.7, 0.6)],
               [rec(9.0, 9.0), rec(0.5, 0.4), rec(0.6, 0.5), rec(0.8, 0.6)]]
    out = summarize(records, cfg, transfer_s=0.4, rtt_s=0.001)
    assert out["steps"] == 6 and out["step_s"] == pytest.approx(0.6)
    assert out["step_mean_s"] == pytest.approx(3.7 / 6)  # (the mean has the rare slow step in it)
    assert out["fixed_s"] == pytest.approx(0.2) and out["bound_s"] == pytest.approx(0.43)
    assert out["phases"]["transfer"] == pytest.approx(0.5) and set(out["phases"]) == set(PHASES)
    assert out["outcomes"] == {"averaged": 6}


def test_the_bound_is_the_issues_for_each_mode() -> None:
    """A step: its bytes' time plus max(3 RTT, 30 ms); a DiLoCo outer step: 1.3x its bytes' time plus 3 RTT (its
    figures describe the outer step)."""
    assert step_bound("sync", 1.0, 0.001) == pytest.approx(1.03)
    assert step_bound("overlap", 1.0, 0.02) == pytest.approx(1.06)
    assert step_bound("diloco", 1.0, 0.001) == pytest.approx(1.303)
    cfg = StepBenchConfig(peers=2, steps=2, warmup=0, mode="diloco")
    rec = {"seconds": 1.2, "outcome": "averaged", "kept": False, "phases": dict.fromkeys(PHASES, 0.0)}
    assert summarize([[rec, rec]], cfg, transfer_s=1.0, rtt_s=0.01)["bound_s"] == pytest.approx(1.33)


def test_the_verdict_says_whether_the_bound_held_and_whether_the_cores_could_tell() -> None:
    """Within the bound; over it where the cores do not bind (the figure is the averaging's); over it where the
    bench's own CPU a step over the cores is CORES_BIND of the bound or more (the machine's); unmeasured CPU says
    nothing either way."""
    cfg = StepBenchConfig(peers=2, steps=2, warmup=0)
    rec = {"seconds": 1.2, "outcome": "averaged", "kept": False, "phases": dict.fromkeys(PHASES, 0.0)}

    def out(transfer: float, cpu_s: float | None) -> dict:
        """Two steps of 1.2 s, the bound 0.03 s over ``transfer``; the bench's processes spent ``cpu_s`` over
        them on 2 cores (cpu_floor_s = cpu_s / 2 steps / 2 cores)."""
        cpu = None if cpu_s is None else CpuWindow(2.4, {"daemon0": cpu_s / 2, "daemon1": cpu_s / 2}, None, 4.8)
        return summarize([[rec, rec]], cfg, transfer_s=transfer, rtt_s=0.001, cpu=cpu)

    ok = out(1.18, None)
    assert ok["within_bound"] and ok["cores_bind"] is None and verdict(ok).startswith("within the bound")
    link = out(1.0, 2.0)  # cpu_floor_s 0.5 of a 1.03 s bound
    assert not link["within_bound"] and link["cores_bind"] is False
    assert verdict(link).startswith("over the bound by 17 %") and "cores" not in verdict(link)
    cores = out(1.0, 3.6)  # cpu_floor_s 0.9: 0.87 of the bound
    assert cores["cpu_floor_s"] == pytest.approx(0.9) and CORES_BIND <= 0.9 / 1.03
    assert cores["cores_bind"] and "the cores bind" in verdict(cores) and "0.87 of the bound" in verdict(cores)
    # a pacer that ended far under the link's rate is named; one near it, or a run without a link, is not
    pacers = [{"rate_bps": 96_000_000}, None, {"rate_bps": 12_700_000}]
    slow = verdict({**link, "link": "100mbit", "pacers": pacers})
    assert "daemon 2's pacer ended at 12.7 Mbit/s, under 70% of the link" in slow and "daemon 0" not in slow, slow
    assert "pacer" not in verdict({**link, "pacers": pacers}) and "pacer" not in verdict({**ok, "link": "100mbit",
                                                                                            "pacers": pacers})


def test_the_command_line_checks_its_arguments() -> None:
    top = argparse.ArgumentParser()
    add_parser(top.add_subparsers(dest="bench_command"))
    args = top.parse_args(["step", "--peers", "4", "--params", "1e6", "--mode", "diloco", "--link", "100mbit",
                           "--link-loss", "0.05", "--json"])
    assert (args.peers, int(args.params), args.mode, args.link, args.link_loss) == (4, 1_000_000, "diloco",
                                                                                     "100mbit", 0.05)
    args = top.parse_args(["step", "--link", "10mbit", "--link-queue-ms", "60", "--robust", "off", "--delay", "25"])
    assert (args.link, args.link_queue_ms, args.robust, args.delay) == ("10mbit", 60.0, "off", 25.0)
    StepBenchConfig(robust="clip:2").check()
    with pytest.raises(SystemExit):
        top.parse_args(["step", "--link", "10 furlongs"])
    for bad in (StepBenchConfig(peers=1), StepBenchConfig(mode="ring"), StepBenchConfig(link_loss=0.1),
                StepBenchConfig(steps=3, warmup=3), StepBenchConfig(compression="zip"),
                StepBenchConfig(link_queue_ms=60.0), StepBenchConfig(link="10mbit", link_queue_ms=0.0),
                StepBenchConfig(robust="median"), StepBenchConfig(delay_ms=-1.0), StepBenchConfig(delay_ms=1500.0)):
        with pytest.raises(ValueError):
            bad.check()


def test_cpu_figures_are_per_step_and_say_what_else_ran() -> None:
    watch = CpuWatch({"daemon0": 1, "daemon1": 2, "trainer0": 3, "trainer1": 4})
    watch.samples = [Sample(10.0, (100.0, 400.0), {"daemon0": 1.0, "daemon1": 1.0, "trainer0": 0.5, "trainer1": 0.5}),
                     Sample(12.0, (103.0, 404.0), {"daemon0": 2.0, "daemon1": 2.4, "trainer0": 0.7, "trainer1": None})]
    assert watch.window(9.0, 12.0) is None and watch.window(10.0, 13.0) is None  # (not covered)
    cpu = watch.window(10.5, 11.5)
    assert cpu is not None and cpu.seconds == 2.0 and cpu.procs["trainer1"] is None
    out = cpu_figures(cpu, steps=4)
    assert out["daemon_cpu_s"] == pytest.approx(1.2 / 4)  # the median of 1.0 and 1.4 CPU seconds, over 4 steps
    assert out["trainer_cpu_s"] == pytest.approx(0.2 / 4)
    assert out["cpu_floor_s"] == pytest.approx(2.6 / 4 / 2)  # all of the bench's CPU over 2 cores (4 s in 2 s)
    assert out["machine_busy"] == pytest.approx(0.75) and out["others_busy"] == pytest.approx(0.4 / 4)
    assert cpu_figures(None, 4) == dict.fromkeys(out)


def test_the_cpu_window_runs_from_the_first_step_after_the_warmup_to_the_last() -> None:
    me = CpuWatch({"trainer0": os.getpid()}, interval_s=0.01)
    me.start()
    t0 = time.monotonic()
    while time.process_time() < 0.05 or time.monotonic() - t0 < 0.05:
        pass
    t1 = time.monotonic()
    me.stop()
    records = [[{"t0": 0.0, "t1": 0.0}, {"t0": t0, "t1": t1 - 0.01}], [{"t0": 0.0, "t1": 0.0}, {"t0": t0, "t1": t1}]]
    cpu = cpu_window(me, records, warmup=1)
    assert cpu is not None and cpu.procs["trainer0"] is not None and cpu.procs["trainer0"] > 0.0
    assert cpu_window(me, [[{"t0": t0}]], warmup=1) is None


def test_trainers_start_together_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    import threading

    from peerd.tools.bench.step import start_together

    outs = [str(tmp_path / f"steps{i}.json") for i in range(3)]
    started: list[float] = []
    threads = [threading.Thread(target=lambda o=o: (start_together(o, 3), started.append(time.monotonic())))
               for o in outs[:2]]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not started  # two of three ready: both wait
    t0 = time.monotonic()
    start_together(outs[2], 3)
    for t in threads:
        t.join()
    assert len(started) == 2 and all(s >= t0 - 0.01 for s in started)
    with pytest.raises(RuntimeError, match="not every one of the 4 trainers"):
        start_together(outs[0], 4, timeout_s=0.2)


def test_a_steps_codec_is_the_one_its_auto_choice_applied() -> None:
    """DiLoCo's compression="auto" picks its outer codec itself: the bench counts the bytes in that codec (int8 for
    the bench's model), not in float32."""
    from peerd.tools.bench.step import step_codec

    assert step_codec({"auto": {"compression": "int8"}, "outer": [{}]}, "auto") == "int8"
    assert step_codec({}, "auto") == "fp32" and step_codec({}, "fp16") == "fp16" and step_codec({}, None) == "fp32"
    assert step_codec({"auto": {"compression": "nonsense"}}, "int4") == "int4"



def test_queue_drop_fractions_are_each_sides_drops_over_what_it_was_offered() -> None:
    def q(packets: int, drops: int) -> QdiscStats:
        return QdiscStats(bytes=0, packets=packets, drops=drops, overlimits=0, backlog_bytes=0)

    before = {"up": [q(100, 1), q(50, 0)], "down": [q(10, 0), q(0, 0)]}
    after = {"up": [q(190, 11), q(140, 0)], "down": [q(10, 0), q(0, 0)]}
    # up: 10 dropped of 90 + 90 sent and those 10 offered; down: nothing offered
    assert LinkLab.queue_drop_fractions(before, after) == {"up": pytest.approx(10 / 190), "down": 0.0}


def test_the_pacers_are_each_daemons_rate_and_bottleneck_in_bits_and_none_where_it_did_not_answer() -> None:
    class FakeNode:
        def __init__(self, reply: dict | None) -> None:
            self.reply = reply

        def call(self, op: str, timeout: float = 10.0) -> dict:
            assert op == "status"
            if self.reply is None:
                raise DaemonError("the daemon went away")
            return self.reply

    pacer = {"rate": 12.5e6, "btl": 11e6, "state": "cycle", "queue_delay": 0.002, "decreases": 3, "increases": 7,
             "resumes": 1}
    assert pacer_figures(FakeNode({"pacer": pacer})) == {"rate_bps": 100_000_000, "btl_bps": 88_000_000,
                                                         "state": "cycle", "cuts": 3, "raises": 7}
    assert pacer_figures(FakeNode({"pacer": {**pacer, "btl": None}}))["btl_bps"] is None  # (startup)
    assert pacer_figures(FakeNode(None)) is None and pacer_figures(FakeNode({})) is None
