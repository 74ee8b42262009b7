"""``slime-args``, ``sft``, ``train`` and ``dashboard``: trainers and viewers over the rollout job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from polar_env import eventloop
from polar_env.cli.checks import add_command
from polar_env.cli.options import literal_values
from polar_env.cli.resume import job_and_resume
from polar_env.cli.rollout import add_job_options


def cmd_slime_args(args: argparse.Namespace) -> int:
    """Print the slime launch a recipe stands for; write the files it names; --run launches it."""
    import importlib.util
    import os
    import subprocess

    from polar_env.integrations.slime_recipe import Recipe, render

    launch = render(Recipe.from_yaml(args.recipe), Path(args.out))
    launch.write_files()
    script = Path(args.out).resolve() / "launch_slime.sh"
    script.write_text(launch.script)
    print(json.dumps(launch.flags) if args.argv else launch.script, end="" if not args.argv else "\n")
    if not args.run:
        print(f"# wrote {script} and {len(launch.files)} file(s) in {Path(args.out).resolve()}", file=sys.stderr)
        return 0
    slime_dir = os.environ.get("SLIME_DIR")
    if importlib.util.find_spec("slime") is None and not (slime_dir and Path(slime_dir, "train.py").is_file()):
        print("polar-env slime-args --run: slime is not installed here (import slime fails and $SLIME_DIR has no "
              "train.py); git clone https://github.com/THUDM/slime and pip install -e slime --no-deps, or run "
              "inside the slimerl/slime image", file=sys.stderr)
        return 2
    return subprocess.call(["bash", str(script)])


def cmd_sft(args: argparse.Namespace) -> int:
    """Roll tasks out, keep the evaluator-accepted sessions, export SFT rows, print the table."""
    from polar_env.integrations.sft import export_job
    from polar_env.journal.store import JournalStore
    from polar_env.preflight import check_job, check_job_options
    from polar_env.staging.job import interrupt_line, run_job
    from polar_env.staging.progress import LiveProgress
    from polar_env.staging.runs import Plan

    check_job_options(args)
    job, resume = job_and_resume(args)
    reqs = check_job(job, "sft")
    print(f"polar-env sft: {job.samples} sample(s) per task; {job.env.engine.describe()}; "
          f"harness {job.env.harness}; {f'resuming {resume}' if resume else f'output {job.out}/<run id>'}", flush=True)
    live = None if args.no_progress else LiveProgress(title="polar-env sft")
    try:
        report = eventloop.run(run_job(job, live, command="sft", resume=resume, reqs=reqs))
    finally:
        if live is not None:
            live.stop()
    run_dir = Path(report["run_dir"])
    line = interrupt_line(report)
    if line is not None:
        print(line, flush=True)
        return int(report["interrupted"]["exit_code"])
    repo_of = {r.task_id: str(r.task.get("repo") or r.task_id) for r in Plan.read(run_dir).requests}
    summary = export_job(run_dir, repo_of, open_journal=JournalStore, min_reward=args.min_reward)
    print(summary.table())
    print(f"wrote {run_dir}/: {', '.join(summary.files)}")
    return 0 if summary.rows else 1


def _add_trainer_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "slime-args", "a slime recipe YAML -> the exact slime launch (bash script)")
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("--out", default="slime_run", help="folder for polar.yaml, the custom config and launch_slime.sh")
    p.add_argument("--argv", action="store_true", help="print the flags as a JSON list instead of the script")
    p.add_argument("--run", action="store_true", help="launch it (needs slime installed, or $SLIME_DIR)")
    p.set_defaults(func=cmd_slime_args)

    p = add_command(sub, "sft", "offline SFT data: roll out, keep evaluator-accepted sessions, export JSONL + Parquet")
    add_job_options(p, samples=4)
    p.add_argument("--min-reward", type=float, default=1.0,
                   help="acceptance for evaluators without a resolved verdict (swebench: resolved)")
    p.set_defaults(func=cmd_sft)


def cmd_train(args: argparse.Namespace) -> int:
    from polar_env.preflight import check_recipe
    from polar_env.train.command import run_train

    overrides = {"seed": args.seed, "steps": args.steps, "control": True if args.control else None, "out_dir": args.out_dir}
    check_recipe(Path(args.recipe), overrides)
    return run_train(Path(args.recipe), overrides, tracker=args.tracker)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from polar_env.dashboard.command import run_dashboard

    return run_dashboard(args.paths, args.host, args.port, args.token, args.server, args.server_token)


def _add_dashboard_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = "web dashboard over run folders, capture stores or a live rollout server (runs, live, sessions, traces)"
    p = add_command(sub, "dashboard", text)
    p.add_argument("paths", nargs="*", help="run folders (polar-env rollout --out), capture stores, or folders of them")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (anything but loopback requires a token)")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    p.add_argument("--token", help="access token (generated and printed when --host is not loopback)")
    p.add_argument("--server", help="also show a live polar-env serve (its URL)")
    p.add_argument("--server-token", help="that server's bearer token")
    p.set_defaults(func=cmd_dashboard)


def _add_train_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = "reference GRPO loop on CPU: rollouts, step-0 check, update, weight sync, run report"
    p = add_command(sub, "train", text)
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/cpu_grpo_toy.yaml")
    p.add_argument("--seed", type=int, help="override the recipe's seed")
    p.add_argument("--steps", type=int, help="override the recipe's number of steps")
    p.add_argument("--control", action="store_true", help="shuffled-reward control run")
    p.add_argument("--out-dir", help="report directory (default: the recipe's out_dir)")
    p.add_argument("--tracker", choices=literal_values("tracker"),  # the rollout job's trackers: one set
                   help="also log each step there (W&B offline by default)")
    p.set_defaults(func=cmd_train)


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_trainer_commands(sub)
    _add_train_command(sub)
    _add_dashboard_command(sub)
