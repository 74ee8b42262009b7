"""Shared pieces of tests/engines/test_engine_contract.py: the request cases (message histories,
error bodies, tool-call variants), a blocking JSON client for one server, the embedded engine's
HTTP server on a background thread (the reference every URL is compared with), and the key-set
policy for comparing two replies.

Key-set policy (``compare_keys``), for a server under test against the embedded reference:

- a key the server sends that the reference lacks -> failure when it carries information (not
  null in the server's reply); a key only the reference sends -> fine (OpenAI-style clients ignore
  unknown keys);
- both send a key with different non-null JSON types -> failure; null on one side only -> failure
  unless the key is in ``NULLABLE_OK`` (values that legitimately depend on the server build).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.server import build_app

MODEL = "polar-tiny-qwen3"
# vLLM's first request warms the CPU kernels (about 40 s on 2 cores); give every call ample room.
REQUEST_TIMEOUT_S = 600
# Keys whose null-ness may differ without breaking a client (the value is server metadata).
NULLABLE_OK = {"system_fingerprint", "param"}  # error.param: vLLM names it only for some errors

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
}
# A tool call exactly as our template renders one (and as Qwen3.5 writes one).
TOOL_CALL_TEXT = "<tool_call>\n<function=bash>\n<parameter=command>\necho hi\n</parameter>\n</function>\n</tool_call>"

# (variant, enable_thinking, logit_bias id forced at +100, forced prefix text, choice): tool-call parsing.
TOOL_VARIANTS: list[tuple[str, bool, int | None, str, str]] = [
    ("thinking off", False, None, "", TOOL_CALL_TEXT),
    ("thinking on, </think> first", True, 248069, "</think>", "\n\n" + TOOL_CALL_TEXT),
    ("thinking on, no </think>", True, 248058, "", TOOL_CALL_TEXT),
]

# (name, JSON body, raw bytes instead of JSON, expected status)
ERROR_CASES: list[tuple[str, Any, bytes | None, int]] = [
    ("malformed JSON", None, b'{"model": "polar-tiny-qwen3", "messages": [{"role": "user", ', 400),
    ("missing messages", {"model": MODEL, "max_tokens": 1}, None, 400),
    ("empty messages", {"model": MODEL, "messages": [], "max_tokens": 1}, None, 400),
    ("body not an object", None, b"[1, 2]", 400),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, None, 404),
]


# Message histories for the prompt-id checks; each is merged into a max_tokens=1 request.
PROMPT_CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    "system+user": {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ]
    },
    "tool": {"messages": [{"role": "user", "content": "List the files."}], "tools": [BASH_TOOL]},
    "system+tool": {
        "messages": [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "List the files."}],
        "tools": [BASH_TOOL],
    },
    "tool loop": {
        "messages": [
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should run ls.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        ],
        "tools": [BASH_TOOL],
    },
    # vLLM's own replies name it "reasoning"; a gateway replays them as history under that key.
    "tool loop, reasoning key": {
        "messages": [
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "I should run ls.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        ],
        "tools": [BASH_TOOL],
    },
    # No reasoning field at all: the template recovers it from "<think>…</think>" in the content.
    "think in content": {
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "<think>\nI should run ls.\n</think>\n\nRunning it."},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        ],
    },
    "two tool calls": {
        "messages": [
            {"role": "user", "content": "Show both files."},
            {
                "role": "assistant",
                "content": "Reading both.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "cat a.py", "timeout": 5}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "cat b.py"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
            {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
        ],
        "tools": [BASH_TOOL],
    },
    "think stripping": {
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "The user greets me."},
            {"role": "user", "content": "What is 2+2?"},
        ]
    },
    "thinking off": {
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "content parts": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "  Part one. "}, {"type": "text", "text": "Part two.  "}],
            }
        ]
    },
}


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON, or the raw text when the body is not JSON


@dataclass
class Server:
    """One OpenAI-compatible chat server on 127.0.0.1; ``kind`` is its /v1/models ``owned_by``
    (``polar_env`` for the embedded engine, ``vllm``, ``sglang``)."""

    name: str
    url: str
    kind: str = ""

    def post(self, body: Any = None, raw: bytes | None = None, path: str = "/v1/chat/completions") -> Reply:
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        try:
            return Reply(status, json.loads(text))
        except json.JSONDecodeError:
            return Reply(status, text)

    def ok(self, body: Any) -> dict[str, Any]:
        """POST ``body``; the JSON object of a 200 reply (assertion error with the reply otherwise)."""
        reply = self.post(body)
        assert reply.status == 200 and isinstance(reply.body, dict), f"{self.name}: HTTP {reply.status} {short(reply.body)}"
        return reply.body

    def identify(self) -> Server:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=REQUEST_TIMEOUT_S) as resp:
            cards = json.loads(resp.read())["data"]
        self.kind = str(cards[0].get("owned_by", "")) if cards else ""
        return self


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash or ``/v1``; only 127.0.0.1 / localhost / ::1 are allowed."""
    host = urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"{url}: the engine contract suite only talks to loopback (127.0.0.1)")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class EmbeddedServer:
    """The embedded engine (seeded tiny model, sampling mode) over its vLLM-shaped HTTP API, served
    from a background thread so the tests can use a blocking client."""

    def __init__(self, engine: EmbeddedEngine | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(build_app(engine or EmbeddedEngine()), access_log=None)
        ready = threading.Event()
        self.port = 0

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = self.runner.addresses[0][1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, name="embedded-engine-server", daemon=True)
        self.thread.start()
        if not ready.wait(120):
            raise RuntimeError("the embedded engine server did not start")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    return "object"


def compare_keys(server: Mapping[str, Any] | None, reference: Mapping[str, Any] | None) -> list[str]:
    """Failures for one JSON object level, by the policy in the module docstring."""
    if server is None or reference is None:
        return [] if server is reference else [f"object present only on {'the server' if reference is None else 'the reference'}"]
    fails = [f"missing in the reference: {k} (server {jtype(server[k])})" for k in sorted(set(server) - set(reference))
             if server[k] is not None]
    for key in sorted(set(server) & set(reference)):
        a, b = jtype(server[key]), jtype(reference[key])
        if a == b or {a, b} == {"int", "float"} or ("null" in (a, b) and key in NULLABLE_OK):
            continue
        fails.append(f"{key}: server {a}, reference {b}")
    return fails


def get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else None


def first(items: Any) -> Any:
    return items[0] if isinstance(items, list) and items else None


def choice_ids(body: Mapping[str, Any]) -> list[int]:
    return list(get(first(body.get("choices")), "token_ids") or [])


def entries(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(get(get(first(body.get("choices")), "logprobs"), "content") or [])


def choice_logprobs(body: Mapping[str, Any]) -> list[float]:
    return [float(e["logprob"]) for e in entries(body)]


def token_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a client reads of one reply: ids, token strings and bytes, rounded logprobs, texts."""
    choice = first(body.get("choices")) or {}
    content = entries(body)
    return {
        "token_ids": choice.get("token_ids"),
        "tokens": [(e.get("token"), e.get("bytes")) for e in content],
        "logprobs": [round(float(e["logprob"]), 4) for e in content],
        "content": get(choice.get("message"), "content"),
        "reasoning": get(choice.get("message"), "reasoning"),
        "finish_reason": choice.get("finish_reason"),
    }


def short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)"
