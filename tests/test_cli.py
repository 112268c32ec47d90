"""The CLI as a user meets it: key files, clear one-line errors, and a node still joining."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from peerd.tools.swarm import LocalSwarm

from .support.processes import lines_until, metric_value, peerd, peerd_json, peerd_process, scrape, wait_until

pytestmark = pytest.mark.e2e


def test_keygen_writes_private_files_and_refuses_to_overwrite(tmp_path) -> None:
    ident, key = str(tmp_path / "id.pem"), str(tmp_path / "swarm.key")
    out = peerd("keygen", "--identity", ident, "--swarm-key-file", key)
    assert "wrote identity" in out.stdout and "wrote a new swarm key" in out.stdout and out.stderr == ""
    for path in (ident, key):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = peerd("keygen", "--identity", ident, check=False)
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr


def test_keygen_old_names_still_work_with_a_deprecation_line(tmp_path) -> None:
    ident, key = str(tmp_path / "id.pem"), str(tmp_path / "swarm.key")
    old = peerd("keygen", ident)
    assert "wrote identity" in old.stdout
    assert "deprecated" in old.stderr and "--identity PATH" in old.stderr and old.stderr.count("\n") == 1
    old = peerd("keygen", "--swarm-key", key)
    assert "deprecated" in old.stderr and "--swarm-key-file PATH" in old.stderr
    both = peerd("keygen", ident, "--identity", ident, check=False)
    assert both.returncode == 2 and "once" in both.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["join", "--listen", "127.0.0.1:0"], "--swarm-key-file"),
        (["join", "--listen", "nonsense"], "expected HOST:PORT"),
        (["join", "--listen", "::1:7000", "--insecure"], "brackets"),
        (["join", "--insecure", "--bootstrap-timeout", "-3"], "must be positive"),
        (["join", "--insecure", "--bootstrap", "http://10.0.0.1:7411"], "not a URL"),
        (["keygen"], "needs --identity PATH"),
        (["dht", "put", "k"], "VALUE"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_hint(args: list[str], needle: str) -> None:
    proc = peerd(*args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_missing_or_bad_key_files(tmp_path) -> None:
    sock = str(tmp_path / "d.sock")
    missing = peerd("join", "--listen", "127.0.0.1:0", "--swarm-key-file", str(tmp_path / "nope"),
                    "--socket", sock, check=False)
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and "peerd keygen --swarm-key" in missing.stderr
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    open_key = peerd("join", "--listen", "127.0.0.1:0", "--swarm-key-file", str(garbage), "--socket", sock,
                     check=False)  # written with the default umask: readable by others, so refused first
    assert open_key.returncode == 1 and open_key.stderr.count("\n") == 1 and "chmod 600" in open_key.stderr
    garbage.chmod(0o600)
    bad = peerd("join", "--listen", "127.0.0.1:0", "--swarm-key-file", str(garbage), "--socket", sock,
                check=False)
    assert bad.returncode == 1 and "is not a swarm key" in bad.stderr
    bad_id = peerd("join", "--insecure", "--listen", "127.0.0.1:0", "--identity", str(garbage),
                   "--socket", sock, check=False)
    assert bad_id.returncode == 1 and "not a peerd identity" in bad_id.stderr
    assert not os.path.exists(sock)


def test_port_in_use(tmp_path) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        proc = peerd("join", "--insecure", "--listen", f"127.0.0.1:{port}", "--socket",
                     str(tmp_path / "d.sock"), check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("peerd: error:")]
        assert proc.returncode == 1 and len(errors) == 1 and "is in use" in errors[0]
    finally:
        taken.close()


def test_status_without_daemon(tmp_path) -> None:
    proc = peerd("status", "--socket", str(tmp_path / "none.sock"), check=False)
    assert proc.returncode == 1 and "peerd join" in proc.stderr


def test_unreachable_bootstrap_answers_status_then_gives_up(tmp_path) -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    sock = str(tmp_path / "d.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "peerd", "join", "--insecure", "--listen", "127.0.0.1:0", "--bootstrap",
         f"127.0.0.1:{silent.getsockname()[1]}", "--bootstrap-timeout", "8", "--socket", sock],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        status = wait_until(lambda: os.path.exists(sock) and peerd_json("status", "--socket", sock),
                            timeout=30, interval=0.3, what="the local socket")
        assert status["peers"] == 0 and status["joined"] is False
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert "no bootstrap node answered within 8 s" in err and "--swarm-key-file" in err
        assert "Traceback" not in err and "ExceptionGroup" not in err, err
        assert err.strip().splitlines()[-1].startswith("peerd: error: "), err
        assert time.monotonic() - start < 30
        assert not os.path.exists(sock)
    finally:
        proc.kill()
        silent.close()


def test_socket_is_private_and_metrics_bind_loopback(tmp_path) -> None:
    with LocalSwarm(str(tmp_path / "s")) as swarm:
        node = swarm.start(extra=("--metrics", "0"))  # a bare port binds 127.0.0.1
        status = swarm.wait_ready(node)
        assert stat.S_IMODE(os.stat(node.socket).st_mode) == 0o600
        assert status["metrics"].startswith("127.0.0.1:")
        text = scrape(status["metrics"])
        for name in ("peerd_dht_peers", "peerd_dht_records"):
            assert f"\n{name} " in text
        for name in ("peerd_datagrams_received_total", "peerd_datagrams_dropped_total", "peerd_rpc_seconds"):
            assert f"# TYPE {name.removesuffix('_total')}" in text
        # Garbage on the local socket is answered with an error and does not hurt the daemon.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(node.socket)
        raw.sendall(b"\x00\x00\x00\x05hello")
        raw.settimeout(10)
        assert b"not msgpack" in raw.recv(1000)
        raw.close()
        assert peerd_json("status", "--socket", node.socket)["peers"] == 0
        assert metric_value(scrape(status["metrics"]), "peerd_local_requests_total", op="status") >= 1


def test_peerd_swarm_starts_and_stops_on_ctrl_c(tmp_path) -> None:
    import signal

    proc = peerd_process("swarm", "--peers", "3", "--dir", str(tmp_path / "s"), stdout=subprocess.PIPE)
    try:
        text = "".join(lines_until(proc.stdout, "Ctrl-C", timeout=90))
        assert "Ctrl-C stops them all" in text, text
        sockets = [str(tmp_path / "s" / f"peer{i}.sock") for i in range(3)]
        assert all(s in text for s in sockets)
        wait_until(lambda: peerd_json("status", "--socket", sockets[2])["peers"] == 2, timeout=30,
                   what="the swarm to connect")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert not any(os.path.exists(s) for s in sockets)
    finally:
        proc.kill()


def test_fault_byzantine_is_hidden_and_never_silently_honest(monkeypatch) -> None:
    from peerd import daemon as daemon_mod
    from peerd.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "fault-byzantine" not in sub["join"].format_help()
    assert build_parser().parse_args(["join", "--fault-byzantine", "nan"]).fault_byzantine == "nan"
    assert daemon_mod._allreduce_kwargs(daemon_mod.DaemonConfig()) == {}
    import numpy as np

    from peerd.cli import _fault_factory
    from peerd.tools.faults import ByzantineGroupAverage

    assert _fault_factory(None) is None
    scale = _fault_factory("scale")
    assert isinstance(scale(1, 2, 0, np.zeros(4, np.float32), 1.0, 0.0), ByzantineGroupAverage)

    class WithoutHook:
        def __init__(self, endpoint, metrics, *, pacer=None) -> None: ...

    class WithHook:
        def __init__(self, endpoint, metrics, *, pacer=None, group_factory=None) -> None: ...

    monkeypatch.setattr(daemon_mod, "AllreduceService", WithoutHook)
    with pytest.raises(daemon_mod.StartupError, match="no group_factory="):
        daemon_mod._allreduce_kwargs(daemon_mod.DaemonConfig(group_factory=scale))
    monkeypatch.setattr(daemon_mod, "AllreduceService", WithHook)
    assert daemon_mod._allreduce_kwargs(daemon_mod.DaemonConfig(group_factory=scale)) == {"group_factory": scale}
    with pytest.raises(ValueError, match="must be one of"):
        _fault_factory("evil")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--peers", "2", "--byzantine", "2"], "at least one peer must be honest"),
        (["demo", "--robust", "median"], "robust must be off"),
        (["demo", "--byzantine-mode", "evil"], "invalid choice"),
        (["train", "--run", "r", "--max-samples", "0"], "positive"),
        (["join", "--insecure", "--fault-byzantine", "evil"], "invalid choice"),
    ],
)
def test_byzantine_and_robust_arguments_are_checked(args: list[str], needle: str) -> None:
    proc = peerd(*args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--model", "huge"], "invalid choice"),
        (["train", "--run", "r", "--model", "huge"], "invalid choice"),
        (["demo", "--baseline", "nccl"], "invalid choice"),
        (["demo", "--target-accuracy", "1.5"], "(0, 1]"),
        (["demo", "--target-accuracy", "lots"], "not a number"),
        (["demo", "--baseline", "gloo", "--mode", "diloco"], "compares plain training"),
        (["demo", "--mode", "diloco", "--compression", "arc-topk"], "not pseudo-gradients"),
        (["demo", "--baseline", "gloo", "--dropcompute", "auto"], "compares plain training"),
        (["demo", "--link-loss", "0.1"], "needs --link"),
        (["bench", "moshpit", "--link-loss", "0.1"], "needs --link"),
        (["bench", "moshpit", "--link", "100mbit", "--link-loss", "1.5"], "[0, 1)"),
        (["bench", "allreduce", "--link-queue-ms", "2"], "needs --link"),
        (["demo", "--link", "100mbit", "--link-queue-ms", "0"], "(0, 10000]"),
        (["bench", "moshpit", "--link", "5bit"], "at least 8kbit"),
        (["bench", "moshpit", "--link", "100mbps"], "expected a link rate"),
    ],
)
def test_link_model_and_baseline_arguments_are_checked(args: list[str], needle: str) -> None:
    proc = peerd(*args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_dht_replicas_is_checked_and_its_help_names_the_default() -> None:
    from peerd.cli import build_parser
    from peerd.dht.core import REPLICAS

    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert f"default {REPLICAS})" in " ".join(sub["join"].format_help().split())
    assert build_parser().parse_args(["join", "--dht-replicas", "8"]).dht_replicas == 8
    for bad in ("0", "21"):
        proc = peerd("join", "--insecure", "--dht-replicas", bad, check=False)
        assert proc.returncode == 2 and "--dht-replicas must be between 1 and 20" in proc.stderr, proc.stderr
