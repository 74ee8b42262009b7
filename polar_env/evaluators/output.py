"""``output``: check the final answer, a workspace file, or a command's exit code.

Exactly one check per spec: ``regex`` (``re.search``), ``exact`` (string equality), ``json``
(``{"path": "a.b.0", "equals": value}`` on the answer or file parsed as JSON) or ``command`` (passes
on ``exit_code``). ``file`` reads a workspace file instead of the final answer. A failed check is
reward 0 with the reason.

``command`` runs in a fresh runtime: the task's pristine base plus the agent's change admitted by
the grading contract (``integrity.py``), under the policy's hermetic interpreter environment, so
nothing the agent planted in its own ``$HOME``, ``/tmp`` or site directories runs, and a workspace it
broke is 0. ``refresh_runtime: false`` (the agent's own runtime) is outside the contract and must say
so: ``integrity: {policy: off}``.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvalContext, EvalResult
from polar_env.evaluators.grading import broken_result, check_env, failing_tests, graded_runtime, pytest_gate, pytest_verdict
from polar_env.evaluators.integrity import WORKSPACE_POLICY, IntegrityParams, grading_env, resolve_policy
from polar_env.evaluators.report import EvalReport
from polar_env.records import Status

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)
_MISSING = object()
OUTPUT_TAIL_CHARS = 4000  # enough to see why a command failed without bloating the record


class JsonCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = ""  # dotted; integer parts index lists; "" is the whole document
    equals: Any


class OutputCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str | None = None  # relative to the runtime's workdir, or absolute
    regex: str | None = None
    exact: str | None = None
    json_: JsonCheck | None = None
    command: str | None = None
    exit_code: int = 0
    ignore_case: bool = False
    strip: bool = True  # exact: compare with surrounding whitespace stripped
    timeout_s: float = 60.0
    refresh_runtime: bool | None = None  # default: True for command, False for the others
    integrity: IntegrityParams = IntegrityParams()  # default policy: allowlist-workspace (the workspace is the deliverable)

    @property
    def fresh(self) -> bool:
        return self.refresh_runtime if self.refresh_runtime is not None else self.command is not None

    @model_validator(mode="before")
    @classmethod
    def _json_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "json" in data:
            data = {**data, "json_": data["json"]}
            del data["json"]
        return data

    @model_validator(mode="after")
    def _one_mode(self) -> Self:
        modes = [m for m in ("regex", "exact", "json_", "command") if getattr(self, m) is not None]
        if len(modes) != 1:
            raise ValueError(f"give exactly one of regex, exact, json, command (got {modes or 'none'})")
        if self.command is not None and self.file is not None:
            raise ValueError("file and command do not combine")
        if self.command is not None and not self.fresh and self.integrity.policy != "off":
            raise ValueError("refresh_runtime: false runs the command in the agent's own runtime, where the grading "
                             "contract cannot hold; add integrity: {policy: off} to accept that")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"bad regex {self.regex!r}: {exc}") from exc
        return self

    @property
    def mode(self) -> str:
        return next(m.rstrip("_") for m in ("regex", "exact", "json_", "command") if getattr(self, m) is not None)


class OutputEvaluator:
    name = "output"
    params_model = OutputCheck  # checked when a TaskRequest is built

    def check_of(self, ctx: EvalContext) -> OutputCheck:
        try:
            return OutputCheck.model_validate(ctx.params)
        except ValidationError as exc:
            raise ConfigError(f"bad output evaluator spec {ctx.params!r}: {exc}") from exc

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
        return self.check_of(ctx).fresh

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        check = self.check_of(ctx)
        if check.command is not None:
            return await self._command(ctx, check)
        report: EvalReport = {"mode": check.mode}
        if check.file is not None:
            runtime = await ctx.fresh_runtime() if check.fresh else ctx.agent_runtime()
            path = posixpath.join(runtime.spec.workdir, check.file)
            report["file"] = path
            try:
                text = (await runtime.read_file(path)).decode("utf-8", errors="replace")
            except (FileNotFoundError, IsADirectoryError) as exc:
                return _verdict(False, f"workspace file {path} is missing ({type(exc).__name__})", report)
        elif ctx.final_answer is None:
            return _verdict(False, "the rollout has no final answer", report)
        else:
            text = ctx.final_answer
        report["target_head"] = text[:200]
        if check.regex is not None:
            flags = re.IGNORECASE if check.ignore_case else 0
            match = re.search(check.regex, text, flags)
            if match:
                report["match"] = match.group(0)[:200]
            return _verdict(
                match is not None, f"regex {check.regex!r} {'matched' if match else 'did not match'}", report
            )
        if check.exact is not None:
            got, want = (text.strip(), check.exact.strip()) if check.strip else (text, check.exact)
            if check.ignore_case:
                got, want = got.casefold(), want.casefold()
            return _verdict(got == want, "exact match" if got == want else f"expected {check.exact!r}", report)
        assert check.json_ is not None
        return _json_verdict(text, check.json_, report)

    async def _command(self, ctx: EvalContext, check: OutputCheck) -> EvalResult:
        assert check.command is not None
        policy = resolve_policy(check.integrity, default=WORKSPACE_POLICY)
        report: EvalReport = {"mode": "command"}
        if check.fresh:
            runtime, graded = await graded_runtime(ctx, policy)
            report |= {"runtime": "fresh", **graded.as_report()}
            broken = broken_result(graded, report)
            if broken is not None:
                return _verdict(False, str(broken.report["reason"]), broken.report)
        else:
            runtime = ctx.agent_runtime()
            report |= {"runtime": "agent", "policy": "off"}
        workdir = runtime.spec.workdir
        env, reporter = await check_env(runtime, policy) if check.fresh else (grading_env(policy, workdir), None)
        res = await runtime.exec(check.command, env=env, cwd=workdir, timeout_s=check.timeout_s)
        report |= {
            "command": check.command,
            "exit_code": res.exit_code,
            "output_tail": res.output[-OUTPUT_TAIL_CHARS:],
            "duration_s": round(res.duration_s, 3),
        }
        if res.timed_out:
            return EvalResult(
                status=Status.TIMEOUT, report={**report, "reason": f"command exceeded {check.timeout_s} s"}
            )
        found = await pytest_verdict(runtime, reporter, res.output)
        forced = pytest_gate(found, report)
        if forced is not None:
            return forced if forced.status is not Status.COMPLETED else _verdict(False, str(forced.report["reason"]), forced.report)
        ok = res.exit_code == check.exit_code
        failing = failing_tests(found)
        if ok and check.exit_code == 0 and failing:
            return _verdict(False, f"the command exited 0, but the authenticated report has failing tests: {failing[:5]}", report)
        return _verdict(ok, f"command exited {res.exit_code}, expected {check.exit_code}", report)


def _verdict(ok: bool, reason: str, report: EvalReport) -> EvalResult:
    return EvalResult(reward=1.0 if ok else 0.0, report={**report, "passed": ok, "reason": reason})


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        blocks = _FENCE.findall(text)  # an answer that wraps its JSON in a fenced block
        if not blocks:
            raise
        return json.loads(blocks[-1])


def _lookup(doc: Any, path: str) -> Any:
    for part in path.split(".") if path else []:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.lstrip("-").isdigit() and -len(doc) <= int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return _MISSING
    return doc


def _same(a: Any, b: Any) -> bool:
    """JSON equality without Python's ``True == 1`` and ``1 == 1.0`` conflations across types."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _json_verdict(text: str, check: JsonCheck, report: EvalReport) -> EvalResult:
    report["path"] = check.path
    try:
        doc = _parse_json(text)
    except json.JSONDecodeError as exc:
        return _verdict(False, f"not valid JSON: {exc}", report)
    value = _lookup(doc, check.path)
    if value is _MISSING:
        return _verdict(False, f"JSON has no field {check.path!r}", report)
    report["value"] = value
    ok = _same(value, check.equals)
    return _verdict(
        ok,
        f"{check.path or 'document'} == {check.equals!r}"
        if ok
        else f"{check.path or 'document'} is {value!r}, expected {check.equals!r}",
        report,
    )
