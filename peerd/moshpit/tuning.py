"""Moshpit's side of self-tuning deadlines: what a round asks the deadline tuner (peerd/deadlines.py) and what it
tells it afterwards, so the service's round loop stays one call each."""

from __future__ import annotations

from ..deadlines import WINDOW_END_SLACK_S, DeadlineTuner
from .rounds import RoundMachine
from .runstate import RoundResult

SILENCE_CAP_S = 1.0  # an averaging phase's floor before tuning: the silence that ends it


def tuned_window(deadlines: DeadlineTuner | None, cap_s: float) -> float:
    """The matchmaking window of the next round: the run's ``cap_s`` unless measurements say it can be shorter."""
    return cap_s if deadlines is None else deadlines.window(cap_s).seconds


def tune_round(deadlines: DeadlineTuner | None, core: RoundMachine, cap_s: float, wait_s: float | None = None) -> float:
    """Set the next round's deadlines on ``core``: its matchmaking window (returned) within the run's ``cap_s`` (kept
    as ``window_cap_s``: the longest a kept round waits for a late member that is alive), and how long its
    matchmaking waits for a member of its last group that did not finish it (the whole window without a tuner:
    today's). ``wait_s``: a round that should gather everyone (the final average of training, which trainers
    reach seconds apart) waits at least this long, whatever the tuner or the run's cap say."""
    window = core.window_s = tuned_window(deadlines, cap_s) if wait_s is None else max(wait_s, cap_s)
    core.window_cap_s = cap_s if wait_s is None else window
    core.doubt_s = window if deadlines is None else deadlines.doubt(window).seconds
    return window


def phase_deadlines(deadlines: DeadlineTuner | None, nbytes: int, cap_s: float, capped_s: float) -> tuple[float, float]:
    """(the silence that ends an averaging phase, its longest) for a vector of ``nbytes``: tuned within today's
    1 s and ``cap_s``, never below what a capped member's share needs (``capped_s``)."""
    if deadlines is None:
        return SILENCE_CAP_S, cap_s
    longest = max(min(capped_s, cap_s), deadlines.phase(nbytes, cap_s).seconds)
    return deadlines.phase_silence(SILENCE_CAP_S).seconds, longest


def probes_silent(deadlines: DeadlineTuner | None) -> bool:
    """Whether an average asks a member gone silent whether its daemon lives (and stops waiting for a dead one at
    once): with tuned deadlines; with today's constants (or no tuner) it waits out the phase deadline."""
    return deadlines is not None and deadlines.mode == "auto"


def note_round(deadlines: DeadlineTuner | None, r: RoundResult, window_s: float, t0: float, now: float) -> None:
    """Hand a round's facts to the tuner: how long its group took to gather (when it matchmade), who was in it, and
    its pace (when every member was heard); a round alone once the window ran out, that nobody came in time."""
    if deadlines is None or r.outcome == "failed" or (r.outcome == "alone" and r.window_end <= 0):
        return
    gathered = r.window_end > 0 and not r.kept
    at_end = gathered and t0 + r.matchmaking_s >= r.window_end - WINDOW_END_SLACK_S
    # a kept group's round did not matchmake, but its renewal is how long the same members took to be there: the
    # gathering a window must allow for when the group breaks (a member died) and the rest gather anew
    gathered = gathered or (r.kept and r.outcome == "averaged" and not r.silent and not r.out)
    if r.outcome == "alone" and not at_end:  # (it moved to the run's round elsewhere: nothing about the window)
        return
    heard = tuple(m for i, m in enumerate(r.members) if i not in r.out)  # (not the members that stayed silent)
    deadlines.receive_round(
        gather_s=r.matchmaking_s if gathered else None, window_s=window_s, members=heard, at_window_end=at_end,
        nbytes=r.vector.nbytes, transfer_s=r.transfer_s, clean=not r.silent and not r.out, now=now)
