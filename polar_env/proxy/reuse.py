"""Unchanged history shares the previous request's objects, so per-call work stays with the delta.

A harness resends its whole history on every call; each body is parsed into fresh objects. Where a
list (the messages, the tools) starts with items that serialize exactly as the previous request's
did, the new list takes the previous request's item objects for that prefix. Everything after
then sees unchanged history by identity: the journal encoder reuses its fingerprints of those
items instead of hashing the history again (``journal.format.Encoder``), and continuation's
history compare short-circuits on them. What is recorded and sent cannot change: an item is
shared only when ``orjson.dumps`` would write it byte for byte as the new one. Python's ``==``
compares the strings at memory speed (~0.05 ms a MB) but also equates ``1``, ``1.0`` and
``True``, ``0.0`` and ``-0.0``, and dicts in another key order; ``same_json`` then walks the
containers for exactly those differences without reading a string. Together they are exact for
parsed JSON and ~4x cheaper than serializing both sides (``tests/proxy/test_reuse.py`` checks
them against ``orjson.dumps`` on generated values).

``Translations`` carries the sharing through a provider's ``to_chat``: an item object the session
translated before is not translated again, so the chat request's unchanged history is the last
one's objects too, and the chat-side share is a pointer compare.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, TypeVar

from polar_env.journal.format import identical_prefix

T = TypeVar("T")


def same_json(a: object, b: object) -> bool:
    """For values that are ``==``: do they serialize alike? The same type at every node, dict
    keys in the same order, zeros of the same sign. Strings are not read: a string equal to a
    string writes the same bytes."""
    return _same_json(a, b)


def _same_json(a: Any, b: Any) -> bool:
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:  # loops, not all(): ~2x cheaper per node
        if list(a) != list(b):
            return False
        for x, y in zip(a.values(), b.values()):  # noqa: B905 - == gave equal sizes
            if type(x) is not str and not _same_json(x, y):
                return False
        return True
    if kind is list:
        for x, y in zip(a, b):  # noqa: B905
            if type(x) is not str and not _same_json(x, y):
                return False
        return True
    if kind is float:
        return math.copysign(1.0, a) == math.copysign(1.0, b)
    return kind in _SCALARS


_SCALARS = (str, int, bool, type(None))


def shared_prefix(new: Sequence[object], old: Sequence[object]) -> int:
    """The longest ``k`` such that ``new[:k]`` serializes exactly as ``old[:k]``."""
    k = 0
    try:
        for a, b in zip(new, old, strict=False):
            if a is not b and not (a == b and _same_json(a, b)):
                break
            k += 1
    except RecursionError:  # nested deeper than a comparison goes: nothing past it is shared
        pass
    return k


def share_items(new: list[T], old: list[T] | None) -> list[T]:
    """``new`` with its exactly-unchanged prefix taken from ``old`` (``new`` itself if none is)."""
    if not old:
        return new
    k = shared_prefix(new, old)
    if k == 0:
        return new
    return old[:k] + new[k:] if k < len(new) else old[:k]


def share_lists(body: dict[str, object], previous: Mapping[str, list[object]]) -> dict[str, list[object]]:
    """Share every top-level list of ``body`` (in place) with ``previous``'s; returns the lists
    to remember for the next request."""
    lists: dict[str, list[object]] = {}
    for key, value in body.items():
        if type(value) is list:
            shared = share_items(value, previous.get(key))
            if shared is not value:
                body[key] = shared
            lists[key] = shared
    return lists


# One raw item's translation: what it becomes (any number of chat items) and the notes it leaves.
ItemTranslator = Callable[[Any, int, list[str]], list[T]]


class Translations:
    """A session's translated body items, by the identity of the raw item objects.

    A provider whose items translate independently (each chat message, tool or note depends on
    its own raw item alone, its index naming it only in errors) asks ``items`` for a list; the
    leading raw items that are the very objects it translated last time (shared history,
    ``share_lists``) take their earlier translation and notes, the rest are translated. The same
    object always translates the same way, so the result is the from-scratch translation. The
    memo holds the raw list and the outputs it returned (the objects the session's chat request
    holds anyway), per name; one gateway session speaks one provider, and a name carries its
    provider's prefix so a switch never reuses another format's output."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[Sequence[object], list[list[Any]], list[tuple[str, ...]]]] = {}

    def items(self, name: str, raw: Sequence[object], translate: ItemTranslator[T], notes: list[str]) -> list[T]:
        """``raw``'s items translated, flattened in order; their notes added to ``notes`` once
        each. A ``RequestError`` from ``translate`` leaves the memo as it was."""
        old = self._memo.get(name)
        k = identical_prefix(raw, old[0]) if old is not None else 0
        out, said = (old[1][:k], old[2][:k]) if old is not None else ([], [])
        for index in range(k, len(raw)):
            item_notes: list[str] = []
            out.append(translate(raw[index], index, item_notes))
            said.append(tuple(item_notes) if item_notes else ())
        self._memo[name] = (raw, out, said)
        for note in chain.from_iterable(said):
            if note not in notes:
                notes.append(note)
        return list(chain.from_iterable(out))
