"""``rollout``, ``eval``, ``serve``, ``submit`` and ``status``: staged rollouts of a task set."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_env.cli.checks import add_command
from polar_env.errors import ConfigError

if TYPE_CHECKING:
    from polar_env.registry import Registry


def env_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """PolarEnvConfig from --config (YAML) with the flags given on the command line on top. Every
    name is resolved here, before anything starts; a mistake is one line, ``<field>: <problem>``."""
    from pydantic import ValidationError

    from polar_env.registry import validation_line

    try:
        return _env_config_unchecked(args)
    except ValidationError as exc:
        from polar_env.env import PolarEnvConfig

        raise ConfigError(validation_line(exc, model=PolarEnvConfig)) from None


def _env_config_unchecked(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.engines.config import ENGINES
    from polar_env.env import PolarEnvConfig

    config = PolarEnvConfig.from_yaml(args.config) if args.config else PolarEnvConfig()
    engine = config.engine.model_dump(exclude_unset=True)
    kind = args.engine or ("vllm" if args.engine_url and not args.config else config.engine.kind)  # a URL: a served engine
    if kind != config.engine.kind and kind in ENGINES:  # another backend: keep what it also has (model, template)
        engine = {k: v for k, v in engine.items() if k in ENGINES.get(kind).model_fields}
    engine["kind"] = kind
    for flag, key in (("engine_url", "url"), ("model_dir", "model_dir"), ("seed", "seed"),
                      ("engine_script", "script"), ("served_model_name", "model")):
        if getattr(args, flag, None) is not None:
            engine[key] = getattr(args, flag)
    limits = config.limits.model_dump()
    for key in ("max_running", "max_init", "max_postrun", "ready_buffer"):
        if getattr(args, key, None) is not None:
            limits[key] = getattr(args, key)
    if args.max_running is not None and args.ready_buffer is None:
        limits["ready_buffer"] = None  # re-derive from the new limits
    sampling = config.sampling.model_dump(exclude_none=True)
    for key in ("temperature", "top_p", "max_tokens"):
        if getattr(args, key, None) is not None:
            sampling[key] = getattr(args, key)
    update: dict[str, Any] = {"engine": engine, "limits": limits, "sampling": sampling}
    for flag in ("harness", "api", "builder", "timeout_s", "nodes", "ray_address"):
        if getattr(args, flag, None) is not None:
            update[flag] = getattr(args, flag)
    if args.ray or args.ray_address:
        update["ray"] = True
    if args.canonical:
        update["continuation"] = False
    if args.runtime is not None:
        update["runtime"] = {**config.runtime.model_dump(exclude_unset=True), "kind": args.runtime}
    if args.evaluator is not None:
        update["evaluator"] = evaluator_option(args.evaluator)
    return PolarEnvConfig.model_validate({**config.model_dump(exclude_unset=True), **update})


def _names(registry: Registry[Any]) -> str:
    """``{a,b,c}``: a registry's names as a flag's metavar. They are listed, not argparse
    ``choices``, so a typo gets the registry's one line with the closest name."""
    return "{" + ",".join(registry.names()) + "}"


def evaluator_option(text: str) -> Any:
    """``--evaluator NAME`` or ``--evaluator '{"name": ..., ...}'`` as data for PolarEnvConfig (which
    resolves the name and params); JSON that does not parse names the option."""
    text = text.strip()
    if not text.startswith("{"):
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--evaluator {text!r} is not JSON ({exc}); give a name, e.g. --evaluator output, "
                          """or JSON, e.g. --evaluator '{"name": "output", "regex": "ok"}'""") from None


def add_env_options(p: argparse.ArgumentParser) -> None:
    from polar_env.engines.config import ENGINES
    from polar_env.runtimes import RUNTIMES
    from polar_env.trajectory.builders import BUILDERS

    g = p.add_argument_group("environment (override --config)")
    g.add_argument("--config", help="YAML file of PolarEnvConfig fields (engine, harness, runtime, limits, ...)")
    g.add_argument("--harness", help="harness preset (pi, qwen_code, mini_swe_agent, claude_code, codex, "
                   "gemini_cli, opencode), a harness file, or 'loop' (built-in agent loop); default pi")
    g.add_argument("--api", help="wire format the harness speaks (default: its own)")
    g.add_argument("--engine", metavar=_names(ENGINES),
                   help="embedded: the CPU engine in-process (default); simulated: a test double")
    g.add_argument("--engine-url", help="vLLM base URL (several, comma-separated: a session-sticky pool), or SGLang "
                   "worker URLs (comma-separated) / router:URL")
    g.add_argument("--served-model-name", help="the engine's model name")
    g.add_argument("--model-dir", help="embedded: a HF Qwen3 folder (default: seeded random tiny weights)")
    g.add_argument("--seed", type=int, help="embedded: seed of the random weights")
    g.add_argument("--engine-script", help="embedded: scripted policy JSON forcing the tokens (a test double)")
    g.add_argument("--max-tokens", type=int, help="sampling.max_tokens: cap on the tokens sampled per call, "
                   "any engine (default: none; embedded 256, scripted 4096)")
    g.add_argument("--temperature", type=float, help="sampling.temperature: trainer-owned (overrides harnesses)")
    g.add_argument("--top-p", type=float, help="sampling.top_p: trainer-owned")
    g.add_argument("--runtime", metavar=_names(RUNTIMES), help="default sandbox (bubblewrap)")
    g.add_argument("--builder", metavar=_names(BUILDERS),
                   help="trajectory builder (default prefix_merge)")
    g.add_argument("--evaluator", help="evaluator name or JSON spec (default: swebench for SWE tasks)")
    g.add_argument("--canonical", action="store_true", help="canonical templating instead of token-in continuation")
    g.add_argument("--timeout-s", type=float, help="agent budget per session in seconds (default 600)")
    g.add_argument("--nodes", type=int, help="gateway nodes (default 1)")
    g.add_argument("--ray", action="store_true", help="run nodes as Ray actors (ray.init() locally)")
    g.add_argument("--ray-address", help="join an existing Ray cluster (implies --ray)")
    g.add_argument("--max-running", type=int, help="RUNNING slots per node (match the engine's capacity)")
    g.add_argument("--max-init", type=int, help="INIT workers per node")
    g.add_argument("--max-postrun", type=int, help="POSTRUN workers per node")
    g.add_argument("--ready-buffer", type=int, help="prepared runtimes per node (INIT + READY)")


def add_job_options(p: argparse.ArgumentParser, samples: int) -> None:
    p.add_argument("--tasks", help="'toy' (the offline toy SWE set; the default), a .jsonl/.json/.parquet file, or a "
                   "folder of Harbor tasks")
    p.add_argument("--task-id", action="append", help="only this task (repeatable)")
    p.add_argument("--limit", type=int, help="at most this many tasks")
    p.add_argument("--samples", type=int, help=f"sessions per task (the GRPO group size; default {samples})")
    p.set_defaults(default_samples=samples)
    p.add_argument("--out", default="polar_rollouts", help="folder of runs: each run writes OUT/<run id>/ (journals, "
                   "trajectories, report) and OUT/latest points at the newest")
    p.add_argument("--run-id", help="name of the run folder (default: UTC time, command and a random tail)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run (e.g. OUT/latest): only the "
                   "sessions that did not finish, under their planned ids")
    p.add_argument("--early-stop", type=int, dest="early_stop", help="finish a group after this many usable sessions")
    p.add_argument("--no-progress", action="store_true", help="no live table (e.g. in CI logs)")
    p.add_argument("--tracker", choices=["wandb", "tensorboard"], help="also log the figures there (W&B offline by default)")
    add_env_options(p)


def job_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.staging.job import RolloutJob

    return RolloutJob(env=env_config(args), tasks="toy" if args.tasks is None else args.tasks, task_ids=args.task_id,
                      limit=args.limit, samples=args.default_samples if args.samples is None else args.samples, out=Path(args.out),
                      mode="eval" if args.command == "eval" else "rollout",
                      pass_k=sorted(set(getattr(args, "k", None) or [1])), early_stop_min_usable=args.early_stop,
                      tracker=args.tracker, run_id=args.run_id)


def cmd_rollout(args: argparse.Namespace) -> int:
    from polar_env.cli.resume import job_and_resume
    from polar_env.preflight import check_job, check_job_options
    from polar_env.staging.job import interrupt_line, run_job
    from polar_env.staging.progress import LiveProgress
    from polar_env.staging.summary import print_summary

    check_job_options(args)
    job, resume = job_and_resume(args)
    reqs = check_job(job, args.command)
    env = job.env
    where = f"resuming {resume}" if resume else f"output {job.out}/<run id>"
    print(f"polar-env {args.command}: {env.engine.describe()}; harness {env.harness}; runtime {env.runtime.kind}; "
          f"{'continuation' if env.continuation else 'canonical'} mode; {env.nodes} node(s){' on Ray' if env.ray else ''}; "
          f"{where}", flush=True)
    live = None if args.no_progress else LiveProgress(title=f"polar-env {args.command}")
    try:
        report = asyncio.run(run_job(job, live, command=args.command, resume=resume, reqs=reqs))
    finally:
        if live is not None:
            live.stop()
    print_summary(report, out=Path(report["run_dir"]))
    print(f"wrote {report['run_dir']}/: {', '.join(report['files'])}")
    line = interrupt_line(report)
    if line is not None:
        print(line, flush=True)
        return int(report["interrupted"]["exit_code"])
    return 0 if report["statuses"].get("completed", 0) > 0 else 1


def _server_token(args: argparse.Namespace) -> str:
    if getattr(args, "token", None):
        return str(args.token)
    path = Path(args.token_file)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        from polar_env.errors import ConfigError

        raise ConfigError(f"token file {path} does not exist; pass --token or the --token-file polar-env serve wrote") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from polar_env.preflight import check_serve
    from polar_env.staging.cluster import serve

    config = env_config(args)
    check_serve(config, args.host, args.port)
    if not args.local:
        config = config.model_copy(update={"ray": True})
    store = Path(args.store)
    config = config.model_copy(update={"store": store / "capture"})
    return asyncio.run(serve(config, args.host, args.port, store, args.token))


def _http(method: str, url: str, token: str, body: bytes | None = None) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError as exc:
        from polar_env.errors import ConfigError

        raise ConfigError(f"cannot reach the rollout server at {url}: {exc} (is polar-env serve running?)") from None


def cmd_submit(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from polar_env.env import task_request
    from polar_env.registry import validation_line
    from polar_env.staging.models import TaskRequest
    from polar_env.staging.submission import chosen_settings, submission_body
    from polar_env.tasks.sources import read_rows

    token = _server_token(args)
    config = env_config(args)
    chosen = chosen_settings(args)  # reads --config: once, not per row
    groups = []
    reqs = []
    for row in read_rows(Path(args.tasks)):  # every row's names resolve before the first one is sent
        is_request = isinstance(row, dict) and "task_id" in row and "instruction" in row and "agent" in row
        try:
            req = TaskRequest.model_validate(row) if is_request else task_request(row, config, args.samples)
        except ValidationError as exc:
            raise ConfigError(f"{args.tasks}: task {row.get('task_id')!r}: {validation_line(exc, model=TaskRequest)}") from None
        reqs.append((req, row if is_request else submission_body(req, row, chosen)))  # the server fills the rest
    for req, sent in reqs:
        status, body = _http("POST", f"{args.server}/rollout/task/submit", token, json.dumps(sent, default=str).encode())
        if status != 202:
            print(f"{req.task_id}: refused ({status}): {body.get('error', body)}", file=sys.stderr)
            continue
        groups.append(body["group_id"])
        print(f"{req.task_id}: submitted as group {body['group_id']} ({req.num_samples} samples)")
        if body.get("warning"):
            print(f"polar-env submit: warning: {req.task_id}: {body['warning']}", file=sys.stderr)
    while args.wait and groups:
        time.sleep(2)
        for gid in list(groups):
            status, body = _http("GET", f"{args.server}/rollout/task/{gid}?results=0", token)
            if body.get("state") in ("done", "cancelled"):
                print(json.dumps(body))
                groups.remove(gid)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    token = _server_token(args)
    path = f"/rollout/task/{args.ref}?results=0" if args.ref else "/rollout/status"
    status, body = _http("GET", args.server + path, token)
    print(json.dumps(body, indent=2))
    return 0 if status == 200 else 1


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "rollout", "the main job: staged rollouts of a task set, rewarded trajectories + report")
    add_job_options(p, samples=2)
    p.set_defaults(func=cmd_rollout)

    p = add_command(sub, "eval", "the rollout pipeline in evaluation mode: pass@1 / pass@k per repo, cost")
    add_job_options(p, samples=1)
    p.add_argument("-k", type=int, action="append", help="report pass@k (repeatable; default 1)")
    p.set_defaults(func=cmd_rollout)

    p = add_command(sub, "serve", "rollout server + N gateway nodes (Ray actors) behind an HTTP task API")
    p.add_argument("--host", default="127.0.0.1", help="address of the task API (keep it off the sandboxes' reach)")
    p.add_argument("--port", type=int, default=8080, help="port of the task API")
    p.add_argument("--store", default="polar_serve", help="journals and the server's token file go here")
    p.add_argument("--token", help="bearer token for the task API (default: generated into STORE/rollout_token)")
    p.add_argument("--local", action="store_true", help="nodes in this process instead of Ray actors")
    add_env_options(p)
    p.set_defaults(func=cmd_serve)

    for name, func, text in (("submit", cmd_submit, "submit a JSONL/JSON/Parquet file of tasks to polar-env serve"),
                             ("status", cmd_status, "status of polar-env serve, or of one task group")):
        p = add_command(sub, name, text)
        if name == "submit":
            p.add_argument("tasks", help="task rows (SWE rows, {task_id, instruction, ...}, or full TaskRequests)")
            p.add_argument("--samples", type=int, default=1, help="sessions per task")
            p.add_argument("--wait", action="store_true", help="poll until every submitted group is done")
            add_env_options(p)
        else:
            p.add_argument("ref", nargs="?", help="group id or task id (default: the whole server)")
        p.add_argument("--server", default="http://127.0.0.1:8080", help="the rollout server's URL")
        p.add_argument("--token", help="the server's bearer token")
        p.add_argument("--token-file", default="polar_serve/rollout_token", help="file holding the token")
        p.set_defaults(func=func)


