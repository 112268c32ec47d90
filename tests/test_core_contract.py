"""Every sans-I/O core has one shape (docs/architecture.md, "The core contract"), checked on the class itself:

- inputs are methods named for what arrives, each taking ``now`` as its last positional parameter;
- a core with timers has ``get_timer() -> float | None`` and ``handle_timer(now)``, and none of the older names;
- a core that emits has ``take_actions()`` (a paced data core also ``datagrams_to_send(now, limit)``), and emits
  only there: none of its inputs hands an action (a frozen dataclass) back to its caller;
- ``statistics()`` returns a frozen dataclass, never a dict.

A core not converted yet is on NOT_YET with the branch of work that converts it; the list only shrinks."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing

import pytest

from .support.cores import CORES

# Cores that do not follow the contract yet: (module, class) -> what is left and which branch of work converts it.
# Remove an entry when its core is converted (test_not_yet_is_not_stale fails on an entry that already passes).
NOT_YET: dict[tuple[str, str], str] = {}

# the older vocabularies, and ``step``: a schedule handed back to one caller instead of actions queued for the shell
OLD_NAMES = frozenset({"on_timer", "poll", "next_deadline", "deadline", "wake_at", "held_expiry", "next_sends",
                       "next_datagrams", "stats", "status", "step"})
TIMER = ("get_timer", "handle_timer")


def contract_violations(cls: type) -> list[str]:
    """How ``cls`` departs from the core contract (empty when it follows it)."""
    found = []
    own = {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}
    for name in sorted(own & OLD_NAMES):
        found.append(f"{name}: an old name (the contract's names are get_timer, handle_timer, take_actions, "
                     f"datagrams_to_send, statistics)")
    if any(n in own for n in TIMER) and not all(n in own for n in TIMER):
        found.append("a core with a timer has both get_timer() and handle_timer(now)")
    if "get_timer" in own:
        params = _params(cls.get_timer)
        if params:
            found.append(f"get_timer takes no arguments (has {params})")
    if "take_actions" in own and _params(cls.take_actions):
        found.append("take_actions takes no arguments")
    if "datagrams_to_send" in own and _params(cls.datagrams_to_send)[:2] != ["now", "limit"]:
        found.append("datagrams_to_send takes (now, limit)")
    for name in sorted(own):
        params = _params(getattr(cls, name))
        if "now" in params and params[-1] != "now" and name != "datagrams_to_send":
            found.append(f"{name}{tuple(params)}: now comes last")
        if "now" in params and "take_actions" in own and name != "datagrams_to_send":
            returned = _frozen_returned(getattr(cls, name))
            if returned is not None:
                found.append(f"{name} returns {returned.__name__}: a core with take_actions queues its decisions")
    if "statistics" in own:
        hints = typing.get_type_hints(cls.statistics)
        ret = hints.get("return")
        if not _frozen(ret):
            found.append(f"statistics() returns {ret!r}, not a frozen dataclass")
    return found


def _frozen(t: object) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen


def _frozen_returned(fn: typing.Any) -> type | None:
    """The frozen dataclass ``fn`` returns (alone or in a union), or None: an action handed back, not queued."""
    ret = typing.get_type_hints(fn).get("return")
    union = typing.get_origin(ret) in (typing.Union, types.UnionType)
    for t in (ret, *(typing.get_args(ret) if union else ())):
        if _frozen(t):
            return typing.cast(type, t)
    return None


def _params(fn: typing.Any) -> list[str]:
    """The positional parameters after self (keyword-only options may follow ``now``)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values() if p.kind in kinds and p.name != "self"]


def _core(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("module", "name"), [c for c in CORES if c not in NOT_YET])
def test_the_core_follows_the_contract(module: str, name: str) -> None:
    found = contract_violations(_core(module, name))
    assert not found, f"{module}.{name}:\n" + "\n".join(found)


@pytest.mark.parametrize(("module", "name"), sorted(NOT_YET))
def test_not_yet_is_not_stale(module: str, name: str) -> None:
    assert (module, name) in CORES
    assert contract_violations(_core(module, name)), (
        f"{module}.{name} follows the contract now: remove it from NOT_YET")


# -- the checker itself ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Loose:
    n: int = 0


@dataclasses.dataclass(frozen=True)
class _Frozen:
    n: int = 0


class _Good:
    def receive(self, data: bytes, now: float) -> None: ...
    def get_timer(self) -> float | None: ...
    def handle_timer(self, now: float) -> None: ...
    def take_actions(self) -> list: ...
    def statistics(self) -> _Frozen: ...


class _Bad:
    def receive(self, now: float, data: bytes) -> None: ...
    def step(self, rid: int, now: float) -> object: ...
    def next_deadline(self) -> float | None: ...
    def get_timer(self, now: float) -> float | None: ...
    def statistics(self) -> dict: ...


class _Handing:
    def receive_pass(self, datagrams: int, now: float) -> _Frozen | None: ...
    def take_actions(self) -> list: ...


class _Unfrozen:
    def statistics(self) -> _Loose: ...


def test_the_checker_passes_a_core_in_shape_and_names_each_departure() -> None:
    assert contract_violations(_Good) == []
    found = "\n".join(contract_violations(_Bad))
    for expected in ("next_deadline: an old name", "step: an old name", "both get_timer() and handle_timer",
                     "get_timer takes no",
                     "receive('now', 'data'): now comes last", "not a frozen dataclass"):
        assert expected in found
    assert contract_violations(_Handing) == [
        "receive_pass returns _Frozen: a core with take_actions queues its decisions"]
    assert contract_violations(_Unfrozen) == [f"statistics() returns {_Loose!r}, not a frozen dataclass"]
