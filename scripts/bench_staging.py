"""Staged pipeline vs a sequential loop, and aggregate gateway throughput for 1, 2 and 4 nodes.

Part 1 (in-process, same run, same node code): sessions with simulated stage costs INIT:RUNNING:
POSTRUN = 1:2:1 (±30% jitter): INIT prepares a SimulatedRuntime (a test double), RUNNING is the
built-in loop harness doing two turns through the real gateway against the simulated engine (a test
double with a fixed latency), POSTRUN runs an evaluator that costs one unit. The *sequential loop*
runs each session start to end in one of ``slots`` workers (setup and grading hold the slot, as
in a plain ``for`` loop per worker); the *staged* pipeline runs the same sessions through the
node's pools (INIT and POSTRUN have their own workers; READY buffers prepared runtimes). Printed:
RUNNING-slot occupancy (time-integrated sessions in RUNNING / slots), engine slot utilization
(time-integrated in-flight calls / slots) and engine-busy fraction (time with ≥1 call in flight),
whole run and steady state (first to last RUNNING start), CPU seconds of the node process and of its
worker processes (forkserver, POSTRUN and evaluation workers), and the speed-up. Target: ≥95% staged.

Part 2 (Ray): N node actors, each its own process with its own gateway in front of one mock
vLLM-shaped engine process (the bench_gateway body: 4k prompt ids, 1k response ids + logprobs,
``--engine-ms`` per call); load generator processes drive sessions sharded over the nodes' ports.
Printed: aggregate requests/s per node count and the ratio to one node. All processes share this
machine's cores, so the ratio is bounded by them (`nproc`).

    python scripts/bench_staging.py [--sessions 160] [--slots 8] [--unit-s 0.1] [--skip-ray]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from polar_env.engines.config import SimulatedEngineConfig, VLLMEngineConfig  # noqa: E402
from polar_env.evaluators import EvalContext, EvalResult, register_evaluator  # noqa: E402
from polar_env.harnesses import loop  # noqa: E402
from polar_env.staging.models import AgentSpec, SessionStatus, Stage, TaskRequest  # noqa: E402
from polar_env.staging.node import GatewayNode, NodeConfig  # noqa: E402
from polar_env.staging.pools import Occupancy, PoolLimits  # noqa: E402
from polar_env.staging.server import LocalNode, RolloutServer, session_ids  # noqa: E402
from polar_env.testing.simulated_runtime import SimulatedRuntime  # noqa: E402

JITTER = 0.3


class SimulatedCostNode(GatewayNode):
    """A GatewayNode whose runtimes are SimulatedRuntimes (test doubles) with INIT cost ``unit_s``."""

    def __init__(self, config: NodeConfig, unit_s: float) -> None:
        super().__init__(config)
        self.unit_s = unit_s

    def make_runtime(self, spec: Any, session_id: str, **options: Any) -> Any:
        return SimulatedRuntime(spec, prepare_s=self.unit_s, jitter=JITTER, seed=hash(session_id) & 0xFFFF)


def register_cost_evaluator(unit_s: float) -> None:
    import random

    rng = random.Random(1)

    @register_evaluator("simulated_cost", replace=True)
    async def simulated_cost(ctx: EvalContext) -> EvalResult:
        await asyncio.sleep(unit_s * (1 + JITTER * (2 * rng.random() - 1)))
        return EvalResult(reward=1.0, report={"reason": "simulated grading cost"})


def node_config(args: argparse.Namespace, store: Path, slots: int, staged: bool) -> NodeConfig:
    # RUNNING = two engine calls of unit_s each (the loop's tool call runs instantly): 2 units
    limits = (PoolLimits(max_running=slots, max_init=slots, max_postrun=slots, ready_buffer=2 * slots) if staged
              else PoolLimits(max_running=slots, max_init=slots, max_postrun=slots, ready_buffer=slots))
    return NodeConfig(engine=SimulatedEngineConfig(latency_s=args.unit_s, jitter=JITTER),
                      store=store, limits=limits, tcp_port=None)


def request(n: int) -> TaskRequest:
    return TaskRequest(task_id="bench", instruction="run echo hi", num_samples=n, agent=AgentSpec(harness="loop"),
                       evaluator={"name": "simulated_cost"}, continuation=False)


def workers_cpu_s() -> float:
    """CPU seconds of this process's live descendants (the node's forkserver and worker processes),
    read from /proc before they are stopped; 0 where there is no /proc."""
    parents: dict[int, list[tuple[int, float]]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append((int(entry), (int(fields[11]) + int(fields[12])) / tick))
    total, todo = 0.0, [os.getpid()]
    while todo:
        for pid, cpu in parents.get(todo.pop(), []):
            total += cpu
            todo.append(pid)
    return total


async def staged_run(args: argparse.Namespace, store: Path) -> dict[str, float]:
    node = SimulatedCostNode(node_config(args, store, args.slots, staged=True), args.unit_s)
    await node.start()
    server = RolloutServer([LocalNode(node)])
    before = workers_cpu_s()
    started, cpu = time.monotonic(), time.process_time()
    status = await server.run(request(args.sessions))
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    workers = workers_cpu_s() - before
    stats = node.stats()
    steady = steady_state(status.results, args.slots)
    await server.aclose()
    assert all(r.status is SessionStatus.COMPLETED for r in status.results), [r.failure_detail for r in status.results][:3]
    return {"wall_s": wall, "occupancy": stats["running_occupancy"], "slot_util": stats["engine_slot_utilization"],
            "busy": stats["engine_busy_fraction"], "cpu_s": cpu, "workers_cpu_s": workers, **steady}


def steady_state(results: list[Any], slots: int) -> dict[str, float]:
    """RUNNING occupancy between the first and the last RUNNING start (no ramp-up, no drain)."""
    starts = sorted(r.stage_times["running"] for r in results)
    lo, hi = starts[0], starts[-1]
    area = 0.0
    for r in results:
        a, b = r.stage_times["running"], r.stage_times["postrun"]
        area += max(0.0, min(b, hi) - max(a, lo))
    return {"steady_occupancy": area / ((hi - lo) * slots) if hi > lo else 0.0}


async def sequential_run(args: argparse.Namespace, store: Path) -> dict[str, float]:
    """Each of ``slots`` workers takes the next session and does INIT, RUNNING and POSTRUN itself."""
    from polar_env.evaluators import run_evaluator
    from polar_env.staging.models import SessionSpec

    node = SimulatedCostNode(node_config(args, store, args.slots, staged=False), args.unit_s)
    await node.start()
    occupancy = Occupancy()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for sid in session_ids("seq", args.sessions):
        queue.put_nowait(sid)
    req = request(1)
    runs: list[dict[str, float]] = []

    async def worker() -> None:
        while not queue.empty():
            sid = queue.get_nowait()
            spec = SessionSpec(session_id=sid, sample_index=0, group_id="seq", request=req)
            await node.open_session(spec, {})
            runtime = await node.prepare_runtime(spec)
            occupancy.move(None, Stage.RUNNING)
            t0 = time.time()
            await loop.run_loop_agent(runtime, socket=node.socket, base_url="http://gateway",
                                      key=node.session(sid).key, model=node.model, prompt=req.instruction,
                                      settings=loop.LoopSettings())
            t1 = time.time()
            occupancy.move(Stage.RUNNING, None)
            await run_evaluator("simulated_cost", EvalContext(task={}))
            await runtime.stop()
            node.close_session(sid)
            runs.append({"running": t0, "postrun": t1})

    before = workers_cpu_s()
    started, cpu = time.monotonic(), time.process_time()
    occupancy.started = started
    await asyncio.gather(*(worker() for _ in range(args.slots)))
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    workers = workers_cpu_s() - before
    stats = node.stats()
    await node.stop()

    class R:
        def __init__(self, d: dict[str, float]) -> None:
            self.stage_times = d

    return {"wall_s": wall, "occupancy": occupancy.mean(Stage.RUNNING, started) / args.slots,
            "slot_util": stats["engine_slot_utilization"], "busy": stats["engine_busy_fraction"],
            "cpu_s": cpu, "workers_cpu_s": workers, **steady_state([R(d) for d in runs], args.slots)}


# -- part 2: gateway throughput over Ray node actors ---------------------------------------------

def load_process(urls_keys: list[tuple[str, str]], concurrency: int, seconds: float, spread_s: float, out: Any) -> None:
    import aiohttp
    import orjson

    body = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "go " * 200}]})

    async def run() -> int:
        done = 0
        deadline = time.perf_counter() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def client(i: int) -> None:
                nonlocal done
                url, key = urls_keys[i % len(urls_keys)]
                headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
                await asyncio.sleep(spread_s * i / concurrency)
                while time.perf_counter() < deadline:
                    async with s.post(url, data=body, headers=headers) as r:
                        await r.read()
                        if r.status == 200:
                            done += 1
            await asyncio.gather(*(client(i) for i in range(concurrency)))
        return done

    out.put(asyncio.run(run()))


async def ray_throughput(args: argparse.Namespace) -> list[tuple[int, float]]:
    import subprocess

    import ray
    from bench_gateway import free_port, wait_port

    from polar_env.staging.cluster import ClusterConfig, start_cluster

    engine_port = free_port()
    mock = subprocess.Popen([sys.executable, str(Path(__file__).with_name("bench_gateway.py")), "--serve-engine",
                             str(engine_port), "--engine-ms", str(args.engine_ms)])
    rows = []
    try:
        wait_port(engine_port)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
        for n in (1, 2, 4):
            store = Path(tempfile.mkdtemp(prefix="polar-bench-ray-"))
            node = NodeConfig(engine=VLLMEngineConfig(url=f"http://127.0.0.1:{engine_port}", model="bench"),
                              store=store, tcp_port=0)
            cluster = await start_cluster(ClusterConfig(nodes=n, ray=True, node=node))
            try:
                targets = []
                for i, actor in enumerate(cluster.actors):
                    opened = await actor.open_external.remote([f"load-{i}-{j}" for j in range(args.concurrency // n)])
                    targets += [(f"http://127.0.0.1:{o['port']}/v1/chat/completions", o["key"]) for o in opened]
                ctx = multiprocessing.get_context("spawn")
                q = ctx.Queue()
                procs = [ctx.Process(target=load_process, args=(targets[p::args.load_procs], args.concurrency // args.load_procs,
                                                                args.seconds, args.engine_ms / 1000, q))
                         for p in range(args.load_procs)]
                for p in procs:
                    p.start()
                total = sum(q.get() for _ in procs)
                for p in procs:
                    p.join()
                rows.append((n, total / args.seconds))
            finally:
                await cluster.aclose()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        mock.terminate()
        mock.wait()
    return rows


async def main_async(args: argparse.Namespace) -> None:
    register_cost_evaluator(args.unit_s)
    print(f"part 1: {args.sessions} sessions, {args.slots} RUNNING slots, unit {args.unit_s * 1000:.0f} ms, "
          f"INIT:RUNNING:POSTRUN = 1:2:1 ±{JITTER:.0%} (simulated runtime, engine and grading: test doubles)")
    with tempfile.TemporaryDirectory(prefix="polar-bench-staging-") as tmp:
        seq = await sequential_run(args, Path(tmp) / "seq")
        staged = await staged_run(args, Path(tmp) / "staged")
    print(f"{'pipeline':>10} | {'wall s':>7} | {'RUNNING occ.':>12} {'steady':>7} | {'engine slots':>12} | "
          f"{'engine busy':>11} | {'node CPU s':>10} | {'workers CPU s':>13}")
    for name, r in (("sequential", seq), ("staged", staged)):
        print(f"{name:>10} | {r['wall_s']:>7.2f} | {r['occupancy']:>12.1%} {r['steady_occupancy']:>7.1%} | "
              f"{r['slot_util']:>12.1%} | {r['busy']:>11.1%} | {r['cpu_s']:>10.2f} | {r['workers_cpu_s']:>13.2f}")
    print(f"staged / sequential: wall {seq['wall_s'] / staged['wall_s']:.2f}x faster, RUNNING occupancy "
          f"{staged['occupancy'] / seq['occupancy']:.2f}x (steady {staged['steady_occupancy']:.1%}; target ≥95%)")
    if args.skip_ray:
        return
    print(f"\npart 2: gateway throughput over Ray node actors; mock vLLM engine {args.engine_ms:g} ms per call, "
          f"{args.concurrency} sessions, {args.load_procs} load processes, {args.seconds:g} s per cell, {os.cpu_count()} CPUs")
    rows = await ray_throughput(args)
    base = rows[0][1]
    for n, rps in rows:
        print(f"{n} node(s): {rps:8.1f} req/s  ({rps / base:.2f}x one node)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=160)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--unit-s", type=float, default=0.1, help="one cost unit (INIT; RUNNING is two)")
    parser.add_argument("--engine-ms", type=float, default=200.0, help="part 2: mock engine time per call")
    parser.add_argument("--concurrency", type=int, default=400, help="part 2: concurrent sessions")
    parser.add_argument("--load-procs", type=int, default=2, help="part 2: load-generator processes")
    parser.add_argument("--seconds", type=float, default=8.0, help="part 2: measurement time per cell")
    parser.add_argument("--skip-ray", action="store_true")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
