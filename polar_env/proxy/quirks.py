"""Named request fixes for what a model's chat template cannot take, applied after normalization.

Each fix says which template or harness needs it, and leaves a note on the captured record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polar_env.chat import ChatFormat
from polar_env.records import ChatRequest


def fit_system_messages(messages: list[dict[str, Any]], notes: list[str],
                        content_text: Callable[[Any], str]) -> list[dict[str, Any]]:
    """Qwen3.5's template accepts one system message, first ("System message must be at the
    beginning"). Claude Code 2.1 sends ``system`` entries mid-conversation (agent and skill
    listings) and Anthropic's top-level ``system`` also becomes a leading one. Leading system
    messages are merged; later ones become user messages at the same position."""
    out: list[dict[str, Any]] = []
    for index, msg in enumerate(messages):
        if msg.get("role") != "system":
            out.append(msg)
        elif not out:
            out.append(msg)
        elif len(out) == 1 and out[0].get("role") == "system" and all(m.get("role") == "system" for m in messages[:index]):
            merged = content_text(out[0].get("content")) + "\n\n" + content_text(msg.get("content"))
            out[0] = {**out[0], "content": merged}
            notes.append(f"system message {index} merged into the leading system message")
        else:
            out.append({"role": "user", "content": content_text(msg.get("content"))})
            notes.append(f"mid-conversation system message {index} sent as a user message")
    return out


def apply_quirks(chat: ChatRequest, notes: list[str], family: ChatFormat) -> ChatRequest:
    """The fixes the engine family's rules call for; the request unchanged when none apply."""
    if not family.rules.system_first:
        return chat
    return chat.model_copy(update={"messages": fit_system_messages(chat.messages, notes, family.content_text)})
