"""Docker variant of the scale benchmark: do ``max_running`` sessions really execute at once?

Runs N sessions (default 64) with ``max_running = N`` through the real ``GatewayNode`` (gateway,
journal, staged pools) whose runtime is the real Docker runtime: one container per session from the
imported test image (``scripts/build_rootfs.sh``), on the private dockerd (``scripts/start_dockerd.sh``).
The harness is the built-in ``loop``; the engine is a mock vLLM server (a test double, in this
process) whose every turn but the last calls the ``bash`` tool with ``sleep <S>.<marker>``, so each
session holds a container exec for S seconds per turn. A sampler thread counts, every 0.2 s, the
host processes whose argv is exactly ``sleep <S>.<marker>`` *and* whose cgroup is a Docker
container's: harness commands executing in containers right now, not queued. The mock engine holds
every session's first call until all N have made one (an engine batch), so sessions whose
container came up early are still running when the last one starts. Also sampled: this
process's thread count, and the sizes of the bounded Docker executor and of asyncio's default one.

Printed: peak concurrently executing container commands vs ``max_running`` (and the time they all
overlapped), peak threads vs executor sizes, prepare/stop figures, wall time, errors.

    eval "$(scripts/start_dockerd.sh)"; scripts/build_rootfs.sh
    python scripts/bench_docker.py [--sessions 64] [--turns 3] [--sleep 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESPONSE_IDS = 64


def docker_pids_running(needle: bytes) -> int:
    """Host processes with argv ``sleep <needle>`` inside a Docker container's cgroup."""
    n = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if argv[:2] != [b"sleep", needle]:
                continue
            with open(f"/proc/{entry}/cgroup", "rb") as f:
                if b"docker" in f.read():
                    n += 1
        except OSError:
            continue
    return n


def mock_engine(turns: int, command: str, sessions: int) -> Any:
    """A mock vLLM chat endpoint (a test double): tool calls until the last turn, realistic ids.
    First calls are held until all ``sessions`` have made theirs (as an engine batch would), so
    containers that finished INIT early do not finish their commands before the last one starts."""
    from aiohttp import web

    first_calls = [0]
    everyone = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        messages = body.get("messages") or []
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        if turn == 0:
            first_calls[0] += 1
            if first_calls[0] >= sessions:
                everyone.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(everyone.wait(), 900)
        prompt = (body.get("kv_transfer_params") or {}).get("prompt_token_ids") or [
            1000 + (b % 200) for b in json.dumps(messages).encode()[::8]]
        ids = [50_000 + (turn * 7 + i) for i in range(RESPONSE_IDS - 1)] + [248046]
        if turn + 1 >= turns:
            message: dict[str, Any] = {"role": "assistant", "content": f"Done after {turn + 1} turns."}
            finish = "stop"
        else:
            message = {"role": "assistant", "content": None,
                       "tool_calls": [{"id": f"call-{turn}", "type": "function",
                                       "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}
            finish = "tool_calls"
        logprobs = {"content": [{"token": f"t{i}", "logprob": -0.5, "bytes": [116], "top_logprobs": []} for i in ids]}
        return web.json_response({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": "bench", "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "token_ids": ids, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from aiohttp import web

    from polar_env.engines.config import VLLMEngineConfig
    from polar_env.runtimes import RuntimeSpec
    from polar_env.runtimes.docker import EXECUTOR, unix_daemon_problem
    from polar_env.staging.models import (
        AgentSpec,
        SessionSpec,
        SessionStatus,
        TaskRequest,
    )
    from polar_env.staging.node import GatewayNode, NodeConfig
    from polar_env.staging.pools import PoolLimits

    if (problem := unix_daemon_problem()) is not None:
        raise SystemExit(f"bench_docker: no Docker daemon ({problem}); run: eval \"$(scripts/start_dockerd.sh)\"")
    marker = f"{args.sleep:g}.{os.getpid() % 10_000:04d}17"  # a sleep length nothing else on the host uses
    command = f"sleep {marker}; echo slept"
    runner = web.AppRunner(mock_engine(args.turns, command, args.sessions))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    samples: list[tuple[float, int, int, int]] = []  # (t, running in containers, threads, waitpid threads)
    stop = threading.Event()
    peak_names: list[Any] = [0, []]

    def sampler() -> None:
        while not stop.is_set():
            names = [t.name for t in threading.enumerate()]
            samples.append((time.monotonic(), docker_pids_running(marker.encode()), len(names),
                            sum(1 for n in names if n.startswith("asyncio-waitpid-"))))
            if len(names) >= peak_names[0]:
                peak_names[0], peak_names[1] = len(names), sorted({re.sub(r"[-_]?\d+$", "", n) for n in names})
            stop.wait(0.2)

    n = args.sessions
    limits = PoolLimits(max_running=n, max_init=min(n, args.max_init), max_postrun=4, ready_buffer=n)
    with tempfile.TemporaryDirectory(prefix="polar-bench-docker-") as store:
        config = NodeConfig(engine=VLLMEngineConfig(url=f"http://127.0.0.1:{port}/v1", model="bench"),
                            store=Path(store), limits=limits, tcp_port=None, install_harnesses=False)
        request = TaskRequest(
            task_id="docker-scale", instruction="Run the command.", num_samples=n,
            agent=AgentSpec(harness="loop", settings={"max_turns": args.turns + 1, "command_timeout_s": args.sleep + 120}),
            runtime=RuntimeSpec(kind="docker", image=args.image), timeout_s=args.turns * args.sleep + 600,
            init_timeout_s=900)
        node = GatewayNode(config)
        await node.start()
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        t0 = time.monotonic()
        try:
            results = await asyncio.gather(*(node.run(SessionSpec(session_id=f"dk-{i}", sample_index=i, group_id="dk",
                                                                  request=request)) for i in range(n)))
        finally:
            wall = time.monotonic() - t0
            stop.set()
            thread.join(5)
            await node.stop()
            await runner.cleanup()
    peak = max((s[1] for s in samples), default=0)
    at_peak = [s[0] for s in samples if s[1] == peak and peak > 0]
    errors = [r for r in results if r.status is not SessionStatus.COMPLETED]
    init_s = [r.stage_times["ready"] - r.stage_times["init"] for r in results
              if "ready" in r.stage_times and "init" in r.stage_times]
    return {
        "sessions": n, "max_running": n, "turns": args.turns, "sleep_s": args.sleep,
        "peak_running_in_containers": peak,
        "seconds_at_peak": round(len(at_peak) * 0.2, 1),
        "peak_threads": max((s[2] for s in samples), default=0),
        "peak_waitpid_threads": max((s[3] for s in samples), default=0),
        "thread_kinds_at_peak": peak_names[1],
        "docker_executor_threads": EXECUTOR._max_workers,
        "default_executor_threads": min(32, (os.cpu_count() or 1) + 4),
        "init_s_median": statistics.median(init_s) if init_s else float("nan"),
        "wall_s": wall, "ideal_running_s": args.sleep * (args.turns - 1),
        "errors": len(errors), "error_samples": [r.failure_detail for r in errors][:3],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64, help="sessions, and max_running (default 64)")
    ap.add_argument("--turns", type=int, default=3, help="model calls per session; all but the last run the sleep")
    ap.add_argument("--sleep", type=float, default=8.0, help="seconds each tool call holds its container exec")
    ap.add_argument("--max-init", type=int, default=16, help="containers prepared at once")
    ap.add_argument("--image", default=os.environ.get("POLAR_ROOTFS_TAG", "polar-test/py:bookworm"))
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    r = asyncio.run(bench(args))
    print(f"bench_docker: {r['sessions']} sessions, max_running={r['max_running']}, {r['turns']} turns, "
          f"{r['sleep_s']:g} s container command per tool call")
    print(f"  peak harness commands executing in containers  {r['peak_running_in_containers']:>6}  "
          f"(max_running {r['max_running']}; held {r['seconds_at_peak']:g} s)")
    print(f"  peak threads in the node process               {r['peak_threads']:>6}  "
          f"(Docker executor {r['docker_executor_threads']}, asyncio default {r['default_executor_threads']})")
    print(f"    of which asyncio child-watcher waitpid threads {r['peak_waitpid_threads']:>6}  "
          "(one per live `docker exec` process on Python 3.11; not a pool, no cap)")
    print(f"    thread kinds at the peak: {', '.join(r['thread_kinds_at_peak'])}")
    print(f"  INIT (container prepare) s, median             {r['init_s_median']:>6.2f}")
    print(f"  wall s                                         {r['wall_s']:>6.1f}  (commands alone: {r['ideal_running_s']:g} s)")
    print(f"  errors                                         {r['errors']:>6}")
    for e in r["error_samples"]:
        print(f"    {e}")
    print("  concurrency >= max_running:", "yes" if r["peak_running_in_containers"] >= r["max_running"] else "NO")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
