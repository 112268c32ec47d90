"""The early all-gather: an owner sends the ranges every reduce-scatter stream is past while its slowest streams
still run (protocol/allreduce.md, "Phases at a receiver"), so a sender done with its reduce-scatter does not
leave its uplink idle until the slowest contribution to its shard has come."""

from __future__ import annotations

import numpy as np
import pytest

from peerd.allreduce import BodyType, GroupAverage, Outcome
from peerd.allreduce.robust import Robust
from peerd.sim.net import Link

from .test_allreduce_core import Net, check_results, inputs, make_group

RS_DATA, RS_END, AG_DATA, AG_END = (int(t) for t in BodyType)
PER = 10


def _group(n: int = 3, length: int = 3000, seed: int = 5, **kw) -> tuple[list[GroupAverage], list, list]:
    xs, ws = inputs(n, length, seed=seed)
    return make_group(xs, ws, PER, floor_s=100.0, **kw), xs, ws


def _rs_to(core: GroupAverage, dest: int) -> list:
    """Every reduce-scatter datagram ``core`` sends to ``dest``, in its send order (data, then END copies)."""
    return [o for o in core.next_datagrams(100_000) if o.to == dest and o.type in (RS_DATA, RS_END)]


def _ag_ranges(outs: list) -> set[int]:
    return {int.from_bytes(o.body[9:13], "little") for o in outs if o.type == AG_DATA}


def test_the_all_gather_sends_what_every_stream_is_past_before_the_slowest_ends():
    m, xs, ws = _group()
    owner = m[0]
    lo, hi = owner.layout.shard(0)
    from1, from2 = _rs_to(m[1], 0), _rs_to(m[2], 0)
    assert _rs_to(owner, 1)  # its own reduce-scatter is all out
    for o in from1:
        owner.receive(1, o.type, o.body, 0.1)
    half = [o for o in from2 if o.type == RS_DATA][:57]
    for o in half:
        owner.receive(2, o.type, o.body, 0.2)
    assert not owner.reduce_scatter_done
    out = owner.next_datagrams(100_000)
    sent = _ag_ranges(out)
    # whole blocks of ranges that both streams are past, to both other members; nothing beyond the frontier
    assert sent and max(sent) < lo + 57 * PER and all(o.to in (1, 2) for o in out if o.type == AG_DATA)
    assert len(sent) % owner._block_rows == 0 or max(sent) + PER >= lo + 57 * PER
    assert not owner.wants_to_send  # waiting for the slow stream, not spinning
    before = owner.phase_changes
    for o in from2[57:]:
        owner.receive(2, o.type, o.body, 0.3)
    assert owner.reduce_scatter_done and owner.phase_changes > before and owner.wants_to_send
    rest = owner.next_datagrams(100_000)
    everything = sent | _ag_ranges(rest)
    assert everything == set(range(lo, hi, PER))
    assert not sent & _ag_ranges(rest)  # each range once
    # the same averages as an owner that waited for its reduce-scatter to end
    m2, _, _ = _group(early_gather=False)
    late_owner = m2[0]
    _rs_to(late_owner, 1)
    for core, src in ((m2[1], 1), (m2[2], 2)):
        for o in _rs_to(core, 0):
            late_owner.receive(src, o.type, o.body, 0.1)
    late = {o.body for o in late_owner.next_datagrams(100_000) if o.type == AG_DATA}
    assert {o.body for o in out + rest if o.type == AG_DATA} == late  # the same bodies, to the same members


def test_a_range_already_gathered_takes_no_late_reduce_scatter_data():
    """A stream's datagram that arrives after a later one of it (reordered) finds its range final: late,
    counted, never summed; the stream is then seen reordered and holds the frontier."""
    m, xs, ws = _group(seed=7)
    owner = m[0]
    lo, _ = owner.layout.shard(0)
    _rs_to(owner, 1)
    from1 = [o for o in _rs_to(m[1], 0) if o.type == RS_DATA]
    from2 = [o for o in _rs_to(m[2], 0) if o.type == RS_DATA]
    held = from2[3]  # range 3 of member 2's stream is overtaken
    for o in from1[:80]:
        owner.receive(1, o.type, o.body, 0.1)
    for o in from2[:80]:
        if o is not held:
            owner.receive(2, o.type, o.body, 0.1)
    sent = _ag_ranges(owner.next_datagrams(100_000))
    assert lo + 3 * PER in sent
    assert owner.receive(2, RS_DATA, held.body, 0.2) is Outcome.LATE
    assert owner.statistics().drops == {"late": 1}
    # the range is member 0's and 1's alone
    r = owner._out[lo + 3 * PER : lo + 4 * PER]
    want = (ws[0] * xs[0][lo + 3 * PER : lo + 4 * PER].astype(np.float64)
            + ws[1] * xs[1][lo + 3 * PER : lo + 4 * PER]) / (ws[0] + ws[1])
    np.testing.assert_allclose(r, want, atol=1e-5)
    # reordered now: member 2's stream holds the frontier, however far member 1's goes
    for o in from1[80:]:
        owner.receive(1, o.type, o.body, 0.3)
    for o in from2[80:120]:
        owner.receive(2, o.type, o.body, 0.3)
    assert not _ag_ranges(owner.next_datagrams(100_000))
    assert not owner.wants_to_send


def test_a_block_of_late_data_into_gathered_ranges_is_taken_apart():
    m, xs, ws = _group(seed=9)
    owner = m[0]
    _rs_to(owner, 1)
    from1 = [o for o in _rs_to(m[1], 0) if o.type == RS_DATA]
    from2 = [o for o in _rs_to(m[2], 0) if o.type == RS_DATA]
    for o in from1 + from2[:2] + from2[60:]:  # member 2's ranges 2..59 overtaken by the rest of its stream
        owner.receive(1 if o in from1 else 2, o.type, o.body, 0.1)
    assert _ag_ranges(owner.next_datagrams(100_000))
    block = np.stack([np.frombuffer(o.body, np.uint8) for o in from2[2:60]])
    assert owner.receive_block(2, RS_DATA, block, 0.2) is None  # the caller feeds it body by body: late


def test_off_without_early_gather_and_with_robust():
    for kw in ({"early_gather": False}, {"robust": Robust("clip", 3.0)}):
        m, _, _ = _group(**kw)
        owner = m[0]
        _rs_to(owner, 1)
        for o in _rs_to(m[1], 0):
            owner.receive(1, o.type, o.body, 0.1)
        assert not owner.wants_to_send and not _ag_ranges(owner.next_datagrams(100_000))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_slow_sender_under_loss_averages_exactly_what_arrived(seed):
    """Member 3's uplink a tenth of the others': the others' all-gathers run beside its reduce-scatter, and
    every result is the independent computation over what the network delivered."""
    xs, ws = inputs(4, 20000, seed=seed)
    m = make_group(xs, ws, 37, floor_s=5.0)
    net = Net(m, drop=lambda w: (w.seq * 7 + seed) % 23 == 0, gap=2e-5, seed=seed)
    for d in range(3):
        net.net.set_link(3, d, Link(latency=0.01, bandwidth=(37 * 4 + 19) / 4e-4))
    net.run()
    check_results(m, xs, ws, 37, net)
    for i in range(3):  # each fast owner's all-gather reached member 1 or 2 before its own reduce-scatter ended
        ended = m[i].phase_state(0)[1]
        firsts = [m[j].progress(1)[3][i] for j in range(3) if j != i]
        assert min(firsts) < ended
