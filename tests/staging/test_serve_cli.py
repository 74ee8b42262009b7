"""``polar-env serve`` / ``submit`` / ``status`` as processes, the way a user runs them: the server
(nodes in-process with ``--local``; the Ray path is tests/staging/test_ray.py) with the simulated
engine test double and the loop harness in real bwrap sandboxes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polar_env.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_serve_submit_status(tmp_path: Path) -> None:
    require_bwrap()
    port = free_port()
    store = tmp_path / "serve"
    server = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "serve", "--local", "--port", str(port),
                               "--store", str(store), "--engine", "simulated", "--harness", "loop", "--nodes", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "polar-env serve ready" in line and f"token in {store / 'rollout_token'}" in line, line
        assert oct((store / "rollout_token").stat().st_mode & 0o777) == "0o600"
        url = f"http://127.0.0.1:{port}"
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"task_id": "echo", "instruction": "run echo hi",
                                     "evaluator": {"name": "output", "regex": "printed"}}) + "\n")
        token = ["--server", url, "--token-file", str(store / "rollout_token")]
        sub = cli("submit", str(tasks), "--samples", "3", "--harness", "loop", "--wait", *token)
        assert sub.returncode == 0, sub.stderr
        assert "echo: submitted as group" in sub.stdout
        summary = json.loads(sub.stdout.strip().splitlines()[-1])
        assert summary["state"] == "done" and summary["statuses"] == {"completed": 3} and summary["mean_reward"] == 1.0
        status = cli("status", *token)
        assert status.returncode == 0, status.stderr
        overview = json.loads(status.stdout)
        assert [n["node_id"] for n in overview["nodes"]] == ["node-0", "node-1"]
        assert sum(n["completed"] for n in overview["nodes"]) == 3
        group = cli("status", summary["group_id"], *token)
        assert json.loads(group.stdout)["done"] == 3
        refused = cli("status", "--server", url, "--token", "wrong")
        assert refused.returncode == 1 and "wrong bearer token" in refused.stdout
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        rest = server.stdout.read() if server.stdout else ""
        if server.stdout:
            server.stdout.close()
    assert server.returncode == 0, rest


def test_serve_defaults_apply_to_rows_that_name_no_harness(tmp_path: Path) -> None:
    """``serve --harness loop`` + ``submit`` without --harness: the rows run loop (they ran pi,
    submit's own default, before); a row's own agent settings merge over the server's harness."""
    require_bwrap()
    port = free_port()
    store = tmp_path / "serve"
    server = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "serve", "--local", "--port", str(port),
                               "--store", str(store), "--engine", "simulated", "--harness", "loop"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "polar-env serve ready" in line, line
        url = f"http://127.0.0.1:{port}"
        tasks = tmp_path / "tasks.jsonl"
        evaluator = {"name": "output", "regex": "printed"}
        tasks.write_text(json.dumps({"task_id": "plain", "instruction": "run echo hi", "evaluator": evaluator}) + "\n"
                         + json.dumps({"task_id": "own-settings", "instruction": "run echo hi", "evaluator": evaluator,
                                       "agent": {"settings": {"max_turns": 4}}}) + "\n")
        token = ["--server", url, "--token-file", str(store / "rollout_token")]
        sub = cli("submit", str(tasks), "--wait", *token)
        assert sub.returncode == 0, sub.stderr
        assert "warning" not in sub.stderr, sub.stderr
        bare = tmp_path / "bare.jsonl"
        bare.write_text(json.dumps({"task_id": "bare", "instruction": "run echo hi"}) + "\n")
        warned = cli("submit", str(bare), *token)
        assert warned.returncode == 0 and warned.stderr.strip() == (
            "polar-env submit: warning: bare: no evaluator (in the row, submit --evaluator or serve --evaluator): "
            "every session gets reward 0"), warned.stderr
        groups = [json.loads(s) for s in sub.stdout.strip().splitlines() if s.startswith("{")]
        assert sorted(g["task_id"] for g in groups) == ["own-settings", "plain"]
        for group in groups:
            assert group["statuses"] == {"completed": 1} and group["mean_reward"] == 1.0, group
            req = urllib.request.Request(f"{url}/rollout/task/{group['group_id']}",
                                         headers={"Authorization": f"Bearer {(store / 'rollout_token').read_text().strip()}"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                results = json.loads(resp.read())["results"]
            assert [r["trajectory"]["metadata"]["harness"] for r in results] == ["loop"], results
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stdout:
            server.stdout.close()
    assert server.returncode == 0
