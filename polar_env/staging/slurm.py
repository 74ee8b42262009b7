"""The SLURM launcher: one batch script that runs a polar-env job on the hosts of its allocation.

Inside the allocation the script finds the hosts (``scontrol show hostnames``), starts the Ray head on
the first (where SLURM runs the batch script) and one Ray worker per other host under ``srun``, each
with one unit of ``polar_host`` so one gateway node lands on each host, waits until every host has
joined, runs the job on the head with ``--ray-address``, ``--nodes`` = hosts and
``--ray-node-resource polar_host``, and on any exit stops Ray on every host. The script is generated
(not a fixed file in the package) so it carries this install's paths and the job's own flags, and
reads top to bottom; docs/slurm.md explains each line.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from polar_env.errors import ConfigError

RESOURCE = "polar_host"
COMMANDS = ("rollout", "eval", "sft", "serve")  # the jobs that take --ray-address / --nodes
SET_HERE = ("--ray-address", "--nodes", "--ray-node-resource", "--ray", "--local")  # the script sets these


@dataclass(frozen=True)
class SlurmJob:
    job: tuple[str, ...]  # the polar-env command and its flags, e.g. ("rollout", "--tasks", "t.jsonl")
    nodes: int = 2
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    output: str = "polar-%j.log"
    chdir: Path = field(default_factory=Path.cwd)
    grace_s: int = 300
    ray_port: int = 6379
    ray_wait_s: int = 300
    ray_tmp: str = "/tmp"  # each host's own local folder for Ray's temp dir (short: Ray's socket paths)
    python: str = sys.executable
    sbatch: tuple[str, ...] = ()  # more #SBATCH lines, as given (e.g. "--gres=gpu:1")

    def __post_init__(self) -> None:
        for flag, value, low, high in (("--nodes", self.nodes, 1, None), ("--grace-s", self.grace_s, 0, None),
                                       ("--ray-port", self.ray_port, 1, 65535), ("--ray-wait-s", self.ray_wait_s, 1, None)):
            if value < low or (high is not None and value > high):
                bound = f"{low}..{high}" if high is not None else f">= {low}"
                raise ConfigError(f"{flag} {value}: must be {bound}")


def check_job_args(job: Sequence[str]) -> None:
    """The pass-through is a polar-env job command without the flags the script sets (that its flags
    parse is checked by the CLI, cli/cluster.py: this layer does not import the CLI)."""
    if not job or job[0] not in COMMANDS:
        raise ConfigError(f"give the job after --, e.g. `-- rollout --tasks tasks.jsonl`; one of {', '.join(COMMANDS)}")
    taken = [a for a in job if a.split("=", 1)[0] in SET_HERE]
    if taken:
        raise ConfigError(f"{' '.join(taken)}: the batch script sets --ray-address, --nodes (one per host) and "
                          "--ray-node-resource itself; drop them")


def ray_cli(python: str) -> str:
    """The ``ray`` of this install (beside its Python), else the one on PATH."""
    beside = Path(python).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def sbatch_lines(job: SlurmJob) -> list[str]:
    """The ``#SBATCH`` lines, each with why it is there."""
    name = job.job_name or f"polar-{job.job[0]}"
    lines = [
        (f"--job-name={name}", "the name squeue shows"),
        (f"--nodes={job.nodes}", "hosts: one gateway node each (the job's --nodes)"),
        ("--ntasks-per-node=1", "one Ray process per host (the srun steps below)"),
        ("--exclusive", "whole hosts: Ray's ports and the sessions' CPUs are this job's alone"),
        ("--no-kill", "a host that fails does not end the job: its sessions end node_lost, the rest finish"),
        (f"--signal=B:TERM@{job.grace_s}", f"TERM to this script {job.grace_s} s before the time limit: "
                                             "the run stops cleanly, --resume finishes it"),
        (f"--output={job.output}", "this script's output (Ray's start, the job's progress), on the head host"),
        (f"--chdir={job.chdir}", "the job's relative paths (--out, --tasks, --config) are from here, on the head"),
    ]
    if job.time:
        lines.append((f"--time={job.time}", "the time limit; the run stops grace seconds before it"))
    if job.partition:
        lines.append((f"--partition={job.partition}", "the partition to run in"))
    if job.account:
        lines.append((f"--account={job.account}", "the account charged"))
    lines += [(extra if extra.startswith("-") else f"--{extra}", "given with --sbatch") for extra in job.sbatch]
    width = max(len(flag) for flag, _ in lines) + 1
    return [f"#SBATCH {flag:<{width}}# {why}" for flag, why in lines]


def render(job: SlurmJob) -> str:
    """The batch script for ``job``."""
    check_job_args(job.job)
    job_args = " ".join(shlex.quote(a) for a in job.job)
    head = ["#!/bin/bash",
            f"# Generated by `polar-env cluster slurm` for: polar-env {job_args}",
            "# polar-env on the hosts of one SLURM allocation: Ray head on the first host, one Ray worker per",
            "# other host (one polar_host unit each: one gateway node per host), the job on the head. docs/slurm.md",
            *sbatch_lines(job)]
    return "\n".join(head) + "\n" + BODY.format(
        python=shlex.quote(job.python), ray=shlex.quote(ray_cli(job.python)), port=job.ray_port,
        wait_s=job.ray_wait_s, ray_tmp=shlex.quote(job.ray_tmp), job_args=job_args, resource=RESOURCE, command=job.job[0])


def submit(script: str, path: Path) -> str:
    """Write the script to ``path`` and submit it; SLURM's job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: run this on a SLURM login host (or print the script without --submit)")
    path.write_text(script)
    path.chmod(0o755)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"sbatch {path}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip().split(";")[0]


BODY = r"""set -uo pipefail

PYTHON={python}  # this polar-env install: the same path on every host
RAY={ray}
RAY_PORT={port}
RAY_TMP={ray_tmp}/polar-ray-$SLURM_JOB_ID  # Ray's sockets and logs, on each host's own disk
RAY_WAIT_S={wait_s}  # every host must join Ray within this
RAY_RESOURCES='{{"{resource}": 1}}'  # one gateway node per host
JOB=({job_args})
export PYTHON RAY RAY_PORT RAY_TMP RAY_RESOURCES

log() {{ echo "[polar-slurm $(date +%H:%M:%S)] $*"; }}

# The allocation's hosts; SLURM runs this script on the first, which is Ray's head.
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${{HOSTS[0]}}
NHOSTS=${{#HOSTS[@]}}
# A host's address as SLURM reaches it (its NodeAddr), as an IP for Ray.
node_ip() {{ getent ahostsv4 "$(scontrol show node "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)" | awk '{{print $1; exit}}'; }}
HEAD_IP=$(node_ip "$HEAD")
export HEAD_IP
# This job's Ray only: a fresh token, which every srun step below inherits; nothing else can join.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
export RAY_USAGE_STATS_ENABLED=0
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0  # at the end nothing is left to drain: stop at once
log "job $SLURM_JOB_ID: ${{NHOSTS}} host(s): ${{HOSTS[*]}}; head $HEAD ($HEAD_IP:$RAY_PORT)"

STEPS=() POLAR= STOPPING=
stop_ray() {{  # on every exit: TERM to the Ray steps, on every host (`ray start --block` stops its Ray on TERM)
  local code=$? start=$SECONDS
  trap - EXIT TERM INT
  log "stopping Ray on ${{NHOSTS}} host(s)"
  # scancel --signal reaches every step but this script's; TERM to srun itself would SIGKILL its tasks
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null
  for pid in "${{STEPS[@]}}"; do  # Ray stops in about a second; a host that died never answers
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - start < 30 )); do sleep 0.2; done
  done
  kill -TERM "${{STEPS[@]}}" 2>/dev/null  # a step still there after 30 s (its host died): srun ends it
  rm -rf "$RAY_TMP"  # the head's; the other hosts keep theirs (Ray's logs) for the site's /tmp clean-up
  log "Ray stopped in $(( SECONDS - start ))s; exit $code"  # whatever is left, SLURM ends with the job
  exit "$code"
}}
on_term() {{  # scancel --batch --signal=TERM, or the time limit's --signal: the job stops cleanly once
  [ -n "$STOPPING" ] && return
  STOPPING=1
  if [ -z "$POLAR" ]; then log "TERM before the job started"; exit 143; fi
  log "TERM: asking polar-env to stop (it writes its outputs; --resume finishes the run)"
  kill -INT "$POLAR" 2>/dev/null
}}
trap stop_ray EXIT
trap on_term TERM INT

# The Ray head, on this host, in its own step; it offers one polar_host unit (a gateway node) too.
srun --nodes=1 --ntasks=1 --nodelist="$HEAD" --overlap --input=none \
  "$RAY" start --block --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" --temp-dir="$RAY_TMP" \
  --include-dashboard=false --resources="$RAY_RESOURCES" &
STEPS+=($!)

hosts_joined() {{  # how many hosts offer a polar_host unit in this job's Ray (0 while the head starts)
  "$PYTHON" -c '
import os, ray
ray.init(address=os.environ["HEAD_IP"] + ":" + os.environ["RAY_PORT"], logging_level="ERROR", log_to_driver=False)
print(int(sum(n["Resources"].get("{resource}", 0) for n in ray.nodes() if n["Alive"])))' 2>/dev/null || echo 0
}}
wait_for() {{  # $1 hosts: poll at 1, 2, 4, 8, 8... s, one line per poll; fail when a Ray step exits or time is up
  local want=$1 start=$SECONDS delay=1 have=0
  while :; do
    have=$(hosts_joined)
    log "ray: $have/$want host(s) joined after $(( SECONDS - start ))s"
    (( have >= want )) && return 0
    for pid in "${{STEPS[@]}}"; do
      kill -0 "$pid" 2>/dev/null || {{ log "ray: a Ray step exited (see its lines above)"; return 1; }}
    done
    (( SECONDS - start >= RAY_WAIT_S )) && {{ log "ray: $have/$want host(s) after ${{RAY_WAIT_S}}s; giving up"; return 1; }}
    sleep "$delay"
    (( delay < 8 )) && delay=$(( delay * 2 ))
  done
}}
wait_for 1 || exit 1

# One Ray worker per other host, all in one step; --no-kill: a host that fails leaves the others running.
if (( NHOSTS > 1 )); then
  export -f node_ip
  srun --nodes=$(( NHOSTS - 1 )) --ntasks=$(( NHOSTS - 1 )) --ntasks-per-node=1 --exclude="$HEAD" --overlap --no-kill --input=none \
    bash -c 'exec "$RAY" start --block --address="$HEAD_IP:$RAY_PORT" --node-ip-address="$(node_ip "$SLURMD_NODENAME")" \
      --resources="$RAY_RESOURCES"' &
  STEPS+=($!)
  wait_for "$NHOSTS" || exit 1
fi

# The job, on the head: TERM from SLURM is ignored by it (the trap above turns it into one INT, so a
# scancel that signals every process does not count twice); its exit code is the script's.
log "polar-env {command} on ${{NHOSTS}} host(s)"
( trap '' TERM; trap - INT
  exec "$PYTHON" -m polar_env.cli "${{JOB[@]}}" --ray-address="$HEAD_IP:$RAY_PORT" --nodes="$NHOSTS" \
    --ray-node-resource={resource} ) &
POLAR=$!
wait "$POLAR"
code=$?
while kill -0 "$POLAR" 2>/dev/null; do wait "$POLAR"; code=$?; done  # a trapped TERM interrupts wait: wait again
exit "$code"
"""
