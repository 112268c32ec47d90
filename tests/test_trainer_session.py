"""The daemon side of the trainer API over the real local socket: sessions, steps through the arena,
refusal of a different model, and a trainer that disconnects mid-step."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from peerd.localsock.arena import Arena
from peerd.localsock.client import DaemonError, LocalClient
from peerd.localsock.frames import encode_frame

from .support.sessions import LAYOUT, open_session, step  # noqa: E402
from .support.trainer_harness import InProcessAverager, ThreadDaemon, error_when_the_daemon_dies, thread_daemon


@pytest.fixture
def daemon(tmp_path):
    with thread_daemon(tmp_path, group_size=2, wait_s=3.0) as d:
        yield d






def test_two_trainers_get_the_weighted_mean_through_the_arena(daemon) -> None:
    a = open_session(daemon.path)
    b = open_session(daemon.path)
    assert a[2]["run_key"] == b[2]["run_key"] and a[2]["run_key"].startswith("r1/")
    va, vb = np.arange(16, dtype=np.float32), np.full(16, 10, np.float32)
    out = {}

    def run(name, s, v, n):
        out[name] = step(*s, 1, v, n, loss=0.5, samples_per_second=100.0)

    threads = [threading.Thread(target=run, args=("a", a, va, 1)), threading.Thread(target=run, args=("b", b, vb, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    expected = (va * 1 + vb * 3) / 4
    for name in "ab":
        reply, result = out[name]
        assert reply["outcome"] == "averaged" and reply["group_size"] == 2
        assert reply["bytes_sent"] == 64  # the round's, as the averager says (what the demo counts for arc-topk)
        np.testing.assert_allclose(result, expected, rtol=1e-6)
    assert daemon.averager.calls[0][0].endswith(".g")
    assert sorted(w for _, w in daemon.averager.calls) == [1.0, 3.0]  # sample count is the weight
    assert daemon.counter(daemon.metrics.trainer_steps, outcome="averaged") == 2
    assert daemon.gauge(daemon.metrics.trainer_loss) == 0.5
    assert daemon.gauge(daemon.metrics.trainer_samples_per_second) == 100.0
    assert daemon.gauge(daemon.metrics.trainer_sessions) == 2
    for client, arena, _ in (a, b):
        client.close()
        arena.close()


def test_alone_returns_own_vector_and_counts_it(daemon) -> None:
    daemon.averager.wait_s = 0.2
    client, arena, reply = open_session(daemon.path)
    r, result = step(client, arena, reply, 1, np.ones(16), 2)
    assert r["outcome"] == "alone" and r["group_size"] == 1
    assert result.tolist() == [1.0] * 16
    assert daemon.counter(daemon.metrics.trainer_steps, outcome="alone") == 1
    # step ids must increase: an old step id is refused
    with pytest.raises(DaemonError, match="not after"):
        client.call("trainer_step", session=reply["session"], step=1)
    client.close()
    arena.close()


def test_a_different_model_in_the_same_run_is_refused(daemon) -> None:
    client, arena, reply = open_session(daemon.path)
    other = [["w", [4, 3], "float32"], ["b", [4], "float32"]]  # same size, different shape
    with pytest.raises(DaemonError, match="different model"):
        open_session(daemon.path, layout=other)
    # another run may train it
    c2, a2, r2 = open_session(daemon.path, layout=other, run="r2")
    assert r2["layout_hash"] != reply["layout_hash"]
    for c, a in ((client, arena), (c2, a2)):
        c.close()
        a.close()


def test_bad_requests_get_clear_errors(daemon) -> None:
    client = LocalClient(daemon.path)
    with pytest.raises(DaemonError, match="file descriptor"):
        client.call("trainer_open", run="r", layout=LAYOUT, nslots=4)
    client = LocalClient(daemon.path)
    small = Arena.create(4, 8)
    with pytest.raises(DaemonError, match="arena"):
        client.call("trainer_open", fds=[small.fd], run="r", layout=LAYOUT, nslots=4)
    small.close()
    client = LocalClient(daemon.path)
    with pytest.raises(DaemonError, match="no such session"):
        client.call("trainer_step", session=12345, step=1)
    for bad in (0, 1001, "10", 2.5):
        client = LocalClient(daemon.path)
        a = Arena.create(4, 16)
        with pytest.raises(DaemonError, match="keep_rounds"):
            client.call("trainer_open", fds=[a.fd], run="r", layout=LAYOUT, nslots=4, keep_rounds=bad)
        a.close()
    c, arena, reply = open_session(daemon.path)
    for t, bad in ((1, -1), (2, "3"), (3, 2**32)):
        arena.write_request(t, 1)
        with pytest.raises(DaemonError, match="round"):
            c.call("trainer_step", session=reply["session"], step=t, round=bad)
    c.close()
    arena.close()
    c, arena, reply = open_session(daemon.path)
    arena.vector(1)[:] = np.nan
    arena.write_request(1, 1)
    with pytest.raises(DaemonError, match="NaN"):
        c.call("trainer_step", session=reply["session"], step=1)
    c.close()
    arena.close()


def test_trainer_killed_mid_step_leaves_the_daemon_healthy(daemon) -> None:
    """The trainer asks for an average and vanishes while the round is open; the session is torn down at
    once, the round's late result is never written, and the daemon keeps serving others."""
    daemon.averager.wait_s = 1.0
    elems = 16
    arena = Arena.create(4, elems)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(daemon.path)
    socket.send_fds(raw, [encode_frame({"op": "trainer_open", "fds": 1, "run": "r1", "layout": LAYOUT,
                                        "nslots": 4})], [arena.fd])
    raw.settimeout(5)
    assert b"session" in raw.recv(65536)
    arena.vector(1)[:] = 5
    arena.write_request(1, 1)
    raw.sendall(encode_frame({"op": "trainer_step", "session": 1, "step": 1}))
    time.sleep(0.2)  # the round is open now
    raw.close()  # the trainer dies mid-step
    time.sleep(0.3)
    assert daemon.gauge(daemon.metrics.trainer_sessions) == 0  # torn down without waiting for the round
    time.sleep(1.2)  # the round finishes after its owner left
    header = arena.read_header(1)
    assert header[2] != 2, "a result was written for a trainer that had gone"
    arena.close()
    # the daemon is healthy: a new trainer steps normally
    daemon.averager.wait_s = 0.2
    client, arena2, reply = open_session(daemon.path)
    r, result = step(client, arena2, reply, 1, np.ones(16), 1)
    assert r["outcome"] == "alone" and result.tolist() == [1.0] * 16
    client.close()
    arena2.close()
    assert daemon.error is None


def test_daemon_that_dies_mid_round_gives_a_clear_error_and_reconnect_works(tmp_path) -> None:
    path = str(tmp_path / "d.sock")
    d = ThreadDaemon(path, InProcessAverager(group_size=2, wait_s=30.0))
    client, arena, reply = open_session(path)
    arena.vector(1)[:] = 1
    arena.write_request(1, 1)
    # the daemon goes away while the round is open
    error = error_when_the_daemon_dies(
        lambda: client.call("trainer_step", session=reply["session"], step=1, timeout_s=30), d, within=10)
    assert "closed the connection" in error
    with pytest.raises(DaemonError, match="broken"):
        client.call("status")
    with pytest.raises(DaemonError, match="no peerd daemon"):
        LocalClient(path)
    d2 = ThreadDaemon(path, InProcessAverager(group_size=1))
    try:
        client2, arena2, reply2 = open_session(path)  # reconnect: a new session on the new daemon
        assert reply2["session"] >= 1
        client2.close()
        arena2.close()
    finally:
        d2.stop()
    arena.close()
    os.path.exists(path)


def test_a_large_slot_is_taken_off_the_event_loop_and_still_checked(daemon, monkeypatch) -> None:
    """A slot of at least OFF_LOOP_ELEMS values is copied and checked for NaN in a worker thread: the average is
    the same, a NaN in its last value is still refused, and the daemon's loop answers meanwhile."""
    import trio

    import peerd.trainer.session as svc

    on_loop: list[bool] = []
    real = svc._copy_checked

    def spy(src):
        on_loop.append(trio.lowlevel.in_trio_run())  # False in a worker thread
        return real(src)

    monkeypatch.setattr(svc, "_copy_checked", spy)
    n = svc.OFF_LOOP_ELEMS
    layout = [["w", [n], "float32"]]
    daemon.averager.wait_s = 0.1
    client, arena, reply = open_session(daemon.path, layout=layout, run="big")
    try:
        vec = np.linspace(-1, 1, n, dtype=np.float32)
        r, result = step(client, arena, reply, 1, vec, 2)
        assert r["outcome"] == "alone" and np.array_equal(result, vec)
        assert on_loop == [False]
        bad = vec.copy()
        bad[-1] = np.nan
        with pytest.raises(DaemonError, match="NaN or infinity"):
            step(client, arena, reply, 2, bad, 2)
        assert on_loop == [False, False]
        small = open_session(daemon.path, run="small")  # (a small slot stays on the loop: no thread hand-off)
        step(*small, 1, np.ones(16, np.float32), 1)
        assert on_loop == [False, False, True]
        small[0].close()
        small[1].close()
    finally:
        client.close()
        arena.close()
