"""A byte budget by the UTC calendar (peerd.linkcap.budget): periods, the count carried over a restart through its
state file (atomic, bounded, a corrupt one refused), and the ticker that reads and writes it (virtual time)."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import UTC, datetime

import pytest
import trio
import trio.testing

from peerd.linkcap import CapConfig, LinkCap, parse_budget
from peerd.linkcap.advert import WIRE_OVERHEAD
from peerd.linkcap.budget import MAX_SAVED_BYTES, SavedBudget, period_bounds
from peerd.linkcap.core import SAVE_S, TICK_S, SaveBudget
from peerd.linkcap.shell import CapTicker, load_budget, save_budget


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def test_periods_are_the_utc_calendars() -> None:
    wall = utc(2026, 12, 2, 7, 30)  # a Wednesday
    assert period_bounds("day", wall) == (utc(2026, 12, 2), utc(2026, 12, 3))
    assert period_bounds("week", wall) == (utc(2026, 11, 30), utc(2026, 12, 7))  # Monday to Monday
    assert period_bounds("month", wall) == (utc(2026, 12, 1), utc(2027, 1, 1))
    assert period_bounds("month", utc(2028, 2, 29, 23, 59)) == (utc(2028, 2, 1), utc(2028, 3, 1))  # 29 days
    assert period_bounds("day", utc(2026, 12, 3)) == (utc(2026, 12, 3), utc(2026, 12, 4))  # a bound is the next's
    with pytest.raises(ValueError):
        period_bounds("year", wall)


def test_a_month_budget_spreads_over_what_is_left_of_the_calendar_month() -> None:
    cap = LinkCap(CapConfig(budget=parse_budget("310GB/month")), 0.0)
    cap.start(0.0)
    cap.receive_wall(utc(2026, 12, 22), None, 0.0)  # 10 days of December's 31 left
    st = cap.statistics().budget
    assert st is not None and st.period == "month" and st.period_s == 31 * 86400
    assert st.period_start == utc(2026, 12, 1) and st.period_left_s == 10 * 86400
    assert st.allowance == pytest.approx(310e9 / (10 * 86400))
    assert cap.upload_limit == pytest.approx(0.5 * st.allowance)


def test_the_count_survives_a_restart_in_the_same_period_only() -> None:
    wall0 = utc(2026, 12, 2, 7)
    first = LinkCap(CapConfig(budget=parse_budget("100GB/month")), 50.0)
    first.start(50.0)
    assert not first.receive_wall(wall0, None, 50.0)
    first.send(3_000_000_000 - 1000 * WIRE_OVERHEAD, 1000, 51.0)
    first.receive_total(1_000_000_000 - 1000 * WIRE_OVERHEAD, 1000, 59.0)
    first.handle_timer(50.0 + SAVE_S)
    saved = [a for a in first.take_actions() if isinstance(a, SaveBudget)]
    assert saved == [SaveBudget(SavedBudget("month", utc(2026, 12, 1), 4_000_000_000))]
    assert first.take_actions() == []  # drained
    record = SavedBudget.decode(saved[0].saved.encode())
    # a restart a day later, same month: the 4 GB count on, and the allowance is what is left of them
    second = LinkCap(CapConfig(budget=parse_budget("100GB/month")), 7.0)
    second.start(7.0)
    assert second.receive_wall(wall0 + 86400, record, 7.0)
    second.send(1_000_000 - WIRE_OVERHEAD, 1, 7.5)
    second.handle_timer(7.0 + TICK_S)
    st = second.statistics().budget
    assert st is not None and st.used_bytes == 4_001_000_000 and st.remaining_bytes == 100e9 - 4_001_000_000
    # a restart in January: December's count is not this period's
    third = LinkCap(CapConfig(budget=parse_budget("100GB/month")), 0.0)
    assert not third.receive_wall(utc(2027, 1, 1, 0, 0, 1), record, 0.0)
    # nor is a day's count a month's, whatever its start
    assert not LinkCap(CapConfig(budget=parse_budget("100GB/month")), 0.0).receive_wall(
        wall0, SavedBudget("day", utc(2026, 12, 1), 5), 0.0)


def test_the_period_rolls_over_at_midnight_utc_and_says_when_it_would_run_out() -> None:
    cap = LinkCap(CapConfig(budget=parse_budget("1GB/day")), 0.0)
    cap.start(0.0)
    cap.receive_wall(utc(2026, 12, 2, 23, 0), None, 0.0)  # an hour before midnight
    for t in range(1, 61):  # 10 MB/s for a minute: 600 MB of the day's 1 GB
        cap.send(10_000_000 - 10 * WIRE_OVERHEAD, 10, t - 0.5)
        cap.handle_timer(float(t))
    st = cap.statistics().budget
    assert st is not None and not st.on_track
    assert st.runs_out_in_s == pytest.approx(40.0, rel=0.05)  # 400 MB left at 10 MB/s
    assert st.runs_out_at == pytest.approx(utc(2026, 12, 2, 23, 0) + 60 + st.runs_out_in_s)
    assert cap.take_actions() == [SaveBudget(SavedBudget("day", utc(2026, 12, 2), 600_000_000))]  # after SAVE_S
    cap.handle_timer(3601.0)  # past midnight: a new day, its count from zero, saved at once
    st = cap.statistics().budget
    assert st is not None and st.used_bytes == 0 and st.period_start == utc(2026, 12, 3) and st.on_track
    assert cap.take_actions() == [SaveBudget(SavedBudget("day", utc(2026, 12, 3), 0))]


def test_the_state_file_is_replaced_whole(tmp_path) -> None:
    path = str(tmp_path / "budget.json")
    assert load_budget(path) is None  # none yet
    rec = SavedBudget("month", utc(2026, 12, 1), 123_456)
    assert save_budget(path, rec) and load_budget(path) == rec
    assert os.stat(path).st_mode & 0o077 == 0 and not os.path.exists(path + ".tmp")
    assert save_budget(path, SavedBudget("month", utc(2026, 12, 1), 7)) and load_budget(path).used_bytes == 7
    assert not save_budget(str(tmp_path / "no" / "such" / "dir.json"), rec)  # a warning, never an exception


@pytest.mark.parametrize("content", [
    b"", b"{", b"\xff\xfe", b"[]", b'{"peerd_budget": 2, "period": "month", "period_start": 0, "used_bytes": 1}',
    b'{"peerd_budget": 1, "period": "year", "period_start": 0, "used_bytes": 1}',
    b'{"peerd_budget": 1, "period": "day", "period_start": NaN, "used_bytes": 1}',
    b'{"peerd_budget": 1, "period": "day", "period_start": 0, "used_bytes": -5}',
    b'{"peerd_budget": 1, "period": "day", "period_start": 0, "used_bytes": true}',
    b'{"peerd_budget": 1, "period": "day", "period_start": 0, "used_bytes": 1e30}',
    b'{"peerd_budget": 1, "period": "day", "period_start": 0, "used_bytes": 100000000000000000000}',
    json.dumps({"peerd_budget": 1, "period": "day", "period_start": 0, "used_bytes": 1,
                "pad": "x" * MAX_SAVED_BYTES}).encode(),
])
def test_a_corrupt_state_file_starts_the_count_afresh_with_a_warning_hostile(tmp_path, caplog, content: bytes) -> None:
    path = tmp_path / "budget.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="peerd.linkcap"):
        assert load_budget(str(path)) is None
    assert "corrupt" in caplog.text and "from zero" in caplog.text


def wait_saved(path: str, used: int) -> bool:
    for _ in range(500):
        rec = load_budget(path)
        if rec is not None and rec.used_bytes == used:
            return True
        time.sleep(0.01)
    return False


def test_the_ticker_reads_the_count_at_start_saves_it_and_again_when_it_stops(tmp_path) -> None:
    path = str(tmp_path / "budget.json")
    wall0 = utc(2026, 12, 2, 7)
    save_budget(path, SavedBudget("month", utc(2026, 12, 1), 2_000_000_000))
    received = [0]

    async def main() -> None:
        core = LinkCap(CapConfig(budget=parse_budget("100GB/month"), budget_state=path), 0.0)
        limits: list[float | None] = []
        ticker = CapTicker(core, lambda: (received[0], 0), lambda c: limits.append(c.upload_limit),
                           wall=lambda: wall0 + trio.current_time())
        async with trio.open_nursery() as nursery:
            await nursery.start(ticker.run)
            assert core.budget is not None and core.budget.used == 2_000_000_000  # carried over
            received[0] = 500_000_000
            await trio.sleep(SAVE_S + 2 * TICK_S)
            assert wait_saved(path, 2_500_000_000)  # saved while running (in a thread: real time)
            received[0] = 700_000_000
            await trio.sleep(TICK_S)
            nursery.cancel_scope.cancel()
        assert limits and limits[0] == pytest.approx(0.5 * 98e9 / (utc(2027, 1, 1) - wall0), rel=1e-3)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert load_budget(path).used_bytes == 2_700_000_000  # saved as it stopped


def test_a_daemon_carries_the_days_count_over_a_restart(tmp_path) -> None:
    from peerd.tools.swarm import LocalSwarm

    path = str(tmp_path / "budget.json")
    today = period_bounds("day", time.time())[0]
    save_budget(path, SavedBudget("day", today, 50_000_000))  # what the run before this one used today
    with LocalSwarm(str(tmp_path / "swarm"), insecure=True, metrics=False) as swarm:
        node = swarm.start(extra=("--budget", "1GB/day", "--budget-state", path))
        swarm.wait_ready(node)
        time.sleep(1.2)  # a tick of the caps' timer
        budget = node.call("status")["caps"]["budget"]
        swarm.stop()  # SIGTERM: the count is saved as the daemon leaves
        assert node.proc.returncode == 0
    assert budget["period"] == "day" and budget["period_start"] == today
    assert budget["used_bytes"] >= 50_000_000 and budget["remaining_bytes"] <= 950_000_000
    saved = load_budget(path)
    if saved is not None and saved.period_start != today:  # (midnight UTC passed meanwhile: a new day's count)
        return
    assert saved is not None and saved.used_bytes >= budget["used_bytes"]
