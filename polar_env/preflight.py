"""Preflight: what a pydantic validator cannot see, checked before any session or runtime starts.

``rollout``, ``eval``, ``sft``, ``train`` and ``serve`` call one of the ``check_*`` functions first.
Each problem is one ``ConfigError`` line, ``<what>, <where>; <how to fix>`` (the CLI prefixes
``polar-env <cmd>: error:`` and exits 2), found in seconds instead of after every session has run
through INIT and RUNNING to ERROR. Checked here: the job's options, tasks and output folder. What
the nodes need is each kind's own check, carried by its registry entry (``Registry(preflight=)``),
which ``node_checks`` runs for every engine, harness, runtime and evaluator the job names: a kind
cannot be registered without one, so none is skipped. The checks live with their kinds
(engines/ready.py, harnesses/install.py, runtimes/<kind>_check.py, evaluators/base.py).
Names (builders, evaluators, harnesses) are validated where the config is built, not here.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from polar_env.errors import ConfigError
from polar_env.registry import Preflight

if TYPE_CHECKING:
    from polar_env.engines.config import AnyEngineConfig
    from polar_env.env import PolarEnvConfig
    from polar_env.staging.job import RolloutJob
    from polar_env.staging.models import TaskRequest

ENGINE_WAIT_S = 2.0  # an engine still loading gets this long; a wrong URL is reported after it
# RolloutJob / TaskRequest fields and the option that sets them.
JOB_OPTIONS = {"samples": "--samples", "num_samples": "--samples", "limit": "--limit",
               "early_stop_min_usable": "--early-stop", "pass_k": "-k", "tasks": "--tasks", "out": "--out"}


def options_error(exc: ValidationError, options: dict[str, str] = JOB_OPTIONS) -> ConfigError:
    """A pydantic error on values the user typed, as one line naming the option."""
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        option = options.get(field, f"--{field.replace('_', '-')}")
        parts.append(f"{option} {err.get('input')!r}: {err['msg'].lower()}")
    return ConfigError(f"invalid option {'; '.join(parts)}; see --help")


def check_job_options(args: argparse.Namespace) -> None:
    """The job's own options (``--samples``, ``--limit``, ``--early-stop``, ``-k``) against the
    RolloutJob model's constraints, before the job (or the config) is built."""
    from polar_env.staging.job import RolloutJob

    values = {"samples": args.samples, "limit": args.limit, "early_stop_min_usable": args.early_stop}
    if getattr(args, "k", None):
        values["pass_k"] = args.k
    try:
        RolloutJob.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise options_error(exc) from None


def check_job(job: RolloutJob, command: str) -> list[TaskRequest]:
    """Tasks resolvable, the tracker's package installed, then everything :func:`check_env`
    checks for them; returns the tasks."""
    from polar_env.observe.tracker import require_tracker
    from polar_env.staging.job import load_tasks

    check_job_bounds(job)
    if job.tracker is not None:
        require_tracker(job.tracker)

    try:
        reqs = load_tasks(job)
    except ValidationError as exc:  # --samples/--early-stop reach the TaskRequests here; anything else is a row's
        if all(err["loc"] and str(err["loc"][0]) in JOB_OPTIONS for err in exc.errors()):
            raise options_error(exc) from None
        fields = "; ".join(f"{'.'.join(map(str, e['loc']))} {e.get('input')!r}: {e['msg'].lower()}" for e in exc.errors())
        raise ConfigError(f"invalid task row ({fields}), in {job.tasks}; fix the row (fields as in TaskRequest)") from None
    except ConfigError as exc:  # a row's names or params (config.task_request): say which file holds it
        if not str(exc).startswith("task ") or str(exc).startswith("task file ") or job.tasks == "toy":
            raise  # not a row's: the file itself (missing, unreadable) says how to fix it
        raise ConfigError(f"{exc}; in {job.tasks}: fix the row") from None
    from polar_env.tasks.eval_scripts import check_gradable

    check_gradable(reqs)  # a row nothing can grade fails now, not after its sessions ran
    check_buildable_images(reqs, str(job.tasks))
    check_env(job.env, reqs, command)
    return reqs


def check_job_bounds(job: RolloutJob) -> None:
    """What one field's bounds cannot say: ``-k`` and ``--early-stop`` within ``--samples`` (pass@k
    needs k samples per task: a larger k was dropped from the report, silently), and ``--out`` a
    folder (or a path to make one at), before the run folder is made."""
    if job.mode == "eval" and max(job.pass_k, default=1) > job.samples:
        k = max(job.pass_k)
        raise ConfigError(f"invalid option -k {k}: pass@{k} needs at least {k} sessions per task and --samples is "
                          f"{job.samples}; pass --samples {k} or a smaller -k")
    if job.early_stop_min_usable is not None and job.early_stop_min_usable > job.samples:
        raise ConfigError(f"invalid option --early-stop {job.early_stop_min_usable}: a group of --samples "
                          f"{job.samples} never has that many usable sessions; give --early-stop at most {job.samples}")
    out = Path(job.out)
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == out else f"is under the file {blocker}"
        raise ConfigError(f"--out {out} {where}, not a folder; pass a folder for the runs (each run writes "
                          "OUT/<run id>/), or move the file away")


def check_buildable_images(reqs: Sequence[TaskRequest], tasks: str) -> None:
    """SWE rows on a local runtime whose image is not in the store but could be built from their
    own recipe: one line with the exact ``images build`` command (the runtime check names the rest)."""
    from polar_env.runtimes.bundle import images_root, resolve_image_dir
    from polar_env.runtimes.imagestore import is_path

    ids = sorted({r.task_id for r in reqs if r.runtime.kind in ("sandbox", "apptainer") and r.runtime.image
                  and not is_path(r.runtime.image) and "://" not in r.runtime.image
                  and isinstance(r.task.get("extra", {}).get("environment_setup"), dict)
                  and resolve_image_dir(r.runtime.image) is None})
    if ids:
        raise ConfigError(f"{len(ids)} task image(s) are not in the image store {images_root()} ({_few(ids)}); build "
                          f"them from the rows' environment_setup: polar-env images build {tasks} --ids {' '.join(ids)}")


def check_serve(config: PolarEnvConfig, host: str, port: int) -> None:
    """``serve``: the task API's port is free, and the server's defaults work."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}), the task API (--host/--port); "
                              "pick another --port, or stop the process that holds it") from None
    check_env(config, [], "serve")


def check_recipe(path: Path, overrides: dict[str, Any]) -> None:
    """``train``: the recipe's pipeline (bwrap sandboxes, its evaluator) is usable."""
    from polar_env.train.recipe import Recipe

    recipe = Recipe.load(path, overrides)
    if recipe.source == "polar_env":
        check_runtime("sandbox")
    for name in sorted({task.evaluator.name for task in [*recipe.toy_tasks(), *recipe.held_out_tasks()]}):
        check_evaluator(name, f"recipe {path}")


def check_env(env: PolarEnvConfig, reqs: Sequence[TaskRequest], command: str) -> None:
    """Engine, harnesses, runtimes and evaluator dependencies of ``env`` and ``reqs``. On an existing
    Ray cluster (``--ray-address``) the nodes may be other machines: what they need is not checked
    from here (only the missing-evaluator warning is given)."""
    if not env.ray_address:
        check_node_side(env, reqs)
    unevaluated = [r.task_id for r in reqs if r.evaluator is None]
    if unevaluated:
        warn(command, f"{len(unevaluated)} of {len(reqs)} task(s) have no evaluator ({_few(unevaluated)}), so every "
             "session of theirs gets reward 0; pass --evaluator (e.g. output, session_completion) or give the rows "
             "an 'evaluator'")


def check_node_side(env: PolarEnvConfig, reqs: Sequence[TaskRequest]) -> None:
    """What the nodes (on this machine) need: every kind the job uses, in the engines, harnesses,
    runtimes and evaluators registries, passes its entry's own preflight check."""
    for check, args in node_checks(env, reqs):
        check(*args)


def node_checks(env: PolarEnvConfig, reqs: Sequence[TaskRequest]) -> Iterator[tuple[Preflight, tuple[object, ...]]]:
    """Each check the job's kinds need, with what it is called with: the engine's, each harness's,
    each runtime kind's (with what its sessions ask of it), each evaluator's; in that order."""
    from polar_env.engines.config import ENGINES
    from polar_env.evaluators import EVALUATORS
    from polar_env.runtimes import RUNTIMES, RuntimeNeeds

    yield ENGINES.preflight(env.engine.kind), (env.engine, ENGINE_WAIT_S)
    for name in sorted({r.agent.harness for r in reqs} if reqs else {env.harness}):
        yield from _harness_check(name, env.harness_cache)
    for kind in sorted({r.runtime.kind for r in reqs} if reqs else {env.runtime.kind}):
        specs = [r.runtime for r in reqs if r.runtime.kind == kind] if reqs else [env.runtime]
        yield RUNTIMES.preflight(kind), (RuntimeNeeds.of(specs),)
    evaluators = {r.evaluator.name: r.task_id for r in reqs if r.evaluator is not None}
    if env.evaluator is not None:
        evaluators.setdefault(env.evaluator.name, "--evaluator")
    for name, where in sorted(evaluators.items()):
        yield EVALUATORS.preflight(name), (name, f"task {where}" if where != "--evaluator" else where)


def warn(command: str, message: str) -> None:
    print(f"polar-env {command}: warning: {message}", file=sys.stderr, flush=True)


def _few(items: Iterable[str], n: int = 3) -> str:
    items = list(items)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


# -- one kind at a time (each runs the kind's registry entry's check) -------------------------------


def check_engine(config: AnyEngineConfig, wait_s: float = ENGINE_WAIT_S) -> None:
    """The engine's check (engines/ready.py): a served engine answers within ``wait_s`` and serves
    ``config.model``; a local engine's files, script and template are usable."""
    from polar_env.engines.config import ENGINES

    ENGINES.preflight(config.kind)(config, wait_s)


def check_harness(name: str, cache_dir: Path | None = None) -> None:
    """The harness's check (by default harnesses/install.py ``check_installable``)."""
    for check, args in _harness_check(name, cache_dir):
        check(*args)


def _harness_check(name: str, cache_dir: Path | None) -> Iterator[tuple[Preflight, tuple[object, ...]]]:
    """The built-in loop needs nothing; a preset its entry's check; a harness file (in no table) the
    table's default, the check every preset's install and needs are read by."""
    from polar_env.harnesses import HARNESSES, LOOP, get_harness
    from polar_env.harnesses.install import check_installable

    if name == LOOP:
        return
    spec = get_harness(name)
    yield (HARNESSES.preflight(spec.name) if spec.name in HARNESSES else check_installable), (spec, cache_dir)


def check_runtime(kind: str, image: str | None = None, agent_root: str = "auto", *, images: Sequence[str] = (),
                  unbounded_ok: bool = False) -> None:
    """The runtime kind's check, for sessions that ask what ``RuntimeNeeds`` says: ``image`` one they
    use, ``agent_root`` the strictest Docker setting, ``images`` all they need present,
    ``unbounded_ok`` none needs memory/pids bounded."""
    from polar_env.runtimes import RUNTIMES, RuntimeNeeds

    RUNTIMES.preflight(kind)(RuntimeNeeds(image, agent_root, tuple(images), unbounded_ok=unbounded_ok))


# -- evaluator -----------------------------------------------------------------------------------


def check_evaluator(name: str, where: str) -> None:
    """The evaluator's check: its own dependencies import (its name is validated with the config)."""
    from polar_env.evaluators import EVALUATORS

    EVALUATORS.preflight(name)(name, where)
