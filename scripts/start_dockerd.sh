#!/usr/bin/env bash
# Start a private Docker engine with no network plumbing (no iptables, no bridge) on a unix socket,
# for the Docker runtime tests. Nothing is pulled: images come from `docker import` (build_rootfs.sh).
#
#   eval "$(scripts/start_dockerd.sh)"     # start (or reuse) and export DOCKER_HOST
#   scripts/start_dockerd.sh --stop        # stop it by the pid in its pidfile
#
# State lives under D=${POLAR_DOCKER_DIR:-/tmp/polar-dockerd}. Needs root. The last line of stdout is
# `export DOCKER_HOST=unix://D/docker.sock`; logs go to D/dockerd.log.
#
# POLAR_DOCKERD_USERNS=1: start it with --userns-remap, so container root is an unprivileged host uid
# (SWE images' agents run as root inside; see docs/runtimes.md). The range is
# POLAR_DOCKERD_USERNS_BASE (default 1000000) .. +POLAR_DOCKERD_USERNS_COUNT (default 262144: the agent
# uid 160000 stays mapped), under a system user polar-remap-<base> with /etc/subuid and /etc/subgid
# lines added once. Remapping is daemon-wide: distinct host ids per group of sessions means one such
# daemon per group, each with its own POLAR_DOCKER_DIR and base.
set -euo pipefail

D="${POLAR_DOCKER_DIR:-/tmp/polar-dockerd}"
SOCK="$D/docker.sock"
PIDFILE="$D/dockerd.pid"
LOG="$D/dockerd.log"
TIMEOUT="${POLAR_DOCKERD_TIMEOUT:-60}"

log() { echo "[start_dockerd] $*" >&2; }

running_pid() {
  [ -f "$PIDFILE" ] || return 1
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

if [ "${1:-}" = "--stop" ]; then
  if pid="$(running_pid)"; then
    log "stopping dockerd pid $pid"
    kill -TERM "$pid"
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "dockerd pid $pid still alive after 20s; sending KILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  else
    log "no dockerd running from $PIDFILE"
  fi
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  log "dockerd needs root"
  exit 1
fi

if ! command -v dockerd >/dev/null 2>&1; then
  log "installing docker.io"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io >&2; }
fi

mkdir -p "$D/data" "$D/exec"
# One start at a time per state dir: a second caller waits, then reuses the daemon the first started
# (without this, it would remove the pidfile of a daemon still starting and start another over it).
exec 9>"$D/start.lock"
flock 9

REMAP=()
if [ "${POLAR_DOCKERD_USERNS:-0}" = "1" ]; then
  BASE="${POLAR_DOCKERD_USERNS_BASE:-1000000}"
  COUNT="${POLAR_DOCKERD_USERNS_COUNT:-262144}"
  NAME="polar-remap-$BASE"
  getent passwd "$NAME" >/dev/null || useradd --system --no-create-home --shell /usr/sbin/nologin "$NAME" >&2
  for f in /etc/subuid /etc/subgid; do
    grep -q "^$NAME:" "$f" 2>/dev/null || echo "$NAME:$BASE:$COUNT" >>"$f"
  done
  REMAP=(--userns-remap "$NAME")
  log "userns-remap: container uids 0..$((COUNT - 1)) are host uids $BASE..$((BASE + COUNT - 1))"
fi

if pid="$(running_pid)"; then
  log "reusing dockerd pid $pid"
else
  rm -f "$SOCK" "$PIDFILE"
  log "starting dockerd (log: $LOG)"
  # setsid: own session, so it survives the caller's process group (and its Ctrl-C).
  setsid dockerd --iptables=false --ip6tables=false --bridge=none \
    --data-root "$D/data" --exec-root "$D/exec" --pidfile "$PIDFILE" \
    --host "unix://$SOCK" "${REMAP[@]}" >"$LOG" 2>&1 </dev/null 9>&- &
  start=$(date +%s)
  until [ -S "$SOCK" ] && DOCKER_HOST="unix://$SOCK" docker version >/dev/null 2>&1; do
    if [ $(( $(date +%s) - start )) -ge "$TIMEOUT" ]; then
      log "dockerd not ready after ${TIMEOUT}s; last log lines:"
      tail -n 20 "$LOG" >&2 || true
      exit 1
    fi
    sleep 0.3
  done
  log "dockerd ready in $(( $(date +%s) - start ))s"
fi

echo "export DOCKER_HOST=unix://$SOCK"
