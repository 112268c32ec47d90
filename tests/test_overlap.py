"""DeAR overlap (peerd.torch.overlap): the bucket plan, the schedule against a replay, and overlap=True against
synchronous steps through an in-process daemon (real local socket, arena and TrainerService)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peerd.localsock.client import DaemonError, LocalClient  # noqa: E402
from peerd.torch import Optimizer  # noqa: E402
from peerd.torch.overlap import Schedule, plan_buckets, summarize  # noqa: E402

from .support.overlap import batch, mlp, run_pair  # noqa: E402
from .support.torch_models import flat  # noqa: E402
from .support.trainer_harness import InProcessAverager, ThreadDaemon, thread_daemon  # noqa: E402

torch.set_num_threads(1)




# -- the plan and the schedule (no torch, no daemon) ---------------------------------------------------------
def test_buckets_are_consecutive_ranges_from_the_last_parameter_back() -> None:
    numels = [64, 16, 128, 8, 16, 2]  # 3 linear layers: weight, bias each
    buckets = plan_buckets(numels, 20)
    assert [b.params for b in buckets] == [(3, 4, 5), (2,), (0, 1)]  # 2 + 16 < 20 <= 2 + 16 + 8
    # every element is in exactly one bucket, each bucket one contiguous range of the flat vector
    covered = sorted((b.offset, b.offset + b.length) for b in buckets)
    assert covered[0][0] == 0 and covered[-1][1] == sum(numels)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    assert [b.index for b in buckets] == [0, 1, 2]
    assert [(b.offset, b.length) for b in buckets] == [(208, 26), (80, 128), (0, 80)]
    assert len(plan_buckets([1] * 5000, 1)) == 1000  # capped at the daemon's MAX_BUCKETS
    assert len(plan_buckets(numels, 10**9)) == 1


def test_schedule_replay_submits_in_backward_order_and_layers_wait_only_for_their_buckets() -> None:
    numels = [64, 16, 128, 8, 16, 2]
    s = Schedule(numels, 20)
    s.arm(7, 8.0)
    out = []
    for i in reversed(range(6)):  # backward: last parameters first
        b = s.grad_ready(i)
        if b is not None:
            s.submitted(b, f"rid{b.index}")
            out.append(b.index)
    assert out == [0, 1, 2] and s.unsubmitted() == []
    s.close_step()
    with pytest.raises(RuntimeError):  # one armed step at a time
        s.arm(8, 1.0)
        s.arm(9, 1.0)
    s.current = None
    # the next forward: layer 0 (params 0, 1) needs bucket 2 only, layer 2 (4, 5) bucket 0 only
    assert s.waits_for([0, 1]) == [2] and s.waits_for([4, 5]) == [0]
    s.collected(2, {"outcome": "averaged"})
    assert s.due([0, 1]) == [0, 1] and s.due([4, 5]) == []
    s.applied([0, 1])
    assert s.finished() is None
    for b in (1, 0):
        s.collected(b, {"outcome": "averaged", "group_size": 3, "seconds": 0.1 * b})
    s.applied([2, 3, 4, 5])
    done = s.finished()
    assert done is not None and s.pending is None
    summary = summarize(done)
    assert summary["outcome"] == "averaged" and summary["buckets"] == 3 and summary["seconds"] == pytest.approx(0.1)
    kinds = [e[0] for e in s.events]
    assert kinds == ["submit"] * 3 + ["collect", "apply"] + ["collect"] * 2 + ["apply"]


def test_summary_reports_the_worst_bucket() -> None:
    s = Schedule([4, 4], 4)
    st = s.arm(1, 1.0)
    st.replies = {0: {"outcome": "averaged", "group_size": 3}, 1: {"outcome": "alone", "group_size": 1}}
    assert summarize(st)["outcome"] == "alone" and summarize(st)["group_size"] == 1
    st.replies[0] = {"outcome": "failed", "error": "x"}
    assert summarize(st)["outcome"] == "failed" and summarize(st)["error"] == "x"




@pytest.fixture
def bucket_runs_daemon(tmp_path):
    """A daemon whose averager has no average_parts: each bucket is its own Moshpit run."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=5.0), parts=False)
    yield d
    d.stop()




def test_overlap_gives_the_parameters_of_synchronous_steps(daemon) -> None:
    """Loss-free: the same seeds give the same parameters (float32 round-off), with several buckets, micro-batches
    and parameter averages every 2 steps."""
    daemon.averager.wait_s = 1.0  # (the synchronous pair waits out a few parameter rounds here)
    log: list = []
    sync = run_pair(daemon, overlap=False, steps=5, micro=2, run="s", average_every=2)
    over = run_pair(daemon, overlap=True, steps=5, micro=2, run="v", average_every=2, log=log)
    assert torch.equal(flat(over[0]), flat(over[1]))
    torch.testing.assert_close(flat(over[0]), flat(sync[0]), rtol=1e-5, atol=1e-6)
    assert not torch.equal(flat(over[0]), flat(mlp(0)))  # it trained
    # one round (one matchmaking) per step and trainer, its 3 buckets in it; both trainers cut the model alike
    rounds = daemon.averager.part_rounds
    assert len(rounds) == 2 * 5 and {n for _, n in rounds} == {3} and len({r for r, _ in rounds}) == 1, rounds
    assert sum("#" in r for r, _ in daemon.averager.calls) == 2 * 5 * 3
    assert not any(".b" in r for r, _ in daemon.averager.calls)
    assert log[0][2]["outcome"] == "pending"  # the first step's statistics come with the next step
    assert all(r["outcome"] == "averaged" and r["group_size"] == 2 and r["buckets"] == 3 for _, s, r in log if s >= 1)
    assert [r["params"]["outcome"] for i, s, r in log if i == 0 and "params" in r] == ["averaged", "averaged"]


def test_overlap_with_a_run_per_bucket_gives_the_parameters_of_synchronous_steps(bucket_runs_daemon) -> None:
    """An averager without average_parts: each bucket its own run, matchmaking started when the step is armed."""
    d = bucket_runs_daemon
    d.averager.wait_s = 1.0
    sync = run_pair(d, overlap=False, steps=3, micro=2, run="s")
    over = run_pair(d, overlap=True, steps=3, micro=2, run="v")
    assert torch.equal(flat(over[0]), flat(over[1]))
    torch.testing.assert_close(flat(over[0]), flat(sync[0]), rtol=1e-5, atol=1e-6)
    assert len({r for r, _ in d.averager.calls if ".b" in r}) == 3  # several buckets, each its own run
    # every bucket's request went out when its step was armed (deferred: matchmaking overlaps backward)
    assert d.averager.readies.count(True) == 2 * 3 * 3 and not d.averager.part_rounds


def test_overlap_hooks_apply_each_layers_update_before_its_forward_and_send_buckets_in_backward_order(tmp_path):
    with thread_daemon(tmp_path, group_size=1, wait_s=0.1) as d:
        m = mlp(1)
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="h", socket=d.path, sync_state=False,
                        state_every=0, average_params_every=0, overlap=True, model=m, bucket_mb=0.0001)
        sched = opt._overlap.schedule
        linears = [mod for mod in m if isinstance(mod, torch.nn.Linear)]
        index = {id(p): k for k, p in enumerate(opt.params)}
        seen: list[tuple] = []  # (step, layer, events so far) at each layer's forward, after the optimizer's hook
        step = [0]
        for j, mod in enumerate(linears):
            mod.register_forward_pre_hook(lambda _m, _a, j=j: seen.append((step[0], j, len(sched.events))))
        before = [mod.weight.detach().clone() for mod in linears]
        for s in range(3):
            step[0] = s
            opt.zero_grad()
            opt.last_microbatch(8)
            x, y = batch(s, 8)
            torch.nn.functional.cross_entropy(m(x), y, reduction="sum").backward()
            opt.step(samples=8)
        assert len(sched.buckets) == 3
        # every step sent its buckets last parameters first: bucket 0 (the last layer) first, all of them
        per_step: dict[int, list[int]] = {}
        for e in sched.events:
            if e[0] == "submit":
                per_step.setdefault(e[1], []).append(e[2])
        assert list(per_step.values()) == [[0, 1, 2]] * 3
        tickets = sorted(per_step)
        # in steps 1 and 2, each layer's update of the step before was applied before that layer's forward ran,
        # and the last layer's update only after the first layer's forward had begun (not all at once)
        for s, j, n in seen:
            if s == 0:
                continue
            w = index[id(linears[j].weight)]
            prev = [e for e in sched.events[:n] if e[0] == "apply" and e[1] == tickets[s - 1]]
            assert any(w in e[2] for e in prev), (s, j)
            if j == 0:
                last = index[id(linears[-1].weight)]
                assert not any(last in e[2] for e in prev), (s, "the last layer was updated before the first ran")
        # and the weights moved only through those applies: after flush, all three steps are in
        opt.flush()
        assert all(not torch.equal(b, mod.weight) for b, mod in zip(before, linears, strict=True))
        assert opt.outcomes == {"alone": 3} and opt.local_steps == 3
        opt.close()


def test_overlap_matches_sync_alone_including_the_last_step(tmp_path) -> None:
    """A lone trainer: overlap after flush() equals synchronous SGD steps exactly (own gradients back)."""
    with thread_daemon(tmp_path, group_size=1, wait_s=0.05) as d:
        out = []
        for overlap in (False, True):
            m = mlp(3)
            kw = {"overlap": True, "model": m, "bucket_mb": 0.0002} if overlap else {}
            opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), run=f"a{overlap}", socket=d.path,
                            sync_state=False, state_every=0, average_params_every=0, **kw)
            for s in range(4):
                opt.zero_grad()
                x, y = batch(s, 6)
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step(samples=6)  # not armed: every bucket goes out after backward (grads are means)
            opt.flush()
            out.append(flat(m))
            opt.close()
        torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-7)


def test_overlap_daemon_death_is_a_clear_error(tmp_path) -> None:
    path = str(tmp_path / "d.sock")
    d = ThreadDaemon(path, InProcessAverager(group_size=2, wait_s=30.0))
    m = mlp(0)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="t", socket=path, sync_state=False, state_every=0,
                    average_params_every=0, timeout_s=30, overlap=True, model=m, bucket_mb=0.0003)
    opt.zero_grad()
    opt.last_microbatch(4)
    x, y = batch(0, 4)
    torch.nn.functional.cross_entropy(m(x), y, reduction="sum").backward()
    opt.step(samples=4)  # the buckets wait for a second member
    start = time.monotonic()
    threading.Timer(0.5, d.stop).start()
    with pytest.raises(DaemonError, match="bucket .* failed: .*closed the connection"):
        m(x)  # the first layer's forward waits for its bucket: the daemon dies meanwhile
    assert time.monotonic() - start < 15
    assert opt._overlap.schedule.pending is None  # nothing left in flight to wait for
    opt.close()


def test_non_finite_own_gradients_skip_the_overlapped_step(daemon) -> None:
    daemon.averager.group_size = 1
    daemon.averager.wait_s = 0.05
    m = mlp(0)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="n", socket=daemon.path, sync_state=False,
                    state_every=0, average_params_every=0, overlap=True, model=m, bucket_mb=0.0003)
    before = flat(m).clone()
    opt.zero_grad()
    opt.last_microbatch(4)
    x, y = batch(0, 4)
    (torch.nn.functional.cross_entropy(m(x), y) * float("nan")).backward()
    opt.step(samples=4)
    opt.flush()
    assert torch.equal(flat(m), before) and opt.outcomes == {"nonfinite": 1}
    opt.close()


def test_concurrent_requests_on_one_connection_answer_by_id(daemon) -> None:
    """Two submitted requests and a plain call in between: each reply finds its caller, whatever the order."""
    c = LocalClient(daemon.path, timeout=10)
    try:
        a = c.submit("trainer_step", session=99, step=1)  # no such session: an error reply with id a
        b = c.submit("trainer_close", session=98)
        with pytest.raises(DaemonError, match="no such session"):
            c.call("trainer_report", session=97)
        with pytest.raises(DaemonError, match="no such session"):
            c.collect(b)
        with pytest.raises(DaemonError, match="no such session"):
            c.collect(a)
        with pytest.raises(ValueError):
            c.collect(a)  # collected already
    finally:
        c.close()


def test_bucket_requests_are_bounded(daemon) -> None:
    m = mlp(0)
    opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="b", socket=daemon.path, sync_state=False,
                    state_every=0)
    c = opt._client
    elems = opt.elems
    opt.arena.write_request(5, 1.0)
    for bad, match in [({"bucket": -1}, "bucket"), ({"bucket": 1000}, "bucket"), ({"offset": elems}, "range"),
                       ({"length": 0}, "range"), ({"offset": -1}, "range"), ({"timeout_s": 0}, "timeout_s"),
                       ({"step": 4}, "slot")]:
        args = {"step": 5, "bucket": 0, "offset": 0, "length": 4, "timeout_s": 5, **bad}
        with pytest.raises(DaemonError, match=match):
            c.call("trainer_bucket", session=opt.session, **args)
    opt.arena.vector(5)[:] = np.nan
    with pytest.raises(DaemonError, match="NaN"):
        c.call("trainer_bucket", session=opt.session, step=5, bucket=0, offset=0, length=4)
    opt.close()


def test_dropcompute_decides_the_last_micro_batch_before_its_forward() -> None:
    from peerd.torch import DropCompute

    now = [0.0]
    dc = DropCompute(0.25, workers=2, clock=lambda: now[0])
    dc.start_step()
    decided = []
    for k in range(8):
        if not dc.keep_going():
            break
        decided.append(dc.decide_last(k, 8))
        with dc.microbatch(4):
            now[0] += 0.1
    # after 2 micro-batches (0.2 s) the third would end at 0.3 s > tau: it is the last, decided before it ran
    assert decided == [False, False, True] and dc.samples == 12 and dc.dropped == 1
    dc.end_step()
    dc2 = DropCompute(None, workers=2, clock=lambda: now[0])
    dc2.start_step()
    assert [dc2.decide_last(k, 3) for k in range(3)] == [False, False, True]  # no threshold: the last of total


def test_deferred_buckets_wait_for_their_gradients_without_an_averager_that_takes_ready(tmp_path) -> None:
    """An averager without ready=: the daemon waits for trainer_bucket_ready, then averages (same parameters)."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=2, wait_s=5.0), ready=False,
                     parts=False)
    try:
        over = run_pair(d, overlap=True, steps=3, run="f")
        assert torch.equal(flat(over[0]), flat(over[1])) and not torch.equal(flat(over[0]), flat(mlp(0)))
        assert d.averager.readies and not any(d.averager.readies)
    finally:
        d.stop()


@pytest.mark.parametrize("ready,parts", [(True, True), (True, False), (False, False)])
def test_a_bucket_ready_that_runs_before_its_bucket_request_is_kept(tmp_path, ready, parts) -> None:
    """Requests with ids run concurrently, in no set order: a trainer_bucket_ready that runs before its
    trainer_bucket must not be lost (the bucket's average would wait for it until its deadline)."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2), ready=ready, parts=parts)
    try:
        m = mlp(0)
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="e", socket=d.path, sync_state=False,
                        state_every=0)
        c, n = opt._client, opt.elems
        args = {"session": opt.session, "offset": 0, "length": n, "timeout_s": 20, "deferred": True,
                "buckets": 1, "plan": "0" * 16}
        for step, skip in [(1, False), (2, True)]:
            opt.arena.write_request(step, 1.0)
            opt.arena.vector(step)[:] = 0.5
            assert not c.call("trainer_bucket_ready", session=opt.session, step=step, bucket=0, skip=skip)["waiting"]
            t0 = time.monotonic()
            if skip:  # the bucket drops out (a failed round's reply, or an error where no averager took ready=)
                try:
                    text = c.call("trainer_bucket", step=step, bucket=0, **args)["error"]
                except DaemonError as e:
                    text = str(e)
                assert "skipped" in text
            else:
                reply = c.call("trainer_bucket", step=step, bucket=0, **args)
                assert reply["outcome"] == "alone" and not reply.get("error")
            assert time.monotonic() - t0 < 5.0  # not the bucket's 20 s deadline
        # a ready far ahead of the latest step is not kept; malformed ones are refused
        c.call("trainer_bucket_ready", session=opt.session, step=9, bucket=0)
        assert not d.service.sessions[opt.session].early_ready
        for bad in [{"step": "1"}, {"bucket": 1000}, {"skip": 1}]:
            with pytest.raises(DaemonError, match="trainer_bucket_ready needs"):
                c.call("trainer_bucket_ready", **{"session": opt.session, "step": 3, "bucket": 0, **bad})
        opt.close()
    finally:
        d.stop()


class _SlowOpening(InProcessAverager):
    """As Moshpit: a run's first rounds look its grid up (the first caller's lookup slower than the second's),
    then every round of the run takes the run's lock in turn."""

    def __init__(self) -> None:
        super().__init__(group_size=1, wait_s=0.2)
        self.lookups = [0.4, 0.05]
        self.opened: set[str] = set()
        self.locks: dict = {}
        self.order: list[str] = []

    async def average_parts(self, run_id: str, parts: list, weight: float, **options) -> list:
        import trio

        if run_id not in self.opened:
            await trio.sleep(self.lookups.pop(0) if self.lookups else 0.0)
            self.opened.add(run_id)
        async with self.locks.setdefault(run_id, trio.Lock()):
            self.order.append(run_id)
            return await super().average_parts(run_id, parts, weight, **options)


def test_a_steps_round_starts_after_the_previous_steps_round(tmp_path) -> None:
    """Step 2's request comes while step 1's round is still opening its run: step 2's round must not take the
    run first (its group would wait for gradients the trainer sends only once step 1's average is back)."""
    d = ThreadDaemon(str(tmp_path / "d.sock"), _SlowOpening())
    try:
        m = mlp(0)
        opt = Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), run="o", socket=d.path, sync_state=False,
                        state_every=0)
        c, n = opt._client, opt.elems
        args = {"session": opt.session, "bucket": 0, "offset": 0, "length": n, "timeout_s": 20,
                "deferred": True, "buckets": 1, "plan": "0" * 16}
        t0 = time.monotonic()
        for step in (1, 2):
            opt.arena.write_request(step, 1.0)
        first = c.submit("trainer_bucket", step=1, **args)
        c.call("trainer_bucket_ready", session=opt.session, step=1, bucket=0)
        second = c.submit("trainer_bucket", step=2, **args)  # its gradients come after step 1's average
        assert c.collect(first, timeout=60)["outcome"] == "alone"
        assert time.monotonic() - t0 < 5.0  # not the round's 20 s deadline
        c.call("trainer_bucket_ready", session=opt.session, step=2, bucket=0)
        assert c.collect(second, timeout=60)["outcome"] == "alone"
        assert len(d.averager.order) == 2
        opt.close()
    finally:
        d.stop()


def test_an_overlap_joiner_counts_its_steps_as_the_swarm_does(daemon) -> None:
    """As in sync mode: a joiner's first averaged round moves its step count to its donor's, though overlap's
    reply of that round comes a step later; the snapshot names the round of its own last step."""
    daemon.averager.wait_s = 0.1
    a, b = mlp(0), mlp(7)
    kw = {"run": "j", "socket": daemon.path, "sync_state": False, "state_every": 0, "average_params_every": 0,
          "overlap": True, "bucket_mb": 25.0}
    oa = Optimizer(torch.optim.SGD(a.parameters(), lr=0.1), model=a, **kw)

    def step(m, o, seed: int) -> dict:
        x, y = batch(seed, 8)
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        return o.step(samples=8)

    for s in range(3):
        step(a, oa, s)
    blob = oa.snapshot()  # step 3, whose last step averaged (alone) in round 2
    for s in range(3, 7):  # the swarm goes on while the joiner downloads (rounds 3-6)
        step(a, oa, s)
    oa.flush()  # (round 6 over before the joiner's first step)
    ob = Optimizer(torch.optim.SGD(b.parameters(), lr=0.1), model=b, **kw)
    assert ob.load_snapshot(blob) == 3 and ob._joined == (3, 2)
    daemon.averager.wait_s = 5.0
    replies: dict = {}

    def two(i: int, m, o) -> None:
        replies[i] = [step(m, o, 50 + 10 * i + k) for k in range(2)]

    threads = [threading.Thread(target=two, args=(i, m, o)) for i, (m, o) in enumerate(((a, oa), (b, ob)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r[1]["outcome"] for r in replies.values()] == ["averaged", "averaged"], replies
    assert oa.step_count == ob.step_count == 9 and ob.caught_up == 4 and oa.caught_up == 0
    for o in (oa, ob):
        o.close()
