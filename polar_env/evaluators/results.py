"""Test results out of band: the grader's side of ``pytest_grader.py``.

``stage_reporter`` puts the plugin and a one-use configuration (HMAC key, report path, canary plan)
in a directory under the grading runtime's ``/tmp`` named with 128 random bits, and returns the
environment that loads it. After the test run, ``read_report`` reads the report file back and keeps
only lines whose MAC verifies; ``verdict`` turns them into a status per test (the statuses
swebench's log parsers produce) and the canaries' outcomes. What a test printed is kept for people
(``log_tail``) and never graded.

What this cannot stop: code a fix may edit runs inside the test process and could, in principle,
find the key in the plugin's memory. The canaries are there for that case: rewriting outcomes
wholesale, or for tests it cannot tell from the task's own, flips a canary and the run is
``tampered``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import posixpath
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_env.errors import ConfigError
from polar_env.runtimes.base import Runtime

PLUGIN_SOURCE = Path(__file__).with_name("pytest_grader.py")
PLUGIN_MODULE = "polar_grader"
CANARY_WORDS = ("basic", "edge", "empty", "large", "negative", "none", "nested", "regression", "repeat", "simple",
                "small", "types", "unicode", "zero", "many", "default", "invalid", "bounds", "order", "mixed")
# swebench's TestStatus values (the log parsers' statuses)
PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"


@dataclass(slots=True)
class Reporter:
    """One staged reporter: where its report lands and the environment that loads it."""

    directory: str
    report: str
    key: bytes
    canaries: list[str]
    env: dict[str, str]


async def stage_reporter(runtime: Runtime, *, canaries: int, files: Sequence[str] = ()) -> Reporter:
    """Stage the plugin in ``runtime`` with ``canaries`` must-pass and as many must-fail canaries,
    preferring the test modules in ``files``."""
    directory = f"/tmp/polar-grader-{secrets.token_hex(16)}"
    key = secrets.token_bytes(32)
    report = posixpath.join(directory, f"report-{secrets.token_hex(8)}.jsonl")
    plan = ["pass", "fail"] * canaries
    secrets.SystemRandom().shuffle(plan)
    config = {"key": key.hex(), "report": report, "seed": secrets.randbits(64), "canaries": plan,
              "files": list(files), "words": list(CANARY_WORDS)}
    config_path = posixpath.join(directory, f"config-{secrets.token_hex(8)}.json")
    await runtime.write_file(posixpath.join(directory, f"{PLUGIN_MODULE}.py"), PLUGIN_SOURCE.read_bytes())
    await runtime.write_file(config_path, json.dumps(config).encode())
    env = {"PYTHONPATH": directory, "POLAR_GRADER_CONFIG": config_path,
           "PYTHONPYCACHEPREFIX": posixpath.join(directory, "pycache")}
    return Reporter(directory, report, key, plan, env)


@dataclass(slots=True)
class Verdict:
    """Per-test statuses from the authenticated report, the canaries' outcomes and what was wrong."""

    statuses: dict[str, str] = field(default_factory=dict)
    canaries: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    forged_lines: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def tampered(self) -> bool:
        return bool(self.problems)

    def as_report(self) -> dict[str, Any]:
        return {"results_from": "grader plugin (authenticated report)", "finished": self.finished,
                "canaries": self.canaries, "forged_lines": self.forged_lines, "tamper_evidence": self.problems}


def read_report(raw: bytes | None, key: bytes) -> tuple[list[dict[str, Any]], int]:
    """(verified records, number of lines that did not verify)."""
    records: list[dict[str, Any]] = []
    bad = 0
    for line in (raw or b"").splitlines():
        body, _, mac = line.rpartition(b"\t")
        want = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
        if not body or not hmac.compare_digest(mac, want):
            bad += 1
            continue
        try:
            records.append(json.loads(body))
        except ValueError:
            bad += 1
    return records, bad


def verdict(records: list[dict[str, Any]], forged: int, planned: Sequence[str]) -> Verdict:
    out = Verdict(forged_lines=forged)
    phases: dict[str, list[dict[str, Any]]] = {}
    canary_kind: dict[str, str] = {}
    collected = 0
    for r in records:
        if "finish" in r:
            out.finished = True
            canary_kind.update(r.get("canaries") or {})
            collected = max(collected, int(r.get("collected") or 0))
            continue
        phases.setdefault(r["nodeid"], []).append(r)
    for nodeid, reps in phases.items():
        out.statuses[nodeid] = _status(reps)
    if forged:
        out.problems.append(f"{forged} report line(s) without a valid MAC")
    if out.finished:
        if collected and len(canary_kind) != len(planned):
            out.problems.append(f"{len(planned)} canaries planned, {len(canary_kind)} placed")
        for nodeid, expect in sorted(canary_kind.items()):
            got = out.statuses.pop(nodeid, None)
            ok = (got == PASSED) if expect == "pass" else (got == FAILED)
            out.canaries.append({"test": nodeid, "expected": PASSED if expect == "pass" else FAILED, "got": got, "ok": ok})
            if not ok:
                out.problems.append(f"canary {nodeid} expected {expect}, got {got}")
    return out


def _status(reps: list[dict[str, Any]]) -> str:
    for r in reps:
        if r["outcome"] == "failed":
            return FAILED if r["when"] == "call" else ERROR
    call = next((r for r in reps if r["when"] == "call"), None)
    skipped = any(r["outcome"] == "skipped" for r in reps)
    if skipped:
        return XFAIL if any(r.get("xfail") for r in reps) else SKIPPED
    if call is not None and call["outcome"] == "passed":
        return PASSED
    return ERROR


async def read_verdict(runtime: Runtime, reporter: Reporter) -> Verdict:
    """The reporter's verdict after the run (an absent report reads as an unfinished run)."""
    try:
        raw: bytes | None = await runtime.read_file(reporter.report)
    except (OSError, ConfigError):
        raw = None
    records, forged = read_report(raw, reporter.key)
    return verdict(records, forged, reporter.canaries)


def synthetic_log(statuses: dict[str, str]) -> str:
    """The statuses as the short test summary ``pytest -rA`` prints, so swebench's own log parser
    maps them to the dataset's test names exactly as it would from a real log."""
    return "".join(f"{status} {nodeid}\n" for nodeid, status in statuses.items())
