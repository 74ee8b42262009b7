"""``polar-env cluster slurm`` on a real SLURM cluster: Debian's slurmctld and two slurmd, each SLURM
node a host of its own (tests/e2e/slurm.py: network namespaces, each with its own run folder, Ray temp
dir and TMPDIR; no shared disk but the test's own folder). The launcher's batch script, submitted with
``--submit``, starts Ray on both hosts under srun and runs a rollout on them (sessions in real bwrap
sandboxes, the simulated engine playing the README's scripted fix, graded by swebench). One host is
powered off mid-run, slurmd and all: its sessions come back ``node_lost``, the job (``--no-kill``)
finishes on the head with its outputs complete, and ``--resume`` through the launcher again, on the one
host left, completes the run. After each job nothing of it is left running (checked in /proc).
The first tests need no SLURM: what the launcher prints and refuses."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar_env.cli import main
from tests.conftest import require_bwrap, unavailable
from tests.e2e import slurm as slurmlib
from tests.staging.test_readme_script import readme_script
from tests.waits import until_sync

REPO = Path(__file__).resolve().parents[2]
JOB = ["rollout", "--task-id", "toy__calc-1", "--samples", "4", "--harness", "loop", "--runtime", "sandbox"]


# -- the script, without SLURM ---------------------------------------------------------------------

def render(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["cluster", "slurm", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_script_starts_ray_on_every_host_and_runs_the_job_on_the_head(capsys: pytest.CaptureFixture[str]) -> None:
    code, script, _ = render(capsys, "--nodes", "3", "--time", "1:00:00", "--partition", "gpu",
                             "--sbatch=--gres=gpu:1", "--", *JOB, "--out", "runs")
    assert code == 0
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert all(re.match(r"#SBATCH --\S+ +# \S", line) for line in sbatch), sbatch  # every option says why
    for option in ("--nodes=3", "--exclusive", "--no-kill", "--signal=B:TERM@300", "--time=1:00:00",
                   "--partition=gpu", "--gres=gpu:1"):
        assert any(f"#SBATCH {option} " in line for line in sbatch), option
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert len(re.findall(r"^\s*srun ", script, re.M)) == 2 and '--exclude="$HEAD"' in script  # the head's step, the workers' step
    assert "JOB=(rollout --task-id toy__calc-1 --samples 4 --harness loop --runtime sandbox --out runs)" in script
    assert '--nodes="$NHOSTS"' in script and "--ray-node-resource=polar_host" in script
    assert "trap stop_ray EXIT" in script and "trap on_term TERM INT" in script
    assert f"PYTHON={sys.executable}" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # bash parses it


@pytest.mark.parametrize(("job", "said"), [
    (["rollout", "--nodes", "2"], "sets --ray-address, --nodes"),
    (["rollout", "--ray-address=h:1"], "sets --ray-address"),
    (["rollout", "--bogus"], "does not parse"),
    (["build", "--store", "x"], "one of rollout, eval, sft, serve"),
    ([], "give the job after --"),
    (["--nodes", "0", "--", "rollout"], "--nodes 0: must be >= 1"),
    (["--ray-port", "70000", "--", "rollout"], "--ray-port 70000: must be 1..65535"),
])
def test_a_job_the_script_cannot_run_is_refused_in_one_line(capsys: pytest.CaptureFixture[str], job: list[str],
                                                            said: str) -> None:
    code, out, err = render(capsys, *(job if "--" in job else ["--", *job]))
    assert code == 2 and out == "" and said in err.splitlines()[-1], err


# -- on a real SLURM cluster -----------------------------------------------------------------------

@dataclass
class Site:
    slurm: slurmlib.Slurm
    root: Path
    runs: Path  # the run folders' parent: each host has its own copy at this path
    local: Path  # each host's own Ray temp dir and TMPDIR
    env: dict[str, str]

    def head_copy(self, path: Path, host: str = "n1") -> Path:
        """``path`` (one of a host's private folders) as that host's own disk holds it."""
        return self.slurm.nodes[host].disk / path.relative_to("/")

    def launch(self, name: str, nodes: int, *job: str) -> str:
        """``polar-env cluster slurm --submit`` on the login host; the SLURM job id."""
        # the job's TMPDIR (sbatch passes on its environment) is each host's own folder, as a site's prolog makes it
        out = self.slurm.client("env", f"TMPDIR={self.local / 'tmp'}", sys.executable, "-m", "polar_env.cli",
                                "cluster", "slurm", "--nodes", str(nodes),
                                "--submit", "--script", str(self.root / f"{name}.sbatch"), "--chdir", str(self.root),
                                "--output", f"{name}-%j.log", "--ray-tmp", str(self.local / "ray"),
                                "--ray-wait-s", "120", "--", *job, env=self.env, timeout_s=120)
        found = re.search(r"submitted SLURM job (\d+)", out)
        assert found, out
        assert found.group(1) in self.slurm.client("squeue", "-j", found.group(1))  # queued or running
        return found.group(1)

    def log(self, name: str, job_id: str) -> str:
        path = self.root / f"{name}-{job_id}.log"
        return path.read_text() if path.exists() else ""

    def wait_done(self, name: str, job_id: str, timeout_s: float = 420) -> str:
        def done() -> bool:
            return self.slurm.job_state(job_id) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")

        try:
            until_sync(done, f"SLURM job {job_id} to end", timeout_s=timeout_s, poll_s=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log:\n{self.log(name, job_id)}") from None
        return self.slurm.job_state(job_id)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    why = slurmlib.missing()
    if why:
        unavailable(why)
    require_bwrap()
    try:
        import ray  # noqa: F401
        import swebench.harness.grading  # noqa: F401
    except ImportError as exc:
        unavailable(f"{exc.name} is not installed (pip install -e '.[ray,swebench]')")
    root = tmp_path_factory.mktemp("slurm")
    runs = root / "runs"
    local = Path(f"/tmp/psl-{secrets.token_hex(3)}")  # short: Ray's socket paths live under it
    env = {**os.environ, "TMPDIR": str(local / "tmp"), "RAY_USAGE_STATS_ENABLED": "0",
           # a host that stops answering is declared dead in ~3 s, not Ray's default ~30 s
           "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
           "RAY_health_check_failure_threshold": "4"}
    env.pop("PYTEST_CURRENT_TEST", None)
    # the job imports polar_env from this checkout, wherever its install points (the batch script runs in --chdir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    with slurmlib.slurm_cluster(root / "cluster", workers=2, private=[runs, local], env=env) as slurm:
        for host in slurm.nodes.values():  # each host's TMPDIR exists on its own disk
            (host.disk / local.relative_to("/") / "tmp").mkdir(parents=True, exist_ok=True)
        (root / "fix.json").write_text(json.dumps(readme_script()["script"]))
        (root / "engine.yaml").write_text("engine: {kind: simulated, latency_s: 1.0}\n")
        try:
            yield Site(slurm, root, runs, local, slurm.env)
        finally:
            shutil.rmtree(local, ignore_errors=True)


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]


def node_of(row: dict[str, Any]) -> str:
    return str(row["metadata"]["node_id"])


def leftovers(site: Site) -> list[str]:
    """Processes of a SLURM job still alive: anything but slurmd in a SLURM host's cgroup (every process
    a job starts there stays in it: proctrack/linuxproc), or anything anywhere naming the hosts' folders."""
    found = []
    daemons = {p.pid for host in site.slurm.nodes.values() for p in host.procs}  # the `sh` that exec'd slurmd
    pids = {pid for host in site.slurm.nodes.values() for pid in host.pids()} - daemons
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(proc.name) in pids or str(site.local) in argv:
            found.append(f"{proc.name}: {argv[:160]}")
    return found


def journaled(out: Path) -> bool:
    """A node's calls have reached this run folder (the head's copy)."""
    shards = out.glob("*/capture/node-*") if out.exists() else []
    return any(p.stat().st_size for s in shards for p in s.glob("*.jsonl"))


@pytest.mark.slow
def test_cancelling_the_job_stops_the_run_cleanly_and_leaves_nothing_running(site: Site) -> None:
    """``scancel --batch --signal=TERM``: the script asks polar-env to stop once, it writes its outputs,
    then Ray stops on both hosts. A plain ``scancel`` (every process of the job signalled, then killed
    after KillWait) also leaves nothing running. Runs first: the next test takes a host away."""
    out = site.runs / "c"
    job = [*JOB, "--config", str(site.root / "engine.yaml"), "--engine-script", str(site.root / "fix.json"),
           "--out", str(out), "--no-progress"]
    first = site.launch("cancel", 2, *job)
    until_sync(lambda: journaled(site.head_copy(out)), "a journal in the head's run folder", timeout_s=300, poll_s=0.5)
    site.slurm.client("scancel", "--batch", "--signal=TERM", first)
    state = site.wait_done("cancel", first, timeout_s=120)
    log = site.log("cancel", first)
    assert "TERM: asking polar-env to stop" in log and "Ray stopped" in log, log
    assert "second SIGINT" not in log and "second SIGTERM" not in log, log  # asked once, not twice
    run = (site.head_copy(out) / "latest").resolve()
    assert (run / "report.json").exists() and (run / "trajectories.jsonl").exists(), log
    assert state == "FAILED", state  # polar-env's exit code after a stop (130) is the job's
    until_sync(lambda: not leftovers(site), "the cancelled job's processes to be gone", timeout_s=60, poll_s=0.5)
    # a plain scancel while it resumes: SLURM signals and then kills everything; nothing survives it
    second = site.launch("cancel-resume", 2, "rollout", "--resume", str(out / run.name), "--no-progress")
    until_sync(lambda: "polar-env rollout on 2 host(s)" in site.log("cancel-resume", second),
               "the resumed job to start", timeout_s=180, poll_s=0.5)
    site.slurm.client("scancel", second)
    assert site.wait_done("cancel-resume", second, timeout_s=120) == "CANCELLED"
    until_sync(lambda: not leftovers(site), "the scancelled job's processes to be gone",
               timeout_s=slurmlib.KILL_WAIT_S + 60, poll_s=0.5)


@pytest.mark.slow
def test_a_rollout_across_slurm_hosts_survives_a_host_failure_and_resumes(site: Site) -> None:
    out = site.runs / "s"
    began = time.monotonic()
    job = [*JOB, "--config", str(site.root / "engine.yaml"), "--engine-script", str(site.root / "fix.json"),
           "--out", str(out), "--no-progress"]
    first = site.launch("first", 2, *job)
    head_out = site.head_copy(out)
    victim = site.slurm.nodes["n2"]
    spool = victim.disk / site.local.relative_to("/") / "tmp" / "polar-runtimes"

    def journaled_on_victim() -> str | None:  # the node on n2, once its calls have reached the head's run folder
        assert site.slurm.job_state(first) in ("PENDING", "RUNNING", "CONFIGURING"), site.log("first", first)
        on_n2 = {p.name for p in spool.glob("node-*")} if spool.exists() else set()
        shards = head_out.glob("*/capture/node-*") if head_out.exists() else []
        return next((s.name for s in shards if s.name in on_n2 and any(p.stat().st_size for p in s.glob("*.jsonl"))),
                    None)

    until_sync(journaled_on_victim, "the n2 node's journal to reach the head's run folder", timeout_s=300, poll_s=0.5)
    lost = journaled_on_victim()
    victim.power_off()  # the host fails: its slurmd, its job step, its Ray, its sessions, all at once
    state = site.wait_done("first", first)
    log = site.log("first", first)
    assert state == "COMPLETED", log  # --no-kill: the job outlives the host, exit 0
    assert "ray: 2/2 host(s) joined" in log and "Ray stopped" in log, log
    run = (head_out / "latest").resolve()
    report = json.loads((run / "report.json").read_text())
    dead = [n for n, s in {n["node_id"]: n for n in report["nodes"]}.items() if "dead" in s]
    assert dead == [lost], report["nodes"]
    first_rows = rows(run)
    assert len(first_rows) == 4, first_rows
    lost_rows = [t for t in first_rows if node_of(t) == lost]
    assert lost_rows and all(t["failure_kind"] == "node_lost" and t["mask"] for t in lost_rows), lost_rows
    assert all(t["reward"] == 1.0 for t in first_rows if node_of(t) != lost)
    until_sync(lambda: not leftovers(site), "the first job's processes to be gone", timeout_s=60, poll_s=0.5)

    # --resume through the launcher, on the one host left (n2 is down)
    run_path = out / run.name  # the run folder as the head host sees it
    second = site.launch("resume", 1, "rollout", "--resume", str(run_path), "--no-progress")
    state = site.wait_done("resume", second)
    log = site.log("resume", second)
    assert state == "COMPLETED", log
    final = rows(run)
    by_sample = {(t["group_id"], t["sample_index"]): t for t in final}
    assert len(final) == len(by_sample) == 4, [(t["sample_index"], t["status"]) for t in final]
    assert all(t["reward"] == 1.0 for t in final), [(node_of(t), t["status"]) for t in final]
    assert {t["session_id"] for t in final if node_of(t) != lost} >= {t["session_id"] for t in first_rows
                                                                      if node_of(t) != lost}  # kept, not rerun
    until_sync(lambda: not leftovers(site), "the resumed job's processes to be gone", timeout_s=60, poll_s=0.5)
    print(f"slurm e2e: {time.monotonic() - began:.0f}s; node_lost {len(lost_rows)} then resumed; nothing left")
