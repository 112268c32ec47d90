#!/usr/bin/env bash
# Entrypoint of the peerd image: make keys, run the daemon, and (PEERD_TRAIN=1) the demo trainer beside it.
# Its environment variables are listed in docs/deploy-env.md (scripts/gen_cli_docs.py writes that table from the
# "# env:" lines below).
#
#   peerd-entrypoint bootstrap   the first daemon of a swarm; writes the swarm key if there is none yet
#   peerd-entrypoint peer        a daemon that joins $PEERD_BOOTSTRAP, waiting for the shared swarm key
#   peerd-entrypoint CMD ...     anything else runs as is (e.g. `peerd status`)
#
# The container lives as long as the daemon: its exit status is the daemon's. The trainer is a guest: if
# `peerd demo-trainer` is missing or fails, that is logged and the daemon keeps running. SIGTERM/SIGINT go to both.
set -u

role=${1:-peer}
case "$role" in
  bootstrap | peer) ;;
  *) exec "$@" ;;
esac

# env: PEERD_STATE | where the node identity (node.pem) and the local socket live
state=${PEERD_STATE:-/var/lib/peerd}
# env: PEERD_SWARM_KEY | the swarm's secret; the bootstrap writes it if missing, peers wait for it
swarm_key=${PEERD_SWARM_KEY:-/swarm/swarm.key}
# env: PEERD_SOCKET | the daemon's local socket (`peerd status` and the trainer use it)
socket=${PEERD_SOCKET:-$state/peerd.sock}
export PEERD_SOCKET=$socket
# env: PEERD_LISTEN | UDP address the daemon listens on (join --listen)
listen=${PEERD_LISTEN:-0.0.0.0:7411}
# env: PEERD_METRICS | Prometheus metrics address (join --metrics); 0.0.0.0:9100 to let a scraper in; empty: off
metrics=${PEERD_METRICS-127.0.0.1:9100}
# env: PEERD_BOOTSTRAP | peer role: the swarm member to join through (join --bootstrap)
bootstrap=${PEERD_BOOTSTRAP:-bootstrap:7411}
# env: PEERD_JOIN_ARGS | more `peerd join` options, as words (e.g. --announce HOST:PORT --mtu 1400)
join_extra=${PEERD_JOIN_ARGS:-}
# env: PEERD_TRAIN | 1: run the demo trainer beside the daemon; 0: the daemon alone
train=${PEERD_TRAIN:-1}
# env: PEERD_RUN | the trainer's run id (demo-trainer --run): trainers with the same id train together
run_name=${PEERD_RUN:-demo}
# env: PEERD_TRAIN_ARGS | more `peerd demo-trainer` options, as words (e.g. --steps 1000 --eval-every 50)
train_extra=${PEERD_TRAIN_ARGS:-}
# env: PEERD_TRAIN_SEED | the trainer's data-order seed (default: from the container's hostname)
train_seed=${PEERD_TRAIN_SEED:-}
# env: PEERD_TRAIN_RESTARTS | times a failed trainer is restarted (10 s apart) before the entrypoint gives up
train_restarts=${PEERD_TRAIN_RESTARTS:-5}
# env: PEERD_KEY_WAIT | seconds a peer waits for the swarm key before it exits with status 1
key_wait=${PEERD_KEY_WAIT:-120}
# env: PEERD_CMD | the peerd command, as words (tests use `python -m peerd`)
# shellcheck disable=SC2206  # PEERD_CMD, PEERD_JOIN_ARGS and PEERD_TRAIN_ARGS are word lists on purpose
peerd=(${PEERD_CMD:-peerd})

say() { echo "entrypoint[$role]: $*" >&2; }

mkdir -p "$state" || exit 1

# Keys: one identity per container (kept in its state dir), one swarm secret shared by all (on a volume).
if [ ! -e "$state/node.pem" ]; then
  "${peerd[@]}" keygen --identity "$state/node.pem" >/dev/null || { say "cannot write an identity to $state/node.pem"; exit 1; }
fi
if [ "$role" = bootstrap ] && [ ! -e "$swarm_key" ]; then
  # Written beside, then renamed, so a peer never reads half a key.
  tmp="$(dirname "$swarm_key")/.swarm.key.$$"
  rm -f "$tmp"
  "${peerd[@]}" keygen --swarm-key-file "$tmp" >/dev/null && mv "$tmp" "$swarm_key" \
    || { say "cannot write the swarm key to $swarm_key"; exit 1; }
  say "wrote a new swarm key to $swarm_key"
fi
waited=0
until [ -s "$swarm_key" ]; do
  if [ "$waited" -ge "$key_wait" ]; then
    say "no swarm key at $swarm_key after ${key_wait} s: is the bootstrap running and the volume shared?"
    exit 1
  fi
  [ "$waited" = 0 ] && say "waiting for the swarm key at $swarm_key (the bootstrap writes it)"
  sleep 1
  waited=$((waited + 1))
done

join_args=(--listen "$listen" --identity "$state/node.pem" --swarm-key-file "$swarm_key" --socket "$socket")
[ -n "$metrics" ] && join_args+=(--metrics "$metrics")
[ "$role" = peer ] && join_args+=(--bootstrap "$bootstrap")
# shellcheck disable=SC2206
join_args+=($join_extra)

daemon=
trainer=
timer=
stopping=0
stop() {
  stopping=1
  say "stopping"
  # shellcheck disable=SC2086
  kill -TERM $daemon $trainer $timer 2>/dev/null
}
trap stop TERM INT

say "peerd join ${join_args[*]}"
"${peerd[@]}" join "${join_args[@]}" &
daemon=$!

# The trainer starts once the daemon answers on its socket and has joined the swarm.
train_ready=0
if [ "$train" = 1 ]; then
  if "${peerd[@]}" demo-trainer --help >/dev/null 2>&1; then
    train_ready=1
  else
    say "TRAINER NOT STARTED: this peerd has no 'peerd demo-trainer' command; the daemon runs without it"
  fi
fi
starts=0
start_trainer() {
  starts=$((starts + 1))
  # Same initial weights everywhere, a different data order per container (unless PEERD_TRAIN_ARGS says else).
  local seed=${train_seed:-$(($(printf '%s' "${HOSTNAME:-$$}" | cksum | cut -d' ' -f1) % 100000))}
  # shellcheck disable=SC2206
  local args=(--run "$run_name" --socket "$socket" --seed "$seed" --init-seed 0 $train_extra)
  say "peerd demo-trainer ${args[*]} (start $starts)"
  "${peerd[@]}" demo-trainer "${args[@]}" &
  trainer=$!
}
if [ "$train_ready" = 1 ]; then
  until [ "$stopping" = 1 ] || ! kill -0 "$daemon" 2>/dev/null; do
    if "${peerd[@]}" status --json 2>/dev/null | grep -q '"joined": true'; then
      start_trainer
      break
    fi
    sleep 1 &
    timer=$!
    wait "$timer"
    timer=
  done
fi

# Wait for whichever ends first: the daemon (then we are done), the trainer (restart it a few times), or the
# restart timer.
while :; do
  pids=()
  for p in $daemon $trainer $timer; do pids+=("$p"); done
  ended=
  wait -n -p ended "${pids[@]}"
  rc=$?
  if [ -z "${ended:-}" ]; then
    continue  # a signal interrupted the wait; stop() has run
  fi
  if [ "$ended" = "$daemon" ]; then
    [ -n "$trainer" ] && kill -TERM "$trainer" 2>/dev/null && wait "$trainer" 2>/dev/null
    [ -n "$timer" ] && kill "$timer" 2>/dev/null
    say "daemon exited with status $rc"
    exit "$rc"
  elif [ "$ended" = "$trainer" ]; then
    trainer=
    if [ "$stopping" = 1 ]; then
      continue
    elif [ "$rc" = 0 ]; then
      say "trainer finished (status 0); the daemon keeps running"
    elif [ "$starts" -gt "$train_restarts" ]; then
      say "TRAINER FAILED (status $rc) on start $starts of $((train_restarts + 1)); giving up on it," \
          "the daemon keeps running"
    else
      say "TRAINER FAILED (status $rc); restarting it in 10 s"
      sleep 10 &
      timer=$!
    fi
  elif [ "$ended" = "$timer" ]; then
    timer=
    [ "$stopping" = 0 ] && start_trainer
  fi
done
