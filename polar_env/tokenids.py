"""Token-id lists that carry their JSON text, so a growing prompt is serialized by its delta.

A token-in prompt is the previous context plus a few new ids, and the engine client sends it as
JSON on every call: ~0.8 ms for 100k ids with orjson, each time for the whole history. A
``JsonIds`` is a plain ``list[int]`` (what records, builders and engines read) that also holds
``orjson.dumps(self)``, built from the list it extends: its JSON with the new ids' JSON appended.
Lists are never mutated after they are built (the gateway's convention for every id list), so
the text stays exact; ``tests/test_tokenids.py`` checks it against ``orjson.dumps``.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson


class JsonIds(list[int]):
    """Token ids and their exact JSON text (``json``)."""

    __slots__ = ("json",)

    json: bytes


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
