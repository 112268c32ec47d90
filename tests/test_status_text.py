"""``peerd status`` as text (peerd.status.text): the caps and budget lines from a status reply."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from peerd.linkcap import CapConfig, LinkCap, parse_budget
from peerd.linkcap.advert import WIRE_OVERHEAD
from peerd.status.text import render

MBIT = 1e6 / 8
BASE = {"peer_id": "ab" * 32, "listen": "127.0.0.1:7411", "peers": 3, "joined": True, "uptime_s": 90.0}


def status_of(cap: LinkCap) -> dict:
    view = {"send_bps": 2e6, "recv_bps": 1e6, "peers": []}
    return {**BASE, "caps": dataclasses.asdict(cap.statistics()), "peer_view": view}


def test_status_shows_the_caps_and_their_use() -> None:
    cap = LinkCap(CapConfig(max_upload=20 * MBIT, max_download=50 * MBIT), 0.0)
    cap.start(0.0)
    cap.send(int(15 * MBIT) - 1000 * WIRE_OVERHEAD, 1000, 0.5)
    cap.handle_timer(1.0)
    text = render(status_of(cap))
    line = next(x for x in text.splitlines() if x.startswith("caps"))
    assert "up 15.0M of 20.0Mbit/s 75 %" in line and "down 0 of 50.0Mbit/s 0 %" in line, line
    assert "budget" not in text and "(caps above)" in text and "(no cap)" not in text
    plain = render({**BASE, "caps": None, "peer_view": {"peers": []}})
    assert "caps " not in plain and "(no cap)" in plain


def test_status_says_how_much_of_the_budget_is_left_and_when_it_would_run_out() -> None:
    cap = LinkCap(CapConfig(max_upload=20 * MBIT, budget=parse_budget("10GB/day")), 0.0)
    cap.start(0.0)
    cap.receive_wall(datetime(2026, 12, 2, 12, tzinfo=UTC).timestamp(), None, 0.0)  # half the day left
    for t in range(1, 61):  # 50 MB/s for a minute: 3 GB, and 7 GB left would last 140 s at that rate
        cap.send(50_000_000 - 50 * WIRE_OVERHEAD, 50, t - 0.5)
        cap.handle_timer(float(t))
    lines = render(status_of(cap)).splitlines()
    budget = next(i for i, x in enumerate(lines) if x.startswith("budget"))
    assert "3.0 GB of 10.0 GB used this day (30.0 %), 7.0 GB left for 11 h 59 min" in lines[budget], lines[budget]
    assert "runs out in 2 min (2026-12-02 12:03 UTC)" in lines[budget + 1], lines[budget + 1]
    assert "(budget)" in next(x for x in lines if x.startswith("caps"))  # the budget, not the flag, binds


def test_status_shows_each_trainer_and_what_auto_chose() -> None:
    trainer = {"session": 3, "run": "gpt", "layout": "x", "steps": 120, "compression": "int8", "outcome": "averaged",
               "seconds": 0.362, "kept": True,
               "phases": {"copy_in": 0.002, "daemon": 0.004, "matchmaking": 0.0, "members": 0.02, "transfer": 0.17,
                          "agree": 0.0, "copy_out": 0.006},
               "auto": {"compression": "int8", "average_every": 10, "bucket_mb": 25.0, "applied": "compression",
                        "reason": "int8: fp32 would take 404 ms a step; parameters every 10 steps: agreed; buckets of "
                                  "25 MB: agreed, the largest of 4 proposals"}}
    text = render({**BASE, "trainers": [trainer], "peer_view": {"peers": []}})
    lines = text.splitlines()
    head = next(x for x in lines if x.startswith("trainer"))
    assert "session 3" in head and "run gpt" in head and "int8" in head and "120 steps" in head, head
    assert "averaged in 0.362 s, kept group" in head
    assert any(x.strip() == "phases: transfer 170 ms, members 20 ms, copy_out 6 ms, daemon 4 ms" for x in lines), lines
    autos = [x.strip() for x in lines if x.strip().startswith("auto:")]
    assert autos == ["auto: int8: fp32 would take 404 ms a step", "auto: parameters every 10 steps: agreed",
                     "auto: buckets of 25 MB: agreed, the largest of 4 proposals"], autos
    assert not any(x.startswith("trainer") for x in render({**BASE, "peer_view": {"peers": []}}).splitlines())
    brief = render({**BASE, "trainers": [trainer], "peer_view": {"peers": []}}, brief=True).splitlines()
    assert head in brief and not any("auto:" in x or "phases:" in x for x in brief)  # `peerd top`: one line each


def test_status_shows_the_pacers_rate_and_what_it_takes_the_bottleneck_for() -> None:
    from peerd.transport.pacing import Pacer

    pacer = Pacer(rate=12.5e6)  # 100 Mbit/s, in startup: no bottleneck measured yet
    line = next(x for x in render({**BASE, "pacer": dataclasses.asdict(pacer.statistics())}).splitlines()
                if x.startswith("pacer"))
    assert "sends at 100.0Mbit/s (startup)" in line and "not yet measured" in line and "0 cuts" in line, line
    pacer.btl = 10e6  # 80 Mbit/s measured
    line = next(x for x in render({**BASE, "pacer": dataclasses.asdict(pacer.statistics())}).splitlines()
                if x.startswith("pacer"))
    assert "(cycle)" in line and "bottleneck 80.0Mbit/s" in line, line
    assert "pacer" not in render(BASE)


def test_top_leaves_out_the_deadlines_so_the_peer_table_stays_on_the_screen() -> None:
    deadline = {"seconds": 1.0, "basis": "floor", "measured": None, "floor_s": 1.0, "cap_s": 3.0}
    reply = {**BASE, "deadlines": {"window": deadline}, "pacer": {"rate": 1e6, "btl": None, "state": "startup"},
             "peer_view": {"peers": []}}
    assert any(x.startswith("deadline   window") for x in render(reply).splitlines())
    brief = render(reply, brief=True).splitlines()
    assert not any(x.startswith("deadline") for x in brief) and any(x.startswith("pacer") for x in brief)
