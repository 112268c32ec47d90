"""A trainer's ``robust``: by default its gradient averages and DiLoCo outer steps run the weight bound and the
direction test (clip only past MAX_C times the median); "clip:C" clips at C; "off" runs none of it, so the owner
streams the contributions as they come (a swarm whose members the owner trusts). Parameter averages clip around
the owner's own parameters whatever the trainer asked."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from peerd.allreduce.robust import MAX_C, Robust
from peerd.metrics import Metrics
from peerd.trainer import TrainerService
from peerd.trainer.session import Session

from .support.sessions import ELEMS, Trainer


def _grad_options(**open_options: object) -> dict:
    calls: list[dict] = []

    async def average(run_id, vector, weight, **kw):  # noqa: ANN001, ANN202 - a recorder
        calls.append(kw)
        raise RuntimeError("no swarm")

    async def main() -> None:
        t = Trainer(TrainerService(Metrics(), average))
        await t.open(**open_options)
        reply, out = await t.step(np.ones(ELEMS, np.float32), 1.0)
        assert reply["outcome"] == "failed" and np.array_equal(out, np.ones(ELEMS, np.float32))
        t.close()

    trio.run(main)
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize(("asked", "runs"), [(None, Robust("clip", MAX_C)), ("clip:2", Robust("clip", 2.0)),
                                             ("centered", Robust("centered", 1.0)), ("off", None)])
def test_a_gradient_average_runs_what_the_trainer_asked(asked, runs):
    got = _grad_options(**({} if asked is None else {"robust": asked}))
    assert got.get("robust") == runs, got
    assert ("robust" in got) == (runs is not None)


def test_off_keeps_parameter_averages_clipped_around_the_own_parameters():
    session = Session(1, "r", "r/x", "x", ELEMS, None, None, robust=None, robust_off=True)  # type: ignore[arg-type]
    vector = np.ones(ELEMS, np.float32)
    params = TrainerService._options(session, "params", vector, 3)
    assert params["robust"].mode == "centered" and params["center"] is vector
    assert "robust" not in TrainerService._options(session, "grad", vector, None)


def test_diloco_outer_steps_with_robust_off_run_no_weight_bound(tmp_path):
    torch = pytest.importorskip("torch")
    from peerd.torch import DiLoCo

    from .support.trainer_harness import thread_daemon

    with thread_daemon(tmp_path, group_size=1, wait_s=0.1) as daemon:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="off", socket=daemon.path, sync_every=2,
                     sync_state=False, state_every=0, robust="off")
        for _ in range(4):
            opt.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
            opt.step(samples=3)
        outer = daemon.averager.outer_options()
        assert len(outer) == 2 and all("robust" not in o for o in outer), outer
        assert all(o.get("max_weight") == opt.max_samples for o in outer), outer  # the trainer's own cap stays
        opt.close()
