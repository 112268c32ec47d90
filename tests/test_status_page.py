"""The status page's snapshot is built only while someone reads it; a first read waits for a fresh one."""

from __future__ import annotations

import threading
import time

from peerd.status.page import FRESH_WAIT_S, StatusPage


def _round(n: int) -> dict:
    return {"round": n, "outcome": "averaged", "group_size": 4, "received_fraction": 1.0, "seconds": 0.3,
            "matchmaking_s": 0.0, "transfer_s": 0.2, "compression": "int8", "bytes_sent": 10, "members": ["x"]}


def test_an_unread_page_is_not_watched_and_a_read_waits_for_the_next_snapshot() -> None:
    page = StatusPage()
    assert not page.watched(time.monotonic())
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(page.read()))
    reader.start()
    time.sleep(0.1)
    assert not got  # waiting for the daemon's next tick, not answering the stale "{}"
    page.update({"node": {"peer_id": "ab"}}, {})
    reader.join(2)
    assert got and b'"peer_id": "ab"' in got[0]
    assert page.watched(time.monotonic())


def test_a_read_without_any_snapshot_ends_after_the_fresh_wait() -> None:
    page = StatusPage()
    t = time.monotonic()
    assert page.read() == b"{}"
    assert FRESH_WAIT_S * 0.9 <= time.monotonic() - t < FRESH_WAIT_S + 1.0
    t = time.monotonic()
    page.read()  # watched now: answers at once
    assert time.monotonic() - t < 0.2


def test_rounds_noted_while_unread_show_once_in_the_recent_rounds() -> None:
    page = StatusPage(rounds=3)
    for n in (1, 1, 2, 3, 4):
        if not page.seen("run", n):
            page.note_round("run", _round(n))
    assert [r["round"] for r in page.rounds] == [4, 3, 2]
    page.update({}, {"run": {"last": _round(4)}})  # the same last round again: not listed twice
    assert [r["round"] for r in page.rounds] == [4, 3, 2]
    assert "members" not in page.rounds[0]
