"""peerd.torch.DiLoCo and the outer-step agreement (peerd.trainer.outer).

- the outer rule and the fragment schedule, against a pure-torch replay (no daemon);
- three DiLoCo trainers on an in-process daemon (real socket, arena, TrainerService) against a replay of
  DiLoCo computed centrally, with and without streaming fragments;
- the agreement over a real DHT and state sync on an in-memory lossy network (virtual time): members whose
  all-gather lost ranges repair them from the owners, a member that missed the group adopts the group's
  average, and a disagreement that cannot be repaired is an error;
- a joiner taking global parameters and outer momentum from a member's snapshot.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

torch = pytest.importorskip("torch")

from peerd.moshpit.records import MAX_ROUND  # noqa: E402
from peerd.torch import DiLoCo  # noqa: E402
from peerd.torch.diloco import due_fragments, fragment_bounds, nesterov_outer  # noqa: E402
from peerd.trainer import outer_step  # noqa: E402
from peerd.trainer.outer import DhtBoard, OuterError, agree  # noqa: E402
from peerd.trainer.outer_step import OUTER_ROUNDS, outer_wait_s, waits_for_participants  # noqa: E402
from peerd.trainer.records import OuterRecord, winner  # noqa: E402

from .support.diloco import _lossy_copies, _swarm, batch, replay  # noqa: E402
from .support.memnet import run_on_memnet  # noqa: E402
from .support.torch_models import flat, model  # noqa: E402
from .support.trainer_harness import (  # noqa: E402
    WINDOW_END,
    InProcessAverager,
    ThreadDaemon,
    in_threads,
    thread_daemon,
)

torch.set_num_threads(1)








# -- the rule and the schedule ---------------------------------------------------------------------------
def test_nesterov_outer_is_torch_sgd_with_nesterov() -> None:
    torch.manual_seed(3)
    p = torch.randn(50)
    mine, mom = p.clone(), torch.zeros(50)
    ref = torch.nn.Parameter(p.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        d = torch.randn(50)
        nesterov_outer(mine, mom, d, 0.7, 0.9)
        ref.grad = d.clone()
        sgd.step()
        torch.testing.assert_close(mine, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mom, sgd.state[ref]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_fragments_cut_whole_tensors_and_stagger_their_steps() -> None:
    assert fragment_bounds([10, 10, 10, 10], 1) == [(0, 40)]
    assert fragment_bounds([10, 10, 10, 10], 2) == [(0, 20), (20, 40)]
    assert fragment_bounds([100, 1, 1, 1], 4) == [(0, 100), (100, 101), (101, 102), (102, 103)]
    assert fragment_bounds([1, 1, 1, 100], 2) == [(0, 3), (3, 103)]
    with pytest.raises(ValueError):
        fragment_bounds([1, 2], 3)
    # fragment f at steps where step % H == f * H // F
    got = {s: due_fragments(s, 8, 4) for s in range(1, 17)}
    assert got[8] == got[16] == [0] and got[2] == got[10] == [1] and got[4] == [2] and got[6] == [3]
    assert sum(len(v) for v in got.values()) == 8  # every fragment twice in 2H steps, one at a time
    assert due_fragments(5, 5, 1) == [0] and due_fragments(0, 5, 1) == []




def train_in_threads(models: list, opts: list, steps: int,
                     pause: Callable[[int, int], float] | None = None) -> None:
    """Each trainer takes ``steps`` inner steps on its own batches in its own thread; errors are raised here.
    ``pause(i, s)``: seconds trainer i spends before step s (its compute, an evaluation)."""

    def worker(i: int) -> None:
        for s in range(1, steps + 1):
            if pause is not None:
                time.sleep(pause(i, s))
            x, y = batch(i, s)
            opts[i].zero_grad()
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            opts[i].step(samples=len(x))

    in_threads(len(opts), worker)


@pytest.mark.parametrize("fragments", [1, 2])
def test_three_trainers_follow_a_replay_of_diloco(tmp_path, fragments: int) -> None:
    with thread_daemon(tmp_path, group_size=3, wait_s=10.0) as daemon:
        models = [model(0) for _ in range(3)]
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=4,
                       fragments=fragments, sync_state=False, state_every=0) for m in models]
        train_in_threads(models, opts, steps=8)
        glob, mom = replay(3, 8, 4, fragments)
        for o, m in zip(opts, models, strict=True):
            assert o.outer_steps == 2 * fragments
            torch.testing.assert_close(o.global_params, glob, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(o.momentum, mom, rtol=1e-5, atol=1e-6)
            assert not torch.equal(mom, torch.zeros_like(mom))
            # the step ended on an outer step of fragment 0 (fragments > 1: fragment 1 synced at step 6 and the
            # model drifted from it since), so at least fragment 0 restarts from the global parameters
            a, b = o.bounds[0]
            assert torch.equal(flat(m.parameters())[a:b], o.global_params[a:b])
        shas = {o.state_sha() for o in opts}
        assert len(shas) == 1  # identical global parameters and momentum
        # every outer step used the Moshpit round numbered by the step (times OUTER_ROUNDS: a grid of one
        # dimension takes one round), under the outer run id
        outer_calls = [r for r in daemon.averager.round_numbers if r is not None]
        assert sorted(set(outer_calls)) == sorted({OUTER_ROUNDS * h["step"] for h in opts[0].history})
        for o in opts:
            o.close()


def test_an_outer_step_on_a_grid_chains_each_rounds_window_to_the_last(tmp_path) -> None:
    """On a grid of two dimensions an outer step takes two Moshpit rounds; the second's matchmaking window is
    chained to the first's (``chain_from``: its ``window_end``), so a member alone in the first round still
    meets the others in the second. The result is still DiLoCo's (every round here holds all three)."""
    averager = InProcessAverager(group_size=3, wait_s=10.0)
    averager.dims = 2
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), averager)
    try:
        models = [model(0) for _ in range(3)]
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=4,
                       sync_state=False, state_every=0) for m in models]
        train_in_threads(models, opts, steps=8)
        glob, mom = replay(3, 8, 4, 1)
        for o in opts:
            assert o.outer_steps == 2
            torch.testing.assert_close(o.global_params, glob, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(o.momentum, mom, rtol=1e-5, atol=1e-6)
        calls = [(r, o.get("chain_from")) for r, o in zip(averager.round_numbers, averager.options, strict=True)
                 if r is not None]
        steps = {OUTER_ROUNDS * h["step"] for h in opts[0].history}
        assert sorted({r for r, _ in calls}) == sorted(steps | {s + 1 for s in steps})
        for r, chained in calls:
            assert chained == (None if r in steps else WINDOW_END + r - 1), (r, chained)
        for o in opts:
            o.close()
    finally:
        daemon.stop()


def test_the_outer_wait_is_a_share_of_the_period_within_half_the_timeout() -> None:
    assert outer_wait_s(None, 60.0) is None  # no period known: the run's window
    assert outer_wait_s(8.0, 60.0) is None  # a quarter of 8 s is within the run's 3 s window
    assert outer_wait_s(26.0, 60.0) == pytest.approx(6.5)
    assert outer_wait_s(400.0, 60.0) == 30.0  # at most half the timeout (Moshpit's bound)
    assert outer_wait_s(float("nan"), 60.0) is None and outer_wait_s(-1.0, 60.0) is None


def test_only_a_kept_groups_outer_step_ends_without_reading_who_took_part() -> None:
    """The read of the run's progress finds other groups of the step that finished first: a step matchmade through
    the DHT (or alone, or failed) waits for it; a kept group's renewal, which finished first, does not."""
    from peerd.moshpit.runstate import RoundResult

    def result(outcome: str, kept: bool) -> RoundResult:
        return RoundResult(np.zeros(2, np.float32), outcome, "ab" if outcome == "averaged" else "", 3, [], 1.0, 8,
                           0.1, kept=kept)

    assert not waits_for_participants(result("averaged", kept=True))
    assert waits_for_participants(result("averaged", kept=False))
    assert waits_for_participants(result("failed", kept=True)) and waits_for_participants(None)


def test_an_outer_step_waits_for_a_member_a_moment_behind(tmp_path, monkeypatch) -> None:
    """Trainers that take H local steps reach an outer step seconds apart (one evaluated, the CPU is shared). The
    outer step's matchmaking waits for the run's members up to a share of the time between outer steps
    (outer_wait_s), beyond the run's own window: a member 0.4 s behind still averages with the others. With the
    window alone the other two closed without it, and the swarm stayed split at the outer steps after (the same lag
    each time): each part averaged a part of the pseudo-gradients."""
    monkeypatch.setattr(outer_step, "RUN_WINDOW_S", 0.2)  # the run's window here (Moshpit's 3 s in a daemon)
    with thread_daemon(tmp_path, group_size=3, wait_s=0.2) as daemon:
        models = [model(0) for _ in range(3)]
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=6,
                       sync_state=False, state_every=0) for m in models]
        # 0.5 s a step (0.75 s of wait at an outer step 3 s after the last); trainer 2 evaluates 0.4 s at step 8
        train_in_threads(models, opts, steps=12, pause=lambda i, s: 0.5 + (0.4 if (i, s) == (2, 8) else 0.0))
        for o in opts:
            assert [h["group_size"] for h in o.history] == [3, 3], o.history
        glob, mom = replay(3, 12, 6, 1)
        for o in opts:
            torch.testing.assert_close(o.global_params, glob, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(o.momentum, mom, rtol=1e-5, atol=1e-6)
            o.close()


def test_an_overlapped_outer_step_lands_later_with_the_same_global_step_and_keeps_the_inner_progress(tmp_path
                                                                                                    ) -> None:
    """overlap_outer=True: the outer average travels while the next inner step runs, and is applied after it.
    On a loss whose gradients do not depend on the parameters (each inner step moves a replica by the same amount
    wherever it stands), applying an outer step late changes nothing: the global parameters, the momentum and each
    replica end exactly where the same run without overlap ends them, and every member agrees on the state."""

    def run(overlap: bool, tag: str) -> tuple[list[DiLoCo], list[torch.Tensor]]:
        daemon = ThreadDaemon(str(tmp_path / f"{tag}.sock"), InProcessAverager(group_size=3, wait_s=10.0))
        try:
            torch.manual_seed(0)
            models = [torch.nn.Linear(6, 2, bias=False) for _ in range(3)]
            for m in models[1:]:
                m.load_state_dict(models[0].state_dict())
            opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run=tag, socket=daemon.path, sync_every=4,
                           sync_state=False, state_every=0, overlap_outer=overlap) for m in models]

            def worker(i: int) -> None:
                for s in range(1, 13):
                    x = torch.full((2, 6), float(i + 1)) * (1.0 + 0.1 * s)  # a linear loss: grad = sum of x
                    opts[i].zero_grad()
                    models[i](x).sum().backward()
                    opts[i].step(samples=2 + i)
                opts[i].flush()

            in_threads(3, worker)
            return opts, [flat(m.parameters()).clone() for m in models]
        finally:
            daemon.stop()

    plain, plain_params = run(False, "plain")
    over, over_params = run(True, "over")
    assert len({o.state_sha() for o in over}) == 1
    for a, b in zip(plain, over, strict=True):
        torch.testing.assert_close(b.global_params, a.global_params, rtol=1e-6, atol=1e-5)  # float rounding
        torch.testing.assert_close(b.momentum, a.momentum, rtol=1e-6, atol=1e-5)
        assert [h["step"] for h in b.history] == [4, 8, 12] and b.outer_steps == 3
        assert all(h["applied_at"] == h["step"] + 1 for h in b.history[:-1])  # applied at the next inner step
        assert all(h["applied_at"] == h["step"] for h in a.history)
    for p, q in zip(plain_params, over_params, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-5)
    for o in plain + over:
        o.close()


class CodecAverager(InProcessAverager):
    """InProcessAverager through a body codec, as Moshpit averages a compressed run: each member's vector is
    encoded for the reduce, and every member (the shard owners too) gets the dequantized encoding of the mean
    from the all-gather. Records the codec keywords of every call and every result it hands out."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.codecs: list[dict] = []
        self.results: dict[int | None, np.ndarray] = {}

    async def average(self, run_id, vector, weight, *, compression=None, quant_group=None, rounding=None,
                      **kw):
        from peerd.compress import codec

        self.codecs.append({"compression": compression, "quant_group": quant_group, "rounding": rounding})
        c = codec(compression, **({"group": quant_group, "rounding": "nearest"} if quant_group else {}))
        def bodies(v: np.ndarray) -> np.ndarray:  # encoded and decoded in ranges of whole quantization groups
            step = 16_384
            return np.concatenate([c.decode(c.encode(v[a: a + step]), v[a: a + step].size)
                                   for a in range(0, v.size, step)])

        sent = bodies(vector)  # the reduce-scatter's bodies
        res = await super().average(run_id, sent, weight, **kw)
        if res.outcome != "averaged":
            return res
        got = bodies(res.vector)  # the all-gather's, the owners' own shard included
        self.results[kw.get("round_no")] = got
        return dataclasses.replace(res, vector=got)


@pytest.mark.parametrize("compression", ["int8", "int4", "fp16", "bf16"])
def test_compressed_outer_averages_agree_and_follow_the_rule_on_the_dequantized_average(tmp_path,
                                                                                       compression: str) -> None:
    """DiLoCo(compression=C): the daemon averages the pseudo-gradients in C, every member ends with the same
    global parameters and momentum, they are the outer rule replayed on the dequantized averages (not the
    float32 ones), and the bytes of each outer step are the codec's, fewer than float32's."""
    from peerd.compress import codec

    averager = CodecAverager(group_size=3, wait_s=10.0)
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), averager)
    extra = {"rounding": "nearest"} if compression.startswith("int") else {}
    try:
        models = [model(0) for _ in range(3)]
        start = flat(models[0].parameters()).clone()
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dlc", socket=daemon.path, sync_every=4,
                       compression=compression, sync_state=False, state_every=0, **extra) for m in models]
        train_in_threads(models, opts, steps=8)
        assert {c["compression"] for c in averager.codecs} == {compression}  # the outer averages went in C
        assert sorted(averager.results) == [4 * OUTER_ROUNDS, 8 * OUTER_ROUNDS]  # (the rounds of steps 4 and 8)
        assert len({o.state_sha() for o in opts}) == 1  # identical global parameters and momentum
        glob, mom = start.clone(), torch.zeros_like(start)
        for r in (4 * OUTER_ROUNDS, 8 * OUTER_ROUNDS):  # the rule on the dequantized averages, bit for bit
            nesterov_outer(glob, mom, torch.from_numpy(averager.results[r]), 0.7, 0.9)
        for o in opts:
            assert torch.equal(o.global_params, glob) and torch.equal(o.momentum, mom)
        ref_glob, _ = replay(3, 8, 4, 1)  # the float32 DiLoCo: close, but not the same bytes
        torch.testing.assert_close(glob, ref_glob, rtol=0.0, atol=0.05)
        assert not torch.equal(glob, ref_glob)
        c = codec(compression, **({"group": 128, **extra} if extra else {}))
        for o in opts:
            assert o.outer_bytes == 2 * c.body_size(o.elems) < 2 * 4 * o.elems
            assert all(h["payload_bytes"] == c.body_size(o.elems) for h in o.history)
        for o in opts:
            o.close()
    finally:
        daemon.stop()


def test_compression_auto_averages_large_fragments_in_int8_and_says_why(tmp_path) -> None:
    """DiLoCo's default codec is "auto": int8 for fragments of at least MIN_INT8_PARAMS values (a quarter of the
    bytes, as deployed DiLoCo runs average), fp32 below; every outer step's result and ``peerd status`` say which
    and why, and an explicit codec wins."""
    from peerd.torch.auto import MIN_INT8_PARAMS

    def run(make, **kw) -> tuple[list[DiLoCo], CodecAverager, ThreadDaemon]:
        averager = CodecAverager(group_size=2, wait_s=10.0)
        daemon = ThreadDaemon(str(tmp_path / f"a{len(kw)}{make().weight.numel()}.sock"), averager)
        models = [make() for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())  # the founders' one initial state
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="auto", socket=daemon.path, sync_every=2,
                       sync_state=False, state_every=0, **kw) for m in models]

        def worker(i: int) -> None:
            for s in range(2):
                x = torch.randn(4, models[i].in_features, generator=torch.Generator().manual_seed(10 * i + s))
                opts[i].zero_grad()
                models[i](x).pow(2).mean().backward()
                opts[i].step(samples=4)

        in_threads(2, worker)
        return opts, averager, daemon

    def big() -> torch.nn.Linear:
        return torch.nn.Linear(512, 512, bias=False)  # 262,144 values: MIN_INT8_PARAMS

    assert big().weight.numel() == MIN_INT8_PARAMS
    for make, kw, want in ((big, {}, "int8"), (lambda: torch.nn.Linear(64, 64, bias=False), {}, "fp32"),
                           (big, {"compression": "fp32"}, "fp32")):
        opts, averager, daemon = run(make, **kw)
        try:
            assert {c["compression"] for c in averager.codecs} == {want}
            assert len({o.state_sha() for o in opts}) == 1
            for o in opts:
                if kw:  # an explicit codec: nothing was chosen
                    assert "auto" not in o.history[-1] and not o.auto_outer
                    continue
                auto = o.history[-1]["auto"]
                assert auto["compression"] == want and auto["reason"].startswith(want + ":")
                assert f"{make().weight.numel():,} values" in auto["reason"]
            shown = [s.auto for s in daemon.service.sessions.values()]
            assert shown == ([] if kw else [opts[0].auto_outer] * 2) or kw
            for o in opts:
                o.close()
        finally:
            daemon.stop()


def test_a_joiner_takes_global_parameters_and_outer_momentum(tmp_path) -> None:
    with thread_daemon(tmp_path, group_size=1, wait_s=1.0) as daemon:
        m = model(0)
        opt = DiLoCo(m, torch.optim.Adam(m.parameters(), lr=0.01), run="dl", socket=daemon.path, sync_every=3,
                     sync_state=False, state_every=0)
        for s in range(1, 7):
            x, y = batch(0, s)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step(samples=len(x))
        assert opt.outer_steps == 2 and bool(opt.momentum.abs().sum() > 0)
        blob = opt.snapshot()
        late = model(5)  # other initial weights
        joiner = DiLoCo(late, torch.optim.Adam(late.parameters(), lr=0.01), run="dl2", socket=daemon.path,
                        sync_every=3, sync_state=False, state_every=0)
        assert joiner.load_snapshot(blob) == 6
        assert torch.equal(joiner.momentum, opt.momentum) and torch.equal(joiner.global_params, opt.global_params)
        assert joiner.state_sha() == opt.state_sha()
        assert torch.equal(flat(late.parameters()), opt.global_params)  # restarts from the global parameters
        third = model(0)
        other = DiLoCo(third, torch.optim.Adam(third.parameters()), run="dl3", socket=daemon.path,
                       sync_every=4, sync_state=False, state_every=0)
        with pytest.raises(ValueError, match="schedule"):
            other.load_snapshot(blob)
        for o in (opt, joiner, other):
            o.close()


class MemorySync:
    """The state-sync surface the trainer service uses, holding the last published snapshot in memory (no
    DHT: the outer op averages without the swarm agreement, which the memnet tests below cover)."""

    def __init__(self) -> None:
        self.blob: bytes | None = None
        self.step = -1

    def keep(self, run_key: str, blob: bytes, *, sha: bytes | None = None) -> bytes:
        self.blob = blob
        assert sha is None or sha == hashlib.sha256(blob).digest()  # the caller's hash is the blob's
        return hashlib.sha256(blob).digest()

    async def advertise_state(self, run, run_key, layout, *, step: int = -1, **kwargs) -> bool:
        self.step = max(self.step, step)
        return True

    async def adverts(self, run: str, *, timeout: float = 10.0) -> list:
        return []

    async def fetch(self, run: str, run_key: str, **kwargs):
        from peerd.statesync import Fetched

        if self.blob is None:
            return None
        sha = hashlib.sha256(self.blob).digest()
        below = kwargs.get("below")
        if below is not None and self.step == 0 and not sha < below:  # a founder's own (never its own donor)
            return None
        return Fetched(self.step, self.blob, sha, 1, 1, 0)


def test_a_joiner_gets_the_outer_state_by_state_sync(tmp_path) -> None:
    sync = MemorySync()
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0), statesync=sync)
    try:
        m = model(0)
        founder = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=3,
                         state_every=1)
        assert founder.synced_from is None  # nobody had a state yet
        for s in range(1, 8):
            x, y = batch(0, s)
            founder.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            founder.step(samples=len(x))
        assert sync.step == 6  # published after its outer step at 6, not at 7
        late = model(9)
        joiner = DiLoCo(late, torch.optim.SGD(late.parameters(), lr=0.1), run="dl", socket=daemon.path,
                        sync_every=3)
        assert joiner.synced_from is not None and joiner.step_count == 6
        assert bool(joiner.momentum.abs().sum() > 0) and torch.equal(joiner.momentum, founder.momentum)
        assert joiner.state_sha() == founder.state_sha()
        assert torch.equal(flat(late.parameters()), founder.global_params)
        for o in (founder, joiner):
            o.close()
    finally:
        daemon.stop()


def test_by_default_a_snapshot_follows_an_outer_step_at_most_once_in_state_min_s(tmp_path, monkeypatch) -> None:
    """state_every=None: the first outer step publishes (a joiner finds the state at once); outer steps that follow
    within STATE_MIN_S (up to 1.5x, the member's draw) publish nothing; the first one after publishes again. An
    explicit state_every keeps its count of outer steps; a negative or fractional one is refused."""
    import peerd.torch.diloco as diloco_module

    clock = [1000.0]  # the module's clock, moved by hand: the test does not depend on how fast steps run
    monkeypatch.setattr(diloco_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time,
                                                                     sleep=time.sleep))
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0),
                          statesync=MemorySync())
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=2)
        published: list[int] = []
        real = opt.publish_state

        def counted(**kw):
            published.append(opt.step_count)
            return real(**kw)

        opt.publish_state = counted
        for s in range(1, 9):
            x, y = batch(0, s)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step(samples=len(x))
            clock[0] += 1.0
            if s == 6:
                clock[0] += 1.5 * diloco_module.STATE_MIN_S  # past the longest draw
        assert opt.outer_steps == 4
        assert published == [2, 8]
        opt.close()
        for bad in (-1, 1.5):
            with pytest.raises(ValueError, match="state_every"):
                DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=2,
                       state_every=bad)
    finally:
        daemon.stop()


def test_a_non_finite_outer_average_never_reaches_the_model(tmp_path) -> None:
    averager = InProcessAverager(group_size=2, wait_s=10.0)
    averager.poison = float("nan")  # every averaged result holds a NaN
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), averager)
    try:
        models = [model(0), model(0)]
        opts = [DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=2,
                       sync_state=False, state_every=0) for m in models]
        replies: list[dict] = [{}, {}]

        def worker(i: int) -> None:
            for s in range(1, 3):
                x, y = batch(i, s)
                opts[i].zero_grad()
                torch.nn.functional.cross_entropy(models[i](x), y).backward()
                replies[i] = opts[i].step(samples=len(x))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for o, m, r in zip(opts, models, replies, strict=True):
            assert r["outer"][0]["outcome"] == "failed"  # the daemon refused the average, kept the own delta
            assert bool(torch.isfinite(o.global_params).all()) and bool(torch.isfinite(o.momentum).all())
            assert bool(torch.isfinite(flat(m.parameters())).all())
            o.close()
    finally:
        daemon.stop()


def test_an_inner_step_on_non_finite_gradients_is_skipped(tmp_path) -> None:
    """A NaN or infinity in any one gradient skips the inner step: the model, the step count and the samples
    toward the next outer step stay as they were."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0))
    try:
        m = model(0)
        o = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=4,
                   sync_state=False, state_every=0)
        for bad in (float("nan"), float("inf"), float("-inf")):
            x, y = batch(0, 1)
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            params = list(m.parameters())
            params[-1].grad.view(-1)[0] = bad
            before = flat(params).clone()
            r = o.step(samples=len(x))
            assert r["outcome"] == "nonfinite" and o.step_count == 0 and o.samples_since == [0.0]
            assert torch.equal(flat(m.parameters()), before)
        assert o.nonfinite_rounds == 3
        x, y = batch(0, 2)
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        assert o.step(samples=len(x))["outcome"] == "local" and o.step_count == 1
        o.close()
    finally:
        daemon.stop()


def test_a_replica_whose_outer_state_differs_from_the_swarms_raises(tmp_path) -> None:
    """The daemon reports the pre-step state hash most members named; a replica that started the outer step
    from another state must not apply the swarm's average to it and drift on: it raises DiLoCoError."""
    from peerd.torch import DiLoCoError

    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=1.0))
    original = daemon.service._op_outer

    async def swarm_started_elsewhere(req, conn):
        reply = await original(req, conn)
        return {**reply, "state_winner": b"\x01" * 32}

    daemon.server.register("trainer_outer", swarm_started_elsewhere, connection=True)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=1,
                     sync_state=False, state_every=0)
        before = opt.global_params.clone()
        x, y = batch(0, 1)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        with pytest.raises(DiLoCoError, match="differs from the swarm"):
            opt.step(samples=len(x))
        assert torch.equal(opt.global_params, before)  # nothing applied
        opt.close()
    finally:
        daemon.stop()


def test_options_are_checked() -> None:
    m = model(0)
    with pytest.raises(ValueError, match="arc-topk.*gradient vectors"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="x", compression="arc-topk")
    with pytest.raises(ValueError, match="compression must be one of"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="x", compression="int3")
    with pytest.raises(ValueError):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="x", sync_every=0)
    with pytest.raises(ValueError):
        DiLoCo(m, torch.optim.SGD(model(1).parameters(), lr=0.1), run="x")


# -- agreement ------------------------------------------------------------------------------------------
def test_records_are_bounded_and_the_winner_is_the_most_held() -> None:
    h = [bytes([i]) * 32 for i in range(4)]
    rec = OuterRecord(b"n" * 32, "0000abcd", 3, 1, h[0], h[1], h[2], h[3], 100, ("127.0.0.1", 5))
    assert OuterRecord.decode(rec.node, rec.encode()) == rec
    assert OuterRecord.decode(rec.node, b"\x93garbage") is None
    bad = OuterRecord(b"n" * 32, "g", 3, 3, h[0], h[1], b"", b"", 100).encode()  # index outside its group
    assert OuterRecord.decode(b"n" * 32, bad) is None

    def r(node: int, final: bytes, size: int = 2) -> OuterRecord:
        return OuterRecord(bytes([node]) * 32, "g", size, 0, h[0], h[0], final, b"", 10)

    assert winner([r(1, h[3]), r(2, h[3]), r(3, h[1])]) == h[3]  # most holders
    assert winner([r(1, h[3], size=3), r(2, h[1], size=2)]) == h[3]  # then the larger group
    assert winner([r(1, h[3]), r(2, h[1])]) == h[1]  # then the lower hash
    assert winner([r(1, b"")]) is None






def test_members_repair_lost_ranges_and_a_straggler_adopts_the_groups_average() -> None:
    from .support.memnet import MemNet
    from .support.virtual import run_virtual

    truth = np.random.default_rng(1).standard_normal(20_000).astype(np.float32)
    rng = np.random.default_rng(2)
    held = _lossy_copies(truth, 3, rng)
    assert all(not np.array_equal(v, truth) for v in held)  # every member lost something

    async def main() -> None:
        net = MemNet(seed=5, drop=0.1, jitter=0.01)  # the repair itself also runs over a lossy network
        results: dict[int, object] = {}
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = await _swarm(nursery, net, 5)
            members = nodes[:3]
            straggler = nodes[3]  # it missed the group: it holds its own vector alone

            async def one(i: int, node, vector, group: str, size: int, index: int) -> None:
                board = DhtBoard(node.sync, "run/0123456789abcdef", 7)
                ids = [n.identity.node_id for n in members]
                results[i] = await agree(board, node.identity.node_id, vector, group=group, size=size, index=index,
                                         state=b"s" * 32, repair_s=60, deadline_s=120, addr=node.addr,
                                         members=ids if group else None)

            async with trio.open_nursery() as inner:
                for i, node in enumerate(members):
                    inner.start_soon(one, i, node, held[i], "0000beef", 3, i)
                inner.start_soon(one, 3, straggler, rng.standard_normal(truth.size).astype(np.float32), "", 1, 0)
            nursery.cancel_scope.cancel()
        finals = {results[i].final for i in range(4)}
        assert finals == {hashlib.sha256(truth.tobytes()).digest()}
        for i in range(4):
            np.testing.assert_array_equal(results[i].vector, truth)
        assert all(results[i].repaired_bytes > 0 for i in range(3))  # fetched from owners, not whole
        assert all(results[i].repaired_bytes < truth.nbytes for i in range(3))
        assert results[3].adopted and results[3].adopted_bytes == truth.nbytes
        assert all(results[i].states == results[i].members for i in range(4))

    run_virtual(main)


def test_without_loss_nothing_is_fetched_and_a_lost_owner_ends_in_one_final() -> None:
    from .support.memnet import MemNet
    from .support.virtual import run_virtual

    truth = np.random.default_rng(3).standard_normal(9_000).astype(np.float32)
    held = _lossy_copies(truth, 3, np.random.default_rng(4))

    async def main() -> None:
        net = MemNet(seed=6)
        results: dict[int, object] = {}
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = await _swarm(nursery, net, 4)

            async def one(i: int, vector, group: str, size: int, index: int, repair_s: float = 30) -> None:
                node = nodes[i]
                board = DhtBoard(node.sync, "run/0123456789abcdef", 8 if group == "a" else 9)
                results[(group, i)] = await agree(board, node.identity.node_id, vector, group=group, size=size,
                                                  index=index, state=b"", repair_s=repair_s, deadline_s=60,
                                                  addr=node.addr, members=[n.identity.node_id for n in nodes[:3]])

            async with trio.open_nursery() as inner:  # round 8: three members that all received everything
                for i in range(3):
                    inner.start_soon(one, i, truth.copy(), "a", 3, i)
            assert all(results[("a", i)].repaired_bytes == 0 and not results[("a", i)].adopted for i in range(3))
            # round 9: the owner of shard 2 never publishes (it died after the average): members 0 and 1 keep
            # what they hold of shard 2, which differs between them, and still end on one final
            async with trio.open_nursery() as inner:
                for i in range(2):
                    inner.start_soon(one, i, held[i], "b", 3, i, 5)
            nursery.cancel_scope.cancel()
        assert results[("b", 0)].final == results[("b", 1)].final
        np.testing.assert_array_equal(results[("b", 0)].vector, results[("b", 1)].vector)
        assert sum(results[("b", i)].adopted for i in range(2)) == 1

    run_virtual(main)


def test_a_member_that_missed_its_group_is_not_waited_for_and_does_not_leave_alone() -> None:
    """Members 1 and 2 averaged in a group of 3 whose member 0 never knew it formed (it averaged alone): they
    must not wait out the repair phase for shard 0, and member 0 must not end with its own vector while
    they are still repairing (measured in CI before the fix: member 0 left alone, the others waited 33 s)."""
    from .support.memnet import MemNet
    from .support.virtual import run_virtual

    truth = np.random.default_rng(5).standard_normal(12_000).astype(np.float32)
    held = _lossy_copies(truth, 3, np.random.default_rng(6))
    own = np.random.default_rng(7).standard_normal(truth.size).astype(np.float32)

    async def main() -> None:
        net = MemNet(seed=8)
        results: dict[int, object] = {}
        took: dict[int, float] = {}
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            nodes = await _swarm(nursery, net, 4)
            ids = [n.identity.node_id for n in nodes[:3]]

            async def one(i: int, vector, group: str, size: int, index: int, delay: float) -> None:
                await trio.sleep(delay)
                t0 = trio.current_time()
                board = DhtBoard(nodes[i].sync, "run/0123456789abcdef", 11)
                results[i] = await agree(board, ids[i], vector, group=group, size=size, index=index, state=b"",
                                         repair_s=30, deadline_s=60, addr=nodes[i].addr,
                                         members=ids if group else None, expect=3)
                took[i] = trio.current_time() - t0

            async with trio.open_nursery() as inner:
                inner.start_soon(one, 0, own, "", 1, 0, 0.0)
                for i in (1, 2):
                    inner.start_soon(one, i, held[i], "0000cafe", 3, i, 1.0)  # a moment later
            nursery.cancel_scope.cancel()
        assert len({results[i].final for i in range(3)}) == 1
        assert results[0].adopted  # it took the group's vector, not the other way round
        assert max(took[1], took[2]) < 15  # not the 30 s repair phase

    run_virtual(main)


@pytest.mark.parametrize("expect", [2, 4])
def test_two_groups_of_a_grid_step_end_on_one_final_when_the_step_expects_them_all(expect: int) -> None:
    """A 2x2 grid's second round left two groups of two with different averages; group a ends its average
    first. Expecting only its own group (2, the last round's size), group a agrees within itself at once and
    leaves, and group b, whose final is the lower hash (so it wins the tie and never adopts a's), waits for
    a majority that cannot come: an error. Expecting the step's 4 members (the trainer reads them from the
    run's progress), all four end on one final."""
    import hashlib as _h


    rng = np.random.default_rng(9)
    va, vb = (rng.standard_normal(5_000).astype(np.float32) for _ in range(2))
    if _h.sha256(vb.tobytes()).digest() > _h.sha256(va.tobytes()).digest():
        va, vb = vb, va  # group b's final is the lower hash: it wins the 2-2 tie
    outcome: dict[int, object] = {}

    async def main(net: Any, nursery: trio.Nursery) -> None:
        nodes = await _swarm(nursery, net, 4)

        async def one(i: int, delay: float) -> None:
            await trio.sleep(delay)
            group, vector = ("a", va) if i < 2 else ("b", vb)
            board = DhtBoard(nodes[i].sync, "run/0123456789abcdef", 12)
            try:
                pair = nodes[:2] if i < 2 else nodes[2:]
                outcome[i] = await agree(board, nodes[i].identity.node_id, vector.copy(), group=group, size=2,
                                         index=i % 2, state=b"", repair_s=10, deadline_s=20,
                                         addr=nodes[i].addr, expect=expect,
                                         members=[n.identity.node_id for n in pair])
            except OuterError as e:
                outcome[i] = e

        async with trio.open_nursery() as inner:
            for i in range(4):
                inner.start_soon(one, i, 0.0 if i < 2 else 1.0)

    run_on_memnet(main, seed=10)
    if expect == 2:
        assert all(isinstance(outcome[i], OuterError) for i in (2, 3)), outcome
    else:
        finals = {outcome[i].final for i in range(4)}
        assert len(finals) == 1 and finals == {_h.sha256(vb.tobytes()).digest()}, outcome
        assert [outcome[i].adopted for i in range(4)] == [True, True, False, False]


class _DeafBoard:
    """A board where this member sees another final but can never fetch it (its holder's blob is gone)."""

    def __init__(self) -> None:
        self.other = OuterRecord(b"o" * 32, "g", 2, 1, b"x" * 32, b"y" * 32, b"\x00" * 32, b"", 100)
        self.mine: OuterRecord | None = None

    def keep(self, blob: bytes, sha: bytes) -> bytes:
        assert sha == hashlib.sha256(blob).digest()  # the core's hash is the blob's
        return sha

    async def publish(self, record: OuterRecord) -> None:
        self.mine = record

    async def read(self) -> list[OuterRecord]:
        return [self.other, *([self.mine] if self.mine else [])]

    async def fetch_range(self, holder, sha, offset, length) -> bytes:
        raise OSError("gone")

    async def fetch(self, sha, size, holders) -> bytes:
        raise OSError("gone")


def test_a_disagreement_that_cannot_be_repaired_is_an_error() -> None:
    async def main() -> None:
        with pytest.raises(OuterError, match="did not agree"):
            await agree(_DeafBoard(), b"m" * 32, np.ones(100, np.float32), group="g", size=2, index=0, state=b"",
                        repair_s=2, deadline_s=10)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- end to end: real daemons, real `peerd train --mode diloco` processes -------------------------------
def _diloco_trainer(node, index: int, *extra: str, peers: int = 3):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "peerd", "train", "--run", "dl-e2e", "--socket", node.socket, "--peers", str(peers),
         "--index", str(index), "--steps", "30", "--mode", "diloco", "--sync-every", "10", "--no-sync",
         "--state-every", "0", "--eval-every", "0", "--json", "--progress", "none", "--timeout", "30", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
    )


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("loss", "compression"), [(0.0, None), (0.1, None), (0.1, "int8")])
def test_three_daemons_agree_on_every_outer_step(tmp_path, loss: float, compression: str | None) -> None:
    """3 daemons (``--loss``: each drops received datagrams, all-gather ones included) and 3 DiLoCo trainers:
    after every outer step all members hold global parameters and momentum of the same SHA-256 (also with an
    int8 outer average: a lost range is repaired with its owner's dequantized shard)."""
    import json

    pytest.importorskip("sklearn")
    from peerd.tools.swarm import LocalSwarm

    extra = ("--loss", str(loss), "--loss-seed", "3") if loss else ()
    with LocalSwarm(str(tmp_path / "swarm"), extra_args=extra) as swarm:
        nodes = swarm.start_many(3)
        codec = ("--compression", compression) if compression else ()
        trainers = [_diloco_trainer(n, i, *(("--fragments", "2") if loss else ()), *codec)
                    for i, n in enumerate(nodes)]
        results = []
        for t in trainers:
            out, err = t.communicate(timeout=240)
            assert t.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    fragments = 2 if loss else 1
    for r in results:
        assert r["mode"] == "diloco" and r["outer_steps"] == 3 * fragments, r
        assert r["params_finite"] and r["compression"] == (compression or "fp32")
    by_step = [{(o["step"], o["fragment"]): o["sha"] for o in r["outer"]} for r in results]
    assert by_step[0].keys() == by_step[1].keys() == by_step[2].keys()
    for key in by_step[0]:
        assert by_step[0][key] == by_step[1][key] == by_step[2][key], key
    assert len({r["state_sha"] for r in results}) == 1
    groups = [o["group_size"] for r in results for o in r["outer"]]
    assert max(groups) == 3  # the outer averages were with the swarm, not alone
    if not loss:  # the second step's group formed complete (the first's knew nobody to expect): the third renewed it
        assert any(o["kept"] for r in results for o in r["outer"]), [r["outer"] for r in results]
    if loss:  # datagrams were lost, yet every member ended on one state: the all-gather's repair, the outer
        # step's repair or a straggler's adopting the swarm's average made up for them
        assert min(o["received_fraction"] for r in results for o in r["outer"]) < 1.0
    assert min(r["accuracy"] for r in results) > 0.5


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_swarm_larger_than_a_group_averages_each_outer_step_over_the_grid(tmp_path) -> None:
    """4 daemons whose groups hold at most 2 (``--max-group 2``: a 2x2 grid, as 17+ peers on groups of 16):
    each outer step takes two Moshpit rounds in groups of 2 (on a full grid every member's pseudo-gradient
    then reaches every other's; one round would leave two group averages), and all four hold the same global
    parameters after each step."""
    import json

    pytest.importorskip("sklearn")
    from peerd.tools.swarm import LocalSwarm

    with LocalSwarm(str(tmp_path / "swarm"), extra_args=("--max-group", "2")) as swarm:
        nodes = swarm.start_many(4)
        # every trainer's first step at once: one that loads torch seconds after the others (a loaded CI
        # machine) reaches each outer step after they left its round, and every round is alone
        start = str(time.time() + 20)
        trainers = [_diloco_trainer(n, i, "--start-at", start, peers=4) for i, n in enumerate(nodes)]
        results = []
        for t in trainers:
            out, err = t.communicate(timeout=240)
            assert t.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["mode"] == "diloco" and r["outer_steps"] == 3 and r["params_finite"], r
    outers = [o for r in results for o in r["outer"]]
    assert all(o["rounds"] == 2 for o in outers), outers
    by_step = [{o["step"]: o["sha"] for o in r["outer"]} for r in results]
    for step in by_step[0]:
        assert len({b[step] for b in by_step}) == 1, step
    # Moshpit keys start at random cells, so a round's groups are not always the grid's rows and columns: a
    # member alone in its last round holds a partial mix, and adopts the winner (the final most members hold)
    assert sum(o["group_size"] == 2 for o in outers) >= len(outers) // 2, outers
    assert len({r["state_sha"] for r in results}) == 1 and min(r["accuracy"] for r in results) > 0.5


def _swarm_finished(daemon: ThreadDaemon, finished: int, asked: list[tuple[int, bool]]) -> None:
    """``daemon``'s outer steps as a swarm's daemon answers them where the swarm has finished the outer rounds up
    to ``finished`` (no DHT in-process): those average alone and adopt the swarm's average, a later one asked with
    behind=True is "current"; each request's (round, behind) goes to ``asked``."""
    original = daemon.service._op_outer

    async def swarm_ahead(req, conn):
        asked.append((req["round"], bool(req.get("behind"))))
        if req.get("behind") and req["round"] <= finished:
            req = {**req, "behind": False}
        reply = await original(req, conn)
        return {**reply, "adopted": True} if req["round"] <= finished and reply["outcome"] == "alone" else reply

    daemon.server.register("trainer_outer", swarm_ahead, connection=True)


def test_a_member_behind_takes_the_rounds_the_swarm_finished_and_stops_at_the_current_one(tmp_path) -> None:
    """An outer step that averaged alone and adopted the swarm's average (the swarm had finished its round)
    finds the replica behind: it takes the next rounds at once with behind=True, without inner steps between,
    until the daemon answers "current" (nothing applied for that one); its step moves with them."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2))
    asked: list[tuple[int, bool]] = []
    _swarm_finished(daemon, 3, asked)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=1,
                     sync_state=False, state_every=0)
        x, y = batch(0, 4)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        reply = opt.step(samples=len(x))
        assert asked == [(1, False), (2, True), (3, True), (4, True)], asked
        assert opt.step_count == 3 and opt.caught_up == 2 and len(reply["outer"]) == 3
        assert [o["step"] for o in reply["outer"]] == [1, 2, 3] and opt.outer_steps == 3
        opt.close()
    finally:
        daemon.stop()


def test_a_fragment_whose_catch_up_round_is_current_keeps_its_samples(tmp_path) -> None:
    """Streaming (two fragments): the catch-up round that comes back "current" is another fragment's, whose inner
    steps since its last outer step still count in its next outer step's weight."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2))
    asked: list[tuple[int, bool]] = []
    _swarm_finished(daemon, 1, asked)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=2,
                     fragments=2, sync_state=False, state_every=0)
        x, y = batch(0, 4)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step(samples=len(x))  # step 1: fragment 1's outer step (round 1, finished by the swarm), then round 2
        assert asked == [(1, False), (2, True)], asked
        assert opt.step_count == 1 and opt.samples_since == [4.0, 0.0]
        opt.close()
    finally:
        daemon.stop()


def test_the_daemon_averages_a_behind_round_only_where_the_swarm_has_not_finished_it(tmp_path, monkeypatch) -> None:
    """behind=True: where progress records say others finished the outer round, it is not averaged (no group of it
    is left; the agreement gives the swarm's); else the reply is "current", nothing ran, and it says how long ago the
    others finished their last outer round (``swarm_lag_s``: the replica counts forward by it)."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2))
    other = b"\x07" * 32
    progress: list[list[tuple[bytes, int, float]]] = [[]]

    async def read_progress(run_id: str) -> list[tuple[bytes, int, float]]:
        return progress[0]

    monkeypatch.setattr(daemon.service.outer, "_progress", read_progress)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=1,
                     sync_state=False, state_every=0)
        opt.step_count = 5
        calls = len(daemon.averager.calls)
        got = opt.outer_step(0, behind=True)
        assert got["outcome"] == "current" and "swarm_lag_s" not in got  # nobody else known: no lag either
        # the others finished round 4 (its last Moshpit round: 4 * OUTER_ROUNDS + 3) 2.5 s ago, not round 5
        progress[0] = [(other, 4 * OUTER_ROUNDS + 3, time.time() - 2.5), (b"\x08" * 32, 3 * OUTER_ROUNDS, 0.0)]
        got = opt.outer_step(0, behind=True)
        assert got["outcome"] == "current" and 2.4 <= got["swarm_lag_s"] <= 3.5, got
        assert len(daemon.averager.calls) == calls
        progress[0] = [(other, 5 * OUTER_ROUNDS, time.time())]
        got = opt.outer_step(0, behind=True)
        assert got["outcome"] == "alone" and len(daemon.averager.calls) == calls  # not averaged
        with pytest.raises(Exception, match="behind must be"):
            opt._client.call("trainer_outer", session=opt.session, step=opt.ticket + 1, round=6, length=4,
                             behind="yes")
        opt.close()
    finally:
        daemon.stop()


def test_a_member_that_adopted_late_counts_forward_by_the_swarms_lead(tmp_path, monkeypatch) -> None:
    """A member that reached an outer step after the swarm had averaged it (a joiner, a trainer whose evaluation ran
    long) adopts the swarm's average and starts its inner steps the swarm's lead behind: it counts forward the steps
    the swarm takes in that lead (``swarm_lag_s`` over its median inner step), never past the next outer step, so that
    it reaches that step with the swarm; its next outer step weighs the samples it took, not the steps counted."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2))
    asked: list[tuple[int, bool]] = []
    _swarm_finished(daemon, 10, asked)
    lead = [0.3]

    async def read_progress(run_id: str) -> list[tuple[bytes, int, float]]:
        return [(b"\x07" * 32, 10 * OUTER_ROUNDS, time.time() - lead[0])]

    monkeypatch.setattr(daemon.service.outer, "_progress", read_progress)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=10,
                     sync_state=False, state_every=0)
        x, y = batch(0, 4)

        def inner_step() -> dict:
            time.sleep(0.05)  # the caller's compute
            torch.nn.functional.cross_entropy(m(x), y).backward()
            return opt.step(samples=len(x))

        for _ in range(10):
            reply = inner_step()
        assert asked == [(10, False), (20, True)], asked  # round 10 adopted late; round 20 is the swarm's current
        counted = opt.caught_up
        assert 3 <= counted <= 7 and opt.step_count == 10 + counted, (counted, opt.step_count)
        while opt.step_count < 20:
            reply = inner_step()
        assert asked[-1] == (20, False) and reply["outer"][0]["step"] == 20
        av = daemon.averager
        weights = [w for (_, w), r in zip(av.calls, av.round_numbers, strict=True) if r is not None]
        assert weights[-1] == pytest.approx(len(x) * (10 - counted)), weights
        opt.close()
    finally:
        daemon.stop()


def test_a_forged_lead_moves_a_replica_at_most_to_just_short_of_its_next_outer_step_hostile(tmp_path) -> None:
    """``swarm_lag_s`` rests on progress records' times, their writers' claims: a record claiming the swarm finished
    an hour ago (MAX_LAG_S) makes a replica that adopted late count forward at most to the step before its next
    outer step (it still takes one inner step, and its weight stays the samples it took); a record from the future
    counts for no lead; records of this member itself or of rounds it has not reached count for nothing."""
    from peerd.torch.diloco import MIN_INNER_TIMES
    from peerd.trainer.outer_step import MAX_LAG_S, swarm_lag_s

    me, other = b"\x01" * 32, b"\x02" * 32
    assert swarm_lag_s([(other, 8, -1e12)], me, 12, 1000.0) == MAX_LAG_S
    assert swarm_lag_s([(other, 8, 2000.0)], me, 12, 1000.0) == 0.0
    assert swarm_lag_s([(me, 8, 0.0), (other, 12, 0.0)], me, 12, 1000.0) is None
    # the latest round's last writer counts, not an older round's
    assert swarm_lag_s([(other, 8, 990.0), (b"\x03" * 32, 4, 0.0)], me, 12, 1000.0) == 10.0
    with thread_daemon(tmp_path, 1, wait_s=0.2) as daemon:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=10,
                     fragments=2, sync_state=False, state_every=0)
        opt._inner_times.extend([0.05] * MIN_INNER_TIMES)
        opt.step_count = 10  # fragment 0's outer step just landed; fragment 1's comes after step 15
        assert opt._count_forward(MAX_LAG_S) == 4 and opt.step_count == 14 and opt.caught_up == 4
        assert opt._count_forward(MAX_LAG_S) == 0 and opt.step_count == 14
        assert opt._count_forward(float("nan")) == 0 and opt._count_forward(-5.0) == 0
        opt.close()


def test_an_outer_step_alone_waits_for_as_many_finals_as_its_last_step_agreed_with(tmp_path, monkeypatch) -> None:
    """The daemon tells the agreement of an outer step it averaged alone how many members held its final at the
    session's last outer step: alone because it came before its swarm, it then waits for the swarm's finals instead
    of ending with its own vector after ALONE_SETTLE_S (the agreement core's tests show the wait)."""
    import types

    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2))
    told: list[int] = []

    async def fake_agree(board, node, out, **kw):
        told.append(kw["expect"])
        return types.SimpleNamespace(vector=out, final=hashlib.sha256(out.tobytes()).digest(), repaired_bytes=0,
                                     adopted_bytes=0, adopted=False, members=3, dissent=0, states=3,
                                     state_winner=b"", ignored=0, pushed=0, reads=1, phases={})

    outer = daemon.service.outer
    monkeypatch.setattr(outer, "statesync", types.SimpleNamespace(dht=object(), forget=lambda key: None))
    monkeypatch.setattr(outer_step, "DhtBoard", lambda *a, **kw: types.SimpleNamespace(node=b"", addr=None))
    monkeypatch.setattr(outer_step, "agree", fake_agree)

    async def no_progress(run_id: str) -> list[tuple[bytes, int, float]]:
        return []

    monkeypatch.setattr(outer, "_progress", no_progress)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=1,
                     sync_state=False, state_every=0)
        x, y = batch(0, 4)
        for _ in range(2):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            assert opt.step(samples=len(x))["outcome"] == "alone"
        assert told == [1, 3], told  # its first step knew no swarm; the second, the 3 its first agreed with
        opt.close()
    finally:
        daemon.stop()


def test_progress_claims_of_a_swarm_always_ahead_move_a_replica_a_bounded_number_of_rounds_hostile(
        tmp_path, monkeypatch) -> None:
    """Progress records are their writers' claims: members (or minted ids) that claim every later round finished
    make a replica behind take at most MAX_CATCH_UP_OUTER rounds in one step, each an agreed average (here
    alone, in-process), never an endless loop."""
    from peerd.torch.diloco import MAX_CATCH_UP_OUTER

    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size=1, wait_s=0.2))
    original = daemon.service._op_outer

    async def claims_ahead(run_id: str) -> list[tuple[bytes, int, float]]:
        return [(b"\x66" * 32, MAX_ROUND, time.time())]

    async def adopted(req, conn):
        reply = await original(req, conn)
        return {**reply, "adopted": True} if reply.get("outcome") == "alone" else reply

    monkeypatch.setattr(daemon.service.outer, "_progress", claims_ahead)
    daemon.server.register("trainer_outer", adopted, connection=True)
    try:
        m = model(0)
        opt = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), run="dl", socket=daemon.path, sync_every=2,
                     sync_state=False, state_every=0)
        x, y = batch(0, 4)
        for _ in range(2):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            reply = opt.step(samples=len(x))
        assert len(reply["outer"]) == 1 + MAX_CATCH_UP_OUTER
        assert opt.step_count == 2 + 2 * MAX_CATCH_UP_OUTER and opt.caught_up == 2 * MAX_CATCH_UP_OUTER
        assert all(torch.isfinite(p).all() for p in m.parameters())
        opt.close()
    finally:
        daemon.stop()
