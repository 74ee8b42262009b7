"""``JsonIds`` carry exactly ``orjson.dumps`` of their ids however they were extended (their JSON
``joined_json`` of the head's and the delta's), and they are plain lists to every reader (equality,
slicing, JSON, pickling)."""

from __future__ import annotations

import pickle

import orjson
import pytest

from polar_env.tokenids import JsonIds, ids_json, joined_json


def extend_ids(head: list[int] | tuple[int, ...], *tails: list[int], head_json: bytes | None = None) -> JsonIds:
    """``head`` + ``tails`` as the continuation builds a prompt: the ids copied, the JSON the
    head's (given, carried, or serialized) joined with the delta's."""
    tail = [i for part in tails for i in part]
    ids = JsonIds([*head, *tail])
    ids.json = joined_json(head_json if head_json is not None else ids_json(head), tail)
    return ids


@pytest.mark.parametrize(("head", "tails"), [
    ([], []), ([], [[]]), ([1], []), ([], [[2, 3]]), ([1, 2], [[], [3]]), ([0], [[248046], [10**6, 7]]),
])
def test_extended_ids_carry_their_exact_json(head: list[int], tails: list[list[int]]) -> None:
    ids = extend_ids(head, *tails)
    expected = head + [i for t in tails for i in t]
    assert ids == expected and ids.json == orjson.dumps(expected) == ids_json(ids)


def test_a_chain_of_extensions_stays_exact_and_reads_as_a_list() -> None:
    ids: list[int] = list(range(5))
    for step in range(50):
        ids = extend_ids(ids, [step * 1000 + 7] * (step % 3), [248046])
    assert ids_json(ids) == orjson.dumps(list(ids))
    assert ids_json(list(ids)) == orjson.dumps(list(ids))  # a plain list is serialized
    assert type(ids[:3]) is list and ids[-1] == 248046
    copy = pickle.loads(pickle.dumps(ids))
    assert copy == ids and copy.json == ids.json
    assert isinstance(ids, JsonIds) and isinstance(ids, list)


def test_a_tuple_head_with_its_json_extends_like_a_list() -> None:
    head = list(range(300, 420))
    for given in (orjson.dumps(head), None):
        ids = extend_ids(tuple(head), [7], [248046], head_json=given)
        assert type(ids) is JsonIds and ids == [*head, 7, 248046]
        assert ids.json == orjson.dumps([*head, 7, 248046])
