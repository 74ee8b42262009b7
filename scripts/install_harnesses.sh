#!/usr/bin/env bash
# Install harness CLIs into the shared cache outside the repo (~/.cache/polar_env/harnesses, or
# $POLAR_HARNESS_CACHE). Versions are pinned in the presets (polar_env/harnesses/<name>.py); a
# harness already installed at its pinned version is skipped, so re-running is cheap.
#
#   scripts/install_harnesses.sh              # pi and qwen (what the CI tests need)
#   scripts/install_harnesses.sh all          # every preset
#   scripts/install_harnesses.sh claude codex
#
# Prints "<preset> <binary path>" per harness.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  set -- pi qwen
fi
exec python -m polar_env.harnesses install "$@"
