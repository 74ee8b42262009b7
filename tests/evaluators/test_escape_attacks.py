"""The agent's breakage is the agent's: a change that breaks the grader's plumbing instead of fixing
the bug (``ESCAPE_ATTACKS`` in ``attacks.py``) → reward 0, not masked, with a named reason, never a
masked ``evaluator_error`` or ``node_lost`` (a dropped sample, which an adversary prefers to a 0);
a limit the grading runtime hits is ``limit_exceeded``. The gold fix → 1 and a no-op → 0 in the same
run. The session cases are real shell commands of the ``loop`` harness in real bubblewrap sessions
graded by the real ``swebench`` evaluator (the policy is a test double, as in
``test_attack_classes.py``); the rules, the fault classification and the outcome writer are also
tested on their own, with no sandbox.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_env.evaluators import EvalContext, EvalResult, FunctionEvaluator, NothingToGrade, run_evaluator
from polar_env.evaluators.grading import broken_result, graded_runtime
from polar_env.evaluators.integrity import (
    BAD_NAME,
    INSIDE_BASE_FILE,
    INSIDE_DROPPED,
    admit,
    agent_fault,
    grade_changes,
    resolve_policy,
    rule_for,
)
from polar_env.evaluators.workspace import Change, Changes, Entry, WorkspaceBroken
from polar_env.journal.store import JournalStore
from polar_env.records import Status, Trajectory
from polar_env.runtimes.base import ExecResult, RuntimeSpec
from polar_env.runtimes.limits import LimitExceeded
from polar_env.safetext import bad_name, json_safe, shown
from polar_env.trajectory.outcome import with_outcome
from tests.conftest import require_bwrap, require_swebench
from tests.evaluators.attacks import ESCAPE_ATTACKS, NOOP_COMMAND, gold_command, run_attacks

XFF = "calc_\udcff.py"  # the name b"calc_\xff.py" as Python reads it (surrogateescape)
# what each session case must end as: (failure kind, {dropped path: rule})
REPLACED = "a file replaced by a directory"
EXPECTED: dict[str, tuple[str | None, dict[str, str]]] = {
    "dir_replaces_file": (None, {"calc.py": REPLACED, "calc.py/__init__.py": INSIDE_BASE_FILE}),
    "dir_replaces_file_nested": (None, {"calc.py": REPLACED, "calc.py/deep/helpers.py": INSIDE_BASE_FILE,
                                        "calc.py/notes.txt": INSIDE_BASE_FILE}),
    "non_utf8_name": (None, {"calc_\\xff.py": BAD_NAME}),
    "non_utf8_dir": (None, {"pkg\\xff/mod.py": BAD_NAME}),
    "newline_name": (None, {"notes\\nfix.py": BAD_NAME}),
    "grading_disk_limit": ("limit_exceeded", {}),
}


# -- real sessions ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    require_bwrap()
    require_swebench()
    tmp = tmp_path_factory.mktemp("escape_attacks")
    return tmp, run_attacks(tmp, ESCAPE_ATTACKS, extra=[("gold_fix", gold_command(), {}), ("noop", NOOP_COMMAND, {})])


def _summary(r: Any) -> dict[str, Any]:
    ev = r.evaluation
    return {"status": r.status.value, "reward": r.reward, "mask": r.mask, "failure_kind": r.failure_kind,
            "failure_detail": r.failure_detail, "reason": ev.get("reason"), "dropped": ev.get("dropped_paths"),
            "error": ev.get("error")}


def test_every_escape_attack_has_its_expectation() -> None:
    assert {a.name for a in ESCAPE_ATTACKS} == set(EXPECTED)
    for a in ESCAPE_ATTACKS:
        assert set(a.expect_dropped) == set(EXPECTED[a.name][1]), a.name


@pytest.mark.slow
@pytest.mark.parametrize("attack", ESCAPE_ATTACKS, ids=[a.name for a in ESCAPE_ATTACKS])
def test_escape_scores_zero_unmasked_with_its_reason(run: tuple[Path, dict[str, Any]], attack: Any) -> None:
    r = run[1][attack.name]
    kind, rules = EXPECTED[attack.name]
    assert r.reward == 0.0 and r.mask is False and r.failure_kind == kind, (attack.name, attack.note, _summary(r))
    dropped = {d["path"]: d["rule"] for d in r.evaluation.get("dropped_paths", [])}
    assert {p: dropped.get(p) for p in rules} == rules, _summary(r)
    if kind is None:
        assert r.status.value == "completed" and r.evaluation["status"] == "completed", _summary(r)
        assert r.evaluation["graded_paths"] == [] and r.evaluation["reason"] == "no admitted change", _summary(r)
    r.trajectory.to_json()  # the trajectory's writers take it


@pytest.mark.slow
def test_a_limit_hit_while_grading_is_limit_exceeded(run: tuple[Path, dict[str, Any]]) -> None:
    r = run[1]["grading_disk_limit"]
    assert r.status.value == "error" and r.failure_kind == "limit_exceeded", _summary(r)
    assert r.evaluation["limit"] == "disk_mb" and "disk_mb=64" in (r.failure_detail or ""), _summary(r)
    assert r.evaluation["graded_paths"] == ["calc.py"]  # the change reached the grader; the limit hit there
    assert r.limits["hit"] is None  # the agent's own runtime never imported calc.py


@pytest.mark.slow
def test_an_undecodable_name_reaches_the_outcome_file_escaped(run: tuple[Path, dict[str, Any]]) -> None:
    tmp, results = run
    for name, shown_path in (("non_utf8_name", "calc_\\xff.py"), ("non_utf8_dir", "pkg\\xff/mod.py")):
        [path] = (tmp / "store").rglob(f"{results[name].session_id}.result.json")
        outcome = orjson.loads(path.read_bytes())
        assert outcome["failure_kind"] is None and outcome["reward"] == 0.0
        assert outcome["evaluation"]["dropped_paths"] == [{"path": shown_path, "rule": BAD_NAME}]


@pytest.mark.slow
def test_gold_fix_scores_one_and_noop_zero(run: tuple[Path, dict[str, Any]]) -> None:
    gold, noop = run[1]["gold_fix"], run[1]["noop"]
    assert gold.status.value == "completed" and gold.reward == 1.0 and gold.mask is False, _summary(gold)
    assert noop.reward == 0.0 and noop.mask is False and noop.failure_kind is None, _summary(noop)


# -- the rules on their own ------------------------------------------------------------------------------


def _file(mode: int = 0o644) -> Entry:
    return Entry("file", mode, 1, "d")


DIR = Entry("dir", 0o755, 0)
BASE = {"calc.py": _file(), "lib": Entry("link", 0, 3, "t"), "pkg": DIR, "pkg/__init__.py": _file(),
        "pkg/core.py": _file(), "data": DIR, "data/table.csv": _file()}


def _new(path: str) -> Change:
    return Change(path, _file(), BASE.get(path), b"x = 1\n")


def test_a_path_under_a_base_file_or_a_dropped_path_is_dropped() -> None:
    items = [
        Change("calc.py", DIR, BASE["calc.py"]),  # a base file replaced by a directory ...
        _new("calc.py/__init__.py"), _new("calc.py/deep/helpers.py"),  # ... holding new files
        _new("lib/x.py"),  # under a base symlink (replaced by a directory)
        Change("pkg", _file(), DIR, b"x\n"),  # a base directory replaced by a file ...
        Change("pkg/core.py", None, BASE["pkg/core.py"]),  # ... and its files' deletions
        Change("pkg/__init__.py", None, BASE["pkg/__init__.py"]),
        Change("data/table.csv", _file(), BASE["data/table.csv"], b"a,b\n"),  # a plain edit: kept
        _new("pkg2/__init__.py"),  # a new package beside it: kept
    ]
    want = {"calc.py": REPLACED, "calc.py/__init__.py": INSIDE_BASE_FILE, "calc.py/deep/helpers.py": INSIDE_BASE_FILE,
            "lib/x.py": INSIDE_BASE_FILE, "pkg": "replaces a symlink, directory or special file of the base",
            "pkg/core.py": INSIDE_DROPPED, "pkg/__init__.py": INSIDE_DROPPED}
    for policy in ("allowlist", "allowlist-workspace", "off"):
        for order in (items, items[::-1]):  # whatever order the change set comes in
            out = admit(Changes(order), resolve_policy(policy), BASE, reserved=frozenset({"json"}))
            assert {d.path: d.rule for d in out.dropped} == want, (policy, out.dropped)
            assert sorted(c.path for c in out.kept) == ["data/table.csv", "pkg2/__init__.py"]
    # rule_for alone sees the base; what lies under a dropped path needs the dropped set
    assert rule_for(_new("calc.py/__init__.py"), resolve_policy(), BASE) == INSIDE_BASE_FILE
    deletion = Change("pkg/core.py", None, BASE["pkg/core.py"])
    assert rule_for(deletion, resolve_policy(), BASE) is None
    assert rule_for(deletion, resolve_policy(), BASE, dropped={"pkg"}) == INSIDE_DROPPED


BAD = {XFF: "calc_\\xff.py", "pkg\udcff/mod.py": "pkg\\xff/mod.py", "notes\nfix.py": "notes\\nfix.py",
       "a\tb.py": "a\\tb.py", "a\rb.txt": "a\\rb.txt", "a\x7fb.py": "a\\x7fb.py", "a\x85b.py": "a\\x85b.py",
       "bell\x07.md": "bell\\x07.md", "back\\slash\udcfe.py": "back\\\\slash\\xfe.py", "lone\ud800.py": "lone\\ud800.py"}


def test_a_name_that_is_not_utf8_text_is_dropped_and_listed_escaped() -> None:
    items = [_new(p) for p in BAD] + [_new("pkg/café.py"), _new("pkg/naïve_ü.json")]
    for policy in ("allowlist", "allowlist-workspace", "off"):
        out = admit(Changes(items), resolve_policy(policy), BASE, reserved=frozenset())
        assert {d.path: d.rule for d in out.dropped} == dict.fromkeys(BAD.values(), BAD_NAME), policy
        assert [c.path for c in out.kept] == ["pkg/café.py", "pkg/naïve_ü.json"]
        orjson.dumps([d.as_dict() for d in out.dropped])  # valid UTF-8 text, every one
    # a widened allow-list does not lift it
    assert rule_for(_new(XFF), resolve_policy({"allow": ["*"]}), BASE) == BAD_NAME
    assert not bad_name("pkg/café.py") and all(bad_name(p) for p in BAD)
    assert [shown(p) for p in BAD] == list(BAD.values())
    assert len({shown(p) for p in [*BAD, "calc_\\xff.py"]}) == len(BAD) + 1  # a literal backslash shows doubled


async def test_an_undecodable_name_is_never_read() -> None:
    from polar_env.evaluators.workspace import changes_between

    class Reads:
        spec = RuntimeSpec()
        asked: list[str] = []

        async def read_file(self, path: str) -> bytes:
            self.asked.append(path)
            return b"x\n"

    rt = Reads()
    after = {**BASE, XFF: _file(), "ok.py": _file()}
    got = await changes_between(rt, BASE, after)  # type: ignore[arg-type]
    assert [(c.path, c.data) for c in got.items] == [("calc_\udcff.py", None), ("ok.py", b"x\n")]
    assert rt.asked == ["/testbed/ok.py"]


async def test_a_file_over_the_read_cap_is_named_as_the_limit() -> None:
    from polar_env.evaluators.workspace import changes_between

    class Capped:
        spec = RuntimeSpec()

        async def read_file(self, path: str) -> bytes:
            raise LimitExceeded("patch_mb", f"{path} is over 32 MiB")

    with pytest.raises(LimitExceeded, match="patch_mb"):  # not a WorkspaceBroken: the session names the limit
        await changes_between(Capped(), BASE, {**BASE, "big.txt": _file()})  # type: ignore[arg-type]


# -- the fault classification ----------------------------------------------------------------------------


class FakeRuntime:
    """TEST DOUBLE of a fresh grading runtime: ``write_file`` raises ``fails``; an exec trips
    ``trips`` (as a full sized tmpfs trips disk_mb on the next check)."""

    def __init__(self, fails: BaseException | None = None, trips: str | None = None) -> None:
        self.spec = RuntimeSpec()
        self.fails, self.trips = fails, trips
        self.limit_hit: str | None = None
        self.written: list[str] = []
        self.stopped = False

    async def prepare(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True

    async def walk_tree(self, inside: str, digests: bool) -> list[tuple[str, str, int, int, str | None]]:
        return [("calc.py", "file", 0o644, 1, "d")]

    async def exec(self, command: Any, **kw: Any) -> ExecResult:
        if self.trips is not None:
            self.limit_hit = self.trips
        return ExecResult(0, "", False, 0.0, limit=self.limit_hit)

    async def read_file(self, path: str) -> bytes:
        return b"old\n"

    async def write_file(self, path: str, data: bytes) -> None:
        if self.fails is not None:
            raise self.fails
        self.written.append(path)


EDIT = Changes([Change("calc.py", _file(), _file(), b"new\n")])
DISK = "disk_mb=64 (tmpfs size=64m): filesystem full: 64 of 64 MiB"


@pytest.mark.parametrize(("exc", "trips", "limit"), [
    (FileExistsError(errno.EEXIST, "File exists"), None, None),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), None, None),
    (OSError(errno.ENAMETOOLONG, "File name too long"), None, None),
    (UnicodeEncodeError("utf-8", XFF, 5, 6, "surrogates not allowed"), None, None),
    (OSError(errno.ENOSPC, "No space left on device"), DISK, "disk_mb"),
    (LimitExceeded("patch_mb", "the agent changed over 1 MiB of files"), None, "patch_mb"),
    (WorkspaceBroken("the grader cannot take the workspace: too many entries"), None, None),
])
async def test_the_changes_own_failure_is_graded_zero(exc: Exception, trips: str | None, limit: str | None) -> None:
    rt = FakeRuntime(exc, trips)
    graded = await grade_changes(rt, EDIT, resolve_policy(), base={"calc.py": _file()})  # type: ignore[arg-type]
    assert graded.fault is not None and graded.fault.limit == limit and graded.broken == graded.fault.reason
    assert (graded.as_report().get("limit"), [c.path for c in graded.kept]) == (limit, ["calc.py"])
    result = broken_result(graded, graded.as_report())
    assert result is not None and result.reward == 0.0 and result.status is Status.COMPLETED
    assert result.report["reason"] == graded.fault.reason and result.report.get("limit") == limit


@pytest.mark.parametrize("exc", [
    PermissionError(errno.EACCES, "Permission denied"),
    OSError(errno.EIO, "Input/output error"),
    OSError(errno.EROFS, "Read-only file system"),
    OSError(errno.ENOSPC, "No space left on device"),  # with no disk limit hit: the host's disk
    RuntimeError("docker: the container is gone"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
])
async def test_the_grading_runtimes_own_failure_is_raised(exc: Exception) -> None:
    rt = FakeRuntime(exc)
    with pytest.raises(type(exc)):
        await grade_changes(rt, EDIT, resolve_policy(), base={"calc.py": _file()})  # type: ignore[arg-type]
    assert await agent_fault(rt, exc) is None  # type: ignore[arg-type]


async def test_a_limit_the_grading_runtime_reports_makes_any_failure_the_changes() -> None:
    rt = FakeRuntime()
    rt.limit_hit = DISK
    fault = await agent_fault(rt, RuntimeError("cannot delete admitted paths"))  # type: ignore[arg-type]
    assert fault is not None and fault.limit == "disk_mb" and DISK in fault.reason


async def test_graded_runtime_grades_a_patch_over_patch_mb_zero_and_a_dead_runtime_raises() -> None:
    rt = FakeRuntime()
    rt.spec = RuntimeSpec(patch_mb=0.001)
    ctx = EvalContext(task={}, patch="x" * 4096, runtime_factory=lambda: rt)
    _, graded = await graded_runtime(ctx, resolve_policy())
    assert graded.fault is not None and graded.fault.limit == "patch_mb" and graded.changes.source == "patch"
    assert graded.as_report()["limit"] == "patch_mb"

    class Dead(FakeRuntime):
        async def prepare(self) -> None:
            raise RuntimeError("the runtime cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        await graded_runtime(EvalContext(task={}, changes=EDIT, runtime_factory=Dead), resolve_policy())


# -- run_evaluator: the last line ---------------------------------------------------------------------------


async def test_run_evaluator_names_a_limit_the_fresh_runtime_hit() -> None:
    rt = FakeRuntime(trips=DISK)

    async def grade(ctx: EvalContext) -> EvalResult:
        fresh = await ctx.fresh_runtime()
        await fresh.exec("python -m pytest")  # the agent's code fills the disk here
        return EvalResult(status=Status.ERROR, report={"error": "the report file is empty"})

    result = await run_evaluator(FunctionEvaluator("grade", grade), EvalContext(task={}, runtime_factory=lambda: rt))
    assert result.status is Status.COMPLETED and result.reward == 0.0, result.report
    assert result.report["limit"] == "disk_mb" and DISK in result.report["reason"]
    assert result.report["verdict_before_limit"]["status"] == "error" and rt.stopped


@pytest.mark.parametrize(("exc", "limit"), [
    (NothingToGrade({"resolved": False, "reason": "the grader cannot read x.py"}), None),
    (WorkspaceBroken("the grader cannot take the workspace: unreadable directory src"), None),
    (LimitExceeded("patch_mb", "the diff is 40.0 MiB, over patch_mb=32"), "patch_mb"),
])
async def test_run_evaluator_grades_the_agents_breakage_zero(exc: Exception, limit: str | None) -> None:
    async def grade(ctx: EvalContext) -> EvalResult:
        raise exc

    result = await run_evaluator(FunctionEvaluator("grade", grade), EvalContext(task={}))
    assert result.status is Status.COMPLETED and result.reward == 0.0 and result.report.get("limit") == limit
    assert result.report["reason"] and "error" not in result.report


async def test_run_evaluator_escapes_an_undecodable_name_in_its_report() -> None:
    async def grade(ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=0.0, report={"reason": f"cannot read {XFF}", "paths": {XFF: [XFF]}})

    result = await run_evaluator(FunctionEvaluator("grade", grade), EvalContext(task={}))
    assert result.report["reason"] == "cannot read calc_\\xff.py"
    assert result.report["paths"] == {"calc_\\xff.py": ["calc_\\xff.py"]}
    orjson.dumps(result.report)


# -- the outcome writers -----------------------------------------------------------------------------------


class Named:
    def __str__(self) -> str:
        return f"Named({XFF})"


def test_the_outcome_writer_escapes_a_surrogate_name(tmp_path: Path) -> None:
    outcome = {"session_id": "s-1", "reward": 0.0, "status": "completed", "failure_detail": f"cannot read {XFF}",
               "evaluation": {"dropped_paths": [{"path": XFF, "rule": BAD_NAME}], XFF: 1, "obj": Named()}}
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(outcome, default=str)  # what the writer met
    store = JournalStore(tmp_path)
    store.write_outcome("s-1", outcome)
    back = store.read_outcome("s-1")
    assert back is not None and back["evaluation"]["dropped_paths"] == [{"path": "calc_\\xff.py", "rule": BAD_NAME}]
    assert back["evaluation"]["calc_\\xff.py"] == 1 and back["evaluation"]["obj"] == "Named(calc_\\xff.py)"
    assert back["failure_detail"] == "cannot read calc_\\xff.py"
    # a clean outcome is written as it is
    store.write_outcome("s-2", {"reward": 1.0, "evaluation": {"reason": "ok"}})
    assert store.read_outcome("s-2") == {"reward": 1.0, "evaluation": {"reason": "ok"}}
    # and the trajectory the outcome goes on
    traj = with_outcome(Trajectory(session_id="s-1", traces=[]), {k: v for k, v in outcome.items() if k != "evaluation"}
                        | {"evaluation": {"dropped_paths": [{"path": XFF}]}})
    assert b"calc_\\\\xff.py" in traj.to_json()


def test_json_safe_keeps_a_clean_value_as_it_is() -> None:
    clean = {"a": ["b", ("c", 1)], "d": {"e": None}}
    assert json_safe(clean) is clean
    dirty = {"a": ["b", (XFF, 1)]}
    assert json_safe(dirty) == {"a": ["b", ("calc_\\xff.py", 1)]} and dirty["a"][1][0] == XFF  # type: ignore[index]
