"""Token-in continuation mode: make every chain append-only by construction.

When a request's messages are an earlier request's messages, then that request's assistant reply
(as the harness echoes it), then new messages, the prompt is built from tokens instead of a fresh
render: earlier prompt ids + the raw sampled ids + the template's tokens for only the new messages.
The engine receives it token-in. Re-rendering can no longer strip reasoning, re-serialise tool
arguments or trim whitespace in what the model already saw, so merged chains have zero drift.

Anything else (history rewritten by compaction, a changed tool list, an echo that does not match
what was sampled, an assistant message the model did not write) falls back to normal templating,
with the reason recorded. The new messages are rendered by the engine's ``ChatFormat``, which also
says when its template cannot be continued token-in (``NotContinuable``: a recorded fallback).

Siblings. A client that gives up on an answered call and retries the same prompt leaves two turns
that extend the same history, often with the same visible text and different reasoning. The turn
continued is the one the harness sent back: the sibling whose reasoning is the echoed reasoning
(when the echo carries any), else the one whose reply was delivered (not ``abandoned``). Siblings
that still cannot be told apart, and differ in their tokens, fall back to templating with the
reason recorded: feeding the model tokens the harness never sent would be worse than the drift.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from polar_env.chat import ChatFormat, NotContinuable
from polar_env.chat.content import content_text
from polar_env.journal.format import common_prefix
from polar_env.records import AssistantMessage, ChatRequest, Generation
from polar_env.tokenids import JsonIds, joined_json

_KEEP_TURNS = 32  # recent turns remembered per session: enough for interleaved sub-agents
# One int object per token id for the whole process: ids parsed from engine replies are fresh
# 28-byte objects each; remembered contexts point into this table instead, so a session's tip
# costs 8 bytes an id (its chunks) — ~0.8 MB at 100k tokens, ~200 MB for 256 sessions, not ~1 GB.
_IDS = list(range(1 << 18))


def _interned(ids: list[int]) -> tuple[int, ...]:
    table = _IDS
    if ids and max(ids) < len(table) and min(ids) >= 0:
        return tuple(map(table.__getitem__, ids))
    return tuple(ids)


# A context as the chunks it was built from, each an immutable run of ids. A session's turns share
# their chunks, so what they store adds up to the final context, not to turns x context. A tuple of
# ints leaves the cyclic GC's tracking at its first pass; what a young collection walks per call is
# the chunk list (one pointer per turn). A whole-context tuple built per call was walked in full:
# at 256 sessions each young collection met ~256 of them, ~100k ids each (230-375 ms pauses).
Chunks = tuple[tuple[int, ...], ...]
L = TypeVar("L", bound=list[int])
_MAX_CHUNKS = 512  # a longer chain is flattened into one chunk (a copy per ~250 turns)


def _cut(chunks: Chunks, n: int) -> Chunks:
    """The first ``n`` ids of ``chunks``, as chunks (the one that straddles ``n`` is sliced)."""
    out: list[tuple[int, ...]] = []
    for chunk in chunks:
        if n <= 0:
            break
        out.append(chunk if len(chunk) <= n else chunk[:n])
        n -= len(chunk)
    return tuple(out)


def _joined(chunks: Chunks, ids: L) -> L:
    """``ids`` extended by every chunk (each a tuple, copied by CPython's fast path)."""
    for chunk in chunks:
        ids.extend(chunk)
    return ids


@dataclass(slots=True, eq=False)
class Turn:
    """One remembered call: its prompt as chunks shared with the turn it extends, its sampled ids,
    and (a chain's tip only) the prompt's JSON, so the next prompt is serialized by its delta."""

    seq: int
    messages: list[dict[str, Any]]
    tools: bytes
    thinking: bool
    prompt: Chunks
    response_ids: tuple[int, ...]
    message: AssistantMessage
    prompt_json: bytes | None = None
    abandoned: bool = False  # its client went away: the harness never saw this reply

    def context_chunks(self) -> Chunks:
        return (*self.prompt, self.response_ids) if self.response_ids else self.prompt

    def context(self) -> list[int]:
        return _joined(self.context_chunks(), [])

    def context_len(self) -> int:
        return sum(map(len, self.prompt)) + len(self.response_ids)

    def next_prompt(self, tail: tuple[int, ...]) -> tuple[JsonIds, Chunks]:
        """``context() + tail`` as the engine's prompt with its JSON (a tip's JSON with the new
        ids' appended: ``polar_env.tokenids``), and as the chunks its turn will keep."""
        chunks = (*self.context_chunks(), tail) if tail else self.context_chunks()
        ids = _joined(chunks, JsonIds())
        if len(chunks) > _MAX_CHUNKS:
            chunks = (tuple(ids),)
        new = self.response_ids + tail
        ids.json = joined_json(self.prompt_json, new) if self.prompt_json is not None else orjson.dumps(ids)
        return ids, chunks


@dataclass(frozen=True, slots=True)
class Plan:
    """A token-in prompt: ``ids`` is ``parent.context()`` (``keep`` tokens) then new tokens;
    ``chunks`` holds the same ids for the turn that remembers it."""

    ids: JsonIds
    parent: Turn
    keep: int
    chunks: Chunks


def _arguments(value: Any) -> Any:
    try:
        return orjson.loads(value) if isinstance(value, str) else value
    except orjson.JSONDecodeError:
        return value


def same_turn(echo: Mapping[str, Any], sampled: AssistantMessage) -> bool:
    """Does the harness's echoed assistant message say what the model sampled? Ids, reasoning
    and formatting may differ; text and tool calls (names, argument values) may not."""
    if echo.get("role") != "assistant":
        return False
    # Some harnesses replay reasoning as text (pi turns unsigned Anthropic thinking into text).
    text = content_text(echo.get("content")).strip()
    content, reasoning = (sampled.content or "").strip(), (sampled.reasoning or "").strip()
    if text not in {content, f"{reasoning}\n\n{content}".strip(), f"{reasoning}{content}".strip()}:
        return False
    calls = echo.get("tool_calls") or []
    if len(calls) != len(sampled.tool_calls):
        return False
    for call, mine in zip(calls, sampled.tool_calls, strict=True):
        fn = call.get("function", call)
        if fn.get("name") != mine.name or _arguments(fn.get("arguments")) != _arguments(mine.arguments):
            return False
    return True


def echoed_reasoning(echo: Mapping[str, Any], sampled: AssistantMessage) -> str | None:
    """The reasoning the harness sent back with an echo that ``same_turn`` accepted (None: none):
    its ``reasoning_content``, or the text before the content when it replays reasoning as text."""
    own = echo.get("reasoning_content")
    if isinstance(own, str) and own.strip():
        return own.strip()
    text, content = content_text(echo.get("content")).strip(), (sampled.content or "").strip()
    if text != content and text.endswith(content):
        return text[: len(text) - len(content)].strip() or None
    return None


def pick_sibling(echo: Mapping[str, Any], siblings: list[Turn]) -> tuple[Turn | None, str]:
    """Of turns that extend the same history and match the echo, the one the harness sent back
    (module docstring); (None, why) when they cannot be told apart and their tokens differ."""
    candidates = siblings
    if len(candidates) > 1:
        said = [echoed_reasoning(echo, t.message) for t in candidates]
        by_reasoning = [t for t, r in zip(candidates, said, strict=True)
                        if r is not None and r == (t.message.reasoning or "").strip()]
        if by_reasoning:
            candidates = by_reasoning
    if len(candidates) > 1:
        candidates = [t for t in candidates if not t.abandoned] or candidates
    if len({t.response_ids for t in candidates}) > 1:
        return None, (f"{len(candidates)} sampled turns (retries) match the echoed assistant turn and differ "
                      "in their tokens; cannot tell which the harness sent")
    return candidates[-1], ""


class Continuation:
    """One session's recent turns, and the token-in prompt planner."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.turns: deque[Turn] = deque(maxlen=_KEEP_TURNS)

    def plan(self, chat: ChatRequest) -> tuple[Plan | None, str]:
        """(token-in plan, note); the plan is None when normal templating must be used."""
        if not self.turns:
            return None, "continuation: first turn, templated"
        messages, tools = chat.messages, orjson.dumps(chat.tools)
        thinking = chat.chat_template_kwargs.get("enable_thinking", True) is not False
        siblings: list[Turn] = []  # the matching turns over the longest matching history
        reason = "history rewritten"
        # Longest remembered history first: once a turn matches, shorter ones cannot win, so a
        # linear chain compares its history once, not once per remembered turn. Equal lengths
        # keep their call order (``pick_sibling`` prefers the latest).
        for turn in sorted(self.turns, key=lambda t: -len(t.messages)):
            n = len(turn.messages)
            if siblings and n < len(siblings[0].messages):
                break
            if len(messages) <= n + 1:
                continue
            if messages[:n] != turn.messages:
                continue
            if turn.tools != tools or turn.thinking != thinking:
                reason = "tool list or thinking mode changed"
            elif not same_turn(messages[n], turn.message):
                reason = "echoed assistant turn differs from what was sampled"
            elif any(m.get("role") in ("assistant", "system") for m in messages[n + 1 :]):
                reason = "new messages include an assistant or system message"
            else:
                siblings = [t for t in siblings if len(t.messages) == n] + [turn]
        best: Turn | None = None
        if siblings:
            best, why = pick_sibling(messages[len(siblings[0].messages)], siblings)
            reason = why or reason
        if best is None:
            return None, f"continuation fallback: {reason}"
        start = len(best.messages) + 1
        ended = bool(best.response_ids) and best.response_ids[-1] in self.chat.eos_ids
        try:
            new_text = self.chat.continuation_text(messages, chat.tools, from_index=start, enable_thinking=thinking)
        except NotContinuable as exc:
            return None, f"continuation fallback: {exc.reason}"
        end = [] if ended else [self.chat.end_of_turn_id]
        keep = best.context_len()
        ids, chunks = best.next_prompt(_interned(end + self.chat.tokenizer.encode(new_text)))
        return Plan(ids, best, keep, chunks), f"continuation: token-in over {keep} earlier tokens"

    def abandon(self, seq: int) -> None:
        """The reply of call ``seq`` never reached its client (the harness cannot continue it)."""
        for turn in self.turns:
            if turn.seq == seq:
                turn.abandoned = True

    def remember(self, chat: ChatRequest, generation: Generation, seq: int, plan: Plan | None = None,
                 *, abandoned: bool = False) -> None:
        """Remember a recorded call; ``plan`` is what it was generated from (None: templated);
        ``abandoned``: its client was gone before the reply."""
        tools = orjson.dumps(chat.tools)
        last = self.turns[-1] if self.turns else None
        messages = chat.messages
        prompt_json: bytes | None = None
        if plan is not None and (generation.prompt_ids is plan.ids or generation.prompt_ids == plan.ids):
            chunks, prompt_json = plan.chunks, plan.ids.json  # interned already
            parent: Turn | None = plan.parent
            messages = plan.parent.messages + messages[len(plan.parent.messages):]  # share the unchanged prefix
        else:  # templated: share what the previous turn's context has in common with it
            ids, parent = _interned(generation.prompt_ids), last
            keep = common_prefix(last.context(), list(ids)) if last is not None else 0
            chunks = (*_cut(last.context_chunks(), keep), ids[keep:]) if last is not None and keep else (ids,)
        if last is not None and last.tools == tools:
            tools = last.tools
        if parent is not None:
            parent.prompt_json = None  # the new turn is the chain's tip now
        self.turns.append(
            Turn(seq=seq, messages=messages, tools=tools,
                 thinking=chat.chat_template_kwargs.get("enable_thinking", True) is not False,
                 prompt=chunks, response_ids=_interned(generation.response_ids),
                 message=generation.message, prompt_json=prompt_json, abandoned=abandoned)
        )
