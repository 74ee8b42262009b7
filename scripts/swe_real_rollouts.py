"""Gold 1.0, empty 0.0, wrong 0.0 on real SWE work, through the real ``polar-env rollout``.

For each instance of ``../shared/swe-real`` (eight SWE-bench-style rows from public repositories, each
with an environment recipe) this builds the environment with the set's ``build_env.sh`` (kept in
``--envs``), writes a tasks file and a config for it, and runs ``polar-env rollout`` (a subprocess:
the CLI a user runs) three times: a scripted policy (``--engine-script``) makes the agent of the
``loop`` harness apply the gold patch, change nothing, or apply a wrong patch, each with a real shell
command in its runtime, and the swebench evaluator grades each in a fresh runtime. The policy is
played by the simulated engine (the same ScriptedPolicy, no model: the reward path is what is under
test, and forcing a 17k-token patch command through the embedded CPU model takes minutes);
``--engine embedded`` forces the model to it instead. It prints one row per case and exits 1 unless
gold is 1.0 and empty and wrong are 0.0, all completed and unmasked with no failure kind, and the
wrong patch's 0 came from its tests (the swebench grading library's verdict).

Why the config looks as it does (rows do not carry their environment yet):

- the instance's venv is bound read-only at the path it was built at (uv venvs hardcode it in their
  scripts' shebangs), with the base interpreter it links to (``home`` in pyvenv.cfg, unless under
  /usr), and its ``bin`` is first on the runtime's ``PATH`` (the grading runtime keeps a PATH the
  task sets, so the tests and the grader's own checks run the venv's python). The row's ``repo_dir``
  (the built repo, one commit) is what the runtime copies to /testbed;
- the venv is an editable install whose ``.pth`` / finder names ``<env>/repo``, the host's pristine
  copy, which is not in the runtime. The test command first links ``<env>/repo`` to ``/testbed``
  (``ln -sfn``; ``<env>`` exists there as the parent of the venv's bind, in the runtime's own
  writable tree: tried under /tmp, /root and /opt), so the editable install imports the graded
  workspace, exactly as it was built to (``.pth`` and finder alike);
- the row's ``base_commit`` becomes the built repo's own commit (the set's upstream id is kept as
  ``upstream_base_commit``): the eval script resets the test files to it.

The wrong patch is the gold patch without its main source file (the non-test ``.py`` file with the
most changed lines of code, docstrings and comments not counted): it applies, is no test
change, and leaves the fix incomplete.

    python scripts/swe_real_rollouts.py --envs /tmp/swe-envs --ids pallets__click-2223
    python scripts/swe_real_rollouts.py --runtime docker --image polar-test/py:bookworm
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed copy from elsewhere
SHARED = ROOT.parent / "shared" / "swe-real"
ENVS = Path.home() / ".cache" / "polar_env" / "swe-real"
CASES = ("gold", "empty", "wrong")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUN_TIMEOUT_S = 1200.0  # one `polar-env rollout` of one case; the slowest test run (requests) is ~60 s
_TEST_PATH = re.compile(r"(^|/)(tests?|testing|test-data|e2e)/|(^|/)test_[^/]*$|_test\.py$|(^|/)conftest\.py$")


class UserError(Exception):
    """A mistake in what was asked (an unknown id, a missing folder): one line, exit 2."""


@dataclass(frozen=True)
class Instance:
    """One row of the set with where its environment was built."""

    row: dict[str, Any]
    env_dir: Path

    @property
    def id(self) -> str:
        return str(self.row["instance_id"])

    @property
    def repo(self) -> Path:
        return self.env_dir / "repo"

    @property
    def venv(self) -> Path:
        return self.env_dir / "venv"


@dataclass(frozen=True)
class CaseResult:
    """What one rollout's outputs say about one case, and whether that is what the case expects."""

    instance: str
    case: str
    status: str
    reward: float | None
    mask: bool | None
    failure_kind: str | None
    reason: str
    eval_s: float | None  # the whole evaluation (fresh runtime, change, tests, grading)
    tests_s: float | None  # the eval script (the test run) alone
    wall_s: float  # the CLI run, start to exit
    graded_tests: bool  # the swebench grading library decided the verdict from test results
    run_dir: Path

    @property
    def ok(self) -> bool:
        clean = self.status == "completed" and self.mask is False and self.failure_kind is None
        if self.case == "gold":
            return clean and self.reward == 1.0
        return clean and self.reward == 0.0 and (self.case == "empty" or self.graded_tests)


def load_instances(shared: Path) -> dict[str, dict[str, Any]]:
    path = shared / "instances.jsonl"
    if not path.is_file():
        raise UserError(f"no swe-real set at {shared} (expected {path}); give --shared DIR")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {str(r["instance_id"]): r for r in rows}


def pick(rows: dict[str, dict[str, Any]], ids: Sequence[str]) -> list[dict[str, Any]]:
    unknown = [i for i in ids if i not in rows]
    if unknown:
        raise UserError(f"unknown instance id(s) {', '.join(unknown)}; known: {', '.join(rows)}")
    return [rows[i] for i in ids] if ids else list(rows.values())


def build_env(shared: Path, row: dict[str, Any], envs: Path) -> Instance:
    """The instance's repo and venv under ``envs/<id>``, built (or reused: the script is idempotent)
    by the set's own recipe, and the repo checked clean: the runtime copies its working tree."""
    inst = Instance(row, envs / str(row["instance_id"]))
    proc = subprocess.run(["bash", str(shared / "build_env.sh"), inst.id, str(inst.env_dir)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"build_env.sh {inst.id} failed (exit {proc.returncode}): {tail}")
    dirty = _git(inst.repo, "status", "--porcelain")
    if dirty:
        raise UserError(f"{inst.repo} has local changes; reset it: git -C {inst.repo} checkout -f HEAD "
                        f"&& git -C {inst.repo} clean -fd")
    return inst


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def patch_sections(patch: str) -> list[str]:
    """A git diff split into its per-file sections (each from its ``diff --git`` line)."""
    return [s for s in re.split(r"(?m)^(?=diff --git )", patch) if s.strip()]


def code_lines(section: str) -> int:
    """Changed lines of code in one file's section: not blank, not a comment, not in a docstring
    (tracked through each hunk's new side by its triple quotes; a hunk is assumed to start outside one)."""
    count, inside = 0, False
    for line in section.splitlines():
        if line.startswith("@@"):
            inside = False
            continue
        tag, text = line[:1], line[1:].strip()
        if tag not in " +-" or line.startswith(("+++ ", "--- ")):
            continue
        quotes = text.count('"""') + text.count("'''")
        doc = inside or quotes > 0
        if tag != "-" and quotes % 2:
            inside = not inside
        if tag in "+-" and text and not text.startswith("#") and not doc:
            count += 1
    return count


def wrong_patch(gold: str) -> tuple[str, str]:
    """The gold patch without its main source file's section, and that file's path. The main source
    file is the non-test ``.py`` file with the most changed lines of code (one whose change is mostly
    docstrings is not where the fix is)."""
    from polar_env.tasks.swe import patch_files

    sections = patch_sections(gold)
    sources = []
    for index, section in enumerate(sections):
        path = next(iter(patch_files(section)), "")
        if path.endswith(".py") and not _TEST_PATH.search(path):
            sources.append((code_lines(section), index, path))
    if not sources:
        raise UserError("the gold patch changes no non-test .py file: no wrong patch to derive")
    _, main, path = max(sources)
    rest = "".join(s for i, s in enumerate(sections) if i != main)
    if not rest.strip():
        raise UserError(f"the gold patch changes only {path}: no wrong patch to derive")
    return rest, path


def apply_command(patch: str) -> str:
    """The agent's shell command: the patch, gzipped and base64'd onto the command line, applied by git."""
    blob = base64.b64encode(gzip.compress(patch.encode(), 9, mtime=0)).decode()
    return f"cd /testbed && echo {blob} | base64 -d | gunzip | git apply -v && git status --short"


def policy(case: str, patch: str) -> dict[str, Any]:
    """A scripted policy file: one shell command, then an answer quoting its output."""
    if case == "empty":
        return {"steps": [{"command": "cd /testbed && git status --short", "reasoning": "Look, change nothing."},
                          {"text": "I changed nothing.\n{tool_output}", "reasoning": "Done."}]}
    return {"steps": [{"command": apply_command(patch), "reasoning": f"Apply the {case} patch."},
                      {"text": "Applied:\n{tool_output}", "reasoning": "The change is in place."}]}


def base_prefix(venv: Path) -> Path | None:
    """The prefix of the interpreter the venv links to (``home`` in pyvenv.cfg), when it is not the
    system's own (/usr is in every runtime already)."""
    cfg = venv / "pyvenv.cfg"
    for line in cfg.read_text(encoding="utf-8").splitlines() if cfg.is_file() else []:
        key, _, value = line.partition("=")
        if key.strip() == "home":
            prefix = Path(value.strip()).parent
            return None if prefix in (Path("/usr"), Path("/")) else prefix
    return None


def eval_command(inst: Instance) -> str:
    """The row's test command, after linking the editable install's repo path to the workspace."""
    return f"ln -sfn /testbed {shlex.quote(str(inst.repo))} && {inst.row['environment_setup']['test_command']}"


def task_row(inst: Instance) -> dict[str, Any]:
    row = {k: v for k, v in inst.row.items() if k != "environment_setup"}
    row.update(upstream_base_commit=row["base_commit"], base_commit=_git(inst.repo, "rev-parse", "HEAD"),
               repo_dir=str(inst.repo))
    return row


def config(inst: Instance, *, runtime: str, image: str | None, max_tokens: int, engine: str = "simulated") -> dict[str, Any]:
    """The rollout config of one instance: its environment, the loop harness, the swebench grader."""
    binds = [[str(inst.venv), str(inst.venv)]]
    prefix = base_prefix(inst.venv)
    if prefix is not None:
        binds.append([str(prefix), str(prefix)])
    spec: dict[str, Any] = {"kind": runtime, "binds": binds, "env": {"PATH": f"{inst.venv / 'bin'}:{DEFAULT_PATH}"}}
    if image is not None:
        spec["image"] = image
    return {"harness": "loop", "engine": {"kind": engine}, "sampling": {"max_tokens": max_tokens},
            "runtime": spec,
            "evaluator": {"name": "swebench", "params": {"test_command": eval_command(inst)}}}


def write_inputs(inst: Instance, work: Path, *, runtime: str, image: str | None, engine: str = "simulated") -> dict[str, Path]:
    """Writes the instance's tasks file and config and one policy per case; returns the policies."""
    work.mkdir(parents=True, exist_ok=True)
    wrong, _ = wrong_patch(str(inst.row["patch"]))
    patches = {"gold": str(inst.row["patch"]), "empty": "", "wrong": wrong}
    policies = {case: policy(case, patch) for case, patch in patches.items()}
    longest = max(len(json.dumps(p)) for p in policies.values())  # a token is at least one character
    max_tokens = min(max(4096, longest + 1024), 30_000)
    (work / "tasks.jsonl").write_text(json.dumps(task_row(inst)) + "\n", encoding="utf-8")
    cfg = config(inst, runtime=runtime, image=image, max_tokens=max_tokens, engine=engine)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, width=1000), encoding="utf-8")
    paths = {}
    for case, data in policies.items():
        paths[case] = work / f"policy-{case}.json"
        paths[case].write_text(json.dumps(data), encoding="utf-8")
    return paths


def run_case(inst: Instance, case: str, work: Path, script: Path, *, timeout_s: float = RUN_TIMEOUT_S) -> CaseResult:
    """One ``polar-env rollout`` of one case, and what its run folder says."""
    out = work / "runs"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
    argv = [sys.executable, "-m", "polar_env.cli", "rollout", "--tasks", str(work / "tasks.jsonl"), "--samples", "1",
            "--config", str(work / "config.yaml"), "--engine-script", str(script), "--out", str(out),
            "--run-id", case, "--no-progress"]
    started = time.monotonic()
    code = None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        printed, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        printed = f"polar-env rollout ran past {timeout_s:.0f} s"
    wall = round(time.monotonic() - started, 1)
    run_dir = out / case
    (work / f"{case}.log").write_text(printed, encoding="utf-8")
    sessions = run_dir / "sessions.jsonl"
    if not sessions.is_file():
        last = (printed.strip().splitlines() or ["no output"])[-1]
        if code == 2:  # the CLI refused what it was given (no daemon, a bad config): nothing else will run
            raise UserError(last)
        return CaseResult(inst.id, case, "no run", None, None, None, last[:200], None, None, wall, False, run_dir)
    s = json.loads(sessions.read_text(encoding="utf-8").splitlines()[0])
    ev = s.get("evaluation") or {}
    timings = ev.get("timings_s") or {}
    reason = str(ev.get("reason") or ev.get("error") or s.get("failure_detail") or "")
    return CaseResult(inst.id, case, str(s.get("status")), s.get("reward"), s.get("mask"), s.get("failure_kind"),
                      reason, ev.get("evaluate_s"), timings.get("eval"), wall, "swebench" in ev, run_dir)


def table(results: Sequence[CaseResult]) -> str:
    head = ("instance", "case", "ok", "status", "reward", "mask", "failure_kind", "eval_s", "tests_s", "wall_s", "reason")
    rows = [head] + [(r.instance, r.case, "yes" if r.ok else "NO", r.status, _num(r.reward), str(r.mask),
                      r.failure_kind or "-", _num(r.eval_s), _num(r.tests_s), _num(r.wall_s), r.reason[:70])
                     for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def run(ids: Sequence[str], *, shared: Path = SHARED, envs: Path = ENVS, work: Path | None = None,
        runtime: str = "sandbox", image: str | None = None, engine: str = "simulated", cases: Sequence[str] = CASES,
        echo: bool = True) -> list[CaseResult]:
    """Every asked case of every asked instance (all eight by default); raises UserError for a mistake."""
    rows = pick(load_instances(shared), ids)
    if runtime == "docker" and image is None:
        raise UserError("--runtime docker needs --image (an imported rootfs, e.g. scripts/build_rootfs.sh)")
    work = work or Path(tempfile.mkdtemp(prefix="swe-real-rollouts-"))
    results = []
    for row in rows:
        inst = build_env(shared, row, envs)
        policies = write_inputs(inst, work / inst.id, runtime=runtime, image=image, engine=engine)
        for case in cases:
            result = run_case(inst, case, work / inst.id, policies[case])
            results.append(result)
            if echo:
                print(f"{inst.id} {case}: {result.status} reward {_num(result.reward)} ({result.wall_s:g} s) "
                      f"{result.reason[:100]}", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    p.add_argument("--ids", nargs="+", default=[], metavar="ID", help="instance ids (default: all eight)")
    p.add_argument("--shared", type=Path, default=SHARED, help=f"the swe-real set (default {SHARED})")
    p.add_argument("--envs", type=Path, default=ENVS, help=f"where environments are built or reused (default {ENVS})")
    p.add_argument("--work", type=Path, help="where tasks, configs, policies and run folders go (default: a new temp dir)")
    p.add_argument("--runtime", choices=("sandbox", "docker"), default="sandbox")
    p.add_argument("--image", help="docker: the image to run in (no pulls: an imported rootfs)")
    p.add_argument("--engine", choices=("simulated", "embedded"), default="simulated",
                   help="who plays the scripted policy: the simulated engine (no model: instant) or the embedded "
                        "CPU model forced to it (real ids and logprobs; ~20-40 ms a token, minutes for a long patch)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = p.parse_args(argv)
    try:
        results = run(args.ids, shared=args.shared, envs=args.envs.expanduser().resolve(), work=args.work,
                      runtime=args.runtime, image=args.image, engine=args.engine, cases=args.cases)
    except UserError as exc:
        print(f"swe_real_rollouts: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} cases as expected"
          + (f"; run folders under {results[0].run_dir.parents[2]}" if results else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
