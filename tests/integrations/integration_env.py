"""The real path for the integration tests: a ``PolarEnv`` with the embedded CPU engine driven by a
scripted policy (it applies a toy task's gold patch through the ``loop`` harness's bash tool),
the bubblewrap sandbox and the swebench evaluator. The script only forces which tokens are
sampled; the engine, gateway capture, runtime and grading are all real."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from polar_env.tasks.swe import SweTask


def require_sandbox() -> None:
    """Skip locally with the fix; fail under CI, which installs all of these."""
    problems = []
    if shutil.which("bwrap") is None:
        problems.append("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if not os.access("/usr/bin/python3", os.X_OK):
        problems.append("/usr/bin/python3 is missing (the sandbox's gateway relay runs on it)")
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        problems.append("the swebench extra is not installed (pip install -e '.[swebench]')")
    if problems:
        reason = "; ".join(problems)
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must provide it)", pytrace=False)
        pytest.skip(reason)


def env_config(tmp: Path, fix: SweTask, **extra: Any) -> dict[str, Any]:
    """A PolarEnv config whose engine applies ``fix``'s gold patch, then answers."""
    command = f"cat > /tmp/fix.diff <<'POLAR_EOF'\n{fix.patch}POLAR_EOF\ngit apply /tmp/fix.diff && echo applied"
    script = tmp / "script.json"
    script.write_text(json.dumps({"steps": [{"command": command, "reasoning": "Apply the fix."},
                                            {"text": "Done: {tool_output}", "reasoning": "It applied."}]}))
    return {"engine": {"kind": "embedded", "script": str(script)}, "harness": "loop", "store": str(tmp / "store"),
            **extra}


class FakeSGLangRouter:
    """Test double for slime's SGLang router + one worker, named as such: ``GET /workers`` lists
    itself, ``POST /v1/chat/completions`` answers in SGLang's token-id chat shape (what
    ``polar_env.engines.sglang`` reads) from a real embedded engine. Every body is recorded, so a
    test can check what the gateway forced."""

    def __init__(self, engine: Any, weight_version: str = "7") -> None:
        self.engine = engine
        self.weight_version = weight_version
        self.bodies: list[dict[str, Any]] = []
        self.runner: Any = None
        self.url = ""

    async def start(self) -> FakeSGLangRouter:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/workers", self._workers)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _workers(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"urls": [self.url]})

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        from polar_env.records import ChatRequest

        body = await request.json()
        self.bodies.append(body)
        gen = await self.engine.generate(ChatRequest(
            messages=body["messages"], tools=body.get("tools") or [], temperature=body.get("temperature"),
            top_p=body.get("top_p"), max_tokens=body.get("max_tokens"), prompt_ids=body.get("input_ids")))
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in gen.message.tool_calls]
        return web.json_response({
            "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": gen.finish_reason,
                         "message": {"role": "assistant", "content": gen.message.content,
                                     "reasoning_content": gen.message.reasoning, "tool_calls": calls},
                         "prompt_token_ids": gen.prompt_ids, "response_token_ids": gen.response_ids,
                         "logprobs": {"content": [{"token": "", "logprob": lp} for lp in gen.response_logprobs]}}],
            "metadata": {"weight_version": self.weight_version},
        })
