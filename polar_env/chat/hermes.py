"""vLLM's ``hermes`` tool parser (``Hermes2ProToolParser.extract_tool_calls``), family-neutral:
for families whose model writes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen3).

Its rules, kept as they are: every ``<tool_call>...</tool_call>`` block, and an unclosed last one,
must be a JSON object with ``name`` and ``arguments``; one that is not makes the whole text content
(no calls). Content is the text before the first ``<tool_call>``, untrimmed (None when empty);
arguments are ``json.dumps(arguments, ensure_ascii=False)``.
"""

from __future__ import annotations

import json
import re
import uuid

from polar_env.records import ToolCall

TOOL_CALL_START = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) as vLLM's hermes parser reads ``text`` (the content after reasoning)."""
    if TOOL_CALL_START not in text:
        return text, []
    calls: list[ToolCall] = []
    for closed, unclosed in _TOOL_CALL.findall(text):
        try:
            body = json.loads(closed or unclosed)
            name, arguments = body["name"], body["arguments"]
        except (ValueError, TypeError, KeyError, IndexError):
            return text, []
        if not isinstance(name, str):  # vLLM's FunctionCall(name=...) refuses it
            return text, []
        calls.append(ToolCall(id=new_tool_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
    content = text[: text.find(TOOL_CALL_START)]
    return (content or None), calls
