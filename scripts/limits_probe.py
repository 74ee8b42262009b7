"""Measure the per-session limits on this machine through real sandboxed sessions: peak RSS of the
rollout process under an output flood, and how a fork storm, a memory hog and a disk filler end.

    python scripts/limits_probe.py [--only flood] [--flood-bytes N]

Run it on another checkout (``PYTHONPATH=<old checkout>:<this checkout>``) for a baseline (the
``--only flood`` case is the one safe to run without limits)."""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from tests.evaluators.attacks import run_sessions


def main() -> None:
    import polar_env

    p = argparse.ArgumentParser()
    p.add_argument("--only", action="append")
    p.add_argument("--flood-bytes", type=int, default=2_000_000_000)
    args = p.parse_args()
    small = {"pids_limit": 64, "memory_mb": 256, "disk_mb": 64}
    cases = {
        "flood": (f"head -c {args.flood_bytes} /dev/zero | tr '\\0' a; echo flood-done", {}),
        "forks": ("for i in $(seq 2000); do sleep 30 & done; wait", small),
        "memory": ("python3 -c \"x = b'a' * (1 << 30); print(len(x))\"", small),
        "disk": ("for i in 1 2 3 4 5; do head -c 30000000 /dev/zero > /testbed/f$i; done; sleep 12; echo filled", small),
        "shadow": ("cat /etc/shadow | head -c 40; echo; id -u; cat /proc/self/uid_map", {}),
        "normal": ("echo 6*7=$((6*7))", small),
    }
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_sessions(Path(tmp), cases)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"package: {Path(polar_env.__file__).parent}")
    print(f"rollout process peak RSS: {before:.0f} MiB before the sessions, {peak:.0f} MiB after "
          f"({time.monotonic() - started:.1f} s)")
    for name, r in results.items():
        limits = getattr(r, "limits", {}) or {}
        print(f"{name:8} {r.status.value:10} reward {r.reward:.1f}  failure: {r.failure_kind} {r.failure_detail}  hit: {limits.get('hit')}")


if __name__ == "__main__":
    main()
