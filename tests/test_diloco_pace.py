"""DiLoCo's ``keep_pace``: a replica the others wait for at outer steps counts inner steps forward, so the swarm's
outer steps go at its faster members' pace. The waits travel in the outer records (OuterRecord.wait), the group's
median comes out of the agreement (OuterAgreement.statistics), and ``pace_skip`` turns them into steps."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

import msgpack
import numpy as np
import pytest

from peerd.torch.diloco import DiLoCo, pace_skip
from peerd.trainer.agreement import OuterAgreement
from peerd.trainer.records import MAX_WAIT_S, OuterRecord, piece_hashes, shard_bounds

from .support.virtual import sha  # noqa: E402

IDS = [bytes([0, i]) * 16 for i in range(5)]
TRUTH = np.random.default_rng(7).standard_normal(3_000).astype(np.float32)


def record(i: int, wait: float | None, *, size: int = 4, group: str = "g", node: bytes | None = None) -> OuterRecord:
    data = TRUTH.tobytes()
    a, b = shard_bounds(TRUTH.size, size, i)
    shard = data[4 * a: 4 * b]
    return OuterRecord(node or IDS[i], group, size, i, sha(shard), sha(data + piece_hashes(shard)), sha(data), b"",
                       TRUTH.size, ("127.0.0.1", 9), wait)


def agreement(index: int, wait: float | None, size: int = 4) -> OuterAgreement:
    return OuterAgreement(IDS[index], TRUTH.tobytes(), group="g", size=size, index=index, state=b"", repair_s=30.0,
                          deadline_s=60.0, members=IDS[:size], expect=size, wait_s=wait)


# -- pace_skip ------------------------------------------------------------------------------------------------
def test_a_replica_behind_its_group_twice_in_a_row_counts_forward_what_they_waited() -> None:
    # the others waited 2.9 s for this replica (0.29 s an inner step), once: it may have been a busy moment
    assert pace_skip(0, 2.89, None, 0.29, 20) == 0
    assert pace_skip(0, 2.89, -0.1, 0.29, 20) == 0
    # behind by 2.9 s and 3.2 s at two outer steps in a row: it counts forward the lesser, 9 steps, from now on
    assert pace_skip(0, 3.2, 2.89, 0.29, 20) == 9
    # it came with them since: it keeps counting forward as many
    assert pace_skip(9, 0.01, 0.05, 0.29, 20) == 9
    # it waited for them now (0.6 s, two of its steps): two fewer at once
    assert pace_skip(9, -0.6, 0.01, 0.29, 20) == 7


def test_a_fast_replica_never_counts_forward_and_noise_under_a_step_moves_nothing() -> None:
    assert pace_skip(0, -2.9, -2.9, 0.145, 20) == 0  # it waited for a straggler: nothing to count
    assert pace_skip(0, 0.05, 0.1, 0.145, 20) == 0  # behind by less than a step: nothing
    assert pace_skip(3, 0.1, 0.1, 0.145, 20) == 3
    assert pace_skip(3, -0.1, 0.1, 0.145, 20) == 3


def test_pace_skip_is_bounded_whatever_the_waits_say_hostile() -> None:
    """A group's told waits are another member's claims: at most half a period more at a time, never the whole
    period (a replica always takes one real inner step), and non-finite numbers change nothing."""
    assert pace_skip(0, 1e9, 1e9, 0.1, 20) == 10
    assert pace_skip(10, 1e9, 1e9, 0.1, 20) == 19
    assert pace_skip(19, 1e9, 1e9, 0.1, 20) == 19
    assert pace_skip(5, float("nan"), 1.0, 0.1, 20) == 5
    assert pace_skip(5, 1.0, float("nan"), 0.1, 20) == 5
    assert pace_skip(5, float("inf"), 1.0, 0.1, 20) == 5
    assert pace_skip(5, 1.0, 1.0, 0.0, 20) == 5
    assert pace_skip(5, -1e9, None, 0.1, 20) == 0
    assert pace_skip(0, 1e9, 1e9, 0.1, 1) == 0  # an outer step every step: nothing to count


# -- the record's wait ----------------------------------------------------------------------------------------
def test_a_records_wait_round_trips_and_is_optional() -> None:
    rec = record(1, 2.5)
    assert OuterRecord.decode(rec.node, rec.encode()) == rec
    bare = record(1, None)
    assert "w" not in msgpack.unpackb(bare.encode(), raw=False)  # older members' records look the same
    assert OuterRecord.decode(bare.node, bare.encode()) == bare


@pytest.mark.parametrize("wait", [-1.0, float("nan"), float("inf"), MAX_WAIT_S + 1, "3", True, [1.0], None])
def test_a_bad_wait_is_not_read_and_the_record_still_counts_hostile(wait) -> None:
    raw = msgpack.unpackb(record(2, 1.0).encode(), raw=False)
    raw["w"] = wait
    got = OuterRecord.decode(IDS[2], msgpack.packb(raw, use_bin_type=True))
    assert got is not None and got.wait is None and got.final == sha(TRUTH.tobytes())


def test_the_golden_vectors_record_tells_its_wait() -> None:
    """protocol/vectors/messages.json's ``outer_record_waited``: its record decodes with its ``w``."""
    import json
    from pathlib import Path

    vectors = json.loads((Path(__file__).parent.parent / "protocol" / "vectors" / "messages.json").read_text())
    vector = next(v for v in vectors["messages"] if v["name"] == "outer_record_waited")
    body = msgpack.unpackb(bytes.fromhex(vector["body"]), raw=False)
    rec = OuterRecord.decode(b"n" * 32, body["record"])
    assert rec is not None and rec.wait == 2.875 and rec.index == 1


# -- the agreement's median -----------------------------------------------------------------------------------
def test_the_agreement_publishes_its_wait_and_tells_the_median_of_the_others() -> None:
    c = agreement(3, 0.01)
    c.start(0.0)
    published = [a.record for a in c.take_actions() if hasattr(a, "record")]
    assert published and published[0].wait == 0.01
    c.receive_records(1, [record(0, 2.9), record(1, 2.7), record(2, 3.1), record(3, 0.01)], 0.1)
    assert c.statistics().group_wait_s == 2.9  # its own record does not count


def test_only_the_groups_own_members_tell_the_group_wait_hostile() -> None:
    """A record from outside the group, or one naming another group, cannot move a member's pace; one liar among
    three members moves the median no further than the honest ones allow."""
    c = agreement(3, 0.01)
    c.start(0.0)
    c.take_actions()
    stranger = record(1, MAX_WAIT_S, node=b"\x09" * 32)
    other_group = record(2, MAX_WAIT_S, group="h")
    c.receive_records(1, [stranger, other_group, record(0, 0.5)], 0.1)
    assert c.statistics().group_wait_s == 0.5
    c.receive_records(2, [record(0, 0.5), record(1, MAX_WAIT_S), record(2, 0.4)], 0.2)
    assert c.statistics().group_wait_s == 0.5
    alone = OuterAgreement(IDS[0], TRUTH.tobytes(), group="", size=1, index=0, state=b"", repair_s=1.0,
                           deadline_s=2.0, wait_s=0.3)
    alone.start(0.0)
    alone.take_actions()
    alone.receive_records(1, [record(1, 9.0)], 0.1)
    assert alone.statistics().group_wait_s is None  # alone: there is no group that waited


def test_an_agreement_given_a_bad_wait_tells_none() -> None:
    for bad in (-0.5, MAX_WAIT_S * 2):
        c = agreement(0, bad)
        c.start(0.0)
        assert all(a.record.wait is None for a in c.take_actions() if hasattr(a, "record"))


# -- the trainer's side -------------------------------------------------------------------------------------
def _paced(step: int, sync_every: int = 10, fragments: int = 1, keep: bool = True) -> DiLoCo:
    """A DiLoCo's pacing state alone (``_keep_pace`` reads nothing else): no daemon needed."""
    d = DiLoCo.__new__(DiLoCo)
    d.keep_pace, d.fragments, d.sync_every, d.step_count = keep, fragments, sync_every, step
    d._skip, d._pace_due, d.paced_steps, d._inner_times, d._late_prev = 0, 0, 0, deque([0.1] * 5), None
    d.auto_outer, d.pace_report, d.reports = {"compression": "int8"}, {}, []
    d._call = lambda op, **args: d.reports.append((op, args)) or {}
    return d


def _twice(d: DiLoCo, wait: float, group: float) -> int:
    """Two outer steps in a row behind the group alike (pace_skip counts forward only then)."""
    d._keep_pace({"outcome": "averaged", "wait_s": wait, "group_wait_s": group})
    return d._keep_pace({"outcome": "averaged", "wait_s": wait, "group_wait_s": group})


def test_keep_pace_counts_forward_short_of_the_next_outer_step() -> None:
    d = _paced(10)
    assert d._keep_pace({"outcome": "averaged", "wait_s": 0.0, "group_wait_s": 0.45}) == 0  # once: not yet
    assert d._keep_pace({"outcome": "averaged", "wait_s": 0.0, "group_wait_s": 0.45}) == 4
    assert (d.step_count, d._pace_due) == (10, 4)  # counted at the period's first inner step
    # an overlapped outer step lands a step later: the count still stops before the next outer step (step 20)
    d = _paced(19)
    d._skip = 8
    assert d._keep_pace({"outcome": "averaged", "wait_s": 0.0, "group_wait_s": 0.0}) == 0
    assert (d.step_count, d._pace_due) == (19, 0)


def test_the_pace_and_why_reach_peerd_status_when_it_changes() -> None:
    from peerd.status.text import trainer_lines

    d = _paced(10)
    _twice(d, 0.01, 0.45)
    assert [op for op, _ in d.reports] == ["trainer_report"]
    auto = d.reports[0][1]["auto"]
    assert auto["compression"] == "int8" and auto["pace_skip"] == 4 and "waited 0.45 s" in auto["pace"]
    d.step_count = 20
    d._keep_pace({"outcome": "averaged", "wait_s": 0.02, "group_wait_s": 0.03})  # the same pace: nothing to say
    assert len(d.reports) == 1
    d._keep_pace({"outcome": "averaged", "wait_s": 0.35, "group_wait_s": 0.03})  # it waited: fewer at once
    assert len(d.reports) == 2 and d.reports[1][1]["auto"]["pace_skip"] == 1
    lines = trainer_lines([{"session": 1, "run": "r", "steps": 20, "auto": auto}])
    assert any(line.strip().startswith("pace: 4 of each outer period's 10 inner steps") for line in lines), lines


@pytest.mark.parametrize("last", [{"outcome": "alone", "wait_s": 0.0, "group_wait_s": 5.0},
                                  {"outcome": "averaged", "wait_s": 0.0},
                                  {"outcome": "averaged", "wait_s": 0.0, "group_wait_s": "5"}])
def test_keep_pace_needs_a_group_and_both_waits(last) -> None:
    d = _paced(10)
    d._keep_pace({"outcome": "averaged", "wait_s": 0.0, "group_wait_s": 5.0})
    assert d._keep_pace(last) == 0 and d.step_count == 10
    # the lateness before it does not count toward the next: two averaged outer steps in a row again
    assert d._keep_pace({"outcome": "averaged", "wait_s": 0.0, "group_wait_s": 5.0}) == 0


def test_keep_pace_off_or_with_periods_of_one_step_counts_nothing() -> None:
    for d in (_paced(10, keep=False), _paced(10, sync_every=6, fragments=6)):
        assert _twice(d, 0.0, 5.0) == 0


def test_with_fragments_a_period_is_the_steps_between_two_fragments_outer_steps() -> None:
    d = _paced(10, sync_every=10, fragments=2)  # fragment 1's outer step comes at step 15
    assert _twice(d, 0.0, 5.0) == 2  # half of 5, at most
    d._skip = 4
    d.step_count = 15
    assert d._keep_pace({"outcome": "averaged", "wait_s": 0.0, "group_wait_s": 5.0}) == 4  # 4 of 5: up to step 19


# -- end to end: real daemons, a straggler ------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_straggler_keeps_the_swarms_pace_and_every_replica_agrees(tmp_path) -> None:
    """3 daemons, 3 DiLoCo trainers in threads, one of them taking three times as long a step: it counts inner
    steps forward from its second outer step on, the others' waits for it shrink, and every outer step leaves the
    three on one outer state."""
    torch = pytest.importorskip("torch")
    from peerd.tools.swarm import LocalSwarm

    steps, h = 60, 10
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    models = []
    for _ in range(3):  # (here: torch's global generator is not the threads' to share)
        torch.manual_seed(0)
        models.append(torch.nn.Linear(16, 4))

    def trainer(i: int, socket: str, step_s: float) -> None:
        try:
            model = models[i]
            opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), run="pace", socket=socket,
                         sync_every=h, outer_lr=1.0, outer_momentum=0.0, sync_state=False, state_every=0,
                         compression="fp32", timeout_s=30.0)
            gen = torch.Generator().manual_seed(i)
            outer, waits = [], []
            while opt.step_count < steps:
                opt.zero_grad()
                x = torch.randn(8, 16, generator=gen)
                model(x).pow(2).mean().backward()
                time.sleep(step_s)
                reply = opt.step(samples=8)
                for o in reply.get("outer", []):
                    outer.append((o["step"], o["sha"], o["group_size"]))
                    waits.append(o.get("wait_s", 0.0))
            results[i] = {"outer": outer, "waits": waits, "paced": opt.paced_steps, "sha": opt.state_sha().hex()}
            opt.close()
        except BaseException as e:  # (reported by the test's thread)
            errors.append(e)

    with LocalSwarm(str(tmp_path / "swarm")) as swarm:
        nodes = swarm.start_many(3)
        threads = [threading.Thread(target=trainer, args=(i, n.socket, 0.09 if i == 2 else 0.03), daemon=True)
                   for i, n in enumerate(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    assert not errors, errors
    assert len(results) == 3
    assert results[2]["paced"] >= h // 2, results[2]  # the straggler counted forward about half of each period
    assert results[0]["paced"] <= 2 and results[1]["paced"] <= 2  # the others hardly ever
    shas = [{(s, sha) for s, sha, size in r["outer"] if size == 3} for r in results.values()]
    common = shas[0] & shas[1] & shas[2]
    assert len(common) >= 3, shas  # outer steps with all three, each leaving them on one state
    assert len({r["sha"] for r in results.values()}) == 1
    fast = results[0]["waits"]
    # the fast trainers waited for the straggler at the first outer steps, much less once it kept their pace
    assert statistics.median(fast[-3:]) < 0.5 * max(fast[:2]), fast
