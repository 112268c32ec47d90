"""One CLI convention: --json on every command that prints something a script wants, the same exit code with
and without it, and every option's default in its help.

Cheap by design: the benches run at their smallest sizes (2 daemons, 1000 floats or 2 keys), `train` runs one
step; `bench soak` and `demo` (tens of seconds at any size) are checked at the --help and argument level only."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys

import pytest

from peerd.cli import build_parser
from peerd.tools.swarm import LocalSwarm

from .support.processes import peerd

pytestmark = pytest.mark.e2e

NO_JSON = {"join", "top"}  # a daemon: it logs, it prints no result; top: a live screen (status --json is its JSON)


def _leaves(parser: argparse.ArgumentParser, name: str = "peerd"):
    """(command name, its parser) for every runnable subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield name, parser
        return
    for sub in subs:
        for child, p in sub.choices.items():
            yield from _leaves(p, f"{name} {child}")


def test_every_command_that_prints_a_result_has_json() -> None:
    missing = [name for name, p in _leaves(build_parser())
               if name.split()[1] not in NO_JSON and "--json" not in p._option_string_actions]
    assert not missing, missing


def test_every_option_has_help_with_its_default() -> None:
    bad = []
    for name, p in _leaves(build_parser()):
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS:
                continue
            if isinstance(a, argparse._HelpAction | argparse._VersionAction):
                continue
            if not a.help:
                bad.append(f"{name} {a.option_strings[0]}: no help")
            elif a.default not in (None, False, []) and "default" not in a.help:
                bad.append(f"{name} {a.option_strings[0]}: default {a.default!r} not in its help")
    assert not bad, bad


def _both(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The command as text and with --json; their exit codes must agree."""
    text = peerd(*args, check=False, timeout=timeout)
    as_json = peerd(*args, "--json", check=False, timeout=timeout)
    assert text.returncode == as_json.returncode, (args, text.stderr, as_json.stderr)
    return text, as_json


def test_keygen_json_and_exit_codes(tmp_path) -> None:
    ident, key = str(tmp_path / "id.pem"), str(tmp_path / "swarm.key")
    out = json.loads(peerd("keygen", "--identity", ident, "--json").stdout)
    assert out["kind"] == "identity" and out["path"] == ident and len(out["peer_id"]) == 64
    assert json.loads(peerd("keygen", "--swarm-key-file", key, "--json").stdout) == {"kind": "swarm_key",
                                                                                     "path": key}
    text, as_json = _both("keygen", "--identity", ident)  # exists: refused in both modes
    assert text.returncode == 1 and as_json.stdout == ""
    none = peerd("keygen", check=False)
    assert none.returncode == 2 and "needs --identity PATH" in none.stderr


def test_daemon_commands_json_and_exit_codes(tmp_path) -> None:
    text, as_json = _both("status", "--socket", str(tmp_path / "none.sock"))
    assert text.returncode == 1 and "peerd join" in as_json.stderr
    with LocalSwarm(str(tmp_path / "s"), metrics=False) as swarm:
        node = swarm.start()
        swarm.wait_ready(node)
        text, as_json = _both("status", "--socket", node.socket)
        assert text.returncode == 0 and "peer id" in text.stdout
        assert json.loads(as_json.stdout)["peer_id"] == node.status["peer_id"]
        put = json.loads(peerd("dht", "put", "k", "v", "--socket", node.socket, "--json").stdout)
        assert put["key"] == "k" and put["stored"] >= 1 and put["subkey"] == node.status["peer_id"]
        assert "stored k on" in peerd("dht", "put", "k", "v", "--socket", node.socket).stdout
        text, as_json = _both("dht", "get", "k", "--socket", node.socket)
        assert text.returncode == 0 and [v["value"] for v in json.loads(as_json.stdout)["values"]] == ["v"]
        text, as_json = _both("dht", "get", "missing", "--socket", node.socket)
        assert text.returncode == 1 and json.loads(as_json.stdout) == {"key": "missing", "values": []}
        assert "no values under missing" in text.stderr

        pytest.importorskip("torch")  # `peerd train` needs the torch extra; everything above ran without it
        train = peerd("demo-trainer", "--run", "r", "--socket", node.socket, "--steps", "1", "--timeout", "1",
                      "--final-average", "0", "--average-every", "0", "--no-sync", "--json", timeout=120)
        result = json.loads(train.stdout)  # one JSON object, nothing else on stdout
        assert result["event"] == "done" and result["steps"] == 1
        assert "step    1" in train.stderr and "nan" not in train.stderr


def test_benches_json_at_their_smallest() -> None:
    text, as_json = _both("bench", "allreduce", "--peers", "2", "--size", "1000", "--repeat", "1")
    assert text.returncode == 0 and json.loads(as_json.stdout)["peers"] == 2
    moshpit = json.loads(peerd("bench", "moshpit", "--peers", "2", "--rounds", "1", "--size", "100", "--window",
                               "0.5", "--json", timeout=120).stdout)
    assert len(moshpit["deviation"]) == 1
    dht = json.loads(peerd("bench", "dht", "--peers", "2", "--keys", "2", "--json", timeout=120).stdout)
    assert dht["keys"] == 2
    for args in (["bench", "soak"], ["demo"], ["demo-trainer"]):  # tens of seconds at any size: --help level only
        assert "--json" in peerd(*args, "--help").stdout
    text, as_json = _both("demo", "--peers", "2", "--byzantine", "2")
    assert text.returncode == 2


def test_swarm_json_line_then_ctrl_c(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "peerd", "swarm", "--peers", "1", "--dir", str(tmp_path / "s"),
                             "--json"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = json.loads(proc.stdout.readline())
        (peer,) = first["peers"]
        assert peer["socket"].endswith("peer0.sock") and peer["listen"].startswith("127.0.0.1:")
        assert json.loads(peerd("status", "--socket", peer["socket"], "--json").stdout)["peer_id"] == peer["peer_id"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert proc.stdout.read() == ""  # the words went to stderr
    finally:
        proc.kill()
        proc.wait()
