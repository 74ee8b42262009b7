"""Ray across hosts that share no disk: a head and two worker hosts (network namespaces on a bridge,
each with its own copy of the run folder's parent, Ray's temp dir, /dev/shm and temp dir; tests/e2e/
hosts.py), one Ray cluster joined by address with token auth, ``polar-env rollout`` and ``serve`` +
``submit`` driven from the head. Gateway nodes run on the worker hosts only (a custom resource), so
every journal, outcome and trajectory that reaches the head's run folder came over Ray
(staging/shipping.py). A worker host powered off mid-run comes back as ``node_lost`` sessions with
their partial calls, the run completes, and ``--resume`` runs them again, nothing lost or counted
twice. A store said to be shared that is not is refused in one line. The engine is the simulated
test double playing the README's scripted fix; sessions run in real bwrap sandboxes and are graded
by swebench."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar_env.journal.store import JournalStore
from tests.conftest import require_bwrap, unavailable
from tests.e2e import hosts as hostlib
from tests.staging.test_readme_script import readme_script
from tests.waits import until_sync

pytestmark = pytest.mark.slow
RESOURCE = "polar_host"
PORT = 6390
RAY = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))  # the ray extra's CLI


@dataclass
class Cluster:
    head: hostlib.Host
    workers: list[hostlib.Host]
    env: dict[str, str]
    root: Path
    runs: Path  # the run folders' parent: the head's own, each worker has its own copy at the same path

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{PORT}"

    def polar(self, *args: str, log: str, timeout_s: float = 300) -> tuple[int, str]:
        """``polar-env ARGS`` on the head; its exit code and output."""
        out = self.root / log
        proc = self.head.popen([sys.executable, "-m", "polar_env.cli", *args], self.env, out)
        try:
            code = proc.wait(timeout_s)
        except BaseException:
            proc.kill()
            raise
        return code, out.read_text()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = hostlib.missing()
    if why:
        unavailable(why)
    require_bwrap()
    try:
        import ray  # noqa: F401
        import swebench.harness.grading  # noqa: F401
    except ImportError as exc:
        unavailable(f"{exc.name} is not installed (pip install -e '.[ray,swebench]')")
    root = tmp_path_factory.mktemp("hosts")
    runs = root / "runs"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0",
           # a host that stops answering is declared dead in ~3 s, not Ray's default ~30 s
           "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
           "RAY_health_check_failure_threshold": "4"}
    # Ray's temp dir (its sockets: short paths) is the head's setting on every host: each has its own copy
    ray_tmp = Path(f"/tmp/polar-ray-{secrets.token_hex(3)}")
    with hostlib.hosts(root, workers=2, private=[runs, ray_tmp]) as made:
        head, *workers = made
        head.run([RAY, "start", "--head", "--node-ip-address", head.ip, "--port", str(PORT), "--num-cpus", "1",
                  "--include-dashboard=false", "--temp-dir", str(ray_tmp)], env, root / "head-ray.log")
        for w in workers:
            w.run([RAY, "start", "--address", f"{head.ip}:{PORT}", "--node-ip-address", w.ip, "--num-cpus", "1",
                   "--resources", json.dumps({RESOURCE: 1})], env, root / f"{w.name}-ray.log")
        (root / "fix.json").write_text(json.dumps(readme_script()["script"]))
        try:
            yield Cluster(head, workers, env, root, runs)
        finally:
            for host in reversed(made):
                host.power_off()
            shutil.rmtree(ray_tmp, ignore_errors=True)


def engine_config(c: Cluster, name: str, latency_s: float) -> str:
    path = c.root / f"{name}.yaml"
    path.write_text(f"engine: {{kind: simulated, latency_s: {latency_s}}}\n")
    return str(path)


def rollout_args(c: Cluster, out: Path, samples: int, latency_s: float, *extra: str) -> list[str]:
    return ["rollout", "--task-id", "toy__calc-1", "--samples", str(samples), "--harness", "loop",
            "--runtime", "sandbox", "--config", engine_config(c, out.name, latency_s),
            "--engine-script", str(c.root / "fix.json"), "--ray-address", c.address, "--nodes", "2",
            "--ray-node-resource", RESOURCE, "--out", str(out), "--no-progress", *extra]


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]


def node_of(row: dict[str, Any]) -> str:
    return str(row["metadata"]["node_id"])


def test_sessions_on_worker_hosts_land_in_the_head_run_folder(cluster: Cluster) -> None:
    out = cluster.runs / "a"
    code, printed = cluster.polar(*rollout_args(cluster, out, 4, 0.05), log="a.log")
    assert code == 0, printed
    run = (out / "latest").resolve()
    report = json.loads((run / "report.json").read_text())
    assert report["mean_reward"] == 1.0, report["session_rows"]
    # each node ran on a worker host, journaling to a spool there that the head pulled
    nodes = {n["node_id"]: n for n in report["nodes"]}
    assert sorted(n["ip"] for n in nodes.values()) == sorted(w.ip for w in cluster.workers)
    assert all(n["spool"] and n["shipped_bytes"] > 0 for n in nodes.values()), nodes
    # every session's journal and outcome is in the head's run folder
    trajectories = rows(run)
    assert len(trajectories) == 4
    for t in trajectories:
        shard = JournalStore(run / "capture" / node_of(t))
        assert len(shard.read(str(t["session_id"]))) >= 2
        assert shard.read_outcome(str(t["session_id"]))["reward"] == 1.0  # type: ignore[index]
    # the worker hosts' own copies of the run folder hold no journal (the spool went with the node)
    for w in cluster.workers:
        own = w.disk / cluster.runs.relative_to("/")
        assert not list(own.rglob("*.jsonl")), w.name
    # the head's copy rebuilds the same trajectories offline
    code, printed = cluster.polar("build", "--store", str(run), "--out", str(cluster.root / "rebuilt.jsonl"),
                                  log="build.log")
    assert code == 0, printed
    rebuilt = [json.loads(x) for x in (cluster.root / "rebuilt.jsonl").read_text().splitlines()]
    assert sorted(r["session_id"] for r in rebuilt) == sorted(str(t["session_id"]) for t in trajectories)


def test_a_store_said_to_be_shared_that_is_not_is_refused(cluster: Cluster) -> None:
    code, printed = cluster.polar(*rollout_args(cluster, cluster.runs / "b", 1, 0.05, "--shared-store"), log="b.log")
    assert code == 2, printed
    lines = [line for line in printed.splitlines() if "not shared" in line]
    assert len(lines) == 1 and "node-0" in lines[0] and "node-1" in lines[0], printed
    assert "Traceback" not in printed


def test_serve_and_submit_from_the_head(cluster: Cluster) -> None:
    """``serve`` on the head with its nodes on the worker hosts; ``submit --wait`` to it; the
    journals of every session are in the head's store when the group is reported done."""
    store = cluster.runs / "serve"
    server = cluster.head.popen([sys.executable, "-m", "polar_env.cli", "serve", "--host", cluster.head.ip,
                                 "--port", "8780", "--store", str(store), "--ray-address", cluster.address,
                                 "--nodes", "2", "--ray-node-resource", RESOURCE, "--harness", "loop",
                                 "--config", engine_config(cluster, "serve", 0.05)], cluster.env,
                                cluster.root / "serve.log")
    try:
        def ready() -> bool:
            log = (cluster.root / "serve.log").read_text()
            assert server.poll() is None, log
            return "polar-env serve ready" in log

        until_sync(ready, "polar-env serve to be ready", timeout_s=180)
        tasks = cluster.root / "echo.jsonl"
        tasks.write_text(json.dumps({"task_id": "echo", "instruction": "run echo hi",
                                     "evaluator": {"name": "output", "regex": "printed"}}) + "\n")
        code, printed = cluster.polar("submit", str(tasks), "--samples", "4", "--harness", "loop", "--wait",
                                      "--server", f"http://{cluster.head.ip}:8780",
                                      "--token-file", str(store / "rollout_token"), log="submit.log")
        assert code == 0, printed
        summary = json.loads(printed.strip().splitlines()[-1])
        assert summary["statuses"] == {"completed": 4} and summary["mean_reward"] == 1.0, summary
        journals = sorted((store / "capture").glob("node-*/*.jsonl"))
        assert len(journals) == 4 and {p.parent.name for p in journals} == {"node-0", "node-1"}
        assert all(p.stat().st_size for p in journals)
        assert len(list((store / "capture").glob("node-*/*.result.json"))) == 4
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.returncode == 0, (cluster.root / "serve.log").read_text()


FAKE_VLLM = """
import sys
from aiohttp import web
from fake_engines import fake_vllm_app

host, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
app = fake_vllm_app()

@web.middleware
async def note(request, handler):
    with open(log, "a") as f:
        f.write(f"{request.remote} {request.path}\\n")
    return await handler(request)

app.middlewares.append(note)
web.run_app(app, host=host, port=port, print=None)
"""


def test_engines_on_another_host_are_reached_by_url(cluster: Cluster) -> None:
    """A vLLM pool of two servers on the head (FakeVLLM, a named test double) serves nodes on the
    worker hosts: each host's node reaches both by URL, across the bridge."""
    servers, urls, logs = [], [], []
    tests_dir = str(Path(__file__).resolve().parents[1])
    for port in (8791, 8792):
        log = cluster.root / f"vllm-{port}.log"
        servers.append(cluster.head.popen([sys.executable, "-c", FAKE_VLLM, cluster.head.ip, str(port), str(log)],
                                          {**cluster.env, "PYTHONPATH": tests_dir}, cluster.root / f"vllm-{port}.out"))
        urls.append(f"http://{cluster.head.ip}:{port}")
        logs.append(log)
    try:
        tasks = cluster.root / "weather.jsonl"
        tasks.write_text(json.dumps({"task_id": "weather", "instruction": "what is the weather in Paris?",
                                     "evaluator": {"name": "session_completion"}}) + "\n")
        code, printed = cluster.polar(
            "rollout", "--tasks", str(tasks), "--samples", "4", "--harness", "loop", "--runtime", "sandbox",
            "--engine", "vllm", "--engine-url", ",".join(urls), "--served-model-name", "qwen3.5-4b", "--canonical",
            "--ray-address", cluster.address,
            "--nodes", "2", "--ray-node-resource", RESOURCE, "--out", str(cluster.runs / "e"), "--no-progress",
            log="e.log")
        assert code == 0, printed
        run = (cluster.runs / "e" / "latest").resolve()
        assert len(list((run / "capture").glob("node-*/*.jsonl"))) == 4
        callers = {line.split()[0] for log in logs for line in log.read_text().splitlines()
                   if line.endswith("/v1/chat/completions")}
        assert callers == {w.ip for w in cluster.workers}, callers  # from the worker hosts, never the head
        assert all(any(line.endswith("/v1/chat/completions") for line in log.read_text().splitlines())
                   for log in logs)  # both servers of the pool took calls
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)


def test_a_host_powered_off_mid_run_comes_back_node_lost_and_resumes(cluster: Cluster) -> None:
    """Runs last: it takes one worker host away for good."""
    out = cluster.runs / "c"
    proc = cluster.head.popen([sys.executable, "-m", "polar_env.cli", *rollout_args(cluster, out, 4, 1.0)],
                              cluster.env, cluster.root / "c.log")
    def journaled() -> str | None:  # a node one of whose calls reached the head whole (a line ends) as the run goes
        shards = out.glob("*/capture/node-*") if out.exists() else []
        return next((s.name for s in shards if any(b"\n" in p.read_bytes() for p in s.glob("*.jsonl"))), None)

    until_sync(journaled, "a node's journal to reach the head's run folder", timeout_s=240)
    lost = journaled()
    assert lost is not None
    # the host that runs that node: its spool is on that host's disk
    victim = next(w for w in cluster.workers if (w.disk / "tmp" / "polar-runtimes" / lost).exists())
    victim.power_off()
    assert proc.wait(300) == 0, (cluster.root / "c.log").read_text()
    run = (out / "latest").resolve()
    report = json.loads((run / "report.json").read_text())
    report_nodes = {n["node_id"]: n for n in report["nodes"]}
    dead = [n for n, s in report_nodes.items() if "dead" in s]
    assert len(dead) == 1, report_nodes
    first = rows(run)
    lost_rows = [t for t in first if node_of(t) == dead[0]]
    assert lost_rows and all(t["failure_kind"] == "node_lost" and t["mask"] for t in lost_rows), lost_rows
    assert any(t["traces"] for t in lost_rows)  # their partial calls, from what the head had pulled
    assert all(t["reward"] == 1.0 for t in first if node_of(t) != dead[0])
    # --resume runs the lost sessions again on the host that is left (one node now)
    code, printed = cluster.polar("rollout", "--resume", str(run), "--nodes", "1", "--ray-address", cluster.address,
                                  "--no-progress", log="c-resume.log")
    assert code == 0, printed
    final = rows(run)
    by_sample = {(t["group_id"], t["sample_index"]): t for t in final}
    assert len(final) == len(by_sample) == 4, [(t["sample_index"], t["status"]) for t in final]
    assert all(t["reward"] == 1.0 for t in final), [(node_of(t), t["status"]) for t in final]
    # two nodes on the one host left that offers the resource: waited for (a progress line per poll) up to
    # --ray-wait-s, then refused in one line, not left waiting
    code, printed = cluster.polar(*rollout_args(cluster, cluster.runs / "d", 1, 0.05, "--ray-wait-s", "3"), log="d.log")
    assert code == 2 and "offer 1 unit(s), 2 node(s) need 2; pass --nodes 1" in printed, printed
    assert "waiting for Ray hosts: 1 of 2 unit(s)" in printed and "after 3 s" in printed, printed
