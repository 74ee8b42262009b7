"""``polar-env demo``: the embedded engine answering a two-turn tool-use chat over its HTTP API.

Starts the vLLM-shaped engine on loopback, talks to it through the real vLLM client, runs the tool
call the model makes, and prints what a trainer would get: prompt ids, sampled ids, logprobs.
"""

from __future__ import annotations

import json
import subprocess
import time

from aiohttp import web

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy
from polar_env.engines.embedded.server import build_app
from polar_env.engines.vllm import VLLMClient
from polar_env.records import ChatRequest, Generation

SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def _show(turn: int, gen: Generation, decode: object) -> None:
    mean = sum(gen.response_logprobs) / max(len(gen.response_logprobs), 1)
    print(f"\n-- turn {turn}: finish_reason={gen.finish_reason}")
    print(f"   prompt ids   : {len(gen.prompt_ids)} (… {gen.prompt_ids[-6:]})")
    print(f"   response ids : {len(gen.response_ids)} {gen.response_ids[:8]}{' …' if len(gen.response_ids) > 8 else ''}")
    print(f"   logprobs     : mean {mean:.3f}, first {[round(x, 3) for x in gen.response_logprobs[:4]]}")
    print(f"   decoded      : {decode(gen.response_ids)!r}")  # type: ignore[operator]
    if gen.message.reasoning:
        print(f"   reasoning    : {gen.message.reasoning!r}")
    if gen.message.content:
        print(f"   content      : {gen.message.content!r}")
    for call in gen.message.tool_calls:
        print(f"   tool call    : {call.name}({call.arguments})")


async def run_demo(port: int = 0) -> int:
    started = time.perf_counter()
    engine = EmbeddedEngine(policy=ScriptedPolicy())
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{bound}"
    print(f"embedded engine ready in {time.perf_counter() - started:.1f}s at {url} ({json.dumps(engine.describe())})")
    client = VLLMClient(url, engine.model_name)
    try:
        messages: list[dict] = [{"role": "user", "content": "What does `echo hi` print? Use the tool."}]
        first = await client.generate(ChatRequest(messages=messages, tools=[SHELL_TOOL]))
        _show(1, first, engine.tokenizer.decode)
        call = first.message.tool_calls[0]
        command = json.loads(call.arguments)["command"]
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=10)
        print(f"   ran `{command}` → {result.stdout!r}")
        messages += [
            {"role": "assistant", "content": None, "reasoning_content": first.message.reasoning,
             "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result.stdout},
        ]
        second = await client.generate(ChatRequest(messages=messages, tools=[SHELL_TOOL]))
        _show(2, second, engine.tokenizer.decode)
        # Inside a tool loop the Qwen3.5 template re-renders the sampled turn identically, so the
        # next prompt is turn-1 prompt + turn-1 sampled ids + (separator, tool result, new prompt).
        seen = first.prompt_ids + first.response_ids
        appended = second.prompt_ids[: len(seen)] == seen
        print(f"\nturn-2 prompt == turn-1 prompt + turn-1 sampled ids + {len(second.prompt_ids) - len(seen)} new: {appended}")
        ok = first.finish_reason == "tool_calls" and second.finish_reason == "stop" and appended
        return 0 if ok else 1
    finally:
        await client.aclose()
        await runner.cleanup()
