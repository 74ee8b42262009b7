"""``loop``: a minimal agent loop the gateway node runs itself, for fast rollouts and training runs.

It is a real client of the gateway, not a shortcut around it: every turn is an OpenAI Chat
Completions request over HTTP (through the gateway's unix socket, with the session's key), so the
capture, continuation mode and trajectories are exactly those of a CLI harness. Tool calls to its
one tool, ``bash``, are executed in the session's runtime. The loop ends when the model answers
without a tool call, or after ``max_turns``. Use it where a CLI's start-up cost dominates (a
tiny model on CPU), or to drive hundreds of sessions per node; use the CLI presets to train on the
harnesses users run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from polar_env.runtimes.base import Runtime, limit_hit_of

NAME = "loop"
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the workspace and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
DEFAULT_SYSTEM = "You are a coding agent. Use the bash tool to inspect and change the workspace, then answer."
TOOL_OUTPUT_LIMIT = 8000  # characters of a command's output sent back to the model


@dataclass(frozen=True, slots=True)
class LoopSettings:
    max_turns: int = 8
    max_tokens: int | None = None
    command_timeout_s: float = 60.0
    system: str = DEFAULT_SYSTEM
    tools: bool = True  # False: a single-turn answer with no tools offered
    thinking: bool = True  # False: ask the template for no reasoning block (chat_template_kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopSettings:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            from polar_env.errors import ConfigError

            raise ConfigError(f"unknown loop harness settings {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class LoopOutcome:
    exit_code: int  # 0: answered; 1: the gateway refused a turn; 2: max_turns reached; 3: a runtime limit was hit
    turns: int
    final_answer: str | None
    output: str
    duration_s: float


async def run_loop_agent(runtime: Runtime | None, *, socket: Path | None, base_url: str, key: str, model: str,
                         prompt: str, settings: LoopSettings) -> LoopOutcome:
    """Run the loop against the gateway at ``base_url`` (through ``socket`` when given)."""
    started = time.monotonic()
    messages: list[dict[str, Any]] = [{"role": "system", "content": settings.system},
                                      {"role": "user", "content": prompt}]
    log: list[str] = []
    connector = aiohttp.UnixConnector(path=str(socket)) if socket is not None else aiohttp.TCPConnector()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        for turn in range(1, settings.max_turns + 1):
            body: dict[str, Any] = {"model": model, "messages": messages}
            if settings.tools:
                body["tools"] = [BASH_TOOL]
            if settings.max_tokens is not None:
                body["max_tokens"] = settings.max_tokens
            if not settings.thinking:
                body["chat_template_kwargs"] = {"enable_thinking": False}
            # orjson both ways: the body is the whole history, which aiohttp's json= (stdlib json)
            # serializes several times slower, on the node's event loop
            async with http.post(f"{base_url}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as resp:
                reply = orjson.loads(await resp.read())
                if resp.status != 200:
                    log.append(f"turn {turn}: gateway answered {resp.status}: {json.dumps(reply)[:500]}")
                    return LoopOutcome(1, turn, None, "\n".join(log), time.monotonic() - started)
            message = reply["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            calls = message.get("tool_calls") or []
            if not calls:
                return LoopOutcome(0, turn, message.get("content"), "\n".join(log), time.monotonic() - started)
            for call in calls:
                output = await _run_tool(runtime, call, settings)
                log.append(f"turn {turn}: {call['function']['name']} -> {output[:200]!r}")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
                hit = limit_hit_of(runtime)
                if hit is not None:  # the runtime killed the session's processes: stop here
                    log.append(f"turn {turn}: session limit: {hit}")
                    return LoopOutcome(3, turn, None, "\n".join(log), time.monotonic() - started)
    return LoopOutcome(2, settings.max_turns, None, "\n".join(log), time.monotonic() - started)


async def _run_tool(runtime: Runtime | None, call: dict[str, Any], settings: LoopSettings) -> str:
    fn = call.get("function", {})
    if fn.get("name") != "bash":
        return f"error: unknown tool {fn.get('name')!r}; the only tool is bash"
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        return "error: tool arguments are not valid JSON"
    command = args.get("command") if isinstance(args, dict) else None
    if not isinstance(command, str):
        return "error: bash takes {\"command\": string}"
    if runtime is None:
        return "error: this session has no runtime to run commands in"
    result = await runtime.exec(["bash", "-lc", command], cwd=runtime.spec.workdir, timeout_s=settings.command_timeout_s)
    text = result.output
    if len(text) > TOOL_OUTPUT_LIMIT:  # head and tail, and the model is told what it did not see
        half = TOOL_OUTPUT_LIMIT // 2
        dropped = getattr(result, "truncated_bytes", 0)
        more = f"; {dropped} more bytes of output were dropped by the runtime's output cap" if dropped else ""
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters truncated{more} ...]\n{text[-half:]}"
    return f"{text}\n[exit code {result.exit_code}{', timed out' if result.timed_out else ''}]"
