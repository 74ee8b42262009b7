"""The main job keeps GRPO groups whole: a session that fails before its first model call still has
its row in trajectories.jsonl (and the Parquet file), typed and masked, so every group has
``--samples`` rows. The simulated engine (a test double, one call of it failing) and the loop
harness in real bwrap sandboxes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import orjson
import pytest

from polar_env.cli import main
from polar_env.engines.config import SimulatedEngineConfig
from polar_env.engines.simulated import SimulatedEngine
from polar_env.env import PolarEnvConfig
from polar_env.errors import EngineUnavailable
from polar_env.records import ChatRequest, FailureKind, Generation
from polar_env.staging.job import RolloutJob, run_job
from polar_env.trajectory.export import read_jsonl
from tests.conftest import require_bwrap


class FailsFirstCall(SimulatedEngine):
    """Test double: the simulated engine, unreachable for the first call it gets (one session's)."""

    def __init__(self) -> None:
        super().__init__(latency_s=0.01)
        self.failed = False

    async def generate(self, request: ChatRequest) -> Generation:
        if not self.failed:
            self.failed = True
            raise EngineUnavailable("connection refused", engine="simulated", url="http://127.0.0.1:9")
        return await super().generate(request)


@pytest.mark.slow
def test_group_size_matches_samples_with_a_failing_session(tmp_path: Path) -> None:
    require_bwrap()
    rows = [{"task_id": "alpha__one", "instruction": "run echo hi and tell me what it printed",
             "evaluator": {"name": "output", "regex": "printed"}}]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    job = RolloutJob(env=PolarEnvConfig(harness="loop", engine=SimulatedEngineConfig()), tasks=str(tasks),
                     samples=3, out=out)
    report = asyncio.run(run_job(job, engine=FailsFirstCall()))
    (run,) = {p.parent for p in out.rglob("trajectories.jsonl")}  # OUT/, or its run folder once runs get one
    trajectories = read_jsonl(run / "trajectories.jsonl")
    sessions = [orjson.loads(line) for line in (run / "sessions.jsonl").read_bytes().splitlines()]
    assert len(trajectories) == len(sessions) == 3
    (group,) = Counter(t.group_id for t in trajectories).items()
    assert group[1] == 3 and sorted(t.sample_index for t in trajectories) == [0, 1, 2]
    failed = [t for t in trajectories if t.failure_kind is not None]
    assert [t.failure_kind for t in failed] == [FailureKind.ENGINE_ERROR]
    assert failed[0].mask and failed[0].traces == [] and failed[0].reward == 0.0
    assert all(not t.mask and t.reward == 1.0 and t.traces for t in trajectories if t.failure_kind is None)
    row = next(s for s in sessions if s["session_id"] == failed[0].session_id)
    assert (row["status"], row["failure_kind"], row["mask"]) == ("error", "engine_error", True) and "error" not in row
    assert report["failure_kinds"] == {"engine_error": 1} and report["masked"] == 1
    import pyarrow.parquet as pq

    table = pq.read_table(run / "trajectories.parquet").to_pylist()
    assert sorted(r["sample_index"] for r in table) == [0, 1, 2]  # one trace each, the failed one a placeholder row
    (empty,) = [r for r in table if r["trace_index"] == -1]
    assert empty["mask"] is True and empty["failure_kind"] == "engine_error" and empty["response_ids"] == []
    # polar-env build of the run's store gives the same complete group (the failed session made no call:
    # it has no journal, only its outcome) and succeeds: a failed session is data, not a build failure
    rebuilt = tmp_path / "rebuilt.jsonl"
    assert main(["build", "--store", str(run / "capture" / "node-0"), "--out", str(rebuilt)]) == 0
    again = {t.session_id: t for t in read_jsonl(rebuilt)}
    assert set(again) == {t.session_id for t in trajectories}
    for t in trajectories:
        assert (again[t.session_id].failure_kind, again[t.session_id].mask, again[t.session_id].status) == (
            t.failure_kind, t.mask, t.status)
