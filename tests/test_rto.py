"""The adaptive retransmission timeout (peerd/transport/rto.py) and its use by Endpoint.request."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from peerd.metrics import Metrics
from peerd.transport.endpoint import Endpoint, RpcTimeout
from peerd.transport.rto import DEFAULT_MIN_RTO, MAX_BACKOFF, RtoEstimator
from peerd.wire import messages as m
from peerd.wire.identity import Identity

from .support.memnet import MemNet, run_on_memnet
from .support.virtual import run_virtual  # noqa: E402

SECRET = bytes(range(32))

A = ("127.0.0.1", 21001)
B = ("127.0.0.1", 21002)

rtts = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


def test_before_a_sample_the_callers_timeout_is_used() -> None:
    est = RtoEstimator()
    assert est.timeout(A, 0.5) == 0.5
    est.timed_out(A)  # no state yet: nothing to back off
    assert est.timeout(A, 0.25) == 0.25
    assert est.srtt(A) is None


def test_first_sample_sets_srtt_and_rttvar_as_rfc6298() -> None:
    est = RtoEstimator(min_rto=0.001)
    est.sample(A, 0.1)
    assert est.srtt(A) == pytest.approx(0.1)
    # rto = srtt + 4 * rtt/2 = 3 * rtt
    assert est.timeout(A, 5.0) == pytest.approx(0.3)
    est.sample(A, 0.1)
    # rttvar = 3/4 * 0.05 + 1/4 * 0 ; srtt unchanged
    assert est.timeout(A, 5.0) == pytest.approx(0.1 + 4 * 0.0375)


def test_fast_peers_get_the_floor_and_other_peers_are_independent() -> None:
    est = RtoEstimator()
    for _ in range(50):
        est.sample(A, 0.0005)
    assert est.timeout(A, 0.5) == DEFAULT_MIN_RTO
    assert est.timeout(B, 0.5) == 0.5


def test_timeouts_back_off_until_the_next_sample() -> None:
    est = RtoEstimator(min_rto=0.01)
    for _ in range(30):
        est.sample(A, 0.01)
    base = est.timeout(A, 100.0)
    est.timed_out(A)
    assert est.timeout(A, 100.0) == pytest.approx(2 * base)
    est.timed_out(A)
    assert est.timeout(A, 100.0) == pytest.approx(4 * base)
    for _ in range(20):
        est.timed_out(A)
    assert est.timeout(A, 100.0) == pytest.approx(MAX_BACKOFF * base)
    assert est.timeout(A, 0.3) == 0.3  # the caller's cap still holds
    est.sample(A, 0.01)
    assert est.timeout(A, 100.0) < 2 * base


def test_capacity_forgets_the_least_recently_sampled() -> None:
    est = RtoEstimator(capacity=2)
    est.sample(A, 0.01)
    est.sample(B, 0.01)
    est.sample(A, 0.01)  # A is now the most recent
    est.sample(("10.0.0.3", 1), 0.01)
    assert len(est) == 2
    assert est.srtt(B) is None and est.srtt(A) is not None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_samples_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="rtt"):
        RtoEstimator().sample(A, bad)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rto"):
        RtoEstimator(min_rto=0)
    with pytest.raises(ValueError, match="capacity"):
        RtoEstimator(capacity=0)
    with pytest.raises(ValueError, match="cap"):
        RtoEstimator().timeout(A, 0)


@given(samples=st.lists(rtts, min_size=1, max_size=40), cap=st.floats(min_value=0.001, max_value=30.0),
       timeouts=st.integers(min_value=0, max_value=10))
def test_timeout_is_always_within_floor_and_cap(samples: list[float], cap: float, timeouts: int) -> None:
    est = RtoEstimator()
    for rtt in samples:
        est.sample(A, rtt)
    for _ in range(timeouts):
        est.timed_out(A)
    t = est.timeout(A, cap)
    assert t <= cap
    assert t >= min(cap, DEFAULT_MIN_RTO)


@given(rtt=st.floats(min_value=0.001, max_value=5.0), n=st.integers(min_value=30, max_value=80))
def test_a_steady_rtt_converges_to_it(rtt: float, n: int) -> None:
    est = RtoEstimator(min_rto=1e-6)
    for _ in range(n):
        est.sample(A, rtt)
    assert est.srtt(A) == pytest.approx(rtt)
    # rttvar decays geometrically toward 0, so the timeout approaches srtt from above
    assert rtt <= est.timeout(A, 100.0) <= rtt * (1 + 2 * 0.75 ** (n - 1)) + 1e-12


# -- Endpoint.request over an in-memory network (virtual time) ----------------------------------


class DropNet(MemNet):
    """MemNet that can drop the next datagrams sent to one address."""

    def __init__(self) -> None:
        super().__init__(seed=1)
        self.drop_to: dict[tuple[str, int], int] = {}

    def deliver(self, src: tuple[str, int], dst: tuple[str, int], data: bytes) -> None:
        if self.drop_to.get(dst, 0) > 0:
            self.drop_to[dst] -= 1
            self.sent += 1
            self.dropped += 1
            return
        super().deliver(src, dst, data)


def _pair(net: MemNet) -> tuple[Endpoint, Endpoint]:
    a = Endpoint(net.socket(*A), Identity.generate(), SECRET, Metrics())
    b = Endpoint(net.socket(*B), Identity.generate(), SECRET, Metrics())
    b.on_request(m.MsgType.PING, lambda inc: {})
    return a, b




def test_request_learns_the_rtt_and_retransmits_sooner_under_loss() -> None:
    async def main(net: Any, nursery: trio.Nursery) -> None:
        a, b = _pair(net)
        nursery.start_soon(a.serve)
        nursery.start_soon(b.serve)
        for _ in range(5):
            await a.request(B, m.MsgType.PING, {}, timeout=2.0)
        assert a.rto.srtt(B) == pytest.approx(2 * net.latency, rel=0.5)
        learned = a.rto.timeout(B, 2.0)
        assert learned == DEFAULT_MIN_RTO
        # Lose the next request: the retransmission goes out after the learned RTO, not after 2 s.
        net.drop_to[B] = 1
        start = trio.current_time()
        await a.request(B, m.MsgType.PING, {}, timeout=2.0)
        assert trio.current_time() - start == pytest.approx(learned + 2 * net.latency, abs=0.002)
        # Karn's rule: the retransmitted exchange gave no sample, and the address is backed off.
        assert a.rto.timeout(B, 2.0) == pytest.approx(2 * learned)
        await a.request(B, m.MsgType.PING, {}, timeout=2.0)
        assert a.rto.timeout(B, 2.0) == learned

    run_on_memnet(main, net=DropNet())


def test_request_gives_up_on_the_callers_schedule_and_retransmits_within_it() -> None:
    async def main(net: Any, nursery: trio.Nursery) -> None:
        a, b = _pair(net)
        nursery.start_soon(a.serve)
        nursery.start_soon(b.serve)
        await a.request(B, m.MsgType.PING, {}, timeout=0.5)
        net.drop_to[B] = 10**6  # B is gone
        sent = net.sent
        start = trio.current_time()
        with pytest.raises(RpcTimeout, match="no answer to ping"):
            await a.request(B, m.MsgType.PING, {}, timeout=0.5, attempts=3)
        assert trio.current_time() - start == pytest.approx(3.5, abs=0.01)
        # more retransmissions than the 3 of the fixed schedule, but a bounded number (doubling waits)
        assert 3 < net.sent - sent <= 8

    run_on_memnet(main, net=DropNet())


def test_request_refuses_bad_arguments() -> None:
    async def main() -> None:
        net = DropNet()
        a, _ = _pair(net)
        with pytest.raises(ValueError, match="timeout"):
            await a.request(B, m.MsgType.PING, {}, timeout=0)
        with pytest.raises(ValueError, match="attempts"):
            await a.request(B, m.MsgType.PING, {}, attempts=0)

    run_virtual(main)
