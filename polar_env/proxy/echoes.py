"""Canonical mode: a session's prompts as the engine echoed them, handled by their delta.

Without token-in (an engine that renders the messages itself, e.g. the vLLM that NeMo RL pins),
the gateway learns each prompt from the engine's echo of its ids. An append-only history renders
to the previous prompt followed by the new turns, so the session keeps its last echoed prompt
(``EchoTip``) and the next call's echo is decoded by its delta from it: the engine client finds
the earlier echo's JSON bytes at the head of the new one and decodes only the ids after them
(``polar_env.tokenids.echoed_ids``; the tip is passed through ``ECHO_ANCHOR``). Such a prompt is
journaled as a reference to the tip's record without comparing the history id by id: its keep is
the tip's prompt length plus the common prefix of the tip's sampled ids with what follows — the
same reference the journal's own prefix check would find, in O(new).

Anything else (history rewritten, an engine whose echo is not byte-stable, the first call) is
decoded whole, and its reference is found by comparing the whole context, off the event loop.
Nothing here changes an id: the ids are the engine's, decoded from its bytes either way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from polar_env.journal.format import PromptRef, common_prefix
from polar_env.tokenids import EchoIds, JsonIds

_INLINE_IDS = 16_384  # a whole comparison this small costs less than a thread hand-off
_NEAR_END = 4096  # ids of the tip's prompt a delta-decoded prompt may re-render and still be compared here


@dataclass(frozen=True, slots=True)
class EchoTip:
    """A session's last recorded call: its seq, its prompt ids as echoed, its sampled ids."""

    seq: int
    prompt: list[int]
    response_ids: list[int]

    def anchor(self) -> JsonIds | None:
        """The prompt the next echo is expected to extend, when its JSON bytes are known."""
        return self.prompt if type(self.prompt) is EchoIds else None


def extending_ref(tip: EchoTip, prompt: list[int]) -> PromptRef | None:
    """The journal reference of a ``prompt`` decoded by its delta from the tip's (O(new)), or
    None when it was not, or shares only a short head with it (then ``context_ref``)."""
    if type(prompt) is not EchoIds or prompt.base is None or prompt.base() is not tip.prompt:
        return None
    shared, n = prompt.shared, len(tip.prompt)
    if n - shared > _NEAR_END:
        return None
    # the first ``shared`` ids are the tip's: the common prefix with its context is found past them
    rest = [*tip.prompt[shared:], *tip.response_ids]
    keep = shared + common_prefix(rest, prompt[shared:shared + len(rest)])
    return PromptRef(tip.seq, keep, prompt) if keep else None


def context_ref(tip: EchoTip, prompt: list[int]) -> PromptRef | None:
    """The journal reference found by comparing ``prompt`` with the tip's whole context."""
    keep = common_prefix(tip.prompt + tip.response_ids, prompt)
    return PromptRef(tip.seq, keep, prompt) if keep else None


async def journal_ref(tip: EchoTip | None, prompt: list[int]) -> PromptRef | None:
    """How ``prompt`` is journaled against the session's last record: by its delta when it
    extends the tip's prompt, else by a whole-context comparison (on a worker thread unless
    small)."""
    if tip is None:
        return None
    ref = extending_ref(tip, prompt)
    if ref is not None:
        return ref
    if len(tip.prompt) + len(prompt) <= _INLINE_IDS:
        return context_ref(tip, prompt)
    return await asyncio.to_thread(context_ref, tip, prompt)
