"""`peerd demo --model gpt`: the user's GPT script (peerd.tools.demo_gpt), its pieces, and a short run end to end with
its DDP baseline on 127.0.0.1 (needs torch)."""

from __future__ import annotations

import math

import pytest

from .support.processes import peerd_json

pytest.importorskip("torch")


def test_corpus_is_deterministic_ascii_and_large_enough() -> None:
    from peerd.tools.demo_gpt import TEXT_BYTES, VAL_CHARS, VOCAB, load_corpus

    a, b = load_corpus(), load_corpus()
    assert len(a) == TEXT_BYTES and (a == b).all()
    assert int(a.max()) < VOCAB and len(a) > 20 * VAL_CHARS


def test_model_size_groups_and_schedule() -> None:
    from peerd.tools.demo_gpt import build_gpt, cosine_lr, param_groups

    model = build_gpt(0)
    n = sum(p.numel() for p in model.parameters())
    assert 0.7e6 < n < 0.9e6  # "~0.8 M parameters, 4 layers"
    decay, rest = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in rest["params"])
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    assert [round(cosine_lr(s, 100, 1.0, 10), 3) for s in (0, 9, 10, 100)] == [0.1, 1.0, 1.0, 0.1]
    # the same seed builds the same weights (founders start alike), another seed others
    same, other = build_gpt(0), build_gpt(1)
    p0, p1, p2 = (next(m.parameters()) for m in (model, same, other))
    assert bool((p0 == p1).all()) and not bool((p0 == p2).all())


def test_time_to_target_reads_the_first_eval_at_or_below() -> None:
    from peerd.tools.demo import loss_by, loss_curve, time_to_target

    evals = {10: {0: (3.0, 105.0), 1: (3.2, 107.0)}, 20: {0: (2.0, 120.0)}, 30: {0: (2.1, 130.0), 1: (1.9, 131.0)}}
    curve = loss_curve(evals, 100.0, members=2)  # step 20 lacks a member: not a row
    assert curve == [(10, 3.1, 7.0), (30, 2.0, 31.0)]
    assert time_to_target(curve, 2.0) == 31.0 and time_to_target(curve, 3.1) == 7.0
    assert time_to_target(curve, 1.0) is None and time_to_target(curve, None) is None
    # the best loss evaluated by a time (what the run reaches in a third of the baseline's)
    assert loss_by(curve, 30.0) == 3.1 and loss_by(curve, 31.0) == 2.0 and loss_by(curve, 6.9) is None
    assert loss_by(curve, None) is None


def test_target_fields_against_a_baseline_of_this_run_or_of_another(capsys) -> None:
    from peerd.cli import main
    from peerd.tools.demo import target_fields

    curve = [(20, 2.5, 10.0), (40, 2.2, 20.0), (60, 2.0, 30.0)]
    ddp = [(25, 2.6, 20.0), (50, 2.3, 45.0), (75, 2.1, 66.0)]
    assert target_fields(curve, 2.1) == {"target_loss": 2.1, "time_to_target_s": 30.0}  # no baseline: no ratio
    here = target_fields(curve, 2.1, baseline_curve=ddp)
    assert here["baseline_time_to_target_s"] == 66.0 and here["speedup"] == 2.2
    assert here["val_loss_at_baseline_third"] == 2.2  # by 22 s: the evaluation at 20 s
    other = target_fields(curve, 2.1, baseline_seconds=90.0)  # --target-seconds: DDP's time from another run
    assert other["speedup"] == 3.0 and other["val_loss_at_baseline_third"] == 2.0
    slow = target_fields(curve, 2.05, baseline_curve=ddp)  # the baseline never got there: no ratio, a bound
    assert slow["speedup"] is None and slow["speedup_at_least"] == 2.2 and slow["baseline_time_to_target_s"] is None
    never = target_fields(curve, 1.5, baseline_seconds=90.0)
    assert never["time_to_target_s"] is None and never["speedup"] == 0.0 and never["val_loss_at_baseline_third"] == 2.0
    for argv in (["--target-seconds", "90"], ["--target-loss", "2.1", "--target-seconds", "-1"],
                 ["--target-loss", "2.1", "--target-seconds", "90", "--baseline", "ddp"]):
        with pytest.raises(SystemExit):
            main(["demo", "--model", "gpt", *argv])
        assert "--target-seconds goes with" in capsys.readouterr().err


def test_evaluations_come_five_times_as_often_past_steps() -> None:
    """Past --steps the curve is finer: a run close to its target crosses it there, and a coarse curve would report
    the crossing up to --eval-every steps late."""
    from types import SimpleNamespace

    from peerd.tools.demo_gpt import evaluates

    args = SimpleNamespace(eval_every=25, steps=300)
    assert [s for s in range(1, 361) if evaluates(s, args)] == [*range(25, 301, 25), *range(305, 361, 5)]
    assert not any(evaluates(s, SimpleNamespace(eval_every=0, steps=300)) for s in range(1, 400))


def test_diloco_evaluates_where_an_outer_average_landed() -> None:
    """DiLoCo's replicas hold the swarm's model only right after an outer average lands: its curve is read there
    (a reading mid-cycle measures replicas apart, and one every 25 steps missed most outer steps); DDP's ranks
    of the same run keep their cadence."""
    from types import SimpleNamespace

    from peerd.tools.demo_gpt import evaluates

    args = SimpleNamespace(eval_every=25, steps=300, mode="diloco", launcher="peerd")
    assert evaluates(20, args, landed=True) and evaluates(23, args, landed=True)
    assert not evaluates(25, args, landed=False) and not evaluates(50, args)
    ddp = SimpleNamespace(eval_every=25, steps=300, mode="diloco", launcher="ddp")
    assert evaluates(25, ddp) and not evaluates(20, ddp, landed=True)
    assert not evaluates(20, SimpleNamespace(eval_every=0, steps=300, mode="diloco", launcher="peerd"), landed=True)


@pytest.mark.timeout(240)
def test_gpt_demo_two_peers_with_ddp_baseline_json() -> None:
    """A few steps, 2 peers on loopback, then DDP: the headline fields are there and make sense."""
    out = peerd_json("demo", "--model", "gpt", "--peers", "2", "--steps", "4", "--eval-every", "2",
                     "--extra-steps", "2", "--baseline", "ddp", timeout=240)
    for key in ("val_loss", "baseline_val_loss", "time_to_target_s", "baseline_time_to_target_s", "speedup"):
        assert key in out, key
    initial = math.log(128)  # the untrained model's loss over 128 characters
    assert out["val_loss"] < initial and out["baseline_val_loss"] < initial, out
    assert out["target_loss"] == out["baseline_val_loss"]
    assert out["baseline_time_to_target_s"] > 0  # DDP reaches its own final loss, at its last evaluation at latest
    tt = out["time_to_target_s"]
    assert out["speedup"] == (round(out["baseline_time_to_target_s"] / tt, 3) if tt else 0.0), out
    third = [row[1] for row in out["curve"] if row[2] <= out["baseline_time_to_target_s"] / 3]
    assert out["val_loss_at_baseline_third"] == (min(third) if third else None), out
    assert out["outcomes"].get("averaged", 0) >= 2 * 4 * 0.75, out["outcomes"]  # the peers did average
    assert out["max_param_divergence"] < 1e-3  # the final parameter averages brought them together
    assert 0 < out["max_wait_s"] <= out["deadline_s"], out  # no step waited in step() past its deadline
    # every evaluation (past --steps five times as often: here every step), then the end of training
    assert [row[0] for row in out["curve"]] == [2, 4, 5, 6, 7]
    assert out["extra_steps"] == 2 and round(out["val_loss_at_steps"], 4) == out["curve"][1][1]
    assert [row[0] for row in out["baseline"]["curve"]][-2] == 4  # DDP trains --steps only


def test_churn_and_straggler_commands() -> None:
    """--straggler slows the last founder only; a --join peer syncs the swarm's state from other weights."""
    from peerd.tools.demo import DemoConfig, gpt_command, gpt_total

    cfg = DemoConfig(model="gpt", peers=4, join=1, straggler=2.0, compression="int8")
    cmds = {i: gpt_command(cfg, i, f"/s{i}", f"/o{i}") for i in range(gpt_total(cfg))}
    assert gpt_total(cfg) == 5
    assert [("--slow" in c) for c in cmds.values()] == [False, False, False, True, False]
    assert cmds[3][cmds[3].index("--slow") + 1] == "2.0"
    assert all("--no-sync" in cmds[i] and "--init-seed" not in cmds[i] for i in range(4))  # founders: alike
    assert "--no-sync" not in cmds[4] and "--init-seed" in cmds[4]  # the joiner: its own weights, then sync
    assert all(c[c.index("--compression") + 1] == "int8" for c in cmds.values())
    assert all(c[c.index("--extra-steps") + 1] == "0" for c in cmds.values())  # no target: no steps past --steps


@pytest.mark.parametrize(("flag", "option", "attr"), [("--overlap-outer", {"overlap_outer": True}, "overlap_outer"),
                                                     ("--no-keep-pace", {"keep_pace": False}, "no_keep_pace")])
def test_diloco_flags_reach_every_diloco_trainer_and_are_refused_elsewhere(capsys, flag, option, attr) -> None:
    import argparse

    from peerd.cli import main
    from peerd.tools.demo import DemoConfig, gpt_command
    from peerd.tools.demo_gpt import add_arguments

    assert flag in gpt_command(DemoConfig(model="gpt", mode="diloco", **option), 0, "/s0", "/o0")
    assert flag not in gpt_command(DemoConfig(model="gpt", mode="diloco"), 0, "/s", "/o")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert getattr(p.parse_args([flag]), attr) and not getattr(p.parse_args([]), attr)
    with pytest.raises(SystemExit):
        main(["demo", "--model", "gpt", flag])
    assert f"{flag} is DiLoCo's" in capsys.readouterr().err


def test_extra_steps_default_to_a_fifth_where_a_target_is_known() -> None:
    from peerd.tools.demo import DemoConfig, extra_steps

    assert extra_steps(DemoConfig(model="gpt", steps=300, baseline="ddp")) == 60
    assert extra_steps(DemoConfig(model="gpt", steps=300, target_loss=2.0)) == 60
    assert extra_steps(DemoConfig(model="gpt", steps=300)) == 0
    assert extra_steps(DemoConfig(model="gpt", steps=300, baseline="ddp", extra_steps=0)) == 0
    assert extra_steps(DemoConfig(model="mlp", steps=300, baseline="ddp")) == 0


def test_average_every_is_auto_for_the_gpt_and_10_for_the_small_models() -> None:
    """The GPT's trainers leave the period to peerd.torch ("auto", as the README's wrap does); the small models keep
    10; an explicit --average-every, auto included, goes through as given."""
    import argparse

    from peerd.tools.demo import DemoConfig, averaging_period, gpt_command
    from peerd.tools.demo_gpt import add_arguments

    cmd = gpt_command(DemoConfig(model="gpt"), 0, "/s0", "/o0")
    assert cmd[cmd.index("--average-every") + 1] == "auto"
    assert averaging_period(DemoConfig(model="mlp")) == 10
    assert averaging_period(DemoConfig(model="mlp", average_every="auto")) == "auto"
    cmd = gpt_command(DemoConfig(model="gpt", average_every=20), 0, "/s0", "/o0")
    assert cmd[cmd.index("--average-every") + 1] == "20"
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).average_every == "auto"
    assert p.parse_args(["--average-every", "auto"]).average_every == "auto"
    assert p.parse_args(["--average-every", "40"]).average_every == 40


def test_straggler_option_parses_factors() -> None:
    import argparse

    from peerd.tools.demo import _straggler

    assert _straggler("2x") == 2.0 and _straggler("1.5") == 1.5
    for bad in ("0.5x", "fast", "1000x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _straggler(bad)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--kill", "1"], "go with --model gpt"),
        (["demo", "--model", "gpt", "--kill", "4"], "--kill must be in [0, --peers)"),
        (["demo", "--model", "gpt", "--straggler", "0.5x"], "[1x, 100x]"),
        (["demo", "--model", "gpt", "--batch", "0"], "--batch must be in"),
        (["demo", "--model", "gpt", "--average-every", "often"], "expected a number of steps or auto"),
        (["demo", "--model", "gpt", "--average-every", "-1"], "must be >= 0"),
    ],
)
def test_gpt_demo_arguments_are_checked(args: list[str], needle: str) -> None:
    from .support.processes import peerd

    proc = peerd(*args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
