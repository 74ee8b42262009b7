"""Turn a ``ToySource`` (files as Python data) into a git repo plus a ``SweTask``, offline.

The repo is committed with a fixed author, committer, dates and an isolated git config, so its
``base_commit`` is the same on every machine. The gold patch, test patch and known-bad variants are
computed with ``git diff`` against that commit. Builds are cached by content hash and land by
atomic rename, so concurrent builders never see half a repo.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from polar_env.tasks.swe import SweTask, build_eval_script

# Same identity and instant for every build: these feed the commit hash.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "polar-env toy",
    "GIT_AUTHOR_EMAIL": "toy@polar-env.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "polar-env toy",
    "GIT_COMMITTER_EMAIL": "toy@polar-env.invalid",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,  # no user hooks, signing, diff prefixes or autocrlf
    "GIT_TERMINAL_PROMPT": "0",
}
COMMON_FILES = {
    "pytest.ini": "[pytest]\n",  # pins pytest's rootdir to the repo, so test ids are repo-relative
    ".gitignore": "__pycache__/\n*.pyc\n",
}
TEST_COMMAND = "python3 -m pytest -rA -p no:cacheprovider"


@dataclass(frozen=True, slots=True)
class ToySource:
    """One toy task. ``files`` is the repo at base_commit; ``fix`` the files the gold patch
    rewrites; ``tests`` the test files after the test patch (a new path means an added file);
    ``variants`` known-bad patches (name → rewritten files) for testing graders."""

    instance_id: str
    repo: str
    problem_statement: str
    files: Mapping[str, str]
    fix: Mapping[str, str]
    tests: Mapping[str, str]
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    variants: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    version: str = "0.1"

    def digest(self) -> str:
        payload = json.dumps(
            {
                "instance_id": self.instance_id,
                "files": dict(self.files),
                "fix": dict(self.fix),
                "tests": dict(self.tests),
                "variants": {k: dict(v) for k, v in self.variants.items()},
                "f2p": self.FAIL_TO_PASS,
                "p2p": self.PASS_TO_PASS,
                "problem": self.problem_statement,
                "common": COMMON_FILES,
                "env": {k: v for k, v in GIT_ENV.items() if k != "GIT_CONFIG_GLOBAL"},
                "cmd": TEST_COMMAND,
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_toy_task(source: ToySource, cache_dir: Path) -> SweTask:
    """The task for ``source``, building its repo under ``cache_dir`` unless a build is cached."""
    final = cache_dir / f"{source.instance_id}-{source.digest()}"
    task_file = final / "task.json"
    if not task_file.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{source.instance_id}-", dir=cache_dir))
        try:
            _build(source, scratch)
            try:
                os.rename(scratch, final)
            except OSError:
                if not task_file.is_file():  # lost a race to another builder: theirs is complete
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    data = json.loads(task_file.read_text(encoding="utf-8"))
    return SweTask.model_validate({**data, "repo_dir": final / "repo"})


def _build(source: ToySource, scratch: Path) -> None:
    repo = scratch / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _write(repo, {**COMMON_FILES, **source.files})
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{source.repo}: base for {source.instance_id}")
    base_commit = _git(repo, "rev-parse", "HEAD").strip()
    patch = _diff(repo, source.fix)
    test_patch = _diff(repo, source.tests)
    variants = {name: _diff(repo, files) for name, files in sorted(source.variants.items())}
    test_paths = sorted({test_id.split("::", 1)[0] for test_id in (*source.FAIL_TO_PASS, *source.PASS_TO_PASS)})
    task = SweTask(
        instance_id=source.instance_id,
        repo=source.repo,
        base_commit=base_commit,
        patch=patch,
        test_patch=test_patch,
        problem_statement=source.problem_statement,
        version=source.version,
        created_at="2024-01-01T00:00:00Z",
        FAIL_TO_PASS=list(source.FAIL_TO_PASS),
        PASS_TO_PASS=list(source.PASS_TO_PASS),
        image_style="local",
        eval_script=build_eval_script(
            base_commit=base_commit, test_patch=test_patch, test_command=f"{TEST_COMMAND} {' '.join(test_paths)}"
        ),
        log_parser="parse_log_pytest",
        eval_type="pass_and_fail",
        data_source="polar_env.toy",
        extra={"variants": variants},
    )
    (scratch / "task.json").write_text(task.model_dump_json(exclude={"repo_dir"}, indent=1), encoding="utf-8")


def _diff(repo: Path, files: Mapping[str, str]) -> str:
    """The patch that rewrites ``files`` on top of HEAD; the worktree is left clean."""
    _write(repo, files)
    try:
        _git(repo, "add", "-A")
        return _git(repo, "diff", "--cached", "--no-color", "--no-ext-diff", "HEAD")
    finally:
        _git(repo, "reset", "-q", "--hard", "HEAD")
        _git(repo, "clean", "-fdxq")


def _write(repo: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
        path.chmod(0o644)  # the mode is part of the tree, so of the commit hash


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout
