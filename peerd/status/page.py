"""The status page an owner opens: served on the metrics port next to ``/metrics`` (``/`` and ``/status``), filled
from ``/status.json``, which the page fetches every 1.5 s. One self-contained HTML file: no external assets.

The daemon's trio loop hands over a finished snapshot (``StatusPage.update``) once a second while someone reads the
page (``watched``), and only notes each run's last round otherwise: building the snapshot costs a few milliseconds of
the CPU a training step shares. The HTTP threads only read the latest bytes (a first read waits up to a second for a
fresh snapshot), so a slow or hostile browser never touches the daemon's state.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

RECENT_ROUNDS = 20
WATCH_S = 10.0  # the page counts as read this long after its last fetch
FRESH_WAIT_S = 1.2  # a fetch while unread waits this long for the next snapshot (the daemon ticks once a second)


class StatusPage:
    """The latest snapshot as JSON bytes, and the recent rounds it has seen."""

    def __init__(self, rounds: int = RECENT_ROUNDS) -> None:
        self.rounds: deque[dict[str, Any]] = deque(maxlen=rounds)
        self._seen: set[tuple[str, int]] = set()
        self.latest = b"{}"
        self._read_at = -math.inf  # (time.monotonic) the last fetch of the page or its JSON
        self._fresh = threading.Event()

    def watched(self, now: float) -> bool:
        """Someone fetched the page within WATCH_S of ``now`` (time.monotonic): the daemon builds snapshots."""
        return now - self._read_at < WATCH_S

    def read(self) -> bytes:
        """The latest snapshot for an HTTP thread; a fetch while unread waits up to FRESH_WAIT_S for a fresh one."""
        now = time.monotonic()
        if not self.watched(now):
            self._fresh.clear()
            self._read_at = now
            self._fresh.wait(FRESH_WAIT_S)
        self._read_at = time.monotonic()
        return self.latest

    def seen(self, run: str, round_number: int) -> bool:
        """This run's round is among the recent rounds already (the caller need not build its record)."""
        return (run, round_number) in self._seen

    def note_round(self, run: str, last: dict[str, Any]) -> None:
        """Add a run's last round (a RoundStatistics as a dict) to the recent rounds, once."""
        if (run, last.get("round", -1)) in self._seen:
            return
        self._seen.add((run, last.get("round", -1)))
        self.rounds.appendleft({"run": run, **{k: last.get(k) for k in (
            "round", "outcome", "group_size", "received_fraction", "seconds", "matchmaking_s", "transfer_s",
            "compression", "bytes_sent")}})
        if len(self._seen) > 4 * (self.rounds.maxlen or 1):
            self._seen = {(r["run"], r["round"]) for r in self.rounds}

    def update(self, snapshot: dict[str, Any], runs: dict[str, Any]) -> None:
        """Take ``snapshot`` (the page's sections) and each run's last round from ``runs`` (moshpit statistics)."""
        for run, st in runs.items():
            last = st.get("last") if isinstance(st, dict) else None
            if last:
                self.note_round(run, last)
        self.latest = json.dumps({**snapshot, "rounds": list(self.rounds)}).encode()
        self._fresh.set()


def _app(registry: CollectorRegistry, page: StatusPage) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path in ("/", "/status"):
            body, kind = HTML.encode(), "text/html; charset=utf-8"
        elif path == "/status.json":
            body, kind = page.read(), "application/json"
        else:
            return metrics(environ, start_response)
        start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                                  ("Content-Security-Policy", "default-src 'self'; style-src 'unsafe-inline'; "
                                                              "script-src 'unsafe-inline'")])
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


def serve(host: str, port: int, registry: CollectorRegistry, page: StatusPage) -> WSGIServer:
    """Serve ``/metrics``, the page and its JSON on ``host:port`` in a daemon thread; the caller shuts it down."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("Server", (_Server,), {"address_family": family})
    server = make_server(host, port, _app(registry, page), server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="peerd-http", daemon=True).start()
    return server


HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>peerd status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .4em}
section{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.6em .9em;margin-bottom:.8em}
table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:2px 8px;border-bottom:1px solid #eee}
th{font-weight:600;color:#555} td.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#888} .bad{color:#b00} .ok{color:#070} .bar{background:#eee;height:8px;width:200px;display:inline-block}
.bar i{display:block;height:8px;background:#4a8}
</style></head><body>
<h1>peerd <span id="peer-id" class="muted"></span></h1>
<div class="muted">updated <span id="updated">never</span> (<span id="updates">0</span> updates)</div>
<section id="node"><h2>This node</h2><div id="node-body" class="muted">waiting for data</div></section>
<section id="link"><h2>Link use</h2><div id="link-body" class="muted">waiting for data</div></section>
<section id="budget"><h2>Budget</h2><div id="budget-body" class="muted">waiting for data</div></section>
<section id="peers"><h2>Peers</h2><table><thead><tr><th>peer</th><th>path</th><th>RTT ms</th><th>p99 ms</th>
<th>loss out</th><th>loss in</th><th>send</th><th>recv</th><th>goodput out</th><th>goodput in</th><th>heard</th>
<th>state</th></tr></thead><tbody id="peers-body"></tbody></table></section>
<section id="rounds"><h2>Recent rounds</h2><table><thead><tr><th>run</th><th>round</th><th>outcome</th><th>group</th>
<th>received</th><th>seconds</th><th>matchmaking s</th><th>transfer s</th><th>codec</th></tr></thead>
<tbody id="rounds-body"></tbody></table></section>
<section id="trainers"><h2>Trainers</h2><table><thead><tr><th>session</th><th>run</th><th>steps</th><th>last</th>
<th>seconds</th><th>codec</th><th>network share</th></tr></thead><tbody id="trainers-body"></tbody></table></section>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function text(x) { return x === null || x === undefined ? "-" : String(x); }
function rate(bps) {
  if (bps === null || bps === undefined) return "-";
  let b = bps * 8;
  for (const [u, s] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) if (b >= s) return (b / s).toFixed(1) + " " + u + "bit/s";
  return b.toFixed(0) + " bit/s";
}
function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%"; }
function num(x, d) { return x === null || x === undefined ? "-" : Number(x).toFixed(d); }
function rows(body, items, cells) {
  const tb = $(body);
  tb.replaceChildren();
  for (const item of items) {
    const tr = document.createElement("tr");
    for (const [value, cls] of cells(item)) {
      const td = document.createElement("td");
      td.textContent = value;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    tb.appendChild(tr);
  }
  if (!items.length) {
    const tr = document.createElement("tr"), td = document.createElement("td");
    td.textContent = "none yet"; td.className = "muted"; td.colSpan = 12; tr.appendChild(td); tb.appendChild(tr);
  }
  tb.dataset.rows = items.length;
}
function kv(id, pairs) {
  const el = $(id);
  el.replaceChildren();
  el.className = "";
  for (const [k, v] of pairs) {
    const d = document.createElement("div"), b = document.createElement("b");
    b.textContent = k + ": "; d.appendChild(b); d.appendChild(document.createTextNode(v)); el.appendChild(d);
  }
  el.dataset.filled = pairs.length;
}
function bytes(n) {
  if (n === null || n === undefined) return "-";
  for (const [u, s] of [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
    if (n >= s) return (n / s).toFixed(1) + " " + u;
  }
  return n.toFixed(0) + " B";
}
function span(s) {
  if (s === null || s === undefined) return "-";
  for (const [u, d] of [["d", 86400], ["h", 3600], ["min", 60]]) if (s >= d) return (s / d).toFixed(1) + " " + u;
  return s.toFixed(0) + " s";
}
function budget(b) {
  if (!b) return [["budget", "none set (peerd join --budget 200GB/month paces the node to one)"]];
  const used = b.budget_bytes > 0 ? b.used_bytes / b.budget_bytes : null;
  return [["used", bytes(b.used_bytes) + " of " + bytes(b.budget_bytes) + " this " + b.period + " (" + pct(used) +
           ")" + bar(used === null ? null : Math.min(1, used))],
    ["left", bytes(b.remaining_bytes) + " for " + span(b.period_left_s) + " (pace " + rate(b.allowance) + ")"],
    ["recent use", rate(b.recent_rate)],
    ["outlook", b.on_track ? "on track: lasts the " + b.period
      : "runs out in " + span(b.runs_out_in_s) + " at the recent rate"]];
}
function pacer(p) {
  if (!p) return "-";
  return "sends at " + rate(p.rate) + " (" + text(p.state) + "), bottleneck " +
    (p.btl === null ? "not yet measured" : rate(p.btl)) + "; " + p.decreases + " cuts, " + p.increases + " raises";
}
function bar(frac) { return frac === null ? "" : " [" + "#".repeat(Math.round(20 * frac)).padEnd(20, ".") + "]"; }
function render(s) {
  const node = s.node || {}, v = s.peer_view || {}, link = s.link || {};
  $("peer-id").textContent = text(node.peer_id).slice(0, 16);
  kv("node-body", [["peer id", text(node.peer_id)], ["listening", text(node.listen)],
    ["reachability", text(node.reachability)], ["routing table", text(node.peers) + " peers"],
    ["uptime", num(node.uptime_s, 0) + " s"], ["version", text(node.version)]]);
  const capUp = link.cap_upload_bps, capDown = link.cap_download_bps;
  kv("link-body", [
    ["upload", rate(v.send_bps) + (capUp ? " of " + rate(capUp) + bar(v.send_bps / capUp) : " (no cap)")],
    ["download", rate(v.recv_bps) + (capDown ? " of " + rate(capDown) + bar(v.recv_bps / capDown) : " (no cap)")],
    ["relayed", pct(v.relayed_fraction) + " of bytes"],
    ["averages received", pct(v.averages_received_fraction)],
    ["steps waiting on the network", pct(v.step_network_share)],
    ["pacer", pacer(s.pacer)],
    ["sent", (text(v.sent_bytes / 1e6 | 0)) + " MB"], ["received", (text(v.received_bytes / 1e6 | 0)) + " MB"]]);
  kv("budget-body", budget(link.budget));
  $("budget-body").dataset.budget = link.budget ? (link.budget.on_track ? "on-track" : "runs-out") : "none";
  rows("peers-body", v.peers || [], (p) => [[text(p.peer).slice(0, 16)],
    [p.path === "relayed" && p.via ? "relay " + p.via.slice(0, 8) : text(p.path)], [num(p.rtt_ms, 1), "n"],
    [num(p.rtt_p99_ms, 1), "n"], [pct(p.loss_out), "n"], [pct(p.loss_in), "n"], [rate(p.send_bps), "n"],
    [rate(p.recv_bps), "n"], [rate(p.goodput_out_bps), "n"], [rate(p.goodput_in_bps), "n"],
    [p.last_heard_s === null ? "-" : num(p.last_heard_s, 0) + " s ago", "n"],
    [text(p.verdict), p.verdict === "reachable" ? "ok" : "bad"]]);
  rows("rounds-body", s.rounds || [], (r) => [[text(r.run)], [text(r.round), "n"],
    [text(r.outcome), r.outcome === "averaged" ? "ok" : (r.outcome === "failed" ? "bad" : "")],
    [text(r.group_size), "n"], [pct(r.received_fraction), "n"], [num(r.seconds, 2), "n"],
    [num(r.matchmaking_s, 2), "n"], [num(r.transfer_s, 2), "n"], [text(r.compression)]]);
  rows("trainers-body", s.trainers || [], (t) => [[text(t.session)], [text(t.run)], [text(t.steps), "n"],
    [text(t.outcome)], [num(t.seconds, 3), "n"], [text(t.compression)], [pct(t.network_share), "n"]]);
}
let updates = 0;
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (r.ok) {
      render(await r.json());
      updates += 1;
      $("updates").textContent = updates;
      $("updated").textContent = new Date().toLocaleTimeString();
      document.body.dataset.updates = updates;
    }
  } catch (e) {
    $("updated").textContent = "failed: " + e;
  }
}
refresh();
setInterval(refresh, 1500);
</script></body></html>
"""
