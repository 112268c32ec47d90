"""Hostile or broken local clients (issue 11, finding 10): an oversized reply, another uid on the socket,
a squatted socket directory, and arenas a trainer could shrink under the daemon's mapping."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import stat
import tempfile
import time

import pytest
import trio
import trio.testing

from peerd.localsock import access
from peerd.localsock.arena import HEADER, MAGIC, VERSION, Arena, ArenaError, arena_size, read_blob, write_blob
from peerd.localsock.client import DaemonError, LocalClient
from peerd.localsock.frames import LENGTH, MAX_FRAME, FrameDecoder, encode_frame
from peerd.localsock.server import LocalServer, SocketInUse
from peerd.metrics import Metrics

from .support.trainer_harness import InProcessAverager, ThreadDaemon

NOBODY = 65534
LAYOUT = [["w", [4], "float32"]]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root (setuid to nobody)")


@pytest.fixture
def daemon(tmp_path):
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0))

    async def ping(request):
        return {"pong": True}

    async def big(request):
        return {"data": bytes(MAX_FRAME + 1)}  # e.g. avg_round's answer for a 16 MiB vector

    async def unencodable(request):
        return {"data": {1, 2}}  # msgpack cannot encode a set: a handler bug

    for op, handler in {"ping": ping, "big": big, "unencodable": unencodable}.items():
        d.server.register(op, handler)
    yield d
    d.stop()


def test_an_oversized_reply_is_an_error_reply_and_the_daemon_keeps_serving(daemon) -> None:
    with LocalClient(daemon.path, timeout=20) as client:
        with pytest.raises(DaemonError, match="too large"):
            client.call("big")
        assert client.call("ping")["pong"]  # same connection, still in step
        with pytest.raises(DaemonError, match="cannot be encoded"):
            client.call("unencodable")
        assert client.call("ping")["pong"]
    with LocalClient(daemon.path, timeout=20) as other:
        assert other.call("ping")["pong"]
    assert daemon.error is None and daemon.thread.is_alive()
    assert daemon.counter(daemon.metrics.local_refused, reason="reply_too_large") == 1


def test_connections_frames_and_descriptors_are_bounded(daemon, monkeypatch) -> None:
    """Same-uid clients are still bounded: connections at once, time to finish a frame, stray descriptors."""
    from peerd.localsock import server as server_mod

    monkeypatch.setattr(server_mod, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(server_mod, "FRAME_TIMEOUT_S", 0.3)
    a, b = LocalClient(daemon.path, timeout=20), LocalClient(daemon.path, timeout=20)
    assert a.call("ping")["pong"] and b.call("ping")["pong"]
    with LocalClient(daemon.path, timeout=20) as c, pytest.raises(DaemonError, match="already serves 2"):
        c.call("ping")
    assert daemon.counter(daemon.metrics.local_refused, reason="connections") == 1
    b.close()
    time.sleep(0.2)
    # a frame that never completes: an error frame, then the connection closes
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.path)
    s.sendall(encode_frame({"op": "ping"})[:3])
    assert "stayed incomplete" in FrameDecoder().feed(s.recv(65536))[0]["error"]
    assert s.recv(65536) == b""
    s.close()
    time.sleep(0.2)
    # descriptors sent ahead of any request that declares them
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.path)
    r, w = os.pipe()
    try:
        s.sendall(LENGTH.pack(1000))  # a request under way, whose bytes bring descriptors nobody declared
        with contextlib.suppress(OSError):
            for _ in range(8):
                socket.send_fds(s, [b"a"], [r, w, r, w])
        assert "ahead of their requests" in FrameDecoder().feed(s.recv(65536))[0]["error"]
    finally:
        s.close()
        os.close(r)
        os.close(w)
    assert a.call("ping")["pong"] and daemon.error is None
    a.close()


def _unsealed_arena(nslots: int, elems: int) -> int:
    """A memfd with a valid header and size but no seals: its owner could shrink it under the daemon."""
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, arena_size(nslots, elems))
    a = Arena(fd, nslots, elems, owns_fd=False)
    HEADER.pack_into(a.map, 0, MAGIC, VERSION, nslots, elems, a.stride)
    a.close()
    return fd


def test_an_unsealed_arena_is_refused(daemon) -> None:
    fd = _unsealed_arena(4, 4)
    try:
        with pytest.raises(ArenaError, match="not sealed against shrinking"):
            Arena.attach(fd, 4, 4)
        with LocalClient(daemon.path, timeout=20) as client:
            with pytest.raises(DaemonError, match="not sealed against shrinking"):
                client.call("trainer_open", fds=[fd], run="r", layout=LAYOUT, nslots=4)
            assert client.call("ping")["pong"]
        with pytest.raises(ArenaError, match="not sealed"):
            read_blob(fd, 16)  # blobs too
    finally:
        os.close(fd)
    pipe_r, pipe_w = os.pipe()  # not a memfd at all
    try:
        with pytest.raises(ArenaError, match="not a sealable memfd"):
            Arena.attach(pipe_r, 4, 4)
    finally:
        os.close(pipe_r)
        os.close(pipe_w)


def test_a_trainers_arena_and_blobs_cannot_shrink() -> None:
    """Truncating after trainer_open would SIGBUS the daemon's mapping: the kernel refuses it up front."""
    arena = Arena.create(4, 1000)
    blob = write_blob(b"x" * 4096)
    try:
        for fd in (arena.fd, blob):
            size = os.fstat(fd).st_size
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size // 2)
            with pytest.raises(PermissionError):  # F_SEAL_SEAL: the seals cannot be changed either
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
            assert os.fstat(fd).st_size == size
        daemon_side = Arena.attach(os.dup(arena.fd), 4, 1000)
        daemon_side.vector(3)[:] = 1.0  # still mapped in full
        assert arena.vector(3).sum() == 1000
        daemon_side.close()
    finally:
        arena.close()
        os.close(blob)


# -- the socket's directory ---------------------------------------------------------------------------
@pytest.fixture
def fallback(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "peerd-uid")
    monkeypatch.setattr(access, "fallback_dir", lambda: path)
    monkeypatch.delenv("PEERD_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return path


def test_the_fallback_socket_directory_is_created_private(fallback) -> None:
    path = access.default_socket_path()
    assert path == os.path.join(fallback, "peerd.sock")

    async def main() -> None:
        server = LocalServer(path, Metrics())
        try:
            st = os.lstat(fallback)
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        finally:
            server.close()

    trio.run(main)


def test_a_socket_directory_open_to_others_is_refused(fallback) -> None:
    os.mkdir(fallback, 0o700)
    os.chmod(fallback, 0o755)
    path = access.default_socket_path()
    with pytest.raises(SocketInUse, match="chmod 700"):
        LocalServer(path, Metrics())
    with pytest.raises(DaemonError, match="chmod 700"):
        LocalClient(path)
    os.rmdir(fallback)
    os.symlink(tempfile.gettempdir(), fallback)  # a link to somewhere else
    with pytest.raises(SocketInUse, match="not a directory"):
        LocalServer(path, Metrics())


@needs_root
def test_a_socket_directory_of_another_user_is_refused(fallback) -> None:
    os.mkdir(fallback, 0o700)
    os.chown(fallback, NOBODY, NOBODY)
    with pytest.raises(SocketInUse, match=f"belongs to uid {NOBODY}"):
        LocalServer(access.default_socket_path(), Metrics())


# -- SO_PEERCRED ----------------------------------------------------------------------------------------
def _as_nobody(body) -> int:
    """Fork a child that drops to uid/gid nobody and runs ``body()``; returns its pid. Exit 0 on success."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            body()
            code = 0
        except BaseException as e:
            os.write(2, f"child as nobody: {e!r}\n".encode())
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the child acting as nobody did not finish")


@contextlib.contextmanager
def _shared_dir():
    """A directory nobody may enter (pytest's tmp_path is 0700 under root's)."""
    path = tempfile.mkdtemp(prefix="peerd-uidtest-", dir="/tmp")
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_a_client_of_another_uid_is_refused_by_the_daemon() -> None:
    with _shared_dir() as directory:
        d = ThreadDaemon(os.path.join(directory, "d.sock"), InProcessAverager(group_size=1))
        try:
            os.chmod(d.path, 0o666)  # even with the file mode opened up, the uid check holds
            r, w = os.pipe()

            def connect() -> None:
                os.close(r)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(d.path)
                with contextlib.suppress(OSError):  # the daemon may have answered and closed already
                    s.sendall(encode_frame({"op": "trainer_close", "session": 1}))
                decoder, replies = FrameDecoder(), []
                with contextlib.suppress(ConnectionResetError):  # the daemon closes on our unread request
                    while not replies and (chunk := s.recv(65536)):
                        replies = decoder.feed(chunk)
                os.write(w, encode_frame({"replies": replies}))

            pid = _as_nobody(connect)
            os.close(w)
            assert _wait(pid) == 0
            with os.fdopen(r, "rb") as f:
                reply = FrameDecoder().feed(f.read())[0]["replies"]
            assert len(reply) == 1 and reply[0]["ok"] is False
            assert f"serves uid {os.geteuid()} only, you are uid {NOBODY}" in reply[0]["error"]
            assert d.counter(d.metrics.local_refused, reason="uid") == 1
            with LocalClient(d.path, timeout=10) as ours, pytest.raises(DaemonError, match="session"):
                ours.call("trainer_close", session=1)  # our own uid is still served
            assert d.error is None
        finally:
            d.stop()


@needs_root
def test_the_client_refuses_a_daemon_of_another_uid() -> None:
    with _shared_dir() as directory:
        path = os.path.join(directory, "squat.sock")
        ready_r, ready_w = os.pipe()

        def squat() -> None:
            os.close(ready_r)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            os.chmod(path, 0o666)
            s.listen(1)
            os.write(ready_w, b"1")
            s.settimeout(10)
            conn, _ = s.accept()
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                got = conn.recv(65536)
                assert not got, "the client sent a request to another uid's daemon"

        pid = _as_nobody(squat)
        os.close(ready_w)
        try:
            assert os.read(ready_r, 1) == b"1"
            with pytest.raises(DaemonError, match=f"served by uid {NOBODY}, not by you"):
                LocalClient(path, timeout=10)
        finally:
            os.close(ready_r)
            assert _wait(pid) == 0



def test_a_free_reply_lock_is_taken_without_a_schedule_point() -> None:
    """A reply goes out as soon as its handler returns (the event loop's other tasks, a receive pass or a sender's
    slice, run after it, not before); a lock another reply holds is still waited for."""
    from peerd.localsock.server import acquire_now

    async def main() -> None:
        lock = trio.Lock()
        with trio.testing.assert_no_checkpoints():
            await acquire_now(lock)
        assert lock.locked()
        order: list[str] = []

        async def second() -> None:
            await acquire_now(lock)
            order.append("second")
            lock.release()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            order.append("first")
            lock.release()
        assert order == ["first", "second"]

    trio.run(main)
