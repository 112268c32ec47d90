"""End to end: a 3-daemon swarm that averaged shows its peers in `peerd status`, `peerd top`, the metrics and the
status page (the page checked in a real headless Chromium where one is installed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from peerd.metrics import TOP_PEERS
from peerd.tools.swarm import LocalSwarm

from .support.processes import metric_value, peerd, peerd_json, scrape, wait_until

pytestmark = pytest.mark.e2e

SIZE = 100_000  # floats: 400 KB a vector
BUDGET = "500TB/month"  # node 0's: its pace (some 800 Mbit/s each way) never binds here
# A trainer that takes a few averaged steps, says so, and keeps its session open until its stdin closes.
TRAINER = """
import sys, torch, peerd.torch
torch.manual_seed(0)
model = torch.nn.Linear(64, 1)
opt = peerd.torch.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), run="trainers", socket=sys.argv[1],
                            timeout_s=20, average_params_every=0)
for _ in range(int(sys.argv[2])):
    loss = model(torch.randn(16, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step(samples=16, loss=loss.item())
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    """Three daemons that averaged two rounds, two of them with a trainer still attached, the first under a byte
    budget too large to bind; yields (swarm, statuses)."""
    swarm = LocalSwarm(str(tmp_path_factory.mktemp("swarm")))
    trainers: list[subprocess.Popen] = []
    try:
        first = swarm.start(extra=("--budget", BUDGET))
        swarm.wait_ready(first)
        nodes = [first, *swarm.start_many(2)]
        wait_until(lambda: min(n.call("status")["peers"] for n in nodes) >= 2, 30, 0.2, what="peers to meet")
        for n in nodes:
            n.call("avg_open", run="view", window_s=2.0)
        rng = np.random.default_rng(1)
        for _ in range(2):
            with ThreadPoolExecutor(3) as pool:
                replies = list(pool.map(lambda n: n.call(
                    "avg_round", timeout=90, run="view", vector=rng.standard_normal(SIZE).astype("<f4").tobytes(),
                    weight=1.0, timeout_s=30.0), nodes))
            assert all(r["stats"]["outcome"] == "averaged" for r in replies), [r["stats"] for r in replies]
            time.sleep(1.5)  # a tick of the view (the status page samples each run's latest round once a second)
        trainers = [subprocess.Popen([sys.executable, "-c", TRAINER, n.socket, "4"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True) for n in nodes[:2]]
        for t in trainers:
            assert t.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        yield swarm, [swarm.wait_ready(n) for n in nodes]
    finally:
        for t in trainers:
            t.stdin.close()
            t.wait(timeout=30)
        swarm.cleanup()


def test_status_json_lists_each_peer_with_plausible_rtt_and_bytes(averaged) -> None:
    swarm, statuses = averaged
    ids = [s["peer_id"] for s in statuses]
    view = peerd_json("status", "--socket", swarm.nodes[0].socket)["peer_view"]
    peers = {p["peer"]: p for p in view["peers"]}
    assert set(ids[1:]) <= set(peers), (ids, list(peers))
    for other in ids[1:]:
        p = peers[other]
        assert p["path"] == "direct" and p["verdict"] == "reachable" and p["addr"].startswith("127.0.0.1:")
        assert p["rtt_samples"] >= 1 and 0 < p["rtt_ms"] < 1000 and p["rtt_p99_ms"] >= p["rtt_ms"] * 0.5
        # each round this node sends its peers about 2/3 of the vector's 400 KB between them, and receives as much
        assert 50_000 < p["sent_bytes"]["averaging"] < 2_000_000, p["sent_bytes"]
        assert 50_000 < p["received_bytes"]["averaging"] < 2_000_000, p["received_bytes"]
        assert p["sent_bytes"]["dht"] > 0 and p["received_bytes"]["dht"] > 0
        assert p["loss_out"] is not None and p["loss_out"] < 0.05  # loopback: the REPORTs say almost nothing lost
        assert p["loss_in"] is not None and p["loss_in"] < 0.05
        assert p["last_heard_s"] is not None and p["last_heard_s"] < 60
    assert view["tracked"] == len(view["peers"]) >= 2 and view["relayed_fraction"] == 0.0
    assert view["averages_received_fraction"] is not None and view["averages_received_fraction"] > 0.95
    assert view["sent_by_kind"]["averaging"] >= sum(peers[i]["sent_bytes"]["averaging"] for i in ids[1:])


def test_status_text_has_one_line_per_peer_and_top_quits_on_q(averaged) -> None:
    swarm, statuses = averaged
    text = peerd("status", "--socket", swarm.nodes[0].socket).stdout
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("PEER "))
    for s in statuses[1:]:
        assert sum(line.startswith(s["peer_id"][:16]) for line in lines[header:]) == 1, text
    start = time.monotonic()
    top = subprocess.run([sys.executable, "-m", "peerd", "top", "--socket", swarm.nodes[0].socket, "--interval",
                          "0.5"], input="q", capture_output=True, text=True, timeout=30)
    assert top.returncode == 0 and time.monotonic() - start < 20, top.stderr
    assert "peerd top" in top.stdout and statuses[1]["peer_id"][:16] in top.stdout and "\x1b[2J" in top.stdout
    top = subprocess.Popen([sys.executable, "-m", "peerd", "top", "--socket", swarm.nodes[0].socket],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "peerd top" in top.stdout.readline()
    top.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = top.communicate(timeout=20)
    assert top.returncode == 0 and "Traceback" not in err and out.endswith("\x1b[?25h"), err


def test_metrics_keep_per_peer_series_bounded(averaged) -> None:
    swarm, statuses = averaged
    text = scrape(statuses[0]["metrics"])
    series = [line for line in text.splitlines() if line.startswith("peerd_peer_send_bytes_per_second{")]
    assert 2 <= len(series) <= TOP_PEERS + 1
    assert metric_value(text, "peerd_traffic_bytes_total", direction="out", kind="averaging") > 50_000
    assert metric_value(text, "peerd_peers_tracked") >= 2
    assert metric_value(text, "peerd_averages_received_fraction") > 0.95
    assert metric_value(text, "peerd_pacing_changes_total", action="increase") >= 1  # startup's steps up, at least
    assert f'peer="{statuses[1]["peer_id"][:16]}",stat="smoothed"' in text


def _page_json(metrics: str) -> dict:
    with urllib.request.urlopen(f"http://{metrics}/status.json", timeout=10) as r:
        return json.loads(r.read())


def test_status_page_json_has_every_section(averaged) -> None:
    swarm, statuses = averaged
    page = _page_json(statuses[0]["metrics"])
    assert page["node"]["peer_id"] == statuses[0]["peer_id"]
    assert len(page["peer_view"]["peers"]) >= 2
    link = page["link"]  # the budget's pace is the limit in force each way
    assert link["budget"]["budget_bytes"] == 500e12 and link["budget"]["on_track"], link
    assert link["cap_upload_bps"] > 1e8 and link["cap_download_bps"] > 1e8, link
    assert 0 < link["budget"]["used_bytes"] < 1e9 and link["budget"]["period"] == "month", link
    assert [r["outcome"] for r in page["rounds"] if r["run"] == "view"] == ["averaged", "averaged"]
    assert len(page["trainers"]) == 1 and page["trainers"][0]["steps"] == 4
    assert 0 < page["trainers"][0]["network_share"] < 1 and 0 < page["peer_view"]["step_network_share"] < 1
    assert page["pacer"]["rate"] > 0 and page["pacer"]["state"] in ("startup", "cycle"), page["pacer"]
    with urllib.request.urlopen(f"http://{statuses[0]['metrics']}/", timeout=10) as r:
        html = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/html")
    assert "status.json" in html and "http://" not in html.replace("http://www.w3.org", "")  # no external assets


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_status_page_in_a_real_browser_shows_every_section(averaged, tmp_path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's chromium; apt-get could not here)")
    swarm, statuses = averaged
    url = f"http://{statuses[0]['metrics']}/status"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert 'data-updates="' in dom, dom[:2000]
    for section in ("node-body", "link-body", "budget-body"):
        assert f'id="{section}" class="" data-filled="' in dom, section
    for body, least in (("peers-body", 2), ("rounds-body", 2), ("trainers-body", 1)):
        rows = int(dom.split(f'id="{body}" data-rows="', 1)[1].split('"', 1)[0])
        assert rows >= least, (body, rows)
    assert statuses[1]["peer_id"][:16] in dom and "reachable" in dom
    # the link against its limits, and the budget: used of total, what is left, and its outlook
    assert "upload" in dom and " of " in dom and 'data-budget="on-track"' in dom, dom[:4000]
    assert "sends at " in dom and " raises" in dom, dom[:4000]  # the pacer
    assert "of 500.0 TB this month" in dom and "on track: lasts the month" in dom and "pace " in dom
    shot = os.environ.get("PEERD_STATUS_SCREENSHOT")  # where a person wants the picture (docs/status-page.png)
    if shot:
        subprocess.run([*flags, "--window-size=1100,1080", "--hide-scrollbars", f"--screenshot={shot}", url],
                       capture_output=True, timeout=120, check=True)
        assert Path(shot).stat().st_size > 10_000
