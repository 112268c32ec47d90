"""`peerd demo --model gpt --baseline hivemind`: the GPT script under hivemind.Optimizer (peerd.tools.demo_hivemind).

hivemind is not a dependency of peerd and CI does not install it: these tests drive the wrap through a recording
double of hivemind's two classes (what it asks of them is the contract under test), and check that the demo says how
to get hivemind where it is missing."""

from __future__ import annotations

import sys
import threading
import time
from types import ModuleType, SimpleNamespace

import pytest


class _Recorder:
    """Stand-ins for hivemind.DHT and hivemind.Optimizer that record how they were built."""

    def __init__(self) -> None:
        self.dhts: list[dict] = []
        self.optimizers: list[dict] = []
        recorder = self

        class DHT:
            def __init__(self, initial_peers=None, **kw) -> None:
                recorder.dhts.append({"initial_peers": initial_peers, **kw})
                self.down = False

            def get_visible_maddrs(self):
                return ["/ip4/127.0.0.1/tcp/4001/p2p/Qm", "/ip4/10.77.0.1/tcp/4001/p2p/Qm"]

            def shutdown(self) -> None:
                self.down = True

        class Optimizer:
            def __init__(self, **kw) -> None:
                recorder.optimizers.append(kw)
                self.dht = kw["dht"]
                self.opt = kw["optimizer"]
                self.closed = False

            def shutdown(self) -> None:
                self.closed = True

        self.module = ModuleType("hivemind")
        self.module.DHT = DHT  # type: ignore[attr-defined]
        self.module.Optimizer = Optimizer  # type: ignore[attr-defined]


def _args(tmp_path, **kw) -> SimpleNamespace:
    base = {"index": 0, "world": 4, "batch": 8, "sync_every": 20, "run": "gpt",
            "rendezvous": str(tmp_path)}
    return SimpleNamespace(**{**base, **kw})


def test_the_wrap_uses_the_quickstart_settings_and_the_first_peer_as_bootstrap(tmp_path, monkeypatch) -> None:
    from peerd.tools import demo_hivemind as dh

    rec = _Recorder()
    monkeypatch.setitem(sys.modules, "hivemind", rec.module)
    inner = SimpleNamespace(param_groups=[{"lr": 1.0}])
    first = dh.wrap_hivemind(inner, _args(tmp_path))
    assert rec.dhts[0]["initial_peers"] is None and rec.dhts[0]["start"] is True
    # the first peer leaves the addresses others can reach (not its loopback) where the others look
    assert (tmp_path / dh.PEERS_FILE).read_text().split() == ["/ip4/10.77.0.1/tcp/4001/p2p/Qm"]
    other = dh.wrap_hivemind(inner, _args(tmp_path, index=2, sync_every=50))
    assert rec.dhts[1]["initial_peers"] == ["/ip4/10.77.0.1/tcp/4001/p2p/Qm"]
    h20, h50 = rec.optimizers
    # an average whenever all peers together have trained sync_every steps' samples
    assert h20["target_batch_size"] == 8 * 4 * 20 and h50["target_batch_size"] == 8 * 4 * 50
    dh.wrap_hivemind(inner, _args(tmp_path, index=1, matchmaking_s=1.0))
    assert rec.optimizers[2]["matchmaking_time"] == 1.0  # --hivemind-matchmaking
    for o in (h20, h50):
        assert o["use_local_updates"] is True and o["optimizer"] is inner
        assert o["batch_size_per_step"] == 8 and o["run_id"] == "gpt"
        assert o["matchmaking_time"] == dh.MATCHMAKING_S == 3.0 and o["averaging_timeout"] == 10.0
    # the learning rate goes to the optimizer's own groups (hivemind's param_groups are copies)
    assert dh.inner_groups(first) is inner.param_groups
    dh.close(other)
    assert other.closed and other.dht.down


def test_a_peer_waits_for_the_first_ones_addresses_and_says_when_they_never_come(tmp_path) -> None:
    from peerd.tools import demo_hivemind as dh

    path = str(tmp_path / dh.PEERS_FILE)
    writer = threading.Timer(0.3, dh._publish, args=(path, ["/ip4/10.77.0.1/tcp/1/p2p/Qa", "/ip4/x"]))
    writer.start()
    t0 = time.monotonic()
    assert dh._await_peers(path, timeout_s=10.0) == ["/ip4/10.77.0.1/tcp/1/p2p/Qa", "/ip4/x"]
    assert 0.2 < time.monotonic() - t0 < 5.0
    with pytest.raises(SystemExit, match="did not publish its addresses"):
        dh._await_peers(str(tmp_path / "never"), timeout_s=0.3)



def test_the_wrap_needs_a_rendezvous_folder(tmp_path, monkeypatch) -> None:
    from peerd.tools import demo_hivemind as dh

    monkeypatch.setitem(sys.modules, "hivemind", _Recorder().module)
    with pytest.raises(SystemExit, match="--rendezvous"):
        dh.wrap_hivemind(object(), _args(tmp_path, rendezvous=None))


def test_without_hivemind_the_demo_says_how_to_get_it(monkeypatch, tmp_path) -> None:
    from peerd.tools import demo_hivemind as dh
    from peerd.tools.bench.ddp_baseline import DDPConfig, run_ddp_baseline

    monkeypatch.setitem(sys.modules, "hivemind", None)  # import hivemind raises ImportError
    with pytest.raises(SystemExit, match="pip install hivemind==1.1.12"):
        dh.need_hivemind()
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="pip install hivemind==1.1.12"):
        run_ddp_baseline(DDPConfig(world=2, steps=4, model="gpt", kind="hivemind"), target=0.9, workdir=str(tmp_path))
    with pytest.raises(RuntimeError, match="--model gpt"):
        run_ddp_baseline(DDPConfig(world=2, steps=4, model="mlp", kind="hivemind"), target=0.9, workdir=str(tmp_path))


def test_the_hivemind_rank_runs_the_script_with_its_period_and_rendezvous(monkeypatch) -> None:
    from peerd.tools.bench import ddp_baseline

    seen: list[list[str]] = []
    fake = ModuleType("peerd.tools.demo_gpt")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "peerd.tools.demo_gpt", fake)
    cfg = ddp_baseline.DDPConfig(world=4, steps=600, model="gpt", kind="hivemind", sync_every=50,
                                 rendezvous="/tmp/r")
    assert ddp_baseline.worker(cfg, 3) == 0
    argv = seen[0]
    assert argv[argv.index("--launcher") + 1] == "hivemind" and argv[argv.index("--index") + 1] == "3"
    assert argv[argv.index("--sync-every") + 1] == "50"
    assert argv[argv.index("--rendezvous") + 1] == "/tmp/r" and "--matchmaking-s" not in argv
    ddp_baseline.worker(ddp_baseline.DDPConfig(world=4, steps=6, model="gpt", kind="hivemind", matchmaking_s=1.5), 0)
    assert seen[-1][seen[-1].index("--matchmaking-s") + 1] == "1.5"
    ddp_baseline.worker(ddp_baseline.DDPConfig(world=4, steps=600, model="gpt"), 0)
    assert seen[-1][seen[-1].index("--launcher") + 1] == "ddp" and "--rendezvous" not in seen[-1]


def test_the_cli_says_at_once_when_hivemind_is_missing(capsys, monkeypatch) -> None:
    from peerd.cli import main

    monkeypatch.setitem(sys.modules, "hivemind", None)  # not importable: refused before peerd's own run starts
    with pytest.raises(SystemExit):
        main(["demo", "--model", "gpt", "--baseline", "hivemind"])
    assert "pip install hivemind==1.1.12" in capsys.readouterr().err


def test_the_cli_refuses_hivemind_for_the_small_models(capsys) -> None:
    from peerd.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--model", "mlp", "--baseline", "hivemind"])
    assert "--baseline hivemind trains the GPT script" in capsys.readouterr().err
    for argv in (["--hivemind-matchmaking", "1"], ["--baseline", "hivemind", "--hivemind-matchmaking", "0"]):
        with pytest.raises(SystemExit):
            main(["demo", "--model", "gpt", *argv])
        assert "--hivemind-matchmaking goes with --baseline hivemind" in capsys.readouterr().err
