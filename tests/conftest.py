"""Fixtures for every test (the helpers they use are in tests/support/)."""

from __future__ import annotations

import signal

import pytest

from peerd.dht import records as records_module
from peerd.tools.swarm import LocalSwarm

from .support.trainer_harness import thread_daemon

# A shell without job control starts background jobs (`cmd &`) with SIGINT ignored, and an ignored signal stays
# ignored across exec: every `peerd swarm`, lab holder and daemon a test starts would then ignore the Ctrl-C the
# test sends it (three Ctrl-C tests timed out that way under `nohup .ci/run &`). A handler installed here is reset
# to the default in children, so they get Python's usual KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def swarm(tmp_path):
    s = LocalSwarm(str(tmp_path / "swarm"))
    try:
        yield s
    finally:
        s.cleanup()
        for node in s.nodes:  # show what the daemons said when a test fails
            if node.proc.returncode not in (0, -9):
                print(f"--- peer {node.index} exited {node.proc.returncode}:\n{node.log_tail(40)}")


@pytest.fixture
def verify_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the DHT's record signature check (a record is verified once, then cached)."""
    calls = [0]
    real = records_module.verify

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(records_module, "verify", counting)
    return calls


@pytest.fixture
def daemon(tmp_path):
    """An in-process daemon (local socket, trainer service) whose averager groups two sessions."""
    with thread_daemon(tmp_path, group_size=2, wait_s=5.0) as d:
        yield d
