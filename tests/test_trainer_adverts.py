"""State advertisements a trainer does not wait for (peerd.trainer.adverts): the periodic publishes hand the
snapshot over and return; the DHT put happens in the background, newest per run, and never raises."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from peerd.localsock.arena import write_blob
from peerd.localsock.client import DaemonError
from peerd.trainer.adverts import LaterAdverts, PendingAdvert

from .support.trainer_harness import InProcessAverager, MemoryStateSync, ThreadDaemon

torch = pytest.importorskip("torch")

from peerd.torch import Optimizer  # noqa: E402

from .support.torch_models import model  # noqa: E402


def advert(run: str, step: int) -> PendingAdvert:
    return PendingAdvert(run, f"{run}/key", "layout", step, 100, bytes([step]) * 32)


def test_only_the_newest_waiting_advert_of_a_run_is_put_and_a_failure_is_counted() -> None:
    puts: list[tuple[str, int]] = []

    async def put(run, run_key, layout, *, step, size, sha) -> bool:
        await trio.sleep(1.0)
        if run == "bad":
            raise OSError("no route")
        puts.append((run, step))
        return True

    async def main() -> LaterAdverts:
        later = LaterAdverts(put)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(later.run)
            await trio.sleep(0)
            later.submit(advert("a", 1))  # taken at once: its put runs
            await trio.sleep(0.1)
            for step in (2, 3, 4):  # waiting behind it: only the newest stays
                later.submit(advert("a", step))
            later.submit(advert("bad", 1))
            assert later.waiting == 2
            await trio.sleep(10)
            assert later.waiting == 0
            nursery.cancel_scope.cancel()
        return later

    later = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert puts == [("a", 1), ("a", 4)]
    assert (later.stored, later.failed, later.replaced) == (2, 1, 2)
    assert not later.running


class SlowAdverts(MemoryStateSync):
    """A DHT whose puts of a snapshot's advert take ``delay`` seconds (a lossy path's round trips)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def advertise_state(self, run, run_key, layout, *, step: int = -1, size: int = 0, sha: bytes = b"",
                              **kwargs) -> bool:
        if size:
            await trio.sleep(self.delay)
        return await super().advertise_state(run, run_key, layout, step=step, size=size, sha=sha)


def test_a_periodic_publish_does_not_wait_for_the_advert_and_it_still_lands(tmp_path) -> None:
    sync = SlowAdverts(delay=1.5)
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0), statesync=sync,
                          background=True)
    try:
        m = model(0)
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="p", socket=daemon.path, sync_state=False,
                        state_every=0)
        t = time.monotonic()
        reply = opt.publish_state(wait=False)
        assert time.monotonic() - t < 1.0 and reply["advertised"] is None
        deadline = time.monotonic() + 10
        while not sync.blobs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [step for step, _ in sync.blobs[opt.run_key].values()] == [0]
        t = time.monotonic()
        reply = opt.publish_state()  # a founder's publish waits: it must know whether the swarm saw it
        assert time.monotonic() - t >= 1.4 and reply["advertised"] is True
        opt.close()
    finally:
        daemon.stop()


def test_wait_must_be_a_bool_hostile(tmp_path) -> None:
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0),
                          statesync=SlowAdverts(delay=0.0), background=True)
    try:
        opt = Optimizer(torch.optim.SGD(model(0).parameters(), lr=0.1), run="p", socket=daemon.path,
                        sync_state=False, state_every=0)
        fd = write_blob(b"x" * 10, name="t")
        with pytest.raises(DaemonError, match="wait must be true or false"):
            opt._call("state_publish", fds=[fd], step=1, size=10, wait="no")
        opt.close()
    finally:
        daemon.stop()


def test_a_periodic_publish_is_answered_before_the_daemon_reads_it_one_at_a_time(tmp_path) -> None:
    """The daemon answers a periodic publish once it holds the memfd (``sha`` null) and reads, hashes and keeps it
    beside the training; a session's next publish waits for the last one to be kept (one snapshot in memory)."""
    sync = SlowAdverts(delay=0.0)
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2), statesync=sync,
                          background=True)
    try:
        opt = Optimizer(torch.optim.SGD(model(0).parameters(), lr=0.1), run="p", socket=daemon.path,
                        sync_state=False, state_every=0)
        for step, size in ((1, 5_000_000), (2, 10)):
            fd = write_blob(bytes([step]) * size, name="t")
            reply = opt._call("state_publish", fds=[fd], step=step, size=size, wait=False)
            assert reply["advertised"] is None and reply["sha"] is None
        deadline = time.monotonic() + 10
        while len(sync.blobs.get(opt.run_key, {})) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(step for step, _ in sync.blobs[opt.run_key].values()) == [1, 2]
        opt.close()
    finally:
        daemon.stop()
