#!/usr/bin/env bash
# The compose swarm for real: build the image, bring up bootstrap, 4 peers and Prometheus with podman-compose,
# wait until Prometheus scrapes all 5 daemons and every daemon sees the 4 others (peerd_dht_peers >= 4), then
# take it all down. Exits non-zero, saying why, if any of it fails.
#
# Needs rootful podman with the base images: on a machine without Docker, run deploy/podman-setup.sh first (root).
#   LAB_DIR                where podman-setup.sh put podman-compose (default /var/tmp/peerd-lab)
#   PEERD_INSTALL_FROM     wheels (default: fill deploy/wheels/ on the host, no registry in the build) or pypi
#   PEERD_TRAIN            1 (default): peers run `peerd demo-trainer` beside the daemon, and the script waits for
#                          trainer metrics too when the image has that command; 0: daemons only
#   COMPOSE_TEST_TIMEOUT   seconds to wait for the swarm once the containers run (default 180)
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
say() { echo "[compose-test $((SECONDS - t0))s] $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

LAB_DIR=${LAB_DIR:-/var/tmp/peerd-lab}
PC="$LAB_DIR/pcvenv/bin/podman-compose"
[ "$(id -u)" = 0 ] || fail "needs root (rootful podman)"
command -v podman >/dev/null || fail "no podman: run deploy/podman-setup.sh first"
[ -x "$PC" ] || fail "no podman-compose at $PC: run deploy/podman-setup.sh first (or set LAB_DIR)"
export PEERD_INSTALL_FROM=${PEERD_INSTALL_FROM:-wheels}
export PEERD_TRAIN=${PEERD_TRAIN:-1}
timeout_s=${COMPOSE_TEST_TIMEOUT:-180}
project=peerd-compose-test
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export PEERD_PROMETHEUS_PORT=$port
prom="http://127.0.0.1:$port"
compose() { "$PC" -p "$project" -f docker-compose.yml "$@"; }

# Prometheus's answer to an instant query, as "value" (first result) or "" when there is none.
query() {
  curl -fsS --max-time 5 --get "$prom/api/v1/query" --data-urlencode "query=$1" 2>/dev/null | python3 -c '
import json, sys
try:
    r = json.load(sys.stdin)["data"]["result"]
except Exception:
    r = []
print(r[0]["value"][1] if r else "")'
}

show_state() {
  say "state of the swarm:"
  podman ps -a --filter "label=io.podman.compose.project=$project" --format '{{.Names}} {{.Status}}' >&2
  curl -fsS --max-time 5 "$prom/api/v1/targets" 2>/dev/null | python3 -c '
import json, sys
for t in json.load(sys.stdin)["data"]["activeTargets"]:
    print(" ", t["labels"].get("role"), t["labels"]["instance"], t["health"], t.get("lastError", ""))' >&2 \
    || say "(Prometheus does not answer on $prom)"
  curl -fsS --max-time 5 --get "$prom/api/v1/query" --data-urlencode "query=peerd_dht_peers" 2>/dev/null \
    | python3 -c '
import json, sys
for r in json.load(sys.stdin)["data"]["result"]:
    print("  peerd_dht_peers", r["metric"].get("role"), r["metric"]["instance"], r["value"][1])' >&2 || true
  for c in $(podman ps -a --filter "label=io.podman.compose.project=$project" --format '{{.Names}}'); do
    echo "--- $c (last 15 lines)" >&2
    podman logs --tail 15 "$c" >&2 2>&1
  done
}

cleanup() {
  local t=$SECONDS
  compose down -v -t 5 >/dev/null 2>&1 || true
  say "down in $((SECONDS - t)) s"
}
trap cleanup EXIT
compose down -v -t 5 >/dev/null 2>&1 || true  # leftovers of an interrupted run

if command -v docker-compose >/dev/null; then
  docker-compose -f docker-compose.yml config -q || fail "docker-compose config -q rejects docker-compose.yml"
fi

if [ "$PEERD_INSTALL_FROM" = wheels ]; then
  say "wheels for the image (deploy/fetch-wheels.sh)"
  deploy/fetch-wheels.sh || fail "could not fill deploy/wheels/"
fi

say "build (INSTALL_FROM=$PEERD_INSTALL_FROM)"
tb=$SECONDS
compose build bootstrap >"${TMPDIR:-/tmp}/peerd-compose-build.log" 2>&1 || {
  tail -30 "${TMPDIR:-/tmp}/peerd-compose-build.log" >&2
  fail "image build failed (whole log: ${TMPDIR:-/tmp}/peerd-compose-build.log)"
}
build_s=$((SECONDS - tb))
say "built in $build_s s"

tu=$SECONDS
compose up -d bootstrap peer prometheus >"${TMPDIR:-/tmp}/peerd-compose-up.log" 2>&1 || {
  tail -30 "${TMPDIR:-/tmp}/peerd-compose-up.log" >&2
  fail "podman-compose up failed"
}
running=$(podman ps --filter "label=io.podman.compose.project=$project" --format '{{.Names}}' | wc -l)
[ "$running" = 6 ] || { show_state; fail "expected 6 containers (bootstrap, 4 peers, prometheus), $running run"; }
say "6 containers up; Prometheus on $prom"

deadline=$((SECONDS + timeout_s))
up="" seeing=""
while :; do
  up=$(query 'count(up{job="peerd"} == 1)')
  seeing=$(query 'count(peerd_dht_peers >= 4)')
  [ "$up" = 5 ] && [ "$seeing" = 5 ] && break
  if [ $SECONDS -ge $deadline ]; then
    show_state
    fail "after ${timeout_s} s: Prometheus scrapes ${up:-0} of 5 daemons, ${seeing:-0} of 5 see the 4 others"
  fi
  sleep 2
done
swarm_s=$((SECONDS - tu))
say "Prometheus scrapes 5 daemons, each sees the 4 others: $swarm_s s after up"

# The image must run the native data plane: the daemons say which one in their status.
for c in $(podman ps --filter "label=io.podman.compose.project=$project" --format '{{.Names}}' | grep -v prometheus); do
  dp=$(podman exec "$c" peerd status --json 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["dataplane"])')
  [ "$dp" = native ] || { show_state; fail "$c runs the '${dp:-unknown}' data plane, not the native one"; }
done
say "every daemon runs the native data plane"

if [ "$PEERD_TRAIN" = 1 ]; then
  if podman run --rm --entrypoint peerd localhost/peerd:dev demo-trainer --help >/dev/null 2>&1; then
    while :; do
      training=$(query 'count(peerd_trainer_samples_per_second > 0)')
      [ "${training:-0}" -ge 4 ] 2>/dev/null && break
      if [ $SECONDS -ge $deadline ]; then
        show_state
        fail "the demo trainers do not report: ${training:-0} of 4 peers have peerd_trainer_samples_per_second > 0"
      fi
      sleep 2
    done
    say "4 demo trainers report samples/s; loss $(query 'avg(peerd_trainer_loss)') (mean over peers)," \
        "rounds averaged $(query 'sum(peerd_moshpit_rounds_total{outcome="averaged"})')"
  else
    say "the image has no 'peerd demo-trainer': trainers not checked"
  fi
fi

# Every query of the Grafana dashboard, against this swarm: PromQL errors fail; empty answers are listed.
python3 - "$prom" <<'PY' || fail "a dashboard query is not valid PromQL here"
import json, sys, urllib.parse, urllib.request
prom = sys.argv[1]
exprs = []
def walk(n):
    if isinstance(n, dict):
        for k, v in n.items():
            exprs.append(v) if k == "expr" else walk(v)
    elif isinstance(n, list):
        for v in n:
            walk(v)
walk(json.load(open("deploy/grafana/dashboards/peerd.json")))
bad, empty = 0, []
for e in exprs:
    q = e.replace("$__rate_interval", "1m")
    try:
        with urllib.request.urlopen(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}), timeout=10) as r:
            result = json.load(r)["data"]["result"]
    except Exception as err:  # 400 with the error for bad PromQL
        print(f"  dashboard query failed: {q}: {err}", file=sys.stderr)
        bad += 1
        continue
    if not result:
        empty.append(q)
print(f"  dashboard: {len(exprs)} queries, {len(exprs) - bad - len(empty)} with data, {len(empty)} empty", file=sys.stderr)
for q in empty:
    print(f"    empty: {q}", file=sys.stderr)
sys.exit(1 if bad else 0)
PY

say "PASSED: build ${build_s} s, swarm seen ${swarm_s} s after up, $((SECONDS - t0)) s before teardown"
