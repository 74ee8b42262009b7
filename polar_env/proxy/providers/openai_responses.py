"""OpenAI Responses (``POST /v1/responses``): Codex CLI, and pi in ``openai-responses`` mode.

Input items become OpenAI Chat messages. A ``reasoning`` item becomes the ``reasoning_content`` of
the assistant message built from the items after it; an assistant ``message`` and the
``function_call`` items right after it are one assistant turn, so ``[reasoning, message,
function_call...]`` (exactly what ``from_chat`` emits) folds back into the one assistant message
the engine produced. Nothing server-side can be resolved: ``previous_response_id`` and
``item_reference`` are noted and ignored, and encrypted reasoning is dropped.

Codex groups some tools in ``namespace`` tools (``multi_agent_v1``). Chat has no namespaces, so
their functions are flattened to ``{namespace}__{name}``, Codex's own canonical flat name
(``ToolName::canonical_flat_name``). Codex routes a call by the *pair* (``namespace``, ``name``)
and a flat name matches no handler, so the mapping travels in ``Inbound.options["namespaces"]``
and replies split the name again; echoed ``function_call`` items that carry ``namespace`` are
flattened the same way, so the history matches what the model wrote. Non-function tools
(``web_search``, ``custom``, ...) are dropped with a note.

Replies: one ``function_call`` item per call with compact JSON arguments (pi re-serialises with
``JSON.stringify``; Codex echoes the raw string), the full streaming event sequence (pi builds its
message from ``output_item.added`` and the deltas), and always a ``response.completed`` event, even
when the output was cut by the token budget: Codex treats ``response.incomplete`` as a stream error
and retries the turn, so truncation is reported as ``status: "incomplete"`` inside it instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import count
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
    require,
)
from polar_env.proxy.reuse import Translations
from polar_env.proxy.sse import sse
from polar_env.records import ChatRequest, ProviderAPI

API = ProviderAPI.OPENAI_RESPONSES
ROUTES = (Route("POST", "/v1/responses"), Route("POST", "/responses"))

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
_TOOL_CHOICES = {"auto", "none", "required"}
_NAMESPACE_SEPARATOR = "__"


def _note(notes: list[str], text: str) -> None:
    if text not in notes:  # one note per kind: a long session must not repeat it every turn
        notes.append(text)


def flat_name(namespace: str, name: str) -> str:
    """Codex's canonical flat name for a namespaced tool (``codex-rs/protocol/src/tool_name.rs``)."""
    return f"{namespace.rstrip('_')}{_NAMESPACE_SEPARATOR}{name.lstrip('_')}"


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}.{key} must be a non-empty string")
    return value


# --- request -------------------------------------------------------------------------------------


def _content(content: Any, where: str, notes: list[str]) -> str | list[dict[str, Any]]:
    """Message content (or tool output) as Chat content: text parts joined (what the template does
    with a parts list anyway), or a parts list when an image must stay a real image part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise RequestError(f"{at} must be an object with a string 'type'")
        kind = part["type"]
        if kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise RequestError(f"{at}.{'refusal' if kind == 'refusal' else 'text'} must be a string")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:  # input_file, input_image by file_id, audio: nothing the engine can fetch
            _note(notes, f"dropped content part of type {kind!r}")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value  # raw, as echoed: the engine re-renders it, the capture keeps the original
    if isinstance(value, Mapping):
        return orjson.dumps(value).decode()
    raise RequestError(f"{where}.arguments must be a JSON string")


def _reasoning(item: Mapping[str, Any], where: str, notes: list[str]) -> str:
    """The text of a reasoning item: raw ``content`` when present, else the summary parts."""
    if item.get("encrypted_content"):
        _note(notes, "dropped encrypted reasoning content (only its text is used)")
    content = item.get("content")
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        if texts:
            return "".join(texts)
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise RequestError(f"{where}.summary must be a list")
    texts = []
    for i, part in enumerate(summary):
        if not isinstance(part, Mapping) or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.summary[{i}].text must be a string")
        texts.append(part["text"])
    return "\n\n".join(texts)  # how pi joins several summary parts; from_chat emits one


class _Transcript:
    """Chat messages built item by item, tracking which assistant message a call may join."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] = []  # waiting for the next assistant message
        self.open: dict[str, Any] | None = None  # the assistant turn the next function_call joins

    def assistant(self, content: str | list[dict[str, Any]] | None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = "\n\n".join(self.reasoning)
            self.reasoning = []
        self.messages.append(msg)
        self.open = msg
        return msg

    def call(self, tool_call: dict[str, Any]) -> None:
        msg = self.open if self.open is not None and not self.reasoning else self.assistant(None)
        msg.setdefault("tool_calls", []).append(tool_call)

    def other(self, msg: dict[str, Any]) -> None:
        self.flush()
        self.messages.append(msg)
        self.open = None

    def flush(self) -> None:
        """Reasoning with no assistant item after it (a reply cut short) is a turn of its own."""
        if self.reasoning:
            self.assistant("")


def _items(items: list[Any], notes: list[str]) -> list[dict[str, Any]]:
    out = _Transcript()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type")
        if kind is None and "role" not in item:
            raise RequestError(f"{where} needs a 'type' (or a 'role' for a message)")
        if kind in (None, "message"):
            role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise RequestError(f"{where}.role {item.get('role')!r} is not one of {sorted(_ROLES)}")
            content = _content(item.get("content"), f"{where}.content", notes)
            if role == "assistant":
                out.assistant(content)
            else:
                out.other({"role": role, "content": content})
        elif kind == "reasoning":
            text = _reasoning(item, where, notes)
            if text:
                out.reasoning.append(text)
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            namespace = item.get("namespace")
            if isinstance(namespace, str) and namespace:
                name = flat_name(namespace, name)
            arguments = _arguments(item.get("arguments", ""), where)
            out.call({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "custom_tool_call":  # freeform tool (apply_patch): its raw input as one argument
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            if not isinstance(item.get("input"), str):
                raise RequestError(f"{where}.input must be a string")
            arguments = orjson.dumps({"input": item["input"]}).decode()
            out.call({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            _note(notes, "custom_tool_call history sent as a function call with one 'input' argument")
        elif kind == "local_shell_call":
            shell_id = item.get("call_id") or item.get("id")
            if not isinstance(shell_id, str) or not shell_id:
                raise RequestError(f"{where}.call_id must be a non-empty string")
            call_id = shell_id
            if not isinstance(item.get("action"), Mapping):
                raise RequestError(f"{where}.action must be an object")
            action = {k: v for k, v in item["action"].items() if k != "type"}
            arguments = orjson.dumps(action).decode()
            out.call({"id": call_id, "type": "function", "function": {"name": "local_shell", "arguments": arguments}})
            _note(notes, "local_shell_call history sent as a 'local_shell' function call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", where)
            if "output" not in item:
                raise RequestError(f"{where}.output is required")
            content = _content(item["output"], f"{where}.output", notes)
            out.other({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "item_reference":
            _note(notes, "dropped item_reference input items (server-side state cannot be resolved)")
        else:  # web_search_call, file_search_call, compaction, mcp_*, tool_search_*: server-side
            _note(notes, f"dropped input items of type {kind!r}")
    out.flush()
    return out.messages


def _function(tool: Mapping[str, Any], where: str, name: str | None = None) -> dict[str, Any]:
    """A Responses function tool as a Chat tool; Responses-only keys (defer_loading, output_schema) go."""
    declared = _string(tool, "name", where)
    fn: dict[str, Any] = {"name": name or declared}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    if "parameters" in tool and tool["parameters"] is not None:
        if not isinstance(tool["parameters"], Mapping):
            raise RequestError(f"{where}.parameters must be an object")
        fn["parameters"] = dict(tool["parameters"])
    if isinstance(tool.get("strict"), bool):
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def _tools(tools: Any, notes: list[str]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Chat tools plus ``{flat name: [namespace, name]}`` for the functions of namespace tools."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out: list[dict[str, Any]] = []
    namespaces: dict[str, list[str]] = {}

    def add(tool: dict[str, Any]) -> None:
        name = tool["function"]["name"]
        if any(t["function"]["name"] == name for t in out):
            _note(notes, f"dropped duplicate tool {name!r}")
        else:
            out.append(tool)

    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise RequestError(f"{where} must be an object with a string 'type'")
        if tool["type"] == "function":
            add(_function(tool, where))
        elif tool["type"] == "namespace":
            namespace = _string(tool, "name", where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise RequestError(f"{where}.tools must be a list")
            for j, sub in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(sub, Mapping) or not isinstance(sub.get("type"), str):
                    raise RequestError(f"{at} must be an object with a string 'type'")
                if sub["type"] != "function":
                    _note(notes, f"dropped tool of type {sub['type']!r} in namespace {namespace!r}")
                    continue
                flat = flat_name(namespace, _string(sub, "name", at))
                add(_function(sub, at, name=flat))
                namespaces[flat] = [namespace, sub["name"]]
        else:
            _note(notes, f"dropped tool of type {tool['type']!r}")
    if namespaces:
        _note(notes, f"namespace tools flattened: {', '.join(sorted(namespaces))}")
    return out, namespaces


def _tool_choice(choice: Any, notes: list[str]) -> str | dict[str, Any] | None:
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return choice
    if isinstance(choice, Mapping):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str) and choice["name"]:
            name = choice["name"]
            if isinstance(choice.get("namespace"), str) and choice["namespace"]:
                name = flat_name(choice["namespace"], name)
            return {"type": "function", "function": {"name": name}}
        _note(notes, f"dropped tool_choice of type {choice.get('type')!r} (the engine decides)")
        return None
    raise RequestError(f"'tool_choice' must be one of {sorted(_TOOL_CHOICES)} or a function choice object")


def _response_format(text: Any, notes: list[str]) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if not isinstance(fmt, Mapping) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise RequestError("'text.format.schema' must be an object")
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    _note(notes, f"dropped text.format of type {fmt['type']!r}")
    return None


def to_chat(body: dict[str, Any], path_params: Mapping[str, str], memo: Translations | None = None) -> Inbound:
    """The whole body, every time (``memo`` unused): items fold into the messages around them
    (calls into the assistant turn), so they do not translate one by one."""
    items = require(body, "input", (str, list), "a string or a list of input items")
    notes: list[str] = []
    if body.get("previous_response_id"):
        _note(notes, "ignored previous_response_id (server-side state cannot be resolved; only 'input' is used)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        if not items:
            raise RequestError("'input' must not be empty")
        messages += _items(items, notes)
    if not messages:
        raise RequestError("'input' has no item the model can answer")
    tools, namespaces = _tools(body.get("tools"), notes)
    chat = ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), notes),
        temperature=as_temperature(body.get("temperature"), "temperature"),
        top_p=as_top_p(body.get("top_p"), "top_p"),
        max_tokens=as_int(body.get("max_output_tokens"), "max_output_tokens"),
        response_format=_response_format(body.get("text"), notes),
    )
    # Echoed in the Response object, as the real API echoes the request's settings.
    echo = {
        "tool_choice": body.get("tool_choice") if isinstance(body.get("tool_choice"), (str, dict)) else "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") if isinstance(body.get("parallel_tool_calls"), bool) else True,
        "temperature": chat.temperature if chat.temperature is not None else 1.0,
        "top_p": chat.top_p if chat.top_p is not None else 1.0,
        "max_output_tokens": chat.max_tokens,
        "previous_response_id": body.get("previous_response_id") if isinstance(body.get("previous_response_id"), str) else None,
        "store": body.get("store") if isinstance(body.get("store"), bool) else True,
    }
    options = {"namespaces": namespaces, "echo": echo}
    return Inbound(chat=chat, stream=bool(body.get("stream")), model=str(body.get("model") or ""), notes=notes, options=options)


# --- reply ---------------------------------------------------------------------------------------


def _output(reply: Reply) -> list[dict[str, Any]]:
    """The finished output items: reasoning, message, then one function_call per call."""
    msg = reply.generation.message
    status = "incomplete" if reply.generation.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if msg.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{reply.request_id}", "summary": [{"type": "summary_text", "text": msg.reasoning}]})
    if msg.content or not (items or msg.tool_calls):  # an empty reply still answers with a message
        items.append({
            "type": "message", "id": f"msg_{reply.request_id}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": msg.content or "", "annotations": [], "logprobs": []}],
        })
    namespaces: Mapping[str, list[str]] = reply.options.get("namespaces") or {}
    for call in msg.tool_calls:
        suffix = id_suffix(call.id)
        item: dict[str, Any] = {"type": "function_call", "id": f"fc_{suffix}", "call_id": f"call_{suffix}", "name": call.name}
        if call.name in namespaces:  # Codex dispatches on (namespace, name); see the module docstring
            item["namespace"], item["name"] = namespaces[call.name]
        item["arguments"] = compact_arguments(call.arguments)
        item["status"] = status
        items.append(item)
    return items


def _usage(reply: Reply) -> dict[str, Any]:
    prompt, response = len(reply.generation.prompt_ids), len(reply.generation.response_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": response,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + response,
    }


def _response(reply: Reply, output: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The Response object; ``output=None`` is the in-progress shell that opens a stream."""
    echo: Mapping[str, Any] = reply.options.get("echo") or {}
    if output is None:
        status, details = "in_progress", None
    elif reply.generation.finish_reason == "length":
        status, details = "incomplete", {"reason": "max_output_tokens"}
    else:
        status, details = "completed", None
    return {
        "id": f"resp_{reply.request_id}",
        "object": "response",
        "created_at": reply.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": details,
        "instructions": None,
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": reply.model,
        "output": output or [],
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": echo.get("store", False),
        "temperature": echo.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": [],
        "top_p": echo.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": _usage(reply) if output is not None else None,
        "user": None,
        "metadata": {},
    }


def from_chat(reply: Reply) -> dict[str, Any]:
    return _response(reply, _output(reply))


def stream_events(reply: Reply) -> Iterator[bytes]:
    """The full event sequence, each item opened empty, filled by one delta, then closed."""
    seq = count()

    def event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    output = _output(reply)
    yield event("response.created", response=_response(reply, None))
    yield event("response.in_progress", response=_response(reply, None))
    for index, item in enumerate(output):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            yield event("response.output_item.added", output_index=index, item={**item, "summary": []})
            for s, part in enumerate(item["summary"]):
                yield event("response.reasoning_summary_part.added", **at, summary_index=s, part={**part, "text": ""})
                if part["text"]:
                    yield event("response.reasoning_summary_text.delta", **at, summary_index=s, delta=part["text"])
                yield event("response.reasoning_summary_text.done", **at, summary_index=s, text=part["text"])
                yield event("response.reasoning_summary_part.done", **at, summary_index=s, part=part)
        elif item["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            for c, part in enumerate(item["content"]):
                yield event("response.content_part.added", **at, content_index=c, part={**part, "text": ""})
                if part["text"]:
                    yield event("response.output_text.delta", **at, content_index=c, delta=part["text"], logprobs=[])
                yield event("response.output_text.done", **at, content_index=c, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **at, content_index=c, part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            if item["arguments"]:
                yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=_response(reply, output))


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
