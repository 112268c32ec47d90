"""The trainer service against hostile members (issue 11): a swarm advert of another layout never refuses a
trainer, non-finite averages never reach the arena, a state download is bounded by the local layout, and
trainer_open's max_samples / robust reach the averaging call. Real local socket, in-process averager."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from peerd.allreduce.robust import DEFAULT_C, MAX_C, Robust
from peerd.localsock.arena import Arena, write_blob
from peerd.localsock.client import DaemonError, LocalClient
from peerd.statesync.advert import Advert
from peerd.trainer.options import MAX_BLOB, parse_layout, snapshot_bound

from .support.sessions import LAYOUT, open_session, run_sessions, step
from .support.trainer_harness import InProcessAverager, ThreadDaemon

OTHER_LAYOUT = "f" * 64


class FakeSync:
    """The StateSync surface the trainer service uses, with adverts chosen by the test."""

    def __init__(self, ads: list[Advert]) -> None:
        self.ads = ads
        self.fetches: list[dict] = []
        self.noted: list[list[str]] = []

    async def adverts(self, run: str, *, timeout: float = 10.0) -> list[Advert]:
        return list(self.ads)

    async def advertise_state(self, *args, **kwargs) -> bool:
        return True

    async def fetch(self, run: str, run_key: str, **kwargs):
        self.fetches.append(kwargs)
        return None

    def note_peers(self, members) -> None:
        self.noted.append(list(members))


def other_model_advert(i: int) -> Advert:
    return Advert(bytes([i]) * 32, "r1/ffffffffffffffff", OTHER_LAYOUT, 10**9, 2**33, b"\x01" * 32, None)


@pytest.fixture
def synced(tmp_path):
    sync = FakeSync([other_model_advert(1), other_model_advert(2)])
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=3.0), statesync=sync)
    d.sync = sync
    yield d
    d.stop()


def test_swarm_adverts_of_another_layout_never_refuse_trainer_open(synced) -> None:
    client, arena, reply = open_session(synced.path)  # used to be refused: "different model in the swarm"
    assert "other models" in reply["warning"] and OTHER_LAYOUT[:16] in reply["warning"]
    assert synced.counter(synced.metrics.ignored_records, kind="state_advert", reason="layout") == 2
    # once someone advertises this layout too, there is nothing to warn about
    synced.sync.ads.append(Advert(b"\x03" * 32, reply["run_key"], reply["layout_hash"], -1, 0, bytes(32), None))
    c2, a2, r2 = open_session(synced.path)
    assert "warning" not in r2
    # two local sessions of different models on one run are still refused: that is a local fact
    with pytest.raises(DaemonError, match="different model"):
        open_session(synced.path, layout=[["w", [4, 3], "float32"], ["b", [4], "float32"]])
    for c, a in ((client, arena), (c2, a2)):
        c.close()
        a.close()


@pytest.mark.parametrize("poison,kind", [(math.nan, "grad"), (math.inf, "params")])
def test_a_non_finite_average_is_never_written(synced, poison: float, kind: str) -> None:
    synced.averager.poison = poison  # the group's average holds NaN or inf (a member slipped it through)
    va, vb = np.arange(16, dtype=np.float32), np.full(16, 3, np.float32)
    for (reply, result), own in zip(run_sessions(synced, [va, vb], kind=kind), (va, vb), strict=True):
        assert reply["outcome"] == "failed" and "NaN or infinity" in reply["error"], reply
        np.testing.assert_array_equal(result, own)  # the trainer's own vector, not the poisoned average
    assert synced.counter(synced.metrics.contributions_refused, reason="nonfinite_result") == 2
    assert synced.counter(synced.metrics.trainer_steps, outcome="failed") == 2
    assert synced.sync.noted == []  # members of a poisoned round are not remembered as good donors


def test_averaged_rounds_name_known_donors(synced) -> None:
    run_sessions(synced, [np.ones(16, np.float32), np.zeros(16, np.float32)])
    assert len(synced.sync.noted) == 2 and all(len(m) == 2 for m in synced.sync.noted)


def test_max_samples_and_robust_reach_the_averager(synced) -> None:
    client, arena, reply = open_session(synced.path)
    synced.averager.wait_s = 0.1
    step(client, arena, reply, 1, np.ones(16), 1)
    # unset: no weight cap reaches the averaging call, and gradient averages take the weight bound and the
    # direction test alone (clipping only past MAX_C times the median): a sign flip at a claimed weight is left out
    assert synced.averager.options == [{"robust": Robust("clip", MAX_C)}]
    # parameter averages clip around the trainer's own parameters by default: a sign-flipped member (at any
    # claimed weight) would otherwise shrink every honest model at each parameter average
    step(client, arena, reply, 2, np.full(16, 3.0), 1, kind="params")
    opts = synced.averager.options[-1]
    assert opts["robust"] == Robust("centered", DEFAULT_C) and opts["max_weight"] == 1.0  # parameters weigh 1
    np.testing.assert_array_equal(opts["center"], np.full(16, 3.0, np.float32))
    client.close()
    arena.close()
    arena = Arena.create(4, 16)
    client = LocalClient(synced.path, timeout=30)
    reply = client.call("trainer_open", fds=[arena.fd], run="r1", layout=LAYOUT, nslots=4, max_samples=64,
                        robust="clip:3")
    step(client, arena, reply, 1, np.ones(16), 1)
    assert synced.averager.options[-1] == {"max_weight": 64.0, "robust": Robust("clip", 3.0)}
    # parameter averages clip around the trainer's own parameters (honest replicas stay close to them)
    step(client, arena, reply, 2, np.full(16, 5.0), 1, kind="params")
    opts = synced.averager.options[-1]
    assert opts["robust"] == Robust("centered", 3.0) and opts["max_weight"] == 1.0  # parameters weigh 1 each
    np.testing.assert_array_equal(opts["center"], np.full(16, 5.0, np.float32))
    client.close()
    arena.close()
    for bad in (0, -1, math.inf, math.nan, "10", True, 2.0**60):
        with pytest.raises(DaemonError, match="max_samples"):
            open_with(synced.path, max_samples=bad)
    for bad in ("median", "clip:0", "centered:x", 5):
        with pytest.raises(DaemonError, match="robust"):
            open_with(synced.path, robust=bad)


def open_with(path: str, **fields):
    arena = Arena.create(4, 16)
    try:
        return LocalClient(path, timeout=30).call("trainer_open", fds=[arena.fd], run="r1", layout=LAYOUT,
                                                  nslots=4, **fields)
    finally:
        arena.close()


def test_state_fetch_is_bounded_by_the_local_layout(synced) -> None:
    client, arena, reply = open_session(synced.path)
    bound = snapshot_bound(parse_layout(LAYOUT)[0])
    assert 16 * 4 < bound < 2 << 20
    for asked, expect in ((None, bound), (1000, 1000), (bound * 10, bound)):
        fd = write_blob(b"")
        try:
            extra = {} if asked is None else {"max_size": asked}
            assert client.call("state_fetch", fds=[fd], session=reply["session"], **extra)["found"] is False
        finally:
            os.close(fd)
        assert synced.sync.fetches[-1]["max_size"] == expect
        assert synced.sync.fetches[-1]["layout"] == reply["layout_hash"]
    fd = write_blob(b"")
    try:
        with pytest.raises(DaemonError, match="max_size"):
            client.call("state_fetch", fds=[fd], session=reply["session"], max_size=0)
    finally:
        os.close(fd)
    # the snapshots a trainer refused (exclude): passed on as bytes, and bounded
    refused = ["ab" * 32, "0" * 64]
    fd = write_blob(b"")
    try:
        client.call("state_fetch", fds=[fd], session=reply["session"], exclude=refused)
    finally:
        os.close(fd)
    assert synced.sync.fetches[-1]["exclude"] == [bytes.fromhex(x) for x in refused]
    for bad in (["ab" * 32] * 17, ["AB" * 32], ["ab"], "ab" * 32, [b"\xab" * 32]):
        fd = write_blob(b"")
        try:
            with pytest.raises(DaemonError, match="exclude"):
                client.call("state_fetch", fds=[fd], session=reply["session"], exclude=bad)
        finally:
            os.close(fd)
    client.close()
    arena.close()
    assert snapshot_bound([("w", (1 << 40,), "float64")]) == MAX_BLOB


def test_snapshot_bound_holds_a_real_adam_snapshot(tmp_path) -> None:
    """The bound is computed from the layout alone; a real peerd.torch snapshot (Adam with amsgrad, its
    state filled by a step, many small tensors) must fit under it, or joiners would ignore honest donors."""
    torch = pytest.importorskip("torch")
    from peerd.torch import Optimizer

    d = ThreadDaemon(str(tmp_path / "t.sock"), InProcessAverager(group_size=1))
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(3, 3) for _ in range(20)] + [torch.nn.Linear(3, 300)]
        net = torch.nn.Sequential(*layers)
        opt = Optimizer(torch.optim.Adam(net.parameters(), lr=1e-3, amsgrad=True), run="t", socket=d.path,
                        sync_state=False)
        opt.zero_grad()
        net(torch.randn(2, 3)).sum().backward()
        opt.step(samples=2)
        blob = opt.snapshot()
        (session,) = d.service.sessions.values()
        assert len(blob) <= session.snapshot_max, (len(blob), session.snapshot_max)
        opt.close()
    finally:
        d.stop()


def test_arc_topk_sessions_take_robust_clip_and_refuse_centered(synced) -> None:
    """arc-topk clips its sketches and rows around zero: a session asking for centered is told so, not run
    as something else."""
    assert open_with(synced.path, compression="arc-topk", robust="clip:2")["session"] > 0
    with pytest.raises(DaemonError, match="does not go with arc-topk"):
        open_with(synced.path, compression="arc-topk", robust="centered:2")


def test_a_steps_wait_is_bounded_before_it_reaches_the_averager_hostile(synced) -> None:
    """``wait_s`` (finish()'s longer wait for late trainers) is a number within half the step's deadline, or the
    step is refused before it waits on anything; a valid one reaches the averaging call as it was asked."""
    client, arena, reply = open_session(synced.path)
    synced.averager.wait_s = 0.1
    for t, bad in enumerate((0.0, 0.1, 2.6, math.inf, math.nan, "1", True, []), start=1):
        with pytest.raises(DaemonError, match="wait_s"):
            step(client, arena, reply, t, np.ones(16), 1, kind="params", wait_s=bad)
    assert synced.averager.calls == []

    class ShortRounds:  # a tuner that measured quick rounds: a step's deadline comes down to 1 s
        def step_wait(self, cap_s: float) -> SimpleNamespace:
            return SimpleNamespace(seconds=1.0)

        def receive_step(self, **facts) -> None:
            pass

    synced.service.deadlines = ShortRounds()
    r, _ = step(client, arena, reply, 20, np.ones(16), 1, kind="params")
    r, _ = step(client, arena, reply, 21, np.ones(16), 1, kind="params", wait_s=0.3)
    assert r["outcome"] == "alone" and synced.averager.timeouts == [1.0, 5.0]  # (told to wait: the whole deadline)
    client.close()
    arena.close()
