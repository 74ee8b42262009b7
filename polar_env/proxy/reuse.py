"""Unchanged history shares the previous request's objects, so per-call work stays with the delta.

A harness resends its whole history on every call; each body is parsed into fresh objects. Where a
list (the messages, the tools) starts with items that serialize exactly as the previous request's
did, the new list takes the previous request's item objects for that prefix. Everything after
then sees unchanged history by identity: the journal encoder reuses its fingerprints of those
items instead of hashing the history again (``journal.format.Encoder``), and continuation's
history compare short-circuits on them. What is recorded and sent cannot change: an item is
shared only when ``orjson.dumps`` writes it byte for byte as the new one (Python's ``==`` alone
would also equate ``1``, ``1.0`` and ``True``, or reordered keys). The check serializes both
sides (~0.1 ms a MB), several times cheaper than the per-item BLAKE2b hashing it saves, but it
still reads the history: see docs/performance.md for what is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import orjson

T = TypeVar("T")


def shared_prefix(new: Sequence[object], old: Sequence[object]) -> int:
    """The longest ``k`` such that ``new[:k]`` serializes exactly as ``old[:k]``. Item by item:
    per-item buffers are reused by the allocator, where one whole-prefix buffer would fault in
    fresh pages on every call (~2x slower for a 1 MB history)."""
    dumps = orjson.dumps
    k = 0
    try:
        for a, b in zip(new, old, strict=False):
            if a is not b and dumps(a) != dumps(b):
                break
            k += 1
    except orjson.JSONEncodeError:  # not serializable: nothing past it is shared
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
