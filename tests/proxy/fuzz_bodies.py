"""Fuzzing the gateway: hypothesis strategies for request bodies on every route, a gateway served
from a background thread (so hypothesis can drive it synchronously), and the per-request oracle.

Shared by ``tests/proxy/test_fuzz.py`` (a few hundred bodies in CI) and ``scripts/fuzz_gateway.py``
(10,000+). The engine is ``RenderingFakeEngine``, a test double that runs the real Qwen3.5
template render and tokenizer on every request (where odd message shapes used to crash) but
answers a fixed generation instead of running a model, so thousands of bodies take seconds.

The oracle, per request: never a 5xx; every 4xx is JSON in the provider's error shape; every 200
on a provider route left exactly one more whole record in that session's journal, with the next
seq, and nothing else was written.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from hypothesis import strategies as st

from polar_env.chat.qwen35.template import render
from polar_env.chat.qwen35.tokenizer import load_tokenizer
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway
from polar_env.records import AssistantMessage, ChatRequest, Generation, ToolCall

# -- the engine double ---------------------------------------------------------------------------


class RenderingFakeEngine:
    """Test double: real template render + tokenization of the request, fixed reply (text and a
    tool call), finite logprobs. Counts calls, so the oracle can tell a refused body never got here."""

    name = "rendering-fake"

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer()
        self.calls = 0

    async def generate(self, request: ChatRequest) -> Generation:
        self.calls += 1
        # the sampling contract the real engines enforce (vLLM answers 400, the embedded sampler
        # raises): a body that gets here with these values was not validated
        if request.temperature is not None and not request.temperature >= 0:
            raise ValueError(f"temperature {request.temperature} < 0")
        if request.top_p is not None and not (2.2250738585072014e-308 <= request.top_p <= 1):
            raise ValueError(f"top_p {request.top_p} not in (0, 1]")
        text = render(request.messages, request.tools, add_generation_prompt=True)
        prompt = request.prompt_ids if request.prompt_ids is not None else self.tokenizer.encode(text)
        return Generation(
            message=AssistantMessage(content="done", reasoning="think",
                                     tool_calls=[ToolCall(id="call-1", name="bash", arguments='{"command":"ls"}')]),
            prompt_ids=list(prompt) or [0], response_ids=[9707, 13, 248046], response_logprobs=[-0.1, -0.2, -0.3],
            finish_reason="tool_calls", model="fake", engine=self.name,
        )

    async def aclose(self) -> None:
        return None


# -- JSON strategies -----------------------------------------------------------------------------

# Mostly valid UTF-8 text; lone surrogates (invalid JSON strings) sometimes, as garbage does.
text = st.integers(0, 30).flatmap(lambda i: st.text(max_size=40) if i == 0 else
                                  st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False), text,
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def deep_value(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"a": [value]} if levels % 2 else [value]
    return value


deep = st.integers(min_value=100, max_value=400).map(deep_value)
anything = st.integers(0, 5).flatmap(lambda i: deep if i == 0 else json_values)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes any JSON at all (wrong types, deep nesting)."""
    return st.integers(0, 40).flatmap(lambda i: anything if i == 0 else strategy)


def fields(required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({k: maybe(v) for k, v in required.items()},
                                 optional={k: maybe(v) for k, v in optional.items()})


schema = st.fixed_dictionaries({"type": st.just("object")}, optional={
    "properties": st.dictionaries(st.sampled_from(["command", "cmd", "path", "x"]),
                                  st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["string", "array", "integer"])}), anything),
                                  max_size=3),
    "required": st.lists(text, max_size=2)})
tool_name = st.sampled_from(["bash", "shell", "exec_command", "read", "x"])


def _deep_text(levels: int) -> str:
    return "{\"a\":" * levels + "1" + "}" * levels if levels % 3 else "[" * levels + "]" * levels


# JSON nested 100-5,000 deep *inside a string* (tool-call arguments are JSON text): the server parses it
deep_string = st.integers(min_value=100, max_value=5000).map(_deep_text)
arguments = st.one_of(st.just('{"command":"ls"}'), text, json_values, deep_string)
# sampling values at and past the edges: negative, zero, subnormal, tiny, huge
temperature = st.one_of(st.floats(0, 2), st.floats(-5, 5), st.sampled_from([-2.0, -0.0, 0.0, 5e-324, 1e-320, 1e308]))
top_p = st.one_of(st.floats(0, 1), st.floats(-1, 1.5), st.sampled_from([0.0, -0.0, 5e-324, 1e-320, 1e-300, 1.0, 1.0000001]))

# OpenAI Chat
chat_tool = fields({"type": st.just("function"), "function": fields({"name": tool_name}, {"parameters": schema, "description": text})}, {})
chat_call = fields({"id": text, "type": st.just("function"), "function": fields({"name": tool_name, "arguments": arguments}, {})}, {})
chat_part = fields({"type": st.sampled_from(["text", "image_url"]), "text": text}, {})
chat_message = st.one_of(
    fields({"role": st.sampled_from(["system", "developer", "user"]), "content": st.one_of(text, st.lists(chat_part, max_size=3))},
           {"name": text}),
    fields({"role": st.just("assistant")}, {"content": st.one_of(st.none(), text), "tool_calls": st.lists(chat_call, max_size=2),
                                            "reasoning_content": text}),
    fields({"role": st.just("tool"), "content": st.one_of(text, st.lists(chat_part, max_size=2))}, {"tool_call_id": text}),
)
def opened_by(first: st.SearchStrategy[Any], rest: st.SearchStrategy[Any], max_size: int = 4) -> st.SearchStrategy[list[Any]]:
    """A conversation that usually starts with a user query (the template needs one), then anything."""
    return st.tuples(first, st.lists(rest, max_size=max_size)).map(lambda t: [t[0], *t[1]])


chat_body = fields({"messages": opened_by(st.fixed_dictionaries({"role": st.just("user"), "content": text}), chat_message)}, {
    "model": text, "tools": st.lists(chat_tool, max_size=3), "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "temperature": temperature, "top_p": top_p, "max_tokens": st.integers(1, 4096),
    "max_completion_tokens": st.integers(1, 4096), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "stop": st.one_of(text, st.lists(text, max_size=2)),
    "seed": st.integers(0, 2**31), "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
})

# Anthropic Messages
a_block = st.one_of(
    fields({"type": st.just("text"), "text": text}, {"cache_control": st.fixed_dictionaries({"type": st.just("ephemeral")})}),
    fields({"type": st.just("thinking"), "thinking": text}, {"signature": text}),
    fields({"type": st.just("tool_use"), "id": text, "name": tool_name, "input": json_values}, {}),
    fields({"type": st.just("tool_result"), "tool_use_id": text},
           {"content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
            "is_error": st.booleans()}),
)
a_message = fields({"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(text, st.lists(a_block, max_size=3))}, {})
a_tool = fields({"name": tool_name, "input_schema": schema}, {"description": text})
anthropic_body = fields({"model": text, "max_tokens": st.integers(1, 4096),
                         "messages": opened_by(st.fixed_dictionaries({"role": st.just("user"), "content": text}), a_message)}, {
    "system": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
    "tools": st.lists(a_tool, max_size=3), "stream": st.booleans(),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}, optional={"name": tool_name}),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}, optional={"budget_tokens": st.integers(0, 9999)}),
    "temperature": temperature, "top_p": top_p, "stop_sequences": st.lists(text, max_size=2), "metadata": json_values,
})

# OpenAI Responses
r_item = st.one_of(
    fields({"role": st.sampled_from(["user", "developer", "system", "assistant"]),
            "content": st.one_of(text, st.lists(fields({"type": st.sampled_from(["input_text", "output_text"]), "text": text}, {}),
                                                max_size=2))},
           {"type": st.just("message")}),
    fields({"type": st.just("function_call"), "call_id": text, "name": tool_name, "arguments": arguments}, {"id": text}),
    fields({"type": st.just("function_call_output"), "call_id": text, "output": st.one_of(text, json_values)}, {}),
    fields({"type": st.just("reasoning"),
            "summary": st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": text}), max_size=2)},
           {"encrypted_content": st.one_of(st.none(), text)}),
)
r_tool = fields({"type": st.sampled_from(["function", "web_search", "custom"]), "name": tool_name},
                {"parameters": schema, "strict": st.booleans()})
responses_body = fields({"input": st.one_of(text, opened_by(st.fixed_dictionaries({"role": st.just("user"), "content": text}), r_item))}, {
    "model": text, "instructions": text, "tools": st.lists(r_tool, max_size=3), "stream": st.booleans(),
    "tool_choice": st.sampled_from(["auto", "none", "required"]), "max_output_tokens": st.integers(1, 4096),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high"]), "summary": st.just("auto")}),
    "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_schema"])})}),
    "store": st.booleans(), "include": st.lists(text, max_size=2), "temperature": temperature, "top_p": top_p,
})

# Gemini
g_part = st.one_of(
    fields({"text": text}, {"thought": st.booleans(), "thoughtSignature": text}),
    fields({"functionCall": fields({"name": tool_name, "args": json_values}, {"id": text})}, {}),
    fields({"functionResponse": fields({"name": tool_name, "response": json_values}, {"id": text})}, {}),
)
g_content = fields({"role": st.sampled_from(["user", "model"]), "parts": st.lists(g_part, min_size=1, max_size=3)}, {})
g_decl = fields({"name": tool_name}, {"description": text, "parameters": schema, "parametersJsonSchema": schema})
g_query = st.fixed_dictionaries({"role": st.just("user"), "parts": st.lists(st.fixed_dictionaries({"text": text}), min_size=1, max_size=2)})
gemini_body = fields({"contents": opened_by(g_query, g_content, 3)}, {
    "systemInstruction": fields({"parts": st.lists(fields({"text": text}, {}), max_size=2)}, {}),
    "tools": st.lists(fields({}, {"functionDeclarations": st.lists(g_decl, max_size=2)}), max_size=2),
    "toolConfig": fields({}, {"functionCallingConfig": fields({"mode": st.sampled_from(["AUTO", "ANY", "NONE"])},
                                                              {"allowedFunctionNames": st.lists(tool_name, max_size=2)})}),
    "generationConfig": fields({}, {"temperature": temperature, "topP": top_p, "maxOutputTokens": st.integers(1, 4096),
                                    "thinkingConfig": fields({}, {"includeThoughts": st.booleans(),
                                                                  "thinkingBudget": st.integers(-1, 999)}),
                                    "stopSequences": st.lists(text, max_size=2),
                                    "responseMimeType": st.sampled_from(["text/plain", "application/json"])}),
})

# the same deep argument text in the two places a string carries JSON the gateway parses
_user = {"role": "user", "content": "hi"}
deep_chat_body = deep_string.map(lambda d: {"messages": [
    _user, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"name": "bash", "arguments": d}}]},
    {"role": "tool", "tool_call_id": "c", "content": "x"}]})
deep_responses_body = deep_string.map(lambda d: {"input": [
    _user, {"type": "function_call", "call_id": "c", "name": "bash", "arguments": d},
    {"type": "function_call_output", "call_id": "c", "output": "x"}]})

PROVIDER_ROUTES = {
    "openai_chat_deep_args": ("/v1/chat/completions", deep_chat_body),
    "openai_responses_deep_args": ("/v1/responses", deep_responses_body),
    "openai_chat": ("/v1/chat/completions", chat_body),
    "anthropic": ("/v1/messages", anthropic_body),
    "openai_responses": ("/v1/responses", responses_body),
    "gemini": ("/v1beta/models/gemini-x:generateContent", gemini_body),
    "gemini_stream": ("/v1beta/models/gemini-x:streamGenerateContent?alt=sse", gemini_body),
    "count_tokens": ("/v1/messages/count_tokens", anthropic_body),
}


@dataclass(frozen=True)
class Case:
    route: str  # a PROVIDER_ROUTES name, or a control-plane route name
    method: str
    path: str
    body: bytes | None
    auth: str  # "session", "admin", "none", "other"


def _encode(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:  # deeper than orjson writes: what an attacker sends anyway
        import json
        import sys

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 5000))
        try:
            return json.dumps(value).encode()
        finally:
            sys.setrecursionlimit(limit)


garbage = st.one_of(st.binary(max_size=64), st.just(b""), st.just(b"{"), st.just(b"[]"), st.just(b"null"), st.just(b'"x"'))


@st.composite
def provider_cases(draw: st.DrawFn) -> Case:
    route = draw(st.sampled_from(sorted(PROVIDER_ROUTES)))
    path, strategy = PROVIDER_ROUTES[route]
    body = draw(st.integers(0, 12).flatmap(lambda i: garbage if i == 0 else strategy.map(_encode)))
    auth = draw(st.sampled_from(["session"] * 8 + ["none", "other"]))
    return Case(route, "POST", path, body, auth)


session_ids = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True), text, st.just("abc\n"), st.just("../x"))


@st.composite
def control_cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["create", "get", "completions", "delete", "pause", "resume", "status"]))
    auth = draw(st.sampled_from(["admin", "admin", "admin", "none", "session"]))
    if kind == "create":
        create = fields({}, {"session_id": session_ids, "metadata": json_values, "continuation": st.booleans()})
        body = draw(st.one_of(create.map(_encode), garbage))
        return Case(kind, "POST", "/sessions", body, auth)
    if kind in ("get", "completions", "delete"):
        sid = draw(st.one_of(st.just("@own"), st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True)))
        suffix = "/completions" if kind == "completions" else ""
        return Case(kind, "DELETE" if kind == "delete" else "GET", f"/sessions/{sid}{suffix}", None, auth)
    if kind == "pause":
        value = draw(st.one_of(st.just("0.05"), st.just("0"), text.map(lambda s: s.replace("&", "").replace("#", "")), st.just("nan")))
        from urllib.parse import quote

        return Case(kind, "POST", f"/admin/pause?timeout_s={quote(value)}", None, auth)
    if kind == "resume":
        body = draw(st.one_of(fields({}, {"weight_version": st.one_of(text, st.integers())}).map(_encode), garbage))
        return Case(kind, "POST", "/admin/resume", body, auth)
    return Case(kind, "GET", "/admin/status", None, auth)


cases = st.one_of(provider_cases(), provider_cases(), provider_cases(), control_cases())


# -- the gateway in a thread, and the oracle -----------------------------------------------------

NEWLINE = b"\n"


@dataclass
class Tally:
    bodies: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    by_route: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    def line(self) -> str:
        c4 = sum(n for s, n in self.statuses.items() if 400 <= s < 500)
        c2 = sum(n for s, n in self.statuses.items() if s < 300)
        return f"bodies {self.bodies}: 2xx {c2}, 4xx {c4}, 5xx {self.server_errors}, oracle failures {len(self.failures)}"


class FuzzGateway:
    """A real gateway (Gateway) on 127.0.0.1 in a background thread, with a long-lived session."""

    def __init__(self, root: Path) -> None:
        self.engine = RenderingFakeEngine()
        self.store = JournalStore(root)
        self.gateway = Gateway(self.engine, self.store, GatewayConfig(engine_model="fuzz", session_idle_s=None))
        self.app = self.gateway.app
        self.admin = self.gateway.config.admin_token or ""
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.app, access_log=None)
        ready = threading.Event()
        self.port = 0

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())
            self.loop.close()

        self.thread = threading.Thread(target=serve, name="fuzz-gateway", daemon=True)
        self.thread.start()
        ready.wait(30)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        own = self.gateway.open_session("own")
        other = self.gateway.open_session("other")
        self.keys = {"session": own.key or "", "other": "sk-polar-" + "x" * 32, "none": ""}
        self.own, self.other = own.id, other.id
        del other

    def close(self) -> None:
        self.conn.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    def send(self, case: Case) -> tuple[int, bytes, str]:
        headers = {"Content-Type": "application/json"}
        token = self.admin if case.auth == "admin" else self.keys.get(case.auth, "")
        if token:
            headers["Authorization"] = f"Bearer {token}"
            headers["x-api-key"] = token
        path = case.path.replace("@own", self.own)
        for attempt in (0, 1):
            try:
                self.conn.request(case.method, path, body=case.body, headers=headers)
                resp = self.conn.getresponse()
                return resp.status, resp.read(), resp.getheader("Content-Type") or ""
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def check(self, case: Case, tally: Tally) -> None:
        """Send one case and apply the oracle; failures are collected, not raised."""
        before = self.store.path(self.own).read_bytes() if self.store.path(self.own).exists() else b""
        calls = self.engine.calls
        status, body, _ = self.send(case)
        tally.bodies += 1
        tally.statuses[status] += 1
        tally.by_route[(case.route, status)] += 1
        problems = []
        if status >= 500:
            problems.append(f"{status} from the gateway")
        if status >= 400:
            try:
                err = orjson.loads(body)
                if not isinstance(err, dict) or "error" not in err:
                    problems.append("error body without 'error'")
            except orjson.JSONDecodeError:
                problems.append(f"non-JSON error body {body[:80]!r}")
        after = self.store.path(self.own).read_bytes() if self.store.path(self.own).exists() else b""
        added = after[len(before):]
        provider = case.route in PROVIDER_ROUTES and case.route != "count_tokens"
        if provider and status == 200 and case.auth == "session":
            lines = added.split(b"\n")
            if len(lines) != 2 or lines[1] != b"" or not after.startswith(before):
                problems.append(f"200 left {added.count(NEWLINE)} journal lines")
            else:
                seq = orjson.loads(lines[0])["seq"]
                prev = before.rstrip(b"\n").rsplit(b"\n", 1)[-1]
                if prev and orjson.loads(prev)["seq"] + 1 != seq:
                    problems.append(f"seq {seq} does not follow the previous record")
        elif added:
            problems.append(f"{case.route} answered {status} yet wrote to the journal")
        if status >= 400 and self.engine.calls != calls and status not in (502, 503, 504):
            problems.append(f"refused ({status}) after the engine was called")
        if case.route == "pause" and status == 200:  # a drained pause holds every later call: lift it
            self.send(Case("resume", "POST", "/admin/resume", b"{}", "admin"))
        if case.route == "delete" and status == 200:
            # the long-lived session was closed by a fuzzed DELETE: open a fresh one
            fresh = self.gateway.open_session()
            self.keys["session"], self.own = fresh.key or "", fresh.id
        if problems:
            tally.failures.append(f"{case.method} {case.path} auth={case.auth} -> {status}: {'; '.join(problems)}; "
                                  f"body {(case.body or b'')[:300]!r} answer {body[:300]!r}")
