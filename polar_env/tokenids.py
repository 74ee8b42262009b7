"""Token-id lists that carry their JSON text, so a growing prompt is serialized by its delta.

A token-in prompt is the previous context plus a few new ids, and the engine client sends it as
JSON on every call: ~0.8 ms for 100k ids with orjson, each time for the whole history. A
``JsonIds`` is a plain ``list[int]`` (what records, builders and engines read) that also holds
``orjson.dumps(self)``, built from the list it extends: its JSON with the new ids' JSON appended.
Lists are never mutated after they are built (the gateway's convention for every id list), so
the text stays exact; ``tests/test_tokenids.py`` checks it against ``orjson.dumps``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Annotated

import msgspec
import orjson


class JsonIds(list[int]):
    """Token ids and their exact JSON text (``json``)."""

    __slots__ = ("json", "__weakref__")

    json: bytes


class EchoIds(JsonIds):
    """Prompt ids an engine echoed, ``json`` the exact bytes it sent. ``base``: when set, the
    earlier echo whose JSON bytes these start with up to an id boundary — its first ``shared``
    ids are these first ids (equal bytes decode to equal ids), and only the ids after them were
    decoded. A weak reference, so a session's echoes never chain: whoever compares against the
    earlier one keeps it."""

    __slots__ = ("base", "shared")

    base: weakref.ref[JsonIds] | None
    shared: int

    def __reduce__(self) -> tuple[type[list[int]], tuple[list[int]]]:
        """Pickled and copied as the plain list (a weak reference does not pickle)."""
        return list, (list(self),)


# The prompt ids the next engine echo most likely starts with: in canonical mode, the session's
# previous echoed prompt (an append-only history renders to it plus the new turns). Set by the
# gateway around one engine call (its task's context); engine clients that echo prompts read it.
ECHO_ANCHOR: ContextVar[JsonIds | None] = ContextVar("polar_env_echo_anchor", default=None)
_ENDS = (b",", b"]")
_IDS = msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]])


def _shared_bytes(raw: bytes, start: int, head: memoryview) -> int:
    """How many leading bytes of ``head`` ``raw[start:]`` starts with. A re-rendered history
    differs from the last prompt, if at all, near its end (the generation prompt, a closed
    think block, a merge at the boundary), so windows back from the end are tried first; each
    try is one memcmp, and the last window is bisected."""
    hi = len(head)
    if raw.startswith(head, start):
        return hi
    lo, step = 0, 64
    while hi - step > 0:
        if raw.startswith(head[:hi - step], start):
            lo = hi - step
            break
        hi, step = hi - step, step * 4
    while hi - lo > 1:  # head[:lo] matches, head[:hi] does not
        mid = (lo + hi) // 2
        if raw.startswith(head[lo:mid], start + lo):
            lo = mid
        else:
            hi = mid
    return lo


def echoed_ids(raw: bytes, start: int, anchor: JsonIds | None) -> tuple[EchoIds, int] | None:
    """The flat JSON array of token ids (ints within 0..2**63-1) at ``raw[start:]`` and the offset
    just past it, or None when there is no such array there. The ids before the last id boundary
    (a comma) up to which ``anchor``'s JSON and these bytes agree are taken from ``anchor``, and
    only the bytes after it are decoded (the result's ``base`` and ``shared``): the cost is a
    memcmp of the shared head plus the new ids' decode, not a decode of the whole history."""
    if raw[start:start + 1] != b"[":
        return None
    if anchor is not None and len(anchor):
        head = anchor.json
        last = len(head) - 1  # the anchor's closing bracket
        same = _shared_bytes(raw, start, memoryview(head)[:last])
        if head[same:same + 1] in _ENDS and raw[start + same:start + same + 1] in _ENDS:
            cut = same  # an id ends here in both (at ``last``: all of the anchor)
        else:
            cut = head.rfind(b",", 0, same)
        shared = len(anchor) - head.count(b",", cut, last) if cut > 0 else 0
        if shared:
            end = raw.find(b"]", start + cut) + 1
            try:
                tail = _IDS.decode(b"[" + raw[start + cut + 1:end]) if raw[start + cut:start + cut + 1] == b"," else []
            except msgspec.DecodeError:
                return None
            ids = EchoIds(anchor)
            del ids[shared:]  # the ids re-rendered after the shared head (usually none or a few)
            ids.extend(tail)
            ids.base, ids.shared, ids.json = weakref.ref(anchor), shared, raw[start:end]
            return ids, end
    end = raw.find(b"]", start) + 1
    if not end:
        return None
    try:
        ids = EchoIds(_IDS.decode(raw[start:end]))
    except msgspec.DecodeError:
        return None
    ids.base, ids.shared, ids.json = None, 0, raw[start:end]
    return ids, end


def ids_json(ids: list[int] | tuple[int, ...]) -> bytes:
    """``orjson.dumps(ids)``, read off a ``JsonIds`` instead of serialized again."""
    return ids.json if type(ids) is JsonIds else orjson.dumps(ids)


def joined_json(head_json: bytes, tail: Sequence[int]) -> bytes:
    """The JSON of a list whose first ids serialize as ``head_json``, followed by ``tail``."""
    rest = orjson.dumps(tail)
    if len(head_json) == 2:  # b"[]"
        return rest
    if len(rest) == 2:
        return head_json
    return b"".join((memoryview(head_json)[:-1], b",", memoryview(rest)[1:]))  # one copy of the head
