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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_env.errors import ConfigError
from polar_env.evaluators.report import CanaryOutcome, EvalReport, RefusedOutcome
from polar_env.runtimes.base import Runtime

PLUGIN_SOURCE = Path(__file__).with_name("pytest_grader.py")
PLUGIN_MODULE = "polar_grader"
BEACON = "polar-grader-beacon"  # pytest_grader.BEACON (that file imports nothing of ours)
CANARY_WORDS = ("basic", "edge", "empty", "large", "negative", "none", "nested", "regression", "repeat", "simple",
                "small", "types", "unicode", "zero", "many", "default", "invalid", "bounds", "order", "mixed")
# swebench's TestStatus values (the log parsers' statuses)
PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"


@dataclass(slots=True)
class Reporter:
    """One staged reporter: where its report lands, its first key, its tag on the stderr beacon,
    how many canaries it was asked for, and the environment that loads it."""

    directory: str
    report: str
    key: bytes
    tag: str
    planned: int
    env: dict[str, str]


async def stage_reporter(runtime: Runtime, *, canaries: int, files: Sequence[str] = (),
                         prefer: Sequence[str] = (), prefer_same: Sequence[str] = ()) -> Reporter:
    """Stage the plugin in ``runtime`` with ``canaries`` "same" and as many "fail" copies, taken
    from the test modules in ``files`` (repo-relative) first; "fail" copies of ``prefer`` (tests
    that pass either way, PASS_TO_PASS), "same" copies of ``prefer_same`` (the tests a fix turns,
    FAIL_TO_PASS: a hook that forges only those leaves its copy failing) where they exist. The grader creates the (empty)
    report file itself: one that is gone afterwards was removed from inside the run."""
    directory = f"/tmp/polar-grader-{secrets.token_hex(16)}"
    key = secrets.token_bytes(32)
    tag = secrets.token_hex(8)
    report = posixpath.join(directory, f"report-{secrets.token_hex(8)}.jsonl")
    config = {"key": key.hex(), "report": report, "tag": tag, "seed": secrets.randbits(64), "canaries": canaries,
              "files": list(files), "prefer": list(prefer), "prefer_same": list(prefer_same), "words": list(CANARY_WORDS)}
    config_path = posixpath.join(directory, f"config-{secrets.token_hex(8)}.json")
    await runtime.write_file(posixpath.join(directory, f"{PLUGIN_MODULE}.py"), PLUGIN_SOURCE.read_bytes())
    await runtime.write_file(config_path, json.dumps(config).encode())
    await runtime.write_file(report, b"")
    env = {"PYTHONPATH": directory, "POLAR_GRADER_CONFIG": config_path,
           "PYTHONPYCACHEPREFIX": posixpath.join(directory, "pycache")}
    return Reporter(directory, report, key, tag, 2 * canaries, env)


NOT_LOADED, UNSUPPORTED, FAULT, TAMPERED, UNFINISHED, FINISHED = (
    "not_loaded", "unsupported", "grader_fault", "tampered", "unfinished", "finished")


@dataclass(slots=True)
class Verdict:
    """What the authenticated report says: per-test statuses (canaries removed; an XFAIL or SKIP
    the grader refuses already turned into FAILED), the canaries' outcomes, and evidence of two
    kinds kept apart: ``problems`` (tampering: the agent's doing) and ``faults`` (the grader's own)."""

    statuses: dict[str, str] = field(default_factory=dict)
    canaries: list[CanaryOutcome] = field(default_factory=list)
    refused: list[RefusedOutcome] = field(default_factory=list)
    loaded: dict[str, object] | None = None  # the plugin's "loaded" record
    finished: bool = False
    forged_lines: int = 0
    problems: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)

    @property
    def tampered(self) -> bool:
        return bool(self.problems)

    @property
    def state(self) -> str:
        """One word for what the run left: tampering first (positive evidence), then the grader's
        own faults, then whether pytest ran under the plugin at all and finished."""
        if self.problems:
            return TAMPERED
        if self.faults:
            return FAULT
        if self.loaded is None:
            return NOT_LOADED
        if not self.loaded.get("supported"):
            return UNSUPPORTED
        return FINISHED if self.finished else UNFINISHED

    def as_report(self) -> EvalReport:
        loaded = self.loaded or {}
        return {"results_from": "grader plugin (authenticated report)", "grader_state": self.state,
                "runner": {"pytest": loaded.get("pytest"), "python": loaded.get("python")},
                "finished": self.finished, "canaries": self.canaries, "refused_outcomes": self.refused,
                "forged_lines": self.forged_lines, "tamper_evidence": self.problems, "grader_faults": self.faults}


def _ratchet(key: bytes) -> bytes:
    return hashlib.sha256(b"polar-ratchet" + key).digest()


def _line_ok(line: bytes, key: bytes, seq: int) -> dict[str, object] | None:
    body, _, mac = line.rpartition(b"\t")
    want = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    if not body or not hmac.compare_digest(mac.strip(), want):
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("seq") == seq else None


def read_report(raw: bytes | None, key: bytes) -> tuple[list[dict[str, object]], int]:
    """(verified records in order, number of lines that did not verify). Line ``i`` must carry
    ``seq`` i under the ``i``-th key of the ratchet: a line rewritten, removed or added out of turn
    breaks the chain, and a later key cannot sign an earlier line."""
    records: list[dict[str, object]] = []
    bad = 0
    for line in (raw or b"").splitlines():
        record = _line_ok(line, key, len(records))
        if record is None:
            bad += 1
            continue
        records.append(record)
        key = _ratchet(key)
    return records, bad


def beacon_seen(output: str, reporter: Reporter) -> bool:
    """Whether the plugin's first line, printed to stderr at load, reached the grader verified."""
    prefix = f"{BEACON} {reporter.tag} "
    for line in output.splitlines():
        at = line.find(prefix)
        if at >= 0 and _line_ok(line[at + len(prefix):].encode(), reporter.key, 0) is not None:
            return True
    return False


def _key(nodeid: str) -> str:
    """pytest_grader._key: ``Class::name`` without parameters (the file part differs by version)."""
    return nodeid.partition("::")[2].replace("()::", "").split("[", 1)[0]


def _params(nodeid: str) -> str:
    return nodeid[len(nodeid.split("[", 1)[0]):]


def _passes(status: str | None) -> bool:
    return status in (PASSED, XFAIL)


def verdict(records: list[dict[str, object]], forged: int, reporter: Reporter | None = None, *,
            editable: Callable[[str], bool] = lambda _path: False, beacon: bool = False,
            report_missing: bool = False) -> Verdict:
    """The verdict of one run's verified records. ``editable(path)``: whether a repo path is one a
    fix may change (an XFAIL or SKIP raised from there is refused); ``beacon``: the first line was
    seen on stderr; ``report_missing``: the report file the grader created is gone."""
    out = Verdict(forged_lines=forged)
    phases: dict[str, list[dict[str, object]]] = {}
    plan: dict[str, Any] = {}
    finish: dict[str, object] | None = None
    for r in records:
        event = r.get("event")
        if event == "loaded":
            out.loaded = r
        elif event == "plan":
            plan = _unseal(r, reporter)
        elif event == "internal_error":
            out.faults.append(f"the grader's plugin failed in {r.get('where')}: {r.get('error')}")
        elif event == "finish":
            finish = r
        elif "nodeid" in r:
            phases.setdefault(str(r["nodeid"]), []).append(r)
    out.finished = finish is not None
    if forged:
        out.problems.append(f"{forged} report line(s) out of the authenticated chain")
    if report_missing:
        out.problems.append("the report file the grader created was removed during the run")
    elif out.loaded is None and beacon:
        out.problems.append("the plugin loaded (its first line reached stderr) but its report was emptied")
    xfail_files = set(plan.get("xfail_files") or [])
    for nodeid, reps in phases.items():
        status = _status(reps)
        raised = [r for r in reps if r.get("raised")]
        if raised:
            out.problems.append(f"{nodeid} reported passed in {raised[0]['when']} although it raised {raised[0]['raised']}")
        why = _refusal(nodeid, status, reps, xfail_files, editable)
        if why is not None:
            out.refused.append({"test": nodeid, "status": status, "why": why})
            status = FAILED
        out.statuses[nodeid] = status
    if out.finished:
        _check_canaries(out, plan, finish or {}, reporter)
    return out


def _unseal(record: dict[str, object], reporter: Reporter | None) -> dict[str, Any]:
    sealed = record.get("sealed")
    if reporter is None or not isinstance(sealed, str):
        return {}
    key = hmac.new(reporter.key, b"polar-plan", hashlib.sha256).digest()
    try:
        plan = json.loads(seal(key, bytes.fromhex(sealed)))
    except ValueError:
        return {}
    return plan if isinstance(plan, dict) else {}


def seal(key: bytes, data: bytes) -> bytes:
    """pytest_grader.seal: the plan's XOR keystream (that file imports nothing of ours)."""
    stream = b"".join(hashlib.sha256(key + i.to_bytes(8, "big")).digest() for i in range(len(data) // 32 + 1))
    return bytes(a ^ b for a, b in zip(data, stream, strict=False))


def _refusal(nodeid: str, status: str, reps: list[dict[str, Any]], xfail_files: set[str],
             editable: Callable[[str], bool]) -> str | None:
    """Why an XFAIL or SKIP does not count as the suite's own: raised from code a fix may edit, or
    an xfail mark in a test file (and conftests) that never mention xfail."""
    if status not in (XFAIL, SKIPPED):
        return None
    rep = next((r for r in reps if r.get("outcome") == "skipped"), {})
    origin = rep.get("origin")
    mark = status == XFAIL and rep.get("xfail") == "mark"  # its origin is where the test failed, not an xfail call
    if not mark and isinstance(origin, str) and origin != "<outside>" and editable(origin):
        return f"{'xfail' if status == XFAIL else 'skip'} raised from {origin}, a file a fix may edit"
    if mark and not {nodeid.split("::", 1)[0].rsplit("/", 1)[-1], "conftest.py"} & xfail_files:
        return "an xfail mark, but neither its test file nor a conftest above it mentions xfail"
    if status == XFAIL and rep.get("xfail") == "call" and not isinstance(origin, str):
        return "an imperative xfail whose origin the report does not give"
    return None


def _check_canaries(out: Verdict, plan: dict[str, Any], finish: dict[str, Any], reporter: Reporter | None) -> None:
    placed = [c for c in plan.get("placed") or [] if isinstance(c, dict)]
    wanted, candidates = int(plan.get("wanted") or 0), int(plan.get("candidates") or 0)
    if reporter is not None and wanted != reporter.planned:
        out.problems.append(f"{reporter.planned} canaries planned, the plugin's plan says {wanted}")
    if candidates and len(placed) != wanted:
        out.problems.append(f"{wanted} canaries could be placed, {len(placed)} were")
    if int(finish.get("placed", -1)) != sum(c.get("expect") == "fail" for c in placed):
        out.problems.append("the plugin's failing copies changed during the run")
    broken = {n.split("::", 1)[0].rsplit("/", 1)[-1] for n, s in out.statuses.items() if "::" not in n}
    by_key: dict[str, dict[str, str]] = {}
    for nodeid, status in out.statuses.items():
        by_key.setdefault(_key(nodeid), {})[_params(nodeid)] = status
    copies = {str(c.get("test")) for c in placed}
    out.statuses = {n: s for n, s in out.statuses.items() if _key(n) not in copies}  # the suite's own tests only
    for c in placed:
        copy, orig = str(c.get("test")), str(c.get("of"))
        got, base = by_key.get(copy, {}), by_key.get(orig, {})
        if not got and not base:
            if finish.get("stopped") or int(finish.get("exitstatus", 0)) in (2, 3, 4) or str(c.get("file")) in broken:
                continue  # the run stopped early, or the module never imported: nothing ran to compare
            ok, why = False, "never ran, nor did its original"
        elif not got:
            ok, why = False, "did not run while its original did"
        elif c.get("expect") == "fail":
            bad = [p for p, s in got.items() if _passes(s) or (s == SKIPPED and base.get(p) != SKIPPED)]
            ok, why = not bad, f"must fail, came out {[got[p] for p in bad]}"
        else:
            bad = [p for p, s in got.items() if p in base and _passes(s) != _passes(base[p])]
            ok, why = not bad, f"came out {[got[p] for p in bad]} where its original came out {[base[p] for p in bad]}"
        out.canaries.append({"test": copy, "of": orig, "expected": "fail" if c.get("expect") == "fail" else "same as original",
                             "got": got, "ok": ok})
        if not ok:
            out.problems.append(f"canary {copy} (copy of {orig}) {why}")


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


async def read_verdict(runtime: Runtime, reporter: Reporter, output: str = "", *,
                       editable: Callable[[str], bool] = lambda _path: False) -> Verdict:
    """The reporter's verdict after the run; ``output``: the run's captured output (the beacon)."""
    missing = False
    try:
        raw: bytes | None = await runtime.read_file(reporter.report)
    except FileNotFoundError:
        raw, missing = None, True
    except (OSError, ConfigError):
        raw = None
    records, forged = read_report(raw, reporter.key)
    return verdict(records, forged, reporter, editable=editable, beacon=beacon_seen(output, reporter),
                   report_missing=missing)


def synthetic_log(statuses: dict[str, str]) -> str:
    """The statuses as the short test summary ``pytest -rA`` prints, so swebench's own log parser
    maps them to the dataset's test names exactly as it would from a real log."""
    return "".join(f"{status} {nodeid}\n" for nodeid, status in statuses.items())
