"""Trajectory → NeMo Gym ``/run`` response items that pass NeMo RL's contiguity check.

NeMo RL walks ``response.output``, skips items without ``generation_token_ids``, and requires each
item's ``prompt_token_ids`` to start with every token seen so far (earlier prompt and generation
ids); the new prompt tokens become a non-trainable message and the generation ids a trainable one.
A merged Polar trace is exactly that sequence: each maximal run of ``loss_mask == 1`` becomes one
item whose prompt is everything before the run (the harness's and template's inserted tokens are
implicit prompt tokens) and whose generation is the run, with its logprobs. Ids are the engine's;
the item text is display only.

Gym delivers one chain per rollout, so a session with several traces delivers its main trace
(the one with the most trainable tokens) and reports the others in ``polar`` metadata.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polar_env.records import Trace, Trajectory

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


def main_trace(trajectory: Trajectory) -> int | None:
    """Index of the trace Gym gets: the most trainable tokens, the earliest on ties."""
    best, best_n = None, 0
    for i, t in enumerate(trajectory.traces):
        n = sum(t.loss_mask)
        if n > best_n:
            best, best_n = i, n
    return best


def output_items(trace: Trace, decode: Decode | None = None) -> list[dict[str, Any]]:
    """Responses API output messages, one per trainable run, carrying the three token fields."""
    items: list[dict[str, Any]] = []
    for span in generation_spans(trace):
        generated = trace.response_ids[span.start : span.end]
        items.append({
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": decode(generated) if decode else "", "annotations": []}],
            "prompt_token_ids": [*trace.prompt_ids, *trace.response_ids[: span.start]],
            "generation_token_ids": list(generated),
            "generation_log_probs": list(trace.response_logprobs[span.start : span.end]),
        })
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
