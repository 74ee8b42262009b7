"""One path from an evaluation context to a fresh runtime holding the admitted change.

Every evaluator that runs the agent's code (``swebench``, ``output`` commands, ``harbor``, custom
ones through ``fresh_graded_runtime``) goes through ``graded_runtime``: the change set (the one the
node took from the agent's workspace, ``ctx.changes``; or one computed from a text patch,
``ctx.patch``; or taken now from the agent's live runtime) is admitted under the task's policy and
written into the context's fresh runtime. See ``integrity.py`` for the contract.
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvalContext, EvalResult
from polar_env.evaluators.integrity import (
    GIT_ENV,
    Graded,
    IntegrityParams,
    IntegrityPolicy,
    grade_changes,
    grading_env,
    prepare_grading_home,
    resolve_policy,
)
from polar_env.evaluators.results import PLUGIN_MODULE, Reporter, read_verdict, stage_reporter
from polar_env.evaluators.workspace import Changes, Manifest, agent_changes, changes_between, snapshot
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


async def changes_from_patch(runtime: Runtime, patch: str, base: Manifest, *,
                             timeout_s: float = 120.0) -> tuple[Changes, list[dict[str, Any]]]:
    """The change a text patch makes, read off the files: applied with SWE-bench's fallback chain in
    a scratch copy of the fresh runtime's pristine workspace (the grader's own ``.git``), then the
    copy is compared with ``base``, that workspace's manifest. ``Changes.source`` is ``"patch (does
    not apply)"`` when no method applies."""
    cap = getattr(runtime.spec, "patch_mb", None)
    if cap is not None and len(patch) > cap * 1024 * 1024:
        raise LimitExceeded("patch_mb", f"the patch is {len(patch) / 2**20:.1f} MiB, over patch_mb={cap:g}")
    workdir = runtime.spec.workdir
    scratch = f"/tmp/polar-patch-{secrets.token_hex(8)}"
    logs: list[dict[str, Any]] = []
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
                          timeout_s: float = 120.0) -> tuple[Changes, list[dict[str, Any]], Manifest | None]:
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
    """The context's fresh runtime with the admitted change written in, and what was graded."""
    runtime = await ctx.fresh_runtime()
    changes, logs, fresh = await context_changes(ctx, runtime, timeout_s=timeout_s)
    graded = await grade_changes(runtime, changes, policy, test_files=test_files, base=fresh)
    graded.apply_logs = logs
    await prepare_grading_home(runtime, policy)
    return runtime, graded


async def check_env(runtime: Runtime, policy: IntegrityPolicy, *, files: Sequence[str] = (),
                    safe_path: bool = False) -> tuple[dict[str, str], Reporter | None]:
    """The environment for a check that runs (or may run) pytest, with the grader's plugin staged:
    its report and canaries gate the reward whatever else decides it (``swebench``: the verdict
    itself; ``output`` commands, Harbor verifiers: tampering). ``files``: test modules the canaries
    prefer; ``safe_path``: see ``grading_env``."""
    workdir = runtime.spec.workdir
    if not policy.enabled:
        return grading_env(policy, workdir), None
    reporter = await stage_reporter(runtime, canaries=policy.canaries, files=files)
    env = grading_env(policy, workdir, {**reporter.env, "POLAR_GRADER_PLUGIN": PLUGIN_MODULE}, safe_path=safe_path)
    return env, reporter


async def tamper_evidence(runtime: Runtime, reporter: Reporter | None) -> dict[str, Any] | None:
    """The plugin's report fields when a pytest ran under it and its canaries or lines say the run
    was tampered with (reward 0, ``tampered``); None otherwise."""
    if reporter is None:
        return None
    found = await read_verdict(runtime, reporter)
    return {**found.as_report(), "tampered": True} if found.tampered else None


def broken_result(graded: Graded, report: dict[str, Any]) -> EvalResult | None:
    """Reward 0, unmasked, when the agent left nothing the grader can take or apply."""
    if graded.broken is not None:
        return EvalResult(reward=0.0, report={**report, "resolved": False, "reason": graded.broken})
    if graded.changes.source == "patch (does not apply)":
        return EvalResult(reward=0.0, report={**report, "resolved": False, "reason": "patch does not apply",
                                              "apply_logs": graded.apply_logs})
    return None


async def fresh_graded_runtime(
    ctx: EvalContext, *, integrity: IntegrityParams | Mapping[str, Any] | str | None = None,
    test_files: Sequence[str] = (), timeout_s: float = 120.0, default_policy: str = "allowlist",
) -> tuple[Runtime, Graded, dict[str, str]]:
    """For custom evaluators: the context's fresh runtime holding the admitted change, the
    ``Graded`` record (``.as_report()`` goes into the report) and the environment to run checks
    under. ``integrity`` defaults to ``ctx.params["integrity"]``. Raises ``ConfigError`` when the
    agent's workspace could not be taken or its patch does not apply (grade that 0)."""
    policy = resolve_policy(integrity if integrity is not None else ctx.params.get("integrity"), default=default_policy)
    runtime, graded = await graded_runtime(ctx, policy, test_files=test_files, timeout_s=timeout_s)
    problem = broken_result(graded, {})
    if problem is not None:
        raise ConfigError(f"nothing to grade: {problem.report['reason']}")
    return runtime, graded, grading_env(policy, runtime.spec.workdir)
