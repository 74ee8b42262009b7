"""OpenAI Chat Completions (``POST /v1/chat/completions``): Qwen Code, opencode, pi.

Nearly the engine's own format, so translation is mostly validation: ``developer`` becomes
``system`` (pi without ``supportsDeveloperRole: false``), tool results given as a parts array
(Qwen Code) become text, non-function tools are dropped with a note, and ``max_completion_tokens``
(pi) or ``max_tokens`` set the budget. Replies carry compact tool arguments so the harness's echo
is byte-identical, and streams end with the usage chunk (if asked) and ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from polar_env.errors import RequestError
from polar_env.proxy.providers.base import (
    Inbound,
    Reply,
    Route,
    as_int,
    as_temperature,
    as_top_p,
    compact_arguments,
    id_suffix,
    object_list,
    require,
    stop_list,
    with_items,
)
from polar_env.proxy.reuse import Translations
from polar_env.proxy.sse import DONE, sse
from polar_env.records import ChatRequest, ProviderAPI

API = ProviderAPI.OPENAI_CHAT
ROUTES = (Route("POST", "/v1/chat/completions"), Route("POST", "/chat/completions"))

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _text_parts(content: Any) -> Any:
    """A list of only text parts as one string; anything else unchanged."""
    if isinstance(content, list) and all(isinstance(p, Mapping) and set(p) <= {"type", "text"} and "text" in p
                                         for p in content):
        return "".join(str(p["text"]) for p in content)
    return content


def _message(msg: Any, index: int) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise RequestError(f"messages[{index}] must be an object")
    given = msg.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise RequestError(f"messages[{index}].role {str(given)[:50]!r} is not one of {sorted(_ROLES)}")
    out: dict[str, Any] = {"role": role, "content": msg.get("content")}
    if role == "tool":
        # Qwen Code sends tool results as [{"type": "text", "text": ...}]; parts with media stay
        # parts, for the engine family's render to place.
        out["content"] = _text_parts(msg.get("content"))
        out["tool_call_id"] = msg.get("tool_call_id")
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise RequestError(f"messages[{index}].tool_calls must be a list")
            out["tool_calls"] = [_tool_call(c, index) for c in calls]
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
    if msg.get("name"):
        out["name"] = msg["name"]
    return out


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls entries need function.name")
    args = fn.get("arguments", "{}")
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()},
    }


def _tool(tool: Mapping[str, Any], i: int, notes: list[str]) -> list[dict[str, Any]]:
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
        notes.append(f"dropped tool of type {tool.get('type')!r}")
        return []
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"tools[{i}].function.name is required")
    return [{"type": "function", "function": dict(fn)}]


_TOOL_CHOICES = ("auto", "none", "required")


def _tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return choice
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        if choice.get("type", "function") == "function" and isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return {"type": "function", "function": {"name": fn["name"]}}
    raise RequestError(f"'tool_choice' must be one of {list(_TOOL_CHOICES)} or {{type: function, function: {{name}}}}")


def _template_kwargs(value: Any) -> dict[str, Any]:
    """vLLM's and SGLang's ``chat_template_kwargs`` extension (e.g. ``{"enable_thinking": false}``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError("'chat_template_kwargs' must be an object")
    return dict(value)


def to_chat(body: dict[str, Any], path_params: Mapping[str, str], memo: Translations | None = None) -> Inbound:
    """Messages and tools translate one by one: ``memo`` (the session's) reuses each shared item's."""
    messages = require(body, "messages", list, "a list of messages")
    if not messages:
        raise RequestError("'messages' must not be empty")
    memo = memo if memo is not None else Translations()
    notes: list[str] = []
    items = memo.items("openai_chat.messages", messages, lambda m, i, _: [_message(m, i)], notes)
    tools = memo.items("openai_chat.tools", object_list(body.get("tools"), "tools"), _tool, notes)
    chat = ChatRequest(
        messages=[],
        tool_choice=_tool_choice(body.get("tool_choice")),
        temperature=as_temperature(body.get("temperature"), "temperature"),
        top_p=as_top_p(body.get("top_p"), "top_p"),
        max_tokens=as_int(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens"),
        stop=stop_list(body.get("stop"), "stop"),
        seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
        response_format=body.get("response_format") if isinstance(body.get("response_format"), dict) else None,
        chat_template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
    )
    chat = with_items(chat, items, tools)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise RequestError("'stream_options' must be an object")
    options = {"include_usage": bool((stream_options or {}).get("include_usage"))}
    return Inbound(chat=chat, stream=bool(body.get("stream")), model=str(body.get("model") or ""), notes=notes, options=options)


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{id_suffix(c.id)}", "type": "function", "function": {"name": c.name, "arguments": compact_arguments(c.arguments)}}
        for c in reply.generation.message.tool_calls
    ]


def _usage(reply: Reply) -> dict[str, int]:
    gen = reply.generation
    return {
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": len(gen.response_ids),
        "total_tokens": len(gen.prompt_ids) + len(gen.response_ids),
    }


def from_chat(reply: Reply) -> dict[str, Any]:
    msg = reply.generation.message
    message: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.reasoning is not None:
        message["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return {
        "id": f"chatcmpl-{reply.request_id}",
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reply.generation.finish_reason}],
        "usage": _usage(reply),
    }


def stream_events(reply: Reply) -> Iterator[bytes]:
    msg = reply.generation.message
    head = {"id": f"chatcmpl-{reply.request_id}", "object": "chat.completion.chunk", "created": reply.created, "model": reply.model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    if msg.reasoning:
        yield chunk({"reasoning_content": msg.reasoning})
    if msg.content:
        yield chunk({"content": msg.content})
    for index, call in enumerate(_tool_calls(reply)):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, reply.generation.finish_reason)
    if reply.options.get("include_usage"):
        yield sse({**head, "choices": [], "usage": _usage(reply)})
    yield DONE


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
