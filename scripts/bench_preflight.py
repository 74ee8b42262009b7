"""How long a user's mistake takes to be reported, and what the happy-path preflight costs.

Runs each mistake as a user would (``python -m polar_env.cli ...`` in a subprocess) and prints the
seconds until the command exited, its exit code and how many stderr lines it printed. With
``--baseline SRC`` (another source tree, e.g. ``git archive <commit> | tar -x -C /tmp/base``) the
same cases run against it side by side. The happy path is the default job's preflight (toy tasks,
pi, bwrap sandbox, swebench) timed in-process, best of ``--repeat``.

    python scripts/bench_preflight.py [--baseline /tmp/base] [--only dead-engine,task-id]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM = ["--engine", "simulated", "--harness", "loop", "--no-progress"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cases(tmp: Path, held_port: int) -> dict[str, list[str]]:
    dead = f"http://127.0.0.1:{free_port()}"
    return {
        "dead-engine": ["rollout", "--engine-url", dead, "--task-id", "toy__calc-1", "--samples", "1", "--no-progress"],
        "task-id": ["rollout", *SIM, "--task-id", "toy__nope"],
        "samples-0": ["rollout", *SIM, "--samples", "0"],
        "evaluator-json": ["rollout", *SIM, "--evaluator", "{bad json"],
        "serve-port": ["serve", "--local", "--port", str(held_port), "--engine", "simulated", "--harness", "loop",
                       "--store", str(tmp / "serve")],
        "docker-absent": ["rollout", *SIM, "--runtime", "docker", "--task-id", "toy__calc-1", "--samples", "1"],
    }


def run_case(src: Path, argv: list[str], out: Path) -> tuple[float, int, int]:
    env = {**os.environ, "PYTHONPATH": str(src), "DOCKER_HOST": f"unix://{out.parent / 'no-docker.sock'}"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "polar_env.cli", *argv, *(["--out", str(out)] if argv[0] != "serve" else [])],
                          capture_output=True, text=True, env=env, cwd=out.parent, timeout=900, check=False)
    return time.monotonic() - started, proc.returncode, len(proc.stderr.strip().splitlines())


def happy_path(repeat: int) -> float:
    sys.path.insert(0, str(ROOT))
    from polar_env.preflight import check_job
    from polar_env.staging.job import RolloutJob

    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        check_job(RolloutJob(), "rollout")
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a source tree to compare against (PYTHONPATH for its polar_env)")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        tmp = Path(d)
        selected = cases(tmp, held.getsockname()[1])
        if args.only:
            selected = {k: v for k, v in selected.items() if k in args.only.split(",")}
        trees = [("this tree", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
        print(f"{'case':16}" + "".join(f"{name:>28}" for name, _ in trees))
        for name, argv in selected.items():
            cells, times = [], []
            for i, (_, src) in enumerate(trees):
                seconds, rc, lines = run_case(src, argv, tmp / f"out-{name}-{i}")
                cells.append(f"{seconds:6.1f}s rc={rc} {lines:3d} lines")
                times.append(seconds)
            ratio = f"   baseline/this {times[1] / times[0]:.1f}x" if len(times) == 2 else ""
            print(f"{name:16}" + "".join(f"{c:>28}" for c in cells) + ratio, flush=True)
    print(f"happy-path preflight of the default job (best of {args.repeat}): {happy_path(args.repeat):.3f}s")


if __name__ == "__main__":
    main()
