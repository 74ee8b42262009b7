"""Harbor task folders (the format of Terminal-Bench 2 and many agent benchmarks) as task rows.

A Harbor task is a folder::

    task.toml         [task] name, [metadata], [agent] timeout_sec, [verifier] timeout_sec / env,
                      [environment] docker_image / workdir / memory_mb / ...
    instruction.md    what the agent is asked to do
    environment/      how to build the agent's container (a Dockerfile, or a prebuilt docker_image)
    tests/test.sh     the verifier: run after the agent, writes /logs/verifier/reward.txt (or .json)

The config is read with the ``harbor`` package's own model (``harbor.models.task.task.Task``) when
it imports (it needs Python >= 3.12: ``pip install 'polar-env[harbor]'``); otherwise with
``tomllib`` following the same field names (harbor's ``TaskConfig``), keeping only what polar
uses. Each task becomes a row for ``PolarEnv``/``polar-env rollout``: the instruction, a runtime,
and the ``harbor`` evaluator, with the task folder recorded so grading reads ``tests/`` from the
task, never from what the agent could touch.

Runtime: ``[environment] docker_image`` → that image (Docker or Apptainer runtime). Without a
prebuilt image polar does not build the Dockerfile; it runs the task in the configured runtime
(the embedded bubblewrap sandbox by default) with the workdir seeded from ``environment/workspace/``
when the task ships one (polar's offline convention, used by the toy tasks), else empty. The
workdir is ``[environment] workdir``, else the Dockerfile's last ``WORKDIR``, else ``/app``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from polar_env.errors import ConfigError

TOY_ROOT = Path(__file__).with_name("harbor_toy")
CACHE = Path(os.environ.get("POLAR_HARBOR_CACHE", Path.home() / ".cache" / "polar_env" / "harbor"))
DEFAULT_WORKDIR = "/app"
_GIT_ENV = {"GIT_AUTHOR_NAME": "polar-env harbor", "GIT_AUTHOR_EMAIL": "harbor@polar-env.invalid",
            "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_NAME": "polar-env harbor",
            "GIT_COMMITTER_EMAIL": "harbor@polar-env.invalid", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}


def is_harbor_task(path: Path) -> bool:
    return (path / "task.toml").is_file() and (path / "instruction.md").is_file()


def harbor_task_dirs(root: str | Path) -> list[Path]:
    """The task folders under ``root`` (``root`` itself when it is one), sorted by name."""
    path = Path(root)
    if is_harbor_task(path):
        return [path]
    found = sorted(p for p in path.iterdir() if p.is_dir() and is_harbor_task(p)) if path.is_dir() else []
    if not found:
        raise ConfigError(f"{path}: no Harbor task folders (each needs task.toml and instruction.md)")
    return found


def _config(task_dir: Path) -> tuple[str, dict[str, Any]]:
    """(instruction, config as plain data) with harbor's own model when it imports."""
    try:
        from harbor.models.task.task import Task
    except ImportError:
        Task = None
    if Task is not None:
        task = Task(task_dir)
        return str(task.instruction), task.config.model_dump(mode="json")
    try:
        config = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{task_dir}/task.toml: not TOML: {exc}") from None
    return (task_dir / "instruction.md").read_text(encoding="utf-8"), config


def _workdir(task_dir: Path, env: dict[str, Any]) -> str:
    if isinstance(env.get("workdir"), str) and env["workdir"]:
        return str(env["workdir"])
    dockerfile = task_dir / "environment" / "Dockerfile"
    if dockerfile.is_file():
        found = re.findall(r"^\s*WORKDIR\s+(\S+)", dockerfile.read_text(encoding="utf-8"), re.MULTILINE | re.IGNORECASE)
        if found:
            return str(found[-1])
    return DEFAULT_WORKDIR


def seeded_workspace(task_dir: Path) -> Path:
    """A git checkout of ``environment/workspace/`` (empty when absent), cached by content, so the
    agent's changes are a diff and a fresh grading runtime starts from the same files."""
    src = task_dir / "environment" / "workspace"
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else []
    digest = hashlib.sha256()
    for f in files:
        rel = f.relative_to(src).as_posix()
        digest.update(rel.encode() + b"\0" + oct(f.stat().st_mode & 0o777).encode() + b"\0" + f.read_bytes() + b"\0")
    repo = CACHE / f"{task_dir.name}-{digest.hexdigest()[:16]}" / "repo"
    if repo.is_dir():
        return repo
    repo.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=repo.parent, prefix=".build-"))
    try:
        work = tmp / "repo"
        if src.is_dir():
            shutil.copytree(src, work, symlinks=True)
        else:
            work.mkdir()
        env = {**os.environ, **_GIT_ENV}
        for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                     ["git", "commit", "-q", "--allow-empty", "-m", "harbor task workspace"]):
            subprocess.run(argv, cwd=work, env=env, check=True, capture_output=True)
        try:
            work.rename(repo)
        except OSError:
            if not repo.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return repo


def harbor_row(task_dir: str | Path) -> dict[str, Any]:
    """A ``PolarEnv`` task row for one Harbor task folder; one line on what is wrong with it."""
    path = Path(task_dir).resolve()
    if not is_harbor_task(path):
        raise ConfigError(f"{path}: not a Harbor task (needs task.toml and instruction.md)")
    if not (path / "tests" / "test.sh").is_file():
        raise ConfigError(f"{path}: no tests/test.sh (the Harbor verifier polar runs)")
    instruction, config = _config(path)
    if config.get("steps"):
        raise ConfigError(f"{path}: multi-step Harbor tasks are not supported yet (task.toml has [[steps]])")
    env = dict(config.get("environment") or {})
    verifier = dict(config.get("verifier") or {})
    agent = dict(config.get("agent") or {})
    # A Harbor name is "org/task"; "/" cannot be in a session id (it names journal files).
    name = str((config.get("task") or {}).get("name") or path.name).replace("/", "__")
    runtime: dict[str, Any] = {"workdir": _workdir(path, env)}
    if env.get("docker_image"):
        runtime.update(kind="docker", image=str(env["docker_image"]))
    else:
        runtime["source_dir"] = str(seeded_workspace(path))
    if env.get("memory_mb"):
        runtime["memory_mb"] = int(env["memory_mb"])
    row: dict[str, Any] = {
        "task_id": name,
        "instruction": instruction.strip(),
        "runtime": runtime,
        "evaluator": {"name": "harbor", "params": {"timeout_s": float(verifier.get("timeout_sec") or 600.0),
                                                    "env": dict(verifier.get("env") or {})}},
        "task": {"harbor_task_dir": str(path), "metadata": dict(config.get("metadata") or {})},
    }
    if agent.get("timeout_sec"):
        row["timeout_s"] = float(agent["timeout_sec"])
    return row


def load_harbor_rows(root: str | Path) -> list[dict[str, Any]]:
    return [harbor_row(d) for d in harbor_task_dirs(root)]
