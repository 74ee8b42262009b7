"""One path from an evaluation context to a fresh runtime holding the admitted change.

Every evaluator that runs the agent's code (``swebench``, ``output`` commands, ``harbor``, custom
ones through ``fresh_graded_runtime``) goes through ``graded_runtime``: the change set (the one the
node took from the agent's workspace, ``ctx.changes``; or one computed from a text patch,
``ctx.patch``; or taken now from the agent's live runtime) is admitted under the task's policy and
written into the context's fresh runtime. See ``integrity.py`` for the contract.

The agent's breakage is the agent's: what goes wrong while its change is taken, admitted or
written because of that change (``integrity.agent_fault``) is a ``Graded`` with nothing to grade,
which every evaluator turns into reward 0, unmasked (``broken_result``); a failure of the grading
runtime itself (it cannot start, its exec fails) is raised, an ``evaluator_error``, masked.
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
from collections.abc import Mapping, Sequence

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvalContext, EvalResult
from polar_env.evaluators.integrity import (
    GIT_ENV,
    Graded,
    IntegrityParams,
    IntegrityPolicy,
    agent_fault,
    grade_changes,
    grading_env,
    in_test_location,
    prepare_grading_home,
    resolve_policy,
)
from polar_env.evaluators.report import ApplyLog, EvalReport
from polar_env.evaluators.results import (
    ERROR,
    FAILED,
    FAULT,
    NOT_LOADED,
    PLUGIN_MODULE,
    TAMPERED,
    UNFINISHED,
    Reporter,
    Verdict,
    read_verdict,
    stage_reporter,
)
from polar_env.evaluators.workspace import Changes, Manifest, agent_changes, changes_between, snapshot
from polar_env.records import Status
from polar_env.runtimes.base import Runtime
from polar_env.runtimes.limits import LimitExceeded

# The SWE-bench harness's order: strict first, then three-way merge, then partial hunks, then fuzz.
APPLY_COMMANDS = (
    "git apply --verbose {patch}",
    "git apply --verbose --3way {patch}",
    "git apply --verbose --reject {patch}",
    "patch --batch --forward --fuzz=5 -p1 -i {patch}",
)
RESET_COMMAND = "git reset -q && git checkout -- . && git clean -fdq"
PATCH_FILE = ".git/polar_model.patch"


class NothingToGrade(ConfigError):
    """``fresh_graded_runtime``: the agent left nothing the grader can take or write (``report``: the
    reward-0 report). ``run_evaluator`` grades one that escapes a custom evaluator 0, unmasked."""

    def __init__(self, report: EvalReport) -> None:
        super().__init__(f"nothing to grade: {report.get('reason')}")
        self.report = report


async def changes_from_patch(runtime: Runtime, patch: str, base: Manifest, *,
                             timeout_s: float = 120.0) -> tuple[Changes, list[ApplyLog]]:
    """The change a text patch makes, read off the files: applied with SWE-bench's fallback chain in
    a scratch copy of the fresh runtime's pristine workspace (the grader's own ``.git``), then the
    copy is compared with ``base``, that workspace's manifest. ``Changes.source`` is ``"patch (does
    not apply)"`` when no method applies."""
    cap = getattr(runtime.spec, "patch_mb", None)
    if cap is not None and len(patch) > cap * 1024 * 1024:
        raise LimitExceeded("patch_mb", f"the patch is {len(patch) / 2**20:.1f} MiB, over patch_mb={cap:g}")
    workdir = runtime.spec.workdir
    scratch = f"/tmp/polar-patch-{secrets.token_hex(8)}"
    logs: list[ApplyLog] = []
    copy = await runtime.exec(f"cp -a {shlex.quote(workdir)} {scratch}", cwd="/", timeout_s=timeout_s)
    if copy.exit_code != 0:
        raise RuntimeError(f"cannot copy the grading workspace: {copy.output[-2000:]}")
    try:
        body = patch if patch.endswith("\n") else patch + "\n"
        await runtime.write_file(posixpath.join(scratch, PATCH_FILE), body.encode())
        applied = None
        for template in APPLY_COMMANDS:
            command = template.format(patch=PATCH_FILE)
            res = await runtime.exec(command, env=GIT_ENV, cwd=scratch, timeout_s=timeout_s)
            logs.append({"command": command, "exit_code": res.exit_code, "timed_out": res.timed_out,
                         "output": res.output[-4000:]})
            if res.exit_code == 0 and not res.timed_out:
                applied = template.replace(" -i {patch}", "").replace(" {patch}", "")
                break
            reset = await runtime.exec(RESET_COMMAND, env=GIT_ENV, cwd=scratch, timeout_s=timeout_s)
            if reset.exit_code != 0:
                raise RuntimeError(f"cannot reset the scratch copy after a failed apply: {reset.output[-2000:]}")
        if applied is None:
            return Changes(source="patch (does not apply)"), logs
        changes = await changes_between(runtime, base, await snapshot(runtime, scratch), root=scratch)
        changes.source = f"patch ({applied})"
        return changes, logs
    finally:
        await runtime.exec(f"rm -rf {scratch}", cwd="/", timeout_s=timeout_s)


async def context_changes(ctx: EvalContext, runtime: Runtime, *,
                          timeout_s: float = 120.0) -> tuple[Changes, list[ApplyLog], Manifest | None]:
    """The change set to grade (the node's, a text patch's, or the agent runtime's now), the apply
    logs, and the fresh ``runtime``'s manifest when it took one (admission reuses it)."""
    if ctx.changes is not None:
        return ctx.changes, [], None
    if ctx.patch is not None and not ctx.patch.strip():
        return Changes(source="patch"), [], None
    if ctx.patch is None and ctx.runtime is None:
        return Changes(source="none"), [], None
    if ctx.patch is None and ctx.runtime is not None and ctx.base is not None:
        return await agent_changes(ctx.runtime, ctx.base), [], None
    fresh = await snapshot(runtime)
    if ctx.patch is not None:
        return *(await changes_from_patch(runtime, ctx.patch, fresh, timeout_s=timeout_s)), fresh
    assert ctx.runtime is not None
    return await agent_changes(ctx.runtime, fresh), [], fresh


async def graded_runtime(ctx: EvalContext, policy: IntegrityPolicy, *, test_files: Sequence[str] = (),
                         timeout_s: float = 120.0) -> tuple[Runtime, Graded]:
    """The context's fresh runtime with the admitted change written in, and what was graded. A
    fresh runtime that cannot start raises (masked); a change that cannot be taken or written by
    its own doing (``integrity.agent_fault``) comes back as ``Graded.fault`` (reward 0, unmasked;
    ``limit_exceeded`` when it went over a limit); any other failure raises."""
    runtime = await ctx.fresh_runtime()
    try:
        changes, logs, fresh = await context_changes(ctx, runtime, timeout_s=timeout_s)
    except Exception as exc:
        fault = await agent_fault(runtime, exc)
        if fault is None:
            raise
        graded = Graded(policy, Changes(source="patch" if ctx.patch is not None else "snapshot"), fault=fault)
    else:
        graded = await grade_changes(runtime, changes, policy, test_files=test_files, base=fresh)
        graded.apply_logs = logs
    await prepare_grading_home(runtime, policy)
    return runtime, graded


async def check_env(runtime: Runtime, policy: IntegrityPolicy, *, files: Sequence[str] = (), prefer: Sequence[str] = (),
                    prefer_same: Sequence[str] = (), safe_path: bool = False) -> tuple[dict[str, str], Reporter | None]:
    """The environment for a check that runs (or may run) pytest, with the grader's plugin staged:
    its report and canaries gate the reward whatever else decides it (``swebench``: the verdict
    itself; ``output`` commands, Harbor verifiers: see ``pytest_gate``). ``files``: test modules
    the canaries are copied from first, ``prefer``/``prefer_same``: see ``stage_reporter``;
    ``safe_path``: see ``grading_env``."""
    workdir = runtime.spec.workdir
    if not policy.enabled:
        return grading_env(policy, workdir), None
    reporter = await stage_reporter(runtime, canaries=policy.canaries, files=files, prefer=prefer, prefer_same=prefer_same)
    env = grading_env(policy, workdir, {**reporter.env, "POLAR_GRADER_PLUGIN": PLUGIN_MODULE}, safe_path=safe_path)
    return env, reporter


async def pytest_verdict(runtime: Runtime, reporter: Reporter | None, output: str, *,
                         test_files: Sequence[str] = ()) -> Verdict | None:
    """The plugin's verdict on the run (None when none was staged). An XFAIL or SKIP raised from a
    file a fix may edit (not a test location) is refused there."""
    if reporter is None:
        return None
    return await read_verdict(runtime, reporter, output, editable=lambda path: not in_test_location(path, test_files))


def failing_tests(found: Verdict | None) -> list[str]:
    """The suite's own tests that failed in a finished pytest run under the plugin (canaries aside):
    a check that passes anyway (an exit status or reward forced from inside the run) is 0."""
    if found is None or not found.finished:
        return []
    return [n for n, s in found.statuses.items() if s in (FAILED, ERROR)]


def pytest_gate(found: Verdict | None, report: EvalReport, *, refuse: bool = True) -> EvalResult | None:
    """The result a pytest run under the plugin forces, or None when the check decides (and the
    report has the plugin's fields). Tampering is 0; the grader's own fault is an ERROR (masked,
    never the agent's); a session that never finished (``os._exit`` from project code, a killed
    process) is 0; with ``refuse``, so is an outcome the grader refused (checks whose pass rule is
    an exit status or a reward file: ``output``, ``harbor``; ``swebench`` grades a refused outcome
    as the failure it is). No pytest under the plugin (the check runs none) leaves it to the check."""
    if found is None or found.state == NOT_LOADED:
        return None
    report.update(found.as_report())
    if found.state == TAMPERED:
        report["tampered"] = True
        return EvalResult(reward=0.0, report={**report, "reason": "tampered: " + "; ".join(found.problems[:5])})
    if found.state == FAULT:
        return EvalResult(status=Status.ERROR, report={**report, "error": "; ".join(found.faults[:3])})
    if found.state == UNFINISHED:
        return EvalResult(reward=0.0, report={**report, "reason": "pytest ran under the grader's plugin and its session "
                                              "never finished (the process ended or was killed mid-run)"})
    if refuse and found.refused:
        why = "; ".join(f"{r['test']}: {r['why']}" for r in found.refused[:3])
        return EvalResult(reward=0.0, report={**report, "reason": f"outcomes the grader refuses: {why}"})
    return None


def broken_result(graded: Graded, report: EvalReport) -> EvalResult | None:
    """Reward 0, unmasked, when the agent left nothing the grader can take or apply; ``tampered`` when
    the static scan found what the change adds to reach into the test process."""
    if graded.broken is not None:
        return EvalResult(reward=0.0, report={**report, "resolved": False, "reason": graded.broken})
    if graded.changes.source == "patch (does not apply)":
        return EvalResult(reward=0.0, report={**report, "resolved": False, "reason": "patch does not apply",
                                              "apply_logs": graded.apply_logs})
    if graded.findings:  # positive evidence, found before anything runs
        shown = "; ".join(f"{f.path}:{f.line} {f.rule} ({f.detail})" for f in graded.findings[:5])
        return EvalResult(reward=0.0, report={**report, "resolved": False, "tampered": True,
                                              "scan_findings": [f.as_dict() for f in graded.findings[:50]],
                                              "reason": f"tampered: the change adds what reaches into the test run: {shown}"})
    return None


async def fresh_graded_runtime(
    ctx: EvalContext, *, integrity: IntegrityParams | Mapping[str, object] | str | None = None,
    test_files: Sequence[str] = (), timeout_s: float = 120.0, default_policy: str = "allowlist",
) -> tuple[Runtime, Graded, dict[str, str]]:
    """For custom evaluators: the context's fresh runtime holding the admitted change, the
    ``Graded`` record (``.as_report()`` goes into the report) and the environment to run checks
    under. ``integrity`` defaults to ``ctx.params["integrity"]``. Raises ``NothingToGrade`` (a
    ``ConfigError``) when the agent's change could not be taken or written or its patch does not
    apply: grade that 0 (``run_evaluator`` does, when it is not caught)."""
    policy = resolve_policy(integrity if integrity is not None else ctx.params.get("integrity"), default=default_policy)
    runtime, graded = await graded_runtime(ctx, policy, test_files=test_files, timeout_s=timeout_s)
    problem = broken_result(graded, graded.as_report())
    if problem is not None:
        raise NothingToGrade(problem.report)
    return runtime, graded, grading_env(policy, runtime.spec.workdir)
