"""Gemini ``generateContent`` / ``streamGenerateContent``: Gemini CLI and pi's google-generative-ai mode.

The furthest format from the engine's, so translation does real work:

- ``contents`` turns (``user``/``model``) of typed parts become Chat messages. A model turn's
  ``thought`` text is reasoning, its ``functionCall`` parts are tool calls; a user turn's
  ``functionResponse`` parts become tool messages placed before any text of that turn.
- Gemini ids are optional. A call without one gets ``{name}_{turn}_{k}``; a response is paired
  by id when it has one that matches, else with the first unanswered call of the same name in the
  latest model turn. So Gemini CLI's rewritten echo (it adds ``functionCall.id`` and
  ``thoughtSignature``) and pi's id-less echo pair up the same way.
- Gemini schemas are an OpenAPI subset: ``OBJECT``/``STRING``... become JSON Schema names and
  ``nullable`` becomes a ``"null"`` type, in tools (``parameters`` or ``parametersJsonSchema``)
  and in ``responseSchema``/``responseJsonSchema``.
- Text parts of one turn are joined with no separator: clients split one message into parts and
  carry their own newlines.

Replies put thoughts, text and calls in separate stream chunks (the last one carries
``finishReason`` and ``usageMetadata``); there are no event names and no ``[DONE]``.
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
    arguments_object,
    as_float,
    as_int,
    as_temperature,
    as_top_p,
    id_suffix,
    require,
    stop_list,
)
from polar_env.proxy.reuse import Translations
from polar_env.proxy.sse import sse
from polar_env.records import ChatRequest, ProviderAPI

API = ProviderAPI.GEMINI
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1beta/models/{model}:{method}"),
    Route("POST", "/v1/models/{model}:{method}"),
)

_STREAM = {"generateContent": False, "streamGenerateContent": True}
_ROLES = {"user": "user", "model": "model", "function": "user"}  # "function": the legacy tool-result role
# Keys a part may carry besides its data; a part with only these (an echoed signature) is skipped.
_PART_METADATA = {"thought", "thoughtSignature", "partMetadata", "videoMetadata", "mediaResolution"}
_KNOWN_PARTS = (
    "text",
    "functionCall",
    "functionResponse",
    "inlineData",
    "fileData",
    "executableCode",
    "codeExecutionResult",
)


# ---- schemas --------------------------------------------------------------------------------

_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "not",
    "contains",
    "if",
    "then",
    "else",
    "propertyNames",
)
# int64 in Gemini's proto, so a proto-JSON client may send them as strings.
_SCHEMA_INTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def _type_name(value: Any) -> Any:
    if isinstance(value, str):
        return value.lower() if value.upper() in _TYPES else (None if value == "TYPE_UNSPECIFIED" else value)
    if isinstance(value, list):
        return [_type_name(v) for v in value if v != "TYPE_UNSPECIFIED"]
    return value


def normalize_schema(node: Any) -> Any:
    """A Gemini (OpenAPI-subset) schema as JSON Schema, recursively.

    Uppercase type names become lowercase; ``nullable: true`` adds ``"null"`` to the type (or a
    null branch to ``anyOf``), since guided decoding and tool parsers read JSON Schema. Gemini-only
    keys (``nullable``, ``propertyOrdering``, ``format: enum``) go; everything else is kept.
    Property names, ``enum`` values and defaults are data, never rewritten.
    """
    if isinstance(node, list):
        return [normalize_schema(n) for n in node]
    if not isinstance(node, Mapping):
        return node  # boolean schemas
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            kind = _type_name(value)
            if kind is not None:
                out[key] = kind
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: normalize_schema(sub) for name, sub in value.items()}
        elif (key in _SCHEMA_LISTS and isinstance(value, list)) or key in _SCHEMA_ONE:
            out[key] = normalize_schema(value)
        elif key in _SCHEMA_INTS and isinstance(value, str) and value.isdigit():
            out[key] = int(value)
        elif key in ("nullable", "propertyOrdering") or (key == "format" and value == "enum"):
            continue
        else:
            out[key] = value
    if node.get("nullable") is True:
        kind = out.get("type")
        if isinstance(kind, str) and kind != "null":
            out["type"] = [kind, "null"]
        elif isinstance(kind, list) and "null" not in kind:
            out["type"] = [*kind, "null"]
        elif kind is None and isinstance(out.get("anyOf"), list):
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    return out


# ---- request --------------------------------------------------------------------------------


def _mapping(value: Any, where: str, *, optional: bool = False) -> Mapping[str, Any]:
    if optional and value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(f"'{where}' must be an object")
    return value


def _compact_json(value: Any, where: str) -> str:
    """Compact JSON, as the JSON.stringify-style clients write it (orjson refuses ints past 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:
        raise RequestError(f"'{where}' cannot be encoded as JSON: {exc}") from exc


def _text(part: Mapping[str, Any], where: str) -> str:
    text = part["text"]
    if not isinstance(text, str):
        raise RequestError(f"'{where}.text' must be a string")
    return text


def _code_text(part: Mapping[str, Any], notes: list[str], where: str) -> str:
    """Code-execution parts (server-side tool output) as plain text the model can read."""
    notes.append(f"{where}: code execution part converted to text")
    if "executableCode" in part:
        code = _mapping(part["executableCode"], f"{where}.executableCode")
        language = str(code.get("language") or "").lower().replace("language_unspecified", "")
        return f"```{language}\n{code.get('code', '')}\n```"
    result = _mapping(part["codeExecutionResult"], f"{where}.codeExecutionResult")
    return f"Code execution result ({result.get('outcome', 'OUTCOME_UNSPECIFIED')}):\n{result.get('output', '')}"


def _system(value: Any, notes: list[str]) -> str | None:
    """``systemInstruction`` as text: a string, a Content (role ignored), or a bare parts list."""
    if value is None or isinstance(value, str):
        return value or None
    parts = value.get("parts") if isinstance(value, Mapping) else value
    if not isinstance(parts, list):
        raise RequestError("'systemInstruction' must be a string or an object with a 'parts' list")
    texts = []
    for j, part in enumerate(parts):
        where = f"systemInstruction.parts[{j}]"
        part = _mapping(part, where)
        if "text" in part:
            texts.append(_text(part, where))
        else:
            notes.append(f"{where}: dropped non-text system part")
    return "".join(texts) or None


def _function_call(part: Mapping[str, Any], turn: int, k: int, where: str) -> dict[str, Any]:
    call = _mapping(part["functionCall"], f"{where}.functionCall")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"'{where}.functionCall.name' must be a non-empty string")
    args = call.get("args")
    if args is not None and not isinstance(args, Mapping):
        raise RequestError(f"'{where}.functionCall.args' must be an object")
    given = call.get("id")
    return {
        "id": given if isinstance(given, str) and given else f"{name}_{turn}_{k}",
        "type": "function",
        "function": {"name": name, "arguments": _compact_json(args or {}, f"{where}.functionCall.args")},
    }


def _model_turn(parts: list[Any], turn: int, notes: list[str]) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(parts):
        where = f"contents[{turn}].parts[{j}]"
        part = _mapping(raw, where)
        if "functionCall" in part:
            calls.append(_function_call(part, turn, len(calls), where))
        elif "text" in part:
            (thoughts if part.get("thought") is True else texts).append(_text(part, where))
        elif "executableCode" in part or "codeExecutionResult" in part:
            texts.append(_code_text(part, notes, where))
        elif "inlineData" in part or "fileData" in part:
            notes.append(f"{where}: dropped media part in a model turn")
        elif "functionResponse" in part:
            raise RequestError(f"'{where}.functionResponse' belongs in a user turn, not a model turn")
        elif not part or not part.keys() <= _PART_METADATA:
            raise RequestError(f"'{where}' has none of the known part fields {list(_KNOWN_PARTS)}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _response_text(response: Any, where: str) -> str:
    """Gemini CLI and pi wrap tool output as ``{"output": text}``; anything else stays JSON."""
    if isinstance(response, Mapping) and response.keys() == {"output"} and isinstance(response["output"], str):
        return response["output"]
    return _compact_json(response if response is not None else {}, f"{where}.functionResponse.response")


def _tool_message(
    part: Mapping[str, Any], pending: list[tuple[str, str]], turn: int, k: int, notes: list[str], where: str
) -> dict[str, Any]:
    """A ``functionResponse`` as a tool message, paired with a call of the latest model turn.

    Pairing: the call with the same id if there is one, else the first unanswered call with the
    same name, else the response's own id (or a synthesized one). ``pending`` is consumed.
    """
    result = _mapping(part["functionResponse"], f"{where}.functionResponse")
    name = result.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"'{where}.functionResponse.name' must be a non-empty string")
    given = result.get("id") if isinstance(result.get("id"), str) and result.get("id") else None
    match = next((i for i, (_, cid) in enumerate(pending) if given is not None and cid == given), None)
    if match is None:
        match = next((i for i, (n, _) in enumerate(pending) if n == name), None)
    call_id = pending.pop(match)[1] if match is not None else (given or f"{name}_{turn}_{k}")
    if result.get("parts"):
        notes.append(f"{where}: dropped functionResponse.parts (multimodal tool output)")
    return {"role": "tool", "tool_call_id": call_id, "content": _response_text(result.get("response"), where)}


def _user_turn(parts: list[Any], turn: int, pending: list[tuple[str, str]], notes: list[str]) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    content: list[dict[str, Any]] = []
    for j, raw in enumerate(parts):
        where = f"contents[{turn}].parts[{j}]"
        part = _mapping(raw, where)
        if "functionResponse" in part:
            tools.append(_tool_message(part, pending, turn, len(tools), notes, where))
        elif "text" in part:
            content.append({"type": "text", "text": _text(part, where)})
        elif "inlineData" in part:
            blob = _mapping(part["inlineData"], f"{where}.inlineData")
            mime, data = blob.get("mimeType"), blob.get("data")
            if not isinstance(mime, str) or not isinstance(data, str):
                raise RequestError(f"'{where}.inlineData' needs string 'mimeType' and 'data'")
            if mime.startswith("image/"):
                content.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}})
            else:
                notes.append(f"{where}: dropped inlineData of type {mime}")
        elif "fileData" in part:
            notes.append(f"{where}: dropped fileData (file URIs cannot be fetched)")
        elif "executableCode" in part or "codeExecutionResult" in part:
            content.append({"type": "text", "text": _code_text(part, notes, where)})
        elif "functionCall" in part:
            raise RequestError(f"'{where}.functionCall' belongs in a model turn, not a user turn")
        elif not part or not part.keys() <= _PART_METADATA:
            raise RequestError(f"'{where}' has none of the known part fields {list(_KNOWN_PARTS)}")
    # Tool results first: Chat requires them right after the assistant turn that made the calls.
    if not content:
        return tools
    if all(c["type"] == "text" for c in content):
        return [*tools, {"role": "user", "content": "".join(c["text"] for c in content)}]
    return [*tools, {"role": "user", "content": content}]


def _messages(contents: list[Any], system: str | None, notes: list[str]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    pending: list[tuple[str, str]] = []  # (name, id) of the latest model turn's unanswered calls
    for turn, raw in enumerate(contents):
        content = _mapping(raw, f"contents[{turn}]")
        given = content.get("role") or "user"
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise RequestError(f"'contents[{turn}].role' {content.get('role')!r} is not 'user' or 'model'")
        parts = content.get("parts")
        if not isinstance(parts, list):
            raise RequestError(f"'contents[{turn}].parts' must be a list")
        if not parts:
            notes.append(f"contents[{turn}]: skipped a turn with no parts")
        elif role == "model":
            message = _model_turn(parts, turn, notes)
            pending = [(c["function"]["name"], c["id"]) for c in message.get("tool_calls", [])]
            messages.append(message)
        else:
            messages.extend(_user_turn(parts, turn, pending, notes))
    return messages


def _declaration(decl: Any, where: str) -> dict[str, Any]:
    decl = _mapping(decl, where)
    name = decl.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"'{where}.name' must be a non-empty string")
    schema = decl.get("parametersJsonSchema", decl.get("parameters"))
    if schema is None:
        schema = {"type": "object", "properties": {}}
    function: dict[str, Any] = {"name": name}
    if isinstance(decl.get("description"), str):
        function["description"] = decl["description"]
    function["parameters"] = normalize_schema(_mapping(schema, f"{where}.parameters"))
    return {"type": "function", "function": function}


def _tools(tools: Any, notes: list[str]) -> list[dict[str, Any]]:
    """``functionDeclarations`` become function tools; server-side tools (search, code) are dropped."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(tools):
        tool = _mapping(raw, f"tools[{i}]")
        for key, value in tool.items():
            if key != "functionDeclarations":
                notes.append(f"dropped tool {key!r}: only functionDeclarations are served")
                continue
            if not isinstance(value, list):
                raise RequestError(f"'tools[{i}].functionDeclarations' must be a list")
            out.extend(_declaration(d, f"tools[{i}].functionDeclarations[{k}]") for k, d in enumerate(value))
    return out


def _tool_choice(config: Any, has_tools: bool, notes: list[str]) -> str | dict[str, Any] | None:
    """``functionCallingConfig.mode``: AUTO → auto, ANY → required (or one named function), NONE → none."""
    if config is None:
        return None
    calling = _mapping(config, "toolConfig").get("functionCallingConfig")
    if calling is None:
        return None
    calling = _mapping(calling, "toolConfig.functionCallingConfig")
    mode = calling.get("mode", "AUTO")
    allowed = calling.get("allowedFunctionNames") or []
    if not isinstance(mode, str):
        raise RequestError("'toolConfig.functionCallingConfig.mode' must be a string")
    if not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed):
        raise RequestError("'toolConfig.functionCallingConfig.allowedFunctionNames' must be a list of strings")
    mode = mode.upper()
    choice: str | dict[str, Any]
    if mode in ("AUTO", "MODE_UNSPECIFIED", "VALIDATED"):
        choice = "auto"
    elif mode == "NONE":
        choice = "none"
    elif mode == "ANY":
        choice = {"type": "function", "function": {"name": allowed[0]}} if len(allowed) == 1 else "required"
    else:
        raise RequestError(f"'toolConfig.functionCallingConfig.mode' {mode!r} is not AUTO, ANY or NONE")
    if allowed and not (mode == "ANY" and len(allowed) == 1):
        notes.append("ignored allowedFunctionNames: Chat can force one function or any, not a subset")
    if not has_tools:
        notes.append("dropped toolConfig: no function tools to choose from")
        return None
    return choice


def _response_format(config: Mapping[str, Any], notes: list[str]) -> dict[str, Any] | None:
    mime = config.get("responseMimeType")
    schema = config.get("responseJsonSchema", config.get("responseSchema"))
    if mime == "application/json":
        if schema is None:
            return {"type": "json_object"}
        schema = normalize_schema(_mapping(schema, "generationConfig.responseJsonSchema"))
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    if mime not in (None, "text/plain"):
        notes.append(f"ignored responseMimeType {mime!r}")
    elif schema is not None:
        notes.append("ignored response schema without responseMimeType application/json")
    return None


def to_chat(body: dict[str, Any], path_params: Mapping[str, str], memo: Translations | None = None) -> Inbound:
    """The whole body, every time (``memo`` unused): a function response pairs with an earlier
    turn's call, so turns do not translate one by one."""
    method = path_params.get("method", "")
    if method not in _STREAM:
        raise RequestError(
            f"method '{method}' is not supported; use generateContent or streamGenerateContent",
            status=404,
            kind="not_found_error",
        )
    contents = require(body, "contents", list, "a list of Content turns")
    if not contents:
        raise RequestError("'contents' must not be empty")
    notes: list[str] = []
    config = _mapping(body.get("generationConfig"), "generationConfig", optional=True)
    thinking = _mapping(config.get("thinkingConfig"), "generationConfig.thinkingConfig", optional=True)
    if as_int(config.get("candidateCount"), "generationConfig.candidateCount") not in (None, 1):
        raise RequestError("'generationConfig.candidateCount' above 1 is not supported")
    seed = config.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("'generationConfig.seed' must be an integer")
    extra: dict[str, Any] = {}
    top_k = as_float(config.get("topK"), "generationConfig.topK")
    if top_k is not None:
        extra["top_k"] = int(top_k)
    for key, engine_key in (("presencePenalty", "presence_penalty"), ("frequencyPenalty", "frequency_penalty")):
        value = as_float(config.get(key), f"generationConfig.{key}")
        if value is not None:
            extra[engine_key] = value
    if body.get("cachedContent"):
        notes.append("ignored cachedContent: cached prompts are not stored here")
    # thinkingBudget 0 turns thinking off; any other budget or level leaves the template default.
    budget = thinking.get("thinkingBudget")
    kwargs = {"enable_thinking": False} if budget == 0 and not isinstance(budget, bool) else {}
    tools = _tools(body.get("tools"), notes)
    chat = ChatRequest(
        messages=_messages(contents, _system(body.get("systemInstruction"), notes), notes),
        tools=tools,
        tool_choice=_tool_choice(body.get("toolConfig"), bool(tools), notes),
        temperature=as_temperature(config.get("temperature"), "generationConfig.temperature"),
        top_p=as_top_p(config.get("topP"), "generationConfig.topP"),
        max_tokens=as_int(config.get("maxOutputTokens"), "generationConfig.maxOutputTokens"),
        stop=stop_list(config.get("stopSequences"), "generationConfig.stopSequences"),
        seed=seed,
        response_format=_response_format(config, notes),
        chat_template_kwargs=kwargs,
        extra_body=extra,
    )
    model = path_params.get("model", "").removeprefix("models/")
    options = {"include_thoughts": thinking.get("includeThoughts") is True}
    return Inbound(chat=chat, stream=_STREAM[method], model=model, notes=notes, options=options)


# ---- reply ----------------------------------------------------------------------------------

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}


def _call_id(name: str, engine_id: str) -> str:
    """The id shown for a call: ``{name}__{suffix}``.

    The real API may omit ids, but sending one keeps the echo stable. Gemini CLI uses a
    server-supplied ``functionCall.id`` (it invents ``{name}_{ms}_{n}`` only when there is none)
    on both the echoed call and its ``functionResponse``; from v0.43 it also prefixes
    ``{name}__`` to any id that lacks it. An id already in that form comes back exactly as sent in
    every version, so the per-session engine-id map can find it. pi keeps provided ids as well.
    Pairing in ``to_chat`` works with or without it.
    """
    return f"{name}__{id_suffix(engine_id)}"


def _part_groups(reply: Reply) -> list[list[dict[str, Any]]]:
    """Non-empty part groups in stream order: thoughts (if asked for), text, function calls."""
    msg = reply.generation.message
    groups: list[list[dict[str, Any]]] = []
    # to_chat always sets include_thoughts (the API hides thoughts unless asked); a Reply built
    # without options (a replay) shows them.
    if msg.reasoning and reply.options.get("include_thoughts", True):
        groups.append([{"text": msg.reasoning, "thought": True}])
    if msg.content:
        groups.append([{"text": msg.content}])
    calls = [
        {"functionCall": {"name": c.name, "args": arguments_object(c.arguments), "id": _call_id(c.name, c.id)}}
        for c in msg.tool_calls
    ]
    if calls:
        groups.append(calls)
    return groups


def _usage(reply: Reply) -> dict[str, int]:
    # Thought tokens are not split out (that needs the tokenizer's </think> id), so
    # candidatesTokenCount counts every sampled token and thoughtsTokenCount is absent.
    prompt, sampled = len(reply.generation.prompt_ids), len(reply.generation.response_ids)
    return {"promptTokenCount": prompt, "candidatesTokenCount": sampled, "totalTokenCount": prompt + sampled}


def _response(reply: Reply, parts: list[dict[str, Any]], *, last: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}}
    if last:
        candidate["finishReason"] = _FINISH.get(reply.generation.finish_reason, "OTHER")
    candidate["index"] = 0
    body: dict[str, Any] = {"candidates": [candidate]}
    if last:
        body["usageMetadata"] = _usage(reply)
    body["modelVersion"] = reply.model
    body["responseId"] = reply.request_id
    return body


def from_chat(reply: Reply) -> dict[str, Any]:
    return _response(reply, [part for group in _part_groups(reply) for part in group], last=True)


def stream_events(reply: Reply) -> Iterator[bytes]:
    """One chunk per part group; thoughts never share a chunk with the finish.

    Gemini CLI before v0.26 treated a chunk whose first part is a thought as all thought and
    skipped the rest of it, finishReason included. So thoughts get their own chunk, and a reply
    that is only thinking ends with an extra empty-parts chunk carrying the finish.
    """
    groups = _part_groups(reply)
    if not groups or groups[-1][0].get("thought"):
        groups.append([])
    for index, parts in enumerate(groups):
        yield sse(_response(reply, parts, last=index == len(groups) - 1))


_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _STATUS.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")
    return {"error": {"code": status, "message": message, "status": kind}}
