"""Journal v2: one JSON line per captured call, linear in a session's tokens.

v1 (what earlier gateways wrote) stores every record whole: the raw provider request and the
normalized chat request (each the whole history) and the full prompt ids, so a 100-call session
with a 100k-token final context is ~50 MB. A v2 line (``"v": 2``) stores instead:

- ``prompt``: ``{"parent": seq, "keep": n, "suffix": [...]}`` — the first ``n`` tokens of record
  ``seq``'s context (its prompt ids then its sampled ids), then ``suffix``. In continuation mode
  the reference is exact by construction (the gateway built the prompt that way); otherwise it is
  found by a prefix check against the previous record. ``{"ids": [...]}`` when nothing is shared.
- ``provider_request`` / ``chat_request``: ``{"base": seq, ...delta}`` against the previous
  record's — top-level fields that did not change are omitted, a list field whose old value is a
  prefix of the new one (the history, when append-only) stores only the new items. Whole
  (``{"whole": {...}}``) for the first record or when nothing can be shared.
- everything else whole (sampled ids, logprobs, message, finish reason, timings, notes).

Notes a reader acts on: ``CLIENT_GONE`` — the harness had disconnected when the call was
recorded, so nobody read the reply (builders then trust only a later prompt that continues it).
A reply that could not be delivered after its record was written is marked by an event line
``{"event": "client_gone", "seq": n}``; ``apply_events`` folds those into the records' notes.
Journals written before the note existed have neither: "not gone".

References only point back to the previous ``WINDOW`` records of the same session, so a
streaming reader needs a bounded window. Lines are serialized from the record's fields (no deep
copy). ``Encoder`` is the writer's per-session state, ``Decoder`` the reader's; both are pure
(no I/O) so the journal is readable without the gateway.
"""

from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord

VERSION = 2
WINDOW = 64  # records a v2 reference may point back (Continuation remembers 32 turns)

CLIENT_GONE = "client_gone"
CLIENT_GONE_EVENT = "client_gone"

_CHAT_FIELDS = tuple(name for name in ChatRequest.model_fields if name != "prompt_ids")
_SCALAR_FIELDS = ("finish_reason", "stop_reason", "model", "engine", "weight_version", "logprobs_mode")


class FormatError(ValueError):
    """A line that is JSON but not a record this reader can rebuild (e.g. a dangling reference)."""


Fingerprint = dict[str, "bytes | list[bytes]"]


def _digest(value: Any) -> bytes:
    """16-byte BLAKE2b of the value's JSON, or the JSON itself when shorter (most scalar fields:
    no hash to compute; never equal to a digest, whose length differs)."""
    data = orjson.dumps(value)
    return data if len(data) < 16 else hashlib.blake2b(data, digest_size=16).digest()


def fingerprint(body: Mapping[str, Any]) -> Fingerprint:
    """What the writer remembers of a request instead of the request itself: a digest per
    top-level field, and per item for list fields (the history). 16 bytes a message."""
    return {key: [_digest(v) for v in value] if type(value) is list else _digest(value) for key, value in body.items()}


Items = dict[str, list[object]]  # a request's list fields, shallow copies (item objects, not their content)


def identical_prefix(new: Sequence[object], old: Sequence[object]) -> int:
    """How many leading items of ``new`` are the very objects of ``old`` (pointer compares)."""
    same = list(map(operator.is_, new, old))
    return same.index(False) if False in same else len(same)


def fingerprint_since(body: Mapping[str, object], prev: Fingerprint | None,
                      prev_items: Items | None) -> tuple[Fingerprint, Items]:
    """``fingerprint(body)`` without hashing again the list items that are the previous request's
    own objects (the gateway shares unchanged history by identity: ``proxy/reuse.py``), and the
    items to pass next time. Equal to the from-scratch fingerprint as long as appended records'
    items are not mutated afterwards (the gateway parses every body afresh and never does)."""
    out: Fingerprint = {}
    items: Items = {}
    for key, value in body.items():
        if type(value) is not list:
            out[key] = _digest(value)
            continue
        old = prev_items.get(key) if prev_items is not None else None
        old_fp = prev.get(key) if prev is not None else None
        kept: list[bytes] = []
        if old is not None and isinstance(old_fp, list):
            kept = old_fp[: identical_prefix(value, old)]
        out[key] = kept + [_digest(v) for v in value[len(kept):]]
        items[key] = list(value)
    return out, items


def _delta(prev: Fingerprint | None, prev_seq: int | None, cur: Mapping[str, Any], cur_fp: Fingerprint) -> dict[str, Any]:
    """``cur`` as a delta against the request fingerprinted as ``prev`` (module docstring), or whole."""
    if prev is None or prev_seq is None:
        return {"whole": cur}
    changed: dict[str, Any] = {}
    appended: dict[str, Any] = {}
    shared = 0
    for key, value in cur.items():
        old, new = prev.get(key), cur_fp[key]
        if old is None:
            changed[key] = value
        elif old == new:  # the common case for tools, system, sampling params
            shared += 1
        elif type(old) is list and type(new) is list and len(old) <= len(new) and new[: len(old)] == old:
            appended[key] = value[len(old):]
            shared += 1
        else:
            changed[key] = value
    if not shared:
        return {"whole": cur}
    out: dict[str, Any] = {"base": prev_seq}
    if changed:
        out["set"] = changed
    if appended:
        out["append"] = appended
    dropped = [k for k in prev if k not in cur]
    if dropped:
        out["drop"] = dropped
    return out


def _undelta(stored: Mapping[str, Any], bases: Mapping[int, dict[str, Any]], what: str) -> dict[str, Any]:
    if "whole" in stored:
        return dict(stored["whole"])
    base = bases.get(stored["base"])
    if base is None:
        raise FormatError(f"{what} refers to record {stored['base']}, which is not in the journal before it")
    out = {k: v for k, v in base.items() if k not in stored.get("drop", ())}
    for key, tail in stored.get("append", {}).items():
        out[key] = base[key] + tail
    out.update(stored.get("set", {}))
    return out



def chat_fields(chat: ChatRequest) -> dict[str, Any]:
    """The chat request as a plain dict from its fields (no model_dump deep copy)."""
    return {name: getattr(chat, name) for name in _CHAT_FIELDS}


def _message(message: AssistantMessage) -> dict[str, Any]:
    return {"content": message.content, "reasoning": message.reasoning,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls]}


@dataclass(slots=True)
class _SessionState:
    seqs: OrderedDict[int, None] = field(default_factory=OrderedDict)  # the last WINDOW seqs written
    last_seq: int | None = None
    last_context: list[int] | None = None  # prompt + response of the last record (prefix checks)
    last_provider: Fingerprint | None = None
    last_chat: Fingerprint | None = None
    provider_items: Items | None = None  # the last record's list items (shared with the session's)
    chat_items: Items | None = None


@dataclass(frozen=True, slots=True)
class PromptRef:
    """The gateway's statement that ``prompt_ids`` is ``context(parent)[:keep]`` + the rest."""

    parent: int
    keep: int
    prompt_ids: list[int]  # the ids the gateway sent (checked against the record's)


class Encoder:
    """Per-session writer state. ``encode`` returns the line; ``commit`` advances the state once
    the line is durable (a failed write leaves the state as it was). Besides the digests it holds
    the last record's list items by reference: in the gateway those are the objects the session
    keeps for sharing anyway (``proxy/reuse.py``), so no second copy of the history."""

    def __init__(self) -> None:
        self._sessions: dict[str, _SessionState] = {}

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def encode(self, record: CompletionRecord, ref: PromptRef | None = None) -> tuple[bytes, Any]:
        state = self._sessions.get(record.session_id) or _SessionState()
        prompt = record.prompt_ids
        stored_prompt: dict[str, Any] | None = None
        referenced = False
        if (ref is not None and ref.parent in state.seqs and ref.keep <= len(prompt)
                and (ref.prompt_ids is prompt or ref.prompt_ids == prompt)):
            stored_prompt = {"parent": ref.parent, "keep": ref.keep, "suffix": prompt[ref.keep:]}
            referenced = True
        elif state.last_context is not None and state.last_seq is not None:
            keep = common_prefix(state.last_context, prompt)
            if keep:
                stored_prompt = {"parent": state.last_seq, "keep": keep, "suffix": prompt[keep:]}
        provider = record.provider_request
        chat = chat_fields(record.chat_request)
        provider_fp, provider_items = fingerprint_since(provider, state.last_provider, state.provider_items)
        chat_fp, chat_items = fingerprint_since(chat, state.last_chat, state.chat_items)
        line: dict[str, Any] = {
            "v": VERSION, "session_id": record.session_id, "seq": record.seq, "provider_api": record.provider_api,
            "prompt": stored_prompt if stored_prompt is not None else {"ids": prompt},
            "response_ids": record.response_ids, "response_logprobs": record.response_logprobs,
            "message": _message(record.message),
            **{name: getattr(record, name) for name in _SCALAR_FIELDS},
            "provider_request": _delta(state.last_provider, state.last_seq, provider, provider_fp),
            "chat_request": _delta(state.last_chat, state.last_seq, chat, chat_fp),
            "timings": {"received_at": record.timings.received_at, "engine_ms": record.timings.engine_ms,
                        "total_ms": record.timings.total_ms},
            "notes": record.notes,
        }
        data = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        # The context is kept for the next record's prefix check only when this one had no
        # reference: in continuation mode the gateway's references carry the sharing, and a
        # session then holds no copy of its context here.
        context = None if referenced else prompt + record.response_ids
        return data, (record.session_id, state, record.seq, context, provider_fp, chat_fp, provider_items, chat_items)

    def commit(self, token: Any) -> None:
        session_id, state, seq, context, provider, chat, provider_items, chat_items = token
        state.seqs[seq] = None
        while len(state.seqs) > WINDOW // 2:  # half the reader's window: margin for gaps
            state.seqs.popitem(last=False)
        state.last_seq, state.last_context, state.last_provider, state.last_chat = seq, context, provider, chat
        state.provider_items, state.chat_items = provider_items, chat_items
        self._sessions[session_id] = state


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists (C-level slice comparisons)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Decoder:
    """Per-session reader state over a stream of lines (v1 and v2 mixed, in journal order)."""

    def __init__(self) -> None:
        self._contexts: OrderedDict[int, list[int]] = OrderedDict()
        self._provider: dict[int, dict[str, Any]] = {}
        self._chat: dict[int, dict[str, Any]] = {}

    def decode(self, raw: Mapping[str, Any]) -> CompletionRecord:
        """One parsed line → a validated record (raises ValueError/ValidationError if invalid)."""
        if raw.get("v") == VERSION:
            record = self._v2(raw)
        else:
            record = CompletionRecord.model_validate(raw)
        self._remember(record)
        return record

    def _remember(self, record: CompletionRecord) -> None:
        self._contexts[record.seq] = record.prompt_ids + record.response_ids
        while len(self._contexts) > WINDOW:
            self._contexts.popitem(last=False)
        # only the last record's requests are ever a base (the writer deltas against the last one)
        self._provider = {record.seq: record.provider_request}
        self._chat = {record.seq: chat_fields(record.chat_request)}

    def _v2(self, raw: Mapping[str, Any]) -> CompletionRecord:
        stored = raw["prompt"]
        context: list[int] | None = None
        if "ids" not in stored:
            context = self._contexts.get(stored["parent"])
            if context is None or stored["keep"] > len(context):
                raise FormatError(f"prompt refers to record {stored['parent']}, which is not in the window before it")
        fields = {k: raw[k] for k in ("session_id", "seq", "provider_api", "response_ids", "response_logprobs",
                                      "message", "timings", "notes", *_SCALAR_FIELDS) if k in raw}
        # Validate only what this line adds (the suffix): the kept part is the parent's context,
        # validated when the parent was read. Re-validating it would cost turns × context.
        record = CompletionRecord.model_validate({
            **fields,
            "prompt_ids": stored["ids"] if context is None else stored["suffix"],
            "provider_request": _undelta(raw["provider_request"], self._provider, "provider_request"),
            "chat_request": _undelta(raw["chat_request"], self._chat, "chat_request"),
        })
        if context is not None:
            record.prompt_ids = context[: stored["keep"]] + record.prompt_ids
        return record


def apply_events(records: list[CompletionRecord], events: Sequence[Mapping[str, Any]]) -> list[CompletionRecord]:
    """``records`` with the client-gone events of their journal folded into their notes."""
    gone = {e.get("seq") for e in events if e.get("event") == CLIENT_GONE_EVENT}
    for record in records:
        if record.seq in gone and CLIENT_GONE not in record.notes:
            record.notes = [*record.notes, CLIENT_GONE]
    return records
