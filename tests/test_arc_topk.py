"""arc-topk building blocks: sketch, per-shard selection agreed under loss, selection bodies, EF21M replay."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.allreduce import frames
from peerd.compress import CodecError, codec
from peerd.compress.topk import EF21M, TopKLayout, ratio_formula
from peerd.wire.envelope import HEADER_SIZE as ENVELOPE_SIZE
from peerd.wire.seal import TAG_SIZE

from .support.codecs import bytes_sent_per_peer

SHAPES = ((40, 9), (17,), (8, 5, 2), (), (25, 3), (0, 4))


def layout(n: int = 4, ratio: float = 0.25, shapes=SHAPES) -> TopKLayout:
    return TopKLayout(shapes, n, ratio)


def test_layout_partitions_rows_and_fixes_dense_sizes():
    for n in (1, 2, 3, 4, 7):
        lay = layout(n)
        assert lay.rows == 40 + 8 + 25 and lay.whole_length == 17 + 1
        covered = []
        for j in range(n):
            lo, hi = lay.row_shard(j)
            assert sum(p.hi - p.lo for p in lay.pieces(j)) == hi - lo
            assert all(p.k == -(-(p.hi - p.lo) // 4) for p in lay.pieces(j))
            covered.append(lay.shard_elements(j))
            assert lay.dense_shard(j)[1] - lay.dense_shard(j)[0] == lay.dense_size(j)
        allidx = np.sort(np.concatenate(covered))
        assert np.array_equal(allidx, np.arange(lay.length))  # every element in exactly one shard
        assert lay.dense_shard(n - 1)[1] == lay.dense_length


def test_a_matrix_whose_top_rows_would_be_one_row_goes_whole():
    # the demo MLP at ratio 0.1: the 10 x 64 output layer would refresh one class row a step; it goes whole
    lay = TopKLayout(((64, 64), (64,), (10, 64), (10,)), 4, 0.1)
    assert [m[0] for m in lay.matrices] == [0]
    assert lay.whole == [(4096, 64), (4160, 640), (4800, 10)] and lay.rows == 64
    assert [m[0] for m in TopKLayout(((64, 64), (64,), (10, 64), (10,)), 4, 0.2).matrices] == [0, 2]
    x = np.arange(lay.length, dtype=np.float32)
    dense = np.concatenate([lay.gather(x, j, lay.select(j, np.ones(lay.sketch_shard(j)[1] - lay.sketch_shard(j)[0],
                                                                        np.float32))) for j in range(4)])
    assert np.isin(np.arange(4160, 4800), dense).all()  # every element of the output layer, every round


def test_sketch_is_g_v_with_a_shared_pm1_matrix():
    lay = layout()
    x = np.random.default_rng(0).standard_normal(lay.length).astype(np.float32)
    s = lay.sketch(x, 7, 3).reshape(-1, 4)
    v = lay.sketch_matrix(7, 3, 0)
    assert set(np.unique(v).tolist()) == {-1.0, 1.0} and v.shape == (9, 4)
    assert np.allclose(s[:40], x[:360].reshape(40, 9) @ v)
    assert np.allclose(s[40:48], x[377:457].reshape(8, 10) @ lay.sketch_matrix(7, 3, 2))
    assert np.array_equal(v, TopKLayout(SHAPES, 2, 0.5).sketch_matrix(7, 3, 0))  # shared: run and round only
    assert not np.array_equal(v, lay.sketch_matrix(7, 4, 0))


def test_select_takes_the_top_rows_of_each_piece():
    lay = layout(3)
    sk = np.random.default_rng(1).standard_normal(lay.sketch_length).astype(np.float32)
    for j in range(3):
        lo, hi = lay.sketch_shard(j)
        sel = lay.select(j, sk[lo:hi])
        score = (sk[lo:hi].reshape(-1, 4).astype(np.float64) ** 2).sum(1)
        at = 0
        for p, rows in zip(lay.pieces(j), sel, strict=True):
            sc = score[at : at + p.hi - p.lo]
            chosen = rows - p.lo
            assert len(rows) == p.k and (np.diff(rows) > 0).all()
            rest = np.setdiff1d(np.arange(p.hi - p.lo), chosen)
            assert len(rest) == 0 or sc[chosen].min() >= sc[rest].max()
            at += p.hi - p.lo


def test_planted_rows_are_found():
    lay = TopKLayout(((200, 64),), 4, 0.05)
    rng = np.random.default_rng(2)
    g = rng.standard_normal((200, 64)).astype(np.float32) * 0.1
    planted = np.array([3, 60, 61, 120, 199])
    g[planted] *= 50
    sk = lay.sketch(g.reshape(-1), 1, 1)
    got = np.concatenate([lay.select(j, sk[slice(*lay.sketch_shard(j))])[0] for j in range(4)])
    assert set(planted) <= set(got.tolist())


def test_selection_bodies_roundtrip_and_refuse_malformed():
    lay = layout(3)
    sk = np.random.default_rng(3).standard_normal(lay.sketch_length).astype(np.float32)
    for j in range(3):
        sel = lay.select(j, sk[slice(*lay.sketch_shard(j))])
        body = lay.encode_selection(j, sel)
        assert len(body) == lay.selection_size(j)
        back = lay.decode_selection(j, body)
        assert all(np.array_equal(a, b) for a, b in zip(sel, back, strict=True))
        with pytest.raises(CodecError):
            lay.decode_selection(j, body[:-1])
        with pytest.raises(CodecError):
            lay.decode_selection(j, body + b"\0")
        flipped = bytearray(body)
        flipped[0] ^= 1  # one row more or fewer in the first piece
        with pytest.raises(CodecError):
            lay.decode_selection(j, bytes(flipped))
        lo, hi = lay.row_shard(j)
        if (hi - lo) % 8:
            pad = bytearray(body)
            pad[-1] |= 0x80
            with pytest.raises(CodecError):
                lay.decode_selection(j, bytes(pad))


@settings(max_examples=200, deadline=None)
@given(j=st.integers(0, 2), data=st.binary(max_size=12))
def test_fuzz_selection_bodies(j, data):
    lay = layout(3)
    try:
        sel = lay.decode_selection(j, data)
    except CodecError:
        return
    for p, rows in zip(lay.pieces(j), sel, strict=True):
        assert len(rows) == p.k and ((rows >= p.lo) & (rows < p.hi)).all()


def test_selection_agreed_under_loss():
    """Four members, 30 % loss on every datagram but the owner's own: sketch reduce-scatter, owner selects and
    sends its selection, dense reduce-scatter and all-gather. Every member that holds a selection holds the
    owner's; one that lost it sends nothing for that shard and keeps its own values; every averaged row is the
    weighted mean of exactly the contributions that arrived."""
    n, lay = 4, layout(4, 0.2)
    rng = np.random.default_rng(4)
    for rnd in range(20):
        xs = [rng.standard_normal(lay.length).astype(np.float32) for _ in range(n)]
        w = rng.uniform(0.5, 2.0, n)
        arrive = rng.random((n, n, 3)) >= 0.3  # [sender, receiver, phase]
        arrive[np.arange(n), np.arange(n), :] = True
        sketches = [lay.sketch(x, 9, rnd) for x in xs]
        results = [x.copy() for x in xs]
        for j in range(n):
            sl = slice(*lay.sketch_shard(j))
            senders = [i for i in range(n) if arrive[i, j, 0]]
            avg_sk = sum(w[i] * sketches[i][sl] for i in senders) / w[senders].sum()
            sel = lay.select(j, avg_sk.astype(np.float32))
            body = lay.encode_selection(j, sel)
            known = {}
            for i in range(n):
                if arrive[j, i, 1]:
                    known[i] = lay.decode_selection(j, body)
                    assert all(np.array_equal(a, b) for a, b in zip(known[i], sel, strict=True))
            contrib = [i for i in known if arrive[i, j, 2]]  # dense RS: only members that know the rows
            assert j in contrib
            dense = sum(w[i] * lay.gather(xs[i], j, known[i]) for i in contrib) / w[contrib].sum()
            idx = lay.dense_index(j, sel)
            exact = sum(w[i] * xs[i][idx].astype(np.float64) for i in contrib) / w[contrib].sum()
            assert np.allclose(dense, exact, rtol=1e-5, atol=1e-6)
            for i in known:
                if i == j or arrive[j, i, 2]:  # dense AG (reusing the phase draw for the way back)
                    lay.scatter(results[i], j, known[i], dense.astype(np.float32))
            for i in set(range(n)) - set(known):
                own = lay.shard_elements(j)
                assert np.array_equal(results[i][own], xs[i][own])  # kept its own values


def test_wire_ratio_6250x1000_at_ratio_0_1():
    """4 peers, four 6250 x 1000 matrices (25M elements), ratio 0.1, fp32 values, 1200-byte sealed datagrams:
    sketch reduce-scatter + selection bodies (3 copies to each member) + dense reduce-scatter and all-gather,
    over the dense fp32 all-reduce of the same vector."""
    n = 4
    lay = TopKLayout(((6250, 1000),) * 4, n, 0.1)
    overhead = ENVELOPE_SIZE + TAG_SIZE + frames.HEADER_SIZE
    fp32 = codec("fp32")
    per = fp32.max_count(1200 - overhead)

    def stream(elements: int) -> int:
        full, tail = divmod(elements, per)
        return full * 1200 + (overhead + 4 * tail if tail else 0) + frames.END_REPEATS * overhead

    me = 0
    sent = sum(stream(lay.sketch_shard(j)[1] - lay.sketch_shard(j)[0]) for j in range(n) if j != me)
    assert lay.selection_size(me) <= 1200 - overhead
    sent += (n - 1) * 3 * (overhead + lay.selection_size(me))
    sent += sum(stream(lay.dense_size(j)) for j in range(n) if j != me) + (n - 1) * stream(lay.dense_size(me))
    ratio = sent / bytes_sent_per_peer(fp32, lay.length, n, 1200)
    assert 0.1 < ratio <= 0.11, ratio
    assert abs(ratio - ratio_formula(lay)) < 0.002


# ---- EF21M ---------------------------------------------------------------------------------------------


def reference_replay(grads, gots, avgs, eta):
    """The update rule written out element by element (float32 scalars, same operation order): v = h - u is
    sketched, the sent rows of h averaged; u = the average where it arrived, unchanged elsewhere."""
    f = np.float32
    h = u = None
    vs, us = [], []
    for g, got, avg in zip(grads, gots, avgs, strict=True):
        if h is None:
            h, u = list(g), [f(0)] * len(g)
        else:
            h = [f(hi * (f(1) - f(eta))) + f(f(eta) * gi) for hi, gi in zip(h, g, strict=True)]
        v = [f(hi - ui) for hi, ui in zip(h, u, strict=True)]
        for k in range(len(g)):
            if got[k]:
                u[k] = avg[k]
        vs.append(np.array(v, np.float32))
        us.append(np.array(u, np.float32))
    return vs, us


def test_ef21m_matches_a_reference_replay():
    rng = np.random.default_rng(5)
    size, rounds, eta = 60, 25, 0.2
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(rounds)]
    sends = [rng.random(size) < 0.4 for _ in range(rounds)]
    gots = [s & (rng.random(size) < 0.8) for s in sends]
    avgs = [rng.standard_normal(size).astype(np.float32) for _ in range(rounds)]
    ref_v, ref_u = reference_replay(grads, gots, avgs, eta)
    ef = EF21M(eta)
    for r in range(rounds):
        v = ef.begin(grads[r], key="k")
        assert np.array_equal(v, ref_v[r])
        u = ef.finish(got=gots[r], avg=avgs[r])
        assert np.array_equal(u, ref_u[r])
    v = ef.begin(grads[0], key="k2")  # a new layout: a reset
    assert np.array_equal(v, grads[0]) and not ef.u.any() and ef.e is ef.u
    with pytest.raises(ValueError):
        EF21M(0.0)


def textbook_round(hs, es, u, sent, eta, grads):
    """One round of textbook EF21M for every member (float64): u + mean_j C(h_j - e_j), e_j + C(v_j). Returns
    the new u and the members' mean v (what the sketch averages)."""
    for i, g in enumerate(grads):
        hs[i] = g.copy() if hs[i] is None else (1 - eta) * hs[i] + eta * g
    vs = [h - e for h, e in zip(hs, es, strict=True)]
    u = u + np.where(sent, np.mean(vs, axis=0), 0)
    for i, v in enumerate(vs):
        es[i] = es[i] + np.where(sent, v, 0)
    return u, np.mean(vs, axis=0)


def test_ef21m_without_loss_is_the_textbook_rule():
    """With no loss and a fixed group, anchoring the averaged rows to h (and e to u) gives textbook EF21M: the
    same mean v to sketch every round (so the same rows) and the same u (u + mean C(v), which keeps u = mean e),
    to float32 round-off, and every member holds the same u."""
    n, size, eta = 3, 50, 0.3
    rng = np.random.default_rng(6)
    efs = [EF21M(eta) for _ in range(n)]
    hs, es, u = [None] * n, [np.zeros(size)] * n, np.zeros(size)
    for _ in range(12):
        grads = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
        mean_v = np.mean([ef.begin(g, key=("L", 1)) for ef, g in zip(efs, grads, strict=True)], axis=0)
        sent = rng.random(size) < 0.3
        mean_h = np.mean([np.where(sent, ef.h, 0) for ef in efs], axis=0).astype(np.float32)
        us = [ef.finish(got=sent, avg=mean_h).copy() for ef in efs]
        u, textbook_v = textbook_round(hs, es, u, sent, eta, [g.astype(np.float64) for g in grads])
        assert all(np.array_equal(us[0], x) for x in us)
        np.testing.assert_allclose(us[0], u, atol=1e-5)
        np.testing.assert_allclose(mean_v, textbook_v, atol=1e-5)
    assert np.abs(u).max() > 0.1


def test_ef21m_a_lost_range_does_not_stay_in_u():
    """A member that lost an averaged range, or changed group, differs from the others only until the row is
    averaged again: then every member's u is the group's mean once more (textbook EF21M carries the difference in
    u for good, and adds every later increment on top of it)."""
    n, size, eta = 3, 40, 1.0
    rng = np.random.default_rng(8)
    efs = [EF21M(eta) for _ in range(n)]

    def one_round(members, sent, lost_at=None):
        for i in members:
            efs[i].begin(rng.standard_normal(size).astype(np.float32), key="L")
        mean_h = np.mean([np.where(sent, efs[i].h, 0) for i in members], axis=0).astype(np.float32)
        lost = lost_at if lost_at is not None else np.zeros(size, bool)
        return {i: efs[i].finish(got=sent & ~lost if i == 0 else sent, avg=mean_h).copy()
                for i in members}

    everything = np.ones(size, bool)
    us = one_round(range(n), everything, lost_at=np.arange(size) < 10)  # member 0 lost rows 0..9's average
    assert not us[0][:10].any() and us[1][:10].any()  # it keeps the last average it had: none yet
    # with the same gradient again the lost rows' v still asks for them (h minus the last average it got back:
    # none yet), where the rows that came back say how far its h is from the group's mean
    h0 = efs[0].h.copy()
    v = efs[0].begin(h0, key="L")
    assert np.array_equal(v[:10], h0[:10]) and np.array_equal(v[10:], h0[10:] - us[0][10:])
    efs[0].finish(got=everything, avg=h0)
    one_round([0, 1], rng.random(size) < 0.5)  # groups change: 0 and 1 together, 2 alone
    one_round([2], everything)
    us = one_round(range(n), everything)  # averaged again: the same u everywhere, the mean of the members' h
    assert all(np.array_equal(us[0], us[i]) for i in range(n))
    np.testing.assert_allclose(us[0], np.mean([ef.h for ef in efs], axis=0), atol=1e-6)


def test_ef21m_scores_a_row_whose_average_lacked_a_member():
    """A reduce-scatter that lost one member's values gives every member the mean of the others: the error stays
    in u until the row is averaged again, so the next sketch must see it. With the same h again, the members' mean
    v is exactly the mean of h less that partial average on those rows, and zero where the average was whole (with
    e_j = h_j instead, it would be zero on both: such a row would look fresh)."""
    n, size = 4, 30
    rng = np.random.default_rng(12)
    efs = [EF21M(1.0) for _ in range(n)]
    hs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    for ef, h in zip(efs, hs, strict=True):
        ef.begin(h, key="L")
    partial = np.arange(size) < 12  # member 3's values for these elements never reached their owner
    whole = np.mean(hs, axis=0, dtype=np.float32)
    avg = np.where(partial, np.mean(hs[:3], axis=0, dtype=np.float32), whole).astype(np.float32)
    everything = np.ones(size, bool)
    for ef in efs:
        ef.finish(got=everything, avg=avg)
    mean_v = np.mean([ef.begin(h, key="L") for ef, h in zip(efs, hs, strict=True)], axis=0)
    np.testing.assert_allclose(mean_v[partial], (whole - avg)[partial], atol=1e-6)
    assert np.abs(mean_v[partial]).max() > 0.05
    np.testing.assert_allclose(mean_v[~partial], 0.0, atol=1e-6)
