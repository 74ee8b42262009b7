"""Qwen3.5 as a ``ChatFormat``: our Python template, the offline tiktoken tokenizer, vLLM's
``qwen3`` reasoning and ``qwen3_coder`` tool parsers. ``qwen3.5`` is what vLLM serving Qwen3.5
renders; ``append_only`` switches the three prefix-breaking behaviours off (tests, ablations)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_env.chat.base import ChatFormat, RequestRules, Tokenizer
from polar_env.chat.qwen35.parser import parse_output
from polar_env.chat.qwen35.template import APPEND_ONLY, QWEN35, TemplateQuirks, content_text, render, render_assistant_body
from polar_env.chat.qwen35.tokenizer import EOS_IDS, IM_START_ID, VOCAB_SIZE, export_hf_tokenizer, load_tokenizer
from polar_env.records import AssistantMessage

THINK_ID, END_THINK_ID = 248_068, 248_069  # <think>, </think>


class Qwen35Format(ChatFormat):
    rules = RequestRules(system_first=True, needs_user_query=True)
    eos_ids = EOS_IDS
    turn_start_ids = (IM_START_ID,)

    def __init__(self, name: str, quirks: TemplateQuirks) -> None:
        self.name = name
        self.quirks = quirks

    @property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer()

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
        return render(messages, tools, add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking, quirks=self.quirks)

    def continuation_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                          *, from_index: int, enable_thinking: bool) -> str:
        glue = "\n" if self.quirks.newline_after_turn else ""  # the template's "\n" after <|im_end|>
        return glue + render(messages, tools, enable_thinking=enable_thinking, quirks=self.quirks,
                             from_index=from_index)

    def assistant_text(self, message: Mapping[str, Any], *, thinking: bool) -> str:
        body = render_assistant_body(message, with_think=thinking, quirks=self.quirks)
        return body[len("<think>\n"):] if thinking else body  # with thinking on, the prompt opened it

    def parse(self, text: str, *, tools: Sequence[Mapping[str, Any]], thinking: bool) -> AssistantMessage:
        return parse_output(text, tools=tools, thinking=thinking)

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        for token in reversed(prompt_ids):  # the last turn only: no cost in the history
            if token == END_THINK_ID or token == IM_START_ID:
                return False
            if token == THINK_ID:
                return True
        return False

    def content_text(self, content: Any) -> str:
        return content_text(content)

    def save_tokenizer(self, directory: Path) -> None:
        export_hf_tokenizer(directory)


FORMATS = {"qwen3.5": Qwen35Format("qwen3.5", QWEN35), "append_only": Qwen35Format("append_only", APPEND_ONLY)}
