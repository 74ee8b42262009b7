"""The head's copy of a node's shard (staging/shipping.py): complete lines only, repaired tails sent
again, replaced files sent whole, nothing outside the shard, and a ``sync`` that waits for a pull
begun after it. The real journal store writes the shard; Ray is not needed here (tests/staging/
test_ray.py and tests/e2e/test_multihost.py pull across processes and hosts)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.staging.shipping import Chunk, Puller, ShardMirror, read_shard, sees_probe, write_probe
from tests.journal.test_store import record


def pull_all(node: Path, mirror: ShardMirror) -> None:
    more = True
    while more:
        chunks, more = read_shard(node, mirror.cursors, budget=64)
        mirror.apply(chunks)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_copy_equals_the_shard_as_it_grows(tmp_path: Path) -> None:
    node, head = tmp_path / "node", tmp_path / "head"
    store = JournalStore(node)
    mirror = ShardMirror(head)
    for seq in range(3):
        store.append(record("s1", seq))
        store.write_session_meta(SessionMeta(session_id="s1", key_sha256="0" * 64, created_at=1.0, closed=seq == 2))
        pull_all(node, mirror)
        assert tree(head) == tree(node)
        assert JournalStore(head).read("s1") == store.read("s1")
    store.write_outcome("s1", {"reward": 1.0})
    store.append(record("s2", 0))
    pull_all(node, mirror)
    assert tree(head) == tree(node)
    assert JournalStore(head).read_outcome("s1") == {"reward": 1.0}
    chunks, more = read_shard(node, mirror.cursors)
    assert (chunks, more) == ([], False)  # nothing changed: nothing sent


def test_a_write_in_progress_is_never_half_sent(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    journal = node / "s1.jsonl"
    journal.write_bytes(b'{"a":1}\n{"b":')  # the second record is still being written
    mirror = ShardMirror(tmp_path / "head")
    mirror.apply(read_shard(node, mirror.cursors)[0])
    assert (tmp_path / "head" / "s1.jsonl").read_bytes() == b'{"a":1}\n'
    with journal.open("ab") as f:
        f.write(b'2}\n')
    mirror.apply(read_shard(node, mirror.cursors)[0])
    assert (tmp_path / "head" / "s1.jsonl").read_bytes() == b'{"a":1}\n{"b":2}\n'


def test_a_journal_cut_back_is_sent_again_whole(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    journal = node / "s1.jsonl"
    journal.write_bytes(b"one\ntwo\n")
    mirror = ShardMirror(tmp_path / "head")
    pull_all(node, mirror)
    journal.write_bytes(b"one\n")  # a torn tail repaired when the node restarted
    (node / "s1.jsonl.torn").write_bytes(b"tw")
    pull_all(node, mirror)
    assert tree(tmp_path / "head") == tree(node)
    journal.write_bytes(b"")  # cut back to nothing (its only record was the torn one) ...
    pull_all(node, mirror)
    assert tree(tmp_path / "head") == tree(node)
    journal.write_bytes(b"three\n")  # ... then appended to again
    pull_all(node, mirror)
    assert (tmp_path / "head" / "s1.jsonl").read_bytes() == b"three\n"


def test_only_journal_files_in_the_shard_are_sent(tmp_path: Path) -> None:
    node = tmp_path / "node"
    (node / "sessions").mkdir(parents=True)
    (node / "s1.jsonl").write_bytes(b"x\n")
    (node / "s1.result.tmp").write_bytes(b"half")  # an outcome being replaced
    (node / "notes.txt").write_bytes(b"?")
    (node / "deeper").mkdir()
    (node / "deeper" / "s2.jsonl").write_bytes(b"y\n")
    os.symlink("/etc/passwd", node / "link.jsonl")
    chunks, _ = read_shard(node, {})
    assert [c[0] for c in chunks] == ["s1.jsonl"]


@pytest.mark.parametrize("path", ["../escape.jsonl", "/abs.jsonl", "sessions/../../x.json", "a/b.jsonl", "x.py"])
def test_the_head_refuses_a_path_outside_the_shard(tmp_path: Path, path: str) -> None:
    with pytest.raises(ValueError, match="outside its shard"):
        ShardMirror(tmp_path / "head").apply([(path, 0, b"x\n", True)])
    assert not (tmp_path / "escape.jsonl").exists()


async def test_sync_waits_for_a_pull_that_began_after_it(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    journal = node / "s1.jsonl"
    journal.write_bytes(b"one\n")
    gate = asyncio.Event()
    pulls = 0

    async def pull(cursors: dict[str, int]) -> tuple[list[Chunk], bool]:
        nonlocal pulls
        pulls += 1
        chunks = read_shard(node, cursors)
        if pulls == 1:
            await gate.wait()  # the first pull read before the second line was written
        return chunks

    puller = Puller(ShardMirror(tmp_path / "head"), pull, interval_s=3600)
    first = asyncio.create_task(puller.sync())
    await asyncio.sleep(0)
    journal.write_bytes(b"one\ntwo\n")
    second = asyncio.create_task(puller.sync())  # must not settle for the pull already under way
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(first, second)
    assert pulls == 2
    assert (tmp_path / "head" / "s1.jsonl").read_bytes() == b"one\ntwo\n"
    await puller.aclose()


def test_the_probe_is_seen_only_where_the_store_is(tmp_path: Path) -> None:
    path, token = write_probe(tmp_path / "store")
    assert sees_probe(str(path), token)
    assert not sees_probe(str(path), "another run's token")
    assert not sees_probe(str(tmp_path / "elsewhere" / path.name), token)
