from __future__ import annotations

from pathlib import Path

import pytest

from polar_env.cli import main
from polar_env.demo import run_demo
from polar_env.trajectory.builders import BUILDERS

pytestmark = pytest.mark.slow  # the demo's gateway and engine


async def test_demo_episode_end_to_end(tmp_path, capsys) -> None:
    """README command 1: engine + gateway + a streamed Anthropic tool loop + merged trajectory."""
    assert await run_demo(store_dir=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "The command printed: hi" in out and "demo ok" in out
    assert (tmp_path / "demo.jsonl").exists()


@pytest.fixture(scope="module")
def two_demo_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``polar-env demo --store DIR`` twice on one DIR: the rerun used to crash with
    ``too many values to unpack`` (its calls were appended to the first run's session)."""
    store = tmp_path_factory.mktemp("demo-store")
    for _ in range(2):
        assert main(["demo", "--store", str(store)]) == 0
    return store


def test_rerunning_the_demo_on_one_store(two_demo_runs: Path) -> None:
    assert sorted(p.name for p in two_demo_runs.glob("*.jsonl")) == ["demo-2.jsonl", "demo.jsonl"]
    from polar_env.journal.store import JournalStore

    store = JournalStore(two_demo_runs)
    for sid in ("demo", "demo-2"):
        assert len(store.read(sid)) == 2 and len(BUILDERS["prefix_merge"](store.read(sid)).traces) == 1


def test_verify_prints_a_verdict_with_its_tolerance(two_demo_runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["verify", "--store", str(two_demo_runs)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("PASS: max |Δlogprob| ") and "<= tolerance 0.0001" in last and "in 2 sessions" in last, last
    # The captured logprobs match to ~1e-6, not bit for bit: a zero tolerance must fail, naming both.
    assert main(["verify", "--store", str(two_demo_runs), "--tolerance", "0"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAIL: max |Δlogprob| ") and "> tolerance 0" in last and "failed: demo, demo-2" in last, last


def test_build_writes_every_session(two_demo_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--store", str(two_demo_runs), "--out", str(tmp_path / "t.jsonl")]) == 0
    assert (tmp_path / "t.jsonl").read_bytes().count(b"\n") == 2
    assert capsys.readouterr().out.count(": completed ") == 2
