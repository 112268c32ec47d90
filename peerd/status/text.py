"""``peerd status`` as text: the node's summary, its trainers, its caps and budget, and its per-peer table, one line
a peer (stdlib only: the CLI imports it without numpy)."""

from __future__ import annotations

import textwrap
import time
from typing import Any

# Drops that mean a misconfigured node, not noise: the node that sent them only sees timeouts, so say it here.
DROP_HINTS = {
    "auth": "datagrams that do not open with this swarm's key: a node with another --swarm-key-file "
            "(or --insecure) is trying to join",
    "self": "datagrams signed with this node's own identity: another node runs with the same --identity "
            "(give each node its own 'peerd keygen' file)",
}

COLUMNS = ("PEER", "PATH", "RTT ms", "P99 ms", "LOSS out/in", "SEND", "RECV", "GOODPUT out/in", "AVG MB", "DHT kB",
           "HEARD", "STATE")


def rate(bps: float | None) -> str:
    """Bytes per second as bits per second, short."""
    if bps is None:
        return "-"
    bits = bps * 8
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.1f}{unit}"
    return f"{bits:.0f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.1f}" if x < 100 else f"{x:.0f}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def peer_rows(peers: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = []
    for p in peers:
        path = p.get("path", "?")
        if path == "relayed" and p.get("via"):
            path = f"relay:{p['via'][:8]}"
        sent, received = p.get("sent_bytes") or {}, p.get("received_bytes") or {}
        avg = (sent.get("averaging", 0) + received.get("averaging", 0)) / 1e6
        dht = (sent.get("dht", 0) + received.get("dht", 0)) / 1e3
        heard = p.get("last_heard_s")
        rows.append((
            p.get("peer", "")[:16], path, _ms(p.get("rtt_ms")), _ms(p.get("rtt_p99_ms")),
            f"{_pct(p.get('loss_out'))}/{_pct(p.get('loss_in'))}", rate(p.get("send_bps")), rate(p.get("recv_bps")),
            f"{rate(p.get('goodput_out_bps'))}/{rate(p.get('goodput_in_bps'))}", f"{avg:.1f}", f"{dht:.1f}",
            "-" if heard is None else f"{heard:.0f}s", p.get("verdict", "?"),
        ))
    return rows


def peer_table(peers: list[dict[str, Any]]) -> list[str]:
    """The per-peer table, busiest first (the daemon's order), aligned."""
    rows = [COLUMNS, *peer_rows(peers)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def summary(reply: dict[str, Any]) -> list[str]:
    """The node's identity and swarm view, as ``peerd status`` has always printed it."""
    dropped = reply.get("datagrams_dropped") or {}
    lines = [
        f"peer id    {reply['peer_id']}",
        f"listening  {reply['listen']} (UDP){'  INSECURE' if reply.get('insecure') else ''}",
        f"swarm      {reply['peers']} peers in the routing table, "
        f"{'joined' if reply.get('joined') else 'still joining'}",
        f"records    {reply.get('records', 0)} held for the DHT",
        f"uptime     {reply['uptime_s']:.0f} s",
    ]
    if dropped:
        lines.append("dropped    " + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))
        for reason, why in DROP_HINTS.items():
            if dropped.get(reason):
                lines.append(f"           {reason}: {why}")
    return lines


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _span(s: float) -> str:
    """Seconds as the two largest units (2 d 4 h, 3 h 10 min, 45 s)."""
    s = max(0.0, s)
    d, h, mi = int(s // 86400), int(s % 86400 // 3600), int(s % 3600 // 60)
    if d:
        return f"{d} d {h} h"
    if h:
        return f"{h} h {mi} min"
    return f"{mi} min" if mi else f"{s:.0f} s"


def _use(name: str, used: float, limit: float | None, configured: float | None) -> str:
    if limit is None:
        return f"{name} {rate(used)}bit/s (no cap)"
    why = "" if configured is not None and limit >= configured else " (budget)"
    return f"{name} {rate(used)} of {rate(limit)}bit/s{why} {100 * used / limit:.0f} %"


def caps(c: dict[str, Any]) -> list[str]:
    """The caps in force and this node's use of them (the last second), and a budget's standing: used, left, and
    when it would run out at the last minute's rate."""
    lines = [f"caps       {_use('up', c['upload_rate'], c.get('upload_limit'), c.get('max_upload'))}, "
             f"{_use('down', c['download_rate'], c.get('download_limit'), c.get('max_download'))}; "
             f"sends held {c.get('held_s', 0.0):.1f} s in all"
             + (f", {c['serve_refused']} state answers over the serving share" if c.get("serve_refused") else "")]
    b = c.get("budget")
    if b:
        used, total = b["used_bytes"], b["budget_bytes"]
        lines.append(f"budget     {_bytes(used)} of {_bytes(total)} used this {b.get('period', 'period')} "
                     f"({100 * used / total:.1f} %), {_bytes(b['remaining_bytes'])} left for "
                     f"{_span(b['period_left_s'])}")
        at = b.get("runs_out_at")
        if b.get("on_track", True) or b.get("runs_out_in_s") is None:
            lines.append(f"           on track: at the last minute's {rate(b['recent_rate'])}bit/s it lasts the "
                         f"period (allowance {rate(b['allowance'])}bit/s both ways together)")
        else:
            when = "" if at is None else time.strftime(" (%Y-%m-%d %H:%M UTC)", time.gmtime(at))
            lines.append(f"           at the last minute's {rate(b['recent_rate'])}bit/s it runs out in "
                         f"{_span(b['runs_out_in_s'])}{when}; allowance {rate(b['allowance'])}bit/s both ways "
                         f"together")
    return lines


def pacer_line(p: dict[str, Any]) -> str:
    """The sender's pacer: the rate it sends averages at, what it takes the uplink's bottleneck for, and how often it
    cut and raised them (a rate far under the link's, with many cuts, is a lossy or congested uplink)."""
    btl = "not yet measured (startup)" if p.get("btl") is None else f"{rate(p['btl'])}bit/s"
    queue = "" if p.get("queue_delay") is None else f", uplink queue {1000 * p['queue_delay']:.0f} ms"
    return (f"pacer      sends at {rate(p.get('rate'))}bit/s ({p.get('state', '-')}); bottleneck {btl}{queue}; "
            f"{p.get('decreases', 0)} cuts, {p.get('increases', 0)} raises, {p.get('resumes', 0)} resumes")


def network(view: dict[str, Any], capped: bool = False) -> list[str]:
    """This node's link use, the swarm-level fractions, and the per-peer table."""
    lines = [f"link       up {rate(view.get('send_bps'))}bit/s, down {rate(view.get('recv_bps'))}bit/s"
             f"{' (caps above)' if capped else ' (no cap)'}; "
             f"relayed {_pct(view.get('relayed_fraction'))} of bytes; averages received "
             f"{_pct(view.get('averages_received_fraction'))}; network share of steps "
             f"{_pct(view.get('step_network_share'))}"]
    peers = view.get("peers") or []
    if not peers:
        return [*lines, "peers      none exchanged data yet"]
    more = view.get("tracked", len(peers)) - len(peers)
    return [*lines, "", *peer_table(peers), *([f"... and {more} more"] if more > 0 else [])]


def deadline_lines(deadlines: dict[str, Any]) -> list[str]:
    """``peerd status``'s deadlines, one line each: the value, what it was derived from and its bounds."""
    lines = []
    for name, d in deadlines.items():
        measured = "nothing measured yet" if d.get("measured") is None else \
            f"{d['measurement']} {d['measured']:.3f} over {d['samples']} sample(s)"
        lines.append(f"deadline   {name:<13} {d['seconds']:7.2f} s  ({d['basis']}: {measured}; "
                     f"floor {d['floor_s']:g} s, cap {d['cap_s']:g} s)")
    return lines


def trainer_lines(trainers: list[dict[str, Any]], width: int = 118, *, brief: bool = False) -> list[str]:
    """Each trainer session: its run, codec and steps, its latest step (outcome, seconds, its longest phases), and
    what its "auto" options chose, with why (the reason wrapped, one choice a line). ``brief``: the first line
    only (`peerd top`, whose screen is the peer table's)."""
    out = []
    for t in trainers:
        seconds = t.get("seconds") or 0.0
        kept = ", kept group" if t.get("kept") else ""
        out.append(f"trainer    session {t.get('session')}  run {t.get('run', '?')}  {t.get('compression') or 'fp32'}  "
                   f"{t.get('steps', 0)} steps  last: {t.get('outcome') or '-'} in {seconds:.3f} s{kept}")
        if brief:
            continue
        phases = sorted(((v, k) for k, v in (t.get("phases") or {}).items()
                         if isinstance(v, int | float) and v >= 0.0005), reverse=True)
        if phases:
            out.append("           phases: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for v, k in phases[:4]))
        reason = (t.get("auto") or {}).get("reason")
        if isinstance(reason, str) and reason:
            for part in reason.split("; "):
                out += textwrap.wrap(part, width, initial_indent="           auto: ",
                                     subsequent_indent="                 ")
        pace = (t.get("auto") or {}).get("pace")  # DiLoCo's keep_pace
        if isinstance(pace, str) and pace:
            out += textwrap.wrap(pace, width, initial_indent="           pace: ", subsequent_indent="                 ")
    return out


def render(reply: dict[str, Any], *, brief: bool = False) -> str:
    """The status reply as text; ``brief`` (`peerd top`, a screen of live figures): each trainer in one line, and
    no deadline lines (they move slowly, and would push the per-peer table off the screen)."""
    out = summary(reply)
    if reply.get("trainers"):
        out += trainer_lines(reply["trainers"], brief=brief)
    if reply.get("deadline_mode") == "fixed":
        out.append("deadlines  fixed (--deadlines fixed: today's constants, nothing tuned)")
    if reply.get("deadlines") and not brief:
        out += deadline_lines(reply["deadlines"])
    cap = reply.get("caps")
    if cap:
        out += caps(cap)
    if reply.get("pacer"):
        out.append(pacer_line(reply["pacer"]))
    view = reply.get("peer_view")
    if view:
        out += network(view, capped=bool(cap))
    return "\n".join(out)
