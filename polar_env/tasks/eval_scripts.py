"""Where a SWE row's eval script comes from, decided before any session starts.

Published SWE-Gym / SWE-bench rows carry no ``eval_script``; finding that out at grading time masks
every session of the row after the agent ran. ``resolve_eval_script`` takes, in order: the row's own
``eval_script``; one built from its ``environment_setup.test_command`` (the swe-real layout); the
installed swebench release's spec table by repo and version (swebench < 5 and the SWE-Gym fork
carry one, 5.x does not); the evaluator's ``test_command``. ``check_gradable`` runs it over a job's
swebench rows in preflight, so a row nothing can grade is a ConfigError before any session starts.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from polar_env.errors import ConfigError
from polar_env.tasks.swe import SweTask, build_eval_script

Source = Literal["row", "environment_setup", "spec_table", "test_command"]
WORKDIR = "/testbed"  # where swebench-layout images hold the repo; the script cds there first
SWEBENCH_ENV_NAME = "testbed"  # the conda env name the spec-table scripts activate
# Where a swebench release keeps its eval-script builder: 3.x/4.x, then 2.x and the SWE-Gym fork.
_SCRIPT_BUILDERS = ("swebench.harness.test_spec.create_scripts", "swebench.harness.test_spec")
_FIX = ("give the row an eval_script or an environment_setup.test_command, or the evaluator a test_command "
        "(--evaluator '{\"name\": \"swebench\", \"test_command\": \"pytest -rA <test files>\"}')")


@dataclass(frozen=True, slots=True)
class EvalScript:
    """An eval script in the swebench layout and which source gave it (reported with the grade)."""

    script: str
    source: Source


class NoEvalScript(ConfigError):
    """No source gives this row an eval script; the message is one line naming the row and the fix."""


class _EvaluatorLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def params(self) -> Mapping[str, object]: ...


class GradableRequest(Protocol):
    """What ``check_gradable`` reads of a ``staging.models.TaskRequest`` (a layer above ``tasks``)."""

    @property
    def task_id(self) -> str: ...
    @property
    def task(self) -> Mapping[str, object]: ...
    @property
    def evaluator(self) -> _EvaluatorLike | None: ...


@dataclass(frozen=True, slots=True)
class _Inputs:
    """Everything a script is built from: the cache key (256 sessions of a row build it once)."""

    instance_id: str
    repo: str
    version: str
    base_commit: str
    test_patch: str
    setup_command: str | None
    test_command: str | None
    environment_setup_commit: str | None


def resolve_eval_script(task: SweTask, test_command: str | None = None) -> EvalScript:
    """The row's eval script from the first source that has one; NoEvalScript (one line) when none does."""
    if task.eval_script:
        return EvalScript(task.eval_script, "row")  # nothing to build, nothing to cache
    setup = task.extra.get("environment_setup")
    setup_command = setup.get("test_command") if isinstance(setup, Mapping) else None
    return _resolve(_Inputs(
        instance_id=task.instance_id, repo=task.repo, version=task.version, base_commit=task.base_commit,
        test_patch=task.test_patch,
        setup_command=(setup_command.strip() or None) if isinstance(setup_command, str) else None,
        test_command=(test_command.strip() or None) if test_command else None,
        environment_setup_commit=task.environment_setup_commit,
    ))


@functools.lru_cache(maxsize=256)  # a job's rows run in groups; the key holds the test patch, so keep it small
def _resolve(inputs: _Inputs) -> EvalScript:
    if inputs.setup_command is not None:
        return EvalScript(_built(inputs, inputs.setup_command, WORKDIR), "environment_setup")
    from_table, why_not = _from_spec_table(inputs)
    if from_table is not None:
        return EvalScript(from_table, "spec_table")
    if inputs.test_command is not None:
        return EvalScript(_built(inputs, inputs.test_command, None), "test_command")  # run where the evaluator runs it
    raise NoEvalScript(f"{inputs.instance_id}: no eval_script, no environment_setup.test_command, {why_not}; {_FIX}")


def _built(inputs: _Inputs, command: str, workdir: str | None) -> str:
    """The swebench layout from ``command``; no activation: the image's environment (its venv
    first on PATH) is what runs it."""
    try:
        return build_eval_script(base_commit=inputs.base_commit, test_patch=inputs.test_patch,
                                 test_command=command, workdir=workdir)
    except ValueError as exc:
        raise NoEvalScript(f"{inputs.instance_id}: cannot build its eval script: {exc}") from None


def _from_spec_table(inputs: _Inputs) -> tuple[str | None, str]:
    """(the installed swebench's own eval script for this repo and version, or None and why not)."""
    where = f"{inputs.repo or '(no repo)'} {inputs.version or '(no version)'}"
    release, table, builder = _swebench_table()
    if release is None:
        return None, f"no swebench installed to look {where} up in a spec table"
    if table is None or builder is None:
        return None, f"{where} not in the installed swebench's spec table (swebench {release} has none)"
    specs = table.get(inputs.repo, {}).get(inputs.version) if isinstance(table.get(inputs.repo), Mapping) else None
    if specs is None:
        return None, f"{where} not in the installed swebench's spec table (swebench {release})"
    instance = {"instance_id": inputs.instance_id, "repo": inputs.repo, "version": inputs.version,
                "base_commit": inputs.base_commit, "test_patch": inputs.test_patch,
                "environment_setup_commit": inputs.environment_setup_commit or inputs.base_commit}
    try:
        lines = builder(instance, specs, SWEBENCH_ENV_NAME, WORKDIR, inputs.base_commit, inputs.test_patch)
    except Exception as exc:  # noqa: BLE001 - the release's own code; its failure is this row's one line
        return None, f"swebench {release}'s eval script for {where} failed ({type(exc).__name__}: {exc})"
    # TestSpec.eval_script's own framing, around the release's own lines
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", *lines]) + "\n", ""


@functools.cache
def _swebench_table() -> tuple[str | None, Mapping[str, Any] | None, Callable[..., list[str]] | None]:
    """(installed swebench release, its MAP_REPO_VERSION_TO_SPECS, its make_eval_script_list).
    The eval-script builder, not ``make_test_spec``: that one also builds the environment script,
    which fetches requirements.txt / environment.yml from GitHub for many repos."""
    try:
        from swebench.harness import constants
    except ImportError:
        return None, None, None
    release = _release()
    table = getattr(constants, "MAP_REPO_VERSION_TO_SPECS", None)
    if not isinstance(table, Mapping):
        return release, None, None
    for module in _SCRIPT_BUILDERS:
        try:
            builder = getattr(importlib.import_module(module), "make_eval_script_list", None)
        except ImportError:
            continue
        if callable(builder):
            return release, table, builder
    return release, None, None


def _release() -> str:
    import swebench

    version = getattr(swebench, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("swebench")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown release)"


def _grader_missing() -> str | None:
    """Why the installed swebench cannot grade (the evaluator uses 5.x's make_test_spec and
    get_eval_report; a release old enough to carry a spec table lacks them), or None."""
    try:
        from swebench.harness.grading import get_eval_report  # noqa: F401
        from swebench.harness.utils import make_test_spec  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def check_gradable(reqs: Sequence[GradableRequest]) -> dict[str, int]:
    """Every ``swebench`` request's eval script resolved now; a ConfigError listing every row none
    can be found for (one line each), before any session starts. Returns the count per source."""
    counts: dict[str, int] = {}
    bad: dict[str, str] = {}
    for req in reqs:
        if req.evaluator is None or req.evaluator.name != "swebench":
            continue
        command = req.evaluator.params.get("test_command")
        try:
            task = SweTask.from_row(req.task)
            found = resolve_eval_script(task, command if isinstance(command, str) else None)
        except ValidationError as exc:
            first = exc.errors()[0]
            bad.setdefault(req.task_id, f"{req.task_id}: not a SWE task row ({'.'.join(map(str, first['loc']))}: "
                                        f"{first['msg'].lower()}); give it the SWE-bench fields")
            continue
        except (ConfigError, ValueError) as exc:
            bad.setdefault(req.task_id, str(exc) if isinstance(exc, ConfigError) else f"{req.task_id}: {exc}")
            continue
        counts[found.source] = counts.get(found.source, 0) + 1
        if found.source == "spec_table" and (why := _grader_missing()) is not None:
            bad.setdefault(req.task_id, f"{req.task_id}: its eval script comes from swebench {_release()}'s spec table, "
                                        f"but the swebench evaluator grades with swebench 5.x's library ({why}); {_FIX}")
    if bad:
        total = sum(1 for r in reqs if r.evaluator is not None and r.evaluator.name == "swebench")
        raise ConfigError(f"{len(bad)} of {total} swebench task(s) cannot be graded:\n  "
                          + "\n  ".join(bad.values()))
    return counts
