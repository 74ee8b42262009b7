"""Qwen3.5 chat template, written in Python to reproduce the published template's behaviour.

Rendering is text; callers tokenize the result (special tokens are matched in text). The three
behaviours that break append-only prefixes are flags on ``TemplateQuirks``:

- ``strip_past_reasoning``: assistant turns up to the last real user query lose their reasoning;
  later ones (the tool loop) render ``<think>\\n{reasoning}\\n</think>\\n\\n`` even when empty.
- ``trim_content``: every content and reasoning is ``trim``med, so sampled whitespace is lost.
- ``newline_after_turn``: ``\\n`` follows every ``<|im_end|>``; the model never samples it.

``QWEN35`` turns all on (what vLLM serving Qwen3.5 does); ``APPEND_ONLY`` turns all off, so
prompt(n) + sampled(n) is a prefix of prompt(n+1) for every turn the model wrote itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polar_env.chat.content import content_text as _content_text
from polar_env.errors import RequestError


@dataclass(frozen=True, slots=True)
class TemplateQuirks:
    strip_past_reasoning: bool = True
    trim_content: bool = True
    newline_after_turn: bool = True


QWEN35 = TemplateQuirks()
APPEND_ONLY = TemplateQuirks(strip_past_reasoning=False, trim_content=False, newline_after_turn=False)
QUIRKS = {"qwen3.5": QWEN35, "append_only": APPEND_ONLY}

_TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_TOOLS_FORMAT = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must "
    "be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n- If there is no function call available, answer the question like "
    "normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)


MEDIA = {"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"}


def content_text(content: Any) -> str:
    """Flatten OpenAI message content (string, parts list, or null) to Qwen3.5 template text."""
    return _content_text(content, MEDIA)


def _jinja_string(value: Any) -> str:
    """What Jinja's ``|string`` / ``|tojson`` produce for a tool-call argument value."""
    if isinstance(value, Mapping) or (isinstance(value, Sequence) and not isinstance(value, str)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _arguments(call: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        # vLLM json.loads string arguments before templating; the template iterates a mapping.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"tool call arguments are not valid JSON: {exc}") from exc
    if not isinstance(args, Mapping):
        raise RequestError("tool call arguments must be a JSON object")
    return args


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]], *, after_content: bool) -> str:
    """The ``<tool_call>`` blocks of one assistant turn, exactly as the template writes them."""
    out: list[str] = []
    for i, call in enumerate(tool_calls):
        name = call.get("function", call).get("name", "")
        if i == 0:
            out.append(("\n\n" if after_content else "") + f"<tool_call>\n<function={name}>\n")
        else:
            out.append(f"\n<tool_call>\n<function={name}>\n")
        for arg_name, arg_value in _arguments(call).items():
            out.append(f"<parameter={arg_name}>\n{_jinja_string(arg_value)}\n</parameter>\n")
        out.append("</function>\n</tool_call>")
    return "".join(out)


def render_assistant_body(message: Mapping[str, Any], *, with_think: bool, quirks: TemplateQuirks = QWEN35) -> str:
    """Assistant turn text between ``<|im_start|>assistant\\n`` and ``<|im_end|>``."""
    trim = str.strip if quirks.trim_content else (lambda s: s)
    content = trim(content_text(message.get("content")))
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = message.get("reasoning")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    reasoning = trim(reasoning)
    text = f"<think>\n{reasoning}\n</think>\n\n{content}" if with_think else content
    tool_calls = message.get("tool_calls") or []
    if tool_calls:
        text += render_tool_calls(tool_calls, after_content=bool(content.strip()))
    return text


def _last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        msg = messages[index]
        if msg.get("role") == "user":
            text = content_text(msg.get("content")).strip()
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return index
    raise RequestError("No user query found in messages.")


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    quirks: TemplateQuirks = QWEN35,
    from_index: int = 0,
) -> str:
    """Render OpenAI-style messages (+ tools) to the Qwen3.5 prompt text.

    ``from_index`` > 0 renders only ``messages[from_index:]`` (plus the generation prompt), in the
    context of the whole list: the continuation mode appends exactly these tokens to a prompt.
    """
    if not messages:
        raise RequestError("No messages provided.")
    nl = "\n" if quirks.newline_after_turn else ""
    trim = str.strip if quirks.trim_content else (lambda s: s)
    out: list[str] = []
    first_is_system = messages[0].get("role") == "system"
    header = from_index == 0  # the system/tools header belongs to the part already rendered
    if header and tools:
        out.append("<|im_start|>system\n" + _TOOLS_PREAMBLE)
        out.extend("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        out.append("\n</tools>" + _TOOLS_FORMAT)
        if first_is_system:
            system = trim(content_text(messages[0].get("content")))
            if system:
                out.append("\n\n" + system)
        out.append("<|im_end|>" + nl)
    elif header and first_is_system:
        out.append("<|im_start|>system\n" + trim(content_text(messages[0].get("content"))) + "<|im_end|>" + nl)

    last_query = _last_query_index(messages)
    for index, msg in enumerate(messages):
        role = msg.get("role")
        if index < from_index:
            continue
        if role == "system":
            if index != 0:
                raise RequestError("System message must be at the beginning.")
        elif role == "user":
            out.append("<|im_start|>user\n" + trim(content_text(msg.get("content"))) + "<|im_end|>" + nl)
        elif role == "assistant":
            with_think = index > last_query or not quirks.strip_past_reasoning
            out.append("<|im_start|>assistant\n" + render_assistant_body(msg, with_think=with_think, quirks=quirks))
            out.append("<|im_end|>" + nl)
        elif role == "tool":
            if index > 0 and messages[index - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + trim(content_text(msg.get("content"))) + "\n</tool_response>")
            if index == len(messages) - 1 or messages[index + 1].get("role") != "tool":
                out.append("<|im_end|>" + nl)
        else:
            raise RequestError(f"Unexpected message role: {role!r}.")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        out.append("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n")
    return "".join(out)
