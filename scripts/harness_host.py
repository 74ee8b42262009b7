"""The harness host of ``bench_scale.py``: a test double for sandboxed CLIs, in its own process.

The node's ``loop`` call is handed here (``loop_in_host`` replaces ``run_loop_agent`` in the
node); the host runs the real ``run_loop_agent`` on a ``SimulatedRuntime`` against the node's
gateway socket, so the gateway sees the same traffic while the client's work (serializing its
history, its side of HTTP) is this process's, as a CLI's is its sandbox's in production.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_harness_host(path: str) -> None:
    """Serves ``run_loop_agent`` calls, one JSON line each way per session, on a unix socket; an
    ``{"op": "cpu"}`` line answers this process's CPU seconds so far."""
    import orjson

    sys.path.insert(0, str(REPO))
    from polar_env.harnesses import loop
    from polar_env.runtimes.base import RuntimeSpec
    from polar_env.testing.simulated_runtime import SimulatedRuntime

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        job = orjson.loads(await reader.readline())
        if job.get("op") == "cpu":
            answer: dict[str, Any] = {"cpu_s": time.process_time()}
        else:
            outcome = await loop.run_loop_agent(
                SimulatedRuntime(RuntimeSpec()), socket=Path(job["socket"]), base_url=job["base_url"], key=job["key"],
                model=job["model"], prompt=job["prompt"], settings=loop.LoopSettings.from_dict(job["settings"]))
            answer = {name: getattr(outcome, name) for name in loop.LoopOutcome.__dataclass_fields__}
        writer.write(orjson.dumps(answer) + b"\n")
        await writer.drain()
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_unix_server(handle, path, limit=1 << 26, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


async def ask_host(path: str, job: dict[str, Any]) -> dict[str, Any]:
    import orjson

    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 26)
    writer.write(orjson.dumps(job) + b"\n")
    line = await reader.readline()
    writer.close()
    return dict(orjson.loads(line))


def loop_in_host(host: str) -> Any:
    """``run_loop_agent`` for the node process: the session's loop runs in the harness host."""
    import dataclasses

    from polar_env.harnesses import loop

    async def run_loop_agent(runtime: Any, *, socket: Path, base_url: str, key: str, model: str, prompt: str,
                             settings: Any) -> Any:
        answer = await ask_host(host, {"socket": str(socket), "base_url": base_url, "key": key, "model": model,
                                        "prompt": prompt, "settings": dataclasses.asdict(settings)})
        return loop.LoopOutcome(**answer)

    return run_loop_agent
