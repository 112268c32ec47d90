"""Shared helpers for end-to-end tests that run real peerd processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from peerd.tools.swarm import LocalSwarm

# A shell without job control starts background jobs (`cmd &`) with SIGINT ignored, and an ignored signal stays
# ignored across exec: every `peerd swarm`, lab holder and daemon a test starts would then ignore the Ctrl-C the
# test sends it (three Ctrl-C tests timed out that way under `nohup .ci/run &`). A handler installed here is reset
# to the default in children, so they get Python's usual KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def peerd(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Run the peerd CLI as a user would."""
    proc = subprocess.run([sys.executable, "-m", "peerd", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"peerd {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def peerd_json(*args: str, timeout: float = 60) -> dict:
    return json.loads(peerd(*args, "--json", timeout=timeout).stdout)


def scrape(metrics_addr: str) -> str:
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(predicate, timeout: float, interval: float = 1.0, what: str = "condition"):
    """Poll gently (these machines have 2 cores); returns the predicate's truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


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
