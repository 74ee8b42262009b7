"""``polar-env demo``: one captured agent episode, end to end, on the embedded CPU defaults.

Starts the embedded engine (scripted policy: call the shell tool, then answer) behind the
vLLM-shaped HTTP API, puts the gateway in front of it through the real vLLM client, and plays a
small harness loop over the Anthropic Messages API with streaming (the same wire format and SSE
Claude Code uses): the model calls ``bash``, the demo runs the command, the model answers. Then
it builds the prefix-merged trajectory from the capture journal and re-checks every sampled
logprob with a teacher-forced pass.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy
from polar_env.engines.embedded.server import build_app as build_engine_app
from polar_env.engines.vllm import VLLMClient
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway
from polar_env.trajectory.fidelity import verify
from polar_env.trajectory.per_request import build_per_request
from polar_env.trajectory.prefix_merge import build_prefix_merged

BASH = {"name": "bash", "description": "Run a shell command and return its output.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _read_stream(text: str) -> list[dict[str, Any]]:
    """Rebuild Anthropic content blocks from the SSE the gateway synthesized."""
    blocks: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}.get(delta["type"])
            if key:
                block[key] = block.get(key, "") + delta[key]
    for block in blocks:
        if "partial_json" in block:
            block["input"] = json.loads(block.pop("partial_json"))
    return blocks


def fresh_session_id(store: JournalStore) -> str:
    """``demo``, or ``demo-2``, ``demo-3``… when earlier runs left theirs in the same store: a
    rerun must not append its calls to an old session (its trajectory would be two episodes)."""
    taken = set(store.session_ids())
    return next(sid for sid in ("demo", *(f"demo-{n}" for n in range(2, len(taken) + 3))) if sid not in taken)


async def run_demo(store_dir: str | None = None) -> int:
    started = time.perf_counter()
    engine = EmbeddedEngine(policy=ScriptedPolicy())
    engine_runner, engine_url = await _serve(build_engine_app(engine))
    store = JournalStore(Path(store_dir or tempfile.mkdtemp(prefix="polar-demo-")))
    session_id = fresh_session_id(store)
    gateway = await Gateway(VLLMClient(engine_url, engine.model_name), store, GatewayConfig(engine_model=engine.model_name)).start()
    gateway_url = gateway.url
    print(f"embedded engine {engine_url} + gateway {gateway_url} ready in {time.perf_counter() - started:.1f}s "
          f"({engine.describe()['parameters']:,}-parameter Qwen3, Qwen3.5 tokenizer and template)")
    try:
        async with aiohttp.ClientSession() as http:
            admin = {"Authorization": f"Bearer {gateway.config.admin_token}"}
            async with http.post(f"{gateway_url}/sessions", json={"session_id": session_id}, headers=admin) as resp:
                session = await resp.json()
            headers = {"x-api-key": session["key"], "anthropic-version": "2023-06-01"}
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What does `echo hi` print? Use the tool."}]
            for turn in (1, 2, 3):
                body = {"model": "claude-any", "max_tokens": 256, "stream": True, "tools": [BASH], "messages": messages}
                async with http.post(f"{gateway_url}/v1/messages", json=body, headers=headers) as resp:
                    blocks = _read_stream(await resp.text())
                messages.append({"role": "assistant", "content": blocks})
                calls = [b for b in blocks if b["type"] == "tool_use"]
                for b in blocks:
                    shown = b.get("text") or b.get("thinking") or json.dumps(b.get("input"))
                    print(f"turn {turn} {b['type']:>9}: {shown}")
                if not calls:
                    break
                results = []
                for call in calls:
                    run = subprocess.run(["bash", "-c", call["input"]["command"]], capture_output=True, text=True, timeout=10)
                    print(f"turn {turn}  ran tool: {call['input']['command']!r} -> {run.stdout!r}")
                    results.append({"type": "tool_result", "tool_use_id": call["id"], "content": run.stdout})
                messages.append({"role": "user", "content": results})
    finally:
        await gateway.aclose()
        await engine_runner.cleanup()

    records = store.read(session_id)
    merged = build_prefix_merged(records)
    per_request = build_per_request(records)
    trace = merged.traces[0]
    stats = merged.metadata["stats"]
    print(f"\ncaptured {len(records)} calls in {store.path(session_id)}")
    for r in records:
        print(f"  seq {r.seq}: {len(r.prompt_ids)} prompt ids, {len(r.response_ids)} sampled ids "
              f"(logprobs {len(r.response_logprobs)}), finish {r.finish_reason}")
    print(f"prefix-merged: {stats['chains']} chain, {len(per_request.traces)} traces -> {len(merged.traces)}, "
          f"drift boundaries {stats['drift_boundaries']}")
    print(f"  trace: {len(trace.prompt_ids)} prompt + {len(trace.response_ids)} response ids, "
          f"{sum(trace.loss_mask)} trained (mask 1), {len(trace.loss_mask) - sum(trace.loss_mask)} inserted (mask 0)")
    report = verify([merged], engine.model)
    print(f"fidelity (teacher-forced): {report.line()}")
    ok = len(records) == 2 and stats["chains"] == 1 and len(merged.traces) == 1 and report.max_abs_delta <= 1e-4
    print("demo ok" if ok else "demo FAILED")
    return 0 if ok else 1
