"""peerd.torch.Optimizer against an in-process daemon (real local socket, arena and TrainerService; an
exact in-process averager instead of Moshpit)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peerd.localsock.client import DaemonError  # noqa: E402
from peerd.torch import NoGroupError, Optimizer  # noqa: E402
from peerd.torch.optimizer import DEFAULT_KEEP_ROUNDS, MAX_SAMPLES_FACTOR  # noqa: E402

from .support.torch_models import flat, model  # noqa: E402
from .support.trainer_harness import InProcessAverager, ThreadDaemon, error_when_the_daemon_dies  # noqa: E402

torch.set_num_threads(1)






def train_step(m, opt, seed, samples=8, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(samples, 4, generator=g), torch.randint(0, 2, (samples,), generator=g)
    x, y = x.to(device), y.to(device)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    return opt.step(samples=samples, loss=loss.item())


def replay_weighted_sgd(ref: torch.nn.Module, steps: int) -> None:
    """What two replicas training on seeds 100 i + s with 8 (i + 1) samples should reach: SGD (lr 0.1) on
    the sample-weighted mean of their gradients, computed centrally."""
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        grads = []
        for i in range(2):
            g = torch.Generator().manual_seed(100 * i + s)
            n = 8 * (i + 1)
            x, y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
            ref.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), grads[0], grads[1], strict=True):
            p.grad = (g0 * 8 + g1 * 16) / 24
        ref_opt.step()




def test_two_replicas_stay_identical_and_follow_the_weighted_mean(daemon) -> None:
    models = [model(0), model(0)]
    opts = [Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False,
                      average_params_every=2, state_every=0) for m in models]
    # what the average should be: the sample-weighted mean of both replicas' gradients, then SGD
    ref = model(0)
    replies: list[list[dict]] = [[], []]

    def worker(i: int) -> None:
        for s in range(4):
            replies[i].append(train_step(models[i], opts[i], seed=100 * i + s, samples=8 * (i + 1)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    replay_weighted_sgd(ref, 4)
    assert torch.equal(flat(models[0]), flat(models[1]))
    torch.testing.assert_close(flat(models[0]), flat(ref), rtol=1e-5, atol=1e-6)
    assert all(r["outcome"] == "averaged" and r["group_size"] == 2 for rs in replies for r in rs)
    assert "params" in replies[0][1] and replies[0][1]["params"]["outcome"] == "averaged"  # K = 2
    # the replicas are identical: each parameter average's check round says so, and the average is skipped
    assert all(r["params"]["identical"] for rs in replies for r in rs[1::2])
    assert opts[0].step_count == 4 and opts[0].outcomes == {"averaged": 4}
    kinds = [run_id.rsplit(".", 1)[1] for run_id, _ in daemon.averager.calls]
    assert kinds.count("g") == 8 and kinds.count("c") == 4 and kinds.count("p") == 0
    # parameter averages (and their checks) are numbered by the step (step // K), gradient rounds by the daemon
    numbers = [(k, r) for k, r in zip(kinds, daemon.averager.round_numbers, strict=True)]
    assert sorted(r for k, r in numbers if k == "c") == [1, 1, 2, 2]
    assert all(r is None for k, r in numbers if k == "g")
    for o in opts:
        o.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the pinned-staging path)")
def test_cuda_replicas_average_through_pinned_staging(daemon) -> None:
    """CUDA parameters: gradients go device -> pinned host buffer -> arena and back; the result is the
    same weighted-mean SGD as on the CPU (to float tolerance: CUDA kernels round differently)."""
    models = [model(0).cuda(), model(0).cuda()]
    opts = [Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="cuda", socket=daemon.path,
                      sync_state=False, average_params_every=0, state_every=0) for m in models]
    assert all(o._staging is not None and o._staging.is_pinned() for o in opts)

    def worker(i: int) -> None:
        for s in range(3):
            train_step(models[i], opts[i], seed=100 * i + s, samples=8 * (i + 1), device="cuda")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ref = model(0)
    replay_weighted_sgd(ref, 3)
    assert torch.equal(flat(models[0]), flat(models[1]))
    torch.testing.assert_close(flat(models[0]).cpu(), flat(ref), rtol=1e-4, atol=1e-5)
    assert opts[0].outcomes == {"averaged": 3}
    for o in opts:
        o.close()


def test_keep_rounds_reaches_every_round_of_the_session(daemon) -> None:
    daemon.averager.wait_s = 0.1
    m = model(2)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="k", socket=daemon.path, sync_state=False,
                    state_every=0, average_params_every=1, keep_rounds=8)
    train_step(m, opt, 0)
    assert daemon.averager.keep_rounds == [8, 8, 8]  # gradients, the parameter check and parameters
    opt.close()
    plain = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="k", socket=daemon.path, sync_state=False,
                      state_every=0, average_params_every=0, keep_rounds=None)
    train_step(m, plain, 1)
    assert daemon.averager.keep_rounds[-1] is None  # None: the daemon's default
    plain.close()
    default = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="k", socket=daemon.path, sync_state=False,
                        state_every=0, average_params_every=0)
    train_step(m, default, 2)
    assert daemon.averager.keep_rounds[-1] == DEFAULT_KEEP_ROUNDS == 100  # kept groups by default
    default.close()
    for bad in (0, 1001, 2.0):
        with pytest.raises(ValueError, match="keep_rounds"):
            Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="k", socket=daemon.path, sync_state=False,
                      keep_rounds=bad)


def test_no_group_policies(daemon) -> None:
    daemon.averager.wait_s = 0.1  # nobody else: every round is "alone"
    m = model(1)
    before = flat(m).clone()
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False,
                    no_group="skip", state_every=0)
    r = train_step(m, opt, 0)
    assert r["outcome"] == "alone" and torch.equal(flat(m), before) and opt.step_count == 0
    opt.no_group = "local"
    train_step(m, opt, 0)
    assert opt.step_count == 1 and opt.local_steps == 1 and not torch.equal(flat(m), before)
    opt.no_group = "raise"
    with pytest.raises(NoGroupError, match="alone"):
        train_step(m, opt, 0)
    opt.close()


def test_snapshot_carries_params_optimizer_state_and_step(daemon) -> None:
    daemon.averager.wait_s = 0.1
    a, b = model(0), model(7)
    oa = Optimizer(torch.optim.Adam(a.parameters(), lr=0.01), run="t", socket=daemon.path, sync_state=False,
                   state_every=0)
    for s in range(3):
        train_step(a, oa, s)
    blob = oa.snapshot()
    ob = Optimizer(torch.optim.Adam(b.parameters(), lr=0.01), run="t", socket=daemon.path, sync_state=False,
                   state_every=0)
    assert ob.load_snapshot(blob) == 3 and ob.step_count == 3
    assert torch.equal(flat(a), flat(b))
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    # after taking over, both replicas make the same step from the same gradients
    train_step(a, oa, 9)
    train_step(b, ob, 9)
    torch.testing.assert_close(flat(a), flat(b))
    # another optimizer class or model is refused
    c = model(0)
    oc = Optimizer(torch.optim.SGD(c.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False)
    with pytest.raises(ValueError, match="optimizer"):
        oc.load_snapshot(blob)
    for o in (oa, ob, oc):
        o.close()


def test_a_different_model_is_refused(daemon) -> None:
    a = model(0, hidden=8)
    oa = Optimizer(torch.optim.SGD(a.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False)
    with pytest.raises(DaemonError, match="different model"):
        Optimizer(torch.optim.SGD(model(0, hidden=9).parameters(), lr=0.1), run="t", socket=daemon.path)
    oa.close()


def test_daemon_death_mid_round_is_a_clear_error_and_the_next_step_reconnects(tmp_path) -> None:
    path = str(tmp_path / "d.sock")
    d = ThreadDaemon(path, InProcessAverager(group_size=2, wait_s=30.0))
    m = model(0)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=path, sync_state=False,
                    state_every=0, timeout_s=30)
    # the daemon dies while the round waits for a second member
    assert "closed the connection" in error_when_the_daemon_dies(lambda: train_step(m, opt, 0), d, within=15)
    with pytest.raises(DaemonError, match="no peerd daemon"):
        train_step(m, opt, 1)  # no daemon yet: a clear error, not a hang
    d2 = ThreadDaemon(path, InProcessAverager(group_size=1))
    try:
        r = train_step(m, opt, 2)  # reconnects: a new session on the new daemon
        assert r["outcome"] == "alone" and opt.step_count == 1 and opt.local_steps == 1
    finally:
        opt.close()
        d2.stop()


def test_a_non_finite_average_never_reaches_the_model(tmp_path) -> None:
    """What a daemon that let a Byzantine member's NaN through would hand back: NaN in the result slot."""
    d = ThreadDaemon(str(tmp_path / "nan.sock"), InProcessAverager(group_size=1, wait_s=0.1))
    handler, _ = d.server._ops["trainer_step"]

    async def poisoned(request, conn):
        reply = await handler(request, conn)
        session = d.service.sessions[request["session"]]
        session.arena.write_result(request["step"], np.full(session.elems, np.nan, np.float32))
        return {**reply, "outcome": "averaged"}

    d.server.register("trainer_step", poisoned, connection=True)
    try:
        m = model(3)
        before = flat(m).clone()
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=d.path, sync_state=False,
                        state_every=0, average_params_every=2)
        for s in range(4):
            r = train_step(m, opt, s)
            assert r["outcome"] == "nonfinite"
            assert torch.isfinite(flat(m)).all()
        assert opt.step_count == 4 and opt.local_steps == 4  # own gradients instead ("local")
        assert opt.nonfinite_rounds == 4 + 2  # and two parameter averages dropped
        assert not torch.equal(flat(m), before)
        assert opt.average_parameters()["outcome"] == "nonfinite" and torch.isfinite(flat(m)).all()
        opt.close()
    finally:
        d.stop()


def test_robust_and_max_samples_travel_in_trainer_open(daemon) -> None:
    seen: list[dict] = []
    handler, wants_conn = daemon.server._ops["trainer_open"]

    async def recording(request, conn):
        seen.append(dict(request))
        return await handler(request, conn)

    daemon.server.register("trainer_open", recording, connection=True)
    m = model(0)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False,
                    robust="clip:3", max_samples=64)
    opt.close()
    plain = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False)
    plain.close()
    assert seen[0]["robust"] == "clip:3" and seen[0]["max_samples"] == 64.0
    assert "robust" not in seen[1] and "max_samples" not in seen[1]  # unset: the daemon's defaults
    for bad in ({"robust": "median"}, {"robust": "clip:-1"}, {"max_samples": 0}, {"max_samples": float("nan")}):
        with pytest.raises(ValueError):
            Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False, **bad)


def test_max_samples_defaults_to_a_few_of_the_first_steps_samples(daemon) -> None:
    """Without max_samples a member claiming 2**24 samples counted for 2**24 here: the default is now
    MAX_SAMPLES_FACTOR times this trainer's first step's samples, declared before that step averages."""
    daemon.averager.wait_s = 0.1
    m = model(3)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="d", socket=daemon.path, sync_state=False,
                    state_every=0, average_params_every=0)
    assert opt.max_samples is None
    train_step(m, opt, 0, samples=8)
    assert opt.max_samples == MAX_SAMPLES_FACTOR * 8
    assert daemon.averager.options[-1]["max_weight"] == MAX_SAMPLES_FACTOR * 8
    train_step(m, opt, 1, samples=3)  # a later, smaller step keeps it
    assert daemon.averager.options[-1]["max_weight"] == MAX_SAMPLES_FACTOR * 8
    opt.close()


def test_non_finite_own_gradients_skip_the_step_without_asking_the_daemon(daemon) -> None:
    m = model(4)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=daemon.path, sync_state=False,
                    state_every=0)
    before = flat(m).clone()
    calls = len(daemon.averager.calls)
    opt.zero_grad()
    for p in m.parameters():
        p.grad = torch.full_like(p, float("inf"))
    r = opt.step(samples=8)
    assert r["outcome"] == "nonfinite" and opt.step_count == 0 and opt.nonfinite_rounds == 1
    assert torch.equal(flat(m), before) and len(daemon.averager.calls) == calls  # nothing sent
    opt.no_group = "raise"
    with pytest.raises(NoGroupError, match="not finite"):
        opt.step(samples=8)
    opt.close()


def test_all_finite_takes_the_sum_and_checks_elements_when_it_overflows() -> None:
    """A finite sum proves every element finite; a sum that overflows on finite values is still all finite, and any
    NaN or infinity (even +inf and -inf that cancel into NaN) is found."""
    from peerd.torch.snapcheck import all_finite

    big = torch.full((1000,), 3e38)  # finite values whose float32 sum overflows
    assert all_finite(torch.randn(1000)) and all_finite(big) and all_finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(1000)
        t[517] = bad
        assert not all_finite(t) and not all_finite(t.to(torch.float16))
    pair = torch.zeros(10)
    pair[2], pair[7] = float("inf"), float("-inf")
    assert not all_finite(pair)


def test_all_finite_each_checks_a_model_s_gradients_with_one_sum() -> None:
    """Every gradient of a model at once: None and empty entries skipped, finite values whose sums overflow still
    finite, a NaN or infinity in any one tensor (of one dtype or of several) found."""
    from peerd.torch.snapcheck import all_finite_each

    grads = [torch.randn(64, 32), None, torch.randn(32), torch.empty(0), torch.full((100,), 3e38)]
    assert all_finite_each(grads) and all_finite_each([]) and all_finite_each([None])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in (0, 2, 4):
            ts = [g.clone() if g is not None else None for g in grads]
            ts[i].view(-1)[3] = bad
            assert not all_finite_each(ts)
            mixed = [t.to(torch.float16) if j == 2 and t is not None else t for j, t in enumerate(ts)]
            assert not all_finite_each(mixed)
    assert all_finite_each([torch.randn(8).to(torch.float16), torch.randn(8), torch.randn(8, dtype=torch.float64)])


def test_a_joiner_counts_its_steps_as_the_swarm_does_after_its_first_round(daemon) -> None:
    """A snapshot says which round its step was; the swarm takes more rounds while the joiner downloads, so the
    joiner's first averaged round moves its step count to the donor's, and both end training together."""
    daemon.averager.wait_s = 0.1
    a, b = model(0), model(7)
    oa = Optimizer(torch.optim.SGD(a.parameters(), lr=0.1), run="j", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    for s in range(3):
        assert train_step(a, oa, s)["outcome"] == "alone"
    blob = oa.snapshot()  # step 3, taken in round 2
    for s in range(3, 7):  # the swarm goes on while the joiner downloads
        train_step(a, oa, s)
    ob = Optimizer(torch.optim.SGD(b.parameters(), lr=0.1), run="j", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    assert ob.load_snapshot(blob) == 3
    daemon.averager.wait_s = 5.0
    replies = {}
    threads = [threading.Thread(target=lambda o=o, m=m, i=i: replies.__setitem__(i, train_step(m, o, 50 + i)))
               for i, (m, o) in enumerate(((a, oa), (b, ob)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert replies[0]["outcome"] == replies[1]["outcome"] == "averaged", replies
    assert oa.step_count == ob.step_count == 8 and ob.caught_up == 4 and oa.caught_up == 0
    for o in (oa, ob):
        o.close()


def test_a_forged_round_moves_a_joiner_no_further_than_its_bound_hostile(daemon) -> None:
    """A snapshot's round and a group's round number are members' claims: a snapshot round that is not a round is
    ignored, and a group round that would move the joiner's count past MAX_CATCH_UP steps is not followed."""
    import io

    from peerd.torch.optimizer import MAX_CATCH_UP

    daemon.averager.wait_s = 0.1
    a, b = model(0), model(7)
    oa = Optimizer(torch.optim.SGD(a.parameters(), lr=0.1), run="f", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    train_step(a, oa, 0)
    state = torch.load(io.BytesIO(oa.snapshot()), weights_only=True)
    ob = Optimizer(torch.optim.SGD(b.parameters(), lr=0.1), run="f", socket=daemon.path, sync_state=False,
                   state_every=0, average_params_every=0)
    for forged in (-5, "x", 2**40, 0):
        buf = io.BytesIO()
        torch.save({**state, "round": forged}, buf)
        ob.load_snapshot(buf.getvalue())
        assert ob._joined == (None if forged != 0 else (1, 0)), forged
    for run_id in daemon.averager.numbers:  # the next group claims a round far ahead
        daemon.averager.numbers[run_id] = MAX_CATCH_UP + 10
    daemon.averager.wait_s = 5.0
    threads = [threading.Thread(target=train_step, args=(m, o, i)) for i, (m, o) in enumerate(((a, oa), (b, ob)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert ob.step_count == 2 and ob.caught_up == 0 and ob._joined is None
    for o in (oa, ob):
        o.close()
