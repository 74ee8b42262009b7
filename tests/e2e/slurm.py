"""A real SLURM cluster on this machine for tests: Debian's ``slurm-wlm`` daemons, one ``slurmd`` per
test host (tests/e2e/hosts.py: network namespaces on a bridge, each with its own address, disk and
freezer cgroup), ``slurmctld`` on the head host, a private ``munged`` for their authentication.

Why namespaces and not Debian's multiple-slurmd mode: several ``slurmd`` on one address would give
every Ray node the same IP, ports and /tmp, so the job's hosts would not be hosts. Here each SLURM node
is a host as Ray sees one (its own IP and Ray temp dir), and powering one off (its cgroup frozen and
killed, slurmd included) is a node failing. Process tracking is ``proctrack/linuxproc`` with
``task/none``: the cgroup plugins would move job processes into SLURM's own cgroups, out of the host's
freezer cgroup, so powering a host off would miss them (a real cluster uses ``proctrack/cgroup`` and
``task/cgroup``; see docs/slurm.md). Everything lives under one folder and is stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.e2e import hosts as hostlib

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun")
# `ip netns exec` mounts a fresh /sys, hiding /sys/fs/cgroup, and slurmd 22.05 will not start without
# a cgroup filesystem there even with proctrack/linuxproc: mount the v1 hierarchies back, then run it.
CGROUPS = ("mount -t tmpfs cgroup_root /sys/fs/cgroup && for c in cpu cpuacct cpuset memory devices freezer "
           "blkio pids; do mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done "
           "&& mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd "
           '&& exec "$@"')
KILL_WAIT_S = 10  # SIGTERM then SIGKILL after this long on cancel (slurm.conf KillWait)


def missing() -> str | None:
    """Why a SLURM cluster cannot be made here (None: it can)."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return f"{', '.join(absent)} missing (apt-get install -y slurm-wlm munge)"
    return hostlib.missing()


@dataclass
class Slurm:
    root: Path
    conf: Path
    controller: hostlib.Host  # slurmctld; also where sbatch/squeue run (the login host)
    nodes: dict[str, hostlib.Host]  # SLURM node name -> the host its slurmd runs on
    env: dict[str, str]  # SLURM_CONF set: what a client command or a job needs
    munged: subprocess.Popen[bytes]

    def client(self, *argv: str, timeout_s: float = 60, env: dict[str, str] | None = None) -> str:
        """A SLURM client command on the controller host; its stdout (a failure raises with its output)."""
        log = self.root / "clients.log"
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n")
        start = log.stat().st_size
        proc = self.controller.popen(list(argv), env or self.env, log)
        if proc.wait(timeout_s) != 0:
            raise RuntimeError(f"{' '.join(argv)}: rc {proc.returncode}: {log.read_text()[start:]}")
        return log.read_text()[start:]

    def job_state(self, job_id: str) -> str:
        out = self.client("scontrol", "show", "job", "-o", job_id)
        found = re.search(r"JobState=(\S+)", out)
        return found.group(1) if found else "UNKNOWN"

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Every node of the cluster is up and takes work (slurmd registered with slurmctld)."""
        deadline = time.monotonic() + timeout_s
        out = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                out = self.client("sinfo", "-h", "-N", "-o", "%N %t")
                states = dict(line.split() for line in out.splitlines() if line.strip())
                if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle after {timeout_s}s: {out!r}; logs in {self.root}")


def _conf(root: Path, controller: hostlib.Host, nodes: dict[str, hostlib.Host]) -> str:
    lines = [
        "ClusterName=polartest",
        f"SlurmctldHost={socket.gethostname()}({controller.ip})",  # slurmctld checks its own host name
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.socket'}",
        f"StateSaveLocation={root / 'ctld'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd'}-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "SlurmdTimeout=10",  # a host that stops answering is DOWN after 10 s (default 300)
        f"KillWait={KILL_WAIT_S}",
        "InactiveLimit=0",
        "MinJobAge=300",
        *(f"NodeName={name} NodeAddr={host.ip} CPUs={os.cpu_count() or 1} State=UNKNOWN"
          for name, host in nodes.items()),
        f"PartitionName=polar Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def slurm_cluster(root: Path, workers: int, private: Sequence[Path] = (),
                  env: dict[str, str] | None = None) -> Iterator[Slurm]:
    """slurmctld on a controller host and ``workers`` SLURM nodes (n1..nN), each a host whose
    ``private`` folders are its own; all stopped and removed on exit."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    (root / "ctld").mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    with (root / "munged.out").open("wb") as err:
        munged = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={root / 'munge.socket'}",
             f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
             f"--seed-file={root / 'munged.seed'}"], stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        with hostlib.hosts(root / "hosts", workers, private) as made:
            controller, *workers_ = made
            nodes = {f"n{i + 1}": host for i, host in enumerate(workers_)}
            conf = root / "slurm.conf"
            conf.write_text(_conf(root, controller, nodes))
            base = {**(env or os.environ), "SLURM_CONF": str(conf)}
            controller.popen(["slurmctld", "-D", "-i", "-f", str(conf)], base, root / "slurmctld.out")
            for name, host in nodes.items():
                (root / "spool" / name).mkdir(parents=True)
                host.popen(["sh", "-c", CGROUPS, "sh", "slurmd", "-D", "-N", name, "-f", str(conf)], base,
                           root / f"slurmd-{name}.out")
            slurm = Slurm(root, conf, controller, nodes, base, munged)
            slurm.wait_idle()
            yield slurm
    finally:
        munged.terminate()
        try:
            munged.wait(30)
        except subprocess.TimeoutExpired:
            munged.kill()
