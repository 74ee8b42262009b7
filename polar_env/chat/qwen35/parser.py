"""Parse Qwen3.5 output text into an assistant message: reasoning, content, tool calls.

Mirrors vLLM's ``qwen3`` reasoning parser and ``qwen3_coder`` tool parser: reasoning is the text
before ``</think>`` (the ``<think>\\n`` opener is part of the prompt); tool calls are the XML blocks
``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`` with parameter
values converted by the declared JSON-schema type. Arguments are serialised as vLLM does
(``json.dumps`` with spaces); the gateway compacts them for harnesses.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from polar_env.records import AssistantMessage, ToolCall

_TOOL_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def split_reasoning(text: str, *, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, rest). With thinking on, reasoning ends at ``</think>`` or, as vLLM's qwen3
    parser has it, at a ``<tool_call>``; without either, everything is reasoning."""
    if "</think>" in text:
        reasoning, _, rest = text.partition("</think>")
        reasoning = reasoning.split("<think>")[-1].lstrip("\n").rstrip("\n")
        return (reasoning or None), rest.lstrip("\n")
    if thinking:
        if "<tool_call>" in text:
            reasoning, _, rest = text.partition("<tool_call>")
            return (reasoning.strip("\n") or None), "<tool_call>" + rest
        return (text or None), ""
    return None, text


def _schema_types(tools: Sequence[Mapping[str, Any]], function: str, param: str) -> set[str]:
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("name") == function:
            prop = (fn.get("parameters") or {}).get("properties", {}).get(param, {})
            kind = prop.get("type", "string") if isinstance(prop, Mapping) else "string"
            return {str(k).lower() for k in (kind if isinstance(kind, list) else [kind])}
    return {"string"}


def convert_param(value: str, types: set[str]) -> object:
    """Turn a raw parameter text into the JSON value its schema type asks for."""
    if value.lower() == "null" and "string" not in types:
        return None
    if "string" in types or "str" in types or "text" in types:
        return value
    if "integer" in types or "int" in types:
        try:
            return int(value)
        except ValueError:
            return value
    if "number" in types or "float" in types:
        try:
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        except ValueError:
            return value
    if "boolean" in types or "bool" in types:
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call, calls). Malformed or unclosed calls leave the text as content."""
    start = text.find("<tool_call>")
    if start < 0:
        return (text or None), []
    calls: list[ToolCall] = []
    for match in _TOOL_CALL.finditer(text, start):
        name = match.group(1).strip()
        args = {
            p.group(1).strip(): convert_param(p.group(2), _schema_types(tools, name, p.group(1).strip()))
            for p in _PARAM.finditer(match.group(2))
        }
        calls.append(ToolCall(id=new_tool_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False)))
    if not calls:
        return (text or None), []
    content = text[:start].rstrip()
    return (content or None), calls


def parse_output(text: str, *, tools: Sequence[Mapping[str, Any]], thinking: bool) -> AssistantMessage:
    """Parse a full model response (EOS already removed) the way vLLM's Qwen3.5 parsers would."""
    reasoning, rest = split_reasoning(text, thinking=thinking)
    content, calls = parse_tool_calls(rest, tools) if tools else ((rest or None), [])
    return AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls)
