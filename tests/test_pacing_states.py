"""The pacer's states and transitions (transport/pacing_judge.py), table-driven: every transition the table allows
does what its event says, and every event the table does not allow from a state is refused."""

from __future__ import annotations

import pytest

from peerd.transport.pacing import CYCLE, Pacer
from peerd.transport.pacing_judge import TRANSITIONS, Event, PacerStateError, State, next_state
from peerd.transport.pacing_params import PROBE_STEP

BTL = 10e6


def pacer_in(state: State) -> Pacer:
    """A pacer that has sent a part, in ``state``."""
    pacer = Pacer()
    if state is State.CYCLE:
        pacer.btl = BTL
    pacer.reserve(65536, "a", 0.0)
    return pacer


ROWS = [(state, event, to) for state, events in TRANSITIONS.items() for event, to in events.items()]


@pytest.mark.parametrize(("state", "event", "to"), ROWS, ids=[f"{s.name}-{e.name}" for s, e, _ in ROWS])
def test_each_transition_in_the_table_does_what_its_event_says(state: State, event: Event, to: State) -> None:
    pacer = pacer_in(state)
    now = 0.2
    before = (pacer.rate, pacer.increases, pacer._step)
    if event is Event.CUT and state is State.STARTUP:
        pacer._btl = BTL  # (a cut sets btl before it takes the transition)
    if event is Event.STEP_UP:
        pacer.rate *= 2
    pacer._transition(event, now)
    assert pacer.state is to and pacer.mode == to.value
    assert (pacer.btl is None) == (to is State.STARTUP)
    current = pacer._phases[-1]
    if event in (Event.CUT, Event.PROBE_QUEUED):
        assert pacer._step == PROBE_STEP and pacer._clean_probes == 0
        assert current.start == now  # a new phase at once ...
        if to is State.CYCLE:  # ... the drain after the overshoot
            assert current.kind == "drain" and current.rate == pytest.approx(CYCLE[1] * BTL)
    elif event is Event.CLEAN_PROBE:
        assert pacer._clean_probes == 1 and pacer._step == 2 * before[2] and pacer.increases == before[1] + 1
    elif event is Event.RESTART:
        assert pacer.rate == BTL and current.kind == "startup" and current.start == now
        assert pacer._clean_probes == 0 and pacer._step == PROBE_STEP
    elif event is Event.STEP_UP:
        assert current.kind == "startup" and current.rate == 2 * before[0] and pacer.increases == before[1] + 1


MISSING = [(state, event) for state in State for event in Event if event not in TRANSITIONS[state]]


@pytest.mark.parametrize(("state", "event"), MISSING, ids=[f"{s.name}-{e.name}" for s, e in MISSING])
def test_an_event_the_table_does_not_allow_is_refused(state: State, event: Event) -> None:
    with pytest.raises(PacerStateError):
        next_state(state, event)
    pacer = pacer_in(state)
    with pytest.raises(PacerStateError):
        pacer._transition(event, 0.2)
    assert pacer.state is state  # nothing changed


def test_the_table_covers_every_state_and_leaves_startup_only_by_a_cut() -> None:
    assert set(TRANSITIONS) == set(State)
    assert [e for e, to in TRANSITIONS[State.STARTUP].items() if to is not State.STARTUP] == [Event.CUT]
    assert [e for e, to in TRANSITIONS[State.CYCLE].items() if to is not State.CYCLE] == [Event.RESTART]
    assert MISSING, "some events are not allowed from some states"


def test_a_pacer_placed_in_its_cycle_from_outside_follows_with_its_state() -> None:
    pacer = Pacer()
    assert pacer.state is State.STARTUP and pacer.mode == "startup"
    pacer.btl = BTL
    assert pacer.state is State.CYCLE and pacer.mode == "cycle"
    pacer.btl = None
    assert pacer.state is State.STARTUP


def test_statistics_is_a_frozen_snapshot_of_the_state() -> None:
    import dataclasses

    pacer = pacer_in(State.CYCLE)
    stats = pacer.statistics()
    assert (stats.rate, stats.btl, stats.state) == (pacer.rate, BTL, "cycle")
    assert (stats.decreases, stats.increases, stats.resumes) == (0, 0, 0)
    pacer.btl = None  # back to startup: a new snapshot says so, the old one stays as it was
    assert (pacer.statistics().state, pacer.statistics().btl) == ("startup", None)
    assert (stats.state, stats.btl) == ("cycle", BTL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.rate = 1.0  # type: ignore[misc]
