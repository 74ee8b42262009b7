"""Anthropic Messages (``POST /v1/messages``): Claude Code and pi's ``anthropic-messages`` mode.

Content blocks become OpenAI Chat messages: ``tool_result`` blocks become ``tool`` messages placed
before the rest of their user turn, ``thinking`` becomes ``reasoning_content``, ``tool_use`` becomes
``tool_calls`` with compact JSON arguments. Claude Code's mid-list ``role: "system"`` entries stay a
system message in place; whether the engine can take them is the gateway quirks layer's call.
``cache_control`` and thinking signatures are dropped. Streams replay the finished reply as the full
event sequence Claude Code needs: text only in deltas, never in ``content_block_start``.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from polar_env.errors import RequestError
from polar_env.proxy.providers.base import (
    Inbound,
    Reply,
    Route,
    arguments_object,
    as_int,
    as_temperature,
    as_top_p,
    id_suffix,
    object_list,
    require,
    stop_list,
    with_items,
)
from polar_env.proxy.reuse import Translations
from polar_env.proxy.sse import sse
from polar_env.records import ChatRequest, ProviderAPI

API = ProviderAPI.ANTHROPIC
ROUTES = (Route("POST", "/v1/messages"),)  # Claude Code 2.1 adds ?beta=true; routing is by path

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _note(notes: list[str], text: str) -> None:
    if text not in notes:  # one note per kind: a long session must not repeat it every turn
        notes.append(text)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise RequestError(f"{where} must be an object with a string 'type'")
    return str(block["type"])


def _text(block: Mapping[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}.text must be a string")
    return str(block["text"])


def _plain_text(content: Any, where: str) -> str:
    """System prompts (top-level or mid-list): a string or text blocks, joined as paragraphs."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(content):
        if _block_type(block, f"{where}[{i}]") != "text":
            raise RequestError(f"{where}[{i}] must be a text block")
        texts.append(_text(block, f"{where}[{i}]"))
    return "\n\n".join(texts)


def _image(block: Mapping[str, Any], where: str, notes: list[str]) -> dict[str, Any] | None:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise RequestError(f"{where}.source must be an object")
    kind = source.get("type")
    if kind == "base64":
        if not isinstance(source.get("data"), str) or not isinstance(source.get("media_type"), str):
            raise RequestError(f"{where}.source needs string 'media_type' and 'data'")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url":
        if not isinstance(source.get("url"), str):
            raise RequestError(f"{where}.source.url must be a string")
        url = source["url"]
    else:
        _note(notes, f"dropped image with source type {kind!r}")
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(block: Mapping[str, Any], kind: str, where: str, notes: list[str]) -> list[dict[str, Any]]:
    """A text or image block as OpenAI content parts; other kinds are dropped with a note."""
    if kind == "text":
        return [{"type": "text", "text": _text(block, where)}]
    if kind == "image":
        part = _image(block, where, notes)
        return [part] if part else []
    if kind == "document" and not isinstance(block.get("source"), Mapping):
        raise RequestError(f"{where}.source must be an object")
    _note(notes, f"dropped {kind} block")
    return []


def _tool_message(block: Mapping[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise RequestError(f"{where}.tool_use_id must be a non-empty string")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for i, inner in enumerate(content):
            parts += _parts(inner, _block_type(inner, f"{where}.content[{i}]"), f"{where}.content[{i}]", notes)
        content = parts
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of blocks")
    if block.get("is_error"):
        # Claude Code already words failures in the text (<tool_use_error>); Chat has no flag for it.
        _note(notes, "tool_result is_error flag not forwarded (content kept as sent)")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _user(content: Any, where: str, notes: list[str]) -> list[dict[str, Any]]:
    """One user turn: its tool results first (as ``tool`` messages), then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks")
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = _block_type(block, at)
        if kind == "tool_result":
            tools.append(_tool_message(block, at, notes))
        else:
            parts += _parts(block, kind, at, notes)
    return tools + ([{"role": "user", "content": parts}] if parts or not tools else [])


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not block["name"]:
        raise RequestError(f"{where}.name must be a non-empty string")
    if not isinstance(block.get("id"), str) or not block["id"]:
        raise RequestError(f"{where}.id must be a non-empty string")
    args = block.get("input", {})
    if not isinstance(args, Mapping):
        raise RequestError(f"{where}.input must be an object")
    # Compact, as the engine's echo of its own reply was compact: the rendered history stays stable.
    arguments = orjson.dumps(args).decode()
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _assistant(content: Any, where: str, notes: list[str]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise RequestError(f"{at}.thinking must be a string")
            thoughts.append(block["thinking"])  # the signature is Anthropic's; the engine has no use for it
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        else:
            _note(notes, f"dropped {kind} block")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if thoughts:
        out["reasoning_content"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return out


def _message(msg: Any, i: int, notes: list[str]) -> list[dict[str, Any]]:
    where = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise RequestError(f"{where} must be an object")
    if "content" not in msg:
        raise RequestError(f"{where}.content is required")
    role = msg.get("role")
    if role == "user":
        return _user(msg["content"], where, notes)
    if role == "assistant":
        return [_assistant(msg["content"], where, notes)]
    if role == "system":  # Claude Code 2.1 (mid-conversation-system beta): keep it here, in order
        return [{"role": "system", "content": _plain_text(msg["content"], f"{where}.content")}]
    raise RequestError(f"{where}.role {role!r} is not one of ['assistant', 'system', 'user']")


def _messages(body: Mapping[str, Any], notes: list[str], memo: Translations) -> list[dict[str, Any]]:
    messages = require(body, "messages", list, "a list of messages")
    if not messages:
        raise RequestError("'messages' must not be empty")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _plain_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    return out + memo.items("anthropic.messages", messages, _message, notes)


def _tool(tool: Mapping[str, Any], i: int, notes: list[str]) -> list[dict[str, Any]]:
    if tool.get("type", "custom") != "custom" and "input_schema" not in tool:
        _note(notes, f"dropped server tool of type {tool['type']!r}")
        return []
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise RequestError(f"tools[{i}].name must be a non-empty string")
    if not isinstance(tool.get("input_schema"), Mapping):
        raise RequestError(f"tools[{i}].input_schema must be an object")
    fn: dict[str, Any] = {"name": tool["name"]}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    fn["parameters"] = dict(tool["input_schema"])  # as given, $schema included; cache_control is not copied
    return [{"type": "function", "function": fn}]


def _tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if not isinstance(kind, str):
        raise RequestError("'tool_choice' must be an object with type auto, any, tool or none")
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind]
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise RequestError("tool_choice.name must be a non-empty string when type is 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError("'tool_choice' must be an object with type auto, any, tool or none")


def _response_format(output_config: Any, notes: list[str]) -> dict[str, Any] | None:
    fmt = output_config.get("format") if isinstance(output_config, Mapping) else None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        return None
    if not isinstance(fmt.get("schema"), Mapping):
        raise RequestError("output_config.format.schema must be an object")
    # Claude Code's title request (structured-outputs beta); Chat needs a schema name, Anthropic has none.
    _note(notes, "output_config.format json_schema sent as response_format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": dict(fmt["schema"])}}


def _template_kwargs(thinking: Any) -> dict[str, Any]:
    if thinking is None:
        return {}
    if not isinstance(thinking, Mapping):
        raise RequestError("'thinking' must be an object")
    # enabled (with budget_tokens) and adaptive keep the template's default: thinking on.
    return {"enable_thinking": False} if thinking.get("type") == "disabled" else {}


def _chat(body: Mapping[str, Any], notes: list[str], max_tokens: int | None, memo: Translations) -> ChatRequest:
    """Messages and tools translate one by one: ``memo`` (the session's) reuses each shared item's."""
    if "top_k" in body:
        _note(notes, "ignored top_k")
    messages = _messages(body, notes, memo)
    tools = memo.items("anthropic.tools", object_list(body.get("tools"), "tools"), _tool, notes)
    chat = ChatRequest(
        messages=[],
        tool_choice=_tool_choice(body.get("tool_choice")),
        temperature=as_temperature(body.get("temperature"), "temperature"),
        top_p=as_top_p(body.get("top_p"), "top_p"),
        max_tokens=max_tokens,
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        response_format=_response_format(body.get("output_config"), notes),
        chat_template_kwargs=_template_kwargs(body.get("thinking")),
    )
    return with_items(chat, messages, tools)


def to_chat(body: dict[str, Any], path_params: Mapping[str, str], memo: Translations | None = None) -> Inbound:
    if not isinstance(body, Mapping):
        raise RequestError("request body must be a JSON object")
    max_tokens = as_int(require(body, "max_tokens", int, "a positive integer"), "max_tokens")
    notes: list[str] = []
    chat = _chat(body, notes, max_tokens, memo if memo is not None else Translations())
    options = {"stop_sequences": chat.stop}  # from_chat tells stop_sequence from end_turn with these
    return Inbound(chat=chat, stream=bool(body.get("stream")), model=str(body.get("model") or ""), notes=notes, options=options)


def count_tokens_chat(body: dict[str, Any]) -> ChatRequest:
    """``/v1/messages/count_tokens`` bodies (no ``max_tokens``), converted exactly as ``to_chat`` does."""
    if not isinstance(body, Mapping):
        raise RequestError("request body must be a JSON object")
    return _chat(body, [], None, Translations())


def _stop(reply: Reply) -> tuple[str, str | None]:
    gen = reply.generation
    if gen.finish_reason == "length":
        return "max_tokens", None
    if gen.message.tool_calls or gen.finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(gen.stop_reason, str) and gen.stop_reason in reply.options.get("stop_sequences", ()):
        return "stop_sequence", gen.stop_reason
    return "end_turn", None


def _content(reply: Reply) -> list[dict[str, Any]]:
    msg = reply.generation.message
    blocks: list[dict[str, Any]] = []
    if msg.reasoning:
        # A non-empty opaque signature: pi (and SDK clients) replay only signed thinking blocks and
        # turn unsigned ones into text; replayed reasoning keeps the next prompt an exact append.
        signature = base64.b64encode(f"polar:{reply.request_id}".encode()).decode()
        blocks.append({"type": "thinking", "thinking": msg.reasoning, "signature": signature})
    if msg.content:
        blocks.append({"type": "text", "text": msg.content})
    for call in msg.tool_calls:
        tool_id = f"toolu_{id_suffix(call.id)}"
        blocks.append({"type": "tool_use", "id": tool_id, "name": call.name, "input": arguments_object(call.arguments)})
    return blocks


def _usage(reply: Reply, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": len(reply.generation.prompt_ids),
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def from_chat(reply: Reply) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop(reply)
    return {
        "id": f"msg_{reply.request_id}",
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": _content(reply),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(reply, len(reply.generation.response_ids)),
    }


def _deltas(block: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A block's empty ``content_block_start`` form and the deltas that fill it."""
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}, [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    if block["type"] == "tool_use":
        partial = orjson.dumps(block["input"]).decode()
        return {**block, "input": {}}, [{"type": "input_json_delta", "partial_json": partial}]
    return {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]


def stream_events(reply: Reply) -> Iterator[bytes]:
    def event(kind: str, **data: Any) -> bytes:
        return sse({"type": kind, **data}, event=kind)

    body = from_chat(reply)
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(reply, 1)}
    yield event("message_start", message=start)
    for index, block in enumerate(body["content"]):
        empty, deltas = _deltas(block)
        yield event("content_block_start", index=index, content_block=empty)
        for delta in deltas:
            yield event("content_block_delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
    stop = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
    yield event("message_delta", delta=stop, usage={"output_tokens": body["usage"]["output_tokens"]})
    yield event("message_stop")


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
