"""The prefix-merge builder on the journal's prompt references equals the token comparison: a v2
journal (references found by the writer's prefix check), the same session as a v1 journal (no
references: the comparison path), and references that do not decide (another chain's tip)."""

from __future__ import annotations

import sys
from pathlib import Path

from polar_env.journal.reader import read_with_refs
from polar_env.journal.store import JournalStore
from polar_env.trajectory.builders import build
from polar_env.trajectory.prefix_merge import build_prefix_merged

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from bench_merge import session


def _stores(tmp_path: Path, calls: int) -> tuple[JournalStore, JournalStore]:
    v1, v2 = JournalStore(tmp_path / "v1", version=1), JournalStore(tmp_path / "v2")
    for record in session(calls, seed=3):
        v1.append(record)
        v2.append(record)
    return v1, v2


def test_refs_and_comparison_build_the_same_trajectories(tmp_path: Path) -> None:
    v1, v2 = _stores(tmp_path, 40)
    records, refs = read_with_refs(v2.path("bench"))
    assert len(refs) >= 30  # main loop and sub-agent continue their parents
    v1_records, v1_refs = read_with_refs(v1.path("bench"))
    assert v1_refs == {}  # v1 stores whole prompts: the builder compares
    assert [r.model_dump() for r in records] == [r.model_dump() for r in v1_records] == [r.model_dump() for r in v1.read("bench")]
    for strict in (False, True):
        compared = build_prefix_merged(v1_records, strict=strict)
        assert compared.metadata["stats"]["chains"] == 3
        assert build_prefix_merged(records, strict=strict, prompt_refs=refs).model_dump() == compared.model_dump()
    assert build("prefix_merge", records, refs).model_dump() == build("prefix_merge", v1_records, {}).model_dump()
    assert build("per_request", records, refs).model_dump() == build("per_request", v1_records).model_dump()


def test_a_reference_to_a_record_that_is_not_the_tip_falls_back_to_comparison(tmp_path: Path) -> None:
    _, v2 = _stores(tmp_path, 24)
    records, refs = read_with_refs(v2.path("bench"))
    # Point every reference at record 0 with nothing kept: the refs decide nothing, the comparison must.
    useless = {seq: (0, 0) for seq in refs}
    assert build_prefix_merged(records, prompt_refs=useless).model_dump() == build_prefix_merged(records).model_dump()


def test_a_torn_tail_is_skipped_like_the_store_does(tmp_path: Path) -> None:
    _, v2 = _stores(tmp_path, 5)
    path = v2.path("bench")
    v2.close()
    with open(path, "ab") as f:
        f.write(b'{"v": 2, "session_id": "bench", "se')
    records, _ = read_with_refs(path)
    assert [r.seq for r in records] == [0, 1, 2, 3, 4]
