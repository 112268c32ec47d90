"""A trainer against a poisoned snapshot (peerd.torch.snapcheck): a donor's snapshot with NaN in it or a step of
2**62 used to be loaded as is; now it is refused with nothing applied, and ``sync_state`` asks for the next one."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from peerd.localsock.arena import fill_blob  # noqa: E402
from peerd.torch import Optimizer  # noqa: E402
from peerd.torch.diloco import DiLoCo  # noqa: E402
from peerd.torch.snapcheck import MAX_STEP, SnapshotError  # noqa: E402

from .support.torch_models import flat, model  # noqa: E402


def _local_steps(m: torch.nn.Module, opt: Optimizer, steps: int) -> None:
    """Steps of the wrapped optimizer alone (no averaging: the snapshot only needs optimizer state in it)."""
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.opt.step()
        opt.step_count += 1


def _tampered(blob: bytes, **change) -> bytes:
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    for key, fn in change.items():
        state[key] = fn(state[key])
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _nan_first(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _nan_in_optimizer(opt_state: dict) -> dict:
    for per_param in opt_state["state"].values():
        per_param["exp_avg_sq"] = _nan_first(per_param["exp_avg_sq"])
    return opt_state


def test_a_poisoned_snapshot_is_refused_whole_hostile(daemon) -> None:  # noqa: F811
    a, b = model(0), model(7)
    oa = Optimizer(torch.optim.Adam(a.parameters(), lr=0.01), run="t", socket=daemon.path, sync_state=False,
                   state_every=0)
    _local_steps(a, oa, 3)
    good = oa.snapshot()
    ob = Optimizer(torch.optim.Adam(b.parameters(), lr=0.01), run="t", socket=daemon.path, sync_state=False,
                   state_every=0)
    before = flat(b).clone()
    poisoned = {
        "NaN": _tampered(good, params=_nan_first),
        "NaN or infinity": _tampered(good, optimizer=_nan_in_optimizer),
        "plausible": _tampered(good, step=lambda _: 2**62),
        "plausible step": _tampered(good, step=lambda _: -1),
    }
    for why, blob in poisoned.items():
        with pytest.raises(SnapshotError, match=why):
            ob.load_snapshot(blob)
        assert torch.equal(flat(b), before) and ob.step_count == 0  # nothing of it was applied
    with pytest.raises(SnapshotError, match="advertised"):  # another step than its donors advertised
        ob.load_snapshot(good, expected_step=3 + 10_000)
    with pytest.raises(ValueError):
        ob.load_snapshot(b"junk")
    assert ob.load_snapshot(_tampered(good, step=lambda _: MAX_STEP)) == MAX_STEP  # the bound itself loads
    assert ob.load_snapshot(good, expected_step=3) == 3 and torch.equal(flat(a), flat(b))

    # sync_state: a refused snapshot is excluded and the next candidate is fetched
    asked: list[list[str]] = []
    bad_sha, good_sha = "ee" * 32, "11" * 32

    def call(op: str, **args):
        assert op == "state_fetch"
        asked.append(list(args.get("exclude", [])))
        blob, sha = (good, good_sha) if bad_sha in args.get("exclude", []) else (poisoned["NaN"], bad_sha)
        fill_blob(args["fds"][0], blob)
        return {"found": True, "step": 3, "size": len(blob), "sha": sha, "donors": 1, "chunks": 1, "retries": 0}

    c = model(9)
    oc = Optimizer(torch.optim.Adam(c.parameters(), lr=0.01), run="t", socket=daemon.path, sync_state=False,
                   state_every=0)
    oc._call = call  # type: ignore[method-assign]
    assert oc.sync_state() and oc.step_count == 3 and torch.equal(flat(c), flat(a))
    assert asked == [[], [bad_sha]]

    def only_bad(op: str, **args):  # every donor serves poison: a clear error, never a NaN model
        fill_blob(args["fds"][0], poisoned["NaN"])
        return {"found": True, "step": 3, "size": len(poisoned["NaN"]), "sha": f"{len(asked):064x}", "donors": 1,
                "chunks": 1, "retries": 0}

    oc._call = only_bad  # type: ignore[method-assign]
    with pytest.raises(SnapshotError, match="refused 4 snapshots"):
        oc.sync_state()
    for o in (oa, ob, oc):
        o.close()


def test_a_poisoned_diloco_snapshot_is_refused_whole_hostile(daemon) -> None:  # noqa: F811
    m = model(0)
    opt = DiLoCo(m, torch.optim.Adam(m.parameters(), lr=0.01), run="dl", socket=daemon.path, sync_every=3,
                 sync_state=False, state_every=0)
    good = opt.snapshot()
    late = model(5)
    joiner = DiLoCo(late, torch.optim.Adam(late.parameters(), lr=0.01), run="dl", socket=daemon.path, sync_every=3,
                    sync_state=False, state_every=0)
    before = joiner.global_params.clone()
    for why, blob in {
        "global parameters": _tampered(good, **{"global": _nan_first}),
        "outer momentum": _tampered(good, momentum=lambda t: t + float("inf")),
        "sample counts": _tampered(good, samples=_nan_first),
        "negative": _tampered(good, samples=lambda t: t - 5),
        "plausible": _tampered(good, step=lambda _: 2**62),
    }.items():
        with pytest.raises(SnapshotError, match=why):
            joiner.load_snapshot(blob)
        assert torch.equal(joiner.global_params, before) and joiner.step_count == 0
    assert joiner.load_snapshot(good, expected_step=0) == 0 and torch.equal(joiner.global_params, opt.global_params)
    for o in (opt, joiner):
        o.close()
