"""The daemon runs numpy's OpenBLAS on one thread unless its environment names a count (peerd.blas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from peerd import cli

PROBE = """
import json, os
from peerd.blas import blas_threads, one_blas_thread
import numpy
before = blas_threads()
done = one_blas_thread()
print(json.dumps({"before": before, "done": done, "after": blas_threads()}))
"""


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_one_thread_by_default():
    got = _probe(OPENBLAS_NUM_THREADS="2")
    assert got["before"], "numpy's wheel bundles OpenBLAS: it must be found in the process"
    assert got["done"] is False and got["after"] == got["before"]  # the owner's count wins
    got = _probe()
    assert got["done"] is True
    assert got["after"] == [1] * len(got["before"])


def test_join_sets_one_thread_before_the_daemon_starts(monkeypatch, tmp_path):
    import peerd.daemon as daemon

    calls: list[str] = []

    class Refused(daemon.Daemon):  # type: ignore[misc]
        def __init__(self, config: object) -> None:
            calls.append("daemon")
            raise daemon.StartupError("refused by the test")

    monkeypatch.setattr(cli, "one_blas_thread", lambda: calls.append("blas") or True)
    monkeypatch.setattr(daemon, "Daemon", Refused)
    rc = cli.main(["join", "--insecure", "--listen", "127.0.0.1:0", "--socket", str(tmp_path / "d.sock"),
                   "--identity", str(tmp_path / "id.key")])
    assert rc == 1
    assert calls == ["blas", "daemon"]


@pytest.mark.parametrize("line", ["", "7f00-7f01 r-xp 00000000 00:00 0"])
def test_maps_lines_without_a_path_are_skipped(monkeypatch, tmp_path, line):
    import peerd.blas as blas

    maps = tmp_path / "maps"
    maps.write_text(f"{line}\n7f02-7f03 r-xp 00000000 08:01 42   /opt/lib/libopenblas.so.0\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(maps if p == "/proc/self/maps" else p, *a, **k))
    assert blas._loaded_blas() == ["/opt/lib/libopenblas.so.0"]
