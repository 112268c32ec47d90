"""Compression in the trainer path: trainers declare the codec in trainer_open, and every average of their run
goes through Moshpit and the averaging core in it. Real daemon pieces (TrainerService with a real arena and
connection, MoshpitService, AllreduceService, endpoints, DHT) over tests/memnet.py in virtual time."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from peerd.allreduce.robust import MAX_C, Robust
from peerd.localsock.server import OpError
from peerd.moshpit.service import MoshpitError, check_compression, codec_run_key
from peerd.trainer import TrainerService

from .support.memnet import MemNet, run_on_memnet
from .support.moshpit_swarm import swarm
from .support.sessions import ELEMS, Trainer
from .support.virtual import counter_value

WEIGHTS = [1.0, 2.0, 3.0]


async def _steps(trainers: list[Trainer], vectors: list[np.ndarray], weights: list[float]) -> list[tuple]:
    out: list = [None] * len(trainers)

    async def one(i: int) -> None:
        out[i] = await trainers[i].step(vectors[i], weights[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(trainers)):
            nursery.start_soon(one, i)
    return out


def _three_trainers(options: dict, rounds: int = 2) -> tuple[list, list]:
    """Three daemons, one trainer each, ``rounds`` gradient steps of seeded vectors; the trainers' results."""
    results: list = []
    metrics: list = []

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 3)
        trainers = [Trainer(TrainerService(n.metrics, n.moshpit.average, peer_id=n.identity.node_id.hex()))
                    for n in nodes]
        for t in trainers:
            reply = await t.open(**options)
            assert reply.get("compression") == options.get("compression")
        rng = np.random.default_rng(5)
        for _ in range(rounds):
            vectors = [rng.standard_normal(ELEMS).astype(np.float32) * (i + 1) for i in range(3)]
            results.append((vectors, await _steps(trainers, vectors, WEIGHTS)))
        metrics.extend(n.metrics for n in nodes)
        for t in trainers:
            t.close()

    run_on_memnet(main, seed=17)
    return results, metrics


def test_int8_trainers_average_through_the_daemons_and_every_member_holds_the_same_bytes() -> None:
    results, metrics = _three_trainers({"compression": "int8", "quant_group": 64})
    weights = WEIGHTS
    for vectors, steps in results:
        exact = sum(w * v.astype(np.float64) for w, v in zip(weights, vectors, strict=True)) / sum(weights)
        replies = [r for r, _ in steps]
        outs = [o for _, o in steps]
        assert all(r["outcome"] == "averaged" and r["group_size"] == 3 for r in replies), replies
        assert all(np.array_equal(outs[0], o) for o in outs[1:])  # replicas agree bit for bit
        err = np.abs(outs[0] - exact)
        # two int8 steps (reduce-scatter, all-gather) of groups of 64: each within a step of the group's range
        step = (np.abs(np.stack(vectors)).max() * 2) / 255
        assert err.max() < 2 * step * sum(weights)
        assert err.max() > 1e-6  # it was quantized: an fp32 average is exact to ~1e-7 here
        assert abs(float(np.mean(outs[0] - exact))) < 0.01 * step  # no systematic shift
    for m in metrics:
        assert counter_value(m.moshpit_rounds, outcome="averaged", codec="int8") == 2
        assert counter_value(m.moshpit_bytes_sent, codec="int8") > 0
        assert counter_value(m.moshpit_bytes_sent, codec="fp32") == 0


def test_the_codec_cuts_the_bytes_each_member_sends() -> None:
    sent = {}
    for name in ("fp32", "int8", "int4"):
        _, metrics = _three_trainers({"compression": name}, rounds=1)
        sent[name] = sum(counter_value(m.moshpit_bytes_sent, codec=name) for m in metrics)
    # 2,050 elements: datagram and tensor headers weigh more than at 25M (int8 0.258, int4 0.133 there)
    assert sent["int8"] < 0.35 * sent["fp32"] and sent["int4"] < 0.7 * sent["int8"], sent


def test_trainer_open_refuses_unknown_codecs_and_a_second_codec_in_one_run() -> None:
    async def main() -> None:
        calls: list[dict] = []

        async def average(run_id, vector, weight, **kw):  # noqa: ANN001, ANN202 - a recorder
            calls.append(kw)
            raise RuntimeError("no swarm")

        from peerd.metrics import Metrics

        service = TrainerService(Metrics(), average)
        bad = [({"compression": "int9"}, "compression must be one of"),
               ({"compression": "arc-topk", "topk_ratio": 2}, "topk_ratio must be"),
               ({"compression": "fp16", "quant_group": 64}, "int8 and int4"),
               ({"compression": "int4", "rounding": "up"}, "rounding must be"),
               ({"compression": "int8", "quant_group": 0}, "quant_group")]
        for options, message in bad:
            t = Trainer(service)
            with pytest.raises(OpError, match=message):
                await t.open(**options)
            t.close()
        first, second, third = Trainer(service), Trainer(service), Trainer(service)
        assert (await first.open(compression="int4", rounding="nearest"))["quant_group"] == 128
        with pytest.raises(OpError, match="same compression"):
            await second.open(compression="int8")
        with pytest.raises(OpError, match="same compression"):
            await third.open()
        await first.step(np.ones(ELEMS, np.float32), 1.0)  # the averager fails: the trainer keeps its vector
        # (a gradient average's default robust: the weight bound and the direction test)
        assert calls == [{"timeout_s": 30.0, "compression": "int4", "quant_group": 128, "rounding": "nearest",
                          "robust": Robust("clip", MAX_C)}]
        for t in (first, second, third):
            t.close()

    trio.run(main)


def test_check_compression_and_the_rounding_run_key() -> None:
    assert check_compression("fp32") is None
    assert check_compression("int8", 32, "nearest").group == 32  # type: ignore[union-attr]
    with pytest.raises(MoshpitError):
        check_compression("int8", 70000)
    keys = {codec_run_key("r", n) for n in range(100)} | {codec_run_key("s", 0)}
    assert len(keys) == 101 and all(0 <= k < 2**64 for k in keys)
    assert codec_run_key("r", 3) == codec_run_key("r", 3)


def test_arc_topk_trainers_get_the_same_ef21m_direction_and_their_parameter_averages_stay_fp32() -> None:
    results, metrics = _three_trainers({"compression": "arc-topk", "topk_ratio": 0.25}, rounds=2)
    for _, steps in results:
        replies = [r for r, _ in steps]
        outs = [o for _, o in steps]
        assert all(r["outcome"] == "averaged" and r["group_size"] == 3 for r in replies), replies
        assert all(np.array_equal(outs[0], o) for o in outs[1:]) and np.isfinite(outs[0]).all()
    for m in metrics:
        assert counter_value(m.moshpit_rounds, outcome="averaged", codec="arc-topk") == 2
    # round 1 (a fresh EF21M state): u is the weighted mean of the selected rows and whole tensors, 0 elsewhere
    vectors, steps = results[0]
    exact = sum(w * v.astype(np.float64) for w, v in zip(WEIGHTS, vectors, strict=True)) / sum(WEIGHTS)
    u = steps[0][1]
    picked = u != 0
    assert 0.2 < picked.mean() < 0.4  # a quarter of the 40 rows and the 50-element bias
    np.testing.assert_allclose(u[picked], exact[picked], atol=1e-5)
    assert picked[2000:].all()  # the 1-D tensor goes whole


def test_the_demo_counts_averaged_bytes_in_the_runs_codec() -> None:
    """bytes_sent_per_peer in sync mode: one encoded copy per average in the run's codec (it counted 4 bytes a
    value whatever the codec); arc-topk's gradients from the round's UDP bytes, its parameters in fp32."""
    import argparse

    from peerd.tools.demo_train import averaged_bytes

    def count(name: str | None, **kw: object) -> int:
        return averaged_bytes(argparse.Namespace(compression=name, **kw), 1_000_000, {})

    assert count(None) == count("fp32") == 4_000_000
    assert count("fp16") == count("bf16") == 2_000_000
    assert count("int8") == 1_000_000 + 4 * -(-1_000_000 // 128)  # values, and an fp16 scale and min per group
    assert count("int4", quant_group=256) == 500_000 + 4 * -(-1_000_000 // 256)
    ns = argparse.Namespace(compression="arc-topk")
    assert averaged_bytes(ns, 1000, {"group_size": 4, "bytes_sent": 900}) == 600  # 2 (n - 1) / n of a copy sent
    assert averaged_bytes(ns, 1000, {"group_size": 4, "bytes_sent": 900}, "params") == 4000
    assert averaged_bytes(ns, 1000, {"group_size": 1, "bytes_sent": 0}) == 4000
