"""A new user's first hour: every startup failure is one 'peerd: error:' line that says what to do and leaves
nothing behind, and a joiner that is silently dropped (wrong key, identity in use) is told why it may be."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from peerd.wire.identity import write_identity, write_swarm_key

from .support.processes import lines_until, peerd, peerd_json, peerd_process, wait_until

pytestmark = pytest.mark.e2e


def _one_error(proc: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one 'peerd: error:' line and no traceback; returns that line."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "ExceptionGroup" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("peerd: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_busy_metrics_port_is_one_line_and_leaves_no_socket(tmp_path) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    sock = str(tmp_path / "d.sock")
    try:
        proc = peerd("join", "--insecure", "--listen", "127.0.0.1:0", "--socket", sock, "--metrics", str(port),
                     check=False)
    finally:
        taken.close()
    error = _one_error(proc)
    assert f"127.0.0.1:{port}" in error and "--metrics" in error, error
    assert "async context" not in proc.stderr
    assert os.listdir(tmp_path) == []  # no stale socket file


def test_a_data_plane_that_cannot_run_is_one_line(tmp_path) -> None:
    sock = str(tmp_path / "d.sock")
    env = {**os.environ, "PEERD_DATAPLANE": "fastest"}
    proc = subprocess.run([sys.executable, "-m", "peerd", "join", "--insecure", "--listen", "127.0.0.1:0", "--socket",
                           sock], capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    error = _one_error(proc)
    assert "PEERD_DATAPLANE" in error and "native, python" in error, error
    assert os.listdir(tmp_path) == []


def test_announce_of_the_other_family_is_one_line(tmp_path) -> None:
    sock = str(tmp_path / "d.sock")
    proc = peerd("join", "--insecure", "--listen", "127.0.0.1:0", "--announce", "[2001:db8::1]:7411",
                 "--socket", sock, check=False)
    error = _one_error(proc)
    assert "--announce" in error and "IPv6" in error, error
    assert os.listdir(tmp_path) == []


def test_live_socket_is_refused_and_kept(tmp_path) -> None:
    """The second node started with the first one's --socket: told to pick another, the first is untouched."""
    sock = str(tmp_path / "d.sock")
    first = peerd_process("join", "--insecure", "--listen", "127.0.0.1:0", "--socket", sock)
    try:
        wait_until(lambda: os.path.exists(sock) and peerd_json("status", "--socket", sock), timeout=30,
                   interval=0.2, what="the first daemon")
        proc = peerd("join", "--insecure", "--listen", "127.0.0.1:0", "--socket", sock, check=False)
        error = _one_error(proc)
        assert "another daemon is serving" in error and "--socket" in error, error
        assert peerd_json("status", "--socket", sock)["peers"] == 0  # the first one still serves its socket
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=20)
    assert not os.path.exists(sock)


def test_port_zero_and_wildcard_log_the_real_port_and_a_usable_bootstrap_hint(tmp_path) -> None:
    sock = str(tmp_path / "d.sock")
    proc = peerd_process("join", "--insecure", "--listen", "0.0.0.0:0", "--socket", sock)
    try:
        lines = lines_until(proc.stderr, "others join with", timeout=30)
        text = "".join(lines)
        hint = lines[-1]
        assert "others join with --bootstrap" in hint, text
        assert "0.0.0.0:" not in hint, hint
        assert "peerd[0]" not in text and "peerd[?]" not in text, text
        port = peerd_json("status", "--socket", sock)["listen"].rpartition(":")[2]
        assert f"peerd[{port}]" in hint and f":{port}" in hint.partition("--bootstrap")[2], hint
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    """One sealed daemon with a known identity: the node others join through."""
    d = tmp_path_factory.mktemp("boot")
    key, ident, sock = str(d / "swarm.key"), str(d / "id.pem"), str(d / "boot.sock")
    write_swarm_key(key)
    write_identity(ident)
    proc = subprocess.Popen([sys.executable, "-m", "peerd", "join", "--listen", "127.0.0.1:0", "--swarm-key-file",
                             key, "--identity", ident, "--socket", sock], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        status = wait_until(lambda: os.path.exists(sock) and peerd_json("status", "--socket", sock), timeout=30,
                            interval=0.2, what="the bootstrap daemon")
        yield {"dir": d, "key": key, "identity": ident, "socket": sock, "listen": status["listen"]}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def _join_fails(boot: dict, tmp_path, *args: str) -> tuple[str, str]:
    """A joiner that gives up after 3 s: its one error line, and the bootstrap's plain `peerd status`."""
    sock = str(tmp_path / "joiner.sock")
    proc = peerd("join", "--listen", "127.0.0.1:0", "--bootstrap", boot["listen"], "--bootstrap-timeout", "3",
                 "--socket", sock, *args, check=False, timeout=60)
    error = _one_error(proc)
    assert not os.path.exists(sock)
    return error, peerd("status", "--socket", boot["socket"]).stdout


def test_identity_reuse_is_named_at_both_ends(bootstrap, tmp_path) -> None:
    error, status = _join_fails(bootstrap, tmp_path, "--swarm-key-file", bootstrap["key"],
                                "--identity", bootstrap["identity"])
    assert "no bootstrap node answered" in error
    assert "another node already running with this identity" in error and bootstrap["identity"] in error, error
    assert "peerd status" in error, error
    assert "self: " in status and "same --identity" in status, status


def test_wrong_swarm_key_is_named_at_both_ends(bootstrap, tmp_path) -> None:
    other = str(tmp_path / "other.key")
    write_swarm_key(other)
    error, status = _join_fails(bootstrap, tmp_path, "--swarm-key-file", other)
    assert "swarm key" in error and "peerd status" in error, error
    assert "auth: " in status and "--swarm-key-file" in status, status
