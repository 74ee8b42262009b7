"""Real SWE rows as users bring them, end to end: gold 1.0, empty 0.0, wrong 0.0, through the real
``polar-env images build`` and ``polar-env rollout``.

For each instance of ``../shared/swe-real`` (eight SWE-bench-style rows mined from public
repositories' history, each with an ``environment_setup`` recipe) this

1. builds the row's image with ``polar-env images build`` (a subprocess: the CLI a user runs) from the
   recipe alone — ``--kind rootfs`` for the sandbox and Apptainer (an OCI bundle in the image store,
   under the row's own image name), ``--kind docker`` for Docker (the same build, as a Docker image
   of that name) — and
2. rolls the row out as published (no ``eval_script``, no ``repo_dir``, no config beyond the harness,
   the runtime kind and the engine) three times: a scripted policy (``--engine-script``) makes the
   agent apply the gold patch, change nothing, or apply a wrong patch, each with a real shell command
   through the harness's own shell tool (``--harness loop`` or ``pi``), and the swebench evaluator
   grades each in a fresh runtime from the image, with the eval script the row's ``environment_setup``
   gives.

The policy is played by the simulated engine (the reward path is what is under test; forcing a
17k-token patch command through the embedded CPU model takes minutes); ``--engine embedded`` forces
the model to it instead. It prints one row per case with per-stage seconds (image build, INIT,
RUNNING, grading) and the image's disk, and exits 1 unless gold is 1.0 and empty and wrong are 0.0,
all completed and unmasked with no failure kind, and the wrong patch's 0 came from its tests.

The wrong patch is the gold patch without its main source file (the non-test ``.py`` file with the
most changed lines of code, docstrings and comments not counted): it applies, is no test change, and
leaves the fix incomplete.

    python scripts/swe_real_rollouts.py --ids pallets__click-2223
    python scripts/swe_real_rollouts.py --runtime docker --harness pi
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import re
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
CASES = ("gold", "empty", "wrong")
HARNESSES = ("loop", "pi")
RUNTIMES = ("sandbox", "docker", "apptainer")
RUN_TIMEOUT_S = 1200.0  # one `polar-env rollout` of one case; the slowest test run (requests) is ~60 s
BUILD_TIMEOUT_S = 1800.0
_TEST_PATH = re.compile(r"(^|/)(tests?|testing|test-data|e2e)/|(^|/)test_[^/]*$|_test\.py$|(^|/)conftest\.py$")


class UserError(Exception):
    """A mistake in what was asked (an unknown id, a missing folder): one line, exit 2."""


@dataclass(frozen=True)
class CaseResult:
    """What one rollout's outputs say about one case, and whether that is what the case expects."""

    instance: str
    runtime: str
    harness: str
    case: str
    status: str
    reward: float | None
    mask: bool | None
    failure_kind: str | None
    reason: str
    build_s: float | None  # the image build (0 when the image was current)
    image_mb: float | None  # the image's own disk (beyond the shared base)
    init_s: float | None  # INIT: the runtime prepared from the image
    running_s: float | None  # RUNNING: the harness
    grading_s: float | None  # POSTRUN: the evaluation (fresh runtime, change, tests, grading)
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


@dataclass(frozen=True)
class Built:
    """One image ``polar-env images build`` made (or found current)."""

    image: str
    seconds: float  # the build's stages (0 when the image was current)
    disk_mb: float | None  # rootfs: bytes not shared with the base; docker: the layer over the base image
    wall_s: float = 0.0  # the CLI call, start to exit


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


def _env(store: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT), "POLAR_IMAGES": str(store)}


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


def build_image(shared: Path, instance: str, *, kind: str, store: Path) -> Built:
    """``polar-env images build`` of one row (skipped by the CLI when the image is current)."""
    argv = [sys.executable, "-m", "polar_env.cli", "images", "build", str(shared / "instances.jsonl"), "--ids", instance,
            "--kind", kind, "--repos", str(shared / "repos"), "--store", str(store), "--json"]
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=_env(store), timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"polar-env images build {instance} ran past {BUILD_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        last = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
        raise UserError(f"polar-env images build {instance} --kind {kind} failed (exit {proc.returncode}): {last}")
    report = json.loads(proc.stdout)
    image = report["images"][0]
    seconds = round(sum(image["stages_s"].values()), 1) if not image["skipped"] else 0.0
    disk = image.get("layer_bytes") if kind == "docker" else image.get("unique_bytes")
    if disk is None and kind == "rootfs":  # current already: measure what it holds beyond the base
        from polar_env.runtimes.bundle import read_image_dir
        from polar_env.tasks.image_build import default_base, unique_bytes

        disk = unique_bytes(default_base(os.environ), read_image_dir(image["bundle"]).rootfs)
    return Built(image=str(image["image"]), seconds=seconds, disk_mb=None if disk is None else round(disk / 2**20, 1),
                 wall_s=round(time.monotonic() - started, 1))


def write_inputs(row: dict[str, Any], work: Path, *, runtime: str, harness: str, engine: str) -> dict[str, Path]:
    """The published row as the tasks file, a config naming only harness, runtime and engine, and one
    policy per case; returns the policies."""
    work.mkdir(parents=True, exist_ok=True)
    wrong, _ = wrong_patch(str(row["patch"]))
    patches = {"gold": str(row["patch"]), "empty": "", "wrong": wrong}
    policies = {case: policy(case, patch) for case, patch in patches.items()}
    longest = max(len(json.dumps(p)) for p in policies.values())  # a token is at least one character
    max_tokens = min(max(4096, longest + 1024), 30_000)
    (work / "tasks.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    cfg = {"harness": harness, "engine": {"kind": engine}, "sampling": {"max_tokens": max_tokens},
           "runtime": {"kind": runtime}}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, width=1000), encoding="utf-8")
    paths = {}
    for case, data in policies.items():
        paths[case] = work / f"policy-{case}.json"
        paths[case].write_text(json.dumps(data), encoding="utf-8")
    return paths


def run_case(row: dict[str, Any], case: str, work: Path, script: Path, *, runtime: str, harness: str, built: Built,
             store: Path, timeout_s: float = RUN_TIMEOUT_S) -> CaseResult:
    """One ``polar-env rollout`` of one case, and what its run folder says."""
    out = work / "runs"
    argv = [sys.executable, "-m", "polar_env.cli", "rollout", "--tasks", str(work / "tasks.jsonl"), "--samples", "1",
            "--config", str(work / "config.yaml"), "--engine-script", str(script), "--out", str(out),
            "--run-id", case, "--no-progress"]
    started = time.monotonic()
    code = None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=_env(store), timeout=timeout_s)
        printed, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        printed = f"polar-env rollout ran past {timeout_s:.0f} s"
    wall = round(time.monotonic() - started, 1)
    run_dir = out / case
    (work / f"{case}.log").write_text(printed, encoding="utf-8")
    sessions = run_dir / "sessions.jsonl"
    ident = (str(row["instance_id"]), runtime, harness, case)
    if not sessions.is_file():
        last = (printed.strip().splitlines() or ["no output"])[-1]
        if code == 2:  # the CLI refused what it was given (no daemon, a bad config): nothing else will run
            raise UserError(last)
        return CaseResult(*ident, "no run", None, None, None, last[:200], built.seconds, built.disk_mb, None, None, None,
                          None, wall, False, run_dir)
    s = json.loads(sessions.read_text(encoding="utf-8").splitlines()[0])
    ev = s.get("evaluation") or {}
    stages = s.get("stage_times") or {}
    reason = str(ev.get("reason") or ev.get("error") or s.get("failure_detail") or "")
    return CaseResult(*ident, str(s.get("status")), s.get("reward"), s.get("mask"), s.get("failure_kind"), reason,
                      built.seconds, built.disk_mb, _span(stages, "init", "ready"), _span(stages, "running", "postrun"),
                      _span(stages, "postrun", "done"), (ev.get("timings_s") or {}).get("eval"), wall,
                      "swebench" in ev, run_dir)


def _span(stages: dict[str, float], start: str, end: str) -> float | None:
    if start in stages and end in stages:
        return round(stages[end] - stages[start], 1)
    return None


def table(results: Sequence[CaseResult]) -> str:
    head = ("instance", "runtime", "harness", "case", "ok", "status", "reward", "mask", "failure_kind", "build_s",
            "image_mb", "init_s", "running_s", "grading_s", "tests_s", "reason")
    rows = [head] + [(r.instance, r.runtime, r.harness, r.case, "yes" if r.ok else "NO", r.status, _num(r.reward),
                      str(r.mask), r.failure_kind or "-", _num(r.build_s), _num(r.image_mb), _num(r.init_s),
                      _num(r.running_s), _num(r.grading_s), _num(r.tests_s), r.reason[:60])
                     for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def run(ids: Sequence[str], *, shared: Path = SHARED, store: Path | None = None, work: Path | None = None,
        runtime: str = "sandbox", harness: str = "loop", engine: str = "simulated", cases: Sequence[str] = CASES,
        echo: bool = True) -> list[CaseResult]:
    """Every asked case of every asked instance (all eight by default); raises UserError for a mistake."""
    from polar_env.runtimes.bundle import images_root

    rows = pick(load_instances(shared), ids)
    store = store or images_root()
    work = work or Path(tempfile.mkdtemp(prefix="swe-real-rollouts-"))
    results = []
    for row in rows:
        instance = str(row["instance_id"])
        built = build_image(shared, instance, kind="docker" if runtime == "docker" else "rootfs", store=store)
        if echo:
            print(f"{instance}: image {built.image} ({built.seconds:g} s, {_num(built.disk_mb)} MB)", flush=True)
        folder = work / f"{instance}-{runtime}-{harness}"
        policies = write_inputs(row, folder, runtime=runtime, harness=harness, engine=engine)
        for case in cases:
            result = run_case(row, case, folder, policies[case], runtime=runtime, harness=harness, built=built,
                              store=store)
            results.append(result)
            built = Built(built.image, 0.0, built.disk_mb)  # built once per instance
            if echo:
                print(f"{instance} {runtime} {harness} {case}: {result.status} reward {_num(result.reward)} "
                      f"({result.wall_s:g} s) {result.reason[:100]}", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    p.add_argument("--ids", nargs="+", default=[], metavar="ID", help="instance ids (default: all eight)")
    p.add_argument("--shared", type=Path, default=SHARED, help=f"the swe-real set (default {SHARED})")
    p.add_argument("--store", type=Path, help="the image store the rootfs images go to (default: $POLAR_IMAGES or "
                   "~/.cache/polar_env/images)")
    p.add_argument("--work", type=Path, help="where tasks, configs, policies and run folders go (default: a new temp dir)")
    p.add_argument("--runtime", choices=RUNTIMES, default="sandbox")
    p.add_argument("--harness", choices=HARNESSES, default="loop")
    p.add_argument("--engine", choices=("simulated", "embedded"), default="simulated",
                   help="who plays the scripted policy: the simulated engine (no model: instant) or the embedded "
                        "CPU model forced to it (real ids and logprobs; ~20-40 ms a token, minutes for a long patch)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = p.parse_args(argv)
    try:
        results = run(args.ids, shared=args.shared, store=args.store, work=args.work, runtime=args.runtime,
                      harness=args.harness, engine=args.engine, cases=args.cases)
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
