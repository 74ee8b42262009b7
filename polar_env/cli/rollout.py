"""``rollout``, ``eval``, ``serve``, ``submit`` and ``status``: staged rollouts of a task set."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from polar_env import eventloop
from polar_env.cli.checks import add_command
from polar_env.cli.options import add_flags, chosen_settings, env_config, flags_for
from polar_env.cli.resume import job_and_resume
from polar_env.errors import ConfigError


def add_env_options(p: argparse.ArgumentParser) -> None:
    """The environment's options (``options.FLAGS``, the ``env.…`` ones) on top of ``--config``."""
    g = p.add_argument_group("environment (override --config)")
    g.add_argument("--config", help="YAML file of PolarEnvConfig fields (engine, harness, runtime, limits, ...)")
    add_flags(g, flags_for(p.prog.split()[-1], env_only=True))


def add_job_options(p: argparse.ArgumentParser, samples: int) -> None:
    """The job's options (``options.FLAGS``), ``--resume`` and the display, then the environment's."""
    command = p.prog.split()[-1]
    add_flags(p, tuple(f for f in flags_for(command) if not f.env), defaults={"samples": samples})
    p.set_defaults(default_samples=samples)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run (e.g. OUT/latest): only the "
                   "sessions that did not finish, under their planned ids")
    p.add_argument("--no-progress", action="store_true", help="no live table (e.g. in CI logs)")
    add_env_options(p)


def cmd_rollout(args: argparse.Namespace) -> int:
    from polar_env.preflight import check_job, check_job_options
    from polar_env.staging.deadline import bounded_run, finish
    from polar_env.staging.job import interrupt_line, run_job
    from polar_env.staging.progress import LiveProgress
    from polar_env.staging.summary import print_summary

    began = time.monotonic()
    check_job_options(args)
    job, resume = job_and_resume(args)
    reqs = check_job(job, args.command)
    env = job.env
    where = f"resuming {resume}" if resume else f"output {job.out}/<run id>"
    print(f"polar-env {args.command}: {env.engine.describe()}; harness {env.harness}; runtime {env.runtime.kind}; "
          f"{'continuation' if env.continuation else 'canonical'} mode; {env.nodes} node(s){' on Ray' if env.ray else ''}; "
          f"{where}; preflight passed in {time.monotonic() - began:.1f}s", flush=True)
    live = None if args.no_progress else LiveProgress(title=f"polar-env {args.command}")
    try:
        report = bounded_run(run_job(job, live, command=args.command, resume=resume, reqs=reqs))
    finally:
        if live is not None:
            live.stop()
    print_summary(report, out=Path(report["run_dir"]))
    print(f"wrote {report['run_dir']}/: {', '.join(report['files'])}")
    line = interrupt_line(report)
    if line is not None:
        print(line, flush=True)
    code = int(report["interrupted"]["exit_code"]) if line is not None else int(report["statuses"].get("completed", 0) == 0)
    return finish(code)  # the polar-env process itself exits now, nothing of it left running (deadline.py)


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
    return eventloop.run(serve(config, args.host, args.port, store, args.token))


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

    from polar_env.registry import validation_line
    from polar_env.staging.config import task_request
    from polar_env.staging.models import TaskRequest
    from polar_env.staging.submission import submission_body
    from polar_env.tasks.sources import read_rows

    token = _server_token(args)
    config = env_config(args)
    chosen = chosen_settings(config)  # what --config or a flag gave: sent; the rest is the server's
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


