"""scripts/bench_docker.py at a reduced size: sessions of the real node whose tool calls execute in
real containers (the private dockerd, the imported test image) all execute at the same time — the
peak count of their commands running inside containers, sampled from the host's /proc, reaches
``max_running``, which is above both executors' thread counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow
SESSIONS = 10  # above the node's Docker executor (8) and asyncio's default executor (6 here)


def test_docker_sessions_execute_concurrently(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("docker_host")
    out = tmp_path / "docker.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_docker.py"), "--sessions", str(SESSIONS),
                           "--turns", "2", "--sleep", "3", "--max-init", "10", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["errors"] == 0, r
    assert r["peak_running_in_containers"] == SESSIONS, r
    assert SESSIONS > r["docker_executor_threads"] and SESSIONS > r["default_executor_threads"]
    assert "concurrency >= max_running: yes" in proc.stdout
