"""What the daemon logs of a run's rounds (peerd.moshpit.roundlog): the first, then a summary a minute."""

import logging
from types import SimpleNamespace

from peerd.moshpit.roundlog import SUMMARY_S, RoundLog
from peerd.moshpit.runstate import RunState


def test_the_first_round_then_a_summary_per_window() -> None:
    r = RoundLog()
    assert r.note("run/a", "averaged", 4, 0.35, 100.0) == "run run/a: first round averaged, group of 4, 0.350 s"
    lines = [r.note("run/a", "alone" if i % 10 == 0 else "averaged", 3 if i % 7 == 0 else 4, 0.3 + i / 1000,
                    100.0 + i / 2) for i in range(1, 2 * int(SUMMARY_S) + 1)]
    due = [x for x in lines if x is not None]
    assert len(due) == 1 and lines.index(due[0]) == 2 * int(SUMMARY_S) - 1  # at the first round SUMMARY_S on
    assert due[0] == ("run run/a: 120 rounds in the last 60 s (averaged 108, alone 12), groups of 3-4, "
                      "0.361 s a round (median)")
    assert r.note("run/a", "failed", 1, 5.0, 161.0) is None  # a new window began at the summary
    assert r.note("run/a", "failed", 1, 5.0, 220.0) == ("run run/a: 2 rounds in the last 60 s (failed 2), groups of 1, "
                                                        "5.000 s a round (median)")


def test_each_round_is_logged_at_debug_and_only_the_summaries_at_info(caplog) -> None:
    st = RunState(core=SimpleNamespace(run_id="demo/x"))  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="peerd.moshpit"):
        for i in range(50):
            st.log_round(i, "averaged", 4, 0.2, 1000.0 + i)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == ["run demo/x: first round averaged, group of 4, 0.200 s"] and len(debug) == 50
