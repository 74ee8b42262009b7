#!/usr/bin/env bash
# Install all six harness CLIs (pinned, see install_harnesses.sh) and run every client spec end to
# end against the real gateway + embedded scripted engine, one loopback-only network namespace per
# spec (needs root, or unprivileged user namespaces). Prints one table row per spec; exits non-zero
# if any spec failed.
#
#   scripts/check_harnesses.sh                          # the full matrix
#   scripts/check_harnesses.sh --only pi-gemini --workdir /tmp/polar-check   # keep the artifacts
#
# Extra arguments go to `python -m polar_env.testing.harness_check` (--only, --json, --timeout-s, --workdir).
set -euo pipefail
cd "$(dirname "$0")/.."

# The install script's stdout lists "<name> <binary>"; keep stdout for the table.
scripts/install_harnesses.sh all >&2
exec "${PYTHON:-python3}" -m polar_env.testing.harness_check "$@"
