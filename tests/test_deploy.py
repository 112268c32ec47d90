"""deploy/: a real Prometheus scraping real daemons, the dashboard's metric names against a live daemon, the
compose file, the systemd unit and the container entrypoint (run here on the host, without containers).

The compose swarm itself runs under podman in deploy/compose-test.sh (root only; .ci/run runs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peerd.metrics import Metrics

from .support.processes import metric_value, peerd_json, scrape, wait_until
from .support.users import ROOT, _as_user, _free_id  # noqa: E402

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "peerd.json"

# Names the dashboard uses that no daemon exports yet, because the issue that adds them has not landed.
# Empty now: moshpit (peerd_moshpit_*) and trainer (peerd_trainer_*) metrics are in peerd/metrics.py.
PENDING: frozenset[str] = frozenset()

# Labels Prometheus adds to every target (deploy/prometheus.yml adds `role`).
TARGET_LABELS = {"instance", "job", "role"}


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------------------------------------------
# The dashboard and prometheus.yml: which metrics they name, and whether a live daemon exports them


def dashboard_exprs() -> list[str]:
    exprs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "expr" and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(DASHBOARD.read_text()))
    return exprs


def metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bpeerd_[a-zA-Z0-9_]+", text))


def exported_series(exposition: str) -> dict[str, str]:
    """Every series name a /metrics page can carry, even for labelled metrics with no samples yet -> type."""
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
        "info": ("_info",),
    }
    series = {}
    for family in text_string_to_metric_families(exposition):
        for suffix in suffixes.get(family.type, ("",)):
            series[family.name + suffix] = family.type
        for sample in family.samples:
            series.setdefault(sample.name, family.type)
    return series


def declared_labels() -> dict[str, set[str]]:
    """Series name -> label names, from the daemon's registry (labels of metrics with no samples yet too)."""
    labels: dict[str, set[str]] = {}
    for attr in vars(Metrics()).values():
        names = getattr(attr, "_labelnames", None)
        if names is None:
            continue
        kind = getattr(attr, "_type", "")
        for family in attr.describe():
            base = set(names)
            if kind == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    labels[family.name + suffix] = base | ({"le"} if suffix == "_bucket" else set())
            elif kind == "counter":
                labels[family.name + "_total"] = base
            else:
                labels[family.name] = base
    return labels


def test_dashboard_is_provisioned_against_the_prometheus_datasource():
    dash = json.loads(DASHBOARD.read_text())
    datasource = (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    provider = (DEPLOY / "grafana/provisioning/dashboards/peerd.yml").read_text()
    assert re.search(r"^\s*uid: prometheus$", datasource, re.M)
    assert re.search(r"^\s*url: http://prometheus:9090$", datasource, re.M)
    assert "path: /var/lib/grafana/dashboards" in provider
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in compose
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in compose

    panels = [p for p in dash["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    for wanted in ("Swarm size", "Rounds and their outcome", "Round time", "Group size", "Bytes per second",
                   "Received fraction", "Drops by reason", "Training loss", "Samples per second", "Per-peer send rate",
                   "Per-peer receive rate", "Per-peer RTT", "Per-peer loss", "Traffic by kind"):
        assert wanted in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"]["uid"] == "prometheus", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "prometheus"
            assert metric_names(t["expr"]) or 'up{job="peerd"}' in t["expr"], f"{p['title']}: {t['expr']}"


@pytest.mark.e2e
def test_every_dashboard_metric_is_exported_by_a_live_daemon(swarm):
    used = set()
    for expr in dashboard_exprs():
        used |= metric_names(expr)
    used |= metric_names((DEPLOY / "prometheus.yml").read_text())  # recording/alerting rules, if any
    wanted = {"peerd_dht_peers", "peerd_moshpit_rounds_total", "peerd_moshpit_round_seconds_bucket",
              "peerd_moshpit_group_size", "peerd_udp_sent_bytes_total", "peerd_udp_received_bytes_total",
              "peerd_allreduce_bytes_sent_total", "peerd_allreduce_datagrams_received_total",
              "peerd_allreduce_datagrams_expected_total", "peerd_datagrams_dropped_total", "peerd_trainer_loss",
              "peerd_trainer_samples_per_second", "peerd_peer_send_bytes_per_second",
              "peerd_peer_receive_bytes_per_second", "peerd_peer_rtt_seconds", "peerd_peer_loss_ratio",
              "peerd_traffic_bytes_total", "peerd_relayed_fraction", "peerd_averages_received_fraction",
              "peerd_step_network_share"}
    assert wanted <= used, f"the dashboard lost panels for {sorted(wanted - used)}"

    node = swarm.start_many(1)[0]
    series = exported_series(scrape(node.status["metrics"]))
    missing = used - set(series)
    assert missing == PENDING, (
        f"named in the dashboard but not exported by the daemon: {sorted(missing - PENDING)}; "
        f"exported now, so drop them from PENDING: {sorted(PENDING - missing)}"
    )

    # Labels: every `by (...)` label, selector label and legend label must exist on a metric of that query.
    labels = declared_labels()
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            allowed = set(TARGET_LABELS)
            for name in metric_names(expr) - PENDING:
                allowed |= labels.get(name, set())
            used_labels = set()
            for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                used_labels |= {x.strip() for x in group.split(",") if x.strip()}
            for selector in re.findall(r"peerd_\w+\{([^}]*)\}", expr):
                used_labels |= set(re.findall(r"(\w+)\s*!?[=~]", selector))
            used_labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert used_labels <= allowed, f"{panel['title']}: {expr} uses labels {sorted(used_labels - allowed)}"


# ---------------------------------------------------------------------------------------------------------------
# A real Prometheus server scraping 4 real daemons


def _start_prometheus(tmp_path: Path, targets: list[str]) -> tuple[subprocess.Popen, str, Path]:
    binary = shutil.which("prometheus")
    config = tmp_path / "prometheus.yml"
    # YAML is a superset of JSON.
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "peerd", "static_configs": [{"targets": targets}]}],
    }))
    log_path = tmp_path / "prometheus.log"
    for _attempt in range(3):  # the free port can be taken between asking and binding
        port = free_port()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return proc, url, log_path
            except OSError:
                time.sleep(0.3)
        proc.kill()
        proc.wait()
    raise AssertionError(f"prometheus did not become ready:\n{log_path.read_text()[-3000:]}")


def _query(url: str, promql: str) -> list[dict]:
    reply = http_json(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


@pytest.mark.e2e
def test_prometheus_scrapes_four_daemons_and_sees_the_swarm(swarm, tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary (apt-get install prometheus; .ci/run installs it when root)")
    nodes = swarm.start_many(4)
    targets = [n.status["metrics"] for n in nodes]
    assert all(targets) and len(set(targets)) == 4
    proc, url, log_path = _start_prometheus(tmp_path, targets)
    try:
        def swarm_seen():
            result = _query(url, "peerd_dht_peers")
            seen = {r["metric"]["instance"]: float(r["value"][1]) for r in result}
            return seen if set(seen) == set(targets) and all(v >= 3 for v in seen.values()) else None

        seen = wait_until(swarm_seen, timeout=60, interval=1,
                          what="Prometheus to see peerd_dht_peers >= 3 on all 4 daemons")
        assert set(seen) == set(targets)

        up = {r["metric"]["instance"]: r["value"][1] for r in _query(url, 'up{job="peerd"}')}
        assert up == {t: "1" for t in targets}
        # Prometheus's view agrees with each daemon's own.
        for node in nodes:
            status = node.call("status")
            assert abs(status["peers"] - seen[node.status["metrics"]]) <= 1
        # A counter the dashboard plots, through PromQL.
        traffic = _query(url, "sum(peerd_udp_sent_bytes_total)")
        assert traffic and float(traffic[0]["value"][1]) > 0

        # Every dashboard query is PromQL that this Prometheus (Debian's 2.42) accepts; the ones about the DHT and
        # traffic already have data with idle daemons.
        for expr in dashboard_exprs():
            promql = expr.replace("$__rate_interval", "10s")
            _query(url, promql)
            if re.search(r"peerd_dht_peers|peerd_udp_(sent|received)_bytes_total|up\{", expr):
                wait_until(lambda q=promql: _query(url, q), timeout=30, interval=1, what=f"data for {promql}")

        # A daemon that stops is seen as down.
        nodes[3].proc.send_signal(signal.SIGTERM)
        nodes[3].proc.wait(10)
        gone = targets[3]
        wait_until(lambda: {r["metric"]["instance"]: r["value"][1] for r in _query(url, 'up{job="peerd"}')}
                   .get(gone) == "0", timeout=30, interval=1, what="the stopped daemon's target to go down")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            print(log_path.read_text()[-3000:])


def test_deploy_prometheus_yml_is_valid_for_debian_prometheus():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian's prometheus package has it; .ci/run installs it when root)")
    proc = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (DEPLOY / "prometheus.yml").read_text()
    assert re.search(r"names: \[bootstrap, peer\]", text)
    assert "port: 9100" in text


# ---------------------------------------------------------------------------------------------------------------
# docker-compose.yml


def _yaml_to_data(text: str):
    try:
        import yaml
    except ImportError:
        # Debian's docker-compose brings python3-yaml to the system Python.
        proc = subprocess.run(["/usr/bin/python3", "-c",
                               "import sys, json, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
                              input=text, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip("no YAML parser (PyYAML) to read the resolved compose file")
        return json.loads(proc.stdout)
    return yaml.safe_load(text)


def test_compose_file_validates_and_has_the_services_the_issue_names():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("no docker-compose (apt-get install docker-compose; deploy/podman-setup.sh installs it)")
    base = [compose, "-f", str(ROOT / "docker-compose.yml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEERD_")}
    proc = subprocess.run([*base, "config", "-q"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*base, "--profile", "dashboards", "config"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    config = _yaml_to_data(proc.stdout)
    services = config["services"]
    assert set(services) == {"bootstrap", "peer", "prometheus", "grafana"}
    assert services["peer"]["deploy"] == {"mode": "replicated", "replicas": 4}
    assert services["grafana"]["profiles"] == ["dashboards"]
    for name in ("bootstrap", "peer", "prometheus", "grafana"):
        assert "profiles" not in services[name] or name == "grafana"
    for name in ("bootstrap", "peer"):
        s = services[name]
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"
        assert s["init"] is True
        assert "swarm:/swarm:rw" in s["volumes"] or "swarm:/swarm" in s["volumes"]
        assert "ports" not in s  # the swarm's UDP stays on the compose network
    assert services["peer"]["environment"]["PEERD_BOOTSTRAP"] == "bootstrap:7411"
    assert services["peer"]["environment"]["PEERD_TRAIN"] == "1"
    assert services["peer"]["command"] == ["peer"] and services["bootstrap"]["command"] == ["bootstrap"]
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert len(published) == 2
    for p in published:
        host_ip = p.get("host_ip") if isinstance(p, dict) else str(p).split(":")[0]
        assert host_ip == "127.0.0.1", p
    assert any(v.endswith("/etc/prometheus/prometheus.yml:ro") for v in services["prometheus"]["volumes"])


# ---------------------------------------------------------------------------------------------------------------
# deploy/peerd.service


def test_systemd_unit_verifies():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze")
    unit = (DEPLOY / "peerd.service").read_text()
    for line in ("User=peerd", "Restart=on-failure", "StateDirectory=peerd", "NoNewPrivileges=yes",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "WantedBy=multi-user.target"):
        assert re.search(rf"^{re.escape(line)}$", unit, re.M), line
    peerd_bin = shutil.which("peerd") or f"{sys.prefix}/bin/peerd"
    if not os.path.exists(peerd_bin):
        pytest.skip("no peerd console script to point the unit at")
    # systemd-analyze verify checks ExecStart= paths exist: point it at this machine's peerd.
    work = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"peerd-unit-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        (work / "peerd.service").write_text(unit.replace("/opt/peerd/bin/peerd", peerd_bin))
        proc = subprocess.run([analyze, "verify", str(work / "peerd.service")], capture_output=True, text=True,
                              timeout=60)
        problems = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                    if "peerd.service" in ln or "Unknown" in ln or "Failed" in ln]
        assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# deploy/entrypoint.sh, on the host: keys, the daemon, the trainer's absence or presence, signals


def _entrypoint(role: str, tmp_path: Path, name: str, **env: str) -> tuple[subprocess.Popen, Path, dict]:
    state = tmp_path / name
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PEERD_")}
    full_env.update({
        "PEERD_CMD": f"{sys.executable} -m peerd",
        "PEERD_STATE": str(state),
        "PEERD_SOCKET": str(state / "peerd.sock"),
        "PEERD_SWARM_KEY": str(tmp_path / "swarm" / "swarm.key"),
        "PEERD_METRICS": "127.0.0.1:0",
        **env,
    })
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(DEPLOY / "entrypoint.sh"), role], env=full_env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return proc, log_path, full_env


def _torch_ok() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "sklearn"))


def _train_exists() -> bool:
    return subprocess.run([sys.executable, "-m", "peerd", "demo-trainer", "--help"], capture_output=True,
                          timeout=60).returncode == 0


@pytest.mark.e2e
def test_entrypoint_makes_keys_runs_the_daemon_and_stops_on_sigterm(tmp_path):
    (tmp_path / "swarm").mkdir()
    udp = free_port(socket.SOCK_DGRAM)
    procs = []
    try:
        # The peer starts first: it waits for the swarm key that the bootstrap writes.
        peer, peer_log, _ = _entrypoint("peer", tmp_path, "peer", PEERD_LISTEN="127.0.0.1:0",
                                        PEERD_BOOTSTRAP=f"127.0.0.1:{udp}", PEERD_TRAIN="1",
                                        PEERD_TRAIN_ARGS="--steps 2 --progress json")
        procs.append(peer)
        wait_until(lambda: "waiting for the swarm key" in peer_log.read_text(), timeout=30, interval=0.2,
                   what="the peer to wait for the key")
        boot, boot_log, _ = _entrypoint("bootstrap", tmp_path, "boot", PEERD_LISTEN=f"127.0.0.1:{udp}",
                                        PEERD_TRAIN="0")
        procs.append(boot)

        key = tmp_path / "swarm" / "swarm.key"
        wait_until(lambda: key.exists(), timeout=30, interval=0.2, what="the swarm key")
        assert key.stat().st_mode & 0o777 == 0o600
        assert not [p for p in key.parent.iterdir() if p.name != "swarm.key"]  # no half-written leftovers

        def joined():
            try:
                s = peerd_json("status", "--socket", str(tmp_path / "peer" / "peerd.sock"), timeout=20)
            except AssertionError:
                return None
            return s if s.get("joined") and s["peers"] >= 1 else None

        status = wait_until(joined, timeout=60, interval=0.5, what="the peer to join the bootstrap")
        for name in ("peer", "boot"):
            assert (tmp_path / name / "node.pem").stat().st_mode & 0o777 == 0o600
        boot_status = peerd_json("status", "--socket", str(tmp_path / "boot" / "peerd.sock"))
        assert status["peer_id"] != boot_status["peer_id"]
        assert "peerd_dht_peers 1.0" in scrape(status["metrics"])

        if not _train_exists():
            wait_until(lambda: "TRAINER NOT STARTED" in peer_log.read_text(), timeout=30, interval=0.2,
                       what="the entrypoint to say the trainer is missing")
        elif not _torch_ok():
            wait_until(lambda: "TRAINER FAILED" in peer_log.read_text(), timeout=120, interval=0.5,
                       what="the entrypoint to report the trainer's failure (no torch here)")
        else:
            # The demo trainer runs its steps beside the daemon, reports to it, ends; the daemon stays.
            wait_until(lambda: "trainer finished (status 0)" in peer_log.read_text(), timeout=120, interval=0.5,
                       what="the demo trainer to finish its 2 steps")
            assert "peerd demo-trainer --run demo" in peer_log.read_text()
            metrics = scrape(status["metrics"])
            assert metric_value(metrics, "peerd_trainer_loss") > 0
            assert metric_value(metrics, "peerd_moshpit_rounds_total") >= 2
        assert peer.poll() is None  # the daemon keeps running, whatever became of the trainer
        assert "demo-trainer" not in boot_log.read_text()  # PEERD_TRAIN=0

        started = time.monotonic()
        for p in (peer, boot):
            p.send_signal(signal.SIGTERM)
        for p in (peer, boot):
            assert p.wait(10) == 0
        assert time.monotonic() - started < 5
        assert not (tmp_path / "peer" / "peerd.sock").exists()
        assert "daemon exited with status 0" in peer_log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.e2e
def test_entrypoint_exits_with_the_daemons_failure(tmp_path):
    (tmp_path / "swarm").mkdir()
    # No key and nobody writes one: a clear message, status 1.
    proc, log, _ = _entrypoint("peer", tmp_path, "lonely", PEERD_KEY_WAIT="1", PEERD_TRAIN="0")
    assert proc.wait(30) == 1
    assert "no swarm key at" in log.read_text()

    # A bootstrap that never answers: the daemon gives up, and the container's status is the daemon's.
    subprocess.run([sys.executable, "-m", "peerd", "keygen", "--swarm-key-file", str(tmp_path / "swarm" / "swarm.key")],
                   check=True, capture_output=True, timeout=60)
    udp = free_port(socket.SOCK_DGRAM)
    proc, log, _ = _entrypoint("peer", tmp_path, "nobody", PEERD_LISTEN="127.0.0.1:0", PEERD_TRAIN="0",
                               PEERD_BOOTSTRAP=f"127.0.0.1:{udp}", PEERD_JOIN_ARGS="--bootstrap-timeout 2")
    assert proc.wait(60) == 1
    text = log.read_text()
    assert "daemon exited with status 1" in text and "no bootstrap node answered" in text


@pytest.mark.e2e
def test_entrypoint_keeps_the_daemon_when_the_trainer_fails(tmp_path):
    if not _train_exists():
        pytest.skip("this peerd has no 'peerd demo-trainer'")
    (tmp_path / "swarm").mkdir()
    # --index outside --peers: the trainer fails at once; with no restarts allowed the entrypoint gives up on it.
    proc, log, env = _entrypoint("bootstrap", tmp_path, "boot", PEERD_LISTEN="127.0.0.1:0", PEERD_TRAIN="1",
                                 PEERD_TRAIN_ARGS="--peers 1 --index 5", PEERD_TRAIN_RESTARTS="0")
    try:
        wait_until(lambda: "giving up on it, the daemon keeps running" in log.read_text(), timeout=120,
                   interval=0.5, what="the entrypoint to give up on a failing trainer")
        assert re.search(r"TRAINER FAILED \(status [1-9]\d*\) on start 1 of 1", log.read_text())
        assert proc.poll() is None
        assert peerd_json("status", "--socket", env["PEERD_SOCKET"])["joined"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------------------------
# deploy/peerd.service as written, without systemd: its ExecStartPre and ExecStart with the unit's user, group,
# umask, state, runtime and credential directories; then `peerd status` and a trainer as another user of the
# machine who is in the socket group, and refusals for users who are not.

UNIT_BIN = "/opt/peerd/bin/peerd"


def _unit_settings(unit: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The unit's [Service] settings (last wins) and its Environment= assignments in order; continuation lines
    joined as systemd joins them."""
    text = re.sub(r"\\\n\s*", " ", unit)
    settings: dict[str, str] = {}
    env: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line or line.startswith(("#", "[")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        if key == "Environment":
            env += [tuple(word.split("=", 1)) for word in shlex.split(value)]  # type: ignore[misc]
        else:
            settings[key] = value
    return settings, env


def _unit_command(line: str, env: dict[str, str], spec: dict[str, str]) -> list[str]:
    """An Exec line as systemd runs it: specifiers, ${VAR} as one word, $VAR split into words, and the unit's
    peerd binary replaced by this checkout's."""
    for k, v in spec.items():
        line = line.replace(k, v)
    argv: list[str] = []
    for word in shlex.split(line):
        if re.fullmatch(r"\$\w+", word):
            argv += env.get(word[1:], "").split()
            continue
        word = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word)
        if word == UNIT_BIN:
            argv += [sys.executable, "-m", "peerd"]
        else:
            argv.append(word.replace(UNIT_BIN, f"{sys.executable} -m peerd"))
    return argv








@pytest.mark.e2e
def test_systemd_unit_as_written_serves_its_group(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: it runs the unit's command as a service user and clients as other users")
    missing = [t for t in ("useradd", "usermod", "userdel", "setpriv", "unshare") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} (util-linux, passwd)")
    import grp
    import pwd
    import tempfile

    unit = (DEPLOY / "peerd.service").read_text()
    settings, env_list = _unit_settings(unit)
    assert settings["User"] == "peerd" and settings["Group"] == "peerd"
    # The unit's documented steps that make its user and admit a user of the machine, with this test's names.
    steps = [shlex.split(line[1:], comments=True) for line in unit.splitlines() if line.startswith("#   ")]
    useradd = next(s for s in steps if s and s[0] == "useradd")
    usermod = next(s for s in steps if s and s[0] == "usermod")
    n = os.getpid() % 100000
    names = {"peerd": f"peerdsvc{n}", "alice": f"peerdusr{n}"}
    daemon = None
    base = Path(tempfile.mkdtemp(prefix="peerd-unit-"))
    made: list[str] = []
    try:
        os.chmod(base, 0o755)
        home = useradd.index("--home-dir") + 1
        useradd[home] = str(base / "home")
        subprocess.run([names.get(w, w) for w in useradd], check=True, capture_output=True, timeout=30)
        made.append(names["peerd"])
        subprocess.run(["useradd", "--no-create-home", names["alice"]], check=True, capture_output=True, timeout=30)
        made.append(names["alice"])
        subprocess.run([names.get(w, w) for w in usermod], check=True, capture_output=True, timeout=30)
        group = names["peerd"]
        gid = grp.getgrnam(group).gr_gid
        svc = pwd.getpwnam(names["peerd"]).pw_uid
        member = pwd.getpwnam(names["alice"]).pw_uid
        assert pwd.getpwnam(names["peerd"]).pw_gid == gid and names["alice"] in grp.getgrgid(gid).gr_mem
        taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
        outsider = _free_id(taken, 61000)
        # The directories systemd makes for the unit, with the unit's modes, owned by its user.
        state_root, run_root, creds = base / "state", base / "run", base / "credentials" / "peerd.service"
        for path, mode in ((state_root / "peerd", settings["StateDirectoryMode"]),
                           (run_root / "peerd", settings["RuntimeDirectoryMode"])):
            path.mkdir(parents=True)
            os.chown(path, svc, gid)
            os.chmod(path, int(mode, 8))
        for p in (state_root, run_root):
            os.chmod(p, 0o755)
        creds.mkdir(parents=True)
        name, source = settings["LoadCredential"].split(":", 1)
        assert source == "/etc/peerd/swarm.key"
        subprocess.run([sys.executable, "-m", "peerd", "keygen", "--swarm-key-file", str(creds / name)],
                       check=True, capture_output=True, timeout=60)
        os.chown(creds / name, svc, gid)
        os.chmod(creds / name, 0o400)
        os.chown(creds, svc, gid)
        os.chmod(creds, 0o500)
        os.chmod(creds.parent, 0o755)

        env = dict(env_list)
        # /etc/default/peerd (EnvironmentFile): this test's ports and group
        assert env["PEERD_SOCKET_GROUP"] == "peerd"  # the unit's own group, here under this test's name
        env.update(PEERD_LISTEN="127.0.0.1:0", PEERD_METRICS="127.0.0.1:0", PEERD_SOCKET_GROUP=group, PEERD_ARGS="")
        spec = {"%S": str(state_root), "%t": str(run_root), "%d": str(creds)}
        env = {k: _unit_command(v, env, spec)[0] if v else "" for k, v in env.items()}
        proc_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(base), **env}
        umask = int(settings["UMask"], 8)
        as_service = dict(env=proc_env, cwd="/")
        pre = _as_user(_unit_command(settings["ExecStartPre"], env, spec), svc, gid, [], base, umask)
        done = subprocess.run(pre, capture_output=True, text=True, timeout=60, **as_service)
        if done.returncode != 0 and "unshare" in done.stderr:
            pytest.skip(f"cannot make a private mount namespace here: {done.stderr.strip()[-200:]}")
        assert done.returncode == 0, done.stderr
        ident = state_root / "peerd" / "node.pem"
        assert ident.stat().st_uid == svc and ident.stat().st_mode & 0o777 == 0o600
        subprocess.run(pre, check=True, capture_output=True, timeout=60, **as_service)  # a restart keeps it

        log = open(base / "daemon.log", "wb")  # noqa: SIM115  (closed in finally)
        daemon = subprocess.Popen(_as_user(_unit_command(settings["ExecStart"], env, spec), svc, gid, [], base,
                                           umask), stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **as_service)
        sock = Path(env["PEERD_SOCKET"])
        assert sock == run_root / "peerd" / "peerd.sock"

        def as_user(uid: int, groups: list[int], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
            primary = pwd.getpwuid(uid).pw_gid if uid == member else uid
            return subprocess.run(_as_user([sys.executable, "-m", "peerd", *args], uid, primary, groups, base),
                                  capture_output=True, text=True, timeout=timeout, cwd="/",
                                  env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(base),
                                       "PEERD_SOCKET": str(sock)}, stdin=subprocess.DEVNULL)

        wait_until(lambda: as_user(member, [gid], "status", "--json").returncode == 0, timeout=60, interval=0.5,
                   what=f"the unit's daemon to answer a group member ({(base / 'daemon.log').read_text()[-800:]})")
        st = sock.stat()
        assert st.st_uid == svc and st.st_gid == gid and st.st_mode & 0o777 == 0o660
        status = json.loads(as_user(member, [gid], "status", "--json").stdout)
        assert status["listen"].startswith("127.0.0.1:")
        assert "peer id" in as_user(member, [gid], "status").stdout

        # Not in the group: refused by the file mode or by the daemon, with what to do.
        out = as_user(outsider, [], "status")
        assert out.returncode == 1 and ("permission" in out.stderr or "group" in out.stderr), out.stderr
        # Root is no exception: not a member, refused by the daemon itself.
        root = subprocess.run([sys.executable, "-m", "peerd", "status", "--socket", str(sock)], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert root.returncode == 1 and f"group {gid}" in root.stderr, root.stderr

        if importlib.util.find_spec("torch") is not None and importlib.util.find_spec("sklearn") is not None:
            trainer = as_user(member, [gid], "demo-trainer", "--run", "unit", "--steps", "2", "--timeout", "2",
                              "--eval-every", "0", "--state-every", "0", "--progress", "none", "--json",
                              timeout=240)
            assert trainer.returncode == 0, trainer.stderr[-2000:]
            assert json.loads(trainer.stdout)["steps"] == 2
        else:
            pytest.fail("the trainer half of this test needs torch and scikit-learn (the [torch] extra)")

        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(15) == 0
        assert not sock.exists()
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        for user in reversed(made):
            subprocess.run(["userdel", user], capture_output=True, timeout=30)  # and the user's own group
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# deploy/entrypoint.sh's environment: every variable documented (docs/deploy-env.md, generated), metrics on
# loopback unless asked


def test_entrypoint_environment_is_documented_and_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_cli_docs

    documented = {name for name, _, _ in gen_cli_docs.entrypoint_env()}
    read = set(re.findall(r"\$\{(PEERD_\w+)", (DEPLOY / "entrypoint.sh").read_text()))
    assert read == documented, (read - documented, documented - read)
    assert (ROOT / "docs" / "deploy-env.md").read_text() == gen_cli_docs.render_env(), \
        "docs/deploy-env.md is stale: run python scripts/gen_cli_docs.py"
    defaults = {name: default for name, default, _ in gen_cli_docs.entrypoint_env()}
    assert defaults["PEERD_METRICS"].startswith("127.0.0.1:")
    compose = (ROOT / "docker-compose.yml").read_text()
    assert compose.count("PEERD_METRICS: 0.0.0.0:9100") == 2  # Prometheus scrapes over the compose network
    assert "PEERD_JOIN_ARGS" in compose
