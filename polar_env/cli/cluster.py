"""``cluster slurm``: the batch script that runs a polar-env job across a SLURM allocation (printed,
or submitted with ``--submit``); the script itself is ``staging/slurm.py``'s, explained in docs/slurm.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from polar_env.cli.checks import HelpFormatter, add_command


def cmd_slurm(args: argparse.Namespace) -> int:
    from polar_env.errors import ConfigError
    from polar_env.staging.slurm import SlurmJob, check_job_args, render, submit

    job = list(args.job)
    if job[:1] == ["--"]:
        job = job[1:]
    check_job_args(job)
    try:
        args.commands[job[0]].parse_args(job[1:])  # the job command's own parser (polar-env's subcommands)
    except SystemExit as exc:  # argparse already printed what is wrong with the job's flags
        raise ConfigError(f"the job after -- does not parse: polar-env {' '.join(job)}") from exc
    spec = SlurmJob(job=tuple(job), nodes=args.nodes, time=args.time, partition=args.partition, account=args.account,
                    job_name=args.job_name, output=args.output, chdir=Path(args.chdir).resolve(), grace_s=args.grace_s,
                    ray_port=args.ray_port, ray_wait_s=args.ray_wait_s, ray_tmp=args.ray_tmp, sbatch=tuple(args.sbatch))
    script = render(spec)
    if not args.submit:
        print(script, end="")
        return 0
    path = Path(args.script).resolve()
    job_id = submit(script, path)
    print(f"submitted SLURM job {job_id} ({path}); its output: {spec.chdir / args.output.replace('%j', job_id)}")
    print(f"  follow: squeue -j {job_id}   stop cleanly: scancel --batch --signal=TERM {job_id}")
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "cluster", "launch a polar-env job across the hosts of a cluster's allocation")
    kinds = p.add_subparsers(dest="cluster", required=True, metavar="KIND", help="the scheduler: slurm")
    s = kinds.add_parser("slurm", formatter_class=HelpFormatter,
                         help="the SLURM batch script for a job: Ray on every allocated host, the job on the first",
                         description="Print (or --submit) a SLURM batch script that starts Ray on every host of its "
                                     "allocation and runs the polar-env job given after -- on the first, one gateway "
                                     "node per host. e.g. polar-env cluster slurm --nodes 4 --time 2:00:00 -- rollout "
                                     "--tasks tasks.jsonl --out runs")
    s.add_argument("--nodes", type=int, default=2, help="hosts to allocate; the job gets one gateway node on each")
    s.add_argument("--time", help="SLURM time limit (e.g. 2:00:00); the job is asked to stop --grace-s before it")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--job-name", help="SLURM job name (default: polar-<command>)")
    s.add_argument("--output", default="polar-%j.log", help="the batch script's log, relative to --chdir (%%j: job id)")
    s.add_argument("--chdir", default=".", help="the job's working folder on the head host (relative --out is from here)")
    s.add_argument("--grace-s", type=int, default=300, help="seconds before the time limit at which the job is stopped")
    s.add_argument("--ray-port", type=int, default=6379, help="the Ray head's port")
    s.add_argument("--ray-wait-s", type=int, default=300, help="every host must join Ray within this")
    s.add_argument("--ray-tmp", default="/tmp", help="a local folder on every host for Ray's temp dir (keep it short)")
    s.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="one more #SBATCH option, e.g. --sbatch=--gres=gpu:1 (repeatable)")
    s.add_argument("--submit", action="store_true", help="write the script to --script and sbatch it")
    s.add_argument("--script", default="polar-slurm.sbatch", help="where --submit writes the script")
    s.add_argument("job", nargs=argparse.REMAINDER, help="-- then the polar-env job: rollout|eval|sft|serve FLAGS")
    s.set_defaults(func=cmd_slurm, commands=sub.choices)
