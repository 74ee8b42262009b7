"""Trajectory → NeMo Gym ``/run`` response items that pass NeMo RL's contiguity check.

NeMo RL walks ``response.output``, skips items without ``generation_token_ids``, and requires each
item's ``prompt_token_ids`` to start with every token seen so far (earlier prompt and generation
ids); the new prompt tokens become a non-trainable message and the generation ids a trainable one.
A merged Polar trace is exactly that sequence: each maximal run of ``loss_mask == 1`` becomes one
item whose prompt is everything before the run (the harness's and template's inserted tokens are
implicit prompt tokens) and whose generation is the run, with its logprobs. Ids are the engine's;
the item text is display only.

Items follow Gym's own converter: per model call a ``reasoning`` item, a ``message`` with the
text, ``function_call`` items, with the token fields on the call's last item, and the harness's
tool results as ``function_call_output`` items between calls. Gym delivers one chain per rollout:
which trace is delivered, and what is dropped, is ``polar_env.integrations.delivery``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, Trace

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class GenerationSpan:
    """One trainable run of a trace: response positions ``[start, end)``."""

    start: int
    end: int


def generation_spans(trace: Trace) -> list[GenerationSpan]:
    spans: list[GenerationSpan] = []
    start: int | None = None
    for i, m in enumerate(trace.loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(GenerationSpan(start, i))
            start = None
    if start is not None:
        spans.append(GenerationSpan(start, len(trace.loss_mask)))
    return spans


def call_spans(trace: Trace, lengths: Sequence[int]) -> list[GenerationSpan] | None:
    """One span per model call when ``lengths`` (each call's sampled-token count, in trace order)
    account for exactly the trace's trainable tokens; None when they do not (the harness rewrote
    a turn and the builder masked it), so the caller falls back to the mask's runs."""
    if sum(lengths) != sum(trace.loss_mask):
        return None
    spans: list[GenerationSpan] = []
    pos = 0
    for n in lengths:
        while pos < len(trace.loss_mask) and not trace.loss_mask[pos]:
            pos += 1
        if trace.loss_mask[pos : pos + n] != [1] * n:
            return None
        spans.append(GenerationSpan(pos, pos + n))
        pos += n
    return spans


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def call_items(message: AssistantMessage | None) -> list[dict[str, Any]]:
    """The Responses output items of one model call, as Gym's own converter makes them from a
    chat message: a ``reasoning`` item, a ``message`` item (when there is text, or nothing else)
    and one ``function_call`` per tool call."""
    items: list[dict[str, Any]] = []
    if message is not None and message.reasoning:
        items.append({"id": _new_id("rs"), "type": "reasoning", "status": "completed",
                      "summary": [{"type": "summary_text", "text": message.reasoning}]})
    calls = message.tool_calls if message is not None else []
    content = (message.content or "") if message is not None else ""
    if content or not (items or calls):
        items.append({"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for call in calls:
        call_id = call.id or _new_id("call")
        items.append({"id": call_id, "type": "function_call", "call_id": call_id, "name": call.name,
                      "arguments": call.arguments, "status": "completed"})
    return items


def tool_outputs(message: AssistantMessage | None, next_request: ChatRequest | None) -> list[dict[str, Any]]:
    """``function_call_output`` items for ``message``'s tool calls, from the tool results the
    harness sent in its next request (no token fields: the harness wrote them). The gateway hands
    harnesses provider-styled ids (``call_<suffix>``, ``toolu_<suffix>``) built from the engine's,
    so a result matches a call by that suffix, else by position when the counts agree."""
    if message is None or next_request is None or not message.tool_calls:
        return []
    from polar_env.proxy.providers.base import id_suffix

    tail: list[dict[str, Any]] = []
    for m in reversed(next_request.messages):
        if m.get("role") == "assistant":
            break
        if m.get("role") == "tool":
            tail.insert(0, m)
    out: list[dict[str, Any]] = []
    for pos, call in enumerate(message.tool_calls):
        suffix = id_suffix(call.id) if call.id else None
        match = next((m for m in tail if suffix and str(m.get("tool_call_id") or "").endswith(suffix)), None)
        if match is None and len(tail) == len(message.tool_calls):
            match = tail[pos]
        if match is not None:
            out.append({"id": _new_id("fco"), "type": "function_call_output", "call_id": call.id or "",
                        "output": _text(match.get("content")), "status": "completed"})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def output_items(trace: Trace, records: Sequence[CompletionRecord] = (), decode: Decode | None = None) -> list[dict[str, Any]]:
    """Responses API output items for ``trace``: per model call its reasoning / message /
    function_call items, the token fields on the call's last item (as Gym's converter puts them),
    then the tool results as ``function_call_output`` items. ``records`` are the trace's calls
    (``trace.metadata["seqs"]`` of the session's journal); without them, or when they do not
    line up with the mask, each trainable run is one text-only message (``decode`` for text)."""
    by_seq = {r.seq: r for r in records}
    calls = [by_seq.get(seq) for seq in trace.metadata.get("seqs", [])]
    spans = call_spans(trace, [len(c.response_ids) for c in calls if c is not None]) if calls and all(calls) else None
    items: list[dict[str, Any]] = []
    for k, span in enumerate(spans if spans is not None else generation_spans(trace)):
        generated = trace.response_ids[span.start : span.end]
        record = calls[k] if spans is not None else None
        if record is not None:
            made = call_items(record.message)
        else:
            made = call_items(AssistantMessage(content=decode(generated) if decode else ""))
        made[-1].update({
            "prompt_token_ids": [*trace.prompt_ids, *trace.response_ids[: span.start]],
            "generation_token_ids": list(generated),
            "generation_log_probs": list(trace.response_logprobs[span.start : span.end]),
        })
        items += made
        if record is not None and spans is not None:
            following = calls[k + 1] if k + 1 < len(calls) else None
            items += tool_outputs(record.message, following.chat_request if following is not None else None)
    return items


def response_object(items: list[dict[str, Any]], *, model: str, response_id: str | None = None,
                    created_at: float = 0.0, incomplete: bool = False) -> dict[str, Any]:
    """A Responses API ``Response`` body holding ``items`` (what Gym's ``NeMoGymResponse`` parses)."""
    return {
        "id": response_id or f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": created_at,
        "model": model,
        "output": items,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "status": "incomplete" if incomplete else "completed",
    }


def check_contiguous(output: Sequence[dict[str, Any]]) -> list[int]:
    """NeMo RL's rule, restated: every generated item's prompt extends all tokens seen so far.
    Returns the reconstructed full sequence; raises ValueError naming the first bad item."""
    seen: list[int] = []
    for index, item in enumerate(output):
        generated = item.get("generation_token_ids")
        if not generated:
            continue
        prompt = item["prompt_token_ids"]
        if prompt[: len(seen)] != seen:
            raise ValueError(f"output item {index}: prompt_token_ids do not extend the {len(seen)} tokens seen so far")
        if len(item["generation_log_probs"]) != len(generated):
            raise ValueError(f"output item {index}: {len(item['generation_log_probs'])} logprobs for {len(generated)} ids")
        seen = [*prompt, *generated]
    return seen
