#!/usr/bin/env bash
# Build (once, cached) a Debian bookworm minbase root filesystem with python3, python3-pytest,
# python3-venv (so a SWE-shaped image can make its env offline) and git: the image stand-in for the sandbox runtime (a rootfs directory as /), for the apptainer shim
# (a sandbox dir) and, via `docker import`, for the Docker runtime (tag polar-test/py:bookworm).
#
#   scripts/build_rootfs.sh            # build if missing, import into docker if a daemon answers
#   scripts/build_rootfs.sh --print    # print the rootfs path only (no build)
#   scripts/build_rootfs.sh --stamp    # print what .polar-complete holds when the cache is current
#
# Env: POLAR_ROOTFS_CACHE (default $HOME/.cache/polar_env/rootfs), POLAR_DEBIAN_MIRROR (default: the
# deb.debian.org URI that apt uses here), POLAR_ROOTFS_TAG (default polar-test/py:bookworm).
# Prints the rootfs directory on the last line of stdout.
set -euo pipefail

CACHE="${POLAR_ROOTFS_CACHE:-$HOME/.cache/polar_env/rootfs}"
ROOTFS="$CACHE/bookworm-py"
TAG="${POLAR_ROOTFS_TAG:-polar-test/py:bookworm}"
INCLUDE="python3,python3-pytest,python3-venv,git,ca-certificates"
STAMP="include=$INCLUDE"  # in .polar-complete and the image's polar.rootfs label: a changed list rebuilds

if [ "${1:-}" = "--stamp" ]; then
  echo "$STAMP"
  exit 0
fi
if [ "${1:-}" = "--print" ]; then
  echo "$ROOTFS"
  exit 0
fi

log() { echo "[build_rootfs] $*" >&2; }

mirror() {
  if [ -n "${POLAR_DEBIAN_MIRROR:-}" ]; then
    echo "$POLAR_DEBIAN_MIRROR"
    return
  fi
  # The mirror apt already uses on this machine (deb822 or one-line format); default deb.debian.org.
  local uri
  uri="$(grep -hs -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null \
    | grep -v -- '-security' | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' \
    | awk '{print $1}' | grep -E '/debian/?$' | head -n1 || true)"
  echo "${uri:-http://deb.debian.org/debian}"
}

if [ "$(cat "$ROOTFS/.polar-complete" 2>/dev/null || true)" != "$STAMP" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    log "debootstrap needs root (run this script as root, e.g. in CI)"
    exit 1
  fi
  if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2 \
      || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2; }
  fi
  MIRROR="$(mirror)"
  mkdir -p "$CACHE"
  TMP="$CACHE/.bookworm-py.tmp.$$"
  rm -rf "$TMP"
  trap 'rm -rf "$TMP"' EXIT
  log "debootstrap --variant=minbase --include=$INCLUDE bookworm $TMP $MIRROR"
  start=$(date +%s)
  debootstrap --variant=minbase --include="$INCLUDE" bookworm "$TMP" "$MIRROR" >&2
  # Mount points the runtimes bind onto (a read-only rootfs cannot grow them at run time).
  mkdir -p "$TMP/testbed" "$TMP/run/polar" "$TMP/opt/polar"
  rm -rf "$TMP/var/cache/apt/archives/"*.deb "$TMP/var/lib/apt/lists/"* 2>/dev/null || true
  echo "$STAMP" >"$TMP/.polar-complete"
  rm -rf "$ROOTFS"
  mv "$TMP" "$ROOTFS"
  trap - EXIT
  log "rootfs built in $(( $(date +%s) - start ))s: $(du -sh "$ROOTFS" | cut -f1)"
else
  log "cached rootfs: $ROOTFS"
fi

# Import into docker when a daemon answers (DOCKER_HOST honoured) and the tag is missing or older.
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  if [ "$(docker image inspect -f '{{index .Config.Labels "polar.rootfs"}}' "$TAG" 2>/dev/null || true)" = "$STAMP" ]; then
    log "docker image $TAG present"
  else
    log "docker import -> $TAG"
    start=$(date +%s)
    tar -C "$ROOTFS" -c . | docker import --change "LABEL polar.rootfs=$STAMP" - "$TAG" >&2
    log "imported in $(( $(date +%s) - start ))s"
  fi
fi

echo "$ROOTFS"
