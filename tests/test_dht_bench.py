"""`peerd bench dht` end to end, small: real daemons as processes (a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_dht_reads_back_every_key_and_reports_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "peerd", "bench", "dht", "--peers", "5", "--keys", "6", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["peers"] == 5 and result["keys"] == 6 and result["sealed"]
    assert result["gets_missing_value"] == 0
    for form in ("api_agreed", "member_full", "member_agreed"):
        assert result[form]["gets_missing_value"] == 0
    # a full read asks each of the other daemons (4 < k); one that may end early asks no more
    assert result["rpcs_per_get"] >= 4
    assert 0 < result["member_agreed"]["rpcs_per_get"] <= result["member_full"]["rpcs_per_get"]
    assert 0 < result["api_agreed"]["rpcs_per_get"] <= result["rpcs_per_get"]
    assert result["put_stored_min"] >= 3  # a majority of the 4 others, at least
    for name in ("put_p50_ms", "get_p50_ms", "get_p99_ms", "tables_full_s", "swarm_cpu_ms_per_get"):
        assert result[name] >= 0
    assert result["rss_mib"]["max"] > 0
