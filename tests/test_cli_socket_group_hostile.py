"""`peerd join --socket-group`, from the attacker's side: a user outside the group is refused by the daemon itself
(not only by the file mode), root is no exception, and a client does not hand gradients to a daemon of another
uid whose socket anyone could have put in place."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from peerd.localsock.access import may_use, trusted_daemon

from .support.processes import wait_until
from .support.users import ROOT, _as_user, _free_id


def test_trusted_daemon_needs_a_socket_nobody_else_could_place(tmp_path) -> None:
    me = os.geteuid()
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    path = str(d / "peerd.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    try:
        assert trusted_daemon(path, me)
        assert not trusted_daemon(path, me + 4242)  # the socket is not the serving uid's
        os.chmod(d, 0o777)  # a directory anyone can write: anyone could have put the socket there
        assert not trusted_daemon(path, me)
        os.chmod(d, 0o1777)
        assert not trusted_daemon(path, me)
        os.chmod(d, 0o775)
        assert not trusted_daemon(path, me)
        assert not trusted_daemon(str(d / "missing.sock"), me)
    finally:
        s.close()


def test_own_uid_is_served_with_or_without_a_group() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert may_use(a, None) == (True, os.geteuid())
        assert may_use(a, 4242) == (True, os.geteuid())


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.mark.e2e
def test_socket_group_admits_members_only_hostile() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: clients run as other uids")
    missing = [t for t in ("groupadd", "groupdel", "setpriv", "unshare") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)}")
    import grp
    import pwd

    group = f"peerdh{os.getpid() % 100000}"
    subprocess.run(["groupadd", group], check=True, capture_output=True, timeout=30)
    base = Path(tempfile.mkdtemp(prefix="peerd-group-"))
    daemons: list[subprocess.Popen] = []
    try:
        os.chmod(base, 0o755)
        gid = grp.getgrnam(group).gr_gid
        taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
        member, primary, outsider, svc = (_free_id(taken, 62000) for _ in range(4))
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(base)}
        peerd = [sys.executable, "-m", "peerd"]

        def status(uid: int, gid_: int, groups: list[int], sock: Path) -> subprocess.CompletedProcess:
            return subprocess.run(_as_user([*peerd, "status", "--socket", str(sock)], uid, gid_, groups, base),
                                  capture_output=True, text=True, timeout=60, env=env, cwd="/")

        # A root daemon whose socket an operator loosened to 0666: the daemon's own check still holds.
        run = base / "run"
        run.mkdir(mode=0o755)
        sock = run / "peerd.sock"
        daemons.append(_start([*peerd, "join", "--insecure", "--listen", "127.0.0.1:0", "--socket", str(sock),
                               "--socket-group", group, "--log-level", "warning"], env, base / "root.log"))
        wait_until(lambda: sock.exists(), timeout=60, interval=0.2, what="the daemon's socket")
        assert sock.stat().st_gid == gid and sock.stat().st_mode & 0o777 == 0o660
        os.chmod(sock, 0o666)
        wait_until(lambda: status(member, member, [gid], sock).returncode == 0, timeout=60, interval=0.5,
                   what="a supplementary member to be served")
        assert status(primary, gid, [], sock).returncode == 0  # the group as primary gid
        out = status(outsider, outsider, [], sock)
        assert out.returncode == 1 and f"serves uid 0 and group {gid} only" in out.stderr, out.stderr
        assert "you are uid" in out.stderr

        # A daemon of another uid serving its group: root, not a member, is refused by it.
        run2 = base / "run2"
        run2.mkdir(mode=0o755)
        os.chown(run2, svc, gid)
        sock2 = run2 / "peerd.sock"
        daemons.append(subprocess.Popen(
            _as_user([*peerd, "join", "--insecure", "--listen", "127.0.0.1:0", "--socket", str(sock2),
                      "--socket-group", group, "--log-level", "warning"], svc, gid, [], base, 0o077),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd="/"))
        wait_until(lambda: status(member, member, [gid], sock2).returncode == 0, timeout=60, interval=0.5,
                   what="the service user's daemon to serve a member")
        root = subprocess.run([*peerd, "status", "--socket", str(sock2)], capture_output=True, text=True,
                              timeout=60, env=env)
        assert root.returncode == 1 and f"group {gid}" in root.stderr, root.stderr

        # The same daemon's socket where anyone could have put it (a world-writable directory): a member's client
        # refuses to talk to a daemon of another uid there.
        squat = base / "squat"
        squat.mkdir()
        os.chmod(squat, 0o1777)
        os.link(sock2, squat / "peerd.sock")
        out = status(member, member, [gid], squat / "peerd.sock")
        assert out.returncode == 1 and "refusing to hand it gradients" in out.stderr, out.stderr
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        subprocess.run(["groupdel", group], capture_output=True, timeout=30)
        shutil.rmtree(base, ignore_errors=True)
