"""The trainer's waits for an overlapped step's buckets and for a DiLoCo outer average tune themselves as a sync
step's does (peerd/deadlines.py): after a few rounds each waits k times its recent rounds (at least its floor)
instead of the trainer's timeout_s, and `peerd status --json`'s deadlines show it."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from peerd.deadlines import MIN_SAMPLES, OUTER_FLOOR_S, STEP_FLOOR_S, DeadlineTuner  # noqa: E402
from peerd.status.deadlines import deadlines_json  # noqa: E402
from peerd.torch import DiLoCo  # noqa: E402

from .support.diloco import batch, model  # noqa: E402
from .support.overlap import run_pair  # noqa: E402
from .support.trainer_harness import InProcessAverager, ThreadDaemon  # noqa: E402

torch.set_num_threads(1)


def test_bucket_waits_tune_themselves_from_recent_bucket_rounds(tmp_path) -> None:
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=5.0))
    d.service.deadlines = tuner = DeadlineTuner()
    try:
        run_pair(d, overlap=True, steps=MIN_SAMPLES + 2, run="v")
    finally:
        d.stop()
    wait = tuner.statistics().bucket_wait
    assert wait.samples >= MIN_SAMPLES and wait.measurement == "bucket_round_p90_s", wait
    assert wait.basis == "floor" and wait.seconds == STEP_FLOOR_S and wait.cap_s == 30.0, wait  # quick rounds
    timeouts = d.averager.timeouts
    assert timeouts[0] == 30.0 and timeouts[-1] == STEP_FLOOR_S, timeouts  # the trainer's, then the tuned
    assert deadlines_json(tuner.statistics())["bucket_wait"]["seconds"] == STEP_FLOOR_S


def test_outer_waits_tune_themselves_from_recent_outer_averages(tmp_path) -> None:
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=5.0))
    d.service.deadlines = d.service.outer.deadlines = tuner = DeadlineTuner()
    errors: list[BaseException] = []

    def trainer(i: int) -> None:
        try:
            m = model(0)
            opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=d.path, sync_every=1,
                         sync_state=False, state_every=0, timeout_s=60.0)
            for s in range(MIN_SAMPLES + 2):
                x, y = batch(i, s)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step(samples=len(x))
            opt.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        d.stop()
    assert not errors, errors
    wait = tuner.statistics().outer_wait
    assert wait.samples >= MIN_SAMPLES and wait.measurement == "outer_rounds_p90_s", wait
    assert wait.basis == "floor" and wait.seconds == OUTER_FLOOR_S and wait.cap_s == 60.0, wait
    timeouts = d.averager.timeouts
    assert timeouts[0] == 60.0 and timeouts[-1] == OUTER_FLOOR_S, timeouts
