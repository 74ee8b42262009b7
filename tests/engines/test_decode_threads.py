"""The decode's torch threads follow the cores other processes leave idle (``engines/embedded/threads.py``),
read from a /proc/stat written by the test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from polar_env.engines.embedded.threads import ThreadBudget


def _stat(path: Path, busy_ticks: int) -> None:
    path.write_text(f"cpu  {busy_ticks} 0 0 100000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


@pytest.mark.parametrize(("others", "want"), [(0.0, 2), (0.1, 2), (0.3, 1), (1.0, 1), (3.0, 1)])
def test_two_cores_keep_both_threads_only_while_others_leave_them_idle(others: float, want: int) -> None:
    assert ThreadBudget(2).threads_for(others) == want


def test_eight_cores_give_up_what_others_use() -> None:
    assert [ThreadBudget(8).threads_for(x) for x in (0.0, 2.1, 2.3, 7.9)] == [8, 6, 5, 1]


def test_the_count_comes_from_the_machines_busy_time_less_this_process(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, 1000)
    budget = ThreadBudget(2, stat=stat, interval=0.0)  # its first look at the machine
    time.sleep(0.2)
    assert budget.pick() == 2  # the machine did nothing else
    time.sleep(0.2)
    _stat(stat, 1000 + 25)  # 0.25 s of busy time elsewhere in ~0.2 s: a core
    assert budget.pick() == 1
    time.sleep(0.2)
    assert budget.pick() == 2  # idle again


def test_an_unreadable_stat_or_one_core_means_one_thread(tmp_path: Path) -> None:
    assert ThreadBudget(2, stat=tmp_path / "missing", interval=0.0).pick() == 1
    assert ThreadBudget(1).pick() == 1


@pytest.mark.parametrize(("fixed", "want"), [(2, {2}), (None, {1})])
def test_a_fixed_count_is_used_and_a_lone_row_follows_the_budget_with_one(
        fixed: int | None, want: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads each decode step of a lone request ran with: a fixed count always; the budget's
    own choice gives a lone row one thread."""
    import torch

    from polar_env.engines.embedded.batcher import Scheduler
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.records import ChatRequest

    seen: list[int] = []
    forward = Scheduler._forward

    def recording(self: Scheduler) -> None:
        seen.append(torch.get_num_threads())
        forward(self)

    monkeypatch.setattr(Scheduler, "_forward", recording)
    engine = EmbeddedEngine(decode_threads=fixed)
    engine.complete(ChatRequest(messages=[{"role": "user", "content": "Hi."}], max_tokens=4, seed=1))
    assert seen and set(seen) == want
