"""transport.pause: the junk moderation's pause waits on a timerfd under trio's system clock, on trio.sleep under a
test's MockClock, and a cancelled wait leaves nothing behind."""

from __future__ import annotations

import sys
import time

import pytest
import trio
import trio.testing

from peerd.transport.pause import Pause

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


@linux
def test_a_pause_waits_on_a_timerfd_for_about_its_length() -> None:
    async def main() -> None:
        pause = Pause()
        try:
            assert pause.timerfd
            for seconds in (0.002, 0.02):
                t = time.monotonic()
                await pause.wait(seconds)
                took = time.monotonic() - t
                assert seconds * 0.9 <= took < seconds + 0.25, (seconds, took)
        finally:
            pause.close()
        assert not pause.timerfd
        pause.close()  # twice: nothing happens
        t = time.monotonic()
        await pause.wait(0.01)  # closed: trio.sleep
        assert time.monotonic() - t >= 0.009

    trio.run(main)


@linux
def test_a_cancelled_pause_leaves_no_early_wakeup_for_the_next() -> None:
    async def main() -> None:
        pause = Pause()
        try:
            with trio.move_on_after(0.01) as scope:
                await pause.wait(0.2)
            assert scope.cancelled_caught
            await trio.sleep(0.25)  # the first timer would have fired by now
            t = time.monotonic()
            await pause.wait(0.05)  # re-armed: no stale expiration wakes it at once
            assert time.monotonic() - t >= 0.045
        finally:
            pause.close()

    trio.run(main)


def test_virtual_time_stays_virtual() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> None:
        pause = Pause()
        assert not pause.timerfd
        t = trio.current_time()
        await pause.wait(0.5)
        assert trio.current_time() - t == pytest.approx(0.5)
        pause.close()

    trio.run(main, clock=clock)
