#!/usr/bin/env bash
# Install the harness CLIs polar_env drives, pinned, into a cache outside the repo.
#
#   scripts/install_harnesses.sh            # pi and qwen (what CI needs)
#   scripts/install_harnesses.sh all        # all six
#   scripts/install_harnesses.sh claude codex
#
# Each CLI goes to ${POLAR_NPM_CACHE:-$HOME/.cache/polar_env/harnesses}/<name> via
#   npm install --prefix <prefix>/<name> <package>@<version>
# and its binary lands in <prefix>/<name>/node_modules/.bin/<binary>. A stamp file
# (<prefix>/<name>/.polar-installed) records "<package>@<version>"; a CLI whose stamp matches
# and whose binary exists is skipped, so re-running is cheap. The last lines printed are
# "<name> <binary path>", one per requested CLI.
#
# Versions are the ones documented in the harnesses reference (all still on npm).
set -euo pipefail

CACHE="${POLAR_NPM_CACHE:-$HOME/.cache/polar_env/harnesses}"

# name -> "package version binary"
spec() {
  case "$1" in
    pi)       echo "@mariozechner/pi-coding-agent 0.73.1 pi" ;;
    qwen)     echo "@qwen-code/qwen-code 0.15.10 qwen" ;;
    claude)   echo "@anthropic-ai/claude-code 2.1.197 claude" ;;
    codex)    echo "@openai/codex 0.171.0 codex" ;;
    gemini)   echo "@google/gemini-cli 0.61.0 gemini" ;;
    opencode) echo "opencode-ai 1.18.33 opencode" ;;
    *) return 1 ;;
  esac
}
ALL=(pi qwen claude codex gemini opencode)

if [ $# -eq 0 ]; then
  names=(pi qwen)
elif [ "$1" = "all" ]; then
  names=("${ALL[@]}")
else
  names=("$@")
fi

command -v npm >/dev/null || { echo "install_harnesses: npm not found on PATH" >&2; exit 2; }
for n in "${names[@]}"; do
  spec "$n" >/dev/null || { echo "install_harnesses: unknown harness '$n' (known: ${ALL[*]}, all)" >&2; exit 2; }
done

mkdir -p "$CACHE"
results=()
failed=0
for n in "${names[@]}"; do
  read -r pkg ver bin <<<"$(spec "$n")"
  prefix="$CACHE/$n"
  binpath="$prefix/node_modules/.bin/$bin"
  stamp="$prefix/.polar-installed"
  want="$pkg@$ver"
  if [ -x "$binpath" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "install_harnesses: $n: $want already installed" >&2
  else
    echo "install_harnesses: $n: installing $want into $prefix" >&2
    start=$(date +%s)
    rm -f "$stamp"
    mkdir -p "$prefix"
    if npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "$want" >&2 \
        && [ -x "$binpath" ]; then
      echo "$want" >"$stamp"
      size=$(du -sh "$prefix" 2>/dev/null | cut -f1)
      echo "install_harnesses: $n: done in $(( $(date +%s) - start ))s, $size" >&2
    else
      echo "install_harnesses: $n: FAILED ($want; binary $binpath missing or npm failed)" >&2
      failed=1
      continue
    fi
  fi
  results+=("$n $binpath")
done

for r in "${results[@]}"; do echo "$r"; done
exit "$failed"
