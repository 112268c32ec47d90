"""The scripts in examples/ run as the README says and do what they claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL, cwd=ROOT)


@pytest.mark.e2e
def test_two_peers_on_one_machine_average_every_step_and_end_identical():
    proc = run_example("train_two_peers.py", "--steps", "40", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["peer"] for r in results] == [0, 1]
    for r in results:
        assert r["steps"] == 40
        assert r["outcomes"].get("averaged", 0) >= 30, r  # the peers trained together, not alone
        assert r["accuracy"] > 0.8, r
    assert results[0]["param_checksum"] == results[1]["param_checksum"]
    assert "parameters identical" in proc.stdout
