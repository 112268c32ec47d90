"""The CLI as a newcomer meets it: commands grouped by task, one flag name per idea, defaults equal to the API's,
lab knobs apart, old names still working with a deprecation line, and a generated reference that is never stale."""

from __future__ import annotations

import argparse
import inspect
import sys

import pytest

from peerd import cli
from peerd.cli import COMMAND_GROUPS, build_parser
from peerd.cliargs import LAB_GROUP
from peerd.tools import cli_tools

from .support.processes import peerd

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "scripts"))
import gen_cli_docs  # noqa: E402


def _sub(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _all_parsers(parser: argparse.ArgumentParser, name: str = "peerd"):
    yield name, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child, p in a.choices.items():
                yield from _all_parsers(p, f"{name} {child}")


def test_bare_peerd_prints_the_grouped_help_and_exits_0() -> None:
    bare = peerd()
    assert bare.returncode == 0 and bare.stderr == ""
    assert bare.stdout == peerd("--help").stdout
    text = bare.stdout
    at = [text.index(f"\n{title}:\n") for title, _ in COMMAND_GROUPS]
    assert at == sorted(at)  # run a node, try it, measure: in that order
    for (title, names), start, end in zip(COMMAND_GROUPS, at, [*at[1:], len(text)], strict=True):
        section = text[start:end]
        for name in names:
            assert f"\n  {name} " in section, (title, name)
    assert "peerd " in peerd("--version").stdout


def test_every_command_is_in_exactly_one_group() -> None:
    sub = _sub(build_parser())
    listed = [n for _, names in COMMAND_GROUPS for n in names]
    visible = {a.dest for a in sub._choices_actions}
    assert sorted(listed) == sorted(visible) and len(listed) == len(set(listed))
    assert [t for t, _ in COMMAND_GROUPS] == ["run a node", "try it", "measure"]


def test_one_flag_name_per_idea_across_commands() -> None:
    sub = _sub(build_parser())
    for option in ("--identity", "--swarm-key-file"):
        for command in ("keygen", "join"):
            assert option in sub.choices[command]._option_string_actions, (command, option)
    bench = _sub(sub.choices["bench"]).choices["allreduce"]
    for p in (sub.choices["demo"], bench):
        assert "gloo" in p._option_string_actions["--baseline"].choices
    # the old names parse but are not shown
    assert bench._option_string_actions["--compare-gloo"].help is argparse.SUPPRESS
    assert sub.choices["keygen"]._option_string_actions["--swarm-key"].help is argparse.SUPPRESS


def test_old_names_work_with_one_deprecation_line(monkeypatch, capsys) -> None:
    old = peerd("train", "--help")
    assert old.returncode == 0 and "--run" in old.stdout and old.stderr == ""  # argparse answers --help itself
    proc = peerd("train", "--run", "r", "--model", "huge", check=False)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    # `train` runs demo-trainer's code with demo-trainer's arguments, after one line on stderr.
    seen = []
    monkeypatch.setitem(cli._COMMANDS, "train", lambda args, parser: seen.append(args) or 0)
    assert cli.main(["train", "--run", "r", "--steps", "3"]) == 0
    assert capsys.readouterr().err == ("peerd: warning: 'peerd train' is deprecated and will be removed; "
                                       "use 'peerd demo-trainer'\n")
    assert seen[0].run == "r" and seen[0].steps == 3 and seen[0].timeout == 30.0
    assert cli_tools.TOOL_COMMANDS["demo-trainer"] is cli_tools.TOOL_COMMANDS["train"] is cli_tools.cmd_train
    gloo = peerd("bench", "allreduce", "--compare-gloo", "--nat", "cone", check=False)
    assert gloo.returncode == 2
    assert "'peerd bench allreduce --compare-gloo' is deprecated" in gloo.stderr and "--baseline gloo" in gloo.stderr


def test_fault_injection_and_lab_flags_are_in_their_own_group() -> None:
    sub = _sub(build_parser())
    join = sub.choices["join"]
    groups = {g.title: {o for a in g._group_actions for o in a.option_strings} for g in join._action_groups}
    assert {"--loss", "--loss-seed", "--delay", "--fault-byzantine"} <= groups[LAB_GROUP]
    main = groups.get("options", set()) | groups.get("optional arguments", set())
    assert not {"--loss", "--loss-seed"} & main and {"--listen", "--socket-group"} <= main
    text = peerd("join", "--help").stdout
    lab = text[text.index(f"{LAB_GROUP}:"):]
    assert "--loss P" in lab and "--loss-seed" in lab and "--delay MS" in lab and "--listen" not in lab
    late = peerd("join", "--insecure", "--delay", "5000", check=False)
    assert late.returncode == 2 and "--delay must be in [0, 1000] milliseconds" in late.stderr
    assert "--link RATE" in peerd("demo", "--help").stdout.split(f"{LAB_GROUP}:")[1]


def test_help_texts_point_at_nothing_a_pip_install_lacks() -> None:
    bad = []
    for name, p in _all_parsers(build_parser()):
        for a in p._actions:
            if a.help and a.help is not argparse.SUPPRESS:
                for needle in ("protocol/", ".md", "default: the daemon's", "pacer", "issue "):
                    if needle in a.help:
                        bad.append(f"{name} {'/'.join(a.option_strings) or a.dest}: {needle!r}")
    assert not bad, bad


def test_trainer_defaults_equal_the_apis() -> None:
    torch_mod = pytest.importorskip("torch")
    assert torch_mod is not None
    from peerd.torch import Optimizer

    trainer = _sub(build_parser()).choices["demo-trainer"]
    api = inspect.signature(Optimizer).parameters
    assert trainer.get_default("timeout") == api["timeout_s"].default
    assert trainer.get_default("average_every") == api["average_params_every"].default
    assert trainer.get_default("robust") == "off"  # Optimizer(robust=None) averages plainly: off
    assert "default off" in trainer._option_string_actions["--robust"].help


def test_generated_cli_reference_is_current() -> None:
    text = gen_cli_docs.render_cli()
    assert gen_cli_docs.CLI_MD.read_text() == text, "docs/cli.md is stale: run python scripts/gen_cli_docs.py"
    for name, p in _all_parsers(build_parser()):
        leaf = name != "peerd" and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)
        if leaf and name.split()[1] != "train":  # the old name of demo-trainer: one section, under the new name
            assert f"## {name}\n" in text, name
    assert "| `--listen HOST:PORT` | `0.0.0.0:7411` |" in text
    assert "| `--timeout S` | `30` |" in text
