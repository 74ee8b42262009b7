"""``ChatFormat``: everything token-level about one model family, behind one object.

The gateway, the engines, the continuation planner, the trajectory builders and the dashboard
ask a ``ChatFormat`` (chosen by the engine's ``template``, ``polar_env.chat.chat_format``) for the
tokenizer, the prompt render, the output parse, the text that continues a sampled turn token-in,
the end-of-turn ids and the request rules; none of them knows a family. A family is one module
under ``polar_env/chat/``; ``tests/chat/test_seam.py`` fails when a module outside it imports one.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from polar_env.records import AssistantMessage

T = TypeVar("T")


def load_once(load: Callable[..., T]) -> Callable[..., T]:
    """``functools.cache`` whose first call per argument tuple runs once, however many threads ask
    at the same time: the others wait for it. ``functools.cache`` runs a slow first call in every
    thread that asks before one returns — a node whose first sessions open together built the
    Qwen3.5 tokenizer (~0.5 s of CPU) in each of the default executor's threads."""
    loaded: dict[tuple[Any, ...], T] = {}
    locks: dict[tuple[Any, ...], threading.Lock] = {}
    guard = threading.Lock()

    @functools.wraps(load)
    def once(*args: Any) -> T:
        try:
            return loaded[args]
        except KeyError:
            pass
        with guard:
            lock = locks.setdefault(args, threading.Lock())
        with lock:
            if args not in loaded:
                loaded[args] = load(*args)
        return loaded[args]

    return once


class Tokenizer(Protocol):
    """What callers need of a tokenizer: special tokens are always recognised in text, and
    per-token texts follow vLLM's detokenizer (an unfinished UTF-8 character is held back)."""

    n_vocab: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_texts(self, ids: list[int]) -> list[str]: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def token_texts(ids: list[int], token_bytes: Callable[[int], bytes]) -> list[str]:
    """Per-token text as vLLM's detokenizer reports it: bytes that do not yet decode cleanly
    (text ending in U+FFFD) are held back, so the token that starts a multi-byte character gets
    "" and the one that completes it gets the whole character."""
    out: list[str] = []
    pending = b""
    for token_id in ids:
        pending += token_bytes(token_id)
        text = pending.decode("utf-8", errors="replace")
        if text.endswith("\ufffd"):
            out.append("")
        else:
            out.append(text)
            pending = b""
    return out


@dataclass(frozen=True, slots=True)
class RequestRules:
    """What the family's template refuses, checked by the gateway before the engine is called
    (``proxy/validate.py``) and fixed where a harness commonly trips it (``proxy/quirks.py``)."""

    system_first: bool = False  # only one system message, first ("System message must be at the beginning")
    needs_user_query: bool = False  # at least one user message that is not a wrapped tool result


class NotContinuable(Exception):
    """The family's template cannot append these messages to sampled tokens exactly; the
    continuation falls back to a fresh render and records ``reason`` as the drift's cause."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ChatFormat(ABC):
    """One model family's chat format (see the module docstring)."""

    name: str  # the ``template`` value that chose it
    eos_ids: tuple[int, ...]  # ids that end a sampled turn; ``eos_ids[0]`` ends an assistant turn
    turn_start_ids: tuple[int, ...]  # ids that open a turn (trajectory lineage anchors)
    rules: RequestRules = RequestRules()
    # False: ``continuation_text`` renders the whole history (run it off the event loop)
    cheap_continuation: bool = True

    @property
    def end_of_turn_id(self) -> int:
        return self.eos_ids[0]

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use (a family's tokenizer may take seconds)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding (may exceed the tokenizer's ids: padding rows)."""
        return self.tokenizer.n_vocab

    @abstractmethod
    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
        """The prompt text, as the family's published template renders it (raises RequestError)."""

    @abstractmethod
    def continuation_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                          *, from_index: int, enable_thinking: bool) -> str:
        """Text that follows the end-of-turn token of the assistant turn ``messages[from_index - 1]``
        when ``messages[from_index:]`` are appended, generation prompt included. Raises
        ``NotContinuable`` where the template would not render that turn as it was sampled."""

    @abstractmethod
    def assistant_text(self, message: Mapping[str, Any], *, thinking: bool) -> str:
        """What the model samples for ``message`` (before the end-of-turn token): scripted turns."""

    @abstractmethod
    def parse(self, text: str, *, tools: Sequence[Mapping[str, Any]], thinking: bool) -> AssistantMessage:
        """A sampled turn's text (end-of-turn token removed) as reasoning, content and tool calls,
        the way the family's served parsers (vLLM's named reasoning / tool parsers) read it."""

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt's last turn opened the reasoning without closing it, so the sampled
        text starts inside it. Read from the ids: right for token-in prompts built elsewhere too."""
        start = len(prompt_ids)
        while start > 0 and prompt_ids[start - 1] not in self.turn_start_ids:  # the last turn only
            start -= 1
        tail = self.tokenizer.decode(list(prompt_ids[start:]))
        return "<think>" in tail and "</think>" not in tail.rsplit("<think>", 1)[1]

    def content_text(self, content: Any) -> str:
        """OpenAI message content (string, parts list, null) flattened to template text."""
        from polar_env.chat.content import content_text

        return content_text(content)

    def count_tokens(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, *,
                     enable_thinking: bool) -> int:
        """The engine-side prompt length (Anthropic ``count_tokens``); renders the whole history."""
        return len(self.tokenizer.encode(self.render(messages, tools, enable_thinking=enable_thinking)))

    @property
    def weights(self) -> Path | None:
        """The model the template itself names (``hf:PATH``, ``smollm2``'s GGUF): what a local engine
        serves when given no weights of its own. None: the template names a format only."""
        return None

    def save_tokenizer(self, directory: Path) -> None:
        """Write the tokenizer as a HF folder's files (``tokenizer.json``...) for servers that load one."""
        raise NotImplementedError(f"{self.name} cannot write its tokenizer as HF files")

    def describe(self) -> str:
        return self.name
