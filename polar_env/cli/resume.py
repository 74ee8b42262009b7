"""``--resume RUN_DIR`` for ``rollout``, ``eval`` and ``sft``: the run's plan with the flags given on top."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from polar_env.cli.options import job_from_args, job_values

if TYPE_CHECKING:
    from polar_env.staging.job import RolloutJob


def job_and_resume(args: argparse.Namespace) -> tuple[RolloutJob, Path | None]:
    """The job to run and, with ``--resume``, the run folder: the run's plan with the flags given on
    top (they must not change what the run produces; one line and exit 2 when they do)."""
    if not args.resume:
        return job_from_args(args), None
    from polar_env.staging.job import check_resume
    from polar_env.staging.runs import Plan, resolve_run

    run_dir = resolve_run(Path(args.resume))
    plan = Plan.read(run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flags = argparse.Namespace(**vars(args))
        if not args.config:  # the plan's environment is the base the flags apply to, as --config would be
            flags.config = str(Path(tmp) / "plan_env.yaml")
            Path(flags.config).write_text(json.dumps(plan.job["env"]))
        given = job_from_args(flags).model_dump(mode="json")
    job = {**plan.job, "env": given["env"], **{f: given[f] for f in job_values(args)}}  # the job flags given
    return check_resume(run_dir, args.command, job), run_dir
